"""Fitted R3 transforms beyond the paper: pair-scaled rotations, pre-RoPE key scales, a learned
orthogonal upper reference.

A scalar on a RoPE 2-plane commutes with the plane's rotation, so a key map M_k = S·G(φ) with S tied within
each pair (S = ⊕_k s_k I_2, s_k > 0) commutes with RoPE, and so does the query map M_q = M_k^{-T} = S^{-1}·G(φ).
Then (M_q q)·(M_k k) = qᵀ G(φ)ᵀ S^{-1} S G(φ) k = q·k: the logits are unchanged in exact arithmetic, and because
both maps commute with every R_m they fold into W_Q / W_K before RoPE (``M R_m W x = R_m M W x``).

* ``pairwise_scaled`` (angles φ, scales s): M_k = S·⊕G(φ_k), M_q = S^{-1}·⊕G(φ_k) (commutes).
* ``prerope_channel_scale`` (scales s): M_k = S, M_q = S^{-1} (commutes), KVQuant / SmoothAttention-style key
  scales before RoPE. Only a pair-TIED scale is offered: an untied diag(s) with s_a ≠ s_b on a pair is
  not in the commutant (Lemma: blocks αI + βJ), so it would have to be applied before RoPE with no
  post-RoPE equivalent; the tied scale is the honest foldable version (a special case of pairwise_scaled, φ = 0).
* ``learned_orthogonal`` (matrices Q_h): any orthogonal d×d matrix per KV head (default: the Hadamard H_d/√d,
  the fit's starting point). It mixes pairs of different frequencies, so it does NOT commute: the upper
  reference for what any R3 can reach.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from rope_quant.core import hadamard as _hd
from rope_quant.core.transforms.base import (
    HeadMismatchError,
    Pairwise,
    R3Transform,
    TransformParamError,
    merge_pairs,
    pair_matrix,
)

__all__ = ["ScaleError", "NotOrthogonalError", "PairwiseScaled", "PreRopeChannelScale", "LearnedOrthogonal"]

#: Largest |M Mᵀ − I| entry accepted for a ``learned_orthogonal`` matrix.
ORTHOGONALITY_TOL = 1e-5


class ScaleError(TransformParamError):
    """Pair scales are of the wrong shape, non-finite, or not strictly positive."""


class NotOrthogonalError(TransformParamError):
    """A ``learned_orthogonal`` matrix is of the wrong shape, non-finite, or not orthogonal."""


def _as_array(x: Any) -> np.ndarray:
    return np.asarray(x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else x, dtype=np.float64)


def _check_scales(name: str, scales: Any, n_pairs: int) -> np.ndarray:
    arr = _as_array(scales)
    if arr.ndim not in (1, 2) or arr.shape[-1] != n_pairs or arr.size == 0:
        raise ScaleError(f"{name}: scales must have shape (K,) or (H_kv, K) with K = {n_pairs}, got {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ScaleError(f"{name}: scales contain NaN or infinite values")
    if np.any(arr <= 0):
        raise ScaleError(f"{name}: scales must be > 0, got min {arr.min():.3g}")
    return arr.copy()


class PairwiseScaled(Pairwise):
    """M_k = S·⊕G(φ_k) on keys, M_q = S^{-1}·⊕G(φ_k) on queries; S = ⊕ s_k I_2 tied within each pair."""

    name = "pairwise_scaled"
    commutes_with_rope = True

    def __init__(self, head_dim: int, angles: Any, scales: Any = None, layout: str = "rotate_half") -> None:
        super().__init__(head_dim, angles, layout)
        scales = np.ones_like(self.angles) if scales is None else _check_scales(self.name, scales, self.n_pairs)
        if self.angles.ndim == 1 and scales.ndim == 2:
            self.angles = np.broadcast_to(self.angles, scales.shape).copy()
        elif scales.shape != self.angles.shape:
            raise ScaleError(f"{self.name}: scales {scales.shape} do not match angles {self.angles.shape}")
        self.scales = scales
        self._scale_cache: dict[tuple, torch.Tensor] = {}

    def _scale(self, x: torch.Tensor, inverse: bool) -> torch.Tensor:
        rows = self.n_angle_rows
        n_heads = x.shape[-3] if rows and x.dim() >= 3 else 0
        if rows and (n_heads == 0 or n_heads % rows):
            raise HeadMismatchError(f"{self.name}: {tuple(x.shape)} is not (..., heads, seq, d) with heads a "
                                    f"multiple of {rows} per-head rows")
        key = (x.device, x.dtype, n_heads, inverse)
        hit = self._scale_cache.get(key)
        if hit is None:
            with torch.inference_mode(False):
                s = torch.from_numpy(1.0 / self.scales if inverse else self.scales)
                if rows:
                    s = s.repeat_interleave(n_heads // rows, dim=0)[:, None, :]
                hit = merge_pairs(s, s, self.layout).to(x.device, x.dtype)
            self._scale_cache[key] = hit
        return hit

    def apply_key(self, x: torch.Tensor) -> torch.Tensor:
        return self.apply(x)

    def apply_query(self, x: torch.Tensor) -> torch.Tensor:
        self.apply(x[..., :0, :])  # the input checks of apply(), on an empty slice
        return Pairwise._apply(self, x) * self._scale(x, inverse=True)  # G(φ), then S^{-1}

    def _apply(self, x: torch.Tensor) -> torch.Tensor:
        return super()._apply(x) * self._scale(x, inverse=False)

    def _matrix(self, row: int) -> np.ndarray:
        return self._scaled(row, self.scales)

    def _scaled(self, row: int, scales: np.ndarray) -> np.ndarray:
        phi = self.angles[row] if self.angles.ndim == 2 else self.angles
        s = scales[row] if scales.ndim == 2 else scales
        c, sn = np.cos(phi), np.sin(phi)
        return pair_matrix(self.head_dim, self.layout, s * c, -s * sn, s * sn, s * c)

    def query_matrix(self, head: int = 0, n_heads: int | None = None) -> np.ndarray:
        return self._scaled(self._row(head, n_heads), 1.0 / self.scales)


class PreRopeChannelScale(PairwiseScaled):
    """M_k = S, M_q = S^{-1} with S = ⊕ s_k I_2 (pair-tied key scales, applied before or after RoPE alike)."""

    name = "prerope_channel_scale"

    def __init__(self, head_dim: int, scales: Any = None, layout: str = "rotate_half") -> None:
        k = head_dim // 2 if isinstance(head_dim, int) else 0
        zeros = np.zeros(_as_array(scales).shape if scales is not None else (max(k, 1),))
        super().__init__(head_dim, zeros, scales, layout)


class LearnedOrthogonal(R3Transform):
    """M = Q_h, an orthogonal d×d matrix per KV head (or one for all heads); default H_d/√d (does not commute)."""

    name = "learned_orthogonal"
    commutes_with_rope = False

    def __init__(self, head_dim: int, matrices: Any = None, layout: str = "rotate_half") -> None:
        super().__init__(head_dim, layout)
        d = self.head_dim
        if matrices is None:
            _hd.hadamard_order(d)
            arr = _hd.hadamard_matrix(d).numpy().astype(np.float64) / math.sqrt(d)
        else:
            arr = _as_array(matrices)
        if arr.ndim not in (2, 3) or arr.shape[-2:] != (d, d) or arr.size == 0:
            raise NotOrthogonalError(f"{self.name}: matrices must be (d, d) or (H_kv, d, d) with d = {d}, "
                                     f"got {arr.shape}")
        if not np.all(np.isfinite(arr)):
            raise NotOrthogonalError(f"{self.name}: matrices contain NaN or infinite values")
        gap = np.abs(arr @ np.swapaxes(arr, -1, -2) - np.eye(d)).max()
        if gap > ORTHOGONALITY_TOL:
            raise NotOrthogonalError(f"{self.name}: matrices are not orthogonal (max |M Mᵀ − I| = {gap:.2e} > "
                                     f"{ORTHOGONALITY_TOL:g})")
        self.matrices = arr.copy()
        self._cache: dict[tuple, torch.Tensor] = {}

    @property
    def n_angle_rows(self) -> int:
        return self.matrices.shape[0] if self.matrices.ndim == 3 else 0

    def _mt(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.n_angle_rows
        n_heads = 0
        if rows:
            if x.dim() < 3 or x.shape[-3] % rows:
                raise HeadMismatchError(f"{self.name}: {tuple(x.shape)} is not (..., heads, seq, d) with heads "
                                        f"a multiple of {rows} per-head matrices")
            n_heads = x.shape[-3]
        key = (x.device, x.dtype, n_heads)
        hit = self._cache.get(key)
        if hit is None:
            with torch.inference_mode(False):
                m = torch.from_numpy(np.swapaxes(self.matrices, -1, -2).copy())  # Mᵀ: x @ Mᵀ = (M x)ᵀ
                if rows:
                    m = m.repeat_interleave(n_heads // rows, dim=0)  # (H, d, d)
                hit = m.to(x.device, x.dtype)
            self._cache[key] = hit
        return hit

    def _apply(self, x: torch.Tensor) -> torch.Tensor:
        mt = self._mt(x)
        if mt.dim() == 2:
            return x @ mt
        return torch.einsum("...hld,hde->...hle", x, mt)

    def _matrix(self, row: int) -> np.ndarray:
        return (self.matrices[row] if self.matrices.ndim == 3 else self.matrices).copy()


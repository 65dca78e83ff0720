"""The built-in R3 transforms: online rotations applied to post-RoPE queries and keys (paper §3–4, App. A.1, A.7).

Every entry is an orthogonal d×d matrix M applied to Q and K alike,
``apply(x)[..., h, s, :] = M_h x[..., h, s, :]``
(``apply(x) == x @ M_h.T``), so q·k is preserved. Each declares ``commutes_with_rope``: whether
``M R_m = R_m M`` for every position m. By the Lemma, with distinct frequencies the matrices commuting with
RoPE are exactly the per-pair blocks ``αI + βJ`` (rotation-scalings), so an orthogonal M commutes iff it acts
on each RoPE pair by an SO(2) rotation G(φ_k).

The registry of names lives in :mod:`rope_quant.core.transforms` (the package docstring lists it).

``layout`` ("rotate_half", the HF default, or "interleaved") says which channels form a RoPE pair.
Hadamard parts run through :func:`rope_quant.core.hadamard.hadamard_transform`; pair rotations act on the two
channel halves of every pair with broadcast cos/sin (no dense matmul).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from rope_quant.core import hadamard as _hd
from rope_quant.core.rope import check_head_dim, check_layout, pair_indices

__all__ = [
    "TransformError",
    "UnknownTransformError",
    "TransformParamError",
    "InvalidBlockSizeError",
    "AngleShapeError",
    "HeadMismatchError",
    "R3Transform",
    "Identity",
    "FullHadamard",
    "Pairwise",
    "PairwisePlusHadamard",
    "BlockHadamard",
    "interleave_permutation",
]

_SQRT_HALF = 1.0 / math.sqrt(2.0)


class TransformError(ValueError):
    """Bad R3 transform request."""


class UnknownTransformError(TransformError):
    """The name is not in the registry."""


class TransformParamError(TransformError):
    """A parameter is missing, unexpected or malformed."""


class InvalidBlockSizeError(TransformParamError):
    """Block size b is not a power of two in {2, 4, ..., d} dividing head_dim."""


class AngleShapeError(TransformParamError):
    """Angles are not (K,) or (H_kv, K), or not finite."""


class HeadMismatchError(TransformError):
    """The tensor's head count is not a multiple of the number of per-head angle rows, or d differs."""


# ------------------------------------------------------------------------------------------------ helpers


def interleave_permutation(head_dim: int, layout: str = "rotate_half") -> np.ndarray:
    """perm with ``x_int = x[..., perm]``: slot 2k+s of the interleaved order holds pair k's channel s.

    For rotate_half this is 2k+s ↦ k + s·d/2 (App. A.1); for interleaved it is the identity.
    """
    a, b = pair_indices(head_dim, layout)
    perm = np.empty(head_dim, dtype=np.int64)
    perm[0::2] = a
    perm[1::2] = b
    return perm


def _split(x: torch.Tensor, pairing: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The two channels of every pair, each (..., K), in pair order."""
    if pairing == "rotate_half":
        k = x.shape[-1] // 2
        return x[..., :k], x[..., k:]
    return x[..., 0::2], x[..., 1::2]


def merge_pairs(ya: torch.Tensor, yb: torch.Tensor, pairing: str) -> torch.Tensor:
    """The head vector whose pair halves are ``ya`` and ``yb`` (the inverse of splitting it by ``pairing``)."""
    if pairing == "rotate_half":
        return torch.cat([ya, yb], dim=-1)
    return torch.stack([ya, yb], dim=-1).flatten(-2)


def _block_pairs(u: torch.Tensor, half_block: int) -> torch.Tensor:
    """Apply H_{b/2}/√(b/2) to consecutive groups of b/2 pair indices of u (..., K)."""
    if half_block == 1:
        return u
    shape = u.shape
    v = u.reshape(*shape[:-1], shape[-1] // half_block, half_block)
    return _hd.hadamard_transform(v).reshape(shape)


def pair_matrix(head_dim: int, pairing: str, a11, a12, a21, a22) -> np.ndarray:
    """Dense d×d matrix acting by [[a11, a12], [a21, a22]] (arrays of length K) on every pair."""
    ia, ib = pair_indices(head_dim, pairing)
    m = np.zeros((head_dim, head_dim))
    m[ia, ia] = a11
    m[ia, ib] = a12
    m[ib, ia] = a21
    m[ib, ib] = a22
    return m


def _sylvester_normalised(n: int) -> np.ndarray:
    return _hd.hadamard_matrix(n).numpy() / math.sqrt(n)


# ------------------------------------------------------------------------------------------------ base


class R3Transform:
    """Base class: an orthogonal d×d map applied on the last dim of (..., heads, seq, d) Q and K tensors."""

    name: str = "identity"
    commutes_with_rope: bool = True

    def __init__(self, head_dim: int, layout: str = "rotate_half") -> None:
        self.n_pairs = check_head_dim(head_dim)
        self.head_dim = int(head_dim)
        self.layout = check_layout(layout)

    # -- to override
    def _apply(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def _matrix(self, row: int) -> np.ndarray:
        return np.eye(self.head_dim)

    # -- public
    @property
    def n_angle_rows(self) -> int:
        """Number of per-head angle rows (0 = one setting shared by all heads)."""
        return 0

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate x (..., heads, seq, d); returns a tensor of x's shape, dtype and device."""
        if not torch.is_floating_point(x):
            raise _hd.NonFloatTensorError(f"R3 transforms need a floating-point tensor, got {x.dtype}")
        if x.dim() == 0 or x.shape[-1] != self.head_dim:
            raise HeadMismatchError(
                f"{self.name}: expected last dim {self.head_dim}, got shape {tuple(x.shape)}"
            )
        return self._apply(x)

    __call__ = apply

    def apply_key(self, x: torch.Tensor) -> torch.Tensor:
        """The key map x -> M_k x (the same as :meth:`apply` for orthogonal transforms)."""
        return self.apply(x)

    def apply_query(self, x: torch.Tensor) -> torch.Tensor:
        """The query map x -> M_q x with M_q = M_k^{-T}, so (M_q q)·(M_k k) = q·k (orthogonal: M_q = M_k)."""
        return self.apply(x)

    def query_matrix(self, head: int = 0, n_heads: int | None = None) -> np.ndarray:
        """Dense float64 M_q = M_k^{-T} of head ``head`` (equal to :meth:`matrix` for orthogonal transforms)."""
        return self.matrix(head, n_heads)

    def matrix(self, head: int = 0, n_heads: int | None = None) -> np.ndarray:
        """Dense float64 M (d×d) acting on column vectors of head ``head``.

        With per-head angles, ``head`` indexes the angle rows (KV heads); pass ``n_heads`` (the stream's
        head count, e.g. the Q heads) to map a stream head to its KV group's row: head // (n_heads / H_kv).
        """
        return self._matrix(self._row(head, n_heads))

    def _row(self, head: int, n_heads: int | None) -> int:
        rows = self.n_angle_rows
        if rows == 0:
            return 0
        if n_heads is None:
            n_heads = rows
        if n_heads % rows:
            raise HeadMismatchError(f"{n_heads} heads are not a multiple of {rows} per-head angle rows")
        if not 0 <= head < n_heads:
            raise HeadMismatchError(f"head {head} out of range for {n_heads} heads")
        return head // (n_heads // rows)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, head_dim={self.head_dim}, layout={self.layout!r})"


class Identity(R3Transform):
    """M = I (no R3)."""

    name = "identity"
    commutes_with_rope = True

    def _apply(self, x: torch.Tensor) -> torch.Tensor:
        return x


class FullHadamard(R3Transform):
    """M = H_d/√d on the native channel order (QuaRot/SpinQuant R3)."""

    name = "hadamard"
    commutes_with_rope = False

    def __init__(self, head_dim: int, layout: str = "rotate_half") -> None:
        super().__init__(head_dim, layout)
        _hd.hadamard_order(self.head_dim)  # raises UnsupportedHadamardOrderError early

    def _apply(self, x: torch.Tensor) -> torch.Tensor:
        return _hd.hadamard_transform(x)

    def _matrix(self, row: int) -> np.ndarray:
        return _hd.hadamard_matrix(self.head_dim).numpy() / math.sqrt(self.head_dim)


class Pairwise(R3Transform):
    """M = ⊕_k G(φ_k) on the RoPE pairs (commutes by the Lemma); angles (K,) or (H_kv, K)."""

    name = "pairwise_only"
    commutes_with_rope = True

    def __init__(self, head_dim: int, angles: Any, layout: str = "rotate_half") -> None:
        super().__init__(head_dim, layout)
        arr = np.asarray(
            angles.detach().cpu().numpy() if isinstance(angles, torch.Tensor) else angles, dtype=np.float64
        )
        if arr.ndim not in (1, 2) or arr.shape[-1] != self.n_pairs or arr.size == 0:
            raise AngleShapeError(
                f"{self.name}: angles must have shape (K,) or (H_kv, K) with K = {self.n_pairs}, "
                f"got {arr.shape}"
            )
        if not np.all(np.isfinite(arr)):
            raise AngleShapeError(f"{self.name}: angles contain NaN or infinite values")
        self.angles = arr.copy()
        self._cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def n_angle_rows(self) -> int:
        return self.angles.shape[0] if self.angles.ndim == 2 else 0

    def _cos_sin(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.n_angle_rows
        n_heads = 0
        if rows:
            if x.dim() < 3:
                raise HeadMismatchError(
                    f"{self.name}: per-head angles need (..., heads, seq, d), got {tuple(x.shape)}"
                )
            n_heads = x.shape[-3]
            if n_heads % rows:
                raise HeadMismatchError(
                    f"{self.name}: {n_heads} heads are not a multiple of {rows} per-head angle rows "
                    "(GQA groups)"
                )
        key = (x.device, x.dtype, n_heads)
        hit = self._cache.get(key)
        if hit is None:
            with torch.inference_mode(False):  # cached tables must stay usable outside inference mode
                phi = torch.from_numpy(self.angles)
                if rows:
                    phi = phi.repeat_interleave(n_heads // rows, dim=0)[:, None, :]  # (H, 1, K)
                hit = (torch.cos(phi).to(x.device, x.dtype), torch.sin(phi).to(x.device, x.dtype))
            self._cache[key] = hit
        return hit

    def _apply(self, x: torch.Tensor) -> torch.Tensor:
        c, s = self._cos_sin(x)
        a, b = _split(x, self.layout)
        if x.requires_grad and torch.is_grad_enabled():  # out= kernels do not record autograd
            return merge_pairs(c * a - s * b, s * a + c * b, self.layout)
        out = torch.empty(
            torch.broadcast_shapes(x.shape, c.shape[:-1] + (x.shape[-1],)), dtype=x.dtype, device=x.device
        )
        oa, ob = _split(out, self.layout)
        # a' = c a − s b, b' = s a + c b, written in place (4 fused kernels, no concatenation)
        torch.mul(a, c, out=oa)
        oa.addcmul_(b, s, value=-1.0)
        torch.mul(a, s, out=ob)
        ob.addcmul_(b, c)
        return out

    def _matrix(self, row: int) -> np.ndarray:
        phi = self.angles[row] if self.angles.ndim == 2 else self.angles
        c, s = np.cos(phi), np.sin(phi)
        return pair_matrix(self.head_dim, self.layout, c, -s, s, c)


class PairwisePlusHadamard(Pairwise):
    """M = (H_d/√d)·⊕_k G(φ_k): pairwise first, then the full-head Hadamard."""

    name = "pairwise_plus_hadamard"
    commutes_with_rope = False

    def __init__(self, head_dim: int, angles: Any, layout: str = "rotate_half") -> None:
        super().__init__(head_dim, angles, layout)
        _hd.hadamard_order(self.head_dim)

    def _apply(self, x: torch.Tensor) -> torch.Tensor:
        return _hd.hadamard_transform(super()._apply(x))

    def _matrix(self, row: int) -> np.ndarray:
        return (_hd.hadamard_matrix(self.head_dim).numpy() / math.sqrt(self.head_dim)) @ super()._matrix(row)


class BlockHadamard(R3Transform):
    """Blocks of b interleaved slots get H_{b/2}/√(b/2) ⊗ B2, B2 = G(π/4) (``raw``: H2) (App. A.1, A.7).

    ``contiguous``: blocks over the native channel order instead of the pair-interleaved order.

    Note on ``raw``: H2 = G(π/4)·diag(1, −1) has determinant −1 on each pair, so it conjugates R(θ) into
    R(−θ) and does not commute with RoPE (Lemma (b)); the paper's Table M lists the raw per-pair H2 as
    commuting. We declare what the algebra says, and tests/numerics/test_transforms.py checks it.
    """

    name = "block_hadamard"

    def __init__(
        self,
        head_dim: int,
        block: int,
        layout: str = "rotate_half",
        *,
        raw: bool = False,
        contiguous: bool = False,
    ) -> None:
        super().__init__(head_dim, layout)
        d = self.head_dim
        if isinstance(block, bool) or not isinstance(block, (int, np.integer)):
            raise InvalidBlockSizeError(
                f"block must be an integer power of two in {{2, 4, ..., d}}, got {block!r}"
            )
        block = int(block)
        if block < 2 or block > d or block & (block - 1) or d % block:
            raise InvalidBlockSizeError(
                f"block size must be a power of two in {{2, 4, ..., d}} dividing head_dim = {d}, got {block}"
            )
        self.block = block
        self.raw = raw
        self.contiguous = contiguous
        # The order in which blocks are formed: native channels (contiguous) or pair-interleaved.
        self.pairing = "interleaved" if contiguous else self.layout
        if raw:
            self.name = "pair_h2_raw" if block == 2 and not contiguous else "block_hadamard_raw"
        elif contiguous:
            self.name = "block_hadamard_contiguous"
        else:
            self.name = "pair_h2" if block == 2 else "block_hadamard"
        # Commutes iff every block is one RoPE pair rotated by an SO(2) element.
        self.commutes_with_rope = (not raw) and block == 2 and self.pairing == self.layout

    def _apply(self, x: torch.Tensor) -> torch.Tensor:
        a, b = _split(x, self.pairing)
        if self.raw:  # H2 = [[1, 1], [1, -1]]/√2
            ya, yb = (a + b) * _SQRT_HALF, (a - b) * _SQRT_HALF
        else:  # G(π/4) = [[1, -1], [1, 1]]/√2
            ya, yb = (a - b) * _SQRT_HALF, (a + b) * _SQRT_HALF
        half = self.block // 2
        return merge_pairs(_block_pairs(ya, half), _block_pairs(yb, half), self.pairing)

    def _matrix(self, row: int) -> np.ndarray:
        d, half = self.head_dim, self.block // 2
        base = np.array([[1.0, 1.0], [1.0, -1.0]]) if self.raw else np.array([[1.0, -1.0], [1.0, 1.0]])
        blk = np.kron(_sylvester_normalised(half), base * _SQRT_HALF)
        inner = np.kron(np.eye(d // self.block), blk)  # acts on the interleaved order of `pairing`
        perm = interleave_permutation(d, self.pairing)
        pi = np.zeros((d, d))
        pi[np.arange(d), perm] = 1.0  # x_int = Π x
        return pi.T @ inner @ pi

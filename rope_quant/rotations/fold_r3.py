"""Fold a RoPE-commuting R3 into the weights: the "free" R3 that needs no online kernel (the only R3 fold; cells
record its refusal, exports call it).

A map that commutes with every R_m acts the same before and after RoPE, so the post-RoPE R3 (M_k on keys,
M_q = M_k^{-T} on queries) can be applied to the pre-RoPE projections instead:

* no q/k norm (Llama, SmolLM2): W_K ← M_k W_K and W_Q ← M_q W_Q per head (and their biases);
* a per-head RMSNorm before RoPE (Gemma 3's q_norm / k_norm, weight g shared by the heads): each pair block
  of M is s_k·G(φ_k) (a rotation-scaling, by the Lemma); G passes through the norm when g is tied on that
  pair (rms(Gx) = rms(x) and G·diag(g) = diag(g)·G), so W ← G W; the scales go into the norm's weight
  (offset + g' = S·(offset + g)), which needs S to be the same for every head that shares the norm.
  Otherwise the fold is refused (:class:`FoldError`, naming the layer, the norm and the reason): a
  non-tied norm weight blocks the rotation part, and no runtime would get it for free.

A transform that does not commute (``hadamard``, ``learned_orthogonal``) is refused: it has to stay online.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from rope_quant.core.rope import pair_indices
from rope_quant.model import arch

__all__ = ["FoldError", "fold_r3", "fold_refusal", "pair_blocks"]

#: Tolerance for "this pair block is a rotation-scaling" and "this norm weight is tied on a pair".
TOL = 1e-9


class FoldError(ValueError):
    """The R3 cannot be folded into this model's weights exactly (the message says where and why)."""


def pair_blocks(m: np.ndarray, layout: str = "rotate_half") -> tuple[np.ndarray, np.ndarray]:
    """(s (K,), φ (K,)) with M = ⊕ s_k G(φ_k) on the RoPE pairs; :class:`FoldError` if M is not of that form."""
    d = m.shape[0]
    ia, ib = pair_indices(d, layout)
    mask = np.zeros((d, d), dtype=bool)
    for a, b in ((ia, ia), (ia, ib), (ib, ia), (ib, ib)):
        mask[a, b] = True
    off = np.abs(np.where(mask, 0.0, m)).max() if (~mask).any() else 0.0
    a11, a12, a21, a22 = m[ia, ia], m[ia, ib], m[ib, ia], m[ib, ib]
    scale = max(1.0, float(np.abs(m).max()))
    if off > TOL * scale or np.abs(a11 - a22).max() > TOL * scale or np.abs(a12 + a21).max() > TOL * scale:
        raise FoldError("the map is not a rotation-scaling on every RoPE pair (it does not commute with RoPE)")
    s = np.hypot(a11, a21)
    if np.any(s <= 0):
        raise FoldError("the map is singular on a RoPE pair")
    return s, np.arctan2(a21, a11)


def _fold_rows(linear: Any, mats: Sequence[np.ndarray], d: int) -> None:
    w: torch.Tensor = linear.weight.data
    blocks = torch.stack([torch.as_tensor(m, dtype=torch.float64) for m in mats])  # (H, d, d)
    h = len(mats)
    new = torch.einsum("hij,hjc->hic", blocks, w.double().reshape(h, d, -1)).reshape(w.shape)
    w.copy_(new.to(w.dtype))
    bias = getattr(linear, "bias", None)
    if bias is not None:
        b = torch.einsum("hij,hj->hi", blocks, bias.data.double().reshape(h, d)).reshape(-1)
        bias.data.copy_(b.to(bias.dtype))


def _rotation(phi: np.ndarray, d: int, layout: str) -> np.ndarray:
    ia, ib = pair_indices(d, layout)
    g = np.zeros((d, d))
    c, s = np.cos(phi), np.sin(phi)
    g[ia, ia], g[ia, ib], g[ib, ia], g[ib, ib] = c, -s, s, c
    return g


def _check_with_norm(what: str, layer: int, norm: Any, mats: list[np.ndarray], d: int, offset: float,
                     layout: str) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray, np.ndarray]:
    """The pair blocks, the shared scales and the norm's effective weight, or :class:`FoldError` when the map
    cannot pass through a q/k norm shared by the heads (scales that differ between heads, or a rotation on a
    pair whose norm weight is not tied)."""
    parts = [pair_blocks(m, layout) for m in mats]
    scales = np.stack([s for s, _ in parts])
    if np.abs(scales - scales[0]).max() > TOL * max(1.0, float(scales.max())):
        raise FoldError(f"layer {layer}: the {what} scales differ between heads that share one {what}_norm "
                        "weight; they cannot be folded into it")
    g = offset + norm.weight.data.double().cpu().numpy()
    ia, ib = pair_indices(d, layout)
    rotated = np.zeros(len(ia), dtype=bool)
    for _, phi in parts:
        rotated |= np.abs(np.sin(phi)) > TOL
    untied = rotated & (np.abs(g[ia] - g[ib]) > TOL * max(1.0, float(np.abs(g).max())))
    if untied.any():
        raise FoldError(f"layer {layer}: {what}_norm's weight is not tied within RoPE pair(s) "
                        f"{np.flatnonzero(untied)[:5].tolist()}, so the rotation G(φ) cannot pass through the "
                        "norm; only pair-tied scales fold exactly here")
    return parts, scales, g


def _fold_with_norm(what: str, layer: int, linear: Any, norm: Any, mats: list[np.ndarray], d: int,
                    offset: float, layout: str) -> None:
    parts, scales, g = _check_with_norm(what, layer, norm, mats, d, offset, layout)
    ia, ib = pair_indices(d, layout)
    _fold_rows(linear, [_rotation(phi, d, layout) for _, phi in parts], d)
    full = np.empty(d)
    full[ia], full[ib] = scales[0], scales[0]
    norm.weight.data.copy_(torch.as_tensor(full * g - offset, dtype=norm.weight.dtype))


def fold_refusal(model: nn.Module, transforms: Sequence[Any], layout: str = "rotate_half") -> str | None:
    """Why :func:`fold_r3` would refuse these transforms on this model (the first layer's reason), or None when
    every layer folds. Reads the model only: a cell records it, so a report can say "folds here" per
    architecture (Gemma 3's untied k_norm lets only pair-tied scales through). ``layout``: the pair layout of a
    transform without its own ``layout`` attribute."""
    parts: list[Any] = list(arch.attention_modules(model))
    if len(transforms) != len(parts):
        return f"expected {len(parts)} transforms (one per layer), got {len(transforms)}"
    offset = arch.norm_weight_offset(model)
    try:
        for layer, (p, tr) in enumerate(zip(parts, transforms, strict=True)):
            if tr is None:
                continue
            if not getattr(tr, "commutes_with_rope", False):
                return f"layer {layer}: R3 {getattr(tr, 'name', tr)!r} does not commute with RoPE; it must stay online"
            d = int(tr.head_dim)
            n_q, n_kv = p.q.out_features // d, p.k.out_features // d
            q_norm, k_norm = p.qk_norms
            for what, norm, mats in (("k", k_norm, [tr.matrix(h, n_kv) for h in range(n_kv)]),
                                     ("q", q_norm, [tr.query_matrix(h, n_q) for h in range(n_q)])):
                if norm is None:
                    continue
                _check_with_norm(what, layer, norm, mats, d, offset, getattr(tr, "layout", layout))
    except FoldError as exc:
        return str(exc)
    return None


def fold_r3(model: nn.Module, transforms: Sequence[Any], layout: str = "rotate_half") -> None:
    """Fold one commuting R3 transform per layer into the q/k projections (or q/k norms), in place.

    The model must then run WITHOUT the online R3: its logits equal those of the online R3 up to rounding.
    Raises :class:`FoldError` (naming the layer, :func:`fold_refusal`) before changing any layer.
    """
    reason = fold_refusal(model, transforms, layout)
    if reason is not None:
        raise FoldError(reason)
    offset = arch.norm_weight_offset(model)
    parts: list[Any] = list(arch.attention_modules(model))
    for layer, (p, tr) in enumerate(zip(parts, transforms, strict=True)):
        if tr is None:
            continue
        d = int(tr.head_dim)
        n_q, n_kv = p.q.out_features // d, p.k.out_features // d
        mk = [tr.matrix(h, n_kv) for h in range(n_kv)]
        mq = [tr.query_matrix(h, n_q) for h in range(n_q)]
        q_norm, k_norm = p.qk_norms
        for what, linear, norm, mats in (("k", p.k, k_norm, mk), ("q", p.q, q_norm, mq)):
            if norm is None:
                _fold_rows(linear, mats, d)
            else:
                _fold_with_norm(what, layer, linear, norm, mats, d, offset, getattr(tr, "layout", layout))

"""What of a cell folds into the weights, what stays online, and the R3 fold itself (issue 25).

A RoPE-commuting R3 ``M`` (per head, ``M R_m = R_m M`` for every position m; the Lemma of §3: SO(2)
rotations inside the RoPE pairs) applied to post-RoPE q and k equals ``R_m (M q)``: it folds into the rows
of W_Q and W_K (``W_h ← M_h W_h``, bias ``b_h ← M_h b_h``, head by head). The head order of the rows follows
the model's own ``view(..., heads, head_dim)``; the pair layout (rotate_half, the HF default; FACTS.md) is the
transform's ``layout``, which already shaped ``M``.

A model with per-head q/k norms before RoPE (Gemma 3) computes ``g ⊙ y / rms(y)`` between the projection and
RoPE: ``M`` passes the ``rms`` (orthogonal) but passes the scale ``g`` only where ``M diag(g) = diag(g) M``
(g equal within every RoPE pair the rotation mixes). Elsewhere the fold is refused with
:class:`LayoutError` naming the layer and the norm.

Online parts (never foldable): R4, the Hadamard on down_proj's input (QuaRot/SpinQuant R4), and an R3 that
does not commute with RoPE (``hadamard``, ``pairwise_plus_hadamard``'s Hadamard half, block controls).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np
import torch
from torch import nn

from rope_quant.model import arch

__all__ = [
    "ExportError",
    "OnlinePartError",
    "LayoutError",
    "OnlinePart",
    "online_parts",
    "fold_r3",
    "check_fold_layout",
    "r3_split",
]


class ExportError(ValueError):
    """Bad input to an export (the message names the cell, the part or the path)."""


class OnlinePartError(ExportError):
    """The configuration has a part that must run online, which the chosen format cannot carry."""


class LayoutError(ExportError):
    """The model's layout cannot express the export (e.g. a q/k norm that does not commute with R3)."""


class OnlinePart(StrEnum):
    """An online (runtime) part of a cell, by what it is."""

    R4 = "R4"
    R3 = "R3"


@dataclass(frozen=True)
class Online:
    """One online part: which, and a sentence naming it."""

    part: OnlinePart
    text: str


def r3_split(name: str, head_dim: int, block: int | None = None) -> tuple[bool, str | None]:
    """(foldable pairwise half, online remainder name or None) of R3 ``name``.

    ``pairwise_plus_hadamard`` = H·P(φ): P folds, the full-head Hadamard stays online. A commuting transform
    folds whole; any other non-commuting one stays online whole.
    """
    from rope_quant.core import transforms

    if name == "pairwise_plus_hadamard":
        return True, "hadamard"
    params: dict[str, Any] = {}
    if transforms.needs_block(name):
        params["block"] = block
    if transforms.needs_angles(name):
        params["angles"] = np.zeros(head_dim // 2)
    if transforms.commutes_with_rope(name, head_dim, **params):
        return True, None
    return False, name


def online_parts(cfg: Any, head_dim: int) -> list[Online]:
    """The online parts of RunConfig ``cfg`` (empty: everything folds into the weights)."""
    out = []
    if cfg.rotation.r4:
        out.append(Online(OnlinePart.R4, "R4 (the online Hadamard on down_proj's input)"))
    _, rest = r3_split(cfg.online.transform, head_dim, cfg.online.block)
    if rest is not None:
        what = "its full-head Hadamard half" if rest != cfg.online.transform else "it"
        out.append(Online(OnlinePart.R3, f"R3 {cfg.online.transform!r} ({what} does not commute with RoPE)"))
    return out


def pairwise_part(transform: Any) -> Any:
    """The foldable factor of one layer's R3: the transform itself, or P(φ) of pairwise_plus_hadamard."""
    from rope_quant.core import transforms

    if transform.name == "pairwise_plus_hadamard":
        return transforms.build("pairwise_only", transform.head_dim, angles=transform.angles, layout=transform.layout)
    if not transform.commutes_with_rope:
        raise ExportError(f"R3 {transform.name!r} does not commute with RoPE: it cannot fold into W_Q/W_K")
    return transform


def _norm_scale(norm: Any, offset: float) -> torch.Tensor:
    return offset + norm.weight.detach().to("cpu", torch.float64)


def _check_norm(norm: Any, mats: list[np.ndarray], offset: float, where: str) -> None:
    if norm is None:
        return
    if getattr(norm, "weight", None) is None:
        return  # a scale-free RMSNorm commutes with any orthogonal map
    g = _norm_scale(norm, offset).numpy()
    for h, m in enumerate(mats):
        gh = g if g.shape[0] == m.shape[0] else g[h * m.shape[0]:(h + 1) * m.shape[0]]
        err = float(np.abs(m * gh[None, :] - gh[:, None] * m).max())
        if err > 1e-6 * max(1.0, float(np.abs(gh).max())):
            raise LayoutError(
                f"{where}: the per-head norm before RoPE scales the two channels of a RoPE pair differently "
                f"(|M·diag(g) − diag(g)·M| = {err:.3g}), so R3 cannot fold into the projection before it; "
                "export this cell as compressed-tensors, where R3 can stay online, or choose an R3 that is "
                "the identity on this model")


@torch.no_grad()
def _rotate_rows(lin: Any, mats: list[np.ndarray], head_dim: int) -> None:
    """``W[h] ← M_h W[h]`` (and the bias) for every head h, in float64."""
    w = lin.weight.detach().to("cpu", torch.float64)
    out = w.clone()
    b = None if getattr(lin, "bias", None) is None else lin.bias.detach().to("cpu", torch.float64)
    ob = None if b is None else b.clone()
    for h, m in enumerate(mats):
        rows = slice(h * head_dim, (h + 1) * head_dim)
        mt = torch.from_numpy(m)
        out[rows] = mt @ w[rows]
        if b is not None and ob is not None:
            ob[rows] = mt @ b[rows]
    lin.weight.copy_(out.to(lin.weight.dtype))
    if ob is not None:
        lin.bias.copy_(ob.to(lin.bias.dtype))


def check_fold_layout(model: nn.Module, name: str, block: int | None = None) -> None:
    """Refuse, before the cell is built, a model whose q/k norms cannot let R3 ``name`` through (:class:`LayoutError`).

    Uses generic angles (0.3 rad in every pair): a pair rotation passes a norm only where its scale is equal inside
    the pair, whatever the (non-zero) angle.
    """
    from rope_quant.core import transforms

    if name == "identity" or not any(n is not None for p in arch.attention_modules(model) for n in p.qk_norms):
        return
    head_dim = arch.dims(model).head_dim
    params: dict[str, Any] = {}
    if transforms.needs_angles(name):
        params["angles"] = np.full(head_dim // 2, 0.3)
    if transforms.needs_block(name):
        params["block"] = block
    t = transforms.build(name, head_dim, **params)
    _plan(model, [t] * arch.dims(model).n_layers)


def _plan(model: nn.Module, transforms_: list[Any]) -> list[tuple[Any, list[np.ndarray], list[np.ndarray]]]:
    """The per-layer (parts, Q head matrices, K head matrices) of a fold, after every layout check."""
    dims = arch.dims(model)
    if len(transforms_) != dims.n_layers:
        raise ExportError(f"expected one R3 per layer ({dims.n_layers}), got {len(transforms_)}")
    offset = arch.norm_weight_offset(model)
    plan = []
    for i, t in enumerate(transforms_):
        p = pairwise_part(t)
        if p.name == "identity":
            continue
        parts = arch.attention(model, i)
        q_mats = [p.query_matrix(h, dims.n_heads) for h in range(dims.n_heads)]  # M_q = M_k^{-T}
        k_mats = [p.matrix(h, dims.n_kv_heads) for h in range(dims.n_kv_heads)]
        q_norm, k_norm = parts.qk_norms
        _check_norm(q_norm, q_mats, offset, f"layers.{i} q_norm")
        _check_norm(k_norm, k_mats, offset, f"layers.{i} k_norm")
        plan.append((parts, q_mats, k_mats))
    return plan


def fold_r3(model: nn.Module, transforms_: list[Any]) -> None:
    """Fold each layer's RoPE-commuting R3 into its W_Q and W_K rows, in place (see the module docstring).

    Raises :class:`ExportError` for a transform that does not commute and :class:`LayoutError` where a q/k norm
    before RoPE does not commute with it, before any weight changes.
    """
    head_dim = arch.dims(model).head_dim
    for parts, q_mats, k_mats in _plan(model, transforms_):
        _rotate_rows(parts.q, q_mats, head_dim)
        _rotate_rows(parts.k, k_mats, head_dim)

"""What of a cell folds into the weights and what stays online; the export's side of the one R3 fold.

A RoPE-commuting R3 ``M`` (per head, ``M R_m = R_m M`` for every position m; the Lemma of §3: SO(2)
rotations, and scalings, inside the RoPE pairs) applied to post-RoPE q and k equals ``R_m (M q)``, so it
folds before RoPE. The fold itself is :func:`rope_quant.rotations.fold_r3.fold_r3`, the same code a cell's
fold record uses: W_Q/W_K rows on a model without q/k norms; with per-head q/k norms (Gemma 3, Qwen3) the
pair rotation goes into W_Q/W_K and the pair scales into the norm weights (a scale does not commute with the
RMS that follows W_Q/W_K), and anything else is refused with :class:`LayoutError` naming the layer and the
norm. Which factor folds and which stays online is the registry's declaration (``TransformSpec.folding``):
``pairwise_plus_hadamard`` = H·P(φ): its P(φ) folds, H stays online.

Online parts (never foldable): R4, the Hadamard on down_proj's input (QuaRot/SpinQuant R4), and an R3 that
does not commute with RoPE (``hadamard``, ``pairwise_plus_hadamard``'s Hadamard half, block controls).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np
from torch import nn

from rope_quant.model import arch

__all__ = [
    "ExportError",
    "OnlinePartError",
    "LayoutError",
    "OnlinePart",
    "online_parts",
    "refuse_online_parts",
    "fold_commuting_part",
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
    """(a factor folds, online remainder name or None) of R3 ``name``, as its registry entry declares
    (:func:`rope_quant.core.transforms.foldability`: ``pairwise_plus_hadamard`` = H·P(φ): P folds, the full-head
    Hadamard stays online; a commuting transform folds whole; any other stays online whole)."""
    from rope_quant.core import transforms

    split = transforms.foldability(name, head_dim, block)
    return split.folds, split.online


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


def refuse_online_parts(cfg: Any, head_dim: int, fmt: str, instead: str) -> None:
    """:class:`OnlinePartError` naming ``cfg``'s online parts, which format ``fmt`` cannot carry; ``instead`` says
    where they can go. Nothing when everything folds."""
    parts = online_parts(cfg, head_dim)
    if parts:
        names = "; ".join(p.text for p in parts)
        raise OnlinePartError(f"--format {fmt} cannot carry online parts: {names}. {instead}, or choose a cell "
                              "without them (R4 off; a RoPE-commuting R3 such as pairwise_only)")


def pairwise_part(transform: Any) -> Any:
    """The foldable factor of one layer's R3 as its registry entry declares (the transform itself, or P(φ) of
    pairwise_plus_hadamard); None when nothing folds (identity)."""
    from rope_quant.core import transforms

    part = transforms.fold_factor(transform)
    if part is None and not transform.commutes_with_rope:
        raise ExportError(f"R3 {transform.name!r} does not commute with RoPE: it cannot fold into W_Q/W_K")
    return part


def _refusal(model: nn.Module, transforms_: list[Any]) -> LayoutError | None:
    """The fold's refusal for these (foldable) transforms on ``model`` as a :class:`LayoutError`, or None."""
    from rope_quant.rotations.fold_r3 import fold_refusal

    reason = fold_refusal(model, transforms_)
    if reason is None:
        return None
    return LayoutError(f"{reason}; export this cell as compressed-tensors, where R3 can stay online, or choose an "
                       "R3 that folds into this model")


def check_fold_layout(model: nn.Module, name: str, block: int | None = None) -> None:
    """Refuse, before the cell is built, a model whose q/k norms cannot let R3 ``name`` through (:class:`LayoutError`).

    Uses generic angles (0.3 rad in every pair): a pair rotation passes a norm only where its scale is equal inside
    the pair, whatever the (non-zero) angle. Fitted scales are checked again when the cell's own R3 is folded.
    """
    from rope_quant.core import transforms

    head_dim = arch.dims(model).head_dim
    split = transforms.foldability(name, head_dim, block)
    if split.fold is None or not any(n is not None for p in arch.attention_modules(model) for n in p.qk_norms):
        return
    name = split.fold  # the factor that folds (P(φ) of pairwise_plus_hadamard)
    params: dict[str, Any] = {}
    if transforms.needs_angles(name):
        params["angles"] = np.full(head_dim // 2, 0.3)
    if transforms.needs_block(name):
        params["block"] = block
    t = transforms.build(name, head_dim, **params)
    error = _refusal(model, [pairwise_part(t)] * arch.dims(model).n_layers)
    if error is not None:
        raise error


def fold_commuting_part(model: nn.Module, transforms_: list[Any]) -> None:
    """Fold each layer's RoPE-commuting part of R3 (:func:`pairwise_part`) into the model, in place.

    One fold for cells and exports: :func:`rope_quant.rotations.fold_r3.fold_r3` (W_Q/W_K rows; a per-pair scale
    moves into the q/k norm's weight, since it does not commute with the RMS that follows W_Q/W_K). Raises
    :class:`ExportError` for a transform that does not commute and :class:`LayoutError` (naming the layer and the
    norm) where the model's q/k norms cannot pass it, before any weight changes.
    """
    from rope_quant.rotations.fold_r3 import fold_r3

    parts = [pairwise_part(t) for t in transforms_]
    n_layers = arch.dims(model).n_layers
    if len(parts) != n_layers:
        raise ExportError(f"expected one R3 per layer ({n_layers}), got {len(parts)}")
    error = _refusal(model, parts)
    if error is not None:
        raise error
    fold_r3(model, parts)

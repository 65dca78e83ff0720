"""The function-preserving weight algebra that R1, R2 and R4 share (:mod:`rope_quant.rotations.offline`).

Row-vector convention throughout: a rotation ``R`` maps an activation row ``x`` to ``x @ R``. A linear
``y = x Wᵀ`` whose input is rotated keeps its output when ``W ← W R`` (:func:`fold_right`), and a linear whose
output must come out rotated gets ``W ← Rᵀ W`` (:func:`fold_left`; and ``b ← b R``).

Before R1, :func:`untie_embeddings` gives lm_head its own copy of the (tied) embedding matrix and
:func:`fuse_norms` moves each RMSNorm scale ``g`` into the linears it feeds (``W ← W diag(g)``); the norm weight
becomes 1. A unit-weight RMSNorm commutes with any orthogonal ``Q``: ``rms(xQ) = rms(x)``, so
``norm(xQ) = norm(x) Q``. (QuaRot's fusion also subtracts each embedding row's mean, which is invariant only
for LayerNorm; it is *not* for RMSNorm, see :func:`subtract_embedding_mean`, which the pipeline never calls.)

All weight algebra is done in float64 (float32 for 16-bit weights: :func:`fold_dtype`) on the parameter's
own device, one matrix (and, for a matrix larger than one block, :func:`fold_block_rows` rows or columns: at
most :data:`_FUSE_ROWS` of them and :data:`_FUSE_BLOCK_BYTES` of float64) at a time, and cast back to the
parameter's dtype: the model never has a float64 copy (a 128256 × 4096 embedding alone is 4.2 GB
in float64). A block's arithmetic is the whole matrix's (each output row / column depends on its own input
row / column only), so the blocked results equal the unblocked ones bit for bit. A power-of-two (random)
Hadamard above :data:`R1_DENSE_MAX` is folded by the fast transform (:func:`hadamard_signs`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

import torch
from torch import nn

from rope_quant.model import arch
from rope_quant.rotations.errors import (
    NotOrthogonalError,
    RotationShapeError,
    TiedEmbeddingsError,
    UnsupportedArchitectureError,
)
from rope_quant.rotations.online_r4 import online_r4

__all__ = [
    "fold_block_rows",
    "fold_dtype",
    "decoder_layers",
    "embeddings_tied",
    "untie_embeddings",
    "fuse_norms",
    "norms_fused",
    "subtract_embedding_mean",
    "fold_right",
    "fold_left",
    "hadamard_signs",
]

#: Largest tolerated max |RᵀR − I| (float64) for a matrix passed in as a rotation.
ORTHO_ATOL = 1e-4
#: Rows (or columns) per block of the float64 weight algebra (bounds the float64 temporary) ...
_FUSE_ROWS = 16384
#: ... and at most this many bytes of float64 per block: 4096 rows at width 4096, 2048 at 8192 (the block, its
#: product and the cast back were 1.25 GiB at 16384 × 4096, half of a 1-layer Llama-3-8B in bf16); the embedded
#: widths (576, 640) keep 16384-row blocks.
_FUSE_BLOCK_BYTES = 128 << 20
#: Above this power-of-two width a (random) Hadamard R1 is folded by the fast transform, not the dense product
#: (the embedded models, hidden 576 and 640, keep the dense product and today's bits).
R1_DENSE_MAX = 1024


def _blocks(n: int, width: int) -> Iterator[slice]:
    """Blocks of ``n`` rows (or columns) of a matrix ``width`` wide (at most :data:`_FUSE_ROWS` and
    :data:`_FUSE_BLOCK_BYTES` of float64); each output row depends on its own input row only, so any blocking
    gives the same bits."""
    step = fold_block_rows(width)
    return (slice(start, start + step) for start in range(0, n, step))


def fold_block_rows(width: int) -> int:
    """Rows of one float64 fold block of a matrix ``width`` wide (the plan counts the same block)."""
    return max(1, min(_FUSE_ROWS, _FUSE_BLOCK_BYTES // (8 * max(1, width))))


# ------------------------------------------------------------------------------------------ model layout


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers, checked to carry the attention / MLP / norm modules the rotations touch."""
    layers = arch.decoder_layers(model)
    for i in range(len(layers)):
        a, m = arch.attention(model, i), arch.mlp_parts(model, i)
        arch.layer_norms(model, i)
        if not all(isinstance(lin, nn.Linear) for lin in (a.q, a.k, a.v, a.o, m.gate, m.up, m.down)):
            raise UnsupportedArchitectureError(f"layer {i}: the attention / MLP projections are not nn.Linear")
    return layers


def _lm_head(model: nn.Module) -> nn.Linear:
    head = arch.lm_head(model)
    if not isinstance(head, nn.Linear):
        raise UnsupportedArchitectureError("expected the lm_head to be an nn.Linear")
    return head


def _rmsnorm_weight(norm: nn.Module, where: str) -> torch.Tensor:
    w = getattr(norm, "weight", None)
    if not isinstance(w, torch.Tensor):
        raise UnsupportedArchitectureError(f"{where} has no weight; expected an RMSNorm")
    if getattr(norm, "bias", None) is not None:
        raise UnsupportedArchitectureError(f"{where} has a bias: a LayerNorm, not an RMSNorm")
    return w


# ------------------------------------------------------------------------------------------ folds


@torch.no_grad()
def _set(param: torch.Tensor, value: torch.Tensor) -> None:
    """Write a float64 result back into a parameter, keeping its dtype and device."""
    param.data.copy_(value.to(device=param.device, dtype=param.dtype))


def _check_rotation(mat: torch.Tensor, n: int, what: str, device: torch.device | str | None = None) -> torch.Tensor:
    """Validate a (…, n, n) stack of orthogonal matrices; return it as float64 on ``device`` (default the CPU).

    RᵀR is computed on ``device`` (the weights' device: no host copy of the matrix, one read of the result).
    """
    if not isinstance(mat, torch.Tensor):
        mat = torch.as_tensor(mat)
    if mat.ndim < 2 or mat.shape[-2:] != (n, n):
        raise RotationShapeError(f"{what} must have trailing shape ({n}, {n}), got {tuple(mat.shape)}")
    m = mat.detach().to(device or "cpu", torch.float64)
    finite = torch.isfinite(m).all()
    eye = torch.eye(n, dtype=torch.float64, device=m.device)
    err = torch.where(finite, (m.transpose(-1, -2) @ m - eye).abs().max(), torch.inf).item()
    if err == float("inf"):
        raise NotOrthogonalError(f"{what} has non-finite entries")
    if err > ORTHO_ATOL:
        raise NotOrthogonalError(f"{what} is not orthogonal: max |RᵀR − I| = {err:.3g} > {ORTHO_ATOL}")
    return m


def hadamard_signs(mat: torch.Tensor) -> torch.Tensor | None:
    """``s`` when ``mat`` is a (random) Hadamard ``diag(s)·H/√n`` of power-of-two order n > :data:`R1_DENSE_MAX`
    (then ``x @ mat`` is the fast transform of ``x ⊙ s``, O(n log n) instead of O(n²) per row), else None.

    Decided from the matrix itself, so a weight built and a weight rebuilt from a cached R1 take the same path.
    """
    n = mat.shape[-1]
    if mat.ndim != 2 or n <= R1_DENSE_MAX or n & (n - 1):
        return None
    key = (mat.data_ptr(), mat._version, tuple(mat.stride()), str(mat.device), mat.dtype)
    if key not in _SIGNS_MEMO:  # one check per matrix, not one per folded weight
        _SIGNS_MEMO.clear()
        # the memo holds the matrix itself, so its storage (and address) cannot be reused while it is the key
        _SIGNS_MEMO[key] = (mat, _check_hadamard_signs(mat, n))
    return _SIGNS_MEMO[key][1]


_SIGNS_MEMO: dict[tuple, tuple[torch.Tensor, torch.Tensor | None]] = {}


def _check_hadamard_signs(mat: torch.Tensor, n: int) -> torch.Tensor | None:
    """The signs ``s`` of ``mat = diag(s)·H/√n`` or None, checked on the matrix's own device (one read)."""
    m = mat.detach().to(torch.float64)
    signs = torch.sign(m[:, 0])  # the Sylvester H has a first column of ones
    entries = ((m.abs() - n ** -0.5).abs() < 1e-12).all()
    eye = torch.eye(n, dtype=torch.float64, device=m.device)
    if not bool(entries & ((m - signs[:, None] * online_r4(eye)).abs().max() <= 1e-12)):
        return None
    return signs


def fold_dtype(storage: torch.dtype) -> torch.dtype:
    """The dtype of the fold algebra for weights stored in ``storage``: float64 for float32/float64 weights
    (the embedded models' bits), float32 for 16-bit weights, where the cast back rounds to 8 (bf16) or 11
    (fp16) significant bits and float32's 24-bit products change almost no rounded weight (at most one ulp of
    the storage dtype; tests/numerics/test_scale_pipeline.py), at half the float64 time on a CPU."""
    return torch.float64 if storage in (torch.float32, torch.float64) else torch.float32


@torch.no_grad()
def fold_right(w: torch.Tensor, mat: torch.Tensor) -> None:
    """``W ← W M`` in place, in :func:`fold_dtype` on W's device, one row block at a time (a power-of-two
    random Hadamard above :data:`R1_DENSE_MAX` by the fast transform, :func:`hadamard_signs`)."""
    signs = hadamard_signs(mat)
    dt = fold_dtype(w.dtype)
    m = (mat if signs is None else signs).to(device=w.device, dtype=dt)
    for block in _blocks(*w.shape):
        rows = w.data[block]
        x = rows.to(dt)
        rows.copy_((x @ m if signs is None else online_r4(x * m)).to(w.dtype))


@torch.no_grad()
def fold_left(mat: torch.Tensor, w: torch.Tensor) -> None:
    """``W ← M W`` in place, in :func:`fold_dtype` on W's device, one column block at a time (``M = Qᵀ`` of a
    power-of-two random Hadamard Q above :data:`R1_DENSE_MAX` by the fast transform)."""
    signs = hadamard_signs(mat.T)
    dt = fold_dtype(w.dtype)
    m = (mat if signs is None else signs).to(device=w.device, dtype=dt)
    for block in _blocks(w.shape[1], w.shape[0]):
        cols = w.data[:, block]
        x = cols.to(dt)
        cols.copy_((m @ x if signs is None else online_r4(x.T * m).T).to(w.dtype))


# ------------------------------------------------------------------------------------------ untie / fuse


def embeddings_tied(model: nn.Module) -> bool:
    """True when lm_head and the embeddings share storage."""
    return arch.embeddings_tied(model)


@torch.no_grad()
def untie_embeddings(model: nn.Module) -> bool:
    """Give lm_head its own copy of a tied embedding matrix; set ``tie_word_embeddings=False``.

    Returns True if the model was tied. Needed before R1 (E ← E Q and W_head ← W_head Q would hit the
    shared tensor twice) and before fusing the final norm into lm_head.
    """
    head = _lm_head(model)
    tied = embeddings_tied(model)
    if tied:
        embed = cast(torch.Tensor, arch.embeddings(model).weight)
        head.weight = nn.Parameter(embed.detach().clone(), requires_grad=False)
    for cfg in {id(c): c for c in (model.config, arch.text_config(model))}.values():
        if hasattr(cfg, "tie_word_embeddings"):
            cfg.tie_word_embeddings = False
    return tied


@torch.no_grad()
def fuse_norms(model: nn.Module) -> None:
    """Fuse RMSNorm scales into the following linears and set the norm weights to 1 (QuaRot Sec. 4.1).

    Pre-attention norm → q, k, v; pre-MLP norm → gate, up; final norm → lm_head (the pairs come from
    :func:`rope_quant.model.arch.fusable_norms`): ``W ← W diag(g)`` with ``g`` the norm's scale
    (``offset + weight``, offset 0 for Llama-style norms). Exact: ``g ⊙ n(x)`` then ``Wᵀ`` equals
    ``n(x)`` then ``(W diag g)ᵀ``. No embedding-mean subtraction (see :func:`subtract_embedding_mean`).
    """
    decoder_layers(model)
    if embeddings_tied(model):
        raise TiedEmbeddingsError("fusing the final norm into a tied lm_head would alter the embeddings")
    offset = arch.norm_weight_offset(model)
    for where, norm, linears in arch.fusable_norms(model):
        w = _rmsnorm_weight(norm, where)
        g = w.detach().to(torch.float64).cpu() + offset
        for lin in linears:
            _scale_columns(cast(nn.Linear, lin), g)
        w.data.fill_(1.0 - offset)


def _scale_columns(lin: nn.Linear, g: torch.Tensor) -> None:
    """``W ← W diag(g)`` in float64, in row blocks (no float64 copy of a 262k-row lm_head, Gemma 3)."""
    g = g.to(lin.weight.device, fold_dtype(lin.weight.dtype))
    for block in _blocks(*lin.weight.shape):
        rows = lin.weight.data[block]
        rows.copy_((rows.to(g.dtype) * g[None, :]).to(rows.dtype))


def norms_fused(model: nn.Module) -> bool:
    """True when every fusable RMSNorm has unit scale (``offset + weight == 1``)."""
    offset = arch.norm_weight_offset(model)
    return all(bool((_rmsnorm_weight(n, where) + offset == 1).all()) for where, n, _ in arch.fusable_norms(model))


@torch.no_grad()
def subtract_embedding_mean(model: nn.Module) -> None:
    """QuaRot's LayerNorm trick: subtract each embedding row's mean (``E ← E − mean_j E[:, j]``).

    Function-preserving only when the first consumer is a LayerNorm (which removes the mean anyway).
    For RMSNorm models it changes ``rms(x)`` and the residual stream itself, hence the logits; it is kept
    here only so that a test can demonstrate this, and
    :func:`~rope_quant.rotations.offline.rotate_model` never calls it.
    """
    w = cast(torch.Tensor, arch.embeddings(model).weight)
    w64 = w.detach().to("cpu", torch.float64)
    _set(w, w64 - w64.mean(dim=-1, keepdim=True))

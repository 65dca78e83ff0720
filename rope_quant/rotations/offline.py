"""Offline rotations R1, R2 and the online R4 for Llama-family Hugging Face models.

This is the rotation scaffold shared by QuaRot (Ashkboos et al., 2024, Sec. 4), SpinQuant (Liu et al., 2024,
Sec. 3) and DartQuant (Shao et al., 2025, Sec. 3). Row-vector convention throughout: a rotation ``R`` maps an
activation row ``x`` to ``x @ R``. A linear ``y = x Wᵀ`` whose input is rotated keeps its output when
``W ← W R``, and a linear whose output must come out rotated gets ``W ← Rᵀ W`` (and ``b ← b R``).

Steps, all function-preserving, in the order :func:`rotate_model` runs them (1–3 only when R1 is requested):

1. :func:`untie_embeddings`: lm_head gets its own copy of the (tied) embedding matrix.
2. :func:`fuse_norms`: each RMSNorm scale ``g`` moves into the linears it feeds (``W ← W diag(g)``) and
   the norm weight becomes 1. A unit-weight RMSNorm commutes with any orthogonal ``Q``:
   ``rms(xQ) = rms(x)``, so ``norm(xQ) = norm(x) Q``. (QuaRot's fusion also subtracts each embedding row's
   mean, which is invariant only for LayerNorm; it is *not* for RMSNorm, see
   :func:`subtract_embedding_mean`, which the pipeline never calls.)
3. :func:`apply_r1`: the residual stream is rotated by ``Q`` (hidden × hidden): embeddings ``E ← E Q``,
   residual readers (q, k, v, gate, up, lm_head) ``W ← W Q``, residual writers (o_proj, down_proj)
   ``W ← Qᵀ W``, ``b ← b Q``.
4. :func:`apply_r2`: per KV head an orthogonal ``R_h`` (head_dim²): v_proj rows of head h ``W ← R_hᵀ W``,
   o_proj input columns of every Q head of that KV group ``W ← W R_h``. Attention mixes value rows
   linearly, so the attention output of a head is rotated by the same ``R_h``; no online op is needed.
5. :func:`apply_r4`: down_proj ``W ← W H`` with ``H`` the normalised Hadamard of size ``intermediate``
   (as applied by :func:`rope_quant.core.hadamard.hadamard_transform`), plus an online forward pre-hook that
   applies the same transform to down_proj's input (the hook: :mod:`rope_quant.rotations.online_r4`).

All weight algebra is done in float64 (float32 for 16-bit weights: :func:`fold_dtype`) on the parameter's
own device, one matrix (and, for a matrix larger than one block, :func:`fold_block_rows` rows or columns: at
most :data:`_FUSE_ROWS` of them and :data:`_FUSE_BLOCK_BYTES` of float64) at a time, and cast back to the
parameter's dtype: the model never has a float64 copy (a 128256 × 4096 embedding alone is 4.2 GB
in float64). A block's arithmetic is the whole matrix's (each output row / column depends on its own input
row / column only), so the blocked results equal the unblocked ones bit for bit.

**Ordering with activation quantisers (R4).** The online Hadamard must run *before* the input quantiser of
down_proj: the quantiser has to see the rotated activation, which is what the fused weight expects.
:func:`apply_r4` registers its pre-hook with ``prepend=True`` so it runs before any pre-hook registered
earlier or later without ``prepend``. A pipeline that prefers a single pre-hook can call
``apply_r4(model, register_hooks=False)`` and then apply :func:`online_r4` itself before quantising.
Hooks are not part of a state_dict: after reloading cached rotated weights call :func:`install_online_r4`.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum

import torch
from torch import nn

from rope_quant.core import hadamard
from rope_quant.model import arch
from rope_quant.rotations import whip
from rope_quant.rotations.errors import (
    AlreadyRotatedError,
    MissingRotationError,
    NormsNotFusedError,
    NotFunctionPreservingError,
    NotOrthogonalError,
    RotationError,
    RotationShapeError,
    TiedEmbeddingsError,
    UnsupportedArchitectureError,
)
from rope_quant.rotations.online_r4 import R4_FLAG, down_projs, install_online_r4, online_r4, r4_matrix, r4_rows

__all__ = [
    "RotationError",
    "fold_block_rows",
    "fold_dtype",
    "UnsupportedArchitectureError",
    "NotFunctionPreservingError",
    "TiedEmbeddingsError",
    "NormsNotFusedError",
    "RotationShapeError",
    "NotOrthogonalError",
    "AlreadyRotatedError",
    "MissingRotationError",
    "R1_CHOICES",
    "R2_CHOICES",
    "ModelDims",
    "RotationConfig",
    "RotationKind",
    "RotationResult",
    "model_dims",
    "decoder_layers",
    "check_function_preserving",
    "embeddings_tied",
    "untie_embeddings",
    "rotate_embeddings",
    "fuse_norms",
    "norms_fused",
    "subtract_embedding_mean",
    "r1_hadamard",
    "r2_hadamard",
    "apply_r1",
    "apply_r2",
    "fold_right",
    "fold_left",
    "hadamard_signs",
    "r4_matrix",
    "online_r4",
    "apply_r4",
    "install_online_r4",
    "rotate_model",
]

class RotationKind(StrEnum):
    """An offline rotation (R1 or R2).

    ``identity`` (none), ``hadamard`` (the normalised Hadamard H/√n, the same for every seed),
    ``random_hadamard`` (QuaRot's seeded diag(s)·H/√n: the paper's R2, and R1's whip initialisation),
    ``whip`` (fitted with DartQuant's whip loss; the paper's R1, App. A.1) or ``given`` (a caller's matrix).
    ``"none"`` is accepted as the former name of ``identity``.
    """

    IDENTITY = "identity"
    HADAMARD = "hadamard"
    RANDOM_HADAMARD = "random_hadamard"
    WHIP = "whip"
    GIVEN = "given"

    @classmethod
    def _missing_(cls, value: object) -> RotationKind | None:
        return cls.IDENTITY if value == "none" else None


R1_CHOICES = tuple(k.value for k in RotationKind)
R2_CHOICES = R1_CHOICES
#: Largest tolerated max |RᵀR − I| (float64) for a matrix passed in as a rotation.
ORTHO_ATOL = 1e-4
#: Rows (or columns) per block of the float64 weight algebra (bounds the float64 temporary) ...
_FUSE_ROWS = 16384
#: ... and at most this many bytes of float64 per block: 4096 rows at width 4096, 2048 at 8192 (the block, its
#: product and the cast back were 1.25 GiB at 16384 × 4096, half of a 1-layer Llama-3-8B in bf16); the embedded
#: widths (576, 640) keep 16384-row blocks.
_FUSE_BLOCK_BYTES = 128 << 20


def _blocks(n: int, width: int) -> Iterator[slice]:
    """Blocks of ``n`` rows (or columns) of a matrix ``width`` wide (at most :data:`_FUSE_ROWS` and
    :data:`_FUSE_BLOCK_BYTES` of float64); each output row depends on its own input row only, so any blocking
    gives the same bits."""
    step = fold_block_rows(width)
    return (slice(start, start + step) for start in range(0, n, step))


def fold_block_rows(width: int) -> int:
    """Rows of one float64 fold block of a matrix ``width`` wide (the plan counts the same block)."""
    return max(1, min(_FUSE_ROWS, _FUSE_BLOCK_BYTES // (8 * max(1, width))))


#: Above this order R4 is folded with the fast transform, row block by row block, instead of the dense
#: float64 matrix (14336² float64 is 1.6 GB); at or below it the dense product is kept (today's bits).
R4_DENSE_MAX = 4096
#: Above this power-of-two width a (random) Hadamard R1 is folded by the fast transform, not the dense product
#: (the embedded models, hidden 576 and 640, keep the dense product and today's bits).
R1_DENSE_MAX = 1024


# ------------------------------------------------------------------------------------------ model layout

#: Sizes the rotations need (from :mod:`rope_quant.model.arch`).
ModelDims = arch.ModelDims


def model_dims(model: nn.Module) -> ModelDims:
    """Read hidden / heads / KV heads / head_dim / intermediate from the config (GQA aware)."""
    return arch.dims(model)


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


def _rmsnorm_weight(norm: nn.Module, where: str) -> nn.Parameter:
    w = getattr(norm, "weight", None)
    if not isinstance(w, torch.Tensor):
        raise UnsupportedArchitectureError(f"{where} has no weight; expected an RMSNorm")
    if getattr(norm, "bias", None) is not None:
        raise UnsupportedArchitectureError(f"{where} has a bias: a LayerNorm, not an RMSNorm")
    return w


def check_function_preserving(model: nn.Module, cfg: RotationConfig) -> None:
    """Raise :class:`NotFunctionPreservingError` when ``cfg`` asks for a rotation the architecture refuses."""
    asked = [r for r, on in (("r1", cfg.r1 != "identity"), ("r2", cfg.r2 != "identity"), ("r4", cfg.r4)) if on]
    for rot in asked:
        _require_preserving(model, rot)


def _require_preserving(model: nn.Module, rotation: str) -> None:
    reason = arch.rotation_refusal(model, rotation)
    if reason is not None:
        others = [r for r in ("r1", "r2", "r4") if r != rotation and arch.rotation_refusal(model, r) is None]
        raise NotFunctionPreservingError(
            f"{rotation.upper()} is not function-preserving for this model: {reason}. Alternatives: "
            f"{rotation}='none'" + (f" (still available: {', '.join(others)} and the online R3)" if others else "")
            + ", or a model family without these norms"
        )


# ------------------------------------------------------------------------------------------ helpers


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


def _derived_seed(seed: int, *parts: object) -> int:
    """Deterministic sub-seed for (seed, parts), stable across runs and platforms."""
    return zlib.crc32(repr((int(seed),) + parts).encode()) & 0x7FFFFFFF


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
        head.weight = nn.Parameter(arch.embeddings(model).weight.detach().clone(), requires_grad=False)
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
            _scale_columns(lin, g)
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
    here only so that a test can demonstrate this, and :func:`rotate_model` never calls it.
    """
    w = arch.embeddings(model).weight
    w64 = w.detach().to("cpu", torch.float64)
    _set(w, w64 - w64.mean(dim=-1, keepdim=True))


# ------------------------------------------------------------------------------------------ R1


def r1_hadamard(hidden: int, seed: int | None) -> torch.Tensor:
    """R1 of order ``hidden`` (float64): QuaRot's seeded random Hadamard ``diag(s) · H/√n``, or the plain
    normalised ``H/√n`` when ``seed`` is None."""
    if seed is None:
        return hadamard.hadamard_matrix(hidden, dtype=torch.float64) / hidden ** 0.5
    return hadamard.random_hadamard(hidden, seed, dtype=torch.float64)


@torch.no_grad()
def apply_r1(model: nn.Module, q: torch.Tensor) -> torch.Tensor:
    """Rotate the residual stream by ``Q`` (hidden × hidden orthogonal): ``x ← x Q`` (QuaRot Sec. 4.1, R1).

    Embeddings and residual readers ``W ← W Q``; residual writers ``W ← Qᵀ W`` and ``b ← b Q``.
    Requires untied embeddings and fused norms; raises :class:`NotFunctionPreservingError` where the
    architecture refuses R1 (sandwich norms). Returns ``Q`` as checked (float64, on the weights' device).
    """
    _require_preserving(model, "r1")
    dims = model_dims(model)
    if embeddings_tied(model):
        raise TiedEmbeddingsError("R1 on tied embeddings would rotate the shared matrix twice; untie first")
    if not norms_fused(model):
        raise NormsNotFusedError("R1 needs unit-weight RMSNorms (they commute with Q); call fuse_norms first")
    qm = _check_rotation(q, dims.hidden, "R1", device=arch.embeddings(model).weight.device)
    _fold_r1(model, qm)
    return qm


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


def _fold_r1_ends(model: nn.Module, qm: torch.Tensor) -> None:
    """R1 on the two ends of the residual stream: ``E ← E Q`` and ``W_head ← W_head Q``."""
    for w in (arch.embeddings(model).weight, _lm_head(model).weight):
        fold_right(w, qm)


def _fold_r1(model: nn.Module, qm: torch.Tensor) -> None:
    """The R1 weight algebra without the checks (tests use it to show why a refusal is needed)."""
    _fold_r1_ends(model, qm)
    for i in range(len(decoder_layers(model))):
        a, m = arch.attention(model, i), arch.mlp_parts(model, i)
        for lin in (a.q, a.k, a.v, m.gate, m.up):  # residual readers
            fold_right(lin.weight, qm)
        for lin in (a.o, m.down):  # residual writers
            fold_left(qm.T, lin.weight)
            if lin.bias is not None:
                _set(lin.bias, lin.bias.detach().to(torch.float64) @ qm.to(lin.bias.device))


@torch.no_grad()
def rotate_embeddings(model: nn.Module, q: torch.Tensor) -> None:
    """Untie → fuse the final norm → R1, on the embeddings and lm_head only, with the arithmetic of
    :func:`rotate_model` (QuaRot Sec. 4.1).

    The weight cache stores the quantised decoder linears and leaves these two unquantised matrices out
    (their 227 MB would dominate the file); a cache hit rebuilds them from the loaded model and the cached R1.
    The decoder's norms are left as they are (the cached state holds them, fused).
    """
    qm = _check_rotation(q, model_dims(model).hidden, "R1", device=arch.embeddings(model).weight.device)
    untie_embeddings(model)
    head = _lm_head(model)
    offset = arch.norm_weight_offset(model)
    for where, norm, linears in arch.fusable_norms(model):
        if any(lin is head for lin in linears):
            _scale_columns(head, _rmsnorm_weight(norm, where).detach().to(torch.float64).cpu() + offset)
    _fold_r1_ends(model, qm)


# ------------------------------------------------------------------------------------------ R2


def r2_hadamard(model_or_dims: nn.Module | ModelDims, seed: int | None) -> torch.Tensor:
    """Seeded random Hadamards ``diag(s)·H/√d`` for R2, one per (layer, KV head): float64 (n_layers, n_kv, d, d).

    ``seed=None``: the plain normalised Hadamard H/√d for every head.
    """
    dims = model_or_dims if isinstance(model_or_dims, ModelDims) else model_dims(model_or_dims)
    if seed is None:
        h = hadamard.hadamard_matrix(dims.head_dim, dtype=torch.float64) / dims.head_dim ** 0.5
        return h.expand(dims.n_layers, dims.n_kv_heads, dims.head_dim, dims.head_dim).clone()
    mats = [
        torch.stack([hadamard.random_hadamard(dims.head_dim, _derived_seed(seed, "r2", li, h), torch.float64)
                     for h in range(dims.n_kv_heads)])
        for li in range(dims.n_layers)
    ]
    return torch.stack(mats)


def _r2_stack(model: nn.Module, dims: ModelDims, mats: int | torch.Tensor | list) -> torch.Tensor:
    """Normalise an R2 spec (seed, (d,d), (L,d,d), (L,n_kv,d,d) or a list per layer) to (L, n_kv, d, d)."""
    if isinstance(mats, bool):
        raise RotationShapeError("R2 spec must be a seed (int) or rotation matrices, not a bool")
    if isinstance(mats, int):
        return r2_hadamard(dims, mats)
    if isinstance(mats, (list, tuple)):
        if len(mats) != dims.n_layers:
            raise RotationShapeError(f"R2 list has {len(mats)} entries for {dims.n_layers} layers")
        per_layer = [torch.as_tensor(m) for m in mats]
        mats = torch.stack([m.expand(dims.n_kv_heads, -1, -1) if m.ndim == 2 else m for m in per_layer])
    m = torch.as_tensor(mats)
    d, L, k = dims.head_dim, dims.n_layers, dims.n_kv_heads
    if m.ndim == 2:
        m = m.expand(L, k, d, d)
    elif m.ndim == 3:
        if m.shape[0] != L:
            raise RotationShapeError(f"R2 of shape {tuple(m.shape)}: expected ({L}, {d}, {d})")
        m = m[:, None].expand(L, k, d, d)
    elif m.ndim == 4:
        if m.shape[:2] != (L, k):
            raise RotationShapeError(f"R2 of shape {tuple(m.shape)}: expected ({L}, {k}, {d}, {d})")
    else:
        raise RotationShapeError(f"R2 of shape {tuple(m.shape)}: expected ({L}, {k}, {d}, {d})")
    return _check_rotation(m, d, "R2")


@torch.no_grad()
def apply_r2(model: nn.Module, mats: int | torch.Tensor | list) -> torch.Tensor:
    """Per-KV-head value/output rotation (SpinQuant R2): ``v_h ← v_h R_h`` offline, no online op.

    ``mats``: a seed (random Hadamards, :func:`r2_hadamard`) or matrices of shape (d, d), (L, d, d),
    (L, n_kv, d, d), or a per-layer list. v_proj rows of KV head k: ``W ← R_kᵀ W`` (bias ``b ← b R_k``);
    o_proj input columns of Q head h: ``W[:, h] ← W[:, h] R_{h // group}``. Returns the (L, n_kv, d, d)
    float64 stack applied.
    """
    _require_preserving(model, "r2")
    dims = model_dims(model)
    stack = _r2_stack(model, dims, mats)
    d, k, g = dims.head_dim, dims.n_kv_heads, dims.group
    for li in range(len(decoder_layers(model))):
        r = stack[li]  # (k, d, d)
        attn = arch.attention(model, li)
        v, o = attn.v, attn.o
        r = r.to(v.weight.device)
        wv = v.weight.detach().to(torch.float64).view(k, d, -1)
        _set(v.weight, torch.einsum("kij,kil->kjl", r, wv).reshape(k * d, -1))
        if v.bias is not None:
            bv = v.bias.detach().to(torch.float64).view(k, d)
            _set(v.bias, torch.einsum("ki,kij->kj", bv, r).reshape(-1))
        r_q = r.to(o.weight.device).repeat_interleave(g, dim=0)  # Q head h uses KV head h // g
        wo = o.weight.detach().to(torch.float64).view(o.weight.shape[0], dims.n_heads, d)
        _set(o.weight, torch.einsum("ohi,hij->ohj", wo, r_q).reshape(o.weight.shape[0], -1))
    return stack


# ------------------------------------------------------------------------------------------ R4


@torch.no_grad()
def apply_r4(model: nn.Module, register_hooks: bool = True) -> list[torch.utils.hooks.RemovableHandle]:
    """Online Hadamard on the down_proj input (QuaRot R4): ``W_down ← W_down A``, input ``x ← x A``.

    With ``register_hooks`` (default) a forward pre-hook is registered on every down_proj with
    ``prepend=True`` so it runs before any activation quantiser pre-hook; the handles are returned.
    With ``register_hooks=False`` only the weights change and the caller must apply :func:`online_r4`
    to down_proj's input itself (before quantising it), or the model is no longer equivalent.
    Each down_proj gets ``rq_online_r4 = "hook"`` or ``"external"``.
    """
    _require_preserving(model, "r4")
    dims = model_dims(model)
    downs = down_projs(model)
    if any(getattr(down, R4_FLAG, False) for down in downs):
        raise AlreadyRotatedError("R4 is already applied to this model's down_proj")
    a = r4_matrix(dims.intermediate) if dims.intermediate <= R4_DENSE_MAX else None
    for down in downs:
        if a is not None:
            fold_right(down.weight, a)
        else:  # W A = online_r4(W) row block by row block, in float64, no n × n matrix
            for block in _blocks(*down.weight.shape):
                rows = down.weight.data[block]
                rows.copy_(r4_rows(rows.to(fold_dtype(rows.dtype))).to(rows.dtype))
        setattr(down, R4_FLAG, "external")
    if not register_hooks:
        return []
    for down in downs:
        setattr(down, R4_FLAG, False)
    return install_online_r4(model)


# ------------------------------------------------------------------------------------------ pipeline


@dataclass(frozen=True)
class RotationConfig:
    """Which offline rotations to apply: r1/r2 a :class:`RotationKind` value, r4 on/off.

    "whip" takes a DartQuant-calibrated matrix (passed in, or fitted from ``calib_ids`` by
    :func:`rotate_model` with ``whip`` options); "given" takes a matrix from the caller.
    """

    r1: str = "random_hadamard"
    r2: str = "random_hadamard"
    r4: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("r1", "r2"):
            try:
                object.__setattr__(self, name, RotationKind(getattr(self, name)).value)
            except ValueError:
                raise RotationError(f"{name} must be one of {R1_CHOICES}, got {getattr(self, name)!r}") from None
        if not isinstance(self.r4, bool):
            raise RotationError(f"r4 must be a bool, got {self.r4!r}")

    def key(self) -> str:
        """Stable short key for caches."""
        return f"r1={self.r1},r2={self.r2},r4={int(self.r4)},seed={self.seed}"


@dataclass
class RotationResult:
    """What :func:`rotate_model` applied: the R1 matrix, the R2 stack, the R4 hook handles."""

    config: RotationConfig
    r1: torch.Tensor | None = None
    r2: torch.Tensor | None = None
    r4_handles: list = field(default_factory=list)
    untied: bool = False
    fitted: whip.CalibratedRotations | None = None


def rotate_model(
    model: nn.Module,
    cfg: RotationConfig,
    r1_matrix: torch.Tensor | None = None,
    r2_matrices: torch.Tensor | list | None = None,
    calib_ids: torch.Tensor | None = None,
    whip_options: dict | None = None,
    register_r4_hooks: bool = True,
) -> RotationResult:
    """Untie → fuse norms → R1 (these three only when R1 is not identity) → R2 → R4, in place; every step
    function-preserving.

    r1/r2="random_hadamard" use seeded random Hadamards diag(s)·H (``cfg.seed``), "hadamard" the plain
    normalised Hadamard; "given" needs the matrix;
    "whip" uses the given matrix or, when it is None, fits one with :mod:`rope_quant.rotations.whip` on
    ``calib_ids`` (token ids, (n, seqlen)) before any weight changes (both R1 and R2 samples are
    invariant under untie and fuse; R2 samples under R1 too). ``whip_options`` go to
    :func:`rope_quant.rotations.whip.calibrate_model_rotations`. A rotation the architecture declares
    non-function-preserving raises :class:`NotFunctionPreservingError` before anything changes.
    """
    if not isinstance(cfg, RotationConfig):
        raise RotationError(f"cfg must be a RotationConfig, got {type(cfg).__name__}")
    if r1_matrix is not None and cfg.r1 not in ("given", "whip"):
        raise RotationError(f"r1_matrix was given but cfg.r1={cfg.r1!r}; use r1='given' or 'whip'")
    if r2_matrices is not None and cfg.r2 not in ("given", "whip"):
        raise RotationError(f"r2_matrices were given but cfg.r2={cfg.r2!r}; use r2='given' or 'whip'")
    if cfg.r1 == "given" and r1_matrix is None:
        raise MissingRotationError("r1='given' needs r1_matrix")
    if cfg.r2 == "given" and r2_matrices is None:
        raise MissingRotationError("r2='given' needs r2_matrices")
    check_function_preserving(model, cfg)
    need_r1 = cfg.r1 == "whip" and r1_matrix is None
    need_r2 = cfg.r2 == "whip" and r2_matrices is None
    dims = model_dims(model)
    if need_r1 or need_r2:
        if calib_ids is None:
            raise MissingRotationError("whip rotations need r1_matrix/r2_matrices or calib_ids to fit them")
        fitted = whip.calibrate_model_rotations(
            model, calib_ids, fit_r1=need_r1, fit_r2=need_r2, seed=cfg.seed, **(whip_options or {})
        )
        r1_matrix = fitted.r1 if need_r1 else r1_matrix
        r2_matrices = fitted.r2 if need_r2 else r2_matrices
    else:
        fitted = None

    result = RotationResult(config=cfg, fitted=fitted)
    if cfg.r1 != "identity":
        # untie and fuse only for R1 (as QuaRot does): R1 must pass through unit-weight norms; R2 and R4 pass
        # through none. Without R1 a fused scale would only move the norm's per-channel range into the weights
        # (Gemma 3's (1 + w) scales reach 122: one input column of q/k/v then sets every 4-bit step of a row).
        result.untied = untie_embeddings(model)
        fuse_norms(model)
        q = r1_matrix
        if cfg.r1 in ("random_hadamard", "hadamard"):
            q = r1_hadamard(dims.hidden, cfg.seed if cfg.r1 == "random_hadamard" else None)
        result.r1 = apply_r1(model, q).cpu()  # checked once, on the weights' device
    if cfg.r2 != "identity":
        spec = r2_matrices
        if cfg.r2 in ("random_hadamard", "hadamard"):
            spec = int(cfg.seed) if cfg.r2 == "random_hadamard" else r2_hadamard(dims, None)
        result.r2 = apply_r2(model, spec)
    if cfg.r4:
        result.r4_handles = apply_r4(model, register_hooks=register_r4_hooks)
    model.rq_rotation = cfg  # provenance for caches and env.json
    return result

"""Offline rotations R1, R2 and the online R4 for Llama-family Hugging Face models.

This is the rotation scaffold shared by QuaRot (Ashkboos et al., 2024, Sec. 4), SpinQuant (Liu et al., 2024,
Sec. 3) and DartQuant (Shao et al., 2025, Sec. 3). Row-vector convention throughout: a rotation ``R`` maps an
activation row ``x`` to ``x @ R``. The weight algebra the steps share (``W ← W R``, ``W ← Rᵀ W`` in float64
blocks, untie, norm fusion, the orthogonality check) is :mod:`rope_quant.rotations.folding`'s.

Steps, all function-preserving, in the order :func:`rotate_model` runs them (1–3 only when R1 is requested):

1. :func:`untie_embeddings`: lm_head gets its own copy of the (tied) embedding matrix.
2. :func:`fuse_norms`: each RMSNorm scale moves into the linears it feeds and the norm weight becomes 1, so
   the norm commutes with R1 (and why the embedding mean is not subtracted: :mod:`rope_quant.rotations.folding`).
3. :func:`apply_r1`: the residual stream is rotated by ``Q`` (hidden × hidden): embeddings ``E ← E Q``,
   residual readers (q, k, v, gate, up, lm_head) ``W ← W Q``, residual writers (o_proj, down_proj)
   ``W ← Qᵀ W``, ``b ← b Q``.
4. :func:`apply_r2`: per KV head an orthogonal ``R_h`` (head_dim²): v_proj rows of head h ``W ← R_hᵀ W``,
   o_proj input columns of every Q head of that KV group ``W ← W R_h``. Attention mixes value rows
   linearly, so the attention output of a head is rotated by the same ``R_h``; no online op is needed.
5. :func:`apply_r4`: down_proj ``W ← W H`` with ``H`` the normalised Hadamard of size ``intermediate``
   (as applied by :func:`rope_quant.core.hadamard.hadamard_transform`), plus an online forward pre-hook that
   applies the same transform to down_proj's input (the hook: :mod:`rope_quant.rotations.online_r4`).

**Ordering with activation quantisers (R4).** The online Hadamard must run *before* the input quantiser of
down_proj: the quantiser has to see the rotated activation, which is what the fused weight expects.
:func:`apply_r4` registers its pre-hook with ``prepend=True`` so it runs before any pre-hook registered
earlier or later without ``prepend``. A pipeline that prefers a single pre-hook can call
``apply_r4(model, register_hooks=False)`` and then apply :func:`online_r4` itself before quantising.
Hooks are not part of a state_dict: after reloading cached rotated weights call :func:`install_online_r4`.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from enum import StrEnum

import torch
from torch import nn

from rope_quant.core import hadamard
from rope_quant.model import arch
from rope_quant.rotations import whip, whip_model
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
from rope_quant.rotations.folding import (
    _blocks,
    _check_rotation,
    _lm_head,
    _rmsnorm_weight,
    _scale_columns,
    _set,
    decoder_layers,
    embeddings_tied,
    fold_block_rows,
    fold_dtype,
    fold_left,
    fold_right,
    fuse_norms,
    hadamard_signs,
    norms_fused,
    subtract_embedding_mean,
    untie_embeddings,
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
#: Above this order R4 is folded with the fast transform, row block by row block, instead of the dense
#: float64 matrix (14336² float64 is 1.6 GB); at or below it the dense product is kept (today's bits).
R4_DENSE_MAX = 4096


# ------------------------------------------------------------------------------------------ model layout

#: Sizes the rotations need (from :mod:`rope_quant.model.arch`).
ModelDims = arch.ModelDims


def model_dims(model: nn.Module) -> ModelDims:
    """Read hidden / heads / KV heads / head_dim / intermediate from the config (GQA aware)."""
    return arch.dims(model)


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


def _derived_seed(seed: int, *parts: object) -> int:
    """Deterministic sub-seed for (seed, parts), stable across runs and platforms."""
    return zlib.crc32(repr((int(seed),) + parts).encode()) & 0x7FFFFFFF


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
    "whip" uses the given matrix or, when it is None, fits one with :mod:`rope_quant.rotations.whip_model` on
    ``calib_ids`` (token ids, (n, seqlen)) before any weight changes (both R1 and R2 samples are
    invariant under untie and fuse; R2 samples under R1 too). ``whip_options`` go to
    :func:`rope_quant.rotations.whip_model.calibrate_model_rotations`. A rotation the architecture declares
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
        fitted = whip_model.calibrate_model_rotations(
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

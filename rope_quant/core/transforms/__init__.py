"""The R3 registry: online maps applied to post-RoPE queries and keys (paper §3–4, App. A.1, A.7).

Every entry maps keys by M_k and queries by M_q = M_k^{-T} (``apply_key`` / ``apply_query``; for the orthogonal
entries M_q = M_k = M, ``apply(x) == x @ M_h.T``), so q·k is preserved in exact arithmetic. Each declares
``commutes_with_rope``: whether ``M R_m = R_m M`` for every position m. By the Lemma, with distinct frequencies
the matrices commuting with RoPE are exactly the per-pair blocks ``αI + βJ`` (rotation-scalings), so a map
commutes iff it acts on each RoPE pair by a positive scalar times an SO(2) rotation G(φ_k); such a map folds
into W_Q / W_K (it can be applied before RoPE).

Built-in entries (``names()``; the open registry is :mod:`.registry`):

* ``identity``: M = I (commutes).
* ``hadamard``: the full-head normalised Hadamard H_d/√d in native channel order (does not commute).
* ``pairwise_only``: G(φ_k) inside each RoPE pair, ``angles`` (K,) or per KV head (H_kv, K) (commutes).
* ``pairwise_plus_hadamard``: pairwise first, then the full-head Hadamard: M = H·P(φ) (does not commute).
* ``pair_h2``: G(π/4) in every pair, the 2×2 Hadamard in SO(2) orientation (commutes).
* ``block_hadamard`` (``block`` = b): in the pair-interleaved order (slot 2k+s holds pair k's channel s;
  for rotate_half that is the permutation 2k+s ↦ k + s·d/2), blocks of b consecutive slots get
  H_{b/2}/√(b/2) ⊗ G(π/4), then the permutation is undone. b = 2 spans exactly one pair and equals
  ``pair_h2`` (commutes); b > 2 mixes pairs of different frequencies (does not commute). b = d equals the
  full-head Hadamard up to a fixed output-side permutation (the swap inside every pair).
* ``block_hadamard_contiguous`` (b): the same blocks on the native channel order, without the pair
  interleave: a layout control. In rotate_half, b = 2 mixes channels of different pairs (does not commute);
  in the interleaved layout it coincides with ``block_hadamard``.
* ``pair_h2_raw`` / ``block_hadamard_raw`` (b): raw-orientation controls with base factor
  H2 = [[1, 1], [1, −1]]/√2 = G(π/4)·diag(1, −1), a reflection inside each pair. By Lemma (b) a reflection
  maps R(θ) to R(−θ), so these do NOT commute with RoPE for any b. (The paper's Table M marks the raw
  per-pair H2 as commuting; the algebra, and our numeric tests, say otherwise.)

* ``pairwise_scaled`` (angles, scales): M_k = S·⊕G(φ_k), M_q = S^{-1}·⊕G(φ_k), S = ⊕ s_k I_2 (commutes;
  fitted: :mod:`rope_quant.calib.foldable`).
* ``prerope_channel_scale`` (scales): M_k = S, M_q = S^{-1}, pair-tied key scales (commutes; fitted).
* ``learned_orthogonal`` (matrices): an orthogonal Q_h per KV head, fitted from the Hadamard (does not commute).

Foreign transforms: :func:`register` a :class:`TransformSpec`, or declare an entry point in the group
``rope_quant.r3`` (loaded lazily once; see :mod:`.registry`). The implementations are in :mod:`.base` (the
paper's) and :mod:`.foldable` (fitted, foldable R3s beyond the paper).
"""

from __future__ import annotations

from rope_quant.core.transforms.base import (
    AngleShapeError,
    BlockHadamard,
    FullHadamard,
    HeadMismatchError,
    Identity,
    InvalidBlockSizeError,
    Pairwise,
    PairwisePlusHadamard,
    R3Transform,
    TransformError,
    TransformParamError,
    UnknownTransformError,
    interleave_permutation,
)
from rope_quant.core.transforms.foldable import (
    LearnedOrthogonal,
    NotOrthogonalError,
    PairwiseScaled,
    PreRopeChannelScale,
    ScaleError,
)
from rope_quant.core.transforms.registry import (
    ENTRY_POINT_GROUP,
    INTO_PROJECTIONS,
    INTO_PROJECTIONS_AND_NORMS,
    FitContext,
    FitError,
    Foldability,
    RegistryWarning,
    TransformNameClashError,
    TransformSpec,
    build,
    check_fit,
    closest_names,
    commutes_with_rope,
    fit_function,
    fold_factor,
    foldability,
    load_entry_points,
    names,
    needs_angles,
    needs_block,
    needs_fit,
    register,
    spec,
    unregister,
)

__all__ = [
    "TransformError", "UnknownTransformError", "TransformParamError", "InvalidBlockSizeError", "AngleShapeError",
    "HeadMismatchError", "ScaleError", "NotOrthogonalError", "TransformNameClashError", "FitError",
    "RegistryWarning", "R3Transform", "Identity", "FullHadamard", "Pairwise", "PairwisePlusHadamard",
    "BlockHadamard", "PairwiseScaled", "PreRopeChannelScale", "LearnedOrthogonal", "TransformSpec", "FitContext",
    "ENTRY_POINT_GROUP", "register", "unregister", "spec", "names", "closest_names", "build", "needs_angles",
    "needs_block", "needs_fit", "commutes_with_rope", "check_fit", "load_entry_points", "interleave_permutation",
    "Foldability", "INTO_PROJECTIONS", "INTO_PROJECTIONS_AND_NORMS", "foldability", "fold_factor", "fit_function",
]


def _block(raw: bool, contiguous: bool):
    def make(head_dim: int, block: int, layout: str = "rotate_half") -> R3Transform:
        return BlockHadamard(head_dim, block, layout, raw=raw, contiguous=contiguous)

    return make


#: The module of the built-in fits (they need the quantisers, a layer above core: named, imported on first use).
_FITS = "rope_quant.calib.foldable"


def _builtins() -> list[TransformSpec]:
    angles, block = ("angles",), ("block",)
    return [
        TransformSpec("identity", lambda d, layout="rotate_half": Identity(d, layout), True, "M = I",
                      doc="no R3", folding=Foldability(None, None)),
        TransformSpec("hadamard", lambda d, layout="rotate_half": FullHadamard(d, layout), False, "M = H_d/√d",
                      doc="full-head Hadamard"),
        TransformSpec("pairwise_only", lambda d, angles, layout="rotate_half": Pairwise(d, angles, layout), True,
                      "M = ⊕_k G(φ_k)", angles, angles, doc="Givens G(φ_k) per RoPE pair"),
        TransformSpec("pairwise_plus_hadamard",
                      lambda d, angles, layout="rotate_half": PairwisePlusHadamard(d, angles, layout), False,
                      "M = (H_d/√d)·⊕_k G(φ_k)", angles, angles, doc="pairwise, then full-head Hadamard",
                      folding=Foldability("pairwise_only", "hadamard", INTO_PROJECTIONS)),
        TransformSpec("pair_h2", lambda d, layout="rotate_half": BlockHadamard(d, 2, layout), True,
                      "M = ⊕_k G(π/4)", doc="G(π/4) per RoPE pair"),
        TransformSpec("block_hadamard", _block(False, False), None, "M = Π^T (I ⊗ H_{b/2}/√(b/2) ⊗ G(π/4)) Π",
                      block, block, doc="H_{b/2} ⊗ G(π/4), interleaved"),
        TransformSpec("block_hadamard_contiguous", _block(False, True), None, "M = I ⊗ H_{b/2}/√(b/2) ⊗ G(π/4)",
                      block, block, doc="H_{b/2} ⊗ G(π/4) on native channel order"),
        TransformSpec("pair_h2_raw", lambda d, layout="rotate_half": BlockHadamard(d, 2, layout, raw=True), False,
                      "M = ⊕_k H2", doc="raw H2 per pair (reflection)"),
        TransformSpec("block_hadamard_raw", _block(True, False), False, "M = Π^T (I ⊗ H_{b/2}/√(b/2) ⊗ H2) Π",
                      block, block, doc="H_{b/2} ⊗ raw H2"),
        TransformSpec("pairwise_scaled",
                      lambda d, angles, scales=None, layout="rotate_half": PairwiseScaled(d, angles, scales, layout),
                      True, "M_k = S·⊕_k G(φ_k), M_q = S^{-1}·⊕_k G(φ_k), S = ⊕_k s_k I_2",
                      ("angles", "scales"), angles, needs_fit=True, fit=f"{_FITS}:fit_pairwise_scaled",
                      doc="Givens angle plus a pair-tied key scale (inverse on queries)",
                      folding=Foldability("pairwise_scaled", None, INTO_PROJECTIONS_AND_NORMS)),
        TransformSpec("prerope_channel_scale",
                      lambda d, scales=None, layout="rotate_half": PreRopeChannelScale(d, scales, layout),
                      True, "M_k = S, M_q = S^{-1}, S = ⊕_k s_k I_2 (pair-tied)", ("scales",), needs_fit=True,
                      fit=f"{_FITS}:fit_prerope_channel_scale",
                      doc="KVQuant/SmoothAttention-style pair-tied key scales before RoPE",
                      folding=Foldability("prerope_channel_scale", None, INTO_PROJECTIONS_AND_NORMS)),
        TransformSpec("learned_orthogonal",
                      lambda d, matrices=None, layout="rotate_half": LearnedOrthogonal(d, matrices, layout),
                      False, "M = Q_h, Q_h Q_hᵀ = I (Cayley, from H_d/√d)", ("matrices",), needs_fit=True,
                      fit=f"{_FITS}:fit_learned_orthogonal",
                      doc="orthogonal d×d per KV head fitted to the 4-bit K error (upper reference)"),
    ]


for _spec in _builtins():
    register(_spec)
del _spec

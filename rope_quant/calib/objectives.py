"""Per-pair R3 angle estimation from calibration statistics (paper §3, App. A.2).

``objective="variance"`` (closed forms from :mod:`rope_quant.core.angles`):

- no frequencies: the Jacobi angle φ̂ = ½·atan2(s11 - s22, 2 s12), i.e. (C, S) = (1, 0), unwrapped;
- ``inv_freq`` and ``average_length`` L: the position-averaged φ* (Theorem (ii)), the Jacobi angle of
  the surrogate Σ̃ = mean_{m<L} R_m Σ R_mᵀ, wrapped to [-π/4, π/4);
- ``branch_matched=True``: the φ̂ control with φ*'s wrap, wrap(φ̂).

``objective`` in ``linf``/``l2max``/``quantile``: a 200-point grid over (-π/4, π/4], scored on the
per-(layer, pair) top-k candidate rows kept by :class:`~rope_quant.calib.stats.CalibrationStats`
(y = G(φ)[a; b]):

- ``linf``: max |y| over both outputs and all candidates;
- ``l2max``: the larger of the two outputs' mean y² over the candidates;
- ``quantile``: the ``quantile`` (default 0.99) of |y| over both outputs and all candidates.

Ties go to the grid angle nearest 0. A zero-variance band (s11 + s22 = 0) always gets the identity
angle 0. All objectives are π/2-periodic, so the grid covers every distinct rotation.

The candidate store keeps one merged set per (layer, pair), fed from the streams ``topk_streams`` of the
statistics, every row with weight 1. A grid objective therefore honours exactly the pooling rules that pool
every row of those same streams with weight 1 into one set per layer (:func:`grid_estimators`: ``k_only``
for the default K candidates, ``rows`` for Q+K candidates); ``balanced`` (equal stream weights),
``per_head`` (one set per KV head) and a rule over other streams are refused with
:class:`GridEstimatorError` rather than silently scored on the wrong rows.

``range`` (beyond the paper, §6's untested objective): the angles minimise the calibration mean of the
dynamic K quantiser's tokenwise group range r = max(max_c y_c, 0) − min(min_c y_c, 0) (the statistic
its step Δ = r/(2^b − 1) is set from), over every KV head and sampled token, where y = M·R_m·k is the key
after RoPE at the token's position m and after R3 M. For ``pairwise_only`` M R_m = ⊕_k G(φ_k + m θ_k),
so the live ``inv_freq`` enters through the phases; ``pairwise_plus_hadamard`` adds the Hadamard after.
The range couples the pairs of a head, so :func:`fit_range_angles` runs coordinate descent: per pair, a
grid over the full circle (the asymmetric range is not π/2-periodic) plus a local refinement, the other
pairs held fixed. ``per_head`` gives φ_{h,k} per KV head (Q heads use their group's angle); any other
pooling rule one angle per (layer, pair) shared by the heads (the objective is a K statistic either
way). Cost per layer and sweep: O(K·N·H·d) to update the rest-of-head extrema plus
O(K·(G + R)·N·H) for the candidate scores (×4 sign classes with the Hadamard), N sampled tokens,
G grid and R refinement points.

Over 500 lines because it is the one table of angle estimators that :func:`estimate_angles` dispatches over
(variance, grid, exact range); the range objective's fast path is range_fast.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np
import torch

from rope_quant.calib import range_fast
from rope_quant.calib.errors import CalibrationError
from rope_quant.calib.rules import POOLING, pool_spec
from rope_quant.calib.stats import CalibrationStats
from rope_quant.core.angles import PairCov, as_pair_cov, equalising_angle, jacobi_angle, wrap_angle
from rope_quant.core.rope import check_frequencies, find_inv_freq, pair_indices, phase_averages
from rope_quant.model import arch


class Objective(StrEnum):
    """What the R3 angles optimise: the variance (φ̂/φ*, the paper), a top-k grid score, or the K range."""

    VARIANCE = "variance"
    LINF = "linf"
    L2MAX = "l2max"
    QUANTILE = "quantile"
    RANGE = "range"


class AngleRule(StrEnum):
    """Which variance-objective angle R3 uses (§3, App. A.5, App. J).

    ``phi_hat``: the Jacobi angle φ̂ of the pooled covariance (unwrapped, the paper's pairwise_only);
    ``phi_hat_branch_matched``: φ̂ wrapped to φ*'s branch [−π/4, π/4) — the control that isolates the
    finite-phase correction from the branch shift (App. J); ``phi_star``: the position-averaged φ*.
    """

    PHI_HAT = "phi_hat"
    PHI_HAT_BRANCH_MATCHED = "phi_hat_branch_matched"
    PHI_STAR = "phi_star"


OBJECTIVES = tuple(o.value for o in Objective)
GRID_OBJECTIVES = (Objective.LINF.value, Objective.L2MAX.value, Objective.QUANTILE.value)
DEFAULT_GRID_SIZE = 200
DEFAULT_QUANTILE = 0.99
RANGE_GRID_SIZE = 64
RANGE_REFINE = 16
RANGE_SWEEPS = 2
RANGE_BATCH_LAYERS = 8  # layers per batch of the fast range fit (more spill the caches; fewer add overhead)


class AngleEstimationError(ValueError):
    """Bad arguments to the angle estimators."""


class UnknownObjectiveError(AngleEstimationError):
    """An objective outside :data:`OBJECTIVES` was named."""


class GridEstimatorError(AngleEstimationError, CalibrationError):
    """A grid objective was asked with a pooling rule its candidate rows do not represent."""


def grid_estimators(stats: CalibrationStats) -> tuple[str, ...]:
    """The pooling rules a grid objective honours on ``stats``' candidate sets (App. A.2.1).

    Those that pool every row of exactly the candidate streams (``stats.topk_streams``) with weight 1, one
    pool per layer: the candidate set is then the top-k of the very rows the rule pools.
    """
    streams = set(stats.topk_streams)
    return tuple(rule.value for rule, spec in POOLING.items()
                 if set(spec.streams) == streams and not spec.equal_stream_weights and not spec.per_kv_head)


def _check_grid_estimator(stats: CalibrationStats, estimator: str, objective: str) -> None:
    """Raise :class:`GridEstimatorError` unless ``estimator`` is in :func:`grid_estimators`."""
    valid = grid_estimators(stats)
    if estimator in valid:
        return
    spec = pool_spec(estimator)
    if spec.per_kv_head:
        why = "it gives per-head angles, while the candidate set is one per (layer, pair)"
    elif spec.equal_stream_weights:
        why = "it weights the streams equally, while the candidate rows of all streams count once each"
    else:
        why = f"it pools stream(s) {spec.streams}"
    hint = ("" if set(stats.topk_streams) == {"q", "k"}
            else "; build CalibrationStats with topk_streams=('q', 'k') for estimator 'rows'")
    raise GridEstimatorError(
        f"grid objective {objective!r} scores the top-k candidate rows of stream(s) {stats.topk_streams}, "
        f"so it cannot honour estimator {estimator!r} ({why}); valid estimators with a grid objective "
        f"for these statistics: {list(valid)}{hint}"
    )


def angle_grid(size: int = DEFAULT_GRID_SIZE) -> np.ndarray:
    """``size`` equally spaced angles over (-π/4, π/4]: φ_j = j·(π/2)/size, j = -size/2+1 .. size/2.

    Contains 0 exactly for even ``size``.
    """
    if int(size) != size or size < 2 or size % 2:
        raise AngleEstimationError(f"grid size must be an even integer >= 2, got {size!r}")
    half = size // 2
    return np.arange(-half + 1, half + 1, dtype=np.float64) * (math.pi / 2 / size)


def rotate_candidates(candidates: np.ndarray, phis: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """y = G(φ)[a; b] for candidates (n, K, 2) and angles (G,) -> (y1, y2), each (G, n, K)."""
    a, b = candidates[..., 0], candidates[..., 1]
    c = np.cos(phis)[:, None, None]
    s = np.sin(phis)[:, None, None]
    return c * a - s * b, s * a + c * b


def objective_scores(
    candidates: np.ndarray, phis: Any, objective: str, quantile: float = DEFAULT_QUANTILE
) -> np.ndarray:
    """Score of each angle on candidate rows (n, K, 2): returns (G, K) for angles of shape (G,).

    ``phis`` may also be (G, K) (one angle per pair); the result is then (G, K) as well.
    """
    if objective not in GRID_OBJECTIVES:
        raise UnknownObjectiveError(
            f"unknown grid objective {objective!r}; expected one of {GRID_OBJECTIVES}"
        )
    cand = np.asarray(candidates, dtype=np.float64)
    if cand.ndim != 3 or cand.shape[-1] != 2:
        raise AngleEstimationError(f"candidates must have shape (n, K, 2), got {cand.shape}")
    if cand.shape[0] == 0:
        raise AngleEstimationError("no candidate rows: calibrate the candidate stream first")
    phis = np.asarray(phis, dtype=np.float64)
    per_pair = phis.ndim == 2
    if per_pair:
        c = np.cos(phis)[:, None, :]
        s = np.sin(phis)[:, None, :]
        y1 = c * cand[None, :, :, 0] - s * cand[None, :, :, 1]
        y2 = s * cand[None, :, :, 0] + c * cand[None, :, :, 1]
    else:
        y1, y2 = rotate_candidates(cand, np.atleast_1d(phis))
    if objective == "linf":
        return np.maximum(np.abs(y1).max(axis=1), np.abs(y2).max(axis=1))
    if objective == "l2max":
        return np.maximum((y1 * y1).mean(axis=1), (y2 * y2).mean(axis=1))
    if not 0.0 <= quantile <= 1.0:
        raise AngleEstimationError(f"quantile must lie in [0, 1], got {quantile!r}")
    both = np.abs(np.concatenate([y1, y2], axis=1))
    return np.quantile(both, quantile, axis=1)


def grid_search(
    candidates: np.ndarray,
    objective: str,
    grid_size: int = DEFAULT_GRID_SIZE,
    quantile: float = DEFAULT_QUANTILE,
) -> np.ndarray:
    """Minimise an objective over :func:`angle_grid` for each pair; ties go to the angle nearest 0."""
    grid = angle_grid(grid_size)
    scores = objective_scores(candidates, grid, objective, quantile)  # (G, K)
    best = scores.min(axis=0, keepdims=True)
    tol = 1e-12 * np.maximum(np.abs(best), np.finfo(np.float64).tiny)
    near = scores <= best + tol
    penalty = np.where(near, np.abs(grid)[:, None], np.inf)
    return grid[np.argmin(penalty, axis=0)]


def resolve_inv_freq(inv_freq: Any, head_dim: int | None = None) -> tuple[np.ndarray, str]:
    """Frequencies and their source: a model of a registered family (its layers' shared ``inv_freq``, from
    :mod:`rope_quant.model.arch`), another torch module (searched with :func:`rope.find_inv_freq`) or an array.
    """
    if arch.is_registered(inv_freq):
        values, name = arch.shared_inv_freq(inv_freq, head_dim=head_dim)
        return check_frequencies(values), f"live buffer {name}"
    if hasattr(inv_freq, "named_buffers"):
        values, name = find_inv_freq(inv_freq, head_dim=head_dim)
        return check_frequencies(values), f"live buffer {name}"
    return check_frequencies(inv_freq), "given array"


def resolve_layer_inv_freq(inv_freq: Any, n_layers: int, head_dim: int | None = None
                           ) -> tuple[np.ndarray, tuple[str, ...]]:
    """Per-layer frequencies (n_layers, K) and each layer's source.

    A model of a registered family gives each layer the buffer that layer applies
    (:func:`rope_quant.model.arch.inv_freq_by_layer`: Gemma 3's sliding and full layers differ); a 1-D
    array or another module is shared by every layer; a 2-D array is taken as (n_layers, K).
    """
    if arch.is_registered(inv_freq):
        values, names = arch.inv_freq_by_layer(inv_freq, head_dim=head_dim)
        if values.shape[0] != n_layers:
            raise AngleEstimationError(f"the model has {values.shape[0]} layers, the statistics {n_layers}")
        return np.stack([check_frequencies(v) for v in values]), tuple(f"live buffer {n}" for n in names)
    arr = None if hasattr(inv_freq, "named_buffers") else np.asarray(inv_freq, dtype=np.float64)
    if arr is not None and arr.ndim == 2:
        if arr.shape[0] != n_layers:
            raise AngleEstimationError(f"inv_freq has {arr.shape[0]} rows for {n_layers} layers")
        return np.stack([check_frequencies(v) for v in arr]), ("given array",) * n_layers
    values, source = resolve_inv_freq(inv_freq, head_dim=head_dim)
    return np.broadcast_to(values, (n_layers, values.size)).copy(), (source,) * n_layers


def _per_layer_variance_angles(cov: Any, freqs: np.ndarray, average_length: int | None,
                               branch_matched: bool) -> np.ndarray:
    """:func:`variance_angles` with layer l's frequencies ``freqs[l]`` (one call when all layers agree)."""
    if (freqs == freqs[0]).all():
        return variance_angles(cov, freqs[0], average_length, branch_matched)
    cov = as_pair_cov(cov)
    return np.stack([variance_angles(PairCov(*(np.asarray(v)[layer] for v in cov)), freqs[layer],
                                     average_length, branch_matched) for layer in range(freqs.shape[0])])


def variance_angles(
    cov: PairCov, inv_freq: Any = None, average_length: int | None = None, branch_matched: bool = False
) -> np.ndarray:
    """φ̂, φ* or wrap(φ̂) for pooled covariances (see the module docstring)."""
    if (inv_freq is None) != (average_length is None):
        raise AngleEstimationError("φ* needs both inv_freq and average_length (or neither, for φ̂)")
    cov = PairCov(*(np.asarray(v, dtype=np.float64) for v in as_pair_cov(cov)))
    if branch_matched:
        if inv_freq is not None:
            check_frequencies(inv_freq)
        phi = np.asarray(wrap_angle(jacobi_angle(*cov)), dtype=np.float64)
    elif inv_freq is None:
        phi = np.asarray(jacobi_angle(*cov), dtype=np.float64)
    else:
        freqs = check_frequencies(inv_freq)
        if freqs.size != cov.s11.shape[-1]:
            raise AngleEstimationError(
                f"inv_freq has {freqs.size} frequencies but the covariances have {cov.s11.shape[-1]} pairs"
            )
        C, S = phase_averages(freqs, average_length)
        phi = np.asarray(equalising_angle(cov, C, S), dtype=np.float64)
    return np.where(cov.s11 + cov.s22 == 0, 0.0, phi)


def estimate_angles(
    stats: CalibrationStats,
    estimator: str = "rows",
    objective: str = "variance",
    inv_freq: Any = None,
    average_length: int | None = None,
    branch_matched: bool = False,
    grid_size: int = DEFAULT_GRID_SIZE,
    quantile: float = DEFAULT_QUANTILE,
    then_hadamard: bool = False,
) -> np.ndarray:
    """Per-pair R3 angles, shape (n_layers, K), or (n_layers, n_kv_heads, K) for ``per_head``.

    ``estimator`` is the pooling rule of :meth:`CalibrationStats.pooled`; ``inv_freq`` may be an
    array or a torch module holding the live RoPE buffer (e.g. the model). ``then_hadamard`` (range
    objective only) scores the keys after the Hadamard of ``pairwise_plus_hadamard``. A grid objective
    takes only an ``estimator`` in :func:`grid_estimators` (else :class:`GridEstimatorError`).
    """
    if objective not in OBJECTIVES:
        raise UnknownObjectiveError(f"unknown objective {objective!r}; expected one of {OBJECTIVES}")
    if inv_freq is not None:  # per layer: Gemma 3's sliding and full-attention layers use different bases
        inv_freq, _ = resolve_layer_inv_freq(inv_freq, stats.n_layers, head_dim=stats.head_dim)
        if inv_freq.shape[-1] != stats.n_pairs:
            raise AngleEstimationError(
                f"inv_freq has {inv_freq.shape[-1]} frequencies, "
                f"head_dim {stats.head_dim} has {stats.n_pairs} pairs"
            )
    if objective == "range":
        if inv_freq is None:
            raise AngleEstimationError("objective 'range' needs the live inv_freq (the RoPE phase of each row)")
        if average_length is not None or branch_matched:
            raise AngleEstimationError("average_length/branch_matched apply to objective='variance' only")
        fits = fit_range_angles_layers([stats.k_sample(layer) for layer in range(stats.n_layers)], inv_freq,
                                       per_head=estimator == "per_head", then_hadamard=then_hadamard,
                                       layout=stats.layout)
        return np.stack([fit.angles for fit in fits])
    if then_hadamard:
        raise AngleEstimationError("then_hadamard applies to objective='range' only")
    cov = stats.pooled(estimator)
    if objective == "variance":
        if inv_freq is None:
            return variance_angles(cov, None, average_length, branch_matched)
        return _per_layer_variance_angles(cov, inv_freq, average_length, branch_matched)
    _check_grid_estimator(stats, estimator, objective)
    if inv_freq is not None or average_length is not None or branch_matched:
        raise AngleEstimationError(
            f"objective {objective!r} is a grid search on raw rows; inv_freq/average_length/"
            "branch_matched apply to objective='variance' only"
        )
    if not stats.topk:
        raise CalibrationError("grid objectives need candidate sets: build CalibrationStats with topk > 0")
    out = np.zeros((stats.n_layers, stats.n_pairs))
    for layer in range(stats.n_layers):
        cand = stats.candidates(layer)
        if cand.shape[0] == 0:
            raise AngleEstimationError(f"layer {layer}: no candidate rows (stream(s) {stats.topk_streams})")
        out[layer] = grid_search(cand, objective, grid_size, quantile)
    return np.where(cov.s11 + cov.s22 == 0, 0.0, out)


# ----------------------------------------------------------------------------- range objective


@dataclass
class RangeFit:
    """Result of :func:`fit_range_angles` for one layer: angles (K,) or (H_kv, K) in (-π, π], and the
    objective (mean group range over tokens and heads) at the start and after every sweep."""

    angles: np.ndarray
    trace: list[float] = field(default_factory=list)


def group_range(y: torch.Tensor) -> torch.Tensor:
    """max(max_c y_c, 0) − min(min_c y_c, 0) over the last axis: the asymmetric quantiser's range."""
    lo, hi = torch.aminmax(y, dim=-1)
    return hi.clamp(min=0.0) - lo.clamp(max=0.0)


def mean_group_range(rows: Any, positions: Any, inv_freq: Any, angles: Any, then_hadamard: bool = False,
                     layout: str = "rotate_half") -> float:
    """The range objective of dense matrices, for checks: mean over (token, head) of the group range of
    M·R_m·k with M from the R3 registry (``pairwise_only`` or ``pairwise_plus_hadamard``)."""
    from rope_quant.core import transforms
    from rope_quant.core.rope import rope_matrix

    x = np.asarray(rows, dtype=np.float64)
    freqs = check_frequencies(inv_freq)
    name = "pairwise_plus_hadamard" if then_hadamard else "pairwise_only"
    tr = transforms.build(name, x.shape[-1], angles=angles, layout=layout)
    total = 0.0
    for n, m in enumerate(np.asarray(positions)):
        rm = rope_matrix(freqs, int(m), layout=layout)
        for h in range(x.shape[1]):
            y = tr.matrix(h, x.shape[1]) @ rm @ x[n, h]
            total += max(y.max(), 0.0) - min(y.min(), 0.0)
    return total / (x.shape[0] * x.shape[1])


def fit_range_angles(
    rows: Any, positions: Any, inv_freq: Any, *, per_head: bool = False, then_hadamard: bool = False,
    layout: str = "rotate_half", grid_size: int = RANGE_GRID_SIZE, refine: int = RANGE_REFINE,
    sweeps: int = RANGE_SWEEPS, init: Any = None, exact: bool = False,
) -> RangeFit:
    """Coordinate descent on the range objective (module docstring) for one layer.

    ``rows``: pre-RoPE keys (N, H_kv, d); ``positions``: (N,) RoPE positions. Each pair step scores the
    current angle first, so the objective never increases (ties keep the current angle).

    Every candidate angle is scored in float64 when ``exact``; by default (same choices, much faster,
    :mod:`rope_quant.calib.range_fast`) the candidates are first scored in float32 on the (token, head)
    entries whose range can depend on the pair (an entry whose rest-of-class extremes dominate the pair's
    norm contributes a constant), and only the candidates within a margin of the best (1e-5 of the movable
    entries' sum, ~80× their float32 error bound, plus 1e-12 of the score) are re-scored in float64 exactly
    as with ``exact``. The choice can differ only if the float32 error exceeds that margin;
    tests/numerics/test_range_fast.py checks the angles against ``exact=True`` to 1e-6 rad and
    tests/numerics/test_range_fastpath.py against the previous implementation.
    """
    return fit_range_angles_layers([(rows, positions)], np.asarray(inv_freq, dtype=np.float64)[None],
                                   per_head=per_head, then_hadamard=then_hadamard, layout=layout,
                                   grid_size=grid_size, refine=refine, sweeps=sweeps,
                                   init=None if init is None else [init], exact=exact)[0]


def fit_range_angles_layers(
    samples: Any, inv_freq: Any, *, per_head: bool = False, then_hadamard: bool = False,
    layout: str = "rotate_half", grid_size: int = RANGE_GRID_SIZE, refine: int = RANGE_REFINE,
    sweeps: int = RANGE_SWEEPS, init: Any = None, exact: bool = False,
) -> list[RangeFit]:
    """:func:`fit_range_angles` of several layers: ``samples`` [(rows, positions)] per layer, ``inv_freq``
    (n_layers, K), ``init`` None or one start per layer. The layers are independent; the fast descent runs
    the layers with the same sample shape as one batch (the same angles as one layer at a time)."""
    samples = list(samples)
    freqs_all = np.asarray(inv_freq, dtype=np.float64)
    if freqs_all.ndim != 2 or freqs_all.shape[0] != len(samples):
        raise AngleEstimationError(f"inv_freq must be (n_layers={len(samples)}, K), got {freqs_all.shape}")
    if int(grid_size) != grid_size or grid_size < 4 or refine < 0 or sweeps < 1:
        raise AngleEstimationError("range objective needs grid_size >= 4, refine >= 0, sweeps >= 1")
    inits = [None] * len(samples) if init is None else list(init)
    prepared = [_prepare_range_layer(r, p, f, per_head, layout, i)
                for (r, p), f, i in zip(samples, freqs_all, inits, strict=True)]
    step = 2 * math.pi / grid_size
    grid = torch.arange(grid_size, dtype=torch.float64) * step - math.pi + step
    fine = torch.linspace(-step, step, refine + 2, dtype=torch.float64)[1:-1] if refine else None

    def score(y: torch.Tensor) -> float:
        return float(group_range(y).mean())

    groups: dict[tuple, list[int]] = {}
    for i, (x, _, _, _, _) in enumerate(prepared):
        groups.setdefault(tuple(x.shape) if not exact else (i,), []).append(i)
    batches = [members[j:j + RANGE_BATCH_LAYERS] for members in groups.values()
               for j in range(0, len(members), RANGE_BATCH_LAYERS)]
    fits: list[RangeFit | None] = [None] * len(samples)
    for members in batches:
        x = torch.stack([prepared[i][0] for i in members])
        psi = torch.stack([prepared[i][1] for i in members])
        phi = torch.stack([prepared[i][2] for i in members])
        ia, ib = prepared[members[0]][3], prepared[members[0]][4]
        d = x.shape[-1]
        mix = None  # what follows the pair rotations: the identity, or the Hadamard
        if then_hadamard:
            from rope_quant.core import hadamard as _hd

            mix = _hd.hadamard_matrix(d).to(torch.float64) / math.sqrt(d)
        if exact:
            traces = [_exact_descend(x[0], psi[0], phi[0], ia, ib, mix, grid, fine, int(sweeps), per_head, score)]
        else:
            traces = range_fast.descend(x, psi, phi, ia, ib, mix, grid, fine, int(sweeps), per_head, score)
        out = range_fast.wrap(phi).numpy()
        for j, i in enumerate(members):
            fits[i] = RangeFit(out[j] if per_head else out[j, 0], traces[j])
    return fits


def _prepare_range_layer(rows: Any, positions: Any, inv_freq: Any, per_head: bool, layout: str, init: Any
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]:
    """Checked inputs of one layer: keys x (N, H, d), phases ψ (N, K), start angles (rows, K), pair indices."""
    x = torch.as_tensor(np.asarray(rows, dtype=np.float64))
    if x.ndim != 3 or x.shape[0] == 0:
        raise AngleEstimationError(f"range objective: rows must be (N > 0, H_kv, head_dim), got {tuple(x.shape)}")
    n_tok, n_heads, d = x.shape
    freqs = check_frequencies(inv_freq)
    ia, ib = pair_indices(d, layout)
    if freqs.size != ia.size:
        raise AngleEstimationError(f"inv_freq has {freqs.size} frequencies, head_dim {d} has {ia.size} pairs")
    pos = torch.as_tensor(np.asarray(positions, dtype=np.float64))
    if pos.shape != (n_tok,):
        raise AngleEstimationError(f"positions must have shape ({n_tok},), got {tuple(pos.shape)}")
    n_pairs = ia.size
    rows_ = n_heads if per_head else 1
    phi = torch.zeros(rows_, n_pairs, dtype=torch.float64)
    if init is not None:
        start = np.asarray(init, dtype=np.float64)
        if start.shape not in ((n_pairs,), (rows_, n_pairs)) or not np.all(np.isfinite(start)):
            raise AngleEstimationError(f"init must be finite with shape ({n_pairs},) or ({rows_}, {n_pairs}), "
                                       f"got {start.shape}")
        phi += torch.as_tensor(start)
    psi = pos[:, None] * torch.as_tensor(freqs)[None, :]  # (N, K) RoPE phases m·θ_k
    return x, psi, phi, ia, ib


def _exact_descend(x: torch.Tensor, psi: torch.Tensor, phi: torch.Tensor, ia: np.ndarray, ib: np.ndarray,
                   mix: torch.Tensor | None, grid: torch.Tensor, fine: torch.Tensor | None, sweeps: int,
                   per_head: bool, score: Any) -> list[float]:
    """:func:`range_fast.descend` scoring every candidate in float64 on every entry (``exact=True``)."""
    d = x.shape[-1]
    rows_ = phi.shape[0]
    a, b = x[..., ia], x[..., ib]  # (N, H, K)
    mix = torch.eye(d, dtype=torch.float64) if mix is None else mix

    def pair_out(p: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Both outputs of pair k for angles p (C, rows_) -> (C, N, H)."""
        ang = p[:, None, :] + psi[None, :, k, None]  # (C, N, rows_)
        c, s = torch.cos(ang), torch.sin(ang)
        return c * a[None, :, :, k] - s * b[None, :, :, k], s * a[None, :, :, k] + c * b[None, :, :, k]

    def full(p: torch.Tensor) -> torch.Tensor:
        """y = M R_m k for all tokens (N, H, d) at angles p (rows_, K)."""
        ang = p[None, :, :] + psi[:, None, :]  # (N, rows_, K)
        c, s = torch.cos(ang), torch.sin(ang)
        y = torch.empty_like(x)
        y[..., ia], y[..., ib] = c * a - s * b, s * a + c * b
        return y @ mix.T

    y = full(phi)  # the quantised keys M·R_m·k (after the Hadamard when then_hadamard)
    trace = [score(y)]
    for _ in range(int(sweeps)):
        for k in range(ia.size):
            # y = y_rest + u1·mix[:, a_k] + u2·mix[:, b_k]; channels sharing a coefficient pair form a class
            cols = mix[:, [ia[k], ib[k]]]  # (d, 2)
            old1, old2 = pair_out(phi[None, :, k], k)
            y_rest = y - old1[0, ..., None] * cols[:, 0] - old2[0, ..., None] * cols[:, 1]
            coef, which = torch.unique(cols, dim=0, return_inverse=True)
            classes = [(coef[j], y_rest[..., which == j].amax(-1), y_rest[..., which == j].amin(-1))
                       for j in range(coef.shape[0])]
            current = phi[:, k]
            cands = torch.cat([current[None, :], grid[:, None].expand(-1, rows_)])
            best = _best_candidate(cands, *pair_out(cands, k), classes, per_head)
            if fine is not None:
                cands = torch.cat([best[None, :], best[None, :] + fine[:, None]])
                best = _best_candidate(cands, *pair_out(cands, k), classes, per_head)
            phi[:, k] = best
            u1, u2 = pair_out(best[None, :], k)
            y = y_rest + u1[0, ..., None] * cols[:, 0] + u2[0, ..., None] * cols[:, 1]
        y = full(phi)
        trace.append(score(y))
    return trace


_best_candidate = range_fast.best_candidate

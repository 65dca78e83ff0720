"""Per-pair R3 angle estimation from calibration statistics (paper §3, App. A.2).

``objective="variance"`` (closed forms from :mod:`rope_quant.angles`):

- no frequencies: the Jacobi angle φ̂ = ½·atan2(s11 - s22, 2 s12), i.e. (C, S) = (1, 0), unwrapped;
- ``inv_freq`` and ``average_length`` L: the position-averaged φ* (Theorem (ii)), the Jacobi angle of
  the surrogate Σ̃ = mean_{m<L} R_m Σ R_mᵀ, wrapped to [-π/4, π/4);
- ``branch_matched=True``: the φ̂ control with φ*'s wrap, wrap(φ̂).

``objective`` in ``linf``/``l2max``/``quantile``: a 200-point grid over (-π/4, π/4], scored on the
per-(layer, pair) top-k candidate rows kept by :class:`~rope_quant.calibration.CalibrationStats`
(y = G(φ)[a; b]):

- ``linf``: max |y| over both outputs and all candidates;
- ``l2max``: the larger of the two outputs' mean y² over the candidates;
- ``quantile``: the ``quantile`` (default 0.99) of |y| over both outputs and all candidates.

Ties go to the grid angle nearest 0. A zero-variance band (s11 + s22 = 0) always gets the identity
angle 0. All objectives are π/2-periodic, so the grid covers every distinct rotation.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from rope_quant.angles import PairCov, equalising_angle, jacobi_angle, wrap_angle
from rope_quant.calibration import CalibrationError, CalibrationStats
from rope_quant.rope import check_frequencies, find_inv_freq, phase_averages

OBJECTIVES = ("variance", "linf", "l2max", "quantile")
GRID_OBJECTIVES = ("linf", "l2max", "quantile")
DEFAULT_GRID_SIZE = 200
DEFAULT_QUANTILE = 0.99


class AngleEstimationError(ValueError):
    """Bad arguments to the angle estimators."""


class UnknownObjectiveError(AngleEstimationError):
    """An objective outside :data:`OBJECTIVES` was named."""


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
    """Frequencies and their source: a torch module (searched with :func:`rope.find_inv_freq`) or an array."""
    if hasattr(inv_freq, "named_buffers"):
        values, name = find_inv_freq(inv_freq, head_dim=head_dim)
        return check_frequencies(values), f"live buffer {name}"
    return check_frequencies(inv_freq), "given array"


def variance_angles(
    cov: PairCov, inv_freq: Any = None, average_length: int | None = None, branch_matched: bool = False
) -> np.ndarray:
    """φ̂, φ* or wrap(φ̂) for pooled covariances (see the module docstring)."""
    if (inv_freq is None) != (average_length is None):
        raise AngleEstimationError("φ* needs both inv_freq and average_length (or neither, for φ̂)")
    cov = PairCov(*(np.asarray(v, dtype=np.float64) for v in cov))
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
) -> np.ndarray:
    """Per-pair R3 angles, shape (n_layers, K), or (n_layers, n_kv_heads, K) for ``per_head``.

    ``estimator`` is the pooling rule of :meth:`CalibrationStats.pooled`; ``inv_freq`` may be an
    array or a torch module holding the live RoPE buffer (e.g. the model).
    """
    if objective not in OBJECTIVES:
        raise UnknownObjectiveError(f"unknown objective {objective!r}; expected one of {OBJECTIVES}")
    if inv_freq is not None:
        inv_freq, _ = resolve_inv_freq(inv_freq, head_dim=stats.head_dim)
        if inv_freq.size != stats.n_pairs:
            raise AngleEstimationError(
                f"inv_freq has {inv_freq.size} frequencies, "
                f"head_dim {stats.head_dim} has {stats.n_pairs} pairs"
            )
    cov = stats.pooled(estimator)
    if objective == "variance":
        return variance_angles(cov, inv_freq, average_length, branch_matched)
    if estimator == "per_head":
        raise AngleEstimationError(
            "grid objectives use the per-(layer, pair) candidate set and give no per-head angles; "
            "use estimator 'rows', 'k_only' or 'balanced'"
        )
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

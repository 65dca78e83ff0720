"""Paired statistics for seed-paired comparisons (paired t interval, TOST equivalence, Holm).

All functions take the per-seed results of a treatment and a control measured on the same seeds;
the unit of analysis is the difference ``treatment - control``. Sample sd uses ``n - 1``.
t quantiles come from :mod:`scipy.stats`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats as _st


class StatsError(ValueError):
    """Base class for bad inputs to the paired statistics."""


class TooFewPairsError(StatsError):
    """Fewer than two pairs: no sample sd, no t interval."""


class LengthMismatchError(StatsError):
    """Treatment and control have different lengths, so they cannot be paired."""


class NonFiniteValueError(StatsError):
    """A NaN or infinite value among the inputs (never silently dropped)."""


@dataclass(frozen=True)
class PairedCI:
    """Paired t interval of ``treatment - control``."""

    n: int
    mean: float
    sd: float
    low: float
    high: float
    level: float


def _vector(values: Sequence[float] | np.ndarray, what: str) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim != 1:
        raise StatsError(f"{what} must be 1-D, got shape {arr.shape}")
    bad = np.flatnonzero(~np.isfinite(arr))
    if bad.size:
        raise NonFiniteValueError(f"{what} has non-finite value {arr[bad[0]]!r} at index {int(bad[0])}")
    return arr


def paired_differences(treatment: Sequence[float], control: Sequence[float]) -> np.ndarray:
    """``treatment - control`` after checking lengths (>= 2 pairs) and finiteness."""
    t = _vector(treatment, "treatment")
    c = _vector(control, "control")
    if t.shape != c.shape:
        raise LengthMismatchError(f"treatment has {t.size} values but control has {c.size}")
    if t.size < 2:
        raise TooFewPairsError(f"need at least 2 pairs for a paired t statistic, got {t.size}")
    return t - c


def sample_sd(values: Sequence[float]) -> float:
    """Sample standard deviation with ``n - 1`` in the denominator."""
    arr = _vector(values, "values")
    if arr.size < 2:
        raise TooFewPairsError(f"sample sd needs at least 2 values, got {arr.size}")
    return float(np.std(arr, ddof=1))


def paired_ci(treatment: Sequence[float], control: Sequence[float], level: float = 0.90) -> PairedCI:
    """Two-sided paired t interval at ``level``: ``mean ± t_{(1+level)/2, n-1} · sd / sqrt(n)``."""
    if not (0.0 < level < 1.0):
        raise StatsError(f"confidence level must be in (0, 1), got {level!r}")
    d = paired_differences(treatment, control)
    n = int(d.size)
    mean = float(d.mean())
    sd = float(np.std(d, ddof=1))
    half = float(_st.t.ppf(0.5 + level / 2.0, n - 1)) * sd / math.sqrt(n)
    return PairedCI(n=n, mean=mean, sd=sd, low=mean - half, high=mean + half, level=level)


def equivalent(ci: PairedCI, margin: float) -> bool:
    """TOST in interval form: equivalent within ``±margin`` iff ``-margin < low`` and ``high < margin``.

    A 90% interval corresponds to two one-sided tests at alpha = 0.05.
    """
    if not (math.isfinite(margin) and margin > 0):
        raise StatsError(f"equivalence margin must be a positive finite number, got {margin!r}")
    return bool(-margin < ci.low and ci.high < margin)


def paired_t_pvalue(treatment: Sequence[float], control: Sequence[float]) -> float:
    """Two-sided p-value of the paired t test of mean difference 0.

    With zero spread the statistic is degenerate: p = 1 if every difference is 0, else p = 0.
    """
    d = paired_differences(treatment, control)
    n = d.size
    mean = float(d.mean())
    sd = float(np.std(d, ddof=1))
    if sd == 0.0:
        return 1.0 if mean == 0.0 else 0.0
    tstat = mean / (sd / math.sqrt(n))
    return float(min(1.0, 2.0 * _st.t.sf(abs(tstat), n - 1)))


def holm(pvalues: Sequence[float], alpha: float = 0.05) -> tuple[list[bool], list[float]]:
    """Holm's step-down procedure: (reject flags, adjusted p-values), in the input order.

    Adjusted ``p_(i) = max_{j<=i} min(1, (m - j + 1) p_(j))`` over the ascending order, which is
    monotone; a hypothesis is rejected iff its adjusted p-value is ``<= alpha``.
    """
    if not (0.0 < alpha < 1.0):
        raise StatsError(f"alpha must be in (0, 1), got {alpha!r}")
    p = _vector(pvalues, "pvalues")
    if np.any((p < 0) | (p > 1)):
        raise StatsError("p-values must lie in [0, 1]")
    m = p.size
    if m == 0:
        return [], []
    order = np.argsort(p, kind="stable")
    scaled = np.minimum(1.0, (m - np.arange(m)) * p[order])
    adjusted_sorted = np.maximum.accumulate(scaled)
    adjusted = np.empty(m)
    adjusted[order] = adjusted_sorted
    return [bool(a <= alpha) for a in adjusted], [float(a) for a in adjusted]

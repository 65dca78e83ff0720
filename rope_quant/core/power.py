"""Power of the paired tests behind the verdicts, and the budget that reaches a target power.

The tests are those of :mod:`rope_quant.core.verdict`: a one-sided paired t test at level ``alpha`` (the
end of the two-sided ``1 - 2 alpha`` interval clears a threshold) and TOST (both ends inside ``±margin``).
Power is computed at the plug-in values: the measured mean and sd of the paired differences are taken as the
truth. One-sided power is exact (noncentral t). TOST power is exact too, by quadrature over the sample sd:
given ``S``, the test passes iff ``-m + t·S/√n < D̄ < m - t·S/√n`` with ``D̄ ~ N(μ, σ²/n)``, and
``(n - 1) S² / σ² ~ χ²(n - 1)``.

Budgets: seeds at today's tokens per cell, and tokens per cell at today's seeds under the assumption that the
paired variance scales as ``1 / tokens`` (the per-seed perplexity is a mean over scored tokens) while the
effect does not.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from scipy import stats as _st
from scipy.stats import norm as _normal  # the standard normal (not a model's norm)

TARGET_POWER = 0.80
ALPHA = 0.05
MAX_SEEDS = 1_000_000
_QUAD_POINTS = 4000


def one_sided_power(excess: float, sd: float, n: int | np.ndarray, alpha: float = ALPHA) -> float | np.ndarray:
    """P(the one-sided paired t test at ``alpha`` decides) when the true mean lies ``excess`` beyond its
    threshold, the paired sd is ``sd`` and there are ``n`` pairs: ``P(T'(n-1, excess·√n/sd) > t_{1-alpha})``."""
    n_arr = np.asarray(n, dtype=np.float64)
    df = n_arr - 1.0
    crit = _st.t.ppf(1.0 - alpha, df)
    out = _st.nct.sf(crit, df, excess * np.sqrt(n_arr) / sd)
    return float(out) if np.ndim(out) == 0 else out


def tost_power(mean: float, sd: float, n: int, margin: float, alpha: float = ALPHA) -> float:
    """P(TOST at ``alpha`` shows ``|mean| < margin``) for ``n`` pairs with true mean ``mean`` and sd ``sd``."""
    if margin <= 0:
        return 0.0
    df = n - 1
    crit = float(_st.t.ppf(1.0 - alpha, df))
    probs = (np.arange(_QUAD_POINTS) + 0.5) / _QUAD_POINTS
    s = sd * np.sqrt(_st.chi2.ppf(probs, df) / df)
    se = sd / math.sqrt(n)
    upper = (margin - crit * s / math.sqrt(n) - mean) / se
    lower = (-margin + crit * s / math.sqrt(n) - mean) / se
    inside = np.clip(_normal.cdf(upper) - _normal.cdf(lower), 0.0, 1.0)
    return float(inside.mean())


def smallest_n(power_at: Callable[[int], float], target: float = TARGET_POWER, n_min: int = 2,
               n_max: int = MAX_SEEDS) -> int | None:
    """The smallest ``n >= n_min`` with ``power_at(n) >= target`` (power non-decreasing in n), else None."""
    if power_at(n_min) >= target:
        return n_min
    lo, hi = n_min, n_min
    while power_at(hi) < target:
        lo, hi = hi, hi * 2
        if hi > n_max:
            return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if power_at(mid) < target else (lo, mid)
    return hi


def smallest_token_factor(power_at_sd: Callable[[float], float], sd: float, target: float = TARGET_POWER,
                          max_factor: float = 1e6) -> float | None:
    """The smallest factor ``f`` on tokens per cell (paired sd ``sd/√f``) that reaches ``target``, else None."""
    def power(f: float) -> float:
        return power_at_sd(sd / math.sqrt(f))

    if power(max_factor) < target:
        return None
    lo, hi = 1e-6, max_factor
    if power(lo) >= target:
        return lo
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if power(mid) < target else (lo, mid)
        if hi / lo < 1.0 + 1e-6:
            break
    return hi


def one_sided_budget(excess: float, sd: float, n_now: int, tokens_now: int | None,
                     alpha: float = ALPHA) -> tuple[int | None, int | None]:
    """(seeds at today's tokens, tokens per cell at today's seeds) for the one-sided test to reach 80%."""
    if not excess > 0:
        return None, None
    if sd == 0:
        return 2, tokens_now
    seeds = smallest_n(lambda n: float(one_sided_power(excess, sd, n, alpha)))
    tokens = None
    if tokens_now and n_now >= 2:
        f = smallest_token_factor(lambda s: float(one_sided_power(excess, s, n_now, alpha)), sd)
        tokens = None if f is None else math.ceil(tokens_now * f)
    return seeds, tokens


def tost_budget(mean: float, sd: float, margin: float, n_now: int, tokens_now: int | None,
                alpha: float = ALPHA) -> tuple[int | None, int | None]:
    """(seeds at today's tokens, tokens per cell at today's seeds) for TOST to reach 80%."""
    if not abs(mean) < margin:
        return None, None
    if sd == 0:
        return 2, tokens_now
    seeds = smallest_n(lambda n: tost_power(mean, sd, n, margin, alpha))
    tokens = None
    if tokens_now and n_now >= 2:
        f = smallest_token_factor(lambda s: tost_power(mean, s, n_now, margin, alpha), sd)
        tokens = None if f is None else math.ceil(tokens_now * f)
    return seeds, tokens

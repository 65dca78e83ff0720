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

import functools
import math
from collections.abc import Callable
from typing import Any

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


# ----------------------------------------------------------------------------- the replicated rule


def masks(side: str, b: float, low: Any, high: Any, noise: Any = 0.0) -> tuple[Any, Any]:
    """(holds, refuted) of the interval ``[low, high]`` against the bound ``b`` of ``side`` ("lower", "upper" or
    "equivalent": ``rope_quant.core.verdict._bounds``), every threshold moved by ``noise``. Plain comparisons:
    floats give bools and numpy arrays give masks (the rule in rope_quant.core.verdict, the power below and the
    simulation in tests/theory use this one arithmetic)."""
    if side == "lower":
        return low > b + noise, high < b - noise
    if side == "upper":
        return high < b - noise, low > b + noise
    return (low > -b + noise) & (high < b - noise), (low > b + noise) | (high < -b - noise)


MC_DRAWS = 8000
"""Monte Carlo draws behind :func:`replicated_power` (binomial sd ≤ 0.0056 at power 0.8)."""
_MC_SEED = 20261127


def t_quantile(df: float | np.ndarray, level: float = 1.0 - ALPHA) -> float | np.ndarray:
    """``t_{level, df}``; 0 where ``df`` is infinite (a variance known exactly)."""
    out = _st.t.ppf(level, df)
    return float(out) if np.ndim(out) == 0 else out


def union_bounds(mean, sd, n, bias, sd_d, k, alpha: float = ALPHA, sd_rep=None):
    """(low_A, high_A, low_B, high_B): the primary paired t interval of θ over ``n`` seeds and the replicate
    interval of θ + β (rope_quant.core.verdict's rule). With every seed replicated (``k == n`` and ``sd_rep``,
    the sd of the replicate order's own differences ``θ_i + d_i``) B is that order's paired t interval,
    ``mean + bias ± t_{n-1} · sd_rep/√n`` (exact); otherwise ``mean + bias ± t_ν · sqrt(sd²/n + sd_d²/k)`` with
    Welch–Satterthwaite ``ν``. Elementwise: scalars or numpy arrays."""
    mean, sd, bias, sd_d = (np.asarray(x, dtype=np.float64) for x in (mean, sd, bias, sd_d))
    t_n = _st.t.ppf(1.0 - alpha, n - 1)
    half_a = t_n * sd / math.sqrt(n)
    if sd_rep is not None:
        if k != n:
            raise ValueError(f"the replicate order's own interval needs every seed replicated, got k={k}, n={n}")
        half_b = t_n * np.asarray(sd_rep, dtype=np.float64) / math.sqrt(n)
        return mean - half_a, mean + half_a, mean + bias - half_b, mean + bias + half_b
    va, vd = sd**2 / n, sd_d**2 / k
    v = va + vd
    with np.errstate(divide="ignore", invalid="ignore"):
        nu = np.where(v > 0, v**2 / (va**2 / (n - 1) + vd**2 / (k - 1)), np.inf)
    nu = np.where(np.isfinite(nu), nu, 1e12)
    half_b = _st.t.ppf(1.0 - alpha, nu) * np.sqrt(v)
    return mean - half_a, mean + half_a, mean + bias - half_b, mean + bias + half_b


@functools.lru_cache(maxsize=64)
def _quantiles(draws: int, n: int, k: int) -> tuple[np.ndarray, ...]:
    """The fixed uniforms through their inverse CDFs at (n, k): z1, z2, zw, c1, c2, z3, c3 (cached: the
    token search reuses them at every sd)."""
    u = np.random.default_rng(_MC_SEED).random((draws, 7))
    r = n - k
    zeros = np.zeros(draws)
    out = (_normal.ppf(u[:, 0]), _normal.ppf(u[:, 1]), _normal.ppf(u[:, 4]), _st.chi2.ppf(u[:, 2], k - 1),
           _st.chi2.ppf(u[:, 3], k - 2) if k > 2 else zeros, _normal.ppf(u[:, 5]) if r else zeros,
           _st.chi2.ppf(u[:, 6], r - 1) if r > 1 else zeros)
    for a in out:
        a.setflags(write=False)
    return out


def replicated_power(side: str, b: float, towards: str, mean: float, sd: float, bias: float, sd_d: float, n: int,
                     k: int, draws: int = MC_DRAWS) -> float:
    """P(the replicated rule decides ``towards`` "holds" / "refuted") with ``n`` seeds, ``k`` of them
    replicated, when the truth is the plug-in: per seed (θ_i, d_i) normal with means (mean, bias), sds
    (sd, sd_d) and, on a replicated seed, covariance −σ_e² with σ_e² = min(sd_d²/2, sd²) (the two float
    orders equally noisy: d_i = e'_i − e_i + β). Monte Carlo on the exact sufficient statistics (Bartlett's
    Wishart for the replicated seeds, χ² for the rest) from fixed uniforms through inverse CDFs, so the
    power is a smooth function of n, k and the sds (common random numbers for the budget's search)."""
    if not (2 <= k <= n):
        raise ValueError(f"need 2 <= k <= n replicates, got k={k}, n={n}")
    z1, z2, zw, c1, c2, z3, c3 = _quantiles(draws, n, k)
    var_e = min(sd_d**2 / 2.0, sd**2)
    rho = max(-var_e / (sd * sd_d), -0.99) if sd > 0 and sd_d > 0 else 0.0
    l11, l21, l22 = sd, rho * sd_d, sd_d * math.sqrt(1.0 - rho**2)
    m1 = mean + l11 * z1 / math.sqrt(k)
    m2 = bias + (l21 * z1 + l22 * z2) / math.sqrt(k)
    # W = L A Aᵀ Lᵀ, A = [[√c1, 0], [zw, √c2]]: the replicated seeds' scatter of (θ, d)
    a11, a21, a22 = c1, np.sqrt(c1) * zw, zw**2 + c2
    w11 = l11**2 * a11
    w21 = l11 * (l21 * a11 + l22 * a21)
    w22 = l21**2 * a11 + 2 * l21 * l22 * a21 + l22**2 * a22
    r = n - k
    s_rep = None
    if r:
        m3 = mean + sd * z3 / math.sqrt(r)
        ss3 = sd**2 * c3
        theta = (k * m1 + r * m3) / n
        ss_a = w11 + ss3 + k * r / n * (m1 - m3) ** 2
    else:  # every seed replicated: the replicate order's own scatter, θ_i + d_i
        theta, ss_a = m1, w11
        s_rep = np.sqrt(np.maximum(w11 + 2 * w21 + w22, 0.0) / (n - 1))
    s_a, s_d = np.sqrt(ss_a / (n - 1)), np.sqrt(w22 / (k - 1))
    low_a, high_a, low_b, high_b = union_bounds(theta, s_a, n, m2, s_d, k, sd_rep=s_rep)
    holds, refuted = masks(side, b, np.minimum(low_a, low_b), np.maximum(high_a, high_b))
    return float(np.mean(holds if towards == "holds" else refuted))


def replicates_at(n: int, n_now: int, k_now: int) -> int:
    """Replicates at ``n`` seeds in today's proportion ``k_now / n_now``, at least today's ``k`` and 2."""
    return min(n, max(2, k_now, math.ceil(n * k_now / n_now)))


def replicated_budget(side: str, b: float, towards: str, mean: float, sd: float, bias: float, sd_d: float,
                      n_now: int, k_now: int, tokens_now: int | None) -> tuple[int | None, int | None]:
    """(seeds at today's tokens, replicates in today's proportion; tokens per cell at today's seeds and
    replicates, both variances ∝ 1/tokens) for the replicated rule to reach 80% power."""
    seeds = smallest_n(lambda n: replicated_power(side, b, towards, mean, sd, bias, sd_d, n,
                                                  replicates_at(n, n_now, k_now)))
    tokens = None
    if tokens_now and n_now >= 2 and k_now >= 2 and sd > 0:
        ratio = sd_d / sd
        f = smallest_token_factor(lambda s: replicated_power(side, b, towards, mean, s, bias, ratio * s, n_now,
                                                             k_now), sd)
        tokens = None if f is None else math.ceil(tokens_now * f)
    return seeds, tokens

"""The sequential rule's per-look boundary, and the confidence bounds it gives (docs/verdicts.md, "Skewed and
heavy-tailed seeds").

Three shapes of boundary, named by :class:`Shape`:

* ``normal``: the paired t statistic against one Pocock level α' per look, calibrated on standard normal paths
  (the t sequence is pivotal there). Valid when the per-seed effects are normal; under a skewed law (a bad
  seed now and then) the one-sided error over 38 looks reaches 7–22% at skewness 2;
* ``skew_robust`` (the default): Hall's (1992) monotone skewness-corrected t,
  ``h(T) = T + aT²/3 + a²T³/27 + a/6`` with ``a = γ̂/√n`` (``γ̂`` the sample skewness), against critical values
  ``c_n`` per look taken **least-favourably over a family of per-seed laws**: at each look the largest
  (1 − α″)-quantile of ``h`` over the family, with α″ the largest level at which every law of the family
  crosses some look with probability ≤ α. The family (:data:`FAMILY`): normal, Student t with 3 df, centred
  gamma at skewness 1 and 2, each in both tails. The rule is therefore valid for any law in the family, and —
  as the simulation in ``tests/theory/test_sequential_skew.py`` shows — with normal float-order noise added;
* ``contamination_robust`` (opt-in): the same statistic, least-favourable over the family plus the rare blow-up
  seed (:data:`BLOW_UP`: 5% of seeds 6 sd out), both tails. Valid there; on normal data it decides fast claims a
  seed sooner and slow ones up to 7 seeds later than the default (docs/verdicts.md, "A rare blow-up seed").

A seed outside the laws a shape is calibrated on is flagged in the verdict (:mod:`rope_quant.core.outlier`,
from the same calibration paths: :func:`calibration_paths`).

The boundary is computed once per ``(first, M, α)`` from fixed-seed paths (:func:`critical_values`) and cached.
The confidence bounds invert ``h`` (it is a bijection: ``h'(T) = (1 + aT/3)² ≥ 0``), so the rule reads an
interval ``[L, U]`` like the t rule does: ``L`` clears the "lower" boundary, ``U`` the "upper" one.
Standard library only at import time; numpy when a number is computed.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rope_quant.defaults import DEFAULT_SHAPE, Shape

__all__ = ["BLOW_UP", "DEFAULT_SHAPE", "FAMILIES", "FAMILY", "Boundary", "Shape", "bounds", "calibration_paths",
           "contaminated", "critical_values", "draw_contaminated", "draw_law", "hall", "hall_inverse",
           "per_look_alpha", "statistic"]


FAMILY = ("normal", "t3", "gamma_skew1", "gamma_skew2")
"""The per-seed laws the skew-robust boundary is calibrated on; each is used in both tails (x and −x)."""
BLOW_UP = "contaminated_5pct_6sd"
"""The rare blow-up seed (docs/verdicts.md, "A rare blow-up seed"): 95% N(0, 1) and 5% N(6, 1), standardised;
the law :data:`FAMILIES` adds for the ``contamination_robust`` shape."""
FAMILIES: dict[Shape, tuple[str, ...]] = {Shape.NORMAL: ("normal",), Shape.SKEW_ROBUST: FAMILY,
                                          Shape.CONTAMINATION_ROBUST: (*FAMILY, BLOW_UP)}
"""The laws each shape's boundary (and the outlier flag's threshold, :mod:`rope_quant.core.outlier`) is
calibrated on."""
CALIBRATION_PATHS = 50_000
"""Paths per law behind :func:`critical_values`, and the standard normal paths behind :func:`per_look_alpha`."""
_SEED = 20261128


@functools.lru_cache(maxsize=32)
def per_look_alpha(first: int, max_seeds: int, alpha: float = 0.05) -> float:
    """The Pocock per-look level α' of the one-sided paired t test for looks at ``first … max_seeds`` seeds (the
    ``normal`` boundary): the α-quantile of ``min_n p_n`` (``p_n`` the one-sided t p-value at ``n`` seeds) over
    standard normal paths (the t sequence is pivotal), at its 99% lower confidence bound (so the spent error
    exceeds α only with the calibration's 1% chance); never below the Bonferroni split ``α / L``."""
    import numpy as np
    from scipy import special

    if max_seeds == first:
        return alpha
    z = np.random.default_rng(_SEED).standard_normal((CALIBRATION_PATHS, max_seeds))
    ns = np.arange(first, max_seeds + 1)
    s1, s2 = np.cumsum(z, 1)[:, first - 1:], np.cumsum(z * z, 1)[:, first - 1:]
    mean = s1 / ns
    var = np.maximum(s2 - s1 * mean, 1e-300) / (ns - 1)
    smallest = special.stdtr(ns - 1, -mean / np.sqrt(var / ns)).min(1)
    r = CALIBRATION_PATHS
    k = max(0, int(math.floor(alpha * r - 2.326 * math.sqrt(r * alpha * (1 - alpha)))))
    return float(max(alpha / (max_seeds - first + 1), np.partition(smallest, k)[k]))


def contaminated(percent: int, sd: int) -> str:
    """The name of the contaminated normal law: ``percent``% of seeds from N(``sd``, 1), the rest from N(0, 1)."""
    return f"contaminated_{percent}pct_{sd}sd"


def draw_contaminated(percent: float, shift: float, rng: Any, shape: tuple[int, ...]) -> tuple[Any, Any]:
    """(draws, blown): the contaminated normal law standardised (mean 0, variance 1): each value from N(0, 1), or
    with probability ``percent``/100 from N(``shift``, 1) (``blown`` marks those), centred at the mixture's mean
    ``p·shift`` and scaled by its sd ``√(1 + p(1 − p)·shift²)``."""
    import numpy as np

    p = percent / 100.0
    blown = rng.random(shape) < p
    x = rng.standard_normal(shape) + np.where(blown, shift, 0.0)
    return (x - p * shift) / math.sqrt(1.0 + p * (1.0 - p) * shift * shift), blown


def draw_law(name: str, rng: Any, shape: tuple[int, ...]) -> Any:
    """Standardised draws (mean 0, variance 1 where it exists) of a law of :data:`FAMILY` or a contaminated normal
    law (:func:`contaminated`), or ``"-" + name`` for its mirror image (skewness of the other sign)."""
    import numpy as np

    sign = -1.0 if name.startswith("-") else 1.0
    base = name.lstrip("-")
    blown = re.fullmatch(r"contaminated_(\d+)pct_(\d+(?:\.\d+)?)sd", base)
    if blown:
        x, _ = draw_contaminated(float(blown[1]), float(blown[2]), rng, shape)
    elif base == "normal":
        x = rng.standard_normal(shape)
    elif base == "t3":
        x = rng.standard_t(3, shape) / math.sqrt(3.0)
    elif base.startswith("gamma_skew"):
        k = 4.0 / float(base.removeprefix("gamma_skew")) ** 2  # skewness of Gamma(k) is 2/√k
        x = (rng.gamma(k, 1.0, shape) - k) / math.sqrt(k)
    else:
        raise ValueError(f"unknown law {name!r}; known: {', '.join(FAMILY)}, {contaminated(5, 6)} (any percent and "
                         "sd; prefix '-' for the mirror image)")
    return sign * np.asarray(x, dtype=np.float64)


def running_moments(x: Any, first: int) -> tuple[Any, Any, Any, Any]:
    """(n, mean, sd (n − 1 divisor), sample skewness g1 = m3 / m2^1.5) of every prefix of the rows of ``x`` from
    ``first`` values on (columns: looks)."""
    import numpy as np

    x = np.asarray(x, dtype=np.float64)
    m = x.shape[-1]
    ns = np.arange(first, m + 1, dtype=np.float64)
    x2 = x * x
    s1, s2, s3 = (np.cumsum(v, -1)[..., first - 1:] for v in (x, x2, x2 * x))
    mean = s1 / ns
    m2 = np.maximum(s2 / ns - mean * mean, 0.0)
    m3 = s3 / ns - 3.0 * mean * s2 / ns + 2.0 * mean * mean * mean
    sd = np.sqrt(m2 * ns / (ns - 1))
    with np.errstate(divide="ignore", invalid="ignore"):
        g = np.where(m2 > 1e-300, m3 / np.maximum(m2, 1e-300) ** 1.5, 0.0)
    return ns, mean, sd, g


def hall(t: Any, a: Any) -> Any:
    """Hall's monotone transform of the studentised mean (Hall 1992, JRSS B 54): ``T + aT²/3 + a²T³/27 + a/6``."""
    at = a * t / 3.0  # h(T) = T (1 + aT/3 + (aT/3)²/3) + a/6, the same polynomial with no float power
    return t * (1.0 + at + at * at / 3.0) + a / 6.0


def hall_inverse(c: Any, a: Any) -> Any:
    """The ``T`` with ``hall(T, a) = c``: ``(3/a)((1 + a(c − a/6))^{1/3} − 1)``, and ``c`` where ``a = 0``."""
    import numpy as np

    a = np.asarray(a, dtype=np.float64)
    c = np.asarray(c, dtype=np.float64)
    small = np.abs(a) < 1e-9
    safe = np.where(small, 1.0, a)
    out = 3.0 / safe * (np.cbrt(1.0 + safe * (c - safe / 6.0)) - 1.0)
    return np.where(small, c - a / 6.0, out)


def statistic(x: Any, first: int, shape: Shape) -> tuple[Any, Any]:
    """(upper, lower) one-sided statistics for the mean 0 at every look: the t statistic and its negative
    (normal), or Hall's transform of each (skew-robust: the lower side sees the mirror image, ``a → −a``)."""
    ns, mean, sd, g = running_moments(x, first)
    import numpy as np

    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(sd > 0, mean / (sd / np.sqrt(ns)), np.sign(mean) * np.inf)
    if shape is Shape.NORMAL:
        return t, -t
    a = g / np.sqrt(ns)
    return hall(t, a), hall(-t, -a)


@dataclass(frozen=True)
class Boundary:
    """Critical values per look ``first, first + 1, …`` for the "holds" side and the "refuted" side of a claim
    (the refuted side of a claim of ``P`` parts is spent at α / P: :class:`rope_quant.core.sequential.Plan`);
    ``alpha_look``: the one-look level per side of the "holds" side."""

    first: int
    shape: Shape
    holds: tuple[float, ...]
    refuted: tuple[float, ...]
    alpha_look: float

    @property
    def level(self) -> float:
        """The two-sided level of the interval at one look, as printed ("98.8% CI")."""
        return 1.0 - 2.0 * self.alpha_look

    @classmethod
    def fixed(cls, first: int, max_seeds: int, alpha: float) -> Boundary:
        """The t interval at one level at every look (the naive reading the simulation compares against)."""
        from scipy import stats as st

        c = tuple(float(v) for v in st.t.ppf(1.0 - alpha, [n - 1 for n in range(first, max_seeds + 1)]))
        return cls(first, Shape.NORMAL, c, c, alpha)

    def at(self, n: int) -> tuple[float, float]:
        """(holds, refuted) critical values at the look with ``n`` seeds."""
        return self.holds[n - self.first], self.refuted[n - self.first]


def calibration_paths(max_seeds: int, shape: Shape = DEFAULT_SHAPE) -> Iterator[tuple[str, Any]]:
    """(law, paths) for every law of the shape's family (:data:`FAMILIES`) in order: :data:`CALIBRATION_PATHS`
    standardised paths of ``max_seeds`` seeds each from one fixed-seed stream, the paths behind
    :func:`critical_values` (each law is used in both tails there; the mirror image is ``-paths``)."""
    import numpy as np

    rng = np.random.default_rng(_SEED)
    for law in FAMILIES[Shape(shape)]:
        yield law, draw_law(law, rng, (CALIBRATION_PATHS, max_seeds))


@functools.lru_cache(maxsize=64)
def critical_values(first: int, max_seeds: int, alpha: float,
                    shape: Shape = DEFAULT_SHAPE) -> tuple[float, tuple[float, ...]]:
    """``(α_look, c)``: the boundary ``c_n`` for looks ``n = first … max_seeds`` at ``alpha`` per side over all
    looks, and the one-look level it spends per side.

    ``normal``: ``t_{1−α'}(n − 1)`` with the Pocock α' (:func:`per_look_alpha`).
    ``skew_robust``: the least-favourable boundary over :data:`FAMILY` (module docstring), α″ found by bisection
    with the error target lowered by 2.326 binomial sd of the calibration (so it exceeds α only with the
    calibration's 1% chance)."""
    import numpy as np
    from scipy import stats as st

    ns = np.arange(first, max_seeds + 1)
    if shape is Shape.NORMAL:
        a = per_look_alpha(first, max_seeds, alpha)
        return a, tuple(float(c) for c in st.t.ppf(1.0 - a, ns - 1))
    r = CALIBRATION_PATHS
    sides = []
    for _, x in calibration_paths(max_seeds, shape):
        upper, lower = statistic(x, first, shape)
        sides += [upper, lower]
    s = np.nan_to_num(np.stack(sides), nan=0.0, posinf=1e300, neginf=-1e300).astype(np.float32)
    ordered = np.sort(s, axis=1)  # (2·laws, runs, looks)
    target = alpha - 2.326 * math.sqrt(alpha * (1.0 - alpha) / r)

    def boundary(level: float) -> Any:
        k = min(r - 1, int(math.floor((1.0 - level) * r)))
        return ordered[:, k, :].max(0)

    def worst(level: float) -> float:
        return float((s > boundary(level)).any(2).mean(1).max())

    low, high = 1e-6, alpha
    for _ in range(24):  # α″ to a relative 2^-24 of its log range: far below the calibration's own noise
        mid = math.sqrt(low * high)
        low, high = (mid, high) if worst(mid) <= target else (low, mid)
    return low, tuple(float(c) for c in boundary(low))


def bounds(x: Any, first: int, crit: Any, shape: Shape) -> tuple[Any, Any]:
    """The lower and upper confidence bounds ``(L, U)`` of the mean at every look from ``first`` on, at the
    critical values ``crit`` (one per look): ``L`` is the largest μ0 the upper test rejects at, ``U`` the
    smallest the lower test rejects at (for the normal shape, the paired t interval)."""
    import numpy as np

    ns, mean, sd, g = running_moments(x, first)
    crit = np.asarray(crit, dtype=np.float64)
    se = sd / np.sqrt(ns)
    if shape is Shape.NORMAL:
        return mean - crit * se, mean + crit * se
    a = g / np.sqrt(ns)
    return mean - se * hall_inverse(crit, a), mean + se * hall_inverse(crit, -a)

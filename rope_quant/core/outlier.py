"""The outlier flag of a sequential verdict: seeds the boundary's laws do not explain (docs/verdicts.md, "A rare
blow-up seed").

The boundary's 5% holds for the laws of its shape's family (:data:`rope_quant.core.boundary.FAMILIES`). A rare
blow-up seed (a quantised model that diverges on one seed in twenty) is outside them, and the rule's error there is
above 5%. The flag says when the seeds so far show one. Its statistic (:func:`split_gap`) is the **largest
studentised gap between two groups of seeds**: over every split of the sorted seeds into a low and a high group
whose smaller group holds at most a third of the seeds, ``(mean of the high − mean of the low) / pooled within-group
sd``. A single far seed gives its leave-one-out
studentised deviation (its distance from the others' mean in the others' sd); several blow-ups, which mask one
another in a one-seed statistic such as Grubbs', give the distance between their cluster and the rest.

Its threshold at n seeds (:func:`thresholds`) is the statistic's 99th percentile at n over the normal member of the
boundaries' own calibration paths (:func:`rope_quant.core.boundary.calibration_paths`, one fixed-seed stream for
every shape). So 1% of normal paths carry the flag at whatever look they stop. It is not taken over the whole family:
the family's far seeds (its heavy-tailed members) put the 99th percentile of a one-seed deviation at 12–15 sd (8–40
seeds), past the 6 sd of a seed blown up by 6 sd among normal ones. The family's other members do cross the normal
threshold (at the verdict: t₃ 41%, gamma at skewness 1 18%, at skewness 2 65%), where the 5% does hold. The flag
therefore reads "these seeds are farther from the others than normal seeds go": a warning to look at them, and, if
they are blow-ups, the rule's 5% is not covered. A verdict whose seeds cross it carries an :class:`OutlierFlag` (the
claims JSON's ``outlier``) and says so in its text.

One place for the flag: :func:`flag` reads one verdict's per-seed differences (the sequential rule reads it at every
look, :func:`rope_quant.core.sequential.decide`, which the claims engine and ``rope-quant replay`` both call);
:func:`split_gap` is the same statistic vectorised over paths and looks, for the calibration and the simulations.
Standard library only at import time; numpy when a number is computed.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rope_quant.defaults import DEFAULT_SHAPE, Shape

QUANTILE = 0.99
"""The normal paths' quantile of the statistic at each n that a verdict's seeds must pass to be flagged."""
FIRST = 3
"""The fewest seeds the flag reads (two seeds have no spread within a group)."""
MINORITY = 1.0 / 3.0
"""The largest share of the seeds the far group may hold: blow-ups are rare, and two even clusters (a bimodal
effect, C2's 3 and 4 seeds at ±0.6) are not what the flag is for."""


@dataclass(frozen=True)
class OutlierFlag:
    """Seeds far from the others: their positions ``indices`` (0-based) among the ``n`` seeds read, their seed
    numbers ``seeds`` where the caller knows them (else empty), their paired differences ``values``, the gap
    ``gap`` between them and the others in pooled within-group sd, the threshold ``threshold`` at ``n``, and the
    shape of the boundary the verdict was read at."""

    indices: tuple[int, ...]
    n: int
    values: tuple[float, ...]
    gap: float
    threshold: float
    shape: str
    seeds: tuple[int, ...] = ()

    def text(self) -> str:
        """The verdict's sentence."""
        names = [str(s) for s in self.seeds] or [f"#{i + 1}" for i in self.indices]
        who = ("seed " if len(names) == 1 else "seeds ") + ", ".join(names)
        values = ", ".join(f"{v:+.4g}" for v in self.values[:4]) + (", …" if len(self.values) > 4 else "")
        verb = "lies" if len(names) == 1 else "lie"
        return (f"outlier: {who} ({values}) {verb} {self.gap:.3g} sd from the others, beyond the {self.threshold:.3g} "
                f"that 99% of normal seeds stay within at {self.n} seeds; a seed that blows up lies outside the laws "
                f"this rule is calibrated on ({self.shape}): its 5% is not covered")

    def at_seeds(self, seeds: Sequence[int]) -> OutlierFlag:
        """This flag naming its seeds by number (``seeds``: the verdict's seeds in order)."""
        from dataclasses import replace

        return replace(self, seeds=tuple(int(seeds[i]) for i in self.indices))


def _gaps(sorted_x: Any) -> Any:
    """The studentised gap of every split of the sorted rows (last axis: the ``n`` values; result: ``n − 1`` splits,
    split j puts the lowest j + 1 values in the low group; inf where both groups have no spread; −inf where the
    smaller group holds more than :data:`MINORITY` of the values)."""
    import numpy as np

    n = sorted_x.shape[-1]
    c1, c2 = np.cumsum(sorted_x, -1), np.cumsum(sorted_x * sorted_x, -1)
    k = np.arange(1, n, dtype=np.float64)
    lo1, lo2 = c1[..., :-1], c2[..., :-1]
    hi1, hi2 = c1[..., -1:] - lo1, c2[..., -1:] - lo2
    low, high = lo1 / k, hi1 / (n - k)
    ss = np.maximum(lo2 - lo1 * low, 0.0) + np.maximum(hi2 - hi1 * high, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        gap = np.where(ss > 0, (high - low) / np.sqrt(ss / (n - 2)), np.inf)
    return np.where(np.minimum(k, n - k) <= n * MINORITY, gap, -np.inf)


def split_gap(x: Any, first: int = FIRST) -> Any:
    """The statistic of every prefix of the rows of ``x`` from ``first`` values on (columns: looks
    ``first … M``): the largest studentised gap over the splits of the sorted prefix (module docstring)."""
    import numpy as np

    x = np.asarray(x, dtype=np.float64)
    m = x.shape[-1]
    out = np.empty(x.shape[:-1] + (m - first + 1,))
    for j, n in enumerate(range(first, m + 1)):
        out[..., j] = _gaps(np.sort(x[..., :n], -1)).max(-1)
    return out


@functools.lru_cache(maxsize=4)
def _normal_paths(max_seeds: int) -> Any:
    """The normal member of the boundaries' calibration paths for looks up to ``max_seeds``."""
    from rope_quant.core.boundary import calibration_paths

    return next(calibration_paths(max_seeds, Shape.NORMAL))[1]


@functools.lru_cache(maxsize=1024)
def threshold(max_seeds: int, n: int) -> float:
    """The flag's threshold at ``n`` seeds (``3 ≤ n ≤ max_seeds``): :data:`QUANTILE` of the statistic at n over the
    normal paths behind the boundaries (the normal member of :func:`rope_quant.core.boundary.calibration_paths`;
    ``max_seeds`` names the paths, as it does for the boundary). One look's threshold is computed alone, so a
    verdict pays for its own n only."""
    import numpy as np

    if not FIRST <= n <= max_seeds:
        raise ValueError(f"the flag reads {FIRST} to {max_seeds} seeds, got {n}")
    paths = _normal_paths(max_seeds)[:, :n]
    return float(np.quantile(_gaps(np.sort(paths, -1)).max(-1), QUANTILE))


def thresholds(max_seeds: int) -> tuple[float, ...]:
    """:func:`threshold` at every look ``n = 3 … max_seeds`` (for the simulations)."""
    return tuple(threshold(max_seeds, n) for n in range(FIRST, max_seeds + 1))


def flag(diffs: Sequence[float], max_seeds: int, shape: Shape = DEFAULT_SHAPE) -> OutlierFlag | None:
    """The flag of one verdict's per-seed differences (``3 ≤ n ≤ max_seeds`` of them; the plan's M names the
    calibration paths): the smaller group of the widest split when its gap passes the threshold at n, else None."""
    import numpy as np

    d = np.asarray(diffs, dtype=np.float64)
    n = len(d)
    if n < FIRST or n > max_seeds or not np.all(np.isfinite(d)) or not float(d.std()) > 0:
        return None
    order = np.argsort(d, kind="stable")
    gaps = _gaps(d[order])
    j = int(np.argmax(gaps))
    gap, limit = float(gaps[j]), threshold(max_seeds, n)
    if not gap > limit:
        return None
    group = order[:j + 1] if j + 1 <= n - j - 1 else order[j + 1:]
    indices = tuple(sorted(int(i) for i in group))
    return OutlierFlag(indices, n, tuple(float(d[i]) for i in indices), gap, limit, Shape(shape).value)

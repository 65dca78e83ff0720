"""Side-by-side timing shared by the benchmarks and the pipeline-cost bench script (ratios, never timed asserts)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable


def paired_best(fns: list[Callable[[], None]], rounds: int = 3) -> list[float]:
    """Best wall time (s) of each function, calling them in alternation for ``rounds`` rounds after a warm-up."""
    best = [math.inf] * len(fns)
    for fn in fns:  # warm-up
        fn()
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def best_of(fn: Callable[[], None], repeats: int = 3) -> float:
    """The shortest of ``repeats`` wall times of ``fn()`` (seconds)."""
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best

"""Online R4 cost ÷ the down_proj matmul it precedes, measured side by side in one run (a script, not a test):

    PYTHONPATH=. python tests/bench/bench_r4_cost.py [--threads 1,2] [--tokens 64] [--rounds 5]
        [--sizes HIDDEN:INTERMEDIATE,...] [--no-before] [--clock wall|cpu]

For each (hidden, intermediate) of rope_quant/model/shapes.py (default) it times, on ``tokens`` rows of width
``intermediate``: the online R4 (``core.hadamard.hadamard_transform``, float32) and the down_proj matmul
``x @ Wᵀ`` with W of shape (hidden, intermediate). Each pair alternates round by round and keeps each one's
best. For 11008 it also times the order-5504 Paley factor that served it before (``before_ms``: 5504·2,
one GEMM over every (row, 2) pair), unless ``--no-before``. Timings only, never asserted.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable

import torch

from rope_quant.core import hadamard as hd

CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}

COLUMNS = ("intermediate", "K*2^m", "hidden", "threads", "tokens", "r4_ms", "down_ms", "r4/down", "before_ms",
           "before/down")


def shape_sizes() -> list[tuple[int, int]]:
    """The distinct (hidden, intermediate) pairs of model/shapes.py (11008 is Llama-2-7B's)."""
    from rope_quant.model.shapes import SHAPES

    return sorted({(s.hidden, s.intermediate) for s in SHAPES.values()}, key=lambda hi: hi[1])


def paired_best(fns: list[Callable[[], object]], rounds: int, clock: Callable[[], float]) -> list[float]:
    """Best time (s) of each function by ``clock``, calling them in alternation for ``rounds`` rounds after a
    warm-up (tests/bench/_timing.py's rule with a choice of clock: ``cpu`` is the process's CPU time, which a
    busy machine's descheduling does not inflate; at 1 thread it is the work itself)."""
    best = [math.inf] * len(fns)
    for fn in fns:
        fn()
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            t0 = clock()
            fn()
            best[i] = min(best[i], clock() - t0)
    return best


def _before_11008() -> torch.Tensor:
    """H_5504/√5504, the Paley I factor (q = 5503) that served 11008 = 5504·2 before smaller K were built."""
    from rope_quant.core.hadamard_orders import _paley

    return (_paley(5504).to(torch.float64) / 5504**0.5).to(torch.float32)


def _apply_5504(x: torch.Tensor, h5504: torch.Tensor) -> torch.Tensor:
    rows = x.shape[0]
    y = hd.fwht(x.reshape(rows, 5504, 2))
    return torch.matmul(y.transpose(-1, -2).reshape(-1, 5504), h5504.T).reshape(rows, 2, 5504).transpose(1, 2)


def measure(hidden: int, inter: int, threads: int, tokens: int, rounds: int, before: bool,
            clock: str = "wall") -> dict[str, object]:
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(inter)
    x = torch.randn(tokens, inter, generator=gen)
    w = torch.randn(hidden, inter, generator=gen) / inter**0.5
    k, m = hd.hadamard_order(inter)
    hd.hadamard_transform(x)  # build and cache the factors outside the timing
    fns = [lambda: hd.hadamard_transform(x), lambda: torch.matmul(x, w.T)]
    h5504 = None
    if before and inter == 11008:
        h5504 = _before_11008()
        fns.append(lambda: _apply_5504(x, h5504))
    times = paired_best(fns, rounds, CLOCKS[clock])
    row: dict[str, object] = {"intermediate": inter, "K*2^m": f"{k}*2^{m}", "hidden": hidden, "threads": threads,
                              "tokens": tokens, "r4_ms": times[0] * 1e3, "down_ms": times[1] * 1e3,
                              "r4/down": times[0] / times[1], "before_ms": "", "before/down": ""}
    if h5504 is not None:
        row["before_ms"], row["before/down"] = times[2] * 1e3, times[2] / times[1]
    return row


def _fmt(column: str, v: object) -> str:
    if not isinstance(v, float):
        return str(v)
    return f"{v:.4g}" if column.endswith("_ms") else f"{v:.3f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sizes", default="", help="HIDDEN:INTERMEDIATE pairs, comma-separated (default: shapes.py)")
    ap.add_argument("--no-before", action="store_true", help="skip the order-5504 baseline at 11008")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="wall (default) or cpu: the process's CPU time (robust on a busy machine at 1 thread)")
    args = ap.parse_args(argv)
    try:
        threads = [int(t) for t in args.threads.split(",")]
        sizes = ([tuple(int(v) for v in p.split(":")) for p in args.sizes.split(",")] if args.sizes
                 else shape_sizes())
        if any(len(s) != 2 for s in sizes) or min(threads) < 1 or args.tokens < 1 or args.rounds < 1:
            raise ValueError
    except ValueError:
        print("error: --threads takes positive integers, --sizes HIDDEN:INTERMEDIATE pairs, --tokens and --rounds "
              "positive integers (e.g. --threads 1,2 --sizes 4096:11008)", file=sys.stderr)
        return 2
    print(f"# torch {torch.__version__}; online R4 (hadamard_transform, float32) vs down_proj x @ W.T; best of "
          f"{args.rounds} alternating rounds; {args.clock} clock")
    print(" | ".join(COLUMNS))
    for t in threads:
        for hidden, inter in sizes:
            row = measure(hidden, inter, t, args.tokens, args.rounds, not args.no_before, args.clock)
            print(" | ".join(_fmt(c, row[c]) for c in COLUMNS), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

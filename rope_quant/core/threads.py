"""One intra-op CPU thread for the factorisations whose result depends on the thread count.

LAPACK's blocked Cholesky and triangular solves split their work by the number of OpenMP threads, so their
float32 rounding changes with it; GPTQ's inverse-Hessian factor (:mod:`rope_quant.quant.gptq_solve`) and whip's
CholeskyQR2 (:mod:`rope_quant.rotations.whip`) feed that rounding into 4-bit codes, and one flipped code spreads.
Measured 2026-12-06 on the 2-core Intel Xeon VM (torch 2.13.0+cpu): ``torch.linalg.cholesky`` of a 576 × 576
float32 SPD matrix differs in 105,729 of 331,776 entries between 1 and 2 threads (a 512 × 576 ``x.T @ x`` and a
1536 × 576 ``linear``: in none), and SmolLM2's GPTQ weights of one seed differed in 16% of their codes, which moved
a cell's perplexity from 27.150 to 27.463. On one thread the factorisations, and so the cells, are the same at any
thread count (tests/numerics/test_threads.py). The matrices are at most a few thousand wide: one thread costs
little beside the forwards, which keep every thread. The calibration statistics' per-window update
(:mod:`rope_quant.calib.stats`) runs on one thread too, for speed as well: a few MB of float64 work in ~15 ops
took 89 ms per layer-window at 2 threads against 6.2 ms at 1 on the loaded 2-core machine (2026-11-28).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def one_cpu_thread(device: torch.device | str) -> Iterator[None]:
    """Run the block on one intra-op thread when ``device`` is the CPU (the thread count is restored after);
    nothing changes on an accelerator."""
    threads = torch.get_num_threads()
    if torch.device(device).type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)

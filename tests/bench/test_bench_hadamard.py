"""FWHT (pure torch) vs dense matmul vs fast-hadamard-transform, 4096 rows. Timings only, never asserted."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import pytest
import torch

from rope_quant.core import hadamard as hd

ROWS = 4096
SIZES = (64, 128, 1024, 8192)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _paired_best_ms(
    a: Callable[[], torch.Tensor], b: Callable[[], torch.Tensor], reps: int
) -> tuple[float, float]:
    """Best-of-reps wall times in ms of a and b, alternating calls so that machine load hits both alike."""
    best = [math.inf, math.inf]
    for fn in (a, b):  # warm-up (caches, allocator)
        fn()
    _sync()
    for _ in range(reps):
        for i, fn in enumerate((a, b)):
            t0 = time.perf_counter()
            fn()
            _sync()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best[0] * 1e3, best[1] * 1e3


@pytest.mark.parametrize("d", SIZES)
def test_fwht_vs_dense(benchmark, rq_record, d: int) -> None:
    x = torch.randn(ROWS, d, generator=torch.Generator().manual_seed(d))
    h = hd.hadamard_matrix(d, dtype=torch.float32) / math.sqrt(d)  # dense baseline: matrix built once
    y = benchmark.pedantic(hd.fwht, args=(x,), rounds=3 if d >= 8192 else 10, iterations=1, warmup_rounds=1)
    fwht_ms, dense_ms = _paired_best_ms(
        lambda: hd.fwht(x), lambda: torch.matmul(x, h), 1 if d >= 8192 else 40
    )
    rq_record(
        "FWHT vs dense",
        d=d,
        rows=ROWS,
        fwht_ms=round(fwht_ms, 3),
        dense_ms=round(dense_ms, 3),
        ratio=round(dense_ms / fwht_ms, 2),
        threads=torch.get_num_threads(),
    )
    # correctness of what was timed (cheap check on a few rows)
    torch.testing.assert_close(y[:8], x[:8] @ h, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("d", (576, 1536))
def test_kronecker_orders(benchmark, rq_record, d: int) -> None:
    """Non-power-of-two orders of SmolLM2 (hidden 576 = 36·16, intermediate 1536 = 12·128)."""
    x = torch.randn(ROWS, d, generator=torch.Generator().manual_seed(d))
    h = hd.hadamard_matrix(d, dtype=torch.float32) / math.sqrt(d)
    benchmark.pedantic(hd.hadamard_transform, args=(x,), rounds=10, iterations=1, warmup_rounds=1)
    fast_ms, dense_ms = _paired_best_ms(lambda: hd.hadamard_transform(x), lambda: torch.matmul(x, h.T), 20)
    rq_record(
        "FWHT vs dense",
        d=d,
        rows=ROWS,
        fwht_ms=round(fast_ms, 3),
        dense_ms=round(dense_ms, 3),
        ratio=round(dense_ms / fast_ms, 2),
        threads=torch.get_num_threads(),
    )


@pytest.mark.skipif(
    not (torch.cuda.is_available() and hd.fast_kernel_available()),
    reason="fast-hadamard-transform needs CUDA and the package (pip install fast-hadamard-transform)",
)
@pytest.mark.parametrize("d", SIZES)
def test_fast_hadamard_transform_cuda(benchmark, rq_record, d: int) -> None:  # pragma: no cover - GPU only
    x = torch.randn(ROWS, d, device="cuda")
    h = hd.hadamard_matrix(d, dtype=torch.float32, device="cuda") / math.sqrt(d)

    def run() -> torch.Tensor:
        y = hd.hadamard_transform(x)
        torch.cuda.synchronize()
        return y

    benchmark.pedantic(run, rounds=20, iterations=1, warmup_rounds=2)
    fast_ms, dense_ms = _paired_best_ms(lambda: hd.hadamard_transform(x), lambda: torch.matmul(x, h), 20)
    torch_ms, _ = _paired_best_ms(lambda: hd.fwht(x), lambda: x, 20)
    rq_record(
        "FWHT vs dense (CUDA)",
        d=d,
        rows=ROWS,
        fast_ms=round(fast_ms, 4),
        fwht_ms=round(torch_ms, 4),
        dense_ms=round(dense_ms, 4),
        ratio=round(dense_ms / fast_ms, 2),
    )

"""Cost of applying each R3 variant to a (1, 9, 2048, 64) query tensor (SmolLM2 shape). Timings only."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch

from rope_quant.core import transforms as T

D, H_Q, H_KV, L = 64, 9, 3, 2048
ANGLES = np.random.default_rng(0).uniform(-math.pi / 4, math.pi / 4, (H_KV, D // 2))


def _variants() -> list[tuple[str, dict]]:
    out: list[tuple[str, dict]] = []
    for name in T.names():
        if T.needs_block(name):
            out += [(name, {"block": b}) for b in (2, 8, D)]
        elif T.needs_angles(name):
            out.append((name, {"angles": ANGLES}))
        else:
            out.append((name, {}))
    return out


VARIANTS = _variants()


@pytest.mark.parametrize(
    ("name", "params"), VARIANTS, ids=[f"{n}-{p.get('block', '')}".rstrip("-") for n, p in VARIANTS]
)
def test_r3_apply_cost(benchmark, rq_record, name: str, params: dict) -> None:
    t = T.build(name, D, **params)
    x = torch.randn(1, H_Q, L, D, generator=torch.Generator().manual_seed(0))
    y = benchmark.pedantic(t.apply, args=(x,), rounds=10, iterations=1, warmup_rounds=1)
    dense = torch.from_numpy(t.matrix(0)).float().T.contiguous()
    best = [math.inf, math.inf]  # alternate the two so machine load hits both alike
    for _ in range(20):
        for i, fn in enumerate((lambda: t.apply(x), lambda: torch.matmul(x, dense))):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    rq_record(
        "R3 apply cost (1, 9, 2048, 64)",
        transform=name,
        block=params.get("block", ""),
        apply_ms=round(best[0] * 1e3, 3),
        dense_matmul_ms=round(best[1] * 1e3, 3),
    )  # dense: one shared (d, d) matmul, a timing reference
    assert y.shape == x.shape and torch.isfinite(y).all()

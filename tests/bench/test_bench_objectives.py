"""Cost of the per-layer angle fits at the embedded model's shape (2048 sampled K tokens, 3 KV heads,
head_dim 64): the closed-form φ̂ and φ* against the ``range`` objective's coordinate descent. The
ratios are measured side by side in one run (timings only; no speed is asserted)."""

from __future__ import annotations

import numpy as np
import pytest
from _timing import best_of

from rope_quant.calib.objectives import RANGE_GRID_SIZE, RANGE_REFINE, RANGE_SWEEPS, estimate_angles, fit_range_angles
from rope_quant.calib.stats import CalibrationStats

N, H_Q, H_KV, D = 2048, 9, 3, 64
INV_FREQ = 100000.0 ** (-np.arange(0, D, 2) / D)


@pytest.fixture(scope="module")
def layer():
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((N, H_KV, D)) * np.linspace(0.1, 4.0, D) + rng.standard_normal(D)
    positions = rng.integers(0, 512, N)
    stats = CalibrationStats(1, H_Q, H_KV, D)
    stats.update(0, "k", rows.reshape(-1, H_KV * D))
    stats.update(0, "q", rng.standard_normal((N, H_Q * D)))
    return rows, positions, stats



@pytest.mark.parametrize("then_hadamard", [False, True], ids=["pairwise_only", "pairwise_plus_hadamard"])
@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per_head"])
def test_range_fit_cost_per_layer(benchmark, rq_record, layer, per_head: bool, then_hadamard: bool) -> None:
    rows, positions, stats = layer
    fit = benchmark.pedantic(fit_range_angles, args=(rows, positions, INV_FREQ),
                             kwargs={"per_head": per_head, "then_hadamard": then_hadamard},
                             rounds=2, iterations=1)
    range_s = best_of(lambda: fit_range_angles(rows, positions, INV_FREQ, per_head=per_head,
                                                then_hadamard=then_hadamard), repeats=1)
    phi_hat_s = best_of(lambda: estimate_angles(stats, "k_only"))
    phi_star_s = best_of(lambda: estimate_angles(stats, "k_only", inv_freq=INV_FREQ, average_length=512))
    rq_record(
        f"angle fit cost per layer (N={N} tokens, {H_KV} KV heads, d={D}; grid {RANGE_GRID_SIZE}"
        f"+{RANGE_REFINE}, {RANGE_SWEEPS} sweeps)",
        r3="pairwise_plus_hadamard" if then_hadamard else "pairwise_only", per_head=per_head,
        range_ms=round(range_s * 1e3, 1), phi_hat_ms=round(phi_hat_s * 1e3, 3),
        phi_star_ms=round(phi_star_s * 1e3, 3), range_over_phi_star=round(range_s / phi_star_s, 1),
    )
    assert fit.trace[-1] <= fit.trace[0]

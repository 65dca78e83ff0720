"""CPU scale test (issue 21): Llama-2-7B's shape cut to 1 layer at full width (hidden 4096, vocab 32000), rotated
with R1 (random Hadamard) + R2 + R4 in a subprocess: the rotated model computes the original function at true
width, and its peak RSS is within ±25% of the plan's prediction. Time is only printed (ratios in the bench)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rope_quant.rotations import offline

PROBE = Path(__file__).with_name("scale_probe.py")


@pytest.fixture(scope="module")
def probe() -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(offline.__file__).parents[2]), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(PROBE), "llama-2-7b", "1", "32000", "2", "64", "random_hadamard"],
                         capture_output=True, text=True, env=env, timeout=900, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_rotated_model_is_the_original_function_at_true_width(probe):
    assert probe["params"] == 464_531_456  # 1 layer of Llama-2-7B + its 32000-row embedding and lm_head
    assert probe["rel_logit_err"] < 1e-4


def test_peak_rss_within_25_percent_of_the_plan(probe):
    ratio = probe["peak_rss"] / probe["plan_peak_host"]
    print(f"peak RSS {probe['peak_rss'] / 2**30:.2f} GiB, plan {probe['plan_peak_host'] / 2**30:.2f} GiB "
          f"(x{ratio:.2f}); model {probe['model_bytes'] / 2**30:.2f} GiB; rotate {probe['rotate_s']:.1f} s, "
          f"plan {probe['plan_rotate_s']:.1f} s (dense R1 basis)")
    assert 0.75 <= ratio <= 1.25


def test_fast_hadamard_folds_equal_the_dense_product(monkeypatch):
    """Above R1_DENSE_MAX / R4_DENSE_MAX the folds use the transforms; they equal the dense products."""
    from rope_quant.core import hadamard

    torch.manual_seed(0)
    n = 2048
    q = hadamard.random_hadamard(n, 5, torch.float64)
    assert offline.hadamard_signs(q) is not None
    assert offline.hadamard_signs(torch.linalg.qr(torch.randn(n, n, dtype=torch.float64))[0]) is None
    assert offline.hadamard_signs(hadamard.random_hadamard(512, 5, torch.float64)) is None  # dense below the bar
    w = torch.randn(40, n, dtype=torch.float64)
    right = w.clone()
    offline.fold_right(right, q)
    torch.testing.assert_close(right, w @ q, rtol=0, atol=1e-12)
    left = w.T.clone()
    offline.fold_left(q.T, left)
    torch.testing.assert_close(left, q.T @ w.T, rtol=0, atol=1e-12)
    for width in (96, 3072, 5120):
        x = torch.randn(8, width, dtype=torch.float64)
        torch.testing.assert_close(offline._r4_rows(x), x @ offline.r4_matrix(width), rtol=0, atol=1e-12)


def test_hadamard_detection_is_not_fooled_by_a_reused_address():
    """The per-matrix memo must not hand a Hadamard's signs to a later matrix (freed and reallocated, or edited)."""
    from rope_quant.core import hadamard

    n = 2048
    for _ in range(3):
        q = hadamard.random_hadamard(n, 1, torch.float64)
        assert offline.hadamard_signs(q) is not None
        del q
        dense = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64))[0]
        assert offline.hadamard_signs(dense) is None
    q = hadamard.random_hadamard(n, 2, torch.float64)
    assert offline.hadamard_signs(q) is not None
    q[0, 0] = 0.5  # edited in place: its version changes
    assert offline.hadamard_signs(q) is None

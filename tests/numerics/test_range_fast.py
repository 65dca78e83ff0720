"""The range objective's float32-prefiltered coordinate descent chooses the same angles as the all-float64 one
(rope_quant.calib.objectives.fit_range_angles, ``exact=False`` vs ``exact=True``): tolerance 1e-6 rad."""

from __future__ import annotations

import numpy as np
import pytest

from rope_quant.calib.objectives import fit_range_angles
from tests._support import range_keys as _keys


@pytest.mark.parametrize("then_hadamard", [False, True], ids=["pairwise_only", "pairwise_plus_hadamard"])
@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per_head"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fast_fit_matches_the_exact_fit(seed, per_head, then_hadamard):
    rows, pos, inv = _keys(seed)
    kw = dict(per_head=per_head, then_hadamard=then_hadamard, grid_size=32, refine=8, sweeps=2)
    exact = fit_range_angles(rows, pos, inv, exact=True, **kw)
    fast = fit_range_angles(rows, pos, inv, **kw)
    assert np.abs(fast.angles - exact.angles).max() <= 1e-6
    np.testing.assert_allclose(fast.trace, exact.trace, rtol=1e-12)


def test_fast_fit_keeps_the_current_angle_on_ties():
    """A constant key (every pair's range the same at every angle... up to the rest) keeps φ = 0 like the exact fit."""
    rows = np.zeros((20, 1, 8))
    rows[:, 0, 0] = 5.0  # pair 0 dominates; pairs 1-3 are zero: every angle ties, the current (0) is kept
    pos = np.arange(20)
    inv = 10000.0 ** (-np.arange(0, 8, 2) / 8)
    fast = fit_range_angles(rows, pos, inv, grid_size=16, refine=4)
    exact = fit_range_angles(rows, pos, inv, grid_size=16, refine=4, exact=True)
    np.testing.assert_array_equal(fast.angles, exact.angles)
    assert np.all(fast.angles[1:] == 0)

"""The layer-batched range-objective fit (rope_quant.calib.range_fast) against the previous implementation
(tests/_support/range_reference.py, frozen at 0a3b657) and the all-float64 descent (``exact=True``).

Tolerance, stated: the angles agree within 1e-6 rad and the fitted objective is not worse (1e-12 relative).
The only change in float order is the float64 re-scoring of the near candidates, which now sums the movable
(token, head) entries only (the others add the same constant to every candidate): two candidates whose
float64 scores agree to rounding (~1e-16 relative; in practice angles 1 ulp apart) may swap, which moves an
angle by ~4e-16 rad. On the SmolLM2-135M K samples of tests/bench/bench_pipeline_costs.py (30 layers, both modes)
the angles were bit-identical to the previous implementation.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rope_quant.calib.objectives import AngleEstimationError, fit_range_angles, fit_range_angles_layers
from tests._support import range_keys as _keys
from tests._support.range_reference import reference_fit_range_angles

TOL = 1e-6


def _assert_same_fit(new, old):
    assert np.abs(new.angles - old.angles).max() <= TOL
    assert new.trace[-1] <= old.trace[-1] * (1 + 1e-12)
    np.testing.assert_allclose(new.trace, old.trace, rtol=1e-12)


@pytest.mark.parametrize("then_hadamard", [False, True], ids=["pairwise_only", "pairwise_plus_hadamard"])
@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per_head"])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_matches_the_previous_implementation(seed, per_head, then_hadamard):
    rows, pos, inv = _keys(seed)
    kw = dict(per_head=per_head, then_hadamard=then_hadamard, grid_size=32, refine=8, sweeps=2)
    _assert_same_fit(fit_range_angles(rows, pos, inv, **kw), reference_fit_range_angles(rows, pos, inv, **kw))


@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 40), heads=st.integers(1, 3),
       d=st.sampled_from([2, 4, 8, 16]), per_head=st.booleans(), then_hadamard=st.booleans(),
       layout=st.sampled_from(["rotate_half", "interleaved"]), ties=st.booleans())
def test_matches_the_previous_implementation_on_random_tiny_configs(seed, n, heads, d, per_head, then_hadamard,
                                                                    layout, ties):
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((n, heads, d)) * np.exp(rng.normal(0, 1.5, d))
    if ties:  # integer keys and a few zero pairs: exact ties between candidates
        rows = np.round(rows)
        rows[..., rng.integers(0, d)] = 0.0
    pos = rng.integers(0, 64, n)
    inv = 10000.0 ** (-np.arange(0, d, 2) / d)
    kw = dict(per_head=per_head, then_hadamard=then_hadamard, layout=layout, grid_size=16, refine=4, sweeps=2)
    _assert_same_fit(fit_range_angles(rows, pos, inv, **kw), reference_fit_range_angles(rows, pos, inv, **kw))


@pytest.mark.parametrize("then_hadamard", [False, True], ids=["pairwise_only", "pairwise_plus_hadamard"])
def test_matches_the_exact_descent(then_hadamard):
    rows, pos, inv = _keys(7, n=200, heads=3)
    kw = dict(then_hadamard=then_hadamard, grid_size=32, refine=8, sweeps=2)
    _assert_same_fit(fit_range_angles(rows, pos, inv, **kw), fit_range_angles(rows, pos, inv, exact=True, **kw))


@pytest.mark.parametrize("then_hadamard", [False, True], ids=["pairwise_only", "pairwise_plus_hadamard"])
@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per_head"])
def test_a_batch_of_layers_fits_each_layer_as_alone(per_head, then_hadamard):
    """Layers batched together (and a layer with another sample size, fitted in its own batch) get the angles
    and traces each gets alone: the batch shares operations, never data."""
    keys = [_keys(s, n=n) for s, n in ((10, 120), (11, 120), (12, 90), (13, 120))]
    inv = np.stack([k[2] * (1.0 + 0.5 * i) for i, k in enumerate(keys)])  # a different base per layer
    kw = dict(per_head=per_head, then_hadamard=then_hadamard, grid_size=16, refine=4, sweeps=2)
    batch = fit_range_angles_layers([(r, p) for r, p, _ in keys], inv, **kw)
    for (rows, pos, _), freqs, fit in zip(keys, inv, batch, strict=True):
        alone = fit_range_angles(rows, pos, freqs, **kw)
        np.testing.assert_array_equal(fit.angles, alone.angles)
        assert fit.trace == alone.trace


def test_init_is_the_start_of_every_layer():
    keys = [_keys(s, n=60, d=8) for s in (20, 21)]
    inv = np.stack([k[2] for k in keys])
    starts = [np.full(4, 0.3), np.full(4, -0.2)]
    kw = dict(grid_size=8, refine=2, sweeps=1)
    batch = fit_range_angles_layers([(r, p) for r, p, _ in keys], inv, init=starts, **kw)
    for (rows, pos, freqs), start, fit in zip(keys, starts, batch, strict=True):
        old = reference_fit_range_angles(rows, pos, freqs, init=start, **kw)
        _assert_same_fit(fit, old)


def test_layer_batch_rejects_mismatched_frequencies():
    rows, pos, inv = _keys(0, n=20, d=8)
    with pytest.raises(AngleEstimationError, match="n_layers=2"):
        fit_range_angles_layers([(rows, pos), (rows, pos)], inv[None])

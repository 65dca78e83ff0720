"""Input validation of rope_quant.core.rope and rope_quant.core.angles (specific ValueError subclasses)."""

from __future__ import annotations

import numpy as np
import pytest

from rope_quant.core.rope import (
    InvalidFrequencyError,
    NonDistinctFrequencyError,
    OddHeadDimError,
    RopeError,
    UnsupportedLayoutError,
    check_frequencies,
    check_head_dim,
    check_layout,
    pair_indices,
    phase_averages,
    rope_matrix,
)


@pytest.mark.parametrize("bad", [3, 0, -2, 2.0, True, "8"])
def test_head_dim_must_be_positive_even_int(bad):
    with pytest.raises(OddHeadDimError):
        check_head_dim(bad)


def test_head_dim_and_layout_ok():
    assert check_head_dim(64) == 32 and check_head_dim(np.int64(2)) == 1
    assert check_layout("interleaved") == "interleaved"
    with pytest.raises(UnsupportedLayoutError, match="neox"):
        check_layout("neox")
    with pytest.raises(UnsupportedLayoutError):
        pair_indices(8, "neox")


def test_check_frequencies():
    theta = 10000.0 ** (-np.arange(8) / 8)
    out = check_frequencies(theta.astype(np.float32))
    assert out.dtype == np.float64 and out.shape == (8,)
    with pytest.raises(NonDistinctFrequencyError, match="distinct"):
        check_frequencies([0.5, 0.25, 0.5])
    with pytest.raises(InvalidFrequencyError):
        check_frequencies([0.5, float("nan")])
    with pytest.raises(InvalidFrequencyError):
        check_frequencies([0.5, -0.1])
    with pytest.raises(InvalidFrequencyError):
        check_frequencies(np.ones((2, 2)))
    for exc in (NonDistinctFrequencyError, InvalidFrequencyError, OddHeadDimError):
        assert issubclass(exc, RopeError) and issubclass(exc, ValueError)


def test_phase_average_bad_inputs():
    with pytest.raises(RopeError):
        phase_averages([0.1, 0.2], 0)
    with pytest.raises(RopeError):
        phase_averages([0.1, 0.2], 2.5)
    with pytest.raises(RopeError):
        phase_averages([0.1, 0.2], 4, method="fft")
    with pytest.raises(InvalidFrequencyError):
        phase_averages([0.1, float("inf")], 4)


def test_rope_matrix_batched_positions():
    theta = np.array([0.5, 0.1])
    Rs = rope_matrix(theta, np.arange(3))
    assert Rs.shape == (3, 4, 4)
    assert np.allclose(Rs[0], np.eye(4))
    assert np.allclose(Rs[2], rope_matrix(theta, 2))
    # pair 0 = channels (0, 2) in rotate_half: [[cos, -sin], [sin, cos]] on [a; b]
    R = rope_matrix(theta, 1)
    assert R[0, 0] == pytest.approx(np.cos(0.5)) and R[0, 2] == pytest.approx(-np.sin(0.5))
    assert R[2, 0] == pytest.approx(np.sin(0.5))

"""rope_quant.core.stats against hand-worked cases and independent re-derivations."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats as st_scipy

from rope_quant.core.stats import (
    LengthMismatchError,
    NonFiniteValueError,
    PairedCI,
    StatsError,
    TooFewPairsError,
    equivalent,
    holm,
    paired_ci,
    paired_t_pvalue,
    sample_sd,
)


def test_paired_ci_hand_worked():
    # differences d = [1, 2, 3]: mean 2; sd = sqrt(((1-2)^2 + 0 + (3-2)^2) / (3-1)) = 1
    # t_{0.95, 2} = 2.919986 (90% two-sided), half width = 2.919986 * 1 / sqrt(3) = 1.685854
    ci = paired_ci([11.0, 12.0, 13.0], [10.0, 10.0, 10.0], level=0.90)
    assert isinstance(ci, PairedCI)
    assert ci.n == 3 and ci.level == 0.90
    assert ci.mean == pytest.approx(2.0)
    assert ci.sd == pytest.approx(1.0)
    assert ci.low == pytest.approx(2.0 - 1.685854, abs=1e-6)
    assert ci.high == pytest.approx(2.0 + 1.685854, abs=1e-6)


def test_paired_ci_95_hand_worked():
    # d = [0.5, -0.5, 1.5, 2.5]: mean 1; deviations -0.5, -1.5, 0.5, 1.5 -> SS = 5, sd = sqrt(5/3)
    # t_{0.975, 3} = 3.182446; half = 3.182446 * 0.6454972 (= sd/2) = 1.9364916 + 0.1177685 = 2.054260
    ci = paired_ci([1.5, 0.5, 2.5, 3.5], [1.0, 1.0, 1.0, 1.0], level=0.95)
    assert ci.sd == pytest.approx(math.sqrt(5 / 3))
    assert (ci.low, ci.high) == pytest.approx((1 - 2.054260, 1 + 2.054260), abs=2e-6)


def test_sample_sd_uses_n_minus_one():
    # [1, 2, 3, 4]: mean 2.5, SS = 2.25 + 0.25 + 0.25 + 2.25 = 5, sd = sqrt(5/3) (not sqrt(5/4))
    assert sample_sd([1, 2, 3, 4]) == pytest.approx(math.sqrt(5 / 3))


def test_pvalue_hand_worked_df2():
    # d = [1, 2, 3]: t = 2 / (1 / sqrt 3) = sqrt 12. For df = 2 the t tail is closed form:
    # P(T > t) = (1 - t / sqrt(t^2 + 2)) / 2 = (1 - sqrt(12/14)) / 2 = 0.0370900, two-sided 0.0741799
    p = paired_t_pvalue([1.0, 2.0, 3.0], [0.0, 0.0, 0.0])
    assert p == pytest.approx(1 - math.sqrt(12 / 14), rel=1e-9)
    assert p == pytest.approx(0.0741799, abs=1e-7)


def test_pvalue_degenerate_spread():
    assert paired_t_pvalue([1.0, 1.0], [1.0, 1.0]) == 1.0
    assert paired_t_pvalue([2.0, 2.0, 2.0], [1.0, 1.0, 1.0]) == 0.0


def test_equivalent_tost_interval_form():
    ci = paired_ci([11.0, 12.0, 13.0], [10.0, 10.0, 10.0])  # (0.314146, 3.685854)
    assert equivalent(ci, 4.0)
    assert not equivalent(ci, 3.5)
    assert not equivalent(ci, ci.high)  # strict inequality at the boundary
    sym = PairedCI(n=5, mean=0.0, sd=1.0, low=-0.2, high=0.3, level=0.9)
    assert equivalent(sym, 0.31) and not equivalent(sym, 0.2)
    with pytest.raises(StatsError):
        equivalent(ci, 0.0)
    with pytest.raises(StatsError):
        equivalent(ci, float("nan"))


def test_holm_hand_worked():
    # p = [0.01, 0.04, 0.03, 0.005], m = 4. Ascending: 0.005*4 = 0.02, 0.01*3 = 0.03,
    # 0.03*2 = 0.06, 0.04*1 = 0.04 -> running max 0.06. In input order: [0.03, 0.06, 0.06, 0.02].
    reject, adj = holm([0.01, 0.04, 0.03, 0.005], alpha=0.05)
    assert adj == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert reject == [True, False, False, True]
    # capping at 1: 0.5*2 = 1.0, 0.6*1 -> max(1.0, 0.6) = 1.0
    assert holm([0.5, 0.6])[1] == [1.0, 1.0]
    # all rejected: 0.01*3 = 0.03, 0.02*2 = 0.04, 0.03*1 -> 0.04
    reject, adj = holm([0.03, 0.01, 0.02])
    assert reject == [True, True, True] and adj == pytest.approx([0.04, 0.03, 0.04])
    assert holm([]) == ([], [])


@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=12), st.sampled_from([0.01, 0.05, 0.1]))
def test_holm_matches_sequential_step_down(pvals, alpha):
    reject, adj = holm(pvals, alpha)
    m = len(pvals)
    # the textbook sequential procedure: walk up the sorted p-values, stop at the first failure
    expected = [False] * m
    for rank, i in enumerate(sorted(range(m), key=lambda j: pvals[j])):
        if pvals[i] <= alpha / (m - rank):
            expected[i] = True
        else:
            break
    assert reject == expected
    order = np.argsort(pvals, kind="stable")
    a_sorted = np.asarray(adj)[order]
    assert np.all(np.diff(a_sorted) >= 0) and np.all(a_sorted <= 1.0)
    assert np.all(np.asarray(adj) >= np.asarray(pvals))


@given(st.lists(st.tuples(st.floats(-100, 100), st.floats(-100, 100)), min_size=2, max_size=30))
def test_matches_scipy_ttest_rel(pairs):
    t = np.array([a for a, _ in pairs])
    c = np.array([b for _, b in pairs])
    d = t - c
    ci = paired_ci(t, c, level=0.90)
    assert ci.mean == pytest.approx(d.mean(), abs=1e-9)
    if np.std(d) <= 1e-9 * max(1.0, np.abs(d).max()):
        return  # degenerate spread: scipy returns nan, we return 0/1 (tested elsewhere)
    res = st_scipy.ttest_rel(t, c)
    assert paired_t_pvalue(t, c) == pytest.approx(res.pvalue, rel=1e-6, abs=1e-12)
    lo, hi = res.confidence_interval(0.90)
    assert (ci.low, ci.high) == pytest.approx((lo, hi), rel=1e-8, abs=1e-9)


def test_bad_inputs_raise_specific_errors():
    with pytest.raises(TooFewPairsError):
        paired_ci([1.0], [0.0])
    with pytest.raises(LengthMismatchError):
        paired_ci([1.0, 2.0, 3.0], [0.0, 1.0])
    with pytest.raises(NonFiniteValueError):
        paired_ci([1.0, float("nan")], [0.0, 1.0])
    with pytest.raises(NonFiniteValueError):
        paired_t_pvalue([1.0, 2.0], [0.0, float("inf")])
    with pytest.raises(StatsError):
        paired_ci([1.0, 2.0], [0.0, 1.0], level=1.0)
    with pytest.raises(StatsError):
        holm([0.1, 1.2])
    with pytest.raises(NonFiniteValueError):
        holm([0.1, float("nan")])
    with pytest.raises(TooFewPairsError):
        sample_sd([3.0])
    for exc in (TooFewPairsError, LengthMismatchError, NonFiniteValueError):
        assert issubclass(exc, ValueError)

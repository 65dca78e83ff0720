"""The single-interval form of the decision rule (rope_quant.core.verdict.decide, with an explicit offset: a
``rope-quant compare`` sign has no replicate, offset 0) and its budget (rope_quant.core.power). The claims'
replicated rule is in test_verdict_replicates.py.

The power simulation: on synthetic paired data with a known effect, the predicted budget decides 80% ± 5% of
2000 replicates, for the one-sided and the TOST forms, in seeds and in tokens per cell (variance ∝ 1/tokens).
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as st

from rope_quant.core import power
from rope_quant.core.verdict import (
    Budget,
    Form,
    Outcome,
    combine_all,
    decide,
    decide_interval,
    deterministic,
    equivalence_margin,
)

REPLICATES = 2000


def _decided_fraction(form: Form, mean: float, sd: float, n: int, margin: float, noise: float,
                      rng: np.random.Generator) -> float:
    """Fraction of replicates that the rule decides (towards the side the true mean lies on), vectorised."""
    d = rng.normal(mean, sd, size=(REPLICATES, n))
    m, s = d.mean(axis=1), d.std(axis=1, ddof=1)
    half = st.t.ppf(0.95, n - 1) * s / np.sqrt(n)
    low, high = m - half, m + half
    if form is Form.GREATER:
        return float(np.mean(low > noise))
    if form is Form.LESS:
        return float(np.mean(high < -noise))
    if form is Form.EQUIVALENT:
        return float(np.mean((low > -margin + noise) & (high < margin - noise)))
    raise AssertionError(form)


@pytest.mark.parametrize(("form", "mean", "sd", "margin", "noise"), [
    (Form.GREATER, 0.6, 1.0, 0.0, 0.1),
    (Form.LESS, -1.3, 2.0, 0.0, 0.2),
    (Form.EQUIVALENT, 0.1, 1.0, 0.6, 0.1),
    (Form.EQUIVALENT, -0.05, 0.4, 0.3, 0.05),
])
def test_predicted_seeds_decide_80_percent(form: Form, mean: float, sd: float, margin: float, noise: float) -> None:
    budget = decide_interval(form, 3, mean, sd, -10.0, 10.0, margin=margin, noise=noise, tokens=6144).budget
    assert budget is not None and budget.towards is Outcome.HOLDS and budget.seeds is not None
    assert budget.seeds >= 8, budget  # a sizeable n: the step in power from n - 1 to n is small
    rate = _decided_fraction(form, mean, sd, budget.seeds, margin, noise, np.random.default_rng(23))
    assert abs(rate - 0.80) <= 0.05, (budget, rate)
    below = _decided_fraction(form, mean, sd, budget.seeds // 2, margin, noise, np.random.default_rng(24))
    assert below < 0.75, (budget, below)  # the prediction is not just "any large n"


@pytest.mark.parametrize(("form", "mean", "sd", "margin", "noise", "n_now"), [
    (Form.GREATER, 0.5, 1.5, 0.0, 0.1, 5),
    (Form.EQUIVALENT, 0.02, 0.5, 0.25, 0.05, 6),
])
def test_predicted_tokens_decide_80_percent(form: Form, mean: float, sd: float, margin: float, noise: float,
                                            n_now: int) -> None:
    tokens_now = 6144
    budget = decide_interval(form, n_now, mean, sd, -10.0, 10.0, margin=margin, noise=noise,
                             tokens=tokens_now).budget
    assert budget is not None and budget.tokens is not None and budget.tokens > tokens_now
    sd_then = sd * np.sqrt(tokens_now / budget.tokens)  # the stated assumption: paired variance ∝ 1/tokens
    rate = _decided_fraction(form, mean, sd_then, n_now, margin, noise, np.random.default_rng(25))
    assert abs(rate - 0.80) <= 0.05, (budget, rate)


def test_budget_towards_refutation() -> None:
    v = decide(Form.GREATER, [-0.4, -1.9, 0.3], noise=0.05, tokens=6144)
    assert v.outcome is Outcome.INCONCLUSIVE and v.budget is not None
    assert v.budget.towards is Outcome.REFUTED and v.budget.seeds is not None and v.budget.seeds > 3
    rate = _decided_fraction(Form.LESS, v.mean - 0.0, v.sd, v.budget.seeds, 0.0, 0.05,
                             np.random.default_rng(26))
    assert abs(rate - 0.80) <= 0.05


def test_power_is_exact_against_simulation_at_small_n() -> None:
    rng = np.random.default_rng(27)
    assert abs(power.one_sided_power(1.0, 1.0, 4) - _decided_fraction(Form.GREATER, 1.0, 1.0, 4, 0, 0, rng)) < 0.035
    tost = _decided_fraction(Form.EQUIVALENT, 0.0, 0.3, 4, 0.6, 0, rng)
    assert abs(power.tost_power(0.0, 0.3, 4, 0.6) - tost) < 0.035


def test_rule_decides_every_way() -> None:
    assert decide(Form.GREATER, [3.0, 3.1, 2.9]).outcome is Outcome.HOLDS
    assert decide(Form.GREATER, [-3.0, -3.1, -2.9]).outcome is Outcome.REFUTED
    assert decide(Form.LESS, [-3.0, -3.1, -2.9]).outcome is Outcome.HOLDS
    assert decide(Form.EQUIVALENT, [0.01, -0.01, 0.0], margin=0.5).outcome is Outcome.HOLDS
    assert decide(Form.EQUIVALENT, [1.0, 1.1, 0.9], margin=0.5).outcome is Outcome.REFUTED
    assert decide(Form.NON_INFERIOR, [0.0, 0.02, -0.02], margin=0.5).outcome is Outcome.HOLDS
    assert decide(Form.NON_INFERIOR, [-1.0, -1.1, -0.9], margin=0.5).outcome is Outcome.REFUTED
    assert decide(Form.NON_SUPERIOR, [1.0, 1.1, 0.9], margin=0.5).outcome is Outcome.REFUTED
    wide = decide(Form.EQUIVALENT, [-1.0, 1.0, 0.2], margin=0.5)
    assert wide.outcome is Outcome.INCONCLUSIVE and wide.budget is not None and wide.budget.seeds


def test_noise_widens_every_threshold() -> None:
    d = [1.0, 1.1, 0.9]  # 90% CI about (0.83, 1.17)
    assert decide(Form.GREATER, d, noise=0.5).outcome is Outcome.HOLDS
    assert decide(Form.GREATER, d, noise=0.9).outcome is Outcome.INCONCLUSIVE
    assert decide(Form.LESS, d, noise=0.9).outcome is Outcome.INCONCLUSIVE
    assert decide(Form.LESS, d, noise=0.5).outcome is Outcome.REFUTED
    assert decide(Form.EQUIVALENT, [0.0, 0.01, -0.01], margin=0.2, noise=0.19).outcome is Outcome.INCONCLUSIVE


def test_mean_within_noise_has_no_budget_but_says_why() -> None:
    v = decide(Form.GREATER, [0.3, -0.2, 0.1], noise=0.5, tokens=100)
    assert v.outcome is Outcome.INCONCLUSIVE and v.budget is not None
    assert v.budget.seeds is None and "numerical spread" in v.budget.reason and "no budget" in v.text()
    e = decide(Form.EQUIVALENT, [0.0, 0.1, -0.1], margin=0.1, noise=0.2)
    assert e.budget is not None and "not wider" in e.budget.reason


def test_upper_bound_reason_keeps_the_claims_orientation() -> None:
    """An upper-bound claim (θ < +margin) is decided on its mirror image; the reason it prints must still name
    the measured mean and the boundary as the claim states them (C4's step −1.31 against +0.158), not the
    mirror's (+1.31 against −0.158)."""
    v = decide(Form.NON_SUPERIOR, [-1.0, -1.3, -1.64], margin=0.158, noise=2.0)
    assert v.outcome is Outcome.INCONCLUSIVE and v.budget is not None and v.budget.seeds is None
    assert "-1.313" in v.budget.reason and "+0.158" in v.budget.reason, v.budget.reason
    w = decide(Form.LESS, [0.2, 0.1, 0.3], noise=0.5)
    assert w.budget is not None and "+0.2 " in w.budget.reason + " " and "+0 " in w.budget.reason + " "


@pytest.mark.parametrize("diffs", [[], [1.5]])
def test_fewer_than_two_seeds_is_never_a_verdict(diffs: list[float]) -> None:
    v = decide(Form.GREATER, diffs)
    assert v.outcome is Outcome.INCONCLUSIVE and "needs ≥ 2 seeds" in v.text()
    assert combine_all([deterministic(True), v]).text() == v.text()


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="positive margin"):
        decide(Form.EQUIVALENT, [1.0, 2.0])
    with pytest.raises(ValueError, match="numerical spread"):
        decide(Form.GREATER, [1.0, 2.0], noise=-1.0)
    with pytest.raises(ValueError, match="finite"):
        decide(Form.GREATER, [1.0, float("nan")])


def test_combine_all() -> None:
    hold = decide(Form.GREATER, [3.0, 3.1, 2.9])
    open_a = decide(Form.GREATER, [0.5, 1.5, 0.4], tokens=1000)
    open_b = decide(Form.GREATER, [0.5, 2.5, 0.1], tokens=1000)
    assert combine_all([hold, hold]).outcome is Outcome.HOLDS
    assert combine_all([hold, deterministic(False, "x")]).outcome is Outcome.FAILS
    assert combine_all([open_a, decide(Form.GREATER, [-3.0, -3.1, -2.9])]).outcome is Outcome.REFUTED
    both = combine_all([hold, open_a, open_b])
    assert both.outcome is Outcome.INCONCLUSIVE and both.budget is not None
    assert open_a.budget is not None and open_b.budget is not None
    assert both.budget.seeds == max(open_a.budget.seeds or 0, open_b.budget.seeds or 0)
    assert both.budget.tokens == max(open_a.budget.tokens or 0, open_b.budget.tokens or 0)


def test_equivalence_margin() -> None:
    on_scale = equivalence_margin(7.5)
    assert on_scale.value == 0.05 and "paper's ±0.05" in on_scale.basis
    scaled = equivalence_margin(23.0)
    assert scaled.value == pytest.approx(0.006 * 23.0) and "scaled" in scaled.basis


def test_verdict_serialises() -> None:
    v = decide(Form.EQUIVALENT, [-1.0, 1.0, 0.2], margin=0.5, noise=0.1, tokens=6144)
    d = v.to_dict()
    assert d["outcome"] == "inconclusive" and d["form"] == "equivalent" and d["budget"]["seeds"] == v.budget.seeds
    assert "seeds at today's tokens" in d["text"] and "tokens/cell at today's seeds" in d["text"]
    assert Budget(None, None, None, "x").text() == "no budget decides: x"

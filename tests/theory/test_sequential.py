"""The sequential rule (rope_quant.core.sequential, docs/verdicts.md), proved by simulation.

The same synthetic model as tests/theory/test_verdict_replicates.py: per seed ``θ_i = θ + u_i + e_i`` and, in the
other float order, ``θ + β + u_i + e'_i``; every seed replicated. Each scenario is 20 000 vectorised runs of a plan
with looks at 3 … 40 seeds (binomial sd 0.0015 at 5%). Checked:

* the rule read at every look is wrong (a "holds" or a "refuted" at *any* look up to M) in ≤ 5% of runs per side
  when one float order's effect lies on the boundary, with and without a bias;
* the naive reading (the fixed-n 90% interval after every seed) is wrong far more often, on the same runs;
* the expected seeds to a decision against the fixed-n budget (:func:`rope_quant.core.power.replicated_budget`),
  printed and bounded;
* the vectorised rule is the rule (:func:`rope_quant.core.sequential.decide`), run by run; the honest stop at M.

``PLAN`` is the ``normal`` boundary (the Pocock t rule): the numbers measured here are that rule's. The default
``skew_robust`` boundary is checked on the same normal scenarios here (``SHAPES``) and on skewed and heavy-tailed
laws, claims of parts and its seed cost in ``tests/theory/test_sequential_skew.py``.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from rope_quant.core import sequential
from rope_quant.core.boundary import Boundary, Shape
from rope_quant.core.sequential import Plan, PlanError, draw, expected_seeds, simulate
from rope_quant.core.verdict import FloatOrder, Form, Outcome, _bounds, budget_replicated

RUNS = 20_000
TOL = 0.015
PLAN = Plan(3, 40, shape=Shape.NORMAL)
SHAPES = [Shape.NORMAL, pytest.param(Shape.SKEW_ROBUST, marks=pytest.mark.slow)]
"""The skew-robust boundary on these normal scenarios is ``slow`` (the theory layer's time): the default layer
checks it on the normal law in tests/theory/test_sequential_skew.py."""


def test_per_look_level_lies_between_bonferroni_and_the_fixed_level() -> None:
    """α' is the Pocock level: above the Bonferroni split α / L (valid by the union bound alone), below α."""
    a = PLAN.alpha_look
    assert PLAN.looks == 38 and 0.05 / 38 < a < 0.05, a
    normal = Shape.NORMAL
    assert Plan(3, 3, shape=normal).alpha_look == 0.05 and Plan(3, 10, shape=normal).alpha_look > a  # fewer looks


# (form, margin, σ_u, σ_e, β, which order lies on the boundary)
SCENARIOS = [
    (Form.GREATER, 0.0, 1.0, 0.3, 0.0, "primary"),
    (Form.GREATER, 0.0, 1.0, 1.0, 0.0, "primary"),
    (Form.GREATER, 0.0, 0.3, 1.0, -1.0, "replicate"),
    (Form.GREATER, 0.0, 1.0, 0.3, 1.0, "primary"),
    (Form.LESS, 0.0, 1.0, 1.0, 1.0, "replicate"),
    (Form.EQUIVALENT, 0.5, 0.3, 0.3, 0.4, "replicate"),
    (Form.NON_SUPERIOR, 0.158, 0.85, 1.0, 0.5, "replicate"),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("index", "form", "margin", "su", "se", "beta", "on"),
                         [(i, *s) for i, s in enumerate(SCENARIOS)])
def test_wrong_at_most_five_percent_over_all_looks(index: int, form: Form, margin: float, su: float, se: float,
                                                   beta: float, on: str, shape: Shape) -> None:
    """One float order's effect on the boundary: "holds" at any look ≤ 5% (±1.5%), and "refuted" at any look
    ≤ 5% (the other side of the same boundary); the fixed-n 90% interval read after every seed says "holds" in
    more than 5% of the same runs (measured 2026-11-28, these runs: 7.7–23.9% against 0.5–4.5% for the
    sequential rule)."""
    side, b = _bounds(form, margin)
    theta = b if on == "primary" else b - beta
    primary, replicate = draw(theta, beta, su, se, RUNS, PLAN.max_seeds, seed=200 + index)
    seq = simulate(form, margin, primary, replicate, Plan(3, 40, shape=shape).boundary)
    naive = simulate(form, margin, primary, replicate, Boundary.fixed(PLAN.first, PLAN.max_seeds, 0.05))
    wrong_holds, wrong_refuted = seq["holds"].any(1).mean(), seq["refuted"].any(1).mean()
    print(f"{form.value} {on} β={beta}: sequential holds {wrong_holds:.4f} refuted {wrong_refuted:.4f}; "
          f"naive holds {naive['holds'].any(1).mean():.4f}")
    assert wrong_holds <= 0.05 + TOL and wrong_refuted <= 0.05 + TOL, (wrong_holds, wrong_refuted)
    assert naive["holds"].any(1).mean() > 0.05 + TOL, naive["holds"].any(1).mean()


def test_the_naive_reading_is_wrong_far_more_often() -> None:
    """No bias, σ_u = 1, σ_e = 0.3, the primary order on the boundary: the 90% interval read after each of 3 … 40
    seeds says "holds" at some look in about 17% of runs, more than three times the 5% it promises at one look;
    the sequential rule in about 2.5% (measured 2026-11-28 on the runs of seed 200)."""
    primary, replicate = draw(0.0, 0.0, 1.0, 0.3, RUNS, PLAN.max_seeds, seed=200)
    naive = simulate(Form.GREATER, 0.0, primary, replicate, Boundary.fixed(3, 40, 0.05))["holds"].any(1).mean()
    seq = simulate(Form.GREATER, 0.0, primary, replicate, PLAN.boundary)["holds"].any(1).mean()
    assert naive > 3 * 0.05 and seq <= 0.05, (naive, seq)


# (form, margin, θ, β, σ_u, σ_e): the fixed-n budget cases of test_verdict_replicates.py, and a large effect
BUDGETS = [
    (Form.GREATER, 0.0, 1.0, 0.0, 1.0, 0.5),
    (Form.GREATER, 0.0, 1.5, -0.5, 1.0, 1.0),
    (Form.LESS, 0.0, -1.0, 0.3, 1.0, 1.5),
    (Form.NON_SUPERIOR, 0.158, -1.0, 0.0, 0.85, 2.0),
    (Form.EQUIVALENT, 0.6, 0.1, 0.0, 1.0, 0.7),
    (Form.GREATER, 0.0, 3.0, 0.0, 1.0, 0.5),
]


@pytest.mark.parametrize(("form", "margin", "theta", "beta", "su", "se"), BUDGETS)
def test_expected_seeds_against_the_fixed_n_budget(form: Form, margin: float, theta: float, beta: float, su: float,
                                                   se: float) -> None:
    """The expected seeds to a decision (a run open at M = 40 counts 40) beside the fixed-n budget at 80% power
    (n = 3 today, every seed replicated). Where the fixed-n budget is at most M / 2 the sequential rule decides
    ≥ 95% of runs by M, with expected seeds at most 1.5× that budget (measured 2026-11-28: 13.4 vs 11,
    16.9 vs 14, 4.7 vs 4, deciding 99.8%, 97.6%, 100%), never towards the wrong side."""
    sd, sd_d = math.hypot(su, se), math.sqrt(2) * se
    interval = (beta - 0.01, beta) if beta > 0 else (beta, beta + 0.01) if beta < 0 else (-1.0, 1.0)
    budget = budget_replicated(form, 3, theta, sd, FloatOrder(3, (), sd_d, beta, *interval, 0.0, 0.0),
                               margin=margin, tokens=6144)
    assert budget.seeds is not None
    e = expected_seeds(form, margin, theta, beta, su, se, PLAN, runs=RUNS)
    print(f"{form.value} θ={theta} β={beta}: fixed-n budget {budget.seeds} seeds; sequential expected "
          f"{e.seeds:.1f} seeds, decided by {PLAN.max_seeds}: {e.decided:.3f}")
    assert e.refuted <= 0.005, e
    if budget.seeds <= PLAN.max_seeds // 2:
        assert e.decided >= 0.95 and e.seeds <= 1.5 * budget.seeds, (budget.seeds, e)
    else:
        assert e.seeds > budget.seeds * 0.6, (budget.seeds, e)  # no free lunch where the fixed-n budget is large


@pytest.mark.parametrize(("shape", "parts", "theta"),
                         [(Shape.NORMAL, 1, 0.9), (Shape.SKEW_ROBUST, 1, 1.8), (Shape.SKEW_ROBUST, 3, -1.8)])
def test_the_vectorised_rule_is_the_rule(shape: Shape, parts: int, theta: float) -> None:
    """simulate's decision at each look equals sequential.decide on the same seeds, run by run, for each boundary
    and for a part of a claim of 3 parts (its refuted side at α/3)."""
    plan = Plan(3, 8, shape=shape, parts=parts)
    primary, replicate = draw(theta, -0.3, 1.0, 0.5, 30, plan.max_seeds, seed=7)
    out = simulate(Form.GREATER, 0.0, primary, replicate, plan.boundary)
    seen = set()
    for i in range(30):
        for j, n in enumerate(range(plan.first, plan.max_seeds + 1)):
            v = sequential.decide(Form.GREATER, primary[i, :n], replicate[i, :n] - primary[i, :n], plan)
            assert (v.outcome is Outcome.HOLDS) == out["holds"][i, j], (i, n)
            assert (v.outcome is Outcome.REFUTED) == out["refuted"][i, j], (i, n)
            assert v.rule == sequential.RULE_SEQUENTIAL
            seen.add(v.outcome)
    assert {Outcome.HOLDS if parts == 1 else Outcome.REFUTED, Outcome.INCONCLUSIVE} <= seen


def test_an_open_claim_stops_at_m_with_its_reason() -> None:
    """At M: a mean within a hair of a narrow margin reads "not resolvable at this margin" with the distance; a
    claim that more seeds would decide reads "undecided within M" with the fixed-n budget; below M: "open at
    look j". The reason is in the verdict, its text and its dict (the claims JSON)."""
    rng = np.random.default_rng(5)
    plan = Plan(3, 6, shape=Shape.NORMAL)
    near = 0.15 + rng.normal(0, 1.0, 6)  # NON_SUPERIOR at 0.154: the effect sits at its margin
    shifts = rng.normal(0, 0.3, 6)
    v = sequential.decide(Form.NON_SUPERIOR, near, shifts, plan, margin=0.154)
    assert v.outcome is Outcome.INCONCLUSIVE and v.stop, v
    assert "not resolvable" in v.stop and "of its boundary +0.154" in v.text() and v.to_dict()["stop"] == v.stop
    early = sequential.decide(Form.NON_SUPERIOR, near[:4], shifts[:4], plan, margin=0.154)
    assert early.stop == "" and "open at look 2 of 4" in early.text()
    real = 0.9 + np.array([0.5, -1.2, 0.9, -0.8, 1.4, -1.0])  # an effect ~1 sd from 0 at 6 seeds
    w = sequential.decide(Form.GREATER, real, np.array([0.1, -0.1, 0.05, 0.0, -0.05, 0.1]), plan)
    assert w.outcome is Outcome.INCONCLUSIVE and "undecided within 6 seeds" in w.stop, w.stop


def test_bad_plans_and_missing_replicates() -> None:
    with pytest.raises(PlanError, match="below the 5 seeds given"):
        Plan(5, 4)
    with pytest.raises(PlanError, match="at least 2 seeds"):
        Plan(1, 4)
    with pytest.raises(PlanError, match="outside the plan"):
        sequential.decide(Form.GREATER, [1.0] * 7, [0.0] * 7, Plan(3, 6, shape=Shape.NORMAL))
    v = sequential.decide(Form.GREATER, [3.0, 3.1, 2.9], [0.1, 0.0], Plan(3, 6, shape=Shape.NORMAL))
    assert v.outcome is Outcome.INCONCLUSIVE and "needs every seed replicated" in v.text()


def test_futility_stops_a_claim_far_from_decidable_and_never_a_decidable_one() -> None:
    """C2's shape (an equivalence at ±0.141 with the effect near its margin, σ ≈ 1.2): at 5 seeds its predictive
    chance of a decision by 40 is still 0.20 (the noise of 5 seeds), at 8 it is below 10%, so it stops for
    futility there with that reason and the fixed-n budget; a claim whose effect is 1 sd past its boundary keeps a
    high chance and is not stopped; with futility off nothing stops. The chance is reproducible (a fixed seed)."""
    rng = np.random.default_rng(11)
    diffs = -0.25 + rng.normal(0, 1.2, 8)
    shifts = rng.normal(0, 1.2, 8)
    chance = sequential.predictive_power(Form.EQUIVALENT, 0.141, diffs, shifts, PLAN)
    assert 0.0 <= chance < 0.10 and chance == sequential.predictive_power(Form.EQUIVALENT, 0.141, diffs, shifts, PLAN)
    assert sequential.predictive_power(Form.EQUIVALENT, 0.141, diffs[:5], shifts[:5], PLAN) > 0.10
    v = sequential.decide(Form.EQUIVALENT, diffs, shifts, PLAN, margin=0.141)
    assert v.outcome is Outcome.INCONCLUSIVE and v.stop.startswith("stopped for futility at 8 seeds"), v
    assert "not resolvable" in v.stop and "within 40 seeds" in v.stop and "fixed-n rule would need" in v.stop
    assert not sequential.open_at(v, 8, PLAN) and v.to_dict()["stop"] == v.stop
    assert sequential.decide(Form.EQUIVALENT, diffs[:5], shifts[:5], PLAN, margin=0.141).stop == ""
    no_stop = Plan(3, 40, futility=0.0, shape=Shape.NORMAL)
    assert sequential.decide(Form.EQUIVALENT, diffs, shifts, no_stop, margin=0.141).stop == ""
    clear = 1.0 + np.array([0.5, -1.2, 0.9, -0.8, 1.4])  # GREATER, mean 1.16, sd 1.1: decidable within 40
    small = np.array([0.1, -0.1, 0.05, 0.0, -0.05])
    assert sequential.predictive_power(Form.GREATER, 0.0, clear, small, PLAN) > 0.8  # measured 0.89
    assert sequential.decide(Form.GREATER, clear, small, PLAN).stop == ""
    with pytest.raises(PlanError, match="futility"):
        Plan(3, 40, futility=1.0)


def test_a_claim_of_parts_stops_when_every_open_part_has_or_none_can_still_refute_it() -> None:
    """combine_all: while one part is open and could still be refuted (or was not judged), the claim is open (no
    stop), whichever part comes first; once one part has stopped (the claim cannot hold) and no open part is likely
    to be refuted, the claim stops with the stopped part's reason and says why."""
    from rope_quant.core.verdict import Verdict, combine_all

    stopped = Verdict(Outcome.INCONCLUSIVE, Form.GREATER, 5, stop="stopped for futility at 5 seeds")
    open_ = Verdict(Outcome.INCONCLUSIVE, Form.GREATER, 5, note="open at look 3 of 38")
    assert combine_all([stopped, open_]).stop == "" and combine_all([open_, stopped]).stop == ""
    assert combine_all([stopped, replace(open_, refutable=True)]).stop == ""
    assert combine_all([stopped, replace(stopped, n=6)]).stop.startswith("stopped for futility")
    for parts in ([stopped, replace(open_, refutable=False)], [replace(open_, refutable=False), stopped]):
        v = combine_all(parts)
        assert v.stop.startswith("stopped for futility at 5 seeds") and "cannot hold" in v.stop, v.stop
        assert not sequential.open_at(v, 5, PLAN)
    assert combine_all([replace(open_, refutable=False)] * 2).stop == ""  # nothing stopped: the claim may hold


def test_an_open_part_says_whether_it_could_still_be_refuted() -> None:
    """C4's step shape (NON_SUPERIOR at +0.16, 11 seeds, σ ≈ 1.5): a step measured at −0.5 is open, and its chance
    of being refuted (a rise beyond +0.16) by 40 seeds is below 10% (measured 0.000); measured at +1.0 it is 0.45. The
    two chances add up to the chance of a decision (:func:`predictive_power`)."""
    rng = np.random.default_rng(5)
    noise, shifts = rng.normal(0, 1.5, 11), rng.normal(0, 0.8, 11)
    falling = sequential.decide(Form.NON_SUPERIOR, -0.5 + noise - noise.mean(), shifts, PLAN, margin=0.16)
    rising = sequential.decide(Form.NON_SUPERIOR, 1.0 + noise - noise.mean(), shifts, PLAN, margin=0.16)
    assert falling.outcome is Outcome.INCONCLUSIVE and not falling.stop and falling.refutable is False, falling
    assert rising.outcome is Outcome.INCONCLUSIVE and not rising.stop and rising.refutable is True, rising
    holds, refuted = sequential.predictive_chances(Form.NON_SUPERIOR, 0.16, 1.0 + noise - noise.mean(), shifts, PLAN)
    assert refuted > holds and abs(holds + refuted - sequential.predictive_power(
        Form.NON_SUPERIOR, 0.16, 1.0 + noise - noise.mean(), shifts, PLAN)) < 1e-12


DEFAULT_PLAN = Plan(3, 12, shape=Shape.NORMAL)


def _synthetic_claim(theta: float, computed: list[int], plan: Plan = DEFAULT_PLAN):
    """evaluate(seeds) of a claim whose per-seed cells are memoised: ``computed`` records each seed built once."""
    memo: dict[int, tuple[float, float]] = {}

    def evaluate(seeds: tuple[int, ...]):
        for s in seeds:
            if s not in memo:
                computed.append(s)
                rng = np.random.default_rng(s)
                d = theta + rng.normal(0, 1.0)
                memo[s] = (d, rng.normal(0, 0.3))
        diffs = [memo[s][0] for s in seeds]
        shifts = [memo[s][1] for s in seeds]
        return (sequential.decide(Form.GREATER, diffs, shifts, plan), len(seeds))

    return evaluate


def test_until_decided_adds_one_seed_per_look_and_stops() -> None:
    """A real effect (θ = 2 sd) is decided before M, each seed built once; a null effect runs to M = 12 and stops
    with its reason; a time budget stops between looks and says so."""
    built: list[int] = []
    looked = sequential.until_decided(_synthetic_claim(2.0, built), lambda r: r[0], (0, 1, 2), DEFAULT_PLAN)
    assert looked.result[0].outcome is Outcome.HOLDS and looked.stopped == "decided" and len(looked.seeds) < 12
    assert built == list(range(len(looked.seeds)))  # one new seed per look, none rebuilt
    assert all("seeds so far" in line and "s per seed measured" in line for line in looked.lines)
    null: list[int] = []
    no_futility = Plan(3, 12, futility=0.0, shape=Shape.NORMAL)
    looked = sequential.until_decided(_synthetic_claim(0.0, null, no_futility), lambda r: r[0], (0, 1, 2),
                                      no_futility)
    assert looked.seeds == tuple(range(12)) and looked.result[0].stop and "last look" in looked.stopped
    futile = sequential.until_decided(_synthetic_claim(0.0, []), lambda r: r[0], (0, 1, 2), DEFAULT_PLAN)
    assert futile.stopped.startswith("stopped for futility") and 5 <= len(futile.seeds) < 12, futile.stopped
    ticks = iter(range(0, 10_000, 10))  # a clock: 10 s per reading
    timed = sequential.until_decided(_synthetic_claim(0.0, [], no_futility), lambda r: r[0], (0, 1, 2), no_futility,
                                     time_budget=45.0, started=0.0, clock=lambda: float(next(ticks)))
    assert timed.stopped.startswith("time budget 45 s") and 3 < len(timed.seeds) < 12, timed


def test_the_interval_is_named_at_its_per_look_level() -> None:
    """A sequential verdict's low/high are the per-look interval (1 − 2α'), and its name says so; the fixed-n
    rule's stays "90% CI". Measured: at looks 3 … 40 the interval is 98.8%, not the 90% the claims table printed."""
    from scipy import stats as st

    from rope_quant.core.verdict import paired_claim as fixed_claim

    diffs, shifts = np.array([4.0, 6.0, 5.0, 3.5, 6.5]), np.array([0.2, -0.1, 0.3, 0.0, -0.2])
    v = sequential.decide(Form.GREATER, diffs, shifts, PLAN)
    half = st.t.ppf(1 - PLAN.alpha_look, 4) * diffs.std(ddof=1) / math.sqrt(5)
    assert v.low == pytest.approx(diffs.mean() - half) and v.level == pytest.approx(1 - 2 * PLAN.alpha_look)
    assert v.ci_name == "98.8% CI" and v.to_dict()["level"] == v.level
    assert fixed_claim(Form.GREATER, diffs + 1, np.ones(5), replicates=None).ci_name == "90% CI"


def test_a_resumed_run_projects_the_next_seed_from_its_cost_not_from_the_memoised_ones() -> None:
    """Resumed from a memo, the seeds already computed cost ~0 s and the new ones their real cost (here 100 s):
    the time budget (250 s) stops the run after the second new seed, and the progress prints 100 s per seed. (The
    mean over all added seeds read 100 / 8 = 12.5 s after the first new seed, so a third new seed was started.)"""
    clock = [0.0]
    memo = set(range(10))  # seeds 0-9 in the memo: free
    plan = Plan(3, 40, futility=0.0, shape=Shape.NORMAL)

    def evaluate(seeds: tuple[int, ...]):
        for s in seeds:
            if s not in memo:
                memo.add(s)
                clock[0] += 100.0
        diffs = [float(np.random.default_rng(s).normal(0, 1)) for s in seeds]
        return sequential.decide(Form.GREATER, diffs, [0.1] * len(seeds), plan)

    looked = sequential.until_decided(evaluate, lambda v: v, (0, 1, 2), plan, time_budget=250.0, started=0.0,
                                      clock=lambda: clock[0])
    assert looked.seeds == tuple(range(12)), looked.seeds
    assert looked.stopped.startswith("time budget 250 s: the next seed would pass it"), looked.stopped
    assert "100.0 s per seed" in looked.lines[-1], looked.lines[-1]

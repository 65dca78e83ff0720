"""The sequential rule: the claims' rule read after every added seed, valid under repeated looks (docs/verdicts.md).

The fixed-n rule (:mod:`rope_quant.core.verdict`) decides on the union of the primary paired interval ``A`` and
the float-order replicate interval ``B``, each at 90% (5% per side). Read after every new seed, those intervals
are wrong far more often than 5%: every look is another chance to clear the boundary by luck. The sequential
rule keeps the same structure and spends the 5% over the planned looks (a group-sequential Pocock boundary):

* the **plan**: looks at ``n = n0, n0 + 1, …, M`` seeds (``n0`` the seeds given, ``M`` the most the run may
  use), every seed replicated (``k = n``: ``B`` is the replicate order's own paired t interval, exact);
* at every look both intervals are read at the plan's **boundary** (:mod:`rope_quant.core.boundary`). The
  default, ``skew_robust``, is Hall's skewness-corrected t against critical values taken least-favourably over
  a family of per-seed laws (normal, t₃, gamma at skewness ±1, ±2), so the error bound below holds for skewed
  and heavy-tailed seeds; ``normal`` is the paired t interval at one Pocock level ``α'`` per side, described
  next, valid for normal seeds and cheaper in seeds (docs/verdicts.md);
* a claim of ``P`` parts (refuted if any part is) spends its refuted side at ``α / P`` per part
  (:attr:`Plan.parts`); its holds side needs no adjustment (every part must hold);
* ``α'`` is the **Pocock level for the t statistic**: the largest ``α'`` with
  ``P(some look n in n0…M has t_n > t_{1−α'}(n − 1)) ≤ α`` when the effect lies on the boundary. For normal
  per-seed differences the sequence ``t_n0 … t_M`` of one float order is pivotal: its law does not depend on
  the mean or the variance. So ``α'`` is computed once per ``(n0, M)`` from standard normal paths
  (:func:`rope_quant.core.boundary.per_look_alpha`, 50 000 paths from a fixed seed, the α-quantile of each
  path's smallest one-sided p taken at its 99% lower confidence bound), and it holds for every variance. It is
  never below the Bonferroni split ``α / L`` (``L = M − n0 + 1``), which is valid by the union bound alone;
* **validity**: the union of ``A`` and ``B`` reads a wrong "holds" (or "refuted") only if the interval of the
  float order whose effect lies on the boundary clears it at some look, which has probability ≤ α per side,
  summed over every look up to ``M``. Looking less often (a batch of seeds at a time) only removes looks;
* a claim still open at ``M`` stops with its reason (:func:`stop_reason`): the distance of its effect from
  the boundary and the seeds the fixed-n rule would need to resolve it ("not resolvable at this margin" when
  that is far beyond ``M``), or why no number of seeds decides it;
* **futility** (non-binding stochastic curtailment): from ``futility_from`` seeds on, a claim whose predictive
  chance of a decision by ``M`` is below ``futility`` stops early with that reason (:func:`predictive_power`: the
  rule run over simulated remaining seeds, the effect, bias and noises drawn from their uncertainty at the seeds
  so far). It only ever removes decisions, so the error bound above stands; it saves the seeds a claim far from
  decidable would spend. A claim of parts (:func:`rope_quant.core.verdict.combine_all`) stops as well once one
  part has stopped (so the claim cannot hold) and every part still open has a predictive chance of being refuted
  below ``futility`` (:func:`predictive_chances`; ``Verdict.refutable``).

:func:`simulate` is the rule vectorised over runs and looks (numpy), for the proof by simulation
(``tests/theory/test_sequential.py``) and for :func:`expected_seeds`, the expected seeds to a decision. Standard
library only at import time; numpy/scipy when a number is computed.

Over 500 lines because the plan, the per-look reading, its stops, the replay and the until-decided loop share one
reading of the rule; the boundary is boundary.py's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from rope_quant.core.boundary import DEFAULT_SHAPE, Boundary, Shape, bounds, critical_values
from rope_quant.core.outlier import flag
from rope_quant.core.verdict import (
    Form,
    Outcome,
    Verdict,
    _bounds,
    decide_replicated,
)
from rope_quant.defaults import DEFAULT_FUTILITY, DEFAULT_MAX_SEEDS

ALPHA = 0.05
"""The error per side, spent over every look of the plan."""
RULE_SEQUENTIAL = "union of the primary and the float-order replicate intervals, alpha spent over the looks"
"""The rule name a sequential verdict carries (claims JSON ``rule``)."""
UNRESOLVABLE_FACTOR = 10
"""A claim open at M whose fixed-n budget at the stop exceeds this many times M reads "not resolvable"."""
_CALIBRATION_SEED = 20261128
"""The fixed seed of the futility stop's simulated continuations."""
FUTILITY_FROM = 5
"""The fewest seeds at which futility is judged (fewer estimate the noises too loosely)."""


class PlanError(ValueError):
    """A sequential plan that cannot be run (its message names the bound and the remedy)."""


@dataclass(frozen=True)
class Plan:
    """Looks at ``first`` (n0) … ``max_seeds`` (M) seeds; ``alpha`` per side spent over them under the boundary
    ``shape`` (:mod:`rope_quant.core.boundary`: skew-robust by default, ``normal`` is the Pocock t rule that
    assumes normal per-seed effects); a claim of ``parts`` parts spends its refuted side at α / parts (it is
    refuted if any part is: Bonferroni, which is Holm's first step, the only one that decides the claim); an open
    claim stops for futility from ``futility_from`` seeds when its chance of a decision by M is below
    ``futility`` (0 turns that off)."""

    first: int
    max_seeds: int = DEFAULT_MAX_SEEDS
    alpha: float = ALPHA
    futility: float = DEFAULT_FUTILITY
    futility_from: int = FUTILITY_FROM
    shape: Shape = DEFAULT_SHAPE
    parts: int = 1

    def __post_init__(self) -> None:
        if self.first < 2:
            raise PlanError(f"the sequential rule needs at least 2 seeds at its first look, got {self.first}")
        if self.max_seeds < self.first:
            raise PlanError(f"max seeds {self.max_seeds} is below the {self.first} seeds given: raise it to at "
                            f"least {self.first}")
        if not 0.0 < self.alpha < 0.5:
            raise PlanError(f"alpha must lie in (0, 0.5), got {self.alpha}")
        if not 0.0 <= self.futility < 1.0:
            raise PlanError(f"futility must lie in [0, 1), got {self.futility}")
        if self.parts < 1:
            raise PlanError(f"a claim has at least 1 part, got {self.parts}")
        object.__setattr__(self, "shape", Shape(self.shape))

    @property
    def looks(self) -> int:
        """L = M − n0 + 1 planned looks."""
        return self.max_seeds - self.first + 1

    @property
    def alpha_look(self) -> float:
        """The one-look level per side of the "holds" side (α' of the Pocock t rule for the normal shape)."""
        return self.boundary.alpha_look

    @property
    def boundary(self) -> Boundary:
        """The critical values per look (:func:`rope_quant.core.boundary.critical_values`)."""
        a, holds = critical_values(self.first, self.max_seeds, self.alpha, self.shape)
        refuted = holds if self.parts == 1 else critical_values(self.first, self.max_seeds,
                                                                 self.alpha / self.parts, self.shape)[1]
        return Boundary(self.first, self.shape, holds, refuted, a)

    def with_parts(self, parts: int) -> Plan:
        """This plan for one part of a claim of ``parts`` parts."""
        return replace(self, parts=parts)

    def describe(self) -> str:
        parts = f"; refuted side at α/{self.parts} (claim of {self.parts} parts)" if self.parts > 1 else ""
        return (f"sequential ({self.shape.value} boundary): looks at {self.first}…{self.max_seeds} seeds, every "
                f"seed replicated, α {self.alpha:g} per side over all looks ({self.alpha_look:.3g} per look){parts}")


def decide(form: Form, diffs: Sequence[float], shifts: Sequence[float] | str | None, plan: Plan, *,
           margin: float = 0.0, tokens: int | None = None) -> Verdict:
    """The sequential rule at one look: ``diffs`` the per-seed paired differences so far (``n`` of them,
    ``plan.first ≤ n ≤ plan.max_seeds``), ``shifts`` the replicate shift of every one of them. Decided: the
    verdict at the per-look level. Open below M: inconclusive, "open at look j of L". Open at M: the stop
    (:func:`stop_reason`) in ``Verdict.stop``. Either way the verdict carries the outlier flag of its seeds so far
    (:func:`rope_quant.core.outlier.flag`: seeds farther from the others than normal seeds go)."""
    v = _decide(form, diffs, shifts, plan, margin=margin, tokens=tokens)
    mark = flag(diffs, plan.max_seeds, plan.shape)
    return v if mark is None else replace(v, outlier=mark)


def _decide(form: Form, diffs: Sequence[float], shifts: Sequence[float] | str | None, plan: Plan, *,
            margin: float, tokens: int | None) -> Verdict:
    """:func:`decide` without the outlier flag."""
    n = len(diffs)
    if not plan.first <= n <= plan.max_seeds:
        raise PlanError(f"{n} seeds lie outside the plan's looks {plan.first}…{plan.max_seeds}")
    look = n - plan.first + 1
    if isinstance(shifts, str) or shifts is None or len(shifts) != n:
        why = (shifts if isinstance(shifts, str) else
               "no numerical replicate" if shifts is None else f"{len(shifts)} of {n} seeds replicated")
        v = decide_replicated(form, diffs, shifts if isinstance(shifts, str) or shifts is None else list(shifts),
                              margin=margin, tokens=tokens, with_budget=False)
        return replace(v, outcome=Outcome.INCONCLUSIVE, budget=None, rule=RULE_SEQUENTIAL,
                       note=f"the sequential rule needs every seed replicated ({why})")
    v = read(form, margin, diffs, shifts, plan, tokens=tokens)
    where = f"look {look} of {plan.looks} ({n} seeds), {plan.alpha_look:.3g} per side per look"
    if v.decided:
        return replace(v, note=where)
    if n < plan.max_seeds:
        v = replace(v, note=f"open at {where}")
        if plan.futility > 0 and n >= max(plan.futility_from, plan.first + 1):
            holds, refuted = _predictive_counts(form, margin, diffs, shifts, plan, FUTILITY_RUNS, _CALIBRATION_SEED)
            chance = (holds + refuted) / FUTILITY_RUNS
            if chance < plan.futility:
                fixed = decide_replicated(form, diffs, shifts, margin=margin, tokens=tokens)
                return replace(v, stop=futility_reason(form, margin, v, fixed, plan, chance))
            return replace(v, refutable=refuted / FUTILITY_RUNS >= plan.futility)
        return v
    fixed = decide_replicated(form, diffs, shifts, margin=margin, tokens=tokens)
    return replace(v, stop=stop_reason(form, margin, v, fixed, plan))


def read(form: Form, margin: float, diffs: Sequence[float], shifts: Sequence[float], plan: Plan, *,
         tokens: int | None = None) -> Verdict:
    """The plan's boundary at the look of ``len(diffs)`` seeds, every seed replicated: the primary interval A and
    the replicate order's interval B at the "holds" critical value (the verdict's ``low``/``high`` and
    ``float_order.low_b``/``high_b``), their union read for "holds", and the same at the "refuted" critical value
    for "refuted" (wider for a claim of parts). The numbers the interval does not change (σ_num, the bias) are
    :func:`rope_quant.core.verdict.decide_replicated`'s."""
    import numpy as np

    from rope_quant.core.power import masks

    n = len(diffs)
    base = decide_replicated(form, diffs, shifts, margin=margin, tokens=tokens, alpha=plan.alpha_look,
                             with_budget=False)
    if n < 2 or base.float_order is None or base.float_order.sigma is None:
        return replace(base, rule=RULE_SEQUENTIAL, level=plan.boundary.level)
    c_holds, c_refuted = plan.boundary.at(n)
    p = np.asarray([diffs], dtype=np.float64)
    q = p + np.asarray([shifts], dtype=np.float64)
    side, b = _bounds(form, margin)
    la, ha = (float(x[0, 0]) for x in bounds(p, n, [c_holds], plan.shape))
    lb, hb = (float(x[0, 0]) for x in bounds(q, n, [c_holds], plan.shape))
    holds, _ = masks(side, b, min(la, lb), max(ha, hb))
    ra, rha = (float(x[0, 0]) for x in bounds(p, n, [c_refuted], plan.shape))
    rb, rhb = (float(x[0, 0]) for x in bounds(q, n, [c_refuted], plan.shape))
    _, refuted = masks(side, b, min(ra, rb), max(rha, rhb))
    outcome = Outcome.HOLDS if holds else Outcome.REFUTED if refuted else Outcome.INCONCLUSIVE
    fo = replace(base.float_order, low_b=lb, high_b=hb)
    return replace(base, outcome=outcome, low=la, high=ha, float_order=fo, rule=RULE_SEQUENTIAL,
                   level=plan.boundary.level, shape=plan.shape.value, parts=plan.parts)


FUTILITY_RUNS = 4000
"""Simulated continuations behind :func:`predictive_power`."""


def predictive_power(form: Form, margin: float, diffs: Sequence[float], shifts: Sequence[float], plan: Plan,
                     runs: int = FUTILITY_RUNS, seed: int = _CALIBRATION_SEED) -> float:
    """The predictive chance that the rule decides the claim at a later look up to ``plan.max_seeds``
    (:func:`predictive_chances`, either way)."""
    holds, refuted = _predictive_counts(form, margin, diffs, shifts, plan, runs, seed)
    return (holds + refuted) / runs


def predictive_chances(form: Form, margin: float, diffs: Sequence[float], shifts: Sequence[float], plan: Plan,
                       runs: int = FUTILITY_RUNS, seed: int = _CALIBRATION_SEED) -> tuple[float, float]:
    """The predictive chances that the rule's first decision at a later look up to ``plan.max_seeds`` is holds,
    and that it is refuted: the seeds measured are kept, and each of ``runs`` continuations draws the remaining
    seeds from the model behind the rule (:func:`draw`) at values drawn from their uncertainty given the seeds so
    far (θ the mean paired difference, β the mean replicate shift, each with its t spread; σ_e² = var(shifts)/2
    and σ_u² = var(diffs) − σ_e², each scaled by (n − 1)/χ²(n − 1)). Averaging over that uncertainty, rather than
    plugging in the estimates, keeps a claim whose effect is merely noisy at a few seeds from being stopped. A
    fixed seed: reproducible."""
    holds, refuted = _predictive_counts(form, margin, diffs, shifts, plan, runs, seed)
    return holds / runs, refuted / runs


def _predictive_counts(form: Form, margin: float, diffs: Sequence[float], shifts: Sequence[float], plan: Plan,
                       runs: int, seed: int) -> tuple[int, int]:
    """How many of ``runs`` continuations first decide holds, and how many refuted (:func:`predictive_chances`)."""
    import numpy as np

    n, m = len(diffs), plan.max_seeds
    d = np.asarray(diffs, dtype=np.float64)
    sh = np.asarray(shifts, dtype=np.float64)
    rng = np.random.default_rng(seed)
    var_e = float(sh.var(ddof=1)) / 2.0
    var_u = max(float(d.var(ddof=1)) - var_e, 0.0)
    scale = (n - 1) / rng.chisquare(n - 1, (2, runs, 1))
    se, su = np.sqrt(var_e * scale[0]), np.sqrt(var_u * scale[1])
    theta = d.mean() + float(d.std(ddof=1)) / math.sqrt(n) * rng.standard_t(n - 1, (runs, 1))
    beta = sh.mean() + float(sh.std(ddof=1)) / math.sqrt(n) * rng.standard_t(n - 1, (runs, 1))
    u = rng.standard_normal((runs, m - n)) * su
    new_p = theta + u + rng.standard_normal((runs, m - n)) * se
    new_q = theta + beta + u + rng.standard_normal((runs, m - n)) * se
    p = np.hstack([np.broadcast_to(d, (runs, n)), new_p])
    q = np.hstack([np.broadcast_to(d + sh, (runs, n)), new_q])
    out = simulate(form, margin, p, q, plan.boundary)
    holds, refuted = out["holds"][:, n - plan.first + 1:], out["refuted"][:, n - plan.first + 1:]
    decided = holds | refuted
    first = decided.argmax(1)
    rows = np.arange(runs)
    any_ = decided.any(1)
    return int((any_ & holds[rows, first]).sum()), int((any_ & refuted[rows, first]).sum())


def futility_reason(form: Form, margin: float, v: Verdict, fixed: Verdict, plan: Plan, chance: float) -> str:
    """Why a claim stops before M: its chance of a decision by M at the effect measured so far, its distance from
    the boundary, and the fixed-n budget on the same data."""
    bound = _bound_text(form, margin)
    x = ("" if v.mean is None else
         f"; the effect sits within {distance(form, margin, v.mean):.3g} of its boundary {bound}")
    budget = fixed.budget
    need = (f"; the fixed-n rule would need {budget.seeds} seeds" if budget is not None and budget.seeds else "")
    resolvable = ("not resolvable at this margin within " if budget is not None and budget.seeds
                  and budget.seeds > UNRESOLVABLE_FACTOR * plan.max_seeds else "not resolvable within ")
    return (f"stopped for futility at {v.n} seeds: {resolvable}{plan.max_seeds} seeds (chance of a decision by "
            f"{plan.max_seeds} seeds at the values measured so far {chance:.0%}, below {plan.futility:.0%}){x}{need}")


def paired_claim(form: Form, treatment: Sequence[float], control: Sequence[float], plan: Plan, *,
                 replicates: Mapping[int, tuple[float, float]] | str | None, margin: float = 0.0,
                 tokens: int | None = None) -> Verdict:
    """:func:`rope_quant.core.verdict.paired_claim` under the sequential rule (``replicates``: seed index →
    (treatment, control) in the other float order, every seed's)."""
    if len(treatment) != len(control):
        raise ValueError(f"treatment has {len(treatment)} values but control has {len(control)}")
    diffs = [float(t) - float(c) for t, c in zip(treatment, control, strict=True)]
    if isinstance(replicates, str) or replicates is None:
        return decide(form, diffs, replicates, plan, margin=margin, tokens=tokens)
    shifts = [float(t) - float(c) - diffs[i] for i, (t, c) in sorted(replicates.items())]
    return decide(form, diffs, shifts, plan, margin=margin, tokens=tokens)


def _bound_text(form: Form, margin: float) -> str:
    """The claim's boundary as printed: ±margin for an equivalence, else the signed bound."""
    side, b = _bounds(form, margin)
    return f"±{b:.4g}" if side == "equivalent" else f"{b:+.4g}"


def distance(form: Form, margin: float, mean: float) -> float:
    """How far ``mean`` lies from the claim's boundary (for an equivalence, from the nearer of ±margin)."""
    side, b = _bounds(form, margin)
    return abs(abs(mean) - b) if side == "equivalent" else abs(mean - b)


def stop_reason(form: Form, margin: float, v: Verdict, fixed: Verdict, plan: Plan) -> str:
    """Why a claim open at the last look (``M`` seeds) stays open: the distance of the nearer float order's mean
    from the boundary and what the fixed-n rule's budget at the stop says (``fixed``: the fixed-n verdict on the
    same data)."""
    bound = _bound_text(form, margin)
    means = [m for m in (v.mean, None if v.float_order is None or v.float_order.bias is None or v.mean is None
                         else v.mean + v.float_order.bias) if m is not None]
    if not means:
        return f"open at the last look ({plan.max_seeds} seeds): {v.note or 'no interval'}"
    x = min(distance(form, margin, m) for m in means)
    head = f"open at the last look ({plan.max_seeds} seeds): the effect sits within {x:.3g} of its boundary {bound}"
    budget = fixed.budget
    if fixed.decided:
        return (f"{head}; the fixed-n 90% rule would read {fixed.outcome.value} here, which is not valid after "
                "repeated looks")
    if budget is None or budget.seeds is None:
        why = budget.reason if budget is not None and budget.reason else fixed.note or "no budget decides"
        return f"{head}: not resolvable ({why})"
    if budget.seeds > UNRESOLVABLE_FACTOR * plan.max_seeds:
        return (f"{head}: not resolvable at this margin (the fixed-n rule would need {budget.seeds} seeds, "
                f"more than {UNRESOLVABLE_FACTOR}× the {plan.max_seeds} allowed)")
    return (f"{head}: undecided within {plan.max_seeds} seeds (the fixed-n budget at the stop reads "
            f"{budget.seeds} seeds)")


# ----------------------------------------------------------------------------- the rule vectorised


def simulate(form: Form, margin: float, primary: Any, replicate: Any, boundary: Boundary) -> dict[str, Any]:
    """The rule at every look ``n = boundary.first … M`` over runs (rows), vectorised: ``primary`` (runs × M) the
    per-seed paired differences, ``replicate`` (runs × M) the same seeds in the other float order (every seed
    replicated); the intervals of :func:`read` at ``boundary`` (a plan's, or :meth:`Boundary.fixed` for one
    level at every look). Returns boolean arrays (runs × looks) ``holds`` / ``refuted`` at each look and, per
    run, the ``first`` decision (``"holds"`` / ``"refuted"`` / ``""``) as two masks and ``seeds`` (the seeds at
    the first decision, ``M`` when none)."""
    import numpy as np

    from rope_quant.core.power import masks

    p, q = np.asarray(primary, dtype=np.float64), np.asarray(replicate, dtype=np.float64)
    runs, m = p.shape
    first = boundary.first
    ns = np.arange(first, m + 1)
    looks = len(ns)
    side, b = _bounds(form, margin)
    la, ha = bounds(p, first, boundary.holds[:looks], boundary.shape)
    lb, hb = bounds(q, first, boundary.holds[:looks], boundary.shape)
    holds, _ = masks(side, b, np.minimum(la, lb), np.maximum(ha, hb))
    if boundary.refuted[:looks] != boundary.holds[:looks]:
        la, ha = bounds(p, first, boundary.refuted[:looks], boundary.shape)
        lb, hb = bounds(q, first, boundary.refuted[:looks], boundary.shape)
    _, refuted = masks(side, b, np.minimum(la, lb), np.maximum(ha, hb))
    decided = holds | refuted
    any_ = decided.any(1)
    idx = np.where(any_, decided.argmax(1), len(ns) - 1)
    rows = np.arange(runs)
    return {"holds": holds, "refuted": refuted, "first_holds": any_ & holds[rows, idx],
            "first_refuted": any_ & refuted[rows, idx], "seeds": np.where(any_, ns[idx], m)}


def draw(theta: float, beta: float, su: float, se: float, runs: int, m: int, seed: int) -> tuple[Any, Any]:
    """Synthetic paired data of the model behind the rule: per seed ``θ_i = θ + u_i + e_i`` and, in the other
    float order, ``θ + β + u_i + e'_i`` (seed noise σ_u, float-order noise σ_e, bias β)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    u = rng.normal(0.0, su, (runs, m))
    return theta + u + rng.normal(0.0, se, (runs, m)), theta + beta + u + rng.normal(0.0, se, (runs, m))


@dataclass(frozen=True)
class Expected:
    """The sequential rule's seeds to a decision at given true values: the mean (a run open at M counts M),
    the fraction decided by M, and the fraction decided towards each side."""

    seeds: float
    decided: float
    holds: float
    refuted: float


def expected_seeds(form: Form, margin: float, theta: float, beta: float, su: float, se: float, plan: Plan,
                   runs: int = 4000, seed: int = 20261128) -> Expected:
    """:class:`Expected` by simulation of ``runs`` runs of the plan at the true values."""
    p, q = draw(theta, beta, su, se, runs, plan.max_seeds, seed)
    out = simulate(form, margin, p, q, plan.boundary)
    return Expected(float(out["seeds"].mean()), float((out["first_holds"] | out["first_refuted"]).mean()),
                    float(out["first_holds"].mean()), float(out["first_refuted"].mean()))


# ----------------------------------------------------------------------------- adding seeds until decided


@dataclass(frozen=True)
class Looked:
    """What :func:`until_decided` did: the last evaluation, the seeds it used, why it stopped, the progress."""

    result: Any
    seeds: tuple[int, ...]
    stopped: str
    lines: tuple[str, ...]


@dataclass(frozen=True)
class Recorded:
    """One sampled part of a recorded claim: its form, per-seed differences and replicate shifts in seed order
    (a claims JSON verdict's ``diffs`` and ``float_order.shifts``), its margin and scored tokens."""

    form: Form
    diffs: Sequence[float]
    shifts: Sequence[float]
    margin: float = 0.0
    tokens: int | None = None


def replay_claim(parts: Sequence[Recorded], plan: Plan, fixed: Sequence[Verdict] = ()) -> Verdict:
    """A recorded claim read look by look as :func:`until_decided` would have read it: at each look every sampled
    part at the plan (its refuted side at α / P for P sampled parts), combined with the ``fixed`` parts (those
    without sampling error, as recorded) by :func:`rope_quant.core.verdict.combine_all`; the verdict at the first
    look that decides or stops, else at the last recorded look (open: more seeds than were recorded would be
    needed). This is how a decision is re-read under another boundary, M or futility level."""
    from rope_quant.core.verdict import combine_all

    if not parts:
        raise ValueError("replay needs at least one sampled part")
    seeds = len(parts[0].diffs)
    for part in parts:
        if len(part.diffs) != seeds:
            raise ValueError(f"the parts hold {len(part.diffs)} and {seeds} seeds: a claim's parts share its seeds")
        if len(part.shifts) != len(part.diffs):
            raise ValueError(f"{len(part.diffs)} differences but {len(part.shifts)} shifts: replay needs every "
                             "seed replicated")
    if seeds < plan.first:
        raise PlanError(f"{seeds} recorded seeds are fewer than the plan's first look ({plan.first})")
    at = plan.with_parts(len(parts)) if len(parts) > 1 else plan

    def look(n: int) -> Verdict:
        read = [decide(p.form, p.diffs[:n], p.shifts[:n], at, margin=p.margin, tokens=p.tokens) for p in parts]
        return read[0] if len(read) == 1 and not fixed else combine_all([*read, *fixed])

    v = look(plan.first)
    for n in range(plan.first + 1, min(seeds, plan.max_seeds) + 1):
        if not open_at(v, n - 1, plan):
            break
        v = look(n)
    return v


def replay(form: Form, diffs: Sequence[float], shifts: Sequence[float], plan: Plan, *, margin: float = 0.0,
           tokens: int | None = None) -> Verdict:
    """:func:`replay_claim` of a claim of one part (``diffs`` and ``shifts`` in seed order)."""
    return replay_claim([Recorded(form, diffs, shifts, margin, tokens)], plan)


def open_at(v: Verdict, n: int, plan: Plan) -> bool:
    """Still open: inconclusive below the last look and not stopped for futility (a claim of parts is open
    while any part is)."""
    return v.outcome is Outcome.INCONCLUSIVE and n < plan.max_seeds and not v.stop


def until_decided(evaluate: Any, verdict_of: Any, seeds: Sequence[int], plan: Plan, *,
                  time_budget: float | None = None, started: float | None = None, clock: Any = None,
                  log: Any = None, name: str = "claim") -> Looked:
    """``evaluate(seeds)`` at the seeds given, then, while ``verdict_of(result)`` is open (:func:`open_at`), at one
    more seed (the next integer after the largest) until the claim is decided, reaches ``plan.max_seeds``, or the
    next seed would pass ``time_budget`` seconds since ``started`` (default now; ``clock`` default
    ``time.perf_counter``). ``evaluate`` builds and memoises its own cells (every seed replicated), so only the
    new seed's cells are computed at each look. ``log(line)``: the progress (seeds so far, the seconds per seed,
    an ETA to M). The seconds per seed, which the time budget also uses, are the mean over the seeds added or the
    last one's, whichever is larger: a resumed run's memoised seeds cost ~0 s and must not shrink them."""
    import time

    now = clock or time.perf_counter
    t_start = now() if started is None else started
    current = tuple(int(s) for s in seeds)
    t0 = now()
    result = evaluate(current)
    lines: list[str] = []
    per_seed: float | None = None
    added = 0
    spent = 0.0
    while True:
        v = verdict_of(result)
        if not open_at(v, len(current), plan):
            stopped = ("decided" if v.decided else f"open at the last look ({plan.max_seeds} seeds)"
                       if len(current) >= plan.max_seeds else f"stopped for futility at {len(current)} seeds")
            break
        if per_seed is not None and time_budget is not None and now() - t_start + per_seed > time_budget:
            stopped = f"time budget {time_budget:g} s: the next seed would pass it (open at {len(current)} seeds)"
            break
        if time_budget is not None and now() - t_start > time_budget:
            stopped = f"time budget {time_budget:g} s spent (open at {len(current)} seeds)"
            break
        current = (*current, max(current) + 1)
        t0 = now()
        result = evaluate(current)
        last = now() - t0
        spent += last
        added += 1
        per_seed = max(spent / added, last)  # a resumed run's memoised seeds cost ~0 s: the last seed's cost rules
        line = (f"{name}: open, seeds so far {len(current)} of {plan.max_seeds}; {per_seed:.1f} s per seed "
                f"measured; ETA ≤ {per_seed * (plan.max_seeds - len(current)) / 60:.1f} min")
        lines.append(line)
        if log is not None:
            log(line)
    return Looked(result, current, stopped, tuple(lines))

"""One engine decides every claim: :func:`evaluate` reads a claim's cells from a store and applies the one rule.

For each part of the claim (registry.py): the treatment's and the control's value at every seed, the seeds'
float-order replicates (seed index → (treatment, control) in the other float order), the margin (the
equivalence margin of the comparator cell's mean ppl, :func:`rope_quant.core.verdict.equivalence_margin`: the
paper's ±0.05 PPL of Table 1, scaled off its ppl range), and the scored tokens per cell; then the fixed-n rule
(:func:`rope_quant.core.verdict.paired_claim`) or, with a plan, the sequential rule
(:func:`rope_quant.core.sequential.paired_claim`), both of docs/verdicts.md. A part without sampling error is
:func:`~rope_quant.core.verdict.deterministic`. The parts combine with
:func:`~rope_quant.core.verdict.combine_all`, in the claim's order.

Standard library and ``core/`` at import; numpy when a mean is computed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from rope_quant.claims.registry import (
    EVERY_SEED_FORMS,
    MEANS_FORMS,
    Claim,
    ClaimError,
    Diff,
    Level,
    MarginKind,
    Metric,
    Part,
    Side,
    Statistic,
)
from rope_quant.claims.stores import ReplicateValues, Store
from rope_quant.claims_json import holds_of
from rope_quant.core import verdict as rule
from rope_quant.core.verdict import Form, Margin, Outcome, Verdict

if TYPE_CHECKING:
    from rope_quant.core.sequential import Looked, Plan

Replicates = Mapping[int, tuple[float, float]] | str | None
"""``paired_claim``'s ``replicates``: seed index → (treatment, control) in the other float order, a str (why a
replicate failed to build), or None (no replicate exists)."""

RULE_FIXED = "fixed-n"
RULE_SEQUENTIAL = "sequential"


@dataclass(frozen=True)
class PartResult:
    """One part's verdict and the numbers it was read from (``margin`` None: the part has none)."""

    name: str
    verdict: Verdict
    treatment: tuple[float, ...]
    control: tuple[float, ...]
    margin: Margin | None
    tokens: int | None
    replicates: Replicates

    def numbers(self) -> dict[str, Any]:
        reps = self.replicates
        return {"treatment": list(self.treatment), "control": list(self.control),
                "margin": self.margin.value if self.margin else None,
                "margin_basis": self.margin.basis if self.margin else None, "tokens": self.tokens,
                "replicates": reps if isinstance(reps, str) or reps is None
                else {str(i): list(pair) for i, pair in reps.items()}}


@dataclass(frozen=True)
class ClaimResult:
    """A claim decided over a store: the combined verdict, each part's, the seeds and the rule it was read at."""

    claim: Claim
    seeds: tuple[int, ...]
    verdict: Verdict
    parts: tuple[PartResult, ...]
    rule: str

    @property
    def id(self) -> str:
        return self.claim.id

    @property
    def part_verdicts(self) -> dict[str, Verdict]:
        """Part name → verdict, in the claim's order."""
        return {p.name: p.verdict for p in self.parts}

    def to_dict(self, model: str | None = None) -> dict[str, Any]:
        """The claims JSON row (docs/verdicts.md, "The claims JSON"; ``rope_quant.pytest_plugin``'s ``rq_claim``):
        ``claim``, ``model``, ``expected``, ``measured``, ``holds``, ``decision``, ``numbers``, ``parts``,
        ``verdict``, ``budget``; plus ``id``, ``section``, ``statement``, ``seeds``, ``rule``, ``outlier`` (the
        sequential rule's outlier flag of any part, :mod:`rope_quant.core.outlier`, as a sentence; "" when none)
        and ``cells`` (each cell's overrides of the protocol's base config: a claim's own bits, key quantiser or
        R3). A pytest run's ``test`` and ``outcome`` are not the engine's to give."""
        decision = self.verdict.to_dict()
        return {"claim": self.claim.title, "id": self.claim.id, "section": self.claim.section,
                "statement": self.claim.statement, "model": model,
                "expected": "; ".join(_expected(p, r.margin)
                                      for p, r in zip(self.claim.parts, self.parts, strict=True)),
                "measured": "; ".join(_measured(r) for r in self.parts),
                "holds": holds_of(decision["outcome"]),
                "decision": decision, "numbers": {r.name: r.numbers() for r in self.parts},
                "parts": {r.name: r.verdict.to_dict() for r in self.parts},
                "verdict": self.verdict.text(), "budget": _budget_text(self.verdict),
                "seeds": list(self.seeds), "rule": self.rule,
                "outlier": self.verdict.outlier.text() if self.verdict.outlier is not None else "",
                "cells": {name: dict(c) for name, c in self.claim.cells.items()}}


def evaluate(claim: Claim, store: Store, seeds: Sequence[int], plan: Plan | None = None) -> ClaimResult:
    """Decide ``claim`` at ``seeds`` over ``store``: the fixed-n rule, or the sequential rule at its look
    ``len(seeds)`` when ``plan`` is given (a claim of P sampled parts spends each part's refuted side at α / P:
    :attr:`rope_quant.core.sequential.Plan.parts`). A value missing from the store raises the store's
    :class:`~rope_quant.claims.stores.MissingCellError` (a KeyError naming the cell and the seed)."""
    seeds = tuple(int(s) for s in seeds)
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"claim {claim.id}: seeds repeat: {list(seeds)}")
    todo = claim.unresolved()
    if todo:
        raise ClaimError(f"claim {claim.id}: cells {', '.join(todo)} hold model-dependent values "
                         f"({', '.join(sorted({v.value for got in todo.values() for v in got.values()}))}): "
                         "resolve them for the model first (rope_quant.claims.premises.adapt)")
    reader = _Reader(claim, store, seeds)
    if claim.equal_bits:  # the bits each cell measured after calibration (rope_pair_bits' widths), where recorded
        from rope_quant.claims.bits import check_measured_bits

        check_measured_bits(claim, reader.optional_values)
    sampled = sum(p.statistic is Statistic.PAIRED for p in claim.parts)
    if plan is not None and sampled > 1:
        plan = plan.with_parts(sampled)  # refuted if any part is: the claim's refuted side is spent at α / parts
    results = tuple(_part(claim, part, reader, plan) for part in claim.parts)
    combined = rule.combine_all([r.verdict for r in results])
    return ClaimResult(claim, seeds, combined, results, RULE_FIXED if plan is None else RULE_SEQUENTIAL)


def until_decided(claim: Claim, read: Callable[[tuple[int, ...]], ClaimResult], seeds: Sequence[int], plan: Plan, *,
                  time_budget: float | None = None, started: float | None = None,
                  log: Callable[[str], None] | None = None) -> Looked:
    """Decide ``claim`` by adding seeds (docs/verdicts.md, the sequential rule): ``read(seeds)`` (the claim evaluated
    at its look, the caller's cells built first) at ``seeds``, then at one more seed while the verdict is open, until
    it is decided, reaches ``plan.max_seeds``, stops for futility or the next seed would pass ``time_budget``
    (:func:`rope_quant.core.sequential.until_decided`, the one loop)."""
    from rope_quant.core import sequential

    return sequential.until_decided(read, lambda r: r.verdict, seeds, plan, time_budget=time_budget, started=started,
                                    log=log, name=claim.id)


class _Reader:
    """A claim's reads from one store at one seed list, each cell and metric read once."""

    def __init__(self, claim: Claim, store: Store, seeds: tuple[int, ...]) -> None:
        self.claim, self.store, self.seeds = claim, store, seeds
        self._values: dict[tuple[str, str], list[float]] = {}
        self._reps: dict[tuple[str, str], ReplicateValues] = {}

    def values(self, side: Side, metric: str) -> list[float]:
        if isinstance(side, Level):
            return [float(side.value)] * len(self.seeds)
        if isinstance(side, Diff):
            return [a - b for a, b in zip(self.values(side.of, metric), self.values(side.minus, metric), strict=True)]
        if (side, metric) not in self._values:
            got = [float(v) for v in self.store.values(self.claim.cells[side], self.seeds, metric)]
            if len(got) != len(self.seeds):
                raise ValueError(f"claim {self.claim.id}: the store gave {len(got)} values of cell {side!r} for "
                                 f"{len(self.seeds)} seeds")
            self._values[(side, metric)] = got
        return self._values[(side, metric)]

    def optional_values(self, name: str, metric: str = Metric.K_BITS.value) -> list[float] | None:
        """A cell's ``metric`` at every seed, or None where the store does not hold it at some seed."""
        try:
            return self.values(name, metric)
        except KeyError:  # MissingCellError, or a store's own KeyError for a result without the metric
            return None

    def replicates(self, side: Side, metric: str) -> ReplicateValues:
        """Seed → the side's value in the other float order (a Diff: the difference of its cells')."""
        if isinstance(side, Level):
            raise ClaimError(f"claim {self.claim.id}: a level has no float-order replicate (a paired part reads cells)")
        if isinstance(side, Diff):
            return _pair_up(self.replicates(side.of, metric), self.replicates(side.minus, metric),
                            lambda a, b: a - b)
        if (side, metric) not in self._reps:
            self._reps[(side, metric)] = self.store.replicates(self.claim.cells[side], self.seeds, metric)
        return self._reps[(side, metric)]

    def tokens(self, side: Side) -> int | None:
        if isinstance(side, Level):
            return None
        return self.store.tokens(self.claim.cells[side.of if isinstance(side, Diff) else side])


def _pair_up(a: ReplicateValues, b: ReplicateValues,
             join: Callable[[float, float], Any]) -> Any:
    """Two sides' replicates joined seed by seed: a failure reason wins, then "none exists"; the seeds both have."""
    if isinstance(a, str) or isinstance(b, str):
        return a if isinstance(a, str) else b
    if a is None or b is None:
        return None
    return {s: join(float(a[s]), float(b[s])) for s in a if s in b}


def _part(claim: Claim, part: Part, reader: _Reader, plan: Plan | None) -> PartResult:
    metric = str(part.metric)
    t, c = reader.values(part.treatment, metric), reader.values(part.control, str(part.control_metric or metric))
    margin = _margin(claim, part, reader)
    tokens = reader.tokens(part.treatment)
    if part.statistic is not Statistic.PAIRED:
        return PartResult(part.name, _deterministic(part, t, c, reader, margin), tuple(t), tuple(c), margin, tokens,
                          None)
    by_seed = _pair_up(reader.replicates(part.treatment, metric), reader.replicates(part.control, metric),
                       lambda x, y: (x, y))
    index = {s: i for i, s in enumerate(reader.seeds)}
    reps: Replicates = by_seed if isinstance(by_seed, str) or by_seed is None else \
        {index[s]: pair for s, pair in sorted(by_seed.items(), key=lambda kv: index[kv[0]])}
    value = margin.value if margin else 0.0
    if plan is None:
        v = rule.paired_claim(part.form, t, c, replicates=reps, margin=value, tokens=tokens)
    else:
        from rope_quant.core import sequential

        v = sequential.paired_claim(part.form, t, c, plan, replicates=reps, margin=value, tokens=tokens)
        if v.outlier is not None:  # the flag names the seeds by number
            v = replace(v, outlier=v.outlier.at_seeds(reader.seeds))
    return PartResult(part.name, v, tuple(t), tuple(c), margin, tokens, reps)


def _margin(claim: Claim, part: Part, reader: _Reader) -> Margin | None:
    m = part.margin
    if m.kind is MarginKind.NONE:
        return None
    if m.kind is MarginKind.FIXED:
        assert m.value is not None
        return Margin(m.value, f"a fixed ±{m.value:g} ({part.metric.value})")
    import numpy as np

    assert m.comparator is not None
    mean = float(np.mean(reader.values(m.comparator, part.metric.value if m.kind is MarginKind.RELATIVE
                                       else Metric.PPL.value)))
    if m.kind is MarginKind.RELATIVE:
        assert m.value is not None
        return Margin(m.value * mean, f"{m.value:.0%} of {m.comparator}'s mean {mean:.3f} = ±{m.value * mean:.3f}")
    return rule.equivalence_margin(mean)


def _every_seed(form: Form, x: float, y: float, m: float) -> bool:
    """One seed of an :attr:`Statistic.EVERY_SEED` part (registry.EVERY_SEED_FORMS)."""
    return {Form.GREATER: x > y, Form.LESS: x < y, Form.NON_SUPERIOR: x <= y + m, Form.NON_INFERIOR: x >= y - m,
            Form.EQUIVALENT: abs(x - y) <= m}[form]


def _deterministic(part: Part, t: list[float], c: list[float], reader: _Reader, margin: Margin | None) -> Verdict:
    """A part without sampling error: holds or fails (its note: the part's, else the criterion in words)."""
    import numpy as np

    tn, cn = _side_name(part.treatment), _side_name(part.control)
    if part.statistic is Statistic.EVERY_SEED:
        m = margin.value if margin else 0.0
        holds = all(_every_seed(part.form, x, y, m) for x, y in zip(t, c, strict=True))
        within = f" within ±{m:.3g}" if margin else ""
        text = (f"{part.metric.value}({tn}) {EVERY_SEED_FORMS[part.form]} "
                f"{(part.control_metric or part.metric).value}({cn}){within} in every seed")
    elif part.statistic is Statistic.MEANS:
        mt, mc = float(np.mean(t)), float(np.mean(c))
        holds = _every_seed(part.form, mt, mc, 0.0)
        right = cn if isinstance(part.control, Level) else f"mean {part.metric.value}({cn})"
        text = f"mean {part.metric.value}({tn}) {MEANS_FORMS[part.form]} {right}"
    else:
        assert part.reference is not None and part.share is not None
        mean = float(np.mean(t) - np.mean(c))
        gap = float(np.mean(reader.values(part.reference, part.metric.value)) - np.mean(c))
        holds = abs(mean) < part.share * gap
        text = f"|mean({tn} − {cn})| < {part.share:g} · mean({part.reference} − {cn})"
    return rule.deterministic(holds, part.note or text)


def _side_name(side: Side) -> str:
    if isinstance(side, Level):
        return f"{side.value:g}"
    return f"{side.of} − {side.minus}" if isinstance(side, Diff) else side


def _expected(part: Part, margin: Margin | None) -> str:
    what = (f"{part.statistic.value} {part.form.value}" if part.statistic is Statistic.PAIRED
            else part.note or part.statistic.value)
    return f"{part.name}: {what}" + (f" within ±{margin.value:.3g} ({margin.basis})" if margin else "")


def _measured(r: PartResult) -> str:
    v = r.verdict
    if v.mean is None or v.low is None or v.high is None:
        return f"{r.name}: {v.text()}"
    return f"{r.name}: {v.mean:+.3f} ({v.ci_name} {v.low:+.3f}, {v.high:+.3f}; n={v.n}) → {v.text()}"


def _budget_text(v: Verdict) -> str:
    """The claims table's budget column (as the pytest plugin writes it): empty when decided."""
    if v.outcome is not Outcome.INCONCLUSIVE:
        return ""
    return v.stop or (v.budget.text() if v.budget else v.note)

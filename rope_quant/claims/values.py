"""A claim over values measured elsewhere: per-seed lists put in a :class:`~rope_quant.claims.stores.MemoryStore`
and decided by the one engine (:func:`rope_quant.claims.engine.evaluate`).

The e2e suite measures some claims' cells outside any store (App. D's static control, App. G's retrieval
accuracy: cells of a kind the claims sweep does not run yet). :func:`paired` writes such a comparison as a claim
of one paired part over two cells, ``treatment`` and ``control`` (:data:`TREATMENT`, :data:`CONTROL`), and
:func:`decide` reads it at seed indices 0 … n−1 from the values given, with their float-order replicates, under
the fixed-n rule or a sequential plan: the verdict is the engine's, as for every registry claim.
:func:`decide_block` and :func:`decide_diffs` read the rule on what a compare run's ``summary.json`` holds (a
paired interval, per-seed differences: its report columns, the sign's budget, the foldable gap share's equivalence,
two runs side by side); :func:`replay` reads a recorded claims-JSON row's parts again under another sequential plan
(``rope-quant replay``, :mod:`rope_quant.analysis.replay` parsing the rows). A compare run builds no float-order
replicate, so these read the rule alone, not a claim
of the engine (whose paired parts read the replicates too); with them no verdict is computed outside ``claims/``
and ``core/``.

Standard library and ``claims/`` only at import.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rope_quant.claims.engine import ClaimResult, evaluate
from rope_quant.claims.registry import NO_MARGIN, Claim, MarginRule, Metric, Part, Statistic
from rope_quant.claims.stores import MemoryStore
from rope_quant.core.verdict import Form, Verdict, decide_interval
from rope_quant.core.verdict import decide as _decide_rule

if TYPE_CHECKING:
    from rope_quant.core.sequential import Plan, Recorded

TREATMENT = "treatment"
CONTROL = "control"
VALUES = "values"
"""The one key of the two cells (not a config field: the cells are never built, their values are given)."""

PairReplicates = Mapping[int, tuple[float, float]] | str | None
"""Seed index → (treatment, control) in the other float order; a str: why the replicate failed; None: none."""


def paired(form: Form, *, margin: float = 0.0, title: str = "treatment − control", metric: Metric = Metric.PPL,
           statistic: Statistic = Statistic.PAIRED) -> Claim:
    """A claim of one part, ``treatment`` against ``control`` in ``form`` read by ``statistic`` (a margin > 0: a
    fixed margin in the metric's units, for the forms that take one)."""
    rule = MarginRule.fixed(margin) if margin else NO_MARGIN
    part = Part(title, TREATMENT, CONTROL, form, statistic, margin=rule, metric=metric)
    return Claim(title, title, title, "measured values", {TREATMENT: {VALUES: TREATMENT}, CONTROL: {VALUES: CONTROL}},
                 (part,), premises=(), group=VALUES)


def decide(claim: Claim, treatment: Sequence[float], control: Sequence[float], *,
           replicates: PairReplicates = None, tokens: int | None = None, plan: Plan | None = None) -> ClaimResult:
    """``claim`` (:func:`paired`) read by the engine over ``treatment`` and ``control`` at seed indices 0 … n−1
    (``replicates``: :data:`PairReplicates`; ``tokens``: scored tokens per cell; ``plan``: the sequential rule's
    look at n seeds, else the fixed-n rule)."""
    if len(treatment) != len(control):
        raise ValueError(f"treatment has {len(treatment)} values but control has {len(control)}")
    store = MemoryStore(tokens=tokens)
    seeds = range(len(treatment))
    metric = claim.parts[0].metric
    store.put_seeds(claim.cells[TREATMENT], seeds, treatment, metric=metric)
    store.put_seeds(claim.cells[CONTROL], seeds, control, metric=metric)
    if isinstance(replicates, str):
        store.replicate_failed(claim.cells[TREATMENT], replicates)
    elif replicates is not None:
        for i, (t, c) in replicates.items():
            if not 0 <= int(i) < len(treatment):
                raise ValueError(f"replicate of seed index {i}: the values have {len(treatment)} seeds")
            store.put(claim.cells[TREATMENT], int(i), t, metric=metric, replicate=True)
            store.put(claim.cells[CONTROL], int(i), c, metric=metric, replicate=True)
    return evaluate(claim, store, seeds, plan)


def decide_block(form: Form, block: Mapping[str, Any], *, margin: float = 0.0) -> Verdict | None:
    """The rule (:func:`rope_quant.core.verdict.decide_interval`) on a summary's paired block (``n``, ``mean``,
    ``sd``, ``low``, ``high``, optional ``tokens`` per cell), or None where the block has no interval (n < 2)."""
    if block.get("sd") is None or block.get("low") is None or block.get("high") is None:
        return None
    tokens = block.get("tokens")
    return decide_interval(form, int(block["n"]), float(block["mean"]), float(block["sd"]), float(block["low"]),
                           float(block["high"]), margin=margin, tokens=int(tokens) if tokens else None)


def decide_diffs(form: Form, diffs: Sequence[float], *, margin: float = 0.0, tokens: int | None = None) -> Verdict:
    """The rule (:func:`rope_quant.core.verdict.decide`) on a compare run's per-seed differences (no replicate);
    ``tokens``: scored tokens per cell, so the budget also reads in tokens."""
    return _decide_rule(form, list(diffs), margin=margin, tokens=tokens)


def replay(sampled: Sequence[Recorded], fixed: Sequence[tuple[bool, str]], plan: Plan) -> Verdict:
    """A recorded claim read look by look under ``plan`` (:func:`rope_quant.core.sequential.replay_claim`): its
    sampled parts from their per-seed differences and float-order shifts, each part without sampling error with its
    recorded outcome ``(holds, note)``."""
    from rope_quant.core.sequential import replay_claim
    from rope_quant.core.verdict import deterministic

    return replay_claim(list(sampled), plan, [deterministic(holds, note) for holds, note in fixed])

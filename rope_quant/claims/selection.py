"""Which claims run on a model, the cells each reads and the cost of their table: one place for both fronts.

``rope-quant claims`` (cli/claims.py, its manifest in sweep/claims_sweep.py) and pytest's registry fronts
(tests/_support/registry_front.py) ask here, so a claim added to the registry is selected, adapted, planned and
costed the same way by both:

* :func:`select`: the claims named by id or group (the paper's group by default);
* :func:`table`: each claim as it runs on a model (:func:`rope_quant.claims.premises.adapt` from the model's
  :class:`~rope_quant.claims.premises.ModelFacts` at the evaluation windows' T), or why it does not; with
  ``plain_only``, a claim whose cells a plain run cell does not score (C4's support windows, C7's long context:
  :func:`scoring_reason`) is left out too;
* :func:`cell_configs`: a claim's cells at one seed as configs (the base config with each cell's overrides; the
  support windows for a support cell), each followed by its float-order replicate where the one rule builds one
  (:mod:`rope_quant.experiment.replicate`);
* :func:`cost_plan`: the plan of ``rope-quant plan`` for a table's configs (its weight builds as the plan's seeds,
  its short-context cells per build as its configs, its long-context cells at their lengths), checked against this
  machine when asked.

The configs and the plan are imported lazily: this module loads no torch at import.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from rope_quant.claims import registry
from rope_quant.claims.premises import ModelFacts, adapt
from rope_quant.claims.registry import (
    Claim,
    ClaimError,
    Scoring,
    Statistic,
    length_of,
    overrides_of,
    scoring_of,
    side_cells,
)

_SCORED_BY = {Scoring.RUNTIME: "llama.cpp (a GGUF export of the cell)"}
_NOT_SWEPT = frozenset(_SCORED_BY)
"""The scorings the claims sweep has no cell kind for (support and long-context cells it runs:
sweep/claim_scoring.py)."""


def select(names: Iterable[str] | None = None) -> list[Claim]:
    """The claims of ``names`` (ids and group names: a group is every claim of it, in registration order), each
    once; the paper's group when None. An unknown id raises :class:`~rope_quant.claims.registry.UnknownClaimError`."""
    if names is None:
        return list(registry.claims(registry.PAPER))
    groups = registry.groups()
    out: dict[str, Claim] = {}
    for name in names:
        for claim in registry.claims(name) if name in groups else (registry.get(name),):
            out.setdefault(claim.id, claim)
    return list(out.values())


class LeftOutKind(StrEnum):
    """Why a claim of a model's table does not run there."""

    PREMISE = "premise"  # the model lacks a premise of the claim (premises.adapt)
    NOT_ADAPTED = "not adapted"  # its cells cannot be adapted to the model (unequal bits at T), and nobody asked
    NOT_SWEPT = "not swept"  # its cells are scored where the claims sweep cannot (scoring_reason)


@dataclass(frozen=True)
class LeftOut:
    """A claim left out of a model's table: of which kind, on which model, and the detail; ``str()`` is the reason
    both fronts print."""

    kind: LeftOutKind
    model: str
    detail: str

    def __str__(self) -> str:
        if self.kind is LeftOutKind.PREMISE:
            return f"model {self.model} lacks a premise: {self.detail}"
        if self.kind is LeftOutKind.NOT_ADAPTED:
            return f"it cannot be adapted to {self.model}: {self.detail}"
        return self.detail


def scoring_reason(claim: Claim) -> str | None:
    """Why the claims sweep cannot score ``claim`` (its cells are scored by llama.cpp), or None."""
    other = [s for s in dict.fromkeys(scoring_of(claim.cells[n]) for n in claim.cell_names()) if s in _NOT_SWEPT]
    if not other:
        return None
    return (f"its cells are scored by {' and '.join(_SCORED_BY.get(s, s.value) for s in other)}, which a cell of "
            "this sweep does not score; its e2e test decides it (pytest -m e2e --run-slow)")


def table(claims: Iterable[Claim], facts: ModelFacts, seq_len: int, *, plain_only: bool = False,
          requested: Collection[str] | None = None) -> dict[str, Claim | LeftOut]:
    """Claim id → the claim as it runs on the model of ``facts`` at evaluation windows of ``seq_len`` tokens
    (premises, model-dependent values and equal bits: :func:`~rope_quant.claims.premises.adapt`), or why it does
    not (a :class:`LeftOut`: the premise the model lacks; with ``plain_only``, :func:`scoring_reason`). A
    ``requested`` claim (default: every claim) that cannot be adapted (its cells store unequal bits at T) raises
    :class:`~rope_quant.claims.registry.ClaimError`; any other is left out with that reason, so a claim nobody
    asked for never stops the table of those asked for."""
    out: dict[str, Claim | LeftOut] = {}
    for claim in claims:
        why = scoring_reason(claim) if plain_only else None
        if why is not None:
            out[claim.id] = LeftOut(LeftOutKind.NOT_SWEPT, facts.name, why)
            continue
        try:
            got = adapt(claim, facts, seq_len=seq_len)
        except ClaimError as exc:
            if requested is None or claim.id in requested:
                raise
            out[claim.id] = LeftOut(LeftOutKind.NOT_ADAPTED, facts.name, str(exc))
            continue
        out[claim.id] = got if isinstance(got, Claim) else LeftOut(LeftOutKind.PREMISE, facts.name, got)
    return out


def paired_cells(claim: Claim) -> set[str]:
    """The cells a paired part reads: the ones whose float-order replicates the rule reads."""
    return {n for p in claim.parts if p.statistic is Statistic.PAIRED
            for side in (p.treatment, p.control) for n in side_cells(side)}


@dataclass(frozen=True)
class CellConfig:
    """One config a claim reads at a seed: its cell's name in the claim, the config, whether it is the float-order
    replicate of that cell, and how the cell is scored (``length``: a long-context cell's L)."""

    cell: str
    config: Any
    replicate: bool = False
    scoring: Scoring = Scoring.EVAL
    length: int | None = None


def cell_configs(claim: Claim, base: Any, *, replicated: Collection[str] | None = None,
                 support_windows: int | None = None) -> Iterator[CellConfig]:
    """The configs ``claim`` reads at ``base``'s seed (``base``: the config every cell overrides, a ``RunConfig``),
    in the claim's order: each cell's (``support_windows`` scored windows for a support cell), followed by its
    float-order replicate where the cell is in ``replicated`` (None: every cell) and its weights get a rebuilt
    one (:func:`rope_quant.experiment.replicate.replicate_kind`)."""
    from rope_quant.experiment.replicate import Replicate, replicate_kind, replicate_overrides

    for name in claim.cell_names():
        cell = claim.cells[name]
        scoring = scoring_of(cell)
        extra = {"eval_windows": support_windows} if scoring is Scoring.SUPPORT and support_windows else {}
        cfg = base.override(**overrides_of(cell), **extra)
        yield CellConfig(name, cfg, False, scoring, length_of(cell))
        if (replicated is None or name in replicated) and replicate_kind(cfg) is Replicate.REBUILD:
            yield CellConfig(name, cfg.override(**replicate_overrides(cfg)), True, scoring, length_of(cell))


@dataclass(frozen=True)
class CostPlan:
    """The cost of a claims table: the plan (``rope_quant.planning.plan.Plan``), the offload decision when it
    was checked against this machine (else None), its short-context cells and its weight builds."""

    plan: Any
    decision: Any
    cells: int
    builds: int


def cost_plan(base: Any, configs: Sequence[CellConfig], *, device: str, dtype: str, whip_epochs: int | None = None,
              long_windows: int = 1, offload: bool = False, check: str | None = None, config: Any = None) -> CostPlan:
    """The plan of ``rope-quant plan`` for a table of ``configs`` on ``base``'s model and protocol (calibration,
    seqlen, evaluation windows): one plan seed per weight build (seed × bits × float order), the short-context cells
    per build as its configs, each long-context cell at its L (``long_windows`` windows each). ``check``: the
    requested offload mode, checked against this machine
    (:func:`rope_quant.planning.memory_check.decide`, which raises ``PlanDoesNotFit`` naming the stage, the need
    and the remedy), the plan then made with the offload it decides; else the plan with ``offload``. ``config``:
    the model's config where read already."""
    from rope_quant.planning import memory_check
    from rope_quant.planning import plan as planning

    short = {c.config.key() for c in configs if c.scoring is not Scoring.LONG}
    builds = {c.config.weight_key() for c in configs}
    lengths: dict[int, int] = {}
    for c in configs:
        if c.scoring is Scoring.LONG:
            lengths[int(c.length or 0)] = lengths.get(int(c.length or 0), 0) + 1
    protocol = planning.Protocol(calib_windows=base.calib_windows, seqlen=base.seqlen,
                                 eval_windows=base.eval_windows or planning.PAPER.eval_windows,
                                 whip_epochs=whip_epochs or planning.PAPER.whip_epochs,
                                 configs=max(1, math.ceil(len(short) / max(1, len(builds)))),
                                 seeds=max(1, len(builds)), gptq=any(str(c.config.weights) == "gptq" for c in configs),
                                 long_context=tuple(sorted(lengths)))
    decision = None
    if check is not None:
        decision = memory_check.decide(base.model, device, dtype, protocol, check, config=config)
        offload = decision.offload.value == "cpu"
    plan = memory_check.plan_for(base.model, device, dtype, protocol, offload=offload, config=config)
    eval_tokens = protocol.eval_windows * protocol.seqlen
    for i, stage in enumerate(plan.stages):  # the plan scores eval_tokens // L windows per L; a cell scores fewer
        for length, cells in lengths.items():
            if stage.name == f"long context L={length}":
                per = stage.seconds * long_windows / max(1, eval_tokens // length)
                plan.stages[i] = replace(stage, seconds=per, repeats=cells)
    return CostPlan(plan, decision, len(short), len(builds))


def plan_inputs(claims: Iterable[Claim], bases: Mapping[int, Any], *, replicated_seeds: Collection[int] | None = None,
                support_windows: int | None = None) -> list[CellConfig]:
    """Every config of ``claims`` at each seed of ``bases`` (seed → its base config), each once: a paired cell's
    float-order replicate at the ``replicated_seeds`` (None: every cell at every seed)."""
    out: dict[str, CellConfig] = {}
    for seed, base in bases.items():
        for claim in claims:
            replicated = None if replicated_seeds is None else (
                paired_cells(claim) if seed in replicated_seeds else set())
            for c in cell_configs(claim, base, replicated=replicated, support_windows=support_windows):
                out.setdefault(c.config.key() + (f"@{c.length}" if c.length else ""), c)
    return list(out.values())

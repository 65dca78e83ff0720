"""The registry fronts' one path: a checkpoint's claims table decided by the claims engine.

Shared by ``pytest -m e2e --rq-model PATH`` (tests/e2e/test_registry_claims.py, the CPU budget),
``pytest -m gpu_e2e`` (tests/e2e/test_gpu_claims.py, the paper's protocol :data:`PAPER` on CUDA) and that
parametrization's CPU run (tests/e2e/test_paper_protocol_cpu.py, :data:`PAPER` cut to a tiny budget):

1. :func:`open_front`: the checkpoint's facts from its config, read once (no weights: premises, head_dim, q/k
   norms, the config the plan reads; :func:`rope_quant.claims.premises.facts_of_checkpoint`), each claim of its
   table as it runs there and its cost plan, asked of :mod:`rope_quant.claims.selection` as ``rope-quant claims``
   asks it (adapted at the budget's seqlen: itself, the nearest protocol with the deviation named, its
   model-dependent values resolved, or the reason it skips; a claim at equal bits per key element whose cells store
   unequal bits at that T fails the front), the plan of the whole table (time and memory: :func:`table_plan`)
   printed, or a refusal with the plan's remedy, all before the model loads; then the model and the paired
   :class:`Experiment` (or an experiment the caller already holds: the default suite's on the default model);
2. :class:`ExperimentStore`: the experiment as a claims store (each cell computed and memoised on first read);
3. :func:`decide_claim`: one claim through :func:`rope_quant.claims.engine.evaluate` (fixed-n), or with
   ``--rq-until-decided`` through the sequential rule's loop, :func:`rope_quant.claims.engine.until_decided`; its
   row recorded with ``rq_claim`` and the run's description (the model and the fingerprint of its files, the
   protocol, the device: :func:`rope_quant.analysis.claims_report.describe_run`, the keys ``rope-quant report DIR``
   writes) with ``rq_run``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from rope_quant.claims import registry
from rope_quant.claims.registry import (
    Claim,
    Metric,
    Override,
    Scoring,
    length_of,
    metric_value,
    overrides_of,
    scoring_of,
)
from rope_quant.claims.selection import LeftOut
from rope_quant.claims.stores import ReplicateValues
from rope_quant.sweep.claim_scoring import ScoringBudget

_SCORING = ScoringBudget()

DEFAULT_SEEDS = (0, 1, 2)
_SWEPT = frozenset({Scoring.STATIC, Scoring.NIAH, Scoring.NIAH_FP})
"""The scorings the pytest front computes through the claims sweep's cell kinds (one function per cell)."""


@dataclass(frozen=True)
class FrontProtocol:
    """The sizes a registry front runs its cells at: ``seqlen`` tokens per window, ``calib_windows`` calibration
    windows per seed, ``eval_windows`` scored windows per cell (None: every window of the corpus),
    ``support_windows`` for C4's cells, ``long_windows`` per length for C7's, App. D's and App. G's sizes (the
    fields of :class:`~rope_quant.sweep.claim_scoring.ScoringBudget`)."""

    name: str
    seqlen: int
    calib_windows: int
    eval_windows: int | None
    support_windows: int = 3
    long_windows: int = 1
    static_windows: int = _SCORING.static_windows
    static_eval_windows: int | None = _SCORING.static_eval_windows
    niah_length: int = _SCORING.niah_length
    niah_probes: int = _SCORING.niah_probes

    def budget(self, budget_cls: Any, rq_options: Any, seeds: Sequence[int] = DEFAULT_SEEDS) -> Any:
        """The ``E2EBudget`` of this protocol at ``--rq-seeds`` (else ``seeds``) with the session's replicates:
        ``--rq-replicates`` K, else every seed up to 3, or every seed under ``--rq-until-decided``."""
        chosen = tuple(rq_options.seeds or seeds)
        given = rq_options.replicates if rq_options.replicates is not None or not rq_options.until_decided \
            else len(chosen)
        return budget_cls(seeds=chosen, seqlen=self.seqlen, calib_windows=self.calib_windows,
                          eval_windows=self.eval_windows, support_windows=self.support_windows,
                          long_windows=self.long_windows, static_windows=self.static_windows,
                          static_eval_windows=self.static_eval_windows, niah_length=self.niah_length,
                          niah_probes=self.niah_probes, replicates=budget_cls.replicates_for(given, chosen))


PAPER = FrontProtocol("paper", seqlen=2048, calib_windows=128, eval_windows=None, static_windows=64,
                      static_eval_windows=None, niah_length=2048, niah_probes=20)
"""The paper's protocol (App. A.1): 128 × 2048 calibration tokens, seqlen 2048, every evaluation window; App. D's 64
static estimation windows (A.6) scored on A.4's windows; App. G's 20 probes per depth, at 2048 tokens."""


class ExperimentStore:
    """The :class:`rope_quant.claims.stores.Store` of an ``Experiment``: each cell computed (and memoised) on
    first read."""

    def __init__(self, exp: Any) -> None:
        self.exp = exp

    def scoring(self) -> ScoringBudget:
        """The experiment's budget as the claims sweep's :class:`~rope_quant.sweep.claim_scoring.ScoringBudget`."""
        b = self.exp.budget
        return ScoringBudget(support_windows=b.support_windows, long_windows=b.long_windows, long_corpus=b.long_corpus,
                             static_windows=b.static_windows, static_eval_windows=b.static_eval_windows,
                             niah_length=b.niah_length, niah_probes=b.niah_probes)

    def _swept(self, cell: Mapping[str, Override], seed: int, **rep: Any) -> Any:
        """A cell the claims sweep scores through its cell kind (static, NIAH): its config, as the sweep builds it
        (:func:`~rope_quant.sweep.claim_scoring.scored_config` on the experiment's config at ``seed``)."""
        from rope_quant.sweep.claim_scoring import scored_config

        return scored_config(cell, self.exp.config(seed, **rep), self.scoring())

    def _overrides(self, cell: Mapping[str, Override]) -> dict[str, Any]:
        out: dict[str, Any] = dict(overrides_of(cell))
        if scoring_of(cell) is Scoring.SUPPORT:
            out["eval_windows"] = self.exp.budget.support_windows
        return out

    def _replicate(self, cell: Mapping[str, Override]) -> Any:
        """The cell's float-order replicate (:func:`rope_quant.experiment.replicate.replicate_kind`, the one rule):
        a GPTQ cell's is rebuilt in the other float mode, a cell with unquantised weights is its own (the same key,
        read from the memo: a shift of 0), an RTN cell has none."""
        from rope_quant.experiment.replicate import replicate_kind

        return replicate_kind(self.exp.config(self.exp.budget.seeds[0], **self._overrides(cell)))

    def _value(self, cell: Mapping[str, Override], seed: int, metric: str, **rep: Any) -> float:
        from rope_quant.experiment.replicate import Replicate

        rebuilt = rep and self._replicate(cell) is Replicate.REBUILD
        ov = {**self._overrides(cell), **(rep if rebuilt else {})}
        if scoring_of(cell) is Scoring.LONG:
            length = int(length_of(cell) or 0)
            return float(self.exp.long_context(seed, (length,), **ov)[length].ppl)
        if scoring_of(cell) is Scoring.RUNTIME:
            return float(self.exp.runtime_cell(seed, **ov)[str(metric)])
        if scoring_of(cell) in _SWEPT:
            from rope_quant.claims.stores import MissingCellError
            from rope_quant.sweep.claim_scoring import scored_value

            cfg = self._swept(cell, seed, **(rep if rebuilt else {}))
            value = scored_value(cfg, self.exp.kind_cell(cfg), str(metric))
            if value is None:
                raise MissingCellError(cell, seed, str(metric))
            return value
        return metric_value(self.exp.cell(seed, **ov), str(metric))

    def values(self, cell: Mapping[str, Override], seeds: Sequence[int], metric: str = Metric.PPL) -> list[float]:
        return [self._value(cell, int(s), metric) for s in seeds]

    def replicates(self, cell: Mapping[str, Override], seeds: Sequence[int],
                   metric: str = Metric.PPL) -> ReplicateValues:
        from rope_quant.experiment.replicate import Replicate

        if self._replicate(cell) is Replicate.NONE:
            return None  # RTN weights: a float-order replicate is not built
        got = self.exp.over_replicates(lambda seed, rep: self._value(cell, seed, metric, **rep))
        if isinstance(got, str):
            return got
        chosen = {int(s) for s in seeds}
        out = {self.exp.replicate_seeds[i]: v for i, v in got.items() if self.exp.replicate_seeds[i] in chosen}
        return out or None

    def tokens(self, cell: Mapping[str, Override]) -> int | None:
        """The tokens the cell scored at the first seed (``n_tokens``: seqlen − 1 targets a window), as
        ``rope-quant report`` reads them from a sweep's records; a long-context cell's window tokens."""
        if scoring_of(cell) is Scoring.LONG:
            return int(self.exp.budget.long_windows * int(length_of(cell) or 0))
        if scoring_of(cell) in _SWEPT:
            from rope_quant.sweep.claim_scoring import scored_tokens

            cfg = self._swept(cell, self.exp.budget.seeds[0])
            return scored_tokens(cfg, self.exp.kind_cell(cfg))
        n = self.exp.cell(self.exp.budget.seeds[0], **self._overrides(cell)).get("n_tokens")
        return int(n) if isinstance(n, int) and n > 0 else None


@dataclass
class Front:
    """One checkpoint's registry front: the model, its experiment (None when no claim runs there: the model is
    not loaded), each claim as it runs there (a str: why it skips), the plan printed before the model loaded,
    the offload mode it runs with and the run's description for the claims JSON (``rq_run``)."""

    model: str
    exp: Any
    claims: dict[str, Claim | LeftOut]
    plan: str
    offload: str = "none"
    about: dict[str, Any] = field(default_factory=dict)


def table_configs(model: str, corpus: str, device: str, budget: Any, claims: Iterable[Claim]) -> list[Any]:
    """The table's configs at the budget's seeds, from configs alone (:func:`rope_quant.claims.selection.plan_inputs`:
    C4's cells on the budget's support windows, a paired cell's float-order replicate at the replicated seeds)."""
    from rope_quant.claims.selection import plan_inputs

    bases = {seed: base_config(model, corpus, device, budget, seed) for seed in budget.seeds}
    return plan_inputs(claims, bases, replicated_seeds=set(budget.seeds[: budget.replicates]),
                       support_windows=budget.support_windows)


def base_config(model: str, corpus: str, device: str, budget: Any, seed: int) -> Any:
    """The config every claim cell overrides at ``seed`` under ``budget`` (as ``Experiment.config`` builds it)."""
    from rope_quant.experiment.config import RunConfig

    return RunConfig.from_flat(model=model, corpus=corpus, seed=seed, seqlen=budget.seqlen, device=device,
                               calib_windows=budget.calib_windows, eval_windows=budget.eval_windows)


def table_plan(model: str, device: str, corpus: str, budget: Any, claims: Sequence[Claim],
               requested: str = "auto", config: Any = None) -> Any:
    """The plan of the whole claims table on ``model`` (its config only: ``config`` where read already),
    ``device`` and the budget's protocol, checked against this machine
    (:func:`rope_quant.claims.selection.cost_plan`). Raises ``PlanDoesNotFit`` (the stage, the need and the remedy)
    when it does not fit."""
    from rope_quant.claims.selection import cost_plan

    configs = table_configs(model, corpus, device, budget, claims)
    return cost_plan(base_config(model, corpus, device, budget, budget.seeds[0]), configs, device=device,
                     dtype="float32", long_windows=budget.long_windows, check=requested, config=config)


def plan_text(model: str, device: str, budget: Any, protocol: str, claims: Mapping[str, Claim | LeftOut],
              plan: Any, cells: int, builds: int, selected: Sequence[str] | None = None) -> str:
    """The printed plan: the claims that run and those that skip, the cells and builds, the plan's table (of the
    whole table; ``selected``: the claim ids collected (``-k``), named when fewer than the table's)."""
    from rope_quant.planning.plan import format_plan

    runs = [c.id + (" (deviation)" if "[deviation:" in c.title else "") for c in claims.values()
            if isinstance(c, Claim)]
    skips = [f"{cid}: {why}" for cid, why in claims.items() if isinstance(why, LeftOut)]
    evals = "every" if budget.eval_windows is None else str(budget.eval_windows)
    chosen = [cid for cid in claims if isinstance(claims[cid], Claim)
              and (selected is None or cid in set(selected))]
    return "\n".join([
        f"registry claims plan: {model} on {device}, protocol {protocol} ({budget.calib_windows} x {budget.seqlen} "
        f"calibration tokens, seqlen {budget.seqlen}, {evals} evaluation windows), seeds "
        f"{','.join(map(str, budget.seeds))} ({budget.replicates} replicated in the other float order)",
        f"claims that run: {', '.join(runs) or 'none'}",
        *([f"claims skipped: {'; '.join(skips)}"] if skips else []),
        *([f"collected here: {len(chosen)} of the {len(runs)} (the plan below is the whole table's): "
           f"{', '.join(chosen) or 'none'}"] if len(chosen) < len(runs) else []),
        f"cells: {cells} short-context cells over {builds} weight builds (seed x bits x float order); "
        "--rq-until-decided adds seeds to the open claims only",
        format_plan(plan)])


def claim_params(models: Sequence[str]) -> list[Any]:
    """The parameters of a front's tests: one ``(model, claim id)`` per model and registry claim, model by model in
    the registry's order, id ``<model's last path part>-<claim id>``, marked ``slow`` where the entry says so."""
    return [pytest.param(m, c.id, id=f"{m.rstrip('/').split('/')[-1]}-{c.id}",
                         marks=[pytest.mark.slow] if c.slow else [])
            for m in models for c in registry.claims()]


def _stderr(line: str) -> None:
    print(line, file=sys.__stderr__, flush=True)


def open_front(model: str, device: str, budget: Any, *, corpus: str, experiment_cls: Any, cache: str,
               rq_options: Any, protocol: str, missing: Callable[[str], Any] = pytest.skip,
               offload: str = "auto", log: Callable[[str], None] = _stderr,
               claims: Sequence[Claim] | None = None, experiment: Callable[[], Any] | None = None,
               selected: Sequence[str] | None = None) -> Front:
    """The front of ``model`` on ``device`` at ``budget`` (module docstring, step 1). A model that cannot be
    found calls ``missing`` with the reason (``pytest.skip`` by default; ``pytest.fail`` where it must exist).
    ``claims``: the claims of its table (default: every registry claim); ``experiment``: where the front does not
    load the model itself, the experiment it runs its cells in (called after the plan is printed: the default
    suite's ``experiment`` fixture on the default model, sharing its cells); ``selected``: the claim ids
    collected (``-k``), named in the plan when fewer than the table's."""
    from rope_quant.claims import selection
    from rope_quant.claims.premises import facts_of_checkpoint
    from rope_quant.claims.registry import ClaimError
    from rope_quant.model.arch import ArchitectureError
    from rope_quant.model.loading import ModelLoadError, ModelNotFoundError, load_model
    from rope_quant.planning import plan as planning

    try:
        facts = facts_of_checkpoint(model)
    except (ModelNotFoundError, ModelLoadError, ArchitectureError) as exc:
        missing(f"--rq-model {model!r}: {exc}")
        raise  # missing() raised; this line is for the type checker
    try:
        table = selection.table(registry.claims() if claims is None else claims, facts, budget.seqlen)
    except ClaimError as exc:  # unequal bits per key element at this T: refused before the model loads
        pytest.fail(f"{model}: {exc}", pytrace=False)
    running = [c for c in table.values() if isinstance(c, Claim)]
    mode, text = "none", f"registry claims plan: {model}: no claim runs"
    if running:
        try:
            cost = table_plan(model, device, corpus, budget, running, offload, facts.config)
        except planning.PlanDoesNotFit as exc:
            pytest.fail(f"{model} on {device}: the plan of the claims table does not fit this machine: {exc}",
                        pytrace=False)
        except planning.PlanError as exc:
            text = f"registry claims plan: {model}: none ({exc})"
        else:
            text = plan_text(model, device, budget, protocol, table, cost.plan, cost.cells, cost.builds, selected)
            mode = cost.decision.offload.value
            if cost.decision.note:
                text += "\n" + cost.decision.note
    log(text)
    if not running:
        return Front(model, None, table, text)
    if experiment is not None:  # the caller's experiment (its model already loaded)
        exp = experiment()
    else:
        from rope_quant.core.sequential import Plan

        base = load_model(model, device="cpu" if mode == "cpu" else device)
        seq = (Plan(len(budget.seeds), rq_options.max_seeds, futility=rq_options.futility, shape=rq_options.shape)
               if rq_options.until_decided else None)
        exp = experiment_cls(base, cache, budget, corpus, model=model, device=device, plan=seq,
                             time_budget=rq_options.time_budget)
    return Front(model, exp, table, text, mode, describe(exp, device, protocol))


def describe(exp: Any, device: str, protocol: str) -> dict[str, Any]:
    """The run's description in the claims JSON (``model``, ``protocol``, ``device``), as ``rope-quant report
    DIR`` writes it: the comparator's config with the model's and the corpus's content hashes, and the
    protocol's name."""
    from rope_quant.analysis.claims_report import describe_run
    from rope_quant.defaults import DEFAULT_COMPARATOR
    from rope_quant.experiment.envinfo import device_description
    from rope_quant.experiment.identity import resolve_identity

    run = resolve_identity(exp.config(exp.budget.seeds[0], r3=DEFAULT_COMPARATOR))
    return describe_run(run, exp.budget.seeds, DEFAULT_COMPARATOR, device_description(device), name=protocol)


def decide_claim(front: Front, claim_id: str, rq_claim: Any, rq_run: Any) -> tuple[Any, Any]:
    """``claim_id`` on the front's model: skipped with the missing premise, or decided by the engine over the
    experiment's cells (with ``--rq-until-decided`` by adding seeds, every one replicated, while it is open:
    :func:`rope_quant.claims.engine.until_decided` within ``--rq-max-seeds`` and ``--rq-time-budget``, counted from
    the session's first claim) and recorded with ``rq_claim`` (its run with ``rq_run``); returns (verdict,
    :class:`~rope_quant.claims.engine.ClaimResult`)."""
    from rope_quant.claims.engine import evaluate, until_decided

    claim = front.claims[claim_id]
    if isinstance(claim, LeftOut):
        pytest.skip(f"{claim_id} on {front.model}: {claim}")
    exp = front.exp
    if exp.plan is None:
        result = evaluate(claim, ExperimentStore(exp), exp.budget.seeds)
        verdict = result.verdict
    else:
        looked = until_decided(claim, lambda seeds: evaluate(claim, ExperimentStore(exp.with_seeds(seeds)), seeds,
                                                             plan=exp.plan),
                               exp.budget.seeds, exp.plan, time_budget=exp.time_budget, started=exp.started,
                               log=_stderr)
        result, verdict = looked.result, looked.result.verdict
        if looked.stopped.startswith("time budget"):
            verdict = replace(verdict, stop=f"{looked.stopped}; {verdict.note}")
    parts = result.part_verdicts
    if verdict.stop.startswith("time budget"):  # the stop reaches each part still open, not "open at look k"
        parts = {k: v if v.decided or v.stop else replace(v, stop=verdict.stop) for k, v in parts.items()}
    row = result.to_dict(model=exp.model)
    rq_run(front.about)
    rq_claim(claim.title, row["expected"], row["measured"], model=exp.model, verdict=verdict,
             parts=parts, claim_id=claim.id, **row["numbers"])
    return verdict, result

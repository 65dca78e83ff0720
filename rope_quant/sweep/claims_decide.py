"""Deciding a claims directory under the sequential rule (``rope-quant decide DIR`` on a ``rope-quant claims``
directory), and reading one claim over a directory without crashing on a missing cell.

Each claim the directory planned is read at the directory's seeds, then, while it is open, at one more seed
(:func:`rope_quant.claims.engine.until_decided`, the engine's loop, which the e2e suite's
``--rq-until-decided`` also runs through :func:`rope_quant.core.sequential.until_decided`): the new
seed's cells of that claim only (the comparator, the claim's cells and their float-order replicates,
:mod:`rope_quant.sweep.claims_sweep`) are added to the manifest and run through the sweep runner (resumable: no
complete cell is recomputed), and the claim is read again by :func:`rope_quant.claims.engine.evaluate` with the
plan. The plan (first look, M, boundary shape) and the seeds of the first look are kept in ``DIR/decide.json``
(:func:`rope_quant.sweep.decide_plan.plan_state`), so a killed run resumes with the same plan.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rope_quant.claims import engine
from rope_quant.claims.engine import ClaimResult, PartResult
from rope_quant.claims.registry import Claim, Statistic
from rope_quant.claims.stores import MissingCellError
from rope_quant.core import sequential
from rope_quant.core.verdict import Outcome, Verdict
from rope_quant.defaults import Shape
from rope_quant.io import atomic_write_json
from rope_quant.sweep.cellkind import config_seed, with_overrides
from rope_quant.sweep.claim_store import DirectoryStore
from rope_quant.sweep.claims_sweep import cells_at
from rope_quant.sweep.decide_plan import STATE_FILE, DecideError, plan_state, replicate_config
from rope_quant.sweep.manifest import Manifest, cell_relpath

FAILED_CELL = "a cell failed"
"""How the stop of a claim whose cell failed to compute begins (the loop stops that claim there)."""


def claim_seeds(claim: Claim, store: DirectoryStore) -> list[int]:
    """The directory's seeds at which its manifest names every cell of ``claim`` (all of its seeds when none, so
    that the first missing cell is named)."""
    seeds = store.seeds()
    planned = [s for s in seeds if all(store.planned(claim.cells[n], s) for n in claim.cell_names())]
    return planned or seeds


def missing_result(claim: Claim, seeds: Sequence[int], error: MissingCellError, rule: str,
                   stop: str = "") -> ClaimResult:
    """An inconclusive result naming the missing cell and seed (its parts inconclusive, not read; ``stop``: why
    the sequential loop stops here)."""
    v = Verdict(Outcome.INCONCLUSIVE, None, 0, stop=stop,
                note=f"missing cell: {error}; rerun the claims sweep into this directory (it resumes) to compute it")
    unread = Verdict(Outcome.INCONCLUSIVE, None, 0, note="not read (a cell of the claim is missing)")
    parts = tuple(PartResult(p.name, unread, (), (), None, None, None) for p in claim.parts)
    return ClaimResult(claim, tuple(int(s) for s in seeds), v, parts, rule)


def evaluate(claim: Claim, store: DirectoryStore, seeds: Sequence[int], plan: sequential.Plan | None = None,
             stop_missing: str = "") -> ClaimResult:
    """:func:`~rope_quant.claims.engine.evaluate`, or the inconclusive result naming the missing cell. With a plan
    the refuted side is spent over the claim's sampled parts (as the e2e suite does: ``Plan.with_parts``)."""
    rule = engine.RULE_FIXED if plan is None else engine.RULE_SEQUENTIAL
    if plan is not None:
        plan = plan.with_parts(max(1, sum(p.statistic is Statistic.PAIRED for p in claim.parts)))
    try:
        return engine.evaluate(claim, store, seeds, plan)
    except MissingCellError as exc:
        return missing_result(claim, seeds, exc, rule, stop_missing.format(error=exc))


@dataclass(frozen=True)
class Decided:
    """One claim's last reading, the seeds it used and why the loop stopped there."""

    result: ClaimResult
    seeds: tuple[int, ...]
    stopped: str


def check_claims_inputs(store: DirectoryStore, max_seeds: int, time_budget: float | None) -> None:
    """What the loop refuses before it builds anything: M below the seeds given or below 2, a time budget ≤ 0,
    cells without a float-order replicate (weights not GPTQ: the rule cannot decide)."""
    given = len(store.seeds())
    if max_seeds < max(given, 2):
        raise DecideError(f"--max-seeds {max_seeds} is below the {given} seeds the directory already has: pass "
                          f"--max-seeds {max(given, 2)} or more")
    if given < 2:
        raise DecideError(f"the directory has {given} seed(s): the rule's first look needs 2; rerun the claims "
                          "sweep with two seeds or more")
    if time_budget is not None and not time_budget > 0:
        raise DecideError(f"--time-budget {time_budget:g}: must be a positive number of seconds")
    if replicate_config(store.comparator()) is None:
        raise DecideError(f"the comparator {store.manifest.comparator!r} has no float-order replicate (its weights "
                          "are not GPTQ): the sequential rule cannot decide without one; rerun the claims sweep "
                          "with --weights gptq")


CellsFor = Callable[[Claim, int, dict[str, dict[str, Any]]], list[tuple[str, Any]]]
"""``cells_for(claim, seed, meta)``: the cells ``(name, config)`` the claim reads at ``seed`` with their float-order
replicates (``meta`` filled for the new names): what the loop adds to the manifest for that claim and seed."""
NOT_BUILT = "not built yet"
"""The stop of a claim read before building whose next cell has no record yet (:func:`until_decided_in`)."""


@dataclass(frozen=True)
class Decisions:
    """The loop's result: the plan, each claim's last reading (in the claims' order), whether any cell ran."""

    plan: sequential.Plan
    decided: list[Decided]
    built: bool


def decide_claims(out: str | os.PathLike[str], manifest: Manifest, claims: Sequence[Claim], *,
                  max_seeds: int = sequential.DEFAULT_MAX_SEEDS, time_budget: float | None = None,
                  futility: float = sequential.DEFAULT_FUTILITY, shape: str = sequential.DEFAULT_SHAPE.value,
                  cell_fn: Any = None, cache_dir: Any = None, log: Callable[[str], None] | None = print,
                  run_cells_kw: Mapping[str, Any] | None = None) -> tuple[sequential.Plan, list[Decided]]:
    """Decide each of a claims directory's ``claims`` over directory ``out`` (its manifest ``manifest``) by
    :func:`until_decided_in`, a seed's cells those of the claims study (:func:`rope_quant.sweep.claims_sweep.cells_at`);
    returns the plan and each claim's reading, in order."""
    store = DirectoryStore(out, manifest)
    check_claims_inputs(store, max_seeds, time_budget)
    got = until_decided_in(out, manifest, claims, study_cells(store), max_seeds=max_seeds, time_budget=time_budget,
                           futility=futility, shape=shape, cell_fn=cell_fn, cache_dir=cache_dir, log=log,
                           run_cells_kw=run_cells_kw)
    return got.plan, got.decided


def study_cells(store: DirectoryStore) -> CellsFor:
    """The cells one seed adds for a claim of a claims directory: the comparator at that seed, the claim's cells
    and their float-order replicates (:func:`rope_quant.sweep.claims_sweep.cells_at`)."""
    template = store.comparator()

    def cells_for(claim: Claim, seed: int, meta: dict[str, dict[str, Any]]) -> list[tuple[str, Any]]:
        return cells_at(with_overrides(template, seed=int(seed)), [claim], meta)

    return cells_for


def until_decided_in(out: str | os.PathLike[str], manifest: Manifest, claims: Sequence[Claim], cells_for: CellsFor,
                     *, max_seeds: int = sequential.DEFAULT_MAX_SEEDS, time_budget: float | None = None,
                     futility: float = sequential.DEFAULT_FUTILITY, shape: str = sequential.DEFAULT_SHAPE.value,
                     cell_fn: Any = None, cache_dir: Any = None, log: Callable[[str], None] | None = print,
                     run_cells_kw: Mapping[str, Any] | None = None,
                     replicate: Callable[[Any], Any | None] = replicate_config) -> Decisions:
    """The loop of the module docstring over directory ``out`` (its manifest ``manifest``, as loaded or as built):
    each claim is first read over the records already complete (nothing is built: a directory whose claims are
    all closed there says "no open claim"); each claim still open is then read by
    :func:`rope_quant.claims.engine.until_decided`, ``cells_for`` naming the cells one more seed
    adds, which the sweep runner computes (no complete cell recomputed). ``replicate``: a config's float-order
    replicate (the directory store's)."""
    from rope_quant.sweep.records import is_complete
    from rope_quant.sweep.runner import run_cells

    out = Path(out)
    store = DirectoryStore(out, manifest, replicate=replicate)
    seeds0 = store.seeds()
    state = plan_state(out, len(seeds0), max_seeds, shape)
    first_seeds = [int(s) for s in state.setdefault("seeds", seeds0[: int(state["first"])])]
    plan = sequential.Plan(int(state["first"]), int(state["max_seeds"]), futility=futility, shape=Shape(shape))
    absent = [c.id for c in claims if not all(store.planned(c.cells[n], first_seeds[0]) for n in c.cell_names())]
    if absent:
        raise DecideError(f"claims {', '.join(absent)} have no cells in {out}: leave them out or run the claims sweep "
                          "for them")
    atomic_write_json(out / STATE_FILE, state)
    cells = {(name, config_seed(cfg)): cfg for name, cfg in manifest.cells}
    meta = {k: dict(v) for k, v in manifest.meta.items()}
    started = time.perf_counter()
    failed: dict[str, str] = {}
    ran: list[int] = []

    def read_at(claim: Claim, seeds: Sequence[int], build: bool) -> ClaimResult:
        need: set[tuple[str, int]] = set()
        for seed in seeds:
            for name, cfg in cells_for(claim, int(seed), meta):
                cells.setdefault((name, int(seed)), cfg)
                need.add((name, int(seed)))
        order = {s: i for i, s in enumerate(dict.fromkeys([*first_seeds, *sorted(s for _, s in cells)]))}
        ordered = sorted(cells.items(), key=lambda kv: (order[kv[0][1]], kv[0][0]))
        current = Manifest(cells=[(n, c) for (n, _), c in ordered], study=manifest.study,
                           comparator=manifest.comparator, family=manifest.family, meta=meta)
        chosen = [i for i, (n, c) in enumerate(current.cells) if (n, config_seed(c)) in need
                  and not is_complete(out / cell_relpath(n, c), c.key())]
        if build and chosen:
            report = run_cells(current, out, chosen, cell_fn=cell_fn, cache_dir=cache_dir, log=None,
                               **(run_cells_kw or {}))
            ran.extend([*report.ran, *report.failed])
        stop = (FAILED_CELL + " ({error}); its error record: `rope-quant report DIR --check`") if build else \
            NOT_BUILT + " ({error})"
        result = evaluate(claim, DirectoryStore(out, current, replicate=replicate), seeds, plan, stop_missing=stop)
        if result.verdict.stop.startswith(FAILED_CELL):
            failed[claim.id] = result.verdict.stop
        return result

    def look(claim: Claim, build: bool) -> sequential.Looked:
        return engine.until_decided(claim, lambda seeds: read_at(claim, seeds, build), first_seeds, plan,
                                    time_budget=time_budget if build else None, started=started,
                                    log=log if build else None)

    read = {c.id: look(c, build=False) for c in claims}  # over the complete records: nothing is built
    open_ = [c for c in claims if read[c.id].result.verdict.stop.startswith(NOT_BUILT)]
    say = log or (lambda _line: None)
    if not open_:
        say("decide: no open claim: every claim is decided or stopped at its last look; nothing to build")
    else:
        say(f"decide: {plan.describe()}; {len(open_)} open claim(s) ({', '.join(c.id for c in open_)}); seeds so "
            f"far {min(len(read[c.id].seeds) for c in open_)} of {plan.max_seeds}")
    for claim in open_:
        read[claim.id] = look(claim, build=True)
    decided = [Decided(read[c.id].result, tuple(read[c.id].seeds), failed.get(c.id, read[c.id].stopped))
               for c in claims]
    return Decisions(plan, decided, bool(ran))


def planned_claims(store: DirectoryStore, claims: Sequence[Claim]) -> tuple[list[Claim], list[Claim]]:
    """The claims whose every cell the directory's manifest names at its first seed, with the float-order
    replicate of each cell a paired part reads (a claim whose cells another claim planned without them would read
    "no replicate exists"), and the others."""
    from rope_quant.claims.selection import paired_cells

    first = store.seeds()[0] if store.seeds() else None
    ok = [c for c in claims if first is not None and all(store.planned(c.cells[n], first) for n in c.cell_names())
          and all(store.planned_replicate(c.cells[n], first) for n in paired_cells(c))]
    return ok, [c for c in claims if c not in ok]

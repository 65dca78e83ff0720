"""Deciding a claims directory under the sequential rule (``rope-quant decide DIR`` on a ``rope-quant claims``
directory), and reading one claim over a directory without crashing on a missing cell.

Each claim the directory planned is read at the directory's seeds, then, while it is open, at one more seed
(:func:`rope_quant.core.sequential.until_decided`, the loop of the e2e suite's ``--rq-until-decided``): the new
seed's cells of that claim only (the comparator, the claim's cells and their float-order replicates,
:mod:`rope_quant.sweep.claims_sweep`) are added to the manifest and run through the sweep runner (resumable: no
complete cell is recomputed), and the claim is read again by :func:`rope_quant.claims.engine.evaluate` with the
plan. The plan (first look, M, boundary shape) and the seeds of the first look are kept in ``DIR/decide.json``
(:func:`rope_quant.sweep.decide.plan_state`), so a killed run resumes with the same plan.
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
from rope_quant.sweep.decide import STATE_FILE, DecideError, plan_state, replicate_config
from rope_quant.sweep.manifest import Manifest

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


def decide_claims(out: str | os.PathLike[str], manifest: Manifest, claims: Sequence[Claim], *,
                  max_seeds: int = sequential.DEFAULT_MAX_SEEDS, time_budget: float | None = None,
                  futility: float = sequential.DEFAULT_FUTILITY, shape: str = sequential.DEFAULT_SHAPE.value,
                  cell_fn: Any = None, cache_dir: Any = None, log: Callable[[str], None] | None = print,
                  run_cells_kw: Mapping[str, Any] | None = None) -> tuple[sequential.Plan, list[Decided]]:
    """Decide each of ``claims`` over directory ``out`` (its manifest ``manifest``) by the loop of the module
    docstring; returns the plan and each claim's reading, in order."""
    from rope_quant.sweep.runner import run_cells

    out = Path(out)
    store = DirectoryStore(out, manifest)
    check_claims_inputs(store, max_seeds, time_budget)
    seeds0 = store.seeds()
    state = plan_state(out, len(seeds0), max_seeds, shape)
    first_seeds = [int(s) for s in state.setdefault("seeds", seeds0)]
    plan = sequential.Plan(int(state["first"]), int(state["max_seeds"]), futility=futility, shape=Shape(shape))
    atomic_write_json(out / STATE_FILE, state)
    template = store.comparator(first_seeds[0])
    cells = {(name, config_seed(cfg)): cfg for name, cfg in manifest.cells}
    meta = {k: dict(v) for k, v in manifest.meta.items()}
    started = time.perf_counter()
    failed: dict[str, str] = {}

    def read_at(claim: Claim, seeds: Sequence[int]) -> ClaimResult:
        need: set[tuple[str, int]] = set()
        for seed in seeds:
            for name, cfg in cells_at(with_overrides(template, seed=int(seed)), [claim], meta):
                cells.setdefault((name, int(seed)), cfg)
                need.add((name, int(seed)))
        order = {s: i for i, s in enumerate(dict.fromkeys([*first_seeds, *sorted(s for _, s in cells)]))}
        ordered = sorted(cells.items(), key=lambda kv: (order[kv[0][1]], kv[0][0]))
        current = Manifest(cells=[(n, c) for (n, _), c in ordered], study=manifest.study,
                           comparator=manifest.comparator, family=manifest.family, meta=meta)
        chosen = [i for i, (n, c) in enumerate(current.cells) if (n, config_seed(c)) in need]
        run_cells(current, out, chosen, cell_fn=cell_fn, cache_dir=cache_dir, log=None, **(run_cells_kw or {}))
        result = evaluate(claim, DirectoryStore(out, current), seeds, plan, stop_missing=FAILED_CELL
                          + " ({error}); its error record: `rope-quant report DIR --check`")
        if result.verdict.stop.startswith(FAILED_CELL):
            failed[claim.id] = result.verdict.stop
        return result

    absent = [c.id for c in claims if not all(store.planned(c.cells[n], first_seeds[0]) for n in c.cell_names())]
    if absent:
        raise DecideError(f"claims {', '.join(absent)} have no cells in {out}: leave them out or run the claims sweep "
                          "for them")
    decided: list[Decided] = []
    for claim in claims:
        looked = sequential.until_decided(lambda seeds, c=claim: read_at(c, seeds), lambda r: r.verdict,
                                          first_seeds, plan, time_budget=time_budget, started=started, log=log,
                                          name=claim.id)
        decided.append(Decided(looked.result, tuple(looked.seeds), failed.get(claim.id, looked.stopped)))
    return plan, decided


def planned_claims(store: DirectoryStore, claims: Sequence[Claim]) -> tuple[list[Claim], list[Claim]]:
    """The claims whose every cell the directory's manifest names at its first seed, and the others."""
    first = store.seeds()[0] if store.seeds() else None
    ok = [c for c in claims if first is not None and all(store.planned(c.cells[n], first) for n in c.cell_names())]
    return ok, [c for c in claims if c not in ok]

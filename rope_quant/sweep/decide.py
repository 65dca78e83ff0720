"""Deciding a results directory's claims: add seeds until each is decided (``rope-quant decide DIR``).

The claims of a sweep directory are its paired comparisons: each config against its control (the manifest's
comparator, or ``meta[name]["control"]``), "ppl(config) − ppl(control) > 0" (holds: worse than the control;
refuted: better). :func:`config_claims` writes each as a registry claim (:class:`rope_quant.claims.registry.Claim`
of one paired part, its cells the two configs as flat overrides of the comparator's config), so that the one
engine (:func:`rope_quant.claims.engine.evaluate`) decides it over the directory's records
(:class:`~rope_quant.sweep.claim_store.DirectoryStore`) by the sequential rule (:mod:`rope_quant.core.sequential`;
docs/verdicts.md): the union of the primary paired interval and the float-order replicate interval.

The loop is :func:`rope_quant.sweep.claims_decide.until_decided_in` (:func:`decide_directory`): each claim is read
at the directory's seeds over the records already complete; while it is open, the next seed's cells of that claim
only (its config and its control, each with its float-order replicate: the same cell with GPTQ in the other float
mode, named ``NAME`` + :data:`REPLICATE_SUFFIX`) are added to the manifest and run through the sweep runner
(:func:`~rope_quant.sweep.runner.run_cells`: resumable, no complete cell recomputed); until it is decided, or
stopped at ``M`` seeds (its reason in the verdict), or the time budget is spent. The plan (``n0``, ``M``, the
boundary's shape, the seeds of the first look) is kept in ``DIR/decide.json`` (atomic), so a killed run resumes
with the same plan; ``DIR/decisions.json`` holds the verdicts.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rope_quant.claims.registry import Claim, Override, Part
from rope_quant.core import sequential
from rope_quant.core.verdict import Form, Verdict
from rope_quant.io import atomic_write_json
from rope_quant.sweep.cellkind import CellKindName, config_seed, kind_of, run_of, with_overrides
from rope_quant.sweep.claims_decide import FAILED_CELL, CellsFor, Decisions, until_decided_in
from rope_quant.sweep.decide_plan import (
    DECISIONS_FILE,
    REPLICATE_SUFFIX,
    STATE_FILE,
    DecideError,
    plan_state,
    replicate_config,
)
from rope_quant.sweep.manifest import Manifest

if TYPE_CHECKING:
    from rope_quant.claims.engine import ClaimResult

__all__ = ["DECISIONS_FILE", "REPLICATE_SUFFIX", "STATE_FILE", "DecideError", "compare_cells", "config_claims",
           "decide_directory", "plan_state", "replicate_config", "table", "with_family", "write_decisions"]

DIRECTORY = "directory"
"""The registry group of a directory's config claims (:func:`config_claims`; never registered)."""


def config_claims(manifest: Manifest) -> list[Claim]:
    """Every config of ``manifest`` paired against its control (the report's ``paired`` blocks; replicates and
    controls left out), as registry claims of one paired part "ppl(config) − ppl(control) > 0", in manifest
    order. A claim's id is its config's name, its cells the config and its control as flat overrides of the
    comparator's config (:class:`~rope_quant.sweep.claim_store.DirectoryStore`'s convention); a config that is
    not the comparator's with flat overrides is refused (:class:`DecideError`)."""
    names = [n for n in manifest.names() if not n.endswith(REPLICATE_SUFFIX)]
    control_of = {n: (manifest.meta.get(n) or {}).get("control", manifest.comparator) for n in names}
    controls = set(control_of.values())
    pairs = [(n, control_of[n]) for n in names if n not in controls and control_of[n] in names]
    if not pairs:
        return []
    first: dict[str, Any] = {}
    for name, cfg in manifest.cells:
        first.setdefault(name, cfg)
    if manifest.comparator not in first:
        raise DecideError(f"the comparator {manifest.comparator!r} has no cell in the directory: its claims' cells "
                          "are read as overrides of the comparator's config")
    comparator = first[manifest.comparator]
    cells = {n: _overrides(n, first[n], comparator) for pair in pairs for n in pair}
    return [Claim(name, f"{name} − {control} > 0",
                  f"ppl({name}) − ppl({control}) > 0 (holds: worse than its control; refuted: better)",
                  f"{manifest.study} directory", {name: cells[name], control: cells[control]},
                  (Part(f"ppl({name}) − ppl({control}) > 0", name, control, Form.GREATER),), premises=(),
                  group=DIRECTORY) for name, control in pairs]


def _flat(cfg: Any) -> dict[str, Any]:
    """A plain run's flat fields (a stand-in dataclass without ``flat()``: its fields)."""
    run = run_of(cfg)
    if hasattr(run, "flat"):
        return dict(run.flat())
    return {f.name: getattr(run, f.name) for f in dataclasses.fields(run)}


def _overrides(name: str, cfg: Any, comparator: Any) -> dict[str, Override]:
    """The flat fields in which ``cfg`` differs from ``comparator`` (the seed left out), checked to rebuild it."""
    a, b = _flat(cfg), _flat(comparator)
    out = {k: v for k, v in a.items() if k != "seed" and b.get(k) != v}
    target = with_overrides(cfg, seed=config_seed(comparator))
    if with_overrides(comparator, **out).key() != target.key():
        raise DecideError(f"config {name!r} is not the comparator {comparator!r}'s config with flat overrides: "
                          "decide reads each config as the comparator's with its own settings")
    return out


def claim_control(claim: Claim) -> str:
    """A config claim's control (its part's control cell)."""
    return str(claim.parts[0].control)


@dataclass(frozen=True)
class Outcomes:
    """The loop's result: each claim's verdict, the seeds it used, why the loop stopped."""

    verdicts: dict[str, Verdict]
    seeds: dict[str, int]
    stopped: str
    built: bool


def check_inputs(manifest: Manifest, max_seeds: int, time_budget: float | None,
                 replicate: Callable[[Any], Any | None] = replicate_config) -> list[Claim]:
    """The bad inputs, refused before anything is built: M below the seeds given, a time budget ≤ 0, no claim,
    a claim whose cells have no float-order replicate (the rule cannot decide)."""
    given = len(manifest.seeds())
    if max_seeds < given:
        raise DecideError(f"--max-seeds {max_seeds} is below the {given} seeds the directory already has: pass "
                          f"--max-seeds {given} or more")
    if max_seeds < 2:
        raise DecideError(f"--max-seeds {max_seeds}: the rule needs at least 2 seeds")
    if time_budget is not None and not time_budget > 0:
        raise DecideError(f"--time-budget {time_budget:g}: must be a positive number of seconds")
    other = sorted({kind_of(cfg).name for _, cfg in manifest.cells} - {CellKindName.RUN.value})
    if other:
        raise DecideError(f"cells of kind {', '.join(other)}: decide reads the perplexity of plain run cells (a "
                          "`rope-quant compare`, `support` or `estimators` directory); decide that study's claims "
                          "with `pytest -m e2e --rq-until-decided`")
    claims = config_claims(manifest)
    if not claims:
        raise DecideError("the directory has no paired comparison to decide (one config and its comparator at "
                          "least): run `rope-quant compare` with two configs or more")
    first_cells = {name: cfg for name, cfg in manifest.cells}
    for claim in claims:
        for name in claim.cell_names():
            if replicate(first_cells[name]) is None:
                raise DecideError(f"config {name!r} has no float-order replicate (its weights are not GPTQ): the "
                                  "sequential rule cannot decide without one; rerun the sweep with --weights gptq")
    return claims


def decide_directory(out: str | os.PathLike[str], manifest: Manifest, *, max_seeds: int = sequential.DEFAULT_MAX_SEEDS,
                     time_budget: float | None = None, futility: float = sequential.DEFAULT_FUTILITY,
                     shape: str = sequential.DEFAULT_SHAPE.value, cell_fn: Any = None,
                     replicate: Callable[[Any], Any | None] = replicate_config, cache_dir: Any = None,
                     log: Callable[[str], None] | None = print, run_cells_kw: Mapping[str, Any] | None = None
                     ) -> Outcomes:
    """The loop of the module docstring over ``manifest`` (the directory's, as loaded), in ``out``:
    :func:`check_inputs`, the one loop over :func:`config_claims` with :func:`compare_cells`, then
    :func:`write_decisions`."""
    claims = check_inputs(manifest, max_seeds, time_budget, replicate)
    got = until_decided_in(out, with_family(manifest, claims), claims, compare_cells(manifest, claims, replicate),
                           max_seeds=max_seeds, time_budget=time_budget, futility=futility, shape=shape,
                           cell_fn=cell_fn, cache_dir=cache_dir, log=log, run_cells_kw=run_cells_kw,
                           replicate=replicate)
    return write_decisions(out, claims, got)


def compare_cells(manifest: Manifest, claims: Sequence[Claim],
                  replicate: Callable[[Any], Any | None] = replicate_config) -> CellsFor:
    """The cells one seed adds for a config claim: its config and its control at that seed, each followed by its
    float-order replicate (``NAME`` + :data:`REPLICATE_SUFFIX`, its ``meta`` naming what it replicates)."""
    template = {name: cfg for name, cfg in manifest.cells}
    control = {c.id: claim_control(c) for c in claims}

    def cells_for(claim: Claim, seed: int, meta: dict[str, dict[str, Any]]) -> list[tuple[str, Any]]:
        found = []
        for name in claim.cell_names():
            cfg = with_overrides(template[name], seed=seed)
            found += [(name, cfg), (name + REPLICATE_SUFFIX, replicate(cfg))]
            own = (meta.get(name) or {}).get("control", control.get(name, manifest.comparator))
            meta.setdefault(name + REPLICATE_SUFFIX, {"replicate_of": name, "control": own + REPLICATE_SUFFIX})
        return found

    return cells_for


def with_family(manifest: Manifest, claims: Sequence[Claim]) -> Manifest:
    """``manifest`` whose Holm family is its configs with a claim when it names none (so the replicates the loop
    adds stay out of the report's family)."""
    family = manifest.family if manifest.family is not None else tuple(c.id for c in claims)
    return dataclasses.replace(manifest, family=tuple(family))


def write_decisions(out: str | os.PathLike[str], claims: Sequence[Claim], got: Decisions) -> Outcomes:
    """``DIR/decisions.json`` of a compare directory (the plan, why the loop stopped, each config claim's
    verdict and seeds) and the :class:`Outcomes`."""
    stops = [d.stopped for d in got.decided]
    failed = [d.result.id for d in got.decided if d.stopped.startswith(FAILED_CELL)]
    if not got.built:
        stopped = "no open claim"
    elif failed:
        stopped = f"cells failed for {', '.join(failed)} (their error records: `rope-quant report DIR --check`)"
    else:
        stopped = next((s for s in stops if s.startswith("time budget")),
                       "every claim decided or stopped at its last look")
    verdicts = {d.result.id: decision(d.result) for d in got.decided}
    seeds = {d.result.id: len(d.seeds) for d in got.decided}
    plan = got.plan
    atomic_write_json(Path(out) / DECISIONS_FILE, {
        "plan": {"first": plan.first, "max_seeds": plan.max_seeds, "alpha": plan.alpha,
                 "alpha_per_look": plan.alpha_look, "futility": plan.futility, "shape": plan.shape.value,
                 "rule": sequential.RULE_SEQUENTIAL},
        "stopped": stopped,
        "claims": [{"claim": c.title, "config": c.id, "control": claim_control(c), "seeds": seeds[c.id],
                    "decision": verdicts[c.id].to_dict()} for c in claims]})
    return Outcomes(verdicts, seeds, stopped, got.built)


def decision(result: ClaimResult) -> Verdict:
    """A config claim's verdict: its one part's as the sequential rule gave it (the claim's when its cells were
    not read)."""
    part = result.parts[0]
    return part.verdict if part.treatment else result.verdict


def table(outcomes: Outcomes, claims: Sequence[Claim]) -> str:
    """The claims table of a decide run (markdown)."""
    from rope_quant.io import markdown_table

    rows = []
    for c in claims:
        v = outcomes.verdicts.get(c.id)
        rows.append({"claim": c.title, "seeds": str(outcomes.seeds.get(c.id, 0)),
                     "Δ (interval at the last look)": (f"{v.mean:+.3f} ({v.low:+.3f}, {v.high:+.3f})"
                                                       if v is not None and v.low is not None and v.mean is not None
                                                       else "–"),
                     "verdict": v.text() if v is not None else "inconclusive: fewer seeds than the first look"})
    return markdown_table(rows, ["claim", "seeds", "Δ (interval at the last look)", "verdict"])

"""Deciding a results directory's claims: add seeds until each is decided (``rope-quant decide DIR``).

The claims of a sweep directory are its paired comparisons: each config against its control (the manifest's
comparator, or ``meta[name]["control"]``), "ppl(config) − ppl(control) > 0" (holds: worse than the control;
refuted: better), decided by the sequential rule (:mod:`rope_quant.core.sequential`; docs/verdicts.md) on the
union of the primary paired interval and the float-order replicate interval, read after every added seed.

The loop (:func:`decide_directory`): every seed of an open claim gets its float-order replicate cells (the
same cell with GPTQ in the other float mode, named ``NAME`` + :data:`REPLICATE_SUFFIX`); the claims are read;
for the claims still open the next seed's cells are added to the manifest (only the configs and controls those
claims need, with their replicates) and run through the sweep runner (:func:`~rope_quant.sweep.runner.run_cells`:
resumable, no complete cell recomputed); until every claim is decided, or stopped at ``M`` seeds (its reason in
the verdict), or the time budget is spent. The plan (``n0``, ``M``) and the cells added are kept in
``DIR/decide.json`` (atomic), so a killed run resumes with the same plan; ``DIR/decisions.json`` holds the
verdicts.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rope_quant.core import sequential
from rope_quant.core.verdict import Form, Outcome, Verdict
from rope_quant.defaults import Shape
from rope_quant.io import atomic_write_json
from rope_quant.sweep.cellkind import CellKindName, SweepError, config_seed, kind_of, run_of, with_overrides
from rope_quant.sweep.manifest import Manifest

STATE_FILE = "decide.json"
DECISIONS_FILE = "decisions.json"
REPLICATE_SUFFIX = ".float-order"
"""The name of a config's float-order replicate cells (GPTQ in the other float mode)."""


class DecideError(SweepError):
    """Input the decide loop refuses before it builds anything (the CLI's exit 2)."""


def replicate_config(cfg: Any) -> Any | None:
    """The cell with GPTQ in the other float mode (float64 ↔ float32), or None where no replicate cell is built:
    weights not GPTQ-quantised (:func:`rope_quant.experiment.replicate.replicate_kind`, the one rule)."""
    from rope_quant.experiment.replicate import Replicate, replicate_kind, replicate_overrides

    run = run_of(cfg)
    if replicate_kind(run) is not Replicate.REBUILD:
        return None
    return with_overrides(cfg, **replicate_overrides(run))


@dataclass(frozen=True)
class Claim:
    """One paired comparison of the directory: ``name`` against ``control``."""

    name: str
    control: str

    @property
    def label(self) -> str:
        return f"{self.name} − {self.control} > 0"


def claims_of(manifest: Manifest) -> list[Claim]:
    """Every config paired against its control (the report's ``paired`` blocks), replicates left out."""
    names = [n for n in manifest.names() if not n.endswith(REPLICATE_SUFFIX)]
    control_of = {n: (manifest.meta.get(n) or {}).get("control", manifest.comparator) for n in names}
    controls = set(control_of.values())
    return [Claim(n, control_of[n]) for n in names if n not in controls and control_of[n] in names]


@dataclass
class Progress:
    """What the loop has done so far: rounds, seconds spent running cells, seeds added."""

    rounds: int = 0
    seconds: float = 0.0
    seeds_added: int = 0
    lines: list[str] = field(default_factory=list)

    def per_seed(self) -> float | None:
        return self.seconds / self.seeds_added if self.seeds_added else None


@dataclass(frozen=True)
class Outcomes:
    """The loop's result: each claim's verdict, the seeds it used, why the loop stopped."""

    verdicts: dict[str, Verdict]
    seeds: dict[str, int]
    stopped: str
    built: bool


def plan_state(out: Path, first: int, max_seeds: int, shape: str) -> dict[str, Any]:
    """The plan kept in ``DIR/decide.json`` (a new one at ``first`` seeds); a changed M or shape is refused."""
    path = out / STATE_FILE
    if path.is_file():
        state = json.loads(path.read_text())
        if int(state["max_seeds"]) != max_seeds:
            raise DecideError(f"{path}: this directory's plan was fixed at --max-seeds {state['max_seeds']} (looks "
                              f"{state['first']}…{state['max_seeds']}); rerun with --max-seeds {state['max_seeds']}, "
                              "or decide in a fresh directory (changing M after looking breaks the error bound)")
        fixed = state.get("shape", "normal")  # a plan written before the boundary had a shape used the t boundary
        if fixed != shape:
            raise DecideError(f"{path}: this directory's plan was fixed with --shape {fixed}; rerun with --shape "
                              f"{fixed}, or decide in a fresh directory (changing the boundary after looking "
                              "breaks the error bound)")
        return state
    return {"first": first, "max_seeds": max_seeds, "shape": shape, "added": []}


def check_inputs(manifest: Manifest, max_seeds: int, time_budget: float | None,
                 replicate: Callable[[Any], Any | None]) -> list[Claim]:
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
    claims = claims_of(manifest)
    if not claims:
        raise DecideError("the directory has no paired comparison to decide (one config and its comparator at "
                          "least): run `rope-quant compare` with two configs or more")
    first_cells = {name: cfg for name, cfg in manifest.cells}
    for claim in claims:
        for name in (claim.name, claim.control):
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
    """The loop of the module docstring over ``manifest`` (the directory's, as loaded), in ``out``."""
    from rope_quant.sweep.runner import run_cells

    out = Path(out)
    claims = check_inputs(manifest, max_seeds, time_budget, replicate)
    say = log or (lambda _line: None)
    state = plan_state(out, len(manifest.seeds()), max_seeds, shape)
    plan = sequential.Plan(int(state["first"]), int(state["max_seeds"]), futility=futility, shape=Shape(shape))
    template = {name: cfg for name, cfg in manifest.cells}

    def make(name: str, seed: int) -> Any:
        base = name[: -len(REPLICATE_SUFFIX)] if name.endswith(REPLICATE_SUFFIX) else name
        cfg = with_overrides(template[base], seed=seed)
        return replicate(cfg) if name != base else cfg

    cells = {(name, config_seed(cfg)): cfg for name, cfg in manifest.cells}
    for name, seed in state["added"]:
        cells.setdefault((name, int(seed)), make(name, int(seed)))
    seeds_all = sorted({s for _, s in cells}, key=lambda s: (s not in manifest.seeds(), s))
    verdicts = _read(out, claims, cells, plan, seeds_all)
    open_ = [c for c in claims if _open(verdicts[c.name][0])]
    if not open_:
        say("decide: no open claim: every claim is decided or stopped at its last look; nothing to build")
        return _finish(out, claims, verdicts, plan, "no open claim", built=False)
    say(f"decide: {plan.describe()}; {len(open_)} open claim(s) ({', '.join(c.name for c in open_)}); seeds so far "
        f"{max(verdicts[c.name][1] for c in claims)} of {plan.max_seeds}")
    meta = dict(manifest.meta)
    family = manifest.family if manifest.family is not None else tuple(c.name for c in claims)
    progress, start, stopped = Progress(), time.perf_counter(), ""
    while True:
        target = {c.name: plan.first if verdicts[c.name][0] is None else min(verdicts[c.name][1] + 1, plan.max_seeds)
                  for c in open_}
        while len(seeds_all) < max(target.values()):
            seeds_all.append(max(seeds_all) + 1 if seeds_all else 0)
        need: set[tuple[str, int]] = set()
        for claim in open_:
            for seed in seeds_all[: target[claim.name]]:
                for name in (claim.name, claim.control):
                    need |= {(name, seed), (name + REPLICATE_SUFFIX, seed)}
        for name, seed in sorted(need):
            if (name, seed) not in cells:
                cells[(name, seed)] = make(name, seed)
                state["added"].append([name, seed])
            if name.endswith(REPLICATE_SUFFIX):
                base = name[: -len(REPLICATE_SUFFIX)]
                control = (meta.get(base) or {}).get("control", manifest.comparator)
                meta.setdefault(name, {"replicate_of": base, "control": control + REPLICATE_SUFFIX})
        atomic_write_json(out / STATE_FILE, state)  # before the manifest: a kill between them resumes the same plan
        ordered = sorted(cells.items(), key=lambda kv: (seeds_all.index(kv[0][1]), kv[0][0]))
        full = Manifest(cells=[(name, cfg) for (name, _), cfg in ordered], study=manifest.study,
                        comparator=manifest.comparator, family=tuple(family), meta=meta)
        chosen = [i for i, (name, cfg) in enumerate(full.cells) if (name, config_seed(cfg)) in need]
        t0 = time.perf_counter()
        report = run_cells(full, out, chosen, cell_fn=cell_fn, cache_dir=cache_dir, log=None, **(run_cells_kw or {}))
        if report.ran:
            progress.seconds += time.perf_counter() - t0
            progress.seeds_added += len({config_seed(full.cells[i][1]) for i in report.ran})
        progress.rounds += 1
        verdicts = _read(out, claims, cells, plan, seeds_all)
        stuck = [c for c in open_ if verdicts[c.name][1] < target[c.name] and _open(verdicts[c.name][0])]
        open_ = [c for c in open_ if _open(verdicts[c.name][0]) and c not in stuck]
        per_seed = progress.per_seed()
        most = max((verdicts[c.name][1] for c in open_), default=max(v[1] for v in verdicts.values()))
        eta = f"; ETA ≤ {per_seed * (plan.max_seeds - most) / 60:.1f} min" if per_seed and open_ else ""
        line = (f"decide: round {progress.rounds}: {len(open_)} open claim(s)"
                + (f" ({', '.join(c.name for c in open_)})" if open_ else "")
                + f"; seeds so far {most} of {plan.max_seeds}"
                + (f"; {per_seed:.1f} s per seed measured" if per_seed else "") + eta)
        progress.lines.append(line)
        say(line)
        if stuck:
            stopped = ("cells failed for " + ", ".join(c.name for c in stuck)
                       + " (their error records: `rope-quant report DIR --check`)")
        if not open_:
            stopped = stopped or "every claim decided or stopped at its last look"
            break
        if time_budget is not None and per_seed is not None and \
                time.perf_counter() - start + per_seed > time_budget:
            stopped = f"time budget {time_budget:g} s: the next seed would pass it"
            break
    return _finish(out, claims, verdicts, plan, stopped, built=True)


def _open(v: Verdict | None) -> bool:
    """Not decided and not stopped at the last look (a claim without enough cells yet is open)."""
    return v is None or (v.outcome is Outcome.INCONCLUSIVE and not v.stop)


def _read(out: Path, claims: list[Claim], cells: Mapping[tuple[str, int], Any], plan: sequential.Plan,
          seeds: list[int]) -> dict[str, tuple[Verdict | None, int]]:
    """Each claim's sequential verdict on its first n seeds that have all four cells complete (None below n0)."""
    from rope_quant.sweep.manifest import cell_relpath
    from rope_quant.sweep.records import is_complete, read_record

    def ppl(name: str, seed: int) -> float | None:
        cfg = cells.get((name, seed))
        if cfg is None:
            return None
        path = out / cell_relpath(name, cfg)
        if not is_complete(path, cfg.key()):
            return None
        rec = read_record(path) or {}
        value = (rec.get("result") or {}).get("ppl")
        return float(value) if isinstance(value, (int, float)) else None

    out_: dict[str, tuple[Verdict | None, int]] = {}
    for claim in claims:
        diffs, shifts = [], []
        for seed in seeds:
            vals = [ppl(n, seed) for n in (claim.name, claim.control, claim.name + REPLICATE_SUFFIX,
                                           claim.control + REPLICATE_SUFFIX)]
            if any(v is None for v in vals):
                break
            t, c, tr, cr = (float(v) for v in vals if v is not None)
            diffs.append(t - c)
            shifts.append((tr - cr) - (t - c))
            if len(diffs) == plan.max_seeds:
                break
        n = len(diffs)
        v = sequential.decide(Form.GREATER, diffs, shifts, plan) if n >= plan.first else None
        out_[claim.name] = (v, n)
    return out_


def _finish(out: Path, claims: list[Claim], verdicts: Mapping[str, tuple[Verdict | None, int]],
            plan: sequential.Plan, stopped: str, built: bool) -> Outcomes:
    result = {c.name: v for c in claims if (v := verdicts[c.name][0]) is not None}
    seeds = {c.name: verdicts[c.name][1] for c in claims}
    atomic_write_json(out / DECISIONS_FILE, {
        "plan": {"first": plan.first, "max_seeds": plan.max_seeds, "alpha": plan.alpha,
                 "alpha_per_look": plan.alpha_look, "futility": plan.futility, "shape": plan.shape.value,
                 "rule": sequential.RULE_SEQUENTIAL},
        "stopped": stopped,
        "claims": [{"claim": c.label, "config": c.name, "control": c.control, "seeds": seeds[c.name],
                    "decision": result[c.name].to_dict() if c.name in result else None} for c in claims]})
    return Outcomes(result, seeds, stopped, built)


def table(outcomes: Outcomes, claims: list[Claim]) -> str:
    """The claims table of a decide run (markdown)."""
    from rope_quant.io import markdown_table

    rows = []
    for c in claims:
        v = outcomes.verdicts.get(c.name)
        rows.append({"claim": c.label, "seeds": str(outcomes.seeds.get(c.name, 0)),
                     "Δ (interval at the last look)": (f"{v.mean:+.3f} ({v.low:+.3f}, {v.high:+.3f})"
                                                       if v is not None and v.low is not None and v.mean is not None
                                                       else "–"),
                     "verdict": v.text() if v is not None else "inconclusive: fewer seeds than the first look"})
    return markdown_table(rows, ["claim", "seeds", "Δ (interval at the last look)", "verdict"])

"""The one path every sweep command takes: check the input, build the manifest, run (or submit) its cells,
then write and print the report. Commands supply only the manifest (:func:`sweep`)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rope_quant.cli.args import CLIError
from rope_quant.cli.common import checkpoint, resolve_budget, seeds

if TYPE_CHECKING:
    from rope_quant.sweep.loaded_models import ModelCache

CellFn = Callable[[Any], Mapping[str, Any]]
#: ``build(args, seeds, used) -> Manifest``: a command's manifest (it may append to ``used``).
Build = Callable[[argparse.Namespace, tuple[int, ...], list[str]], Any]


@dataclass(frozen=True)
class Cells:
    """What computes the cells of a command: ``cell_fn`` when given, else the real pipeline over ``models``."""

    cell_fn: CellFn | None = None
    models: ModelCache | None = None

    def cache(self) -> ModelCache:
        """The base-model cache the real pipeline uses (``models``, else the process-wide one)."""
        from rope_quant.sweep.loaded_models import process_models

        return self.models if self.models is not None else process_models()

    def function(self, args: argparse.Namespace, out: Path) -> CellFn:
        """The cell function for results directory ``out`` (weight cache ``--cache-dir``, default DIR/cache)."""
        if self.cell_fn is not None:
            return self.cell_fn
        from rope_quant.sweep.cells import pipeline_cell_fn
        from rope_quant.sweep.runner import CACHE_DIR

        cache = Path(args.cache_dir) if args.cache_dir else out / CACHE_DIR
        return pipeline_cell_fn(cache, artifacts=out, progress=args.progress, models=self.cache())


def describe(cfg: Any) -> str:
    """One line with the settings shared by a sweep's cells (the rotations and their deviations included)."""
    from rope_quant.experiment.config import RotationKind
    from rope_quant.quant.quantizers import OFF_BITS
    from rope_quant.sweep.cellkind import run_of

    run = run_of(cfg)
    evals = "all" if run.eval_windows is None else run.eval_windows
    rot = run.rotation
    r1 = rot.r1.value + (f" (epochs {rot.whip.epochs}, batch {rot.whip.batch_size}, subset {rot.whip.subset}, "
                         f"lr {rot.whip.lr}{', cosine' if rot.whip.cosine else ''})"
                         if rot.r1 == RotationKind.WHIP else "")
    weights = (f"weights=16-bit (W{run.w_bits}: not quantised)" if run.w_bits >= OFF_BITS else
               f"weights={run.weights}{'' if run.gptq.mse else ' (no MSE clip search)'}")
    line = (f"model={run.model} corpus={run.corpus} W{run.w_bits}A{run.a_bits}K{run.k_bits}V{run.v_bits} "
            f"{weights} R1={r1} R2={rot.r2.value} R4={'hadamard' if rot.r4 else 'off'} "
            f"estimator={run.estimator} angle={run.angle} seqlen={run.seqlen} calib_windows={run.calib_windows} "
            f"eval_windows={evals} device={run.device} dtype={run.dtype}")
    kq = run.quant.kq
    if not kq.is_default:  # another key quantiser than the paper's per-token rule, with its parameters
        given = ", ".join(f"{k}={v}" for k, v in kq.params().items() if v is not None)
        line += f"\nkey quantiser: {kq.kind}" + (f" ({given})" if given else "")
    if run.online.runtime_rotation:
        line += "\nruntime rotation: llama.cpp's online Hadamard on Q and K after RoPE and R3"
    if rot.deviations:
        line += "\ndeviations from the paper's rotations: " + "; ".join(rot.deviations)
    return line


def weight_mode_note(cfg: Any, used: Sequence[str]) -> str | None:
    """Which weight quantiser the perplexities come from, when it is the CPU budget's RTN (not the paper's GPTQ)."""
    from rope_quant.quant.quantizers import OFF_BITS
    from rope_quant.sweep.cellkind import run_of

    run = run_of(cfg)
    if run.w_bits >= OFF_BITS or str(run.weights) != "rtn":
        return None
    why = "the CPU budget's default" if any(u.startswith("weights=") for u in used) else "--weights rtn"
    return (f"weights: RTN ({why}), not the paper's GPTQ: perplexities are higher than GPTQ's; "
            "--weights gptq for the paper's weight quantiser")


def print_settings(args: argparse.Namespace, cfg: Any, used: Sequence[str]) -> None:
    """The settings line, the defaults used and the weight-mode note (stdout)."""
    print("settings: " + describe(cfg), flush=True)
    if used:
        print("defaults used: " + ", ".join(used), flush=True)
    note = weight_mode_note(cfg, used)
    if note:
        print(note, flush=True)


def slurm_params(items: Sequence[str]) -> dict[str, Any]:
    """``--slurm-param KEY=VALUE`` items as executor parameters (values parsed as JSON where they are)."""
    params: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise CLIError(f"--slurm-param expects KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError:
            params[key] = value
    return params


def print_first_error(out: Path, manifest: Any, failed: Sequence[int]) -> None:
    """The first failed cell's error on stderr: in full, or one line for a filesystem fault (disk full ...)."""
    from rope_quant.sweep import records

    name, cfg = manifest.cells[failed[0]]
    sidecar = records.failure_path(out, name, cfg)  # a failed rerun of a complete cell keeps the good record
    path = sidecar if sidecar.exists() else records.cell_path(out, name, cfg)
    error = (records.read_record(path) or {}).get("error") or {}
    print(f"\nfirst error ({name} seed {cfg.seed}, {len(failed)} failed cell(s); records under {out}):",
          file=sys.stderr)
    line = environment_line(error.get("type"), error.get("message"))
    print(line or error.get("traceback") or f"{error.get('type')}: {error.get('message')}", file=sys.stderr)


def environment_line(kind: str | None, message: str | None) -> str | None:
    """One line for a cell that failed on a filesystem fault (its record holds the traceback), else None."""
    text = str(message or "")
    for needle, what in (("No space left", "disk full"), ("Disk quota", "disk full"),
                         ("Read-only file system", "read-only filesystem"), ("Permission denied", "permission")):
        if needle in text:
            return (f"{what}: {kind}: {text} (an environment fault, not a bug: fix it and rerun the same "
                    "command; complete cells are kept)")
    return None


def pending(out: Path, manifest: Any, indices: Sequence[int], resume: bool) -> list[tuple[str, Any]]:
    """The cells among ``indices`` that will run (with ``resume``, those not complete yet)."""
    from rope_quant.sweep import records

    cells = [manifest.cells[i] for i in indices]
    if not resume:
        return cells
    return [(name, cfg) for name, cfg in cells if not records.is_complete(records.cell_path(out, name, cfg),
                                                                           cfg.key())]


def sweep(args: argparse.Namespace, cells: Cells, build: Build,
          report_fn: Callable[[Path], dict] | None = None) -> int:
    """The shared sweep command: validate every model-free input, build the manifest, execute it."""
    from rope_quant.cli.validate import check_memory, validate_common
    from rope_quant.model.offload import set_default_mode

    validate_common(args)
    used: list[str] = []
    chosen = seeds(args, used)
    used += resolve_budget(args)[1]
    manifest = build(args, chosen, used)
    configs = len({name for name, _ in manifest.cells})  # cell names are the configs (each run per seed)
    mode = check_memory(args, configs=configs, seeds=len(chosen))  # exit 2 with the remedy before anything loads
    if getattr(args, "dry_run", False):  # a command's --dry-run: every check made, nothing run or written
        print_settings(args, manifest.cells[0][1], used)
        print(f"dry run: {len(manifest)} cells planned; nothing was run or written to {args.out}", flush=True)
        return 0
    with set_default_mode(mode):
        return execute(args, cells, manifest, used, report_fn)


def _selection(args: argparse.Namespace) -> Any:
    from rope_quant.sweep import runner

    if args.slurm is not None and args.slurm < 1:
        raise CLIError("--slurm needs a positive number of array tasks")
    if args.shard is None:
        return None
    selection = runner.shard_from_env() if args.shard == "auto" else runner.parse_shard(args.shard)
    if selection is None:
        raise CLIError("--shard auto: no SLURM_ARRAY_TASK_ID/COUNT or PYTEST_XDIST_WORKER/COUNT set")
    return selection


def execute(args: argparse.Namespace, cells: Cells, manifest: Any, used: list[str],
            report_fn: Callable[[Path], dict] | None = None) -> int:
    """Run (or submit) a sweep's cells, then write and print the report (``report_fn(out)`` for kinds with
    their own report, returning ``{"markdown", "files"}``; default the paired perplexity report)."""
    from rope_quant.analysis import report
    from rope_quant.sweep import runner, slurm
    from rope_quant.sweep.manifest import Manifest, reconcile, write_manifest
    from rope_quant.sweep.preflight import preflight

    out = Path(args.out)
    print(f"rope-quant {args.command}: {len(manifest)} cells -> {out}", flush=True)
    print_settings(args, manifest.cells[0][1], used)
    params = slurm_params(args.slurm_param)  # executor parameters; cluster=local picks submitit's local executor
    for key in ("cell_fn", "cache_dir", "resume"):
        if key in params:
            raise CLIError(f"--slurm-param {key}=...: not an executor parameter (see --cache-dir, --no-resume)")
    selection = _selection(args)
    merged = reconcile(out, manifest, force=args.force_new_manifest)
    if merged.kept or (merged.added and merged.added < len(merged.manifest)):
        print(f"manifest of {out}: same study, {merged.added} cells added, {merged.kept} existing cells kept "
              f"({len(merged.manifest)} in all)", flush=True)
    if merged.content_changed:
        print(f"note: content changed since the last run into {out} (cells get new keys and are recomputed): "
              + "; ".join(merged.content_changed), flush=True)
    chosen = range(len(manifest)) if selection is None else runner.shard_indices(len(manifest), *selection)
    selected = [merged.indices[i] for i in chosen]
    todo = pending(out, merged.manifest, selected, args.resume and args.slurm is None)
    if todo:
        for note in preflight(Manifest(cells=todo, study=manifest.study), cells.cache(),
                              load=cells.cell_fn is None and args.slurm is None,
                              configs={args.model: checkpoint(args).config}):
            print(f"note: {note}", file=sys.stderr)
    if args.slurm is not None:
        write_manifest(out, merged.manifest)
        jobs = slurm.submit_slurm(out, args.slurm, cell_fn=cells.cell_fn, cache_dir=args.cache_dir,
                                  resume=args.resume, **params)
        print(f"submitted {len(jobs)} Slurm array tasks; when done run `rope-quant report {out}`")
        return 0
    start = time.perf_counter()
    from rope_quant.sweep.cache_policy import default_pruner

    pruner = default_pruner(out, merged.manifest, keep=getattr(args, "keep_cache", False), cache_dir=args.cache_dir)
    result = runner.run_cells(merged.manifest, out, selected,
                              cell_fn=cells.function(args, out), resume=args.resume,
                              cache_dir=args.cache_dir, device=args.device,
                              log=None if args.quiet else (lambda s: print(s, flush=True)),
                              after_cell=None if pruner is None else pruner.after_cell)
    print(f"cells: {result.summary()}", flush=True)
    if report_fn is None:
        rep = report.write_report(out, comparator=args.comparator, figures=args.figures)
        written = f"{out / 'summary.json'} and {out / 'summary.md'}"
    else:
        rep = report_fn(out)
        written = ", ".join(str(f) for f in rep["files"] if not str(f).endswith(".png"))
    print()
    print(rep["markdown"])
    print(f"wrote {written} (wall {time.perf_counter() - start:.1f}s)")
    for path in rep["files"]:
        if str(path).endswith(".png"):
            print(f"figure: {path}")
    if cells.cell_fn is None:
        from rope_quant.sweep.cache_policy import policy_lines

        for line in policy_lines(Path(args.cache_dir) if args.cache_dir else out / runner.CACHE_DIR, pruner):
            print(line)
    if result.failed:
        print_first_error(out, merged.manifest, result.failed)
    return 1 if result.failed else 0

"""Running a sweep: the cells of a manifest, one record each, with resume and shards (docs/ARCHITECTURE.md).

Each cell runs on its own and writes its record (:mod:`rope_quant.sweep.records`); a rerun skips the
complete cells; a cell that raises writes an error record (not complete) and the sweep goes on. What
computes a cell is a parameter: ``cell_fn`` (tests pass fakes) or, by default, the real pipeline
(:func:`rope_quant.sweep.cells.pipeline_cell_fn`) over a :class:`~rope_quant.sweep.loaded_models.ModelCache`.

Parallelism is left to existing engines. ``--shard i/n`` (:func:`shard_indices`) splits the manifest
into ``n`` deterministic, disjoint, contiguous blocks, so pytest-xdist workers, Slurm array tasks
(:mod:`rope_quant.sweep.slurm`) or several hosts on a shared file system can each run one block.
Contiguous blocks keep the cells of one seed together, so the weight cache (``DIR/cache``, keyed by
``cfg.weight_key()``) is mostly reused within a process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rope_quant.experiment.envinfo import env_info, write_env
from rope_quant.sweep import records
from rope_quant.sweep.cells import CellFn, artifact_dir, pipeline_cell_fn
from rope_quant.sweep.loaded_models import ModelCache
from rope_quant.sweep.lock import CellClaim
from rope_quant.sweep.manifest import Manifest, SweepError, commit_manifest, config_seed, load_manifest, run_of

CACHE_DIR = "cache"


class ShardSpecError(SweepError):
    """A malformed ``--shard i/n``."""


# ----------------------------------------------------------------------------- shards


def parse_shard(text: str) -> tuple[int, int]:
    """Parse ``"i/n"`` (0-based ``i``, ``0 <= i < n``)."""
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text or "")
    if not match:
        raise ShardSpecError(f"--shard expects i/n with integers 0 <= i < n (e.g. 0/4), got {text!r}")
    i, n = int(match.group(1)), int(match.group(2))
    if n < 1 or not 0 <= i < n:
        raise ShardSpecError(f"--shard {text!r}: need n >= 1 and 0 <= i < n (shards are 0-based)")
    return i, n


def shard_from_env(env: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """The shard of this process under Slurm arrays or pytest-xdist, if any (``--shard auto``)."""
    env = os.environ if env is None else env
    if "SLURM_ARRAY_TASK_ID" in env and "SLURM_ARRAY_TASK_COUNT" in env:
        i = int(env["SLURM_ARRAY_TASK_ID"]) - int(env.get("SLURM_ARRAY_TASK_MIN", "0"))
        return parse_shard(f"{i}/{env['SLURM_ARRAY_TASK_COUNT']}")
    worker = env.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and "PYTEST_XDIST_WORKER_COUNT" in env:
        return parse_shard(f"{worker[2:]}/{env['PYTEST_XDIST_WORKER_COUNT']}")
    return None


def shard_indices(n_cells: int, shard: int, n_shards: int) -> list[int]:
    """Cell indices of shard ``shard`` of ``n_shards``: contiguous, balanced (sizes differ by <= 1).

    Shard ``i`` holds ``[floor(i N / n), floor((i+1) N / n))``; over ``i`` these partition ``range(N)``.
    """
    parse_shard(f"{shard}/{n_shards}")
    return list(range((shard * n_cells) // n_shards, ((shard + 1) * n_cells) // n_shards))


Selection = tuple[int, int] | Iterable[int] | Callable[[str, Any], bool] | None


def select(manifest: Manifest, selection: Selection = None) -> list[int]:
    """Indices of the manifest's cells chosen by ``selection``.

    ``None``: all; ``(i, n)`` or ``"i/n"``: shard ``i`` of ``n``; an iterable of ints: those indices;
    a callable ``f(name, cfg) -> bool``: a filter.
    """
    n = len(manifest)
    if selection is None:
        return list(range(n))
    if isinstance(selection, str):
        return shard_indices(n, *parse_shard(selection))
    if callable(selection):
        return [i for i, (name, cfg) in enumerate(manifest.cells) if selection(name, cfg)]
    if isinstance(selection, tuple) and len(selection) == 2 and all(isinstance(v, int) for v in selection):
        return shard_indices(n, *selection)
    chosen = sorted({int(i) for i in selection})
    bad = [i for i in chosen if not 0 <= i < n]
    if bad:
        raise SweepError(f"cell indices {bad} out of range for a manifest of {n} cells")
    return chosen


# ----------------------------------------------------------------------------- running


@dataclass
class SweepReport:
    """What one ``run_cells`` call did (indices into the manifest)."""

    ran: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        return (
            f"{len(self.ran)} ran, {len(self.skipped)} already complete, {len(self.failed)} failed "
            f"in {self.seconds:.1f}s"
        )


def run_cell_record(
    name: str, cfg: Any, out: str | os.PathLike[str], cell_fn: CellFn, env: dict | None = None
) -> tuple[Path, bool]:
    """Run one cell and write its record atomically; returns (path, ok).

    An ``Exception`` from ``cell_fn``, or a result without a score (e.g. every context length failed),
    becomes an error record (``ok=False``); ``KeyboardInterrupt`` and other ``BaseException`` propagate,
    leaving the previous record as it was, so the cell runs again on resume. A record is replaced only
    by a complete one (:func:`~rope_quant.sweep.records.write_record`): a failing rerun of a complete
    cell (``resume=False``) keeps the old result and writes its error record next to it.
    """
    env = env if env is not None else env_info()
    start = time.perf_counter()
    try:
        result = dict(cell_fn(cfg))
    except Exception as exc:  # recorded, the sweep goes on
        record = records.error_record(name, cfg, exc, time.perf_counter() - start, env)
        return records.write_record(out, name, cfg, record), False
    record = records.result_record(name, cfg, result, time.perf_counter() - start, env)
    return records.write_record(out, name, cfg, record), record["status"] == "ok"


def _protocol(manifest: Manifest) -> dict[str, Any] | None:
    """The offline rotations of the manifest's cells for env.json (per distinct setting when they differ)."""
    seen: dict[str, dict[str, Any]] = {}
    for _, cfg in manifest.cells:
        rotation = getattr(run_of(cfg), "rotation", None)
        if rotation is not None and hasattr(rotation, "protocol"):
            p = rotation.protocol()
            seen.setdefault(json.dumps(p, sort_keys=True), p)
    if not seen:
        return None
    values = list(seen.values())
    return values[0] if len(values) == 1 else {"per_cell_settings": values}


def _grouped_by_weights(manifest: Manifest, indices: Sequence[int]) -> list[int]:
    """Stable reorder so cells sharing ``weight_key()`` run back to back (cache reuse)."""
    first: dict[str, int] = {}
    keyed = []
    for pos, i in enumerate(indices):
        group = first.setdefault(manifest.cells[i][1].weight_key(), pos)
        keyed.append((group, pos, i))
    return [i for _, _, i in sorted(keyed)]


def run_cells(
    manifest: Manifest,
    out: str | os.PathLike[str],
    selection: Selection = None,
    *,
    cell_fn: CellFn | None = None,
    models: ModelCache | None = None,
    resume: bool = True,
    cache_dir: str | os.PathLike[str] | None = None,
    device: str | None = None,
    log: Callable[[str], None] | None = print,
    after_cell: Callable[[int], object] | None = None,
) -> SweepReport:
    """Run the selected cells of ``manifest`` into ``out``, one record each.

    ``cell_fn(cfg) -> dict`` computes a cell (default: :func:`~rope_quant.sweep.cells.pipeline_cell_fn`
    over the real pipeline, with base models from ``models`` and the weight cache ``cache_dir``, default
    ``out/cache``). With ``resume`` (default) cells whose record :func:`~rope_quant.sweep.records.is_complete`
    are skipped; a cell without a complete record (missing, unreadable, error, every length failed) runs.
    A failing cell is recorded and the others continue; a complete record is never removed before its
    replacement is complete, also with ``resume=False``. ``after_cell(i)`` runs after each cell that ran
    (the CLI's cache pruning, :mod:`rope_quant.sweep.cache_policy`).

    Concurrency (two runs, one directory; :mod:`rope_quant.sweep.lock`): the manifest is checked and written under the
    study lock (:func:`~rope_quant.sweep.manifest.commit_manifest`: a different study written by another run
    meanwhile raises ``ManifestMismatchError``); each cell is computed under its claim. A cell claimed by
    another live run is skipped and revisited at the end: complete by then, it counts as skipped (without
    ``resume``: if written since this run started); otherwise (its holder failed or died) it is taken over.
    """
    start = time.perf_counter()
    started_at = time.time()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    commit_manifest(out, manifest)  # under the study lock: a different study written meanwhile is refused
    protocol = _protocol(manifest)
    env = env_info(device, protocol)
    write_env(out, device, protocol)
    if cell_fn is None:
        cell_fn = pipeline_cell_fn(cache_dir if cache_dir is not None else out / CACHE_DIR, artifacts=out,
                                   models=models)
    report = SweepReport()
    chosen = _grouped_by_weights(manifest, select(manifest, selection))

    def done_elsewhere(path: Path, key: str) -> bool:
        """Complete, and (without resume) written since this run started: another run computed it."""
        if not records.is_complete(path, key):
            return False
        return resume or path.stat().st_mtime >= started_at

    def run_one(count: int, i: int, claim: CellClaim) -> None:
        name, cfg = manifest.cells[i]
        path = records.cell_path(out, name, cfg)
        with claim:
            if done_elsewhere(path, cfg.key()):  # completed by another run before our claim
                report.skipped.append(i)
                return
            _remove_stale_temporaries(path, artifact_dir(out, cfg))
            if log:
                log(f"[{count}/{len(chosen)}] {name} seed {config_seed(cfg)} ...")
            t0 = time.perf_counter()
            written, ok = run_cell_record(name, cfg, out, cell_fn, env)
        (report.ran if ok else report.failed).append(i)
        if log:
            kept = "; the previous complete record is kept" if written != path else ""
            state = "done" if ok else f"FAILED (see {written}{kept})"
            elapsed = time.perf_counter() - t0
            log(f"[{count}/{len(chosen)}] {name} seed {config_seed(cfg)} {state} in {elapsed:.1f}s")
        if after_cell is not None:
            after_cell(i)

    deferred: list[tuple[int, int, CellClaim]] = []
    for count, i in enumerate(chosen, 1):
        name, cfg = manifest.cells[i]
        path = records.cell_path(out, name, cfg)
        if resume and records.is_complete(path, cfg.key()):  # looked up at call time: the shared predicate
            report.skipped.append(i)
            continue
        claim = CellClaim(out, path.relative_to(out))
        if not claim.try_claim():  # another run computes it now: come back to it at the end
            if log:
                log(f"[{count}/{len(chosen)}] {name} seed {config_seed(cfg)} is being computed by another run")
            deferred.append((count, i, claim))
            continue
        run_one(count, i, claim)
    for count, i, claim in deferred:  # wait for the holder; take over if it left no complete record
        claim.wait_claim()
        run_one(count, i, claim)
    report.seconds = time.perf_counter() - start
    return report


def _remove_stale_temporaries(record: Path, artifacts: Path) -> None:
    """Remove the temporary files a killed writer of this cell left (``.<name>.*.tmp``: :func:`atomic_writer`'s),
    beside its record and in its artefact directory. Called under the cell's claim, so no live run writes them."""
    stale = [*record.parent.glob(f".{record.name}.*.tmp")]
    if artifacts.is_dir():
        stale += [p for p in artifacts.glob(".*.tmp") if p.is_file()]
    for tmp in stale:
        tmp.unlink(missing_ok=True)


def run_shard(
    out: str | os.PathLike[str], shard: int, n_shards: int, resume: bool = True, *,
    cell_fn: CellFn | None = None, cache_dir: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Run shard ``shard``/``n_shards`` of ``out/manifest.json`` (one Slurm array task, one xdist worker).

    The real pipeline with the weight cache ``cache_dir`` (default ``out/cache``), unless ``cell_fn``.
    Returns the :class:`SweepReport` as a dict.
    """
    report = run_cells(load_manifest(out), out, (shard, n_shards), cell_fn=cell_fn, resume=resume,
                       cache_dir=cache_dir)
    return dataclasses.asdict(report)

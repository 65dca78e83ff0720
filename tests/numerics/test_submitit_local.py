"""A real sweep through submitit's local executor: two array tasks share one results directory.

``slurm.submit_slurm(..., cluster="local")`` runs each shard as its own subprocess tree, exactly as a
Slurm array task would run it (pickled ``run_shard``, submitit's job folder), only without a cluster.
The cell function is cheap (:mod:`submitit_cells`, a deterministic function of the config) so the test
is about the engine: one task is SIGKILLed mid-cell and the sweep is resubmitted; no finished cell is
lost or recomputed, and the report equals that of an unsharded run of the same manifest.
"""

from __future__ import annotations

import collections
import functools
import json
import os
from pathlib import Path
from typing import Any

import pytest

import rope_quant
from rope_quant.analysis import report
from rope_quant.experiment.config import RunConfig
from rope_quant.sweep import presets, slurm
from rope_quant.sweep.manifest import write_manifest
from rope_quant.sweep.records import cell_path, is_complete
from rope_quant.sweep.runner import run_cells

submitit = pytest.importorskip("submitit")

from submitit_cells import COMPUTATIONS, KILL_AT, cell_label, counting_cell  # noqa: E402

CONFIGS = ("hadamard", "pairwise_only", "identity")
SEEDS = (0, 1)
#: Fields that would describe the run rather than its results (timing, environment). summary.json holds
#: none of them today (they live in the cell records and env.json); dropped wherever they may appear.
VOLATILE = frozenset({"seconds", "wall_s", "timestamp", "env", "environment", "results_dir"})


def _strip(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def _computations(log: Path) -> collections.Counter:
    return collections.Counter((log / COMPUTATIONS).read_text().split())


def _tables(out: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted((out / "tables").iterdir())}


def test_local_submitit_sweep_survives_a_killed_task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = Path(rope_quant.__file__).resolve().parents[1]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(repo), str(Path(__file__).parent),
                                                      os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the tasks inherit the environment
    manifest = presets.compare_manifest(RunConfig(), CONFIGS, SEEDS)
    labels = [cell_label(cfg) for _, cfg in manifest]
    assert labels[:3] == ["hadamard@0", "pairwise_only@0", "identity@0"]  # seed-major: shard 0 = seed 0

    sharded, log = tmp_path / "sharded", tmp_path / "log"
    log.mkdir()
    write_manifest(sharded, manifest)
    (log / KILL_AT).write_text("pairwise_only@0")  # task 0 dies inside its second cell
    cell_fn = functools.partial(counting_cell, str(log))

    def submit() -> list[Any]:
        jobs = slurm.submit_slurm(sharded, 2, cluster="local", cell_fn=cell_fn, timeout_min=3)
        for job in jobs:
            job.wait()
        return jobs

    killed, survivor = submit()
    assert survivor.result() == {**survivor.result(), "ran": [3, 4, 5], "skipped": [], "failed": []}
    with pytest.raises(submitit.core.utils.UncompletedJobError):
        killed.result()  # SIGKILLed: no result, like a Slurm task killed by OOM or preemption
    assert not (log / KILL_AT).exists()
    done = {i for i, (name, cfg) in enumerate(manifest) if is_complete(cell_path(sharded, name, cfg))}
    assert done == {0, 3, 4, 5}  # the cell finished before the kill is on disk; the killed one is not
    assert _computations(log) == collections.Counter(labels[:2] + labels[3:])
    finished = {i: cell_path(sharded, *manifest.cells[i]).read_bytes() for i in done}

    first, second = submit()  # the same submission again: the resume
    assert first.result()["ran"] == [1, 2] and first.result()["skipped"] == [0]
    assert second.result()["ran"] == [] and second.result()["skipped"] == [3, 4, 5]
    counts = _computations(log)
    assert counts == collections.Counter({**dict.fromkeys(labels, 1), "pairwise_only@0": 2})  # nothing recomputed
    assert all(cell_path(sharded, *manifest.cells[i]).read_bytes() == data for i, data in finished.items())
    assert not [p for p in sharded.rglob("*") if p.name.endswith(".tmp")]

    whole, whole_log = tmp_path / "whole", tmp_path / "whole-log"
    whole_log.mkdir()
    result = run_cells(manifest, whole, cell_fn=functools.partial(counting_cell, str(whole_log)), log=None)
    assert result.ran == list(range(len(manifest)))
    for out in (sharded, whole):
        report.write_report(out, comparator="hadamard", figures=False)
    summary = json.loads((sharded / "summary.json").read_text())
    assert summary["status"] == {"total": 6, "complete": 6, "failed": [], "missing": []}
    assert set(summary["paired"]) == {"pairwise_only", "identity"}
    assert _strip(summary) == _strip(json.loads((whole / "summary.json").read_text()))
    assert _tables(sharded) == _tables(whole)
    assert (sharded / "summary.md").read_text() == (whole / "summary.md").read_text()

"""Real sweeps through submitit's local executor: two array tasks share one results directory.

``slurm.submit_slurm(..., cluster="local")`` runs each shard as its own subprocess tree, exactly as a
Slurm array task would run it (pickled ``run_shard``, submitit's job folder), only without a cluster.
The cell function is cheap (:mod:`submitit_cells`, a deterministic function of the config) so the test
is about the engine: one task is SIGKILLed mid-cell and the sweep is resubmitted; no finished cell is
lost or recomputed, and the report equals that of an unsharded run of the same manifest. Once for a compare
manifest submitted through :func:`slurm.submit_slurm`, once for ``rope-quant claims --slurm 2 --slurm-param
cluster=local`` (the claims table of ``rope-quant report DIR`` against the unsharded command's).
"""

from __future__ import annotations

import collections
import functools
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import rope_quant
from rope_quant.analysis import report
from rope_quant.experiment.config import RunConfig
from rope_quant.sweep import presets, slurm
from rope_quant.sweep.manifest import write_manifest
from rope_quant.sweep.records import cell_path, is_complete
from rope_quant.sweep.runner import run_cells

submitit = pytest.importorskip("submitit")

from submitit_cells import COMPUTATIONS, KILL_AT, cell_label, claims_cell, counting_cell  # noqa: E402

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


#: ``rope-quant claims``' smallest budget (the stand-in cell function ignores it).
CLAIMS_TINY = ["--seqlen", "64", "--calib-windows", "1", "--eval-windows", "1", "--quiet"]
CLAIMS_ARGS = ["--claims", "C1,C3", "--seeds", "0,1"]
#: Keys of the claims JSON that describe the run, not its claims (the machine and its timestamp).
RUN_KEYS = frozenset({"machine"})


def _claims_json(out: Path) -> dict[str, Any]:
    data = json.loads((out / "claims.json").read_text())
    return {k: v for k, v in data.items() if k not in RUN_KEYS}


def test_claims_sweep_on_local_slurm_survives_a_killed_task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """``rope-quant claims --slurm 2 --slurm-param cluster=local``: task 0 is SIGKILLed inside its third cell, the
    same command resubmitted computes only the cells without a record, and ``rope-quant report DIR``'s claims
    JSON and table equal those of the same command run unsharded."""
    from rope_quant import cli
    from rope_quant.sweep.manifest import read_manifest

    repo = Path(rope_quant.__file__).resolve().parents[1]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(repo), str(Path(__file__).parent),
                                                      os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    jobs: list[Any] = []
    submit = slurm.submit_slurm

    def recording(*args: Any, **kwargs: Any) -> list[Any]:
        got = submit(*args, **kwargs)
        jobs[:] = got
        return got

    monkeypatch.setattr(slurm, "submit_slurm", recording)
    sharded, log = tmp_path / "sharded", tmp_path / "log"
    log.mkdir()
    (log / KILL_AT).write_text("pairwise_only+rows@0")  # seed 0's pairwise_only cell, in task 0 after hadamard
    argv = ["claims", "--out", str(sharded), *CLAIMS_TINY, *CLAIMS_ARGS, "--slurm", "2",
            "--slurm-param", "cluster=local", "--slurm-param", "timeout_min=3"]
    cell_fn = functools.partial(claims_cell, str(log))

    def submit_and_wait() -> list[Any]:
        assert cli.main(argv, cell_fn=cell_fn) == 0
        assert len(jobs) == 2
        for job in jobs:
            job.wait()
        return list(jobs)

    killed, survivor = submit_and_wait()
    entries = read_manifest(sharded)["cells"]
    assert len(entries) == 10 and {e["seed"] for e in entries[:5]} == {0}  # seed-major: task i runs seed i's cells
    with pytest.raises(submitit.core.utils.UncompletedJobError):
        killed.result()  # SIGKILLed inside a cell: no result
    assert sorted(survivor.result()["ran"]) == list(range(5, 10)) and survivor.result()["failed"] == []
    assert not (log / KILL_AT).exists()
    done = {i for i, e in enumerate(entries) if is_complete(sharded / e["path"], e["key"])}
    killed_at = next(i for i, e in enumerate(entries) if e["seed"] == 0 and e["name"] == "pairwise_only")
    assert killed_at not in done and 0 < len(done - set(range(5, 10))) < 5, done  # task 0 died mid-shard
    first = _computations(log)
    assert first["pairwise_only+rows@0"] == 1 and sum(first.values()) == len(first) == len(done) + 1
    records = {i: (sharded / entries[i]["path"]).read_bytes() for i in done}

    again, other = submit_and_wait()  # the same command again: the resume
    assert sorted(again.result()["ran"]) == sorted(set(range(5)) - done)
    assert sorted(again.result()["skipped"]) == sorted(done - set(range(5, 10)))
    assert other.result()["ran"] == [] and sorted(other.result()["skipped"]) == list(range(5, 10))
    counts = _computations(log)
    assert len(counts) == 10 and counts["pairwise_only+rows@0"] == 2
    assert sum(counts.values()) == 11  # every cell once, the killed one twice: nothing finished is recomputed
    assert all((sharded / entries[i]["path"]).read_bytes() == data for i, data in records.items())

    assert cli.main(["report", str(sharded)]) == 0
    whole, whole_log = tmp_path / "whole", tmp_path / "whole-log"
    whole_log.mkdir()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the Slurm tasks' OMP_NUM_THREADS: the claims JSON records the device's threads
    try:
        assert cli.main(["claims", "--out", str(whole), *CLAIMS_TINY, *CLAIMS_ARGS],
                        cell_fn=functools.partial(claims_cell, str(whole_log))) == 0
    finally:
        torch.set_num_threads(threads)
    assert sorted(_computations(whole_log)) == sorted(counts)
    capsys.readouterr()
    ours, theirs = _claims_json(sharded), _claims_json(whole)
    assert {r["id"]: r["decision"]["outcome"] for r in ours["claims"]}["C1"] == "holds"
    assert ours == theirs
    assert (sharded / "claims.md").read_text() == (whole / "claims.md").read_text()

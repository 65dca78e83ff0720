"""Sweeps: manifest, atomic cell records, resume after interrupt, failing cells, shards, is_complete."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import types
from pathlib import Path

import pytest

from rope_quant.sweep import records, runner, slurm
from rope_quant.sweep.manifest import (
    DuplicateCellError,
    InvalidCellNameError,
    Manifest,
    ManifestNotFoundError,
    SweepError,
    build_manifest,
    commit_manifest,
    manifest_from_dict,
    read_manifest,
    reconcile,
    write_manifest,
)
from rope_quant.sweep.records import cell_path, is_complete, status
from rope_quant.sweep.runner import ShardSpecError, parse_shard, run_cells, shard_from_env, shard_indices
from tests._support import FakeConfig

CONFIGS = {"hadamard": {"r3": "hadamard"}, "pairwise_only": {"r3": "pairwise_only"},
           "identity": {"r3": "identity"}}
SEEDS = (0, 1, 2)


def fake_ppl(cfg: FakeConfig) -> float:
    return {"hadamard": 10.0, "pairwise_only": 10.3, "identity": 11.0}[cfg.r3] + 0.1 * cfg.seed


class CountingCell:
    """A fake cell function that counts calls per (r3, seed) and can interrupt or fail on demand."""

    def __init__(self, interrupt_at: int | None = None, fail_r3: str | None = None) -> None:
        self.calls: list[tuple[str, int]] = []
        self.interrupt_at = interrupt_at
        self.fail_r3 = fail_r3

    def __call__(self, cfg: FakeConfig) -> dict:
        self.calls.append((cfg.r3, cfg.seed))
        if self.interrupt_at is not None and len(self.calls) == self.interrupt_at:
            raise KeyboardInterrupt
        if cfg.r3 == self.fail_r3:
            raise RuntimeError(f"boom in {cfg.r3}")
        return {"ppl": fake_ppl(cfg), "n_windows": 2, "n_tokens": 128, "k_range_mean": 1.0, "k_rel_err": 0.01}


def make_manifest() -> Manifest:
    return build_manifest(FakeConfig(), CONFIGS, SEEDS, study="compare")


def test_manifest_is_seed_major_and_written(tmp_path: Path) -> None:
    manifest = make_manifest()
    assert [(name, cfg.seed) for name, cfg in manifest] == [(n, s) for s in SEEDS for n in CONFIGS]
    assert all(cfg.r3 == name for name, cfg in manifest)
    run_cells(manifest, tmp_path, cell_fn=CountingCell(), log=None)
    data = json.loads((tmp_path / "manifest.json").read_text())
    assert data["study"] == "compare" and "kind" not in data and data["comparator"] == "hadamard"
    assert len(data["cells"]) == 9
    entry = data["cells"][4]
    name, cfg = manifest.cells[4]
    assert entry["name"] == name and entry["key"] == cfg.key() and entry["config"]["seed"] == cfg.seed
    assert entry["path"] == f"cells/{name}/seed{cfg.seed}-{cfg.key()}.json"


def test_cell_record_layout_and_content(tmp_path: Path) -> None:
    manifest = make_manifest()
    report = run_cells(manifest, tmp_path, cell_fn=CountingCell(), log=None)
    assert len(report.ran) == 9 and not report.failed and not report.skipped
    name, cfg = manifest.cells[0]
    path = tmp_path / "cells" / name / f"seed{cfg.seed}-{cfg.key()}.json"
    assert path == cell_path(tmp_path, name, cfg)
    record = json.loads(path.read_text())
    assert record["config"] == dataclasses.asdict(cfg)
    assert record["result"]["ppl"] == pytest.approx(fake_ppl(cfg))
    assert record["status"] == "ok" and record["key"] == cfg.key()
    assert "packages" in record["env"] and (tmp_path / "env.json").is_file()
    # no temporary files left behind by the atomic writes
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]


@pytest.mark.parametrize("k", [0, 1, 4, 8])
def test_resume_after_interrupt_recomputes_nothing_and_loses_nothing(tmp_path: Path, k: int) -> None:
    manifest = make_manifest()
    first = CountingCell(interrupt_at=k + 1)
    with pytest.raises(KeyboardInterrupt):
        run_cells(manifest, tmp_path, cell_fn=first, log=None)
    done = [cell_path(tmp_path, n, c) for n, c in manifest if is_complete(cell_path(tmp_path, n, c))]
    assert len(done) == k
    snapshot = {p: p.read_bytes() for p in done}

    second = CountingCell()
    report = run_cells(manifest, tmp_path, cell_fn=second, log=None)
    assert len(second.calls) == len(manifest) - k  # no finished cell recomputed
    assert len(set(second.calls)) == len(second.calls)
    assert set(first.calls[:k]).isdisjoint(second.calls)
    assert len(report.skipped) == k and len(report.ran) == len(manifest) - k
    assert all(p.read_bytes() == b for p, b in snapshot.items())  # none lost or rewritten
    assert status(tmp_path).done and len(status(tmp_path).complete) == len(manifest)


def test_no_resume_recomputes_everything(tmp_path: Path) -> None:
    manifest = make_manifest()
    run_cells(manifest, tmp_path, cell_fn=CountingCell(), log=None)
    again = CountingCell()
    run_cells(manifest, tmp_path, cell_fn=again, resume=False, log=None)
    assert len(again.calls) == len(manifest)


def test_failing_cell_is_recorded_and_others_continue(tmp_path: Path) -> None:
    manifest = make_manifest()
    fn = CountingCell(fail_r3="pairwise_only")
    report = run_cells(manifest, tmp_path, cell_fn=fn, log=None)
    assert len(fn.calls) == 9
    assert len(report.failed) == 3 and len(report.ran) == 6
    for name, cfg in manifest:
        path = cell_path(tmp_path, name, cfg)
        assert path.is_file()
        record = json.loads(path.read_text())
        if name == "pairwise_only":
            assert record["status"] == "error" and not is_complete(path)
            assert record["error"]["type"] == "RuntimeError" and "boom" in record["error"]["message"]
            assert "Traceback" in record["error"]["traceback"]
        else:
            assert is_complete(path)
    st = status(tmp_path)
    assert sorted(st.failed) == [f"pairwise_only/seed{s}" for s in SEEDS]
    assert not st.missing and not st.done
    # a rerun retries only the failed cells
    retry = CountingCell()
    run_cells(manifest, tmp_path, cell_fn=retry, log=None)
    assert sorted(retry.calls) == [("pairwise_only", s) for s in SEEDS]
    assert status(tmp_path).done


def test_result_without_ppl_is_not_complete(tmp_path: Path) -> None:
    manifest = build_manifest(FakeConfig(), {"hadamard": {}}, (0,))
    report = run_cells(manifest, tmp_path, cell_fn=lambda cfg: {"n_windows": 0}, log=None)
    assert report.failed == [0]
    assert not is_complete(cell_path(tmp_path, "hadamard", manifest.cells[0][1]))
    run_cells(manifest, tmp_path, cell_fn=lambda cfg: {"lengths": {"512": {"ppl": 3.0}}}, log=None)
    assert is_complete(cell_path(tmp_path, "hadamard", manifest.cells[0][1]))


def test_is_complete_predicate(tmp_path: Path) -> None:
    cfg = FakeConfig()
    path = cell_path(tmp_path, "hadamard", cfg)
    assert not is_complete(path)  # missing
    path.parent.mkdir(parents=True)
    good = {"key": cfg.key(), "result": {"ppl": 3.5}}
    path.write_text(json.dumps(good))
    assert is_complete(path) and is_complete(path, cfg.key())
    assert not is_complete(path, "another-key")
    path.write_text(json.dumps({**good, "key": "stale"}))
    assert not is_complete(path)  # key in file differs from key in name
    path.write_text(json.dumps(good)[:-3])
    assert not is_complete(path)  # truncated JSON
    path.write_text(json.dumps({"key": cfg.key(), "result": {"ppl": None}}))
    assert not is_complete(path)
    path.write_text(json.dumps({"key": cfg.key(), "result": {"lengths": {}}}))
    assert not is_complete(path)
    path.write_text(json.dumps({"key": cfg.key(), "result": {"lengths": {"256": {"ppl": 2.0}}}}))
    assert is_complete(path)


def test_runner_and_status_share_is_complete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manifest = make_manifest()
    run_cells(manifest, tmp_path, cell_fn=CountingCell(), log=None)
    seen: list[str] = []
    real = records.is_complete

    def spy(path, key=None):
        seen.append("call")
        return real(path, key)

    monkeypatch.setattr(records, "is_complete", spy)
    assert status(tmp_path).done
    n_status = len(seen)
    assert n_status == len(manifest)
    fn = CountingCell()
    run_cells(manifest, tmp_path, cell_fn=fn, log=None)
    assert len(seen) - n_status == len(manifest) and fn.calls == []
    # a corrupted record is missing for both
    name, cfg = manifest.cells[2]
    cell_path(tmp_path, name, cfg).write_text("{not json")
    st = status(tmp_path)
    assert st.missing == [f"{name}/seed{cfg.seed}"]
    fn = CountingCell()
    run_cells(manifest, tmp_path, cell_fn=fn, log=None)
    assert fn.calls == [(cfg.r3, cfg.seed)]


@pytest.mark.parametrize("n_cells", [0, 1, 2, 7, 12, 13, 31])
@pytest.mark.parametrize("n_shards", [1, 2, 3, 5, 8])
def test_shards_partition_exactly(n_cells: int, n_shards: int) -> None:
    parts = [shard_indices(n_cells, i, n_shards) for i in range(n_shards)]
    flat = [i for part in parts for i in part]
    assert sorted(flat) == list(range(n_cells)) and len(flat) == len(set(flat))
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    assert all(p == list(range(p[0], p[-1] + 1)) for p in parts if p)  # contiguous
    assert parts == [shard_indices(n_cells, i, n_shards) for i in range(n_shards)]  # deterministic


def test_shards_run_every_cell_once(tmp_path: Path) -> None:
    manifest = make_manifest()
    fns = []
    for i in range(4):  # four "workers" sharing the directory
        fn = CountingCell()
        run_cells(manifest, tmp_path, f"{i}/4", cell_fn=fn, log=None)
        fns.append(fn)
    calls = [c for fn in fns for c in fn.calls]
    assert sorted(calls) == sorted((cfg.r3, cfg.seed) for _, cfg in manifest)
    assert status(tmp_path).done
    # shard 0 of 3 holds exactly the seed-0 cells: one weight cache per worker
    fn = CountingCell()
    run_cells(manifest, tmp_path / "other", (0, 3), cell_fn=fn, log=None)
    assert {seed for _, seed in fn.calls} == {0}


def test_selection_forms(tmp_path: Path) -> None:
    manifest = make_manifest()
    assert runner.select(manifest, None) == list(range(9))
    assert runner.select(manifest, [5, 1, 1]) == [1, 5]
    assert runner.select(manifest, lambda name, cfg: name == "identity") == [2, 5, 8]
    assert runner.select(manifest, "1/3") == [3, 4, 5]
    with pytest.raises(SweepError):
        runner.select(manifest, [9])


@pytest.mark.parametrize("text", ["", "1", "3/3", "-1/2", "a/b", "1/0", "1/2/3"])
def test_bad_shard_spec(text: str) -> None:
    with pytest.raises(ShardSpecError):
        parse_shard(text)


def test_shard_from_env() -> None:
    assert shard_from_env({}) is None
    assert shard_from_env({"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_COUNT": "4"}) == (2, 4)
    assert shard_from_env({"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "4",
                           "SLURM_ARRAY_TASK_MIN": "1"}) == (2, 4)
    assert shard_from_env({"PYTEST_XDIST_WORKER": "gw1", "PYTEST_XDIST_WORKER_COUNT": "3"}) == (1, 3)


def test_manifest_validation() -> None:
    with pytest.raises(InvalidCellNameError):
        Manifest(cells=[("bad/name", FakeConfig())])
    with pytest.raises(DuplicateCellError):
        Manifest(cells=[("a", FakeConfig()), ("a", FakeConfig(r3="x"))])
    with pytest.raises(SweepError):
        build_manifest(FakeConfig(), CONFIGS, ())


def test_manifest_round_trip_and_merge(tmp_path: Path) -> None:
    manifest = make_manifest()
    write_manifest(tmp_path, manifest)
    mtime = os.stat(tmp_path / "manifest.json").st_mtime_ns
    write_manifest(tmp_path, manifest)  # unchanged content: not rewritten
    assert os.stat(tmp_path / "manifest.json").st_mtime_ns == mtime
    data = read_manifest(tmp_path)
    rebuilt = manifest_from_dict(data, lambda d: FakeConfig(**d))
    assert rebuilt.cells == manifest.cells and rebuilt.study == "compare"
    with pytest.raises(SweepError, match="key"):
        manifest_from_dict(data, lambda d: FakeConfig(**{**d, "seqlen": 1}))
    extra = Manifest(cells=[("block-b4", FakeConfig(r3="block"))], study="run",
                     meta={"block-b4": {"block": 4}})
    write_manifest(tmp_path, extra, merge=True)
    merged = read_manifest(tmp_path)
    assert len(merged["cells"]) == 10 and merged["study"] == "compare"
    assert merged["meta"]["block-b4"] == {"block": 4}
    with pytest.raises(ManifestNotFoundError):
        read_manifest(tmp_path / "nowhere")


def test_a_manifest_written_before_the_study_rename_is_read_and_resumed(tmp_path: Path) -> None:
    """manifest.json files of earlier versions say ``kind`` for the study: they are the same study, and resume."""
    from rope_quant.experiment.config import RunConfig

    manifest = build_manifest(RunConfig(), {"hadamard": {"r3": "hadamard"}, "identity": {"r3": "identity"}},
                              (0, 1), study="compare")
    data = manifest.to_dict()
    data["kind"] = data.pop("study")
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    assert manifest_from_dict(read_manifest(tmp_path), RunConfig.from_dict).study == "compare"
    reconcile(tmp_path, manifest)  # the same study: no mismatch
    commit_manifest(tmp_path, manifest)  # ... written in the new spelling
    assert read_manifest(tmp_path)["study"] == "compare"
    data["kind"] = "support"
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(SweepError, match='study: "support" -> "compare"'):
        reconcile(tmp_path, manifest)
    with pytest.warns(DeprecationWarning, match="build_manifest\\(kind=...\\)"):
        assert build_manifest(FakeConfig(), CONFIGS, SEEDS, kind="support").study == "support"
    assert manifest.kind == "compare"  # the read-only alias


def test_slurm_without_submitit_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "submitit", None)  # import fails as if not installed
    write_manifest(tmp_path, make_manifest())
    with pytest.raises(SweepError, match="pip install submitit"):
        slurm.submit_slurm(tmp_path, 2)


def test_slurm_submits_one_array_task_per_shard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    submitted: dict = {}

    class FakeExecutor:
        def __init__(self, folder: str) -> None:
            submitted["folder"] = folder

        def update_parameters(self, **params) -> None:
            submitted["params"] = params

        def map_array(self, fn, *iterables):
            submitted["fn"] = fn
            submitted["args"] = list(zip(*iterables, strict=True))
            return ["job"] * len(submitted["args"])

    monkeypatch.setitem(sys.modules, "submitit", types.SimpleNamespace(AutoExecutor=FakeExecutor))
    write_manifest(tmp_path, make_manifest())
    jobs = slurm.submit_slurm(tmp_path, 3, timeout_min=30)
    assert jobs == ["job"] * 3
    assert submitted["fn"] is runner.run_shard and submitted["params"] == {"timeout_min": 30}
    assert submitted["args"] == [(str(tmp_path), i, 3) for i in range(3)]
    assert submitted["folder"] == str(tmp_path / "slurm")


def _fake_submitit(monkeypatch: pytest.MonkeyPatch) -> dict:
    submitted: dict = {}

    class FakeExecutor:
        def __init__(self, folder: str, **kwargs) -> None:
            submitted["folder"], submitted["kwargs"] = folder, kwargs

        def update_parameters(self, **params) -> None:
            submitted["params"] = params

        def map_array(self, fn, *iterables):
            submitted["fn"], submitted["args"] = fn, list(zip(*iterables, strict=True))
            return ["job"] * len(submitted["args"])

    monkeypatch.setitem(sys.modules, "submitit", types.SimpleNamespace(AutoExecutor=FakeExecutor))
    return submitted


def test_slurm_executor_kind_cache_and_cell_fn_reach_every_task(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    submitted = _fake_submitit(monkeypatch)
    write_manifest(tmp_path, make_manifest())
    assert slurm.submit_slurm(tmp_path, 2, cluster="local", cache_dir=tmp_path / "shared", resume=False,
                              cell_fn=len, timeout_min=5) == ["job"] * 2
    assert submitted["kwargs"] == {"cluster": "local"} and submitted["params"] == {"timeout_min": 5}
    fn = submitted["fn"]
    assert fn.func is runner.run_shard
    assert fn.keywords == {"cell_fn": len, "cache_dir": str(tmp_path / "shared"), "resume": False}
    assert submitted["args"] == [(str(tmp_path), 0, 2), (str(tmp_path), 1, 2)]
    with pytest.raises(SweepError, match="positive"):
        slurm.submit_slurm(tmp_path, 0)


def test_cli_slurm_passes_cluster_and_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture) -> None:
    from transformers import LlamaConfig

    from rope_quant import cli

    submitted = _fake_submitit(monkeypatch)
    model = tmp_path / "tiny-llama"  # config.json only: what the preflight reads (the embedded GGUF is slow)
    LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=4, max_position_embeddings=4096).save_pretrained(model)
    out, cache = tmp_path / "out", tmp_path / "shared-cache"
    argv = ["compare", "--model", str(model), "--out", str(out), "--seeds", "0,1", "--configs", "hadamard,identity",
            "--slurm", "2",
            "--slurm-param", "cluster=local", "--slurm-param", "timeout_min=30", "--cache-dir", str(cache)]
    assert cli.main(argv) == 0
    assert "submitted 2 Slurm array tasks" in capsys.readouterr().out
    assert submitted["kwargs"] == {"cluster": "local"} and submitted["params"] == {"timeout_min": 30}
    assert submitted["fn"].func is runner.run_shard and submitted["fn"].keywords == {"cache_dir": str(cache)}
    assert cli.main([*argv, "--slurm-param", "cache_dir=x"]) == 2


def test_env_info(tmp_path: Path) -> None:
    from rope_quant.experiment import envinfo

    info = envinfo.env_info("cpu")
    assert set(info["packages"]) == {"torch", "transformers", "numpy", "scipy", "gguf", "rope_quant"}
    assert info["packages"]["torch"] != "not installed" and info["python"].count(".") == 2
    assert info["device"]["requested"] == "cpu" and "T" in info["timestamp"]
    rev = info["source_revision"]
    assert rev == "unknown" or len(rev.split("+")[0]) == 40
    assert envinfo.source_revision(tmp_path) == "unknown"  # not a git repository
    path = envinfo.write_env(tmp_path, "cpu")
    assert json.loads(path.read_text())["packages"] == info["packages"]
    assert oct(path.stat().st_mode & 0o777) != oct(0o600)  # not mkstemp's private mode
    # the atomic writes themselves: tests/numerics/test_io.py


def test_model_cache_holds_one_base_model() -> None:
    from rope_quant.sweep.loaded_models import ModelCache

    loads: list[tuple[str, str]] = []
    cache = ModelCache(loader=lambda model, device: loads.append((model, device)) or (f"m:{model}", "tok"))
    base, corpora = cache.get("a")
    assert base == ("m:a", "tok") and corpora == {} and loads == [("a", "cpu")]
    corpora["pydoc"] = "corpus"
    assert cache.get("a", "cpu") == (base, {"pydoc": "corpus"}) and len(loads) == 1  # loaded once
    cache.get("b")
    assert loads == [("a", "cpu"), ("b", "cpu")] and ("a", "cpu") not in cache and ("b", "cpu") in cache
    cache.put("c", "cpu", ("given", "tok"), {"pydoc": "c-corpus"})
    assert cache.get("c") == (("given", "tok"), {"pydoc": "c-corpus"}) and len(loads) == 2
    cache.clear()
    assert ("c", "cpu") not in cache

"""Reliability of caches and of the completion predicate, fault by fault.

- content identity: a corpus rewritten under the same path recomputes the cell and its statistics; a
  relative and an absolute path to one model give one key; new model files give a new key;
- completion: a long-context cell whose every length failed is failed (retried, nonzero exit), one
  scored length makes it complete; the verifier skips incomplete cells;
- corrupt caches (statistics, weights, corpus tokens) are warned about by name and rebuilt;
- a failing ``--no-resume`` rerun keeps the complete record; kill -9 mid-cell and two concurrent shards
  lose and recompute no finished cell.

Real-pipeline cases run on a tiny random Llama saved as a local Hugging Face directory with a small
byte-level BPE tokenizer trained here (no embedded model).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from rope_quant import cli
from rope_quant.corpora import token_streams
from rope_quant.experiment import identity, pipeline
from rope_quant.experiment.config import RunConfig
from rope_quant.sweep import records
from rope_quant.sweep.loaded_models import ModelCache
from rope_quant.sweep.manifest import Manifest, build_manifest, read_manifest
from rope_quant.sweep.records import cell_path, is_complete, record_is_complete, status
from rope_quant.sweep.runner import run_cells
from tests._support.reliability import TINY, corpus_text, only_record, save_tiny_model


@pytest.fixture(autouse=True)
def _private_corpus_cache(tmp_path_factory, monkeypatch) -> None:
    """Token caches of these tests go to a temporary directory, not ~/.cache."""
    monkeypatch.setenv("ROPE_QUANT_CACHE_DIR", str(tmp_path_factory.mktemp("corpus-cache")))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


REPO = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- defect 1: content identity


def test_corpus_rewritten_under_the_same_path_recomputes_cell_and_statistics(tmp_path, tiny_model, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(corpus_text(1))
    out = tmp_path / "out"
    argv = ["compare", "--model", str(tiny_model), "--corpus", str(corpus), "--configs", "pairwise_only",
            "--comparator", "pairwise_only", "--out", str(out), "--keep-cache", *TINY]  # the test reads the cache
    assert cli.main(argv, models=ModelCache()) == 0
    assert "1 ran, 0 already complete" in capsys.readouterr().out
    first = only_record(out)
    assert first["config"]["corpus_id"] and first["config"]["model_id"]
    assert len(list((out / "cache").glob("stats-*.npz"))) == 1

    corpus.write_text(corpus_text(2))  # other text, same path, same size class
    assert cli.main(argv, models=ModelCache()) == 0
    printed = capsys.readouterr().out
    assert "1 ran, 0 already complete" in printed  # not "already complete"
    assert "note: content changed" in printed and "corpus_id:" in printed  # the same study, not a mismatch
    second = only_record(out)
    assert second["key"] != first["key"] and second["config"]["corpus_id"] != first["config"]["corpus_id"]
    assert second["result"]["ppl"] != first["result"]["ppl"]
    assert len(list((out / "cache").glob("stats-*.npz"))) == 2  # the old statistics were not reused

    # the same text again: the first result is found (same content, same key)
    corpus.write_text(corpus_text(1))
    assert cli.main(argv, models=ModelCache()) == 0
    assert "0 ran, 1 already complete" in capsys.readouterr().out


def test_statistics_cache_is_keyed_by_the_calibration_windows(tmp_path, tiny_model):
    """Even an unresolved config (no corpus_id) never reads statistics computed on other text."""
    from rope_quant.model.loading import load_model

    base = load_model(str(tiny_model))
    cfg = RunConfig.from_flat(model="tiny", r3="pairwise_only", weights="rtn", seqlen=64, calib_windows=2,
                              eval_windows=1)
    counters = pipeline.PipelineCounters()
    for seed in (1, 2, 1):
        path = tmp_path / f"c{seed}.txt"
        path.write_text(corpus_text(seed))
        corpus = token_streams.load_corpus(str(path), base[1], use_cache=False)
        pipeline.build_quantized_model(cfg, cache_dir=tmp_path / "cache", base=base, corpus=corpus,
                                       counters=counters)
    assert counters.calibration_passes == 2  # text 1, text 2; text 1 again is a cache hit
    assert len(list((tmp_path / "cache").glob("stats-*.npz"))) == 2


def test_relative_and_absolute_model_paths_give_one_key(tmp_path, tiny_model, monkeypatch):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(corpus_text(1))
    monkeypatch.chdir(tiny_model.parent)
    rel = identity.resolve_identity(RunConfig.from_flat(model=tiny_model.name, corpus=str(corpus)))
    monkeypatch.chdir(tmp_path)
    absolute = identity.resolve_identity(RunConfig.from_flat(model=str(tiny_model), corpus="corpus.txt"))
    assert rel.model == absolute.model == str(tiny_model.resolve())
    assert rel.key() == absolute.key() and rel.weight_key() == absolute.weight_key()
    assert rel.stats_key() == absolute.stats_key()
    assert identity.resolve_identity(absolute) == absolute  # idempotent
    # a copy of the same files elsewhere is the same model; new weights under the same path are not
    import shutil

    copy = Path(shutil.copytree(tiny_model, tmp_path / "copy"))
    assert identity.resolve_identity(absolute.override(model=str(copy))).key() == absolute.key()
    save_tiny_model(copy, seed=1)
    changed = identity.resolve_identity(absolute.override(model=str(copy)))
    assert changed.model_id != absolute.model_id and changed.key() != absolute.key()
    assert changed.weight_key() != absolute.weight_key()


def test_unresolved_keys_are_unchanged_and_large_files_are_sampled(tmp_path, monkeypatch):
    """Configs without content identities keep their keys; big files are hashed by sampled chunks."""
    cfg = RunConfig.from_flat(r3="pairwise_only")
    assert cfg.model_id is None and cfg.key() == RunConfig.from_dict(cfg.to_dict()).key()
    assert cfg.override(model_id="m").key() != cfg.key()
    assert cfg.override(model="elsewhere", model_id="m").key() == cfg.override(model_id="m").key()
    monkeypatch.setattr(identity, "WHOLE_FILE_LIMIT", 4 << 20)
    big = tmp_path / "weights.bin"
    big.write_bytes(bytes(8 << 20))
    before = identity.file_digest(big)
    with open(big, "r+b") as fh:  # a change inside a sampled chunk (the first one)
        fh.write(b"\1")
    os.utime(big, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert identity.file_digest(big) != before


# ----------------------------------------------------------------------------- defect 2: completion


def failed_lengths(cfg) -> dict:
    return {"lengths": {str(L): {"error": "OutOfMemoryError", "message": "CUDA out of memory", "length": L,
                                 "oom": True} for L in cfg.lengths}, "k_range_mean": 1.0}


def test_all_failed_long_context_cell_is_failed_not_complete(tmp_path, capsys):
    from rope_quant.sweep.manifest import LongContextConfig

    record = {"key": "k", "result": failed_lengths(LongContextConfig(RunConfig(), (256, 512)))}
    assert not record_is_complete(record, "k")
    record["result"]["lengths"]["256"] = {"ppl": 12.5, "n_windows": 1}
    assert record_is_complete(record, "k")  # one scored length is enough
    assert not record_is_complete({"key": "k", "result": {"lengths": {"256": {"ppl": None}}}}, "k")

    out = tmp_path / "lc"
    argv = ["long-context", "--out", str(out), "--seeds", "0", "--configs", "hadamard", "--lengths",
            "10000000", "--eval-corpora", "pydoc", "--quiet", "--no-figures"]
    calls: list = []

    def all_fail(cfg):
        calls.append(cfg)
        return failed_lengths(cfg)

    assert cli.main(argv, cell_fn=all_fail) == 1
    assert "1 failed" in capsys.readouterr().out
    rec = only_record(out)
    assert rec["status"] == "error" and rec["error"]["type"] == "IncompleteResult"
    assert "every context length failed" in rec["error"]["message"] and "L=10000000" in rec["error"]["message"]
    assert cli.main(["report", str(out), "--check"]) == 1
    assert status(out).failed == ["hadamard/seed0"]
    assert cli.main(argv, cell_fn=all_fail) == 1 and len(calls) == 2  # retried on rerun

    def one_scored(cfg):
        calls.append(cfg)
        res = failed_lengths(cfg)
        res["lengths"][str(cfg.lengths[0])] = {"ppl": 20.0, "n_windows": 1, "n_tokens": 10, "seqlen": 10}
        return res

    assert cli.main(argv, cell_fn=one_scored) == 0
    assert cli.main(["report", str(out), "--check"]) == 0
    assert cli.main(argv, cell_fn=one_scored) == 0 and len(calls) == 3  # complete: not rerun


def test_real_long_context_beyond_the_stream_is_refused_before_any_cell(tmp_path, tiny_model, capsys):
    """On the real pipeline the impossible length never becomes a "complete" cell: the preflight refuses it
    as bad input (exit 2, naming the length) before anything is written. A length that fails only while a
    cell runs (e.g. out of memory) is the all-failed case above: exit 1, retried."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(corpus_text(1))
    out = tmp_path / "lc"
    argv = ["long-context", "--model", str(tiny_model), "--corpus", str(corpus), "--configs", "hadamard",
            "--comparator", "hadamard", "--lengths", "10000000", "--out", str(out), *TINY]
    assert cli.main(argv, models=ModelCache()) == 2
    printed = capsys.readouterr()
    assert "10000000" in printed.out + printed.err
    assert not list(out.glob("cells/**/*.json"))


def test_verify_counts_only_complete_cells(tmp_path, capsys):
    out = tmp_path / "est"

    def phi_star_fails(cfg):
        if cfg.position_average:
            raise RuntimeError("simulated failure after the artefacts were written")
        return {"ppl": 12.0, "n_windows": 1}

    argv = ["estimators", "--out", str(out), "--seeds", "0", "--phi-star", "--quiet", "--no-figures"]
    assert cli.main(argv, cell_fn=phi_star_fails) == 1
    star = [e for e in read_manifest(out)["cells"] if e["config"]["online"].get("angle") == "phi_star"]
    art = out / "artifacts" / star[0]["key"]
    art.mkdir(parents=True)
    (art / "angles.npy").write_bytes(b"left over by the failed cell")
    assert cli.main(["verify", str(out)]) == 1
    assert "cell not complete" in capsys.readouterr().out


# ----------------------------------------------------------------------------- defect 3: corrupt caches


def test_truncated_statistics_cache_is_warned_rebuilt_and_the_cell_succeeds(tmp_path, tiny_model, caplog, capsys):
    from rope_quant.calib.stats import CalibrationStats

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(corpus_text(1))
    out = tmp_path / "out"
    argv = ["compare", "--model", str(tiny_model), "--corpus", str(corpus), "--configs", "pairwise_only",
            "--comparator", "pairwise_only", "--out", str(out), "--keep-cache", *TINY]  # the test reads the cache
    assert cli.main(argv, models=ModelCache()) == 0
    good = only_record(out)
    (stats,) = (out / "cache").glob("stats-*.npz")
    stats.write_bytes(stats.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="rope_quant.experiment.pipeline"):
        assert cli.main([*argv, "--no-resume"], models=ModelCache()) == 0
    messages = [r.getMessage() for r in caplog.records]
    assert any(str(stats) in m and "statistics cache" in m for m in messages), messages
    CalibrationStats.load(stats)  # rewritten, readable
    assert only_record(out)["result"]["ppl"] == pytest.approx(good["result"]["ppl"])


def test_statistics_file_errors_name_the_file(tmp_path):
    from rope_quant.calib.errors import StatsFileError
    from rope_quant.calib.stats import CalibrationStats

    path = tmp_path / "stats.npz"
    for content in (b"", b"PK\3\4 truncated", b"not a zip at all"):
        path.write_bytes(content)
        with pytest.raises(StatsFileError, match="stats.npz"):
            CalibrationStats.load(path)


def test_garbage_weight_cache_is_warned_and_rebuilt(tmp_path, tiny_model, caplog):
    from rope_quant.model.loading import load_model

    base = load_model(str(tiny_model))
    corpus = token_streams.load_corpus(str(_write(tmp_path / "c.txt", corpus_text(1))), base[1], use_cache=False)
    cfg = RunConfig.from_flat(model="tiny", r3="hadamard", weights="rtn", seqlen=64, calib_windows=2)
    cache = tmp_path / "cache"
    pipeline.build_quantized_model(cfg, cache_dir=cache, base=base, corpus=corpus)
    (weights,) = cache.glob("weights-*.pt")
    for bad in (weights.read_bytes()[:50], b"garbage bytes, not a torch file"):
        weights.write_bytes(bad)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="rope_quant.experiment.pipeline"):
            qm = pipeline.build_quantized_model(cfg, cache_dir=cache, base=base, corpus=corpus)
        assert not qm.weight_cache_hit
        assert any(str(weights) in r.getMessage() for r in caplog.records)
    assert pipeline.build_quantized_model(cfg, cache_dir=cache, base=base, corpus=corpus).weight_cache_hit


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_truncated_corpus_token_cache_is_warned_and_rebuilt(tmp_path, tiny_model, caplog):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    path = _write(tmp_path / "c.txt", corpus_text(1))
    first = token_streams.load_corpus(str(path), tok, cache_dir=tmp_path / "tc")
    assert first.cache_path is not None and first.cache_path.is_file()
    first.cache_path.write_bytes(first.cache_path.read_bytes()[:64])
    with caplog.at_level(logging.WARNING, logger="rope_quant.cache"):
        again = token_streams.load_corpus(str(path), tok, cache_dir=tmp_path / "tc")
    assert any(first.cache_path.name in r.getMessage() for r in caplog.records)
    assert torch.equal(again.calib_ids, first.calib_ids) and torch.equal(again.eval_ids, first.eval_ids)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rope_quant.cache"):
        third = token_streams.load_corpus(str(path), tok, cache_dir=tmp_path / "tc")  # rewritten: read without warning
    assert torch.equal(third.eval_ids, first.eval_ids) and not caplog.records


# ----------------------------------------------------------------------------- records are never lost


class Cfg:
    """A minimal cell config for the runner (key, weight_key, seed, to_dict)."""

    def __init__(self, seed: int = 0, r3: str = "hadamard") -> None:
        self.seed, self.r3 = seed, r3

    def key(self) -> str:
        return f"k-{self.r3}-{self.seed}"

    def weight_key(self) -> str:
        return f"w-{self.seed}"

    def to_dict(self) -> dict:
        return {"seed": self.seed, "r3": self.r3}


def test_failing_no_resume_rerun_keeps_the_complete_record(tmp_path, capsys):
    manifest = Manifest(cells=[("hadamard", Cfg())])
    run_cells(manifest, tmp_path, cell_fn=lambda cfg: {"ppl": 10.0}, log=None)
    path = cell_path(tmp_path, "hadamard", Cfg())
    good = path.read_bytes()

    def boom(cfg):
        raise RuntimeError("transient OOM")

    report = run_cells(manifest, tmp_path, cell_fn=boom, resume=False, log=print)
    assert report.failed == [0]
    assert path.read_bytes() == good and is_complete(path)  # the old result stays
    failed = records.failure_path(tmp_path, "hadamard", Cfg())
    assert json.loads(failed.read_text())["error"]["message"] == "transient OOM"
    assert "previous complete record is kept" in capsys.readouterr().out
    assert status(tmp_path).done
    # an incomplete result does not replace it either; a complete one does, and clears the failure
    run_cells(manifest, tmp_path, cell_fn=lambda cfg: {"lengths": {}}, resume=False, log=None)
    assert path.read_bytes() == good
    run_cells(manifest, tmp_path, cell_fn=lambda cfg: {"ppl": 11.0}, resume=False, log=None)
    assert json.loads(path.read_text())["result"]["ppl"] == 11.0 and not failed.exists()


def test_failing_no_resume_rerun_through_the_cli_exits_1_and_keeps_the_record(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["run", "--config", "hadamard", "--seed", "0", "--out", str(out)]
    assert cli.main(argv, cell_fn=lambda cfg: {"ppl": 10.0}) == 0

    def boom(cfg):
        raise RuntimeError("transient OOM")

    assert cli.main([*argv, "--no-resume"], cell_fn=boom) == 1
    assert "transient OOM" in capsys.readouterr().err
    assert only_record(out)["result"]["ppl"] == 10.0
    assert cli.main(["report", str(out), "--check"]) == 0


SWEEP_SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from test_reliability import Cfg
    from rope_quant.sweep.manifest import Manifest
    from rope_quant.sweep.runner import run_cells

    out, selection, slow_at = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    manifest = Manifest(cells=[("c" + str(i), Cfg(seed=i)) for i in range(8)])

    def cell(cfg):
        (out / "started").mkdir(parents=True, exist_ok=True)
        (out / "started" / str(cfg.seed)).write_text("")
        if cfg.seed == slow_at:
            time.sleep(600)
        time.sleep(0.05)
        return {{"ppl": 10.0 + cfg.seed}}

    run_cells(manifest, out, None if selection == "all" else selection, cell_fn=cell, log=None)
""")


def _sweep_process(out: Path, selection: str, slow_at: int) -> subprocess.Popen:
    script = out.parent / "sweep_script.py"
    script.write_text(SWEEP_SCRIPT.format(tests=str(Path(__file__).parent)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(script), str(out), selection, str(slow_at)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _all_cells() -> Manifest:
    return Manifest(cells=[(f"c{i}", Cfg(seed=i)) for i in range(8)])


def test_kill_9_mid_cell_loses_and_recomputes_no_finished_cell(tmp_path):
    out = tmp_path / "out"
    proc = _sweep_process(out, "all", slow_at=3)
    deadline = time.monotonic() + 120
    while not (out / "started" / "3").exists():
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    manifest = _all_cells()
    done = {i for i, (n, c) in enumerate(manifest) if is_complete(cell_path(out, n, c))}
    assert done == {0, 1, 2}
    snapshot = {i: cell_path(out, *manifest.cells[i]).read_bytes() for i in done}
    calls: list[int] = []
    report = run_cells(manifest, out, cell_fn=lambda cfg: calls.append(cfg.seed) or {"ppl": 1.0}, log=None)
    assert calls == [3, 4, 5, 6, 7] and sorted(report.skipped) == [0, 1, 2]
    assert all(cell_path(out, *manifest.cells[i]).read_bytes() == b for i, b in snapshot.items())
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]


def test_two_concurrent_shards_lose_and_recompute_nothing(tmp_path):
    out = tmp_path / "out"
    procs = [_sweep_process(out, f"{i}/2", slow_at=-1) for i in range(2)]
    for proc in procs:
        output = proc.communicate(timeout=300)[0]
        assert proc.returncode == 0, output
    assert sorted(int(p.name) for p in (out / "started").iterdir()) == list(range(8))
    assert status(out).done and len(status(out).complete) == 8
    calls: list[int] = []
    run_cells(_all_cells(), out, cell_fn=lambda cfg: calls.append(cfg.seed) or {"ppl": 1.0}, log=None)
    assert calls == []


def test_manifest_of_fake_configs_still_builds() -> None:
    """The runner's contract for plain configs is unchanged (no content identity required)."""
    manifest = build_manifest(RunConfig(), {"hadamard": {"r3": "hadamard"}}, (0,))
    assert manifest.cells[0][1].model_id is None

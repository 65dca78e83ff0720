"""Fault by fault (library side): quantisers never overflow, a study directory is owned by one run,
cells are claimed, caches heal, checkpoint errors name the culprit; and the cases that already held (kill -9
mid-sweep with a bit-identical resume, damaged records, a corpus changed under the same path).

Everything here runs on stub cell functions or a tiny random Llama (no embedded model).
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rope_quant import cli
from rope_quant.experiment.config import RunConfig
from rope_quant.model.loading import CheckpointError, ModelNotFoundError, check_checkpoint, load_model
from rope_quant.quant.quantizers import fake_quant_per_token
from rope_quant.quant.rtn import GPTQError, _rtn, rtn_quantize
from rope_quant.quant.static import StaticChannelQuantizer
from rope_quant.sweep.loaded_models import ModelCache
from rope_quant.sweep.manifest import ManifestMismatchError, build_manifest, claim_study, read_manifest, reconcile
from rope_quant.sweep.records import status
from tests._support.reliability import TINY, corpus_text, only_record, save_tiny_model

REPO = Path(__file__).resolve().parents[2]

# ----------------------------------------------------------------------------- quantisers never overflow

F32_MAX = torch.finfo(torch.float32).max
HALF = [torch.float16, torch.bfloat16, torch.float32]


def _finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


@pytest.mark.parametrize("row", [[3.4028e38, -3.4028e38, 1.0, 0.5], [3.4028e38, -3.4e36, 1.0, 0.0]])
def test_asym_per_token_near_float32_max_is_finite(row):
    """In 0.1.0 these gave -inf and +inf (the rounded zero point puts a grid end past the max)."""
    x = torch.tensor([row])
    y = fake_quant_per_token(x, 4)
    assert _finite(y), y
    step = (max(row) - min(min(row), 0.0)) / 15
    assert float((y.double() - x.double()).abs().max()) <= step  # still a quantiser: within one step


def test_asym_per_token_float16_max_is_finite():
    """In 0.1.0 float16 [65504, -65504, 1, .5] gave -inf; now saturates at -65504."""
    x = torch.tensor([[65504.0, -65504.0, 1.0, 0.5]], dtype=torch.float16)
    y = fake_quant_per_token(x, 4)
    assert _finite(y), y
    assert float(y[0, 1]) == -65504.0


@pytest.mark.parametrize("dtype,big", [(torch.float16, -65440.0), (torch.float32, -3.3994e38)])
def test_rtn_mse_clip_search_near_dtype_max_is_finite(dtype, big):
    """In 0.1.0 a row where the MSE search picks a ratio < 1 used code −8 ·
    scale = −8/7·0.9x·max|w| past the dtype's maximum. Codes × scales still reproduce the output."""
    gen = torch.Generator().manual_seed(3)
    w = (torch.rand(4, 16, generator=gen) * 2 - 1) * abs(big) * 0.6
    w[:, 0] = big
    w = w.to(dtype)
    assert _finite(w)
    for mse in (True, False):
        out, codes, scales = _rtn(w, 4, -1, mse, 1.0, 100, 0.8)
        assert _finite(out), (mse, out)
        assert torch.equal((codes * scales).to(dtype), out)
        assert float(codes.min()) >= -8 and float(codes.max()) <= 7


def test_rtn_normal_rows_keep_their_bits_when_another_row_overflows():
    """Only the overflowing row is requantised (symmetric grid); the others are the plain path's bits."""
    gen = torch.Generator().manual_seed(0)
    normal = torch.randn(3, 32, generator=gen)
    extreme = torch.randn(1, 32, generator=gen) * 1e38
    extreme[0, 0] = -3.3994e38
    both = rtn_quantize(torch.cat([normal, extreme]), 4)
    assert _finite(both)
    assert torch.equal(both[:3], rtn_quantize(normal, 4))


@pytest.mark.parametrize("shape", [(3, 0), (0, 0)])
def test_rtn_zero_column_weight_is_a_clear_error(shape):
    """In 0.1.0 rtn_quantize on a 0-column weight raised ZeroDivisionError."""
    with pytest.raises(GPTQError, match=r"at least one column, got shape \(" + str(shape[0]) + ", 0\\)"):
        rtn_quantize(torch.zeros(shape), 4)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("symmetric", [False, True])
def test_static_quantizer_near_dtype_max_is_finite(dtype, symmetric):
    lim = torch.finfo(dtype).max
    q = StaticChannelQuantizer(3, bits=4, symmetric=symmetric)
    q.observe(torch.tensor([[lim, -lim, 1.0], [-lim, lim * 0.9, -2.0]], dtype=dtype))
    y = q(torch.tensor([[lim, -lim, 0.5], [-lim, lim, -2.0]], dtype=dtype))
    assert _finite(y), y


def _dtype_floats(dtype: torch.dtype):
    lim = float(torch.finfo(dtype).max)
    width = 16 if dtype == torch.float16 else 32
    extremes = st.sampled_from([lim, -lim, lim * 0.999, -lim * 0.999, lim / 2, -lim / 2, 0.0, -0.0, 1.0, 0.5])
    return st.one_of(extremes, st.floats(-lim, lim, width=width, allow_nan=False, allow_infinity=False))


@settings(max_examples=120, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(HALF), bits=st.sampled_from([2, 3, 4, 8]),
       gsize=st.sampled_from([1, 2, 4, 7]), groups=st.integers(1, 3), rows=st.integers(1, 3),
       clip=st.sampled_from([1.0, 0.9]), symmetric=st.booleans())
def test_finite_input_gives_finite_output_up_to_each_dtype_max(data, dtype, bits, gsize, groups, rows, clip,
                                                               symmetric):
    """Dynamic (sym/asym, grouped), static and RTN (with and without the MSE search): finite in, finite out."""
    n = gsize * groups
    vals = data.draw(st.lists(_dtype_floats(dtype), min_size=rows * n, max_size=rows * n))
    x = torch.tensor(vals, dtype=torch.float64).to(dtype).reshape(rows, n)
    assert _finite(x)
    for group in (-1, gsize):
        assert _finite(fake_quant_per_token(x, bits, group, clip, symmetric=symmetric)), (group, x)
    q = StaticChannelQuantizer(n, bits=bits, clip_ratio=clip, symmetric=symmetric)
    q.observe(x)
    assert _finite(q(x)), x
    if bits >= 2:
        for mse in (True, False):
            for group in (-1, gsize):
                out, codes, scales = _rtn(x, bits, group, mse, clip, 20, 0.8)
                assert _finite(out), (mse, group, x)
                col = scales.repeat_interleave(n if group == -1 else group, dim=1)[:, :n]
                assert torch.equal((codes * col).to(dtype), out)


def test_normal_range_rows_are_untouched_by_the_overflow_repair():
    """A call holding one extreme token keeps every other token's bits (only the overflowing group is redone)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, 64, generator=gen)
    extreme = x.clone()
    extreme[5] = torch.linspace(-F32_MAX, F32_MAX, 64, dtype=torch.float64).float()
    assert _finite(extreme)
    for symmetric in (False, True):
        a = fake_quant_per_token(x, 4, symmetric=symmetric)
        b = fake_quant_per_token(extreme, 4, symmetric=symmetric)
        assert _finite(b)
        keep = [i for i in range(16) if i != 5]
        assert torch.equal(a[keep].view(torch.int32), b[keep].view(torch.int32))
        assert math.isfinite(float(b[5].abs().max()))


# ----------------------------------------------------------------------------- one study per directory, claims

RUN_SCRIPT = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from rope_quant.experiment.config import RunConfig
    from rope_quant.sweep.manifest import ManifestMismatchError, build_manifest
    from rope_quant.sweep.runner import run_cells

    out, k_bits, slow_at, resume = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
    go = out.parent / "go"
    manifest = build_manifest(RunConfig().override(k_bits=k_bits),
                              {{"hadamard": {{"r3": "hadamard"}}, "pairwise_only": {{"r3": "pairwise_only"}}}},
                              range(4))
    marks = out.parent / "computed"
    marks.mkdir(exist_ok=True)

    def cell(cfg):
        (marks / f"{{cfg.r3.name if hasattr(cfg.r3, 'name') else cfg.r3}}-{{cfg.seed}}-{{os.getpid()}}").write_text("")
        time.sleep(600 if cfg.seed == slow_at else {cell_s})
        return {{"ppl": 10.0 + cfg.seed + k_bits / 100}}

    (out.parent / f"ready-{{os.getpid()}}").write_text("")
    while not go.exists():  # a start barrier: both runs reach run_cells together
        time.sleep(0.01)
    try:
        report = run_cells(manifest, out, cell_fn=cell, resume=resume, log=None)
    except ManifestMismatchError as exc:
        print("error: " + str(exc), file=sys.stderr)
        sys.exit(2)
    print(report.summary())
""")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1"}


def _start_runs(tmp_path: Path, specs: list[tuple[int, int, bool]], cell_s: float = 0.4) -> list[subprocess.Popen]:
    """Start one process per (k_bits, slow_at, resume) on ``tmp_path/out`` and release them together."""
    script = tmp_path / "run_script.py"
    script.write_text(RUN_SCRIPT.format(cell_s=cell_s))
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path / "out"), str(k), str(slow), str(int(res))],
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k, slow, res in specs]
    deadline = time.monotonic() + 180
    while len(list(tmp_path.glob("ready-*"))) < len(procs):
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        assert time.monotonic() < deadline, "the runs did not start"
        time.sleep(0.05)
    (tmp_path / "go").write_text("")
    return procs


def _computed(tmp_path: Path) -> dict[str, list[int]]:
    """cell (r3-seed) -> pids of the processes that computed it."""
    out: dict[str, list[int]] = {}
    for p in (tmp_path / "computed").iterdir():
        r3, seed, pid = p.name.rsplit("-", 2)
        out.setdefault(f"{r3}-{seed}", []).append(int(pid))
    return out


def test_two_identical_concurrent_runs_split_the_cells_and_compute_each_once(tmp_path):
    procs = _start_runs(tmp_path, [(4, -1, True), (4, -1, True)])
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr
    computed = _computed(tmp_path)
    assert len(computed) == 8 and all(len(pids) == 1 for pids in computed.values()), computed
    assert {pid for pids in computed.values() for pid in pids} == {p.pid for p in procs}  # the work was split
    st = status(tmp_path / "out")
    assert st.done and len(st.complete) == 8


def test_two_identical_no_resume_runs_also_compute_each_cell_once(tmp_path):
    first = _start_runs(tmp_path, [(4, -1, True)], cell_s=0.0)[0]
    assert first.wait(timeout=300) == 0
    for p in (tmp_path / "computed").iterdir():
        p.unlink()
    (tmp_path / "go").unlink()
    for p in tmp_path.glob("ready-*"):
        p.unlink()
    procs = _start_runs(tmp_path, [(4, -1, False), (4, -1, False)])
    for p in procs:
        assert p.wait(timeout=300) == 0, p.communicate()[1]
    computed = _computed(tmp_path)
    assert len(computed) == 8 and all(len(pids) == 1 for pids in computed.values()), computed


def test_concurrent_run_of_another_study_is_refused_with_the_sequential_diff(tmp_path):
    """In 0.1.0 `--k-bits 3` started together with the K4 study and both exited 0."""
    procs = _start_runs(tmp_path, [(4, -1, True), (3, -1, True)])
    codes, errs = [], []
    for p in procs:
        _, stderr = p.communicate(timeout=300)
        codes.append(p.returncode)
        errs.append(stderr)
    assert sorted(codes) == [0, 2], errs
    winner, loser = (0, 1) if codes[0] == 0 else (1, 0)
    k_win, k_lose = (4, 3) if winner == 0 else (3, 4)
    def study(k: int):
        return build_manifest(RunConfig().override(k_bits=k),
                              {"hadamard": {"r3": "hadamard"}, "pairwise_only": {"r3": "pairwise_only"}}, range(4))

    assert {c["key"] for c in read_manifest(tmp_path / "out")["cells"]} == {c.key() for _, c in study(k_win)}
    loser_pid = procs[loser].pid
    assert all(loser_pid not in pids for pids in _computed(tmp_path).values())  # it computed nothing
    st = status(tmp_path / "out")
    assert st.done and len(st.complete) == 8
    # the same refusal as a run started after the first one
    with pytest.raises(ManifestMismatchError) as sequential:
        reconcile(tmp_path / "out", study(k_lose))
    assert errs[loser].strip() == "error: " + str(sequential.value)
    assert f"k_bits: {k_win} -> {k_lose}" in errs[loser]


def test_a_claim_left_by_a_killed_run_is_taken_over(tmp_path):
    """Run A dies (kill -9) inside a cell it claimed; run B, which skipped it, takes it over at the end."""
    a, b = _start_runs(tmp_path, [(4, 1, True), (4, -1, True)], cell_s=0.2)
    deadline = time.monotonic() + 120
    while not any(p.name.endswith(f"-{a.pid}") and "-1-" in p.name for p in (tmp_path / "computed").iterdir()):
        assert time.monotonic() < deadline and a.poll() is None
        time.sleep(0.05)
    time.sleep(1.0)  # B meets the claimed cell and moves on
    assert b.poll() is None  # B waits for the claim held by A
    os.kill(a.pid, signal.SIGKILL)
    a.wait()
    assert b.wait(timeout=120) == 0, b.communicate()[1]
    computed = _computed(tmp_path)
    assert len(computed) == 8
    taken_over = [c for c, pids in computed.items() if len(pids) == 2]
    assert all(c.endswith("-1") for c in taken_over) and taken_over, computed
    assert all(len(pids) == 1 for c, pids in computed.items() if c not in taken_over)
    st = status(tmp_path / "out")
    assert st.done and len(st.complete) == 8


# ----------------------------------------------------------------------------- every cache heals

_VOLATILE = {"timing", "weight_cache_hit", "model_reused"}  # what may differ between a fresh and a cached build


def _comparable(record: dict) -> dict:
    """A record's result without its timings and cache-hit flags (every other field must survive a damaged
    cache unchanged, ``rotation_fit`` included)."""
    result = {k: v for k, v in record["result"].items() if k not in _VOLATILE}
    fit = dict(result.get("rotation_fit") or {})
    fit.pop("cache_hit", None)
    result["rotation_fit"] = fit
    return {"status": record["status"], "key": record.get("key"), "keys": sorted(record), "result": result}


@pytest.fixture()
def healing_study(tmp_path, monkeypatch):
    """A finished one-cell study on the tiny random Llama with a whip R1 (the default), RTN weights."""
    token_cache = tmp_path / "token-cache"
    monkeypatch.setenv("ROPE_QUANT_CACHE_DIR", str(token_cache))
    model = save_tiny_model(tmp_path / "tiny")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(corpus_text(1))
    out = tmp_path / "out"
    argv = ["compare", "--model", str(model), "--corpus", str(corpus), "--configs", "pairwise_only",
            "--comparator", "pairwise_only", "--out", str(out), "--keep-cache", *TINY, "--whip-epochs", "1"]
    assert cli.main(argv, models=ModelCache()) == 0
    good = only_record(out)
    assert good["result"]["rotation_fit"]["kind"] == "whip" and good["result"]["rotation_fit"]["steps"] > 0
    return argv, out, token_cache, good


def _cache_files(out: Path, token_cache: Path) -> dict[str, Path]:
    (r1,) = (out / "cache").glob("r1-whip-*.pt")
    (weights,) = (out / "cache").glob("weights-*.pt")
    (stats,) = (out / "cache").glob("stats-*.npz")
    tokens = [p for p in token_cache.rglob("*") if p.is_file()]
    assert len(tokens) == 1, tokens
    return {"r1": r1, "weights": weights, "stats": stats, "tokens": tokens[0]}


@pytest.mark.parametrize("damage", ["truncate", "garbage", "delete"])
def test_every_cache_damaged_in_turn_heals_and_the_record_keeps_every_field(healing_study, damage, caplog):
    """The R1 file damaged while the weight cache is intact (0.1.0 did not heal it) and the other caches:
    each is damaged in turn, the rerun (--no-resume) rewrites it, and the record is the same field by field."""
    argv, out, token_cache, good = healing_study
    files = _cache_files(out, token_cache)
    for name in ("r1", "weights", "stats", "tokens"):
        path = files[name]
        intact = path.read_bytes()
        if damage == "truncate":
            path.write_bytes(intact[: len(intact) // 3])
        elif damage == "garbage":
            path.write_bytes(b"not a cache file at all")
        else:
            path.unlink()
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert cli.main([*argv, "--no-resume"], models=ModelCache()) == 0, name
        again = only_record(out)
        assert _comparable(again) == _comparable(good), name
        healed = _cache_files(out, token_cache)[name]
        assert healed.is_file() and healed.stat().st_size > 0, name
        if name == "r1":  # rebuilt from the weight cache: the same R1 and log as the original fit
            new, old = (torch.load(b, weights_only=True) for b in (healed, _bytes_io(intact)))
            assert torch.equal(new["r1"], old["r1"]) and new["log"] == old["log"]
            assert again["result"]["weight_cache_hit"]
        if damage != "delete" and name != "tokens":
            assert any(healed.name in r.getMessage() for r in caplog.records), (name, caplog.records)


def test_damaged_r1_file_with_an_older_weight_cache_refits_r1(healing_study, caplog):
    """A weight cache written before it kept the fit log cannot rebuild the R1 file: R1 is refitted (and the
    weights recomputed), the R1 file rewritten, and the record keeps rotation_fit."""
    argv, out, token_cache, good = healing_study
    files = _cache_files(out, token_cache)
    payload = torch.load(files["weights"], weights_only=True)
    assert payload.pop("rotation_fit")["steps"] == good["result"]["rotation_fit"]["steps"]
    torch.save(payload, files["weights"])
    original = torch.load(files["r1"], weights_only=True)
    files["r1"].write_bytes(b"damaged")
    with caplog.at_level(logging.WARNING):
        assert cli.main([*argv, "--no-resume"], models=ModelCache()) == 0
    assert any("refitting R1" in r.getMessage() for r in caplog.records)
    again = only_record(out)
    fit = dict(again["result"]["rotation_fit"])
    assert fit.pop("cache_hit") is False and not again["result"]["weight_cache_hit"]
    want = {k: v for k, v in good["result"]["rotation_fit"].items() if k not in ("cache_hit", "fit_s")}
    assert {k: v for k, v in fit.items() if k != "fit_s"} == want
    assert again["result"]["ppl"] == good["result"]["ppl"]
    refit = torch.load(files["r1"], weights_only=True)
    assert torch.equal(refit["r1"], original["r1"])
    assert torch.load(files["weights"], weights_only=True)["rotation_fit"]["steps"] == want["steps"]


def _bytes_io(data: bytes):
    import io

    return io.BytesIO(data)


# ----------------------------------------------------------------------------- checkpoint errors name the culprit


def _tiny_gguf(path: Path, hidden: int = 64, heads: int = 4) -> Path:
    """A GGUF with llama metadata and two float32 tensors (no tokenizer: enough for the header checks)."""
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_embedding_length(hidden)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.ones((32, hidden), dtype=np.float32))
    writer.add_tensor("blk.0.attn_q.weight", np.ones((hidden, hidden), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_cut_inside_its_tensor_data_is_named_before_and_at_load(tmp_path):
    """In 0.1.0 a GGUF cut inside its tensor data was reported as "cannot read the tokenizer"."""
    good = _tiny_gguf(tmp_path / "m.gguf")
    check_checkpoint(str(good))  # intact: no error
    cut = tmp_path / "cut.gguf"
    data = good.read_bytes()
    cut.write_bytes(data[: len(data) - 1000])
    want = r"checkpoint .*cut\.gguf: the GGUF file is cut inside its tensor data: tensor 'blk\.0\.attn_q\.weight'"
    with pytest.raises(CheckpointError, match=want + rf".*the file ends at {len(data) - 1000}"):
        check_checkpoint(str(cut))
    with pytest.raises(CheckpointError, match=want):
        load_model(str(cut))
    header_cut = tmp_path / "header.gguf"
    header_cut.write_bytes(data[:40])
    with pytest.raises(CheckpointError, match=r"header\.gguf: the GGUF header is truncated \(the file ends at"):
        check_checkpoint(str(header_cut))


def test_odd_head_dim_gguf_is_named(tmp_path):
    path = _tiny_gguf(tmp_path / "odd.gguf", hidden=60, heads=4)
    with pytest.raises(CheckpointError, match=r"checkpoint .*odd\.gguf: head_dim 15 is odd"):
        check_checkpoint(str(path))
    with pytest.raises(CheckpointError, match="head_dim 15 is odd"):  # not "cannot read the tokenizer"
        load_model(str(path))


def test_odd_head_dim_hf_checkpoint_is_named_from_its_config(tmp_path):
    import json

    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text(json.dumps(
        {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 60, "num_attention_heads": 4,
         "head_dim": 15, "num_hidden_layers": 1, "intermediate_size": 32, "vocab_size": 64}))
    with pytest.raises(CheckpointError, match=r"checkpoint .*odd: head_dim 15 is odd"):
        check_checkpoint(str(tmp_path / "odd"))
    with pytest.raises(CheckpointError, match="head_dim 15 is odd"):  # not "cannot read the tokenizer"
        load_model(str(tmp_path / "odd"))


def test_safetensors_cut_inside_its_tensor_data_is_named(tmp_path):
    model = save_tiny_model(tmp_path / "tiny")
    check_checkpoint(str(model))  # intact
    (weights,) = model.glob("*.safetensors")
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 4096])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: the safetensors file is cut inside its tensor "
                                              r"data: tensor '.+' ends at byte \d+, the file ends at"):
        check_checkpoint(str(model))
    with pytest.raises(ModelNotFoundError):
        check_checkpoint(str(tmp_path / "absent"))


# ----------------------------------------------------------------------------- what held keeps holding


def _compare_argv(model: Path, corpus: Path, out: Path) -> list[str]:
    flags = [f for f in TINY if f not in ("--seeds", "0")]
    return ["compare", "--model", str(model), "--corpus", str(corpus), "--configs", "hadamard,pairwise_only,identity",
            "--seeds", "0,1", "--out", str(out), *flags, "--whip-epochs", "1"]


def _results(out: Path) -> dict[str, dict]:
    """Every record's result by relative path, without timings and cache-hit flags."""
    found = {}
    for entry in read_manifest(out)["cells"]:
        record = _comparable(json.loads((out / entry["path"]).read_text()))
        record["result"]["rotation_fit"].pop("fit_s", None)  # wall time of the fit (another run's cache)
        found[entry["path"]] = record
    return found


def _diff(got: dict, want: dict) -> list[str]:
    """The differing result fields, by record."""
    return [f"{path}: {k}: {got[path]['result'].get(k)!r} != {want[path]['result'].get(k)!r}"
            for path in want if path in got for k in want[path]["result"]
            if got[path]["result"].get(k) != want[path]["result"][k]] or [str(set(got) ^ set(want))]


def test_kill_9_mid_sweep_then_resume_is_bit_identical_and_damaged_records_rerun(tmp_path, monkeypatch):
    """The real pipeline on the tiny Llama, killed (SIGKILL) after its first record: the resumed sweep's records
    equal an uninterrupted sweep's field by field (perplexities to the bit); then damaged records (truncated,
    garbage) are recomputed, and only they."""
    monkeypatch.setenv("ROPE_QUANT_CACHE_DIR", str(tmp_path / "token-cache"))
    model = save_tiny_model(tmp_path / "tiny")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(corpus_text(1))
    reference = tmp_path / "reference"
    assert cli.main(_compare_argv(model, corpus, reference), models=ModelCache()) == 0
    want = _results(reference)
    assert len(want) == 6

    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "rope_quant.cli", *_compare_argv(model, corpus, out)],
                            env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while not list((out / "cells").rglob("*.json")) if (out / "cells").exists() else True:
        assert proc.poll() is None, "the sweep ended before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = len(list((out / "cells").rglob("*.json")))
    assert 1 <= done_before < 6
    assert cli.main(_compare_argv(model, corpus, out), models=ModelCache()) == 0
    got = _results(out)
    assert got == want, _diff(got, want)  # the cell paths carry the keys: same cells, same results
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]

    paths = sorted(got)
    (out / paths[0]).write_text((out / paths[0]).read_text()[:40])
    (out / paths[1]).write_bytes(b"\x00garbage")
    intact = {p: (out / p).read_bytes() for p in paths[2:]}
    assert cli.main(_compare_argv(model, corpus, out), models=ModelCache()) == 0
    again = _results(out)
    assert again == want, _diff(again, want)
    assert all((out / p).read_bytes() == b for p, b in intact.items())  # the intact records were not rewritten


def test_empty_token_batches_still_quantise():
    for symmetric in (False, True):
        assert fake_quant_per_token(torch.zeros(0, 8), 4, symmetric=symmetric).shape == (0, 8)
        empty = torch.zeros(2, 0, 8, dtype=torch.float16)
        assert fake_quant_per_token(empty, 4, symmetric=symmetric).shape == (2, 0, 8)


def test_claim_study_checks_and_writes_in_one_step(tmp_path):
    """The CLI's pre-load check: a different study is refused before anything is written; the same study
    (more seeds) is merged and written."""
    out = tmp_path / "out"
    variants = {"hadamard": {"r3": "hadamard"}, "pairwise_only": {"r3": "pairwise_only"}}
    first = claim_study(out, build_manifest(RunConfig(), variants, [0]))
    assert len(first.manifest) == 2 and len(read_manifest(out)["cells"]) == 2
    before = (out / "manifest.json").read_bytes()
    with pytest.raises(ManifestMismatchError, match=f"k_bits: {RunConfig().k_bits} -> 3 "):
        claim_study(out, build_manifest(RunConfig().override(k_bits=3), variants, [0]))
    assert (out / "manifest.json").read_bytes() == before
    more = claim_study(out, build_manifest(RunConfig(), variants, [0, 1]))
    assert len(more.manifest) == 4 and len(read_manifest(out)["cells"]) == 4


def test_a_held_study_lock_times_out_with_a_clear_error(tmp_path):
    from filelock import FileLock

    from rope_quant.sweep.lock import STUDY_LOCK, StudyLockTimeout, lock_dir, study_lock

    holder = FileLock(str(lock_dir(tmp_path) / STUDY_LOCK))
    with holder:
        with pytest.raises(StudyLockTimeout, match=r"another run has held .*study\.lock"):
            with study_lock(tmp_path, timeout=0.2):
                pass
    with study_lock(tmp_path, timeout=0.2):  # released: free again
        pass


def test_two_cli_runs_of_different_studies_started_together(tmp_path, monkeypatch):
    """The reported command pair: `compare … --out D` and the same plus `--k-bits 3`, started together. One
    exits 0, the other 2 with the diff; the manifest holds the winner's study and its records only."""
    monkeypatch.setenv("ROPE_QUANT_CACHE_DIR", str(tmp_path / "token-cache"))
    model = save_tiny_model(tmp_path / "tiny")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(corpus_text(1))
    out = tmp_path / "out"
    base = [sys.executable, "-m", "rope_quant.cli", *_compare_argv(model, corpus, out)]
    procs = [subprocess.Popen(argv, env={**_env(), "ROPE_QUANT_CACHE_DIR": str(tmp_path / "token-cache")},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for argv in (base, [*base, "--k-bits", "3"])]
    results = [(p.wait(timeout=400), *p.communicate()) for p in procs]
    codes = [r[0] for r in results]
    assert sorted(codes) == [0, 2], [r[2][-2000:] for r in results]
    loser = codes.index(2)
    assert "holds a different study" in results[loser][2] and "k_bits: " in results[loser][2]
    k_win = 3 if loser == 0 else RunConfig().k_bits
    cells = read_manifest(out)["cells"]
    assert len(cells) == 6 and {c["config"]["quant"]["k"]["bits"] for c in cells} == {k_win}
    on_disk = sorted(str(p.relative_to(out)) for p in (out / "cells").rglob("*.json"))
    assert on_disk == sorted(c["path"] for c in cells)  # no record of the refused study


# ----------------------------------------------------------------------------- out of memory inside a stage

@pytest.mark.parametrize("oom", [torch.OutOfMemoryError, MemoryError])
def test_out_of_memory_in_a_stage_is_recorded_with_its_name_and_the_other_cells_go_on(tmp_path, monkeypatch, oom):
    """An OOM in the middle of a stage (here RTN, first call only) makes that cell's record name the
    stage; the study's other cells complete, and a rerun computes only the failed cell."""
    from rope_quant.planning.stages import StageName
    from rope_quant.quant import rtn

    monkeypatch.setenv("ROPE_QUANT_CACHE_DIR", str(tmp_path / "token-cache"))
    model = save_tiny_model(tmp_path / "tiny")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(corpus_text(1))
    out = tmp_path / "out"
    real_rtn, calls = rtn.quantize_model_rtn, []

    def rtn_once_out_of_memory(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise oom("Tried to allocate 20.00 GiB")
        return real_rtn(*args, **kwargs)

    monkeypatch.setattr(rtn, "quantize_model_rtn", rtn_once_out_of_memory)
    assert cli.main(_compare_argv(model, corpus, out), models=ModelCache()) == 1  # some cells failed
    recs = [json.loads((out / e["path"]).read_text()) for e in read_manifest(out)["cells"]]
    failed = [r for r in recs if r["status"] == "error"]
    assert len(recs) == 6 and len(failed) == 1, [r["status"] for r in recs]
    err = failed[0]["error"]
    assert err["type"] == "StageOutOfMemoryError" and err["stage"] == StageName.RTN == "RTN"
    assert "out of memory in stage 'RTN'" in err["message"] and "--offload cpu" in err["message"]
    assert "20.00 GiB" in err["message"]
    ok_before = {e["path"]: (out / e["path"]).read_bytes() for e in read_manifest(out)["cells"]
                 if json.loads((out / e["path"]).read_text())["status"] == "ok"}
    assert cli.main(_compare_argv(model, corpus, out), models=ModelCache()) == 0
    assert all((out / p).read_bytes() == b for p, b in ok_before.items())  # only the failed cell ran again
    assert all(json.loads((out / e["path"]).read_text())["status"] == "ok" for e in read_manifest(out)["cells"])


def test_a_rerun_cell_removes_the_temporaries_its_killed_writer_left(tmp_path):
    """kill -9 inside an atomic write leaves ``.<name>.*.tmp`` beside the record or in the artefact directory; the
    run that takes the cell over removes them (under the claim), and leaves a complete cell's files alone."""
    from rope_quant.sweep.cells import artifact_dir
    from rope_quant.sweep.records import cell_path
    from rope_quant.sweep.runner import run_cells
    from tests._support import FakeConfig

    manifest = build_manifest(FakeConfig(seqlen=64), {"hadamard": {"r3": "hadamard"}}, (0, 1), study="compare")
    run_cells(manifest, tmp_path, [0], cell_fn=lambda cfg: {"ppl": 10.0, "n_windows": 1, "n_tokens": 64}, log=None)
    (name0, cfg0), (name1, cfg1) = manifest.cells
    leftovers = []
    for name, cfg in ((name0, cfg0), (name1, cfg1)):
        record, art = cell_path(tmp_path, name, cfg), artifact_dir(tmp_path, cfg)
        art.mkdir(parents=True, exist_ok=True)
        record.parent.mkdir(parents=True, exist_ok=True)
        leftovers.append((record.parent / f".{record.name}.abc123.tmp", art / ".angles.npy.xyz789.tmp"))
        for tmp in leftovers[-1]:
            tmp.write_bytes(b"half a file")
    report = run_cells(manifest, tmp_path, cell_fn=lambda cfg: {"ppl": 11.0, "n_windows": 1, "n_tokens": 64},
                       log=None)
    assert report.ran == [1] and report.skipped == [0]
    assert all(tmp.exists() for tmp in leftovers[0])  # a complete cell is not touched
    assert not any(tmp.exists() for tmp in leftovers[1])

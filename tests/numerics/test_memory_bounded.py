"""The memory-bounded pipeline: the dtype default, no model copy per cell, the plan checked first."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from rope_quant import cli
from rope_quant.cli.validate import check_memory, resolve_dtype
from rope_quant.corpora import token_streams
from rope_quant.experiment import pipeline
from rope_quant.experiment.config import RunConfig
from rope_quant.model.offload import OffloadMode
from rope_quant.planning import memory_check
from rope_quant.planning import plan as planning
from rope_quant.planning.plan_costs import GIB
from rope_quant.sweep.manifest import read_manifest
from tests._support import TINY, tiny_base
from tests._support.models import tiny_llama


class _Cell:
    def __init__(self) -> None:
        self.calls: list = []

    def __call__(self, cfg) -> dict:
        self.calls.append(cfg)
        return {"ppl": 12.0, "n_windows": 2, "n_tokens": 100, "k_range_mean": 2.0, "k_range_max": 5.0,
                "delta_mean": 0.1, "k_rel_err": 0.01}


# ----------------------------------------------------------------------------- 1. --dtype auto


def test_dtype_auto_is_bf16_on_cuda_fp32_on_cpu() -> None:
    assert resolve_dtype("cpu", "auto") == "float32"
    assert resolve_dtype("cuda", "auto") == "bfloat16" and resolve_dtype("cuda:1", "auto") == "bfloat16"
    assert resolve_dtype("cuda", "float32") == "float32" and resolve_dtype("cpu", "bfloat16") == "bfloat16"


def test_cpu_keys_and_records_do_not_move_with_the_auto_default(tmp_path: Path, capsys) -> None:
    cell = _Cell()
    base = ["run", "--config", "pairwise_only", "--seed", "1"]
    assert cli.main([*base, "--out", str(tmp_path / "auto")], cell_fn=cell) == 0
    assert cli.main([*base, "--dtype", "float32", "--out", str(tmp_path / "fp32")], cell_fn=cell) == 0
    assert cli.main([*base, "--dtype", "bfloat16", "--out", str(tmp_path / "bf16")], cell_fn=cell) == 0
    auto, fp32, bf16 = cell.calls
    assert auto.key() == fp32.key() and auto.weight_key() == fp32.weight_key()  # CPU cache keys unchanged
    assert bf16.key() != fp32.key()  # the dtype is part of the key: the resolved one must be stored
    stored = read_manifest(tmp_path / "auto")["cells"][0]
    assert json.dumps(stored).count('"dtype": "float32"') == 1 and '"dtype": "auto"' not in json.dumps(stored)
    assert "dtype=float32" in capsys.readouterr().out


def test_dtype_help_names_the_auto_rule(capsys) -> None:
    assert cli.main(["run", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "auto (default) = bfloat16 on CUDA, float32 on the CPU" in text


# ----------------------------------------------------------------------------- 2. no model copy per cell


def _old_load(cfg, base, partial=False, stream=False):
    """The earlier ``pipeline.load_base``: a deep copy of the base per cell (the reference for bit-identity)."""
    model = copy.deepcopy(base[0]).to(device=cfg.runtime.device, dtype=cfg.runtime.dtype.torch)
    return model.eval(), base[1]


def test_cells_need_no_model_deepcopy_and_match_the_old_path_bit_for_bit(embedded_model, tmp_path, monkeypatch):
    base = tiny_base(embedded_model)
    before = {k: v.clone() for k, v in base[0].state_dict().items()}
    corpus = token_streams.load_corpus("pydoc", base[1])
    configs = ["hadamard", "pairwise_only", "pairwise_plus_hadamard"]
    cfgs = [RunConfig.from_flat(**TINY, r3=r3, weights="rtn", seed=seed) for seed in (0, 1) for r3 in configs]

    real_deepcopy = copy.deepcopy
    module_copies: list[str] = []

    def counting(obj, *args, **kwargs):
        if isinstance(obj, torch.nn.Module):
            module_copies.append(type(obj).__name__)
        return real_deepcopy(obj, *args, **kwargs)

    monkeypatch.setattr(copy, "deepcopy", counting)
    new = [pipeline.run_cell(c, cache_dir=tmp_path / "new", base=base, corpus=corpus) for c in cfgs]
    assert module_copies == []  # no deepcopy of the model, neither per cell nor per seed
    assert [r["weight_cache_hit"] for r in new] == [False, True, True, False, True, True]
    monkeypatch.setattr(pipeline, "load_base", _old_load)
    old = [pipeline.run_cell(c, cache_dir=tmp_path / "old", base=base, corpus=corpus) for c in cfgs]
    assert len(module_copies) == len(cfgs)  # the old path copies the whole model once per cell
    for a, b in zip(new, old, strict=True):
        assert a["ppl"] == b["ppl"] and a["window_nll"] == b["window_nll"], (a["key"], a["ppl"], b["ppl"])
        assert a["k_range_mean"] == b["k_range_mean"]
    after = base[0].state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_working_copy_equals_deepcopy_cast_and_keeps_tying_and_buffers():
    from rope_quant.model import working_copy

    base = tiny_llama(96, tied=True)
    for dtype in (torch.float32, torch.bfloat16):
        ref = copy.deepcopy(base).to(dtype=dtype)
        state = torch.get_rng_state()
        model = working_copy.skeleton(base, "cpu", dtype)
        assert torch.equal(torch.get_rng_state(), state)  # building it draws no random numbers
        working_copy.fill(model, base)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        ref_state, state_ = ref.state_dict(), model.state_dict()
        assert ref_state.keys() == state_.keys()
        for k in ref_state:
            assert ref_state[k].dtype == state_[k].dtype and torch.equal(ref_state[k], state_[k]), k
        for (n, a), (_, b) in zip(ref.named_buffers(), model.named_buffers(), strict=True):  # non-persistent too
            assert torch.equal(a, b), n
        ids = torch.randint(0, 96, (1, 16))
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=0)
    untied = tiny_llama(96, tied=False)
    copy_ = working_copy.skeleton(untied, "cpu", torch.float32)
    assert copy_.lm_head.weight is not copy_.model.embed_tokens.weight


# ----------------------------------------------------------------------------- 4. the plan before anything loads

PAPER_CUDA = dict(calib_windows=128, seqlen=2048, eval_windows=None, whip_epochs=None, configs=4, seeds=3, gptq=True)


@pytest.mark.parametrize("command", [["run", "--config", "hadamard"], ["compare", "--seeds", "0"]])
def test_a_run_that_does_not_fit_exits_2_with_the_remedy_and_writes_nothing(command, tmp_path, capsys,
                                                                            monkeypatch):
    monkeypatch.setenv(memory_check.ENV_HOST, "0.01")  # 10 MiB of host RAM: the embedded model cannot fit
    out = tmp_path / "out"
    assert cli.main([*command, "--out", str(out), "--seqlen", "64", "--calib-windows", "2"]) == 2
    err = capsys.readouterr().err
    assert "the plan for this run does not fit: stage 'load' needs" in err and "0.0 GiB available" in err
    assert "use a smaller --calib-windows" in err and "or more memory" in err
    assert not out.exists()  # nothing written, nothing loaded


def test_a_bad_budget_variable_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(memory_check.ENV_HOST, "lots")
    assert cli.main(["run", "--out", str(tmp_path / "o")]) == 2
    assert "ROPE_QUANT_HOST_MEMORY_GIB must be a number of GiB, got 'lots'" in capsys.readouterr().err


def test_auto_offloads_exactly_when_only_the_streamed_plan_fits(monkeypatch):
    monkeypatch.setattr(memory_check, "_plan_device", lambda device: "h100")  # a CUDA device without one
    protocol = memory_check.protocol_for(**PAPER_CUDA)
    full, streamed = (memory_check.plan_for("smollm2-135m", "cuda", "bfloat16", protocol, offload=o).peak_gpu
                      for o in (False, True))
    assert streamed < full
    between = (full + streamed) // 2
    big = 64 * GIB
    d = memory_check.decide("smollm2-135m", "cuda", "bfloat16", protocol, "auto", gpu_bytes=full, host_bytes=big)
    assert d.offload == OffloadMode.NONE and d.note == ""
    d = memory_check.decide("smollm2-135m", "cuda", "bfloat16", protocol, "auto", gpu_bytes=between,
                            host_bytes=big)
    assert d.offload == OffloadMode.CPU and d.note.startswith("offload: cpu (the plan: stage 'GPTQ' needs")
    assert "without offload; it fits streaming one decoder layer at a time" in d.note
    with pytest.raises(planning.PlanDoesNotFit, match="use --offload cpu"):
        memory_check.decide("smollm2-135m", "cuda", "bfloat16", protocol, "none", gpu_bytes=between,
                            host_bytes=big)
    with pytest.raises(planning.PlanDoesNotFit, match="more GPU memory"):
        memory_check.decide("smollm2-135m", "cuda", "bfloat16", protocol, "auto", gpu_bytes=streamed - 1,
                            host_bytes=big)
    # on the CPU offload is a no-op: only the host is checked
    on_cpu = memory_check.decide("smollm2-135m", "cpu", "float32", protocol, "cpu", host_bytes=big)
    assert on_cpu.offload == OffloadMode.NONE


def test_the_cli_announces_the_auto_offload(monkeypatch, capsys):
    import argparse

    monkeypatch.setattr(memory_check, "_plan_device", lambda device: "h100")
    protocol = memory_check.protocol_for(**{**PAPER_CUDA, "calib_windows": 128})
    full, streamed = (memory_check.plan_for("smollm2-135m", "cuda", "bfloat16", protocol, offload=o).peak_gpu
                      for o in (False, True))
    monkeypatch.setenv(memory_check.ENV_GPU, str((full + streamed) / 2 / GIB))
    args = argparse.Namespace(model="smollm2-135m", device="cuda", dtype="bfloat16", offload="auto", seqlen=None,
                              calib_windows=None, eval_windows=None, weights=None, w_mse=None, w_bits=4,
                              whip_epochs=None)
    assert check_memory(args, configs=4, seeds=3) == "cpu"
    assert capsys.readouterr().out.startswith("offload: cpu (the plan: stage 'GPTQ' needs")


def test_a_slurm_submission_from_a_machine_without_a_gpu_plans_against_the_named_gpu(monkeypatch, capsys):
    """Slurm: `--device cuda --slurm N` from a login node passes the device check; with
    ROPE_QUANT_GPU_MEMORY_GIB set the plan is checked against that GPU (exit 2 with the remedy when it does not
    fit), without it the submission says the plan was not checked. A run *here* still needs CUDA."""
    import argparse

    import torch

    from rope_quant.cli.args import CLIError
    from rope_quant.cli.validate import check_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert check_device("cuda", runs_here=False) == "cuda"
    with pytest.raises(CLIError, match="CUDA is not available on this machine"):
        check_device("cuda")
    args = argparse.Namespace(model="smollm2-135m", device="cuda", dtype="bfloat16", offload="auto", seqlen=None,
                              calib_windows=None, eval_windows=None, weights=None, w_mse=None, w_bits=4,
                              whip_epochs=None)
    monkeypatch.delenv(memory_check.ENV_GPU, raising=False)
    assert check_memory(args, configs=4, seeds=3) == "none"
    assert "no GPU on this machine, so the plan is not checked before submitting" in capsys.readouterr().err
    with pytest.raises(planning.PlanError, match="without CUDA: set ROPE_QUANT_GPU_MEMORY_GIB"):
        memory_check.gpu_budget("cuda")
    monkeypatch.setenv(memory_check.ENV_GPU, "0.01")
    with pytest.raises(CLIError, match=r"does not fit: stage '.*' needs .* of GPU memory"):
        check_memory(args, configs=4, seeds=3)
    monkeypatch.setenv(memory_check.ENV_GPU, "80")
    assert check_memory(args, configs=4, seeds=3) == "none"


def test_auto_dtype_picks_float16_on_a_gpu_without_bfloat16_and_says_why(monkeypatch, capsys):
    """A pre-Ampere GPU (capability < 8.0) has no native bfloat16: ``--dtype auto`` takes float16 with a note."""
    from rope_quant.model import dtypes

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _i=None: "Tesla V100-SXM2-32GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _i=None: (7, 0))
    name, note = dtypes.auto_dtype("cuda:0")
    assert name == "float16" and "V100" in note and "7.0" in note and "--dtype float32" in note
    assert resolve_dtype("cuda", "auto") == "float16"
    assert "no native bfloat16" in capsys.readouterr().err
    assert resolve_dtype("cuda", "bfloat16") == "bfloat16"  # an explicit choice is kept
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert dtypes.auto_dtype("cuda") == ("bfloat16", "") and dtypes.auto_dtype("cpu") == ("float32", "")

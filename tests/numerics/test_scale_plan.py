"""``rope-quant plan``: per-stage predictions from a config read on the meta device, exit 2 with the
remedy when a run does not fit."""

from __future__ import annotations

import argparse
import json

import pytest

from rope_quant.cli import plan as cli_plan
from rope_quant.model import shapes
from rope_quant.planning import plan as planning

GIB = 1 << 30


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    cli_plan.add_parser(parser.add_subparsers(dest="cmd"))
    return cli_plan.run(parser.parse_args(["plan", *argv]))


@pytest.mark.parametrize("name", [s.value for s in shapes.ShapeName])
def test_every_shape_has_every_stage(name):
    mc = planning.model_cost(planning.read_model(name), name)
    plan = planning.make_plan(mc, "h100", protocol=planning.Protocol(long_context=(8192,)))
    names = [s.name for s in plan.stages]
    assert names == ["load", "whip R1", "offline rotation", "GPTQ", "calibration", "evaluation (per config)",
                     "long context L=8192"]
    assert plan.dtype == "bfloat16" and plan.total_seconds > 0
    # the stored model is the floor of every GPU stage without offload
    assert all(s.gpu_bytes >= mc.params * 2 for s in plan.stages)


def test_the_8b_paper_protocol_fits_an_h100_and_70b_needs_offload(capsys):
    assert _run(["llama-3-8b", "--device", "h100"]) == 0
    out = capsys.readouterr().out
    assert "GPU-hours" in out and "| GPTQ |" in out
    assert "measured on one NVIDIA H100 80GB" in out and "2026-11-27" in out  # the GPU constants' provenance
    assert _run(["llama-3-70b", "--device", "h100"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: stage 'load' needs 131.4 GiB") and "--offload cpu" in err
    assert _run(["llama-3-70b", "--device", "h100", "--offload", "cpu"]) == 0


def test_offload_bounds_gpu_memory_by_a_layer_not_the_model():
    mc = planning.model_cost(planning.read_model("llama-3-70b"))
    full = planning.make_plan(mc, "h100")
    streamed = planning.make_plan(mc, "h100", offload=True)
    assert streamed.peak_gpu < 0.5 * full.peak_gpu
    assert streamed.peak_gpu < 80 * GIB < full.peak_gpu


def test_memory_grows_with_calibration_windows_and_time_with_the_sweep():
    mc = planning.model_cost(planning.read_model("llama-2-7b"))
    small = planning.make_plan(mc, "cpu", protocol=planning.Protocol(calib_windows=8))
    big = planning.make_plan(mc, "cpu", protocol=planning.Protocol(calib_windows=128))
    assert big.peak_host > small.peak_host and small.dtype == "float32"
    one = planning.make_plan(mc, "h100", protocol=planning.Protocol(configs=1, seeds=1))
    more = planning.make_plan(mc, "h100", protocol=planning.Protocol(configs=4, seeds=3))
    assert more.total_seconds > 3 * one.total_seconds


def test_host_budget_gives_the_remedy(capsys):
    assert _run(["llama-2-7b", "--device", "cpu", "--host-memory-gib", "8"]) == 2
    err = capsys.readouterr().err
    assert "host RAM" in err and "--calib-windows" in err and "--dtype bfloat16" in err


def test_reads_a_checkpoint_dir_and_a_config_json(tmp_path, capsys):
    shapes.hf_config("qwen2.5-7b").to_json_file(str(tmp_path / "config.json"))
    assert _run([str(tmp_path), "--device", "a100-80g"]) == 0
    assert "7.62B parameters" in capsys.readouterr().out
    assert _run([str(tmp_path / "config.json"), "--device", "a100-80g"]) == 0


def test_bad_input_exits_2_with_one_line(tmp_path, capsys):
    assert _run([str(tmp_path / "nowhere")]) == 2
    assert "neither a shape" in capsys.readouterr().err
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    assert _run([str(cfg)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "gpt2" in err and err.count("\n") == 1
    cfg.write_text("{not json")
    assert _run([str(cfg)]) == 2
    assert "cannot read the config" in capsys.readouterr().err
    with pytest.raises(planning.PlanError, match="unknown device 'tpu'"):
        planning.make_plan(planning.model_cost(planning.read_model("llama-2-7b")), "tpu")


def test_gpu_plan_prices_layer_windows_and_columns_from_the_h100_measurements():
    """On a GPU the plan is per layer-window (forward, statistics) and per column (GPTQ), with the H100's
    measured constants: at the measured setting (Llama-3-8B shape cut to 2 layers, full vocabulary, 128 x 2048
    calibration, 8 evaluation windows) it returns the measured evaluation (0.235 s per config) and GPTQ
    (34.2 s), and calibration grows with layers x windows, not with FLOPs alone."""
    import dataclasses

    from rope_quant.planning import plan_costs as pc

    mc = planning.model_cost(planning.read_model("llama-3-8b"))
    two = dataclasses.replace(mc, n_layers=2, params=mc.params - 30 * mc.layer_params)
    plan = planning.make_plan(two, "h100", protocol=planning.Protocol(configs=2, seeds=1, eval_windows=8))
    secs = {s.name: s.seconds for s in plan.stages}
    assert secs["evaluation (per config)"] == pytest.approx(0.235, rel=0.02)
    assert secs["GPTQ"] == pytest.approx(34.2, rel=0.02)
    calib = {(layers, windows): planning.make_plan(
        dataclasses.replace(mc, n_layers=layers), "h100",
        protocol=planning.Protocol(calib_windows=windows, seeds=1)).stages for layers in (2, 4)
        for windows in (8, 16)}
    t = {k: next(s.seconds for s in v if s.name == "calibration") for k, v in calib.items()}
    per_lw = (t[(4, 16)] - t[(4, 8)] - t[(2, 16)] + t[(2, 8)]) / (2 * 8)
    fwd = 2 * 2048 * (mc.layer_params + 2048 * mc.hidden) / pc.H100_MEASURED.bf16_flops
    want = fwd * pc.H100_MEASURED.quant_layer_overhead + pc.H100_MEASURED.stats_s  # the 8B q/k is the reference
    assert per_lw == pytest.approx(want, rel=1e-6)
    assert "2026-11-27" in plan.device.basis and plan.device.measured

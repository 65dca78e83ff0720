"""The CUDA scale benchmark (tests/bench/bench_cuda_scale.py): smoke-tested on the CPU at a tiny width (every
stage runs and is reported, with the plan's prediction), its out-of-memory and time-budget reports, and the full
run where CUDA is available (prints, never asserts on time)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "tests" / "bench" / "bench_cuda_scale.py"
SMOKE = ["--device", "cpu", "--tiny", "--layers", "2", "--calib-windows", "2", "--seqlen", "64",
         "--eval-windows", "2", "--whip-epochs", "1"]


def _run(*extra: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(BENCH), *SMOKE, *extra], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def test_smoke_on_the_cpu_reports_every_stage_with_the_plan(tmp_path):
    out = _run("--json", str(tmp_path / "rows.json"))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "rows.json").read_text())
    stages = [r["stage"] for r in rows]
    assert stages[:5] == ["load", "whip R1", "offline rotation", "RTN", "calibration"]
    assert stages.count("evaluation (per config)") == 4 and stages[-1] == "GPTQ"
    assert all(r["wall_s"] is not None and r["wall_s"] >= 0 for r in rows)
    planned = {r["stage"] for r in rows if r["plan_s"] is not None}
    assert {"whip R1", "offline rotation", "calibration", "evaluation (per config)", "GPTQ"} <= planned
    assert rows[-1]["note"] == "2/2 layers"
    assert "| calibration |" in out.stdout and "Table 1 projection" in out.stdout


def test_a_stage_out_of_memory_is_reported_by_name_not_raised(monkeypatch, capsys):
    sys.path.insert(0, str(BENCH.parent))
    import bench_cuda_scale as bench

    from rope_quant.experiment import pipeline

    def oom(*_a, **_k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(pipeline, "_calibrate", oom)
    rows = bench.run(bench.parse(SMOKE))
    assert rows[-1].stage == "calibration"
    assert "OUT OF MEMORY" in rows[-1].note and "stage 'calibration'" in rows[-1].note
    assert pipeline._load.__name__ == "_load"  # the bench put the pipeline back


def test_the_time_budget_stops_the_running_stage_and_still_reports():
    out = _run("--budget-s", "0.5")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "STOPPED: time budget" in out.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA scale bench needs a CUDA GPU (run it in one "
                    "device call: PYTHONPATH=$PWD python3 tests/bench/bench_cuda_scale.py)")
def test_full_depth_llama_3_8b_one_seed_on_cuda(capsys):
    sys.path.insert(0, str(BENCH.parent))
    import bench_cuda_scale as bench

    assert bench.main([]) == 0
    out = capsys.readouterr().out
    print(out)
    assert "| GPTQ |" in out and "Table 1 projection" in out

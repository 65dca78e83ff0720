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


def test_a_stage_out_of_memory_is_reported_by_name_not_raised():
    """An OOM inside calibration (raised by the pipeline's own code) is a row note naming the stage."""
    driver = (
        "import runpy, sys, torch\n"
        "from rope_quant.experiment import pipeline\n"
        "def oom(*a, **k):\n"
        "    raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 20.00 GiB')\n"
        "pipeline.calibrate = oom\n"
        f"sys.argv = [{str(BENCH)!r}, *{SMOKE!r}]\n"
        f"runpy.run_path({str(BENCH)!r}, run_name='__main__')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, timeout=600, env=env,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    row = next(line for line in out.stdout.splitlines() if line.startswith("| calibration |"))
    assert "OUT OF MEMORY" in row and "stage 'calibration'" in row
    assert "| evaluation" not in out.stdout  # the run stopped there, and still reported


def test_the_time_budget_stops_the_running_stage_and_still_reports():
    out = _run("--budget-s", "0.5")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "STOPPED: time budget" in out.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA scale bench needs a CUDA GPU (run it in one "
                    "device call: PYTHONPATH=$PWD python3 tests/bench/bench_cuda_scale.py)")
def test_full_depth_llama_3_8b_one_seed_on_cuda():
    out = subprocess.run([sys.executable, str(BENCH)], capture_output=True, text=True, timeout=900,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    print(out.stdout)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| GPTQ |" in out.stdout and "Table 1 projection" in out.stdout

"""tests/bench/bench_r4_cost.py runs and prints its ratio columns (a tiny size; timings are never asserted)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "bench" / "bench_r4_cost.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=120,
                          check=False)


def test_bench_prints_ratio_columns_at_a_tiny_size() -> None:
    out = _run("--sizes", "64:96,32:172", "--tokens", "4", "--threads", "1", "--rounds", "1", "--clock", "cpu")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    header = lines[1].split(" | ")
    assert header[:8] == ["intermediate", "K*2^m", "hidden", "threads", "tokens", "r4_ms", "down_ms", "r4/down"]
    rows = [line.split(" | ") for line in lines[2:]]
    assert [r[:2] for r in rows] == [["96", "12*2^3"], ["172", "172*2^0"]]
    for r in rows:
        r4, down, ratio = (float(v) for v in r[5:8])
        assert r4 > 0 and down > 0 and abs(ratio - r4 / down) <= 2e-3 * ratio + 1e-3  # ms: 4 significant digits


def test_bench_bad_sizes_exit_2_with_one_error_line() -> None:
    out = _run("--sizes", "4096x11008")
    assert out.returncode == 2
    assert out.stderr.strip().startswith("error:") and len(out.stderr.strip().splitlines()) == 1
    assert "--sizes" in out.stderr

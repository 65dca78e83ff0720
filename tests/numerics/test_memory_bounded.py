"""Issue 21, the memory-bounded pipeline: the dtype default, no model copy per cell, the plan checked first."""

from __future__ import annotations

import json
from pathlib import Path

from rope_quant import cli
from rope_quant.cli.validate import resolve_dtype
from rope_quant.sweep.manifest import read_manifest


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
    assert json.dumps(stored).count('"dtype": "float32"') == 1 and "auto" not in json.dumps(stored)
    assert "dtype=float32" in capsys.readouterr().out


def test_dtype_help_names_the_auto_rule(capsys) -> None:
    assert cli.main(["run", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "auto (default) = bfloat16 on CUDA, float32 on the CPU" in text

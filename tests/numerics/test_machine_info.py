"""The machine record of the claims JSON: what moves a result's digits between machines."""

from __future__ import annotations

import json

import torch

from rope_quant.experiment.envinfo import machine_info


def test_machine_info_names_what_moves_the_digits() -> None:
    info = machine_info("gptq float64")
    assert isinstance(info["cpu_model"], str) and info["cpu_model"] not in ("", "unknown")
    assert info["threads"] == torch.get_num_threads() and info["threads"] >= 1
    assert info["torch"] == torch.__version__
    assert info["transformers"] != "not installed" and info["blas"] not in ("", "unknown")
    assert info["float_mode"]["run"] == "gptq float64"
    assert info["float_mode"]["matmul_precision"] == torch.get_float32_matmul_precision()
    assert json.loads(json.dumps(info)) == info  # JSON-ready as it is


def test_machine_info_follows_the_thread_count() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert machine_info()["threads"] == 1
    finally:
        torch.set_num_threads(before)

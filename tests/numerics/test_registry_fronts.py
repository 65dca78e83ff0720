"""The registry fronts (tests/_support/registry_front.py) before any model loads, and ``gpu_e2e``'s collection.

The plan of a checkpoint's whole claims table is made from its config alone: the claims that run and those that
skip, the cells and weight builds of every claim at the seeds (float-order replicates included), the long-context
cells at their lengths; it is printed before the model loads, and a table that does not fit this machine is
refused with the plan's remedy. ``pytest -m gpu_e2e --collect-only`` lists one test per registry claim per model,
each model's in a row (its front is built once), and skips them without CUDA with the reason.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rope_quant.claims import registry
from rope_quant.experiment import memory_check
from rope_quant.pytest_plugin import RQOptions
from tests._support.registry_front import open_front

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m"  # embedded: its config is read without its weights


def _budget(seeds: tuple[int, ...] = (0, 1, 2)) -> Any:
    """The fields of the e2e suite's E2EBudget the front reads (its CPU defaults)."""
    return SimpleNamespace(seeds=seeds, replicates=len(seeds), seqlen=512, calib_windows=16, eval_windows=12,
                           support_windows=3, long_windows=1, gptq_float64=False)


class Loaded(Exception):
    """Raised in place of loading the model: the plan has been made by then."""


def _front(monkeypatch: pytest.MonkeyPatch, lines: list[str]) -> Any:
    from rope_quant.model import loading

    def refuse(*_: Any, **__: Any) -> Any:
        lines.append("load")
        raise Loaded

    monkeypatch.setattr(loading, "load_model", refuse)
    return open_front(MODEL, "cpu", _budget(), corpus="pydoc", experiment_cls=None, cache="unused",
                      rq_options=RQOptions(), protocol="e2e CPU budget", log=lines.append)


def test_the_plan_of_the_whole_table_is_printed_before_the_model_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every claim runs on SmolLM2 (head_dim 64, R1 folds); the builds are seeds × bit settings (App. F's three) ×
    float order; C7's cells are planned at their lengths, one window each."""
    lines: list[str] = []
    with pytest.raises(Loaded):
        _front(monkeypatch, lines)
    assert len(lines) == 2 and lines[1] == "load", lines
    text = lines[0]
    assert f"registry claims plan: {MODEL} on cpu, protocol e2e CPU budget (16 x 512 calibration tokens" in text
    assert "claims that run: " + ", ".join(c.id for c in registry.claims()) in text and "skipped" not in text
    assert "over 18 weight builds (seed x bits x float order)" in text, text
    for length in (1024, 4096, 8192):
        row = next(line for line in text.splitlines() if line.startswith(f"| long context L={length} |"))
        assert row.endswith("| 12 |"), row  # 2 cells x 3 seeds x 2 float orders, one window each
    assert "| GPTQ |" in text and "total: " in text


def test_a_table_that_does_not_fit_is_refused_with_the_remedy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(memory_check.ENV_HOST, "0.01")  # 10 MiB of host RAM
    lines: list[str] = []
    with pytest.raises(pytest.fail.Exception, match=rf"{MODEL} on cpu: the plan of the claims table does not fit "
                                                    r"this machine: stage '.*' needs .* GiB of host RAM, 0.0 GiB "
                                                    r"available: use a smaller --calib-windows"):
        _front(monkeypatch, lines)
    assert lines == []  # neither a plan printed as fitting nor a model loaded


def test_gpu_e2e_collects_one_test_per_registry_claim_per_model() -> None:
    """``pytest -m gpu_e2e`` over two models: each claim once per model, a model's claims in a row (collected, or
    run and each skipped without CUDA with the reason: one pytest process either way)."""
    import torch

    cuda = torch.cuda.is_available()
    argv = [sys.executable, "-m", "pytest", "-m", "gpu_e2e", "tests/e2e/test_gpu_claims.py", "-p", "no:cacheprovider",
            "--rq-model", "/ckpt/a", "--rq-model", "/ckpt/b", *(["--collect-only", "-q"] if cuda else ["-v", "-rs"])]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    ids = [line.split("[", 1)[1].split("]", 1)[0] for line in out.stdout.splitlines()
           if line.startswith("tests/e2e/test_gpu_claims.py::test_gpu_registry_claim[")]
    assert ids == [f"{m}-{c.id}" for m in ("a", "b") for c in registry.claims()], out.stdout + out.stderr
    if not cuda:  # on a CUDA machine the run itself is the gpu_e2e layer's
        assert out.returncode == 0 and f"SKIPPED [{len(ids)}]" in out.stdout, out.stdout + out.stderr
        assert "gpu_e2e: CUDA is not available on this machine" in out.stdout

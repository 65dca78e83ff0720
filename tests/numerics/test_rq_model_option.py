"""``--rq-model`` in this suite: a bad model is one usage error before anything is collected (the repository's
conftest.py), and a session naming other models only runs nothing on the default model (tests/e2e/conftest.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rope_quant.defaults import DEFAULT_MODEL

pytestmark = pytest.mark.numerics

ROOT = Path(__file__).resolve().parents[2]


def _collect(*flags: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "pytest", "tests/e2e", "-m", "e2e", "--collect-only", "-q", "-p", "no:cacheprovider",
            *flags]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)


def _ids(out: subprocess.CompletedProcess) -> list[str]:
    return [line for line in out.stdout.splitlines() if line.startswith("tests/e2e/")]


def test_a_bad_rq_model_is_one_usage_error_before_anything_is_collected(tmp_path: Path) -> None:
    """A missing path and an architecture the adapter does not know (GPT-2): exit 4, one error naming both,
    nothing collected (no test of the default model runs first)."""
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=300).save_pretrained(tmp_path / "gpt2")
    out = _collect(f"--rq-model={tmp_path / 'missing'}", f"--rq-model={tmp_path / 'gpt2'}")
    errors = [line for line in out.stderr.splitlines() if line.startswith("ERROR")]
    assert out.returncode == pytest.ExitCode.USAGE_ERROR and len(errors) == 1, out.stdout + out.stderr
    assert errors[0].startswith("ERROR: --rq-model: ") and f"{tmp_path / 'missing'}" in errors[0]
    assert "model type 'gpt2' is not supported" in errors[0]
    assert _ids(out) == [] and "collected" not in out.stdout


def test_naming_another_model_runs_nothing_on_the_default_model(tmp_path: Path) -> None:
    """``--rq-model`` a tiny Llama: its registry claims are collected and no e2e test of the default model (the
    statements of test_claims.py and the others that use its experiment) is; naming the default model as well
    brings them back."""
    from tests._support.models import tiny_llama

    tiny_llama().config.save_pretrained(tmp_path / "tiny")
    other = _collect(f"--rq-model={tmp_path / 'tiny'}")
    ids = _ids(other)
    assert other.returncode == 0, other.stdout + other.stderr
    registry_ids = [i for i in ids if i.startswith("tests/e2e/test_registry_claims.py::")]
    assert registry_ids and all("[tiny-" in i for i in registry_ids)
    assert not [i for i in ids if DEFAULT_MODEL in i or i.startswith("tests/e2e/test_claims.py::")], ids
    assert f"deselected (add --rq-model={DEFAULT_MODEL} to run them)" in other.stdout
    both = _collect(f"--rq-model={tmp_path / 'tiny'}", f"--rq-model={DEFAULT_MODEL}")
    named = _ids(both)
    assert any(i.startswith("tests/e2e/test_claims.py::") for i in named)
    assert any(f"[{DEFAULT_MODEL}-" in i for i in named) and set(ids) < set(named)

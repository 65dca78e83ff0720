"""rope_quant.runtime.llamacpp without llama.cpp: its names, the rotation switch, and every refusal that comes
before a model loads (a missing llama-cpp-python, a head dimension the runtime rotation skips, bad windows)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rope_quant.runtime import llamacpp as lc


def tiny_gguf(path: Path, head_dim: int = 96, heads: int = 2, vocab: int = 10) -> Path:
    """A llama GGUF header with the fields scoring reads (one small tensor; no model to run)."""
    import gguf

    w = gguf.GGUFWriter(path, "llama")
    w.add_embedding_length(head_dim * heads)
    w.add_head_count(heads)
    w.add_key_length(head_dim)
    w.add_token_list([f"t{i}" for i in range(vocab)])
    w.add_tensor("token_embd.weight", np.zeros((vocab, head_dim * heads), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_k_cache_types_are_llamas_ggml_ids() -> None:
    """type_k takes ggml's type ids (llama-cpp-python 0.3.36: f16 1, q4_0 2, q4_1 3, q8_0 8, iq4_nl 20)."""
    assert {t.value: t.ggml_type for t in lc.KCacheType} == {"f16": 1, "q8_0": 8, "q4_0": 2, "q4_1": 3, "iq4_nl": 20}
    assert [t.quantised for t in lc.KCacheType] == [False, True, True, True, True]


@pytest.mark.parametrize("before", [None, "0", "1"])
def test_rotation_env_set_inside_and_restored(monkeypatch, before: str | None) -> None:
    if before is None:
        monkeypatch.delenv(lc.ROTATION_ENV, raising=False)
    else:
        monkeypatch.setenv(lc.ROTATION_ENV, before)
    with lc.rotation_env(False):
        assert os.environ[lc.ROTATION_ENV] == "1"
    assert os.environ.get(lc.ROTATION_ENV) == before
    with pytest.raises(RuntimeError), lc.rotation_env(True):
        assert lc.ROTATION_ENV not in os.environ
        raise RuntimeError("context creation failed")
    assert os.environ.get(lc.ROTATION_ENV) == before


def test_missing_llama_cpp_names_the_extra_and_build_flags(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    with pytest.raises(lc.LlamaCppMissingError) as info:
        lc.require()
    msg = str(info.value)
    assert "rope-quant[llamacpp]" in msg and "-DGGML_NATIVE=OFF" in msg and "-DGGML_AMX_TILE=OFF" in msg
    assert "Illegal instruction" in msg


def test_geometry_from_the_header(tmp_path: Path) -> None:
    geo = lc.gguf_geometry(tiny_gguf(tmp_path / "m.gguf", head_dim=96, vocab=10))
    assert (geo.architecture, geo.head_dim_k, geo.n_vocab) == ("llama", 96, 10)
    with pytest.raises(lc.LlamaCppError, match="does not exist"):
        lc.gguf_geometry(tmp_path / "missing.gguf")


@pytest.mark.parametrize("k_type", ["q4_0", "q8_0", "q4_1", "iq4_nl"])
def test_rotation_on_a_head_dim_it_skips_refused_before_loading(tmp_path: Path, monkeypatch, k_type: str) -> None:
    path = tiny_gguf(tmp_path / "m.gguf", head_dim=96)
    monkeypatch.setattr(lc, "require", lambda: pytest.fail("llama.cpp was reached"))
    with pytest.raises(lc.RotationSkippedError, match="head_dim 96 is not a multiple of 64.*rotation=off"):
        lc.score_windows(path, [[1, 2, 3]], k_type, rotation=True)
    lc.check_rotation(96, lc.KCacheType(k_type), rotation=False)  # off: nothing to skip
    lc.check_rotation(96, lc.KCacheType.F16, rotation=True)  # f16 K: the runtime rotates nothing anyway
    lc.check_rotation(128, lc.KCacheType(k_type), rotation=True)


@pytest.mark.parametrize(("windows", "words"), [
    ([], "no window"),
    ([[1]], "at least 2 token ids"),
    ([[1, 2], [3, 10]], "window 1: token ids must lie in [0, 10)"),
    ([[0.5, 1.0]], "must be integers"),
])
def test_bad_windows_refused_before_loading(tmp_path: Path, monkeypatch, windows, words: str) -> None:
    path = tiny_gguf(tmp_path / "m.gguf", head_dim=64)
    monkeypatch.setattr(lc, "require", lambda: pytest.fail("llama.cpp was reached"))
    with pytest.raises(lc.LlamaCppError) as info:
        lc.score_windows(path, windows, "q4_0")
    assert words in str(info.value)


def test_bad_k_type_and_threads(tmp_path: Path) -> None:
    path = tiny_gguf(tmp_path / "m.gguf", head_dim=64)
    with pytest.raises(lc.LlamaCppError, match="'q3_k' is not one of f16, q8_0, q4_0, q4_1, iq4_nl"):
        lc.score_windows(path, [[1, 2]], "q3_k")
    with pytest.raises(lc.LlamaCppError, match="n_threads"):
        lc.score_windows(path, [[1, 2]], "f16", n_threads=0)


def test_nll_sum_is_cross_entropy() -> None:
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((70, 300)) * 5).astype(np.float32)
    targets = rng.integers(0, 300, 70)
    want = torch.nn.functional.cross_entropy(torch.from_numpy(logits).double(), torch.from_numpy(targets),
                                             reduction="sum").item()
    assert lc._nll_sum(logits, targets) == pytest.approx(want, rel=1e-12)


def test_window_scores_aggregate() -> None:
    s = lc.WindowScores((10.0, 30.0), (4, 6))
    assert s.nll == pytest.approx(4.0) and s.ppl == pytest.approx(np.exp(4.0)) and s.window_nll == (2.5, 5.0)

"""llama.cpp runs our GGUF exports: its logits of the unrotated export equal transformers', the folded export's
equal the unrotated one's (R1, R2 and a RoPE-commuting R3 fold exactly), its scores on our evaluator's windows
equal our perplexity, and its K rotation switch acts where it should. Skipped only without llama-cpp-python.

Tolerances (max |Δlogit|) are stated per test with the values measured on the 2-core Intel Xeon (docs/llamacpp.md):
llama.cpp keeps K and V in its f16 cache and accumulates in its own order, so logits agree to about 1e-2, not
to float32 rounding.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from rope_quant.experiment.config import RunConfig
from rope_quant.runtime import llamacpp as lc
from tests.numerics.test_export_gguf import FOLDED, TEXT, UNROTATED, export_gguf

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                reason=f"llama-cpp-python is not installed: {lc.INSTALL_LINE}")

#: max |llama.cpp logit - transformers logit| on TEXT, SmolLM2 f32 export, f16 K/V cache (logits up to 31.4 in
#: size): measured 2.46e-2.
TOL_HF = 0.05
#: max |folded - unrotated| llama.cpp logits, f32 files, f16 K/V cache: measured 4.24e-2 (R1 moves every activation,
#: so the f16 cache rounds other numbers).
TOL_FOLD = 0.1
#: per-window mean NLL (nats), llama.cpp against rope_quant's evaluator on the same 2 windows of 128: measured
#: 2.2e-4 (ppl 17.9510 against 17.9518).
TOL_NLL = 2e-3


@pytest.fixture(scope="module")
def smol_exports(embedded_model, tmp_path_factory):
    """(unrotated GGUF, folded GGUF) of SmolLM2 at f32, written once for the module."""
    root = tmp_path_factory.mktemp("gguf")
    plain, _ = export_gguf(RunConfig.from_flat(**UNROTATED), embedded_model, root / "plain")
    folded, qm = export_gguf(RunConfig.from_flat(**FOLDED), embedded_model, root / "folded")
    assert float(abs(qm.angles).max()) > 0.05  # the fitted angles are not a near-identity R3
    del qm
    return plain / "model.gguf", folded / "model.gguf"


def llama_logits(path: Path, ids: list[int], k_type: str = "f16", rotation: bool = True) -> np.ndarray:
    llm = lc.open_model(path, len(ids), lc.KCacheType(k_type), rotation, 2)
    try:
        return lc.window_logits(llm, ids)
    finally:
        llm.close()


def text_ids(tokenizer) -> list[int]:
    return tokenizer(TEXT, add_special_tokens=False)["input_ids"]


def test_smollm2_unrotated_export_logits_match_transformers(embedded_model, smol_exports) -> None:
    ids = text_ids(embedded_model[1])
    with torch.no_grad():
        ref = embedded_model[0](input_ids=torch.tensor([ids])).logits[0].numpy()
    got = llama_logits(smol_exports[0], ids)
    diff = float(np.abs(got - ref).max())
    print(f"smollm2 llama.cpp vs transformers: max |dlogit| {diff:.3e} (logits up to {np.abs(ref).max():.1f})")
    assert diff < TOL_HF
    assert (got.argmax(1) == ref.argmax(1)).mean() > 0.95


def test_smollm2_folded_export_equals_unrotated_in_llamacpp(embedded_model, smol_exports) -> None:
    """R1 and R2 (random Hadamard) and pairwise_only (fitted φ̂) folded: the same function in llama.cpp at f16 K.
    (At a quantised K the two differ by design: the rounding of K is what R1 and R3 change.)"""
    ids = text_ids(embedded_model[1])
    plain, folded = (llama_logits(p, ids) for p in smol_exports)
    diff = float(np.abs(folded - plain).max())
    print(f"smollm2 llama.cpp folded vs unrotated: max |dlogit| {diff:.3e}")
    assert diff < TOL_FOLD
    assert (folded.argmax(1) == plain.argmax(1)).mean() > 0.95


def test_scores_on_our_windows_equal_our_perplexity(embedded_model, smol_exports) -> None:
    from rope_quant.corpora import token_streams
    from rope_quant.scoring import evaluate

    corpus = token_streams.load_corpus("pydoc", embedded_model[1])
    windows = evaluate.eval_windows(corpus.eval_ids, 128, 2)
    ours = evaluate.perplexity(embedded_model[0], corpus.eval_ids, 128, 2, progress=False)
    got = lc.score_windows(smol_exports[0], windows, "f16", rotation=True, n_threads=2)
    assert got.n_tokens == (127, 127)
    gaps = np.abs(np.array(got.window_nll) - np.array(ours.window_nll))
    print(f"smollm2 window NLL llama.cpp vs evaluator: max gap {gaps.max():.2e} nats (ppl {got.ppl:.4f} vs "
          f"{ours.ppl:.4f})")
    assert gaps.max() < TOL_NLL


def test_rotation_switch_acts_at_quantised_k_only(embedded_model, smol_exports, monkeypatch) -> None:
    """At q4_0 K the rotation changes the logits (the environment variable reaches the context); at f16 K it
    changes nothing (llama.cpp rotates only a quantised cache); the environment is restored after."""
    monkeypatch.setenv(lc.ROTATION_ENV, "0")
    ids = text_ids(embedded_model[1])
    on, off = (llama_logits(smol_exports[0], ids, "q4_0", r) for r in (True, False))
    assert float(np.abs(on - off).max()) > 1e-2
    f_on, f_off = (llama_logits(smol_exports[0], ids, "f16", r) for r in (True, False))
    assert np.array_equal(f_on, f_off)
    assert lc.os.environ[lc.ROTATION_ENV] == "0"


# ----------------------------------------------------------------------------- Gemma 3 (slow: its load and export)

GEMMA_UNROTATED = {**UNROTATED, "model": "gemma3-270m"}
#: Gemma 3 (logits up to 32.7, an f16 cache of 256-wide heads): measured 5.43e-2 against transformers and 4.98e-2
#: folded against unrotated.
TOL_HF_GEMMA = 0.1
#: R2 folded, and the pre-RoPE channel scales fitted on the K sample, folded into q_norm/k_norm (R1 is refused on
#: Gemma 3 and a pair rotation is refused by its q/k norms, docs/export.md).
GEMMA_FOLDED = {**UNROTATED, "model": "gemma3-270m", "r2": "random_hadamard", "r3": "prerope_channel_scale"}


@pytest.mark.slow
def test_gemma3_exports_in_llamacpp(tmp_path: Path) -> None:
    from rope_quant.model.loading import load_model

    base = load_model("gemma3-270m", device="cpu")
    plain, _ = export_gguf(RunConfig.from_flat(**GEMMA_UNROTATED), base, tmp_path / "plain")
    folded, qm = export_gguf(RunConfig.from_flat(**GEMMA_FOLDED), base, tmp_path / "folded")
    del qm
    ids = text_ids(base[1])
    with torch.no_grad():
        ref = base[0](input_ids=torch.tensor([ids])).logits[0].numpy()
    got = llama_logits(plain / "model.gguf", ids)
    got_folded = llama_logits(folded / "model.gguf", ids)
    diff, diff_fold = float(np.abs(got - ref).max()), float(np.abs(got_folded - got).max())
    print(f"gemma3 llama.cpp vs transformers: max |dlogit| {diff:.3e} (logits up to {np.abs(ref).max():.1f}); "
          f"folded vs unrotated {diff_fold:.3e}")
    assert diff < TOL_HF_GEMMA and diff_fold < TOL_FOLD

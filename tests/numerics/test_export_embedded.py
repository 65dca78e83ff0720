"""Export on the embedded models: the hf export (fp32, pairwise_only with φ̂ angles folded) loads without
rope_quant and matches rope_quant's rotated model and the original model; Gemma 3 (R1 refused, q/k norms before
RoPE) gets the layout error, or folds an identity R3."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pytest
import torch

from rope_quant.experiment.config import RunConfig
from rope_quant.experiment.pipeline import build_quantized_model
from rope_quant.export import build as ebuild
from rope_quant.export import fold, hf, outdir
from tests.numerics.export_isolated import hf_logits
from tests.numerics.test_export_hf import REL, rel

# measured 2026-11-25 (busy 2-core machine): SmolLM2 99 s + 80 s load; Gemma 3 41 s + 17 s; peak RSS 6.0 GB
pytestmark = pytest.mark.slow

SMALL = dict(corpus="pydoc", seed=0, r2="random_hadamard", r4=False, r3="pairwise_only", weights="none",
             a_bits=16, k_bits=16, v_bits=16, seqlen=128, calib_windows=2, eval_windows=1)


def ids_of(tokenizer) -> torch.Tensor:
    text = "The quick brown fox jumps over the lazy dog. Rotations fold into the weights."
    return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])


def export_hf(cfg: RunConfig, base, out: Path) -> Path:
    with outdir.staged(out, overwrite=False) as tmp:
        em = ebuild.build_export_model(cfg, None, base=(copy.deepcopy(base[0]), base[1]))
        hf.write_hf(em, tmp, torch.float32, weights="unquantised", source={"test": True})
    return out


def test_smollm2_hf_fp32_whip_r1_pairwise_phi_hat(embedded_model, tmp_path: Path) -> None:
    t0 = time.perf_counter()
    cfg = RunConfig.from_flat(model="smollm2-135m", r1="whip", **SMALL)
    qm = build_quantized_model(cfg, base=(copy.deepcopy(embedded_model[0]), embedded_model[1]))
    assert float(abs(qm.angles).max()) > 0.05
    ids = ids_of(embedded_model[1])
    with torch.no_grad():
        rotated = qm.model(input_ids=ids).logits
        original = embedded_model[0](input_ids=ids).logits
    del qm
    out = export_hf(cfg, embedded_model, tmp_path / "smol")
    logits, info = hf_logits(out, ids, tmp_path)
    assert info["class"] == "LlamaForCausalLM"
    assert rel(logits, rotated) < REL, rel(logits, rotated)
    assert rel(logits, original) < REL, rel(logits, original)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    print(f"smollm2 hf export proof: {time.perf_counter() - t0:.1f}s, rel vs rotated {rel(logits, rotated):.2e}, "
          f"vs original {rel(logits, original):.2e}")


@pytest.fixture(scope="module")
def gemma():
    from rope_quant.model.loading import load_model

    return load_model("gemma3-270m", device="cpu")


def test_gemma3_pairwise_refused_by_its_qk_norms(gemma) -> None:
    """Gemma 3's per-head q/k norms sit between W_Q/W_K and RoPE with scales that differ inside RoPE pairs:
    a pairwise R3 cannot fold there (specific error naming the norm), before any weight changes."""
    from rope_quant.core import transforms
    from rope_quant.model import arch

    model = copy.deepcopy(gemma[0])
    d = arch.dims(model)
    ts = [transforms.build("pairwise_only", d.head_dim, angles=torch.full((d.head_dim // 2,), 0.2))
          for _ in range(d.n_layers)]
    before = arch.attention(model, 0).q.weight.detach().clone()
    with pytest.raises(fold.LayoutError) as info:
        fold.fold_r3(model, ts)
    assert "layers.0 q_norm" in str(info.value) and "RoPE pair" in str(info.value)
    assert torch.equal(arch.attention(model, 0).q.weight, before)


def test_gemma3_hf_fp32_kv_only_cell_identity_r3(gemma, tmp_path: Path) -> None:
    """The KV-only Gemma 3 cell (R1 refused: identity; R2 folded; an identity R3) exports and matches."""
    cfg = RunConfig.from_flat(model="gemma3-270m", r1="identity", **{**SMALL, "r3": "identity"})
    qm = build_quantized_model(cfg, base=(copy.deepcopy(gemma[0]), gemma[1]))
    ids = ids_of(gemma[1])
    with torch.no_grad():
        rotated = qm.model(input_ids=ids).logits
        original = gemma[0](input_ids=ids).logits
    del qm
    out = export_hf(cfg, gemma, tmp_path / "gemma")
    logits, info = hf_logits(out, ids, tmp_path)
    assert info["class"] == "Gemma3ForCausalLM"
    assert rel(logits, rotated) < REL, rel(logits, rotated)
    assert rel(logits, original) < REL, rel(logits, original)

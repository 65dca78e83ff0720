"""Export ``--format hf``: the folded checkpoint loads without rope_quant and computes the cell's function."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from rope_quant.experiment.config import RunConfig
from rope_quant.experiment.pipeline import build_quantized_model, remove_activation_quantizers
from rope_quant.export import build as ebuild
from rope_quant.export import fold, hf, outdir
from rope_quant.quant.quantizers import QuantConfig
from rope_quant.rotations import attention
from tests import _support as support
from tests._support import ByteTokenizer
from tests.numerics.export_isolated import hf_logits

REL = 1e-4


def tiny_llama(seed: int = 0, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
               intermediate: int = 128) -> LlamaForCausalLM:
    model = support.tiny_llama(256, seed=seed, hidden=heads * head_dim, heads=heads, kv_heads=kv_heads,
                               intermediate=intermediate, max_positions=256, tied=True, rms_norm_eps=1e-6)
    return support.randomise_norms(model, 0.5, 1.5)  # non-trivial norm scales, so fusing them is visible


def cell(**over) -> RunConfig:
    flat = dict(model="tiny", corpus="pydoc", seed=0, r1="random_hadamard", r2="random_hadamard", r4=False,
                r3="pairwise_only", weights="none", a_bits=16, k_bits=16, v_bits=16, seqlen=32, calib_windows=2,
                eval_windows=1)
    flat.update(over)
    return RunConfig.from_flat(**flat)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def weights_only(qm) -> torch.nn.Module:
    """The cell's model with activation and K/V quantisers off (R3 still applied online by rope_quant)."""
    remove_activation_quantizers(qm.model, qm.act_handles)
    for st in attention.attention_states(qm.model):
        st.k = st.v = QuantConfig()
    return qm.model


@pytest.fixture(scope="module")
def base():
    return tiny_llama(), ByteTokenizer()


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))


def export(cfg: RunConfig, base, out: Path, weights=ebuild.WeightSource.UNQUANTISED, dtype=torch.float32) -> Path:
    with outdir.staged(out, overwrite=False) as tmp:
        em = ebuild.build_export_model(cfg, None, base=(copy.deepcopy(base[0]), base[1]), weights=weights)
        hf.write_hf(em, tmp, dtype, weights=weights.value, source={"test": True})
    return out


def test_hf_fp32_pairwise_matches_rotated_and_original(base, ids, tmp_path: Path) -> None:
    cfg = cell()
    qm = build_quantized_model(cfg, base=(copy.deepcopy(base[0]), base[1]))
    assert float(abs(qm.angles).max()) > 0.05  # φ̂ angles are not trivially zero
    with torch.no_grad():
        rotated = qm.model(input_ids=ids).logits
        original = base[0](input_ids=ids).logits
    out = export(cfg, base, tmp_path / "hf")
    logits, info = hf_logits(out, ids, tmp_path)
    assert info["class"] == "LlamaForCausalLM"
    assert rel(logits, rotated) < REL, rel(logits, rotated)
    assert rel(logits, original) < REL, rel(logits, original)
    # the config describes what is saved: R1 untied the embeddings and fused the norms
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    from safetensors.torch import load_file

    state = load_file(out / "model.safetensors")
    norms = [k for k in state if k.endswith("norm.weight")]
    assert norms and all(torch.all(state[k] == 1) for k in norms)
    assert not torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    info_file = json.loads((out / hf.EXPORT_INFO).read_text())
    assert info_file["folded"]["r3"] == "pairwise_only" and info_file["online"] == []


def test_hf_fold_is_not_vacuous(base, ids) -> None:
    """Control: without the R3 fold the rotated weights give other logits than rope_quant's R3 model."""
    cfg = cell()
    qm = build_quantized_model(cfg, base=(copy.deepcopy(base[0]), base[1]))
    q_ref = qm.model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    em = ebuild.build_export_model(cfg, None, base=(copy.deepcopy(base[0]), base[1]))
    folded = em.model.model.layers[0].self_attn.q_proj.weight.detach()
    assert rel(folded, q_ref) > 1e-2  # the fold changed W_Q
    with torch.no_grad():  # and undoing it on K only breaks the function (q·k no longer preserved)
        k = em.model.model.layers[0].self_attn.k_proj
        k.weight.copy_(qm.model.model.layers[0].self_attn.k_proj.weight)
        attention.uninstall_attention(qm.model)
        assert rel(em.model(input_ids=ids).logits, qm.model(input_ids=ids).logits) > 1e-3


def test_hf_dequantised_matches_weights_only_cell(base, ids, tmp_path: Path) -> None:
    cfg = cell(weights="rtn", a_bits=4, k_bits=4, v_bits=4)
    qm = build_quantized_model(cfg, base=(copy.deepcopy(base[0]), base[1]))
    with torch.no_grad():
        ref = weights_only(qm)(input_ids=ids).logits
    out = export(cfg, base, tmp_path / "hfq", weights=ebuild.WeightSource.DEQUANTISED)
    logits, _ = hf_logits(out, ids, tmp_path)
    assert rel(logits, ref) < REL, rel(logits, ref)
    notes = json.loads((out / hf.EXPORT_INFO).read_text())["notes"]
    assert any("a=4-bit" in n and "k=4-bit" in n for n in notes)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_hf_half_dtypes_saved_as_asked(base, tmp_path: Path, dtype) -> None:
    out = export(cell(), base, tmp_path / "h", dtype=dtype)
    from safetensors.torch import load_file

    state = load_file(out / "model.safetensors")
    assert {v.dtype for v in state.values()} == {dtype}
    assert json.loads((out / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")


@pytest.mark.parametrize(("over", "words"), [
    ({"r4": True}, ["R4", "down_proj", "compressed-tensors"]),
    ({"r3": "hadamard"}, ["R3 'hadamard'", "does not commute", "compressed-tensors"]),
    ({"r3": "pairwise_plus_hadamard"}, ["Hadamard half", "compressed-tensors"]),
])
def test_hf_refuses_online_parts(over, words) -> None:
    with pytest.raises(fold.OnlinePartError) as info:
        hf.check_hf(cell(**over), 16)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_fold_refuses_pair_mixing_qk_norm() -> None:
    """A per-head q/k norm with unequal scales inside a RoPE pair cannot let R3 through: a specific error."""
    import transformers

    from rope_quant.core import transforms

    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                        layer_types=["sliding_attention", "full_attention"], sliding_window=32)
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    angles = torch.full((8,), 0.3)
    ts = [transforms.build("pairwise_only", 16, angles=angles) for _ in range(2)]
    before = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    with torch.no_grad():
        model.model.layers[1].self_attn.k_norm.weight[0] = 0.7  # channel 0 and its pair partner 8 now differ
    with pytest.raises(fold.LayoutError) as info:
        fold.fold_commuting_part(model, ts)
    assert "layer 1: k_norm" in str(info.value) and "compressed-tensors" in str(info.value)
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, before)  # nothing changed
    with torch.no_grad():
        model.model.layers[1].self_attn.k_norm.weight[8] = 0.7  # pair-uniform again: folds
    fold.fold_commuting_part(model, ts)
    assert not torch.equal(model.model.layers[0].self_attn.q_proj.weight, before)


def test_layout_refused_before_the_cell_is_built(monkeypatch) -> None:
    """build_export_model checks the q/k norms on the loaded model before any calibration or quantisation."""
    import transformers

    from rope_quant.experiment import pipeline

    torch.manual_seed(0)
    gcfg = transformers.Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                         layer_types=["sliding_attention", "full_attention"], sliding_window=32)
    model = transformers.Gemma3ForCausalLM(gcfg).eval()
    with torch.no_grad():
        model.model.layers[0].self_attn.q_norm.weight[3] = 0.5
    calls: list = []
    monkeypatch.setattr(pipeline, "build_quantized_model", lambda *a, **k: calls.append(1))
    with pytest.raises(fold.LayoutError) as info:
        ebuild.build_export_model(cell(r1="identity"), None, base=(model, ByteTokenizer()))
    assert "layer 0: q_norm" in str(info.value) and calls == []


def test_fold_of_a_scaled_r3_keeps_every_q_dot_k_head_by_head() -> None:
    """pairwise_scaled is not orthogonal: the queries must get M_q = M_k^{-T}, or q·k changes.

    Pre-RoPE check per (Q head, its KV head): the R3 commutes with RoPE, so preserving q·k before RoPE preserves
    it after. With ``matrix()`` on the queries (the orthogonal-only rule) this fails by the scales' spread."""
    import copy

    import numpy as np
    import torch

    from rope_quant.core import transforms
    from rope_quant.rotations.fold_r3 import fold_r3
    from tests._support.models import tiny_llama

    model = tiny_llama(attention_bias=True)
    d, n_heads, n_kv = 16, 4, 2
    rng = np.random.default_rng(0)
    tr = transforms.build("pairwise_scaled", d, angles=rng.uniform(-1, 1, d // 2),
                          scales=np.exp(rng.uniform(-1, 1, d // 2)))
    folded = copy.deepcopy(model)
    fold_r3(folded, [tr] * 2)
    x = torch.randn(5, 64, dtype=torch.float64)
    for before, after in zip(model.model.layers, folded.model.layers, strict=True):
        def qk(layer):
            a = layer.self_attn
            q = torch.nn.functional.linear(x, a.q_proj.weight.double(), a.q_proj.bias.double()).view(5, n_heads, d)
            k = torch.nn.functional.linear(x, a.k_proj.weight.double(), a.k_proj.bias.double()).view(5, n_kv, d)
            k = k.repeat_interleave(n_heads // n_kv, dim=1)
            return torch.einsum("thd,shd->hts", q, k)
        ref, got = qk(before), qk(after)
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
        a0, a1 = before.self_attn.k_proj.weight, after.self_attn.k_proj.weight
        assert not torch.allclose(a0, a1)  # the fold did change W_K

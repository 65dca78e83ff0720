"""The architecture adapter (rope_quant.model.arch): one registry, every registered family end to end.

Per registered family (llama, mistral, qwen2, qwen3) on a tiny random model built from transformers' own
config class: R1/R2/R4 preserve the logits, an R3 Hadamard preserves them at 16-bit KV, calibration sees
head_dim/2 pairs per layer, GPTQ runs. Gemma 3 (sandwich norms) is registered only so that R1 is refused;
a test folds R1 anyway to show the refusal is honest. A source scan keeps model attribute names inside
the adapter.

The module imports on every supported transformers (4.48+): a family whose classes are newer than the
installed transformers (Qwen3: 4.51; the adapter's Gemma 3 layout: 5.0) skips, naming the version it needs.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers
from packaging.version import Version
from transformers import GPT2Config, GPT2LMHeadModel

import rope_quant
from rope_quant.calib.stats import CalibrationStats
from rope_quant.core import transforms as T
from rope_quant.model import arch
from rope_quant.quant import gptq
from rope_quant.quant.rtn import GPTQConfig
from rope_quant.rotations import attention
from rope_quant.rotations import offline as rotation
from tests import _support as support

# transformers' model and config classes of every family: tox -e tf448-compat runs this module
pytestmark = pytest.mark.compat

REL_TOL = 1e-4  # max |Δlogit| / max |logit| for a function-preserving step in fp32 (as test_rotation.py)
VOCAB = 128
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=True)
TRANSFORMERS = Version(transformers.__version__)
# family: (config class, model class, first transformers release that has them); the classes are looked up by
# name so that the module still imports on the oldest supported transformers (4.48).
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", "4.48"),
    "mistral": ("MistralConfig", "MistralForCausalLM", "4.48"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "4.48"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "4.51"),
}


def _needs(minimum: str, what: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        TRANSFORMERS < Version(minimum),
        reason=f"{what} needs transformers>={minimum}; this is transformers {transformers.__version__}",
    )


FAMILY_PARAMS = [pytest.param(f, marks=_needs(v, f"{cfg} ({f})"), id=f) for f, (cfg, _, v) in FAMILIES.items()]
needs_qwen3 = _needs(FAMILIES["qwen3"][2], "Qwen3Config (qwen3)")
# Gemma 3 is in transformers from 4.50, but until 4.57 it keeps two rotary modules (rotary_emb, rotary_emb_local)
# and no config.layer_types-keyed RoPE; the adapter reads 5.0's layout: one rotary module holding a
# ``<layer_type>_inv_freq`` buffer per layer type, and ``config.rope_parameters``.
needs_gemma3 = _needs("5.0", "the gemma3_text adapter (one rotary module with per-layer-type inv_freq buffers)")


def _randomise(model: torch.nn.Module) -> torch.nn.Module:
    """Norm weights away from their init (so fusing them is not a no-op) and non-zero biases."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model


def tiny(family: str, seed: int = 0, **extra) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg_name, model_name, _ = FAMILIES[family]
    cfg_cls, model_cls = getattr(transformers, cfg_name), getattr(transformers, model_name)
    model = model_cls(cfg_cls(**{**TINY, **extra})).eval()
    model.config._attn_implementation = "sdpa"
    return _randomise(model)


def tiny_gemma3(seed: int = 0) -> torch.nn.Module:
    """Sliding and full layers with different RoPE bases; norm weights random (Gemma scales by 1 + w)."""
    model = support.tiny_gemma3(VOCAB, seed=seed, kv_heads=2, max_positions=128, tie_word_embeddings=True)
    model.config._attn_implementation = "sdpa"
    return support.randomise_norms(model, -0.5, 0.5)


def _ids(n: int = 2, length: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.double()


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).abs().max() / ref.abs().max()).item()


# ----------------------------------------------------------------------------- one module knows the names


_STRICT = re.compile(r"(?<!\barch)\.(self_attn|q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|rotary_emb"
                     r"|input_layernorm|post_attention_layernorm|pre_feedforward_layernorm"
                     r"|post_feedforward_layernorm|embed_tokens|lm_head|q_norm|k_norm)\b")
# Generic names: also model attributes unless read from the adapter or from an object's own state.
_GENERIC = re.compile(r"(?<!\barch)(?<!\bself)(?<!\bother)\.(mlp|layers|norm)\b(?!\()")


def test_no_model_attribute_names_outside_the_adapter():
    root = Path(rope_quant.__file__).parent
    adapter = root / "model" / "arch.py"
    offenders = []
    for path in sorted(root.rglob("*.py")):
        if path == adapter:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if _STRICT.search(code) or _GENERIC.search(code):
                offenders.append(f"{path.relative_to(root.parent)}:{n}: {line.strip()}")
    assert not offenders, "model attribute names outside rope_quant/model/arch.py:\n" + "\n".join(offenders)


def test_the_scan_catches_an_attribute_read():
    assert _STRICT.search("a = layer.self_attn.q_proj") and _GENERIC.search("for layer in base.layers:")
    assert not _STRICT.search("head = arch.lm_head(model)") and not _GENERIC.search("self.layers = {}")


# ----------------------------------------------------------------------------- registry


def test_registered_families():
    assert {"llama", "mistral", "qwen2", "qwen3", "gemma3_text"} <= set(arch.registered_types())
    for family in FAMILIES:
        spec = arch.spec_for(family)
        assert spec.model_type == family and spec.post_attn_norm is None and spec.post_mlp_norm is None
    assert arch.spec_for("qwen3").q_norm == "q_norm" and arch.spec_for("llama").q_norm is None


@pytest.mark.parametrize("model", [
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=64)),
    SimpleNamespace(config=SimpleNamespace(model_type="foo")),
], ids=["gpt2", "foo"])
def test_unregistered_model_type_names_the_registered_ones(model):
    mtype = model.config.model_type
    with pytest.raises(arch.UnsupportedModelTypeError) as info:
        arch.decoder_layers(model)
    msg = str(info.value)
    assert repr(mtype) in msg and "rope_quant/model/arch.py" in msg and "ARCHITECTURES" in msg
    for t in arch.registered_types():
        assert t in msg
    assert isinstance(info.value, ValueError)
    with pytest.raises(attention.UnsupportedAttentionError, match="llama, mistral"):
        attention.check_model(model)


# ----------------------------------------------------------------------------- per family


@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_adapter_reads_geometry_and_modules(family):
    model = tiny(family)
    d = arch.dims(model)
    assert (d.n_layers, d.hidden, d.n_heads, d.n_kv_heads, d.head_dim, d.intermediate) == (2, 64, 4, 2, 16, 96)
    a, m, n = arch.attention(model, 1), arch.mlp_parts(model, 1), arch.layer_norms(model, 1)
    assert (a.q.out_features, a.k.out_features, a.v.out_features, a.o.in_features) == (64, 32, 32, 64)
    assert (m.gate.out_features, m.down.in_features) == (96, 96) and n.post_attn is None
    assert (a.q_norm is not None) == (family == "qwen3") and a.layer_idx == 1
    assert arch.embeddings_tied(model) and arch.lm_head(model).out_features == VOCAB
    inv, source = arch.layer_inv_freq(model, 1)
    assert inv.shape == (8,) and source == "model.rotary_emb.inv_freq"
    grouped = {f"layers.0.{n}" for group in arch.layer_linear_groups(model) for n in group}
    assert grouped == {n for n, _ in arch.decoder_linears(model) if n.startswith("layers.0.")}
    for rot in arch.ROTATIONS:
        assert arch.rotation_refusal(model, rot) is None


@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_offline_rotations_preserve_logits(family):
    model = tiny(family)
    ids = _ids()
    ref = _logits(model, ids)
    result = rotation.rotate_model(model, rotation.RotationConfig(r1="hadamard", r2="hadamard", r4=True, seed=3))
    assert result.untied and result.r1 is not None and result.r2.shape == (2, 2, 16, 16)
    assert _rel(_logits(model, ids), ref) < REL_TOL


@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_r3_hadamard_preserves_logits_at_16_bit_kv(family):
    model = tiny(family)
    ids = _ids()
    ref = _logits(model, ids)
    geom = attention.check_model(model)
    assert (geom.n_layers, geom.n_q_heads, geom.n_kv_heads, geom.head_dim) == (2, 4, 2, 16)
    attention.install_attention(model, [T.build("hadamard", geom.head_dim) for _ in range(geom.n_layers)])
    assert model.config._attn_implementation == attention.ATTN_NAME
    assert _rel(_logits(model, ids), ref) < REL_TOL
    attention.uninstall_attention(model)


@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_calibration_sees_head_dim_over_two_pairs_per_layer(family):
    model = tiny(family)
    geom = attention.check_model(model)
    stats = CalibrationStats(geom.n_layers, geom.n_q_heads, geom.n_kv_heads, geom.head_dim, sample_rows=16)
    with attention.calibration_hooks(model, stats), torch.no_grad():
        model(_ids(2, 24))
    assert stats.n_pairs == geom.head_dim // 2 == 8
    assert stats.n_rows("q").tolist() == [48, 48] and stats.n_rows("k").tolist() == [48, 48]
    assert stats.pooled("rows").s11.shape == (2, 8)
    rows, positions = stats.k_sample(0)
    assert rows.shape == (16, 2, 16) and positions.max() < 24


@needs_qwen3
def test_qwen3_calibration_reads_the_keys_after_k_norm():
    """RoPE rotates k_norm's output, so the statistics must be of that, not of the raw k_proj output."""
    model = tiny("qwen3")
    ids = _ids(1, 20)
    stats = CalibrationStats(2, 4, 2, 16, topk=0)
    seen = {}
    attn = arch.attention(model, 0)
    handle = attn.k_norm.register_forward_hook(lambda m, a, o: seen.update(k=o.detach().reshape(-1, 2, 16)))
    with attention.calibration_hooks(model, stats), torch.no_grad():
        model(ids)
    handle.remove()
    a = seen["k"][..., :8].double().reshape(-1, 8)
    np.testing.assert_allclose(stats.pooled("k_only").s11[0], a.var(0, unbiased=False).numpy(), rtol=1e-6)


@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_gptq_runs(family):
    model = tiny(family)
    errors = gptq.quantize_model_gptq(model, _ids(2, 32), 4, GPTQConfig(), progress=False)
    assert set(errors) == set(gptq.linear_names(model)) and len(errors) == 2 * 7
    assert all(np.isfinite(e) and 0 <= e < 1 for e in errors.values())
    assert torch.isfinite(_logits(model, _ids())).all()


# ----------------------------------------------------------------------------- Gemma 3: R1 refused


@needs_gemma3
def test_gemma3_adapter_reads_sandwich_norms_and_per_layer_rope_bases():
    model = tiny_gemma3()
    n = arch.layer_norms(model, 0)
    assert n.post_attn is not None and n.post_mlp is not None and n.pre_mlp is not n.post_attn
    assert arch.attention(model, 0).q_norm is not None and arch.norm_weight_offset(model) == 1.0
    (sliding, s_src), (full, f_src) = arch.layer_inv_freq(model, 0), arch.layer_inv_freq(model, 1)
    assert s_src.endswith("sliding_attention_inv_freq") and f_src.endswith("full_attention_inv_freq")
    cfg = model.config.rope_parameters
    for inv, kind in ((sliding, "sliding_attention"), (full, "full_attention")):
        theta = cfg[kind]["rope_theta"]
        np.testing.assert_allclose(inv, 1.0 / theta ** (np.arange(0, 16, 2) / 16), rtol=1e-6)
    assert not np.allclose(sliding, full)
    with pytest.raises(Exception, match="different RoPE frequencies"):
        arch.shared_inv_freq(model)


@needs_gemma3
def test_gemma3_r1_is_refused_naming_the_norms_and_the_alternative():
    model = tiny_gemma3()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    reason = arch.rotation_refusal(model, "r1")
    assert "post_attention_layernorm" in reason and "post_feedforward_layernorm" in reason
    for r1 in ("hadamard", "whip", "given"):
        cfg = rotation.RotationConfig(r1=r1, r2="hadamard", r4=True)
        kwargs = {"r1_matrix": torch.eye(64, dtype=torch.float64)} if r1 == "given" else {}
        with pytest.raises(rotation.NotFunctionPreservingError) as info:
            rotation.rotate_model(model, cfg, calib_ids=_ids(), **kwargs)
        msg = str(info.value)
        assert "R1" in msg and "post_attention_layernorm" in msg and "post_feedforward_layernorm" in msg
        assert "r1='none'" in msg and "r2" in msg and "r4" in msg
    with pytest.raises(rotation.NotFunctionPreservingError):
        rotation.apply_r1(model, torch.eye(64, dtype=torch.float64))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # refused before any change
    assert arch.rotation_refusal(model, "r2") is None and arch.rotation_refusal(model, "r4") is None


@needs_gemma3
def test_gemma3_pipeline_refuses_r1_before_any_expensive_step():
    from rope_quant.experiment.pipeline import RunConfig, build_quantized_model

    cfg = RunConfig.from_flat(seqlen=32, calib_windows=2, eval_windows=1, r1="hadamard", w_bits=16, a_bits=16,
                              k_bits=16, v_bits=16, weights="none")
    with pytest.raises(rotation.NotFunctionPreservingError, match="post_feedforward_layernorm"):
        build_quantized_model(cfg, base=(tiny_gemma3(), None))  # no tokenizer: it must fail before the corpus


def _fold_r1_anyway(model) -> None:
    rotation.untie_embeddings(model)
    rotation.fuse_norms(model)
    rotation._fold_r1(model, rotation.r1_hadamard(64, seed=5))


@needs_gemma3
def test_gemma3_folding_r1_anyway_changes_the_logits():
    """The refusal is honest: with per-channel sandwich-norm weights, R1 changes the model; with uniform
    ones (Gemma's ``1 + w`` at ``w = 0``) the same folding preserves it, so the sandwich norms are the cause."""
    ids = _ids()
    model = tiny_gemma3()
    ref = _logits(model, ids)
    _fold_r1_anyway(model)
    assert _rel(_logits(model, ids), ref) > 1e-2

    uniform = tiny_gemma3()
    with torch.no_grad():
        for i in range(2):
            norms = arch.layer_norms(uniform, i)
            norms.post_attn.weight.zero_()
            norms.post_mlp.weight.zero_()
    ref = _logits(uniform, ids)
    _fold_r1_anyway(uniform)
    assert _rel(_logits(uniform, ids), ref) < REL_TOL


@needs_gemma3
def test_gemma3_r2_r4_and_norm_fusion_preserve_logits():
    """Without R1 the offline steps stay exact on Gemma 3 and leave its norms unfused (fusion is R1's step);
    norm fusion itself is exact too (it honours the ``1 + w`` scale)."""
    model = tiny_gemma3()
    ids = _ids()
    ref = _logits(model, ids)
    rotation.rotate_model(model, rotation.RotationConfig(r1="none", r2="hadamard", r4=True, seed=1))
    assert not rotation.norms_fused(model)
    assert _rel(_logits(model, ids), ref) < REL_TOL
    rotation.untie_embeddings(model)
    rotation.fuse_norms(model)
    assert rotation.norms_fused(model)
    assert _rel(_logits(model, ids), ref) < REL_TOL


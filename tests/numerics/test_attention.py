"""Online R3 and the K/V quantiser inside attention (rope_quant.rotations.attention)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from rope_quant.calib.stats import CalibrationStats
from rope_quant.core import rope
from rope_quant.core import transforms as T
from rope_quant.quant.quantizers import QuantConfig, QuantConfigError
from rope_quant.rotations import attention

# the attention-function registry and config plumbing differ across transformers: compat
pytestmark = pytest.mark.compat

VOCAB = 128


def tiny_llama(seed: int = 0, heads: int = 6, kv_heads: int = 2, head_dim: int = 16, layers: int = 2):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=heads * head_dim, intermediate_size=64,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


def _ids(n: int = 2, length: int = 40, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


def _transforms(name: str, n_layers: int, head_dim: int, **params):
    return [T.build(name, head_dim, **params) for _ in range(n_layers)]


# ----------------------------------------------------------------------------- invariance


def test_hadamard_on_q_and_k_keeps_embedded_logits_with_and_without_cache(embedded_model):
    """FACTS: the same Hadamard on q and k leaves the logits equal to about 5e-5 (fp32)."""
    base, tok = embedded_model
    model = copy.deepcopy(base)
    ids = tok("def fibonacci(n):\n    if n < 2:\n        return n\n", return_tensors="pt").input_ids
    with torch.no_grad():
        ref = base(ids).logits
        ref_gen = base.generate(ids, max_new_tokens=6, do_sample=False, use_cache=True)
        ref_step = _cached_steps(base, ids, 4)
    geom = attention.check_model(model)
    attention.install_attention(model, _transforms("hadamard", geom.n_layers, geom.head_dim))
    assert model.config._attn_implementation == attention.ATTN_NAME
    with torch.no_grad():
        out = model(ids).logits
        gen = model.generate(ids, max_new_tokens=6, do_sample=False, use_cache=True)
        step = _cached_steps(model, ids, 4)
    assert (out - ref).abs().max().item() < 2e-4
    assert torch.equal(gen, ref_gen)
    for a, b in zip(step, ref_step, strict=True):
        assert (a - b).abs().max().item() < 2e-4
    # Non-trivially exercised: a single-sided rotation (q only) does change the logits.
    q_only = [_QOnly(t) for t in _transforms("hadamard", geom.n_layers, geom.head_dim)]
    attention.install_attention(model, q_only)
    with torch.no_grad():
        assert (model(ids).logits - ref).abs().max().item() > 1e-2


class _QOnly:
    """Applies the transform to the query only (key tensors have fewer heads under GQA)."""

    def __init__(self, t, n_q: int = 9):
        self.t, self.n_q = t, n_q

    def apply(self, x):
        return self.t.apply(x) if x.shape[1] == self.n_q else x


def _cached_steps(model, ids: torch.Tensor, n: int) -> list[torch.Tensor]:
    """Prefill, then n greedy decode steps through the KV cache; the logits of every step."""
    from rope_quant.scoring.generate import cache_keyword

    kw = cache_keyword(model)
    out = model(ids, use_cache=True)
    past, logits = getattr(out, kw), [out.logits[:, -1]]
    for _ in range(n):
        nxt = logits[-1].argmax(-1, keepdim=True)
        out = model(nxt, use_cache=True, **{kw: past})
        past = getattr(out, kw)
        logits.append(out.logits[:, -1])
    return logits


@pytest.mark.parametrize("name,params", [
    ("hadamard", {}),
    ("pairwise_only", {"per_head": True}),
    ("pairwise_plus_hadamard", {"per_head": True}),
    ("pairwise_only", {}),
    ("pair_h2", {}),
    ("block_hadamard", {"block": 4}),
])
def test_gqa_logits_invariant_under_orthogonal_r3(name, params):
    """q heads use their KV group's matrix: per-head angles keep q.k exact under GQA (6 q / 2 kv heads)."""
    model = tiny_llama()
    ids = _ids()
    with torch.no_grad():
        ref = model(ids).logits
    rng = np.random.default_rng(0)
    kw = dict(params)
    if "per_head" in kw:
        kw.pop("per_head")
        kw["angles"] = rng.uniform(-np.pi, np.pi, size=(2, 8))
    elif T.needs_angles(name):
        kw["angles"] = rng.uniform(-np.pi, np.pi, size=8)
    attention.install_attention(model, _transforms(name, 2, 16, **kw))
    with torch.no_grad():
        out = model(ids).logits
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)


def test_wrong_gqa_mapping_would_be_detected():
    """Control for the test above: giving q heads other angles than their KV head changes the logits."""
    model = tiny_llama()
    ids = _ids()
    with torch.no_grad():
        ref = model(ids).logits
    ang = np.random.default_rng(0).uniform(-np.pi, np.pi, size=(2, 8))
    tk = T.build("pairwise_only", 16, angles=ang)
    tq = T.build("pairwise_only", 16, angles=ang[::-1].copy())

    class Split:
        def apply(self, x):
            return (tq if x.shape[1] == 6 else tk).apply(x)

    attention.install_attention(model, [Split(), Split()])
    with torch.no_grad():
        assert (model(ids).logits - ref).abs().max().item() > 1e-3


def test_padding_mask_is_honoured():
    """Left-padded batch: the custom function gets the same masks as SDPA."""
    model = tiny_llama()
    ids = _ids(2, 24)
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
    attention.install_attention(model, _transforms("hadamard", 2, 16))
    with torch.no_grad():
        out = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(out[0, 7:], ref[0, 7:], atol=2e-5, rtol=0)
    torch.testing.assert_close(out[1], ref[1], atol=2e-5, rtol=0)


# ----------------------------------------------------------------------------- what the function sees


class _Recorder:
    def __init__(self):
        self.seen: dict[int, list[torch.Tensor]] = {}

    def update(self, k, layer=None):
        self.seen.setdefault(layer, []).append(k.detach().clone())


def test_diagnostics_see_post_rope_post_r3_keys_before_quantisation():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = tiny_llama()
    ids = _ids(1, 20)
    ang = np.random.default_rng(2).uniform(-1, 1, size=8)
    tr = T.build("pairwise_plus_hadamard", 16, angles=ang)
    rec = _Recorder()
    attention.install_attention(model, [tr, tr], k=QuantConfig(bits=3), diagnostics=rec)
    captured = {}
    h0 = model.model.layers[0].self_attn.k_proj.register_forward_hook(lambda m, i, o: captured.update(k=o))
    h1 = model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, o: captured.update(q=o))
    with torch.no_grad():
        model(ids)
    h0.remove()
    h1.remove()
    k = captured["k"].view(1, 20, 2, 16).transpose(1, 2)
    q = captured["q"].view(1, 20, 6, 16).transpose(1, 2)
    cos, sin = model.model.rotary_emb(k, torch.arange(20)[None])
    _, k_rot = apply_rotary_pos_emb(q, k, cos, sin)
    expected = tr.apply(k_rot)
    assert sorted(rec.seen) == [0, 1]
    got = rec.seen[0][0]
    assert got.shape == (1, 2, 20, 16)  # before the GQA repeat
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert len(torch.unique(got[0, 0, 0])) > 2**3  # not yet quantised


def test_kv_quantiser_runs_after_r3():
    """With 4-bit keys, Hadamard and identity R3 differ; with 16-bit keys they agree (R3 is exact)."""
    ids = _ids()
    outs = {}
    for k_bits in (4, 16):
        for name in ("identity", "hadamard"):
            model = tiny_llama()
            attention.install_attention(model, _transforms(name, 2, 16), k=QuantConfig(bits=k_bits))
            with torch.no_grad():
                outs[(k_bits, name)] = model(ids).logits
    torch.testing.assert_close(outs[(16, "identity")], outs[(16, "hadamard")], atol=2e-5, rtol=0)
    assert (outs[(4, "identity")] - outs[(4, "hadamard")]).abs().max().item() > 1e-3
    assert (outs[(4, "identity")] - outs[(16, "identity")]).abs().max().item() > 1e-3


def test_v_quantiser_and_group_size_change_the_output():
    ids = _ids()
    outs = {}
    for v_bits, v_group in ((16, -1), (3, -1), (3, 4)):
        model = tiny_llama()
        attention.install_attention(model, None, v=QuantConfig(bits=v_bits, group_size=v_group))
        with torch.no_grad():
            outs[(v_bits, v_group)] = model(ids).logits
    assert (outs[(3, -1)] - outs[(16, -1)]).abs().max().item() > 1e-3
    # Smaller groups quantise more finely: closer to the unquantised output.
    e_head = (outs[(3, -1)] - outs[(16, -1)]).pow(2).mean()
    e_group = (outs[(3, 4)] - outs[(16, -1)]).pow(2).mean()
    assert e_group < e_head


def test_static_kv_control_is_used_instead_of_dynamic():
    model = tiny_llama()
    ids = _ids()
    calls = []

    def static(x):
        calls.append(tuple(x.shape))
        return x

    attention.install_attention(model, None, k=QuantConfig(bits=2), v=QuantConfig(bits=2), k_static=[static, static],
                                v_static=[static, static])
    with torch.no_grad():
        out = model(ids).logits
    attention.uninstall_attention(model)
    with torch.no_grad():
        ref = model(ids).logits
    torch.testing.assert_close(out, ref)  # the identity "static quantiser" replaced the 2-bit one
    assert len(calls) == 4 and calls[0] == (2, 2, 40, 16)


def test_uninstall_restores_sdpa_and_register_is_idempotent():
    model = tiny_llama()
    assert attention.register_attention() == attention.register_attention() == attention.ATTN_NAME
    attention.install_attention(model, None, k=QuantConfig(bits=4))
    assert model.config._attn_implementation == attention.ATTN_NAME
    assert len(attention.attention_states(model)) == 2
    attention.uninstall_attention(model)
    assert model.config._attn_implementation == "sdpa"
    assert attention.attention_states(model) == []


def test_state_stays_on_the_model_not_in_globals():
    a, b = tiny_llama(), tiny_llama()
    ids = _ids()
    attention.install_attention(a, None, k=QuantConfig(bits=2))
    attention.install_attention(b, None, k=QuantConfig(bits=16))
    with torch.no_grad():
        ref = tiny_llama()(ids).logits
        out_b = b(ids).logits
        out_a = a(ids).logits
    torch.testing.assert_close(out_b, ref)
    assert (out_a - ref).abs().max().item() > 1e-3
    c = copy.deepcopy(a)  # the state travels with a deep copy
    assert attention.attention_states(c)[0].k_bits == 2


# ----------------------------------------------------------------------------- calibration mode


def test_calibration_hooks_stream_pre_rope_qk_and_are_removed():
    model = tiny_llama()
    ids = _ids(2, 30)
    stats = CalibrationStats(2, 6, 2, 16)
    q_proj = model.model.layers[0].self_attn.q_proj
    before = len(q_proj._forward_hooks)
    with attention.calibration_hooks(model, stats):
        assert len(q_proj._forward_hooks) == before + 1
        with torch.no_grad():
            model(ids)
    assert len(q_proj._forward_hooks) == before
    assert stats.n_rows("q").tolist() == [60, 60] and stats.n_rows("k").tolist() == [60, 60]
    # Pre-RoPE: the pooled K covariance of layer 0 equals the one of the raw k_proj outputs.
    with torch.no_grad():
        h = model.model.embed_tokens(ids)
        x = model.model.layers[0].input_layernorm(h)
        k = model.model.layers[0].self_attn.k_proj(x).reshape(-1, 2, 16).double()
    a = k[..., :8].reshape(-1, 8)
    cov = stats.pooled("k_only")
    np.testing.assert_allclose(cov.s11[0], a.var(0, unbiased=False).numpy(), rtol=1e-6)


# ----------------------------------------------------------------------------- bad input


def test_gpt2_cannot_be_wrapped():
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=64))
    with pytest.raises(attention.UnsupportedAttentionError, match="gpt2"):
        attention.check_model(model)
    with pytest.raises(ValueError):
        attention.install_attention(model, None)


def test_odd_head_dim_is_rejected():
    """transformers 5.x refuses head_dim=63 in LlamaConfig, so give an existing model odd-width heads."""
    model = tiny_llama(heads=2, kv_heads=2, head_dim=16)
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.head_dim = 63
        attn.q_proj, attn.k_proj, attn.v_proj = (nn.Linear(32, 2 * 63, bias=False) for _ in range(3))
        attn.o_proj = nn.Linear(2 * 63, 32, bias=False)
    with pytest.raises(rope.OddHeadDimError, match="63"):
        attention.check_model(model)


def test_model_without_rope_buffer_is_rejected():
    model = tiny_llama()
    model.model.rotary_emb = nn.Module()  # no inv_freq anywhere
    with pytest.raises(rope.MissingInvFreqError):
        attention.check_model(model)


def test_missing_layer_idx_and_config_plumbing_are_rejected():
    model = tiny_llama()
    model.model.layers[1].self_attn.layer_idx = None
    with pytest.raises(attention.UnsupportedAttentionError, match="layer_idx"):
        attention.check_model(model)
    model = tiny_llama()
    fake = SimpleNamespace(model=model.model, config=SimpleNamespace(model_type="llama"))
    with pytest.raises(attention.UnsupportedAttentionError, match="_attn_implementation"):
        attention.check_model(fake)


def test_bad_install_arguments():
    model = tiny_llama()
    with pytest.raises(attention.AttentionWrapError, match="one per layer"):
        attention.install_attention(model, _transforms("identity", 1, 16))
    with pytest.raises(attention.AttentionWrapError, match="k must be a QuantConfig"):
        attention.install_attention(model, None, k=4)
    with pytest.raises(QuantConfigError, match="bits"):
        QuantConfig(bits=0)
    assert issubclass(attention.AttentionWrapError, ValueError)

"""find_inv_freq (App. A.5) on transformers rotary-embedding modules built from a config alone.

Configs are built so that they work on transformers 4.x (``rope_theta`` + ``rope_scaling``) and
5.x (``rope_parameters``); the rotary module is built as ``LlamaRotaryEmbedding(config=cfg)``
(never with ``device=``, which 5.x does not take).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import transformers
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from rope_quant.core.rope import (
    AmbiguousInvFreqError,
    MissingInvFreqError,
    check_frequencies,
    find_inv_freq,
    phase_averages,
)

# rotary modules built from HF configs (rope_theta / rope_scaling vs rope_parameters): compat
pytestmark = pytest.mark.compat

MAJOR = int(transformers.__version__.split(".")[0])
HEAD_DIM = 64
K = HEAD_DIM // 2

LLAMA3 = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
ROPE_TYPES = {
    "default": (10000.0, {}),
    "llama3": (500000.0, LLAMA3),
    "linear": (10000.0, dict(factor=4.0)),
    "dynamic": (10000.0, dict(factor=4.0)),
    "yarn": (10000.0, dict(factor=4.0, original_max_position_embeddings=2048)),
}


def make_config(
    rope_type: str, theta: float, params: dict, head_dim: int = HEAD_DIM, heads: int = 2
) -> LlamaConfig:
    base = dict(hidden_size=head_dim * heads, num_attention_heads=heads, num_key_value_heads=1,
                intermediate_size=64, num_hidden_layers=2, vocab_size=32, max_position_embeddings=131072)
    if MAJOR >= 5:
        return LlamaConfig(**base, rope_parameters={"rope_type": rope_type, "rope_theta": theta, **params})
    scaling = None if rope_type == "default" else {"rope_type": rope_type, **params}
    return LlamaConfig(**base, rope_theta=theta, rope_scaling=scaling)


def rotary(rope_type: str, head_dim: int = HEAD_DIM) -> LlamaRotaryEmbedding:
    theta, params = ROPE_TYPES[rope_type]
    return LlamaRotaryEmbedding(config=make_config(rope_type, theta, params, head_dim=head_dim))


def default_inv_freq(theta: float, d: int = HEAD_DIM) -> np.ndarray:
    return 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)


def llama3_inv_freq(theta: float, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_position_embeddings: int) -> np.ndarray:
    """Llama 3's frequency rescaling, written out independently of transformers."""
    inv = default_inv_freq(theta)
    wavelen = 2 * math.pi / inv
    low_wl = original_max_position_embeddings / low_freq_factor
    high_wl = original_max_position_embeddings / high_freq_factor
    ratio = original_max_position_embeddings / wavelen
    smooth = (ratio - low_freq_factor) / (high_freq_factor - low_freq_factor)
    mid = (1 - smooth) * inv / factor + smooth * inv
    return np.where(wavelen < high_wl, inv, np.where(wavelen > low_wl, inv / factor, mid))


@pytest.mark.parametrize("rope_type", list(ROPE_TYPES))
def test_returns_the_module_buffer(rope_type):
    mod = rotary(rope_type)
    inv, source = find_inv_freq(mod)
    assert source == "inv_freq"
    assert inv.dtype == np.float64 and inv.shape == (K,)
    assert np.array_equal(inv, mod.inv_freq.detach().double().numpy())
    check_frequencies(inv)  # distinct and positive: the Lemma's precondition holds
    assert np.array_equal(find_inv_freq(mod, head_dim=HEAD_DIM)[0], inv)


def test_default_matches_closed_form():
    inv, _ = find_inv_freq(rotary("default"))
    assert np.allclose(inv, default_inv_freq(10000.0), rtol=1e-6)


def test_llama3_differs_from_default_at_low_frequencies():
    theta = ROPE_TYPES["llama3"][0]
    inv, _ = find_inv_freq(rotary("llama3"))
    plain = default_inv_freq(theta)
    assert np.allclose(inv, llama3_inv_freq(theta, **LLAMA3), rtol=1e-6)
    assert np.allclose(inv[:4], plain[:4], rtol=1e-6)  # highest frequencies untouched
    assert np.allclose(inv[-4:], plain[-4:] / LLAMA3["factor"], rtol=1e-6)  # lowest divided by factor
    assert not np.allclose(inv, plain, rtol=1e-3)
    # and it matters for phi*: the phase averages of the lowest pairs move
    C1, _ = phase_averages(inv, 4096)
    C0, _ = phase_averages(plain, 4096)
    assert np.max(np.abs(C1 - C0)) > 0.05
    assert np.allclose(C1[:4], C0[:4], atol=1e-6)  # up to float32 rounding of the buffer


def test_linear_and_yarn_rescale():
    plain = default_inv_freq(10000.0)
    lin, _ = find_inv_freq(rotary("linear"))
    assert np.allclose(lin, plain / 4.0, rtol=1e-6)
    yarn, _ = find_inv_freq(rotary("yarn"))
    assert not np.allclose(yarn, plain, rtol=1e-3)
    assert np.all(yarn <= plain * (1 + 1e-6)) and np.all(yarn >= plain / 4.0 * (1 - 1e-6))
    dyn, _ = find_inv_freq(rotary("dynamic"))
    assert np.allclose(dyn, plain, rtol=1e-6)  # dynamic starts from the default frequencies


def test_whole_model_and_repeated_identical_buffers():
    cfg = make_config("default", 10000.0, {})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    inv, source = find_inv_freq(model)
    assert source.endswith("rotary_emb.inv_freq")
    assert np.allclose(inv, default_inv_freq(10000.0), rtol=1e-6)

    holder = nn.Module()
    holder.a = rotary("default")
    holder.b = rotary("default")  # same values twice: one candidate, not ambiguous
    inv2, source2 = find_inv_freq(holder)
    assert np.array_equal(inv2, inv) and source2 == "a.inv_freq"


def test_ambiguous_and_resolved_by_head_dim():
    holder = nn.Module()
    holder.a = rotary("default")
    holder.b = rotary("llama3")
    with pytest.raises(AmbiguousInvFreqError, match="2 distinct"):
        find_inv_freq(holder)
    mixed = nn.Module()
    mixed.a = rotary("default", head_dim=64)
    mixed.b = rotary("default", head_dim=32)
    with pytest.raises(AmbiguousInvFreqError):
        find_inv_freq(mixed)
    inv, source = find_inv_freq(mixed, head_dim=32)
    assert source == "b.inv_freq" and inv.shape == (16,)


def test_missing_buffers():
    with pytest.raises(MissingInvFreqError):
        find_inv_freq(nn.Linear(4, 4))
    with pytest.raises(MissingInvFreqError, match="not a torch module"):
        find_inv_freq(object())
    only_original = nn.Module()
    only_original.register_buffer("original_inv_freq", torch.ones(4), persistent=False)
    with pytest.raises(MissingInvFreqError):
        find_inv_freq(only_original)
    with pytest.raises(MissingInvFreqError, match="length"):
        find_inv_freq(rotary("default"), head_dim=128)
    meta = nn.Module()
    meta.register_buffer("inv_freq", torch.empty(K, device="meta"), persistent=False)
    with pytest.raises(MissingInvFreqError, match="meta"):
        find_inv_freq(meta)


def test_ambiguous_message_does_not_suggest_head_dim_when_it_was_passed():
    holder = nn.Module()
    holder.a = rotary("default")
    holder.b = rotary("llama3")
    with pytest.raises(AmbiguousInvFreqError, match="pass head_dim=") as plain:
        find_inv_freq(holder)
    with pytest.raises(AmbiguousInvFreqError, match="length head_dim/2 = 32") as given:
        find_inv_freq(holder, head_dim=64)
    assert "pass head_dim=" not in str(given.value)
    assert "rotary module of one layer" in str(given.value)
    assert "length head_dim/2" not in str(plain.value)


def test_frequencies_one_ulp_apart_are_not_distinct():
    from rope_quant.core.rope import FREQ_RTOL, NonDistinctFrequencyError, check_frequencies

    freq = default_inv_freq(10000.0).astype(np.float32)
    near = freq.copy()
    near[5] = np.nextafter(near[4], np.float32(0))  # one float32 ulp below its neighbour
    with pytest.raises(NonDistinctFrequencyError, match="relative tolerance 1e-06"):
        check_frequencies(near)
    apart = freq.astype(np.float64)
    apart[5] = apart[4] * (1 - 10 * FREQ_RTOL)  # clearly apart, but closer than any RoPE schedule
    check_frequencies(apart)  # accepted
    check_frequencies(freq)  # the real schedule passes

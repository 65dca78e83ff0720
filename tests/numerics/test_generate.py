"""Greedy decoding with a growing KV cache (rope_quant.scoring.generate), the NIAH task's decoder (App. G).

Checks: the loop equals transformers' greedy ``generate``; under identity R3 with 16-bit W/A/K/V the
pipeline's model continues exactly like the plain model (tiny random Llama, a tiny random Gemma 3 with
sliding layers, and the embedded SmolLM2-135M); under 4-bit KV (W4A4KV4) the decode-time logits equal the
full-forward logits of the same quantised model at the same positions, and the attention function sees
every cached key raw (R3 and the quantiser act once per key, never on an already quantised one).
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from transformers import LlamaForCausalLM

from rope_quant.core import transforms as T
from rope_quant.experiment.pipeline import RunConfig, build_quantized_model
from rope_quant.quant.quantizers import QuantConfig
from rope_quant.rotations import attention
from rope_quant.scoring.generate import GenerationError, greedy_generate
from tests._support import tiny_gemma3 as _shared_tiny_gemma3
from tests._support import tiny_llama as _shared_tiny_llama

# the decoding loop passes the KV cache under the name this transformers reads (5.x deprecates past_key_values)
pytestmark = pytest.mark.filterwarnings("error:`past_key_values` is deprecated:FutureWarning")

OFF = dict(w_bits=16, a_bits=16, k_bits=16, v_bits=16, weights="none")
TINY = dict(seqlen=64, calib_windows=2, eval_windows=1)


def tiny_llama(vocab: int, seed: int = 0) -> LlamaForCausalLM:
    return _shared_tiny_llama(vocab, seed=seed, tied=True)


def tiny_gemma3(vocab: int = 256, window: int = 8, seed: int = 0) -> transformers.PreTrainedModel:
    """Three layers, sliding, sliding, full (window 8): the Gemma 3 pattern at toy size."""
    return _shared_tiny_gemma3(vocab, seed=seed, layers=3, intermediate=128, window=window, query_pre_attn_scalar=16)


def _prompt(vocab: int, n: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _hf_greedy(model, prompt: torch.Tensor, n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(prompt.unsqueeze(0), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             use_cache=True, attention_mask=torch.ones(1, prompt.numel(), dtype=torch.long))
    return out[0, prompt.numel():].tolist()


def _full_forward_logits(model, prompt: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """Logits of one cache-free forward over prompt + tokens[:-1], at the positions that chose ``tokens``."""
    ids = torch.cat([prompt, torch.tensor(tokens[:-1], dtype=torch.long)]).unsqueeze(0)
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
    return logits[prompt.numel() - 1:]


@pytest.fixture(scope="module")
def tiny_base(embedded_model):
    """A 2-layer random Llama with the embedded tokenizer (the pipeline needs a real corpus)."""
    return tiny_llama(embedded_model[0].config.vocab_size), embedded_model[1]


# ----------------------------------------------------------------------------- the loop itself


def test_greedy_generate_equals_transformers_generate_on_plain_models():
    llama = tiny_llama(300)
    prompt = _prompt(300, 37)
    assert greedy_generate(llama, prompt, 12).tokens == _hf_greedy(llama, prompt, 12)
    gemma = tiny_gemma3()
    prompt = _prompt(256, 29)  # longer than the window: the sliding layers drop cached tokens
    assert greedy_generate(gemma, prompt, 12).tokens == _hf_greedy(gemma, prompt, 12)


def test_greedy_generate_stops_and_refuses_bad_input():
    llama = tiny_llama(300)
    prompt = _prompt(300, 10)
    full = greedy_generate(llama, prompt, 6).tokens
    assert greedy_generate(llama, prompt, 6, eos_token_id=full[2]).tokens == full[:full.index(full[2]) + 1]
    stopped = greedy_generate(llama, prompt, 6, stop=lambda toks: len(toks) == 3)
    assert stopped.tokens == full[:3] and stopped.stopped == "stop"
    with pytest.raises(GenerationError, match="non-empty 1-D"):
        greedy_generate(llama, torch.zeros(0, dtype=torch.long), 3)
    with pytest.raises(GenerationError, match="max_new_tokens"):
        greedy_generate(llama, prompt, 0)


# ----------------------------------------------------------------------------- identity R3, 16-bit


def test_identity_r3_16bit_pipeline_continues_like_the_plain_model(tiny_base):
    model, tok = tiny_base
    prompt = _prompt(model.config.vocab_size, 48)
    ref = greedy_generate(model, prompt, 16).tokens
    assert ref == _hf_greedy(model, prompt, 16)
    cfg = RunConfig.from_flat(r3="identity", **OFF, **TINY)
    qm = build_quantized_model(cfg, base=(model, tok))
    assert qm.model.config._attn_implementation == attention.ATTN_NAME  # the quantised path is in effect
    assert greedy_generate(qm.model, prompt, 16).tokens == ref


def test_identity_r3_16bit_embedded_model_continues_like_the_plain_model(embedded_model):
    base, tok = embedded_model
    prompt = tok("The special magic number for amber-falcon is 4821. What is the special magic number for "
                 "amber-falcon? The special magic number for amber-falcon is", return_tensors="pt",
                 add_special_tokens=False).input_ids[0]
    ref = greedy_generate(base, prompt, 8).tokens
    cfg = RunConfig.from_flat(r3="identity", r1="identity", r2="identity", r4=False, **OFF, **TINY)
    qm = build_quantized_model(cfg, base=embedded_model)
    assert greedy_generate(qm.model, prompt, 8).tokens == ref
    assert "4821" in tok.decode(ref)  # a coherent copy: the check is not vacuous


def test_identity_r3_16bit_on_sliding_window_model_matches_plain():
    """Gemma 3 style sliding layers: the quantise-mode attention with identity R3 and 16-bit KV is the plain
    model, also once the prompt outgrows the window."""
    plain = tiny_gemma3()
    model = copy.deepcopy(plain)
    geom = attention.check_model(model)
    attention.install_attention(model, [T.build("identity", geom.head_dim) for _ in range(geom.n_layers)])
    prompt = _prompt(256, 29)
    assert greedy_generate(model, prompt, 12).tokens == greedy_generate(plain, prompt, 12).tokens


# ----------------------------------------------------------------------------- 4-bit KV: cache consistency


def test_kv4_decode_logits_equal_full_forward_logits(tiny_base):
    model, tok = tiny_base
    cfg = RunConfig.from_flat(r3="hadamard", weights="rtn", **TINY)  # W4A4KV4, online R3
    qm = build_quantized_model(cfg, base=(model, tok))
    assert qm.states[0].k.bits == 4 and qm.states[0].v.bits == 4
    prompt = _prompt(model.config.vocab_size, 40)
    gen = greedy_generate(qm.model, prompt, 10, keep_logits=True)
    full = _full_forward_logits(qm.model, prompt, gen.tokens)
    decoded = torch.stack(gen.step_logits)
    scale = full.abs().max()
    assert torch.allclose(decoded, full, atol=2e-4 * float(scale), rtol=0), float((decoded - full).abs().max())
    # the check can fail: the same model with 16-bit KV gives different logits at these positions
    plain_kv = build_quantized_model(cfg.override(k_bits=16, v_bits=16), base=(model, tok))
    other = _full_forward_logits(plain_kv.model, prompt, gen.tokens)
    assert float((other - full).abs().max()) > 100 * 2e-4 * float(scale)


def test_kv4_decode_on_sliding_window_model_matches_full_forward():
    model = tiny_gemma3()
    geom = attention.check_model(model)
    attention.install_attention(model, [T.build("hadamard", geom.head_dim) for _ in range(geom.n_layers)],
                                k=QuantConfig(bits=4), v=QuantConfig(bits=4))
    prompt = _prompt(256, 29)
    gen = greedy_generate(model, prompt, 10, keep_logits=True)
    full = _full_forward_logits(model, prompt, gen.tokens)
    decoded = torch.stack(gen.step_logits)
    assert torch.allclose(decoded, full, atol=2e-4 * float(full.abs().max()), rtol=0)


class _Recorder:
    """Wraps an R3 transform and records every key tensor it is applied to (queries have H_q heads)."""

    def __init__(self, inner, n_kv: int) -> None:
        self.inner, self.n_kv, self.keys = inner, n_kv, []

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] == self.n_kv:
            self.keys.append(x.detach().clone())
        return self.inner.apply(x)


def test_cached_keys_reach_the_quantiser_raw_once_per_step(tiny_base):
    """The cache stores raw post-RoPE keys: at decode step t the attention function receives the prompt's
    keys exactly as it received them at prefill, so R3 and the K quantiser act on each key once."""
    model, tok = tiny_base
    cfg = RunConfig.from_flat(r3="hadamard", weights="rtn", **TINY)
    qm = build_quantized_model(cfg, base=(model, tok))
    state = qm.states[0]
    rec = _Recorder(state.transform, qm.geometry.n_kv_heads)
    state.transform = rec
    prompt = _prompt(model.config.vocab_size, 20)
    greedy_generate(qm.model, prompt, 4)
    assert [k.shape[-2] for k in rec.keys] == [20, 21, 22, 23]  # the whole cache, growing one token a step
    for step, keys in enumerate(rec.keys[1:], 1):
        assert torch.equal(keys[..., :20, :], rec.keys[0])  # raw keys, never rotated or quantised in place
        assert torch.equal(keys[..., 20:20 + step - 1, :], rec.keys[step - 1][..., 20:, :])

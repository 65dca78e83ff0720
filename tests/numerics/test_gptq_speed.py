"""GPTQ's early-stopped group forwards give bit-identical weights (rope_quant.quant.gptq.EARLY_STOP)."""

from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rope_quant.quant import gptq, packing
from rope_quant.quant.quantizers import QuantConfig


def test_early_stop_keeps_the_weights_bit_identical(monkeypatch):
    from rope_quant.experiment.pipeline import install_activation_quantizers

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()
    install_activation_quantizers(model, QuantConfig(bits=4))  # hooks before the Hessian hooks, as in the pipeline
    windows = torch.randint(0, 128, (3, 32))
    fast = copy.deepcopy(model)
    calls = {"n": 0}
    for layer in fast.model.layers:
        layer.mlp.down_proj.register_forward_hook(lambda *_: calls.__setitem__("n", calls["n"] + 1))
    err_fast = gptq.quantize_model_gptq(fast, windows, 4, gptq.GPTQConfig(grid=10), progress=False)
    monkeypatch.setattr(gptq, "EARLY_STOP", False)
    err_full = gptq.quantize_model_gptq(model, windows, 4, gptq.GPTQConfig(grid=10), progress=False)
    assert err_fast == err_full
    for (n, a), b in zip(fast.state_dict().items(), model.state_dict().values(), strict=True):
        assert packing.bitwise_equal(a, b), n
    # down_proj ran only in the passes that produce the next layer's inputs (1 per layer and window)
    assert calls["n"] == 2 * 3

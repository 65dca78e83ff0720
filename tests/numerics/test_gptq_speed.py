"""GPTQ's early-stopped group forwards give bit-identical weights (rope_quant.quant.gptq.EARLY_STOP)."""

from __future__ import annotations

import copy

import torch

from rope_quant.quant import gptq, packing, rtn
from rope_quant.quant.quantizers import QuantConfig
from tests._support import tiny_llama


def test_early_stop_keeps_the_weights_bit_identical(monkeypatch):
    """The whole-layer group forwards (the staged forward's early stop: tests/numerics/test_gptq_staged.py)."""
    from rope_quant.experiment.pipeline import install_activation_quantizers

    monkeypatch.setattr(gptq, "STAGED", False)

    model = _tiny(0)
    install_activation_quantizers(model, QuantConfig(bits=4))  # hooks before the Hessian hooks, as in the pipeline
    windows = torch.randint(0, 128, (3, 32))
    fast = copy.deepcopy(model)
    calls = {"n": 0}
    for layer in fast.model.layers:
        layer.mlp.down_proj.register_forward_hook(lambda *_: calls.__setitem__("n", calls["n"] + 1))
    err_fast = gptq.quantize_model_gptq(fast, windows, 4, rtn.GPTQConfig(grid=10), progress=False)
    monkeypatch.setattr(gptq, "EARLY_STOP", False)
    err_full = gptq.quantize_model_gptq(model, windows, 4, rtn.GPTQConfig(grid=10), progress=False)
    assert err_fast == err_full
    for (n, a), b in zip(fast.state_dict().items(), model.state_dict().values(), strict=True):
        assert packing.bitwise_equal(a, b), n
    # down_proj ran only in the passes that produce the next layer's inputs (1 per layer and window)
    assert calls["n"] == 2 * 3


def _tiny(seed: int = 0):
    return tiny_llama(128, seed=seed, intermediate=96, max_positions=64)


def test_shared_hessians_keep_the_weights_bit_identical(monkeypatch):
    """q/k/v and gate/up read one tensor: one accumulator each instead of copies, same weights bit for bit."""
    from rope_quant.experiment.pipeline import install_activation_quantizers

    real_add = gptq.HessianAccumulator.add
    adds = {"n": 0}

    def counting_add(self, x):
        adds["n"] += 1
        real_add(self, x)
    for act in (True, False):  # through the quantiser's shared-input memo, and the raw hidden states
        model = _tiny()
        if act:
            install_activation_quantizers(model, QuantConfig(bits=4))
        windows = torch.randint(0, 128, (3, 32), generator=torch.Generator().manual_seed(1))
        fast = copy.deepcopy(model)
        adds["n"] = 0
        monkeypatch.setattr(gptq.HessianAccumulator, "add", counting_add)
        err_fast = gptq.quantize_model_gptq(fast, windows, 4, rtn.GPTQConfig(grid=10), progress=False)
        shared_adds, adds["n"] = adds["n"], 0
        monkeypatch.setattr(gptq, "SHARE_HESSIANS", False)
        err_full = gptq.quantize_model_gptq(model, windows, 4, rtn.GPTQConfig(grid=10), progress=False)
        monkeypatch.setattr(gptq, "SHARE_HESSIANS", True)
        assert err_fast == err_full
        for (n, a), b in zip(fast.state_dict().items(), model.state_dict().values(), strict=True):
            assert packing.bitwise_equal(a, b), n
        # per layer and window: q,k,v,o,gate,up,down = 7 accumulations without sharing, 4 with
        assert (shared_adds, adds["n"]) == (2 * 3 * 4, 2 * 3 * 7), act


def test_a_linear_that_shares_only_sometimes_falls_back_to_its_own_hessian(monkeypatch):
    """If k_proj read q_proj's tensor in one window but its own in another, nothing is shared."""
    model = _tiny()
    layer = model.model.layers[0]
    state = {"n": 0}

    def fresh_input_every_other_call(_mod, args):
        state["n"] += 1
        return (args[0].clone(),) + tuple(args[1:]) if state["n"] % 2 else None
    layer.self_attn.k_proj.register_forward_pre_hook(fresh_input_every_other_call)
    windows = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(2))
    ref = copy.deepcopy(model)
    gptq.quantize_model_gptq(model, windows, 4, rtn.GPTQConfig(grid=10), progress=False)
    monkeypatch.setattr(gptq, "SHARE_HESSIANS", False)
    gptq.quantize_model_gptq(ref, windows, 4, rtn.GPTQConfig(grid=10), progress=False)
    for (n, a), b in zip(model.state_dict().items(), ref.state_dict().values(), strict=True):
        assert packing.bitwise_equal(a, b), n

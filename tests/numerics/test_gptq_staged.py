"""Staged GPTQ (rope_quant.quant.gptq_layer.staged_layer through rope_quant.model.layer_stages) against the
whole-layer group forwards, on the tiny model of every supported architecture.

Tolerance: the staged forward calls the same modules, with the same hooks, in the same order as the layer's own
forward, so on the CPU the two paths may differ by float order only. The tests require identical integer codes
and dequantised weights, and final logits equal to 1e-5 relative (measured on 2026-11-28 with torch 2.13 CPU:
0.0 difference on all three architectures).
"""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import torch
from torch import nn

from rope_quant.model import arch, layer_stages
from rope_quant.quant import gptq, packing, rtn
from rope_quant.quant.quantizers import QuantConfig
from rope_quant.rotations import online_r4
from tests._support import randomise_norms, tiny_gemma3, tiny_llama, tiny_qwen3

BUILDERS = {
    "llama": lambda: tiny_llama(128, layers=3, intermediate=96, max_positions=64),
    "gemma3": lambda: randomise_norms(tiny_gemma3(128, layers=3), -0.5, 0.5),  # sandwich norms not a no-op
    "qwen3": lambda: randomise_norms(tiny_qwen3(128, layers=3), 0.5, 1.5),  # q/k norms not a no-op
}
WINDOWS = torch.randint(0, 128, (3, 40), generator=torch.Generator().manual_seed(0))


def _pipeline_hooks(model: nn.Module) -> nn.Module:
    """The hooks the pipeline installs before GPTQ: the online R4 on down_proj (Llama: Hadamard order 96) and
    the 4-bit activation quantisers on every linear (GPTQ's Hessians must see their outputs)."""
    from rope_quant.experiment.pipeline import install_activation_quantizers

    if arch.spec_for(model).model_type == "llama":
        online_r4.install_online_r4(model)
    install_activation_quantizers(model, QuantConfig(bits=4))
    return model


def _quantise(model: nn.Module, staged: bool, monkeypatch, **cfg) -> tuple[dict, dict[str, int]]:
    """GPTQ of ``model`` in place; returns its errors and the layer / down_proj calls it made."""
    monkeypatch.setattr(gptq, "STAGED", staged)
    calls = {"layer": 0, "down": 0, "q": 0}
    layers = arch.decoder_layers(model)
    for layer in layers:  # a wrapped forward, not a hook: a hook on the layer refuses the stages
        layer.forward = (lambda f: lambda *a, **k: (calls.__setitem__("layer", calls["layer"] + 1), f(*a, **k))[1])(
            layer.forward)
    handles = [arch.mlp_parts(model, i).down.register_forward_hook(
        lambda *_: calls.__setitem__("down", calls["down"] + 1)) for i in range(len(layers))]
    handles += [arch.attention(model, i).q.register_forward_hook(
        lambda *_: calls.__setitem__("q", calls["q"] + 1)) for i in range(len(layers))]
    try:
        errors = gptq.quantize_model_gptq(model, WINDOWS, 4, rtn.GPTQConfig(grid=10, **cfg), progress=False)
    finally:
        for h in handles:
            h.remove()
        for layer in layers:
            del layer.forward
    return errors, calls


def _assert_same(a: nn.Module, b: nn.Module) -> None:
    for (n, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert packing.bitwise_equal(x, y), n
    for (n, m), m2 in zip(arch.decoder_linears(a), (m for _, m in arch.decoder_linears(b)), strict=True):
        ca, cb = getattr(m, packing.CODES_ATTR), getattr(m2, packing.CODES_ATTR)
        assert torch.equal(ca.codes, cb.codes) and torch.equal(ca.scales, cb.scales), n
    with torch.no_grad():
        la, lb = a(WINDOWS).logits, b(WINDOWS).logits
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5 * float(lb.abs().max()))


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_staged_and_whole_layer_gptq_agree(family, monkeypatch, caplog):
    base = _pipeline_hooks(BUILDERS[family]())
    staged, whole = copy.deepcopy(base), copy.deepcopy(base)
    with caplog.at_level(logging.WARNING, logger="rope_quant.quant.gptq"):
        err_s, calls_s = _quantise(staged, True, monkeypatch)
    assert "staged layer forward not used" not in caplog.text
    err_w, calls_w = _quantise(whole, False, monkeypatch)
    n_layers, n_windows = len(arch.decoder_layers(base)), len(WINDOWS)
    # Gemma 3 (two layer types) runs one whole-model forward per window to capture each layer's own kwargs
    kw = n_layers * n_windows if family == "gemma3" else 0
    # the staged path enters a layer only for its one check (layer 0, window 0); down_proj runs once per
    # layer-window plus that check's two forwards; the whole-layer path enters each layer 5 times per window
    # q_proj's matmul: once per layer-window, once more in each layer's first window (the capture forward
    # that checks q/k/v read one tensor; later windows stop at q's hook), and in the check's two forwards
    assert calls_s == {"layer": 1 + kw, "down": n_layers * n_windows + 2 + kw,
                       "q": n_layers * n_windows + n_layers + 2 + kw}, calls_s
    assert calls_w["layer"] == 5 * n_layers * n_windows + kw, calls_w
    assert err_s == pytest.approx(err_w, rel=1e-6)
    _assert_same(staged, whole)


def test_staged_early_stop_keeps_the_weights_bit_identical(monkeypatch):
    base = _pipeline_hooks(BUILDERS["llama"]())
    fast, full = copy.deepcopy(base), copy.deepcopy(base)
    _quantise(fast, True, monkeypatch)
    monkeypatch.setattr(gptq, "EARLY_STOP", False)
    _quantise(full, True, monkeypatch)
    _assert_same(fast, full)


def test_an_unsplit_architecture_falls_back_with_a_note(monkeypatch, caplog):
    """A family registered with ``staged=False`` runs the whole-layer path: a warning says why, and the weights
    are those of the whole-layer path."""
    base = _pipeline_hooks(BUILDERS["qwen3"]())
    refused, whole = copy.deepcopy(base), copy.deepcopy(base)
    monkeypatch.setitem(arch.ARCHITECTURES, "qwen3", dataclasses.replace(arch.ARCHITECTURES["qwen3"], staged=False))
    with caplog.at_level(logging.WARNING, logger="rope_quant.quant.gptq"):
        _, calls = _quantise(refused, True, monkeypatch)
    assert "staged layer forward not used (model type 'qwen3' is registered with staged=False)" in caplog.text
    assert calls["layer"] > len(WINDOWS) * 3  # whole-layer forwards
    _quantise(whole, False, monkeypatch)
    _assert_same(refused, whole)


def test_a_layout_the_stages_do_not_reproduce_is_caught_before_any_weight_changes(monkeypatch, caplog):
    """If the adapter's residual layout were wrong for a family (here: Gemma 3's post-attention sandwich norm
    dropped), the check on layer 0 sees the staged forward differ from the layer's own and GPTQ falls back."""
    base = _pipeline_hooks(BUILDERS["gemma3"]())
    wrong, whole = copy.deepcopy(base), copy.deepcopy(base)
    monkeypatch.setattr(layer_stages.LayerStages, "attention_residual", lambda self, x, a: x + a)
    with caplog.at_level(logging.WARNING, logger="rope_quant.quant.gptq"):
        _quantise(wrong, True, monkeypatch)
    assert "staged forward differs from its own forward" in caplog.text
    _quantise(whole, False, monkeypatch)
    _assert_same(wrong, whole)


def test_hooks_on_the_layer_itself_refuse_the_stages():
    model = BUILDERS["llama"]()
    args = (torch.zeros(1, 4, 64),)
    assert layer_stages.staging_refusal(model, 0, args) is None
    arch.decoder_layers(model)[1].register_forward_pre_hook(lambda *_: None)
    assert "layers.1 carries hooks of its own" in layer_stages.staging_refusal(model, 1, args)
    assert "2 positional inputs" in layer_stages.staging_refusal(model, 0, args + (None,))


def test_without_kept_down_inputs_the_weights_are_the_same(monkeypatch):
    """Over the memory budget the output step runs the quantised MLP again instead of keeping down_proj's inputs:
    the same weights and outputs, gate/up once more per layer-window."""
    base = _pipeline_hooks(BUILDERS["gemma3"]())
    kept, rerun = copy.deepcopy(base), copy.deepcopy(base)
    _, calls_kept = _quantise(kept, True, monkeypatch)
    monkeypatch.setattr(gptq, "STAGED_KEEP_BYTES", 0)
    _, calls_rerun = _quantise(rerun, True, monkeypatch)
    assert calls_rerun["down"] == calls_kept["down"] and calls_rerun["layer"] == calls_kept["layer"]
    _assert_same(kept, rerun)

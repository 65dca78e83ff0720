"""Foldable R3 on the embedded models: folding a commuting R3 into the weights equals applying it online.

SmolLM2-135M (Llama, no q/k norm; with R1/R2/R4 applied first: R1 is allowed there): pairwise_scaled folds
into W_Q/W_K. Gemma 3 270M (q_norm/k_norm before RoPE; R1 refused by its sandwich norms, so KV-only):
pair-tied scales fold into the q/k norms; a Givens rotation is refused because k_norm's weight is not tied
within RoPE pairs; the fits run on its K sample; R1's refusal names R1 only.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from rope_quant.calib import foldable as F
from rope_quant.calib.objectives import resolve_layer_inv_freq
from rope_quant.calib.stats import CalibrationStats
from rope_quant.core import transforms as T
from rope_quant.model import arch
from rope_quant.rotations import attention
from rope_quant.rotations import offline as rotation
from rope_quant.rotations.fold_r3 import FoldError, fold_r3, fold_refusal


def _text_ids(tok, n: int) -> torch.Tensor:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))[:6000]
    return torch.tensor(tok(text, add_special_tokens=False)["input_ids"][:n]).unsqueeze(0)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _online_then_folded(model, trs, ids) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits with the online R3, then (after uninstalling it) with the R3 folded into ``model``'s weights."""
    attention.install_attention(model, trs)
    with torch.no_grad():
        online = model(ids).logits
    attention.uninstall_attention(model)
    fold_r3(model, trs)
    with torch.no_grad():
        folded = model(ids).logits
    return online, folded


def _random_scaled(name: str, n_layers: int, n_kv: int, d: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    k = d // 2
    scales = np.exp(rng.normal(0, 0.5, (n_layers, n_kv, k)))
    if name == "prerope_channel_scale":
        return [T.build(name, d, scales=scales[i]) for i in range(n_layers)]
    return [T.build(name, d, angles=rng.uniform(-np.pi, np.pi, (n_kv, k)), scales=scales[i])
            for i in range(n_layers)]


def test_smollm2_fold_into_wq_wk_equals_online_after_r1(embedded_model) -> None:
    model, tok = embedded_model
    model = copy.deepcopy(model)
    rotation.rotate_model(model, rotation.RotationConfig(r1="random_hadamard", r2="random_hadamard", r4=True,
                                                         seed=0))
    dims = arch.dims(model)
    ids = _text_ids(tok, 160)
    with torch.no_grad():
        plain = model(ids).logits
    trs = _random_scaled("pairwise_scaled", dims.n_layers, dims.n_kv_heads, dims.head_dim)
    online, folded = _online_then_folded(model, trs, ids)
    assert _rel(online, plain) < 1e-4  # q·k is kept (in exact arithmetic: the R3 changes no logit)
    assert _rel(folded, online) < 1e-5, _rel(folded, online)  # bit-close: the fold is the online map


@pytest.fixture(scope="module")
def gemma():
    from rope_quant.model.loading import ModelNotFoundError, load_model

    try:
        return load_model("gemma3-270m")
    except ModelNotFoundError as exc:
        pytest.fail(f"embedded model unavailable: {exc}")


def test_gemma3_pair_tied_scales_fold_into_the_qk_norms_and_rotations_are_refused(gemma) -> None:
    base, tok = gemma
    dims = arch.dims(base)
    ids = _text_ids(tok, 96)
    model = copy.deepcopy(base)
    trs = _random_scaled("prerope_channel_scale", dims.n_layers, dims.n_kv_heads, dims.head_dim)
    online, folded = _online_then_folded(model, trs, ids)
    assert _rel(folded, online) < 1e-5, _rel(folded, online)
    assert not torch.equal(arch.attention(model, 0).k_norm.weight, arch.attention(base, 0).k_norm.weight)
    del model
    rot = _random_scaled("pairwise_scaled", dims.n_layers, dims.n_kv_heads, dims.head_dim)
    with pytest.raises(FoldError, match="layer 0: k_norm's weight is not tied within RoPE pair"):
        fold_r3(copy.deepcopy(base), rot)
    # the dry check a cell records says the same, without touching the model
    before = arch.attention(base, 0).k_norm.weight.clone()
    assert fold_refusal(base, trs) is None
    assert "k_norm's weight is not tied within RoPE pair" in (fold_refusal(base, rot) or "")
    assert torch.equal(arch.attention(base, 0).k_norm.weight, before)


def test_gemma3_fits_run_kv_only_and_the_refusal_names_r1_only(gemma) -> None:
    model, tok = gemma
    with pytest.raises(rotation.NotFunctionPreservingError) as info:
        rotation.check_function_preserving(model, rotation.RotationConfig(r1="whip", r2="identity", r4=False))
    msg = str(info.value)
    assert msg.startswith("R1 is not function-preserving")  # R1 is refused, and only R1:
    assert "still available: r2, r4 and the online R3" in msg
    rotation.check_function_preserving(model, rotation.RotationConfig(r1="identity", r2="identity", r4=False))
    dims = arch.dims(model)
    stats = CalibrationStats(dims.n_layers, dims.n_heads, dims.n_kv_heads, dims.head_dim, sample_rows=128,
                             sample_seed=0)
    with attention.calibration_hooks(model, stats), torch.no_grad():
        model(_text_ids(tok, 128))
    inv, _ = resolve_layer_inv_freq(model, dims.n_layers, head_dim=dims.head_dim)
    angles = np.zeros((dims.n_layers, dims.n_kv_heads, dims.head_dim // 2))
    ctx = T.FitContext(stats=stats, inv_freq=inv, n_layers=dims.n_layers, n_kv_heads=dims.n_kv_heads,
                       head_dim=dims.head_dim, angles=angles, k_bits=4, seed=0)
    for name in ("prerope_channel_scale", "pairwise_scaled"):
        params = F.fit_for(name, ctx)
        assert len(params) == dims.n_layers
        assert all(np.all(p["scales"] > 0) for p in params)
        trs = [T.build(name, dims.head_dim, **p) for p in params]
        assert all(tr.commutes_with_rope for tr in trs)

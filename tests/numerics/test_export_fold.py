"""The export folds R3 with the cells' one fold: every foldable R3, on Llama, Gemma 3 and Qwen3, computes the cell.

A 16-bit cell (R1 = R2 = identity, weights none, a/k/v 16 bits) with R3 applied online, against
``build_export_model`` (R3 folded, no rope_quant hook): the logits agree within 1e-4 relative, or the export is
refused with the layer and the norm named. Tiny random models with per-head q/k norms whose weights are tied
within every RoPE pair ("pair-uniform": a pair rotation passes them) or not ("pair-mixing": only pair scales
pass). A per-pair scale never folds into W_Q/W_K ahead of a q/k norm (the RMS that follows would undo it): it
goes into the norm's weight.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from rope_quant.core.rope import pair_indices
from rope_quant.experiment.config import RunConfig
from rope_quant.experiment.pipeline import build_quantized_model
from rope_quant.export import build as ebuild
from rope_quant.export import fold, hf, outdir
from tests._support import ByteTokenizer, randomise_norms, tiny_gemma3, tiny_llama, tiny_qwen3
from tests.numerics.export_isolated import hf_logits

REL = 1e-4
FOLDABLE = ["pairwise_only", "pair_h2", "pairwise_scaled", "prerope_channel_scale"]
HEAD_DIM = 16


def _model(family: str, norms: str, seed: int = 0) -> torch.nn.Module:
    """A tiny random ``family`` model; ``norms``: 'pair-uniform' or 'pair-mixing' q/k norm weights (or 'none')."""
    if family == "llama":
        model = tiny_llama(256, seed=seed, intermediate=96, max_positions=256, rms_norm_eps=1e-6)
    elif family == "gemma3":
        model = tiny_gemma3(seed=seed, rms_norm_eps=1e-6, query_pre_attn_scalar=HEAD_DIM)
    else:  # qwen3 (GQA, 2 KV heads) or qwen3_mqa (1 KV head: every head shares the KV head's fitted scales)
        model = tiny_qwen3(seed=seed, kv_heads=1 if family == "qwen3_mqa" else 2, rms_norm_eps=1e-6)
    randomise_norms(model, 0.5, 1.5)
    ia, ib = pair_indices(HEAD_DIM, "rotate_half")
    if norms == "pair-uniform":
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    p[ib] = p[ia]
    return model


def _cell(r3: str) -> RunConfig:
    return RunConfig.from_flat(model="tiny", corpus="pydoc", seed=0, r1="identity", r2="identity", r4=False, r3=r3,
                               weights="none", a_bits=16, k_bits=16, v_bits=16, seqlen=32, calib_windows=4,
                               eval_windows=1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))


CASES = [("llama", "none"), ("gemma3", "pair-uniform"), ("gemma3", "pair-mixing"), ("qwen3", "pair-uniform"),
         ("qwen3", "pair-mixing"), ("qwen3_mqa", "pair-uniform"), ("qwen3_mqa", "pair-mixing")]


@pytest.mark.parametrize("r3", FOLDABLE)
@pytest.mark.parametrize(("family", "norms"), CASES)
def test_export_computes_the_cell_or_is_refused_with_the_layer(family: str, norms: str, r3: str,
                                                                 ids: torch.Tensor) -> None:
    model = _model(family, norms)
    cfg = _cell(r3)
    rotates = r3 in ("pairwise_only", "pair_h2", "pairwise_scaled")
    if norms == "pair-mixing" and rotates:
        # a pair rotation cannot pass an untied norm weight: refused before the cell is built, layer named
        with pytest.raises(fold.LayoutError, match=r"layer 0: [qk]_norm's weight is not tied"):
            ebuild.build_export_model(cfg, None, base=(copy.deepcopy(model), ByteTokenizer()))
        return
    qm = build_quantized_model(cfg, base=(copy.deepcopy(model), ByteTokenizer()))
    with torch.no_grad():
        cell = qm.model(input_ids=ids).logits
        original = model(input_ids=ids).logits
    if family == "qwen3" and r3 in ("pairwise_scaled", "prerope_channel_scale"):
        # the fitted scales differ between KV heads, which share one k_norm weight: refused after the fit
        with pytest.raises(fold.LayoutError, match="layer 0: the k scales differ between heads"):
            ebuild.build_export_model(cfg, None, base=(copy.deepcopy(model), ByteTokenizer()))
        return
    em = ebuild.build_export_model(cfg, None, base=(copy.deepcopy(model), ByteTokenizer()))
    with torch.no_grad():
        exported = em.model(input_ids=ids).logits
    assert _rel(exported, cell) < REL, (family, norms, r3, _rel(exported, cell))
    # not vacuous: the R3 reached the weights (W_K or the k/q norm changed)
    changed = any(not torch.equal(a, b) for a, b in zip(em.model.state_dict().values(),
                                                          model.state_dict().values(), strict=True))
    assert changed
    if r3 in ("pairwise_scaled", "prerope_channel_scale"):
        # the scaled R3s change what a 16-bit cell computes only through the fold being right: q·k is kept
        assert _rel(cell, original) < REL


def test_scaled_r3_before_a_qk_norm_is_not_folded_into_the_projection(ids: torch.Tensor) -> None:
    """Control for the bug this file guards: folding the scales into W_K ahead of k_norm changes the function."""
    import numpy as np

    from rope_quant.core import transforms
    from rope_quant.rotations.attention import install_attention, uninstall_attention
    from rope_quant.rotations.fold_r3 import fold_r3

    model = _model("gemma3", "pair-uniform")
    rng = np.random.default_rng(0)
    tr = transforms.build("prerope_channel_scale", HEAD_DIM, scales=np.exp(rng.normal(0, 0.5, HEAD_DIM // 2)))
    install_attention(model, [tr, tr])
    with torch.no_grad():
        online = model(input_ids=ids).logits
    uninstall_attention(model)
    wrong = copy.deepcopy(model)
    with torch.no_grad():  # the old export's fold: rows of W_Q/W_K times M, norms untouched
        for layer in wrong.model.layers:
            a = layer.self_attn
            a.k_proj.weight.copy_(torch.as_tensor(tr.matrix(0, 1), dtype=torch.float32) @ a.k_proj.weight)
            mq = torch.as_tensor(tr.query_matrix(0, 4), dtype=torch.float32)
            a.q_proj.weight.copy_(torch.block_diag(*[mq] * 4) @ a.q_proj.weight)
    right = copy.deepcopy(model)
    fold_r3(right, [tr, tr])
    with torch.no_grad():
        assert _rel(wrong(input_ids=ids).logits, online) > 1e-3
        assert _rel(right(input_ids=ids).logits, online) < REL


def test_gemma3_prerope_channel_scale_hf_checkpoint_loads_and_computes_the_cell(ids: torch.Tensor,
                                                                                tmp_path: Path) -> None:
    """The study's best foldable R3 on Gemma 3, written with --format hf and loaded without rope_quant."""
    model = _model("gemma3", "pair-mixing")
    cfg = _cell("prerope_channel_scale")
    qm = build_quantized_model(cfg, base=(copy.deepcopy(model), ByteTokenizer()))
    with torch.no_grad():
        cell = qm.model(input_ids=ids).logits
    out = tmp_path / "hf"
    with outdir.staged(out, overwrite=False) as tmp:
        em = ebuild.build_export_model(cfg, None, base=(copy.deepcopy(model), ByteTokenizer()))
        hf.write_hf(em, tmp, torch.float32, weights="unquantised", source={"test": True})
    logits, info = hf_logits(out, ids, tmp_path)
    assert info["class"] == "Gemma3ForCausalLM"
    assert _rel(logits, cell) < REL, _rel(logits, cell)

"""The one-cell pipeline (rope_quant.experiment.pipeline): configuration keys, quantised linears, weight cache,
invariance of the unquantised rotated model, the K-only R3 ordering, and the full W4A4KV4 pipeline.

Budgets are small (2 shared CPU cores): mechanics run on a tiny random Llama that uses the embedded
tokenizer (so the real corpus loader and windows are exercised); paper-level checks use the embedded
SmolLM2-135M.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from rope_quant.core import rope
from rope_quant.corpora import token_streams
from rope_quant.experiment import act_quant, pipeline
from rope_quant.experiment.pipeline import GPTQConfig, PipelineError, RunConfig, build_quantized_model, run_cell
from rope_quant.quant import gptq
from rope_quant.quant.quantizers import QuantConfig, fake_quant_per_token
from rope_quant.rotations import attention
from rope_quant.rotations import offline as rotation
from rope_quant.scoring import evaluate
from tests._support import TINY, tiny_base

R3_VARIANTS = [("identity", None), ("hadamard", None), ("pairwise_only", None),
               ("pairwise_plus_hadamard", None), ("pair_h2", None), ("block_hadamard", 4)]
OFF = dict(w_bits=16, a_bits=16, k_bits=16, v_bits=16, weights="none")


@pytest.fixture(scope="module")
def corpus(embedded_model):
    return token_streams.load_corpus("pydoc", embedded_model[1])




# ----------------------------------------------------------------------------- RunConfig


def test_run_config_keys_separate_weights_from_r3():
    cfg = RunConfig()
    assert cfg.key() == RunConfig().key() and cfg.key().startswith("v4-") and len(cfg.key()) == 19
    assert RunConfig.from_dict(cfg.to_dict()) == cfg
    r3_changes = [dict(r3="pairwise_only"), dict(r3="block_hadamard", r3_block=8), dict(estimator="per_head"),
                  dict(objective="linf", estimator="k_only"), dict(position_average=True, average_length=512),
                  dict(k_bits=3),
                  dict(v_bits=2), dict(k_clip=0.9), dict(eval_windows=3), dict(static_scope="kv")]
    for change in r3_changes:
        other = cfg.override(**change)
        assert other.key() != cfg.key(), change
        assert other.weight_key() == cfg.weight_key(), change
        assert other.stats_key() == cfg.stats_key(), change
    w_changes = [dict(w_bits=3), dict(seed=1), dict(r1="none"), dict(r4=False), dict(weights="rtn"),
                 dict(a_bits=3), dict(calib_windows=64), dict(corpus="shakespeare"),
                 dict(gptq=GPTQConfig(act_order=False)), dict(static_scope="act")]
    for change in w_changes:
        assert cfg.override(**change).weight_key() != cfg.weight_key(), change
    # RTN does not look at activations or calibration data: with a data-free R1 those do not enter its weight
    # key; the default whip R1 is fitted on the calibration windows, so with it they do.
    rtn = cfg.override(weights="rtn", r1="random_hadamard")
    assert rtn.override(a_bits=8, calib_windows=3).weight_key() == rtn.weight_key()
    assert rtn.override(a_bits=8).stats_key() != rtn.stats_key()
    rtn_whip = cfg.override(weights="rtn")
    assert rtn_whip.override(calib_windows=3).weight_key() != rtn_whip.weight_key()
    assert rtn_whip.override(a_bits=8).weight_key() == rtn_whip.weight_key()


@pytest.mark.parametrize("bad", [dict(w_bits=1), dict(a_bits=True), dict(k_group=0), dict(v_clip=1.5),
                                 dict(weights="awq"), dict(static_scope="weights"), dict(r1="random"),
                                 dict(r3=""), dict(r3_block=0), dict(estimator="median"),
                                 dict(objective="l1"), dict(seqlen=0), dict(eval_windows=0),
                                 dict(dtype="int8"), dict(gptq={"percdamp": 0.01})])
def test_run_config_rejects_bad_values(bad):
    with pytest.raises(PipelineError):
        RunConfig.from_flat(**bad)


# ----------------------------------------------------------------------------- quantised linears


def test_r4_hadamard_runs_before_the_activation_quantiser(embedded_model):
    model, _ = tiny_base(embedded_model)
    rotation.rotate_model(model, rotation.RotationConfig(r1="hadamard", r2="hadamard", r4=True, seed=0))
    handles = pipeline.install_activation_quantizers(model, QuantConfig(bits=4, group_size=-1, clip_ratio=0.9))
    down = model.model.layers[0].mlp.down_proj
    seen = {}
    down.register_forward_pre_hook(lambda m, a: seen.update(raw=a[0].clone()), prepend=True)  # runs first
    down.register_forward_pre_hook(lambda m, a: seen.update(final=a[0].clone()))  # runs last
    with torch.no_grad():
        model(torch.randint(0, 1000, (1, 16)))
    expected = fake_quant_per_token(rotation.online_r4(seen["raw"]), 4, clip_ratio=0.9)
    torch.testing.assert_close(seen["final"], expected)
    assert len(handles) == 14  # 7 linears x 2 layers
    assert not model.lm_head._forward_pre_hooks  # lm_head stays 16-bit
    with pytest.raises(PipelineError, match="already"):
        pipeline.install_activation_quantizers(model, QuantConfig(bits=4))
    pipeline.remove_activation_quantizers(model, handles)
    assert pipeline.install_activation_quantizers(model, QuantConfig(bits=16)) == []


def test_shared_inputs_are_quantised_once_with_bit_identical_outputs(embedded_model, monkeypatch):
    """q/k/v (and gate/up) read one tensor: its dynamic fake-quant runs once and is reused; the logits are
    bit-identical to quantising at every linear (the fake-quant forward's cost)."""
    from rope_quant.quant import quantizers

    ids = torch.randint(0, 1000, (1, 24), generator=torch.Generator().manual_seed(3))
    spec = QuantConfig(bits=4)
    model, _ = tiny_base(embedded_model)
    calls = {"n": 0}
    real = quantizers.fake_quant

    def counting(x, s):
        calls["n"] += 1
        return real(x, s)

    monkeypatch.setattr(quantizers, "fake_quant", counting)
    handles = pipeline.install_activation_quantizers(model, spec)
    with torch.no_grad():
        shared = model(ids).logits
    assert calls["n"] == 4 * 2  # per layer: one for q/k/v, o_proj, one for gate/up, down_proj
    with torch.inference_mode():  # the evaluator's mode: inference tensors have no version counter
        assert torch.equal(model(ids).logits, shared)
    assert calls["n"] == 2 * 4 * 2
    pipeline.remove_activation_quantizers(model, handles)

    each = [m.register_forward_pre_hook(lambda _m, a: (real(a[0], spec),) + tuple(a[1:]))
            for _, m in act_quant.decoder_linears(model)]
    with torch.no_grad():
        per_linear = model(ids).logits
    for h in each:
        h.remove()
    assert torch.equal(shared, per_linear)


# ----------------------------------------------------------------------------- weight cache


def test_whip_r1_is_fitted_cached_and_logged(embedded_model, corpus, tmp_path, caplog):
    """The default R1 is a whip fit (App. A.1), not its random-Hadamard start: fitted once per (seed, whip
    settings, windows), cached, its log in every cell (also on a weight-cache hit); a corrupt R1 cache is named
    and refitted."""
    from rope_quant.rotations import offline

    base = tiny_base(embedded_model)
    cfg = RunConfig.from_flat(**TINY, r3="hadamard", weights="rtn", gptq=GPTQConfig(mse=False))
    assert (cfg.r1, cfg.r2) == ("whip", "random_hadamard")
    first = build_quantized_model(cfg, cache_dir=tmp_path, base=base, corpus=corpus)
    fit = first.rotation_fit
    assert fit["kind"] == "whip" and not fit["cache_hit"] and fit["steps"] > 0
    assert fit["loss_fit"] < fit["loss_init"] and fit["settings"]["subset"] == 0.1
    r1 = first.rotation.r1
    start = offline.r1_hadamard(r1.shape[0], cfg.seed)
    torch.testing.assert_close(r1.T @ r1, torch.eye(r1.shape[0], dtype=r1.dtype), rtol=0, atol=1e-8)
    assert not torch.allclose(r1, start, atol=1e-4)  # fitted, not the initialisation
    (path,) = tmp_path.glob("r1-whip-*.pt")
    # another weight setting of the same seed reuses the fitted R1; a weight-cache hit still reports its log
    again = build_quantized_model(cfg.override(w_bits=3), cache_dir=tmp_path, base=base, corpus=corpus)
    assert again.rotation_fit["cache_hit"] and torch.equal(again.rotation.r1, r1)
    hit = build_quantized_model(cfg.override(r3="pairwise_only"), cache_dir=tmp_path, base=base, corpus=corpus)
    assert hit.weight_cache_hit and hit.rotation_fit["loss_fit"] == fit["loss_fit"]
    path.write_bytes(b"not a torch file")
    with caplog.at_level("WARNING"):
        refit = build_quantized_model(cfg.override(w_bits=2), cache_dir=tmp_path, base=base, corpus=corpus)
    assert path.name in caplog.text and not refit.rotation_fit["cache_hit"]
    torch.testing.assert_close(refit.rotation.r1, r1, rtol=0, atol=1e-12)  # the same deterministic fit


def test_weight_cache_is_shared_by_r3_variants(embedded_model, corpus, tmp_path):
    base = tiny_base(embedded_model)
    cfg = RunConfig.from_flat(**TINY, r3="hadamard", gptq=GPTQConfig(grid=20))
    counters = pipeline.PipelineCounters()
    gptq0 = gptq.GPTQ_CALLS["model"]
    first = build_quantized_model(cfg, cache_dir=tmp_path, base=base, corpus=corpus, counters=counters)
    assert first.counters is counters
    assert not first.weight_cache_hit
    assert gptq.GPTQ_CALLS["model"] == gptq0 + 1
    assert len(list(tmp_path.glob("weights-*.pt"))) == 1

    other = cfg.override(r3="pairwise_only", estimator="k_only", k_bits=3)
    second = build_quantized_model(other, cache_dir=tmp_path, base=base, corpus=corpus, counters=counters)
    assert second.weight_cache_hit
    assert gptq.GPTQ_CALLS["model"] == gptq0 + 1  # no second GPTQ run
    assert counters == pipeline.PipelineCounters(weight_quantizations=1, weight_cache_hits=1,
                                                 calibration_passes=1)  # stats cached too
    sd1, sd2 = first.model.state_dict(), second.model.state_dict()
    assert sd1.keys() == sd2.keys()
    for k in sd1:
        assert torch.equal(sd1[k], sd2[k]), k
    np.testing.assert_array_equal(first.stats.pooled("rows").s11, second.stats.pooled("rows").s11)
    # Same R3 on both: identical outputs (the restored model also has the online R4 and act quantisers).
    first.reconfigure(other)
    ids = token_streams.calibration_windows(corpus, 1, 64, seed=7)
    with torch.no_grad():
        torch.testing.assert_close(first.model(ids).logits, second.model(ids).logits, rtol=0, atol=0)
    # A different weight setting misses the cache.
    third = build_quantized_model(cfg.override(w_bits=3), cache_dir=tmp_path, base=base,
                                  corpus=corpus)
    assert not third.weight_cache_hit and len(list(tmp_path.glob("weights-*.pt"))) == 2


def test_reconfigure_refuses_weight_changes(embedded_model, corpus):
    base = tiny_base(embedded_model)
    cfg = RunConfig.from_flat(**TINY, **OFF)
    qm = build_quantized_model(cfg, base=base, corpus=corpus)
    with pytest.raises(PipelineError, match="reconfigure"):
        qm.reconfigure(cfg.override(w_bits=4, weights="rtn"))
    qm.reconfigure(cfg.override(r3="pairwise_only", k_bits=4))
    assert [s.k_bits for s in qm.states] == [4, 4] and qm.transforms[0].name == "pairwise_only"


def test_static_control_scopes_run(embedded_model, corpus):
    base = tiny_base(embedded_model)
    results = {}
    for scope in (None, "act", "kv", "both"):
        cfg = RunConfig.from_flat(**TINY, w_bits=16, weights="none", a_bits=4, k_bits=4, v_bits=4,
                                  static_scope=scope, r3="pairwise_only")
        qm = build_quantized_model(cfg, base=base, corpus=corpus)
        has_kv = all(s.k_static is not None and s.v_static is not None for s in qm.states)
        assert has_kv == (scope in ("kv", "both"))
        results[scope] = run_cell(cfg, qm=qm)["ppl"]
    assert all(np.isfinite(v) for v in results.values())
    assert len({round(v, 6) for v in results.values()}) == 4  # each scope changes the quantisers


# ----------------------------------------------------------------------------- bad input


def test_models_the_pipeline_cannot_handle_fail_early(embedded_model):
    cfg = RunConfig.from_flat(**TINY, **OFF)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=64))
    with pytest.raises(attention.UnsupportedAttentionError):
        build_quantized_model(cfg, base=(gpt2, None))
    no_rope, _ = tiny_base(embedded_model)
    no_rope.model.rotary_emb = nn.Module()
    with pytest.raises(rope.MissingInvFreqError):
        build_quantized_model(cfg, base=(no_rope, None))
    odd, _ = tiny_base(embedded_model)
    for layer in odd.model.layers:
        layer.self_attn.head_dim = 15
    with pytest.raises(rope.OddHeadDimError):
        build_quantized_model(cfg, base=(odd, None))


# ----------------------------------------------------------------------------- embedded model


def test_unquantised_rotated_model_is_invariant_to_every_r3(embedded_model, corpus, rq_record):
    """R1/R2/R4 and any registry R3 (real φ̂ angles) leave the fp perplexity unchanged (≤ 1e-4 rel.)."""
    model, tok = embedded_model
    ids = corpus.eval_ids
    ref = evaluate.perplexity(model, ids, 256, max_windows=2).ppl
    cfg = RunConfig.from_flat(**OFF, seqlen=256, calib_windows=2, eval_windows=2)
    qm = build_quantized_model(cfg, base=embedded_model, corpus=corpus)
    assert np.abs(qm.angles).max() > 0.1  # real, non-trivial φ̂
    for name, block in R3_VARIANTS:
        c = cfg.override(r3=name, r3_block=block)
        ppl = run_cell(c, qm=qm.reconfigure(c))["ppl"]
        rq_record("R3 invariance (fp, rotated)", r3=name, ppl=ppl, ref=ref, rel=ppl / ref - 1)
        assert abs(ppl / ref - 1) <= 1e-4, (name, ppl, ref)


def test_k_only_4bit_keys_order_identity_pairwise_hadamard(embedded_model, corpus, rq_record):
    """W16A16K4V16, no R1/R2/R4: identity > pairwise_only(φ̂) > hadamard in perplexity, K range and K error.

    φ̂ from the K stream (estimator k_only). Measured here (8×512 calibration and evaluation windows,
    pydoc): ppl 13.92 / 13.63 / 12.65 (margins 2.1 % and 7.2 %), mean K range 14.78 / 13.11 / 9.66,
    relative K error 0.0178 / 0.0139 / 0.0075, in line with FACTS.md. (With the default ``rows``
    pooling, Q-dominated, pairwise φ̂ barely moves the K range: 14.74, ppl 14.09.)
    """
    cfg = RunConfig.from_flat(w_bits=16, a_bits=16, k_bits=4, v_bits=16, weights="none", r1="none", r2="none",
                              r4=False, r3="identity", estimator="k_only", seqlen=512, calib_windows=8,
                              eval_windows=8)
    qm = build_quantized_model(cfg, base=embedded_model, corpus=corpus)
    res = {}
    for name in ("identity", "pairwise_only", "hadamard"):
        c = cfg.override(r3=name)
        res[name] = run_cell(c, qm=qm.reconfigure(c))
        r = res[name]
        rq_record("K-only 4-bit keys (embedded, pydoc, 8x512)", r3=name, ppl=round(r["ppl"], 3),
                  k_range_mean=round(r["k_range_mean"], 3), k_rel_err=round(r["k_rel_err"], 5))
    fp = run_cell(cfg.override(k_bits=16), qm=qm.reconfigure(cfg.override(k_bits=16)))
    rq_record("K-only 4-bit keys (embedded, pydoc, 8x512)", r3="(fp keys)", ppl=round(fp["ppl"], 3))
    i, p, h = res["identity"], res["pairwise_only"], res["hadamard"]
    for metric in ("ppl", "k_range_mean", "k_rel_err"):
        assert i[metric] > p[metric] > h[metric], (metric, i[metric], p[metric], h[metric])
    assert h["ppl"] > fp["ppl"]
    # Paired over windows (measured: pairwise beats identity in 5/8 windows, Hadamard beats pairwise in 8/8).
    wins_p = sum(a > b for a, b in zip(i["window_nll"], p["window_nll"], strict=True))
    wins_h = sum(a > b for a, b in zip(p["window_nll"], h["window_nll"], strict=True))
    assert wins_p >= 5 and wins_h >= 7, (wins_p, wins_h)


def test_full_w4a4kv4_gptq_pipeline(embedded_model, corpus, rq_record, build_cache):
    """W4A4KV4 + GPTQ end to end on CPU, scored on 2×512 windows: finite perplexity, GPTQ beats RTN under the same
    rotations, and the rotated pipeline beats the unrotated one under the same (RTN) weights.

    The GPTQ build is the e2e layer's seed 0 (the same settings: 16×512 calibration tokens, seed 0), made once per
    session through the shared ``build_cache``; the RTN builds reuse its R1 fit."""
    model, _ = embedded_model
    eval_ppl = lambda m: evaluate.perplexity(m, corpus.eval_ids, 512, max_windows=2).ppl  # noqa: E731
    fp = eval_ppl(model)
    cfg = RunConfig.from_flat(seed=0, seqlen=512, calib_windows=16, eval_windows=12, r3="hadamard")
    out = {}
    rtn = cfg.override(weights="rtn")
    for label, c in (("rotated GPTQ", cfg), ("rotated RTN", rtn),
                     ("unrotated RTN", rtn.override(r1="none", r2="none", r4=False, r3="identity"))):
        qm = build_quantized_model(c, base=embedded_model, corpus=corpus, cache_dir=build_cache)
        out[label] = eval_ppl(qm.model)
        rq_record("W4A4KV4 pipeline (embedded, pydoc, 2x512)", cell=label, ppl=round(out[label], 3),
                  fp=round(fp, 3), weights_s=round(qm.timing["weights_s"], 1))
        if label == "rotated GPTQ":
            assert qm.weight_errors and all(0 <= e < 1 for e in qm.weight_errors.values())
            for name in ("pairwise_only", "identity"):
                c2 = c.override(r3=name, estimator="k_only")
                rq_record("W4A4KV4 pipeline (embedded, pydoc, 2x512)", cell=f"rotated GPTQ, R3 {name}",
                          ppl=round(eval_ppl(qm.reconfigure(c2).model), 3), fp=round(fp, 3))
        del qm
    assert all(np.isfinite(v) for v in out.values())
    assert fp < out["rotated GPTQ"] < out["rotated RTN"] < out["unrotated RTN"], out

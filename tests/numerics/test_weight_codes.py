"""The compact weight cache: integer codes + scales of GPTQ/RTN weights, dequantised bit for bit
(rope_quant.quant.packing and the weight-cache functions of rope_quant.experiment.pipeline)."""

from __future__ import annotations

import logging

import pytest
import torch

from rope_quant.corpora import token_streams
from rope_quant.experiment import weight_cache
from rope_quant.experiment.pipeline import GPTQConfig, RunConfig, build_quantized_model
from rope_quant.quant import gptq, gptq_solve, packing, rtn


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("n", [1, 7, 64])
def test_codes_round_trip(bits, n):
    g = torch.Generator().manual_seed(bits * 100 + n)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    codes = torch.randint(lo, hi + 1, (3, n), generator=g).float()
    codes[0, 0], codes[-1, -1] = lo, hi
    scales = torch.rand(3, 1, generator=g) + 0.01
    w = codes * scales
    wc = packing.WeightCodes.from_codes(codes, scales, bits, -1, w)
    assert packing.bitwise_equal(wc.dequantize(), w)
    assert packing.bitwise_equal(packing.from_dict(wc.to_dict()).dequantize(), w)
    if bits <= 4:
        assert wc.codes.dtype == torch.uint8 and wc.codes.numel() == (3 * n + 1) // 2


def test_negative_zero_is_kept_and_a_mismatch_is_refused():
    codes = torch.tensor([[0.0, 1.0, -1.0, 0.0]])
    scales = torch.tensor([[0.5]])
    w = torch.tensor([[-0.0, 0.5, -0.5, 0.0]])
    wc = packing.WeightCodes.from_codes(codes, scales, 4, -1, w)
    out = wc.dequantize()
    assert packing.bitwise_equal(out, w) and torch.signbit(out[0, 0]) and not torch.signbit(out[0, 3])
    assert packing.encode(w, wc) is wc
    assert packing.encode(w.abs(), wc) is None  # +0.0 where the codes say -0.0: not bit-identical
    assert packing.encode(w + 1e-7, wc) is None
    assert packing.encode(w, None) is None


@pytest.mark.parametrize("cfg", [GPTQConfig(grid=10), GPTQConfig(grid=10, group_size=8, act_order=False),
                                 GPTQConfig(grid=10, group_size=8, act_order=True), GPTQConfig(mse=False)],
                         ids=["row", "group-lazy", "group-actorder", "nomse"])
@pytest.mark.parametrize("bits", [3, 4, 8])
def test_gptq_and_rtn_codes_dequantise_bit_for_bit(cfg, bits):
    g = torch.Generator().manual_seed(0)
    W = torch.randn(24, 40, generator=g)
    X = torch.randn(200, 40, generator=g) * torch.linspace(0.1, 3, 40)
    H = 2 * X.T @ X / 200
    Q, codes, scales = gptq_solve._gptq(W, H, bits, cfg, 1.0)
    assert packing.bitwise_equal(Q, gptq.gptq_quantize(W, H, bits, cfg))  # the public path is unchanged
    wc = packing.WeightCodes.from_codes(codes, scales, bits, cfg.group_size, Q)
    assert packing.encode(Q, wc) is wc
    R, rcodes, rscales = rtn._rtn(W, bits, cfg.group_size, cfg.mse, 1.0, cfg.grid, cfg.max_shrink)
    assert packing.bitwise_equal(R, rtn.rtn_quantize(W, bits, cfg.group_size, cfg.mse, 1.0, cfg.grid, cfg.max_shrink))
    assert packing.encode(R, packing.WeightCodes.from_codes(rcodes, rscales, bits, cfg.group_size, R)) is not None


@pytest.fixture(scope="module")
def corpus(embedded_model):
    return token_streams.load_corpus("pydoc", embedded_model[1])


@pytest.mark.parametrize("weights", ["gptq", "rtn"])
def test_weight_cache_round_trip_is_bit_identical(tiny_base_model, corpus, tmp_path, weights, caplog):
    base = tiny_base_model
    cfg = RunConfig.from_flat(seqlen=64, calib_windows=4, eval_windows=2, weights=weights, gptq=GPTQConfig(grid=20),
                              r3="pairwise_only")
    first = build_quantized_model(cfg, cache_dir=tmp_path, base=base, corpus=corpus)
    (path,) = tmp_path.glob("weights-*.pt")
    payload = torch.load(path, map_location="cpu", weights_only=True)
    linears = {f"model.{n}.weight" for n in gptq.linear_names(first.model)}
    assert set(payload["codes"]) == linears and not linears & set(payload["state"])
    # the rotated embeddings and lm_head are left out, rebuilt from R1 on a hit (only their digests are kept)
    assert set(payload["derived"]) == {"model.embed_tokens.weight", "lm_head.weight"}
    assert not set(payload["derived"]) & set(payload["state"]) and payload["r1"] is not None
    second = build_quantized_model(cfg, cache_dir=tmp_path, base=base, corpus=corpus)
    assert second.weight_cache_hit
    sd1, sd2 = first.model.state_dict(), second.model.state_dict()
    assert sd1.keys() == sd2.keys()
    for k in sd1:
        assert packing.bitwise_equal(sd1[k], sd2[k]), k
    ids = token_streams.calibration_windows(corpus, 1, 64, seed=7)
    with torch.no_grad():
        assert torch.equal(first.model(ids).logits, second.model(ids).logits)
    # fp32 bytes of the coded weights vs their codes: 4-bit codes (0.5 B) + the -0.0 mask (0.125 B) + per-row
    # scales (4 B per 64 weights here)
    coded = sum(packing.from_dict(e).nbytes() for e in payload["codes"].values())
    full = sum(sd1[k].numel() * 4 for k in linears)
    assert coded < full / 5
    # a damaged codes section is warned about and recomputed
    payload["codes"][next(iter(linears))]["codes"] = torch.zeros(3, dtype=torch.uint8)
    torch.save(payload, path)
    with caplog.at_level(logging.WARNING, logger=weight_cache.log.name):
        third = build_quantized_model(cfg, cache_dir=tmp_path, base=base, corpus=corpus)
    assert not third.weight_cache_hit and "unreadable weight cache" in caplog.text
    for k in sd1:
        assert packing.bitwise_equal(sd1[k], third.model.state_dict()[k]), k


def _logits(qm, corpus) -> torch.Tensor:
    with torch.no_grad():
        return qm.model(token_streams.calibration_windows(corpus, 1, 64, seed=7)).logits


@pytest.mark.parametrize("r1", ["whip", "identity"])
def test_weight_cache_rebuilds_the_embeddings_or_recomputes(tiny_base_model, corpus, tmp_path, caplog, r1):
    """A hit rebuilds the left-out embeddings from R1 (or, without R1, keeps the model's own) bit for bit; a
    file whose digests do not match what the rebuild gives is warned about and recomputed; an older file that
    holds the embeddings still loads."""
    base = tiny_base_model
    cfg = RunConfig.from_flat(seqlen=64, calib_windows=4, eval_windows=2, weights="rtn", r3="hadamard", r1=r1)
    first = build_quantized_model(cfg, cache_dir=tmp_path, base=base, corpus=corpus)
    ref = _logits(first, corpus)
    (path,) = tmp_path.glob("weights-*.pt")
    payload = torch.load(path, map_location="cpu", weights_only=True)
    key = "model.embed_tokens.weight"
    # the digest covers every bit: one flipped mantissa bit in the rebuilt matrix is a mismatch
    emb = first.model.state_dict()[key].clone()
    assert weight_cache.digest(emb) == payload["derived"][key]
    emb.view(torch.int32)[0, 0] ^= 1
    assert weight_cache.digest(emb) != payload["derived"][key]

    bad = dict(payload, derived=dict(payload["derived"], **{key: "0" * 64}))
    torch.save(bad, path)
    with caplog.at_level(logging.WARNING, logger=weight_cache.log.name):
        second = build_quantized_model(cfg, cache_dir=tmp_path, base=base, corpus=corpus)
    assert not second.weight_cache_hit and "differs from the cached digest" in caplog.text
    assert torch.equal(_logits(second, corpus), ref)

    old = dict(payload, derived={}, state=dict(payload["state"], **{
        k: first.model.state_dict()[k].clone() for k in payload["derived"]}))
    torch.save(old, path)
    third = build_quantized_model(cfg, cache_dir=tmp_path, base=base, corpus=corpus)
    assert third.weight_cache_hit and torch.equal(_logits(third, corpus), ref)

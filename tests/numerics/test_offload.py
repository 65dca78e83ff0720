"""Layer streaming (rope_quant.model.offload, ``--offload cpu``): bookkeeping, function, pipeline coverage, and
(on CUDA) the GPU peak of one layer."""

from __future__ import annotations

import os

import pytest
import torch

from rope_quant.corpora import token_streams
from rope_quant.experiment import pipeline
from rope_quant.experiment.config import RunConfig
from rope_quant.model import offload
from rope_quant.quant import gptq, rtn
from tests._support import TINY, tiny_base
from tests._support.models import tiny_llama


def _logits(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False).logits


def test_one_unit_resident_at_a_time_in_order_and_the_function_is_unchanged():
    model = tiny_llama(96, layers=3)
    ids = torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(0))
    ref = _logits(model, ids)
    st = offload.enable(model, "cpu")  # the CPU stands in for the compute device: the bookkeeping is the same
    out = _logits(model, ids)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    units = ["embeddings", "model.rotary_emb", "layers.0", "layers.1", "layers.2", "model.norm", "lm_head"]
    assert st.events == [(what, u) for u in units for what in ("in", "out")]
    assert sorted(st.units) == sorted(units)  # every tensor of the model belongs to one unit
    assert st.max_resident == 1 and st.resident_units == []
    with pytest.raises(offload.OffloadError, match="already streamed"):
        offload.enable(model, "cpu")
    offload.disable(model)
    assert offload.streamer(model) is None and not model.model.layers[0]._forward_pre_hooks
    torch.testing.assert_close(_logits(model, ids), ref, rtol=0, atol=0)


def test_a_forward_stopped_inside_a_unit_is_evicted_by_the_next_unit():
    model = tiny_llama(96, layers=2)
    st = offload.enable(model, "cpu")
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    inputs = gptq.capture_layer_inputs(model, ids)  # raises inside layer 0's pre-hooks: no post-hook runs
    assert len(inputs) == 2 and st.max_resident == 1 and st.resident_units == ["layers.0"]


def test_gptq_streams_one_pinned_layer_and_gives_the_same_weights():
    ref, streamed = tiny_llama(96, layers=3), tiny_llama(96, layers=3)
    ids = torch.randint(0, 96, (4, 32), generator=torch.Generator().manual_seed(2))
    cfg = rtn.GPTQConfig(grid=20)
    err_ref = gptq.quantize_model_gptq(ref, ids, 4, cfg, progress=False)
    st = offload.enable(streamed, "cpu")
    err = gptq.quantize_model_gptq(streamed, ids, 4, cfg, progress=False)
    assert err == err_ref
    for (n, a), (_, b) in zip(ref.state_dict().items(), streamed.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    assert st.max_resident == 1
    layer_visits = [u for what, u in st.events if what == "in" and u.startswith("layers.")]
    assert layer_visits[-3:] == ["layers.0", "layers.1", "layers.2"]  # one pinned visit per layer, in order


def test_the_pipeline_streams_whip_gptq_calibration_and_evaluation_with_equal_results(embedded_model, tmp_path,
                                                                                        monkeypatch):
    base = tiny_base(embedded_model)
    corpus = token_streams.load_corpus("pydoc", base[1])
    cfg = RunConfig.from_flat(**TINY, r3="pairwise_only", weights="gptq", gptq=rtn.GPTQConfig(grid=20))
    plain = pipeline.run_cell(cfg, base=base, corpus=corpus)
    streamers: list[offload.Streamer] = []
    real_enable = offload.enable

    def recording(model, device, host="cpu"):
        streamers.append(real_enable(model, device, host))
        return streamers[-1]

    monkeypatch.setattr(offload, "enable", recording)
    monkeypatch.setattr(pipeline, "streams", lambda cfg, mode: True)  # stream on the CPU: the same hook path
    streamed = pipeline.run_cell(cfg, base=base, corpus=corpus)
    assert len(streamers) == 1 and streamers[0].max_resident == 1
    assert streamed["ppl"] == plain["ppl"] and streamed["window_nll"] == plain["window_nll"]
    assert streamed["rotation_fit"]["loss_fit"] == plain["rotation_fit"]["loss_fit"]  # whip saw the same samples
    ins = [u for what, u in streamers[0].events if what == "in"]
    n_layers = base[0].config.num_hidden_layers
    # whip samples, GPTQ capture + pinned layers, calibration and evaluation all went through the hooks
    # lm_head: the evaluation windows only (one 1024-row block each); whip's samples and calibration run the
    # decoder alone (their statistics never read a logit)
    assert ins.count("lm_head") == cfg.eval_windows
    # layers.1: whip samples (a forward per window), one pinned GPTQ visit (the calibration statistics are
    # gathered there, rope_quant.experiment.calibrate.DuringGPTQ), evaluation
    assert ins.count("layers.1") == cfg.calib_windows + 1 + cfg.eval_windows
    assert {f"layers.{i}" for i in range(n_layers)} <= set(ins)


def test_offload_on_the_cpu_is_a_validated_no_op():
    cfg = RunConfig.from_flat(**TINY)
    assert pipeline.streams(cfg, "cpu") is False and pipeline.streams(cfg, "none") is False
    assert pipeline.streams(cfg.override(device="cuda"), "cpu") is True
    with pytest.raises(ValueError):
        pipeline.streams(cfg, "disk")
    with pytest.raises(pipeline.PipelineError, match="resolved"):
        pipeline.streams(cfg, "auto")
    with offload.set_default_mode("cpu"):
        assert offload.default_mode() == offload.OffloadMode.CPU
        assert os.environ[offload.ENV_OFFLOAD] == "cpu"  # inherited by Slurm / submitit workers
    assert offload.default_mode() == offload.OffloadMode.NONE and offload.ENV_OFFLOAD not in os.environ
    with pytest.raises(offload.OffloadError, match="resolve"):
        with offload.set_default_mode("auto"):
            pass


def test_a_worker_reads_the_resolved_mode_from_its_environment(monkeypatch):
    monkeypatch.setenv(offload.ENV_OFFLOAD, "cpu")
    assert offload.default_mode() == offload.OffloadMode.CPU
    monkeypatch.setenv(offload.ENV_OFFLOAD, "disk")
    with pytest.raises(offload.OffloadError, match="must be none or cpu, got 'disk'"):
        offload.default_mode()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the CPU tests above cover the bookkeeping)")
def test_gpu_peak_is_one_layer_plus_activations():
    model = tiny_llama(32000, layers=6, hidden=1024, heads=8, kv_heads=8, intermediate=4096).to(torch.bfloat16)
    ids = torch.randint(0, 32000, (1, 256), generator=torch.Generator().manual_seed(0))
    ref = _logits(model.cuda(), ids.cuda()).float().cpu()
    model.cpu()
    torch.cuda.empty_cache()
    unit_bytes = {n: sum(p.numel() * p.element_size() for p in m.parameters())
                  for n, m in offload._units(model).items()}
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    offload.enable(model, "cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    out = _logits(model, ids.cuda()).float().cpu()
    peak = torch.cuda.max_memory_allocated() - start
    activations = 256 * 32000 * 4 * 3 + 256 * 4096 * 4 * 8  # logits (bf16 + fp32 copies) and MLP activations
    bound = max(unit_bytes.values()) + activations + (16 << 20)
    print(f"GPU peak {peak / 2**20:.1f} MiB, bound {bound / 2**20:.1f} MiB, model {model_bytes / 2**20:.1f} MiB")
    assert peak <= bound < model_bytes
    torch.testing.assert_close(out, ref, rtol=0, atol=0)

"""The calibration statistics gathered in GPTQ's own pass (rope_quant.experiment.calibrate.DuringGPTQ) against
the calibration pass over the finished model: bit for bit, on the tiny model of every supported architecture,
through the staged and the whole-layer GPTQ paths; and the pipeline's use of them (one pass fewer per GPTQ build,
the same statistics file as a weight-cache hit's own pass)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from rope_quant.calib.stats import CalibrationStats
from rope_quant.corpora import token_streams
from rope_quant.experiment import calibrate
from rope_quant.experiment.act_quant import forward_windows, install_activation_quantizers
from rope_quant.experiment.pipeline import GPTQConfig, PipelineCounters, RunConfig, build_quantized_model
from rope_quant.model import arch
from rope_quant.quant import gptq, rtn
from rope_quant.quant.quantizers import QuantConfig
from rope_quant.rotations import attention, online_r4
from tests._support import TINY, randomise_norms, tiny_base, tiny_gemma3, tiny_llama, tiny_qwen3

FAMILIES = {
    "llama": lambda: tiny_llama(128, layers=3, intermediate=96, max_positions=64),
    "gemma3": lambda: randomise_norms(tiny_gemma3(128, layers=3), -0.5, 0.5),
    "qwen3": lambda: randomise_norms(tiny_qwen3(128, layers=3), 0.5, 1.5),
}
WINDOWS = torch.randint(0, 128, (3, 40), generator=torch.Generator().manual_seed(0))


def _fresh(model) -> CalibrationStats:
    g = attention.check_model(model)
    return CalibrationStats(g.n_layers, g.n_q_heads, g.n_kv_heads, g.head_dim, sample_rows=16, sample_seed=0)


def _arrays(stats: CalibrationStats, path: Path) -> dict[str, bytes]:
    """Every array of the statistics file, as bytes."""
    stats.finalize()
    with np.load(stats.save(path), allow_pickle=False) as z:
        return {k: z[k].tobytes() for k in z.files}


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "whole-layer"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gptqs_pass_gathers_the_calibration_pass_statistics_bit_for_bit(family, staged, monkeypatch, tmp_path):
    model = FAMILIES[family]()
    if arch.spec_for(model).model_type == "llama":
        online_r4.install_online_r4(model)
    install_activation_quantizers(model, QuantConfig(bits=4))
    monkeypatch.setattr(gptq, "STAGED", staged)
    during = calibrate.DuringGPTQ(_fresh(model), WINDOWS.shape[0])
    with during.hooks(model):
        gptq.quantize_model_gptq(model, WINDOWS, 4, rtn.GPTQConfig(grid=10), progress=False,
                                 observe=during.observe)
    got = during.result()
    assert got is not None, dict(during.calls)
    ref = _fresh(model)
    with attention.calibration_hooks(model, ref):
        forward_windows(model, WINDOWS, "calibration", False)
    a, b = _arrays(got, tmp_path / "gptq.npz"), _arrays(ref, tmp_path / "pass.npz")
    assert a.keys() == b.keys() and [k for k in a if a[k] != b[k]] == []


def test_a_layer_observed_twice_or_never_gives_no_statistics():
    model = FAMILIES["llama"]()
    during = calibrate.DuringGPTQ(_fresh(model), 2)
    x = torch.randn(1, 8, 64)
    for layer in range(3):
        with during.observe(layer):
            for _ in range(2):
                during.update(layer, "q", x)
                during.update(layer, "k", x[..., :32])
    assert during.result() is not None
    with during.observe(1):
        during.update(1, "k", x[..., :32])  # a pass GPTQ repeated
    assert during.result() is None
    fresh = calibrate.DuringGPTQ(_fresh(model), 2)
    fresh.update(0, "q", x)  # outside observe: dropped, not counted
    assert fresh.calls == {} and fresh.result() is None  # no layer observed


def test_a_gptq_build_gathers_its_statistics_in_gptq_and_a_weight_hit_reads_the_same_file(
        embedded_model, tmp_path, monkeypatch):
    """One pass fewer per GPTQ build; deleting the statistics file makes the next build (a weight-cache hit) run
    the calibration pass, whose file is byte for byte the one GPTQ's pass wrote."""
    corpus = token_streams.load_corpus("pydoc", embedded_model[1])
    base = tiny_base(embedded_model)
    cfg = RunConfig.from_flat(**TINY, r3="hadamard", gptq=GPTQConfig(grid=20))
    passes = []
    real = calibrate.forward_windows
    monkeypatch.setattr(calibrate, "forward_windows", lambda *a, **k: (passes.append(1), real(*a, **k))[1])
    counters = PipelineCounters()
    first = build_quantized_model(cfg, cache_dir=tmp_path, base=base, corpus=corpus, counters=counters)
    assert passes == [] and counters == PipelineCounters(weight_quantizations=1, calibration_passes=1)
    (stats_file,) = tmp_path.glob("stats-*.npz")
    fused = stats_file.read_bytes()
    stats_file.unlink()
    again = build_quantized_model(cfg, cache_dir=tmp_path, base=base, corpus=corpus, counters=counters)
    assert again.weight_cache_hit and passes == [1]
    assert stats_file.read_bytes() == fused
    np.testing.assert_array_equal(first.angles, again.angles)

"""Calibration statistics on the device: the same whatever the number of windows per forward.

The K sample draws its keys per layer, so batching windows (what a GPU does where memory allows) changes no
key; the moments and candidates change only by float rounding of the batched forward.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rope_quant.calib.stats import CalibrationStats
from rope_quant.experiment import act_quant, calibrate, pipeline
from rope_quant.model import offload
from rope_quant.planning import plan_costs
from rope_quant.rotations import attention
from tests._support import ByteTokenizer, tiny_llama


def _stats(model: torch.nn.Module, windows: torch.Tensor, batch: int) -> CalibrationStats:
    geom = attention.check_model(model)
    stats = CalibrationStats(geom.n_layers, geom.n_q_heads, geom.n_kv_heads, geom.head_dim, topk=8,
                             sample_rows=40, sample_seed=3)
    with attention.calibration_hooks(model, stats):
        act_quant.forward_windows(model, windows, "calibration", False, batch=batch)
    stats.finalize()
    return stats


def test_windows_per_forward_do_not_change_the_statistics() -> None:
    model = tiny_llama(96, layers=2)
    windows = torch.randint(0, 96, (4, 24), generator=torch.Generator().manual_seed(0))
    one, four = _stats(model, windows, 1), _stats(model, windows, 4)
    a, b = one.moments.to_arrays(), four.moments.to_arrays()
    for key in a:
        np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-6, err_msg=key)
    for layer in range(2):
        rows1, pos1 = one.k_sample(layer)
        rows4, pos4 = four.k_sample(layer)
        assert np.array_equal(pos1, pos4)  # the same tokens: the keys do not depend on the batching
        assert np.array_equal(one.ksample.to_arrays()[f"sample_{layer}_keys"],
                              four.ksample.to_arrays()[f"sample_{layer}_keys"])
        np.testing.assert_allclose(rows4, rows1, rtol=1e-5, atol=1e-6)
        s1 = np.abs(one.candidates(layer)).sum(-1)
        s4 = np.abs(four.candidates(layer)).sum(-1)
        np.testing.assert_allclose(s4, s1, rtol=1e-5, atol=1e-6)


def test_calibration_batch_is_one_on_the_cpu_and_fills_a_share_of_free_gpu_memory(monkeypatch) -> None:
    model = tiny_llama(96, layers=2)
    assert calibrate.calibration_batch(model, 128, 2048) == 1
    monkeypatch.setattr(offload, "compute_device", lambda _m: torch.device("cuda"))
    free = [0]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda _d=None: (free[0], 80 << 30))
    cfg = model.config
    per_window = 2048 * (4 * (6 * cfg.hidden_size + 3 * cfg.intermediate_size) + 8 * 6 * (4 + 2) * 16)
    free[0] = int(3.5 * per_window / plan_costs.CALIB_MEMORY_FRACTION)
    assert calibrate.calibration_batch(model, 128, 2048) == 3
    free[0] = 0  # nothing free: still one window per forward (an OOM is then the stage's to report)
    assert calibrate.calibration_batch(model, 128, 2048) == 1
    free[0] = 1 << 50
    assert calibrate.calibration_batch(model, 128, 2048) == plan_costs.CALIB_MAX_BATCH
    assert calibrate.calibration_batch(model, 5, 2048) == 5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the CPU case is tested above)")
def test_device_statistics_equal_the_cpu_ones_on_cuda() -> None:
    model = tiny_llama(96, layers=2)
    windows = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    cpu = _stats(model, windows, 1)
    gpu = _stats(model.cuda(), windows, 2)
    for key, value in cpu.moments.to_arrays().items():
        np.testing.assert_allclose(gpu.moments.to_arrays()[key], value, rtol=1e-4, atol=1e-5, err_msg=key)


def test_the_pipeline_calibrates_a_batch_of_windows_like_one_at_a_time(monkeypatch) -> None:
    """Through the whole build (activation quantisers, R4, the collect-mode attention): two windows per forward
    give the statistics of one window per forward (the same K-sample tokens; moments to float32 rounding)."""
    import copy

    from rope_quant.experiment.config import RunConfig

    model = tiny_llama(256, layers=2, tied=True)
    cfg = RunConfig.from_flat(model="tiny", corpus="pydoc", seed=0, r3="hadamard", weights="rtn", a_bits=4,
                              k_bits=4, v_bits=4, seqlen=64, calib_windows=4, eval_windows=2)
    out = {}
    for batch in (1, 2):
        monkeypatch.setattr(calibrate, "calibration_batch", lambda *_a, _b=batch: _b)
        qm = pipeline.build_quantized_model(cfg, base=(copy.deepcopy(model), ByteTokenizer()))
        out[batch] = qm.stats
    a, b = out[1].moments.to_arrays(), out[2].moments.to_arrays()
    for key in a:
        np.testing.assert_allclose(b[key], a[key], rtol=1e-4, atol=1e-5, err_msg=key)
    for layer in range(2):
        assert np.array_equal(out[1].k_sample(layer)[1], out[2].k_sample(layer)[1])

"""The calibration pass waits on the host a small constant number of times, not per layer-window.

The pre-RoPE q/k statistics (moments, top-k candidates, K sample) accumulate on the activations' device and
are copied to the host once at the end of the pass (:meth:`CalibrationStats.finalize`). Counted on the CPU with
:func:`tests._support.host_syncs.count_host_syncs` (each counted call would make a GPU wait for the host) on a
tiny random Llama at 2 and 4 layers × 2 and 4 windows; the marginal count per added layer-window must be at
most 2 (before the device path, with a host copy and a numpy reduction per q/k output: 4 per layer-window and
10 per layer at these settings, 23 syncs at 2 layers × 2 windows).

The activation quantisers are off here (``a_bits=16``) so that the count is the statistics' own; the fake
quantisers that run inside the same forwards with ``a_bits=4`` have their own count in
``tests/numerics/test_host_syncs.py``. What remains is per pass or per forward: the calibration-window hash
(1), the final copy (``.cpu`` + ``.numpy``, 2), reading each layer's inv_freq once when the hooks are
installed (2 per layer), and transformers' causal-mask check (1 per forward).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from rope_quant.experiment import pipeline
from rope_quant.experiment.config import RunConfig
from tests._support import ByteTokenizer, tiny_llama
from tests._support.host_syncs import count_host_syncs, marginal


def _calibration_syncs(layers: int, windows: int, a_bits: int, monkeypatch: pytest.MonkeyPatch) -> int:
    """Host syncs counted inside the calibration pass (step 5) of one build."""
    counted: list[int] = []
    real = pipeline.calibrate

    def counting(*args: Any, **kwargs: Any) -> Any:
        with count_host_syncs() as counts:
            out = real(*args, **kwargs)
        counted.append(sum(counts.values()))
        return out

    monkeypatch.setattr(pipeline, "calibrate", counting)
    model = tiny_llama(256, layers=layers, tied=True)
    cfg = RunConfig.from_flat(model="tiny", corpus="pydoc", seed=0, r3="hadamard", weights="rtn", a_bits=a_bits,
                              k_bits=4, v_bits=4, seqlen=64, calib_windows=windows, eval_windows=2)
    pipeline.build_quantized_model(cfg, base=(copy.deepcopy(model), ByteTokenizer()))
    assert len(counted) == 1  # the pass ran once (no cache)
    return counted[0]


def test_calibration_syncs_per_layer_window(monkeypatch: pytest.MonkeyPatch) -> None:
    grid = {(layers, windows): _calibration_syncs(layers, windows, 16, monkeypatch)
            for layers in (2, 4) for windows in (2, 4)}
    per_layer_window, per_layer = marginal(grid)
    per_window = (grid[(2, 4)] - grid[(2, 2)]) / 2
    assert per_layer_window <= 2, grid
    assert per_layer <= 2, grid  # setup per layer only: the statistics' copy does not grow with the layers
    assert per_window <= 1, grid  # at most the forward's own mask check
    assert grid[(2, 2)] - 2 * per_layer - 2 * per_window <= 3, grid  # the hash and one copy to the host

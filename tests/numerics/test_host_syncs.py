"""Host synchronisations inside the window and column loops, counted on the CPU (tests/_support/host_syncs.py).

Each counted call (``Tensor.item``, ``.tolist``, ``.cpu``, ``.numpy``, ``__bool__``, ``__float__``, ``__int__``)
makes a GPU wait for the host. The evaluation of a cell and GPTQ are measured on the tiny random Llama at 2 and
4 layers × 2 and 4 windows; what must stay a small constant is the marginal count: per added layer-window (the
quantisers, the K diagnostics, the attention hook, the Hessian forwards) and per added layer (GPTQ: per linear
group, never per column). Calibration statistics and the whip fit are measured elsewhere.
"""

from __future__ import annotations

import copy

import pytest
import torch

from rope_quant.experiment import pipeline
from rope_quant.experiment.config import RunConfig
from rope_quant.quant import gptq, gptq_solve, rtn
from rope_quant.quant.quantizers import QuantConfig
from tests._support import tiny_llama
from tests._support.host_syncs import count_host_syncs, marginal

GRID = [(layers, windows) for layers in (2, 4) for windows in (2, 4)]


class _ByteTokenizer:
    """UTF-8 bytes as token ids (vocabulary 256): no tokenizer files needed."""

    def __call__(self, text: str, **_: object) -> dict[str, list[int]]:
        return {"input_ids": list(text.encode("utf-8"))}

    def get_vocab(self) -> dict[str, int]:
        return {chr(i): i for i in range(256)}


def _cfg(windows: int) -> RunConfig:
    return RunConfig.from_flat(model="tiny", corpus="pydoc", seed=0, r3="hadamard", weights="rtn", a_bits=4,
                               k_bits=4, v_bits=4, seqlen=64, calib_windows=windows, eval_windows=windows)


def test_evaluation_syncs_at_most_two_per_layer_window() -> None:
    counts: dict[tuple[int, int], int] = {}
    for layers, windows in GRID:
        cfg = _cfg(windows)
        qm = pipeline.build_quantized_model(cfg, base=(tiny_llama(256, layers=layers, tied=True), _ByteTokenizer()),
                                            progress=False)
        with count_host_syncs() as c:
            result = pipeline.run_cell(cfg, qm=qm)
        counts[(layers, windows)] = sum(c.values())
    per_lw, per_layer = marginal(counts)
    assert result is not None
    assert per_lw <= 2, (per_lw, counts)
    assert per_layer <= 2, (per_layer, counts)  # evaluation has no per-layer host work either


def _gptq_syncs(layers: int, windows: int) -> int:
    model = tiny_llama(128, layers=layers, intermediate=96, max_positions=64)
    pipeline.install_activation_quantizers(model, QuantConfig(bits=4))  # as the pipeline quantises with A4
    ids = torch.randint(0, 128, (windows, 32), generator=torch.Generator().manual_seed(0))
    with count_host_syncs() as c:
        gptq.quantize_model_gptq(model, ids, 4, rtn.GPTQConfig(grid=10), progress=False)
    return sum(c.values())


def test_gptq_syncs_per_linear_group_not_per_column() -> None:
    counts = {k: _gptq_syncs(*k) for k in GRID}
    per_lw, per_layer = marginal(counts)
    assert per_lw <= 2, (per_lw, counts)
    assert per_layer <= 30, (per_layer, counts)


def test_the_counter_sees_a_per_column_sync() -> None:
    """The measurement can fail: a column loop that reads one scalar per column shows up per layer."""
    real = gptq_solve._gptq_flagged

    def per_column_read(W, H, bits, cfg, clip_ratio):  # type: ignore[no-untyped-def]
        for j in range(W.shape[1]):
            float(H[j, j])
        return real(W, H, bits, cfg, clip_ratio)
    mp = pytest.MonkeyPatch()
    mp.setattr(gptq_solve, "_gptq_flagged", per_column_read)
    try:
        counts = {k: _gptq_syncs(*k) for k in [(2, 2), (4, 2)]}
    finally:
        mp.undo()
    assert (counts[(4, 2)] - counts[(2, 2)]) / 2 > 30, counts


def test_quantised_model_build_does_not_change_under_counting() -> None:
    """Counting wraps Tensor methods only: the evaluated model gives the same perplexity with and without it."""
    cfg = _cfg(2)
    base = (tiny_llama(256, layers=2, tied=True), _ByteTokenizer())
    qm = pipeline.build_quantized_model(cfg, base=(copy.deepcopy(base[0]), base[1]), progress=False)
    plain = pipeline.run_cell(cfg, qm=qm)
    with count_host_syncs():
        counted = pipeline.run_cell(cfg, qm=qm)
    plain.pop("timing"), counted.pop("timing")
    assert plain == counted and plain["ppl"] > 1

"""The seed-cost bench (tests/bench/bench_seed_cost.py) on the tiny random Llama: its code path runs in
seconds and prints every column (stages with their ratio, the counted GPTQ forwards, the seed with and without
its float-order replicate). Timings are printed by the script, never asserted."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from rope_quant.corpora import token_streams
from rope_quant.experiment.pipeline import RunConfig
from tests._support import ByteTokenizer, tiny_llama

BENCH = Path(__file__).resolve().parent / "bench_seed_cost.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_seed_cost", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def result():
    bench = _bench()
    base = (tiny_llama(256, layers=2, tied=True), ByteTokenizer())
    cfg = RunConfig.from_flat(model="tiny", corpus="pydoc", seed=0, seqlen=64, calib_windows=2, eval_windows=2,
                              whip_epochs=1)
    corpus = token_streams.load_corpus("pydoc", base[1])
    before = {k: v.clone() for k, v in base[0].state_dict().items()}
    out = bench.measure(base, cfg, corpus)
    assert all(torch.equal(v, base[0].state_dict()[k]) for k, v in before.items())  # the base is never written
    return bench, out


def test_every_column_is_reported(result):
    bench, out = result
    names = [name for name, _, _ in out["rows"]]
    for want in ("plain fp32 forward of the calibration tokens", "whip R1 + offline rotations",
                 "GPTQ (quantize_model_gptq)", "calibration statistics", "cell identity", "cell pairwise_only",
                 "fresh seed: build + cells", "replicate GPTQ (float64)", "fresh seed + replicate"):
        assert want in names, (want, names)
    plain = out["plain_forward_s"]
    for name, s, ratio in out["rows"]:
        assert s >= 0 and ratio == pytest.approx(s / plain), name
    text = bench.report(out)
    assert "x plain" in text and "linear passes" in text and "replicate GPTQ / primary GPTQ" in text


def test_forwards_are_counted_not_estimated(result):
    """The hooks see GPTQ's forwards: at least one pass of every linear per window (the Hessians need them),
    the same count for the float64 replicate (same algorithm, other float order)."""
    _, out = result
    seed, rep = out["seed"], out["replicate"]
    assert seed["linear_passes_per_layer"] >= 1.0
    assert rep["linear_passes_per_layer"] == seed["linear_passes_per_layer"]
    assert seed["cells"]["identity"]["ppl"] > 1 and rep["cells"]["identity"]["ppl"] > 1


def test_bad_flag_is_refused_before_loading(capsys):
    with pytest.raises(SystemExit) as exc:
        _bench().main(["--calib-windows", "0"])
    assert exc.value.code == 2
    assert "--calib-windows must be at least 1" in capsys.readouterr().err

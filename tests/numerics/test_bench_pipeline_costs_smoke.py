"""Smoke test of tests/bench/bench_pipeline_costs.py's ``fq`` and ``calibstats`` parts on a tiny random Llama: the
code paths the bench times run, every figure is printed, and the component timer leaves the model as it found it.
No time is asserted (the bench prints ratios)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch

from rope_quant.corpora import token_streams
from rope_quant.rotations import attention
from tests._support import ByteTokenizer, tiny_llama

BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH_DIR))
    try:
        import bench_pipeline_costs
        yield bench_pipeline_costs
    finally:
        sys.path.remove(str(BENCH_DIR))


def _printed(out: str, part: str) -> dict:
    line = next(row for row in out.splitlines() if row.startswith(part + " "))
    return ast.literal_eval(line[len(part) + 1:])


def test_fq_and_calibstats_parts_run_on_a_tiny_model(bench, capsys) -> None:
    tok = ByteTokenizer()
    base = (tiny_llama(256, layers=2, tied=True), tok)
    corpus = token_streams.load_corpus("pydoc", tok, use_cache=False)
    threads = torch.get_num_threads()
    try:
        bench.main(["--threads", "1", "--only", "fq,calibstats", "--fq-lengths", "32,64", "--rounds", "1",
                    "--repeats", "2", "--calib-windows", "2"], base=base, corpus=corpus)
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    fq = _printed(out, "fq")
    assert fq["r3"] == "hadamard"
    for length in (32, 64):
        row = fq[length]
        assert len(row["ratios"]) == 2 and min(row["plain_s"] + row["fq_s"]) > 0
        assert set(row["components_s"]) == {"quantisers", "R4", "R3"}  # each one ran inside the timed forward
    stats = _printed(out, "calibstats")
    assert len(stats["ratios"]) == 2 and min(stats["numpy_ms"] + stats["torch_ms"]) > 0
    assert "4 q / 2 kv heads, head_dim 16" in stats["shape"]


def test_component_timer_restores_what_it_wraps(bench) -> None:
    from rope_quant.core.transforms.base import FullHadamard
    from rope_quant.quant import quantizers
    from rope_quant.rotations import online_r4
    from rope_quant.rotations.attention import install_attention

    model = tiny_llama(96, layers=2)
    install_attention(model, [FullHadamard(16) for _ in range(2)])
    before = (quantizers.fake_quant_per_token, online_r4.online_r4)
    with bench._component_timer(model):
        assert quantizers.fake_quant_per_token is not before[0]
        assert all("apply" in vars(s.transform) for s in attention.attention_states(model))
    assert (quantizers.fake_quant_per_token, online_r4.online_r4) == before
    assert not any(vars(s.transform).keys() & {"apply", "apply_query", "apply_key"}
                   for s in attention.attention_states(model))


def test_an_unknown_part_is_refused_before_loading_anything(bench, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.main(["--only", "fq,bogus"], base=object(), corpus=object())
    assert exc.value.code == 2
    assert "--only: unknown part(s) bogus" in capsys.readouterr().err

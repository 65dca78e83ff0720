"""The static per-channel control of App. A.6 (rope_quant.experiment.static_control, rope_quant.sweep.static).

Tiny random Llama with the embedded tokenizer (``tests._support.tiny_base``): scales are
per channel and estimated from the evaluation-corpus windows of the target length, frozen during evaluation,
scope masks, the window cap, records, the CLI, resume, and the A.8 non-additivity arithmetic of the report.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from rope_quant import cli
from rope_quant.experiment import act_quant, pipeline, static_control
from rope_quant.experiment.config import PipelineError, StaticScope
from rope_quant.experiment.pipeline import RunConfig, build_quantized_model
from rope_quant.experiment.static_control import StaticProtocol, StaticWindowsError
from rope_quant.quant import diagnostic
from rope_quant.sweep import static
from rope_quant.sweep.loaded_models import ModelCache
from rope_quant.sweep.manifest import SweepError, config_from_dict
from tests._support import tiny_base

TINY = dict(seqlen=32, calib_windows=2, eval_windows=2, weights="rtn", r1="random_hadamard")


@pytest.fixture(scope="module")
def qm(embedded_model):
    cfg = RunConfig.from_flat(**TINY)
    return build_quantized_model(cfg, base=tiny_base(embedded_model))


def _logits(qm, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return qm.model(input_ids=ids).logits


# ----------------------------------------------------------------------------- windows


def test_static_windows_are_the_first_non_overlapping_windows_up_to_the_cap() -> None:
    ids = torch.arange(1000)
    w = static_control.static_windows(ids, 64, 64)
    assert w.shape == (15, 64)  # ⌊1000/64⌋ < 64
    assert torch.equal(w.flatten(), ids[:960])
    assert static_control.static_windows(ids, 64, 4).shape == (4, 64)  # the budget knob caps it
    assert torch.equal(static_control.static_windows(ids, 10, 3), ids[:30].reshape(3, 10))
    with pytest.raises(StaticWindowsError, match="1000 tokens"):
        static_control.static_windows(ids, 2000)
    with pytest.raises(PipelineError, match="max_windows"):
        static_control.static_windows(ids, 10, 0)


def test_source_is_the_evaluation_stream_unless_calibration_split(qm) -> None:
    ev = qm.corpus.eval_ids
    assert static_control.source_ids("transductive", ev, qm.corpus) is ev
    assert static_control.source_ids(StaticProtocol.CALIBRATION_SPLIT, ev, qm.corpus) is qm.corpus.calib_ids


# ----------------------------------------------------------------------------- scales


def _reference_act_ranges(qm, windows: torch.Tensor, names: list[str]) -> dict[str, tuple]:
    """Per-channel min/max over every token of each linear's input, with the activation quantisers removed
    and K/V dynamic (what the act-scope estimation pass sees), computed independently."""
    mods = dict(act_quant.decoder_linears(qm.model))
    pipeline.remove_activation_quantizers(qm.model, qm.act_handles)
    seen: dict[str, list] = {n: [] for n in names}
    hooks = [mods[n].register_forward_pre_hook(lambda m, a, _n=n: seen[_n].append(a[0].detach().clone()))
             for n in names]
    try:
        for row in windows:
            _logits(qm, row.unsqueeze(0))
    finally:
        for h in hooks:
            h.remove()
        qm.act_handles = pipeline.install_activation_quantizers(qm.model, qm.cfg.quant.a)
    out = {}
    for n in names:
        flat = torch.cat([t.reshape(-1, t.shape[-1]) for t in seen[n]])
        out[n] = (flat.amin(0), flat.amax(0))
    return out


def test_act_scales_are_per_channel_min_max_across_tokens_of_the_windows(qm) -> None:
    windows = static_control.static_windows(qm.corpus.eval_ids, 32, 3)
    scales = static_control.estimate_scales(qm, windows, "act")
    names = ["layers.0.self_attn.q_proj", "layers.1.mlp.down_proj", "layers.1.self_attn.o_proj"]
    ref = _reference_act_ranges(qm, windows, names)
    mods = dict(act_quant.decoder_linears(qm.model))
    assert set(scales.act) == set(mods) and scales.k is None and scales.v is None
    for n in names:
        q = scales.act[n]
        assert q.lo.shape == (mods[n].in_features,) and q.frozen  # one range (one step) per channel
        torch.testing.assert_close(q.lo, ref[n][0], rtol=0, atol=0)
        torch.testing.assert_close(q.hi, ref[n][1], rtol=0, atol=0)
        assert q.step().shape == (mods[n].in_features,)
        assert torch.unique(q.step()).numel() > 1  # channels differ: not a per-tensor scale
    rec = scales.record()
    assert rec["scope"] == "act" and rec["windows"] == 3 and rec["length"] == 32 and rec["tokens"] == 96


def test_kv_scales_are_per_channel_over_post_r3_keys(qm) -> None:
    windows = static_control.static_windows(qm.corpus.eval_ids, 32, 2)
    scales = static_control.estimate_scales(qm, windows, "kv")
    assert scales.act is None and len(scales.k) == len(scales.v) == qm.geometry.n_layers
    width = qm.geometry.head_dim * qm.geometry.n_kv_heads
    seen: list = []
    states = qm.states
    saved = [(s.k, s.v) for s in states]
    from rope_quant.quant.quantizers import QuantConfig

    for s in states:
        s.k = s.v = QuantConfig()
        s.observers.append(lambda layer, k, v: seen.append((layer, act_quant.heads_last(k).reshape(-1, width))))
    try:
        for row in windows:
            _logits(qm, row.unsqueeze(0))
    finally:
        for s, (k, v) in zip(states, saved, strict=True):
            s.observers.clear()
            s.k, s.v = k, v
    for layer in range(qm.geometry.n_layers):
        ks = torch.cat([k for i, k in seen if i == layer])
        assert scales.k[layer].q.lo.shape == (width,)
        torch.testing.assert_close(scales.k[layer].q.lo, ks.amin(0), rtol=0, atol=0)
        torch.testing.assert_close(scales.k[layer].q.hi, ks.amax(0), rtol=0, atol=0)


def test_scales_follow_the_target_length_and_protocol(qm) -> None:
    ev = qm.corpus.eval_ids
    a = static_control.estimate_scales(qm, static_control.static_windows(ev, 32, 2), "kv")
    b = static_control.estimate_scales(qm, static_control.static_windows(ev, 64, 2), "kv")
    c = static_control.estimate_scales(qm, static_control.static_windows(qm.corpus.calib_ids, 32, 2), "kv")
    again = static_control.estimate_scales(qm, static_control.static_windows(ev, 32, 2), "kv")
    assert torch.equal(a.k[0].q.lo, again.k[0].q.lo)  # deterministic
    assert not torch.equal(a.k[0].q.hi, b.k[0].q.hi)  # re-estimated per length
    assert not torch.equal(a.k[0].q.hi, c.k[0].q.hi)  # the evaluation corpus, not the calibration split


def test_scales_are_fixed_during_evaluation_and_the_model_is_restored(qm) -> None:
    ev = qm.corpus.eval_ids
    probe = ev[:32].unsqueeze(0)
    dynamic = _logits(qm, probe)
    scales = static_control.estimate_scales(qm, static_control.static_windows(ev, 32, 2), "both")
    assert torch.equal(_logits(qm, probe), dynamic)  # estimation leaves the dynamic model as it was
    snap = {n: (q.lo.clone(), q.hi.clone()) for n, q in scales.act.items()}
    ksnap = [q.q.hi.clone() for q in scales.k]
    with static_control.applied(qm, scales):
        first = _logits(qm, probe)
        _logits(qm, torch.randint(0, 1000, (1, 48)) * 7)  # other inputs, larger outliers
        _logits(qm, ev[100:164].unsqueeze(0))
        assert torch.equal(_logits(qm, probe), first)  # the same scales answer the probe identically
        assert not torch.equal(first, dynamic)
    for n, q in scales.act.items():
        assert torch.equal(q.lo, snap[n][0]) and torch.equal(q.hi, snap[n][1])
    assert all(torch.equal(q.q.hi, h) for q, h in zip(scales.k, ksnap, strict=True))
    from rope_quant.quant.quantizers import QuantConfigError

    with pytest.raises(QuantConfigError, match="frozen"):
        next(iter(scales.act.values())).observe(torch.zeros(1, 64))
    assert torch.equal(_logits(qm, probe), dynamic)  # dynamic quantisers back after the block


@pytest.mark.parametrize(("scope", "expected"), [
    ("act", {"act/static", "k/dynamic", "v/dynamic"}),
    ("kv", {"act/dynamic", "k/static", "v/static"}),
    ("both", {"act/static", "k/static", "v/static"}),
])
def test_scope_masks(qm, scope: str, expected: set[str]) -> None:
    ev = qm.corpus.eval_ids
    scales = static_control.estimate_scales(qm, static_control.static_windows(ev, 32, 1), scope)
    with static_control.applied(qm, scales), diagnostic.recording() as rec:
        _logits(qm, ev[:32].unsqueeze(0))
    assert set(rec.summary()) == expected
    with diagnostic.recording() as rec:
        _logits(qm, ev[:32].unsqueeze(0))
    assert set(rec.summary()) == {"act/dynamic", "k/dynamic", "v/dynamic"}


def test_static_control_refuses_a_model_built_static(embedded_model) -> None:
    cfg = RunConfig.from_flat(**TINY, static_scope="kv")
    built = build_quantized_model(cfg, base=tiny_base(embedded_model))
    with pytest.raises(PipelineError, match="dynamic"):
        static_control.estimate_scales(built, torch.zeros(1, 8, dtype=torch.long), "kv")


# ----------------------------------------------------------------------------- cells, records


def test_static_config_round_trip_and_keys() -> None:
    run = RunConfig.from_flat(**TINY)
    cfg = static.StaticConfig(run, (32, 64), "both", "transductive", 8)
    assert config_from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    keys = {cfg.key(), static.StaticConfig(run, (32, 64), "act", "transductive", 8).key(),
            static.StaticConfig(run, (32, 64), "both", "calibration-split", 8).key(),
            static.StaticConfig(run, (32, 64), "both", "transductive", 64).key(),
            static.StaticConfig(run, (32, 64), None).key()}
    assert len(keys) == 5
    assert cfg.weight_key() == run.weight_key()  # paired: the dynamic cells' weights
    with pytest.raises(SweepError, match="scope"):
        static.StaticConfig(run, (32,), "weights")
    with pytest.raises(SweepError, match="protocol"):
        static.StaticConfig(run, (32,), "both", "leave-one-out")
    with pytest.raises(SweepError, match="max_windows"):
        static.StaticConfig(run, (32,), "both", max_windows=0)
    with pytest.raises(SweepError, match="dynamic"):
        static.StaticConfig(run.override(static_scope="act"), (32,))


def test_evaluate_static_cell_records_protocol_scope_and_window_counts(qm) -> None:
    cfg = static.StaticConfig(qm.cfg, (32, 64), "both", "transductive", 3)
    res = static.evaluate_static_cell(cfg, qm)
    n_eval = qm.corpus.eval_ids.numel()
    for length in (32, 64):
        entry = res["lengths"][str(length)]
        assert entry["n_windows"] == 2 and 1 < entry["ppl"] < 1e6
        st = entry["static"]
        assert st["windows"] == min(3, n_eval // length) and st["length"] == length
        assert st["available_windows"] == n_eval // length and st["protocol"] == "transductive"
        assert "evaluation split" in st["source"]
        assert "quant_diagnostic" not in entry
    assert res["static"]["transductive"] is True and res["static"]["scope"] == "both"
    assert any("at most 3 estimation windows" in d for d in res["static"]["deviations"])
    dyn = static.evaluate_static_cell(static.StaticConfig(qm.cfg, (32,), None, quant_diagnostic=True), qm)
    assert "static" not in dyn["lengths"]["32"] and dyn["static"]["deviations"] == []
    assert dyn["lengths"]["32"]["quant_diagnostic"]["k/dynamic"]["evaluations"] == 2 * qm.geometry.n_layers


# ----------------------------------------------------------------------------- CLI, resume, report


def test_cli_static_runs_records_and_resumes(tmp_path: Path, capsys, embedded_model) -> None:
    models = ModelCache()
    models.put("smollm2-135m", "cpu", tiny_base(embedded_model))
    out = tmp_path / "static"
    argv = ["static", "--out", str(out), "--seeds", "0", "--configs", "hadamard,pairwise_only",
            "--scopes", "dynamic,both", "--lengths", "32", "--static-windows", "2", "--seqlen", "32",
            "--calib-windows", "2", "--eval-windows", "1", "--weights", "rtn", "--no-w-mse", "--r1",
            "random_hadamard", "--no-figures", "--quant-diagnostic", "--cache-dir", str(tmp_path / "cache")]
    assert cli.main(argv, models=models) == 0
    printed = capsys.readouterr().out
    assert "static protocol: transductive" in printed
    assert "deviation from A.6: at most 2 estimation windows per length" in printed
    assert "4 ran, 0 already complete" in printed
    rec = json.loads(next((out / "cells" / "pairwise_only.both").glob("seed0-*.json")).read_text())
    st = rec["result"]["lengths"]["32"]["static"]
    assert st["scope"] == "both" and st["windows"] == 2 and st["protocol"] == "transductive"
    assert rec["result"]["static"]["max_windows"] == 2
    assert rec["result"]["lengths"]["32"]["quant_diagnostic"]["act/static"]["evaluations"] > 0
    text = (out / "static.md").read_text()
    assert "pairwise_only − hadamard" in text and "Quantiser-step diagnostic" in text
    assert "transductive" in text
    rows = (out / "tables" / "static-contrasts.csv").read_text().splitlines()
    assert rows[0].startswith("L,scope,contrast") and len(rows) == 3  # dynamic and both
    assert cli.main(argv, models=models) == 0
    assert "0 ran, 4 already complete" in capsys.readouterr().out
    bad = cli.main([*argv[:-2], "--scopes", "dynamic,weights"], models=models)
    assert bad == 2 and "unknown static scope 'weights'" in capsys.readouterr().err


def test_report_contrasts_and_non_additivity_arithmetic(tmp_path: Path, capsys) -> None:
    """A fake cell function with known perplexities: the report's gaps and the A.8 interaction."""
    base = {"hadamard": 10.0, "pairwise_only": 11.0, "pairwise_plus_hadamard": 10.5}
    shift = {"dynamic": 0.0, "act": 2.0, "kv": 1.0, "both": 5.0}  # both ≠ act + kv: interaction +2 on ppl

    def fake(cfg):
        run = cfg.run
        extra = {"dynamic": 0.0, "act": -0.5, "kv": 0.0, "both": -3.0}[static.scope_name(cfg.scope)]
        bump = extra + (0.0, 0.01, -0.01)[run.seed] if run.r3 == "pairwise_only" else 0.0
        ppl = base[run.r3] + shift[static.scope_name(cfg.scope)] + bump + 0.1 * run.seed
        return {"lengths": {str(L): {"ppl": ppl + L / 1000, "n_windows": 1} for L in cfg.lengths},
                "static": {"transductive": cfg.scope is not None, "deviations": []}}

    out = tmp_path / "fake"
    code = cli.main(["static", "--out", str(out), "--seeds", "0,1,2", "--lengths", "64,128", "--no-figures",
                     "--quiet"], cell_fn=fake)
    assert code == 0, capsys.readouterr().err
    rows = {(r["L"], r["scope"], r["contrast"]): r for r in
            csv.DictReader((out / "tables" / "static-contrasts.csv").open())}
    assert float(rows[("64", "both", "pairwise_only − hadamard")]["mean"]) == pytest.approx(1.0 - 3.0)
    assert float(rows[("128", "dynamic", "pairwise_only − hadamard")]["mean"]) == pytest.approx(1.0)
    assert float(rows[("64", "act", "pairwise_plus_hadamard − hadamard")]["mean"]) == pytest.approx(0.5)
    na = {(r["L"], r["quantity"]): r for r in csv.DictReader((out / "tables" / "static-nonadditivity.csv").open())}
    assert float(na[("64", "ppl(hadamard)")]["interaction"]) == pytest.approx(5.0 - 3.0)
    (out / "static.md").unlink()
    assert cli.main(["report", str(out), "--no-figures"]) == 0  # `report` rewrites the static tables too
    assert "Non-additivity of the static scopes" in capsys.readouterr().out and (out / "static.md").is_file()
    gap = na[("128", "gap(pairwise_only − hadamard)")]
    assert float(gap["effect_both"]) == pytest.approx(-3.0) and float(gap["effect_sum"]) == pytest.approx(-0.5)
    assert float(gap["interaction"]) == pytest.approx(-2.5)


def test_scope_enum_and_cli_names_agree() -> None:
    assert {s.value for s in StaticScope} == {"act", "kv", "both"}
    assert static.parse_scope("dynamic") is None and static.parse_scope("kv") == StaticScope.KV

"""The run configuration (rope_quant.experiment.config): composed specs, flat names, versioned keys that
hash only non-default fields, nested and legacy dicts, enums behind the CLI choices, and a results
directory that resumes with zero recomputed cells after a new defaulted field is added."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from rope_quant import cli
from rope_quant.experiment import config
from rope_quant.experiment.config import (
    KEY_VERSION,
    Budget,
    DType,
    Estimator,
    Objective,
    PipelineError,
    RunConfig,
    WeightMode,
    flat_fields,
)
from rope_quant.quant.rtn import GPTQConfig
from rope_quant.sweep import presets
from rope_quant.sweep.manifest import load_manifest, manifest_from_dict, read_manifest
from rope_quant.sweep.runner import run_cells

#: The field names of the former flat RunConfig (old manifests and cell records store these).
LEGACY_FIELDS = ("model", "corpus", "seed", "w_bits", "a_bits", "k_bits", "v_bits", "a_group", "k_group", "v_group",
                 "a_clip", "k_clip", "v_clip", "w_clip", "weights", "static_scope", "r1", "r2", "r4", "r3", "r3_block",
                 "estimator", "objective", "position_average", "average_length", "seqlen", "calib_windows",
                 "eval_windows", "gptq", "device", "dtype")


class Cell:
    """A fake cell function counting its calls."""

    def __init__(self) -> None:
        self.calls: list = []

    def __call__(self, cfg) -> dict:
        self.calls.append(cfg)
        return {"ppl": 10.0 + len(cfg.r3) / 10 + cfg.seed, "n_windows": 1, "k_range_mean": 1.0, "k_rel_err": 0.1}


def with_new_budget_field(default: int = 7) -> type[RunConfig]:
    """RunConfig as it would be after adding ``Budget.new_knob`` (with a default) to the code."""
    budget = dataclasses.make_dataclass("Budget", [("new_knob", int, dataclasses.field(default=default))],
                                        bases=(Budget,), frozen=True)
    return dataclasses.make_dataclass(
        "RunConfig", [("budget", budget, dataclasses.field(default_factory=budget))], bases=(RunConfig,), frozen=True)


# ----------------------------------------------------------------------------- keys


def test_keys_carry_the_version_and_hash_only_non_default_fields():
    cfg = RunConfig()
    for key in (cfg.key(), cfg.weight_key(), cfg.stats_key()):
        assert key.startswith(f"v{KEY_VERSION}-") and len(key) == len(f"v{KEY_VERSION}-") + 16
    # Setting a field to its default value is no change at all.
    explicit = RunConfig.from_flat(k_bits=4, seqlen=2048, estimator="rows", gptq=GPTQConfig(), device="cpu")
    assert explicit.key() == cfg.key() and explicit.weight_key() == cfg.weight_key()
    # Any non-default value changes the key.
    for change in (dict(k_bits=3), dict(seqlen=1024), dict(gptq=GPTQConfig(grid=20)), dict(device="cuda"),
                   dict(a_symmetric=True), dict(r3="identity"), dict(seed=1)):
        assert cfg.override(**change).key() != cfg.key(), change


def test_weight_and_stats_keys_follow_the_specs_that_shape_them():
    cfg = RunConfig()
    assert cfg.weight_fields() == {"format": config.WEIGHT_CACHE_FORMAT, "runtime": {}, "rotation": {},
                                   "weights": {}, "calibration": {}, "activations": {}}
    for change in (dict(eval_windows=2), dict(device="cuda"), dict(v_clip=0.5),
                   dict(objective="linf", estimator="k_only")):
        other = cfg.override(**change)
        assert other.weight_key() == cfg.weight_key() and other.stats_key() == cfg.stats_key(), change
    off = cfg.override(weights="none")
    assert off.override(w_bits=3, gptq=GPTQConfig(grid=5), a_bits=8).weight_key() == off.weight_key()
    rtn = cfg.override(weights="rtn")
    assert rtn.override(gptq=GPTQConfig(act_order=False)).weight_key() == rtn.weight_key()  # GPTQ-only field
    assert rtn.override(gptq=GPTQConfig(mse=False)).weight_key() != rtn.weight_key()  # shapes RTN's scales too
    whip = rtn.override(r1="whip")
    assert whip.override(calib_windows=3).weight_key() != whip.weight_key()  # whip fits on the calibration


def test_a_new_defaulted_field_keeps_every_key():
    new_cls = with_new_budget_field()
    assert "new_knob" in flat_fields(new_cls)
    for flat in ({}, dict(r3="pairwise_only", k_bits=3), dict(weights="rtn", seqlen=128, position_average=True)):
        old, new = RunConfig.from_flat(**flat), new_cls.from_flat(**flat)
        assert (old.key(), old.weight_key(), old.stats_key()) == (new.key(), new.weight_key(), new.stats_key())
        assert new.override(new_knob=8).key() != new.key()
        knob = new.override(new_knob=8)  # a budget field: part of the calibration sample
        assert knob.stats_key() != new.stats_key()
        assert (knob.weight_key() != new.weight_key()) == new.uses_calibration_for_weights  # not for RTN


# ----------------------------------------------------------------------------- dicts and flat names


def test_nested_round_trip_and_flat_names():
    cfg = RunConfig.from_flat(r3="block_hadamard", r3_block=8, estimator="per_head", k_bits=3, k_group=16,
                              static_scope="kv", gptq=GPTQConfig(mse=False), eval_windows=2, dtype="bfloat16")
    data = json.loads(json.dumps(cfg.to_dict()))
    assert data["online"]["transform"] == "block_hadamard" and data["quant"]["k"]["group_size"] == 16
    again = RunConfig.from_dict(data)
    assert again == cfg and again.key() == cfg.key()
    assert cfg.k_bits is cfg.quant.k.bits and cfg.r3 == "block_hadamard" and cfg.gptq.mse is False
    assert cfg.estimator is Estimator.PER_HEAD and cfg.runtime.dtype is DType.BFLOAT16
    assert RunConfig.from_flat(**cfg.flat()) == cfg
    with pytest.raises(PipelineError, match="valid: model, corpus, seed"):
        cfg.override(k_bitz=3)
    with pytest.raises(AttributeError):
        _ = cfg.no_such_field
    partial = {"seed": 2, "budget": {"seqlen": 64}}  # missing fields (e.g. ones added later) take defaults
    assert RunConfig.from_dict(partial) == RunConfig.from_flat(seed=2, seqlen=64)


def test_old_flat_dicts_load():
    cfg = RunConfig.from_flat(r3="pairwise_only", estimator="k_only", weights="rtn", w_bits=3, static_scope="act",
                              gptq=GPTQConfig(mse=False), average_length=99, eval_windows=4)
    old = {name: getattr(cfg, name) for name in LEGACY_FIELDS}
    old["gptq"] = dataclasses.asdict(old["gptq"])
    old = json.loads(json.dumps(old))
    assert set(old) == set(LEGACY_FIELDS) and old["weights"] == "rtn"
    assert RunConfig.from_dict(old) == cfg
    assert config.RunConfig.from_dict({"r3": "identity"}) == RunConfig.from_flat(r3="identity")


# ----------------------------------------------------------------------------- enums and the CLI


def _choices(parser: argparse.ArgumentParser, command: str) -> dict[str, tuple]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return {a.dest: tuple(a.choices) for a in sub._actions if a.choices is not None}


def test_every_enum_drives_the_cli_choices(capsys):
    choices = _choices(cli.build_parser(), "compare")
    assert choices["estimator"] == tuple(e.value for e in Estimator)
    assert choices["objective"] == tuple(o.value for o in Objective)
    assert choices["weights"] == tuple(w.value for w in WeightMode)
    assert choices["dtype"] == ("auto", *(d.value for d in DType))  # auto: bf16 on CUDA, fp32 on CPU
    assert cli.main(["compare", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for enum_cls in (Estimator, Objective, WeightMode):
        assert "{" + ",".join(m.value for m in enum_cls) + "}" in text.replace(", ", ",")
    assert "{auto," + ",".join(m.value for m in DType) + "}" in text.replace(", ", ",")


# ----------------------------------------------------------------------------- resume


def test_results_directory_resumes_after_a_new_defaulted_field(tmp_path: Path, monkeypatch):
    out = tmp_path / "cmp"
    argv = ["compare", "--out", str(out), "--seeds", "0,1", "--no-figures", "--quiet", "--seqlen", "64"]
    first = Cell()
    assert cli.main(argv, cell_fn=first) == 0
    assert len(first.calls) == 8

    # The code gains Budget.new_knob (default 7): the same command resumes with zero recomputed cells.
    new_cls = with_new_budget_field()
    monkeypatch.setattr(config, "RunConfig", new_cls)
    again = Cell()
    assert cli.main(argv, cell_fn=again) == 0
    assert again.calls == []
    manifest = load_manifest(out)  # rebuilt with the new class: every recorded key matches
    assert all(isinstance(cfg, new_cls) for _, cfg in manifest)
    report = run_cells(manifest, out, cell_fn=again, log=None)
    assert again.calls == [] and len(report.skipped) == 8 and not report.ran

    # A non-default value of the new field is a new cell.
    changed = presets.compare_manifest(manifest.cells[0][1].override(new_knob=8, seed=0),
                                       cli.DEFAULT_CONFIGS, (0,))
    report = run_cells(changed, tmp_path / "other", cell_fn=again, log=None)
    assert len(again.calls) == 4 and len(report.ran) == 4


def test_manifest_with_a_flat_legacy_config_is_rebuilt(tmp_path: Path):
    cell = Cell()
    manifest = presets.compare_manifest(RunConfig.from_flat(seqlen=64), ("hadamard",), (0,))
    run_cells(manifest, tmp_path, cell_fn=cell, log=None)
    data = read_manifest(tmp_path)
    cfg = manifest.cells[0][1]
    legacy = {name: getattr(cfg, name) for name in LEGACY_FIELDS}
    legacy["gptq"] = dataclasses.asdict(legacy["gptq"])
    data["cells"][0]["config"] = json.loads(json.dumps(legacy))
    rebuilt = manifest_from_dict(data, config.RunConfig.from_dict)
    assert rebuilt.cells[0][1] == cfg


def test_a_window_needs_two_tokens_everywhere():
    """One minimum for the window length: the config refuses what the evaluation would refuse after the build,
    and the CLI's budget check reads the same number."""
    from rope_quant.experiment.config import Budget, PipelineError, RunConfig
    from rope_quant.sweep.presets import BUDGET_MINIMUM

    assert Budget.MIN_SEQLEN == BUDGET_MINIMUM["seqlen"] == 2
    with pytest.raises(PipelineError, match="seqlen must be >= 2"):
        RunConfig.from_flat(seqlen=1)
    assert RunConfig.from_flat(seqlen=2).budget.seqlen == 2

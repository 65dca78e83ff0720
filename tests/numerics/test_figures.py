"""The main jobs end with their figure: compare.png, long-context.png and lm-eval.png are written under
DIR/figures and their paths printed (fake cells, no model); the lm-eval paired report from fake records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rope_quant import cli
from rope_quant.sweep import figures, report
from rope_quant.sweep.manifest import LmEvalConfig, LongContextConfig

OFFSET = {"hadamard": 0.0, "pairwise_only": 0.4, "pairwise_plus_hadamard": 0.05, "identity": 1.5}
ACC = {"hadamard": 0.60, "pairwise_only": 0.55}


def fake_cell(cfg) -> dict:
    """ppl / gaps / accuracies that depend on (r3, seed), with seed noise so the intervals have width."""
    if isinstance(cfg, LmEvalConfig):
        r3, seed = cfg.run.r3, cfg.seed
        noise = 0.01 * ((seed * 7) % 3) * (r3 != "hadamard") - 0.01
        return {"tasks": {task: {"acc": ACC.get(r3, 0.5) + noise + 0.1 * i, "acc_stderr": 0.02,
                                 "acc_norm": ACC.get(r3, 0.5) - 0.02 * seed}
                          for i, task in enumerate(cfg.tasks)}}
    if isinstance(cfg, LongContextConfig):
        r3, seed = cfg.run.r3, cfg.seed
        return {"lengths": {str(L): {"ppl": 10.0 + L / 256 + OFFSET.get(r3, 0.2) * (512 / L)
                                     + 0.05 * seed + 0.03 * (seed % 2) * (r3 != "hadamard")}
                            for L in cfg.lengths}}
    noise = 0.04 * ((cfg.seed * 3) % 2) * (cfg.r3 != "hadamard")
    return {"ppl": 12.0 + OFFSET.get(cfg.r3, 0.2) + 0.1 * cfg.seed + noise, "k_range_mean": 2.0, "k_rel_err": 0.01}


def test_compare_writes_and_prints_its_figure(tmp_path: Path, capsys) -> None:
    out = tmp_path / "cmp"
    assert cli.main(["compare", "--out", str(out), "--seeds", "0,1,2", "--quiet"], cell_fn=fake_cell) == 0
    figure = out / "figures" / "compare.png"
    assert figure.is_file() and figure.stat().st_size > 10_000
    assert f"figure: {figure}" in capsys.readouterr().out


def test_long_context_writes_and_prints_its_figure(tmp_path: Path, capsys) -> None:
    out = tmp_path / "lc"
    assert cli.main(["long-context", "--out", str(out), "--seeds", "0,1,2", "--lengths", "256,512,1024",
                     "--configs", "hadamard,pairwise_only,pairwise_plus_hadamard", "--quiet"], cell_fn=fake_cell) == 0
    figure = out / "figures" / "long-context.png"
    assert figure.is_file() and (out / "figures" / "crossover.png").is_file()
    assert f"figure: {figure}" in capsys.readouterr().out


def test_lm_eval_cells_paired_table_and_figure(tmp_path: Path, capsys) -> None:
    """The lm-eval sweep with a fake cell function: manifest, completion, paired accuracy, figure, resume."""
    out = tmp_path / "lm"
    argv = ["lm-eval", "--out", str(out), "--seeds", "0,1,2", "--tasks", "piqa,arc_easy", "--limit", "50",
            "--quiet"]
    calls = []

    def cell(cfg):
        calls.append(cfg)
        return fake_cell(cfg)

    assert cli.main(argv, cell_fn=cell) == 0
    printed = capsys.readouterr().out
    assert len(calls) == 6 and all(isinstance(c, LmEvalConfig) and c.limit == 50 for c in calls)
    assert {c.run.r3 for c in calls} == {"hadamard", "pairwise_only"}
    summary = json.loads((out / "summary.json").read_text())
    lm = summary["lm_eval"]
    assert lm["tasks"] == ["piqa", "arc_easy"] and lm["metrics"]["piqa"] == ["acc", "acc_norm"]  # no stderr
    block = lm["paired"]["piqa"]["acc"]["pairwise_only"]
    assert block["n"] == 3 and block["mean"] == pytest.approx(-0.05 + 0.01) and block["low"] < block["high"]
    assert summary["status"]["complete"] == 6 and summary["seeds"] == [0, 1, 2]
    assert "| arc_easy | acc | pairwise_only |" in printed
    assert f"figure: {out / 'figures' / 'lm-eval.png'}" in printed
    calls.clear()
    assert cli.main(argv, cell_fn=cell) == 0
    assert calls == [] and "6 already complete" in capsys.readouterr().out
    # the manifest rebuilds the lm-eval configs with the same keys (Slurm / run_shard path)
    from rope_quant.sweep.manifest import load_manifest

    rebuilt = load_manifest(out)
    assert all(isinstance(cfg, LmEvalConfig) for _, cfg in rebuilt)


def test_figures_choose_by_kind(tmp_path: Path) -> None:
    assert figures.write_figures({"kind": "support", "configs": {"x": {}}}, tmp_path) == []
    assert figures.headline_metric(["word_perplexity", "bits_per_byte"]) == "word_perplexity"
    assert figures.headline_metric(["acc_norm", "acc"]) == "acc"


def test_report_rewrites_the_figure(tmp_path: Path, capsys) -> None:
    out = tmp_path / "cmp"
    assert cli.main(["compare", "--out", str(out), "--seeds", "0,1", "--configs", "hadamard,pairwise_only",
                     "--no-figures", "--quiet"], cell_fn=fake_cell) == 0
    assert not (out / "figures" / "compare.png").exists()
    rep = report.write_report(out)
    assert str(out / "figures" / "compare.png") in rep["files"]

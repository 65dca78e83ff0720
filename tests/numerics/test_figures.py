"""The main jobs end with their figure: compare.png, long-context.png and lm-eval.png are written under
DIR/figures and their paths printed (fake cells, no model); the lm-eval paired report from fake records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rope_quant import cli
from rope_quant.analysis import figures, report
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


# ----------------------------------------------------------------------------- what a reader sees


def _legends_clear_of_axes(fig) -> None:
    """Every legend's box lies outside every axes' box (so it cannot hide data)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [ax.get_window_extent(renderer) for ax in fig.axes]
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert legends
    for legend in legends:
        box = legend.get_window_extent(renderer)
        assert not any(box.overlaps(ax_box) for ax_box in boxes), "a legend sits on an axes"


def _compare_dir(tmp_path: Path) -> Path:
    out = tmp_path / "cmp"
    assert cli.main(["compare", "--out", str(out), "--seeds", "0,1,2", "--quiet", "--no-figures",
                     "--configs", "hadamard,pairwise_only,pairwise_plus_hadamard"], cell_fn=fake_cell) == 0
    return out


def _mean_markers(ax) -> dict[int, str]:
    """Row (y) of each mean-Δ errorbar → its marker face colour."""
    from matplotlib.colors import to_hex

    return {round(c.lines[0].get_ydata()[0]): to_hex(c.lines[0].get_markerfacecolor()) for c in ax.containers}


def test_compare_figure_names_the_run_marks_holm_and_keeps_legends_clear(tmp_path: Path) -> None:
    from rope_quant.analysis.titles import describe

    out = _compare_dir(tmp_path)
    summary = report.summarize(out, write=False)
    setup = describe(out)
    assert setup.title() == "smollm2-135m · W4A4KV4 · RTN weights · 3 seeds × 4 windows × L=512"
    summary["holm"]["results"]["pairwise_plus_hadamard"]["reject"] = False  # one of each verdict
    assert summary["holm"]["results"]["pairwise_only"]["reject"] is True
    fig = figures.compare_figure(summary, setup)
    try:
        assert fig._suptitle.get_text().splitlines()[0] == setup.title()
        right = fig.axes[1]
        faces = _mean_markers(right)  # rows: 0 hadamard (comparator), 1 pairwise_only, 2 pairwise_plus_hadamard
        assert faces[2] == "#ffffff" and faces[1] != "#ffffff"  # open: not significant after Holm; filled: is
        texts = [t.get_text() for t in right.texts]
        stars = summary["holm"]["results"]["pairwise_only"]["stars"]
        assert stars and any(t.startswith("+") and stars in t for t in texts)
        labels = right.get_legend_handles_labels()[1]
        assert "significant after Holm (α=0.05)" in labels and "not significant after Holm" in labels
        _legends_clear_of_axes(fig)
    finally:
        figures.pyplot().close(fig)


def test_long_context_figure_fills_only_the_holm_significant_gaps(tmp_path: Path) -> None:
    from rope_quant.analysis.titles import describe

    out = tmp_path / "lc"
    # one evaluation corpus, named: the default list depends on which optional corpora are installed (kjv)
    assert cli.main(["long-context", "--out", str(out), "--seeds", "0,1,2", "--lengths", "256,1024", "--no-figures",
                     "--configs", "hadamard,pairwise_only", "--eval-corpora", "shakespeare", "--quiet"],
                    cell_fn=fake_cell) == 0
    summary = report.summarize(out, write=False)
    paired = summary["long_context"]["paired"]
    name = next(iter(paired["256"]))
    paired["1024"][name]["reject"] = False
    assert paired["256"][name]["reject"] is True
    setup = describe(out)
    assert setup.lengths == "{256,1024}" and "RTN weights" in setup.title()
    fig = figures.long_context_figure(summary, setup)
    try:
        assert setup.title() in fig._suptitle.get_text()
        right = fig.axes[1]
        from matplotlib.colors import to_hex

        points = {round(line.get_xdata()[0]): to_hex(line.get_markerfacecolor())
                  for line in right.lines if len(line.get_xdata()) == 1}
        assert points[1024] == "#ffffff" and points[256] != "#ffffff"
        _legends_clear_of_axes(fig)
    finally:
        figures.pyplot().close(fig)


def test_lm_eval_figure_claims_no_holm_family(tmp_path: Path) -> None:
    out = tmp_path / "lm"
    assert cli.main(["lm-eval", "--out", str(out), "--seeds", "0,1", "--tasks", "piqa", "--limit", "5", "--quiet",
                     "--no-figures"], cell_fn=fake_cell) == 0
    from rope_quant.analysis.titles import describe

    fig = figures.lm_eval_figure(report.summarize(out, write=False), describe(out))
    try:
        assert "W4A4KV4" in fig._suptitle.get_text() and "(no Holm family)" in fig.axes[1].get_title()
        assert not any("Holm" in label for label in fig.axes[1].get_legend_handles_labels()[1])
        _legends_clear_of_axes(fig)
    finally:
        figures.pyplot().close(fig)


def test_titles_read_nested_flat_and_unquantised_settings() -> None:
    from rope_quant.analysis.titles import setup_from

    nested = {"seed": 0, "config": {"run": {"model": "m", "quant": {"w": {"bits": 16, "mode": "rtn"},
                                                                    "a": {"bits": 8}, "k": {"bits": 4},
                                                                    "v": {"bits": 8}},
                                            "budget": {"seqlen": 256, "eval_windows": None}},
                                    "lengths": [256, 1024]}}
    flat = {"seed": 1, "config": {"model": "m", "w_bits": 4, "a_bits": 4, "k_bits": 4, "v_bits": 4,
                                  "weights": "gptq", "seqlen": 2048, "eval_windows": 8}}
    assert setup_from([nested]).title() == "m · W16A8K4V8 · unquantised weights · 1 seed × all windows × " \
                                           "L={256,1024}"
    assert setup_from([flat]).title() == "m · W4A4KV4 · GPTQ weights · 1 seed × 8 windows × L=2048"
    records = [{"seed": 1, "result": {"ppl": 3.0, "n_windows": 6}}, {"seed": 2, "result": {"ppl": 3.0,
                                                                                            "n_windows": 7}}]
    assert setup_from([flat], records).budget() == "2 seeds × 6–7 windows × L=2048"  # what the cells scored


def test_the_legend_check_can_fail() -> None:
    fig, ax = figures.pyplot().subplots()
    try:
        ax.plot([0, 1], [0, 1], label="data")
        ax.legend(loc="upper left")
        with pytest.raises(AssertionError, match="a legend sits on an axes"):
            _legends_clear_of_axes(fig)
    finally:
        figures.pyplot().close(fig)

"""NIAH in the RULER format (App. G): probes, scoring, the sweep's cells and report, and the CLI.

Probe construction uses the embedded tokenizer; the sweep and CLI run with an injected fake cell function;
one cheap real check answers short probes with the embedded SmolLM2-135M in full precision.
"""

from __future__ import annotations

import json

import pytest
import torch

from rope_quant import cli
from rope_quant.analysis import niah_report
from rope_quant.corpora import token_streams
from rope_quant.scoring.niah import HEADER, NiahError, NiahSpec, accuracy_table, make_probe, run_probes, score
from rope_quant.sweep import niah as sweep_niah
from rope_quant.sweep.manifest import config_from_dict, read_manifest
from rope_quant.sweep.records import is_complete, status

TINY = ["--seqlen", "64", "--calib-windows", "2", "--weights", "rtn", "--no-w-mse"]


@pytest.fixture(scope="module")
def tok(embedded_model):
    return embedded_model[1]


@pytest.fixture(scope="module")
def stream(tok):
    return token_streams.load_corpus("pydoc", tok).eval_ids


# ----------------------------------------------------------------------------- probes


@pytest.mark.parametrize("template", ["plain", "chat"])
def test_probe_has_exact_length_needle_at_depth_and_question_last(tok, stream, template):
    spec = NiahSpec(lengths=(300,), probes=2, template=template)
    for depth in (0.0, 0.5, 1.0):
        p = make_probe(tok, stream, spec, seed=0, length=300, depth=depth, index=1)
        assert p.ids.numel() == 300 and len(p.value) == 7
        text = tok.decode(p.ids)
        needle = f"The special magic number for {p.key} is {p.value}."
        assert text.count(needle) == 1 and text.count(p.value) == 1
        assert text.rstrip().endswith(f"The special magic number for {p.key} mentioned in the provided text is")
        assert HEADER.strip() in text
        hay_start = len(tok(HEADER, add_special_tokens=False)["input_ids"])
        frac = (p.needle_at - hay_start) / (300 - hay_start - 40)  # ~40 tokens of needle and question
        assert abs(frac - depth) < 0.2, (depth, frac)
    if template == "chat":
        assert tok.decode(p.ids).startswith("<|im_start|>")


def test_probes_are_deterministic_per_seed_and_paired_across_configs(tok, stream):
    spec = NiahSpec(lengths=(200,), probes=3)
    a = make_probe(tok, stream, spec, seed=0, length=200, depth=0.5, index=2)
    b = make_probe(tok, stream, spec, seed=0, length=200, depth=0.5, index=2)
    assert torch.equal(a.ids, b.ids) and (a.key, a.value) == (b.key, b.value)
    others = [make_probe(tok, stream, spec, seed=s, length=200, depth=0.5, index=i) for s, i in ((1, 2), (0, 1))]
    assert all(o.value != a.value or o.haystack_start != a.haystack_start for o in others)


def test_bad_specs_and_short_inputs_raise_niah_error(tok, stream):
    for bad in (dict(lengths=()), dict(lengths=(8,)), dict(lengths=(64, 64)), dict(lengths=(64,), depths=(1.5,)),
                dict(lengths=(64,), probes=0), dict(lengths=(64,), digits=0), dict(lengths=(64,), template="json")):
        with pytest.raises(NiahError):
            NiahSpec(**bad)
    with pytest.raises(NiahError, match="no room for a haystack"):
        make_probe(tok, stream, NiahSpec(lengths=(40,)), 0, 40, 0.5, 0)
    with pytest.raises(NiahError, match="haystack stream has 100 tokens"):
        make_probe(tok, stream[:100], NiahSpec(lengths=(400,)), 0, 400, 0.5, 0)


def test_score_is_exact_match_of_the_first_number():
    assert score(" 4821093.", "4821093") == {"correct": True, "contains": True, "answer": "4821093"}
    assert score(" 482109.", "4821093")["correct"] is False
    assert score(" 48210931", "4821093")["correct"] is False  # a longer number is not the answer
    assert score(" 17, not 4821093", "4821093") == {"correct": False, "contains": True, "answer": "17"}
    assert score(" unknown", "4821093")["answer"] is None
    recs = [{"length": 64, "depth": d, "correct": c, "contains": True} for d, c in ((0, 1), (0, 0), (1, 1), (1, 1))]
    table = accuracy_table(recs)
    assert table["by_length"] == {"64": 0.75} and table["by_depth"] == {"64": {"0": 0.5, "1": 1.0}}


def test_embedded_model_retrieves_short_needles_in_full_precision(embedded_model, stream):
    """The task is answerable: the plain 135M model finds the needle in short haystacks."""
    model, tok = embedded_model
    spec = NiahSpec(lengths=(128,), depths=(0.0, 1.0), probes=2)
    recs = run_probes(model, tok, stream, spec, seed=0)
    assert len(recs) == 4 and all(r["output"] for r in recs)
    assert accuracy_table(recs)["by_length"]["128"] >= 0.75, [(r["value"], r["output"]) for r in recs]


# ----------------------------------------------------------------------------- sweep and CLI


class FakeNiah:
    """NIAH results without a model: FP saturates below 1024; pairwise_only drops first."""

    ACC = {"fp": (1.0, 0.95, 0.5), "hadamard": (1.0, 0.9, 0.3), "pairwise_plus_hadamard": (1.0, 0.85, 0.3),
           "pairwise_only": (0.9, 0.6, 0.2)}

    def __init__(self) -> None:
        self.calls = []

    def __call__(self, cfg) -> dict:
        self.calls.append(cfg)
        name = "fp" if cfg.fp else cfg.run.r3
        probes = [{"length": L, "depth": d, "probe": 0, "correct": self.ACC[name][i] - 0.01 * cfg.seed,
                   "contains": 1.0} for i, L in enumerate(cfg.spec.lengths) for d in cfg.spec.depths]
        return {"niah": {"accuracy": accuracy_table(probes), "contains": accuracy_table(probes, "contains"),
                         "probes": probes, "fp": cfg.fp}}


def test_niah_cli_runs_resumes_and_reports_discriminative_lengths(tmp_path):
    fake = FakeNiah()
    out = tmp_path / "niah"
    argv = ["niah", "--lengths", "256,512,1024", "--seeds", "0,1", "--probes", "2", "--depths", "0,1",
            "--out", str(out), *TINY, "--quiet"]
    assert cli.main(argv, cell_fn=fake) == 0
    assert len(fake.calls) == 8 and sum(c.fp for c in fake.calls) == 2
    man = read_manifest(out)
    assert man["study"] == "niah" and [c["name"] for c in man["cells"][:4]] == [
        "fp", "hadamard", "pairwise_only", "pairwise_plus_hadamard"]
    for entry in man["cells"]:  # the manifest rebuilds the cells with the same keys
        assert config_from_dict(entry["config"]).key() == entry["key"]
        assert is_complete(out / entry["path"], entry["key"])
    assert status(out).done
    summary = json.loads((out / niah_report.SUMMARY_FILE).read_text())
    disc = {r["length"]: r["discriminative"] for r in summary["discriminative"]}
    assert disc == {256: True, 512: True, 1024: False}  # 1024: FP 0.5 is not saturated
    assert summary["paired"]["pairwise_only"]["512"]["diffs"] == pytest.approx([0.3, 0.3])
    assert (out / niah_report.FIGURE_FILE).stat().st_size > 1000
    again = FakeNiah()
    assert cli.main(argv, cell_fn=again) == 0 and again.calls == []  # resumed: nothing recomputed


def test_niah_cli_refuses_bad_input_before_any_cell(tmp_path):
    fake = FakeNiah()
    base = ["niah", "--out", str(tmp_path / "o"), *TINY, "--quiet"]
    assert cli.main([*base, "--depths", "0,1.5"], cell_fn=fake) == 2
    assert cli.main([*base, "--depths", "half"], cell_fn=fake) == 2
    assert cli.main([*base, "--lengths", "8"], cell_fn=fake) == 2
    assert cli.main([*base, "--configs", "bogus"], cell_fn=fake) == 2
    assert cli.main([*base, "--haystack", "no-such-corpus"], cell_fn=fake) == 2
    assert fake.calls == []


def test_niah_cell_without_accuracy_is_an_error_record():
    assert sweep_niah.scored({"niah": {"accuracy": {"by_length": {"256": 0.5}}}})
    assert not sweep_niah.scored({"niah": {"accuracy": {"by_length": {}}}})
    assert not sweep_niah.scored({"niah": {"accuracy": {"by_length": {"256": float("nan")}}}})


def test_real_niah_cli_on_the_embedded_model(tmp_path, embedded_model):
    """``rope-quant niah`` through the real pipeline (RTN, tiny calibration): FP and a quantised config answer
    every probe, each probe is saved, and the quantised cell generated with the quantise-mode attention."""
    from rope_quant.sweep.loaded_models import ModelCache

    models = ModelCache()
    models.put("smollm2-135m", "cpu", embedded_model)
    out = tmp_path / "real"
    argv = ["niah", "--lengths", "96", "--depths", "0.5", "--probes", "2", "--seeds", "0", "--configs", "hadamard",
            "--out", str(out), *TINY, "--quiet", "--no-figures"]
    assert cli.main(argv, models=models) == 0
    recs = {r["name"]: r for r in (json.loads(p.read_text()) for p in out.glob("cells/*/*.json"))}
    assert set(recs) == {"fp", "hadamard"}
    for rec in recs.values():
        probes = rec["result"]["niah"]["probes"]
        assert len(probes) == 2 and all(p["length"] == 96 and p["output"] for p in probes)
    assert recs["fp"]["result"]["niah"]["accuracy"]["by_length"]["96"] == 1.0  # the plain model finds it
    assert "hadamard − pairwise_only" not in (out / "niah_summary.md").read_text()
    assert "| hadamard | 96 |" in (out / "niah_summary.md").read_text()


def test_niah_figure_names_the_run_and_keeps_the_legend_clear(tmp_path):
    from rope_quant.analysis.figures import pyplot
    from rope_quant.analysis.titles import describe

    out = tmp_path / "niah"
    argv = ["niah", "--lengths", "256,512", "--seeds", "0,1,2", "--probes", "3", "--depths", "0,1", "--out", str(out),
            *TINY, "--quiet"]
    assert cli.main(argv, cell_fn=FakeNiah()) == 0
    setup = describe(out)
    assert setup.budget() == "3 seeds × 3 probes per depth × L={256,512}" and setup.bits == "W4A4KV4"
    from rope_quant.analysis.kind_reports import write_kind_reports

    (out / niah_report.SUMMARY_FILE).unlink()
    (part,) = write_kind_reports(out)  # `rope-quant report` finds the NIAH report through the kind registry
    assert part.kind == "niah" and str(out / niah_report.SUMMARY_FILE) in part.files
    assert part.markdown.startswith("NIAH accuracy") and (out / niah_report.FIGURE_FILE).is_file()
    data = niah_report.collect(out)
    fig = niah_report.accuracy_axes(data["accuracy"], niah_report.discriminative_lengths(data["accuracy"]), setup)
    try:
        ax = fig.axes[0]
        assert fig._suptitle.get_text().splitlines()[0] == setup.title()
        labels = ax.get_legend_handles_labels()[1]
        assert "unquantised model (fp): mean over seeds" in labels and "fp" not in labels
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        assert not ax.get_legend().get_window_extent(renderer).overlaps(ax.get_window_extent(renderer))
    finally:
        pyplot().close(fig)

"""report.py: summary.json shape and numbers against hand-computed statistics, tables, figures.

The reference numbers use df = 2 (three seeds), where Student's t has closed forms:
two-sided p = 1 - t / sqrt(t^2 + 2) and the quantile t_q = (2q - 1) / sqrt(2 q (1 - q)).
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from rope_quant.analysis import report
from rope_quant.core.verdict import equivalence_margin
from rope_quant.sweep.manifest import build_manifest
from rope_quant.sweep.runner import run_cells
from tests._support import FakeConfig

SEEDS = (0, 1, 2)
HADAMARD = [10.0, 10.5, 11.0]
# per-seed differences against hadamard, chosen so the statistics are easy by hand
DIFFS = {
    "pairwise_only": [0.2, 0.1, 0.3],      # mean 0.2, sd 0.1
    "identity": [1.0, 1.2, 0.8],           # mean 1.0, sd 0.2
    "near": [0.01, -0.01, 0.0],            # mean 0.0, sd 0.01
    "close": [0.03, 0.05, 0.04],           # mean 0.04, sd 0.01
}
SD = {"pairwise_only": 0.1, "identity": 0.2, "near": 0.01, "close": 0.01}
MEAN = {"pairwise_only": 0.2, "identity": 1.0, "near": 0.0, "close": 0.04}


def t_quantile_df2(q: float) -> float:
    return (2 * q - 1) / math.sqrt(2 * q * (1 - q))


def p_two_sided_df2(t: float) -> float:
    return 1 - abs(t) / math.sqrt(t * t + 2)


def fake_cell(cfg: FakeConfig) -> dict:
    base = HADAMARD[cfg.seed]
    ppl = base if cfg.r3 == "hadamard" else base + DIFFS[cfg.r3][cfg.seed]
    return {"ppl": ppl, "n_windows": 4, "n_tokens": 512, "k_range_mean": 2.0 + cfg.seed,
            "k_range_max": 9.0, "delta_mean": 0.1, "k_rel_err": 0.01 * (cfg.seed + 1)}


def make_results(tmp_path: Path, names=("hadamard", *DIFFS), family=None, **kw) -> Path:
    variants = {n: {"r3": n} for n in names}
    manifest = build_manifest(FakeConfig(), variants, SEEDS, study="compare", family=family, **kw)
    run_cells(manifest, tmp_path, cell_fn=fake_cell, log=None)
    return tmp_path


def test_summary_shape_and_numbers(tmp_path: Path) -> None:
    out = make_results(tmp_path)
    summary = report.summarize(out)
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    assert set(summary["configs"]) == {"hadamard", *DIFFS}
    had = summary["configs"]["hadamard"]
    assert had["ppl"] == pytest.approx(HADAMARD)
    assert had["k_range_mean"] == [2.0, 3.0, 4.0] and had["k_rel_err"] == pytest.approx([0.01, 0.02, 0.03])
    assert had["seeds"] == [0, 1, 2] and summary["seeds"] == [0, 1, 2]
    assert "hadamard" not in summary["paired"]
    tq = t_quantile_df2(0.95)
    assert tq == pytest.approx(2.919986, abs=1e-6)
    for name in DIFFS:
        block = summary["paired"][name]
        assert block["comparator"] == "hadamard" and block["n"] == 3
        assert block["mean"] == pytest.approx(MEAN[name], abs=1e-12)
        assert block["sd"] == pytest.approx(SD[name], rel=1e-9)
        half = tq * SD[name] / math.sqrt(3)
        assert block["low"] == pytest.approx(MEAN[name] - half, abs=1e-9)
        assert block["high"] == pytest.approx(MEAN[name] + half, abs=1e-9)
        if MEAN[name] != 0:
            t = MEAN[name] / (SD[name] / math.sqrt(3))
            assert block["p"] == pytest.approx(p_two_sided_df2(t), rel=1e-7)
    # pairwise: CI [0.0314, 0.3686]; near: [-0.0169, 0.0169]; close: [0.0231, 0.0569]. One margin, the claims'
    # (equivalence_margin of hadamard's mean ppl 10.5: 0.05 · 10.5 / 8.33 = 0.063), which both use; the fixed
    # 0.02 / 0.05 / 0.10 columns are gone on purpose (close was "no" at ±0.05 and "yes" at ±0.10).
    eq = summary["equivalence"]
    margin = equivalence_margin(10.5)
    assert margin.value == pytest.approx(0.063) and "scaled by the ppl ratio" in margin.basis
    assert summary["margin_rule"] == report.MARGIN_RULE and "equivalence_margin" in summary["margin_rule"]
    for name, expected in {"pairwise_only": False, "near": True, "close": True, "identity": False}.items():
        assert eq[name] == {"margin": pytest.approx(margin.value), "basis": margin.basis, "equivalent": expected}
    assert summary["status"]["complete"] == 15 and summary["status"]["total"] == 15


def test_holm_against_hand_computation(tmp_path: Path) -> None:
    out = make_results(tmp_path)
    holm = report.summarize(out)["holm"]
    assert holm["family"] == list(DIFFS) and holm["alpha"] == 0.05
    raw = {n: p_two_sided_df2(MEAN[n] / (SD[n] / math.sqrt(3))) for n in DIFFS}
    assert raw["near"] == pytest.approx(1.0)
    ordered = sorted(raw, key=raw.get)
    adjusted, running = {}, 0.0
    for i, name in enumerate(ordered):
        running = max(running, min(1.0, (len(ordered) - i) * raw[name]))
        adjusted[name] = running
    for name in DIFFS:
        res = holm["results"][name]
        assert res["p"] == pytest.approx(raw[name], rel=1e-7)
        assert res["p_holm"] == pytest.approx(adjusted[name], rel=1e-7)
        assert res["reject"] == (adjusted[name] <= 0.05)
        assert res["stars"] == report.stars(adjusted[name])
    # close: t = 6.93, p = 0.0202; identity: t = 8.66, p = 0.0131 -> adjusted 4 x 0.0131 = 0.052
    assert holm["results"]["identity"]["reject"] is False
    assert raw["identity"] < 0.05  # significant before correction, not after: the correction matters


def test_declared_family_changes_the_correction(tmp_path: Path) -> None:
    out = make_results(tmp_path, family=["identity"])
    holm = report.summarize(out)["holm"]
    assert holm["family"] == ["identity"]
    res = holm["results"]["identity"]
    assert res["p_holm"] == pytest.approx(res["p"]) and res["reject"] is True and res["stars"] == "*"
    assert "pairwise_only" not in holm["results"]
    holm2 = report.summarize(out, family=["identity", "close"])["holm"]
    assert holm2["results"]["identity"]["p_holm"] == pytest.approx(2 * res["p"])


def test_stars_thresholds() -> None:
    assert [report.stars(p) for p in (0.0005, 0.005, 0.05, 0.0501, None)] == ["***", "**", "*", "", ""]


def test_tables_written_as_csv_and_markdown(tmp_path: Path) -> None:
    out = make_results(tmp_path)
    result = report.write_report(out, figures=False)
    files = {Path(f).name for f in result["files"]}
    assert {"summary.json", "summary.md", "multiseed.csv", "multiseed.md", "corrected-star.csv",
            "corrected-star.md"} <= files
    with open(out / "tables" / "multiseed.csv") as handle:
        rows = {r["config"]: r for r in csv.DictReader(handle)}
    assert float(rows["pairwise_only"]["seed 1"]) == pytest.approx(10.6)
    assert float(rows["pairwise_only"]["delta"]) == pytest.approx(0.2)
    assert float(rows["hadamard"]["mean"]) == pytest.approx(10.5)
    assert float(rows["hadamard"]["sd"]) == pytest.approx(0.5)
    assert float(rows["identity"]["k_rel_err"]) == pytest.approx(0.02)
    with open(out / "tables" / "corrected-star.csv") as handle:
        star = {r["config"]: r for r in csv.DictReader(handle)}
    assert list(star["near"])[-2:] == ["tost_margin", "tost"]
    assert star["close"]["tost"] == "True" and float(star["close"]["tost_margin"]) == pytest.approx(0.063)
    assert star["pairwise_only"]["tost"] == "False"
    summary = result["summary"]
    holm_identity = summary["holm"]["results"]["identity"]["p_holm"]
    assert float(star["identity"]["p_holm"]) == pytest.approx(holm_identity)
    md = (out / "summary.md").read_text()
    assert md == result["markdown"]
    assert "| config | seed 0 | seed 1 | seed 2 | mean ± sd |" in md
    assert "+0.200 [+0.031, +0.369]" in md  # pairwise Δ with its 90% CI
    assert "≡ (margin)" in md and "at the claims' equivalence margin" in md
    assert "against hadamard: ±0.05 PPL scaled by the ppl ratio 10.50/8.33 = ±0.063" in md  # the margin used
    near_line = next(line for line in md.splitlines() if line.startswith("| near |") and "±0.063" in line)
    assert "yes (±0.063)" in near_line


def test_missing_seed_and_single_seed(tmp_path: Path) -> None:
    def cell(cfg: FakeConfig) -> dict:
        if cfg.r3 == "identity" and cfg.seed == 2:
            raise RuntimeError("lost")
        return fake_cell(cfg)

    manifest = build_manifest(FakeConfig(), {"hadamard": {"r3": "hadamard"}, "identity": {"r3": "identity"}},
                              SEEDS)
    run_cells(manifest, tmp_path, cell_fn=cell, log=None)
    summary = report.summarize(tmp_path)
    assert summary["configs"]["identity"]["seeds"] == [0, 1]
    block = summary["paired"]["identity"]
    assert block["n"] == 2 and block["seeds"] == [0, 1] and block["mean"] == pytest.approx(1.1)
    assert summary["status"]["failed"] == ["identity/seed2"]
    assert "Failed cells: identity/seed2" in report.write_report(tmp_path, figures=False)["markdown"]

    one = tmp_path / "one"
    manifest = build_manifest(FakeConfig(), {"hadamard": {"r3": "hadamard"}, "identity": {"r3": "identity"}},
                              (1,))
    run_cells(manifest, one, cell_fn=fake_cell, log=None)
    summary = report.summarize(one)
    block = summary["paired"]["identity"]
    assert block["n"] == 1 and block["mean"] == pytest.approx(1.2)
    assert block["sd"] is None and block["low"] is None and block["p"] is None
    assert summary["equivalence"]["identity"]["equivalent"] is False  # one seed: no equivalence claimed
    assert summary["holm"]["family"] == [] and summary["holm"]["untested"] == ["identity"]
    assert "+1.200 (n=1)" in report.write_report(one, figures=False)["markdown"]


def test_support_and_estimator_tables_and_figures(tmp_path: Path) -> None:
    def cell(cfg: FakeConfig) -> dict:
        base = HADAMARD[cfg.seed]
        if cfg.r3 == "hadamard":
            return {"ppl": base, "k_range_mean": 1.0, "k_rel_err": 0.005}
        return {"ppl": base + 1.0 / cfg.block + 0.01 * cfg.seed, "k_range_mean": 10.0 / cfg.block,
                "k_rel_err": 0.02 / cfg.block}

    blocks = (2, 4, 8)
    variants = {"hadamard": {"r3": "hadamard"},
                **{f"block-b{b}": {"r3": "block", "block": b} for b in blocks}}
    meta = {f"block-b{b}": {"block": b} for b in blocks}
    manifest = build_manifest(FakeConfig(), variants, SEEDS, study="support", meta=meta)
    run_cells(manifest, tmp_path, cell_fn=cell, log=None)
    result = report.write_report(tmp_path)
    with open(tmp_path / "tables" / "mixing-support.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [int(r["b"]) for r in rows] == [2, 4, 8]
    assert [float(r["k_range_mean"]) for r in rows] == pytest.approx([5.0, 2.5, 1.25])
    assert [float(r["gap"]) for r in rows] == pytest.approx([0.51, 0.26, 0.135])
    png = tmp_path / "figures" / "support.png"
    assert str(png) in result["files"] and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    est = tmp_path / "est"
    names = ("rows", "k_only")
    variants = {"hadamard": {"r3": "hadamard"},
                **{n: {"r3": "near" if n == "rows" else "close"} for n in names}}
    manifest = build_manifest(FakeConfig(), variants, SEEDS, study="estimators",
                              meta={n: {"estimator": n} for n in names})
    run_cells(manifest, est, cell_fn=fake_cell, log=None)
    report.write_report(est, figures=False)
    with open(est / "tables" / "estimators.csv") as handle:
        rows = {r["estimator"]: r for r in csv.DictReader(handle)}
    assert float(rows["k_only"]["delta"]) == pytest.approx(0.04)
    assert float(rows["rows"]["delta"]) == pytest.approx(0.0, abs=1e-12)


def test_crossover_table_and_figure(tmp_path: Path) -> None:
    gaps = {256: 0.3, 512: 0.1, 1024: -0.2}

    def cell(cfg: FakeConfig) -> dict:
        lengths = {}
        for length, gap in gaps.items():
            base = 10.0 + cfg.seed + length / 1024
            ppl = base if cfg.r3 == "hadamard" else base + gap + 0.01 * cfg.seed
            lengths[str(length)] = {"ppl": ppl, "n_windows": 2}
        lengths["4096"] = {"error": "corpus too short"}
        return {"lengths": lengths}

    manifest = build_manifest(FakeConfig(), {"hadamard": {"r3": "hadamard"}, "pairwise_only": {"r3": "p"}},
                              SEEDS, study="long-context")
    run_cells(manifest, tmp_path, cell_fn=cell, log=None)
    result = report.write_report(tmp_path)
    lc = result["summary"]["long_context"]
    assert lc["lengths"] == [256, 512, 1024, 4096]
    assert lc["configs"]["hadamard"]["4096"] == [None, None, None]
    block = lc["paired"]["512"]["pairwise_only"]
    assert block["mean"] == pytest.approx(0.11) and block["sd"] == pytest.approx(0.01)
    assert "4096" not in lc["paired"]
    with open(tmp_path / "tables" / "crossover.csv") as handle:
        rows = list(csv.DictReader(handle))
    got = {int(r["L"]): r["gap"] for r in rows}
    assert float(got[256]) == pytest.approx(0.31) and float(got[1024]) == pytest.approx(-0.19)
    assert got[4096] == ""
    assert (tmp_path / "figures" / "crossover.png").read_bytes()[:4] == b"\x89PNG"


def test_phi_star_excess_figure(tmp_path: Path) -> None:
    from rope_quant.calib.verify import CSV_COLUMNS

    path = tmp_path / "verify" / "phi_star_pairs.csv"
    path.parent.mkdir()
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(CSV_COLUMNS)
        for layer in range(2):
            for pair in range(4):
                row = {c: 1.0 for c in CSV_COLUMNS}
                row.update(layer=layer, pair=pair, excess=1e-9 * pair, excess_phi_hat=0.1 * pair)
                writer.writerow([row[c] for c in CSV_COLUMNS])
    out = report.plot_phi_star_excess(path, tmp_path / "fig.png")
    assert out.read_bytes()[:4] == b"\x89PNG"
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(report.ReportError):
        report.plot_phi_star_excess(bad, tmp_path / "bad.png")


def test_summary_without_comparator(tmp_path: Path) -> None:
    out = make_results(tmp_path, names=("pairwise_only", "identity"))
    summary = report.summarize(out)
    assert summary["paired"] == {} and summary["holm"]["family"] == []
    assert set(summary["configs"]) == {"pairwise_only", "identity"}
    md = report.write_report(out, figures=False)["markdown"]
    assert "corrected-star" not in md and "pairwise_only" in md


def test_the_report_of_plain_runs_loads_no_torch(tmp_path: Path) -> None:
    """The records ask each record's kind; a plain run's kind is found without importing the built-in kinds
    (NIAH and static import torch), so reading a compare study stays light."""
    import subprocess
    import sys

    out = make_results(tmp_path)
    code = ("import sys; from rope_quant.analysis import report; "
            f"report.summarize({str(out)!r}); print('torch' in sys.modules)")
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root,
                          env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert done.stdout.strip().splitlines()[-1] == "False"

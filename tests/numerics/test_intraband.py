"""Intra-band statistics (App. A, Table A): σ1, σ2 and ρ of each RoPE pair from the calibration
accumulators, against a direct numpy computation; the ρ-quantile table, its CSV and the |ρ| figure."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from rope_quant import cli
from rope_quant.analysis import report
from rope_quant.calib import intraband
from rope_quant.calib.stats import CalibrationStats
from rope_quant.core.rope import pair_indices
from rope_quant.sweep.manifest import read_manifest

L_, HQ, HK, D = 2, 4, 2, 8
K = D // 2


def _sample(seed: int = 0) -> tuple[CalibrationStats, dict[str, np.ndarray]]:
    """Correlated pair channels (ρ varies by head and pair) fed in three batches; returns the raw rows too."""
    rng = np.random.default_rng(seed)
    stats = CalibrationStats(L_, HQ, HK, D, topk=0)
    raw: dict[str, list[np.ndarray]] = {"q": [], "k": []}
    for _ in range(3):
        for st, h in (("q", HQ), ("k", HK)):
            n = int(rng.integers(20, 40))
            x = rng.normal(size=(L_, n, h, D)) * rng.uniform(0.5, 3.0, size=(1, 1, h, D)) + 5.0
            a, b = pair_indices(D, "rotate_half")
            mix = rng.uniform(-0.9, 0.9, size=(1, 1, h, K))
            x[..., b] = x[..., b] + mix * x[..., a] * 2.0
            for layer in range(L_):
                stats.update(layer, st, x[layer].reshape(n, h * D))
            raw[st].append(x)
    return stats, {st: np.concatenate(v, axis=1) for st, v in raw.items()}


def _direct(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """σ1, σ2, ρ over axis 0 of pair channels given as (n, ..., D)."""
    a, b = pair_indices(D, "rotate_half")
    xa, xb = x[..., a], x[..., b]
    s1, s2 = xa.std(axis=0), xb.std(axis=0)
    cov = ((xa - xa.mean(axis=0)) * (xb - xb.mean(axis=0))).mean(axis=0)
    return s1, s2, cov / (s1 * s2)


def test_sigma_rho_from_accumulators_match_numpy() -> None:
    stats, raw = _sample()
    covs = intraband.scope_covariances(stats)
    for st in ("q", "k"):
        got = intraband.sigma_rho(covs[st])
        for layer in range(L_):
            want = _direct(raw[st][layer])  # (n, H, D) -> (H, K)
            for g, w in zip(got, want, strict=True):
                np.testing.assert_allclose(g[layer], w, rtol=1e-10)
        # a numpy corrcoef cross-check of one (layer, head, pair)
        a, b = pair_indices(D, "rotate_half")
        x = raw[st][1][:, 0]
        assert got[2][1, 0, 2] == pytest.approx(np.corrcoef(x[:, a[2]], x[:, b[2]])[0, 1], rel=1e-10)
    pooled = intraband.sigma_rho(covs["pooled"])
    grouped = intraband.sigma_rho(covs["pooled_kv_group"])
    for layer in range(L_):
        q, k = raw["q"][layer], raw["k"][layer]
        want = _direct(np.concatenate([q.reshape(-1, D), k.reshape(-1, D)]))  # rows: every head's rows
        for g, w in zip(pooled, want, strict=True):
            np.testing.assert_allclose(g[layer, 0], w, rtol=1e-9)
        g_size = HQ // HK
        for h in range(HK):
            rows = np.concatenate([q[:, h * g_size:(h + 1) * g_size].reshape(-1, D), k[:, h]], axis=0)
            want = _direct(rows)
            for g, w in zip(grouped, want, strict=True):
                np.testing.assert_allclose(g[layer, h], w, rtol=1e-9)
    # the heads are correlated (so the test can tell ρ from 0) with mixed signs, which pooling averages down
    assert np.abs(intraband.sigma_rho(covs["q"])[2]).max() > 0.5 > np.abs(pooled[2]).max()


def test_quantile_table_and_rows() -> None:
    stats, raw = _sample(1)
    rows = intraband.intraband_rows(stats)
    assert len(rows) == L_ * K * (HQ + HK + 1 + HK)
    assert set(rows[0]) == set(intraband.ROW_COLUMNS)
    table = {r["scope"]: r for r in intraband.rho_quantiles(stats)}
    assert list(table) == list(intraband.SCOPES)
    rho_k = np.stack([_direct(raw["k"][layer])[2] for layer in range(L_)]).ravel()
    assert table["k"]["n"] == rho_k.size == L_ * HK * K and table["k"]["n_undefined"] == 0
    for q in intraband.QUANTILES:
        assert table["k"][f"rho_q{round(q * 100):02d}"] == pytest.approx(np.quantile(rho_k, q), rel=1e-9)
        assert table["k"][f"abs_rho_q{round(q * 100):02d}"] == pytest.approx(np.quantile(np.abs(rho_k), q),
                                                                                rel=1e-9)
    assert table["k"]["frac_abs_rho_gt_0.3"] == pytest.approx(float((np.abs(rho_k) > 0.3).mean()))
    med, lo, hi = intraband.abs_rho_by_pair(stats, "k")
    assert med.shape == (K,) and np.all(lo <= med) and np.all(med <= hi)


def test_zero_variance_pair_has_no_correlation() -> None:
    s1, s2, rho = intraband.sigma_rho((np.array([0.0, 4.0]), np.array([1.0, 1.0]), np.array([0.0, 1.0])))
    assert np.isnan(rho[0]) and rho[1] == pytest.approx(0.5) and s1[1] == 2.0


def test_report_writes_the_csv_and_the_figure(tmp_path: Path) -> None:
    out = tmp_path / "res"
    fake = lambda cfg: {"ppl": 10.0 + (cfg.r3 != "hadamard"), "k_range_mean": 1.0}  # noqa: E731
    assert cli.main(["compare", "--configs", "hadamard,pairwise_only", "--seeds", "0", "--out", str(out),
                     "--quiet", "--no-figures"], cell_fn=fake) == 0
    entry = next(c for c in read_manifest(out)["cells"] if c["name"] == "pairwise_only")
    stats, _ = _sample(2)
    stats.save(out / "artifacts" / entry["key"] / "stats.npz")
    written = report.write_report(out)
    with open(out / "tables" / "intraband.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0]) == list(intraband.ROW_COLUMNS) and len(rows) == L_ * K * (HQ + 2 * HK + 1)
    with open(out / "tables" / "intraband-rho.csv", newline="") as fh:
        qrows = list(csv.DictReader(fh))
    assert [r["scope"] for r in qrows] == list(intraband.SCOPES)
    assert {"rho_q05", "rho_q50", "rho_q95", "abs_rho_q50", "sigma_ratio_median"} <= set(qrows[0])
    png = out / "figures" / "intraband_rho.png"
    assert str(png) in written["files"] and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Intra-band correlation" in (out / "summary.md").read_text()
    assert "pairwise_only seed 0" in (out / "tables" / "intraband-rho.md").read_text()
    (out / "artifacts" / entry["key"] / "stats.npz").write_bytes(b"broken")
    with pytest.warns(UserWarning, match="intra-band"):
        report.write_report(out, figures=False)  # a damaged artefact costs the table, not the report
    assert json.loads((out / "summary.json").read_text())["configs"]


def test_abs_rho_figure_uses_the_tables_quantiles_and_user_facing_names() -> None:
    """The band is the table's outer quantiles (5/95%), computed from the same |ρ| values; no internal scope
    key appears in the figure; the title names the run."""
    from matplotlib.collections import PolyCollection

    from rope_quant.analysis import protocol_report
    from rope_quant.analysis.figures import pyplot
    from rope_quant.analysis.titles import Setup

    stats, raw = _sample(3)
    assert protocol_report.band_quantiles() == (0.05, 0.95) == (min(intraband.QUANTILES), max(intraband.QUANTILES))
    setup = Setup(model="m", bits="W4A4KV4", weights="GPTQ weights", seeds=1, windows="128",
                  unit="calibration windows", lengths="2048")
    fig = protocol_report.abs_rho_figure(stats, "x seed 0", setup)
    try:
        texts = [fig._suptitle.get_text()] + [t.get_text() for ax in fig.axes for t in
                                              (ax.title, ax.xaxis.label, ax.yaxis.label)]
        texts += [label for ax in fig.axes for label in ax.get_legend_handles_labels()[1]]
        assert setup.title() in texts[0] and "5–95%" in fig.axes[0].get_ylabel()
        assert not any(key in text for key in ("pooled_kv_group", "10–90") for text in texts)
        assert "per KV head: 5–95% band" in texts
        rho_k = np.abs(np.stack([_direct(raw["k"][layer])[2] for layer in range(L_)]))  # (L, n?, HK, K)
        flat = rho_k.reshape(-1, K)
        band = [c for c in fig.axes[0].collections if isinstance(c, PolyCollection)][1]  # the K stream's band
        verts = band.get_paths()[0].vertices
        for k in range(K):
            ys = verts[np.isclose(verts[:, 0], k), 1]
            assert ys.min() == pytest.approx(np.quantile(flat[:, k], 0.05), rel=1e-9)
            assert ys.max() == pytest.approx(np.quantile(flat[:, k], 0.95), rel=1e-9)
    finally:
        pyplot().close(fig)

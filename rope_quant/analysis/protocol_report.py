"""Report parts that read the cell records and artefacts directly: the long-context protocol table (App. A.4,
App. C) and the intra-band statistics (App. A, Table A).

- ``tables/long-context-protocol.{csv,md}``: per long-context config and seed, the calibration and evaluation
  corpora, N (stream tokens), the documents concatenated, the window cap, and the windows and scored tokens
  at every L, as each cell recorded them (``result["protocol"]``);
- ``tables/intraband.csv`` (σ1, σ2, ρ per scope, layer, head and pair), ``tables/intraband-rho.{csv,md}`` (the
  head-resolved ρ quantiles) and ``figures/intraband_rho.png`` (|ρ| against the pair index, with the table's
  5–95% quantiles as its band), from the
  calibration statistics a cell saved under ``artifacts/<key>/stats.npz`` (the first in manifest order; a
  seed's R3 variants share one set of statistics).
"""

from __future__ import annotations

import csv
import io
import warnings
from pathlib import Path
from typing import Any

from rope_quant.analysis.figures import legend_outside, pyplot, save_png, suptitle
from rope_quant.analysis.tables import Table
from rope_quant.analysis.titles import Setup, calibration_setup
from rope_quant.io import atomic_write_text
from rope_quant.sweep.manifest import read_manifest
from rope_quant.sweep.records import complete_records

INTRABAND_ROWS = "intraband"
INTRABAND_RHO = "intraband-rho"
PROTOCOL = "long-context-protocol"


def find_stats(root: Path) -> tuple[Path, str] | None:
    """The first ``artifacts/<key>/stats.npz`` of the manifest's cells and a label ``name seed s``."""
    from rope_quant.sweep.manifest import ARTIFACTS_DIR

    for entry in read_manifest(root)["cells"]:
        path = root / ARTIFACTS_DIR / entry["key"] / "stats.npz"
        if path.is_file():
            return path, f"{entry['name']} seed {entry['seed']}"
    return None


def protocol_table(root: Path) -> Table | None:
    """The long-context protocol of every complete long-context cell that recorded one (Markdown: one line per
    distinct protocol)."""
    rows, md_rows = [], []
    lengths: list[str] = []
    recs = [r for r in complete_records(root) if isinstance(r.get("result", {}).get("protocol"), dict)]
    for rec in recs:
        for L in rec["result"]["protocol"].get("windows", {}):
            if L not in lengths:
                lengths.append(L)
    lengths.sort(key=int)
    for rec in recs:
        p = rec["result"]["protocol"]
        row = {"config": rec["name"], "seed": rec["seed"], "calib_corpus": p.get("calib_corpus"),
               "eval_corpus": p.get("eval_corpus"), "n_stream_tokens": p.get("n_stream_tokens"),
               "n_documents": p.get("n_documents"), "split_documents": p.get("split_documents"),
               "window_cap": p.get("window_cap"), "matched_average": p.get("matched_average")}
        for L in lengths:
            row[f"windows_{L}"] = p.get("windows", {}).get(L)
            row[f"tokens_{L}"] = p.get("scored_tokens", {}).get(L)
        rows.append(row)
        shown = {"calib → eval": f"{row['calib_corpus']} → {row['eval_corpus']}", "N": str(row["n_stream_tokens"]),
                 "docs": f"{row['n_documents']}/{row['split_documents']}", "cap": str(row["window_cap"]),
                 "windows per L": "/".join(str(row[f"windows_{L}"]) for L in lengths),
                 "scored tokens per L": "/".join(str(row[f"tokens_{L}"]) for L in lengths)}
        same = next((r for r in md_rows if all(r[k] == v for k, v in shown.items())), None)
        if same is None:
            md_rows.append({**shown, "cells": 1})
        else:
            same["cells"] += 1
    if not rows:
        return None
    for r in md_rows:
        r["cells"] = str(r["cells"])
    columns = ["config", "seed", "calib_corpus", "eval_corpus", "n_stream_tokens", "n_documents",
               "split_documents", "window_cap", "matched_average",
               *[f"{k}_{L}" for L in lengths for k in ("windows", "tokens")]]
    return Table(PROTOCOL, "Long-context protocol (App. A.4): stream and windows per length", columns, rows,
                 ["calib → eval", "N", "docs", "cap", "windows per L", "scored tokens per L", "cells"],
                 md_rows, notes=[f"L = {', '.join(lengths)}; windows = min(cap, ⌊N/L⌋), scored tokens = "
                                 "windows × (L − 1); docs = documents concatenated / documents in the evaluation "
                                 "split (A.4: the first 64); one line per distinct protocol (the CSV: one row per "
                                 "cell)."])


def intraband_table(stats: Any, label: str) -> Table:
    """The head-resolved ρ quantiles (Table A) of one set of calibration statistics."""
    from rope_quant.calib import intraband

    rows = intraband.rho_quantiles(stats)
    columns = list(rows[0])
    md_cols = ["scope", "n", "rho_q05", "rho_q25", "rho_q50", "rho_q75", "rho_q95", "abs_rho_q50", "abs_rho_q95",
               "frac_abs_rho_gt_0.1", "frac_abs_rho_gt_0.3", "sigma_ratio_median"]
    return Table(INTRABAND_RHO, f"Intra-band correlation ρ of the RoPE pairs (App. A, Table A), {label}", columns,
                 rows, md_cols, notes=[
                     "ρ = Σ12/(σ1σ2) of a frequency pair's two pre-RoPE channels over the calibration rows; "
                     "quantiles over every layer, head and pair of the scope. q / k: per Q / KV head; pooled: the "
                     "rows rule (per layer); pooled_kv_group: the per_head rule (a KV head and its GQA Q heads)."])


def intraband_csv(stats: Any) -> str:
    """σ1, σ2, ρ per scope, layer, head and pair as CSV text."""
    from rope_quant.calib import intraband

    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(intraband.ROW_COLUMNS), lineterminator="\n")
    writer.writeheader()
    writer.writerows(intraband.intraband_rows(stats))
    return buf.getvalue()


#: What the figure calls each scope of :data:`rope_quant.calib.intraband.SCOPES` (the tables keep the keys).
SCOPE_LABELS = {"q": "per Q head", "k": "per KV head", "pooled": "pooled per layer (rows rule)",
                "pooled_kv_group": "pooled per KV group (per-head rule)"}


def band_quantiles() -> tuple[float, float]:
    """The band of the |ρ| figure: the outer quantiles of the intra-band table (5% and 95%)."""
    from rope_quant.calib import intraband

    return min(intraband.QUANTILES), max(intraband.QUANTILES)


def abs_rho_quantiles(stats: Any, scope: str, quantiles: tuple[float, ...]) -> list[Any]:
    """Per pair index k: the given quantiles of |ρ| over the layers and heads of ``scope``."""
    import numpy as np

    from rope_quant.calib import intraband

    _, _, rho = intraband.sigma_rho(intraband.scope_covariances(stats)[scope])
    flat = np.abs(rho).reshape(-1, rho.shape[-1])
    with np.errstate(all="ignore"):
        return [np.nanquantile(flat, q, axis=0) for q in quantiles]


def abs_rho_figure(stats: Any, label: str = "", setup: Setup | None = None) -> Any:
    """|ρ| against the pair index k (median over layers and heads, band between the table's outer quantiles,
    5–95%): the Q and K streams on the left, the two poolings on the right."""
    import numpy as np

    from rope_quant.calib import intraband

    lo_q, hi_q = band_quantiles()
    band = f"{round(lo_q * 100)}–{round(hi_q * 100)}%"
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.0), sharey=True, layout="constrained")
    for ax, scopes, title in zip(axes, (intraband.SCOPES[:2], intraband.SCOPES[2:]),
                                 ("separately: per Q head, per KV head", "pooled: per layer, per KV group"),
                                 strict=True):
        for scope in scopes:
            med, lo, hi = abs_rho_quantiles(stats, scope, (0.5, lo_q, hi_q))
            ks = np.arange(med.size)
            (line,) = ax.plot(ks, med, marker=".", label=f"{SCOPE_LABELS.get(scope, scope)}: median")
            ax.fill_between(ks, lo, hi, color=line.get_color(), alpha=0.15, lw=0,
                            label=f"{SCOPE_LABELS.get(scope, scope)}: {band} band")
        ax.set_xlabel("frequency pair index k (0 = highest frequency)")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_title(title, fontsize=9)
        legend_outside(ax)
    axes[0].set_ylabel(f"|ρ| over layers and heads: median, {band} band")
    axes[0].set_ylim(0, 1)
    what = "intra-band |ρ| of the pre-RoPE pairs (App. A, Table A)" + (f", calibration statistics of {label}"
                                                                         if label else "")
    suptitle(fig, setup, what)
    return fig


def plot_abs_rho(stats: Any, path: Path, label: str = "", setup: Setup | None = None) -> Path:
    """Write :func:`abs_rho_figure`."""
    fig = abs_rho_figure(stats, label, setup)
    out = save_png(fig, path)
    pyplot().close(fig)
    return out


def extra_report(root: Path, figures: bool = True) -> tuple[list[Table], list[Path]]:
    """The protocol and intra-band tables  and the |ρ| figure
    of ``root``, and the extra files written."""
    from rope_quant.calib.errors import CalibrationError
    from rope_quant.calib.stats import CalibrationStats

    tables: list[Table] = []
    files: list[Path] = []
    proto = protocol_table(root)
    if proto is not None:
        tables.append(proto)
    found = find_stats(root)
    stats = None
    if found is not None:
        try:
            stats = CalibrationStats.load(found[0])
        except CalibrationError as exc:  # a damaged artefact costs the intra-band table, not the report
            warnings.warn(f"no intra-band statistics: {exc}", stacklevel=2)
    if stats is not None and found is not None:
        tables.append(intraband_table(stats, found[1]))
        files.append(atomic_write_text(root / "tables" / f"{INTRABAND_ROWS}.csv", intraband_csv(stats)))
        if figures:
            name, seed = found[1].rsplit(" seed ", 1)  # the label find_stats gives: "<name> seed <s>"
            files.append(plot_abs_rho(stats, root / "figures" / "intraband_rho.png", found[1],
                                      calibration_setup(root, name, int(seed))))
    return tables, files

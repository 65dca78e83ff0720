"""The report of a results directory: summary.json, CSV/Markdown tables, figures (docs/ARCHITECTURE.md).

The statistics are :mod:`rope_quant.analysis.paired`'s and the tables :mod:`rope_quant.analysis.tables`'; their
public names are re-exported here (``report.summarize``, ``report.Table``, ...).

Every config is paired *within seed* against a comparator (default
:data:`~rope_quant.defaults.DEFAULT_COMPARATOR`): for each seed
both cells share the model, rotations R1/R2/R4, weights and calibration windows, so the unit of
analysis is the per-seed difference ``d_s = ppl(config, s) - ppl(comparator, s)`` (positive: worse
than the comparator). On the differences we report the mean, the sample sd (``n - 1``) and the 90%
paired t interval (:func:`rope_quant.core.stats.paired_ci`); TOST equivalence at the claims' one margin
(:func:`rope_quant.core.verdict.equivalence_margin` of the control's ppl, named in the table;
:func:`rope_quant.core.stats.equivalent`, the 90% interval form); and Holm's
step-down correction over a declared family of paired t tests (:func:`rope_quant.core.stats.holm`).

Tables, in the shape of the paper's: ``multiseed`` (per-seed ppl, mean ± sd, Δ with CI),
``corrected-star`` (Holm-corrected stars and TOST), ``crossover`` (gap vs comparator per context length
L), ``estimators`` (rows / k_only / balanced / φ*), ``mixing-support`` (block size b: K range, relative
error, gap). Each is written as ``DIR/tables/<name>.csv`` and ``.md``; ``DIR/summary.md`` collects them.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rope_quant.analysis.figures import (  # the table figures live with the others; re-exported here
    legend_outside,
    plot_beyond,
    plot_crossover,
    plot_support,
    pyplot,
    save_png,
    suptitle,
    write_figures,
)
from rope_quant.analysis.paired import (
    DEFAULT_ALPHA,
    DEFAULT_COMPARATOR,
    DEFAULT_LEVEL,
    LM_EVAL_SKIP,
    MARGIN_RULE,
    METRICS,
    ReportError,
    holm_family,
    lm_eval_summary,
    margin_of,
    paired_block,
    stars,
    summarize,
)
from rope_quant.analysis.protocol_report import extra_report  # the A.4 protocol and Table A
from rope_quant.analysis.tables import (
    Table,
    beyond_table,
    build_tables,
    corrected_star_table,
    crossover_table,
    estimators_table,
    lm_eval_table,
    multiseed_table,
    sign_budget,
    summary_markdown,
    support_table,
)
from rope_quant.analysis.titles import Setup, describe
from rope_quant.io import atomic_write_text

__all__ = [
    "DEFAULT_ALPHA", "DEFAULT_COMPARATOR", "DEFAULT_LEVEL", "LM_EVAL_SKIP", "MARGIN_RULE", "METRICS",
    "ReportError", "holm_family", "lm_eval_summary", "margin_of", "paired_block", "stars", "summarize", "Table",
    "beyond_table", "build_tables", "corrected_star_table", "crossover_table", "estimators_table", "lm_eval_table",
    "multiseed_table", "sign_budget", "summary_markdown", "support_table", "legend_outside", "plot_beyond",
    "plot_crossover", "plot_support", "pyplot", "save_png", "suptitle", "write_figures", "read_csv_rows",
    "EXCESS_LABELS", "plot_phi_star_excess", "write_report",
]


# ----------------------------------------------------------------------------- figures


def read_csv_rows(path: str | os.PathLike[str]) -> list[dict[str, str]]:
    """Rows of a CSV file as dicts of strings."""
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


#: What the φ* excess figure calls verify's CSV columns (``calib/verify.py``).
EXCESS_LABELS = {"excess": "φ* (the verified angle)", "excess_identity": "identity (φ = 0)",
                 "excess_h2": "H2 (φ = π/4)", "excess_phi_hat": "φ̂ (variance rule)"}


def plot_phi_star_excess(csv_path: str | os.PathLike[str], path: str | os.PathLike[str],
                         setup: Setup | None = None) -> Path:
    """Per-pair minimax excess of φ̂ and φ* (from verify's per-pair CSV) against the pair index k.

    Plots every column whose name contains ``excess``, averaged over layers/heads per pair index.
    """
    rows = read_csv_rows(csv_path)
    if not rows:
        raise ReportError(f"{csv_path} has no rows")
    pair_col = next((c for c in ("pair", "k", "pair_index") if c in rows[0]), None)
    excess_cols = [c for c in rows[0] if "excess" in c.lower()]
    if pair_col is None or not excess_cols:
        raise ReportError(f"{csv_path}: need a pair column (pair/k) and excess columns, got {list(rows[0])}")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.8), layout="constrained")
    for col in excess_cols:
        acc: dict[int, list[float]] = {}
        for r in rows:
            try:
                acc.setdefault(int(r[pair_col]), []).append(float(r[col]))
            except (TypeError, ValueError):
                continue
        ks = sorted(acc)
        ax.plot(ks, [sum(acc[k]) / len(acc[k]) for k in ks], marker=".", label=EXCESS_LABELS.get(col, col))
    ax.set_yscale("symlog", linthresh=1e-8)
    ax.set_xlabel("pair index k")
    ax.set_ylabel("minimax excess (mean over layers)")
    legend_outside(ax)
    suptitle(fig, setup, "φ̂ and φ*: per-pair minimax excess (rope-quant verify)")
    out = save_png(fig, Path(path))
    plt.close(fig)
    return out


# ----------------------------------------------------------------------------- driver


def write_report(
    results_dir: str | os.PathLike[str],
    *,
    comparator: str | None = None,
    family: Sequence[str] | None = None,
    level: float = DEFAULT_LEVEL,
    alpha: float = DEFAULT_ALPHA,
    figures: bool = True,
    phi_star_csv: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """summary.json, summary.md, tables/*.csv|md and figures/*.png for ``results_dir``.

    Returns ``{"summary": dict, "markdown": str, "files": [paths]}``. ``phi_star_csv`` (default: the
    first ``**/*_pairs.csv`` under the directory, as written by ``rope-quant verify``) feeds the
    per-pair φ* excess figure.
    """
    root = Path(results_dir)
    summary = summarize(root, comparator=comparator, family=family, level=level,
                        alpha=alpha, write=True)
    tables = build_tables(summary)
    extra_tables, extra_files = extra_report(root, figures=figures)
    tables += extra_tables
    files: list[Path] = [root / "summary.json", *extra_files]
    for table in tables:
        files.append(atomic_write_text(root / "tables" / f"{table.name}.csv", table.csv()))
        files.append(atomic_write_text(root / "tables" / f"{table.name}.md", table.markdown()))
    text = summary_markdown(summary, tables)
    files.append(atomic_write_text(root / "summary.md", text))
    if figures:
        setup = describe(root)  # every title names the model, bits, weight mode and budget
        by_name = {t.name: t for t in tables}
        if "crossover" in by_name and by_name["crossover"].rows:
            files.append(plot_crossover(by_name["crossover"], root / "figures" / "crossover.png", setup,
                                        float(summary["holm"].get("alpha", alpha))))
        if "beyond" in by_name and by_name["beyond"].rows:
            files.append(plot_beyond(by_name["beyond"], root / "figures" / "beyond.png", setup,
                                     summary["holm"].get("results")))
        if "mixing-support" in by_name and by_name["mixing-support"].rows:
            files.append(plot_support(by_name["mixing-support"], root / "figures" / "support.png", setup))
        files += write_figures(summary, root / "figures", setup)
        found = sorted(root.glob("**/*_pairs.csv"))
        csv_path = Path(phi_star_csv) if phi_star_csv else (found[0] if found else None)
        if csv_path is not None:
            files.append(plot_phi_star_excess(csv_path, root / "figures" / "phi_star_excess.png", setup))
    return {"summary": summary, "markdown": text, "files": [str(f) for f in files]}

"""The report of ``rope-quant niah`` (App. G): accuracy per config × length (mean over seeds, with the per-seed
values) and per length × depth, the paired difference against the comparator per length, the *discriminative
lengths* (FP at or above ``saturation`` while the quantised configs spread by at least ``separation``), a
markdown table, ``niah_summary.json`` and the figure ``niah_accuracy.png``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rope_quant.analysis.figures import legend_outside, pyplot, save_png, suptitle
from rope_quant.analysis.titles import Setup, describe
from rope_quant.defaults import DEFAULT_COMPARATOR
from rope_quant.io import atomic_write_json, atomic_write_text
from rope_quant.sweep.niah import DEFAULT_CONFIGS, FP, SATURATION, SEPARATION
from rope_quant.sweep.records import complete_records

__all__ = ["collect", "discriminative_lengths", "paired", "niah_report", "accuracy_figure", "accuracy_axes",
           "SATURATION", "SEPARATION"]

SUMMARY_FILE = "niah_summary.json"
FIGURE_FILE = "niah_accuracy.png"


def _cells(out: Path) -> list[dict[str, Any]]:
    return [r for r in complete_records(out) if isinstance(r.get("result"), Mapping) and "niah" in r["result"]]


def collect(out: str | os.PathLike[str]) -> dict[str, Any]:
    """Per config, length and seed: accuracy; per config, length, depth and seed: accuracy."""
    acc: dict[str, dict[str, dict[int, float]]] = {}
    depth: dict[str, dict[str, dict[str, dict[int, float]]]] = {}
    for rec in _cells(Path(out)):
        name, seed = rec["name"], int(rec["seed"])
        table = rec["result"]["niah"]["accuracy"]
        for L, value in table["by_length"].items():
            acc.setdefault(name, {}).setdefault(L, {})[seed] = float(value)
        for L, ds in table["by_depth"].items():
            for d, value in ds.items():
                depth.setdefault(name, {}).setdefault(L, {}).setdefault(d, {})[seed] = float(value)
    return {"accuracy": acc, "depth": depth}


def discriminative_lengths(acc: Mapping[str, Mapping[str, Mapping[int, float]]], *, fp: str = FP,
                           saturation: float = SATURATION, separation: float = SEPARATION) -> list[dict[str, Any]]:
    """Per length: FP's mean accuracy, the quantised configs' means and spread, and whether the length is
    discriminative (FP >= ``saturation`` and spread >= ``separation``)."""
    rows = []
    lengths = sorted({L for per in acc.values() for L in per}, key=int)
    for L in lengths:
        quant = {n: float(np.mean(list(per[L].values()))) for n, per in acc.items() if n != fp and L in per}
        fp_acc = float(np.mean(list(acc[fp][L].values()))) if fp in acc and L in acc[fp] else None
        spread = (max(quant.values()) - min(quant.values())) if len(quant) > 1 else 0.0
        rows.append({"length": int(L), "fp": fp_acc, "quantised": quant, "spread": spread,
                     "discriminative": fp_acc is not None and fp_acc >= saturation and spread >= separation})
    return rows


def paired(acc: Mapping[str, Mapping[str, Mapping[int, float]]], a: str, b: str, length: str) -> dict[str, Any]:
    """acc(a) − acc(b) at ``length`` per shared seed, and its mean."""
    sa, sb = acc.get(a, {}).get(length, {}), acc.get(b, {}).get(length, {})
    seeds = sorted(set(sa) & set(sb))
    diffs = [sa[s] - sb[s] for s in seeds]
    return {"seeds": seeds, "diffs": diffs, "mean": float(np.mean(diffs)) if diffs else None}


def _fmt(values: Mapping[int, float]) -> str:
    vals = [values[s] for s in sorted(values)]
    return f"{np.mean(vals):.3f} [" + " ".join(f"{v:.2f}" for v in vals) + "]"


def niah_report(out: str | os.PathLike[str], *, comparator: str = DEFAULT_COMPARATOR, figures: bool = True,
                saturation: float = SATURATION, separation: float = SEPARATION) -> dict[str, Any]:
    """Write ``niah_summary.json``, ``niah_summary.md`` and (``figures``) the accuracy-against-length figure."""
    out = Path(out)
    data = collect(out)
    acc = data["accuracy"]
    names = [n for n in (FP, *DEFAULT_CONFIGS) if n in acc] + sorted(set(acc) - {FP, *DEFAULT_CONFIGS})
    lengths = sorted({L for per in acc.values() for L in per}, key=int)
    disc = discriminative_lengths(acc, saturation=saturation, separation=separation)
    pairs = {n: {L: paired(acc, comparator, n, L) for L in lengths}
             for n in names if n not in (comparator, FP) and comparator in acc}
    lines = ["NIAH accuracy (exact match; mean over seeds [per seed]):", "",
             "| config | " + " | ".join(f"L={L}" for L in lengths) + " |",
             "|---|" + "---|" * len(lengths)]
    for n in names:
        lines.append(f"| {n} | " + " | ".join(_fmt(acc[n][L]) if L in acc[n] else "–" for L in lengths) + " |")
    lines += ["", f"paired {comparator} − config (mean over seeds [per seed]):", ""]
    for n, per in pairs.items():
        lines.append(f"- {comparator} − {n}: " + "; ".join(
            f"L={L} {p['mean']:+.3f} [" + " ".join(f"{d:+.2f}" for d in p["diffs"]) + "]"
            for L, p in per.items() if p["mean"] is not None))
    lines += ["", f"discriminative lengths (FP ≥ {saturation}, quantised spread ≥ {separation}): "
              + (", ".join(str(r["length"]) for r in disc if r["discriminative"]) or "none"), ""]
    for r in disc:
        fp_txt = "–" if r["fp"] is None else f"{r['fp']:.3f}"
        lines.append(f"- L={r['length']}: FP {fp_txt}, spread {r['spread']:.3f}"
                     + (" (discriminative)" if r["discriminative"] else ""))
    lines += ["", "accuracy per depth (mean over seeds):", "",
              "| config | L | " + " | ".join(f"d={d}" for d in _depths(data)) + " |",
              "|---|---|" + "---|" * len(_depths(data))]
    for n in names:
        for L in lengths:
            per = data["depth"].get(n, {}).get(L, {})
            if per:
                lines.append(f"| {n} | {L} | " + " | ".join(
                    f"{np.mean(list(per[d].values())):.2f}" if d in per else "–" for d in _depths(data)) + " |")
    markdown = "\n".join(lines)
    summary = {"accuracy": acc, "depth": data["depth"], "discriminative": disc, "paired": pairs,
               "comparator": comparator, "saturation": saturation, "separation": separation}
    files = [atomic_write_json(out / SUMMARY_FILE, summary)]
    files.append(atomic_write_text(out / "niah_summary.md", markdown + "\n"))
    if figures and acc:
        files.append(accuracy_figure(acc, out / FIGURE_FILE, disc, describe(out)))
    return {"markdown": markdown, "summary": summary, "files": [str(f) for f in files]}


def _depths(data: Mapping[str, Any]) -> list[str]:
    return sorted({d for per in data["depth"].values() for ds in per.values() for d in ds}, key=float)


def accuracy_figure(acc: Mapping[str, Mapping[str, Mapping[int, float]]], path: Path,
                    disc: Sequence[Mapping[str, Any]] = (), setup: Setup | None = None) -> Path:
    """Write :func:`accuracy_axes`' figure."""
    fig = accuracy_axes(acc, disc, setup)
    out = save_png(fig, path)
    pyplot().close(fig)
    return out


def accuracy_axes(acc: Mapping[str, Mapping[str, Mapping[int, float]]], disc: Sequence[Mapping[str, Any]] = (),
                  setup: Setup | None = None) -> Any:
    """Accuracy against context length, one line per config (mean over seeds, per-seed values as dots); grey
    bands: the discriminative lengths. The NIAH report has no Holm family, so no marker claims significance."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.6, 4.2), layout="constrained")
    for n, per in acc.items():
        lengths = sorted(per, key=int)
        xs = [int(L) for L in lengths]
        means = [float(np.mean(list(per[L].values()))) for L in lengths]
        style = dict(color="black", linestyle="--") if n == FP else {}
        label = "unquantised model (fp)" if n == FP else n
        (line,) = ax.plot(xs, means, marker="o", label=f"{label}: mean over seeds", **style)
        for i, (x, L) in enumerate(zip(xs, lengths, strict=True)):
            ax.scatter([x] * len(per[L]), list(per[L].values()), s=10, alpha=0.35, color=line.get_color(),
                       label=f"{label}: per seed" if i == 0 else None)
    shaded = False
    for r in disc:
        if r["discriminative"]:
            ax.axvline(r["length"], color="grey", alpha=0.25, linewidth=6,
                       label=None if shaded else "discriminative length")
            shaded = True
    ax.set_xscale("log", base=2)
    ticks = sorted({int(L) for per in acc.values() for L in per})
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("NIAH accuracy (exact match)")
    ax.set_ylim(-0.03, 1.03)
    ax.set_title("needle in a haystack (RULER format, App. G); grey: discriminative lengths", fontsize=9)
    legend_outside(ax)
    suptitle(fig, setup, "NIAH accuracy against context length")
    return fig


def kind_report(root: Path, options: Any) -> Any:
    """The NIAH cell kind's part of ``rope-quant report`` (:class:`~rope_quant.analysis.kind_reports.KindReport`):
    paired against ``options.comparator``, else the manifest's."""
    from rope_quant.analysis.kind_reports import KindReport
    from rope_quant.sweep.cellkind import CellKindName
    from rope_quant.sweep.manifest import read_manifest

    comparator = options.comparator or read_manifest(root).get("comparator") or DEFAULT_COMPARATOR
    out = niah_report(root, comparator=comparator, figures=options.figures)
    return KindReport(CellKindName.NIAH.value, out["markdown"], list(out["files"]))

"""The figure of each main job, drawn from ``summary.json`` content (matplotlib, Agg backend).

* ``compare.png`` (``rope-quant compare``): perplexity of every config at every seed, and the paired
  Δ ppl against the comparator with its interval;
* ``long-context.png``: perplexity against context length L, and the gap against the comparator at each L
  with its interval;
* ``lm-eval.png``: per task, the headline metric (``acc`` where the task has it) of every config at every
  seed, and the paired Δ against the comparator with its interval;
* the report's table figures: ``crossover.png`` (gap against L), ``support.png`` (block size b) and
  ``beyond.png`` (gap against K range).

In every Δ panel the comparator is the dashed zero line (named in the legend), the dots are the per-seed
differences and the bars the paired t interval of their mean; a filled marker (and its stars) is a difference
that stays significant after the report's Holm correction, an open one is not. Every title names the model, the
bits, the weight mode and the budget (:mod:`rope_quant.analysis.titles`); every legend sits outside the axes.
:func:`write_figures` picks the figure of a summary's ``kind``. The ``*_figure`` functions return the open
matplotlib figure (tests read its titles, labels and markers); the ``plot_*`` ones write it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rope_quant.analysis.titles import Setup
from rope_quant.core.verdict import LEVEL
from rope_quant.io import atomic_writer

#: The studies (``summary["kind"]``, the manifest's study) each figure draws; not cell kinds.
COMPARE_STUDIES = ("compare", "beyond")
LONG_CONTEXT_STUDY = "long-context"
LM_EVAL_STUDY = "lm-eval"
#: Headline metric of an lm-eval task, first found.
HEADLINE_METRICS = ("acc", "acc_norm", "exact_match", "word_perplexity", "bits_per_byte")
_SEED_MARKERS = "os^Dv<>p*h"


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def save_png(fig: Any, path: Path) -> Path:
    """Write ``fig`` as a PNG atomically (120 dpi, tight box)."""
    with atomic_writer(path) as handle:
        fig.savefig(handle, format="png", dpi=120, bbox_inches="tight")
    return path


def legend_outside(ax: Any, **kwargs: Any) -> Any:
    """The axes' legend to the right of its axes, clear of the data (None when nothing is labelled)."""
    if not ax.get_legend_handles_labels()[0]:
        return None
    return ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, frameon=False,
                     **kwargs)


def suptitle(fig: Any, setup: Setup | None, what: str) -> None:
    """Two title lines: the run (model · bits · weight mode · budget) and what the figure shows."""
    line = setup.title() if setup is not None else ""
    fig.suptitle(f"{line}\n{what}" if line else what, fontsize=10)


def holm_proxy(ax: Any, reject: bool | None, alpha: float, seen: set[str], marker: str = "o") -> None:
    """A legend entry (once per verdict, neutral colour) for a filled (significant after Holm), open (not) or
    grey (outside the Holm family) marker."""
    if reject is None:
        text, face, edge = "outside the Holm family", "0.6", "0.6"
    else:
        text = f"significant after Holm (α={alpha:g})" if reject else "not significant after Holm"
        face, edge = ("0.25" if reject else "white"), "0.25"
    if text not in seen:
        seen.add(text)
        ax.plot([], [], marker, ls="none", ms=7, color=edge, mfc=face, mew=1.6, label=text)


def _level(summary: Mapping[str, Any]) -> int:
    return int(round(100 * float(summary.get("level", LEVEL))))


def _values_panel(ax: Any, names: Sequence[str], seeds: Sequence[int], values: Mapping[str, Mapping[int, float]],
                  comparator: str, xlabel: str) -> None:
    """One row per config: a marker per seed and a bar at the mean; the comparator's row is shaded."""
    plt = pyplot()
    colours = {s: plt.get_cmap("tab10")(i % 10) for i, s in enumerate(seeds)}
    labelled: set[int] = set()
    for row, name in enumerate(names):
        if name == comparator:
            ax.axhspan(row - 0.4, row + 0.4, color="0.9", zorder=0)
        per = values.get(name, {})
        for i, seed in enumerate(seeds):
            if seed in per:
                jitter = (i - (len(seeds) - 1) / 2) * min(0.1, 0.5 / max(len(seeds), 1))  # equal values stay visible
                ax.plot(per[seed], row + jitter, _SEED_MARKERS[i % len(_SEED_MARKERS)], color=colours[seed], ms=6,
                        ls="none", label=None if seed in labelled else f"seed {seed}")
                labelled.add(seed)
        if per:
            mean = sum(per.values()) / len(per)
            ax.plot([mean, mean], [row - 0.3, row + 0.3], color="black", lw=2,
                    label=None if -1 in labelled else "mean")
            labelled.add(-1)
    ax.set_yticks(range(len(names)), [f"{n}\n(comparator)" if n == comparator else n for n in names])
    ax.set_ylim(len(names) - 0.5, -0.5)
    ax.set_xlabel(xlabel)
    ax.grid(axis="x", color="0.85", lw=0.6)
    ax.margins(x=0.08)
    legend_outside(ax)


def _delta_panel(ax: Any, names: Sequence[str], values: Mapping[str, Mapping[int, float]],
                 blocks: Mapping[str, Mapping[str, Any]], comparator: str, xlabel: str,
                 holm: Mapping[str, Mapping[str, Any]] | None = None, alpha: float = 0.05) -> None:
    """One row per config: per-seed differences (dots) and the paired mean with its interval (bar); the mean is
    filled when Holm rejects (``holm[name]["reject"]``, with its stars), open when not, grey when the config
    is outside the Holm family (or ``holm`` is None: no family for this figure)."""
    control = values.get(comparator, {})
    ax.axvline(0.0, color="tab:red", ls="--", lw=1.2, label=f"{comparator} (comparator)")
    first: set[str] = set()
    for row, name in enumerate(names):
        if name == comparator:
            ax.axhspan(row - 0.4, row + 0.4, color="0.9", zorder=0)
            continue
        per = values.get(name, {})
        diffs = [per[s] - control[s] for s in per if s in control]
        ax.plot(diffs, [row + 0.22] * len(diffs), "o", color="0.45", ms=4, ls="none",
                label=None if "seed" in first else "per-seed Δ")
        first.add("seed")
        block = blocks.get(name)
        if not block:
            continue
        err = None
        if block.get("low") is not None:
            err = [[block["mean"] - block["low"]], [block["high"] - block["mean"]]]
        h = (holm or {}).get(name)
        reject = None if h is None else bool(h.get("reject"))
        colour = "tab:blue" if h is not None or holm is None else "0.5"
        ax.errorbar([block["mean"]], [row], xerr=err, fmt="D", color=colour, capsize=4, ms=7, lw=2,
                    mfc=colour if reject or h is None else "white", mew=1.6,
                    label=None if "mean" in first else "mean Δ with its interval")
        first.add("mean")
        if holm is not None:
            holm_proxy(ax, reject, alpha, first, "D")
        star = (h or {}).get("stars", "") if reject else ""
        text = f"{block['mean']:+.3g}{star}" + (f"  [{block['low']:+.3g}, {block['high']:+.3g}]" if err else
                                                f"  (n={block['n']})")
        ax.annotate(text, (block["mean"], row), xytext=(0, 9), textcoords="offset points", ha="center",
                    fontsize=7, color=colour)
    ax.set_yticks(range(len(names)), [f"{n}\n(comparator)" if n == comparator else n for n in names])
    ax.set_ylim(len(names) - 0.5, -0.5)
    ax.set_xlabel(xlabel)
    ax.grid(axis="x", color="0.85", lw=0.6)
    ax.margins(x=0.18)  # room for the interval labels
    legend_outside(ax)


def _ordered(names: Sequence[str], comparator: str) -> list[str]:
    """The comparator first, then the others in their order."""
    return ([comparator] if comparator in names else []) + [n for n in names if n != comparator]


def _close(fig: Any, path: str | os.PathLike[str]) -> Path:
    out = save_png(fig, Path(path))
    pyplot().close(fig)
    return out


def compare_figure(summary: Mapping[str, Any], setup: Setup | None = None) -> Any:
    """Perplexity per config and seed (left); paired Δ ppl against the comparator with its interval and its Holm
    verdict (right)."""
    comp, configs = summary["comparator"], summary["configs"]
    names = _ordered(list(configs), comp)
    values = {n: dict(zip(configs[n]["seeds"], configs[n]["ppl"], strict=True)) for n in names}
    seeds = list(dict.fromkeys(s for n in names for s in configs[n]["seeds"]))
    holm = summary.get("holm") or {}
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13.0, 1.6 + 0.75 * len(names)), sharey=True,
                                      layout="constrained")
    _values_panel(left, names, seeds, values, comp, "perplexity (lower is better)")
    left.set_title("perplexity per seed", fontsize=10)
    _delta_panel(right, names, values, summary.get("paired", {}), comp,
                 f"Δ ppl vs {comp} ({_level(summary)}% paired CI over seeds)", holm.get("results") or {},
                 float(holm.get("alpha", 0.05)))
    right.set_title(f"paired difference against {comp} (positive: worse)", fontsize=10)
    suptitle(fig, setup, f"rope-quant {summary.get('kind', 'compare')}: R3 configurations against {comp}")
    return fig


def plot_compare(summary: Mapping[str, Any], path: str | os.PathLike[str], setup: Setup | None = None) -> Path:
    """Write :func:`compare_figure`."""
    return _close(compare_figure(summary, setup), path)


def long_context_figure(summary: Mapping[str, Any], setup: Setup | None = None) -> Any:
    """Perplexity against context length L per config (left); gap against the comparator with its interval at
    each L, filled where it stays significant after Holm over the (L, config) family (right)."""
    comp, lc = summary["comparator"], summary["long_context"]
    lengths = lc["lengths"]
    names = _ordered(list(lc["configs"]), comp)
    alpha = float((summary.get("holm") or {}).get("alpha", 0.05))
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13.0, 4.6), layout="constrained")
    colours = {n: plt.get_cmap("tab10")(i % 10) for i, n in enumerate(names)}
    for name in names:
        xs, means = [], []
        for length in lengths:
            vals = [v for v in lc["configs"][name].get(str(length), []) if v is not None]
            if vals:
                left.plot([length] * len(vals), vals, ".", color=colours[name], alpha=0.5, ms=5)
                xs.append(length)
                means.append(sum(vals) / len(vals))
        style = {"ls": "--", "lw": 2.2} if name == comp else {"ls": "-", "lw": 1.4}
        left.plot(xs, means, marker="o", color=colours[name], label=f"{name} (comparator)" if name == comp else name,
                  **style)
    left.set_xscale("log", base=2)
    left.set_xticks(lengths, [str(v) for v in lengths])
    left.set_xlabel("context length L (tokens)")
    left.set_ylabel("perplexity (dots: seeds, line: mean)")
    left.set_title("perplexity against context length", fontsize=10)
    legend_outside(left)
    refs = {b["comparator"] for per in lc["paired"].values() for b in per.values()}
    ref_text = comp if refs <= {comp} else "control"  # App. J: each φ* against its own branch-matched control
    right.axhline(0.0, color="tab:red", ls="--", lw=1.2, label=f"{ref_text} (zero gap)")
    others = [n for n in names if any(n in per for per in lc["paired"].values())]
    width = 0.04 * max(len(others) - 1, 0)
    first: set[str] = set()
    for i, name in enumerate(others):
        xs, ys, lo, hi, rejects = [], [], [], [], []
        for length in lengths:
            block = lc["paired"].get(str(length), {}).get(name)
            if not block:
                continue
            shift = 2 ** ((i - (len(others) - 1) / 2) * width)  # spread configs sideways on the log axis
            xs.append(length * shift)
            ys.append(block["mean"])
            lo.append(block["mean"] - block["low"] if block.get("low") is not None else 0.0)
            hi.append(block["high"] - block["mean"] if block.get("high") is not None else 0.0)
            rejects.append(block.get("reject"))
        label = name if ref_text == comp else f"{name} − its control"
        right.errorbar(xs, ys, yerr=[lo, hi], marker="none", capsize=4, color=colours[name], label=label, lw=1.4)
        for x, y, reject in zip(xs, ys, rejects, strict=True):
            right.plot([x], [y], "o", ms=7, color=colours[name], mfc=colours[name] if reject else "white", mew=1.6)
            holm_proxy(right, None if reject is None else bool(reject), alpha, first)
    right.set_xscale("log", base=2)
    right.set_xticks(lengths, [str(v) for v in lengths])
    right.set_xlabel("context length L (tokens)")
    right.set_ylabel(f"gap: ppl − ppl({ref_text}), {_level(summary)}% paired CI")
    right.set_title(f"gap against {ref_text} (positive: worse); filled: significant after Holm", fontsize=10)
    legend_outside(right)
    suptitle(fig, setup, f"rope-quant {summary.get('kind', 'long-context')}: perplexity against context length")
    return fig


def plot_long_context(summary: Mapping[str, Any], path: str | os.PathLike[str], setup: Setup | None = None) -> Path:
    """Write :func:`long_context_figure`."""
    return _close(long_context_figure(summary, setup), path)


def headline_metric(metrics: Sequence[str]) -> str | None:
    """The metric an lm-eval task is plotted by: the first of :data:`HEADLINE_METRICS` it has, else its first."""
    return next((m for m in HEADLINE_METRICS if m in metrics), metrics[0] if metrics else None)


def lm_eval_figure(summary: Mapping[str, Any], setup: Setup | None = None) -> Any:
    """Per task (one row each): the headline metric per config and seed (left); the paired Δ against the
    comparator with its interval (right; the lm-eval report has no Holm family, so no marker claims one)."""
    comp, lm = summary["comparator"], summary["lm_eval"]
    tasks = [t for t in lm["tasks"] if headline_metric(lm["metrics"][t])]
    names = _ordered(list(lm["configs"]), comp)
    seeds = list(dict.fromkeys(s for n in names for s in lm["seeds"][n]))
    plt = pyplot()
    fig, axes = plt.subplots(len(tasks), 2, figsize=(13.0, 0.6 + (1.2 + 0.75 * len(names)) * len(tasks)),
                             squeeze=False, layout="constrained")
    for (left, right), task in zip(axes, tasks, strict=True):
        metric = headline_metric(lm["metrics"][task])
        values = {n: {s: v for s, v in zip(lm["seeds"][n], lm["configs"][n].get(task, {}).get(metric, []),
                                           strict=False) if v is not None} for n in names}
        better = (lm.get("higher_is_better") or {}).get(metric)
        hint = "" if better is None else (" (higher is better)" if better else " (lower is better)")
        _values_panel(left, names, seeds, values, comp, f"{metric}{hint}")
        left.set_title(f"{task}: {metric} per seed", fontsize=10)
        blocks = lm["paired"].get(task, {}).get(metric, {})
        _delta_panel(right, names, values, blocks, comp,
                     f"Δ {metric} vs {comp} ({_level(summary)}% paired CI over seeds)")
        right.set_title(f"{task}: paired difference against {comp} (no Holm family)", fontsize=10)
    suptitle(fig, setup, f"rope-quant lm-eval: task metrics against {comp}")
    return fig


def plot_lm_eval(summary: Mapping[str, Any], path: str | os.PathLike[str], setup: Setup | None = None) -> Path:
    """Write :func:`lm_eval_figure`."""
    return _close(lm_eval_figure(summary, setup), path)


# ----------------------------------------------------------------------------- the report's table figures


def plot_crossover(table: Any, path: str | os.PathLike[str], setup: Setup | None = None,
                   alpha: float = 0.05) -> Path:
    """The ``crossover`` table's figure: perplexity gap against context length, one line per config, with its CI
    as error bars; a filled marker is a gap that stays significant after Holm over the (L, config) family (the
    table's ``p_holm``)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10.0, 4.2), layout="constrained")
    first: set[str] = set()
    for i, name in enumerate(dict.fromkeys(r["config"] for r in table.rows)):
        colour = plt.get_cmap("tab10")(i % 10)
        rows = [r for r in table.rows if r["config"] == name and r["gap"] is not None]
        xs = [r["L"] for r in rows]
        ys = [r["gap"] for r in rows]
        err = [[(r["gap"] - r["ci_low"]) if r["ci_low"] is not None else 0 for r in rows],
               [(r["ci_high"] - r["gap"]) if r["ci_high"] is not None else 0 for r in rows]]
        controls = ", ".join(dict.fromkeys(r["control"] for r in rows))
        ax.errorbar(xs, ys, yerr=err, marker="none", capsize=3, color=colour, label=f"{name} − {controls}")
        for r in rows:
            reject = None if r.get("p_holm") is None else r["p_holm"] <= alpha
            ax.plot([r["L"]], [r["gap"]], "o", ms=7, color=colour, mfc=colour if reject else "white", mew=1.6)
            holm_proxy(ax, reject, alpha, first)
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    lengths = sorted({r["L"] for r in table.rows})
    ax.set_xticks(lengths, [str(v) for v in lengths])
    ax.set_xlabel("context length L (tokens)")
    ax.set_ylabel("gap: ppl(config) − ppl(control)\n(90% paired CI)")
    ax.set_title("gap by context length (positive: worse)", fontsize=9)
    legend_outside(ax)
    suptitle(fig, setup, "crossover: where the gap changes sign")
    out = save_png(fig, Path(path))
    plt.close(fig)
    return out


def plot_support(table: Any, path: str | os.PathLike[str], setup: Setup | None = None) -> Path:
    """Support interpolation: K range, relative K error and perplexity gap against block size b."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.8), layout="constrained")
    bs = [r["b"] for r in table.rows]
    for ax, key, label in zip(axes, ("k_range_mean", "k_rel_err", "gap"),
                              ("mean K range", "relative K error", "Δ ppl vs comparator (90% paired CI)"),
                              strict=True):
        ys = [r[key] if r[key] is not None else math.nan for r in table.rows]
        if key == "gap":
            err = [[(r["gap"] - r["ci_low"]) if r["ci_low"] is not None else 0 for r in table.rows],
                   [(r["ci_high"] - r["gap"]) if r["ci_high"] is not None else 0 for r in table.rows]]
            ax.errorbar(bs, ys, yerr=err, marker="o", capsize=3)
            ax.axhline(0.0, color="grey", lw=0.8)
        else:
            ax.plot(bs, ys, marker="o")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size b")
        ax.set_ylabel(label)
    suptitle(fig, setup, "mixing support: block-diagonal R3 of block size b")
    out = save_png(fig, Path(path))
    plt.close(fig)
    return out


def plot_beyond(table: Any, path: str | os.PathLike[str], setup: Setup | None = None,
                holm: Mapping[str, Mapping[str, Any]] | None = None) -> Path:
    """Δ ppl vs the comparator (with its CI) against the mean K range: colour = angle rule, filled circles =
    RoPE-commuting maps, open squares = maps that mix across pairs; stars: significant after Holm (``holm``: the
    summary's ``holm["results"]``)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8.0, 4.4), layout="constrained")
    colours = {a: plt.get_cmap("tab10")(i % 10) for i, a in enumerate(dict.fromkeys(r["angles"] for r in table.rows))}
    for row in table.rows:
        if row["k_range_mean"] is None:
            continue
        gap = row["delta"] if row["delta"] is not None else 0.0
        err = [[gap - row["ci_low"]], [row["ci_high"] - gap]] if row["ci_low"] is not None else None
        colour = colours[row["angles"]]
        ax.errorbar([row["k_range_mean"]], [gap], yerr=err, marker="o" if row["commutes"] else "s", capsize=3,
                    ls="none", color=colour, mfc=colour if row["commutes"] else "white", ms=7,
                    label=f"{row['r3']}: {row['angles']}")
        h = (holm or {}).get(row["config"]) or {}
        stars = h.get("stars", "") if h.get("reject") else ""
        if stars:
            ax.annotate(stars, (row["k_range_mean"], gap), xytext=(6, 4), textcoords="offset points",
                        fontsize=9, color=colour)
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.set_xlabel("mean K range after R3 (the dynamic quantiser's range)")
    ax.set_ylabel("Δ ppl vs comparator (90% CI)")
    ax.set_title("filled: commutes with RoPE; open: mixes across pairs; *: significant after Holm", fontsize=9)
    legend_outside(ax)
    suptitle(fig, setup, "beyond the paper: gap against K range")
    out = save_png(fig, Path(path))
    plt.close(fig)
    return out


def write_figures(summary: Mapping[str, Any], directory: str | os.PathLike[str],
                  setup: Setup | None = None) -> list[Path]:
    """The figure of the summary's study under ``directory`` (none when it has no data); ``setup`` titles it
    (:func:`rope_quant.analysis.titles.describe`)."""
    directory = Path(directory)
    study = summary.get("kind")  # summary.json keeps the manifest's study under its earlier key
    out: list[Path] = []
    if study in COMPARE_STUDIES and summary.get("configs"):
        out.append(plot_compare(summary, directory / "compare.png", setup))
    if study == LONG_CONTEXT_STUDY and (summary.get("long_context") or {}).get("configs"):
        out.append(plot_long_context(summary, directory / "long-context.png", setup))
    if study == LM_EVAL_STUDY and (summary.get("lm_eval") or {}).get("configs"):
        out.append(plot_lm_eval(summary, directory / "lm-eval.png", setup))
    return out

"""The figure of each main job, drawn from ``summary.json`` content (matplotlib, Agg backend).

* ``compare.png`` (``rope-quant compare``): perplexity of every config at every seed, and the paired
  Δ ppl against the comparator with its interval;
* ``long-context.png``: perplexity against context length L, and the gap against the comparator at each L
  with its interval;
* ``lm-eval.png``: per task, the headline metric (``acc`` where the task has it) of every config at every
  seed, and the paired Δ against the comparator with its interval.

In every Δ panel the comparator is the dashed zero line (named in the legend), the dots are the per-seed
differences and the bars the paired t interval of their mean. :func:`write_figures` picks the figure of a
summary's ``kind``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rope_quant.io import atomic_writer

COMPARE_KINDS = ("compare", "beyond")
LONG_CONTEXT_KIND = "long-context"
LM_EVAL_KIND = "lm-eval"
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


def _level(summary: Mapping[str, Any]) -> int:
    return int(round(100 * float(summary.get("level", 0.90))))


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
    if labelled:
        ax.legend(fontsize=8, loc="best")


def _delta_panel(ax: Any, names: Sequence[str], values: Mapping[str, Mapping[int, float]],
                 blocks: Mapping[str, Mapping[str, Any]], comparator: str, xlabel: str) -> None:
    """One row per config: per-seed differences (dots) and the paired mean with its interval (bar)."""
    control = values.get(comparator, {})
    ax.axvline(0.0, color="tab:red", ls="--", lw=1.2, label=f"{comparator} (comparator)")
    for row, name in enumerate(names):
        if name == comparator:
            ax.axhspan(row - 0.4, row + 0.4, color="0.9", zorder=0)
            continue
        per = values.get(name, {})
        diffs = [per[s] - control[s] for s in per if s in control]
        first = row == next((i for i, n in enumerate(names) if n != comparator), -1)
        ax.plot(diffs, [row + 0.22] * len(diffs), "o", color="0.45", ms=4, ls="none",
                label="per-seed Δ" if first else None)
        block = blocks.get(name)
        if not block:
            continue
        err = None
        if block.get("low") is not None:
            err = [[block["mean"] - block["low"]], [block["high"] - block["mean"]]]
        ax.errorbar([block["mean"]], [row], xerr=err, fmt="D", color="tab:blue", capsize=4, ms=6, lw=2,
                    label="mean Δ with its interval" if first else None)
        text = f"{block['mean']:+.3g}" + (f"  [{block['low']:+.3g}, {block['high']:+.3g}]" if err else
                                          f"  (n={block['n']})")
        ax.annotate(text, (block["mean"], row), xytext=(0, 9), textcoords="offset points", ha="center",
                    fontsize=7, color="tab:blue")
    ax.set_yticks(range(len(names)), [f"{n}\n(comparator)" if n == comparator else n for n in names])
    ax.set_ylim(len(names) - 0.5, -0.5)
    ax.set_xlabel(xlabel)
    ax.grid(axis="x", color="0.85", lw=0.6)
    ax.margins(x=0.18)  # room for the interval labels
    if comparator in names:  # the comparator's row of this panel is empty: the legend goes there
        ax.legend(fontsize=8, loc="upper center", ncol=3, framealpha=0.9, borderaxespad=0.3)
    else:
        ax.legend(fontsize=8, loc="best")


def _ordered(names: Sequence[str], comparator: str) -> list[str]:
    """The comparator first, then the others in their order."""
    return ([comparator] if comparator in names else []) + [n for n in names if n != comparator]


def plot_compare(summary: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Perplexity per config and seed (left); paired Δ ppl against the comparator with its interval (right)."""
    comp, configs = summary["comparator"], summary["configs"]
    names = _ordered(list(configs), comp)
    values = {n: dict(zip(configs[n]["seeds"], configs[n]["ppl"], strict=True)) for n in names}
    seeds = list(dict.fromkeys(s for n in names for s in configs[n]["seeds"]))
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11.5, 1.0 + 0.75 * len(names)), sharey=True)
    _values_panel(left, names, seeds, values, comp, "perplexity (lower is better)")
    left.set_title("perplexity per seed", fontsize=10)
    _delta_panel(right, names, values, summary.get("paired", {}), comp,
                 f"Δ ppl vs {comp} ({_level(summary)}% paired CI over seeds)")
    right.set_title(f"paired difference against {comp} (positive: worse)", fontsize=10)
    fig.suptitle(f"rope-quant {summary.get('kind', 'compare')}: {len(seeds)} seeds", fontsize=11)
    fig.tight_layout()
    out = save_png(fig, Path(path))
    plt.close(fig)
    return out


def plot_long_context(summary: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Perplexity against context length L per config (left); gap against the comparator with its interval
    at each L (right)."""
    comp, lc = summary["comparator"], summary["long_context"]
    lengths = lc["lengths"]
    names = _ordered(list(lc["configs"]), comp)
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11.5, 4.2))
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
    left.legend(fontsize=8)
    refs = {b["comparator"] for per in lc["paired"].values() for b in per.values()}
    ref_text = comp if refs <= {comp} else "control"  # App. J: each φ* against its own branch-matched control
    right.axhline(0.0, color="tab:red", ls="--", lw=1.2, label=f"{ref_text} (zero gap)")
    others = [n for n in names if any(n in per for per in lc["paired"].values())]
    width = 0.04 * max(len(others) - 1, 0)
    for i, name in enumerate(others):
        xs, ys, lo, hi = [], [], [], []
        for length in lengths:
            block = lc["paired"].get(str(length), {}).get(name)
            if not block:
                continue
            shift = 2 ** ((i - (len(others) - 1) / 2) * width)  # spread configs sideways on the log axis
            xs.append(length * shift)
            ys.append(block["mean"])
            lo.append(block["mean"] - block["low"] if block.get("low") is not None else 0.0)
            hi.append(block["high"] - block["mean"] if block.get("high") is not None else 0.0)
        label = name if ref_text == comp else f"{name} − its control"
        right.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=4, color=colours[name], label=label, lw=1.4)
    right.set_xscale("log", base=2)
    right.set_xticks(lengths, [str(v) for v in lengths])
    right.set_xlabel("context length L (tokens)")
    right.set_ylabel(f"gap: ppl − ppl({ref_text}), {_level(summary)}% paired CI")
    right.set_title(f"gap against {ref_text} (positive: worse)", fontsize=10)
    right.legend(fontsize=8)
    fig.tight_layout()
    out = save_png(fig, Path(path))
    plt.close(fig)
    return out


def headline_metric(metrics: Sequence[str]) -> str | None:
    """The metric an lm-eval task is plotted by: the first of :data:`HEADLINE_METRICS` it has, else its first."""
    return next((m for m in HEADLINE_METRICS if m in metrics), metrics[0] if metrics else None)


def plot_lm_eval(summary: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Per task (one row each): the headline metric per config and seed (left); the paired Δ against the
    comparator with its interval (right)."""
    comp, lm = summary["comparator"], summary["lm_eval"]
    tasks = [t for t in lm["tasks"] if headline_metric(lm["metrics"][t])]
    names = _ordered(list(lm["configs"]), comp)
    seeds = list(dict.fromkeys(s for n in names for s in lm["seeds"][n]))
    plt = pyplot()
    fig, axes = plt.subplots(len(tasks), 2, figsize=(11.5, (1.2 + 0.75 * len(names)) * len(tasks)), squeeze=False)
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
        right.set_title(f"{task}: paired difference against {comp}", fontsize=10)
    fig.tight_layout()
    out = save_png(fig, Path(path))
    plt.close(fig)
    return out


def write_figures(summary: Mapping[str, Any], directory: str | os.PathLike[str]) -> list[Path]:
    """The figure of the summary's job kind under ``directory`` (none when it has no data)."""
    directory = Path(directory)
    kind = summary.get("kind")
    out: list[Path] = []
    if kind in COMPARE_KINDS and summary.get("configs"):
        out.append(plot_compare(summary, directory / "compare.png"))
    if kind == LONG_CONTEXT_KIND and (summary.get("long_context") or {}).get("configs"):
        out.append(plot_long_context(summary, directory / "long-context.png"))
    if kind == LM_EVAL_KIND and (summary.get("lm_eval") or {}).get("configs"):
        out.append(plot_lm_eval(summary, directory / "lm-eval.png"))
    return out

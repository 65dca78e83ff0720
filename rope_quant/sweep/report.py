"""Paired analysis of a results directory: summary.json, CSV/Markdown tables, figures (docs/ARCHITECTURE.md).

Every config is paired *within seed* against a comparator (default ``hadamard``): for each seed
both cells share the model, rotations R1/R2/R4, weights and calibration windows, so the unit of
analysis is the per-seed difference ``d_s = ppl(config, s) - ppl(comparator, s)`` (positive: worse
than the comparator). On the differences we report the mean, the sample sd (``n - 1``) and the 90%
paired t interval (:func:`rope_quant.core.stats.paired_ci`); TOST equivalence at margins 0.02, 0.05 and
0.10 perplexity points (:func:`rope_quant.core.stats.equivalent`, the 90% interval form); and Holm's
step-down correction over a declared family of paired t tests (:func:`rope_quant.core.stats.holm`).

Tables, in the shape of the paper's: ``multiseed`` (per-seed ppl, mean ± sd, Δ with CI),
``corrected-star`` (Holm-corrected stars and TOST), ``crossover`` (gap vs comparator per context length
L), ``estimators`` (rows / k_only / balanced / φ*), ``mixing-support`` (block size b: K range, relative
error, gap). Each is written as ``DIR/tables/<name>.csv`` and ``.md``; ``DIR/summary.md`` collects them.
"""

from __future__ import annotations

import csv
import io
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rope_quant.core import stats
from rope_quant.io import atomic_write_json, atomic_write_text, markdown_table
from rope_quant.sweep.figures import (  # the table figures live with the others; re-exported here
    legend_outside,
    plot_beyond,
    plot_crossover,
    plot_support,
    pyplot,
    save_png,
    suptitle,
    write_figures,
)
from rope_quant.sweep.manifest import read_manifest
from rope_quant.sweep.records import complete_records, status
from rope_quant.sweep.titles import Setup, describe

DEFAULT_COMPARATOR = "hadamard"
DEFAULT_MARGINS: tuple[float, ...] = (0.02, 0.05, 0.10)
DEFAULT_LEVEL = 0.90
DEFAULT_ALPHA = 0.05
#: Per-seed record fields carried into the summary (``r3_folds``: whether the R3 folds into this model).
METRICS = ("k_range_mean", "k_range_max", "delta_mean", "k_rel_err", "r3_folds")


class ReportError(ValueError):
    """A results directory that cannot be summarised as asked."""


def margin_key(margin: float) -> str:
    """JSON key of an equivalence margin: ``0.02 -> "0.02"``, ``0.1 -> "0.10"``."""
    return f"{margin:.2f}"


def stars(p_adjusted: float | None, alpha: float = DEFAULT_ALPHA) -> str:
    """Significance stars of a Holm-adjusted p-value: *** < 0.001, ** < 0.01, * <= alpha."""
    if p_adjusted is None:
        return ""
    if p_adjusted < 0.001:
        return "***"
    if p_adjusted < 0.01:
        return "**"
    return "*" if p_adjusted <= alpha else ""


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _mean(values: Sequence[Any]) -> float | None:
    vals = [float(v) for v in values if _finite(v)]
    return sum(vals) / len(vals) if vals else None


def _sd(values: Sequence[Any]) -> float | None:
    vals = [float(v) for v in values if _finite(v)]
    return stats.sample_sd(vals) if len(vals) >= 2 else None


# ----------------------------------------------------------------------------- paired statistics


def paired_block(
    treatment: Mapping[int, float], control: Mapping[int, float], comparator: str,
    level: float = DEFAULT_LEVEL, margins: Sequence[float] = DEFAULT_MARGINS,
) -> dict[str, Any] | None:
    """Paired statistics of ``treatment - control`` over the seeds both have (None if no common seed).

    With one common seed only the difference is known: ``sd``, ``low``, ``high`` and ``p`` are None and
    no equivalence is claimed.
    """
    common = [s for s in treatment if s in control and _finite(treatment[s]) and _finite(control[s])]
    if not common:
        return None
    t = [float(treatment[s]) for s in common]
    c = [float(control[s]) for s in common]
    block: dict[str, Any] = {"comparator": comparator, "n": len(common), "seeds": common, "level": level}
    if len(common) >= 2:
        ci = stats.paired_ci(t, c, level=level)
        block.update(mean=ci.mean, sd=ci.sd, low=ci.low, high=ci.high, p=stats.paired_t_pvalue(t, c))
        block["equivalence"] = {margin_key(m): stats.equivalent(ci, m) for m in margins}
    else:
        block.update(mean=t[0] - c[0], sd=None, low=None, high=None, p=None)
        block["equivalence"] = {margin_key(m): False for m in margins}
    return block


def holm_family(
    paired: Mapping[str, Mapping[str, Any]], family: Sequence[str] | None, alpha: float = DEFAULT_ALPHA
) -> dict[str, Any]:
    """Holm over the family's paired t p-values (members without a p-value are left out and listed)."""
    names = list(family) if family is not None else list(paired)
    unknown = [n for n in names if n not in paired]
    tested = [n for n in names if n in paired and paired[n].get("p") is not None]
    reject, adjusted = stats.holm([paired[n]["p"] for n in tested], alpha=alpha) if tested else ([], [])
    results = {
        n: {"p": paired[n]["p"], "p_holm": adj, "reject": rej, "stars": stars(adj, alpha)}
        for n, rej, adj in zip(tested, reject, adjusted, strict=True)
    }
    return {"family": tested, "alpha": alpha, "untested": [n for n in names if n not in tested and n not in
                                                          unknown], "unknown": unknown, "results": results}


# ----------------------------------------------------------------------------- summary


def _seed_map(values: Mapping[str, Mapping[int, Any]], name: str) -> dict[int, Any]:
    return dict(values.get(name, {}))


#: lm-eval numbers that are bookkeeping, not metrics.
LM_EVAL_SKIP = ("sample_len",)


def lm_eval_summary(
    records: Sequence[Mapping[str, Any]], name_order: Sequence[str], seed_order: Sequence[int], comparator: str,
    level: float = DEFAULT_LEVEL,
) -> dict[str, Any]:
    """lm-eval metrics of the complete cells, paired within seed against ``comparator`` (empty if none).

    Shape::

        {"tasks": [...], "metrics": {task: [metric, ...]}, "seeds": {name: [...]},
         "configs": {name: {task: {metric: [value per seed of seeds[name]]}}},
         "paired": {task: {metric: {name: paired block (mean, sd, low, high, n, p, ...)}}},
         "higher_is_better": {metric: bool | None}}

    Stderr entries (``*_stderr``) are left out; Δ = metric(config) − metric(comparator) within seed.
    """
    values: dict[str, dict[str, dict[str, dict[int, float]]]] = {}  # name -> task -> metric -> seed -> value
    for rec in records:
        tasks = rec["result"].get("tasks")
        if not isinstance(tasks, Mapping):
            continue
        for task, metrics in tasks.items():
            for metric, value in metrics.items():
                if metric.endswith("_stderr") or metric in LM_EVAL_SKIP or not _finite(value):
                    continue
                per = values.setdefault(rec["name"], {}).setdefault(task, {}).setdefault(metric, {})
                per[int(rec["seed"])] = float(value)
    if not values:
        return {}
    names = [n for n in name_order if n in values]
    tasks = list(dict.fromkeys(t for n in names for t in values[n]))
    metrics = {t: list(dict.fromkeys(m for n in names for m in values[n].get(t, {}))) for t in tasks}
    seeds = {n: [s for s in seed_order if any(s in per for tv in values[n].values() for per in tv.values())]
             for n in names}
    configs = {n: {t: {m: [values[n][t][m].get(s) for s in seeds[n]] for m in values[n][t]} for t in values[n]}
               for n in names}
    paired: dict[str, dict[str, dict[str, Any]]] = {}
    for task in tasks:
        for metric in metrics[task]:
            control = values.get(comparator, {}).get(task, {}).get(metric, {})
            for name in names:
                treat = values[name].get(task, {}).get(metric, {})
                if name == comparator or not control or not treat:
                    continue
                block = paired_block(treat, control, comparator, level)
                if block is not None:
                    block.pop("equivalence")
                    paired.setdefault(task, {}).setdefault(metric, {})[name] = block
    lower = ("perplexity", "bits_per_byte", "loss")
    higher = {m: (False if any(w in m for w in lower) else True if m.startswith(("acc", "exact_match", "f1"))
                  else None) for t in tasks for m in metrics[t]}
    return {"tasks": tasks, "metrics": metrics, "seeds": seeds, "configs": configs, "paired": paired,
            "higher_is_better": higher}


def summarize(
    results_dir: str | os.PathLike[str],
    *,
    comparator: str | None = None,
    family: Sequence[str] | None = None,
    level: float = DEFAULT_LEVEL,
    margins: Sequence[float] = DEFAULT_MARGINS,
    alpha: float = DEFAULT_ALPHA,
    write: bool = True,
) -> dict[str, Any]:
    """Build (and by default write atomically) ``DIR/summary.json`` from the complete cells of ``DIR``.

    Shape (a contract other tools read)::

        {"configs": {NAME: {"ppl": [...], "k_range_mean": [...], "k_rel_err": [...], "seeds": [...], ...}},
         "paired": {NAME: {"comparator", "n", "mean", "sd", "low", "high", "p", "seeds", "level"}},
         "equivalence": {NAME: {"0.02": bool, "0.05": bool, "0.10": bool}},
         "holm": {"family": [...], "alpha": .., "results": {NAME: {"p", "p_holm", "reject", "stars"}}},
         "seeds": [...], "comparator": .., "kind": .., "meta": {...}, "long_context": {...},
         "lm_eval": {...} (see :func:`lm_eval_summary`), "status": {...}}

    Per-config lists are aligned with that config's ``seeds``. ``paired`` excludes the comparator.
    """
    manifest = read_manifest(results_dir)
    comparator = comparator or manifest.get("comparator") or DEFAULT_COMPARATOR
    if family is None and manifest.get("family") is not None:
        family = list(manifest["family"])
    records = complete_records(results_dir)
    seed_order = list(dict.fromkeys(int(c["seed"]) for c in manifest["cells"]))
    name_order = list(dict.fromkeys(c["name"] for c in manifest["cells"]))

    ppl: dict[str, dict[int, float]] = {}
    metrics: dict[str, dict[str, dict[int, Any]]] = {m: {} for m in METRICS}
    lengths: dict[str, dict[int, dict[int, float | None]]] = {}
    tokens: dict[str, int] = {}  # scored tokens per cell (the fewest over a config's seeds): the budget's unit
    for rec in records:
        name, seed, result = rec["name"], int(rec["seed"]), rec["result"]
        if _finite(result.get("ppl")):
            ppl.setdefault(name, {})[seed] = float(result["ppl"])
            if isinstance(result.get("n_tokens"), int):
                tokens[name] = min(tokens.get(name, result["n_tokens"]), result["n_tokens"])
            for m in METRICS:
                metrics[m].setdefault(name, {})[seed] = result.get(m)
        if isinstance(result.get("lengths"), Mapping):
            for length, res in result["lengths"].items():
                value = res.get("ppl") if isinstance(res, Mapping) else None
                lengths.setdefault(name, {}).setdefault(int(length), {})[seed] = (
                    float(value) if _finite(value) else None
                )

    lm_eval = lm_eval_summary(records, name_order, seed_order, comparator, level)

    configs: dict[str, Any] = {}
    for name in name_order:
        if name not in ppl:
            continue
        seeds = [s for s in seed_order if s in ppl[name]]
        configs[name] = {
            "seeds": seeds,
            "ppl": [ppl[name][s] for s in seeds],
            **{m: [metrics[m][name].get(s) for s in seeds] for m in METRICS},
            "mean": _mean([ppl[name][s] for s in seeds]),
            "sd": _sd([ppl[name][s] for s in seeds]),
        }

    meta = manifest.get("meta") or {}
    # a config may name its own control (App. J: φ* against the branch-matched φ̂ of the same corpus; App. F:
    # each bit setting's configs against that setting's hadamard)
    control_of = {n: (meta.get(n) or {}).get("control", comparator) for n in name_order}
    controls = set(control_of.values())
    paired: dict[str, Any] = {}
    for name in configs:
        ref = control_of[name]
        if name in controls or name == ref or ref not in ppl:
            continue
        block = paired_block(ppl[name], ppl[ref], ref, level, margins)
        if block is not None:
            if name in tokens and ref in tokens:
                block["tokens"] = min(tokens[name], tokens[ref])
            paired[name] = block
    equivalence = {name: block.pop("equivalence") for name, block in paired.items()}
    holm = holm_family(paired, family, alpha)

    long_context: dict[str, Any] = {}
    if lengths:
        all_lengths = sorted({length for per in lengths.values() for length in per})
        lc_paired: dict[str, dict[str, Any]] = {}
        for length in all_lengths:
            for name in name_order:
                if name in controls or name not in lengths:
                    continue
                ref = control_of[name]
                control = {s: v for s, v in lengths.get(ref, {}).get(length, {}).items() if v is not None}
                treat = {s: v for s, v in lengths[name].get(length, {}).items() if v is not None}
                block = paired_block(treat, control, ref, level, margins) if control else None
                if block is not None:
                    block.pop("equivalence")
                    lc_paired.setdefault(str(length), {})[name] = block
        lc_family = [(length, name) for length, per in lc_paired.items() for name in per
                     if (family is None or name in family) and per[name].get("p") is not None]
        reject, adjusted = (stats.holm([lc_paired[length][name]["p"] for length, name in lc_family], alpha=alpha)
                            if lc_family else ([], []))
        for (length, name), rej, adj in zip(lc_family, reject, adjusted, strict=True):
            lc_paired[length][name].update(p_holm=adj, reject=rej)
        long_context = {
            "lengths": all_lengths,
            "configs": {
                name: {str(length): [lengths[name][length].get(s) for s in seed_order
                                     if s in lengths[name][length]]
                       for length in sorted(lengths[name])}
                for name in name_order if name in lengths
            },
            "seeds": {
                name: {str(length): [s for s in seed_order if s in lengths[name][length]]
                       for length in sorted(lengths[name])}
                for name in name_order if name in lengths
            },
            "paired": lc_paired,
            "holm_family_size": len(lc_family),
        }

    st = status(results_dir)
    summary = {
        "kind": manifest.get("kind", "custom"),
        "comparator": comparator,
        "seeds": [s for s in seed_order if any(s in per for per in ppl.values())
                  or any(s in seeds for seeds in (lm_eval.get("seeds") or {}).values())
                  or any(s in per for by_length in lengths.values() for per in by_length.values())],
        "level": level,
        "margins": [margin_key(m) for m in margins],
        "configs": configs,
        "paired": paired,
        "equivalence": equivalence,
        "holm": holm,
        "meta": manifest.get("meta") or {},
        "long_context": long_context,
        "lm_eval": lm_eval,
        "status": {"total": st.total, "complete": len(st.complete), "failed": st.failed,
                   "missing": st.missing},
    }
    if write:
        atomic_write_json(Path(results_dir) / "summary.json", summary)
    return summary


# ----------------------------------------------------------------------------- tables


@dataclass
class Table:
    """One table: raw rows for CSV, formatted rows for Markdown."""

    name: str
    title: str
    columns: list[str]
    rows: list[dict[str, Any]]
    md_columns: list[str] = field(default_factory=list)
    md_rows: list[dict[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def csv(self) -> str:
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=self.columns, extrasaction="ignore", lineterminator="\n")
        writer.writeheader()
        for row in self.rows:
            writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
        return buf.getvalue()

    def markdown(self) -> str:
        cols = self.md_columns or self.columns
        rows = self.md_rows or [{c: _fmt(r.get(c)) for c in cols} for r in self.rows]
        lines = [f"### {self.title}", "", markdown_table(rows, cols)]
        if self.notes:
            lines += [""] + [f"_{n}_" for n in self.notes]
        return "\n".join(lines) + "\n"


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        if not math.isfinite(x):
            return "–"
        if x != 0 and (abs(x) < 10 ** -digits or abs(x) >= 1e5):
            return f"{x:.{digits}g}" if abs(x) >= 1e5 else f"{x:.2e}"
        return f"{x:.{digits}f}"
    return str(x)


def _fmt_p(p: Any) -> str:
    if p is None:
        return "–"
    return f"{p:.2e}" if p < 1e-3 else f"{p:.4f}"


def _mean_sd(mean: Any, sd: Any) -> str:
    return _fmt(mean) if sd is None else f"{_fmt(mean)} ± {_fmt(sd)}"


def _delta_ci(block: Mapping[str, Any] | None) -> str:
    if not block:
        return "–"
    if block.get("low") is None:
        return f"{block['mean']:+.3f} (n={block['n']})"
    return f"{block['mean']:+.3f} [{block['low']:+.3f}, {block['high']:+.3f}]"


def _control_note(block: Mapping[str, Any], comparator: str) -> str:
    """``"vs <control>: "`` where a config is paired against its own control instead of the comparator."""
    return "" if block.get("comparator") == comparator else f"vs {block['comparator']}: "


def multiseed_table(summary: Mapping[str, Any]) -> Table:
    """Per config: per-seed ppl, mean ± sd, Δ vs comparator with the paired CI, K diagnostics."""
    seeds = summary["seeds"]
    comp = summary["comparator"]
    level = int(round(100 * summary.get("level", DEFAULT_LEVEL)))
    holm = summary["holm"]["results"]
    seed_cols = [f"seed {s}" for s in seeds]
    columns = ["config", *seed_cols, "mean", "sd", "control", "delta", "sd_delta", "ci_low", "ci_high",
               "n_pairs", "k_range_mean", "k_rel_err"]
    own = {(m or {}).get("control") for m in (summary.get("meta") or {}).values()} - {None}
    rows, md_rows = [], []
    for name, cfg in summary["configs"].items():
        per_seed = dict(zip(cfg["seeds"], cfg["ppl"], strict=True))
        block = summary["paired"].get(name)
        row = {"config": name, **{f"seed {s}": per_seed.get(s) for s in seeds},
               "mean": cfg["mean"], "sd": cfg["sd"],
               "control": block["comparator"] if block else None,
            "delta": block["mean"] if block else (0.0 if name == comp else None),
               "sd_delta": block["sd"] if block else None,
               "ci_low": block["low"] if block else None, "ci_high": block["high"] if block else None,
               "n_pairs": block["n"] if block else None,
               "k_range_mean": _mean(cfg["k_range_mean"]), "k_rel_err": _mean(cfg["k_rel_err"])}
        rows.append(row)
        md_rows.append({
            "config": f"**{name}**" if name == comp else name,
            **{f"seed {s}": _fmt(per_seed.get(s)) for s in seeds},
            "mean ± sd": _mean_sd(cfg["mean"], cfg["sd"]),
            f"Δ vs {comp} [{level}% CI]": (_control_note(block, comp) + _delta_ci(block)
                                           + holm.get(name, {}).get("stars", "") if block else
                                           "(comparator)" if name == comp else "(control)" if name in own
                                           else "–"),
            "K range": _fmt(row["k_range_mean"]),
            "K rel. err": _fmt(row["k_rel_err"], 4),
        })
    md_cols = ["config", *seed_cols, "mean ± sd", f"Δ vs {comp} [{level}% CI]", "K range", "K rel. err"]
    return Table("multiseed", f"Perplexity per seed, paired against {comp}", columns, rows, md_cols, md_rows,
                 notes=[f"Δ = ppl(config) − ppl({comp}) within seed (\"vs X\": against the config's own "
                        f"control X); {level}% paired t interval; stars: Holm-corrected paired t test "
                        "(* ≤ 0.05, ** < 0.01, *** < 0.001)."])


def sign_budget(block: Mapping[str, Any]) -> tuple[int | None, str]:
    """(seeds, text): the budget that decides the sign of Δ at 80% power where its 90% CI straddles 0
    (:mod:`rope_quant.core.verdict`, GREATER form, no numerical spread), as seeds at today's tokens per cell
    or tokens per cell at today's seeds (the block's ``tokens``); (None, "") when decided or n < 2."""
    from rope_quant.core.verdict import Form, decide_interval

    if block.get("sd") is None or block.get("low") is None:
        return None, ""
    tokens = block.get("tokens")
    v = decide_interval(Form.GREATER, int(block["n"]), float(block["mean"]), float(block["sd"]),
                        float(block["low"]), float(block["high"]), tokens=int(tokens) if tokens else None)
    if v.decided or v.budget is None:
        return None, ""
    b = v.budget
    if b.seeds is None and b.tokens is None:
        return None, b.text()
    parts = ([f"{b.seeds} seeds"] if b.seeds else []) + ([f"{b.tokens} tokens/cell"] if b.tokens else [])
    return b.seeds, " or ".join(parts)


def corrected_star_table(summary: Mapping[str, Any]) -> Table:
    """Holm-corrected significance and TOST equivalence of each config against the comparator."""
    comp = summary["comparator"]
    margins = summary["margins"]
    holm = summary["holm"]
    columns = ["config", "n", "delta", "sd", "ci_low", "ci_high", "p", "p_holm", "reject", "stars",
               "budget_sign_seeds", *[f"tost_{m}" for m in margins]]
    rows, md_rows = [], []
    for name, block in summary["paired"].items():
        h = holm["results"].get(name, {})
        eq = summary["equivalence"].get(name, {})
        row = {"config": name, "n": block["n"], "delta": block["mean"], "sd": block["sd"],
               "ci_low": block["low"], "ci_high": block["high"], "p": block["p"],
               "p_holm": h.get("p_holm"), "reject": h.get("reject"), "stars": h.get("stars", ""),
               "budget_sign_seeds": sign_budget(block)[0], **{f"tost_{m}": eq.get(m) for m in margins}}
        rows.append(row)
        md_rows.append({
            "config": name, "n": str(block["n"]), "Δ [CI]": _delta_ci(block), "p": _fmt_p(block["p"]),
            "p (Holm)": _fmt_p(h.get("p_holm")) + ("" if name in holm["results"] else " (not in family)"),
            "sig": h.get("stars", "") or ("n.s." if name in holm["results"] else "–"),
            **{f"≡ ±{m}": ("yes" if eq.get(m) else "no") for m in margins},
            "budget to decide the sign": sign_budget(block)[1],
        })
    md_cols = ["config", "n", "Δ [CI]", "p", "p (Holm)", "sig", *[f"≡ ±{m}" for m in margins],
               "budget to decide the sign"]
    fam = ", ".join(holm["family"]) or "(empty)"
    return Table("corrected-star", f"Holm-corrected comparisons against {comp}", columns, rows, md_cols,
                 md_rows, notes=[f"Holm family (alpha {holm['alpha']}): {fam}. ≡ ±m: TOST equivalence "
                                 "(90% CI inside ±m perplexity points)."])


def crossover_table(summary: Mapping[str, Any]) -> Table | None:
    """Gap ppl(config) − ppl(control) at each context length L, with the paired CI and the Holm-adjusted p over
    every (L, config) contrast of the family (App. J). The control is the comparator unless a config names
    its own (``meta[name]["control"]``)."""
    lc = summary.get("long_context") or {}
    if not lc:
        return None
    comp = summary["comparator"]
    columns = ["L", "config", "control", "ppl", "ppl_control", "gap", "sd", "ci_low", "ci_high", "n", "p", "p_holm"]
    meta = summary.get("meta") or {}
    control_of = {n: (meta.get(n) or {}).get("control", comp) for n in lc["configs"]}
    rows, md_rows = [], []
    for length in lc["lengths"]:
        for name, per_len in lc["configs"].items():
            if name in set(control_of.values()):
                continue
            block = lc["paired"].get(str(length), {}).get(name) or {}
            ref = control_of[name]
            ref_vals = lc["configs"].get(ref, {}).get(str(length), [])
            row = {"L": length, "config": name, "control": ref, "ppl": _mean(per_len.get(str(length), [])),
                   "ppl_control": _mean(ref_vals), "gap": block.get("mean"), "sd": block.get("sd"),
                   "ci_low": block.get("low"), "ci_high": block.get("high"), "n": block.get("n", 0),
                   "p": block.get("p"), "p_holm": block.get("p_holm")}
            rows.append(row)
            md_rows.append({"L": str(length), "config": name, "control": ref, "ppl": _fmt(row["ppl"]),
                            "ppl control": _fmt(row["ppl_control"]), "gap [CI]": _delta_ci(block or None),
                            "p (Holm)": _fmt_p(row["p_holm"])})
    size = lc.get("holm_family_size", 0)
    return Table("crossover", f"Perplexity gap against {comp} by context length", columns, rows,
                 ["L", "config", "control", "ppl", "ppl control", "gap [CI]", "p (Holm)"], md_rows,
                 notes=["gap = ppl(config) − ppl(control) within seed; a sign change in L is a crossover.",
                        f"p (Holm): paired t test, Holm-adjusted over the {size} (L, config) contrasts of the "
                        "family (App. J's long-context family)."])


def lm_eval_table(summary: Mapping[str, Any]) -> Table | None:
    """lm-eval metrics per task and config: per-seed values, mean ± sd, Δ vs the comparator with its CI."""
    lm = summary.get("lm_eval") or {}
    if not lm:
        return None
    comp = summary["comparator"]
    level = int(round(100 * summary.get("level", DEFAULT_LEVEL)))
    seeds = list(dict.fromkeys(s for per in lm["seeds"].values() for s in per))
    seed_cols = [f"seed {s}" for s in seeds]
    columns = ["task", "metric", "config", *seed_cols, "mean", "sd", "delta", "sd_delta", "ci_low", "ci_high",
               "n_pairs", "p"]
    rows, md_rows = [], []
    for task in lm["tasks"]:
        for metric in lm["metrics"][task]:
            for name, per_task in lm["configs"].items():
                vals = per_task.get(task, {}).get(metric)
                if vals is None:
                    continue
                per_seed = dict(zip(lm["seeds"][name], vals, strict=True))
                block = lm["paired"].get(task, {}).get(metric, {}).get(name)
                row = {"task": task, "metric": metric, "config": name,
                       **{f"seed {s}": per_seed.get(s) for s in seeds}, "mean": _mean(vals), "sd": _sd(vals),
                       "control": block["comparator"] if block else None,
            "delta": block["mean"] if block else (0.0 if name == comp else None),
                       "sd_delta": block["sd"] if block else None, "ci_low": block["low"] if block else None,
                       "ci_high": block["high"] if block else None, "n_pairs": block["n"] if block else None,
                       "p": block["p"] if block else None}
                rows.append(row)
                md_rows.append({
                    "task": task, "metric": metric, "config": f"**{name}**" if name == comp else name,
                    **{f"seed {s}": _fmt(per_seed.get(s), 4) for s in seeds},
                    "mean ± sd": _mean_sd(row["mean"], row["sd"]),
                    f"Δ vs {comp} [{level}% CI]": "(comparator)" if name == comp else _delta_ci(block),
                })
    md_cols = ["task", "metric", "config", *seed_cols, "mean ± sd", f"Δ vs {comp} [{level}% CI]"]
    return Table("lm-eval", f"lm-eval metrics per seed, paired against {comp}", columns, rows, md_cols, md_rows,
                 notes=[f"Δ = metric(config) − metric({comp}) within seed (accuracies as fractions); {level}% "
                        "paired t interval over seeds. acc: higher is better; perplexities and bits_per_byte: "
                        "lower is better."])


def _meta_table(summary: Mapping[str, Any], key: str) -> list[tuple[Any, str]]:
    meta = summary.get("meta") or {}
    return [(meta[name][key], name) for name in summary["configs"] if key in meta.get(name, {})]


def estimators_table(summary: Mapping[str, Any]) -> Table | None:
    """Per angle estimator (rows, k_only, balanced, φ*): ppl, Δ vs comparator, K diagnostics."""
    entries = _meta_table(summary, "estimator")
    if not entries or summary.get("kind") == "beyond":
        return None
    comp = summary["comparator"]
    columns = ["estimator", "config", "mean", "sd", "delta", "ci_low", "ci_high", "n", "k_range_mean",
               "k_rel_err"]
    rows, md_rows = [], []
    for est, name in entries:
        cfg = summary["configs"][name]
        block = summary["paired"].get(name)
        row = {"estimator": est, "config": name, "mean": cfg["mean"], "sd": cfg["sd"],
               "delta": block["mean"] if block else None, "ci_low": block["low"] if block else None,
               "ci_high": block["high"] if block else None, "n": block["n"] if block else 0,
               "k_range_mean": _mean(cfg["k_range_mean"]), "k_rel_err": _mean(cfg["k_rel_err"])}
        rows.append(row)
        md_rows.append({"estimator": str(est), "ppl": _mean_sd(cfg["mean"], cfg["sd"]),
                        f"Δ vs {comp} [CI]": _delta_ci(block), "K range": _fmt(row["k_range_mean"]),
                        "K rel. err": _fmt(row["k_rel_err"], 4)})
    return Table("estimators", "Angle estimators", columns, rows,
                 ["estimator", "ppl", f"Δ vs {comp} [CI]", "K range", "K rel. err"], md_rows)


def support_table(summary: Mapping[str, Any]) -> Table | None:
    """Mixing support: block size b against K range, relative K error and the gap to the comparator."""
    entries = sorted(_meta_table(summary, "block"), key=lambda e: (int(e[0]), e[1]))
    if not entries:
        return None
    comp = summary["comparator"]
    columns = ["b", "config", "k_range_mean", "k_rel_err", "ppl", "gap", "ci_low", "ci_high", "n"]
    rows, md_rows = [], []
    for b, name in entries:
        cfg = summary["configs"][name]
        block = summary["paired"].get(name)
        row = {"b": int(b), "config": name, "k_range_mean": _mean(cfg["k_range_mean"]),
               "k_rel_err": _mean(cfg["k_rel_err"]), "ppl": cfg["mean"],
               "gap": block["mean"] if block else None, "ci_low": block["low"] if block else None,
               "ci_high": block["high"] if block else None, "n": block["n"] if block else 0}
        rows.append(row)
        md_rows.append({"b": str(b), "config": name, "K range": _fmt(row["k_range_mean"]),
                        "K rel. err": _fmt(row["k_rel_err"], 4), "ppl": _fmt(row["ppl"]),
                        f"gap vs {comp} [CI]": _delta_ci(block)})
    return Table("mixing-support", "Mixing support: block size b", columns, rows,
                 ["b", "config", "K range", "K rel. err", "ppl", f"gap vs {comp} [CI]"], md_rows)


def _commutes(r3: str) -> bool | None:
    from rope_quant.core import transforms

    try:
        if transforms.needs_block(r3):
            return None
        params = {"angles": [0.0] * 32} if transforms.needs_angles(r3) else {}
        return transforms.commutes_with_rope(r3, 64, **params)
    except transforms.TransformError:
        return None


def beyond_table(summary: Mapping[str, Any]) -> Table | None:
    """The beyond-the-paper study: per R3 variant, whether it commutes with RoPE, its angles, ppl, Δ vs the
    comparator with the paired CI, and the K diagnostics (range and relative error after R3)."""
    if summary.get("kind") != "beyond" or not summary["configs"]:
        return None
    comp, meta = summary["comparator"], summary.get("meta") or {}
    columns = ["config", "r3", "commutes", "angles", "mean", "sd", "delta", "ci_low", "ci_high", "n",
               "k_range_mean", "k_rel_err"]
    rows, md_rows = [], []
    for name, cfg in summary["configs"].items():
        m = meta.get(name, {})
        r3 = m.get("r3", name)
        if r3 == comp:
            angles = "–"
        else:
            star = m.get("angle") == "phi_star" or m.get("position_average")  # older manifests: the flag
            kind = "φ*" if star else ("range" if m.get("objective") == "range" else "φ̂")
            angles = f"{kind} ({m.get('estimator', 'rows')})"
        block = summary["paired"].get(name)
        row = {"config": name, "r3": r3, "commutes": _commutes(r3), "angles": angles, "mean": cfg["mean"],
               "sd": cfg["sd"], "delta": block["mean"] if block else None,
               "ci_low": block["low"] if block else None, "ci_high": block["high"] if block else None,
               "n": block["n"] if block else 0, "k_range_mean": _mean(cfg["k_range_mean"]),
               "k_rel_err": _mean(cfg["k_rel_err"])}
        rows.append(row)
        md_rows.append({"R3": r3, "commutes": _fmt(row["commutes"]), "angles": angles,
                        "ppl": _mean_sd(cfg["mean"], cfg["sd"]), f"Δ vs {comp} [CI]": _delta_ci(block),
                        "K range": _fmt(row["k_range_mean"]), "K rel. err": _fmt(row["k_rel_err"], 4)})
    return Table("beyond", f"Beyond the paper: can a RoPE-commuting R3 match {comp}?", columns, rows,
                 ["R3", "commutes", "angles", "ppl", f"Δ vs {comp} [CI]", "K range", "K rel. err"], md_rows,
                 notes=["commutes: the map commutes with RoPE (foldable into W_Q/W_K); Δ = paired "
                        "ppl difference within seed."])


def build_tables(summary: Mapping[str, Any]) -> list[Table]:
    """Every table the summary has data for, main table first."""
    tables: list[Table | None] = []
    if summary["configs"]:
        tables.append(multiseed_table(summary))
    if summary["paired"]:
        tables.append(corrected_star_table(summary))
    tables += [beyond_table(summary), estimators_table(summary), support_table(summary),
               crossover_table(summary), lm_eval_table(summary)]
    return [t for t in tables if t is not None]


def summary_markdown(summary: Mapping[str, Any], tables: Sequence[Table]) -> str:
    """The text of ``summary.md`` (also printed by the CLI)."""
    st = summary["status"]
    blocks = [f"## rope_quant {summary['kind']}: {st['complete']}/{st['total']} cells, seeds "
              f"{', '.join(map(str, summary['seeds'])) or '–'}, comparator {summary['comparator']}"]
    if st["failed"]:
        blocks.append(f"Failed cells: {', '.join(st['failed'])}")
    if st["missing"]:
        blocks.append(f"Missing cells: {', '.join(st['missing'])}")
    if not tables:
        blocks.append("No complete cells yet.")
    blocks += [t.markdown().rstrip("\n") for t in tables]
    return "\n\n".join(blocks) + "\n"


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
    margins: Sequence[float] = DEFAULT_MARGINS,
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
    summary = summarize(root, comparator=comparator, family=family, level=level, margins=margins,
                        alpha=alpha, write=True)
    tables = build_tables(summary)
    from rope_quant.sweep.protocol_report import extra_report  # the A.4 protocol and Table A

    extra_tables, extra_files = extra_report(root, Table, figures=figures)
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

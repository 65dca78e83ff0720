"""Paired statistics of a results directory: per-config, per-seed values and the paired blocks of summary.json.

Every config is paired *within seed* against a comparator (default :data:`rope_quant.defaults.DEFAULT_COMPARATOR`):
for each seed both cells share the model, rotations R1/R2/R4, weights and calibration windows, so the unit of
analysis is the per-seed difference ``d_s = ppl(config, s) - ppl(comparator, s)`` (positive: worse than the
comparator). On the differences: the mean, the sample sd (``n - 1``) and the paired t interval at
:data:`rope_quant.core.verdict.LEVEL` (:func:`rope_quant.core.stats.paired_ci`); TOST equivalence at the claims'
one margin, :func:`rope_quant.core.verdict.equivalence_margin` of the control's mean ppl (the paper's ±0.05 PPL on
its ppl scale, else scaled by the ppl ratio; :func:`rope_quant.core.stats.equivalent`, the interval form), each
block naming the margin and its basis; and Holm's step-down correction over a declared family of paired t tests
(:func:`rope_quant.core.stats.holm`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeGuard

from rope_quant.core import stats
from rope_quant.core.verdict import LEVEL, Margin, equivalence_margin
from rope_quant.defaults import DEFAULT_COMPARATOR
from rope_quant.io import atomic_write_json
from rope_quant.sweep.manifest import read_manifest, study_of
from rope_quant.sweep.records import complete_records, status

#: The report's equivalence margin is the claims' (one rule for one question): named in summary.json and the tables.
MARGIN_RULE = ("the claims' equivalence margin (rope_quant.core.verdict.equivalence_margin): the paper's ±0.05 PPL "
               "where the control's mean ppl lies on its scale (6–9 PPL), otherwise scaled by the ppl ratio")
DEFAULT_LEVEL = LEVEL
DEFAULT_ALPHA = 0.05
#: Per-seed record fields carried into the summary (``r3_folds``: whether the R3 folds into this model).
METRICS = ("k_range_mean", "k_range_max", "delta_mean", "k_rel_err", "r3_folds")


class ReportError(ValueError):
    """A results directory that cannot be summarised as asked."""


def stars(p_adjusted: float | None, alpha: float = DEFAULT_ALPHA) -> str:
    """Significance stars of a Holm-adjusted p-value: *** < 0.001, ** < 0.01, * <= alpha."""
    if p_adjusted is None:
        return ""
    if p_adjusted < 0.001:
        return "***"
    if p_adjusted < 0.01:
        return "**"
    return "*" if p_adjusted <= alpha else ""


def finite(x: Any) -> TypeGuard[int | float]:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def mean_of(values: Sequence[Any]) -> float | None:
    vals = [float(v) for v in values if finite(v)]
    return sum(vals) / len(vals) if vals else None


def sd_of(values: Sequence[Any]) -> float | None:
    vals = [float(v) for v in values if finite(v)]
    return stats.sample_sd(vals) if len(vals) >= 2 else None


# ----------------------------------------------------------------------------- paired statistics


def paired_block(
    treatment: Mapping[int, float], control: Mapping[int, float], comparator: str,
    level: float = DEFAULT_LEVEL, equivalence: bool = False,
) -> dict[str, Any] | None:
    """Paired statistics of ``treatment - control`` over the seeds both have (None if no common seed).

    ``equivalence`` (perplexities only): TOST at :func:`margin_of` the control's mean over the common seeds, as
    ``block["equivalence"] = {"margin", "basis", "equivalent"}``. With one common seed only the difference is
    known: ``sd``, ``low``, ``high`` and ``p`` are None and no equivalence is claimed.
    """
    common = [s for s in treatment if s in control and finite(treatment[s]) and finite(control[s])]
    if not common:
        return None
    t = [float(treatment[s]) for s in common]
    c = [float(control[s]) for s in common]
    block: dict[str, Any] = {"comparator": comparator, "n": len(common), "seeds": common, "level": level}
    margin = margin_of(sum(c) / len(c)) if equivalence else None
    if len(common) >= 2:
        ci = stats.paired_ci(t, c, level=level)
        block.update(mean=ci.mean, sd=ci.sd, low=ci.low, high=ci.high, p=stats.paired_t_pvalue(t, c))
        equivalent = stats.equivalent(ci, margin.value) if margin is not None else None
    else:
        block.update(mean=t[0] - c[0], sd=None, low=None, high=None, p=None)
        equivalent = False
    if margin is not None:
        block["equivalence"] = {"margin": margin.value, "basis": margin.basis, "equivalent": equivalent}
    return block


def margin_of(control_ppl: float) -> Margin:
    """The equivalence margin of a comparison against a control of mean perplexity ``control_ppl``: the claims'
    :func:`rope_quant.core.verdict.equivalence_margin` (:data:`MARGIN_RULE`)."""
    return equivalence_margin(float(control_ppl))


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
                if metric.endswith("_stderr") or metric in LM_EVAL_SKIP or not finite(value):
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
    alpha: float = DEFAULT_ALPHA,
    write: bool = True,
) -> dict[str, Any]:
    """Build (and by default write atomically) ``DIR/summary.json`` from the complete cells of ``DIR``.

    Shape (a contract other tools read)::

        {"configs": {NAME: {"ppl": [...], "k_range_mean": [...], "k_rel_err": [...], "seeds": [...], ...}},
         "paired": {NAME: {"comparator", "n", "mean", "sd", "low", "high", "p", "seeds", "level"}},
         "equivalence": {NAME: {"margin": float, "basis": str, "equivalent": bool}},
         "margin_rule": MARGIN_RULE,
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
        if finite(result.get("ppl")):
            ppl.setdefault(name, {})[seed] = float(result["ppl"])
            if isinstance(result.get("n_tokens"), int):
                tokens[name] = min(tokens.get(name, result["n_tokens"]), result["n_tokens"])
            for m in METRICS:
                metrics[m].setdefault(name, {})[seed] = result.get(m)
        if isinstance(result.get("lengths"), Mapping):
            for length, res in result["lengths"].items():
                value = res.get("ppl") if isinstance(res, Mapping) else None
                lengths.setdefault(name, {}).setdefault(int(length), {})[seed] = (
                    float(value) if finite(value) else None
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
            "mean": mean_of([ppl[name][s] for s in seeds]),
            "sd": sd_of([ppl[name][s] for s in seeds]),
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
        block = paired_block(ppl[name], ppl[ref], ref, level, equivalence=True)
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
                block = paired_block(treat, control, ref, level) if control else None
                if block is not None:
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
        "kind": study_of(manifest),
        "comparator": comparator,
        "seeds": [s for s in seed_order if any(s in per for per in ppl.values())
                  or any(s in seeds for seeds in (lm_eval.get("seeds") or {}).values())
                  or any(s in per for by_length in lengths.values() for per in by_length.values())],
        "level": level,
        "margin_rule": MARGIN_RULE,
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

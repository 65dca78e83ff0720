"""The report's tables, in the shape of the paper's, built from a summary (:func:`.paired.summarize`).

``multiseed`` (per-seed ppl, mean ± sd, Δ with CI), ``corrected-star`` (Holm-corrected stars and TOST),
``crossover`` (gap vs comparator per context length L), ``lm-eval``, ``estimators`` (rows / k_only / balanced /
φ*), ``mixing-support`` (block size b: K range, relative error, gap), ``beyond`` (RoPE-commuting R3s against the
comparator). Each is written as ``DIR/tables/<name>.csv`` and ``.md``; ``DIR/summary.md`` collects them.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rope_quant.analysis.paired import DEFAULT_LEVEL, mean_of, sd_of
from rope_quant.io import markdown_table


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
        rows = self.md_rows or [{c: fmt(r.get(c)) for c in cols} for r in self.rows]
        lines = [f"### {self.title}", "", markdown_table(rows, cols)]
        if self.notes:
            lines += [""] + [f"_{n}_" for n in self.notes]
        return "\n".join(lines) + "\n"


def fmt(x: Any, digits: int = 3) -> str:
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


def fmt_p(p: Any) -> str:
    if p is None:
        return "–"
    return f"{p:.2e}" if p < 1e-3 else f"{p:.4f}"


def mean_sd(mean: Any, sd: Any) -> str:
    return fmt(mean) if sd is None else f"{fmt(mean)} ± {fmt(sd)}"


def delta_ci(block: Mapping[str, Any] | None) -> str:
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
               "k_range_mean": mean_of(cfg["k_range_mean"]), "k_rel_err": mean_of(cfg["k_rel_err"])}
        rows.append(row)
        md_rows.append({
            "config": f"**{name}**" if name == comp else name,
            **{f"seed {s}": fmt(per_seed.get(s)) for s in seeds},
            "mean ± sd": mean_sd(cfg["mean"], cfg["sd"]),
            f"Δ vs {comp} [{level}% CI]": (_control_note(block, comp) + delta_ci(block)
                                           + holm.get(name, {}).get("stars", "") if block else
                                           "(comparator)" if name == comp else "(control)" if name in own
                                           else "–"),
            "K range": fmt(row["k_range_mean"]),
            "K rel. err": fmt(row["k_rel_err"], 4),
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
    from rope_quant.claims.values import decide_block
    from rope_quant.core.verdict import Form

    v = decide_block(Form.GREATER, block)
    if v is None or v.decided or v.budget is None:
        return None, ""
    b = v.budget
    if b.seeds is None and b.tokens is None:
        return None, b.text()
    parts = ([f"{b.seeds} seeds"] if b.seeds else []) + ([f"{b.tokens} tokens/cell"] if b.tokens else [])
    return b.seeds, " or ".join(parts)


def corrected_star_table(summary: Mapping[str, Any]) -> Table:
    """Holm-corrected significance and TOST equivalence of each config against the comparator, at the claims'
    one equivalence margin (``summary["margin_rule"]``; each row names its margin, the notes its basis)."""
    comp = summary["comparator"]
    holm = summary["holm"]
    columns = ["config", "n", "delta", "sd", "ci_low", "ci_high", "p", "p_holm", "reject", "stars",
               "budget_sign_seeds", "tost_margin", "tost"]
    rows, md_rows = [], []
    bases: dict[str, str] = {}
    for name, block in summary["paired"].items():
        h = holm["results"].get(name, {})
        eq = summary["equivalence"].get(name) or {}
        margin = eq.get("margin")
        if eq.get("basis"):
            bases.setdefault(block.get("comparator", comp), eq["basis"])
        row = {"config": name, "n": block["n"], "delta": block["mean"], "sd": block["sd"],
               "ci_low": block["low"], "ci_high": block["high"], "p": block["p"],
               "p_holm": h.get("p_holm"), "reject": h.get("reject"), "stars": h.get("stars", ""),
               "budget_sign_seeds": sign_budget(block)[0], "tost_margin": margin, "tost": eq.get("equivalent")}
        rows.append(row)
        md_rows.append({
            "config": name, "n": str(block["n"]), "Δ [CI]": delta_ci(block), "p": fmt_p(block["p"]),
            "p (Holm)": fmt_p(h.get("p_holm")) + ("" if name in holm["results"] else " (not in family)"),
            "sig": h.get("stars", "") or ("n.s." if name in holm["results"] else "–"),
            "≡ (margin)": (("yes" if eq.get("equivalent") else "no") + f" (±{margin:.3f})") if margin else "–",
            "budget to decide the sign": sign_budget(block)[1],
        })
    md_cols = ["config", "n", "Δ [CI]", "p", "p (Holm)", "sig", "≡ (margin)", "budget to decide the sign"]
    fam = ", ".join(holm["family"]) or "(empty)"
    margins = "; ".join(f"against {ref}: {basis}" for ref, basis in bases.items()) or "none"
    return Table("corrected-star", f"Holm-corrected comparisons against {comp}", columns, rows, md_cols,
                 md_rows, notes=[f"Holm family (alpha {holm['alpha']}): {fam}. ≡: TOST equivalence (90% CI inside "
                                 f"±margin perplexity points) at {summary.get('margin_rule', 'the claims margin')}. "
                                 f"Margins used: {margins}."])


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
            row = {"L": length, "config": name, "control": ref, "ppl": mean_of(per_len.get(str(length), [])),
                   "ppl_control": mean_of(ref_vals), "gap": block.get("mean"), "sd": block.get("sd"),
                   "ci_low": block.get("low"), "ci_high": block.get("high"), "n": block.get("n", 0),
                   "p": block.get("p"), "p_holm": block.get("p_holm")}
            rows.append(row)
            md_rows.append({"L": str(length), "config": name, "control": ref, "ppl": fmt(row["ppl"]),
                            "ppl control": fmt(row["ppl_control"]), "gap [CI]": delta_ci(block or None),
                            "p (Holm)": fmt_p(row["p_holm"])})
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
                       **{f"seed {s}": per_seed.get(s) for s in seeds}, "mean": mean_of(vals), "sd": sd_of(vals),
                       "control": block["comparator"] if block else None,
            "delta": block["mean"] if block else (0.0 if name == comp else None),
                       "sd_delta": block["sd"] if block else None, "ci_low": block["low"] if block else None,
                       "ci_high": block["high"] if block else None, "n_pairs": block["n"] if block else None,
                       "p": block["p"] if block else None}
                rows.append(row)
                md_rows.append({
                    "task": task, "metric": metric, "config": f"**{name}**" if name == comp else name,
                    **{f"seed {s}": fmt(per_seed.get(s), 4) for s in seeds},
                    "mean ± sd": mean_sd(row["mean"], row["sd"]),
                    f"Δ vs {comp} [{level}% CI]": "(comparator)" if name == comp else delta_ci(block),
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
               "k_range_mean": mean_of(cfg["k_range_mean"]), "k_rel_err": mean_of(cfg["k_rel_err"])}
        rows.append(row)
        md_rows.append({"estimator": str(est), "ppl": mean_sd(cfg["mean"], cfg["sd"]),
                        f"Δ vs {comp} [CI]": delta_ci(block), "K range": fmt(row["k_range_mean"]),
                        "K rel. err": fmt(row["k_rel_err"], 4)})
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
        row = {"b": int(b), "config": name, "k_range_mean": mean_of(cfg["k_range_mean"]),
               "k_rel_err": mean_of(cfg["k_rel_err"]), "ppl": cfg["mean"],
               "gap": block["mean"] if block else None, "ci_low": block["low"] if block else None,
               "ci_high": block["high"] if block else None, "n": block["n"] if block else 0}
        rows.append(row)
        md_rows.append({"b": str(b), "config": name, "K range": fmt(row["k_range_mean"]),
                        "K rel. err": fmt(row["k_rel_err"], 4), "ppl": fmt(row["ppl"]),
                        f"gap vs {comp} [CI]": delta_ci(block)})
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
               "n": block["n"] if block else 0, "k_range_mean": mean_of(cfg["k_range_mean"]),
               "k_rel_err": mean_of(cfg["k_rel_err"])}
        rows.append(row)
        md_rows.append({"R3": r3, "commutes": fmt(row["commutes"]), "angles": angles,
                        "ppl": mean_sd(cfg["mean"], cfg["sd"]), f"Δ vs {comp} [CI]": delta_ci(block),
                        "K range": fmt(row["k_range_mean"]), "K rel. err": fmt(row["k_rel_err"], 4)})
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

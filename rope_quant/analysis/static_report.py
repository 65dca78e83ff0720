"""The report of ``rope-quant static`` (App. A.6, A.8, D, E): paired contrasts per length and scope, the
non-additivity of the static scopes, and the quantiser-step diagnostic.

:func:`static_tables` reads a static results directory (:mod:`rope_quant.sweep.static` builds its cells):
pairwise_only − hadamard and pairwise_plus_hadamard − hadamard per length and scope (paired over seeds, t
intervals), the non-additivity check of App. A.8 (effect(both) against effect(act) + effect(kv), effects measured
against the dynamic cells), and, with ``--quant-diagnostic``, App. E's quantiser-step table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rope_quant.analysis.paired import paired_block
from rope_quant.analysis.tables import Table, delta_ci, fmt
from rope_quant.core.verdict import LEVEL
from rope_quant.defaults import DEFAULT_COMPARATOR
from rope_quant.experiment.config import StaticScope
from rope_quant.io import atomic_write_text
from rope_quant.sweep.kinds.static import DYNAMIC
from rope_quant.sweep.manifest import read_manifest
from rope_quant.sweep.records import complete_records
from rope_quant.sweep.static import CONTRASTS

__all__ = ["static_tables", "write_static_report"]


def _collect(records: Sequence[Mapping[str, Any]], meta: Mapping[str, Any]) -> dict[tuple[str, str], dict]:
    """``{(r3, scope): {L: {seed: ppl}}}`` from the complete static cells."""
    out: dict[tuple[str, str], dict[int, dict[int, float]]] = {}
    for rec in records:
        m = meta.get(rec["name"]) or {}
        lengths = (rec.get("result") or {}).get("lengths")
        if "scope" not in m or not isinstance(lengths, Mapping):
            continue
        per = out.setdefault((m["r3"], m["scope"]), {})
        for length, entry in lengths.items():
            if isinstance(entry, Mapping) and isinstance(entry.get("ppl"), (int, float)):
                per.setdefault(int(length), {})[int(rec["seed"])] = float(entry["ppl"])
    return out


def _sub(a: Mapping[int, float], b: Mapping[int, float]) -> dict[int, float]:
    return {s: a[s] - b[s] for s in a if s in b}


def static_tables(results_dir: Any, comparator: str = DEFAULT_COMPARATOR, level: float = LEVEL) -> list[Any]:
    """The contrast table, the non-additivity table (A.8) and, when recorded, App. E's diagnostic table."""
    manifest = read_manifest(results_dir)
    meta = manifest.get("meta") or {}
    records = complete_records(results_dir)
    ppl = _collect(records, meta)
    scopes = [s for s in (DYNAMIC, *(x.value for x in StaticScope)) if any(k[1] == s for k in ppl)]
    lengths = sorted({length for per in ppl.values() for length in per})
    tables = []

    cols = ["L", "scope", "contrast", "ppl", "ppl_control", "mean", "sd", "ci_low", "ci_high", "n"]
    rows, md = [], []
    for length in lengths:
        for scope in scopes:
            control = ppl.get((comparator, scope), {}).get(length, {})
            for r3 in CONTRASTS:
                treat = ppl.get((r3, scope), {}).get(length, {})
                block = paired_block(treat, control, comparator, level) if treat and control else None
                if block is None:
                    continue
                block.pop("equivalence", None)
                row = {"L": length, "scope": scope, "contrast": f"{r3} − {comparator}",
                       "ppl": sum(treat.values()) / len(treat), "ppl_control": sum(control.values()) / len(control),
                       "mean": block["mean"], "sd": block["sd"], "ci_low": block["low"], "ci_high": block["high"],
                       "n": block["n"]}
                rows.append(row)
                md.append({"L": str(length), "scope": scope, "contrast": row["contrast"], "ppl": fmt(row["ppl"]),
                           f"ppl {comparator}": fmt(row["ppl_control"]),
                           f"Δ [{int(level * 100)}% CI]": delta_ci(block)})
    tables.append(Table("static-contrasts", "Static per-channel control (A.6): paired gaps against "
                        f"{comparator} by length and scope", cols, rows,
                        ["L", "scope", "contrast", "ppl", f"ppl {comparator}", f"Δ [{int(level * 100)}% CI]"], md,
                        notes=["Δ = ppl(config) − ppl(hadamard) within seed, paired over seeds (t interval).",
                               "scope dynamic: no static control (the reference ordering)."]))

    # A.8: effects of the static control are not additive over the scopes
    cols = ["L", "quantity", "effect_act", "effect_kv", "effect_sum", "effect_both", "interaction", "ci_low",
            "ci_high", "n"]
    rows, md = [], []
    quantities: dict[str, dict[str, dict[int, dict[int, float]]]] = {}
    for (r3, scope), per in ppl.items():
        quantities.setdefault(f"ppl({r3})", {})[scope] = per
    for r3 in CONTRASTS:
        for scope in scopes:
            t, c = ppl.get((r3, scope), {}), ppl.get((comparator, scope), {})
            gaps = {length: _sub(t[length], c[length]) for length in t if length in c}
            if gaps:
                quantities.setdefault(f"gap({r3} − {comparator})", {})[scope] = gaps
    for length in lengths:
        for qname, by_scope in quantities.items():
            if not all(s in by_scope and length in by_scope[s] for s in (DYNAMIC, "act", "kv", "both")):
                continue
            dyn = by_scope[DYNAMIC][length]
            eff = {s: _sub(by_scope[s][length], dyn) for s in ("act", "kv", "both")}
            summed = {s: eff["act"][s] + eff["kv"][s] for s in eff["act"] if s in eff["kv"]}
            block = paired_block(eff["both"], summed, "act+kv", level)
            if block is None:
                continue
            block.pop("equivalence", None)

            def mean(d: Mapping[int, float]) -> float | None:
                return sum(d.values()) / len(d) if d else None

            row = {"L": length, "quantity": qname, "effect_act": mean(eff["act"]), "effect_kv": mean(eff["kv"]),
                   "effect_sum": mean(summed), "effect_both": mean(eff["both"]), "interaction": block["mean"],
                   "ci_low": block["low"], "ci_high": block["high"], "n": block["n"]}
            rows.append(row)
            md.append({"L": str(length), "quantity": qname, "effect act": fmt(row["effect_act"]),
                       "effect kv": fmt(row["effect_kv"]), "act + kv": fmt(row["effect_sum"]),
                       "effect both": fmt(row["effect_both"]),
                       f"both − (act + kv) [{int(level * 100)}% CI]": delta_ci(block)})
    if rows:
        tables.append(Table("static-nonadditivity", "Non-additivity of the static scopes (App. A.8)", cols, rows,
                            ["L", "quantity", "effect act", "effect kv", "act + kv", "effect both",
                             f"both − (act + kv) [{int(level * 100)}% CI]"], md,
                            notes=["effect(scope) = quantity under the static scope − the same quantity with the "
                                   "dynamic quantisers, within seed; additive scopes give both − (act + kv) = 0."]))

    # App. E: the quantiser-step diagnostic
    cols = ["L", "config", "stream", "seeds", "evaluations", "n_steps", "delta_mean", "delta_sd", "delta_max",
            "rel_mse_mean", "rel_mse_sd", "rel_mse_max", "rel_mse_pooled"]
    acc: dict[tuple[int, str, str], list[dict]] = {}
    for rec in records:
        for length, entry in ((rec.get("result") or {}).get("lengths") or {}).items():
            for stream, st in ((entry or {}).get("quant_diagnostic") or {}).items():
                acc.setdefault((int(length), rec["name"], stream), []).append(st)
    rows = []
    for (length, name, stream), sts in sorted(acc.items()):
        def avg(k: str, _sts: list = sts) -> float | None:
            vals = [s[k] for s in _sts if isinstance(s.get(k), (int, float))]
            return sum(vals) / len(vals) if vals else None

        rows.append({"L": length, "config": name, "stream": stream, "seeds": len(sts),
                     **{k: avg(k) for k in cols[4:]}})
    if rows:
        tables.append(Table("quant-diagnostic", "Quantiser-step diagnostic (App. E): selected step Δ and relative "
                            "error per stream and rule (mean over seeds)", cols, rows,
                            notes=["Δ: per token/group (dynamic) or per channel (static); rel-MSE = ‖y − ŷ‖²/‖y‖² "
                                   "per quantiser evaluation (mean, sd, max over evaluations; pooled = Σ‖y − ŷ‖² / "
                                   "Σ‖y‖²); evaluations = quantiser calls (a memoised shared input counts once)."]))
    return tables


def write_static_report(results_dir: Any, comparator: str = DEFAULT_COMPARATOR, level: float = LEVEL) -> str:
    """Write ``tables/<name>.csv|md`` and ``static.md`` for a static results directory; return the markdown."""
    root = Path(results_dir)
    tables = static_tables(root, comparator, level)
    deviation_lines: list[str] = []
    transductive = False
    for rec in complete_records(root):
        st = (rec.get("result") or {}).get("static") or {}
        transductive |= bool(st.get("transductive"))
        for d in st.get("deviations") or []:
            if d not in deviation_lines:
                deviation_lines.append(d)
    blocks = []
    if transductive:
        blocks.append("Protocol: transductive, as in A.6 (the static scales are estimated from windows of the "
                      "evaluation corpus at each evaluated length).")
    if deviation_lines:
        blocks.append("Deviations from A.6: " + "; ".join(deviation_lines) + ".")
    for table in tables:
        atomic_write_text(root / "tables" / f"{table.name}.csv", table.csv())
        atomic_write_text(root / "tables" / f"{table.name}.md", table.markdown())
        blocks.append(table.markdown().rstrip("\n"))
    text = "\n\n".join(blocks) + "\n"
    atomic_write_text(root / "static.md", text)
    return text


def kind_report(root: Path, options: Any) -> Any:
    """The static cell kind's part of ``rope-quant report``: contrasts against the comparator within each scope
    (App. D), at ``options.level``."""
    from rope_quant.analysis.kind_reports import KindReport
    from rope_quant.sweep.cellkind import CellKindName

    text = write_static_report(root, level=options.level)
    return KindReport(CellKindName.STATIC.value, text, [str(root / "static.md")])

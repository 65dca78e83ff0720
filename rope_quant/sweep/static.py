"""``rope-quant static``: the static per-channel control (App. A.6, D, H) as sweep cells, and its report.

A :class:`StaticConfig` cell evaluates one R3 configuration at one seed under one static scope (``both``,
``act``, ``kv``; or ``dynamic``, the reference without the static control) at several context lengths. At each
length the scales are re-estimated (:mod:`rope_quant.experiment.static_control`) from up to ``max_windows``
non-overlapping windows of that length, from the evaluation corpus (``transductive``, A.6) or from the
calibration split (``calibration-split``, the out-of-sample alternative), frozen, and the first
min(eval cap, ⌊N/L⌋) windows are scored. The cell shares weights, rotations and calibration statistics with
every other cell of its seed (paired design). Cells are named ``<r3>.<scope>``; each names its control
``hadamard.<scope>`` so the generic long-context report pairs within a scope.

:func:`static_tables` adds the paper's contrasts: pairwise_only − hadamard and pairwise_plus_hadamard −
hadamard per length and scope (paired over seeds, t intervals), the non-additivity check of App. A.8
(effect(both) against effect(act) + effect(kv), effects measured against the dynamic cells), and, with
``--quant-diagnostic``, App. E's quantiser-step table.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rope_quant.experiment.config import StaticScope
from rope_quant.experiment.static_control import PAPER_MAX_WINDOWS, StaticProtocol
from rope_quant.sweep.manifest import Manifest, SweepError, _WrapsRun, config_dict, with_overrides

__all__ = ["DYNAMIC", "StaticConfig", "static_manifest", "scope_name", "parse_scope", "evaluate_static_cell",
           "deviations", "static_tables", "write_static_report"]

#: The scope name of the reference cells without the static control.
DYNAMIC = "dynamic"
#: The R3 configurations the paper contrasts with hadamard under the static control (App. D).
CONTRASTS = ("pairwise_only", "pairwise_plus_hadamard")


def scope_name(scope: StaticScope | None) -> str:
    return DYNAMIC if scope is None else StaticScope(scope).value


def parse_scope(name: str) -> StaticScope | None:
    """``dynamic`` → None, else a :class:`StaticScope` (SweepError naming the valid scopes)."""
    if name == DYNAMIC:
        return None
    try:
        return StaticScope(name)
    except ValueError:
        raise SweepError(f"unknown static scope {name!r}; valid: {DYNAMIC}, "
                         + ", ".join(s.value for s in StaticScope)) from None


@dataclass(frozen=True)
class StaticConfig(_WrapsRun):
    """A static-control cell: ``run`` evaluated at ``lengths`` under ``scope`` (None: dynamic reference).

    ``protocol``: where the scales come from; ``max_windows``: the cap on estimation windows per length (A.6:
    64; lower it on CPU, and the report names the deviation); ``eval_corpus``: the scored corpus (None: the
    calibration corpus's evaluation split); ``quant_diagnostic``: record App. E's statistics in the cell.
    The number of scored windows per length is ``run.eval_windows`` (None: 24, App. A.4's cap).
    """

    run: Any
    lengths: tuple[int, ...]
    scope: StaticScope | None = StaticScope.BOTH
    protocol: StaticProtocol = StaticProtocol.TRANSDUCTIVE
    max_windows: int = PAPER_MAX_WINDOWS
    eval_corpus: str | None = None
    quant_diagnostic: bool = False

    def __post_init__(self) -> None:
        lengths = tuple(int(v) for v in self.lengths)
        if not lengths or any(v < 2 for v in lengths) or len(set(lengths)) != len(lengths):
            raise SweepError(f"lengths must be distinct integers >= 2, got {self.lengths!r}")
        object.__setattr__(self, "lengths", lengths)
        object.__setattr__(self, "scope", None if self.scope in (None, DYNAMIC) else parse_scope(str(self.scope)))
        try:
            object.__setattr__(self, "protocol", StaticProtocol(self.protocol))
        except ValueError:
            raise SweepError(f"unknown static protocol {self.protocol!r}; valid: "
                             + ", ".join(p.value for p in StaticProtocol)) from None
        if isinstance(self.max_windows, bool) or not isinstance(self.max_windows, int) or self.max_windows < 1:
            raise SweepError(f"static max_windows must be a positive integer, got {self.max_windows!r}")
        if self.run.quant.static_scope is not None:
            raise SweepError("a static cell's run must use the dynamic quantisers (the A.6 control is applied "
                             "at evaluation time)")

    def static_fields(self) -> dict[str, Any]:
        return {"lengths": list(self.lengths), "scope": scope_name(self.scope), "protocol": self.protocol.value,
                "max_windows": self.max_windows, "eval_corpus": self.eval_corpus,
                "quant_diagnostic": self.quant_diagnostic}

    def key(self) -> str:
        return self._hash({"static": self.static_fields()})

    def to_dict(self) -> dict[str, Any]:
        return {"run": config_dict(self.run), "static": self.static_fields()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StaticConfig:
        from rope_quant.experiment.config import RunConfig

        fields = dict(data["static"])
        fields["lengths"] = tuple(fields["lengths"])
        return cls(RunConfig.from_dict(dict(data["run"])), **fields)


def static_manifest(base: Any, configs: Sequence[str], seeds: Sequence[int], lengths: Sequence[int],
                    scopes: Sequence[StaticScope | None], *,
                    protocol: StaticProtocol | str = StaticProtocol.TRANSDUCTIVE,
                    max_windows: int = PAPER_MAX_WINDOWS, eval_corpus: str | None = None,
                    quant_diagnostic: bool = False, comparator: str = "hadamard") -> Manifest:
    """Cells ``<r3>.<scope>`` for every seed, R3 config and scope; each pairs with ``<comparator>.<scope>``."""
    cells, meta = [], {}
    for s in seeds:
        for scope in scopes:
            for r3 in configs:
                name = f"{r3}.{scope_name(scope)}"
                cells.append((name, StaticConfig(with_overrides(base, seed=int(s), r3=r3), tuple(lengths), scope,
                                                 protocol, max_windows, eval_corpus, quant_diagnostic)))
                meta[name] = {"r3": r3, "scope": scope_name(scope), "lengths": list(lengths),
                              "control": f"{comparator}.{scope_name(scope)}"}
    if not cells:
        raise SweepError("no configs, scopes or seeds given")
    family = [n for n, m in meta.items() if m["r3"] != comparator]
    return Manifest(cells=cells, kind="static", comparator=f"{comparator}.{scope_name(scopes[0])}", family=family,
                    meta=meta)


def deviations(cfg: StaticConfig, windows_used: Mapping[int, int] | None = None,
               available: Mapping[int, int] | None = None) -> list[str]:
    """Departures from A.6 of a static cell (and of its measured window counts, when given)."""
    out = []
    if cfg.scope is None:
        return out
    if cfg.protocol != StaticProtocol.TRANSDUCTIVE:
        out.append("scales from the calibration split (out of sample), not from the evaluation corpus as in A.6")
    if cfg.max_windows < PAPER_MAX_WINDOWS:
        out.append(f"at most {cfg.max_windows} estimation windows per length (A.6: up to {PAPER_MAX_WINDOWS})")
    for length, used in sorted((windows_used or {}).items()):
        avail = (available or {}).get(length)
        if avail is not None and used < min(PAPER_MAX_WINDOWS, avail):
            out.append(f"L={length}: {used} estimation windows of the {min(PAPER_MAX_WINDOWS, avail)} A.6 would use")
    return out


def evaluate_static_cell(cfg: StaticConfig, qm: Any, progress: bool = False) -> dict[str, Any]:
    """Score ``qm`` (built for ``cfg.run``) at every length under the cell's scope; the JSON-able result."""
    from rope_quant.experiment import evaluate, static_control
    from rope_quant.quant import diagnostic

    run = cfg.run
    eval_ids = qm.corpus.eval_ids
    eval_name = run.corpus
    if cfg.eval_corpus is not None and cfg.eval_corpus != run.corpus:
        from rope_quant.experiment.data import load_corpus

        eval_ids = load_corpus(cfg.eval_corpus, qm.tokenizer).eval_ids
        eval_name = cfg.eval_corpus
    source = static_control.source_ids(cfg.protocol, eval_ids, qm.corpus)
    cap = run.eval_windows or evaluate.LONG_CONTEXT_MAX_WINDOWS
    lengths: dict[str, Any] = {}
    used, available = {}, {}
    start = time.perf_counter()
    for length in cfg.lengths:
        scales = None
        if cfg.scope is not None:
            windows = static_control.static_windows(source, length, cfg.max_windows)
            scales = static_control.estimate_scales(qm, windows, cfg.scope, progress=progress)
            used[length], available[length] = int(windows.shape[0]), int(source.numel() // length)
        recorder = diagnostic.recording() if cfg.quant_diagnostic else contextlib.nullcontext()
        with static_control.applied(qm, scales), recorder as rec:
            res = evaluate.perplexity(qm.model, eval_ids, length, cap, run.device, progress=progress)
        entry = {"ppl": res.ppl, "nll": res.nll, "n_windows": res.n_windows, "n_tokens": res.n_tokens,
                 "seqlen": res.seqlen}
        if scales is not None:
            transductive = cfg.protocol == StaticProtocol.TRANSDUCTIVE
            source_name = f"{eval_name} (evaluation split)" if transductive else f"{run.corpus} (calibration split)"
            entry["static"] = {**scales.record(), "available_windows": available[length], "source": source_name,
                               "protocol": cfg.protocol.value}
        if cfg.quant_diagnostic:
            entry["quant_diagnostic"] = rec.summary()
        lengths[str(length)] = entry
    return {"lengths": lengths,
            "static": {"scope": scope_name(cfg.scope), "protocol": cfg.protocol.value,
                       "transductive": cfg.scope is not None and cfg.protocol == StaticProtocol.TRANSDUCTIVE,
                       "max_windows": cfg.max_windows, "eval_corpus": eval_name, "calib_corpus": run.corpus,
                       "eval_windows_cap": cap, "deviations": deviations(cfg, used, available)},
            "timing": {**qm.timing, "eval_s": time.perf_counter() - start}}


# ----------------------------------------------------------------------------- report


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


def static_tables(results_dir: Any, comparator: str = "hadamard", level: float = 0.90) -> list[Any]:
    """The contrast table, the non-additivity table (A.8) and, when recorded, App. E's diagnostic table."""
    from rope_quant.sweep.manifest import read_manifest
    from rope_quant.sweep.records import complete_records
    from rope_quant.sweep.report import Table, _delta_ci, _fmt, paired_block

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
                md.append({"L": str(length), "scope": scope, "contrast": row["contrast"], "ppl": _fmt(row["ppl"]),
                           f"ppl {comparator}": _fmt(row["ppl_control"]),
                           f"Δ [{int(level * 100)}% CI]": _delta_ci(block)})
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
            md.append({"L": str(length), "quantity": qname, "effect act": _fmt(row["effect_act"]),
                       "effect kv": _fmt(row["effect_kv"]), "act + kv": _fmt(row["effect_sum"]),
                       "effect both": _fmt(row["effect_both"]),
                       f"both − (act + kv) [{int(level * 100)}% CI]": _delta_ci(block)})
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


def write_static_report(results_dir: Any, comparator: str = "hadamard", level: float = 0.90) -> str:
    """Write ``tables/<name>.csv|md`` and ``static.md`` for a static results directory; return the markdown."""
    from pathlib import Path

    from rope_quant.io import atomic_write_text

    root = Path(results_dir)
    tables = static_tables(root, comparator, level)
    deviation_lines: list[str] = []
    transductive = False
    from rope_quant.sweep.records import complete_records

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

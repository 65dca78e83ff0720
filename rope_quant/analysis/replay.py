"""A claims JSON's decisions re-read under another sequential plan (docs/verdicts.md, "The recorded decisions
re-read"): ``rope-quant replay CLAIMS.json --shape normal``.

Every verdict the rule writes keeps its per-seed paired differences (``diffs``) and float-order shifts
(``float_order.shifts``). A JSON written before ``diffs`` were recorded gives them as the part's treatment −
control (``numbers``), or, where it kept only per-config lists, as the one ordered pair of lists whose mean
difference is the recorded mean. :func:`replay_row` rebuilds a row's sampled parts from them and reads the claim
look by look as ``--rq-until-decided`` would have (the engine's :func:`rope_quant.claims.values.replay`); a part
without sampling error keeps its recorded outcome. The replayed verdict carries the outlier flag of its seeds
(:mod:`rope_quant.core.outlier`, computed by the rule itself, so a JSON written before the flag existed gets it too),
naming the seeds by the row's ``seeds`` where it kept them. The recorded equivalence margin is used at every look
(the run computed it from the comparator's mean at each look, so an equivalence read at an earlier look may differ in
its last digits). A row that kept no per-seed values is named with the reason, never guessed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rope_quant.analysis.reproduce import read_claims_payload
from rope_quant.claims.values import replay
from rope_quant.core.sequential import Plan, PlanError, Recorded
from rope_quant.core.verdict import Form, Verdict
from rope_quant.io import markdown_table


@dataclass(frozen=True)
class Replayed:
    """One claims-JSON row: its recorded outcome, seeds and boundary, and the verdict under the plan (None, with
    ``why``, where the row cannot be replayed)."""

    claim: str
    recorded: str
    seeds: int | None
    shape: str
    verdict: Verdict | None
    why: str = ""


def _lists(numbers: Mapping[str, Any]) -> list[list[float]]:
    """The per-seed lists of a row's ``numbers`` (and of its mappings one level down)."""
    out = []
    for v in numbers.values():
        for w in (v.values() if isinstance(v, Mapping) else [v]):
            if isinstance(w, list) and w and all(isinstance(x, (int, float)) for x in w):
                out.append([float(x) for x in w])
    return out


def _diffs(name: str, d: Mapping[str, Any], numbers: Mapping[str, Any]) -> list[float] | None:
    """A part's per-seed differences: its ``diffs``; else its numbers' treatment − control; else (a JSON of
    per-config lists) the one ordered pair of lists whose mean difference is the recorded mean."""
    if d.get("diffs"):
        return [float(x) for x in d["diffs"]]
    got = numbers.get(name)
    if isinstance(got, Mapping) and isinstance(got.get("treatment"), list) and isinstance(got.get("control"), list):
        return [float(t) - float(c) for t, c in zip(got["treatment"], got["control"], strict=True)]
    n, mean = d.get("n"), d.get("mean")
    if not isinstance(n, int) or not isinstance(mean, (int, float)):
        return None
    lists = [v for v in _lists(numbers) if len(v) == n]
    found = [[x - y for x, y in zip(a, b, strict=True)] for i, a in enumerate(lists) for j, b in enumerate(lists)
             if i != j and abs(sum(a) / n - sum(b) / n - mean) <= 1e-9 * (1.0 + abs(mean))]
    return found[0] if len(found) == 1 else None


def recorded_parts(row: Mapping[str, Any]) -> tuple[list[Recorded], list[tuple[bool, str]], str]:
    """(sampled parts, fixed parts as (holds, note), why not replayable or "") of a claims JSON row: its ``parts``
    where it has them, else its ``decision`` as the claim's one part."""
    parts = row.get("parts") or {"claim": row.get("decision") or {}}
    got = row.get("numbers")
    numbers: Mapping[str, Any] = got if isinstance(got, Mapping) else {}
    sampled: list[Recorded] = []
    fixed: list[tuple[bool, str]] = []
    for name, d in parts.items():
        if not isinstance(d, Mapping):
            return [], [], f"part {name!r} has no recorded verdict"
        if d.get("form") is None:  # a part without sampling error (holds / fails, no interval)
            fixed.append((d.get("outcome") == "holds", str(d.get("note") or name)))
            continue
        fo = d.get("float_order")
        diffs = _diffs(name, d, numbers)
        if diffs is None:
            return [], [], f"part {name!r} kept no per-seed differences"
        if not isinstance(fo, Mapping) or not isinstance(fo.get("shifts"), list):
            return [], [], f"part {name!r} kept no float-order shifts"
        own = numbers.get(name)
        sampled.append(Recorded(Form(d["form"]), diffs, [float(x) for x in fo["shifts"]],
                                float(d.get("margin") or 0.0), own.get("tokens") if isinstance(own, Mapping) else None))
    return sampled, fixed, ""


def replay_row(row: Mapping[str, Any], plan: Plan) -> Replayed:
    """A claims JSON row re-read under ``plan`` (module docstring)."""
    decision = row.get("decision")
    claim = str(row.get("id") or row.get("claim") or "?")
    if not isinstance(decision, Mapping):
        return Replayed(claim, "?", None, "?", None, "the row records no decision")
    read = [decision, *[d for d in (row.get("parts") or {}).values() if isinstance(d, Mapping)]]
    seeds = max((d["n"] for d in read if isinstance(d.get("n"), int)), default=None)
    shape = next((str(d["shape"]) for d in read if d.get("shape")), "")
    shape = shape or ("normal" if any("look" in str(d.get("note", "")) for d in read) else "fixed-n")
    recorded = str(decision.get("outcome", "?"))
    try:
        sampled, fixed, why = recorded_parts(row)
        if not why and not sampled:
            why = "no sampled part: nothing for a boundary to change"
        if why:
            return Replayed(claim, recorded, seeds, shape, None, why)
        v = replay(sampled, fixed, plan)
        numbers = row.get("seeds")
        if v.outlier is not None and isinstance(numbers, list) and len(numbers) >= v.n:  # name the seeds
            v = replace(v, outlier=v.outlier.at_seeds([int(s) for s in numbers]))
        return Replayed(claim, recorded, seeds, shape, v)
    except (ValueError, PlanError) as exc:  # parts of unequal seeds, too few seeds, an unknown form
        return Replayed(claim, recorded, seeds, shape, None, str(exc))


def read_claims(path: str | Path) -> list[Mapping[str, Any]]:
    """The rows of a claims JSON (:func:`rope_quant.analysis.reproduce.read_claims_payload`, whose
    :class:`~rope_quant.analysis.reproduce.ReproduceError` names a file that is not one)."""
    return [r for r in read_claims_payload(path)["claims"] if isinstance(r, Mapping)]


def replay_file(path: str | Path, plan: Plan) -> list[Replayed]:
    return [replay_row(row, plan) for row in read_claims(path)]


def table(rows: Sequence[Replayed], plan: Plan) -> str:
    """The recorded and the replayed decision of every row, side by side (Markdown)."""
    out = []
    for r in rows:
        v = r.verdict
        out.append({"claim": r.claim, "recorded": f"{r.recorded} at {r.seeds} seeds ({r.shape})",
                    "replayed": (f"{v.outcome.value} at {v.n} seeds" if v is not None else "not replayed"),
                    "verdict": v.text() if v is not None else r.why,
                    "outlier": ("no" if v.outlier is None else "yes") if v is not None else "–"})
    head = f"replayed under: {plan.describe()}\n\n"
    return head + markdown_table(out, ["claim", "recorded", "replayed", "outlier", "verdict"],
                                 ["claim", "recorded", f"replayed ({plan.shape.value})", "outlier seed",
                                  "verdict or why not"])

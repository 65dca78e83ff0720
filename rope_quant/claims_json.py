"""The claims JSON and its Markdown table: one schema and one writer for both fronts.

The pytest plugin's ``--rq-claims-out`` (``rope_quant/pytest_plugin.py``) and ``rope-quant report DIR``
(``rope_quant/analysis/claims_report.py``) write the same file (docs/verdicts.md, "The claims JSON"):
``{"schema": 2, "claims": [row, ...], "tables", "machine", "model", "protocol", "device", "runs", ...}``. A row
holds :data:`ROW_KEYS`: the claim's title, its registry id, the model, what is expected and measured, ``holds``
(:func:`holds_of` its decision), the decision rule's ``decision`` (a Verdict's ``to_dict()``), its ``numbers``, the
pytest ``test`` and ``outcome`` (None where no pytest test ran), and the table's ``verdict`` and ``budget`` columns
(:func:`with_columns`). Standard library and ``rope_quant.io`` only: the plugin imports it at no cost.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rope_quant.io import atomic_write_text, json_text, markdown_table

CLAIMS_SCHEMA = 2
"""The claims JSON's layout: 2 adds ``schema`` and each decision's ``rule`` / ``float_order``
(rope_quant.analysis.reproduce reads both layouts)."""
CLAIMS_JSON = "claims.json"
CLAIMS_MD = "claims.md"
RUN_KEYS = ("model", "protocol", "device")
"""The keys that describe a run (``analysis.claims_report.describe_run``), written at the top of the claims JSON
when it measured one model; ``runs`` lists one such description per model."""
ROW_KEYS = ("claim", "id", "model", "expected", "measured", "holds", "decision", "numbers", "test", "outcome",
            "verdict", "budget")
"""The keys of every row, from either front (a row may carry more: ``parts``, the engine's ``section`` …)."""
COLUMNS = ("claim", "model", "expected", "measured", "verdict")
"""The claims table's columns (``budget to decide`` added when any row has a budget)."""
BUDGET_COLUMN = "budget to decide"


def holds_of(outcome: str) -> bool | None:
    """The row's ``holds`` from its decision's outcome: True for holds, False for fails and refuted, else None."""
    return {"holds": True, "fails": False, "refuted": False}.get(outcome)


def verdict(row: Mapping[str, Any]) -> str:
    """The verdict column: the decision rule's text (rope_quant.core.verdict) combined with the test outcome (a
    failed test whose claim was not decided against reads FAILED; None: no pytest test, the decision alone)."""
    decision = row.get("decision")
    outcome = row.get("outcome")
    xfail = " (xfail)" if outcome == "xfailed" else ""
    if outcome == "failed":
        if decision and decision["outcome"] in ("fails", "refuted"):
            return str(decision["text"])
        return "FAILED"
    if decision:
        return str(decision["text"]) + xfail
    if row.get("holds") is None and not xfail:
        return "recorded (no claim)"
    return ("holds" if row.get("holds") and not xfail else "fails") + xfail


def budget(row: Mapping[str, Any]) -> str:
    """The budget column: what would decide an inconclusive claim at 80% power (empty when decided); the sequential
    rule's honest stop at M gives its reason instead."""
    decision = row.get("decision") or {}
    if decision.get("outcome") != "inconclusive":
        return ""
    if decision.get("stop"):
        return str(decision["stop"])
    if decision.get("budget"):
        return str(decision["budget"]["text"])
    return str(decision.get("note", ""))


def with_columns(row: Mapping[str, Any]) -> dict[str, Any]:
    """``row`` with its ``verdict`` and ``budget`` columns (:func:`verdict`, :func:`budget`)."""
    return {**row, "verdict": verdict(row), "budget": budget(row)}


def claims_markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    """The claims table of rows that carry their columns (:func:`with_columns`)."""
    shown = [{**r, BUDGET_COLUMN: r.get("budget") or ""} for r in rows]
    columns = [*COLUMNS, *([BUDGET_COLUMN] if any(r[BUDGET_COLUMN] for r in shown) else [])]
    return markdown_table(shown, columns)


def runs_keys(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The run keys written at the top of the payload: the one run's, when one model was measured (else none)."""
    return {k: runs[0][k] for k in RUN_KEYS if k in runs[0]} if len(runs) == 1 else {}


def write(directory: str | os.PathLike[str], data: Mapping[str, Any], name: str = CLAIMS_JSON,
          markdown: str | None = CLAIMS_MD) -> list[Path]:
    """Write the claims JSON ``data`` as ``name`` (and its rows' table as ``markdown``, unless None) into
    ``directory``, atomically; returns the paths written."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = [atomic_write_text(out / name, json_text(dict(data)))]
    if markdown:
        written.append(atomic_write_text(out / markdown, claims_markdown(data["claims"]) + "\n"))
    return written

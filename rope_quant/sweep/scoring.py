"""When a cell's result holds a score, per result shape (stdlib only: the records and the cell kinds use it).

Each cell kind (:mod:`rope_quant.sweep.cellkind`) names the predicate of its own results; the records' one
completion predicate (:func:`rope_quant.sweep.records.result_is_scored`) accepts any of them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def scored_ppl(entry: Any) -> bool:
    """A result entry holds a score: a finite numeric ``ppl`` and no ``error``."""
    if not isinstance(entry, Mapping) or "error" in entry:
        return False
    return _finite_number(entry.get("ppl"))


def scored_lengths(result: Mapping[str, Any]) -> list[str]:
    """The context lengths of a long-context result that were scored (not failed)."""
    lengths = result.get("lengths")
    if not isinstance(lengths, Mapping):
        return []
    return [str(length) for length, entry in lengths.items() if scored_ppl(entry)]


def scored_tasks(result: Mapping[str, Any]) -> bool:
    """An lm-eval result: ``tasks`` maps every task to a non-empty ``{metric: value}``."""
    tasks = result.get("tasks")
    return isinstance(tasks, Mapping) and len(tasks) > 0 and all(isinstance(v, Mapping) and v for v in tasks.values())


def scored_niah(result: Mapping[str, Any]) -> bool:
    """A NIAH result (App. G): a finite accuracy for at least one length."""
    acc = result.get("niah", {}).get("accuracy", {}) if isinstance(result.get("niah"), Mapping) else {}
    by_length = acc.get("by_length") if isinstance(acc, Mapping) else None
    return isinstance(by_length, Mapping) and bool(by_length) and all(_finite_number(v) for v in by_length.values())

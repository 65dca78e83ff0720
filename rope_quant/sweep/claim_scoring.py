"""How a claims sweep scores a registry cell: the cell's sweep config at a seed, by its :class:`Scoring`.

A registry cell (``rope_quant/claims/registry.py``) is flat config overrides plus how it is scored. On the
comparator's config at a seed (the base of every claim cell) the sweep scores it as the pytest front does
(``tests/_support/registry_front.py``, ``ExperimentStore``), so both fronts compute each cell by the same function:

- ``EVAL``: the comparator's config with the overrides, a plain run cell at the budget's evaluation windows;
- ``SUPPORT`` (C4, Table M): the same run cell with ``eval_windows`` = the budget's support windows;
- ``LONG`` (C7, App. A.4): a long-context cell (:mod:`rope_quant.sweep.kinds.long_context`) of that run at the cell's
  length L, scored on the first ``long_docs`` evaluation documents of ``long_corpus`` (A.4: 64), ``long_windows``
  windows (the run's ``eval_windows``).

The sizes are a study's :class:`ScoringBudget`, kept in its manifest's ``meta`` under :data:`SCORING_META` (a key no
cell name can take), so ``report``, ``decide`` and a resumed run read the cells the sweep planned. The defaults are
the e2e suite's (``E2EBudget``: 3 support windows, one window per length on the Gutenberg plays).
Standard library and the light sweep modules only (no torch at import).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from rope_quant.claims.registry import Override, Scoring, length_of, metric_value, overrides_of, scoring_of
from rope_quant.sweep.cellkind import CellKindName, SweepError, kind_of, run_of, with_overrides
from rope_quant.sweep.kinds.long_context import LongContextConfig

SCORING_META = "_scoring"
"""The key of a claims manifest's ``meta`` holding its :class:`ScoringBudget` (a cell name starts with a letter or
digit, so no cell's meta takes it)."""


@dataclass(frozen=True)
class ScoringBudget:
    """The sizes a claims study scores its support and long-context cells at: ``support_windows`` windows per C4
    cell, ``long_windows`` windows per length of a C7 cell on the first ``long_docs`` evaluation documents of
    ``long_corpus`` (None: A.4's 64, ``rope_quant.scoring.longctx.EVAL_DOCUMENTS``)."""

    support_windows: int = 3
    long_windows: int = 1
    long_corpus: str = "shakespeare"
    long_docs: int | None = None

    def __post_init__(self) -> None:
        for name in ("support_windows", "long_windows", "long_docs"):
            value = getattr(self, name)
            if value is None and name == "long_docs":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SweepError(f"{name} must be a positive integer, got {value!r}")
        if not self.long_corpus:
            raise SweepError("long_corpus must name a corpus")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> ScoringBudget:
        """The budget a manifest's ``meta`` holds (the defaults where none: a directory from before it was kept)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in dict(meta.get(SCORING_META) or {}).items() if k in known})


def scored_config(cell: Mapping[str, Override], comparator: Any, budget: ScoringBudget) -> Any:
    """The sweep config of registry ``cell`` on ``comparator`` (a ``RunConfig`` at one seed), scored as the module
    docstring says."""
    run = with_overrides(comparator, **overrides_of(cell))
    scoring = scoring_of(cell)
    if scoring is Scoring.EVAL:
        return run
    if scoring is Scoring.SUPPORT:
        return with_overrides(run, eval_windows=budget.support_windows)
    length = length_of(cell)
    if length is None:
        raise SweepError(f"a long-context cell needs its length: {dict(cell)}")
    return LongContextConfig(with_overrides(run, eval_windows=budget.long_windows), (int(length),),
                             eval_corpus=budget.long_corpus, eval_docs=_docs(budget))


def _docs(budget: ScoringBudget) -> int:
    if budget.long_docs is not None:
        return budget.long_docs
    from rope_quant.scoring.longctx import EVAL_DOCUMENTS  # deferred: imports torch

    return int(EVAL_DOCUMENTS)


def long_length(cfg: Any) -> int | None:
    """The context length a claims sweep's long-context cell scores (None for any other cell)."""
    kind = kind_of(cfg)
    if kind.name != CellKindName.LONG_CONTEXT.value:
        return None
    (length,) = kind.eval_lengths(cfg, ())
    return int(length)


def scored_value(cfg: Any, result: Mapping[str, Any], metric: str) -> float | None:
    """``metric`` of a complete record's ``result`` of config ``cfg`` (a long-context cell: its one length's entry;
    a length that failed holds none), or None when absent or not finite."""
    length = long_length(cfg)
    if length is not None:
        result = (result.get("lengths") or {}).get(str(length)) or {}
    try:
        value = metric_value(result, str(metric))
    except (KeyError, TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def scored_tokens(cfg: Any, result: Mapping[str, Any]) -> int | None:
    """The tokens a cell scores, as the budget to decide counts them: a run cell's recorded ``n_tokens``; a
    long-context cell's windows × L (the pytest front's count)."""
    length = long_length(cfg)
    if length is not None:
        return int(run_of(cfg).eval_windows or 0) * length or None
    n = result.get("n_tokens")
    return int(n) if isinstance(n, int) and n > 0 else None

"""How a claims sweep scores a registry cell: the cell's sweep config at a seed, by its :class:`Scoring`.

A registry cell (``rope_quant/claims/registry.py``) is flat config overrides plus how it is scored. On the
comparator's config at a seed (the base of every claim cell) the sweep scores it as the pytest front does
(``tests/_support/registry_front.py``, ``ExperimentStore``), so both fronts compute each cell by the same function:

- ``EVAL``: the comparator's config with the overrides, a plain run cell at the budget's evaluation windows;
- ``SUPPORT`` (C4, Table M): the same run cell with ``eval_windows`` = the budget's support windows;
- ``LONG`` (C7, App. A.4): a long-context cell (:mod:`rope_quant.sweep.kinds.long_context`) of that run at the cell's
  length L, scored on the first ``long_docs`` evaluation documents of ``long_corpus`` (A.4: 64), ``long_windows``
  windows (the run's ``eval_windows``);
- ``STATIC`` (App. D): a static-control cell (:mod:`rope_quant.sweep.kinds.static`: scope both, A.6's transductive
  scales from the first ``static_windows`` windows of the evaluation split) at the run's seqlen, scoring
  ``static_eval_windows`` windows (None: A.4's cap of 24);
- ``NIAH`` / ``NIAH_FP`` (App. G): a NIAH cell (:mod:`rope_quant.sweep.kinds.niah`) at ``niah_length`` tokens, App. G's
  5 depths × ``niah_probes`` probes on the run's corpus, answered by the quantised model (``NIAH_FP``: the
  unquantised one); its value is the accuracy at that length.

The sizes are a study's :class:`ScoringBudget`, kept in its manifest's ``meta`` under :data:`SCORING_META` (a key no
cell name can take), so ``report``, ``decide`` and a resumed run read the cells the sweep planned. The defaults are
the e2e suite's (``E2EBudget``: 3 support windows, one window per length on the Gutenberg plays, 4 + 4 static
windows, NIAH at 256 tokens with 5 probes per depth); each is a named deviation from the paper's protocol.
Standard library and the light sweep modules only (no torch at import).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from rope_quant.claims.registry import Metric, Override, Scoring, length_of, metric_value, overrides_of, scoring_of
from rope_quant.sweep.cellkind import CellKindName, SweepError, kind_of, run_of, with_overrides
from rope_quant.sweep.kinds.long_context import LongContextConfig

SCORING_META = "_scoring"
"""The key of a claims manifest's ``meta`` holding its :class:`ScoringBudget` (a cell name starts with a letter or
digit, so no cell's meta takes it)."""


@dataclass(frozen=True)
class ScoringBudget:
    """The sizes a claims study scores its support, long-context, static and NIAH cells at: ``support_windows``
    windows per C4 cell, ``long_windows`` windows per length of a C7 cell on the first ``long_docs`` evaluation
    documents of ``long_corpus`` (None: A.4's 64, ``rope_quant.scoring.longctx.EVAL_DOCUMENTS``); App. D's
    ``static_windows`` estimation windows (A.6: up to 64) and ``static_eval_windows`` scored windows (None: A.4's
    cap); App. G's ``niah_length`` tokens and ``niah_probes`` probes per depth (App. G: 20)."""

    support_windows: int = 3
    long_windows: int = 1
    long_corpus: str = "shakespeare"
    long_docs: int | None = None
    static_windows: int = 4
    static_eval_windows: int | None = 4
    niah_length: int = 256
    niah_probes: int = 5

    def __post_init__(self) -> None:
        for name in ("support_windows", "long_windows", "long_docs", "static_windows", "static_eval_windows",
                     "niah_length", "niah_probes"):
            value = getattr(self, name)
            if value is None and name in ("long_docs", "static_eval_windows"):
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
    if scoring is Scoring.STATIC:
        from rope_quant.sweep.kinds.static import StaticConfig  # deferred: imports the static control's protocol

        return StaticConfig(with_overrides(run, eval_windows=budget.static_eval_windows), (int(run.seqlen),),
                            max_windows=budget.static_windows)
    if scoring in (Scoring.NIAH, Scoring.NIAH_FP):
        from rope_quant.scoring.niah import NiahSpec
        from rope_quant.sweep.kinds.niah import NiahConfig

        spec = NiahSpec(lengths=(budget.niah_length,), probes=budget.niah_probes, corpus=str(run.corpus))
        return NiahConfig(run, spec, fp=scoring is Scoring.NIAH_FP)
    if scoring is not Scoring.LONG:
        raise SweepError(f"the claims sweep has no cell kind for scoring {scoring.value!r}: {dict(cell)}")
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


_BY_LENGTH = frozenset({CellKindName.LONG_CONTEXT.value, CellKindName.STATIC.value})
"""The cell kinds whose result holds an entry per length (``result["lengths"][L]``)."""


def scored_length(cfg: Any) -> int | None:
    """The one length a claims sweep's long-context, static or NIAH cell scores (None for a run cell)."""
    name = kind_of(cfg).name
    if name in _BY_LENGTH:
        (length,) = cfg.lengths
        return int(length)
    if name == CellKindName.NIAH.value:
        (length,) = cfg.spec.lengths
        return int(length)
    return None


def scored_value(cfg: Any, result: Mapping[str, Any], metric: str) -> float | None:
    """``metric`` of a complete record's ``result`` of config ``cfg`` (a long-context or static cell: its one
    length's entry, a length that failed holds none; a NIAH cell: ``accuracy`` at its length), or None when absent
    or not finite."""
    length = scored_length(cfg)
    if kind_of(cfg).name == CellKindName.NIAH.value:
        by_length = (((result.get("niah") or {}).get("accuracy") or {}).get("by_length") or {})
        result = {Metric.ACCURACY.value: by_length[str(length)]} if str(length) in by_length else {}
    elif length is not None:
        result = (result.get("lengths") or {}).get(str(length)) or {}
    try:
        value = metric_value(result, str(metric))
    except (KeyError, TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def scored_tokens(cfg: Any, result: Mapping[str, Any]) -> int | None:
    """The tokens a cell scores, as the budget to decide counts them: a run cell's recorded ``n_tokens``; a
    long-context or static cell's windows × L; none for a NIAH cell (probes, not tokens)."""
    if kind_of(cfg).name == CellKindName.NIAH.value:
        return None
    length = scored_length(cfg)
    if length is not None:
        return int(run_of(cfg).eval_windows or 0) * length or None
    n = result.get("n_tokens")
    return int(n) if isinstance(n, int) and n > 0 else None

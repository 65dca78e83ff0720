"""``rope-quant static``: the static per-channel control (App. A.6, D, H) as sweep cells.

A :class:`StaticConfig` cell evaluates one R3 configuration at one seed under one static scope (``both``,
``act``, ``kv``; or ``dynamic``, the reference without the static control) at several context lengths. At each
length the scales are re-estimated (:mod:`rope_quant.experiment.static_control`) from up to ``max_windows``
non-overlapping windows of that length, from the evaluation corpus (``transductive``, A.6) or from the
calibration split (``calibration-split``, the out-of-sample alternative), frozen, and the first
min(eval cap, ⌊N/L⌋) windows are scored. The cell shares weights, rotations and calibration statistics with
every other cell of its seed (paired design). Cells are named ``<r3>.<scope>``; each names its control
``hadamard.<scope>`` so the generic long-context report pairs within a scope.

Its report is :mod:`rope_quant.analysis.static_report` (the paper's contrasts per length and scope, the
non-additivity check of App. A.8 and App. E's quantiser-step table).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rope_quant.defaults import DEFAULT_COMPARATOR
from rope_quant.experiment.config import StaticScope
from rope_quant.experiment.static_control import PAPER_MAX_WINDOWS, StaticProtocol
from rope_quant.sweep.kinds.static import (
    DYNAMIC,
    StaticConfig,
    deviations,
    evaluate_static_cell,
    parse_scope,
    scope_name,
)
from rope_quant.sweep.manifest import Manifest, SweepError, with_overrides

__all__ = ["DYNAMIC", "CONTRASTS", "StaticConfig", "static_manifest", "scope_name", "parse_scope",
           "evaluate_static_cell", "deviations"]

#: The R3 configurations the paper contrasts with hadamard under the static control (App. D).
CONTRASTS = ("pairwise_only", "pairwise_plus_hadamard")

def static_manifest(base: Any, configs: Sequence[str], seeds: Sequence[int], lengths: Sequence[int],
                    scopes: Sequence[StaticScope | None], *,
                    protocol: StaticProtocol | str = StaticProtocol.TRANSDUCTIVE,
                    max_windows: int = PAPER_MAX_WINDOWS, eval_corpus: str | None = None,
                    quant_diagnostic: bool = False, comparator: str = DEFAULT_COMPARATOR) -> Manifest:
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
    return Manifest(cells=cells, study="static", comparator=f"{comparator}.{scope_name(scopes[0])}", family=family,
                    meta=meta)

"""lm-evaluation-harness sweeps: the manifest of ``rope-quant lm-eval`` and what computes one of its cells.

A cell is an :class:`~rope_quant.sweep.kinds.lm_eval.LmEvalConfig`: one R3 configuration at one seed, its quantised
model scored by lm-eval on the requested tasks (:mod:`rope_quant.experiment.lm_eval`). Cells are written, resumed
and sharded by the ordinary runner; the real cell function (:func:`rope_quant.sweep.cells.pipeline_cell_fn`) builds
or reconfigures the seed's quantised model and hands it to :class:`~rope_quant.sweep.kinds.lm_eval.LmEvalCells` (the
lm-eval cell kind). The report pairs each task metric within seed against the comparator.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rope_quant.defaults import DEFAULT_COMPARATOR
from rope_quant.sweep.kinds.lm_eval import LmEvalCells, LmEvalConfig
from rope_quant.sweep.manifest import Manifest, with_overrides

__all__ = ["KIND", "lm_eval_manifest", "LmEvalCells", "LmEvalConfig"]

KIND = "lm-eval"


def lm_eval_manifest(
    base: Any, configs: Sequence[str], seeds: Sequence[int], tasks: Sequence[str], *,
    include_path: str | os.PathLike[str] | None = None, include_defaults: bool = True,
    limit: int | None = None, num_fewshot: int | None = None, batch_size: int = 1,
    max_length: int | None = None, comparator: str = DEFAULT_COMPARATOR,
) -> Manifest:
    """Cells ``LmEvalConfig(base.override(seed=s, r3=name), tasks, ...)``, seed-major (weights shared)."""
    path = str(Path(include_path).expanduser().resolve()) if include_path else None
    cells = [
        (name, LmEvalConfig(with_overrides(base, seed=int(seed), r3=name), tuple(tasks), include_path=path,
                            include_defaults=include_defaults, limit=limit, num_fewshot=num_fewshot,
                            batch_size=batch_size, max_length=max_length))
        for seed in seeds for name in configs
    ]
    meta = {name: {"r3": name, "tasks": list(tasks)} for name in configs}
    return Manifest(cells=cells, study=KIND, comparator=comparator, meta=meta)

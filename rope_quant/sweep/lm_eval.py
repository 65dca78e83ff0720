"""lm-evaluation-harness sweeps: the manifest of ``rope-quant lm-eval`` and what computes one of its cells.

A cell is an :class:`~rope_quant.sweep.manifest.LmEvalConfig`: one R3 configuration at one seed, its
quantised model scored by lm-eval on the requested tasks (:mod:`rope_quant.experiment.lm_eval`). Cells
are written, resumed and sharded by the ordinary runner; the real cell function
(:func:`rope_quant.sweep.cells.pipeline_cell_fn`) builds or reconfigures the seed's quantised model and
hands it to :class:`LmEvalCells`. The report pairs each task metric within seed against the comparator.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rope_quant.sweep.manifest import LmEvalConfig, Manifest, with_overrides

KIND = "lm-eval"


def lm_eval_manifest(
    base: Any, configs: Sequence[str], seeds: Sequence[int], tasks: Sequence[str], *,
    include_path: str | os.PathLike[str] | None = None, include_defaults: bool = True,
    limit: int | None = None, num_fewshot: int | None = None, batch_size: int = 1,
    max_length: int | None = None, comparator: str = "hadamard",
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
    return Manifest(cells=cells, kind=KIND, comparator=comparator, meta=meta)


class LmEvalCells:
    """Scores built quantised models on an lm-eval cell's tasks; one ``TaskManager`` per task source."""

    def __init__(self) -> None:
        self._managers: dict[tuple[str | None, bool], Any] = {}

    def manager(self, cfg: LmEvalConfig) -> Any:
        from rope_quant.experiment import lm_eval

        ident = (cfg.include_path, cfg.include_defaults)
        if ident not in self._managers:
            self._managers[ident] = lm_eval.task_manager(cfg.include_path, include_defaults=cfg.include_defaults)
        return self._managers[ident]

    def __call__(self, cfg: LmEvalConfig, qm: Any) -> Mapping[str, Any]:
        """lm-eval's metrics and per-document scores of ``qm`` (the built model of ``cfg.run``)."""
        from rope_quant.experiment import lm_eval

        start = time.perf_counter()
        lm = lm_eval.as_hflm(qm.model, qm.tokenizer, batch_size=cfg.batch_size, max_length=cfg.max_length)
        out = lm_eval.evaluate_tasks(lm, cfg.tasks, manager=self.manager(cfg), limit=cfg.limit,
                                     num_fewshot=cfg.num_fewshot)
        if not out["tasks"]:
            raise lm_eval.LmEvalError(f"lm-eval returned no results for {', '.join(cfg.tasks)}")
        return {**out, "timing": {**qm.timing, "lm_eval_s": time.perf_counter() - start}}

"""The lm-eval cell kind: the quantised model of a RunConfig scored by lm-evaluation-harness on some tasks."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rope_quant.sweep.cellkind import CellContext, CellKind, CellKindName, SweepError, WrapsRun, config_dict, register
from rope_quant.sweep.scoring import scored_tasks


@dataclass(frozen=True)
class LmEvalConfig(WrapsRun):
    """An lm-evaluation-harness cell: the quantised model of a RunConfig scored on lm-eval ``tasks``.

    ``key()`` adds the task settings to the run's key (``batch_size`` is left out: scores do not depend on
    it); ``weight_key()`` is the run's, so lm-eval cells share weights and calibration with the other cells
    of the same seed. ``include_path`` is a folder of local task YAMLs; ``include_defaults=False`` indexes
    only those (faster); ``limit`` caps the documents per task; ``max_length`` bounds lm-eval's windows.
    """

    run: Any
    tasks: tuple[str, ...]
    include_path: str | None = None
    include_defaults: bool = True
    limit: int | None = None
    num_fewshot: int | None = None
    batch_size: int = 1
    max_length: int | None = None

    def __post_init__(self) -> None:
        tasks = tuple(str(t) for t in self.tasks)
        if not tasks or any(not t for t in tasks) or len(set(tasks)) != len(tasks):
            raise SweepError(f"tasks must be distinct non-empty names, got {self.tasks!r}")
        object.__setattr__(self, "tasks", tasks)
        for name in ("limit", "num_fewshot", "max_length"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise SweepError(f"{name} must be None or a non-negative integer, got {value!r}")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise SweepError(f"batch_size must be a positive integer, got {self.batch_size!r}")
        if not self.include_defaults and not self.include_path:
            raise SweepError("include_defaults=False needs an include_path with local task YAMLs")

    def _task_fields(self) -> dict[str, Any]:
        return {"tasks": list(self.tasks), "include_path": self.include_path,
                "include_defaults": self.include_defaults, "limit": self.limit,
                "num_fewshot": self.num_fewshot, "max_length": self.max_length}

    def key(self) -> str:
        return self._hash({"lm_eval": self._task_fields()})

    def to_dict(self) -> dict[str, Any]:
        return {"run": config_dict(self.run), "lm_eval": {**self._task_fields(), "batch_size": self.batch_size}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LmEvalConfig:
        from rope_quant.experiment.config import RunConfig  # deferred: heavy

        fields = dict(data["lm_eval"])
        fields["tasks"] = tuple(fields["tasks"])
        return cls(RunConfig.from_dict(dict(data["run"])), **fields)


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


def evaluate(cfg: LmEvalConfig, ctx: CellContext) -> dict[str, Any]:
    """lm-eval's ``{"tasks": {task: {metric: value}}, "samples": ...}`` for the seed's quantised model."""
    qm, reused = ctx.quantized(cfg)
    cells = ctx.state.setdefault(CellKindName.LM_EVAL.value, LmEvalCells())  # one per sweep (lm-eval is optional)
    return {**cells(cfg, qm), "model_reused": reused}


KIND = register(CellKind(CellKindName.LM_EVAL.value, LmEvalConfig, tag="lm_eval", from_dict=LmEvalConfig.from_dict,
                         extra_settings=lambda cfg: {"lm_eval": cfg.to_dict()["lm_eval"]}, evaluate=evaluate,
                         scored=scored_tasks, description="lm-evaluation-harness tasks on the quantised model"))

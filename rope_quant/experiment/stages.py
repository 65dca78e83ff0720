"""The stages of one cell, by name, and what an out-of-memory error inside one becomes (issue 21).

:class:`StageName` is the one source of the stage names: the rows of ``rope-quant plan``
(:mod:`rope_quant.experiment.plan`) and the stage an error record names (:mod:`rope_quant.sweep.records`) are
the same strings. :func:`stage` wraps one stage of :func:`rope_quant.experiment.pipeline.build_quantized_model`
or :func:`~rope_quant.experiment.pipeline.run_cell`: a ``torch.OutOfMemoryError`` (CUDA) or ``MemoryError``
(host) raised inside it becomes :class:`StageOutOfMemoryError`, which names the stage and the remedy. The sweep
runner records it like any other failing cell (the record's ``error.stage``) and goes on with the next one; the
stage's tensors are freed when the exception is dropped, so the next cell starts from the same memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum

import torch

__all__ = ["StageName", "StageOutOfMemoryError", "stage"]


class StageName(StrEnum):
    """A stage of one cell; the plan's rows carry these names (RTN and the static ranges are not planned)."""

    LOAD = "load"
    WHIP_R1 = "whip R1"
    ROTATION = "offline rotation"
    STATIC_RANGES = "static activation ranges"
    GPTQ = "GPTQ"
    RTN = "RTN"
    CALIBRATION = "calibration"
    EVALUATION = "evaluation (per config)"


class StageOutOfMemoryError(MemoryError):
    """Out of memory inside a named stage; ``stage`` is its :class:`StageName`."""

    def __init__(self, name: StageName, cause: BaseException) -> None:
        self.stage = StageName(name)
        super().__init__(
            f"out of memory in stage '{self.stage}' ({type(cause).__name__}: {str(cause)[:300]}). "
            "`rope-quant plan MODEL` predicts every stage's peak before a run: use --offload cpu, a smaller "
            "--calib-windows / --eval-windows, or a device with more memory")


@contextmanager
def stage(name: StageName) -> Iterator[None]:
    """Run the body as stage ``name``: an out-of-memory error inside it is re-raised as
    :class:`StageOutOfMemoryError` naming the stage (an inner stage's error passes through unchanged)."""
    try:
        yield
    except StageOutOfMemoryError:
        raise
    except (torch.OutOfMemoryError, MemoryError) as exc:
        raise StageOutOfMemoryError(name, exc) from exc

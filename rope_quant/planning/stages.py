"""The stages of one cell, by name, and what an out-of-memory error inside one becomes (names the stage).

:class:`StageName` is the one source of the stage names: the rows of ``rope-quant plan``
(:mod:`rope_quant.planning.plan`) and the stage an error record names (:mod:`rope_quant.sweep.records`) are
the same strings. :func:`stage` wraps one stage of :func:`rope_quant.experiment.pipeline.build_quantized_model`
or :func:`~rope_quant.experiment.pipeline.run_cell`: a ``torch.OutOfMemoryError`` (CUDA) or ``MemoryError``
(host) raised inside it becomes :class:`StageOutOfMemoryError`, which names the stage and the remedy. The sweep
runner records it like any other failing cell (the record's ``error.stage``) and goes on with the next one; the
stage's tensors are freed when the exception is dropped, so the next cell starts from the same memory.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum
from typing import Any

import torch

__all__ = ["StageName", "StageOutOfMemoryError", "stage", "release_host_memory"]


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
    release_host_memory()


@functools.cache
def _libc() -> Any:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, musl): nothing to trim
        return None


def release_host_memory() -> None:
    """Hand the heap pages that a stage freed back to the OS (glibc ``malloc_trim``; a no-op elsewhere): the
    float64 fold blocks and RTN's temporaries otherwise stay in the process's RSS for the later stages."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)

"""The README's ``pytest -n 2``: the e2e layer first, alone, then every other module spread over the workers.

The e2e layer is one session of shared builds (a seed's GPTQ weights serve every claim, and the numerics layer's
W4A4KV4 GPTQ pipeline test reads the e2e layer's seed 0 from the same ``build_cache``), and its forwards already
use every core. So it runs as one work unit, :data:`FIRST`, on one worker at torch's default thread count, while
the other workers wait; then the remaining modules (one work unit per module, pytest-xdist's ``loadscope``) run
on every worker at one torch thread each, where most of them are single-threaded Python and subprocesses.
Measured side by side on the 2-core AMD EPYC: docs/testing.md, "CI time".

:class:`PhasedScheduling` is xdist's :class:`~xdist.scheduler.LoadScopeScheduling` with a different scope split
and a hold on the other workers while :data:`FIRST` runs; :func:`set_threads` is what the root ``conftest.py``
calls before each test's set-up under xdist.
"""

from __future__ import annotations

import os
from typing import Any

from xdist.scheduler import LoadScopeScheduling

FIRST = "e2e session"
"""The work unit of the e2e layer and of the tests that read its builds."""
SHARES_E2E_BUILDS = ("tests/numerics/test_pipeline.py::test_full_w4a4kv4_gptq_pipeline",)
"""Tests outside ``tests/e2e`` that read the e2e layer's builds from the session's ``build_cache``."""


def in_first(nodeid: str) -> bool:
    """The test runs in the :data:`FIRST` unit: the e2e layer (``gpu_e2e`` too: it skips without CUDA) and
    :data:`SHARES_E2E_BUILDS`."""
    return nodeid.startswith("tests/e2e/") or nodeid.split("[", 1)[0] in SHARES_E2E_BUILDS


def threads_for(nodeid: str, default: int) -> int:
    """torch threads for a test under xdist: the worker's default in :data:`FIRST` (it runs alone), else 1."""
    return default if in_first(nodeid) else 1


_WORKER: dict[str, Any] = {}
"""The worker's own torch thread count and ``OMP_NUM_THREADS``, read before the first test changes them."""


def set_threads(nodeid: str) -> None:
    """torch's thread count for the test (:func:`threads_for`), and ``OMP_NUM_THREADS`` for its subprocesses (the
    worker's own value back in :data:`FIRST`)."""
    import torch

    if not _WORKER:
        _WORKER.update(torch=torch.get_num_threads(), env=os.environ.get("OMP_NUM_THREADS"))
    n = threads_for(nodeid, _WORKER["torch"])
    torch.set_num_threads(n)
    env = _WORKER["env"] if n == _WORKER["torch"] else str(n)
    if env is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = env


class PhasedScheduling(LoadScopeScheduling):
    """``loadscope`` by module, with :data:`FIRST` assigned to the first worker that asks and every other worker
    held (given nothing, not shut down) until :data:`FIRST` has finished; then each gets the next module. A worker
    whose :data:`FIRST` dies gives it to the next worker that asks."""

    def __init__(self, config: Any, log: Any = None) -> None:
        super().__init__(config, log)
        self._first_node: Any = None

    def _split_scope(self, nodeid: str) -> str:
        return FIRST if in_first(nodeid) else nodeid.split("::", 1)[0]

    def _first_running(self) -> bool:
        if FIRST in self.workqueue:
            return True
        unit = self.assigned_work.get(self._first_node, {}).get(FIRST) if self._first_node is not None else None
        return unit is not None and not all(unit.values())

    def _assign_work_unit(self, node: Any) -> None:
        if FIRST in self.workqueue and self._first_node not in self.assigned_work:  # not yet taken, or its worker died
            self.workqueue.move_to_end(FIRST, last=False)
            self._first_node = node
        elif node is not self._first_node and self._first_running():
            return  # held: FIRST runs alone (its own worker takes its next unit early: an xdist worker runs its
            # last pending test only once it has a next one, or is shut down)
        super()._assign_work_unit(node)

    def mark_test_complete(self, node: Any, item_index: int, duration: float = 0) -> None:
        super().mark_test_complete(node, item_index, duration)
        if node is self._first_node and not self._first_running():
            for other in self.nodes:
                if other is not node and not self._pending_of(self.assigned_work[other]):
                    self._reschedule(other)  # released: the held workers take the next modules

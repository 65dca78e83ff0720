"""Checks read once per window instead of once per quantiser call (no host synchronisation inside a forward).

The quantisers' rare branches (non-finite input, a range near the dtype's maximum) and the K diagnostics'
non-finite refusal need a host read to decide. Inside a :func:`deferred_checks` block they do not read:
each call takes the branch-free path and records a 0-d device flag with the window ("this call needed the
exact path", or "this call must raise"). The block's owner (the evaluation loop, GPTQ's group forwards)
reads every flag in ONE transfer when the window ends (:meth:`CheckWindow.read`): a flagged error is raised
then; a flagged call makes the owner recompute the window under :func:`exact_checks`, where every call
decides on the host as it always did. So the results equal the per-call exact path's bit for bit, and a GPU
waits for the host once per window, not several times per linear and head.

Outside any block (direct calls, tests) nothing is deferred.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import torch

__all__ = ["CheckWindow", "current", "deferred_checks", "exact_checks", "run_checked"]

T = TypeVar("T")


class CheckWindow:
    """The device flags of the calls inside one window (see the module docstring)."""

    def __init__(self) -> None:
        self.rerun: list[torch.Tensor] = []
        self.errors: list[tuple[torch.Tensor, Callable[[], Exception]]] = []
        self.commits: list[Callable[[], None]] = []

    def need_exact_if(self, flag: torch.Tensor) -> None:
        """Record a 0-d bool tensor: true when the call's fast result may differ from the exact path's."""
        self.rerun.append(flag.reshape(()))

    def raise_if(self, flag: torch.Tensor, make: Callable[[], Exception]) -> None:
        """Record a 0-d bool tensor: true when the call must raise ``make()`` (raised at :meth:`read`)."""
        self.errors.append((flag.reshape(()), make))

    def on_commit(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` (e.g. fold a batch into running statistics) when the window is read and kept; a window
        that is recomputed drops it (its recomputation records again, exactly)."""
        self.commits.append(fn)

    def read(self, values: Sequence[torch.Tensor] = ()) -> tuple[list[float], bool]:
        """One host transfer of ``values`` (0-d tensors, returned as floats) and every flag; raises the first
        flagged error; returns (values, whether a call asked for the exact path)."""
        parts = [v.detach().reshape(1).double() for v in values]
        n_rerun = 1 if self.rerun else 0
        if self.rerun:
            parts.append(torch.stack(self.rerun).any().reshape(1).double())
        parts += [f.reshape(1).double() for f, _ in self.errors]
        if not parts:
            self._commit(False)
            return [], False
        host = torch.cat([p.to(parts[0].device) for p in parts]).tolist()
        nv = len(values)
        for (_, make), hit in zip(self.errors, host[nv + n_rerun:], strict=True):
            if hit:
                raise make()
        rerun = bool(n_rerun and host[nv])
        self._commit(rerun)
        return host[:nv], rerun

    def _commit(self, rerun: bool) -> None:
        commits, self.commits = self.commits, []
        if not rerun:
            for fn in commits:
                fn()


_STACK: list[CheckWindow | None] = []


def current() -> CheckWindow | None:
    """The innermost deferred window, or None (exact per-call checks)."""
    return _STACK[-1] if _STACK else None


@contextlib.contextmanager
def deferred_checks() -> Iterator[CheckWindow]:
    """Defer the checks of every call inside the block to the yielded window."""
    win = CheckWindow()
    _STACK.append(win)
    try:
        yield win
    finally:
        _STACK.pop()


@contextlib.contextmanager
def exact_checks() -> Iterator[None]:
    """Decide every check on the host, per call (the recomputation of a flagged window)."""
    _STACK.append(None)
    try:
        yield
    finally:
        _STACK.pop()


def run_checked(fn: Callable[[], T], values: Callable[[T], Sequence[torch.Tensor]] = lambda _: ()
                ) -> tuple[T, list[float]]:
    """``fn()`` with deferred checks and one host read (of ``values(result)`` and the flags); recomputed with
    exact checks when a call asked for it. Returns (result, the values as floats)."""
    with deferred_checks() as win:
        out = fn()
    host, rerun = win.read(values(out))
    if rerun:
        with exact_checks():
            out = fn()
        vals = values(out)
        host = torch.stack([v.detach().reshape(()).double() for v in vals]).tolist() if vals else []
    return out, host

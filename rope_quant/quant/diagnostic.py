"""The quantiser-step diagnostic (App. E): the step Δ each quantiser call selects and its relative error.

For every quantiser evaluation (activations into the decoder linears, K, V; dynamic per-token/group or
static per-channel rule) a :class:`QuantDiagnostic` records

* the selected step Δ: one per token/group under the dynamic rule, one per channel under the static rule;
* the relative post-quantisation error ``‖y − ŷ‖² / ‖y‖²`` of the call (finite entries);
* the number of quantiser evaluations (a memoised shared input, e.g. q/k/v reading one tensor, is one
  evaluation: the diagnostic sits where the quantiser actually runs).

It is read-only: the quantisers compute exactly what they compute without it (the logits are bit-identical,
``tests/numerics/test_quant_diagnostic.py``). Recording is off unless a :func:`recording` block is active,
and the call sites test :func:`active` before doing any work.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch

from rope_quant.quant import deferred

__all__ = ["Stream", "Rule", "StreamStats", "QuantDiagnostic", "recording", "active", "observe"]


class Stream(StrEnum):
    """Which quantiser: the input of a decoder linear, the keys, or the values."""

    ACT = "act"
    K = "k"
    V = "v"


class Rule(StrEnum):
    """How the step is chosen: per token/group at run time, or per channel from frozen ranges (A.6)."""

    DYNAMIC = "dynamic"
    STATIC = "static"


@dataclass
class _Moments:
    """Running count, sum, sum of squares and max (float64) of a stream of values.

    :meth:`add` keeps each batch's four numbers on the device; :meth:`fold` brings the pending ones to the
    host in one transfer (the quantisers never wait for the host on the diagnostic's account).
    """

    n: int = 0
    total: float = 0.0
    total_sq: float = 0.0
    peak: float = -math.inf
    pending: list[torch.Tensor] = field(default_factory=list)

    def add(self, values: torch.Tensor) -> None:
        v = values.detach().double().flatten()
        ok = torch.isfinite(v)
        zero = torch.zeros_like(v)
        self.pending.append(torch.stack([ok.sum().double(), torch.where(ok, v, zero).sum(),
                                         torch.where(ok, v * v, zero).sum(),
                                         torch.where(ok, v, torch.full_like(v, -math.inf)).amax()
                                         if v.numel() else torch.tensor(-math.inf, dtype=torch.float64,
                                                                        device=v.device)]))

    def fold(self, host: list[list[float]] | None = None) -> None:
        if host is None:
            if not self.pending:
                return
            host = torch.stack([t.cpu() for t in self.pending]).tolist()
        self.pending = []
        for n, total, sq, peak in host:
            if n == 0:
                continue
            self.n += int(n)
            self.total += total
            self.total_sq += sq
            self.peak = max(self.peak, peak)

    def summary(self) -> dict[str, Any]:
        self.fold()
        if self.n == 0:
            return {"n": 0, "mean": None, "sd": None, "max": None}
        mean = self.total / self.n
        var = max(self.total_sq / self.n - mean * mean, 0.0) * (self.n / (self.n - 1) if self.n > 1 else 0.0)
        return {"n": self.n, "mean": mean, "sd": math.sqrt(var) if self.n > 1 else None, "max": self.peak}


@dataclass
class StreamStats:
    """One (stream, rule): Δ moments over every selected step, rel-MSE moments over calls, pooled rel-MSE."""

    evaluations: int = 0
    delta: _Moments = field(default_factory=_Moments)
    rel_mse: _Moments = field(default_factory=_Moments)
    err_sq: float = 0.0
    ref_sq: float = 0.0
    pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        d, r = self.delta.summary(), self.rel_mse.summary()
        return {"evaluations": self.evaluations, "n_steps": d["n"], "delta_mean": d["mean"], "delta_sd": d["sd"],
                "delta_max": d["max"], "rel_mse_mean": r["mean"], "rel_mse_sd": r["sd"], "rel_mse_max": r["max"],
                "rel_mse_pooled": self.err_sq / self.ref_sq if self.ref_sq > 0 else None}


class QuantDiagnostic:
    """Accumulates App. E's statistics per (stream, rule); :meth:`summary` gives a JSON-able dict."""

    def __init__(self) -> None:
        self.streams: dict[tuple[Stream, Rule], StreamStats] = {}

    def observe(self, stream: Stream | str, rule: Rule | str, x: torch.Tensor, y: torch.Tensor,
                delta: torch.Tensor) -> None:
        """One quantiser evaluation: input ``x``, output ``y`` (= x̂), the steps it selected."""
        st = self.streams.setdefault((Stream(stream), Rule(rule)), StreamStats())
        st.evaluations += 1
        with torch.no_grad():
            ref = x.detach().double()
            err = y.detach().double() - ref
            ok = torch.isfinite(ref) & torch.isfinite(err)
            e2 = torch.where(ok, err * err, torch.zeros_like(err)).sum()
            r2 = torch.where(ok, ref * ref, torch.zeros_like(ref)).sum()
            d = delta.detach()
        st.pending.append((d, e2, r2))  # folded in summary(): no host read per call

    def _fold(self) -> None:
        for st in self.streams.values():
            pending, st.pending = st.pending, []
            for d, e2_t, r2_t in pending:
                st.delta.add(d)
                e2, r2 = torch.stack([e2_t, r2_t]).tolist()
                st.err_sq += e2
                st.ref_sq += r2
                if r2 > 0:
                    st.rel_mse.add(torch.tensor([e2 / r2]))

    def summary(self) -> dict[str, dict[str, Any]]:
        """``{"<stream>/<rule>": {evaluations, n_steps, delta_mean, delta_sd, delta_max, rel_mse_*}}``."""
        self._fold()
        return {f"{s.value}/{r.value}": st.summary() for (s, r), st in sorted(self.streams.items())}


_ACTIVE: list[QuantDiagnostic] = []


def active() -> QuantDiagnostic | None:
    """The recorder of the innermost :func:`recording` block, or None (the quantisers skip all work)."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def recording(diag: QuantDiagnostic | None = None) -> Iterator[QuantDiagnostic]:
    """Record every quantiser evaluation inside the block into ``diag`` (a fresh one by default)."""
    diag = QuantDiagnostic() if diag is None else diag
    _ACTIVE.append(diag)
    try:
        yield diag
    finally:
        _ACTIVE.remove(diag)


def observe(stream: Stream | str, rule: Rule | str, x: torch.Tensor, y: torch.Tensor,
            delta: Callable[[], torch.Tensor]) -> None:
    """Record one evaluation into the active recorder, if any (``delta`` is computed only then)."""
    diag = active()
    if diag is not None:
        d = delta()
        win = deferred.current()
        if win is None:
            diag.observe(stream, rule, x, y, d)
        else:  # kept only if the window is not recomputed (its recomputation observes again)
            win.on_commit(lambda: diag.observe(stream, rule, x, y, d))

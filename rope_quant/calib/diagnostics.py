"""Streaming K-cache diagnostics after R3 (paper §4 diagnostics, App. A.6).

For keys ``k`` after R3, shape (..., heads, seq, d), quantised per token (and per head) in groups of
``group_size`` channels of the last dim (-1: the whole head):

- range = max - min over each token's quantisation group (mean and max over all groups);
- the quantiser step Δ = range·clip/(2^b - 1) (its mean over groups), as :func:`quant.quant_step` gives
  it: the asymmetric quantiser's range always contains 0, so for a group that does not straddle 0
  (never the case for real keys) Δ uses [min(lo, 0), max(hi, 0)] instead of max - min;
- the relative K quantisation error ‖k - q(k)‖² / ‖k‖², a ratio of sums over everything seen, with
  q = :func:`quant.fake_quant_per_token`.

Sums are accumulated in float64, so feeding batches (and layers) one at a time gives the same summary
as one pass over their concatenation; ``per_layer=True`` keeps a breakdown by the ``layer`` passed to
:meth:`KDiagnostics.update`.

Inside a window with deferred checks (:mod:`rope_quant.quant.deferred`: the evaluation loop) an update reads
nothing on the host: its sums stay on the device until :meth:`KDiagnostics.summary` (one transfer for all
of them), and non-finite keys raise :class:`NonFiniteKeysError` when the window is read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from rope_quant.quant import deferred
from rope_quant.quant.quantizers import fake_quant_per_token, quant_step


class DiagnosticsError(ValueError):
    """Bad input to the K diagnostics."""


class NonFiniteKeysError(DiagnosticsError):
    """The keys passed to the diagnostics contain NaN or Inf."""


@dataclass
class KStats:
    """Float64 running sums of one scope (everything, or one layer)."""

    n_groups: int = 0
    range_sum: float = 0.0
    range_max: float = -math.inf
    delta_sum: float = 0.0
    err_sq: float = 0.0
    norm_sq: float = 0.0

    def add(self, other: KStats) -> None:
        self.n_groups += other.n_groups
        self.range_sum += other.range_sum
        self.range_max = max(self.range_max, other.range_max)
        self.delta_sum += other.delta_sum
        self.err_sq += other.err_sq
        self.norm_sq += other.norm_sq

    def summary(self) -> dict[str, float]:
        n = self.n_groups
        return {
            "k_range_mean": self.range_sum / n if n else math.nan,
            "k_range_max": self.range_max if n else math.nan,
            "delta_mean": self.delta_sum / n if n else math.nan,
            "k_rel_err": self.err_sq / self.norm_sq if self.norm_sq > 0 else (0.0 if n else math.nan),
            "n_groups": n,
        }


class KDiagnostics:
    """Streaming K range / step / relative error of the per-token K quantiser (see module docstring)."""

    def __init__(
        self, bits: int, group_size: int = -1, clip_ratio: float = 1.0, per_layer: bool = False
    ) -> None:
        if isinstance(bits, bool) or int(bits) != bits or bits < 1:
            raise DiagnosticsError(f"bits must be a positive integer, got {bits!r}")
        if int(group_size) != group_size or (group_size != -1 and group_size < 1):
            raise DiagnosticsError(f"group_size must be -1 or a positive integer, got {group_size!r}")
        if not 0 < clip_ratio <= 1:
            raise DiagnosticsError(f"clip_ratio must lie in (0, 1], got {clip_ratio!r}")
        self.bits, self.group_size, self.clip_ratio = int(bits), int(group_size), float(clip_ratio)
        self.per_layer = per_layer
        self.total = KStats()
        self.layers: dict[int, KStats] = {}
        #: Deferred batches (layer, n_groups, float64 device sums): folded in by :meth:`flush`.
        self._pending: list[tuple[int | None, int, torch.Tensor]] = []

    def _check(self, k: torch.Tensor) -> tuple[torch.Tensor, int]:
        if not isinstance(k, torch.Tensor):
            k = torch.as_tensor(k)
        if k.ndim < 1 or k.shape[-1] == 0:
            raise DiagnosticsError(f"keys must have a non-empty last (head_dim) axis, got {tuple(k.shape)}")
        d = k.shape[-1]
        if self.group_size != -1 and d % self.group_size:
            raise DiagnosticsError(f"head_dim {d} is not a multiple of group_size {self.group_size}")
        return k, d if self.group_size == -1 else self.group_size

    def _device_sums(self, k: torch.Tensor, gs: int) -> torch.Tensor:
        """(range sum, range max, Δ sum, error², norm²) of finite keys as one float64 device tensor, with no
        host read (the window checks the keys, and the quantiser's own flags)."""
        k64 = k.double()
        lo, hi = torch.aminmax(k64.reshape(-1, gs), dim=-1)
        rng = hi - lo
        g = k.reshape(-1, gs).float() if k.dtype in (torch.float16, torch.bfloat16) else k.reshape(-1, gs)
        levels = (1 << self.bits) - 1
        glo = torch.amin(g, dim=-1).clamp(max=0.0)
        ghi = torch.amax(g, dim=-1).clamp(min=0.0)
        if self.clip_ratio != 1.0:
            glo, ghi = glo * self.clip_ratio, ghi * self.clip_ratio
        delta = ((ghi - glo) / levels).double()  # = quant_step's Δ for finite keys (its range, its formula)
        win = deferred.current()
        if win is not None:
            win.need_exact_if(~torch.isfinite(delta).all())  # a range overflowing float: quant_step's other branch
        err = k64 - fake_quant_per_token(k, self.bits, self.group_size, self.clip_ratio).double()
        return torch.stack([rng.sum(), rng.max(), delta.sum(), (err * err).sum(), (k64 * k64).sum()])

    def flush(self) -> None:
        """Fold the deferred batches into the running sums (one host transfer)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        host = torch.stack([t.to(pending[0][2].device) for _, _, t in pending]).tolist()
        for (layer, n, _), (rs, rm, ds, es, ns) in zip(pending, host, strict=True):
            batch = KStats(n, rs, rm, ds, es, ns)
            self.total.add(batch)
            if self.per_layer and layer is not None:
                self.layers.setdefault(int(layer), KStats()).add(batch)

    def batch_stats(self, k: torch.Tensor) -> KStats:
        """The sums of one batch of keys (..., heads, seq, d), without accumulating them."""
        k, gs = self._check(k)
        if not torch.isfinite(k).all():
            raise NonFiniteKeysError("keys contain NaN/Inf values")
        k = k.detach()
        if k.numel() == 0:
            return KStats()
        k64 = k.double()
        lo, hi = torch.aminmax(k64.reshape(-1, gs), dim=-1)
        rng = hi - lo
        delta, _ = quant_step(k, self.bits, self.group_size, self.clip_ratio)
        delta = delta.detach().double().reshape(-1)
        if delta.numel() != rng.numel():
            raise DiagnosticsError(
                f"quant_step returned {delta.numel()} steps for {rng.numel()} groups "
                f"of keys with shape {tuple(k.shape)}"
            )
        err = k64 - fake_quant_per_token(k, self.bits, self.group_size, self.clip_ratio).double()
        return KStats(
            n_groups=int(rng.numel()),
            range_sum=float(rng.sum()),
            range_max=float(rng.max()),
            delta_sum=float(delta.sum()),
            err_sq=float((err * err).sum()),
            norm_sq=float((k64 * k64).sum()),
        )

    def update(self, k: torch.Tensor, layer: int | None = None) -> KStats | None:
        """Accumulate one batch (e.g. one layer's post-R3 keys); returns that batch's sums (None inside a
        deferred window: they stay on the device until :meth:`flush`)."""
        if self.per_layer and layer is None:
            raise DiagnosticsError("per_layer=True needs the layer index in update(k, layer=...)")
        win = deferred.current()
        if win is not None:
            k, gs = self._check(k)
            if k.numel() == 0:
                return None
            k = k.detach()
            win.raise_if(~torch.isfinite(k).all(), lambda: NonFiniteKeysError("keys contain NaN/Inf values"))
            entry = (layer, k.numel() // gs, self._device_sums(k, gs))
            win.on_commit(lambda: self._pending.append(entry))
            return None
        batch = self.batch_stats(k)
        self.total.add(batch)
        if self.per_layer and layer is not None:  # (per_layer without a layer raised above)
            self.layers.setdefault(int(layer), KStats()).add(batch)
        return batch

    def merge(self, other: KDiagnostics) -> KDiagnostics:
        """Fold another accumulator with the same quantiser settings into this one."""
        if (self.bits, self.group_size, self.clip_ratio) != (other.bits, other.group_size, other.clip_ratio):
            raise DiagnosticsError("cannot merge diagnostics of different quantiser settings")
        self.flush()
        other.flush()
        self.total.add(other.total)
        for layer, st in other.layers.items():
            self.layers.setdefault(layer, KStats()).add(st)
        return self

    def reset(self) -> None:
        self._pending = []
        self.total = KStats()
        self.layers = {}

    def summary(self) -> dict[str, Any]:
        """dict(k_range_mean, k_range_max, delta_mean, k_rel_err, n_groups[, per_layer={layer: ...}])."""
        self.flush()
        out: dict[str, Any] = self.total.summary()
        out.update(bits=self.bits, group_size=self.group_size, clip_ratio=self.clip_ratio)
        if self.per_layer:
            out["per_layer"] = {layer: st.summary() for layer, st in sorted(self.layers.items())}
        return out

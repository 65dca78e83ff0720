"""The static per-channel INT-b quantiser (App. A.6/D): one range per channel, calibrated once, then frozen.

It follows the dynamic quantisers' conventions and their one non-finite and overflow policy
(:mod:`rope_quant.quant.quantizers`): calibration on a NaN/inf input raises :class:`NonFiniteInputError`; a
frozen range near a dtype's maximum is repaired in float64 and saturated.
"""

from __future__ import annotations

import torch

from rope_quant.quant import deferred
from rope_quant.quant.quantizers import (
    NonFiniteInputError,
    NotCalibratedError,
    QuantConfigError,
    _all_finite,
    _fq_asym,
    _fq_sym,
    _overflow_risk,
    _passthrough_nonfinite,
    _quarter_max,
    _saturate64,
    _step,
    _work,
    check_bits,
    check_clip,
    is_off,
)

__all__ = ["StaticChannelQuantizer"]


class StaticChannelQuantizer:
    """Static per-channel INT-b control (App. A.6/D): one range per channel of the last dim, calibrated once.

    Usage: ``q = StaticChannelQuantizer(n_channels, bits=4)``; ``q.observe(x)`` on calibration tensors
    (..., n_channels) accumulates the running per-channel min/max over all other axes; ``q.finalize()``
    freezes the ranges; ``q(x)`` fake-quantises with them (values outside are clamped). Ranges follow the
    dynamic quantiser's convention (asymmetric with 0 in range, or symmetric), scaled by ``clip_ratio``.
    """

    def __init__(
        self,
        n_channels: int | None = None,
        bits: int = 4,
        clip_ratio: float = 1.0,
        symmetric: bool = False,
    ) -> None:
        check_bits(bits)
        check_clip(clip_ratio)
        if n_channels is not None and (isinstance(n_channels, bool) or int(n_channels) < 1):
            raise QuantConfigError(f"n_channels must be a positive integer or None, got {n_channels!r}")
        self.n_channels = None if n_channels is None else int(n_channels)
        self.bits = bits
        self.clip_ratio = float(clip_ratio)
        self.symmetric = symmetric
        self.lo: torch.Tensor | None = None
        self.hi: torch.Tensor | None = None
        self.frozen = False
        self._params: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def calibrated(self) -> bool:
        return self.lo is not None

    def _check_channels(self, x: torch.Tensor) -> None:
        n = x.shape[-1] if x.dim() else 0
        if self.n_channels is not None and n != self.n_channels:
            raise QuantConfigError(
                f"expected {self.n_channels} channels on the last dim, got shape {tuple(x.shape)}"
            )
        if self.lo is not None and n != self.lo.shape[0]:
            raise QuantConfigError(f"channel count changed: {n} vs {self.lo.shape[0]} observed before")

    def observe(self, x: torch.Tensor) -> None:
        """Accumulate running per-channel min/max from a calibration tensor (..., n_channels)."""
        if self.frozen:
            raise QuantConfigError("observe() after finalize(): the static ranges are frozen")
        self._check_channels(x)
        flat = x.detach().reshape(-1, x.shape[-1]).float()
        if flat.shape[0] == 0:
            return
        if not _all_finite(flat):
            bad = (~torch.isfinite(flat)).any(dim=0).nonzero().flatten().tolist()
            raise NonFiniteInputError(
                f"static calibration input has NaN/inf in {len(bad)} channel(s) (first: {bad[:8]}); "
                "a range observed from it would be non-finite for every later input"
            )
        lo, hi = torch.aminmax(flat, dim=0)
        if self.lo is None or self.hi is None:  # set together
            self.lo, self.hi = lo, hi
        else:
            self.lo = torch.minimum(self.lo, lo.to(self.lo.device))
            self.hi = torch.maximum(self.hi, hi.to(self.hi.device))

    def merge(self, other: StaticChannelQuantizer) -> None:
        """Combine the ranges observed by another quantiser with the same settings."""
        if other.lo is None or other.hi is None:
            return
        if self.lo is None or self.hi is None:
            self.lo, self.hi = other.lo.clone(), other.hi.clone()
            return
        self.lo = torch.minimum(self.lo, other.lo.to(self.lo.device))
        self.hi = torch.maximum(self.hi, other.hi.to(self.hi.device))

    def finalize(self) -> None:
        """Freeze the calibrated ranges and precompute (Δ, z) or Δ per channel."""
        if self.lo is None or self.hi is None:
            raise NotCalibratedError("StaticChannelQuantizer.finalize() before observe() saw any data")
        if self.symmetric:
            amax = torch.maximum(self.lo.abs(), self.hi.abs()) * self.clip_ratio
            self._params = (amax, amax)
        else:
            lo = self.lo.clamp(max=0.0) * self.clip_ratio
            hi = self.hi.clamp(min=0.0) * self.clip_ratio
            self._params = (lo, hi)
        self.frozen = True

    def step(self) -> torch.Tensor:
        """The frozen per-channel step Δ_c (App. E's diagnostic), with the quantiser's zero-range guard."""
        if self._params is None:
            self.finalize()
        a, b = self._params  # type: ignore[misc]
        if self.symmetric:
            delta = _step(a, torch.zeros_like(a), (1 << (self.bits - 1)) - 1)
        else:
            delta = _step(b, a, (1 << self.bits) - 1)
        return torch.where(delta > 0, delta, torch.ones_like(delta))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Fake-quantise x (..., n_channels) with the frozen per-channel ranges."""
        if is_off(self.bits):
            return x
        if self._params is None:
            if self.lo is None:
                raise NotCalibratedError("StaticChannelQuantizer used before observe() saw any data")
            self.finalize()
        self._check_channels(x)
        w = _work(x)
        a, b = (t.to(device=w.device, dtype=w.dtype) for t in self._params)  # type: ignore[union-attr]
        win = deferred.current()
        if win is not None:
            res, flag = self._flagged(w, a, b, x.dtype)
            win.need_exact_if(flag)
            return res.to(x.dtype)
        out = _fq_sym(w, a, self.bits) if self.symmetric else _fq_asym(w, a, b, self.bits)
        if not _all_finite(w):
            out = _passthrough_nonfinite(out, w)
        res = out.to(x.dtype)
        if _overflow_risk(a if not self.symmetric else -a, b, x.dtype):
            res = self._repair_overflow(res, x)
        return res

    def _flagged(self, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The frozen-range quantiser without a host read (deferred checks): the result and a 0-d flag, true
        when the exact path may differ (a non-finite input, a range near ``dtype``'s maximum); unflagged,
        the exact path's bits (see :func:`_fq_flagged`)."""
        lim = _quarter_max(dtype)
        flag = ~torch.isfinite(w.sum()) | (b.amax() > lim)
        if self.symmetric:
            maxq = (1 << (self.bits - 1)) - 1
            delta = (a - torch.zeros_like(a)) / maxq
            delta = torch.where(delta > 0, delta, torch.ones_like(delta))
            q = torch.div(w, delta)
            q.round_()
            q.clamp_(-maxq - 1, maxq)
            return q.mul_(delta), flag
        maxq = (1 << self.bits) - 1
        flag = flag | (a.amin() < -lim)
        delta = (b - a) / maxq
        delta = torch.where(delta > 0, delta, torch.ones_like(delta))
        zero = torch.round(-a / delta)
        q = torch.div(w, delta)
        q.round_()
        q.clamp_(min=-zero, max=maxq - zero)
        return q.mul_(delta), flag

    def _repair_overflow(self, res: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Elements whose finite input came out ±inf, recomputed in float64 with the same frozen ranges and
        saturated at the dtype's maximum (the ranges are per channel, so elements are independent)."""
        bad = torch.isinf(res) & torch.isfinite(x)
        if not bool(bad.any()):
            return res
        a, b = (t.to(device=x.device, dtype=torch.float64) for t in self._params)  # type: ignore[union-attr]
        x64 = x.double()
        out64 = _fq_sym(x64, a, self.bits) if self.symmetric else _fq_asym(x64, a, b, self.bits)
        return torch.where(bad, _saturate64(out64, x64, x.dtype), res)

    quantize = __call__

"""Fake quantisers: dynamic per-token activations/KV, and the rules every quantiser shares (the static per-channel
control: static.py; weight RTN: rtn.py).

Conventions follow the rotation-PTQ baselines the paper builds on (QuaRot/SpinQuant, Sec. 4 and App. A.6):

* Asymmetric INT-b on a group g: lo = min(min g, 0)·c, hi = max(max g, 0)·c (c the clip ratio), step
  Δ = (hi − lo)/(2^b − 1), zero point z = round(−lo/Δ), q = clamp(round(x/Δ) + z, 0, 2^b − 1), x̂ = (q − z)Δ.
  The range always contains 0 (so 0 is exactly representable); unclipped values err by at most Δ/2.
* Symmetric INT-b: Δ = max|g|·c/(2^(b−1) − 1), q = clamp(round(x/Δ), −2^(b−1), 2^(b−1) − 1).
* A zero range (an all-zero group) is guarded: it reconstructs exactly, never NaN.
* bits ≥ 16 means "off": the input is returned unchanged.
* Non-finite policy (one rule for every quantiser): dynamic quantisers pass NaN/±inf entries through
  unchanged and set the range from the finite entries of the group, so a NaN never spreads to its
  neighbours; calibration (:meth:`rope_quant.quant.static.StaticChannelQuantizer.observe`) raises
  :class:`NonFiniteInputError`, since a
  non-finite range would poison a channel for every later input. Ranges near the float32 limit (±3e38)
  are computed without overflow. The fast path for finite inputs is bit-identical to the plain formulas.
* Overflow policy: finite input gives finite output in every input dtype (float16, bfloat16, float32). The
  reconstruction can exceed the group's range by up to Δ/2 (the zero point is rounded), which overflows the
  dtype near its maximum. Only groups whose range exceeds a quarter of the dtype's maximum can do so (a cheap
  test on the per-group range); when one does, the groups that came out ±inf are recomputed in float64 and
  saturated at the dtype's largest finite value. Every other output is the fast path's, bit for bit.

Computation runs in float32 for half-precision inputs and the result is cast back to the input dtype.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

import torch

from rope_quant.core.hadamard import NonFloatTensorError
from rope_quant.quant import deferred

__all__ = [
    "QuantConfigError",
    "NotCalibratedError",
    "NonFiniteInputError",
    "QuantConfig",
    "OFF_BITS",
    "is_off",
    "check_bits",
    "check_group",
    "check_clip",
    "fake_quant_per_token",
    "fake_quant",
    "quant_step",
    "selected_step",
]

OFF_BITS = 16


class QuantConfigError(ValueError):
    """Invalid quantiser settings (bits, group size, clip ratio), or a group size not dividing the dim."""


class NotCalibratedError(ValueError):
    """A static quantiser was used before it observed any calibration data."""


class NonFiniteInputError(ValueError):
    """Calibration data holds NaN or ±inf (a static range observed from it would be non-finite)."""


@dataclass(frozen=True)
class QuantConfig:
    """One quantiser's settings; bits ≥ 16 means off. group_size −1 = the whole last dim.

    The ``flat`` metadata names a field inside flat run-configuration names (``a_group``, ``k_clip``).
    """

    bits: int = 16
    group_size: int = field(default=-1, metadata={"short": "group"})
    clip_ratio: float = field(default=1.0, metadata={"short": "clip"})
    symmetric: bool = False

    def __post_init__(self) -> None:
        check_bits(self.bits)
        check_group(self.group_size)
        check_clip(self.clip_ratio)
        if not isinstance(self.symmetric, bool):
            raise QuantConfigError(f"symmetric must be a bool, got {self.symmetric!r}")

    @property
    def enabled(self) -> bool:
        return not is_off(self.bits)


def is_off(bits: int) -> bool:
    """bits ≥ 16 disables quantisation."""
    return bits >= OFF_BITS


def check_bits(bits: object, what: str = "bits", *, low: int = 1, high: int | None = None,
               error: type[Exception] = QuantConfigError) -> int:
    """THE bit-width check: an integer (not a bool) ≥ ``low`` (and ≤ ``high`` when given); ≥ 16 means off."""
    if isinstance(bits, bool) or not isinstance(bits, int) or bits < low or (high is not None and bits > high):
        bound = f">= {low}" if high is None else f"between {low} and {high}"
        raise error(f"{what} must be an integer {bound} (16 = off), got {bits!r}")
    return bits


def check_group(group: object, what: str = "group_size", *, error: type[Exception] = QuantConfigError) -> int:
    """A group size: −1 (the whole row / head) or a positive integer."""
    if isinstance(group, bool) or not isinstance(group, int) or (group != -1 and group < 1):
        raise error(f"{what} must be -1 (whole row/head) or a positive integer, got {group!r}")
    return group


def check_clip(clip: object, what: str = "clip_ratio", *, error: type[Exception] = QuantConfigError) -> float:
    """A clip ratio in (0, 1]."""
    if isinstance(clip, bool) or not isinstance(clip, numbers.Real) or not 0.0 < clip <= 1.0:
        raise error(f"{what} must lie in (0, 1], got {clip!r}")
    return float(clip)


def _grouped(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """View (..., n) as (..., n/g, g); group_size −1 → one group."""
    n = x.shape[-1]
    g = n if group_size in (-1, None) or group_size == n else group_size
    if g < 1 or n % g:
        raise QuantConfigError(f"group_size {group_size} does not divide the last dimension {n}")
    return x.reshape(*x.shape[:-1], n // g, g)


def _work(x: torch.Tensor) -> torch.Tensor:
    if not torch.is_floating_point(x):
        raise NonFloatTensorError(f"fake quantisation needs a floating-point tensor, got {x.dtype}")
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _all_finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


def _finite_or_zero(g: torch.Tensor) -> torch.Tensor:
    """g with NaN/±inf replaced by 0: the range of the finite entries (0 is always in the range)."""
    return torch.where(torch.isfinite(g), g, torch.zeros_like(g))


def _passthrough_nonfinite(out: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Put the non-finite input entries back (NaN stays NaN where, and only where, the input was NaN)."""
    return torch.where(torch.isfinite(g), out, g)


def _step(span_hi: torch.Tensor, span_lo: torch.Tensor, levels: int) -> torch.Tensor:
    """(span_hi − span_lo)/levels, recomputed as span_hi/levels − span_lo/levels where the difference
    overflows float (|x| ≈ 3e38); the common finite case is the plain formula, bit for bit."""
    delta = (span_hi - span_lo) / levels
    if not _all_finite(delta):
        delta = torch.where(torch.isfinite(delta), delta, span_hi / levels - span_lo / levels)
    return delta


def _asym_params(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(Δ, z) for an asymmetric range [lo, hi] ∋ 0; zero ranges get Δ = 1 (then x̂ = 0 = x exactly)."""
    maxq = (1 << bits) - 1
    delta = _step(hi, lo, maxq)
    delta = torch.where(delta > 0, delta, torch.ones_like(delta))
    zero = torch.round(-lo / delta)
    return delta, zero


def _asym_range(g: torch.Tensor, clip_ratio: float) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(lo, hi, finite): the clipped range ∋ 0 of each group's finite entries; ``finite`` says the whole
    input was finite (min and max propagate NaN and ±inf, so a finite min and max imply finite entries).

    Fast path: ``amin`` + ``amax`` (vectorised; ``aminmax`` over the last dim is not, ~18× slower on CPU).
    Both return the exact extreme value, so they agree with ``aminmax`` bit for bit except possibly in the
    sign of a zero extreme (a ±0 tie); any zero, NaN or ±inf extreme therefore takes the ``aminmax`` path.
    """
    lo = torch.amin(g, dim=-1, keepdim=True)
    hi = torch.amax(g, dim=-1, keepdim=True)
    finite = bool((torch.isfinite(lo) & torch.isfinite(hi) & (lo != 0) & (hi != 0)).all())
    if not finite:  # the plain path (finite is then recomputed: a zero extreme is finite)
        lo, hi = torch.aminmax(g, dim=-1, keepdim=True)
        finite = _all_finite(lo) and _all_finite(hi)
        if not finite:
            lo, hi = torch.aminmax(_finite_or_zero(g), dim=-1, keepdim=True)
    lo = lo.clamp(max=0.0)
    hi = hi.clamp(min=0.0)
    if clip_ratio != 1.0:
        lo, hi = lo * clip_ratio, hi * clip_ratio
    return lo, hi, finite


def _sym_amax(g: torch.Tensor, clip_ratio: float) -> tuple[torch.Tensor, bool]:
    """(max|g|·c, finite) per group. max|g| = max(amax, −amin) without materialising |g|; it can differ from
    ``g.abs().amax()`` only in the sign of a zero maximum (an all-zero group), where Δ is guarded to 1 anyway."""
    amax = torch.maximum(torch.amax(g, dim=-1, keepdim=True), torch.amin(g, dim=-1, keepdim=True).neg_())
    finite = _all_finite(amax)
    if not finite:
        amax = _finite_or_zero(g).abs().amax(dim=-1, keepdim=True)
    return amax * clip_ratio, finite


def _overflow_risk(lo: torch.Tensor, hi: torch.Tensor, dtype: torch.dtype) -> bool:
    """Can x̂ leave ``dtype``'s finite range? |x̂| ≤ max(|lo|, |hi|) + Δ/2 ≤ 2·max(|lo|, |hi|) for every
    bit width, so a range inside ±max/4 is safe (the test reads only the per-group bounds)."""
    if hi.numel() == 0:
        return False
    lim = _QUARTER_MAX.get(dtype)
    if lim is None:
        lim = _QUARTER_MAX.setdefault(dtype, torch.finfo(dtype).max / 4)
    return float(hi.amax()) > lim or (lo is not hi and float(lo.amin()) < -lim)


_QUARTER_MAX: dict[torch.dtype, float] = {}


def _saturate64(out64: torch.Tensor, src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float64 result clamped to ``dtype``'s finite range where the input was finite, input elsewhere."""
    lim = torch.finfo(dtype).max
    return torch.where(torch.isfinite(src), out64.clamp(-lim, lim), src).to(dtype)


def _repair_overflow(res: torch.Tensor, x: torch.Tensor, group_size: int, fq64) -> torch.Tensor:
    """Recompute in float64 (``fq64``: grouped float64 rows → x̂) the groups whose finite inputs came out
    ±inf in ``res``, saturated at the dtype's maximum; every other group keeps its bits."""
    rg = _grouped(res, group_size)
    xg = _grouped(x, group_size)
    bad = (torch.isinf(rg) & torch.isfinite(xg)).any(dim=-1)
    if not bool(bad.any()):
        return res
    rg = rg.clone()
    sub = xg[bad].double()
    rg[bad] = _saturate64(fq64(sub), sub, x.dtype)
    return rg.reshape(x.shape)


def _clamp_between(q: torch.Tensor, low: torch.Tensor, high: torch.Tensor, zero_sign_free: bool) -> torch.Tensor:
    """q.clamp_(low, high) in place, bit for bit.

    ``clamp_`` with two broadcast tensor bounds runs ATen's scalar loop (std::min(std::max(q, low), high));
    ``clamp_min_`` then ``clamp_max_`` run the vectorised maximum/minimum, which equal it on every value
    except a ±0 tie (the vector max/min returns the bound's zero, the scalar one q's). With
    ``zero_sign_free`` (no bound is ±0) no such tie exists and the vectorised pair is used.
    """
    if zero_sign_free:
        return q.clamp_min_(low).clamp_max_(high)
    return q.clamp_(min=low, max=high)


def _rows_broadcast(q: torch.Tensor, delta: torch.Tensor) -> bool:
    """True when one (Δ, z) per group broadcasts along a contiguous group axis of more than one element: there
    the plain two-bound ``clamp_`` runs ATen's scalar loop, whose every tie keeps q (its sign of zero too)."""
    return delta.shape[-1] == 1 < q.shape[-1] and q.stride(-1) == 1


def _round_clamp_rows(v: torch.Tensor, zero: torch.Tensor, maxq: int, lower: bool) -> torch.Tensor:
    """clamp(round(v), −z, maxq − z) in place, bit for bit the scalar two-bound clamp, in vectorised passes.

    v is clamped BEFORE rounding, to bounds a quarter outside the integer ones (maxq − z + ¼, −z − ¼): a value
    beyond one rounds to the integer bound (round(+¼) = +0, round(−¼) = −0, as the plain clamp returns its
    bounds maxq − maxq = +0 and −0), a value inside is left to round as before, and no bound is ±0, so no tie
    can choose a sign of zero. ``lower=False`` skips the lower clamp where no value can be below −z (every
    finite x ≥ lo, the unclipped dynamic range: x/Δ ≥ lo/Δ and round(lo/Δ) = −z)."""
    v.clamp_max_((maxq + 0.25) - zero)
    if lower:
        v.clamp_min_(-0.25 - zero)
    return v.round_()


def _fq_asym(g: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int, lower: bool = True) -> torch.Tensor:
    """x̂ = (clamp(round(x/Δ) + z, 0, 2^b − 1) − z)·Δ, computed as clamp(round(x/Δ), −z, 2^b − 1 − z)·Δ
    (the same integers) with in-place ops: one allocation, four passes (per-token groups: see
    :func:`_round_clamp_rows`; ``lower=False`` only where every finite x ≥ lo)."""
    maxq = (1 << bits) - 1
    delta, zero = _asym_params(lo, hi, bits)
    q = torch.div(g, delta)
    if _rows_broadcast(q, delta):
        return _round_clamp_rows(q, zero, maxq, lower).mul_(delta)
    q.round_()
    zero_sign_free = bool(((zero != 0) & (zero != maxq)).all())
    _clamp_between(q, -zero, maxq - zero, zero_sign_free)
    return q.mul_(delta)


def _fq_sym(g: torch.Tensor, amax: torch.Tensor, bits: int) -> torch.Tensor:
    maxq = (1 << (bits - 1)) - 1
    if maxq < 1:
        raise QuantConfigError("symmetric quantisation needs bits ≥ 2")
    delta = _step(amax, torch.zeros_like(amax), maxq)
    delta = torch.where(delta > 0, delta, torch.ones_like(delta))
    q = torch.div(g, delta)
    q.round_()
    q.clamp_(-maxq - 1, maxq)
    return q.mul_(delta)


def fake_quant_per_token(
    x: torch.Tensor,
    bits: int,
    group_size: int = -1,
    clip_ratio: float = 1.0,
    *,
    symmetric: bool = False,
) -> torch.Tensor:
    """Dynamic per-token (per-group) INT-b fake quantisation over the last dim; returns x̂ in x's dtype.

    Asymmetric by default (activations into every linear except lm_head, and K/V, Sec. 4 / App. A.6).
    """
    check_bits(bits)
    if is_off(bits):
        return x
    check_clip(clip_ratio)
    w = _work(x)
    g = _grouped(w, group_size)
    win = deferred.current()
    if win is not None:
        out, flag = _fq_flagged(g, bits, clip_ratio, symmetric, x.dtype)
        win.need_exact_if(flag)
        return out.reshape(x.shape).to(x.dtype)
    if symmetric:
        amax, finite = _sym_amax(g, clip_ratio)
        out = _fq_sym(g, amax, bits)
        risky = _overflow_risk(amax, amax, x.dtype)  # amax ≥ 0: one bound suffices
    else:
        lo, hi, finite = _asym_range(g, clip_ratio)
        out = _fq_asym(g, lo, hi, bits, lower=clip_ratio != 1.0)
        risky = _overflow_risk(lo, hi, x.dtype)
    if not finite:
        out = _passthrough_nonfinite(out, g)
    res = out.reshape(x.shape).to(x.dtype)
    if risky:
        res = _repair_overflow(res, x, group_size, lambda s: _fq_group64(s, bits, clip_ratio, symmetric))
    return res


def _quarter_max(dtype: torch.dtype) -> float:
    lim = _QUARTER_MAX.get(dtype)
    return _QUARTER_MAX.setdefault(dtype, torch.finfo(dtype).max / 4) if lim is None else lim


def _fq_flagged(g: torch.Tensor, bits: int, clip_ratio: float, symmetric: bool,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The dynamic quantiser without a host read (deferred checks, :mod:`rope_quant.quant.deferred`): the
    result and a 0-d device flag, true when a group's range is non-finite or beyond a quarter of ``dtype``'s
    maximum (then the exact path may differ: the window is recomputed). Unflagged, the result equals the
    exact path's bit for bit: ``amin``/``amax`` give its range up to the sign of a zero extreme, which
    reaches only the sign of a ±0 bound, and the clamp is the exact path's: per-token groups clamp before
    rounding to bounds that are never ±0 (:func:`_round_clamp_rows`), other layouts use the plain formula's
    single ``clamp_`` with both bounds."""
    lo = torch.amin(g, dim=-1, keepdim=True)
    hi = torch.amax(g, dim=-1, keepdim=True)
    lim = _quarter_max(dtype)
    flag = ~((hi <= lim) & (lo >= -lim)).all()  # NaN fails both comparisons
    if symmetric:
        amax = torch.maximum(hi, lo.neg()) * clip_ratio
        maxq = (1 << (bits - 1)) - 1
        if maxq < 1:
            raise QuantConfigError("symmetric quantisation needs bits ≥ 2")
        delta = (amax - torch.zeros_like(amax)) / maxq
        delta = torch.where(delta > 0, delta, torch.ones_like(delta))
        q = torch.div(g, delta)
        q.round_()
        q.clamp_(-maxq - 1, maxq)  # bounds ≠ 0: no sign-of-zero tie
        return q.mul_(delta), flag
    else:
        lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)
        if clip_ratio != 1.0:
            lo, hi = lo * clip_ratio, hi * clip_ratio
        maxq = (1 << bits) - 1
        delta = (hi - lo) / maxq
        delta = torch.where(delta > 0, delta, torch.ones_like(delta))
        zero = torch.round(-lo / delta)
        q = torch.div(g, delta)
        if _rows_broadcast(q, delta):
            return _round_clamp_rows(q, zero, maxq, lower=clip_ratio != 1.0).mul_(delta), flag
        q.round_()
        q.clamp_(min=-zero, max=maxq - zero)  # the plain formula's one clamp: no ±0-tie question to ask
    return q.mul_(delta), flag


def _fq_group64(g: torch.Tensor, bits: int, clip_ratio: float, symmetric: bool) -> torch.Tensor:
    """The dynamic quantiser on float64 groups (range, Δ and z in float64: no overflow at any input dtype)."""
    if symmetric:
        return _fq_sym(g, _sym_amax(g, clip_ratio)[0], bits)
    lo, hi, _ = _asym_range(g, clip_ratio)
    return _fq_asym(g, lo, hi, bits, lower=clip_ratio != 1.0)


def fake_quant(x: torch.Tensor, cfg: QuantConfig) -> torch.Tensor:
    """Apply a dynamic per-token quantiser described by a :class:`QuantConfig`."""
    return fake_quant_per_token(x, cfg.bits, cfg.group_size, cfg.clip_ratio, symmetric=cfg.symmetric)


def quant_step(
    x: torch.Tensor, bits: int, group_size: int = -1, clip_ratio: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token/group step Δ and range (hi − lo) of the asymmetric quantiser, shape (..., n_groups).

    The range is the quantiser's (it contains 0 and is scaled by the clip ratio); Δ = range/(2^b − 1).
    """
    check_bits(bits)
    check_clip(clip_ratio)
    g = _grouped(_work(x), group_size)
    lo, hi, _ = _asym_range(g, clip_ratio)
    levels = (1 << bits) - 1
    return _step(hi, lo, levels).squeeze(-1), (hi - lo).squeeze(-1)


def selected_step(x: torch.Tensor, cfg: QuantConfig) -> torch.Tensor:
    """The step Δ the dynamic quantiser :func:`fake_quant` selects for each token/group of x, shape
    (..., n_groups), float32 (App. E's diagnostic): the same range, clip and zero-range guard (Δ = 1) as
    the quantiser itself; asymmetric or symmetric as ``cfg`` says."""
    g = _grouped(_work(x), cfg.group_size)
    win = deferred.current()
    if win is not None:  # the same Δ without a host read (a zero extreme's sign does not reach Δ's value)
        lo, hi = torch.amin(g, dim=-1, keepdim=True), torch.amax(g, dim=-1, keepdim=True)
        if cfg.symmetric:
            span = torch.maximum(hi, lo.neg()) * cfg.clip_ratio
            delta = (span - torch.zeros_like(span)) / ((1 << (cfg.bits - 1)) - 1)
        else:
            lo, hi = lo.clamp(max=0.0) * cfg.clip_ratio, hi.clamp(min=0.0) * cfg.clip_ratio
            delta = (hi - lo) / ((1 << cfg.bits) - 1)
        win.need_exact_if(~torch.isfinite(delta).all())
        return torch.where(delta > 0, delta, torch.ones_like(delta)).squeeze(-1)
    if cfg.symmetric:
        amax, _ = _sym_amax(g, cfg.clip_ratio)
        delta = _step(amax, torch.zeros_like(amax), (1 << (cfg.bits - 1)) - 1)
    else:
        lo, hi, _ = _asym_range(g, cfg.clip_ratio)
        delta = _step(hi, lo, (1 << cfg.bits) - 1)
    return torch.where(delta > 0, delta, torch.ones_like(delta)).squeeze(-1)

"""GPTQ weight quantisation (Frantar et al. 2022), written from the algorithm.

For one linear layer ``y = W x`` with calibration inputs ``X`` (columns = tokens), GPTQ quantises the
columns of ``W`` one at a time and spreads each column's rounding error over the not-yet-quantised
columns, using the inverse of the layer Hessian ``H = 2 X X^T / n`` (the Hessian of ``||W X - Q X||^2``):

1. damp ``H += percdamp * mean(diag H) * I`` (dead inputs, ``H_jj = 0``, get ``H_jj = 1`` and ``W_:j = 0``);
2. optionally permute columns by decreasing ``diag H`` (``act_order``);
3. ``U = chol(H^{-1})^T`` (upper Cholesky factor of the inverse Hessian);
4. for each block of ``blocksize`` columns, for each column ``j``: ``q_j = quant(w_j)``,
   ``e_j = (w_j - q_j) / U_jj``, ``w_{j+1:} -= e_j U_{j, j+1:}`` inside the block; after the block, the
   block's errors update all later columns in one matmul (lazy batch update).

The quantiser is symmetric INT-b per output channel (or per group of ``group_size`` input columns), with
an optional clip search: for every output channel (group) the clip ratio over a grid minimising GPTQ's proxy
loss with the Hessian's diagonal, ``sum_j H_jj (w_j - q_j)^2``, or the weights' own error ``||w - q(w)||^2``
(QuaRot/DartQuant ``w_clip``); by default the first without R1, the second with it (:class:`ScaleObjective`).
Without rotations the weights' own error clips outlier weights that the layer's inputs need
(docs/protocol.md, "The weight scale search").

:func:`quantize_model_gptq` runs GPTQ layer by layer through a decoder: the inputs of layer 0 are captured
by a pre-hook that stops the forward, and every quantised layer is run to produce the next layer's inputs.
Inside a layer, linears are quantised in execution groups (``q/k/v``, ``o``, ``gate/up``, ``down``:
"true sequential"), so each group's Hessian comes from inputs that already pass through the quantised
earlier groups. The Hessian of each linear is accumulated by a forward pre-hook registered *after* any
hooks already on that linear: it therefore sees exactly what the linear sees, including the online R4
Hadamard on ``down_proj`` and the activation fake-quantiser when the pipeline has installed them (our
choice, recorded in the weight cache key). The attention's K/V quantisers and R3 are not active during
GPTQ: they depend on the R3 choice, which must not influence the weights (paired design).

Linears that share one Hessian (q/k/v, gate/up) are solved together: their rows are stacked under one
factorisation and one column loop (rows are independent given H). Nothing inside the column loop reads the
device from the host; a layer's group forwards, factorisations and error estimates read it a fixed number of
times per layer (tests/numerics/test_host_syncs.py).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch
from torch import nn

from rope_quant.model import arch, offload
from rope_quant.quant import deferred
from rope_quant.quant.packing import CODES_ATTR, WeightCodes, negzero_flag
from rope_quant.quant.quantizers import check_bits

log = logging.getLogger(__name__)

__all__ = [
    "GPTQConfig",
    "ScaleObjective",
    "resolve_objective",
    "GPTQError",
    "HessianAccumulator",
    "LayerGroups",
    "weight_scales",
    "quantize_with_scales",
    "rtn_quantize",
    "gptq_quantize",
    "gptq_quantize_shared",
    "quantize_model_gptq",
    "quantize_model_rtn",
    "GPTQ_CALLS",
]

#: Stop a decoder layer's forward once every linear of the group being quantised has seen its input (the
#: Hessians need nothing later; the weights are bit-identical either way, tests/numerics/test_gptq_speed.py).
EARLY_STOP = True
#: Linears of a group that read the very same input tensor in every window (q/k/v, gate/up: one tensor, also
#: through the activation quantiser's shared-input memo) share one Hessian instead of accumulating copies of
#: it (the same additions in the same order: bit-identical, tests/numerics/test_gptq_speed.py).
SHARE_HESSIANS = True

#: Linears that share a Hessian run ONE GPTQ solve over their stacked rows (one factorisation, one column loop;
#: rows are independent given H, so each equals its own solve up to float rounding, test_gptq_fast.py).
STACK_SHARED = True

#: Number of per-linear GPTQ solves run in this process (the weight-cache test checks it does not grow).
GPTQ_CALLS = {"linear": 0, "model": 0}


class GPTQError(ValueError):
    """Bad GPTQ settings or a Hessian that cannot be factorised."""


class ScaleObjective(StrEnum):
    """What the per-row (per-group) scale search minimises.

    ``weight``: the weights' own error ``sum_j |w_j - q_j|^p``. ``hessian_diag``: GPTQ's proxy loss
    ``(w - q) H (w - q)^T`` (Frantar et al. 2022, Eq. 1-2) with ``H`` replaced by its diagonal,
    ``sum_j H_jj |w_j - q_j|^p``: the exact per-row proxy costs one (in x in) product per candidate ratio
    (81 ratios x every linear), the diagonal one the same as ``weight``. ``auto`` (the default):
    ``weight`` on a model whose residual stream is rotated (R1 applied, ``model.rq_rotation.r1`` not
    ``identity``), ``hessian_diag`` otherwise, and for a bare matrix (:func:`gptq_quantize`). Measured
    (docs/protocol.md): the proxy wins by 4.8 perplexity without rotations and loses up to 0.6 at 3 bits with
    them. RTN has no Hessian and always uses ``weight``.
    """

    WEIGHT = "weight"
    HESSIAN_DIAG = "hessian_diag"
    AUTO = "auto"


@dataclass(frozen=True)
class GPTQConfig:
    """GPTQ settings (Frantar et al. 2022, Alg. 1; QuaRot/DartQuant defaults).

    ``group_size=-1``: one scale per output channel. ``mse``: clip-ratio grid search per channel/group.
    ``act_order``: quantise columns by decreasing Hessian diagonal (groups then use static scales computed
    on the original contiguous column groups). ``true_sequential``: quantise a layer's linears in
    execution order groups. ``grid``/``max_shrink``: the MSE search grid ``1, 1 - 1/grid, ...,
    1 - max_shrink``. ``p_norm``: the exponent p of the search's error ``sum |w - q|^p``; ``objective``:
    the weights' own error or GPTQ's diagonal proxy (:class:`ScaleObjective`). ``full_range``: the unclipped
    scale is ``max|w| / (2^(b-1) - 1/2)`` instead of ``max|w| / (2^(b-1) - 1)``: the grid's 2^b codes span
    the row (``+max|w|`` half a step above ``2^(b-1) - 1``, ``-max|w|`` at the tie with ``-2^(b-1)``), a step
    1 - 1/(2^b - 1) as wide (llm-compressor's symmetric scale). Fields
    marked ``rtn`` in their metadata also shape the RTN baseline's scales (:func:`rtn_quantize`); the others
    matter to GPTQ only.
    """

    percdamp: float = 0.01
    blocksize: int = 128
    act_order: bool = True
    group_size: int = field(default=-1, metadata={"rtn": True})
    mse: bool = field(default=True, metadata={"rtn": True})
    true_sequential: bool = True
    grid: int = field(default=100, metadata={"rtn": True})
    max_shrink: float = field(default=0.8, metadata={"rtn": True})
    p_norm: float = field(default=2.0, metadata={"rtn": True})
    objective: ScaleObjective = ScaleObjective.AUTO
    full_range: bool = field(default=False, metadata={"rtn": True})
    #: Hessians and the column loop in float64 (a robustness probe of GPTQ's floating-point order).
    float64: bool = False
    #: Hessian products on bfloat16-rounded inputs with float32 accumulation (tensor cores on a GPU). Off
    #: unless :func:`rope_quant.quant.hessian_check.validate_fast_hessian` passes on the real shapes.
    hessian_bf16: bool = False

    @property
    def dtype(self) -> torch.dtype:
        """The precision of the Hessians and the GPTQ loop."""
        return torch.float64 if self.float64 else torch.float32

    def __post_init__(self) -> None:
        if not (0.0 <= self.percdamp < 1.0):
            raise GPTQError(f"percdamp must be in [0, 1), got {self.percdamp}")
        if self.blocksize < 1:
            raise GPTQError(f"blocksize must be positive, got {self.blocksize}")
        if self.group_size != -1 and self.group_size < 1:
            raise GPTQError(f"group_size must be -1 or positive, got {self.group_size}")
        if self.grid < 1 or not (0.0 <= self.max_shrink < 1.0):
            raise GPTQError(f"bad MSE grid: grid={self.grid}, max_shrink={self.max_shrink}")
        p = self.p_norm
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (1.0 <= p < math.inf):
            raise GPTQError(f"p_norm must be a finite number >= 1, got {self.p_norm!r}")
        try:
            object.__setattr__(self, "objective", ScaleObjective(self.objective))
        except ValueError:
            raise GPTQError(f"objective must be one of {tuple(o.value for o in ScaleObjective)}, "
                            f"got {self.objective!r}") from None
        if not isinstance(self.full_range, bool):
            raise GPTQError(f"full_range must be a bool, got {self.full_range!r}")


def _check_bits(bits: int) -> int:
    return check_bits(bits, "weight bits", low=2, error=GPTQError)


# ----------------------------------------------------------------------------- the quantiser


def _qmax(bits: int) -> int:
    return 2 ** (bits - 1) - 1


def quantize_with_scales(w: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """Symmetric INT-b fake quantisation ``s * clamp(round(w / s), -2^(b-1), 2^(b-1) - 1)``.

    ``scale`` broadcasts against ``w`` (e.g. ``(out, 1)`` for a column ``(out, 1)`` or a whole matrix).
    """
    return _int_codes(w, scale, bits) * scale


def _int_codes(w: torch.Tensor, scale: torch.Tensor, bits: int, qlow: int | None = None) -> torch.Tensor:
    """The integer codes ``clamp(round(w / s), -2^(b-1), 2^(b-1) - 1)`` (as floats) of :func:`quantize_with_scales`
    (``qlow``: another lowest code, ``-qmax`` for the symmetric grid of rows near the dtype's maximum)."""
    qmax = _qmax(bits)
    return torch.clamp(torch.round(w / scale), -qmax - 1 if qlow is None else qlow, qmax)


def weight_scales(w: torch.Tensor, bits: int, mse: bool = True, clip_ratio: float = 1.0,
                  grid: int = 100, max_shrink: float = 0.8, norm: float = 2.0,
                  chunk_rows: int = 4096, qlow: int | None = None, full_range: bool = False,
                  col_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row symmetric scales (rows, 1) for ``w`` (rows = output channels, or channel x group).

    Without ``mse``: ``s = clip_ratio * max|w| / d`` with ``d = 2^(b-1) - 1`` (``full_range``:
    ``d = 2^(b-1) - 1/2``, which spends the code ``-2^(b-1)``). With ``mse``: for each row, the ratio
    ``r`` in ``{1, 1 - 1/grid, ..., 1 - max_shrink}`` (times that scale) minimising
    ``sum_j c_j |w_j - q_r(w_j)|^norm``, with ``c_j = col_weight[j]`` (GPTQ's Hessian diagonal,
    :class:`ScaleObjective`) or 1. Every returned scale is therefore at least ``(1 - max_shrink)`` times the
    unsearched one. The search runs on ``x = w / max|w|`` (the error of a row scales by a per-row constant,
    so the argmin is unchanged) with in-place scalar ops, ``chunk_rows`` rows at a time; ties keep the
    larger ratio. ``qlow`` (default ``-2^(b-1)``) is the lowest code the search may use.
    """
    _check_bits(bits)
    if w.dim() != 2 or w.shape[1] == 0:
        raise GPTQError(f"weight_scales needs a 2-D weight with at least one column, got shape {tuple(w.shape)}")
    if col_weight is not None and col_weight.shape != (w.shape[1],):
        raise GPTQError(f"col_weight must have shape ({w.shape[1]},), got {tuple(col_weight.shape)}")
    w = w.float()
    qmax = _qmax(bits)
    qmin = -qmax - 1 if qlow is None else qlow
    denom = qmax + 0.5 if full_range else qmax
    amax = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-8) * clip_ratio
    if not mse:
        return amax / denom
    cw = None if col_weight is None else col_weight.to(device=w.device, dtype=torch.float32).clamp_min(0.0)
    ratios = [1.0 - i / grid for i in range(int(max_shrink * grid) + 1)]
    best_ratio = torch.ones_like(amax)
    for r0 in range(0, w.shape[0], chunk_rows):
        x = w[r0:r0 + chunk_rows] / amax[r0:r0 + chunk_rows]  # |x| <= 1 / clip_ratio
        buf = torch.empty_like(x)
        best_err = torch.full((x.shape[0],), float("inf"), device=x.device)
        best = best_ratio[r0:r0 + chunk_rows, 0]
        for r in ratios:
            step = r / denom
            torch.mul(x, 1.0 / step, out=buf)
            buf.round_().clamp_(qmin, qmax).mul_(step).sub_(x)
            if cw is None:
                err = torch.linalg.vector_norm(buf, ord=norm, dim=1)
            else:  # sum_j c_j |e_j|^p (the p-th power: the same argmin as its p-th root)
                err = (buf.abs_().pow_(norm) if norm != 2.0 else buf.square_()) @ cw
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best.masked_fill_(better, r)
    return amax * best_ratio / denom


def _group_scales(w: torch.Tensor, bits: int, group_size: int, mse: bool, clip_ratio: float,
                  grid: int, max_shrink: float, qlow: int | None = None, norm: float = 2.0,
                  full_range: bool = False, col_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Scales of shape (out, n_groups) for contiguous column groups (``group_size=-1``: one group);
    ``col_weight`` (in,): the search's per-column weights (:func:`weight_scales`)."""
    out_f, in_f = w.shape
    gs = in_f if group_size == -1 else group_size
    n_groups = math.ceil(in_f / gs)
    scales = torch.empty(out_f, n_groups, dtype=torch.float32, device=w.device)
    for g in range(n_groups):
        cols = w[:, g * gs:(g + 1) * gs]
        cw = None if col_weight is None else col_weight[g * gs:(g + 1) * gs]
        scales[:, g] = weight_scales(cols, bits, mse, clip_ratio, grid, max_shrink, norm=norm, qlow=qlow,
                                     full_range=full_range, col_weight=cw)[:, 0]
    return scales


def rtn_quantize(w: torch.Tensor, bits: int, group_size: int = -1, mse: bool = True,
                 clip_ratio: float = 1.0, grid: int = 100, max_shrink: float = 0.8, norm: float = 2.0,
                 full_range: bool = False) -> torch.Tensor:
    """Round-to-nearest symmetric INT-b with the same scales as GPTQ (the RTN baseline).

    Non-finite entries follow the quantisers' one policy (:mod:`rope_quant.quant.quantizers`): they pass
    through unchanged and the scales come from the finite entries; finite weights take the plain path.
    Finite weights never overflow: a row whose codes times scale leave the weight dtype's finite range (code
    −2^(b−1) reaches 2^(b−1)/(2^(b−1)−1)·max|w|) is requantised on the symmetric grid ±(2^(b−1)−1), with
    the MSE search over that grid; every other row keeps its bits. A weight with no columns is refused.
    """
    return _rtn(w, bits, group_size, mse, clip_ratio, grid, max_shrink, norm, full_range)[0]


def _rtn(w: torch.Tensor, bits: int, group_size: int, mse: bool, clip_ratio: float, grid: int,
         max_shrink: float, norm: float = 2.0,
         full_range: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`rtn_quantize` with its integer codes and scales: (weight, codes, scales (out, n_groups))."""
    _check_bits(bits)
    if w.dim() != 2 or w.shape[1] == 0 or not torch.is_floating_point(w):
        raise GPTQError(f"RTN needs a 2-D floating-point weight with at least one column, got shape "
                        f"{tuple(w.shape)} ({w.dtype})")
    w32 = w.float()
    finite = bool(torch.isfinite(w32).all())
    src = w32 if finite else torch.where(torch.isfinite(w32), w32, torch.zeros_like(w32))
    in_f = w.shape[1]
    gs = in_f if group_size == -1 else group_size
    scales = _group_scales(src, bits, group_size, mse, clip_ratio, grid, max_shrink, norm=norm,
                           full_range=full_range)
    col_scale = scales.repeat_interleave(gs, dim=1)[:, :in_f]
    codes = _int_codes(src, col_scale, bits)
    out = codes * col_scale
    lim = torch.finfo(w.dtype).max
    if scales.numel() and float(scales.amax()) * (_qmax(bits) + 1) > lim / 2:
        bad = (~torch.isfinite(out.to(w.dtype)) & torch.isfinite(w32)).any(dim=1)
        if bool(bad.any()):
            _symmetric_grid_rows(src, bad, scales, codes, out, bits, group_size, mse, clip_ratio, grid,
                                 max_shrink, w.dtype, norm)
    if not finite:
        out = torch.where(torch.isfinite(w32), out, w32)
    return out.to(w.dtype), codes, scales


def _symmetric_grid_rows(src: torch.Tensor, bad: torch.Tensor, scales: torch.Tensor, codes: torch.Tensor,
                         out: torch.Tensor, bits: int, group_size: int, mse: bool, clip_ratio: float, grid: int,
                         max_shrink: float, dtype: torch.dtype, norm: float = 2.0) -> None:
    """Requantise the rows ``bad`` (their codes times scale overflow ``dtype``) on the symmetric grid
    ±qmax, in place: |code·s| ≤ qmax·s ≤ max|w|; a scale whose product still rounds past the dtype's maximum
    is stepped down one ulp. Codes and scales stay consistent (the packed weights reproduce ``out``)."""
    qmax = _qmax(bits)
    lim = torch.finfo(dtype).max
    sub = src[bad]
    s = _group_scales(sub, bits, group_size, mse, clip_ratio, grid, max_shrink, qlow=-qmax, norm=norm)
    for _ in range(4):
        over = (s.double() * qmax).to(dtype).isinf() | (s * qmax).isinf()
        if not bool(over.any()):
            break
        s = torch.where(over, torch.nextafter(s, torch.zeros_like(s)), s)
    in_f = src.shape[1]
    gs = in_f if group_size == -1 else group_size
    col = s.repeat_interleave(gs, dim=1)[:, :in_f]
    c = _int_codes(sub, col, bits, qlow=-qmax)
    scales[bad], codes[bad], out[bad] = s, c, (c * col).clamp(-lim, lim)


# ----------------------------------------------------------------------------- Hessian


@dataclass
class HessianAccumulator:
    """Running ``H = 2/n sum_t x_t x_t^T`` over the rows ``x_t`` of a linear's inputs (float32).

    ``bf16_inputs``: the product takes the inputs rounded to bfloat16 and accumulates in float32 (tensor
    cores on a GPU, ``torch.mm(..., out_dtype=torch.float32)``; an exact float32 product of the rounded
    inputs elsewhere). Off by default: use it only where
    :func:`rope_quant.quant.hessian_check.validate_fast_hessian` passes on the real shapes.
    """

    n_features: int
    device: torch.device | str = "cpu"
    dtype: torch.dtype = torch.float32
    bf16_inputs: bool = False
    H: torch.Tensor = field(init=False)
    n_samples: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.H = torch.zeros(self.n_features, self.n_features, dtype=self.dtype, device=self.device)

    def add(self, x: torch.Tensor) -> None:
        """Accumulate a batch of inputs of shape (..., n_features)."""
        if x.shape[-1] != self.n_features:
            raise GPTQError(f"input has {x.shape[-1]} features, Hessian expects {self.n_features}")
        x = x.detach().reshape(-1, x.shape[-1])
        m = x.shape[0]
        if m == 0:
            return
        total = self.n_samples + m
        self.H.mul_(self.n_samples / total)
        if self.bf16_inputs:
            self.H.add_(_bf16_gram(x.to(device=self.H.device)), alpha=2.0 / total)
        else:
            x = x.to(device=self.H.device, dtype=self.dtype) * math.sqrt(2.0 / total)
            self.H.addmm_(x.T, x)
        self.n_samples = total


def _bf16_gram(x: torch.Tensor) -> torch.Tensor:
    """``x^T x`` of the bfloat16-rounded rows, accumulated in float32."""
    xb = x.to(torch.bfloat16)
    if xb.is_cuda:
        try:
            return torch.mm(xb.T, xb, out_dtype=torch.float32)
        except (TypeError, RuntimeError):  # a torch without out_dtype: the float32 product below
            pass
    xf = xb.float()
    return xf.T @ xf


# ----------------------------------------------------------------------------- GPTQ for one matrix


def _inverse_hessian_factor(H: torch.Tensor, percdamp: float, max_tries: int = 6) -> torch.Tensor:
    """Upper Cholesky factor of ``(H + damp I)^{-1}``, raising the damping tenfold if H is not PD.

    The first attempt reads its outcome in one host transfer (the diagonal mean and both factorisations'
    status together): one synchronisation per Hessian on an accelerator, not three.
    """
    diag_mean_t = torch.mean(torch.diagonal(H))
    # float64 product, then H's dtype: the value the host float gave before (percdamp * mean, rounded once)
    damp_t = (diag_mean_t.double() * percdamp).to(H.dtype) if percdamp > 0 else torch.zeros_like(diag_mean_t)
    Hd = H.clone()
    Hd.diagonal().add_(damp_t)
    L, info = torch.linalg.cholesky_ex(Hd)
    U, info2 = torch.linalg.cholesky_ex(torch.cholesky_inverse(L), upper=True)
    diag_mean, first, second = torch.stack([diag_mean_t.double(), info.double(), info2.double()]).tolist()
    if not math.isfinite(diag_mean):
        raise GPTQError("Hessian contains NaN or infinite values (did the calibration inputs overflow?)")
    if first == 0 and second == 0:
        return U
    damp = percdamp * diag_mean if percdamp > 0 else 0.0
    idx = torch.arange(H.shape[0], device=H.device)
    for attempt in range(1, max_tries):
        damp = max(damp, 1e-8 * max(diag_mean, 1e-8)) * 10.0
        Hd = H.clone()
        Hd[idx, idx] += damp
        L, info = torch.linalg.cholesky_ex(Hd)
        if int(info) == 0:
            Hinv = torch.cholesky_inverse(L)
            U, info2 = torch.linalg.cholesky_ex(Hinv, upper=True)
            if int(info2) == 0:
                log.warning("GPTQ: Hessian needed damping %.3g (percdamp x %d)", damp, 10**attempt)
                return U
    raise GPTQError(
        f"Hessian is not positive definite even with damping {damp:.3g}; "
        "increase percdamp or use more calibration data"
    )


def gptq_quantize(W: torch.Tensor, H: torch.Tensor, bits: int, cfg: GPTQConfig = GPTQConfig(),
                  clip_ratio: float = 1.0) -> torch.Tensor:
    """GPTQ (Frantar et al. 2022, Alg. 1) of ``W`` (out, in) given the input Hessian ``H`` (in, in).

    Returns the dequantised weight (same dtype/device as ``W``).
    """
    return _gptq(W, H, bits, cfg, clip_ratio)[0]


def gptq_quantize_shared(Ws: Sequence[torch.Tensor], H: torch.Tensor, bits: int, cfg: GPTQConfig = GPTQConfig(),
                         clip_ratio: float = 1.0) -> list[torch.Tensor]:
    """GPTQ of several weights that share one input Hessian (q/k/v, gate/up): one factorisation and one
    column loop over their stacked rows. GPTQ treats rows independently given ``H``, so each result equals
    :func:`gptq_quantize` of that weight alone up to floating-point rounding (tests/numerics/test_gptq_fast.py)."""
    res = _gptq_stacked(list(Ws), H, bits, cfg, clip_ratio)
    if not bool(torch.stack([r[3] for r in res]).all()):
        raise GPTQError("GPTQ produced non-finite weights")
    return [r[0] for r in res]


def _gptq_stacked(Ws: list[torch.Tensor], H: torch.Tensor, bits: int, cfg: GPTQConfig, clip_ratio: float
                  ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """:func:`_gptq` of the row-stacked ``Ws`` split back per weight (one solve for all)."""
    if len(Ws) == 1:
        return [_gptq_flagged(Ws[0], H, bits, cfg, clip_ratio)]
    if len({(W.ndim, W.shape[1:], W.dtype, W.device) for W in Ws}) != 1:
        raise GPTQError(f"stacked GPTQ needs weights of one width, dtype and device, got "
                        f"{[(tuple(W.shape), W.dtype) for W in Ws]}")
    rows = [W.shape[0] for W in Ws]
    Q, C, S, _ = _gptq_flagged(torch.cat([W.detach() for W in Ws]), H, bits, cfg, clip_ratio)
    return [(q, c, s, torch.isfinite(q).all())
            for q, c, s in zip(Q.split(rows), C.split(rows), S.split(rows), strict=True)]


def _gptq(W: torch.Tensor, H: torch.Tensor, bits: int, cfg: GPTQConfig,
          clip_ratio: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`gptq_quantize` with its integer codes (out, in) and scales (out, n_groups), in column order."""
    Q, C, S, finite = _gptq_flagged(W, H, bits, cfg, clip_ratio)
    if not bool(finite):
        raise GPTQError("GPTQ produced non-finite weights")
    return Q, C, S


def _gptq_flagged(W: torch.Tensor, H: torch.Tensor, bits: int, cfg: GPTQConfig,
                  clip_ratio: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_gptq` with a 0-d device flag
    "every weight is finite" (read by the caller: no host synchronisation here besides the factorisation's).

    The column loop runs on the transposed weight (a column of W is a contiguous row), with the per-column
    scales gathered before the loop: ~7 kernels per column and no host read inside the loop.
    """
    _check_bits(bits)
    if W.ndim != 2 or H.shape != (W.shape[1], W.shape[1]):
        raise GPTQError(f"shape mismatch: W {tuple(W.shape)}, H {tuple(H.shape)}")
    GPTQ_CALLS["linear"] += 1
    out_f, in_f = W.shape
    Wf = W.detach().clone().to(cfg.dtype)
    H = H.detach().clone().to(device=Wf.device, dtype=cfg.dtype)

    dead = torch.diagonal(H) == 0  # masked ops, not boolean indexing: no host read of the dead count
    H.diagonal().masked_fill_(dead, 1.0)
    Wf.masked_fill_(dead[None, :], 0.0)

    gs = in_f if cfg.group_size == -1 else cfg.group_size
    n_groups = math.ceil(in_f / gs)
    # The search's per-column weights: GPTQ's proxy loss with H's diagonal (ScaleObjective), or none.
    hdiag = torch.diag(H).float() if cfg.objective != ScaleObjective.WEIGHT else None
    grp = lambda W_: _group_scales(W_, bits, cfg.group_size, cfg.mse, clip_ratio,  # noqa: E731
                                   cfg.grid, cfg.max_shrink, norm=cfg.p_norm, full_range=cfg.full_range,
                                   col_weight=hdiag)
    # Static scales (computed once, on the original contiguous groups) unless groups are formed on the fly.
    lazy_groups = cfg.group_size != -1 and not cfg.act_order
    scales = torch.empty(out_f, n_groups, dtype=cfg.dtype, device=Wf.device) if lazy_groups else grp(Wf)
    group_of_col = torch.arange(in_f, device=Wf.device) // gs

    perm = None
    if cfg.act_order:
        perm = torch.argsort(torch.diagonal(H), descending=True)
        Wf = Wf[:, perm]
        H = H[perm][:, perm]
        group_of_col = group_of_col[perm]

    U = _inverse_hessian_factor(H, cfg.percdamp)
    # Row j of col_scales: the scales of (permuted) column j, gathered on the device before the loop.
    col_scales = None if lazy_groups else (scales.T.expand(in_f, out_f) if n_groups == 1
                                           else scales.T[group_of_col])
    qmax = _qmax(bits)
    Wt = Wf.T.contiguous()  # (in, out): the column loop reads and writes contiguous rows
    Qt = torch.empty_like(Wt)
    Ct = torch.empty_like(Wt)

    for i1 in range(0, in_f, cfg.blocksize):
        i2 = min(i1 + cfg.blocksize, in_f)
        W1 = Wt[i1:i2]  # updated in place: these rows are not read after their block
        Err1 = torch.empty_like(W1)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if lazy_groups and col % gs == 0:
                # Scales of the group starting here, from the error-updated weights (Frantar et al.).
                block = torch.cat([W1[i:], Wt[i2:]], dim=0)[:gs].T
                scales[:, col // gs] = weight_scales(
                    block, bits, cfg.mse, clip_ratio, cfg.grid, cfg.max_shrink, norm=cfg.p_norm,
                    full_range=cfg.full_range, col_weight=None if hdiag is None else hdiag[col:col + gs])[:, 0]
            s = scales[:, col // gs] if col_scales is None else col_scales[col]
            w, c, q, e = W1[i], Ct[col], Qt[col], Err1[i]
            torch.div(w, s, out=c)  # = _int_codes(w, s, bits), written in place
            c.round_().clamp_(-qmax - 1, qmax)
            torch.mul(c, s, out=q)  # = quantize_with_scales(w, s, bits)
            torch.sub(w, q, out=e).div_(U1[i, i])
            if i + 1 < i2 - i1:
                W1[i + 1:].addr_(U1[i, i + 1:], e, alpha=-1.0)
        if i2 < in_f:
            Wt[i2:].addmm_(U[i1:i2, i2:].T, Err1, alpha=-1.0)

    Q, C = Qt.T, Ct.T
    if perm is not None:
        inv = torch.argsort(perm)
        Q, C = Q[:, inv], C[:, inv]
    Q, C = Q.contiguous(), C.contiguous()
    return Q.to(dtype=W.dtype), C, scales, torch.isfinite(Q).all()


# ----------------------------------------------------------------------------- layer-by-layer driver


#: Execution groups of a decoder layer (true-sequential order), names relative to the layer.
LayerGroups = tuple[tuple[str, ...], ...]


class _StopForward(Exception):
    """Raised by the capture hook on decoder layer 0 once its inputs are recorded."""


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    try:
        return arch.decoder_layers(model)
    except arch.ArchitectureError as exc:
        raise GPTQError(f"{type(model).__name__}: {exc}") from exc


def _linear_groups(layer: nn.Module, true_sequential: bool,
                   order: LayerGroups = ()) -> list[list[tuple[str, nn.Linear]]]:
    linears = {n: m for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
    if not true_sequential:
        return [list(linears.items())]
    groups, seen = [], set()
    for names in order:
        g = [(n, linears[n]) for n in names if n in linears]
        if g:
            groups.append(g)
            seen.update(n for n, _ in g)
    rest = [(n, m) for n, m in linears.items() if n not in seen]
    if rest:
        groups.append(rest)
    return groups


def capture_layer_inputs(model: nn.Module, windows: torch.Tensor,
                         device: torch.device | str | None = None) -> list[tuple[tuple, dict]]:
    """Run the model on each window until decoder layer 0 and return that layer's (args, kwargs)."""
    layers = _decoder_layers(model)
    captured: list[tuple[tuple, dict]] = []

    def hook(_mod, args, kwargs):
        captured.append((tuple(a.detach() if torch.is_tensor(a) else a for a in args), dict(kwargs)))
        raise _StopForward

    handle = layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    dev = device or next(model.parameters()).device
    try:
        with torch.no_grad():
            for row in windows:
                try:
                    model(row.unsqueeze(0).to(dev), use_cache=False)
                except _StopForward:
                    pass
    finally:
        handle.remove()
    if len(captured) != len(windows):
        raise GPTQError("could not capture the inputs of decoder layer 0")
    return captured


def capture_per_layer_kwargs(model: nn.Module, windows: torch.Tensor,
                             device: torch.device | str | None = None) -> list[list[dict]] | None:
    """Each decoder layer's keyword inputs per window, ``[layer][window]``, for models whose layers receive
    different ones (Gemma 3: sliding layers get the θ = 1e4 RoPE and the banded mask, full-attention layers the
    θ = 1e6 RoPE and the causal mask); None when ``config.layer_types`` has one kind (layer 0's are reused)."""
    if len(set(getattr(arch.text_config(model), "layer_types", None) or ())) <= 1:
        return None
    layers = _decoder_layers(model)
    per_layer: list[list[dict]] = [[] for _ in layers]
    handles = [layer.register_forward_pre_hook(
        lambda _m, _a, kwargs, _i=i: per_layer[_i].append(dict(kwargs)), with_kwargs=True)
        for i, layer in enumerate(layers)]
    dev = device or next(model.parameters()).device
    try:
        with torch.no_grad():
            for row in windows:
                arch.base_model(model)(input_ids=row.unsqueeze(0).to(dev), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return per_layer


def _layer_output(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _group_hessians(layer: nn.Module, group: list[tuple[str, nn.Module]], inputs: list, dtype: torch.dtype,
                    share: bool, bf16: bool = False) -> dict[str, HessianAccumulator]:
    """The Hessian of each linear of ``group`` over the layer's ``inputs`` (one layer forward per window,
    stopped early where :data:`EARLY_STOP`).

    With ``share``, a linear whose input is, in every window, the tensor the previous linear of the group
    just read (same object, unchanged) takes that linear's accumulator instead of a copy; if a linear shares
    in some windows but not in others, the forwards run again without sharing.
    """
    accs = {n: HessianAccumulator(m.in_features, m.weight.device, dtype, bf16) for n, m in group}
    last: dict[str, Any] = {"x": None, "version": None, "name": None}
    source: dict[str, set] = {n: set() for n, _ in group}  # who accumulated n's input, per window
    handles = []
    seen: set[str] = set()
    size = len(accs)
    for n, m in group:
        def pre(_mod, args, _n=n):
            x = args[0]
            version = None if x.is_inference() else x._version
            if share and last["x"] is x and last["version"] == version:
                source[_n].add(last["name"])
            else:
                accs[_n].add(x)
                source[_n].add(_n)
                last.update(x=x, version=version, name=_n)
            seen.add(_n)
            if EARLY_STOP and len(seen) == size:
                raise _StopForward  # every Hessian of the group has its input: the rest is unused
        handles.append(m.register_forward_pre_hook(pre))
    try:
        with torch.no_grad():
            for args, kwargs in inputs:
                seen.clear()
                try:
                    layer(*args, **kwargs)
                except _StopForward:
                    pass
    finally:
        for h in handles:
            h.remove()
        last.clear()
    if not share:
        return accs
    for n, src in source.items():
        (leader,) = src if len(src) == 1 else (None,)
        if leader is None or source[leader] != {leader}:
            return _group_hessians(layer, group, inputs, dtype, share=False, bf16=bf16)
        accs[n] = accs[leader]
    return accs


def resolve_objective(cfg: GPTQConfig, model: nn.Module) -> GPTQConfig:
    """``cfg`` with :attr:`ScaleObjective.AUTO` resolved for ``model``: the weights' own error when R1 rotated
    its residual stream (``model.rq_rotation``, set by the offline rotations), GPTQ's diagonal proxy otherwise."""
    if cfg.objective != ScaleObjective.AUTO:
        return cfg
    r1 = getattr(getattr(model, "rq_rotation", None), "r1", "identity")
    return dataclasses.replace(
        cfg, objective=ScaleObjective.WEIGHT if r1 != "identity" else ScaleObjective.HESSIAN_DIAG)


def quantize_model_gptq(model: nn.Module, windows: torch.Tensor, bits: int, cfg: GPTQConfig = GPTQConfig(),
                        clip_ratio: float = 1.0, progress: bool = True,
                        skip: Callable[[str], bool] | None = None) -> dict[str, float]:
    """Quantise every linear of every decoder layer with GPTQ, sequentially over layers (in place).

    ``windows``: (n, seqlen) token ids. The embedding, final norm and lm_head stay in full precision
    (QuaRot/DartQuant keep lm_head at 16 bit). Returns per-linear relative output errors
    ``||W X - Q X||_F^2 / ||W X||_F^2`` estimated from the Hessian (``tr(D H D^T) / tr(W H W^T)``).
    """
    from tqdm.auto import tqdm

    _check_bits(bits)
    GPTQ_CALLS["model"] += 1
    cfg = resolve_objective(cfg, model)
    layers = _decoder_layers(model)
    order = arch.layer_linear_groups(model)
    inputs = capture_layer_inputs(model, windows)
    per_layer_kwargs = capture_per_layer_kwargs(model, windows)
    errors: dict[str, float] = {}
    for li, layer in enumerate(tqdm(layers, desc="GPTQ layers", disable=not progress)):
        with offload.resident(model, layer):  # a streamed model (--offload cpu): this layer on the device
            inputs = _quantize_layer(layer, li, inputs, per_layer_kwargs, order, bits, cfg, clip_ratio, skip, errors)
    return errors


def _quantize_layer(layer: nn.Module, li: int, inputs: list, per_layer_kwargs: list | None, order: Any, bits: int,
                    cfg: GPTQConfig, clip_ratio: float, skip: Callable[[str], bool] | None,
                    errors: dict[str, float]) -> list:
    """GPTQ of one decoder layer (in place); returns the next layer's inputs.

    The group forwards run with the quantisers' checks deferred (one host read per group,
    :mod:`rope_quant.quant.deferred`); the error estimates and finiteness flags of every linear are read in
    one transfer at the end of the layer.
    """
    if per_layer_kwargs is not None:  # this layer's own RoPE / mask, not layer 0's
        inputs = [(args, per_layer_kwargs[li][w]) for w, (args, _) in enumerate(inputs)]
    pending: list[tuple[str, nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    records: list[tuple[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for group in _linear_groups(layer, cfg.true_sequential, order):
        group = [(n, m) for n, m in group if not (skip and skip(f"layers.{li}.{n}"))]
        if not group:
            continue
        accs, _ = deferred.run_checked(
            lambda g=group: _group_hessians(layer, g, inputs, cfg.dtype, SHARE_HESSIANS, cfg.hessian_bf16))
        shared: dict[int, list[tuple[str, nn.Module]]] = {}
        for n, m in group:  # linears with one accumulator: one stacked solve
            shared.setdefault(id(accs[n]) if STACK_SHARED else id(m), []).append((n, m))
        for members in shared.values():
            H = accs[members[0][0]].H
            Ws = [m.weight.data for _, m in members]
            for (n, m), W, (Q, codes, scales, finite) in zip(
                    members, Ws, _gptq_stacked(Ws, H, bits, cfg, clip_ratio), strict=True):
                Wh = W.to(H.dtype)
                num = torch.einsum("oi,ij,oj->", Wh - Q.to(H.dtype), H, Wh - Q.to(H.dtype))
                den = torch.einsum("oi,ij,oj->", Wh, H, Wh)
                neg = negzero_flag(codes, Q) if bits <= 8 else torch.zeros((), dtype=torch.bool, device=Q.device)
                pending.append((n, m, num, den, finite, neg))
                records.append((m, codes, scales, Q))
                m.weight.data.copy_(Q)
    if pending:
        host = torch.stack([torch.stack([num.double(), den.double(), fin.double(), neg.double()])
                            for _, _, num, den, fin, neg in pending]).tolist()
        for (n, _, _, _, _, _), (num, den, fin, _) in zip(pending, host, strict=True):
            if not fin:
                raise GPTQError(f"GPTQ produced non-finite weights (layers.{li}.{n})")
            errors[f"layers.{li}.{n}"] = num / max(den, 1e-30)
        for (m, codes, scales, Q), row in zip(records, host, strict=True):
            _record_codes(m, codes, scales, bits, cfg.group_size, Q, has_negzero=bool(row[3]))

    # Inputs of the next layer: this layer, now quantised (with whatever hooks are installed).
    def forward() -> list:
        with torch.no_grad():
            return [((_layer_output(layer(*args, **kwargs)),) + tuple(args[1:]), kwargs) for args, kwargs in inputs]
    return deferred.run_checked(forward)[0]


def quantize_model_rtn(model: nn.Module, bits: int, group_size: int = -1, mse: bool = True,
                       clip_ratio: float = 1.0, skip: Callable[[str], bool] | None = None,
                       cfg: GPTQConfig | None = None) -> int:
    """Round-to-nearest quantisation of every decoder-layer linear (in place); returns the count.

    ``cfg`` (default :class:`GPTQConfig()`) gives the scale search's grid, shrink, norm and range (the fields
    marked ``rtn``); ``group_size`` and ``mse`` are the arguments."""
    _check_bits(bits)
    count = 0
    for li, layer in enumerate(_decoder_layers(model)):
        for n, m in layer.named_modules():
            if isinstance(m, nn.Linear) and not (skip and skip(f"layers.{li}.{n}")):
                codes, scales = _rtn_in_place(m.weight.data, bits, group_size, mse, clip_ratio, cfg)
                _record_codes(m, codes, scales, bits, group_size, m.weight.data)
                count += 1
    return count


#: Rows of a weight that :func:`quantize_model_rtn` quantises at a time: every RTN quantity is per row, so the
#: blocks give the whole matrix's bits, with float32 temporaries of this many rows (the whole
#: 14336 × 4096 down_proj at once held ~1.4 GB of them).
RTN_BLOCK_ROWS = 1024


def _rtn_in_place(w: torch.Tensor, bits: int, group_size: int, mse: bool,
                  clip_ratio: float, cfg: GPTQConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_rtn` of ``w`` written into ``w``, :data:`RTN_BLOCK_ROWS` rows at a time; returns the integer
    codes (int8) and the scales of the whole matrix."""
    g = GPTQConfig() if cfg is None else cfg
    codes, scales = [], []
    for r0 in range(0, w.shape[0], RTN_BLOCK_ROWS):
        rows = w[r0:r0 + RTN_BLOCK_ROWS]
        q, c, sc = _rtn(rows, bits, group_size, mse, clip_ratio, g.grid, g.max_shrink, g.p_norm, g.full_range)
        rows.copy_(q)
        codes.append(c.to(torch.int8) if bits <= 8 else c)
        scales.append(sc)
    return torch.cat(codes), torch.cat(scales)


def _record_codes(m: nn.Module, codes: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int,
                  Q: torch.Tensor, has_negzero: bool | None = None) -> None:
    """Keep the integer codes of ``m``'s new weight on the module (:data:`packing.CODES_ATTR`) for the
    weight cache, which stores them instead of the weight when they dequantise to it bit for bit."""
    if bits <= 8:
        setattr(m, CODES_ATTR, WeightCodes.from_codes(codes, scales, bits, group_size, Q, has_negzero))


def linear_names(model: nn.Module) -> Sequence[str]:
    """Qualified names of the decoder-layer linears GPTQ/RTN quantise."""
    return [f"layers.{li}.{n}" for li, layer in enumerate(_decoder_layers(model))
            for n, m in layer.named_modules() if isinstance(m, nn.Linear)]

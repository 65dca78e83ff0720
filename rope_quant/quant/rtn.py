"""Per-channel / per-group symmetric weight scales with the clip search, and round-to-nearest weight quantisation.

The quantiser is symmetric INT-b per output channel (or per group of ``group_size`` input columns), with
an optional clip search: for every output channel (group) the clip ratio over a grid minimising GPTQ's proxy
loss with the Hessian's diagonal, ``sum_j H_jj (w_j - q_j)^2``, or the weights' own error ``||w - q(w)||^2``
(QuaRot/DartQuant ``w_clip``); by default the first without R1, the second with it (:class:`ScaleObjective`).
Without rotations the weights' own error clips outlier weights that the layer's inputs need
(docs/protocol.md, "The weight scale search").

:func:`rtn_quantize` (one matrix) and :func:`quantize_model_rtn` (every decoder-layer linear, in place) are the
round-to-nearest baseline: these scales, no error feedback. GPTQ (:mod:`rope_quant.quant.gptq`) quantises with
the same scales and spreads each column's rounding error; the settings both read, :class:`GPTQConfig` (its fields
marked ``rtn`` shape the RTN scales), :class:`ScaleObjective` and :class:`GPTQError`, are defined here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

import torch
from torch import nn

from rope_quant.model import arch
from rope_quant.quant.packing import CODES_ATTR, WeightCodes
from rope_quant.quant.quantizers import check_bits

__all__ = [
    "GPTQConfig",
    "ScaleObjective",
    "GPTQError",
    "weight_scales",
    "quantize_with_scales",
    "rtn_quantize",
    "quantize_model_rtn",
]


class GPTQError(ValueError):
    """Bad GPTQ settings or a Hessian that cannot be factorised."""


class ScaleObjective(StrEnum):
    """What the per-row (per-group) scale search minimises.

    ``weight``: the weights' own error ``sum_j |w_j - q_j|^p``. ``hessian_diag``: GPTQ's proxy loss
    ``(w - q) H (w - q)^T`` (Frantar et al. 2022, Eq. 1-2) with ``H`` replaced by its diagonal,
    ``sum_j H_jj |w_j - q_j|^p``: the exact per-row proxy costs one (in x in) product per candidate ratio
    (81 ratios x every linear), the diagonal one the same as ``weight``. ``auto`` (the default):
    ``weight`` on a model whose residual stream is rotated (R1 applied, ``model.rq_rotation.r1`` not
    ``identity``), ``hessian_diag`` otherwise, and for a bare matrix (:func:`~rope_quant.quant.gptq.gptq_quantize`).
    Measured (docs/protocol.md): the proxy wins by 4.8 perplexity without rotations and loses up to 0.6 at 3 bits
    with them. RTN has no Hessian and always uses ``weight``.
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
    #: Hessian sums and the inverse-Hessian factorisation in float64 (the float-order replicate); the per-window
    #: products, the column loop and the forwards stay in the model's precision (docs/verdicts.md).
    float64: bool = False
    #: Hessian products on bfloat16-rounded inputs with float32 accumulation (tensor cores on a GPU). Off
    #: unless :func:`rope_quant.quant.hessian_check.validate_fast_hessian` passes on the real shapes.
    hessian_bf16: bool = False

    @property
    def dtype(self) -> torch.dtype:
        """The precision of the Hessian sums and the factorisation (the loop: :func:`gptq_solve.loop_dtype`)."""
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


# ----------------------------------------------------------------------------- a model, in place


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    try:
        return arch.decoder_layers(model)
    except arch.ArchitectureError as exc:
        raise GPTQError(f"{type(model).__name__}: {exc}") from exc


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

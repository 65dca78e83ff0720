"""llama.cpp's K-cache formats (ggml ``q4_0``, ``q4_1``, ``iq4_nl``, ``q8_0``): blocks of 32 along each key row.

The rules are ggml's reference quantisers as llama.cpp's CPU backend writes a quantised K cache (``from_float`` of the
type: ``quantize_row_q4_0_ref``, ``quantize_row_q4_1_ref``, ``quantize_row_iq4_nl_ref``, ``quantize_row_q8_0_ref``),
in float32, with the scale (and q4_1's minimum) stored as float16; the dequantised value is what attention reads.
Per block of 32 values x (d: the float32 scale, f16(d) the stored one):

=========== ==================================================================================================
``q4_0``    m = the signed value of largest |x| (the first one), d = m/−8, q = min(15, trunc(x/d + 8.5)),
            x̂ = f16(d)·(q − 8): 4.5 bits per element (16 four-bit codes per 8 bytes, one f16 scale)
``q4_1``    d = (max − min)/15, q = min(15, trunc((x − min)/d + 0.5)), x̂ = f16(d)·q + f16(min): 5.0 bits
``iq4_nl``  the non-linear grid v = (−127, −104, …, 113): d₀ = m/−127, each x to the nearest v_l of x/d₀ (a tie
            to the upper one), then the weighted least-squares scale d = Σ w·v_l·x / Σ w·v_l² with w = x²
            (float32 sums in order), x̂ = f16(d)·v_l: 4.5 bits. The K cache's reference has no scale search
            (``ntry = −1``); the search over ±7 steps is ``quantize_iq4_nl``, ggml's weight quantiser
``q8_0``    d = max|x|/127, q = roundf(x/d) (half away from zero), x̂ = f16(d)·q: 8.5 bits
=========== ==================================================================================================

``x/d`` is ``x·(1/d)`` in float32 (1/d = 0 where d = 0), as ggml computes it. Non-finite elements count as 0 in
their block's statistics and pass through unchanged (the other key quantisers' convention); a finite block whose
scale overflows float16 gives what ggml gives (inf or NaN). :func:`pack` writes ggml's block bytes (the ``gguf``
package reads them: tests/numerics/test_ggml_keys.py checks every format against ``gguf.quants``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import torch

from rope_quant.quant.keys.base import KeyQuantError, _back, _work

__all__ = ["BLOCK", "IQ4_NL_VALUES", "GgmlFormat", "GgmlBlocks", "code_bits", "scales_per_block", "quantize",
           "dequantize", "pack", "fake_quant_ggml", "check_row"]

#: Elements per ggml block (QK4_0 = QK4_1 = QK4_NL = QK8_0 = 32).
BLOCK = 32
#: ggml's ``kvalues_iq4nl``: the non-linear 4-bit grid of iq4_nl.
IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
#: ggml's GROUP_MAX_EPS: an iq4_nl block whose largest |x| is below it is stored as zeros.
_GROUP_MAX_EPS = 1e-15


class GgmlFormat(StrEnum):
    """The ggml types llama.cpp offers for a quantised K cache (``-ctk``)."""

    Q4_0 = "q4_0"
    Q4_1 = "q4_1"
    IQ4_NL = "iq4_nl"
    Q8_0 = "q8_0"


def code_bits(fmt: GgmlFormat) -> int:
    """Bits of one element's code."""
    return 8 if GgmlFormat(fmt) == GgmlFormat.Q8_0 else 4


def scales_per_block(fmt: GgmlFormat) -> int:
    """16-bit numbers stored per block besides the codes (q4_1: scale and minimum; the others: the scale)."""
    return 2 if GgmlFormat(fmt) == GgmlFormat.Q4_1 else 1


@dataclass(frozen=True)
class GgmlBlocks:
    """Quantised blocks of rows (..., n): ``d`` (..., n/32) float16 scales, ``m`` q4_1's float16 minima (else
    None), ``codes`` (..., n/32, 32) int64: q4_0 / q4_1 / iq4_nl grid indices 0..15, q8_0 values −127..127."""

    fmt: GgmlFormat
    d: torch.Tensor
    m: torch.Tensor | None
    codes: torch.Tensor


def check_row(n: int, what: str = "head_dim") -> int:
    """``n`` as a row length ggml can quantise: a positive multiple of 32 (else :class:`KeyQuantError`)."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < BLOCK or n % BLOCK:
        raise KeyQuantError(f"llama.cpp's K-cache formats quantise blocks of {BLOCK} along the key: {what} must be "
                            f"a positive multiple of {BLOCK}, got {n!r}")
    return int(n)


def _inv(d: torch.Tensor) -> torch.Tensor:
    """ggml's ``id = d ? 1.0f/d : 0.0f`` (an IEEE division, not an approximate reciprocal)."""
    return torch.where(d == 0, torch.zeros_like(d), torch.ones_like(d) / torch.where(d == 0, torch.ones_like(d), d))


def _signed_absmax(b: torch.Tensor) -> torch.Tensor:
    """The first value of largest magnitude per block (ggml's ``if (amax < fabsf(v))`` scan), (..., nb, 1)."""
    return torch.gather(b, -1, b.abs().argmax(dim=-1, keepdim=True))


def _roundf(v: torch.Tensor) -> torch.Tensor:
    """C's ``roundf`` (half away from zero), exact in float32: trunc(v) + trunc(2·frac(v))."""
    t = torch.trunc(v)
    return t + torch.trunc(2 * (v - t))


def _nearest_iq4(al: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """ggml's ``best_index_int8``: the nearest grid index of ``al`` (a tie to the upper one; clamped ends)."""
    mu = (al.unsqueeze(-1) >= grid).sum(dim=-1).clamp(1, len(IQ4_NL_VALUES) - 1)
    lower = grid[mu - 1]
    pick = torch.where(al - lower < grid[mu] - al, mu - 1, mu)
    pick = torch.where(al <= grid[0], torch.zeros_like(pick), pick)
    return torch.where(al >= grid[-1], torch.full_like(pick, len(IQ4_NL_VALUES) - 1), pick)


def _iq4_nl(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_row_iq4_nl_impl`` with ntry = −1 (the K cache's reference): float32 scales and grid indices."""
    grid = torch.tensor(IQ4_NL_VALUES, dtype=torch.float32, device=b.device)
    top = _signed_absmax(b)
    zero = top.abs() < _GROUP_MAX_EPS
    d0 = top / grid[0]
    idx = _nearest_iq4(_inv(d0) * b, grid)
    q = grid[idx]
    w = b * b
    sumqx = torch.zeros_like(b[..., 0])
    sumq2 = torch.zeros_like(sumqx)
    for j in range(BLOCK):  # float32 sums in ggml's order (no reassociation)
        wq = w[..., j] * q[..., j]
        sumqx = sumqx + wq * b[..., j]
        sumq2 = sumq2 + wq * q[..., j]
    d = torch.where(sumq2 > 0, sumqx / torch.where(sumq2 > 0, sumq2, torch.ones_like(sumq2)), torch.zeros_like(sumq2))
    d = torch.where(zero.squeeze(-1), torch.zeros_like(d), d)
    idx = torch.where(zero, torch.full_like(idx, IQ4_NL_VALUES.index(1)), idx)  # any index: d = 0 stores zeros
    return d, idx


def quantize(x: torch.Tensor, fmt: GgmlFormat | str) -> GgmlBlocks:
    """ggml's reference quantisation of the rows of ``x`` (..., n), n a multiple of 32, in float32."""
    fmt = GgmlFormat(fmt)
    n = check_row(x.shape[-1], "the row length")
    w = _work(x).float()
    w = torch.where(torch.isfinite(w), w, torch.zeros_like(w))
    b = w.reshape(*w.shape[:-1], n // BLOCK, BLOCK)
    m16 = None
    if fmt == GgmlFormat.Q4_0:
        d = _signed_absmax(b) / -8
        codes = torch.trunc(b * _inv(d) + 8.5).clamp(0, 15)
    elif fmt == GgmlFormat.Q4_1:
        lo, hi = b.amin(dim=-1, keepdim=True), b.amax(dim=-1, keepdim=True)
        d = (hi - lo) / 15
        codes = torch.trunc((b - lo) * _inv(d) + 0.5).clamp(0, 15)
        m16 = lo.squeeze(-1).half()
    elif fmt == GgmlFormat.Q8_0:
        d = b.abs().amax(dim=-1, keepdim=True) / 127
        codes = _roundf(b * _inv(d))
    else:
        scale, codes = _iq4_nl(b)
        return GgmlBlocks(fmt, scale.half(), None, codes.long())
    return GgmlBlocks(fmt, d.squeeze(-1).half(), m16, codes.long())


def dequantize(blocks: GgmlBlocks) -> torch.Tensor:
    """The float32 rows the blocks hold (ggml's ``dequantize_row_*``)."""
    d = blocks.d.float().unsqueeze(-1)
    c = blocks.codes
    if blocks.fmt == GgmlFormat.Q4_0:
        out = d * (c - 8).float()
    elif blocks.fmt == GgmlFormat.Q4_1:
        assert blocks.m is not None
        out = d * c.float() + blocks.m.float().unsqueeze(-1)
    elif blocks.fmt == GgmlFormat.Q8_0:
        out = d * c.float()
    else:
        out = d * torch.tensor(IQ4_NL_VALUES, dtype=torch.float32, device=c.device)[c]
    return out.reshape(*out.shape[:-2], -1)


def pack(blocks: GgmlBlocks) -> np.ndarray:
    """ggml's block bytes, (..., n/32 · type_size) uint8: f16 scale [, f16 minimum], then the codes (4-bit: byte
    j holds element j in its low and element j + 16 in its high nibble; q8_0: int8 per element)."""
    d = blocks.d.detach().cpu().numpy().astype(np.float16)
    parts = [d[..., None].view(np.uint8)]
    if blocks.m is not None:
        parts.append(blocks.m.detach().cpu().numpy().astype(np.float16)[..., None].view(np.uint8))
    c = blocks.codes.detach().cpu().numpy()
    if blocks.fmt == GgmlFormat.Q8_0:
        parts.append(c.astype(np.int8).view(np.uint8))
    else:
        c = c.astype(np.uint8)
        parts.append(c[..., : BLOCK // 2] | (c[..., BLOCK // 2:] << np.uint8(4)))
    out = np.concatenate(parts, axis=-1)
    return out.reshape(*out.shape[:-2], -1)


def fake_quant_ggml(x: torch.Tensor, fmt: GgmlFormat | str) -> torch.Tensor:
    """``x`` (..., n) as the runtime reads it back from a ``fmt`` cache: quantised and dequantised in blocks of 32
    along the last dim, in ``x``'s dtype (non-finite elements unchanged)."""
    if not torch.is_floating_point(x):
        raise KeyQuantError(f"key quantisation needs a floating-point tensor, got {x.dtype}")
    return _back(dequantize(quantize(x, fmt)), x)

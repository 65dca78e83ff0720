"""Integer codes of quantised weights: what GPTQ/RTN produced, stored compactly and dequantised bit for bit.

A symmetric INT-b weight is ``W = codes · s`` with integer codes in [-2^(b-1), 2^(b-1) - 1] and one float32
scale per output channel and group of ``group_size`` contiguous input columns (the scales of
:mod:`rope_quant.quant.gptq`). :class:`WeightCodes` holds the codes (two 4-bit codes per byte for b ≤ 4, int8
up to b = 8) and the scales. :meth:`WeightCodes.dequantize` recomputes ``codes · s`` with the same float32
multiply the quantiser did, so the result equals the quantised weight bit for bit, the sign of zero
included (a code 0 of a negative weight gave -0.0: those positions are kept as a packed bit mask).
:func:`encode` checks that identity before it lets a caller store codes instead of the weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

#: Attribute of a quantised nn.Linear holding the :class:`WeightCodes` of its current weight.
CODES_ATTR = "rq_weight_codes"

__all__ = ["CODES_ATTR", "WeightCodes", "encode", "from_dict", "pack_nibbles", "unpack_nibbles", "bitwise_equal"]


def pack_nibbles(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Flatten integer codes in [-2^(b-1), 2^(b-1)) (b ≤ 4) into uint8, two codes per byte (low nibble first)."""
    off = 1 << (bits - 1)
    u = (codes.reshape(-1).to(torch.int16) + off).to(torch.uint8)
    if u.numel() % 2:
        u = torch.cat([u, u.new_zeros(1)])
    return u[0::2] | (u[1::2] << 4)


def unpack_nibbles(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: the first ``n`` codes as int8."""
    off = 1 << (bits - 1)
    out = torch.empty(packed.numel() * 2, dtype=torch.uint8, device=packed.device)
    out[0::2] = packed & 0x0F
    out[1::2] = packed >> 4
    return (out[:n].to(torch.int16) - off).to(torch.int8)


def negzero_flag(codes: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """0-d device bool: does a code 0 carry a -0.0 weight (the mask :meth:`WeightCodes.from_codes` keeps)."""
    return (torch.signbit(weight.detach().to(codes.device)) & (codes == 0)).any()


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, dtypes and shapes, and equal signs of zero (NaN never compares equal)."""
    return (a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
            and torch.equal(torch.signbit(a), torch.signbit(b)))


@dataclass
class WeightCodes:
    """Integer codes and float32 scales of one quantised (out, in) weight (see the module docstring)."""

    bits: int
    shape: tuple[int, int]
    group_size: int  # -1: one group per row
    scales: torch.Tensor  # (out, n_groups) float32
    codes: torch.Tensor  # uint8 nibbles (bits <= 4) or int8, flattened row-major
    negzero: torch.Tensor | None = None  # packed bit mask of the -0.0 entries, or None
    dtype: str = "float32"

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int,
                   weight: torch.Tensor, has_negzero: bool | None = None) -> WeightCodes:
        """Compact form of integer-valued ``codes`` (out, in) with ``scales`` (out, n_groups) of ``weight``.

        ``has_negzero``: whether any code 0 carries a -0.0 weight, when the caller has read it already
        (:func:`negzero_flag`, batched with other reads); None reads it here."""
        if not 2 <= bits <= 8:
            raise ValueError(f"integer codes are stored for 2..8 bits, got {bits}")
        # Packed where the codes are (the device), then one copy of the compact form to the host.
        c = codes.detach()
        packed = pack_nibbles(c, bits) if bits <= 4 else c.reshape(-1).to(torch.int8)
        neg = torch.signbit(weight.detach().to(c.device)) & (c == 0)
        if has_negzero is None:
            has_negzero = bool(neg.any())
        mask = _pack_bits(neg.reshape(-1)) if has_negzero else None
        return cls(bits, (int(c.shape[0]), int(c.shape[1])), int(group_size),
                   scales.detach().to("cpu", torch.float32).contiguous(), packed.to("cpu").contiguous(),
                   None if mask is None else mask.to("cpu"), str(weight.dtype).removeprefix("torch."))

    def dequantize(self) -> torch.Tensor:
        """``codes · s`` as the quantiser computed it (float32 multiply, then the weight's dtype)."""
        out_f, in_f = self.shape
        n = out_f * in_f
        c = unpack_nibbles(self.codes, n, self.bits) if self.bits <= 4 else self.codes[:n]
        gs = in_f if self.group_size == -1 else self.group_size
        col_scale = self.scales.repeat_interleave(gs, dim=1)[:, :in_f]
        w = c.reshape(out_f, in_f).to(torch.float32) * col_scale
        if self.negzero is not None:
            neg = _unpack_bits(self.negzero, n).reshape(out_f, in_f)
            w = torch.where(neg, torch.full_like(w, -0.0), w)
        return w.to(getattr(torch, self.dtype))

    def to_dict(self) -> dict[str, Any]:
        """Plain tensors and ints (loadable with ``torch.load(weights_only=True)``)."""
        return {"bits": self.bits, "shape": list(self.shape), "group_size": self.group_size, "scales": self.scales,
                "codes": self.codes, "negzero": self.negzero, "dtype": self.dtype}

    def nbytes(self) -> int:
        extra = 0 if self.negzero is None else self.negzero.numel()
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * 4 + extra


def from_dict(d: dict[str, Any]) -> WeightCodes:
    """Inverse of :meth:`WeightCodes.to_dict` (KeyError/TypeError/ValueError if malformed)."""
    bits, shape, gs = int(d["bits"]), tuple(int(v) for v in d["shape"]), int(d["group_size"])
    scales, codes, neg = d["scales"], d["codes"], d.get("negzero")
    if len(shape) != 2 or not torch.is_tensor(scales) or not torch.is_tensor(codes):
        raise ValueError("malformed weight codes")
    n = shape[0] * shape[1]
    expect = (n + 1) // 2 if bits <= 4 else n
    if codes.numel() != expect or scales.shape[0] != shape[0] or (neg is not None and not torch.is_tensor(neg)):
        raise ValueError(f"weight codes of shape {shape}: {codes.numel()} codes, scales {tuple(scales.shape)}")
    return WeightCodes(bits, (shape[0], shape[1]), gs, scales, codes, neg, str(d.get("dtype", "float32")))


def encode(weight: torch.Tensor, codes: WeightCodes | None) -> WeightCodes | None:
    """``codes`` if they dequantise to ``weight`` bit for bit (sign of zero included), else None."""
    if codes is None or tuple(weight.shape) != codes.shape:
        return None
    return codes if bitwise_equal(codes.dequantize(), weight.detach().to("cpu")) else None


_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    n = mask.numel()
    pad = (-n) % 8
    m = torch.cat([mask.to(torch.uint8), torch.zeros(pad, dtype=torch.uint8, device=mask.device)]).reshape(-1, 8)
    return (m * _BIT_WEIGHTS.to(mask.device)).sum(dim=1, dtype=torch.uint8)


def _unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    bits = (packed[:, None] & _BIT_WEIGHTS) != 0
    return bits.reshape(-1)[:n]

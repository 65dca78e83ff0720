"""The key quantisers' names, constants, errors and argument checks (docs/key_quantizers.md)."""

from __future__ import annotations

import numbers
from enum import StrEnum
from typing import Any

import torch

from rope_quant.quant.quantizers import OFF_BITS, QuantConfigError

#: The entry-point group scanned for foreign key quantisers.
ENTRY_POINT_GROUP = "rope_quant.key_quant"
#: Bits of one stored scale or zero point.
SCALE_BITS = 16
#: Bits of one element kept in full precision (a sink token, the KIVI window, a 16-bit pair).
FULL_BITS = 16
#: The bit widths a key quantiser other than the default accepts (16 = that part in full precision).
MIN_BITS, MAX_BITS = 2, OFF_BITS


class KeyQuantName(StrEnum):
    """The built-in key quantisers (the one list of their names)."""

    PER_TOKEN = "per_token"
    KIVI = "kivi"
    KVQUANT_PREROPE = "kvquant_prerope"
    ROPE_PAIR_BITS = "rope_pair_bits"
    SINK = "sink"
    PER_TOKEN_WINDOW = "per_token_window"
    GGML_Q4_0 = "ggml_q4_0"
    GGML_Q4_1 = "ggml_q4_1"
    GGML_IQ4_NL = "ggml_iq4_nl"
    GGML_Q8_0 = "ggml_q8_0"


#: The paper's key quantiser, the default of every cell.
DEFAULT_KEY_QUANT = KeyQuantName.PER_TOKEN


class KeyQuantError(QuantConfigError):
    """Bad key-quantiser settings: the message names the parameter (its flat config name) and the rule."""


class UnknownKeyQuantError(KeyQuantError):
    """A key-quantiser name that is not registered (the message names the closest ones)."""


class KeyQuantNameClashError(KeyQuantError):
    """A key quantiser is registered under a name that is already taken."""


class KeyQuantWarning(UserWarning):
    """An entry point of the ``rope_quant.key_quant`` group was skipped (load failure or name clash)."""


def _int_in(value: Any, what: str, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < low or (
            high is not None and int(value) > high):
        bound = f">= {low}" if high is None else f"between {low} and {high}"
        raise KeyQuantError(f"{what} must be an integer {bound}, got {value!r}")
    return int(value)


def _bits(value: Any, what: str) -> int:
    """A bit width in MIN_BITS..MAX_BITS (16: full precision)."""
    return _int_in(value, what, MIN_BITS, MAX_BITS)


def _check_positions(key: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """Positions as a (b or 1, T) integer tensor on the key's device (default: 0..T-1, the cache index)."""
    length = key.shape[-2]
    if positions is None:
        return torch.arange(length, device=key.device).unsqueeze(0)
    pos = torch.as_tensor(positions, device=key.device)
    if pos.dim() == 1:
        pos = pos.unsqueeze(0)
    if pos.dim() != 2 or pos.shape[-1] != length:
        raise KeyQuantError(f"positions must have shape (T,) or (batch, T) with T = {length}, "
                            f"got {tuple(pos.shape)}")
    return pos


def _work(x: torch.Tensor) -> torch.Tensor:
    if not torch.is_floating_point(x):
        raise KeyQuantError(f"key quantisation needs a floating-point tensor, got {x.dtype}")
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _back(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``out`` in x's dtype: non-finite inputs passed through unchanged, finite ones saturated at the dtype's
    largest finite value (finite in, finite out)."""
    if out.dtype != x.dtype:
        lim = torch.finfo(x.dtype).max
        out = out.clamp(-lim, lim)
    out = torch.where(torch.isfinite(x), out.to(x.dtype), x)
    return out

"""Key quantisers: the other answers to 4-bit keys, one registry beside R3 (docs/key_quantizers.md).

The paper quantises post-R3 keys with the dynamic per-token quantiser (:func:`rope_quant.quant.quantizers.fake_quant`).
This module names that rule and the alternatives, so that a cell can swap its key quantiser and be compared with
R3 at equal bits:

=================== ============================================================================================
``per_token``       the default: asymmetric INT-b per token (per group of ``group_size`` channels), today's rule
``kivi``            KIVI (Liu et al., ICML 2024): per channel over groups of G tokens, min/max; the most recent
                    R tokens (R >= G) and a group not yet full stay in full precision
``kvquant_prerope`` KVQuant (Hooper et al., NeurIPS 2024): per channel *before* RoPE (groups of G tokens, as
                    above without a window), RoPE re-applied to the dequantised key at its position
``rope_pair_bits``  integer bits per RoPE frequency pair (both channels of a pair alike) allocated from the
                    pairs' energies so that the mean is the target; per-token scales per group of equal widths
``sink``            RotateKV's attention-sink protection: the first S tokens in 16 bits, the rest per token
``per_token_window`` the per-token rule with KIVI's full-precision tokens (the R most recent and the group being
                    filled): KIVI's reference at equal bits (with G = head_dim both store the same bits)
=================== ============================================================================================

Each option is a small frozen dataclass of named, checked parameters (:class:`KeyQuantOption`): it states its
``online_step`` (what decoding needs besides reading codes) and counts its storage with
:meth:`~KeyQuantOption.bits_per_element` (payload bits, each scale and zero point at 16 bits, full-precision
tokens at 16 bits), and :meth:`~KeyQuantOption.build` makes the per-layer :class:`KeyQuantizer` that the
attention function (:mod:`rope_quant.rotations.attention`) calls on the key cache.

**Names.** :class:`KeyQuantName` is the one list of the built-in names (the CLI's ``--k-quant`` and the config's
``k_quant`` read it). Another package adds an option with :func:`register` (a taken name is refused) or through an
entry point of the group ``rope_quant.key_quant`` (loaded lazily, once; a taken or broken one is skipped with a
warning), like the R3 registry.

**Streaming groups.** KIVI and KVQuant quantise a group of G tokens per channel once the group is complete (and,
for KIVI, has left the full-precision window). A quantiser with ``streaming = True`` says how many leading tokens
of a cache of length T are quantised (:meth:`KeyQuantizer.quantized_prefix`); called on a cache it returns that
cache's state. Within one forward over many new tokens the attention function gives each query the cache state
at its own length (:mod:`rope_quant.rotations.attention`), so a query never sees a group that was not yet
complete, nor a range computed from later tokens.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar

import numpy as np
import torch

from rope_quant.core.rope import check_head_dim, check_layout, pair_indices
from rope_quant.quant.quantizers import OFF_BITS, QuantConfig, QuantConfigError, fake_quant

__all__ = [
    "ENTRY_POINT_GROUP",
    "KeyQuantName",
    "DEFAULT_KEY_QUANT",
    "SCALE_BITS",
    "FULL_BITS",
    "MIN_BITS",
    "MAX_BITS",
    "KeyQuantError",
    "UnknownKeyQuantError",
    "KeyQuantNameClashError",
    "KeyQuantWarning",
    "KeyQuantContext",
    "KeyQuantOption",
    "PerTokenOption",
    "KiviOption",
    "KVQuantPreRoPEOption",
    "RopePairBitsOption",
    "SinkOption",
    "PerTokenWindowOption",
    "KeyQuantizer",
    "PerTokenQuantizer",
    "ChannelGroupQuantizer",
    "KiviQuantizer",
    "KVQuantPreRoPEQuantizer",
    "RopePairBitsQuantizer",
    "SinkQuantizer",
    "PerTokenWindowQuantizer",
    "register",
    "unregister",
    "names",
    "option_class",
    "option_from",
    "spec_defaults",
    "closest_names",
    "load_entry_points",
    "allocate_pair_bits",
    "pair_energies",
    "fake_quant_channel_groups",
    "apply_rope",
]

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


# ----------------------------------------------------------------------------- checks


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


# ----------------------------------------------------------------------------- tensor kernels


def fake_quant_channel_groups(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Per-channel asymmetric INT-b over groups of ``group`` consecutive tokens (KIVI's key rule, Sec. 3.2/3.3).

    ``x``: (..., T, d) with T a multiple of ``group``. For channel c of a group g: z = min_g x_c,
    s = (max_g x_c − z)/(2^b − 1), q = clamp(round((x − z)/s), 0, 2^b − 1), x̂ = q·s + z (a constant channel,
    s = 0, reconstructs exactly). Ranges come from the finite entries; NaN/±inf pass through. ``bits`` >= 16:
    unchanged.
    """
    if bits >= OFF_BITS:
        return x
    length, d = x.shape[-2], x.shape[-1]
    if group < 1 or length % group:
        raise KeyQuantError(f"the token count {length} is not a multiple of the token group {group}")
    if length == 0:
        return x
    w = _work(x)
    g = w.reshape(*w.shape[:-2], length // group, group, d)
    finite = torch.isfinite(g)
    lo = torch.where(finite, g, torch.full_like(g, math.inf)).amin(dim=-2, keepdim=True)
    hi = torch.where(finite, g, torch.full_like(g, -math.inf)).amax(dim=-2, keepdim=True)
    lo = torch.where(torch.isfinite(lo), lo, torch.zeros_like(lo))  # a channel with no finite entry
    hi = torch.where(torch.isfinite(hi), hi, torch.zeros_like(hi))
    maxq = (1 << bits) - 1
    scale = (hi - lo) / maxq
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((g - lo) / scale).clamp_(0, maxq)
    out = torch.minimum(q * scale + lo, hi).reshape(w.shape)
    return _back(out, x)


def _rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position·θ_k, (b, 1, T, K), angles in float64."""
    ang = positions.to(torch.float64).unsqueeze(-1) * inv_freq.to(device=positions.device, dtype=torch.float64)
    return torch.cos(ang).to(dtype).unsqueeze(1), torch.sin(ang).to(dtype).unsqueeze(1)


def apply_rope(x: torch.Tensor, inv_freq: Any, positions: torch.Tensor, layout: str = "rotate_half",
               inverse: bool = False) -> torch.Tensor:
    """RoPE R_p on x (b, H, T, d) at ``positions`` (b or 1, T), or its inverse R_p^T (``inverse``).

    Pair k (channels a, b of ``layout``) turns by p·θ_k: a' = a cos − b sin, b' = b cos + a sin. Computed in x's
    working dtype (float32 for half inputs) with the angles in float64.
    """
    layout = check_layout(layout)
    freq = torch.as_tensor(np.asarray(inv_freq, dtype=np.float64)) if not torch.is_tensor(inv_freq) else inv_freq
    w = _work(x)
    k = check_head_dim(w.shape[-1])
    if freq.numel() != k:
        raise KeyQuantError(f"inv_freq has {freq.numel()} frequencies, the head has {k} pairs")
    cos, sin = _rope_cos_sin(freq.reshape(-1), positions.to(w.device), w.dtype)
    if inverse:
        sin = -sin
    if layout == "rotate_half":
        a, b = w[..., :k], w[..., k:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    a, b = w[..., 0::2], w[..., 1::2]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)


def pair_energies(sum_aa: np.ndarray, sum_bb: np.ndarray, n: np.ndarray | float) -> np.ndarray:
    """Mean energy E[a² + b²] of every RoPE pair from raw moment sums (e.g. CalibrationStats.raw_moments("k"):
    sum_aa, sum_bb (L, H, K), n (L,)). RoPE turns a pair without changing a² + b², so pre- and post-RoPE energies
    agree; an R3 that mixes pairs changes them (the pipeline measures post-R3 keys instead)."""
    aa, bb = np.asarray(sum_aa, dtype=np.float64), np.asarray(sum_bb, dtype=np.float64)
    rows = np.asarray(n, dtype=np.float64)
    rows = rows.reshape(rows.shape + (1,) * (aa.ndim - rows.ndim))
    if np.any(rows <= 0):
        raise KeyQuantError("pair energies need at least one row per layer")
    return (aa + bb) / rows


def allocate_pair_bits(energies: Any, target: float, min_bits: int = 2, max_bits: int = 8) -> np.ndarray:
    """Integer bit widths per RoPE pair whose mean is exactly ``target``, more bits to higher-energy pairs.

    ``energies``: (..., K) non-negative (one allocation per leading index, e.g. per layer and KV head).
    Greedy marginal allocation on log2 energy: every pair starts at ``min_bits``; each of the K·(target −
    min_bits) added bits goes to the pair with the largest log2 E_k − 2 b_k below ``max_bits`` (the largest
    drop of the high-rate error E_k·4^(−b_k); ties to the lower pair index). This is the integer optimum of
    Σ_k E_k·4^(−b_k) under the budget (the marginal gains decrease), and E_i > E_j gives b_i >= b_j.
    Raises :class:`KeyQuantError` when integer widths in [min_bits, max_bits] cannot average ``target``
    (outside the range, or K·target not an integer).
    """
    lo, hi = _bits(min_bits, "k_min_bits"), _bits(max_bits, "k_max_bits")
    if lo > hi:
        raise KeyQuantError(f"k_min_bits {lo} exceeds k_max_bits {hi}")
    e = np.asarray(energies, dtype=np.float64)
    if e.ndim < 1 or e.shape[-1] < 1:
        raise KeyQuantError(f"energies must have a last axis of pairs, got shape {e.shape}")
    if not np.all(np.isfinite(e)) or np.any(e < 0):
        raise KeyQuantError("pair energies must be finite and non-negative")
    k = e.shape[-1]
    budget = _pair_budget(target, k, lo, hi)
    rows = e.reshape(-1, k)
    widths = np.full(rows.shape, lo, dtype=np.int64)
    score = np.log2(np.maximum(rows, np.finfo(np.float64).tiny)) - 2.0 * lo
    idx = np.arange(rows.shape[0])
    for _ in range(budget - k * lo):
        pick = np.argmax(np.where(widths < hi, score, -np.inf), axis=-1)
        widths[idx, pick] += 1
        score[idx, pick] -= 2.0
    return widths.reshape(e.shape)


def _pair_budget(target: float, k: int, lo: int, hi: int) -> int:
    """K·target as an integer number of bits per pair set, or KeyQuantError naming why it is unreachable."""
    if isinstance(target, bool) or not isinstance(target, numbers.Real) or not math.isfinite(target):
        raise KeyQuantError(f"the rope_pair_bits target must be a finite number, got {target!r}")
    if not lo <= target <= hi:
        raise KeyQuantError(f"rope_pair_bits: integer widths in [{lo}, {hi}] (k_min_bits, k_max_bits) cannot "
                            f"average {target} bits")
    total = k * float(target)
    if abs(total - round(total)) > 1e-9:
        raise KeyQuantError(f"rope_pair_bits: integer widths over {k} pairs cannot average {target} bits "
                            f"({k} × {target} = {total:g} is not an integer)")
    return int(round(total))


# ----------------------------------------------------------------------------- built quantisers


class KeyQuantizer:
    """One layer's key quantiser: ``q(key, positions=None)`` -> the dequantised key cache (b, H_kv, T, d).

    ``pre_rope``: the quantiser reads the post-RoPE key *before* R3 (it undoes RoPE itself); else it runs on the
    post-R3 key. ``streaming``: the cache state depends on the cache length (:meth:`quantized_prefix`); else the
    rule is token-local. ``needs_positions``: the call uses the keys' positions (default 0..T-1).
    """

    name: str = ""
    pre_rope: bool = False
    streaming: bool = False
    needs_positions: bool = False

    def __call__(self, key: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def quantized_prefix(self, length: Any) -> Any:
        """How many leading tokens of a cache of ``length`` tokens are quantised (an int or an integer tensor);
        a token-local quantiser quantises all of them."""
        return length


@dataclass
class PerTokenQuantizer(KeyQuantizer):
    """The default rule, :func:`~rope_quant.quant.quantizers.fake_quant` with a :class:`QuantConfig`."""

    cfg: QuantConfig
    name: str = KeyQuantName.PER_TOKEN.value

    def __call__(self, key: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return fake_quant(key, self.cfg) if self.cfg.enabled else key


@dataclass
class ChannelGroupQuantizer(KeyQuantizer):
    """Per-channel groups of ``group`` tokens, a window of the ``residual`` most recent tokens in full
    precision, and a group that is not yet complete in full precision (streaming)."""

    bits: int
    group: int
    residual: int = 0
    name: str = KeyQuantName.KIVI.value
    streaming: bool = True

    def quantized_prefix(self, length: Any) -> Any:
        """G·⌊max(T − R, 0)/G⌋: the complete groups older than the window."""
        if torch.is_tensor(length):
            return torch.div((length - self.residual).clamp(min=0), self.group, rounding_mode="floor") * self.group
        return max(int(length) - self.residual, 0) // self.group * self.group

    def _quantize(self, head: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        return fake_quant_channel_groups(head, self.bits, self.group)

    def __call__(self, key: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if self.bits >= OFF_BITS:
            return key
        n = self.quantized_prefix(key.shape[-2])
        if n == 0:
            return key
        pos = _check_positions(key, positions)[..., :n] if self.needs_positions else None
        head = self._quantize(key[..., :n, :], pos)
        return torch.cat([head.to(key.dtype), key[..., n:, :]], dim=-2)


@dataclass
class KiviQuantizer(ChannelGroupQuantizer):
    """KIVI's keys: per channel over groups of G tokens, the R most recent tokens in full precision."""


@dataclass
class PerTokenWindowQuantizer(ChannelGroupQuantizer):
    """The per-token rule ``cfg`` on KIVI's quantised prefix (complete groups of G tokens older than the window of
    R), the other tokens in full precision: KIVI's bits-matched reference. The rule is token-local, so only which
    tokens are quantised depends on the cache length (the streaming state KIVI has)."""

    cfg: QuantConfig = dataclasses.field(default_factory=QuantConfig)
    name: str = KeyQuantName.PER_TOKEN_WINDOW.value

    def _quantize(self, head: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        return fake_quant(head, self.cfg)


@dataclass
class KVQuantPreRoPEQuantizer(ChannelGroupQuantizer):
    """KVQuant's pre-RoPE keys: RoPE undone at each key's position (``inv_freq`` (K,), ``layout``), per-channel
    groups quantised, RoPE re-applied to the dequantised key. The post-RoPE key in, the post-RoPE key out: the
    undo and redo are exact up to float error (no quantisation: a round trip within a few ulps)."""

    inv_freq: Any = None
    layout: str = "rotate_half"
    name: str = KeyQuantName.KVQUANT_PREROPE.value
    pre_rope: bool = True
    needs_positions: bool = True

    def __post_init__(self) -> None:
        if self.inv_freq is None:
            raise KeyQuantError("kvquant_prerope needs the layer's RoPE inv_freq")
        self.inv_freq = torch.as_tensor(np.asarray(self.inv_freq, dtype=np.float64).reshape(-1))
        self._on: dict[torch.device, torch.Tensor] = {}  # inv_freq on each device used (one copy)
        check_layout(self.layout)

    def _quantize(self, head: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        assert positions is not None
        freq = self._on.get(head.device)
        if freq is None:
            freq = self._on.setdefault(head.device, self.inv_freq.to(head.device))
        pre = apply_rope(head, freq, positions, self.layout, inverse=True)
        deq = fake_quant_channel_groups(pre, self.bits, self.group)
        return _back(apply_rope(deq, freq, positions, self.layout), head)


@dataclass
class SinkQuantizer(KeyQuantizer):
    """The first ``sinks`` tokens (positions 0..S-1; a left pad's negative position is no sink) unquantised, every
    other token by the per-token rule ``cfg``."""

    cfg: QuantConfig
    sinks: int
    name: str = KeyQuantName.SINK.value
    needs_positions: bool = True

    def __call__(self, key: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if not self.cfg.enabled:
            return key
        out = fake_quant(key, self.cfg)
        if self.sinks == 0:
            return out
        pos = _check_positions(key, positions)
        keep = ((pos >= 0) & (pos < self.sinks))[:, None, :, None]
        return torch.where(keep, key, out)


@dataclass
class RopePairBitsQuantizer(KeyQuantizer):
    """Per-pair bit widths ``widths`` ((H_kv, K) or (K,) integers; both channels of a pair alike, 16 = full
    precision): per token and head, the channels of one width share one asymmetric range (the default rule's
    convention: 0 in range, Δ = (hi − lo)/(2^b − 1), z = round(−lo/Δ))."""

    widths: Any
    layout: str = "rotate_half"
    name: str = KeyQuantName.ROPE_PAIR_BITS.value

    def __post_init__(self) -> None:
        w = np.asarray(self.widths)
        if w.ndim not in (1, 2) or not np.issubdtype(w.dtype, np.integer):
            raise KeyQuantError(f"widths must be integers of shape (K,) or (H_kv, K), got {w.dtype} {w.shape}")
        if w.size and (w.min() < MIN_BITS or w.max() > MAX_BITS):
            raise KeyQuantError(f"widths must lie in {MIN_BITS}..{MAX_BITS}, got {w.min()}..{w.max()}")
        idx_a, idx_b = pair_indices(2 * w.shape[-1], check_layout(self.layout))
        per_channel = np.empty(w.shape[:-1] + (2 * w.shape[-1],), dtype=np.int64)
        per_channel[..., idx_a] = w
        per_channel[..., idx_b] = w
        self.widths = w.astype(np.int64)
        self._channels = torch.as_tensor(per_channel)
        self._on: dict[torch.device, torch.Tensor] = {}  # the per-channel widths on each device used (one copy)
        self._levels = sorted(int(b) for b in np.unique(w) if b < OFF_BITS)

    def __call__(self, key: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        chan = self._on.get(key.device)
        if chan is None:
            chan = self._on.setdefault(key.device, self._channels.to(key.device))
        if chan.dim() == 2:
            if chan.shape[0] != key.shape[1]:
                raise KeyQuantError(f"widths are given for {chan.shape[0]} KV heads, the key has {key.shape[1]}")
            chan = chan[:, None, :]  # (H, 1, d): broadcasts over (b, H, T, d)
        if chan.shape[-1] != key.shape[-1]:
            raise KeyQuantError(f"widths cover head_dim {chan.shape[-1]}, the key has {key.shape[-1]}")
        if not self._levels:
            return key
        w = _work(key)
        g = torch.where(torch.isfinite(w), w, torch.zeros_like(w))
        out = w
        for bits in self._levels:
            member = chan == bits
            lo = torch.where(member, g, torch.full_like(g, math.inf)).amin(dim=-1, keepdim=True).clamp(max=0.0)
            hi = torch.where(member, g, torch.full_like(g, -math.inf)).amax(dim=-1, keepdim=True).clamp(min=0.0)
            maxq = (1 << bits) - 1
            delta = (hi - lo) / maxq
            delta = torch.where(delta > 0, delta, torch.ones_like(delta))
            zero = torch.round(-lo / delta)
            deq = (torch.round(g / delta).add_(zero).clamp_(0, maxq).sub_(zero)).mul_(delta)
            out = torch.where(member, deq, out)
        return _back(out, key)


# ----------------------------------------------------------------------------- options


@dataclass(frozen=True)
class KeyQuantContext:
    """What building one layer's quantiser may need: geometry, the layer's RoPE frequencies and layout, and
    (for ``rope_pair_bits``) its pair energies (H_kv, K)."""

    head_dim: int
    n_kv_heads: int = 1
    inv_freq: Any = None
    layout: str = "rotate_half"
    energies: Any = None


@dataclass(frozen=True)
class KeyQuantOption:
    """Base of the options: a frozen dataclass of checked parameters, ``bits`` (the cell's ``k_bits``) first.

    Class attributes: ``name`` (registry name), ``paper`` (source), ``online_step`` (what decoding needs
    besides reading codes), ``spec_params`` (config field of :class:`~rope_quant.experiment.specs.KeyQuantSpec`
    -> option field), ``token_settings`` (takes the per-token ``k_group`` / ``k_clip`` / ``k_symmetric``),
    ``needs_energies`` (built from pair energies), ``pre_rope`` (runs on the pre-RoPE key), ``source``.
    """

    bits: int = 4

    name: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    online_step: ClassVar[str] = "none"
    spec_params: ClassVar[Mapping[str, str]] = {}
    token_settings: ClassVar[bool] = False
    needs_energies: ClassVar[bool] = False
    pre_rope: ClassVar[bool] = False
    source: ClassVar[str] = "rope_quant"

    def __post_init__(self) -> None:
        _bits(self.bits, "k_bits")

    def bits_per_element(self, head_dim: int, seq_len: int, **kwargs: Any) -> float:
        """Storage bits per key element of a cache of ``seq_len`` tokens and ``head_dim`` channels per head:
        payload, scales and zero points (16 bits each), and full-precision elements (16 bits)."""
        raise NotImplementedError

    def build(self, ctx: KeyQuantContext) -> KeyQuantizer:
        """This option's quantiser for one layer."""
        raise NotImplementedError


def _geometry(head_dim: Any, seq_len: Any) -> tuple[int, int]:
    return check_head_dim(_int_in(head_dim, "head_dim", 2)) * 2, _int_in(seq_len, "seq_len", 1)


def _token_overhead(bits: int, group: int, head_dim: int, symmetric: bool) -> float:
    """Bits per element of the per-token rule: b + (scale [+ zero point]) / group; 16 when off."""
    if bits >= OFF_BITS:
        return float(FULL_BITS)
    g = head_dim if group == -1 else group
    return bits + SCALE_BITS * (1 if symmetric else 2) / g


@dataclass(frozen=True)
class PerTokenOption(KeyQuantOption):
    """The paper's rule (the default): asymmetric INT-b per token over groups of ``group_size`` channels
    (-1: the whole head), the range scaled by ``clip_ratio``; ``symmetric`` stores no zero point."""

    group_size: int = -1
    clip_ratio: float = 1.0
    symmetric: bool = False

    name: ClassVar[str] = KeyQuantName.PER_TOKEN.value
    paper: ClassVar[str] = "QuaRot / SpinQuant / DartQuant's dynamic per-token KV quantiser (the paper, Sec. 4, A.6)"
    online_step: ClassVar[str] = "none"
    token_settings: ClassVar[bool] = True

    def __post_init__(self) -> None:
        # The default rule keeps the config's own check (bits >= 2, >= 16 = off) so no existing cell changes.
        _int_in(self.bits, "k_bits", MIN_BITS)
        self.config()

    def config(self) -> QuantConfig:
        return QuantConfig(bits=self.bits, group_size=self.group_size, clip_ratio=self.clip_ratio,
                           symmetric=self.symmetric)

    def bits_per_element(self, head_dim: int, seq_len: int, **kwargs: Any) -> float:
        d, _ = _geometry(head_dim, seq_len)
        return _token_overhead(self.bits, self.group_size, d, self.symmetric)

    def build(self, ctx: KeyQuantContext) -> KeyQuantizer:
        return PerTokenQuantizer(self.config())


def _window_bits(bits: int, group: int, residual: int, head_dim: int, seq_len: int) -> float:
    """Per-channel groups: n = G·⌊max(T − R, 0)/G⌋ tokens at b + 2·16/G bits (a scale and a zero point per
    channel per group), the other T − n tokens at 16 bits."""
    if bits >= OFF_BITS:
        return float(FULL_BITS)
    n = max(seq_len - residual, 0) // group * group
    return (n * (bits + 2 * SCALE_BITS / group) + (seq_len - n) * FULL_BITS) / seq_len


@dataclass(frozen=True)
class KiviOption(KeyQuantOption):
    """KIVI's keys: per channel over groups of ``group`` tokens (min/max), the ``residual`` most recent tokens
    and a group not yet complete in full precision (R >= G)."""

    group: int = 32
    residual: int = 128

    name: ClassVar[str] = KeyQuantName.KIVI.value
    paper: ClassVar[str] = ("KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache (Liu et al., ICML 2024; "
                            "arXiv:2402.02750), Sec. 3.3 and Algorithm 1")
    online_step: ClassVar[str] = ("full-precision window of R tokens: each new key is kept in 16 bits until its "
                                  "group of G leaves the window, then the group is quantised per channel")
    spec_params: ClassVar[Mapping[str, str]] = {"token_group": "group", "residual": "residual"}

    def __post_init__(self) -> None:
        super().__post_init__()
        _int_in(self.group, "k_token_group", 1)
        _int_in(self.residual, "k_residual", 0)
        if self.residual < self.group:
            raise KeyQuantError(f"kivi: the full-precision window k_residual={self.residual} is smaller than the "
                                f"token group k_token_group={self.group} (KIVI needs R >= G)")

    def bits_per_element(self, head_dim: int, seq_len: int, **kwargs: Any) -> float:
        d, t = _geometry(head_dim, seq_len)
        return _window_bits(self.bits, self.group, self.residual, d, t)

    def build(self, ctx: KeyQuantContext) -> KeyQuantizer:
        return KiviQuantizer(self.bits, self.group, self.residual)


@dataclass(frozen=True)
class KVQuantPreRoPEOption(KeyQuantOption):
    """KVQuant's pre-RoPE per-channel keys: per channel over groups of ``group`` tokens (min/max) on the key
    before RoPE, a group not yet complete in full precision; RoPE re-applied to the dequantised key."""

    group: int = 128

    name: ClassVar[str] = KeyQuantName.KVQUANT_PREROPE.value
    paper: ClassVar[str] = ("KVQuant: Towards 10 Million Context Length LLM Inference with KV Cache Quantization "
                            "(Hooper et al., NeurIPS 2024; arXiv:2401.18079), Sec. 3.1-3.2 (per-channel, "
                            "pre-RoPE keys)")
    online_step: ClassVar[str] = ("RoPE re-applied after dequantisation (the cache holds pre-RoPE codes); the "
                                  "group being filled stays in 16 bits")
    spec_params: ClassVar[Mapping[str, str]] = {"token_group": "group"}
    pre_rope: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        _int_in(self.group, "k_token_group", 1)

    def bits_per_element(self, head_dim: int, seq_len: int, **kwargs: Any) -> float:
        d, t = _geometry(head_dim, seq_len)
        return _window_bits(self.bits, self.group, 0, d, t)

    def build(self, ctx: KeyQuantContext) -> KeyQuantizer:
        if ctx.inv_freq is None:
            raise KeyQuantError("kvquant_prerope needs the layer's RoPE inv_freq")
        return KVQuantPreRoPEQuantizer(self.bits, self.group, 0, inv_freq=ctx.inv_freq, layout=ctx.layout)


@dataclass(frozen=True)
class RopePairBitsOption(KeyQuantOption):
    """Integer widths per RoPE pair in [``min_bits``, ``max_bits``] averaging ``target`` (``avg_bits`` when
    given, else ``bits``), allocated from the pairs' energies (:func:`allocate_pair_bits`)."""

    min_bits: int = 2
    max_bits: int = 8
    avg_bits: float | None = None

    name: ClassVar[str] = KeyQuantName.ROPE_PAIR_BITS.value
    paper: ClassVar[str] = ("reverse water-filling of transform coding (bits follow ½·log2 of the component "
                            "variance; Huang & Schultheiss 1963, Gersho & Gray 1992 Ch. 8) applied to RoPE "
                            "frequency pairs")
    online_step: ClassVar[str] = "none (the widths are fixed per layer and head after calibration)"
    spec_params: ClassVar[Mapping[str, str]] = {"min_bits": "min_bits", "max_bits": "max_bits",
                                                "avg_bits": "avg_bits"}
    needs_energies: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        lo, hi = _bits(self.min_bits, "k_min_bits"), _bits(self.max_bits, "k_max_bits")
        if lo > hi:
            raise KeyQuantError(f"rope_pair_bits: k_min_bits {lo} exceeds k_max_bits {hi}")
        if self.avg_bits is not None and (isinstance(self.avg_bits, bool) or not isinstance(
                self.avg_bits, numbers.Real) or not math.isfinite(self.avg_bits)):
            raise KeyQuantError(f"k_avg_bits must be a finite number, got {self.avg_bits!r}")
        if not lo <= self.target <= hi:
            raise KeyQuantError(f"rope_pair_bits: integer widths in [{lo}, {hi}] (k_min_bits, k_max_bits) cannot "
                                f"average the target {self.target} bits")

    @property
    def target(self) -> float:
        """The mean bits per element the widths reach."""
        return float(self.bits if self.avg_bits is None else self.avg_bits)

    def check_head_dim(self, head_dim: int) -> None:
        """KeyQuantError when integer widths over head_dim/2 pairs cannot average the target."""
        _pair_budget(self.target, check_head_dim(head_dim), self.min_bits, self.max_bits)

    def allocate(self, energies: Any) -> np.ndarray:
        """The widths of ``energies`` (..., K)."""
        return allocate_pair_bits(energies, self.target, self.min_bits, self.max_bits)

    def bits_per_element(self, head_dim: int, seq_len: int, widths: Any = None, **kwargs: Any) -> float:
        """Payload Σ 2·b_k (16-bit pairs at 16), plus a scale and a zero point per token for each width below
        16 that a head uses, per element, averaged over heads. Without ``widths`` (before calibration): the
        target plus the most such groups there can be (an upper bound)."""
        d, _ = _geometry(head_dim, seq_len)
        k = d // 2
        if widths is None:
            self.check_head_dim(d)
            groups = min(k, sum(1 for b in range(self.min_bits, self.max_bits + 1) if b < OFF_BITS))
            return self.target + 2 * SCALE_BITS * groups / d
        w = np.asarray(widths).reshape(-1, k)
        total = 0.0
        for row in w:
            quantised = {int(b) for b in row if b < OFF_BITS}
            total += (2 * float(row.sum()) + 2 * SCALE_BITS * len(quantised)) / d
        return total / w.shape[0]

    def build(self, ctx: KeyQuantContext) -> KeyQuantizer:
        if ctx.energies is None:
            raise KeyQuantError("rope_pair_bits needs the layer's pair energies (H_kv, K)")
        return RopePairBitsQuantizer(self.allocate(ctx.energies), layout=ctx.layout)


@dataclass(frozen=True)
class SinkOption(KeyQuantOption):
    """RotateKV's attention-sink protection: the first ``sinks`` tokens in 16 bits, the others by the per-token
    rule (``group_size``, ``clip_ratio``, ``symmetric`` as for ``per_token``)."""

    sinks: int = 4
    group_size: int = -1
    clip_ratio: float = 1.0
    symmetric: bool = False

    name: ClassVar[str] = KeyQuantName.SINK.value
    paper: ClassVar[str] = ("RotateKV: Accurate and Robust 2-Bit KV Cache Quantization for LLMs via Outlier-Aware "
                            "Adaptive Rotations (Su et al., IJCAI 2025; arXiv:2501.16383), attention-sink-aware "
                            "quantisation")
    online_step: ClassVar[str] = "first S tokens kept in 16 bits"
    spec_params: ClassVar[Mapping[str, str]] = {"sinks": "sinks"}
    token_settings: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        _int_in(self.sinks, "k_sinks", 0)
        self.config()

    def config(self) -> QuantConfig:
        return QuantConfig(bits=self.bits, group_size=self.group_size, clip_ratio=self.clip_ratio,
                           symmetric=self.symmetric)

    def bits_per_element(self, head_dim: int, seq_len: int, **kwargs: Any) -> float:
        d, t = _geometry(head_dim, seq_len)
        s = min(self.sinks, t)
        return (s * FULL_BITS + (t - s) * _token_overhead(self.bits, self.group_size, d, self.symmetric)) / t

    def build(self, ctx: KeyQuantContext) -> KeyQuantizer:
        return SinkQuantizer(self.config(), self.sinks)


@dataclass(frozen=True)
class PerTokenWindowOption(KeyQuantOption):
    """KIVI's bits-matched reference: the per-token rule (``group_size``, ``clip_ratio``, ``symmetric`` as for
    ``per_token``) on the tokens KIVI quantises, and KIVI's full-precision tokens (the ``residual`` most recent and
    the group of ``group`` being filled) in 16 bits. With G = head_dim and a whole-head per-token group, a token
    costs b + 32/d in both, so the two store the same bits at every T (KIVI Sec. 3.3, Algorithm 1)."""

    group: int = 32
    residual: int = 128
    group_size: int = -1
    clip_ratio: float = 1.0
    symmetric: bool = False

    name: ClassVar[str] = KeyQuantName.PER_TOKEN_WINDOW.value
    paper: ClassVar[str] = ("KIVI's full-precision tokens (Liu et al., ICML 2024; arXiv:2402.02750, Sec. 3.3, "
                            "Algorithm 1) around the paper's dynamic per-token rule (Sec. 4, A.6): KIVI's "
                            "reference at equal bits")
    online_step: ClassVar[str] = ("full-precision window of R tokens: each new key is kept in 16 bits until its "
                                  "group of G leaves the window, then its tokens are quantised per token")
    spec_params: ClassVar[Mapping[str, str]] = {"token_group": "group", "residual": "residual"}
    token_settings: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        _int_in(self.group, "k_token_group", 1)
        _int_in(self.residual, "k_residual", 0)
        if self.residual < self.group:
            raise KeyQuantError(f"per_token_window: the full-precision window k_residual={self.residual} is smaller "
                                f"than the token group k_token_group={self.group} (KIVI's window: R >= G)")
        self.config()

    def config(self) -> QuantConfig:
        return QuantConfig(bits=self.bits, group_size=self.group_size, clip_ratio=self.clip_ratio,
                           symmetric=self.symmetric)

    def bits_per_element(self, head_dim: int, seq_len: int, **kwargs: Any) -> float:
        """With n = G·⌊max(T − R, 0)/G⌋ (KIVI's count): (n·(b + 32/g) + (T − n)·16)/T, g the per-token group."""
        d, t = _geometry(head_dim, seq_len)
        if self.bits >= OFF_BITS:
            return float(FULL_BITS)
        n = max(t - self.residual, 0) // self.group * self.group
        return (n * _token_overhead(self.bits, self.group_size, d, self.symmetric) + (t - n) * FULL_BITS) / t

    def build(self, ctx: KeyQuantContext) -> KeyQuantizer:
        return PerTokenWindowQuantizer(self.bits, self.group, self.residual, cfg=self.config())


# ----------------------------------------------------------------------------- the registry


_REGISTRY: dict[str, type[KeyQuantOption]] = {}
_loaded = False


def register(option: type[KeyQuantOption]) -> type[KeyQuantOption]:
    """Add an option class (a frozen :class:`KeyQuantOption` subclass with a ``name``); a taken name raises
    :class:`KeyQuantNameClashError`. Returns it (usable as a class decorator)."""
    if not (isinstance(option, type) and issubclass(option, KeyQuantOption)) or not dataclasses.is_dataclass(option):
        raise KeyQuantError(f"register() takes a KeyQuantOption dataclass, got {option!r}")
    name = option.name
    if not isinstance(name, str) or not name or not name.replace("_", "").isalnum():
        raise KeyQuantError(f"a key quantiser name must be a non-empty identifier-like string, got {name!r}")
    taken = _REGISTRY.get(name)
    if taken is not None:
        raise KeyQuantNameClashError(f"key quantiser {name!r} is already registered (by {taken.source}); "
                                     "choose another name")
    fields = {f.name for f in dataclasses.fields(option)}
    bad = sorted(set(option.spec_params.values()) - fields)
    if bad:
        raise KeyQuantError(f"{name}: spec_params name fields it does not have: {bad}")
    _REGISTRY[name] = option
    return option


def unregister(name: str) -> None:
    """Remove a foreign option (tests, interactive use); built-in ones cannot be removed."""
    option = _REGISTRY.get(name)
    if option is None:
        raise UnknownKeyQuantError(f"unknown key quantiser {name!r}")
    if option.source == "rope_quant":
        raise KeyQuantNameClashError(f"{name!r} is built in and cannot be unregistered")
    del _REGISTRY[name]


for _option in (PerTokenOption, KiviOption, KVQuantPreRoPEOption, RopePairBitsOption, SinkOption,
                PerTokenWindowOption):
    register(_option)
assert list(_REGISTRY) == [m.value for m in KeyQuantName]


def _options_of(obj: Any) -> list[type[KeyQuantOption]]:
    if isinstance(obj, type):
        return [obj]
    if callable(obj):
        obj = obj()
    if isinstance(obj, type):
        return [obj]
    if isinstance(obj, Iterable):
        return list(obj)
    raise KeyQuantError(f"expected a KeyQuantOption class or an iterable of them, got {type(obj).__name__}")


def load_entry_points(force: bool = False) -> list[str]:
    """Register the ``rope_quant.key_quant`` entry points (once; ``force`` rescans). Returns the names added."""
    global _loaded
    if _loaded and not force:
        return []
    _loaded = True
    from importlib.metadata import entry_points

    added: list[str] = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        where = f"entry point {ep.name!r} ({ep.value}) of group {ENTRY_POINT_GROUP!r}"
        try:
            options = _options_of(ep.load())
            for option in options:
                if _REGISTRY.get(str(getattr(option, "name", ""))) is option:
                    continue
                register(option)
                added.append(option.name)
        except Exception as exc:  # a broken plugin must not break the registry
            warnings.warn(f"skipping {where}: {type(exc).__name__}: {exc}", KeyQuantWarning, stacklevel=2)
    return added


def _all() -> dict[str, type[KeyQuantOption]]:
    if not _loaded:
        load_entry_points()
    return _REGISTRY


def names() -> list[str]:
    """The registered names: the built-ins in :class:`KeyQuantName` order, then foreign ones."""
    return list(_all())


def closest_names(name: str, n: int = 3) -> list[str]:
    """Up to ``n`` registered names closest to ``name`` (difflib)."""
    return difflib.get_close_matches(str(name), names(), n=n, cutoff=0.5)


def option_class(name: Any) -> type[KeyQuantOption]:
    """The option class of ``name`` (:class:`UnknownKeyQuantError` with the closest names otherwise)."""
    key = name.value if isinstance(name, KeyQuantName) else name
    try:
        return _all()[key]
    except (KeyError, TypeError):
        close = closest_names(key) if isinstance(key, str) else []
        hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
        raise UnknownKeyQuantError(f"unknown key quantiser {name!r}{hint}; valid: {', '.join(names())}") from None


def spec_defaults(name: Any) -> dict[str, Any]:
    """The defaults of the config fields ``name`` takes (config field -> the option field's default)."""
    cls = option_class(name)
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    return {spec: defaults[field] for spec, field in cls.spec_params.items()}


def option_from(name: Any, k: QuantConfig, **params: Any) -> KeyQuantOption:
    """The option ``name`` built from the cell's K settings ``k`` (bits; group, clip and symmetric for the
    per-token rules) and config fields ``params`` (``token_group``, ``residual``, ``sinks``, ``min_bits``,
    ``max_bits``, ``avg_bits``; None = the option's default). A parameter the option does not take must be
    None, and the per-token settings must keep their defaults for an option that has none: a
    :class:`KeyQuantError` names the flat config field otherwise."""
    cls = option_class(name)
    kwargs: dict[str, Any] = {"bits": k.bits}
    if cls.token_settings:
        kwargs.update(group_size=k.group_size, clip_ratio=k.clip_ratio, symmetric=k.symmetric)
    else:
        plain = QuantConfig(bits=k.bits)
        changed = [flat for flat, attr in (("k_group", "group_size"), ("k_clip", "clip_ratio"),
                                           ("k_symmetric", "symmetric")) if getattr(k, attr) != getattr(plain, attr)]
        if changed:
            takers = [n for n, c in _all().items() if c.token_settings]
            raise KeyQuantError(f"{', '.join(changed)} set the per-token rule's groups, clip and symmetry: they "
                                f"apply to {' and '.join(takers)}, not to {cls.name}")
    for spec_name, value in params.items():
        if value is None:
            continue
        if spec_name not in cls.spec_params:
            takes = ", ".join(f"k_{p}" for p in cls.spec_params) or "no parameter of its own"
            raise KeyQuantError(f"k_{spec_name} does not apply to the key quantiser {cls.name} (it takes {takes})")
        kwargs[cls.spec_params[spec_name]] = value
    try:
        return cls(**kwargs)
    except KeyQuantError:
        raise
    except QuantConfigError as exc:  # the per-token rule's own checks (group, clip)
        raise KeyQuantError(f"{cls.name}: {exc}") from None


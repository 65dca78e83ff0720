"""The built key quantisers (one per layer): the per-token rule, per-channel token groups (KIVI Sec. 3.2–3.3),
their pre-RoPE form (KVQuant Sec. 3.1–3.2), the per-token rule on KIVI's quantised tokens, attention sinks in 16 bits
(RotateKV) and per-pair widths; each called on the key cache (b, H_kv, T, d)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

import rope_quant.quant.keys.ggml as ggml
from rope_quant.core.rope import check_layout, pair_indices
from rope_quant.quant.keys.base import MAX_BITS, MIN_BITS, KeyQuantError, KeyQuantName, _back, _check_positions, _work
from rope_quant.quant.keys.rope import apply_rope
from rope_quant.quant.quantizers import OFF_BITS, QuantConfig, fake_quant


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


@dataclass
class GgmlQuantizer(KeyQuantizer):
    """llama.cpp's K-cache format ``fmt``: each key row quantised in blocks of 32 and read back
    (:func:`~rope_quant.quant.keys.ggml.fake_quant_ggml`); token-local. ``runtime_row``: the attention gives it
    the key in llama.cpp's element order (:func:`~rope_quant.rotations.runtime_rotation.runtime_row_order`), whose
    blocks of 32 the runtime quantises."""

    fmt: ggml.GgmlFormat = ggml.GgmlFormat.Q4_0
    name: str = KeyQuantName.GGML_Q4_0.value
    runtime_row: ClassVar[bool] = True

    def __call__(self, key: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return ggml.fake_quant_ggml(key, self.fmt)

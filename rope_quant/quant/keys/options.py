"""The key-quantiser options: a frozen dataclass of checked parameters each, with its source paper, its online
step, its storage in bits per key element (payload, scales and zero points at 16 bits, full-precision tokens at 16
bits) and its per-layer quantiser."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

import rope_quant.quant.keys.ggml as ggml
from rope_quant.core.rope import check_head_dim
from rope_quant.quant.keys.allocation import _pair_budget, allocate_pair_bits
from rope_quant.quant.keys.base import (
    FULL_BITS,
    MIN_BITS,
    SCALE_BITS,
    KeyQuantError,
    KeyQuantName,
    _bits,
    _int_in,
)
from rope_quant.quant.keys.quantizers import (
    GgmlQuantizer,
    KeyQuantizer,
    KiviQuantizer,
    KVQuantPreRoPEQuantizer,
    PerTokenQuantizer,
    PerTokenWindowQuantizer,
    RopePairBitsQuantizer,
    SinkQuantizer,
)
from rope_quant.quant.quantizers import OFF_BITS, QuantConfig


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

    def quantized_tokens(self, seq_len: int) -> int:
        """How many of a cache's ``seq_len`` tokens hold quantised keys (the others are in 16 bits): every one for
        a token-local rule at fewer than 16 bits."""
        return 0 if self.bits >= OFF_BITS else int(seq_len)


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
    n = _window_tokens(group, residual, seq_len)
    return (n * (bits + 2 * SCALE_BITS / group) + (seq_len - n) * FULL_BITS) / seq_len


def _window_tokens(group: int, residual: int, seq_len: int) -> int:
    """G·⌊max(T − R, 0)/G⌋: the complete groups of G tokens older than the window of R (streaming groups)."""
    return max(int(seq_len) - residual, 0) // group * group


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

    def quantized_tokens(self, seq_len: int) -> int:
        return 0 if self.bits >= OFF_BITS else _window_tokens(self.group, self.residual, seq_len)

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

    def quantized_tokens(self, seq_len: int) -> int:
        return 0 if self.bits >= OFF_BITS else _window_tokens(self.group, 0, seq_len)

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

    def quantized_tokens(self, seq_len: int) -> int:
        return 0 if self.bits >= OFF_BITS else max(int(seq_len) - self.sinks, 0)

    def build(self, ctx: KeyQuantContext) -> KeyQuantizer:
        return SinkQuantizer(self.config(), self.sinks)


@dataclass(frozen=True)
class PerTokenWindowOption(KeyQuantOption):
    """The bits-matched reference of the streaming group quantisers: the per-token rule (``group_size``,
    ``clip_ratio``, ``symmetric`` as for ``per_token``) on exactly the tokens KIVI quantises, and KIVI's
    full-precision tokens (the ``residual`` most recent and the group of ``group`` being filled) in 16 bits. With
    G = head_dim and a whole-head per-token group, a token costs b + 32/d in both, so the two store the same bits
    at every T (KIVI Sec. 3.3, Algorithm 1). ``residual`` 0 (no window) gives KVQuant's streaming groups
    (``kvquant_prerope`` holds the group being filled in 16 bits): its reference at every T."""

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
        if 0 < self.residual < self.group:
            raise KeyQuantError(f"per_token_window: the full-precision window k_residual={self.residual} is smaller "
                                f"than the token group k_token_group={self.group} (KIVI's window: R >= G; R = 0: no "
                                "window, KVQuant's groups)")
        self.config()

    def config(self) -> QuantConfig:
        return QuantConfig(bits=self.bits, group_size=self.group_size, clip_ratio=self.clip_ratio,
                           symmetric=self.symmetric)

    def bits_per_element(self, head_dim: int, seq_len: int, **kwargs: Any) -> float:
        """With n = G·⌊max(T − R, 0)/G⌋ (KIVI's count): (n·(b + 32/g) + (T − n)·16)/T, g the per-token group."""
        d, t = _geometry(head_dim, seq_len)
        if self.bits >= OFF_BITS:
            return float(FULL_BITS)
        n = _window_tokens(self.group, self.residual, t)
        return (n * _token_overhead(self.bits, self.group_size, d, self.symmetric) + (t - n) * FULL_BITS) / t

    def quantized_tokens(self, seq_len: int) -> int:
        return 0 if self.bits >= OFF_BITS else _window_tokens(self.group, self.residual, seq_len)

    def build(self, ctx: KeyQuantContext) -> KeyQuantizer:
        return PerTokenWindowQuantizer(self.bits, self.group, self.residual, cfg=self.config())


@dataclass(frozen=True)
class GgmlOption(KeyQuantOption):
    """Base of llama.cpp's K-cache formats (:mod:`rope_quant.quant.keys.ggml`): blocks of 32 along each key row
    (per token and head), ggml's reference rounding, f16 scales. ``bits`` (the cell's ``k_bits``) must be the
    format's code width (4, or 8 for q8_0)."""

    fmt: ClassVar[ggml.GgmlFormat] = ggml.GgmlFormat.Q4_0
    paper: ClassVar[str] = ("llama.cpp's quantised K cache (``-ctk``; ggml's reference quantisers, "
                            "ggml/src/ggml-quants.c, as its CPU backend writes the cache)")
    online_step: ClassVar[str] = "none (token-local: each key row is quantised in blocks of 32 as it enters the cache)"

    def __post_init__(self) -> None:
        super().__post_init__()
        width = ggml.code_bits(self.fmt)
        if self.bits != width:
            raise KeyQuantError(f"{self.name} stores {width}-bit codes: it needs k_bits {width}, got {self.bits}")

    def check_head_dim(self, head_dim: int) -> None:
        """KeyQuantError when ``head_dim`` is not a multiple of the block of 32."""
        ggml.check_row(head_dim)

    def bits_per_element(self, head_dim: int, seq_len: int, **kwargs: Any) -> float:
        """The code width plus the block's 16-bit scale (and q4_1's minimum) over its 32 elements."""
        d, _ = _geometry(head_dim, seq_len)
        self.check_head_dim(d)
        return ggml.code_bits(self.fmt) + SCALE_BITS * ggml.scales_per_block(self.fmt) / ggml.BLOCK

    def build(self, ctx: KeyQuantContext) -> KeyQuantizer:
        self.check_head_dim(ctx.head_dim)
        return GgmlQuantizer(self.fmt, name=self.name)


@dataclass(frozen=True)
class GgmlQ40Option(GgmlOption):
    """ggml ``q4_0``: symmetric 4-bit, the scale from the signed extreme (m/−8); 4.5 bits per element."""

    name: ClassVar[str] = KeyQuantName.GGML_Q4_0.value
    fmt: ClassVar[ggml.GgmlFormat] = ggml.GgmlFormat.Q4_0


@dataclass(frozen=True)
class GgmlQ41Option(GgmlOption):
    """ggml ``q4_1``: asymmetric 4-bit (min and step, both f16); 5.0 bits per element."""

    name: ClassVar[str] = KeyQuantName.GGML_Q4_1.value
    fmt: ClassVar[ggml.GgmlFormat] = ggml.GgmlFormat.Q4_1


@dataclass(frozen=True)
class GgmlIQ4NLOption(GgmlOption):
    """ggml ``iq4_nl``: a non-linear 4-bit grid with a least-squares scale; 4.5 bits per element."""

    name: ClassVar[str] = KeyQuantName.GGML_IQ4_NL.value
    fmt: ClassVar[ggml.GgmlFormat] = ggml.GgmlFormat.IQ4_NL


@dataclass(frozen=True)
class GgmlQ80Option(GgmlOption):
    """ggml ``q8_0``: symmetric 8-bit (max|x|/127, round half away from zero); 8.5 bits per element."""

    bits: int = 8

    name: ClassVar[str] = KeyQuantName.GGML_Q8_0.value
    fmt: ClassVar[ggml.GgmlFormat] = ggml.GgmlFormat.Q8_0

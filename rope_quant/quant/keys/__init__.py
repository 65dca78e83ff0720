"""Key quantisers: the other answers to 4-bit keys, one registry beside R3 (docs/key_quantizers.md).

The package: ``base.py`` (names, constants, errors, checks), ``rope.py`` (RoPE undone and redone), ``allocation.py``
(rope_pair_bits' widths), ``quantizers.py`` (the built per-layer quantisers), ``options.py`` (the options and their
bits) and ``registry.py`` (names to options, entry points). The old path ``rope_quant.quant.key_quantizers`` is this
package, with a DeprecationWarning (:mod:`rope_quant._deprecation`).

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

from rope_quant.quant.keys.allocation import allocate_pair_bits, pair_energies
from rope_quant.quant.keys.base import (
    DEFAULT_KEY_QUANT,
    ENTRY_POINT_GROUP,
    FULL_BITS,
    MAX_BITS,
    MIN_BITS,
    SCALE_BITS,
    KeyQuantError,
    KeyQuantName,
    KeyQuantNameClashError,
    KeyQuantWarning,
    UnknownKeyQuantError,
)
from rope_quant.quant.keys.options import (
    KeyQuantContext,
    KeyQuantOption,
    KiviOption,
    KVQuantPreRoPEOption,
    PerTokenOption,
    PerTokenWindowOption,
    RopePairBitsOption,
    SinkOption,
)
from rope_quant.quant.keys.quantizers import (
    ChannelGroupQuantizer,
    KeyQuantizer,
    KiviQuantizer,
    KVQuantPreRoPEQuantizer,
    PerTokenQuantizer,
    PerTokenWindowQuantizer,
    RopePairBitsQuantizer,
    SinkQuantizer,
    fake_quant_channel_groups,
)
from rope_quant.quant.keys.registry import (
    closest_names,
    load_entry_points,
    names,
    option_class,
    option_from,
    register,
    spec_defaults,
    unregister,
)
from rope_quant.quant.keys.rope import apply_rope

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

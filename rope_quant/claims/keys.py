"""Beyond the paper: the other answers to 4-bit keys against the online Hadamard R3, at equal bits per key element.

The field answers 4-bit keys without an online rotation by changing the key quantiser (docs/key_quantizers.md):
KIVI quantises keys per channel with a full-precision window of recent tokens (Liu et al. 2024, Sec. 3), KVQuant
quantises them per channel before RoPE (Hooper et al. 2024, Sec. 3.1–3.2), rate-distortion theory gives RoPE pairs
with more energy more bits (transform coding: Huang & Schultheiss 1963), and RotateKV keeps the attention-sink
tokens in 16 bits (Su et al. 2025). Each entry here asks whether a scheme, with no R3 or with the best R3 that
folds into the weights, replaces the paper's per-token quantiser with the online Hadamard:

    ppl(scheme + R3) − ppl(reference + online Hadamard) < +margin

(:attr:`~rope_quant.core.verdict.Form.NON_SUPERIOR` with the equivalence margin of the paper's claims, the
reference cell's ±0.05 PPL scaled by its ppl: holds = it replaces the online Hadamard at equal bits; refuted =
worse by more than the margin). Every pair of cells stores the same bits per key element at the evaluation
windows' T (``equal_bits``: checked from the configs before any model loads, and on the measured bits after
calibration). At T = 512 (the e2e budget) with head_dim d, the paper's rule (4 bits, whole-head asymmetric)
stores 4 + 32/d:

* ``kvquant`` — ``kvquant_prerope`` with G = d tokens per channel group stores 4 + 32/d at T (d | T), but the
  queries of a window read its open group in 16 bits (bits.attended): the reference is ``per_token_window`` with
  R = 0, the per-token rule on exactly KVQuant's complete groups;
* ``pairbits`` — ``rope_pair_bits`` with widths in {3, 4} averaging 4 − 32/d: both widths in every head, so
  payload + two per-token ranges = 4 + 32/d (the calibrated allocation's bits are recorded and compared);
* ``sink`` — no sink setting matches 4 + 32/d at T = 512: the reference is the per-token rule with the online
  Hadamard and the same S = 4 sink tokens in 16 bits;
* ``kivi`` — KIVI's full-precision window cannot match either: the reference is ``per_token_window``, the
  per-token rule with exactly KIVI's full-precision tokens. KIVI with G = R = d: R = G is the smallest window KIVI
  allows (R >= G), so the most tokens are quantised at T = 512 (a larger R leaves Gemma 3's d = 256 with no
  complete group outside the window); with G = d a quantised token costs 4 + 32/d in both.

Each scheme × R3 (``id``: identity; ``fold``: the best foldable R3 of the architecture,
:func:`rope_quant.claims.premises.best_foldable_r3`) × setting (``KV4``: 4-bit keys alone, W16A16K4V16 with
unquantised weights and no R1, R2 or R4, as the cross-model KV-only claims; ``W4A4KV4``: the paper's pipeline) is
one claim, id ``K-<scheme>-<id|fold>-<KV4|W4A4KV4>``. The model-dependent values (G = d, the mean width, the best
foldable R3) are :class:`~rope_quant.claims.registry.Resolve` sentinels, resolved from the model's config.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# the paper's entries register first (its module is imported here); PIPELINE: the W4A4KV4 pipeline's premises
from rope_quant.claims.paper import PIPELINE
from rope_quant.claims.registry import (
    KEYS,
    Claim,
    MarginRule,
    Override,
    Part,
    Premise,
    Resolve,
    cell,
    register,
)
from rope_quant.core.verdict import Form
from rope_quant.defaults import KEYS_ALONE

SETTINGS: dict[str, tuple[dict[str, Override], tuple[Premise, ...], str]] = {
    "KV4": (dict(KEYS_ALONE), (Premise.ROPE,), "4-bit keys alone (W16A16K4V16: unquantised weights, no R1, R2 or R4)"),
    "W4A4KV4": ({"w_bits": 4, "a_bits": 4, "k_bits": 4, "v_bits": 4}, PIPELINE,
                "the paper's W4A4KV4 pipeline (GPTQ weights, whip R1, random-Hadamard R2, online R4)"),
}
"""Setting → (the overrides of every cell, the premises, the words of the title)."""

SINKS = 4
"""S of the sink claims (RotateKV's and the option's default)."""

R3S: dict[str, tuple[Override, str]] = {"id": ("identity", "no R3"),
                                        "fold": (Resolve.BEST_FOLDABLE_R3, "the best foldable R3")}
"""R3 tag → (the cell's r3, the words of the title)."""


@dataclass(frozen=True)
class Scheme:
    """A key quantiser at the reference's bits: its cell overrides, its reference's (with the online Hadamard),
    and the words of its title and statement."""

    tag: str
    overrides: Mapping[str, Override]
    reference: Mapping[str, Override]
    label: str
    reference_label: str
    equal_bits: str


PER_TOKEN = "the paper's per-token rule with the online Hadamard"

SCHEMES: tuple[Scheme, ...] = (
    Scheme("kvquant", {"k_quant": "kvquant_prerope", "k_token_group": Resolve.HEAD_DIM},
           {"k_quant": "per_token_window", "k_token_group": Resolve.HEAD_DIM, "k_residual": 0},
           "KVQuant pre-RoPE per-channel keys (G = head_dim)",
           f"{PER_TOKEN} on KVQuant's complete groups (per_token_window, R = 0)",
           "KVQuant's open group of G = d tokens in 16 bits in both cells, b + 32/d on the others"),
    Scheme("pairbits", {"k_quant": "rope_pair_bits", "k_min_bits": 3, "k_max_bits": 4,
                        "k_avg_bits": Resolve.EQUAL_PAIR_AVG}, {},
           "RoPE-pair bit allocation (widths 3/4, mean 4 − 32/d)", PER_TOKEN,
           "widths in {3, 4} averaging 4 − 32/d, two per-token ranges: 4 + 32/d bits"),
    Scheme("sink", {"k_quant": "sink", "k_sinks": SINKS}, {"k_quant": "sink", "k_sinks": SINKS},
           f"attention sinks in 16 bits (S = {SINKS})", f"{PER_TOKEN} and the same {SINKS} sinks in 16 bits",
           f"the same {SINKS} sink tokens in 16 bits in both cells"),
    Scheme("kivi", {"k_quant": "kivi", "k_token_group": Resolve.HEAD_DIM, "k_residual": Resolve.HEAD_DIM},
           {"k_quant": "per_token_window", "k_token_group": Resolve.HEAD_DIM, "k_residual": Resolve.HEAD_DIM},
           "KIVI per-channel keys (G = R = head_dim)", f"{PER_TOKEN} on KIVI's quantised tokens (per_token_window)",
           "KIVI's full-precision tokens (window R = d and the open group) in 16 bits in both cells, b + 32/d on "
           "the others"),
)
"""The schemes, each at the bits of its reference."""


def claim_id(scheme: str, r3: str, setting: str) -> str:
    """``K-<scheme>-<r3 tag>-<setting>``: ``K-kvquant-id-KV4``."""
    return f"K-{scheme}-{r3}-{setting}"


def _claim(scheme: Scheme, r3: str, setting: str) -> Claim:
    base, premises, words = SETTINGS[setting]
    r3_value, r3_words = R3S[r3]
    treatment = cell(**base, **scheme.overrides, r3=r3_value)
    reference = cell(**base, **scheme.reference, r3="hadamard")
    part = Part(f"ppl({scheme.tag} + {r3_words}) − ppl(reference + hadamard) < +margin", "scheme", "reference",
                Form.NON_SUPERIOR, margin=MarginRule.equivalence("reference"))
    return Claim(
        claim_id(scheme.tag, r3, setting),
        f"Keys: {scheme.label} + {r3_words} vs {scheme.reference_label}, {setting}, equal bits",
        f"Under {words}, {scheme.label} with {r3_words} is not worse than {scheme.reference_label} by more than the "
        f"equivalence margin (the reference's ±0.05 PPL scaled by its ppl), at equal bits per key element "
        f"({scheme.equal_bits}): it replaces the online Hadamard.",
        "beyond the paper (docs/key_quantizers.md)",
        {"scheme": treatment, "reference": reference}, (part,), premises, group=KEYS, equal_bits=True, question=True)


KEY_CLAIMS: tuple[Claim, ...] = tuple(_claim(s, r3, setting) for setting in SETTINGS for s in SCHEMES for r3 in R3S)
"""Every entry of this module, in the claims table's order (KV4 first, then W4A4KV4)."""

for _claim_entry in KEY_CLAIMS:
    register(_claim_entry)

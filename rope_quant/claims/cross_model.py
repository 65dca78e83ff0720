"""The model-generic claims of App. I on every model: the paper's C1, C3, C4 and C8 where no offline rotation is
needed, so that an architecture that refuses R1 (Gemma 3's sandwich norms) is decided too.

Two settings (App. I):

* **4-bit keys alone** (:data:`rope_quant.defaults.KEYS_ALONE`, W16A16KV4 with V in 16 bits): nothing else
  quantised and no offline rotation; it isolates R3's effect on the keys. Unquantised weights have no float-order
  step, so each cell is its own replicate (:mod:`rope_quant.experiment.replicate`) and C3's paired part reads the
  seeds' interval alone;
* **W4A16KV4** (:data:`W4A16KV4`): GPTQ weights, no R1, R2 random Hadamard, R4 online, 4-bit keys.

C4's block sizes run b = 2 … 32 and then d_h (:class:`~rope_quant.claims.registry.Resolve`: 64 on SmolLM2, 256
on Gemma 3, whose 64 and 128 are not read). Every entry is ``slow`` (the 4-bit-keys entries took 5 min 29 s on
Gemma 3 on 2 cores, 2026-12-06). Run them on several models with one ``--rq-model`` each (``pytest -m e2e
--run-slow --rq-model=smollm2-135m --rq-model=gemma3-270m -k "C1-C8 or C3-kv or C4-K-kv"``).
"""

from __future__ import annotations

from collections.abc import Mapping

from rope_quant.claims.paper import K_METRICS  # registered after the paper's entries: it imports them
from rope_quant.claims.registry import (
    Claim,
    Override,
    Part,
    Premise,
    Resolve,
    Scoring,
    Statistic,
    cell,
    register,
)
from rope_quant.core.verdict import Form
from rope_quant.defaults import KEYS_ALONE

W4A16KV4: Mapping[str, Override] = {"w_bits": 4, "a_bits": 16, "k_bits": 4, "v_bits": 16, "r1": "identity"}
"""GPTQ weights without R1 (App. I), R2 random Hadamard and R4 online (valid on both embedded families)."""

BLOCKS = ("2", "4", "8", "16", "32", "d_h")
"""C4's block sizes here: 2 … 32, then the model's head_dim."""


def _kv(r3: str, **more: Override) -> Mapping[str, Override]:
    return cell(r3=r3, **KEYS_ALONE, **more)


def _c1_c8(claim_id: str, title: str, setting: Mapping[str, Override]) -> Claim:
    return Claim(
        claim_id, title,
        "pairwise_only has a higher perplexity than hadamard in every seed (C1), and hadamard a lower K range and "
        "relative K error (C8); criteria without sampling error: hold or fail.", "App. I",
        {"hadamard": cell(r3="hadamard", **setting), "pairwise_only": cell(r3="pairwise_only", **setting)},
        (Part("ppl(pairwise_only) > ppl(hadamard) every seed", "pairwise_only", "hadamard", Form.GREATER,
              Statistic.EVERY_SEED),
         *(Part(f"{m.value}(hadamard) < {m.value}(pairwise_only) every seed", "hadamard", "pairwise_only",
                Form.LESS, Statistic.EVERY_SEED, metric=m) for m in K_METRICS)), (Premise.ROPE,), slow=True)


C1_C8_KV = register(_c1_c8("C1-C8-kv", "C1 + C8 (App. I) pairwise_only vs hadamard, W16A16KV4", KEYS_ALONE))

C3_KV = register(Claim(
    "C3-kv", "C3 (App. I, App. L) k_only vs rows, W16A16KV4",
    "The paired 90% interval of ppl(k_only) − ppl(rows) lies below zero on 4-bit keys alone (each cell its own "
    "float-order replicate: no step depends on the float order).", "App. I, App. L",
    {"k_only": _kv("pairwise_only", estimator="k_only"), "rows": _kv("pairwise_only", estimator="rows")},
    (Part("ppl(k_only) − ppl(rows) < 0", "k_only", "rows", Form.LESS),), (Premise.ROPE,), slow=True))


def _block(b: str) -> Mapping[str, Override]:
    return cell(Scoring.SUPPORT, r3="block_hadamard", r3_block=Resolve.HEAD_DIM.value if b == "d_h" else int(b),
                **KEYS_ALONE)


C4_K_KV = register(Claim(
    "C4-K-kv", "C4 (App. I, Table M) K range / K error vs b=2…d_h, W16A16KV4",
    "K range and relative K error are non-increasing in block size b = 2 … 32, d_h, in every seed, on 4-bit keys "
    "alone (a criterion without sampling error: holds or fails).", "App. I, Table M",
    {f"b={b}": _block(b) for b in BLOCKS},
    tuple(Part(f"{m.value} b={lo}→{hi}", f"b={hi}", f"b={lo}", Form.NON_SUPERIOR, Statistic.EVERY_SEED, metric=m)
          for m in K_METRICS for lo, hi in zip(BLOCKS, BLOCKS[1:], strict=False)), (Premise.ROPE,), slow=True))

C1_C8_W4A16 = register(_c1_c8("C1-C8-w4a16", "C1 + C8 (App. I) pairwise_only vs hadamard, W4A16KV4", W4A16KV4))

CROSS_MODEL: tuple[Claim, ...] = (C1_C8_KV, C3_KV, C4_K_KV, C1_C8_W4A16)
"""The entries of this module, in the claims table's order."""

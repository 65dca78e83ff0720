"""Beyond the paper: its question inside llama.cpp, the runtime that ships R3 (docs/llamacpp.md).

llama.cpp multiplies Q and K by a Hadamard after RoPE whenever its K cache is quantised (``runtime_rotation``,
:mod:`rope_quant.rotations.runtime_rotation`): the paper's ``hadamard`` R3, online, on every token. These entries
ask the paper's question there, with KV-only quantisation (:data:`rope_quant.defaults.KEYS_ALONE`: unquantised
weights and activations, no R1, R2 or R4; V in 16 bits) and llama.cpp's ``q4_0`` keys, each cell scored by
llama.cpp itself (``Scoring.RUNTIME``: the cell exported to GGUF with its commuting R3 folded,
:mod:`rope_quant.runtime.cells`):

* **L1** (the paper's C1/C8 in the runtime): the online Hadamard lowers perplexity against the rotation off;
* **L2**: the best foldable R3 of the architecture, folded into the GGUF, with the rotation off, is not worse than
  the online Hadamard by more than the equivalence margin (the paper's ±0.05 PPL scaled); the same with both on.
  Holds: a llama.cpp user can drop the rotation;
* **L3**: the simulator agrees with the runtime: for each cell of L1 and L2, the simulated perplexity (the same
  overrides scored by our fake quantisation, ``ggml_q4_0`` keys and the ``runtime_rotation`` switch) is equivalent
  to llama.cpp's within :data:`L3_TOLERANCE` of its perplexity. The same claims read from simulated cells are
  ``L1-sim`` and ``L2-sim``; a test compares their verdicts with L1's and L2's.

L1 and L2 are questions (``question=True``): either decided answer is a result (on Gemma 3 the rotation raises
perplexity). Every entry is ``slow`` (a GGUF export per cell and seed).
"""

from __future__ import annotations

from collections.abc import Mapping

from rope_quant.claims.registry import (
    Claim,
    MarginRule,
    Override,
    Part,
    Premise,
    Resolve,
    Scoring,
    cell,
    register,
)
from rope_quant.core.verdict import Form
from rope_quant.defaults import KEYS_ALONE

RUNTIME_GROUP = "llamacpp"
"""The registry group of these entries."""

K_TYPE = "ggml_q4_0"
"""llama.cpp's K cache type of the cells (``-ctk q4_0``: the type its users run)."""

L3_TOLERANCE = 0.02
"""L3's margin, a share of the runtime cell's perplexity: the simulator agrees when it is this close."""

#: cell name → (R3, runtime rotation)
CELLS: dict[str, tuple[Override, bool]] = {
    "off": ("identity", False),
    "on": ("identity", True),
    "fold_off": (Resolve.BEST_FOLDABLE_R3, False),
    "fold_on": (Resolve.BEST_FOLDABLE_R3, True),
}


def _cells(scoring: Scoring) -> dict[str, Mapping[str, Override]]:
    return {name: cell(scoring, **KEYS_ALONE, k_quant=K_TYPE, r3=r3, runtime_rotation=rot)
            for name, (r3, rot) in CELLS.items()}


def _l1(suffix: str, scoring: Scoring, where: str) -> Claim:
    return Claim(
        f"L1{suffix}", f"llama.cpp: its online Hadamard lowers ppl at q4_0 keys ({where})",
        "With q4_0 keys in llama.cpp, its online Hadamard on Q and K after RoPE lowers perplexity against the "
        "rotation off (the paper's C1/C8 in the runtime).",
        "beyond the paper (docs/llamacpp.md)", _cells(scoring),
        (Part("ppl(rotation off) − ppl(rotation on) > 0", "off", "on", Form.GREATER),),
        (Premise.ROPE,), group=RUNTIME_GROUP, question=True, slow=True)


def _l2(suffix: str, scoring: Scoring, where: str) -> Claim:
    margin = MarginRule.equivalence("on")
    return Claim(
        f"L2{suffix}", f"llama.cpp: the best foldable R3, folded, replaces its online Hadamard ({where})",
        "With q4_0 keys in llama.cpp, the best foldable R3 folded into the GGUF is not worse than the runtime's "
        "online Hadamard by more than the equivalence margin, with the rotation off, and with both on.",
        "beyond the paper (docs/llamacpp.md)", _cells(scoring),
        (Part("ppl(fold, rotation off) − ppl(rotation on) < +margin", "fold_off", "on", Form.NON_SUPERIOR,
              margin=margin),
         Part("ppl(fold, rotation on) − ppl(rotation on) < +margin", "fold_on", "on", Form.NON_SUPERIOR,
              margin=margin)),
        (Premise.ROPE,), group=RUNTIME_GROUP, question=True, slow=True)


def _l3() -> Claim:
    runtime, simulated = _cells(Scoring.RUNTIME), _cells(Scoring.EVAL)
    cells = {**{f"rt_{n}": c for n, c in runtime.items()}, **{f"sim_{n}": c for n, c in simulated.items()}}
    parts = tuple(Part(f"ppl_sim({n}) ≡ ppl_llama.cpp({n}) within {L3_TOLERANCE:.0%}", f"sim_{n}", f"rt_{n}",
                       Form.EQUIVALENT, margin=MarginRule.relative(f"rt_{n}", L3_TOLERANCE)) for n in CELLS)
    return Claim(
        "L3", f"llama.cpp: the simulator agrees with the runtime (within {L3_TOLERANCE:.0%} of ppl)",
        f"For each cell of L1 and L2, our simulation of llama.cpp's q4_0 keys and online rotation gives the "
        f"perplexity llama.cpp gives, within {L3_TOLERANCE:.0%}.",
        "beyond the paper (docs/llamacpp.md)", cells, parts, (Premise.ROPE,), group=RUNTIME_GROUP, slow=True)


RUNTIME_CLAIMS: tuple[Claim, ...] = (
    _l1("", Scoring.RUNTIME, "scored by llama.cpp"), _l2("", Scoring.RUNTIME, "scored by llama.cpp"), _l3(),
    _l1("-sim", Scoring.EVAL, "simulated"), _l2("-sim", Scoring.EVAL, "simulated"))
"""Every entry of this module, in the claims table's order."""

for _entry in RUNTIME_CLAIMS:
    register(_entry)

"""Which R1 a run uses: the requested one, else whip, unless the architecture refuses R1 (Sec. 2).

QuaRot/SpinQuant's R1 must fold into the weights to preserve the model's function. Where the architecture
adapter says it does not (:func:`rope_quant.model.arch.rotation_refusal`, e.g. sandwich norms), an unrequested R1
becomes ``identity`` when activations stay 16-bit, and is refused otherwise, with the alternatives named.
Stdlib only: the CLI asks it before any model loads.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["R1Choice", "R1_ALTERNATIVES", "choose_r1"]


@dataclass(frozen=True)
class R1Choice:
    """The R1 a run uses (:func:`choose_r1`): the rotation's name, and the note that explains a changed default."""

    r1: str
    note: str | None = None


R1_ALTERNATIVES = ("--r1 identity (R2, R4 and the online R3 remain available), or a setting with 16-bit "
                   "activations, where R1 defaults to identity: KV-only (--w-bits 16 --a-bits 16) or W4A16KV4 "
                   "(--w-bits 4 --a-bits 16: GPTQ weights, no R1)")


def choose_r1(model: str, reason: str | None, requested: str | None, a_bits: int, *, off_bits: int = 16) -> R1Choice:
    """The R1 rule (QuaRot/SpinQuant R1 needs a function-preserving fold, Sec. 2): ``requested``, else whip.

    ``reason`` is :func:`rope_quant.model.arch.rotation_refusal`'s answer for ``"r1"``. Where the architecture
    refuses R1 (sandwich norms), an unrequested R1 becomes ``identity`` when activations stay 16-bit (R1 then only
    conditions the weights), with a note naming the norms; otherwise ValueError naming the norms and the
    alternatives.
    """
    if requested == "identity" or reason is None:
        return R1Choice(requested or "whip")
    if requested is None and a_bits >= off_bits:
        return R1Choice("identity", f"R1 set to identity for {model}: {reason}")
    what = f"--r1 {requested}" if requested else f"the default R1 (whip) with --a-bits {a_bits}"
    raise ValueError(f"{what} is refused for {model}: R1 would change the model's function, since {reason}. "
                     f"Alternatives: {R1_ALTERNATIVES}")

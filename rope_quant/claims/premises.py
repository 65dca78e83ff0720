"""Which claims a model can carry: the premises of registry.py answered by the architecture adapter, and the
nearest protocol a claim runs under where one premise is missing (named in its row).

* ``rope``: the model's layers give RoPE frequencies (``model/arch.py``: ``inv_freq_by_layer``);
* ``r1_foldable``: R1 is function-preserving (``arch.rotation_refusal``; Gemma 3's sandwich norms refuse it);
* ``head_dim_64``: C4's block sizes 2 … 64 end at d_h.

A claim whose only missing premise is ``r1_foldable`` runs with ``r1=identity`` in every cell (R2, R4 and the
online R3 unchanged; the paper's pipeline without R1, the deviation named); any other missing premise skips
the claim with its reason. The model is imported lazily: this module loads no torch at import.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from rope_quant.claims.registry import Claim, Override, Premise


def premises_of(model: Any) -> dict[Premise, str | None]:
    """Premise → None where ``model`` meets it, else why not. ``model``: a loaded model, or anything with its
    ``config`` (the answers read the structure the adapter registers, not the weights)."""
    from rope_quant.model import arch

    out: dict[Premise, str | None] = {}
    try:
        arch.spec_for(model)  # every registered architecture applies RoPE to q and k
        out[Premise.ROPE] = None
    except arch.ArchitectureError as exc:
        out[Premise.ROPE] = str(exc)
    out[Premise.R1_FOLDABLE] = arch.rotation_refusal(model, "r1") if out[Premise.ROPE] is None else out[Premise.ROPE]
    head_dim = arch.dims(model).head_dim if out[Premise.ROPE] is None else None
    out[Premise.HEAD_DIM_64] = None if head_dim == 64 else f"head_dim {head_dim}: C4's blocks 2 … 64 end at d_h = 64"
    return out


def premises_of_checkpoint(name_or_path: str) -> dict[Premise, str | None]:
    """:func:`premises_of` from a checkpoint's config alone (no weights loaded: the CLI's plan)."""
    from types import SimpleNamespace

    from rope_quant.model.loading import load_config

    return premises_of(SimpleNamespace(config=load_config(name_or_path)))


@dataclass(frozen=True)
class Protocol:
    """How a claim runs on a model: ``overrides`` added to every cell, the ``deviation`` from the paper's protocol
    (empty: none), or ``skip`` (the reason it cannot run)."""

    overrides: Mapping[str, Override]
    deviation: str = ""
    skip: str = ""


def protocol_for(claim: Claim, premises: Mapping[Premise, str | None]) -> Protocol:
    """The nearest protocol ``claim`` runs under on a model with ``premises`` (module docstring)."""
    missing = {p: premises.get(p) or "" for p in claim.premises if premises.get(p) is not None}
    if not missing:
        return Protocol({})
    if set(missing) == {Premise.R1_FOLDABLE}:
        return Protocol({"r1": "identity"}, f"R1 refused by the architecture ({missing[Premise.R1_FOLDABLE]}): "
                                            "every cell runs with r1=identity (R2, R4 and the online R3 unchanged)")
    return Protocol({}, skip="; ".join(f"{p.value}: {why}" for p, why in missing.items()))


def adapt(claim: Claim, premises: Mapping[Premise, str | None]) -> Claim | str:
    """``claim`` as it runs on a model with ``premises``: itself, a copy whose every cell carries the nearest
    protocol's overrides and whose title names the deviation, or the reason it cannot run (a str)."""
    protocol = protocol_for(claim, premises)
    if protocol.skip:
        return protocol.skip
    if not protocol.overrides:
        return claim
    cells = {name: MappingProxyType({**cell, **protocol.overrides}) for name, cell in claim.cells.items()}
    return replace(claim, cells=cells, title=f"{claim.title} [deviation: {protocol.deviation}]")

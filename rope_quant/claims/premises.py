"""Which claims a model can carry: the premises of registry.py answered by the architecture adapter, and the
nearest protocol a claim runs under where one premise is missing (named in its row).

* ``rope``: the model's layers give RoPE frequencies (``model/arch.py``: ``inv_freq_by_layer``);
* ``r1_foldable``: R1 is function-preserving (``arch.rotation_refusal``; Gemma 3's sandwich norms refuse it);
* ``head_dim_64``: C4's block sizes 2 … 64 end at d_h.

A claim whose only missing premise is ``r1_foldable`` runs with ``r1=identity`` in every cell (R2, R4 and the
online R3 unchanged; the paper's pipeline without R1, the deviation named), unless its cells set ``r1``
themselves (A1-whip: a claim about R1); any other missing premise skips the claim with its reason.

A checkpoint's config is read once (:func:`read_checkpoint`): its :class:`ModelFacts` hold the config itself,
the premises, head_dim (the key quantisers' limits), the geometry, the R1 refusal, or why the config cannot be
read; ``rope-quant claims`` builds them once per model and hands them down (the R1 default, the key-quantiser
checks, the claims that run, the cost plan), as the pytest fronts do.

A cell value that depends on the model (a :class:`~rope_quant.claims.registry.Resolve` sentinel) is replaced
from the model's config, :class:`ModelFacts` (no weights): ``HEAD_DIM`` by d, ``EQUAL_PAIR_AVG`` by
k_bits − 32/d, ``BEST_FOLDABLE_R3`` by :func:`best_foldable_r3` (its settings with it); a claim whose resolved
cell cannot run at d (rope_pair_bits' widths 3/4 cannot average 4 − 32/16 = 2 bits) skips with that reason. A
claim with ``equal_bits`` is then checked at the evaluation windows' length T (claims/bits.py) before any model
loads. The pytest front (tests/e2e/test_registry_claims.py) and ``rope-quant claims`` both go through
:func:`adapt`, so they run the same cells. The model and the configs are imported lazily: this module loads no
torch at import.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType, SimpleNamespace
from typing import Any

from rope_quant.claims.registry import Claim, ClaimError, Override, Premise, Resolve


@dataclass(frozen=True)
class ModelFacts:
    """What a model's config says, read once: its premises (premise → None where met, else why not), its
    ``head_dim`` (None where the adapter cannot read it), whether its attention has per-head q/k norms (Qwen3,
    Gemma 3) and its ``model_type``; ``name`` (the checkpoint read), ``config`` (the config itself, for the cost
    plan and the geometry; None when it cannot be read) and ``error`` (why not)."""

    premises: Mapping[Premise, str | None]
    head_dim: int | None = None
    qk_norms: bool = False
    model_type: str = ""
    name: str = field(default="", compare=False)
    config: Any = field(default=None, compare=False, repr=False)
    error: BaseException | None = field(default=None, compare=False)

    def as_model(self) -> Any:
        """An object with the model's ``config`` (what the architecture adapter reads without weights); the
        reading's error where the config could not be read."""
        if self.config is None:
            raise self.error or ValueError(f"model {self.name or '?'}: no config was read")
        return SimpleNamespace(config=self.config)

    @property
    def r1_refusal(self) -> str | None:
        """Why the architecture refuses R1, or None (it folds, or the config cannot be read: the model checks
        report that)."""
        if self.premises.get(Premise.ROPE) is not None:
            return None
        return self.premises.get(Premise.R1_FOLDABLE)

    def dims(self) -> Any:
        """The model's geometry (``model/arch.py``: layers, heads, head_dim …) from its config."""
        from rope_quant.model import arch

        return arch.dims(self.as_model())


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


def facts_of(model: Any, name: str = "") -> ModelFacts:
    """:class:`ModelFacts` of ``model`` (a loaded model, or anything with its ``config``)."""
    from rope_quant.model import arch

    premises = premises_of(model)
    config = getattr(model, "config", None)
    if premises[Premise.ROPE] is not None:
        return ModelFacts(premises, name=name, config=config)
    spec = arch.spec_for(model)
    return ModelFacts(premises, arch.dims(model).head_dim, spec.has_qk_norm, spec.model_type, name, config)


def facts_of_checkpoint(name_or_path: str) -> ModelFacts:
    """:func:`facts_of` from a checkpoint's config alone (no weights loaded); its reading's error raised
    (``ModelNotFoundError``, ``ModelLoadError``)."""
    facts = read_checkpoint(name_or_path)
    if facts.error is not None:
        raise facts.error
    return facts


def read_checkpoint(name_or_path: str) -> ModelFacts:
    """The checkpoint's :class:`ModelFacts`, its config read once (``model/loading.py: load_config``); a config
    that cannot be read gives facts with no premise met and the ``error`` (raised by :meth:`ModelFacts.as_model`)."""
    from rope_quant.model.arch import ArchitectureError
    from rope_quant.model.loading import ModelLoadError, ModelNotFoundError, load_config

    try:
        return facts_of(SimpleNamespace(config=load_config(name_or_path)), str(name_or_path))
    except (ModelNotFoundError, ModelLoadError, ArchitectureError) as exc:
        return ModelFacts({}, name=str(name_or_path), error=exc)


#: The best foldable R3 of docs/foldable_r3.md's study (3 seeds, KV4 alone and with GPTQ weights), by whether the
#: architecture has per-head q/k norms: there only per-pair scales fold (into the norm weights; a Givens part
#: does not fold through the RMS), and ``prerope_channel_scale`` was the best that folds on Gemma 3; without them
#: every RoPE-commuting R3 folds into W_Q/W_K, and ``pairwise_scaled`` with per-head range-objective angles was the
#: best on SmolLM2.
BEST_FOLDABLE_R3: dict[bool, dict[str, Override]] = {
    True: {"r3": "prerope_channel_scale"},
    False: {"r3": "pairwise_scaled", "estimator": "per_head", "objective": "range"},
}


def best_foldable_r3(facts: ModelFacts) -> dict[str, Override] | str:
    """The overrides of the best foldable R3 on a model with ``facts`` (:data:`BEST_FOLDABLE_R3`), or why it
    cannot run there (not registered, does not fold whole at this head_dim)."""
    from rope_quant.core import transforms

    chosen = BEST_FOLDABLE_R3[facts.qk_norms]
    name = str(chosen["r3"])
    head_dim = facts.head_dim or 0
    try:
        folding = transforms.foldability(name, head_dim)
        transforms.commutes_with_rope(name, head_dim)
    except Exception as exc:  # noqa: BLE001 - an R3 that cannot be built here is the claim's skip reason
        return f"the best foldable R3 {name} cannot run at head_dim {head_dim}: {type(exc).__name__}: {exc}"
    if not folding.folds or folding.online is not None:
        return f"the best foldable R3 {name} does not fold whole into the weights (online factor {folding.online})"
    return dict(chosen)


def resolve(claim: Claim, facts: ModelFacts) -> Claim | str:
    """``claim`` with every :class:`Resolve` sentinel replaced from ``facts`` (its title naming what each became),
    itself when it has none, or why it cannot run on the model (a str: no head_dim in its config, the best foldable
    R3 does not run there, or a resolved cell's key quantiser cannot run at that head_dim)."""
    todo = claim.unresolved()
    if not todo:
        return claim
    d = facts.head_dim
    if d is None:
        return "its cells depend on the model's head_dim, which its config does not give"
    cells: dict[str, Mapping[str, Override]] = {}
    named: dict[str, dict[str, Override]] = {}
    for name, cell in claim.cells.items():
        out: dict[str, Override] = {}
        for key, value in cell.items():
            if key not in todo.get(name, {}):
                out.setdefault(key, value)
                continue
            got = _resolved(todo[name][key], key, cell, facts)
            if isinstance(got, str):
                return got
            clash = [k for k in got if k != key and k in cell]
            if clash:
                raise ClaimError(f"claim {claim.id}, cell {name!r}: {key}={value} sets {', '.join(clash)}, which the "
                                 "cell also sets")
            out.update(got)
            for k, v in got.items():
                named.setdefault(str(value), {})[k] = v
        cells[name] = MappingProxyType(out)
    from rope_quant.claims.bits import head_dim_refusal

    for name in todo:  # a value resolved from d may leave the cell's key quantiser unable to run at d
        if why := head_dim_refusal(cells[name], d):
            return f"its cells cannot adapt to head_dim {d}: {why}"
    label = "; ".join(f"{_label(Resolve(v), items)}: {', '.join(f'{k}={x}' for k, x in items.items())}"
                      for v, items in named.items())
    return replace(claim, cells=cells, title=f"{claim.title} [on {facts.model_type or 'this model'}: {label}]")


_LABEL = {Resolve.HEAD_DIM: "G = head_dim", Resolve.EQUAL_PAIR_AVG: "equal-bits mean width",
          Resolve.BEST_FOLDABLE_R3: "best foldable R3"}


def _label(what: Resolve, items: Mapping[str, Override]) -> str:
    """How a claim's title names a resolved value: a block size b = d_h (C4's last block) or the key's label."""
    return "b = head_dim" if what is Resolve.HEAD_DIM and set(items) == {"r3_block"} else _LABEL[what]


def _resolved(what: Resolve, key: str, cell: Mapping[str, Override], facts: ModelFacts) -> dict[str, Override] | str:
    assert facts.head_dim is not None
    d = facts.head_dim
    if what is Resolve.HEAD_DIM:
        return {key: d}
    if what is Resolve.EQUAL_PAIR_AVG:  # widths {b − 1, b} averaging b − 32/d: payload + two ranges = b + 32/d
        bits = cell.get("k_bits", 4)
        if isinstance(bits, bool) or not isinstance(bits, int):
            raise ClaimError(f"{Resolve.EQUAL_PAIR_AVG.value} needs an integer k_bits, got {bits!r}")
        return {key: bits - 32 / d}
    if key != "r3":
        raise ClaimError(f"{Resolve.BEST_FOLDABLE_R3.value} is the value of 'r3', not of {key!r}")
    return best_foldable_r3(facts)


@dataclass(frozen=True)
class Protocol:
    """How a claim runs on a model: ``overrides`` added to every cell, the ``deviation`` from the paper's protocol
    (empty: none), or ``skip`` (the reason it cannot run)."""

    overrides: Mapping[str, Override]
    deviation: str = ""
    skip: str = ""


def protocol_for(claim: Claim, premises: Mapping[Premise, str | None]) -> Protocol:
    """The nearest protocol ``claim`` runs under on a model with ``premises`` (module docstring). A claim whose cells
    set R1 themselves (A1-whip: the whip fit) is about R1, so a model that refuses R1 skips it instead."""
    missing = {p: premises.get(p) or "" for p in claim.premises if premises.get(p) is not None}
    if not missing:
        return Protocol({})
    if set(missing) == {Premise.R1_FOLDABLE} and not any("r1" in c for c in claim.cells.values()):
        return Protocol({"r1": "identity"}, f"R1 refused by the architecture ({missing[Premise.R1_FOLDABLE]}): "
                                            "every cell runs with r1=identity (R2, R4 and the online R3 unchanged)")
    return Protocol({}, skip="; ".join(f"{p.value}: {why}" for p, why in missing.items()))


def adapt(claim: Claim, model: Mapping[Premise, str | None] | ModelFacts, *, seq_len: int | None = None
          ) -> Claim | str:
    """``claim`` as it runs on a model: itself, a copy whose every cell carries the nearest protocol's overrides
    (its title naming the deviation) and its model-dependent values resolved (:func:`resolve`), or the reason
    it cannot run (a str). ``model``: the model's :class:`ModelFacts` (its premises alone do for a claim without
    :class:`Resolve` sentinels). A claim with ``equal_bits`` is checked at T = ``seq_len`` (the evaluation
    windows' length) from its resolved configs: :class:`ClaimError` naming the cells and their bits where a
    part compares unequal bits."""
    facts = model if isinstance(model, ModelFacts) else None
    premises = facts.premises if facts is not None else model
    protocol = protocol_for(claim, premises)  # type: ignore[arg-type]
    if protocol.skip:
        return protocol.skip
    adapted = claim
    if protocol.overrides:
        cells = {name: MappingProxyType({**cell, **protocol.overrides}) for name, cell in claim.cells.items()}
        adapted = replace(claim, cells=cells, title=f"{claim.title} [deviation: {protocol.deviation}]")
    if claim.unresolved() or claim.equal_bits:
        if facts is None:
            raise ClaimError(f"claim {claim.id} depends on the model's config (head_dim, architecture): adapt it "
                             "with the model's ModelFacts (premises.facts_of), not its premises alone")
        got = resolve(adapted, facts)
        if isinstance(got, str):
            return got
        adapted = got
    if claim.equal_bits:
        from rope_quant.claims.bits import check_equal_bits, too_few_quantised

        if seq_len is None:
            raise ClaimError(f"claim {claim.id} compares at equal bits per key element: adapt it with the evaluation "
                             "windows' length (seq_len)")
        assert facts is not None
        if facts.head_dim is None:
            return "it compares at equal bits per key element, which needs the model's head_dim (its config has none)"
        check_equal_bits(adapted, facts.head_dim, seq_len)
        why = too_few_quantised(adapted, facts.head_dim, seq_len)
        if why:
            return why
    return adapted

"""The claims as data: a :class:`Claim` names its cells, its parts and what it asks of an architecture.

A claim of the paper (or beyond it) is a list of :class:`Part`\\ s over named **cells**. A cell is a set of flat
config overrides (``{"r3": "pairwise_only", "estimator": "k_only"}``, the names of
:meth:`rope_quant.experiment.config.RunConfig.from_flat`) on top of the study's base config; two reserved keys
say how the cell is scored when that is not the budget's evaluation windows (:data:`SCORING`, :data:`LENGTH`:
C4's support windows, C7's long-context protocol of App. A.4). A part compares a treatment and a control (a
cell, or a :class:`Diff` of two cells: App. F's gap of gaps) in one :class:`~rope_quant.core.verdict.Form`,
with one :class:`Statistic` (the paired rule of docs/verdicts.md, or a criterion without sampling error) and
one :class:`MarginRule`. :func:`rope_quant.claims.engine.evaluate` decides any claim over any store; adding a
claim is one :func:`register` call (docs/ARCHITECTURE.md, "Adding a claim").

A cell value that depends on the model (its head_dim, the best foldable R3 of its architecture) is a
:class:`Resolve` sentinel, replaced from the model's config by :func:`rope_quant.claims.premises.adapt` before any
store reads the cell. A claim belongs to a **group** (:data:`PAPER`: the paper's claims and the rows beyond it that
the e2e suite's test modules state; :data:`KEYS`: the key quantisers against R3); ``equal_bits`` says its parts
compare cells at equal bits per key element, checked from the configs before any model loads.

Standard library and :mod:`rope_quant.core.verdict` only (no torch, numpy or scipy at import).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from rope_quant.core.verdict import Form

Override = str | int | float | bool
"""One flat config value of a cell."""


class Metric(StrEnum):
    """What a part reads from a cell's result (a key of the cell record's ``result``)."""

    PPL = "ppl"
    K_RANGE_MEAN = "k_range_mean"
    K_REL_ERR = "k_rel_err"
    K_BITS = "k_bits_per_element"  # the stored bits per key element of the cell's key cache (after calibration)
    R1_LOSS_INIT = "rotation_fit.loss_init"  # the whip loss of R1 at its random-Hadamard start (App. A.1)
    R1_LOSS_FIT = "rotation_fit.loss_fit"  # the whip loss of the fitted R1
    ACCURACY = "accuracy"  # a NIAH cell's exact-match retrieval accuracy at its length (App. G)


def metric_value(result: Mapping[str, Any], metric: str) -> float:
    """A :class:`Metric` of a cell's result: a key, or a dotted path into a nested record (``rotation_fit.loss_fit``);
    a KeyError names what is missing."""
    value: Any = result
    for key in str(metric).split("."):
        if not isinstance(value, Mapping) or key not in value:
            raise KeyError(f"the cell's result has no {metric!r}")
        value = value[key]
    return float(value)


class Resolve(StrEnum):
    """A cell value that depends on the model, resolved from its config (no weights) by
    :func:`rope_quant.claims.premises.adapt`; a cell holding one is never read from a store."""

    HEAD_DIM = "<head_dim>"  # the model's head_dim d (KVQuant's and KIVI's token group G = d)
    EQUAL_PAIR_AVG = "<equal_pair_avg>"  # rope_pair_bits' mean width k_bits − 32/d: two widths at k_bits + 32/d
    BEST_FOLDABLE_R3 = "<best_foldable_r3>"  # the key "r3": the best foldable R3 of the architecture (its settings)


PAPER = "paper"
"""The group of the paper's claims and the measured rows beyond it (claims/paper.py: the e2e tests state each)."""
KEYS = "keys"
"""The group of the key-quantiser claims (claims/keys.py): other answers to 4-bit keys against the online R3."""


class Scoring(StrEnum):
    """How a cell is scored; the store resolves it against its budget (absent from a cell: ``EVAL``)."""

    EVAL = "eval"  # the budget's evaluation windows (short context)
    SUPPORT = "support"  # the budget's support windows (C4, Table M)
    LONG = "long"  # the App. A.4 long-context protocol at the cell's LENGTH
    RUNTIME = "runtime"  # llama.cpp on the evaluation windows (rope_quant.runtime.cells: the cell exported to GGUF)
    STATIC = "static"  # App. D: the static joint control (A.6, scope both, transductive scales) at the run's seqlen
    NIAH = "niah"  # App. G: the budget's NIAH probes at its NIAH length, answered by the cell's quantised model
    NIAH_FP = "niah_fp"  # App. G's reference: the same probes answered by the unquantised model


SCORING = "scoring"
"""The reserved cell key naming a :class:`Scoring` (not a config field: the store resolves it)."""
LENGTH = "length"
"""The reserved cell key of a long-context cell's context length L (with ``scoring="long"``)."""


class Statistic(StrEnum):
    """How a part reads its per-seed values."""

    PAIRED = "paired"  # the rule on treatment − control per seed, with the float-order replicates
    EVERY_SEED = "every_seed"  # no sampling error: the form holds in every seed (holds or fails; EVERY_SEED_FORMS)
    MEANS = "means"  # no sampling error: the form's sign holds between the seed means
    WITHIN_SHARE = "within_share"  # no sampling error: |mean(t − c)| < share · mean(reference − c)


class MarginKind(StrEnum):
    """Where a part's margin comes from."""

    NONE = "none"  # GREATER / LESS: the boundary is 0
    EQUIVALENCE = "equivalence"  # verdict.equivalence_margin of the comparator cell's mean ppl
    FIXED = "fixed"  # a value in the metric's units
    RELATIVE = "relative"  # a share (``value``) of the comparator cell's mean (L3: the simulator within 2% of ppl)


def unresolved(c: Mapping[str, Override]) -> dict[str, Resolve]:
    """The cell's keys whose value is a :class:`Resolve` sentinel."""
    return {k: Resolve(v) for k, v in c.items() if isinstance(v, str) and v in _RESOLVE_VALUES}


_RESOLVE_VALUES = frozenset(r.value for r in Resolve)


class Premise(StrEnum):
    """What a claim asks of an architecture (``model/arch.py`` answers; the claims of a model that lacks one are
    not run there)."""

    ROPE = "rope"  # rotary position embeddings on q and k: R3 acts after RoPE
    R1_FOLDABLE = "r1_foldable"  # R1 folds into the weights (no sandwich norms): the paper's W4A4KV4 pipeline
    HEAD_DIM_64 = "head_dim_64"  # head_dim 64: C4's block sizes 2 … 64 end at d_h


class ClaimError(ValueError):
    """A claim or part that cannot be decided as written (the message names the claim and the field)."""


class DuplicateClaimError(ClaimError):
    """A claim id that the registry already holds."""


class UnknownClaimError(KeyError):
    """No claim of that id in the registry."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def cell(scoring: Scoring = Scoring.EVAL, length: int | None = None, /,
         **overrides: Override) -> Mapping[str, Override]:
    """A cell: flat config ``overrides``, scored by ``scoring`` (``length``: a long-context cell's L; both
    positional, so that no override can take their place)."""
    if (scoring is Scoring.LONG) != (length is not None):
        raise ClaimError(f"a long-context cell needs a length and only it takes one (scoring {scoring.value}, "
                         f"length {length})")
    for reserved in (SCORING, LENGTH):
        if reserved in overrides:
            raise ClaimError(f"{reserved!r} is a reserved cell key: pass the scoring (and length) first, "
                             f"positionally: cell(Scoring.LONG, 4096, r3=...)")
    out: dict[str, Override] = dict(overrides)
    if scoring is not Scoring.EVAL:
        out[SCORING] = scoring.value
    if length is not None:
        out[LENGTH] = int(length)
    return MappingProxyType(out)


def scoring_of(c: Mapping[str, Override]) -> Scoring:
    """A cell's :class:`Scoring` (``EVAL`` when it names none)."""
    return Scoring(str(c.get(SCORING, Scoring.EVAL.value)))


def length_of(c: Mapping[str, Override]) -> int | None:
    """A long-context cell's context length L (None for any other cell)."""
    value = c.get(LENGTH)
    return None if value is None else int(value)


def overrides_of(c: Mapping[str, Override]) -> dict[str, Override]:
    """A cell's config overrides, the reserved keys left out."""
    return {k: v for k, v in c.items() if k not in (SCORING, LENGTH)}


def cell_key(c: Mapping[str, Override]) -> str:
    """The canonical text of a cell: its items sorted, as JSON (``scoring="eval"`` dropped: it is the default)."""
    items = {k: c[k] for k in sorted(c) if not (k == SCORING and c[k] == Scoring.EVAL.value)}
    return json.dumps(items, separators=(",", ":"), default=str)


def describe(c: Mapping[str, Override]) -> str:
    """A cell as a reader writes it: ``r3=pairwise_only, estimator=k_only`` (``defaults`` when empty)."""
    return ", ".join(f"{k}={v}" for k, v in c.items()) or "defaults"


@dataclass(frozen=True)
class Level:
    """A part's control that is a constant, not a cell (App. G: FP retrieval near saturation, accuracy ≥ 0.9); read
    only by the parts without sampling error."""

    value: float


@dataclass(frozen=True)
class Diff:
    """A side that is the per-seed difference of two cells (``of`` − ``minus``; App. F's gap at one setting)."""

    of: str
    minus: str


Side = str | Diff | Level
"""A part's treatment or control: a cell name of the claim, a :class:`Diff` of two, or (a control only) a
:class:`Level`."""


@dataclass(frozen=True)
class MarginRule:
    """A part's margin: none, the equivalence margin of ``comparator``'s mean ppl, a fixed ``value``, or a share
    ``value`` of ``comparator``'s mean (relative)."""

    kind: MarginKind = MarginKind.NONE
    comparator: str | None = None
    value: float | None = None

    def __post_init__(self) -> None:
        if self.kind is MarginKind.EQUIVALENCE and not self.comparator:
            raise ClaimError("an equivalence margin names its comparator cell")
        if self.kind is MarginKind.FIXED and not (self.value is not None and self.value > 0):
            raise ClaimError(f"a fixed margin is a positive number, got {self.value!r}")
        if self.kind is MarginKind.RELATIVE and not (self.comparator and self.value is not None and 0 < self.value):
            raise ClaimError(f"a relative margin names its comparator cell and a positive share, got "
                             f"{self.comparator!r}, {self.value!r}")

    @classmethod
    def equivalence(cls, comparator: str) -> MarginRule:
        return cls(MarginKind.EQUIVALENCE, comparator=comparator)

    @classmethod
    def fixed(cls, value: float) -> MarginRule:
        return cls(MarginKind.FIXED, value=float(value))

    @classmethod
    def relative(cls, comparator: str, share: float) -> MarginRule:
        return cls(MarginKind.RELATIVE, comparator=comparator, value=float(share))


NO_MARGIN = MarginRule()
_MARGIN_FORMS = (Form.EQUIVALENT, Form.NON_INFERIOR, Form.NON_SUPERIOR)
EVERY_SEED_FORMS = {Form.GREATER: ">", Form.LESS: "<", Form.NON_SUPERIOR: "≤", Form.NON_INFERIOR: "≥",
                    Form.EQUIVALENT: "≡"}
"""The forms :attr:`Statistic.EVERY_SEED` reads, per seed: t > c, t < c, t ≤ c + m, t ≥ c − m (m: the part's margin,
0 without one; C4's "non-increasing in b"), |t − c| ≤ m (a margin needed; C4's endpoints)."""
MEANS_FORMS = {Form.GREATER: ">", Form.LESS: "<", Form.NON_SUPERIOR: "≤", Form.NON_INFERIOR: "≥"}
"""The forms :attr:`Statistic.MEANS` reads between the seed means (no margin)."""


def side_cells(side: Side) -> tuple[str, ...]:
    """The cell names a side reads (none for a :class:`Level`)."""
    if isinstance(side, Level):
        return ()
    return (side.of, side.minus) if isinstance(side, Diff) else (side,)


@dataclass(frozen=True)
class Part:
    """One comparison of a claim: ``treatment`` against ``control`` in ``form``, read by ``statistic`` on
    ``metric`` (``control_metric``: the control's, where it reads another: A.1's whip loss after the fit against the
    same cell's loss before). ``reference`` / ``share``: :attr:`Statistic.WITHIN_SHARE`'s scale (C2's robust part:
    a quarter of pairwise_only's gap). ``note``: the text a deterministic part's verdict carries."""

    name: str
    treatment: Side
    control: Side
    form: Form
    statistic: Statistic = Statistic.PAIRED
    margin: MarginRule = NO_MARGIN
    metric: Metric = Metric.PPL
    reference: str | None = None
    share: float | None = None
    note: str = ""
    control_metric: Metric | None = None

    def __post_init__(self) -> None:
        needs = self.form in _MARGIN_FORMS
        margin = self.margin.kind is not MarginKind.NONE
        if self.statistic is Statistic.PAIRED and needs != margin:
            raise ClaimError(f"part {self.name!r}: {self.form.value} " + (
                "needs a margin" if needs else "takes no margin (its boundary is 0)"))
        if self.statistic is Statistic.EVERY_SEED:
            if self.form not in EVERY_SEED_FORMS:
                raise ClaimError(f"part {self.name!r}: {self.statistic.value} reads "
                                 f"{', '.join(f.value for f in EVERY_SEED_FORMS)}, not {self.form.value}")
            if self.form is Form.EQUIVALENT and not margin:
                raise ClaimError(f"part {self.name!r}: {self.form.value} every seed needs a margin")
            if self.form in (Form.GREATER, Form.LESS) and margin:
                raise ClaimError(f"part {self.name!r}: {self.form.value} every seed takes no margin")
        elif self.statistic is not Statistic.PAIRED:
            forms = MEANS_FORMS if self.statistic is Statistic.MEANS else (Form.GREATER, Form.LESS)
            if self.form not in forms and self.statistic is not Statistic.WITHIN_SHARE:
                raise ClaimError(f"part {self.name!r}: {self.statistic.value} reads "
                                 f"{', '.join(f.value for f in forms)}, not {self.form.value}")
            if margin:
                raise ClaimError(f"part {self.name!r}: {self.statistic.value} takes no margin")
        if isinstance(self.treatment, Level) or (isinstance(self.control, Level)
                                                  and self.statistic not in (Statistic.EVERY_SEED, Statistic.MEANS)):
            raise ClaimError(f"part {self.name!r}: a level is the control of an {Statistic.EVERY_SEED.value} or "
                             f"{Statistic.MEANS.value} part")
        if self.control_metric is not None and self.statistic is Statistic.PAIRED:
            raise ClaimError(f"part {self.name!r}: a paired part reads one metric on both sides")
        within = self.statistic is Statistic.WITHIN_SHARE
        if within != (self.reference is not None and self.share is not None):
            raise ClaimError(f"part {self.name!r}: reference and share go with {Statistic.WITHIN_SHARE.value} only")
        if within and (self.form is not Form.EQUIVALENT or not self.share or self.share <= 0):
            raise ClaimError(f"part {self.name!r}: {Statistic.WITHIN_SHARE.value} is an equivalence within a "
                             "positive share")

    def cells(self) -> tuple[str, ...]:
        """Every cell name the part reads, in order, once each."""
        names = [*side_cells(self.treatment), *side_cells(self.control)]
        names += [self.margin.comparator] if self.margin.comparator else []
        names += [self.reference] if self.reference else []
        return tuple(dict.fromkeys(names))


@dataclass(frozen=True)
class Claim:
    """A claim as data. ``id``: the registry's key (``C2``); ``title``: the claims table's claim column;
    ``statement``: the paper's claim in words; ``section``: where the paper makes it; ``cells``: name → cell;
    ``parts``: combined by :func:`rope_quant.core.verdict.combine_all` in this order; ``premises``: what it asks
    of an architecture; ``outside``: what the claim asserts beyond its parts that no cell value carries (a closed
    form, an assertion of its test), empty when nothing; ``group``: :data:`PAPER`, :data:`KEYS` or another
    package's; ``equal_bits``: every part compares cells that store equal bits per key element (checked from the
    configs by :func:`rope_quant.claims.premises.adapt`, and on the cells' measured ``k_bits_per_element`` by the
    engine); ``question``: a question beyond the paper rather than a statement of it (the key quantisers: does a
    scheme replace the online Hadamard?), so either decided answer is a result and its test fails only on an
    answer it cannot give (:meth:`fails_test`); ``slow``: its cells would push the default e2e layer past CI's
    time, so pytest's fronts mark its test ``slow`` (run with ``--run-slow``; ``rope-quant claims`` runs it when
    asked)."""

    id: str
    title: str
    statement: str
    section: str
    cells: Mapping[str, Mapping[str, Override]]
    parts: tuple[Part, ...]
    premises: tuple[Premise, ...] = (Premise.ROPE,)
    outside: str = ""
    group: str = PAPER
    equal_bits: bool = False
    question: bool = False
    slow: bool = False

    def fails_test(self, verdict: Any) -> bool:
        """Whether a front's test of this claim fails on ``verdict``: a statement of the paper fails when it is
        false or shown false (``verdict.failed``); a question only when a criterion without sampling error fails
        (refuted is one of its answers)."""
        return bool(verdict.outcome.value == "fails") if self.question else bool(verdict.failed)

    def __post_init__(self) -> None:
        object.__setattr__(self, "id", str(self.id))
        object.__setattr__(self, "group", str(self.group))
        cells = MappingProxyType({str(k): MappingProxyType(dict(v)) for k, v in self.cells.items()})
        object.__setattr__(self, "cells", cells)
        object.__setattr__(self, "parts", tuple(self.parts))
        if not self.id or not self.parts:
            raise ClaimError(f"claim {self.id!r}: needs an id and at least one part")
        names = [p.name for p in self.parts]
        if len(set(names)) != len(names):
            raise ClaimError(f"claim {self.id!r}: part names repeat: {names}")
        for p in self.parts:
            unknown = [n for n in p.cells() if n not in cells]
            if unknown:
                raise ClaimError(f"claim {self.id!r}, part {p.name!r}: no cell named {', '.join(unknown)} "
                                 f"(cells: {', '.join(cells)})")

    def cell_names(self) -> tuple[str, ...]:
        """The cells the parts read, in the order they first read them."""
        return tuple(dict.fromkeys(n for p in self.parts for n in p.cells()))

    def unresolved(self) -> dict[str, dict[str, Resolve]]:
        """Cell name → its keys still holding a :class:`Resolve` sentinel (empty: the claim can be read)."""
        return {n: got for n, c in self.cells.items() if (got := unresolved(c))}


class Registry:
    """Claims by id, in registration order; a taken id is refused."""

    def __init__(self, claims: Mapping[str, Claim] | None = None) -> None:
        self._claims: dict[str, Claim] = dict(claims or {})

    def register(self, claim: Claim) -> Claim:
        if claim.id in self._claims:
            raise DuplicateClaimError(f"claim id {claim.id!r} is already registered ({self._claims[claim.id].title})")
        self._claims[claim.id] = claim
        return claim

    def get(self, claim_id: str) -> Claim:
        try:
            return self._claims[claim_id]
        except KeyError:
            raise UnknownClaimError(f"no claim {claim_id!r}; registered: {', '.join(self._claims) or 'none'}") \
                from None

    def claims(self, group: str | None = None) -> tuple[Claim, ...]:
        return tuple(c for c in self._claims.values() if group is None or c.group == group)

    def ids(self, group: str | None = None) -> tuple[str, ...]:
        return tuple(c.id for c in self.claims(group))

    def groups(self) -> tuple[str, ...]:
        """The groups of the registered claims, in registration order."""
        return tuple(dict.fromkeys(c.group for c in self._claims.values()))


_ACTIVE: list[Registry] = [Registry()]


def active() -> Registry:
    """The registry in use (the default one, or the innermost :func:`temporary`)."""
    return _ACTIVE[-1]


def register(claim: Claim) -> Claim:
    """Add ``claim`` to the registry in use; a taken id raises :class:`DuplicateClaimError`."""
    return active().register(claim)


def get(claim_id: str) -> Claim:
    """The claim of ``claim_id`` (:class:`UnknownClaimError`, a KeyError, when none)."""
    return active().get(claim_id)


def claims(group: str | None = None) -> tuple[Claim, ...]:
    """Every registered claim (of ``group`` when given), in registration order."""
    return active().claims(group)


def groups() -> tuple[str, ...]:
    """The groups of the registered claims (:data:`PAPER`, :data:`KEYS`, …)."""
    return active().groups()


@contextmanager
def temporary(*, empty: bool = False) -> Iterator[Registry]:
    """A registry in use inside the block: a copy of the one in use (``empty``: none of its claims); what is
    registered inside is gone after it."""
    reg = Registry() if empty else Registry({c.id: c for c in active().claims()})
    _ACTIVE.append(reg)
    try:
        yield reg
    finally:
        _ACTIVE.remove(reg)

"""The run configuration: one cell of an experiment, composed of small frozen specs.

A :class:`RunConfig` holds the model, corpus and seed plus five specs (defined in
:mod:`rope_quant.experiment.specs`, with their names and checks; this module re-exports them)::

    quant     QuantSpecs    weights (WeightSpec: mode, bits, clip, GPTQConfig), a/k/v (QuantConfig), static scope,
                            the key quantiser (KeyQuantSpec: per_token by default, kivi, kvquant_prerope, ...)
    rotation  RotationSpec  offline R1, R2 (RotationKind) and the online R4 flag
    online    R3Spec        R3 transform and block, angle estimator, objective, angle rule (φ̂ or φ*)
    budget    Budget        seqlen, calibration windows, evaluation windows
    runtime   Runtime       device, dtype

Names with a fixed set of values come from one ``StrEnum`` each (:class:`WeightMode`, :class:`StaticScope`,
:class:`~rope_quant.rotations.offline.RotationKind`, :class:`Estimator`,
:class:`~rope_quant.calib.objectives.Objective`, :class:`DType`); the CLI's choices read them too.

**Flat names.** Every leaf has one flat name, equal to the field names of the former flat ``RunConfig``
(``w_bits``, ``k_group``, ``r3``, ``estimator``, ``seqlen`` ...). :func:`flat_fields` derives the table
from the dataclass fields: a spec field's ``prefix`` metadata prefixes its leaves (``a`` + ``group`` →
``a_group``), a leaf's ``short`` metadata shortens its name, ``flat`` gives an absolute name, ``leaf``
stops the descent (``gptq``). :meth:`RunConfig.from_flat` / :meth:`RunConfig.override` build configs
from flat names, and flat names read as attributes (``cfg.k_bits``).

**Content identity.** ``model_id`` and ``corpus_id`` (None by default) hold content hashes of the model
files and the corpus (:func:`rope_quant.experiment.identity.resolve_identity` sets them, the CLI before any
cell runs). Where set, every key hashes the content identity instead of the model / corpus name, so a
corpus rewritten under the same path changes the keys and a relative or absolute path to the same model
does not.

**Keys.** :meth:`RunConfig.key` (cell identity), :meth:`RunConfig.weight_key` (quantised weights) and
:meth:`RunConfig.stats_key` (calibration statistics) hash only the fields that differ from the default
``RunConfig()``, prefixed with :data:`KEY_VERSION` (``v4-<16 hex>``): adding a field with a default keeps
every existing key. Changing a default value (or what a key covers) needs a new :data:`KEY_VERSION`.
The weight and statistics keys are derived from the specs that shape them, never from the R3 spec, so
every R3 variant of a seed shares them (paired design). Fields marked ``cell_only`` (evaluation windows,
device) belong to the cell but shape neither the weights nor the statistics.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rope_quant.calib.objectives import AngleRule, Objective
from rope_quant.defaults import DEFAULT_CORPUS, DEFAULT_MODEL
from rope_quant.experiment.specs import (
    Budget,
    DType,
    Estimator,
    KeyQuantSpec,
    PipelineError,
    QuantSpecs,
    R3Spec,
    RotationSpec,
    Runtime,
    StaticScope,
    WeightMode,
    WeightSpec,
    WhipSpec,
    _plain,
)
from rope_quant.quant.quantizers import QuantConfigError
from rope_quant.quant.rtn import GPTQConfig, GPTQError
from rope_quant.rotations.offline import RotationKind

__all__ = [
    "KEY_VERSION",
    "WEIGHT_CACHE_FORMAT",
    "WHIP_FIT_REVISION",
    "K_SAMPLE_ROWS",
    "PipelineError",
    "WeightMode",
    "StaticScope",
    "RotationKind",
    "Estimator",
    "Objective",
    "DType",
    "WeightSpec",
    "KeyQuantSpec",
    "QuantSpecs",
    "WhipSpec",
    "RotationSpec",
    "AngleRule",
    "R3Spec",
    "Budget",
    "Runtime",
    "RunConfig",
    "flat_fields",
    "versioned_hash",
]

#: Version of the key scheme, carried by every key (``v4-…``). 1 hashed every flat field; 2 hashed the
#: non-default fields; 3: the paper's rotations became the default (R1 whip, R2 random_hadamard), the
#: random Hadamard became QuaRot's diag(s)·H, and φ̂/φ* became the ``angle`` rule. 4: GPTQ's scale search
#: minimises the Hessian-diagonal proxy by default where R1 is identity (``GPTQConfig.objective="auto"``).
KEY_VERSION = 4
#: Format of the on-disk weight cache and revision of the GPTQ arithmetic that fills it (part of the weight key,
#: so a cache written by another revision is rebuilt, never read). 2: the staged layer forward, one Cholesky with
#: a triangular inverse, and the float-order replicate's float64 scope (Hessian sums and factorisation only):
#: the same algorithm in another float order. 3: the factorisations on one CPU thread (:mod:`rope_quant.core.threads`),
#: so the weights are the same at any thread count (a format-2 file holds whatever its writer's thread count gave).
WEIGHT_CACHE_FORMAT = 3
#: Revision of the whip fit's arithmetic (part of the R1 cache key). 2: its factorisations on one CPU thread
#: (:mod:`rope_quant.core.threads`), so the fit is the same at any thread count.
WHIP_FIT_REVISION = 2
#: Pre-RoPE K tokens sampled per layer during calibration (positions kept) for the ``range`` objective.
K_SAMPLE_ROWS = 2048
#: How the K sample draws its keys (part of the statistics cache key: a file sampled another way is rebuilt, not
#: read). "per_layer": one generator per layer, seeded by (seed, layer), so the sample does not depend on how
#: many windows a calibration forward holds.
K_SAMPLE_KEYS = "per_layer"


# ----------------------------------------------------------------------------- generic helpers


FieldFilter = Callable[[dataclasses.Field], bool]


def _not_cell_only(f: dataclasses.Field) -> bool:
    return not f.metadata.get("cell_only", False)


def _diff(obj: Any, ref: Any, keep: FieldFilter | None = None) -> dict[str, Any]:
    """The fields of dataclass ``obj`` that differ from ``ref`` (same type), nested, JSON-able.

    ``keep`` filters the fields of ``obj`` itself (not of nested specs).
    """
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        if keep is not None and not keep(f):
            continue
        value, default = getattr(obj, f.name), getattr(ref, f.name)
        if dataclasses.is_dataclass(value) and type(value) is type(default):
            sub = _diff(value, default)
            if sub:
                out[f.name] = sub
        elif value != default:
            out[f.name] = _plain(value)
    return out


def versioned_hash(payload: Mapping[str, Any]) -> str:
    """``v<KEY_VERSION>-`` + 16 hex digits of the SHA-256 of ``payload`` (sorted-key JSON)."""
    text = json.dumps({"version": KEY_VERSION, **payload}, sort_keys=True, default=str)
    return f"v{KEY_VERSION}-" + hashlib.sha256(text.encode()).hexdigest()[:16]


@functools.cache
def _default(cls: type) -> Any:
    return cls()


@functools.cache
def flat_fields(cls: type) -> dict[str, tuple[str, ...]]:
    """Flat name -> attribute path (``"k_group" -> ("quant", "k", "group_size")``) of config class ``cls``.

    Derived from the dataclass fields of ``cls()`` and their metadata (module docstring); flat names
    are unique.
    """
    table: dict[str, tuple[str, ...]] = {}

    def walk(obj: Any, path: tuple[str, ...], prefix: str) -> None:
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value) and not f.metadata.get("leaf", False):
                walk(value, (*path, f.name), f.metadata.get("prefix", prefix))
                continue
            name = f.metadata.get("flat")
            if name is None:
                short = f.metadata.get("short", f.name)
                name = f"{prefix}_{short}" if prefix else short
            if name in table:
                raise TypeError(f"flat name {name!r} of {'.'.join((*path, f.name))} is already "
                                f"{'.'.join(table[name])}")
            table[name] = (*path, f.name)

    walk(_default(cls), (), "")
    return table


def _legacy_angle(values: Mapping[str, Any]) -> dict[str, Any]:
    """Map the former ``position_average`` flag onto the ``angle`` rule (older records, presets, callers)."""
    out = dict(values)
    if "position_average" not in out:
        return out
    flag = out.pop("position_average")
    rule = AngleRule.PHI_STAR.value if flag else AngleRule.PHI_HAT.value
    if "angle" in out and out["angle"] is not None and str(out["angle"]) != rule and flag:
        raise PipelineError(f"position_average=True contradicts angle={out['angle']!r}")
    out.setdefault("angle", rule)
    return out


class _Node(dict):
    """A group of changes to one nested spec (distinguishes specs from dict-valued leaves)."""


def _apply(obj: Any, changes: Mapping[str, Any]) -> Any:
    kwargs = {name: _apply(getattr(obj, name), value) if isinstance(value, _Node) else value
              for name, value in changes.items()}
    return dataclasses.replace(obj, **kwargs)


def _build(default: Any, data: Mapping[str, Any], where: str) -> Any:
    """A dataclass like ``default`` with the fields given in nested ``data`` (the others default)."""
    names = {f.name for f in dataclasses.fields(default)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise PipelineError(f"unknown field(s) {unknown} in {where}; valid: {', '.join(sorted(names))}")
    kwargs = {}
    for name, value in data.items():
        current = getattr(default, name)
        if dataclasses.is_dataclass(current) and isinstance(value, Mapping):
            value = _build(current, value, f"{where}.{name}")
        kwargs[name] = value
    return dataclasses.replace(default, **kwargs)


# ----------------------------------------------------------------------------- the run configuration


@dataclass(frozen=True)
class RunConfig:
    """One cell of an experiment (frozen). Build it from specs, :meth:`from_flat` or :meth:`from_dict`.

    Bits of 16 (or more) switch a quantiser off; groups of -1 mean the whole row (activations) or the
    whole head (K/V). Flat names read as attributes: ``cfg.k_bits is cfg.quant.k.bits``.
    """

    model: str = DEFAULT_MODEL
    corpus: str = field(default=DEFAULT_CORPUS, metadata={"calibration": True})
    seed: int = 0
    model_id: str | None = field(default=None, metadata={"names": "model"})
    corpus_id: str | None = field(default=None, metadata={"calibration": True, "names": "corpus"})
    quant: QuantSpecs = field(default_factory=QuantSpecs)
    rotation: RotationSpec = field(default_factory=RotationSpec)
    online: R3Spec = field(default_factory=R3Spec)
    budget: Budget = field(default_factory=Budget)
    runtime: Runtime = field(default_factory=Runtime)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
            if dataclasses.is_dataclass(default) and not isinstance(getattr(self, f.name), type(default)):
                raise PipelineError(f"{f.name} must be a {type(default).__name__}, "
                                    f"got {type(getattr(self, f.name)).__name__}")
        if self.online.objective == Objective.RANGE and self.quant.k.group_size != -1:
            raise PipelineError("objective 'range' scores whole-head K groups: it needs k_group=-1")
        if self.online.runtime_rotation:
            self._check_runtime_rotation()

    def _check_runtime_rotation(self) -> None:
        """llama.cpp rotates only a quantised K cache, and after RoPE (no pre-RoPE key quantiser)."""
        q = self.quant
        if not (q.k.enabled or q.static_kv):
            raise PipelineError("runtime_rotation: llama.cpp rotates Q and K only when the K cache is quantised; this "
                                f"cell's keys are not (k_bits {q.k.bits})")
        option = q.key_option()
        if option.pre_rope:
            raise PipelineError(f"runtime_rotation acts on the post-RoPE key the runtime stores; k_quant="
                                f"{option.name} quantises the key before RoPE: the two do not combine")

    # -- flat names

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        path = flat_fields(type(self)).get(name)
        if path is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        value: Any = self
        for part in path:
            value = getattr(value, part)
        return value

    @classmethod
    def from_flat(cls, **flat: Any) -> RunConfig:
        """The default config with flat-named fields set (``from_flat(w_bits=3, r3="pairwise_only")``)."""
        return _default(cls).override(**flat)

    def override(self, **flat: Any) -> RunConfig:
        """A copy with flat-named fields replaced; unknown names raise :class:`PipelineError`."""
        table = flat_fields(type(self))
        flat = _legacy_angle(flat)
        unknown = sorted(set(flat) - set(table))
        if unknown:
            raise PipelineError(f"unknown configuration field(s) {', '.join(unknown)}; valid: {', '.join(table)}")
        tree = _Node()
        for name, value in flat.items():
            node = tree
            *parents, leaf = table[name]
            for part in parents:
                node = node.setdefault(part, _Node())
            node[leaf] = value
        try:
            return _apply(self, tree)
        except (QuantConfigError, GPTQError) as exc:
            raise PipelineError(f"{exc} (setting {', '.join(flat)})") from None

    def flat(self) -> dict[str, Any]:
        """Every flat name with its value (enums as values; ``gptq`` as a GPTQConfig)."""
        return {name: _plain(getattr(self, name)) if name != "gptq" else self.quant.w.gptq
                for name in flat_fields(type(self))}

    # -- (de)serialisation

    def to_dict(self) -> dict[str, Any]:
        """Nested JSON-able dict (:meth:`from_dict` inverts it)."""
        return _plain(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunConfig:
        """Rebuild from :meth:`to_dict` output, or from the flat dict of the former flat ``RunConfig``
        (manifests and cell records of older results directories). Missing fields take their defaults."""
        default = _default(cls)
        specs = {f.name for f in dataclasses.fields(cls) if dataclasses.is_dataclass(getattr(default, f.name))}
        if specs & set(data):
            data = dict(data)
            if isinstance(data.get("online"), Mapping):
                data["online"] = _legacy_angle(data["online"])
            try:
                return _build(default, data, cls.__name__)
            except (QuantConfigError, GPTQError, TypeError) as exc:
                raise PipelineError(f"bad configuration dict: {exc}") from None
        flat = dict(data)
        if isinstance(flat.get("gptq"), Mapping):
            try:
                flat["gptq"] = GPTQConfig(**flat["gptq"])
            except (GPTQError, TypeError) as exc:
                raise PipelineError(f"bad gptq settings: {exc}") from None
        return cls.from_flat(**flat)

    @property
    def position_average(self) -> bool:
        """R3 uses the position-averaged φ* (``online.angle == phi_star``)."""
        return self.online.position_average

    # -- keys

    @classmethod
    def identity_fields(cls) -> tuple[str, ...]:
        """The content-identity fields (``model_id``, ``corpus_id``): hashes of content, not settings, so a
        study rerun on changed content is the same study with new cells."""
        return tuple(f.name for f in dataclasses.fields(cls) if "names" in f.metadata)

    def _keyed(self) -> RunConfig:
        """The view the keys hash: a name whose content identity is set (``model_id``, ``corpus_id``) is
        replaced by its default, so the keys follow the content, not the spelling of a path."""
        ref = _default(type(self))
        names = {}
        for f in dataclasses.fields(self):
            name = f.metadata.get("names")
            if name is not None and getattr(self, f.name) is not None and getattr(self, name) != getattr(ref, name):
                names[name] = getattr(ref, name)
        return dataclasses.replace(self, **names) if names else self

    def key(self) -> str:
        """The cell's identity (caches, records, resume): a versioned hash of the non-default fields
        (content identities in place of the model and corpus names where resolved)."""
        return versioned_hash(_diff(self._keyed(), _default(type(self))))

    @property
    def gptq_sees_act_quant(self) -> bool:
        """GPTQ Hessians are accumulated on the quantised activations when activation quant is on."""
        q = self.quant
        return q.w.mode == WeightMode.GPTQ and (q.a.enabled or q.static_act)

    @property
    def uses_calibration_for_weights(self) -> bool:
        """GPTQ (Hessians) and whip rotations (fits) read the calibration windows."""
        return self.quant.w.mode == WeightMode.GPTQ or self.rotation.uses_calibration

    def _calibration(self, ref: RunConfig) -> dict[str, Any]:
        """The calibration sample: the corpus and the budget fields that are not evaluation-only."""
        top = _diff(self, ref, keep=lambda f: f.metadata.get("calibration", False))
        return {**top, **_diff(self.budget, ref.budget, keep=_not_cell_only)}

    def _activations(self, ref: RunConfig) -> dict[str, Any]:
        """The activation quantiser: the dynamic spec and whether the static control replaces it."""
        return {**_diff(self.quant.a, ref.quant.a), **({"static": True} if self.quant.static_act else {})}

    def _weights(self, ref: RunConfig) -> dict[str, Any]:
        """The weight quantiser; GPTQ-only settings count for GPTQ only, and nothing counts when off."""
        w, rw = self.quant.w, ref.quant.w
        if w.mode == WeightMode.NONE:
            return {"mode": w.mode.value}
        out = _diff(w, rw, keep=lambda f: f.name != "gptq")
        rtn_only = None if w.mode == WeightMode.GPTQ else (lambda f: f.metadata.get("rtn", False))
        gptq = _diff(w.gptq, rw.gptq, keep=rtn_only)
        return {**out, **({"gptq": gptq} if gptq else {})}

    def weight_fields(self) -> dict[str, Any]:
        """What determines the quantised weights (never the R3 spec, K/V or evaluation settings)."""
        if (keyed := self._keyed()) is not self:
            return keyed.weight_fields()
        ref = _default(type(self))
        top = _diff(self, ref, keep=lambda f: not f.metadata.get("calibration", False)
                    and not dataclasses.is_dataclass(getattr(ref, f.name)))
        parts: dict[str, Any] = {"format": WEIGHT_CACHE_FORMAT, **top,
                                 "runtime": _diff(self.runtime, ref.runtime, keep=_not_cell_only),
                                 "rotation": _diff(self.rotation, ref.rotation), "weights": self._weights(ref)}
        if self.uses_calibration_for_weights:
            parts["calibration"] = self._calibration(ref)
        if self.gptq_sees_act_quant:
            parts["activations"] = self._activations(ref)
        if self.rotation.r1 == "identity":  # norms stay unfused without R1 (rotations/offline.rotate_model); the
            parts["norms"] = "unfused"     # marker keeps caches written when they were fused from being read
        return parts

    def weight_key(self) -> str:
        """Versioned hash of :meth:`weight_fields`: shared by every R3 variant (and K/V setting) of a seed."""
        return versioned_hash(self.weight_fields())

    def stats_key(self) -> str:
        """Versioned hash of what determines the calibration statistics: weights, activation quantisers,
        calibration sample and K sample size."""
        if (keyed := self._keyed()) is not self:
            return keyed.stats_key()
        ref = _default(type(self))
        return versioned_hash({"weights": self.weight_fields(), "calibration": self._calibration(ref),
                               "activations": self._activations(ref), "k_sample": K_SAMPLE_ROWS,
                               "k_sample_keys": K_SAMPLE_KEYS})

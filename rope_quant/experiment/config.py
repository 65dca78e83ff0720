"""The run configuration: one cell of an experiment, composed of small frozen specs.

A :class:`RunConfig` holds the model, corpus and seed plus five specs::

    quant     QuantSpecs    weights (WeightSpec: mode, bits, clip, GPTQConfig), a/k/v (QuantConfig), static scope
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
import enum
import functools
import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

from rope_quant.calib.objectives import GRID_OBJECTIVES, AngleRule, Objective
from rope_quant.calib.rules import PoolingRule
from rope_quant.defaults import DEFAULT_CORPUS, DEFAULT_MODEL
from rope_quant.quant.quantizers import QuantConfig, QuantConfigError, check_bits, check_clip
from rope_quant.quant.rtn import GPTQConfig, GPTQError
from rope_quant.rotations.offline import RotationConfig, RotationKind
from rope_quant.rotations.whip import WhipConfig

__all__ = [
    "KEY_VERSION",
    "WEIGHT_CACHE_FORMAT",
    "K_SAMPLE_ROWS",
    "PipelineError",
    "WeightMode",
    "StaticScope",
    "RotationKind",
    "Estimator",
    "Objective",
    "DType",
    "WeightSpec",
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
#: the same algorithm in another float order.
WEIGHT_CACHE_FORMAT = 2
#: Pre-RoPE K tokens sampled per layer during calibration (positions kept) for the ``range`` objective.
K_SAMPLE_ROWS = 2048
#: How the K sample draws its keys (part of the statistics cache key: a file sampled another way is rebuilt, not
#: read). "per_layer": one generator per layer, seeded by (seed, layer), so the sample does not depend on how
#: many windows a calibration forward holds.
K_SAMPLE_KEYS = "per_layer"


class PipelineError(ValueError):
    """Bad run configuration or pipeline state."""


# ----------------------------------------------------------------------------- names


class WeightMode(StrEnum):
    """The weight quantiser: GPTQ, round-to-nearest, or none."""

    GPTQ = "gptq"
    RTN = "rtn"
    NONE = "none"


class StaticScope(StrEnum):
    """Where the static per-channel control (App. A.6, D) replaces the dynamic quantisers (None: nowhere)."""

    ACT = "act"
    KV = "kv"
    BOTH = "both"


# The covariance pooling rule behind the pairwise angles: the calibration layer owns the names.
Estimator = PoolingRule


class DType(StrEnum):
    """The model's compute dtype."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"

    @property
    def torch(self) -> Any:
        import torch

        return getattr(torch, self.value)


#: The offline rotations the pipeline can build by itself ("given" needs a caller's matrix).
PIPELINE_ROTATIONS = (RotationKind.WHIP, RotationKind.RANDOM_HADAMARD, RotationKind.HADAMARD, RotationKind.IDENTITY)


def _choice(enum_cls: type[StrEnum], value: Any, what: str, allowed: tuple | None = None) -> Any:
    """``value`` as a member of ``enum_cls`` (restricted to ``allowed``), else :class:`PipelineError`."""
    allowed = tuple(enum_cls) if allowed is None else allowed
    try:
        member = enum_cls(value)
    except ValueError:
        member = None
    if member is None or member not in allowed:
        raise PipelineError(f"{what} must be one of {tuple(m.value for m in allowed)}, got {value!r}")
    return member


def _positive(value: Any, what: str, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PipelineError(f"{what} must be {'None or ' if optional else ''}a positive integer, got {value!r}")


def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)


# ----------------------------------------------------------------------------- specs


@dataclass(frozen=True)
class WeightSpec:
    """Weight quantisation: the quantiser, its bits and clip ratio, and the GPTQ (and RTN scale) settings."""

    mode: WeightMode = field(default=WeightMode.GPTQ, metadata={"flat": "weights"})
    bits: int = 4
    clip: float = 1.0
    gptq: GPTQConfig = field(default_factory=GPTQConfig, metadata={"flat": "gptq", "leaf": True})

    def __post_init__(self) -> None:
        _set(self, "mode", _choice(WeightMode, self.mode, "weights"))
        check_bits(self.bits, "w_bits", low=2, error=PipelineError)
        check_clip(self.clip, "w_clip", error=PipelineError)
        if not isinstance(self.gptq, GPTQConfig):
            raise PipelineError(f"gptq must be a GPTQConfig, got {type(self.gptq).__name__}")


def _act_default() -> QuantConfig:
    return QuantConfig(bits=4)


@dataclass(frozen=True)
class QuantSpecs:
    """Every quantiser of a cell: weights, activations (a), keys (k), values (v), and the static control."""

    w: WeightSpec = field(default_factory=WeightSpec, metadata={"prefix": "w"})
    a: QuantConfig = field(default_factory=_act_default, metadata={"prefix": "a"})
    k: QuantConfig = field(default_factory=_act_default, metadata={"prefix": "k"})
    v: QuantConfig = field(default_factory=_act_default, metadata={"prefix": "v"})
    static_scope: StaticScope | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.w, WeightSpec):
            raise PipelineError(f"w must be a WeightSpec, got {type(self.w).__name__}")
        for name in ("a", "k", "v"):
            spec = getattr(self, name)
            if not isinstance(spec, QuantConfig):
                raise PipelineError(f"{name} must be a QuantConfig, got {type(spec).__name__}")
            check_bits(spec.bits, f"{name}_bits", low=2, error=PipelineError)
        if self.static_scope is not None:
            _set(self, "static_scope", _choice(StaticScope, self.static_scope, "static_scope"))

    @property
    def static_act(self) -> bool:
        """The static control replaces the dynamic activation quantisers."""
        return self.static_scope in (StaticScope.ACT, StaticScope.BOTH)

    @property
    def static_kv(self) -> bool:
        """The static control replaces the dynamic K/V quantisers."""
        return self.static_scope in (StaticScope.KV, StaticScope.BOTH)


@dataclass(frozen=True)
class WhipSpec:
    """The whip fit of R1 (DartQuant Sec. 3.2–3.3; the paper's pipeline, App. A.1): SGD with momentum on the
    QR-orthogonal parameterisation, cosine-annealed, each epoch drawing ``subset`` of the samples.

    Defaults are the paper's CUDA schedule: learning rate 1e-3, momentum 0.9 and a cosine schedule (the
    released scripts' optimiser), subset fraction 0.1 (the released R1 script). The released batch size and
    epoch count are not known to us: ``batch_size`` 64 and ``epochs`` 10 are our choice, named as such in the
    README. A sample is ``tokens_per_sample`` tokens of one layer's normed residual. The schedule is the same on
    CPU (the fit takes seconds there); ``--whip-epochs`` changes it and the run prints it.
    """

    lr: float = 1e-3
    momentum: float = 0.9
    epochs: int = 10
    batch_size: int = 64
    subset: float = 0.1
    cosine: bool = True
    tokens_per_sample: int = 64

    def __post_init__(self) -> None:
        _positive(self.epochs, "whip_epochs")
        _positive(self.batch_size, "whip_batch_size")
        _positive(self.tokens_per_sample, "whip_tokens_per_sample")
        if not (isinstance(self.subset, (int, float)) and 0 < self.subset <= 1):
            raise PipelineError(f"whip_subset must be in (0, 1], got {self.subset!r}")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise PipelineError(f"whip_lr must be positive, got {self.lr!r}")

    def whip_config(self) -> WhipConfig:
        """The :class:`~rope_quant.rotations.whip.WhipConfig` of this schedule (R1's fit)."""
        return WhipConfig(lr=float(self.lr), momentum=float(self.momentum), epochs=self.epochs,
                          batch_size=self.batch_size, subset=float(self.subset), cosine=self.cosine)


@dataclass(frozen=True)
class RotationSpec:
    """The offline rotations (App. A.1, A.8): R1 (residual stream), R2 (per head, V/O), the online R4.

    Defaults are the paper's pipeline: R1 fitted with whip, R2 left at its seeded random-Hadamard
    initialisation (the released R2 calibrator never steps, A.8), R4 an online Hadamard before down_proj.
    ``r2="whip"`` trains R2 (our working schedule): an explicit deviation from A.8.
    """

    r1: RotationKind = RotationKind.WHIP
    r2: RotationKind = RotationKind.RANDOM_HADAMARD
    r4: bool = True
    whip: WhipSpec = field(default_factory=WhipSpec, metadata={"prefix": "whip"})

    def __post_init__(self) -> None:
        for name in ("r1", "r2"):
            _set(self, name, _choice(RotationKind, getattr(self, name), name, PIPELINE_ROTATIONS))
        if not isinstance(self.r4, bool):
            raise PipelineError(f"r4 must be a bool, got {self.r4!r}")
        if not isinstance(self.whip, WhipSpec):
            raise PipelineError(f"whip must be a WhipSpec, got {type(self.whip).__name__}")

    @property
    def uses_calibration(self) -> bool:
        """whip rotations are fitted on the calibration windows."""
        return RotationKind.WHIP in (self.r1, self.r2)

    @property
    def deviations(self) -> list[str]:
        """Departures from the paper's rotations (A.1, A.8), named for the printed settings and the README."""
        out = []
        if self.r1 != RotationKind.WHIP:
            out.append(f"R1 {self.r1.value} instead of whip (A.1)")
        if self.r2 == RotationKind.WHIP:
            out.append("R2 trained with whip (the paper keeps R2 at its random-Hadamard initialisation, A.8)")
        elif self.r2 != RotationKind.RANDOM_HADAMARD:
            out.append(f"R2 {self.r2.value} instead of random_hadamard (A.8)")
        if not self.r4:
            out.append("no online R4")
        return out

    def protocol(self) -> dict[str, Any]:
        """What env.json records of these rotations: kinds, the whip settings, the deviations (A.1, A.8)."""
        return {"r1": self.r1.value, "r2": self.r2.value, "r4": "hadamard" if self.r4 else "off",
                "whip": _plain(self.whip), "deviations": self.deviations}

    def whip_options(self) -> dict[str, Any]:
        """Keyword options of :func:`rope_quant.rotations.whip.calibrate_model_rotations`."""
        cfg = self.whip.whip_config()
        return {"r1": cfg, "r2": cfg, "tokens_per_sample": self.whip.tokens_per_sample}

    def config(self, seed: int) -> RotationConfig:
        """The :class:`~rope_quant.rotations.offline.RotationConfig` of these rotations at ``seed``."""
        return RotationConfig(r1=self.r1.value, r2=self.r2.value, r4=self.r4, seed=seed)


@dataclass(frozen=True)
class R3Spec:
    """The online R3 after RoPE and its angles.

    ``transform``: an R3 registry name (``core.transforms``), ``block`` its block size. The angles come
    from the ``estimator``'s pooled covariances and the ``objective``; for the variance objective the
    ``angle`` rule picks φ̂, the branch-matched φ̂ (App. J's control) or the position-averaged φ* over
    ``average_length`` (default: seqlen). ``position_average`` reads (and, as a flat name, sets)
    ``angle == phi_star``, its former spelling.
    """

    transform: str = field(default="hadamard", metadata={"flat": "r3"})
    block: int | None = field(default=None, metadata={"flat": "r3_block"})
    estimator: Estimator = Estimator.ROWS
    objective: Objective = Objective.VARIANCE
    angle: AngleRule = AngleRule.PHI_HAT
    average_length: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.transform, str) or not self.transform:
            raise PipelineError(f"r3 must be a registry name, got {self.transform!r}")
        _positive(self.block, "r3_block", optional=True)
        _set(self, "estimator", _choice(Estimator, self.estimator, "estimator"))
        _set(self, "objective", _choice(Objective, self.objective, "objective"))
        _set(self, "angle", _choice(AngleRule, self.angle, "angle"))
        _positive(self.average_length, "average_length", optional=True)
        if self.objective.value in GRID_OBJECTIVES and self.estimator != Estimator.K_ONLY:
            raise PipelineError(f"objective {self.objective.value!r} scores the pipeline's K candidate rows: "
                                f"it needs estimator 'k_only', got {self.estimator.value!r}")
        if self.objective != Objective.VARIANCE and self.angle != AngleRule.PHI_HAT:
            raise PipelineError(f"objective {self.objective.value!r} fits its own angles: the angle rule "
                                f"({self.angle.value}) applies to objective='variance'")

    @property
    def position_average(self) -> bool:
        """φ* (the position-averaged angle) rather than a φ̂ variant."""
        return self.angle == AngleRule.PHI_STAR


@dataclass(frozen=True)
class Budget:
    """Window length and window counts (``eval_windows=None``: every evaluation window). A window needs
    :data:`MIN_SEQLEN` tokens: one to predict from and one to score."""

    seqlen: int = 2048
    calib_windows: int = 128
    eval_windows: int | None = field(default=None, metadata={"cell_only": True})

    MIN_SEQLEN: ClassVar[int] = 2

    def __post_init__(self) -> None:
        _positive(self.seqlen, "seqlen")
        if self.seqlen < self.MIN_SEQLEN:
            raise PipelineError(f"seqlen must be >= {self.MIN_SEQLEN} (a window scores its next tokens), "
                                f"got {self.seqlen}")
        _positive(self.calib_windows, "calib_windows")
        _positive(self.eval_windows, "eval_windows", optional=True)


@dataclass(frozen=True)
class Runtime:
    """Where and in which dtype the model runs (the device shapes neither weights nor statistics keys)."""

    device: str = field(default="cpu", metadata={"cell_only": True})
    dtype: DType = DType.FLOAT32

    def __post_init__(self) -> None:
        _set(self, "dtype", _choice(DType, self.dtype, "dtype"))


# ----------------------------------------------------------------------------- generic helpers


def _plain(value: Any) -> Any:
    """JSON-able form: dataclasses as dicts, enums as their values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


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

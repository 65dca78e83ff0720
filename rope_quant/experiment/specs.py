"""The specs a :class:`~rope_quant.experiment.config.RunConfig` is composed of, and the names they take.

A spec is a small frozen dataclass of one concern: :class:`WeightSpec`, :class:`KeyQuantSpec` and
:class:`QuantSpecs` (the quantisers), :class:`WhipSpec` and :class:`RotationSpec` (the offline rotations),
:class:`R3Spec` (the online R3 and its angles), :class:`Budget` (windows), :class:`Runtime` (device, dtype). Each
checks its fields when built and raises :class:`PipelineError` on a bad value. Names with a fixed set of values are
``StrEnum`` members (:class:`WeightMode`, :class:`StaticScope`, :class:`Estimator`, :class:`DType`).

:mod:`rope_quant.experiment.config` holds :class:`~rope_quant.experiment.config.RunConfig`, the flat names
(field metadata ``prefix``, ``short``, ``flat``, ``leaf``) and the keys (``cell_only``, ``calibration``,
``rtn``), and re-exports the public names of this module.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

from rope_quant.calib.objectives import GRID_OBJECTIVES, AngleRule, Objective
from rope_quant.calib.rules import PoolingRule
from rope_quant.quant import keys as keyq
from rope_quant.quant.quantizers import QuantConfig, check_bits, check_clip
from rope_quant.quant.rtn import GPTQConfig
from rope_quant.rotations.offline import RotationConfig, RotationKind
from rope_quant.rotations.whip import WhipConfig

__all__ = [
    "PipelineError",
    "WeightMode",
    "StaticScope",
    "Estimator",
    "DType",
    "PIPELINE_ROTATIONS",
    "WeightSpec",
    "KeyQuantSpec",
    "QuantSpecs",
    "WhipSpec",
    "RotationSpec",
    "R3Spec",
    "Budget",
    "Runtime",
]


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


def _plain(value: Any) -> Any:
    """JSON-able form: dataclasses as dicts, enums as their values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


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


#: The config fields of :class:`KeyQuantSpec` that are an option's own parameters (None: the option's default).
KEY_QUANT_PARAMS = ("token_group", "residual", "sinks", "min_bits", "max_bits", "avg_bits")


@dataclass(frozen=True)
class KeyQuantSpec:
    """Which key quantiser a cell uses (``k_quant``, a :mod:`rope_quant.quant.keys` registry name) and
    its own parameters; the bits, and the per-token rule's group / clip / symmetry, stay in ``QuantSpecs.k``.

    The default, ``per_token``, is the paper's rule: with it every parameter is None and no key changes. A
    parameter the chosen quantiser does not take must stay None; one it takes is filled with the option's
    default when None, so a config that spells a default out has the key of one that does not (docs/
    key_quantizers.md). Flat names: ``k_quant``, ``k_token_group`` (KIVI / KVQuant's G), ``k_residual`` (KIVI's
    R), ``k_sinks`` (S), ``k_min_bits`` / ``k_max_bits`` / ``k_avg_bits`` (rope_pair_bits' widths and target).
    """

    kind: str = field(default=keyq.DEFAULT_KEY_QUANT.value, metadata={"flat": "k_quant"})
    token_group: int | None = None
    residual: int | None = None
    sinks: int | None = None
    min_bits: int | None = None
    max_bits: int | None = None
    avg_bits: float | None = None

    def __post_init__(self) -> None:
        kind = self.kind.value if isinstance(self.kind, enum.Enum) else self.kind
        try:
            defaults = keyq.spec_defaults(kind)
        except keyq.KeyQuantError as exc:
            raise PipelineError(f"k_quant: {exc}") from None
        _set(self, "kind", str(kind))
        for name in KEY_QUANT_PARAMS:
            if getattr(self, name) is None and name in defaults:
                _set(self, name, defaults[name])
        if isinstance(self.avg_bits, int) and not isinstance(self.avg_bits, bool):
            _set(self, "avg_bits", float(self.avg_bits))

    @property
    def is_default(self) -> bool:
        """The paper's per-token rule."""
        return self.kind == keyq.DEFAULT_KEY_QUANT.value

    def params(self) -> dict[str, Any]:
        """The option's own parameters (config field -> value; None where the option does not take it)."""
        return {name: getattr(self, name) for name in KEY_QUANT_PARAMS}

    def option(self, k: QuantConfig) -> keyq.KeyQuantOption:
        """The registry option with the cell's K settings ``k``; :class:`PipelineError` on a bad value."""
        try:
            return keyq.option_from(self.kind, k, **self.params())
        except keyq.KeyQuantError as exc:
            raise PipelineError(str(exc)) from None


@dataclass(frozen=True)
class QuantSpecs:
    """Every quantiser of a cell: weights, activations (a), keys (k), values (v), the static control, and which
    key quantiser reads the K settings (``kq``, default the paper's per-token rule)."""

    w: WeightSpec = field(default_factory=WeightSpec, metadata={"prefix": "w"})
    a: QuantConfig = field(default_factory=_act_default, metadata={"prefix": "a"})
    k: QuantConfig = field(default_factory=_act_default, metadata={"prefix": "k"})
    v: QuantConfig = field(default_factory=_act_default, metadata={"prefix": "v"})
    static_scope: StaticScope | None = None
    kq: KeyQuantSpec = field(default_factory=KeyQuantSpec, metadata={"prefix": "k"})

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
        if not isinstance(self.kq, KeyQuantSpec):
            raise PipelineError(f"kq must be a KeyQuantSpec, got {type(self.kq).__name__}")
        self.kq.option(self.k)  # every parameter checked here, before any model loads
        if self.kq.avg_bits is not None and self.kq.avg_bits == self.k.bits:
            _set(self, "kq", dataclasses.replace(self.kq, avg_bits=None))  # the target k_bits spelled out
        if not self.kq.is_default:
            if self.static_scope is not None and self.static_kv:
                raise PipelineError(f"static_scope={self.static_scope.value} replaces the K quantiser with the "
                                    f"static per-channel control: k_quant={self.kq.kind} needs static_scope "
                                    "None or 'act'")

    def key_option(self) -> keyq.KeyQuantOption:
        """The cell's key quantiser (:mod:`rope_quant.quant.keys`) with its checked parameters."""
        return self.kq.option(self.k)

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
        """Keyword options of :func:`rope_quant.rotations.whip_model.calibrate_model_rotations`."""
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

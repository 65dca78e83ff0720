"""Cell kinds as registered objects: what tells a long-context, NIAH, static or lm-eval cell from a plain run.

A *cell kind* (:class:`CellKind`) owns one kind of sweep cell: its config type, how the manifest's JSON dict
of such a cell is recognised (``tag``: the key its ``to_dict()`` adds beside ``"run"``) and rebuilt
(``from_dict``), the settings that must agree for two cells to be one study (``settings``), what computes
one cell (``evaluate``, given a :class:`CellContext`) and when its result counts as scored (``scored``).

Kinds are found through a registry keyed by name (:class:`CellKindName` names the built-in ones; the names
are the ones results directories already hold, so nothing on disk changes). A config's kind is looked up by
its exact type (:func:`kind_of`), a manifest dict's by its tag (:func:`kind_for_dict`); a type nobody
registered is a plain run (:data:`RUN`, a ``RunConfig`` or a test's stand-in). The built-in kinds live in
:mod:`rope_quant.sweep.kinds` and register themselves on import; a kind from another package calls
:func:`register` the same way. This module imports nothing heavy (no torch), so the manifest can use it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from rope_quant.io import to_jsonable


class SweepError(ValueError):
    """Base class for bad sweep inputs."""


class CellKindName(StrEnum):
    """The built-in cell kinds (their registry names)."""

    RUN = "run"
    LONG_CONTEXT = "long-context"
    LM_EVAL = "lm-eval"
    NIAH = "niah"
    STATIC = "static"


# ----------------------------------------------------------------------------- config helpers


def config_seed(cfg: Any) -> int:
    """The seed of a RunConfig (attribute ``seed``)."""
    try:
        return int(cfg.seed)
    except AttributeError as exc:
        raise SweepError(f"{type(cfg).__name__} has no 'seed' field") from exc


def config_dict(cfg: Any) -> dict[str, Any]:
    """A RunConfig as a JSON-able dict (``to_dict()`` if it has one, else ``dataclasses.asdict``)."""
    if hasattr(cfg, "to_dict"):
        return to_jsonable(cfg.to_dict())
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return to_jsonable(dataclasses.asdict(cfg))
    raise SweepError(f"cannot serialise config of type {type(cfg).__name__}")


def with_overrides(cfg: Any, **overrides: Any) -> Any:
    """``cfg.override(**overrides)`` (flat names, ``RunConfig``) or ``dataclasses.replace`` for plain dataclasses.
    A cell wrapping a run (:class:`WrapsRun`: long-context, NIAH, static, lm-eval) takes the names of its own fields
    itself and passes the others to its run (``seed``, ``gptq``: the run's)."""
    if hasattr(cfg, "override"):
        return cfg.override(**overrides)
    if kind_of(cfg).wraps_run:  # a wrapping kind's config is a dataclass holding its run as ``run``
        own = {f.name for f in dataclasses.fields(cfg)} - {"run"}
        mine = {k: v for k, v in overrides.items() if k in own}
        rest = {k: v for k, v in overrides.items() if k not in own}
        return dataclasses.replace(cfg, **mine, **({"run": with_overrides(cfg.run, **rest)} if rest else {}))
    return dataclasses.replace(cfg, **overrides)


class WrapsRun:
    """Base of a cell that evaluates one ``RunConfig`` (``self.run``) differently: seed, model, device and the
    weight key are the run's, so such cells share weights and calibration with the run's other cells."""

    run: Any

    @property
    def seed(self) -> int:
        return config_seed(self.run)

    @property
    def model(self) -> str:
        return self.run.model

    @property
    def device(self) -> str:
        return getattr(self.run, "device", "cpu")

    def weight_key(self) -> str:
        return self.run.weight_key()

    def _hash(self, extra: Mapping[str, Any]) -> str:
        blob = json.dumps({"run": self.run.key(), **extra}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- the kind object


@dataclass
class CellContext:
    """What a kind's ``evaluate`` may use (built by :func:`rope_quant.sweep.cells.pipeline_cell_fn`).

    ``quantized(cfg)``: the seed's quantised model for the cell's run (built, or reconfigured in the paired
    design; the cell's φ artefacts saved when the sweep keeps them) and whether it was reused; ``base(run)``: the
    unquantised ``(model, tokenizer)`` and the corpora dict of that model; ``state``: a per-sweep dict a kind may
    keep things in (e.g. lm-eval's task managers).
    """

    quantized: Callable[[Any], tuple[Any, bool]]
    base: Callable[[Any], tuple[tuple[Any, Any], dict]]
    progress: bool = False
    state: dict[str, Any] = field(default_factory=dict)


def _plain_settings(cfg: Any) -> dict[str, Any]:
    """A plain run's settings by flat name, without its seed and content identities."""
    flat = cfg.flat() if hasattr(cfg, "flat") else config_dict(cfg)
    flat = {k: to_jsonable(dataclasses.asdict(v)) if dataclasses.is_dataclass(v) and not isinstance(v, type) else v
            for k, v in flat.items()}
    for name in ("seed", *identity_fields(cfg)):
        flat.pop(name, None)
    return flat


def identity_fields(run: Any) -> tuple[str, ...]:
    """The content-identity fields of a run (model / corpus hashes), none for a stand-in without them."""
    return run.identity_fields() if hasattr(run, "identity_fields") else ()


def _not_registered(what: str) -> Callable[..., Any]:
    def fail(*_: Any, **__: Any) -> Any:
        raise SweepError(f"cell kind has no {what}")
    return fail


@dataclass(frozen=True)
class CellKind:
    """One kind of sweep cell (see the module docstring).

    ``wraps_run``: the config holds its ``RunConfig`` as ``.run`` (else it is the run itself); ``tag``: the key
    of the manifest dict beside ``"run"`` that marks this kind (None: the plain run, the fallback);
    ``extra_settings(cfg)``: the settings a wrapping kind adds to its run's (:func:`cell_settings`);
    ``lengths(cfg)``: the context lengths a cell scores, for kinds that score several (None: the run's seqlen);
    ``scored(result)``: whether a result holds this kind's score (the records ask it; default: a plain run's);
    ``report``: the import reference ``"module:function"`` of the kind's part of ``rope-quant report``
    (``function(results_dir, options) -> KindReport``, :mod:`rope_quant.analysis.kind_reports`), named rather
    than imported because a report reads records, a layer above the kinds.
    """

    name: str
    config_type: type | None = None
    tag: str | None = None
    wraps_run: bool = True
    from_dict: Callable[[Mapping[str, Any]], Any] = _not_registered("from_dict")
    extra_settings: Callable[[Any], Mapping[str, Any]] = lambda cfg: {}
    evaluate: Callable[[Any, CellContext], Mapping[str, Any]] = _not_registered("evaluate")
    scored: Callable[[Mapping[str, Any]], bool] = lambda result: _run_scored(result)
    lengths: Callable[[Any], tuple[int, ...]] | None = None
    description: str = ""
    report: str | None = None

    def run_of(self, cfg: Any) -> Any:
        """The ``RunConfig`` behind a cell config of this kind."""
        return cfg.run if self.wraps_run else cfg

    def eval_lengths(self, cfg: Any, default: tuple[int, ...]) -> tuple[int, ...]:
        """The context lengths a cell of this kind scores (``default``, the run's seqlen, unless it has its own)."""
        return default if self.lengths is None else tuple(self.lengths(cfg))

    def settings(self, cfg: Any) -> dict[str, Any]:
        """The cell's settings by flat name, without its seed: what must agree for two cells to be one study."""
        if not self.wraps_run:
            return _plain_settings(cfg)
        return {**_plain_settings(cfg.run), **self.extra_settings(cfg)}


_BY_NAME: dict[str, CellKind] = {}
_BY_TYPE: dict[type, CellKind] = {}


def register(kind: CellKind, *, replace: bool = False) -> CellKind:
    """Add ``kind`` to the registry (by name, config type and tag); SweepError if one of those is taken."""
    if not replace:
        clash = []
        if kind.name in _BY_NAME:
            clash.append(f"name {kind.name!r}")
        if kind.config_type is not None and kind.config_type in _BY_TYPE:
            clash.append(f"config type {kind.config_type.__name__}")
        if kind.tag is not None and any(other.tag == kind.tag for other in _BY_NAME.values()):
            clash.append(f"tag {kind.tag!r}")
        if clash:
            raise SweepError(f"cell kind {kind.name!r}: {', '.join(clash)} already registered")
    if kind.report is not None and ":" not in kind.report:
        raise SweepError(f"cell kind {kind.name!r}: report must be a 'module:function' reference")
    if kind.wraps_run and kind.tag is None:
        raise SweepError(f"cell kind {kind.name!r} wraps a run, so it needs a tag to be found in a manifest")
    _BY_NAME[kind.name] = kind
    if kind.config_type is not None:
        _BY_TYPE[kind.config_type] = kind
    return kind


def unregister(name: str) -> None:
    """Remove a kind registered with :func:`register` (tests, plug-ins being reloaded)."""
    kind = _BY_NAME.pop(name, None)
    if kind is not None and kind.config_type is not None:
        _BY_TYPE.pop(kind.config_type, None)


def registered() -> dict[str, CellKind]:
    """The registered kinds by name, in registration order."""
    return dict(_BY_NAME)


def kind_named(name: str) -> CellKind:
    """The kind called ``name`` (SweepError listing the registered ones)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise SweepError(f"unknown cell kind {name!r}; registered: {', '.join(_BY_NAME)}") from None


def kind_of(cfg: Any) -> CellKind:
    """The kind of a cell config, by its exact type; a type no kind registered is a plain run."""
    return _BY_TYPE.get(type(cfg), RUN)


def kind_for_dict(data: Mapping[str, Any]) -> CellKind:
    """The kind of a manifest config dict: the first registered kind whose tag sits beside ``"run"``, else the
    plain run (a nested or an older flat ``RunConfig`` dict)."""
    if "run" in data:
        for kind in _BY_NAME.values():
            if kind.tag is not None and kind.tag in data:
                return kind
    return RUN


def run_of(cfg: Any) -> Any:
    """The ``RunConfig`` behind a cell config (the cell's own for a plain run)."""
    return kind_of(cfg).run_of(cfg)


def cell_settings(cfg: Any) -> dict[str, Any]:
    """A cell's settings by flat name, without its seed: what must agree for two cells to be one study."""
    return kind_of(cfg).settings(cfg)


def _run_from_dict(data: Mapping[str, Any]) -> Any:
    from rope_quant.experiment.config import RunConfig  # deferred: heavy

    return RunConfig.from_dict(dict(data))


def _run_evaluate(cfg: Any, ctx: CellContext) -> Mapping[str, Any]:
    """A short-context cell: ``pipeline.run_cell`` on the seed's quantised model."""
    from rope_quant.experiment import pipeline  # deferred: heavy

    qm, reused = ctx.quantized(cfg)
    return {**pipeline.run_cell(cfg, qm=qm, progress=ctx.progress), "model_reused": reused}


def _run_scored(result: Mapping[str, Any]) -> bool:
    """A plain run's finite ``ppl``, or scored context lengths (a run config that scores several lengths: a
    stand-in of the tests, or a record from before the long-context cells carried their own tag)."""
    from rope_quant.sweep.scoring import scored_lengths, scored_ppl

    return scored_ppl(result) or bool(scored_lengths(result))


#: The plain run: one ``RunConfig`` evaluated at its own sequence length (the R3 comparison's cell).
RUN = register(CellKind(CellKindName.RUN.value, wraps_run=False, from_dict=_run_from_dict, evaluate=_run_evaluate,
                        scored=_run_scored, description="one RunConfig at its seqlen (short-context perplexity)"))

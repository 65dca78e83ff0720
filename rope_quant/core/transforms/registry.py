"""The open R3 registry: :class:`TransformSpec` entries, :func:`register`, and the ``rope_quant.r3`` entry points.

A spec names a transform, its factory ``factory(head_dim, layout=..., **params) -> R3Transform``, whether it
commutes with RoPE, its equation, the parameters it takes, and (for fitted transforms) how it is fitted.
Another package adds a transform without changing this repository in either of two ways:

* call ``rope_quant.core.transforms.register(TransformSpec(...))`` at import time, or
* declare an entry point in the group ``rope_quant.r3`` whose object is a :class:`TransformSpec`, an iterable of
  them, or a zero-argument callable returning either. The group is loaded lazily, once, the first time the
  registry is read (:func:`names`, :func:`build`, ...).

Names are unique: :func:`register` refuses a taken name with :class:`TransformNameClashError`; an entry point
whose name is taken (or whose object fails to load) is skipped with a :class:`RegistryWarning` that names it,
so the built-in meaning of a name never changes under a user.

A transform whose spec has ``needs_fit`` gets its parameters from ``spec.fit(ctx)`` (a :class:`FitContext`:
the calibration statistics with the pre-RoPE K sample, per-layer RoPE frequencies, the estimated angles) in
the pipeline, one parameter dict per layer; the built-in fits live in :mod:`rope_quant.calib.foldable`.
Every fit result is checked (:func:`check_fit`): a non-finite value is rejected naming the layer and head.
A spec's ``fit`` is a callable or an import reference ``"module:function"``, resolved on first use (the
built-in fits need the quantisers, a layer above this one, so their specs name them that way).

A spec also declares its foldability (:class:`Foldability`): which factor of ``M = online · fold`` is
RoPE-commuting and folds before RoPE (and where: W_Q/W_K rows, and the per-pair scales into the q/k norm
weights of a model that has them), and which factor stays online on post-RoPE q/k. A spec that declares none
folds whole when it commutes with RoPE and stays online whole otherwise (:func:`foldability`). The export and
the pipeline read this declaration; no code outside the registry compares R3 names.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rope_quant.core.transforms.base import R3Transform, TransformError, TransformParamError, UnknownTransformError

__all__ = [
    "ENTRY_POINT_GROUP",
    "TransformSpec",
    "FitContext",
    "TransformNameClashError",
    "FitError",
    "RegistryWarning",
    "register",
    "unregister",
    "spec",
    "names",
    "build",
    "needs_angles",
    "needs_block",
    "needs_fit",
    "commutes_with_rope",
    "check_fit",
    "Foldability",
    "INTO_PROJECTIONS",
    "INTO_PROJECTIONS_AND_NORMS",
    "foldability",
    "fold_factor",
    "fit_function",
    "load_entry_points",
    "closest_names",
]

#: The entry-point group scanned for foreign R3 transforms.
ENTRY_POINT_GROUP = "rope_quant.r3"


class TransformNameClashError(TransformError):
    """A transform is registered under a name that is already taken."""


class FitError(TransformError):
    """A fit diverged or produced non-finite parameters (the message names the layer and head)."""


class RegistryWarning(UserWarning):
    """An entry point of the ``rope_quant.r3`` group was skipped (load failure or name clash)."""


@dataclass(frozen=True)
class FitContext:
    """What a fit sees (pipeline step 8). ``stats``: :class:`rope_quant.calib.stats.CalibrationStats` with
    the pre-RoPE K sample (``stats.k_sample(layer)``); ``inv_freq`` (n_layers, K) RoPE frequencies per layer;
    ``angles``: the angle estimator's output, (n_layers, K) or (n_layers, H_kv, K), or None; ``k_bits``: the K
    quantiser's bit width (4 when K is not quantised); ``seed``: the cell's seed; ``options``: free settings."""

    stats: Any
    inv_freq: np.ndarray
    n_layers: int
    n_kv_heads: int
    head_dim: int
    layout: str = "rotate_half"
    angles: np.ndarray | None = None
    k_bits: int = 4
    seed: int = 0
    options: Mapping[str, Any] = field(default_factory=dict)


#: Where a folded factor goes: its rotation into the W_Q/W_K rows ...
INTO_PROJECTIONS: tuple[str, ...] = ("W_Q/W_K",)
#: ... and, for a factor with per-pair scales, the scales into the q/k norm weights where the model has per-head
#: q/k norms (a scale does not commute with the RMS that follows W_Q/W_K; :mod:`rope_quant.rotations.fold_r3`).
INTO_PROJECTIONS_AND_NORMS: tuple[str, ...] = ("W_Q/W_K", "q/k norm weights")


@dataclass(frozen=True)
class Foldability:
    """Which factor of an R3 ``M = online · fold`` folds into the weights before RoPE, and which stays online.

    ``fold``: the registry name of the RoPE-commuting factor (built from the transform's own parameters that
    it accepts), None when nothing folds; ``online``: the registry name of the factor applied to post-RoPE q/k
    at run time, None when nothing stays online; ``into``: where the folded factor goes. ``identity`` is
    ``Foldability(None, None)``: nothing to fold, nothing online.
    """

    fold: str | None
    online: str | None
    into: tuple[str, ...] = ()

    @property
    def folds(self) -> bool:
        """A factor folds into the weights."""
        return self.fold is not None

    @property
    def online_is_hadamard(self) -> bool:
        """The online factor is the full-head Hadamard (what compressed-tensors can carry at q_attn/k_cache)."""
        return self.online == "hadamard"


@dataclass(frozen=True)
class TransformSpec:
    """One registry entry.

    ``factory(head_dim, layout="rotate_half", **params)`` builds the transform. ``commutes_with_rope``: the
    declared flag (None: it depends on the parameters, e.g. the block size; the built transform says).
    ``equation``: the map in one line (documentation and the report). ``params``: accepted parameters besides
    ``layout``; ``required``: those that must be given (``angles`` makes the pipeline estimate angles first).
    ``needs_fit``: parameters come from ``fit(FitContext) -> [params per layer]`` (a callable, or an import
    reference ``"module:function"``: the built-ins name theirs in :mod:`rope_quant.calib.foldable`).
    ``folding``: the declared :class:`Foldability` (None: derived from ``commutes_with_rope``).
    """

    name: str
    factory: Callable[..., R3Transform]
    commutes_with_rope: bool | None
    equation: str
    params: tuple[str, ...] = ()
    required: tuple[str, ...] = ()
    needs_fit: bool = False
    fit: Callable[[FitContext], Sequence[Mapping[str, Any]]] | str | None = None
    doc: str = ""
    source: str = "rope_quant"
    folding: Foldability | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or not self.name.replace("_", "").isalnum():
            raise TransformParamError(f"an R3 name must be a non-empty identifier-like string, got {self.name!r}")
        if not callable(self.factory):
            raise TransformParamError(f"{self.name}: factory must be callable")
        if self.commutes_with_rope not in (True, False, None):
            raise TransformParamError(f"{self.name}: commutes_with_rope must be True, False or None")
        if not set(self.required) <= set(self.params):
            raise TransformParamError(f"{self.name}: required {self.required} must be among params {self.params}")
        if self.fit is not None and not callable(self.fit) and not (isinstance(self.fit, str) and ":" in self.fit):
            raise TransformParamError(f"{self.name}: fit must be callable or a 'module:function' reference")
        if self.folding is not None and not isinstance(self.folding, Foldability):
            raise TransformParamError(f"{self.name}: folding must be a Foldability")

    @property
    def needs_angles(self) -> bool:
        return "angles" in self.required

    @property
    def needs_block(self) -> bool:
        return "block" in self.required


_REGISTRY: dict[str, TransformSpec] = {}
_loaded = False


def register(entry: TransformSpec) -> TransformSpec:
    """Add ``entry`` to the registry; a taken name raises :class:`TransformNameClashError`. Returns it."""
    if not isinstance(entry, TransformSpec):
        raise TransformParamError(f"register() takes a TransformSpec, got {type(entry).__name__}")
    taken = _REGISTRY.get(entry.name)
    if taken is not None:
        raise TransformNameClashError(
            f"R3 name {entry.name!r} is already registered (by {taken.source}); choose another name")
    _REGISTRY[entry.name] = entry
    return entry


def unregister(name: str) -> None:
    """Remove a foreign entry (tests, interactive use); built-in entries cannot be removed."""
    entry = _REGISTRY.get(name)
    if entry is None:
        raise UnknownTransformError(f"unknown R3 transform {name!r}")
    if entry.source == "rope_quant":
        raise TransformNameClashError(f"{name!r} is built in and cannot be unregistered")
    del _REGISTRY[name]


def _specs_of(obj: Any) -> list[TransformSpec]:
    if callable(obj) and not isinstance(obj, TransformSpec):
        obj = obj()
    if isinstance(obj, TransformSpec):
        return [obj]
    if isinstance(obj, Iterable):
        items = list(obj)
        if all(isinstance(x, TransformSpec) for x in items):
            return items
    raise TransformParamError(f"expected a TransformSpec or an iterable of them, got {type(obj).__name__}")


def load_entry_points(force: bool = False) -> list[str]:
    """Register the ``rope_quant.r3`` entry points (once; ``force`` rescans). Returns the names added."""
    global _loaded
    if _loaded and not force:
        return []
    _loaded = True
    from rope_quant.core.plugins import loaded

    added: list[str] = []
    for where, value, specs in loaded(ENTRY_POINT_GROUP, _specs_of, RegistryWarning):
        for s in specs:
            if s.name in _REGISTRY and _REGISTRY[s.name].factory is s.factory:
                continue  # the same spec seen again (force=True)
            if s.name in _REGISTRY:
                warnings.warn(f"refusing R3 {s.name!r} from {where}: the name is already registered by "
                              f"{_REGISTRY[s.name].source}", RegistryWarning, stacklevel=2)
                continue
            src = s.source if s.source != "rope_quant" else value
            _REGISTRY[s.name] = TransformSpec(**{**s.__dict__, "source": src})
            added.append(s.name)
    return added


def _all() -> dict[str, TransformSpec]:
    if not _loaded:
        load_entry_points()
    return _REGISTRY


def names() -> list[str]:
    """Registry names: the built-ins in declaration order, then foreign ones."""
    return list(_all())


def closest_names(name: str, n: int = 3) -> list[str]:
    """Up to ``n`` registry names closest to ``name`` (difflib)."""
    import difflib

    return difflib.get_close_matches(str(name), names(), n=n, cutoff=0.5)


def spec(name: str) -> TransformSpec:
    """The registry entry of ``name`` (:class:`UnknownTransformError` with the closest names otherwise)."""
    try:
        return _all()[name]
    except (KeyError, TypeError):
        close = closest_names(name) if isinstance(name, str) else []
        hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
        raise UnknownTransformError(f"unknown R3 transform {name!r}{hint}; expected one of {names()}") from None


def needs_angles(name: str) -> bool:
    """True when ``build(name, ...)`` requires ``angles`` (the pipeline estimates them first)."""
    return spec(name).needs_angles


def needs_block(name: str) -> bool:
    """True when ``build(name, ...)`` requires ``block``."""
    return spec(name).needs_block


def needs_fit(name: str) -> bool:
    """True when the pipeline fits the transform's parameters per layer (:class:`FitContext`)."""
    return spec(name).needs_fit


def build(name: str, head_dim: int, **params: Any) -> R3Transform:
    """Build a registry transform with its parameters (``angles``, ``block``, ``scales``, ``matrices``, ``layout``)."""
    entry = spec(name)
    allowed = set(entry.params) | {"layout"}
    extra = sorted(set(params) - allowed)
    if extra:
        raise TransformParamError(f"{name}: unexpected parameter(s) {extra}; accepted: {sorted(allowed)}")
    missing = [p for p in entry.required if params.get(p) is None]
    if missing:
        raise TransformParamError(f"{name}: missing required parameter(s) {missing}")
    return entry.factory(head_dim, **params)


def commutes_with_rope(name: str, head_dim: int = 64, **params: Any) -> bool:
    """The declared flag of a registry entry (a parameter-dependent entry is built with ``params``)."""
    entry = spec(name)
    if entry.commutes_with_rope is not None:
        return entry.commutes_with_rope
    return build(name, head_dim, **params).commutes_with_rope


def check_fit(name: str, fitted: Sequence[Mapping[str, Any]], n_layers: int, n_kv_heads: int) -> list[dict]:
    """The per-layer fit results as dicts; a missing layer or a non-finite value raises :class:`FitError`
    naming the layer and the (KV) head."""
    out = [dict(p) for p in fitted]
    if len(out) != n_layers:
        raise FitError(f"{name}: the fit gave {len(out)} layers' parameters, the model has {n_layers}")
    for layer, params in enumerate(out):
        for key, value in params.items():
            if key == "layout" or value is None:
                continue
            arr = np.asarray(value.detach().cpu().numpy() if hasattr(value, "detach") else value, dtype=np.float64)
            bad = ~np.isfinite(arr)
            if bad.any():
                head = ""
                if arr.ndim >= 2 and arr.shape[0] == n_kv_heads and n_kv_heads > 1:
                    head = f" head {int(np.argwhere(bad)[0][0])}"
                elif arr.ndim >= 2 and arr.shape[0] == n_kv_heads:
                    head = " head 0"
                raise FitError(f"{name}: the fit of layer {layer}{head} gave non-finite {key!r}; "
                               "refusing to use it")
    return out


def fit_function(name: str) -> Callable[[FitContext], Sequence[Mapping[str, Any]]] | None:
    """The spec's fit as a callable (an import reference ``"module:function"`` is imported here), or None."""
    fit = spec(name).fit
    if isinstance(fit, str):
        module, _, attr = fit.partition(":")
        resolved = getattr(importlib.import_module(module), attr, None)
        if not callable(resolved):
            raise FitError(f"{name}: fit reference {fit!r} is not a callable")
        return resolved  # type: ignore[no-any-return]
    return fit


def foldability(name: str, head_dim: int = 64, block: int | None = None) -> Foldability:
    """The declared :class:`Foldability` of ``name``, else: folds whole into W_Q/W_K when it commutes with RoPE
    (a parameter-dependent entry is built with ``block`` and zero angles), stays online whole otherwise."""
    entry = spec(name)
    if entry.folding is not None:
        return entry.folding
    params: dict[str, Any] = {}
    if entry.needs_block:
        params["block"] = block
    if entry.needs_angles:
        params["angles"] = np.zeros(head_dim // 2)
    if commutes_with_rope(name, head_dim, **params):
        return Foldability(name, None, INTO_PROJECTIONS)
    return Foldability(None, name)


def fold_factor(transform: R3Transform) -> R3Transform | None:
    """The factor of a built transform that folds before RoPE (the transform itself, a factor built from its
    parameters, e.g. P(φ) of ``pairwise_plus_hadamard``), or None when nothing folds."""
    entry = spec(transform.name)
    folding = entry.folding
    if folding is None:  # the built transform knows (a block size may decide)
        folding = Foldability(transform.name, None) if transform.commutes_with_rope else Foldability(None, None)
    if folding.fold is None:
        return None
    if folding.fold == transform.name:
        return transform
    params = {p: getattr(transform, p) for p in spec(folding.fold).params if getattr(transform, p, None) is not None}
    return build(folding.fold, transform.head_dim, layout=getattr(transform, "layout", "rotate_half"), **params)

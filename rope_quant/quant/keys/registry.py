"""The key-quantiser registry: the built-in options by name, foreign ones by :func:`register` or the entry-point
group ``rope_quant.key_quant`` (loaded lazily, once; a taken or broken one is skipped with a warning), and an
option built from a cell's K settings (:func:`option_from`)."""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from collections.abc import Iterable
from typing import Any

from rope_quant.quant.keys.base import (
    ENTRY_POINT_GROUP,
    KeyQuantError,
    KeyQuantName,
    KeyQuantNameClashError,
    KeyQuantWarning,
    UnknownKeyQuantError,
)
from rope_quant.quant.keys.options import (
    GgmlIQ4NLOption,
    GgmlQ40Option,
    GgmlQ41Option,
    GgmlQ80Option,
    KeyQuantOption,
    KiviOption,
    KVQuantPreRoPEOption,
    PerTokenOption,
    PerTokenWindowOption,
    RopePairBitsOption,
    SinkOption,
)
from rope_quant.quant.quantizers import QuantConfig, QuantConfigError

_REGISTRY: dict[str, type[KeyQuantOption]] = {}
_loaded = False


def register(option: type[KeyQuantOption]) -> type[KeyQuantOption]:
    """Add an option class (a frozen :class:`KeyQuantOption` subclass with a ``name``); a taken name raises
    :class:`KeyQuantNameClashError`. Returns it (usable as a class decorator)."""
    if not (isinstance(option, type) and issubclass(option, KeyQuantOption)) or not dataclasses.is_dataclass(option):
        raise KeyQuantError(f"register() takes a KeyQuantOption dataclass, got {option!r}")
    name = option.name
    if not isinstance(name, str) or not name or not name.replace("_", "").isalnum():
        raise KeyQuantError(f"a key quantiser name must be a non-empty identifier-like string, got {name!r}")
    taken = _REGISTRY.get(name)
    if taken is not None:
        raise KeyQuantNameClashError(f"key quantiser {name!r} is already registered (by {taken.source}); "
                                     "choose another name")
    fields = {f.name for f in dataclasses.fields(option)}
    bad = sorted(set(option.spec_params.values()) - fields)
    if bad:
        raise KeyQuantError(f"{name}: spec_params name fields it does not have: {bad}")
    _REGISTRY[name] = option
    return option


def unregister(name: str) -> None:
    """Remove a foreign option (tests, interactive use); built-in ones cannot be removed."""
    option = _REGISTRY.get(name)
    if option is None:
        raise UnknownKeyQuantError(f"unknown key quantiser {name!r}")
    if option.source == "rope_quant":
        raise KeyQuantNameClashError(f"{name!r} is built in and cannot be unregistered")
    del _REGISTRY[name]


for _option in (PerTokenOption, KiviOption, KVQuantPreRoPEOption, RopePairBitsOption, SinkOption,
                PerTokenWindowOption, GgmlQ40Option, GgmlQ41Option, GgmlIQ4NLOption, GgmlQ80Option):
    register(_option)
assert list(_REGISTRY) == [m.value for m in KeyQuantName]


def _options_of(obj: Any) -> list[type[KeyQuantOption]]:
    if isinstance(obj, type):
        return [obj]
    if callable(obj):
        obj = obj()
    if isinstance(obj, type):
        return [obj]
    if isinstance(obj, Iterable):
        return list(obj)
    raise KeyQuantError(f"expected a KeyQuantOption class or an iterable of them, got {type(obj).__name__}")


def load_entry_points(force: bool = False) -> list[str]:
    """Register the ``rope_quant.key_quant`` entry points (once; ``force`` rescans). Returns the names added."""
    global _loaded
    if _loaded and not force:
        return []
    _loaded = True
    from rope_quant.core.plugins import loaded

    added: list[str] = []
    for where, _, options in loaded(ENTRY_POINT_GROUP, _options_of, KeyQuantWarning):
        for option in options:
            if _REGISTRY.get(str(getattr(option, "name", ""))) is option:
                continue
            try:
                register(option)
            except Exception as exc:  # noqa: BLE001 - a clash or a bad option must not break the registry
                warnings.warn(f"skipping {where}: {type(exc).__name__}: {exc}", KeyQuantWarning,
                              stacklevel=2)
                continue
            added.append(option.name)
    return added


def _all() -> dict[str, type[KeyQuantOption]]:
    if not _loaded:
        load_entry_points()
    return _REGISTRY


def names() -> list[str]:
    """The registered names: the built-ins in :class:`KeyQuantName` order, then foreign ones."""
    return list(_all())


def closest_names(name: str, n: int = 3) -> list[str]:
    """Up to ``n`` registered names closest to ``name`` (difflib)."""
    return difflib.get_close_matches(str(name), names(), n=n, cutoff=0.5)


def option_class(name: Any) -> type[KeyQuantOption]:
    """The option class of ``name`` (:class:`UnknownKeyQuantError` with the closest names otherwise)."""
    key = name.value if isinstance(name, KeyQuantName) else name
    try:
        return _all()[key]
    except (KeyError, TypeError):
        close = closest_names(key) if isinstance(key, str) else []
        hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
        raise UnknownKeyQuantError(f"unknown key quantiser {name!r}{hint}; valid: {', '.join(names())}") from None


def spec_defaults(name: Any) -> dict[str, Any]:
    """The defaults of the config fields ``name`` takes (config field -> the option field's default)."""
    cls = option_class(name)
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    return {spec: defaults[field] for spec, field in cls.spec_params.items()}


def option_from(name: Any, k: QuantConfig, **params: Any) -> KeyQuantOption:
    """The option ``name`` built from the cell's K settings ``k`` (bits; group, clip and symmetric for the
    per-token rules) and config fields ``params`` (``token_group``, ``residual``, ``sinks``, ``min_bits``,
    ``max_bits``, ``avg_bits``; None = the option's default). A parameter the option does not take must be
    None, and the per-token settings must keep their defaults for an option that has none: a
    :class:`KeyQuantError` names the flat config field otherwise."""
    cls = option_class(name)
    kwargs: dict[str, Any] = {"bits": k.bits}
    if cls.token_settings:
        kwargs.update(group_size=k.group_size, clip_ratio=k.clip_ratio, symmetric=k.symmetric)
    else:
        plain = QuantConfig(bits=k.bits)
        changed = [flat for flat, attr in (("k_group", "group_size"), ("k_clip", "clip_ratio"),
                                           ("k_symmetric", "symmetric")) if getattr(k, attr) != getattr(plain, attr)]
        if changed:
            takers = [n for n, c in _all().items() if c.token_settings]
            raise KeyQuantError(f"{', '.join(changed)} set the per-token rule's groups, clip and symmetry: they "
                                f"apply to {' and '.join(takers)}, not to {cls.name}")
    for spec_name, value in params.items():
        if value is None:
            continue
        if spec_name not in cls.spec_params:
            takes = ", ".join(f"k_{p}" for p in cls.spec_params) or "no parameter of its own"
            raise KeyQuantError(f"k_{spec_name} does not apply to the key quantiser {cls.name} (it takes {takes})")
        kwargs[cls.spec_params[spec_name]] = value
    try:
        return cls(**kwargs)
    except KeyQuantError:
        raise
    except QuantConfigError as exc:  # the per-token rule's own checks (group, clip)
        raise KeyQuantError(f"{cls.name}: {exc}") from None

"""Entry points of the open registries (R3 transforms: ``rope_quant.r3``; key quantisers:
``rope_quant.key_quant``): each group's objects loaded, a broken plugin skipped with a warning, never raised.

Standard library only.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from importlib.metadata import entry_points
from typing import Any, TypeVar

T = TypeVar("T")


def loaded(group: str, convert: Callable[[Any], T], warning: type[Warning]) -> Iterator[tuple[str, str, T]]:
    """``(where, value, convert(obj))`` for each entry point of ``group``: ``where`` describes it for messages,
    ``value`` is its ``module:attr``. One whose load or conversion raises is skipped with ``warning``."""
    for ep in entry_points(group=group):
        where = f"entry point {ep.name!r} ({ep.value}) of group {group!r}"
        try:
            converted = convert(ep.load())
        except Exception as exc:  # noqa: BLE001 - a broken plugin must not break the registry
            warnings.warn(f"skipping {where}: {type(exc).__name__}: {exc}", warning, stacklevel=3)
            continue
        yield where, ep.value, converted

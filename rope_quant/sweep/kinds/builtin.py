"""Every built-in cell kind, registered (:mod:`rope_quant.sweep.cellkind`), and the kinds other packages declare
in the ``rope_quant.cell_kinds`` entry-point group: imported where a manifest dict of any kind must be rebuilt
(:func:`rope_quant.sweep.manifest.config_from_dict`).

A plug-in declares ``[project.entry-points."rope_quant.cell_kinds"] name = "pkg.module:KIND"`` where ``KIND`` is
a :class:`~rope_quant.sweep.cellkind.CellKind`; it is registered the first time this module is imported (a
plug-in that fails to load is reported as a warning, and the built-in kinds still work).
"""

from __future__ import annotations

import warnings

from rope_quant.sweep.cellkind import CellKind, SweepError, register, registered
from rope_quant.sweep.kinds import lm_eval, long_context, niah, static

BUILTIN: tuple[CellKind, ...] = (niah.KIND, static.KIND, lm_eval.KIND, long_context.KIND)
#: The entry-point group of cell kinds from other packages.
ENTRY_POINT_GROUP = "rope_quant.cell_kinds"


def load_entry_points(group: str = ENTRY_POINT_GROUP) -> list[str]:
    """Register the :class:`CellKind` objects the installed packages declare in ``group``; their names."""
    from importlib.metadata import entry_points

    loaded = []
    for ep in entry_points(group=group):
        try:
            kind = ep.load()
            if not isinstance(kind, CellKind):
                raise SweepError(f"{ep.value} is a {type(kind).__name__}, not a CellKind")
            if registered().get(kind.name) is not kind:
                register(kind)
            loaded.append(kind.name)
        except Exception as exc:  # a broken plug-in costs its kind, not the sweep
            warnings.warn(f"cell kind entry point {ep.name!r} ({ep.value}) not loaded: {exc}", stacklevel=2)
    return loaded


PLUGINS: list[str] = load_entry_points()

__all__ = ["BUILTIN", "ENTRY_POINT_GROUP", "PLUGINS", "load_entry_points", "registered"]

"""Every built-in cell kind, registered (:mod:`rope_quant.sweep.cellkind`): imported where a manifest dict of
any kind must be rebuilt (:func:`rope_quant.sweep.manifest.config_from_dict`)."""

from __future__ import annotations

from rope_quant.sweep.cellkind import CellKind, registered
from rope_quant.sweep.kinds import lm_eval, long_context, niah, static

BUILTIN: tuple[CellKind, ...] = (niah.KIND, static.KIND, lm_eval.KIND, long_context.KIND)

__all__ = ["BUILTIN", "registered"]

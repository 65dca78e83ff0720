"""The report part each cell kind adds to ``rope-quant report`` (static: App. A.6/A.8 tables; NIAH: accuracy tables
and figure), found through a registry keyed by the kind's name, as the manifest's cells give it.

A kind names its report on its :class:`~rope_quant.sweep.cellkind.CellKind` (``report = "module:function"``:
named, not imported, because a report reads the records, which sit above the kinds); :func:`write_kind_reports`
runs the report of every kind present in a results directory. :func:`register_report` adds or replaces one
at run time (tests, interactive use).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rope_quant.core.verdict import LEVEL
from rope_quant.sweep.cellkind import SweepError, kind_for_dict, kind_named
from rope_quant.sweep.manifest import read_manifest


@dataclass(frozen=True)
class ReportOptions:
    """What ``rope-quant report`` passes every kind's report: the interval level and whether to draw figures;
    ``comparator``: the configuration NIAH pairs against (None: the manifest's). The static report always
    contrasts against hadamard within each scope (App. D), as ``rope-quant report`` did before."""

    level: float = LEVEL
    figures: bool = True
    comparator: str | None = None


@dataclass(frozen=True)
class KindReport:
    """What one kind's report wrote: its Markdown (printed by the CLI) and its files."""

    kind: str
    markdown: str
    files: list[str] = field(default_factory=list)


ReportHook = Callable[[Path, ReportOptions], KindReport]
_REPORTS: dict[str, ReportHook] = {}


def register_report(kind: str, hook: ReportHook, *, replace: bool = False) -> None:
    """Run ``hook(results_dir, options)`` in :func:`write_kind_reports` for directories holding ``kind`` cells."""
    if kind in _REPORTS and not replace:
        raise SweepError(f"cell kind {kind!r} already has a report")
    _REPORTS[kind] = hook


def unregister_report(kind: str) -> None:
    _REPORTS.pop(kind, None)


def kinds_in(results_dir: str | os.PathLike[str]) -> list[str]:
    """The cell kinds of a results directory's manifest, in order of first appearance."""
    import rope_quant.sweep.kinds.builtin  # noqa: F401  the built-in kinds, registered

    return list(dict.fromkeys(kind_for_dict(c["config"]).name for c in read_manifest(results_dir)["cells"]))


def report_hook(kind: str) -> ReportHook | None:
    """The report part of ``kind``: one added with :func:`register_report`, else the one its
    :class:`~rope_quant.sweep.cellkind.CellKind` names (``report = "module:function"``), else None."""
    if kind in _REPORTS:
        return _REPORTS[kind]
    ref = kind_named(kind).report
    if ref is None:
        return None
    module, _, attr = ref.partition(":")
    hook = getattr(importlib.import_module(module), attr, None)
    if not callable(hook):
        raise SweepError(f"cell kind {kind!r}: report {ref!r} is not a callable")
    return hook  # type: ignore[no-any-return]


def write_kind_reports(results_dir: str | os.PathLike[str], options: ReportOptions | None = None) -> list[KindReport]:
    """The report of every kind in ``results_dir`` that has one (none for plain and long-context cells, whose
    tables are :func:`rope_quant.analysis.report.write_report`'s)."""
    root = Path(results_dir)
    options = options or ReportOptions()
    hooks = [(kind, report_hook(kind)) for kind in kinds_in(root)]
    return [hook(root, options) for _, hook in hooks if hook is not None]

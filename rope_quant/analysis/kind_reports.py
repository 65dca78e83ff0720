"""The report part each cell kind adds to ``rope-quant report`` (static: App. A.6/A.8 tables; NIAH: accuracy tables
and figure), found through a registry keyed by the kind's name, as the manifest's cells give it.

The hooks live here, above the records and the report, and not on :class:`~rope_quant.sweep.cellkind.CellKind`:
a kind's report reads the records, and the records sit above the kinds (the manifest rebuilds cells through
them), so the import graph stays a tree. :func:`write_kind_reports` runs the hook of every kind present in a
results directory; a kind from another package adds its own with :func:`register_report`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rope_quant.core.verdict import LEVEL
from rope_quant.defaults import DEFAULT_COMPARATOR
from rope_quant.sweep.cellkind import CellKindName, SweepError, kind_for_dict
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


def write_kind_reports(results_dir: str | os.PathLike[str], options: ReportOptions | None = None) -> list[KindReport]:
    """The report of every kind in ``results_dir`` that registered one (none for plain and long-context cells,
    whose tables are :func:`rope_quant.analysis.report.write_report`'s)."""
    root = Path(results_dir)
    options = options or ReportOptions()
    return [_REPORTS[kind](root, options) for kind in kinds_in(root) if kind in _REPORTS]


def _static_report(root: Path, options: ReportOptions) -> KindReport:
    from rope_quant.analysis.static_report import write_static_report

    text = write_static_report(root, level=options.level)
    return KindReport(CellKindName.STATIC.value, text, [str(root / "static.md")])


def _niah_report(root: Path, options: ReportOptions) -> KindReport:
    from rope_quant.analysis.niah_report import niah_report

    comparator = options.comparator or read_manifest(root).get("comparator") or DEFAULT_COMPARATOR
    out = niah_report(root, comparator=comparator, figures=options.figures)
    return KindReport(CellKindName.NIAH.value, out["markdown"], list(out["files"]))


register_report(CellKindName.STATIC.value, _static_report)
register_report(CellKindName.NIAH.value, _niah_report)

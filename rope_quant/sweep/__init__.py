"""Many cells: manifests, atomic records, the resumable runner, presets, Slurm and the report.

Until 0.2.0 ``rope_quant.sweep`` was one module; its names (``run_cells``, ``build_manifest``, ...) now live in
this package's modules and still resolve here, with a :class:`DeprecationWarning` naming the new path, until
0.3.0.
"""

from typing import Any

_SEARCH = tuple(f"rope_quant.sweep.{m}" for m in ("manifest", "records", "runner", "presets", "cells", "slurm"))


def __getattr__(name: str) -> Any:
    from rope_quant._deprecation import OLD_SWEEP_NAMES, moved_attribute

    if name in OLD_SWEEP_NAMES:
        return moved_attribute(__name__, name, _SEARCH)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

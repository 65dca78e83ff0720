"""Module paths that moved, kept importable until :data:`REMOVAL`: one table and one import hook, no files.

:class:`_MovedFinder` sits on ``sys.meta_path`` (installed by ``rope_quant/__init__.py``) and serves every old
path in :data:`MOVED_MODULES`: the first import warns with a :class:`DeprecationWarning` that names the new path
and the removal version, and the old name then *is* the new module (same object, so patching either patches
both). Two old modules became packages of the same name (``rope_quant.quant``, ``rope_quant.sweep``); their old
top-level names resolve through the package's ``__getattr__`` with :func:`moved_attribute`. Stdlib only:
importing an old path costs what importing its target costs.
"""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import pkgutil
import sys
import warnings
from collections.abc import Iterable, Sequence
from types import ModuleType
from typing import Any, cast

REMOVAL = "0.3.0"

# old module (under rope_quant.) -> its new path. The single source for the import hook and its tests.
MOVED_MODULES: dict[str, str] = {
    "angles": "rope_quant.core.angles",
    "attention": "rope_quant.rotations.attention",
    "calibration": "rope_quant.calib.moments",
    "data": "rope_quant.corpora.token_streams",
    "diagnostics": "rope_quant.calib.diagnostics",
    "envinfo": "rope_quant.experiment.envinfo",
    "evaluate": "rope_quant.scoring.evaluate",
    "gptq": "rope_quant.quant.gptq",
    "hadamard": "rope_quant.core.hadamard",
    "models": "rope_quant.model.loading",
    "objectives": "rope_quant.calib.objectives",
    "pipeline": "rope_quant.experiment.pipeline",
    "report": "rope_quant.analysis.report",
    "rope": "rope_quant.core.rope",
    "rotation": "rope_quant.rotations.offline",
    "stats": "rope_quant.core.stats",
    "transforms": "rope_quant.core.transforms",
    "verify": "rope_quant.calib.verify",
    "whip": "rope_quant.rotations.whip",
    # moved after 2da0636, inside the package (a name that says what the module is)
    "sweep.models": "rope_quant.sweep.loaded_models",
    # the key quantisers' first path, a module re-exporting the package that now holds them
    "quant.key_quantizers": "rope_quant.quant.keys",
    # reporting left sweep/ (which runs studies) for analysis/ (which reads their records)
    "sweep.figures": "rope_quant.analysis.figures",
    "sweep.gap_share": "rope_quant.analysis.gap_share",
    "sweep.kind_reports": "rope_quant.analysis.kind_reports",
    "sweep.protocol_report": "rope_quant.analysis.protocol_report",
    "sweep.report": "rope_quant.analysis.report",
    "sweep.reproduce": "rope_quant.analysis.reproduce",
    "sweep.titles": "rope_quant.analysis.titles",
    # experiment/ keeps one cell's config and build pipeline; its corpora, scoring and cost plan are packages now
    "experiment.corpora": "rope_quant.corpora.sources",
    "experiment.documents": "rope_quant.corpora.documents",
    "experiment.data": "rope_quant.corpora.token_streams",
    "experiment.evaluate": "rope_quant.scoring.evaluate",
    "experiment.longctx": "rope_quant.scoring.longctx",
    "experiment.generate": "rope_quant.scoring.generate",
    "experiment.niah": "rope_quant.scoring.niah",
    "experiment.plan": "rope_quant.planning.plan",
    "experiment.plan_costs": "rope_quant.planning.plan_costs",
    "experiment.memory_check": "rope_quant.planning.memory_check",
    "experiment.stages": "rope_quant.planning.stages",
}

# 0.1.0 modules that a later split spread over more than one module: old path -> the homes beside its
# MOVED_MODULES target. The old path is then a module of its own whose names resolve from the target, then
# these (PEP 562 ``__getattr__``); it is not the same object as any of them, so patch the new path.
SPLIT_MODULES: dict[str, tuple[str, ...]] = {
    "calibration": ("rope_quant.calib.stats",),
    "data": ("rope_quant.corpora.sources", "rope_quant.corpora.documents"),
    "gptq": ("rope_quant.quant.rtn",),
    "whip": ("rope_quant.rotations.whip_model",),
}

# The public names of the old flat modules that are packages now, as 0.1.0 had them.
OLD_QUANT_NAMES = frozenset({
    "OFF_BITS", "NonFloatTensorError", "QuantConfigError", "NotCalibratedError", "QuantConfig", "is_off",
    "fake_quant_per_token", "fake_quant", "quant_step", "StaticChannelQuantizer",
})
OLD_SWEEP_NAMES = frozenset({
    "MANIFEST_FILE", "CELLS_DIR", "CACHE_DIR", "ARTIFACTS_DIR", "CellFn", "Selection", "SweepError",
    "InvalidCellNameError", "DuplicateCellError", "ShardSpecError", "ManifestNotFoundError", "check_name",
    "config_seed", "config_dict", "Manifest", "build_manifest", "manifest_from_dict", "read_manifest",
    "write_manifest", "cell_relpath", "cell_path", "read_record", "record_is_complete", "is_complete",
    "parse_shard", "shard_from_env", "shard_indices", "select", "SweepReport", "run_cell_record", "run_cells",
    "Status", "status", "complete_records", "LongContextConfig", "compare_manifest", "support_manifest",
    "estimators_manifest", "long_context_manifest", "BEYOND_ANGLES", "BEYOND_TRANSFORMS", "BEYOND_LONG",
    "beyond_variants", "beyond_manifest", "beyond_long_context_manifest", "artifact_dir", "save_artifacts",
    "pipeline_cell_fn", "config_from_dict", "run_shard", "submit_slurm",
})


def message(old: str, new: str) -> str:
    """The one wording of every deprecation in this package."""
    return f"{old} is deprecated since rope_quant 0.2.0 and will be removed in {REMOVAL}; use {new}"


def warn_renamed(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn that ``old`` (a keyword, an attribute) is deprecated for ``new`` (the caller's caller is named)."""
    warnings.warn(message(old, new), DeprecationWarning, stacklevel=stacklevel)


class _MovedFinder:
    """Finds an old path of :data:`MOVED_MODULES`; loading it warns and puts the new module in its place."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.startswith("rope_quant.") and fullname.removeprefix("rope_quant.") in MOVED_MODULES:
            return importlib.machinery.ModuleSpec(fullname, cast(Any, self))  # a loader by protocol
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # a placeholder module; exec_module swaps the new one in

    def exec_module(self, module: ModuleType) -> None:
        old = module.__name__
        key = old.removeprefix("rope_quant.")
        new = MOVED_MODULES[key]
        homes = (new, *SPLIT_MODULES.get(key, ()))
        warnings.warn(message(f"module {old}", " and ".join(homes)), DeprecationWarning,
                      stacklevel=_caller_level())
        if len(homes) == 1:
            # the import system returns sys.modules[old] after exec_module: the new module itself
            sys.modules[old] = importlib.import_module(new)
            return
        module.__doc__ = f"rope_quant 0.1.0's {old}, deprecated: its names now live in {', '.join(homes)}."
        names = sorted({n for h in homes for n in getattr(importlib.import_module(h), "__all__", ())})
        setattr(module, "__all__", names)  # noqa: B010 (a placeholder module: no __all__ to type-check)
        setattr(module, "__getattr__", functools.partial(_split_attribute, old, homes))  # noqa: B010 (PEP 562)


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (idempotent)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())


def _caller_level() -> int:
    """The ``stacklevel`` of the importing code: past this module, any loader and importlib (whose frames
    ``warnings`` does not count)."""
    frame = sys._getframe(1)  # exec_module: level 1
    level = 1
    while frame.f_back is not None:
        frame = frame.f_back
        internal = "importlib" in frame.f_code.co_filename and "_bootstrap" in frame.f_code.co_filename
        if not internal:
            level += 1
            # a loader's exec_module (pytest's assertion rewriter, say) may sit between: walk past it too
            if frame.f_globals.get("__name__") != __name__ and frame.f_code.co_name != "exec_module":
                return level
    return level


def moved_attribute(package: str, name: str, modules: Iterable[str]) -> Any:
    """Resolve ``package.name`` (an old flat module's name) from the first of ``modules`` that defines it.

    Warns with the new path. Searches the package's other submodules if none of ``modules`` has it, so a later
    move inside the package keeps the old name working.
    """
    preferred = list(modules)
    for mod_name in preferred + [m for m in _submodules(package) if m not in preferred]:
        try:
            module = importlib.import_module(mod_name)
        except ImportError:
            if mod_name in preferred:
                raise
            continue  # a submodule needing an optional extra cannot be where a 0.1.0 name lives
        if name in vars(module):
            warnings.warn(message(f"{package}.{name}", f"{mod_name}.{name}"), DeprecationWarning, stacklevel=3)
            return vars(module)[name]
    raise AttributeError(f"module {package!r} has no attribute {name!r}")


def _split_attribute(old: str, homes: Sequence[str], name: str) -> Any:
    """A split old module's ``__getattr__``: its 0.1.0 names from their homes (no dunder: it is no package)."""
    if name.startswith("__"):
        raise AttributeError(f"module {old!r} has no attribute {name!r}")
    for home in homes:  # the module that defines it, not one that imports it
        value = vars(importlib.import_module(home)).get(name)
        if value is not None and getattr(value, "__module__", home) == home:
            return moved_attribute(old, name, (home,))
    return moved_attribute(old, name, homes)


def _submodules(package: str) -> list[str]:
    pkg = importlib.import_module(package)
    return [m.name for m in pkgutil.walk_packages(getattr(pkg, "__path__", []), f"{package}.")]

"""The public API (``rope_quant.__all__``, loaded lazily) and the 0.1.0 module paths that 0.2.0 moved.

Every old path must still import, warn with a DeprecationWarning that names the new path and the removal
version, and give the very object the new path gives.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest

import rope_quant
from rope_quant import _deprecation

REPO = Path(__file__).resolve().parents[2]

# What commit 2da0636 moved, written out independently of rope_quant/_deprecation.py (git show --stat 2da0636).
MOVED_BY_2DA0636 = {
    "diagnostics": "calib.diagnostics", "calibration": "calib.moments", "objectives": "calib.objectives",
    "verify": "calib.verify", "angles": "core.angles", "hadamard": "core.hadamard", "rope": "core.rope",
    "stats": "core.stats", "transforms": "core.transforms", "data": "experiment.data",
    "envinfo": "experiment.envinfo", "evaluate": "experiment.evaluate", "pipeline": "experiment.pipeline",
    "models": "model.loading", "gptq": "quant.gptq", "attention": "rotations.attention",
    "rotation": "rotations.offline", "whip": "rotations.whip", "report": "sweep.report",
}
# Modules moved inside the package after 2da0636 (CHANGELOG.md, 0.2.0), served by the same hook.
MOVED_LATER = {
    "sweep.models": "sweep.loaded_models",
    "quant.key_quantizers": "quant.keys",
    **{f"sweep.{m}": f"analysis.{m}" for m in ("figures", "gap_share", "kind_reports", "protocol_report", "report",
                                                "reproduce", "titles")},
    # experiment/ split: one cell's config and build pipeline stay; corpora, scoring and the cost plan moved out
    "experiment.corpora": "corpora.sources", "experiment.documents": "corpora.documents",
    "experiment.data": "corpora.token_streams",
    **{f"experiment.{m}": f"scoring.{m}" for m in ("evaluate", "longctx", "generate", "niah")},
    **{f"experiment.{m}": f"planning.{m}" for m in ("plan", "plan_costs", "memory_check", "stages")},
}


def _now(path: str) -> str:
    """Where a module that 2da0636 moved lives today (a later move goes straight there)."""
    return MOVED_LATER.get(path, path)
# ... and the two flat modules that became packages of the same name.
BECAME_PACKAGES = ("quant", "sweep")


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    return out.stdout.strip()


def _forget(name: str) -> None:
    """Make the next ``import name`` go through the import hook again (a module warns on its first import only)."""
    sys.modules.pop(name, None)
    parent, _, child = name.rpartition(".")
    vars(importlib.import_module(parent)).pop(child, None)


# ---- the public API ------------------------------------------------------------------------------------


def test_import_rope_quant_and_the_plugin_stay_light():
    heavy = ("torch", "numpy", "transformers", "scipy")
    code = ("import sys, rope_quant, rope_quant.pytest_plugin; "
            f"print(sorted(m for m in {heavy!r} if m in sys.modules)); print(rope_quant.__version__)")
    loaded, version = _run(code).splitlines()
    assert loaded == "[]", f"import rope_quant loaded {loaded}"
    assert version == rope_quant.__version__


def test_a_public_name_loads_its_module_on_first_use():
    loaded = _run("import sys, rope_quant; before = 'torch' in sys.modules; rope_quant.RunConfig; "
                  "print(before, 'torch' in sys.modules)")
    assert loaded == "False True"


def test_all_lists_exactly_the_public_names_and_each_resolves():
    assert set(rope_quant.__all__) == {"__version__", *rope_quant._PUBLIC}
    assert len(rope_quant.__all__) == len(set(rope_quant.__all__))
    for name, where in rope_quant._PUBLIC.items():
        module = importlib.import_module(where)
        expected = importlib.import_module(f"{where}.{name}") if where == "rope_quant.core" else getattr(module, name)
        assert getattr(rope_quant, name) is expected, name
        assert name in dir(rope_quant)


def test_public_api_covers_config_cell_registry_stats_hadamard():
    from rope_quant.core import stats, transforms
    from rope_quant.experiment import config, pipeline

    assert rope_quant.RunConfig is config.RunConfig
    assert rope_quant.run_cell is pipeline.run_cell
    assert rope_quant.build_quantized_model is pipeline.build_quantized_model
    assert rope_quant.transforms is transforms
    assert "hadamard" in rope_quant.transforms.names() and "pairwise_only" in rope_quant.transforms.names()
    assert rope_quant.holm is stats.holm
    h = rope_quant.hadamard_matrix(12)  # a Paley order: constructed, not a power of two
    assert set(h.flatten().tolist()) == {-1.0, 1.0}
    assert (h @ h.T - 12 * __import__("torch").eye(12, dtype=h.dtype)).abs().max() < 1e-9


def test_the_public_api_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in rope_quant._PUBLIC:
            getattr(rope_quant, name)
        from rope_quant import transforms  # the registry's public spelling
    assert transforms.build("identity", 8) is not None


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        rope_quant.not_a_name  # noqa: B018
    with pytest.raises(ImportError):
        exec("from rope_quant import not_a_name")


def test_the_version_is_the_projects():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["version"] == rope_quant.__version__ == "0.2.0"


# ---- the moved module paths ----------------------------------------------------------------------------


def test_the_moved_table_is_what_2da0636_and_later_commits_moved():
    moved = {k: v.removeprefix("rope_quant.") for k, v in _deprecation.MOVED_MODULES.items()}
    assert moved == {**{old: _now(new) for old, new in MOVED_BY_2DA0636.items()}, **MOVED_LATER}


@pytest.mark.parametrize("old", sorted(MOVED_LATER))
def test_a_later_move_warns_and_is_the_new_module(old):
    new = importlib.import_module(f"rope_quant.{MOVED_LATER[old]}")
    _forget(f"rope_quant.{old}")
    with pytest.warns(DeprecationWarning, match=rf"module rope_quant\.{old} is deprecated .*0\.3\.0.*{new.__name__}"):
        moved = importlib.import_module(f"rope_quant.{old}")
    assert moved is new and sys.modules[f"rope_quant.{old}"] is new


def test_the_old_paths_are_served_by_the_import_hook_not_by_files():
    """One table and one finder on ``sys.meta_path``: no file at an old path, and the front holds at most seven
    (``__init__``, ``_deprecation``, ``defaults``, ``seeds``, ``io``, ``pytest_plugin`` and ``claims_json``, the
    claims JSON writer the plugin and the CLI share, stdlib only)."""
    package = Path(rope_quant.__file__).parent
    for old in _deprecation.MOVED_MODULES:
        stem = package.joinpath(*old.split("."))
        assert not stem.with_suffix(".py").exists() and not stem.is_dir(), f"a file still sits at {old}"
    assert len(list(package.glob("*.py"))) <= 7
    code = ("import sys, rope_quant; print(sum(type(f).__name__ == '_MovedFinder' for f in sys.meta_path)); "
            "import importlib; rope_quant._deprecation.install(); "
            "print(sum(type(f).__name__ == '_MovedFinder' for f in sys.meta_path))")
    assert _run(code).split() == ["1", "1"]


def test_an_old_path_fails_under_error_and_works_without():
    code = "import rope_quant.stats, rope_quant.core.stats as new; print(rope_quant.stats is new)"
    assert _run(code) == "True"
    failed = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", code], capture_output=True,
                            text=True, cwd=REPO)
    assert failed.returncode != 0 and "DeprecationWarning: module rope_quant.stats" in failed.stderr


# 0.1.0 names that a later split moved out of the module the old path serves (git show 2da0636^:rope_quant/...).
SPLIT_OUT = {
    "calibration": {"calib.stats": ("CalibrationStats", "merge_all", "register_projection_hooks")},
    "gptq": {"quant.rtn": ("GPTQConfig", "GPTQError", "weight_scales", "quantize_with_scales", "rtn_quantize",
                           "quantize_model_rtn")},
    "whip": {"rotations.whip_model": ("collect_r1_samples", "collect_r2_samples", "calibrate_model_rotations")},
    "data": {"corpora.sources": ("load_text", "list_corpora", "parse_bible_output"),
             "corpora.documents": ("CorpusError", "CorpusFormatError", "Document", "TextSplit", "split_documents")},
}
# A 0.1.0 name of each split module that stayed in the module its old path's MOVED_MODULES entry names.
STAYED = {"calibration": "PairMoments", "gptq": "quantize_model_gptq", "whip": "fit_rotation", "data": "load_corpus"}


@pytest.mark.parametrize("old", sorted(SPLIT_OUT))
def test_a_split_old_module_serves_every_0_1_0_name_from_its_new_home(old):
    """An old path whose module was later split is a module of its own: each name warns with its new home and
    is that home's object; the names that stayed come from the MOVED_MODULES target."""
    assert {h.removeprefix("rope_quant.") for h in _deprecation.SPLIT_MODULES[old]} == set(SPLIT_OUT[old])
    _forget(f"rope_quant.{old}")
    with pytest.warns(DeprecationWarning, match=r"module rope_quant\.\w+ is deprecated .*0\.3\.0.* and "):
        shimmed = importlib.import_module(f"rope_quant.{old}")
    for home, names in {**SPLIT_OUT[old], _now(MOVED_BY_2DA0636[old]): (STAYED[old],)}.items():
        module = importlib.import_module(f"rope_quant.{home}")
        for name in names:
            with pytest.warns(DeprecationWarning, match=rf"rope_quant\.{old}\.{name} .*use {module.__name__}"):
                value = getattr(shimmed, name)
            assert value is vars(module)[name], (old, name)
            assert name in shimmed.__all__
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        shimmed.not_a_name  # noqa: B018


@pytest.mark.parametrize("old", sorted(set(MOVED_BY_2DA0636) - set(SPLIT_OUT)))
def test_an_old_module_path_warns_and_is_the_new_module(old):
    new = importlib.import_module(f"rope_quant.{_now(MOVED_BY_2DA0636[old])}")
    _forget(f"rope_quant.{old}")
    with pytest.warns(DeprecationWarning) as caught:
        shimmed = importlib.import_module(f"rope_quant.{old}")
    text = str(caught[0].message)
    assert f"rope_quant.{old}" in text and new.__name__ in text and "removed in 0.3.0" in text
    assert shimmed is new
    assert sys.modules[f"rope_quant.{old}"] is new


def test_the_warning_points_at_the_importing_line():
    _forget("rope_quant.rope")
    with pytest.warns(DeprecationWarning) as caught:
        import rope_quant.rope  # noqa: F401
    assert caught[0].filename == __file__


def test_a_module_moved_out_of_a_package_imports_from_it():
    """``from rope_quant.experiment import evaluate`` (the package stays, the module left it) warns with the new
    path and gives the new module."""
    from rope_quant.scoring import evaluate as new

    _forget("rope_quant.experiment.evaluate")
    with pytest.warns(DeprecationWarning, match=r"rope_quant\.experiment\.evaluate .*rope_quant\.scoring\.evaluate"):
        from rope_quant.experiment import evaluate
    assert evaluate is new
    assert importlib.import_module("rope_quant.experiment").evaluate is new


def test_the_old_from_import_forms_work():
    _forget("rope_quant.stats")
    with pytest.warns(DeprecationWarning, match="rope_quant.core.stats"):
        from rope_quant.stats import paired_ci
    from rope_quant.core.stats import paired_ci as new

    assert paired_ci is new


@pytest.mark.parametrize("name", sorted(_deprecation.OLD_QUANT_NAMES))
def test_old_quant_module_names_resolve_through_the_package(name):
    from rope_quant.quant import quantizers, static

    home = static if name == "StaticChannelQuantizer" else quantizers  # the static quantiser's own module
    with pytest.warns(DeprecationWarning, match=rf"rope_quant\.quant\.{name} .*0\.3\.0.*{home.__name__}\.{name}"):
        value = getattr(importlib.import_module("rope_quant.quant"), name)
    assert value is vars(home)[name]


def test_from_rope_quant_quant_import_quantconfig():
    with pytest.warns(DeprecationWarning, match="rope_quant.quant.quantizers.QuantConfig"):
        from rope_quant.quant import QuantConfig
    from rope_quant.quant.quantizers import QuantConfig as new

    assert QuantConfig is new


@pytest.mark.parametrize("name", sorted(_deprecation.OLD_SWEEP_NAMES))
def test_old_sweep_module_names_resolve_through_the_package(name):
    with pytest.warns(DeprecationWarning) as caught:
        value = getattr(importlib.import_module("rope_quant.sweep"), name)
    text = str(caught[0].message)
    new_path = text.rpartition("; use ")[2]
    module, _, attr = new_path.rpartition(".")
    assert text.startswith(f"rope_quant.sweep.{name} is deprecated") and "0.3.0" in text
    assert attr == name and module.startswith("rope_quant.sweep.")
    assert value is vars(importlib.import_module(module))[name]


@pytest.mark.parametrize("package", BECAME_PACKAGES)
def test_a_package_still_refuses_names_it_never_had(package):
    mod = importlib.import_module(f"rope_quant.{package}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
            mod.not_a_name  # noqa: B018
        assert not hasattr(mod, "__path_hook__")


def test_the_new_paths_do_not_warn():
    code = ("import warnings; warnings.simplefilter('error'); "
            + "; ".join(f"import rope_quant.{_now(new)}" for new in MOVED_BY_2DA0636.values())
            + "; " + "; ".join(f"import rope_quant.{new}" for new in MOVED_LATER.values())
            + "; from rope_quant.quant.quantizers import QuantConfig; from rope_quant.sweep.runner import run_cells"
            + "; print('ok')")
    assert _run(code) == "ok"

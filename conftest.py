"""This repository's own pytest configuration: what only the rope_quant suite wants.

Markers, ``--rq-*`` options, the ``rq_*`` fixtures and the claims table come from the installed plugin
(``rope_quant.pytest_plugin``), which every project in the environment loads and which therefore changes
nothing on its own. These are this suite's choices and live here, where only this suite sees them:

* the hypothesis profiles ``ci`` (derandomised; loaded when ``CI`` is set), ``dev`` (the default) and
  ``thorough``; they are loaded at import, before hypothesis' plugin applies ``--hypothesis-profile``
  (in its ``pytest_configure``), so the command line still wins;
* the layer markers, given by directory: ``tests/<layer>/`` marks ``<layer>`` (``theory``, ``numerics``,
  ``e2e``, ``bench``), relative to this file, so nothing outside this repository's ``tests/`` is marked;
* each ``--rq-model`` checked before anything is collected (a missing path, an unknown name or an unsupported
  architecture: one usage error);
* the budget split: tests marked ``slow`` are deselected unless ``--run-slow`` is given or the ``-m``
  expression names ``slow`` (``tox -e slow`` runs them; README "Test layers");
* under pytest-xdist (the README's ``pytest -n 2``): the e2e layer first, alone, at torch's default thread count,
  then the other modules over every worker at one thread each (``tests/_support/xdist_phases.py``);
* the ``compat`` marker (registered here, not by the plugin): the numerics tests that exercise transformers'
  own APIs and so are the ones that differ between transformers versions. A test module opts in with
  ``pytestmark = pytest.mark.compat``; ``tox -e tf448-compat`` (which CI runs) selects
  ``theory or (numerics and compat)`` on the oldest supported transformers.

Heavy objects are built lazily, once per session.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

pytest_plugins = ["pytester", "tests._support.fixtures"]

settings.register_profile(
    "ci", derandomize=True, max_examples=40, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=60, deadline=None)
settings.register_profile("thorough", max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")

_TESTS_DIR = Path(__file__).resolve().parent / "tests"
LAYERS = ("theory", "numerics", "e2e", "bench")
SLOW = "slow: outside the default run's CI budget (deselected unless --run-slow or -m names it; tox -e slow)"
COMPAT = (
    "compat: numerics that exercise transformers' own APIs (model classes and configs, GGUF loading, the "
    "attention-function registry, rotary inv_freq, tokenizer BOS, the lm-eval bridge); CI runs them on the "
    "oldest supported transformers (tox -e tf448-compat)"
)


def pytest_configure(config: pytest.Config) -> None:
    if config.inipath is None:
        # pytest fixes its rootdir before plugin options are known, so `--rq-claims-out DIR` (a space, not `=`)
        # makes DIR look like a test path: the rootdir moves there and pytest.ini (strict xfail, markers) is lost.
        raise pytest.UsageError(
            f"pytest found no pytest.ini (rootdir {config.rootpath}): a path-valued --rq-* option was probably "
            "written with a space (`--rq-claims-out DIR`); write it with `=` (`--rq-claims-out=DIR`) or name the "
            "tests to run (`pytest tests -m e2e --rq-claims-out DIR`)")
    config.addinivalue_line("markers", COMPAT)
    config.addinivalue_line("markers", SLOW)
    check_models(config)


def check_models(config: pytest.Config) -> None:
    """Each ``--rq-model`` names an embedded model or a checkpoint of a supported architecture, read from its config
    alone (``rope_quant.cli.validate.check_model``, the CLI's ``--model`` check): one usage error naming every bad
    one, before any test is collected or run."""
    named = config.getoption("--rq-model", None) or ()
    if not named or hasattr(config, "workerinput"):  # an xdist worker: the controller checked them
        return
    from rope_quant.cli.args import CLIError
    from rope_quant.cli.validate import check_model

    bad = []
    for name in dict.fromkeys(named):
        try:
            check_model(name)
        except CLIError as exc:
            bad.append(str(exc))
    if bad:
        raise pytest.UsageError(f"--rq-model: {'; '.join(bad)}")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``-n N`` with xdist's default distribution: :class:`tests._support.xdist_phases.PhasedScheduling` (the e2e
    layer first, alone); an explicit ``--dist`` mode is left as given."""
    if config.getoption("dist", "load") != "load":
        return None
    from tests._support.xdist_phases import PhasedScheduling

    return PhasedScheduling(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Under xdist, before each test's fixtures: its torch threads (``tests._support.xdist_phases.set_threads``)."""
    if hasattr(item.config, "workerinput"):
        from tests._support.xdist_phases import set_threads

        set_threads(item.nodeid)


def layer_of(path: Path) -> str | None:
    """The layer marker of a test file: its first directory under this repository's ``tests/``, if a layer."""
    try:
        rel = Path(path).resolve().relative_to(_TESTS_DIR)
    except ValueError:
        return None
    return rel.parts[0] if len(rel.parts) > 1 and rel.parts[0] in LAYERS else None


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true",
                     help="also run the tests marked slow (outside the default run's CI budget)")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with its layer directory (``gpu_e2e`` tests in ``tests/e2e`` stay out of ``-m e2e``),
    and deselect ``slow`` tests unless asked for (before ``-m`` filtering, so ``-m slow`` still selects)."""
    for item in items:
        layer = layer_of(item.path)
        if layer and not (layer == "e2e" and item.get_closest_marker("gpu_e2e")):
            item.add_marker(getattr(pytest.mark, layer))
    if config.getoption("--run-slow") or "slow" in (config.getoption("markexpr") or ""):
        return
    slow = [it for it in items if it.get_closest_marker("slow") and layer_of(it.path)]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [it for it in items if it not in slow]


@pytest.fixture(scope="session")
def embedded_model():
    """(model, tokenizer) of the embedded SmolLM2-135M in fp32 on CPU, loaded once per session.

    Tests must not mutate it: build rotated or quantised copies with ``copy.deepcopy``.
    """
    from rope_quant.model.loading import ModelNotFoundError, load_model

    try:
        return load_model("smollm2-135m", device="cpu")
    except ModelNotFoundError as exc:  # the README install step provides it; say so if it is missing
        pytest.fail(f"embedded model unavailable: {exc}")


@pytest.fixture(scope="session")
def build_cache(tmp_path_factory) -> str:
    """The session's cache of built models (GPTQ weights, R1 fits, calibration statistics, e2e cells; keyed by
    content): ``ROPE_QUANT_E2E_CACHE`` to keep it across sessions, else a fresh session directory. The e2e layer's
    experiments and the numerics layer's SmolLM2 pipeline test share it, so a build both need is made once."""
    import os

    return str(os.environ.get("ROPE_QUANT_E2E_CACHE") or tmp_path_factory.mktemp("build-cache"))

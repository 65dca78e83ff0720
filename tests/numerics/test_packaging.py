"""pyproject.toml, tox.ini and .ci agree: test tooling is an extra, not a runtime
dependency; the install line names it; the lint env type-checks the package against a baseline that only
names modules that exist."""

from __future__ import annotations

import configparser
import importlib.util
import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
TEST_TOOLS = {"pytest", "pytest-benchmark", "pytest-xdist", "hypothesis", "sympy"}


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_test_tooling_is_an_extra_not_a_runtime_dependency():
    runtime = _names(PROJECT["project"]["dependencies"])
    assert not runtime & TEST_TOOLS, f"test tooling among the runtime dependencies: {runtime & TEST_TOOLS}"
    assert TEST_TOOLS <= _names(PROJECT["project"]["optional-dependencies"]["test"])
    assert {"torch", "transformers", "numpy"} <= runtime


def test_the_install_line_and_tox_install_the_test_extra():
    install = re.search(r"^INSTALL: (.*)$", (REPO / ".ci/commands").read_text(), re.M).group(1)
    assert '-e ".[eval,test,export]"' in install
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(REPO / "tox.ini")
    assert {e.strip() for e in tox["testenv"]["extras"].split(",")} == {"eval", "test"}
    lint = tox["testenv:lint"]["commands"]
    assert "mypy rope_quant" in lint and "ruff check" in lint


def test_the_mypy_baseline_names_only_modules_that_exist():
    overrides = PROJECT["tool"]["mypy"]["overrides"]
    baseline = [m for o in overrides if o.get("ignore_errors") for m in o["module"]]
    assert baseline == sorted(baseline)
    missing = [m for m in baseline if importlib.util.find_spec(m) is None]
    assert not missing, f"the mypy baseline names modules that no longer exist (delete them): {missing}"


def test_no_stale_module_path_in_pyproject():
    text = (REPO / "pyproject.toml").read_text()
    stale = re.findall(r"rope_quant\.(?:hadamard|stats|rope|transforms|quant\.QuantConfig)\b", text)
    assert not stale

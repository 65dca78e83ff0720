"""pytest plugin for rope_quant (entry point ``pytest11: rope_quant``).

A ``pytest11`` plugin is loaded by every pytest run in the environment, in every project, so this
one changes nothing that a project did not ask for: it registers the suite's marker names, the
``--rq-*`` options, the ``rq_options`` / ``rq_claim`` / ``rq_record`` fixtures and the claims table,
and skips tests that carry its own ``gpu_e2e`` marker where CUDA is unavailable. What only the
rope_quant suite wants (marking tests by their ``tests/<layer>/`` directory, the hypothesis
profiles) lives in the repository's root ``conftest.py``. Like hypothesis' own plugin, this module
imports nothing heavy at import time: torch is only imported when a ``gpu_e2e`` test has been
selected and needs a CUDA check. Per-session state lives in ``config.stash``.

Tests attach measurements with the ``rq_claim`` / ``rq_record`` fixtures. The data travels on
``report.user_properties`` (so it survives pytest-xdist) and is printed by
``pytest_terminal_summary``; ``--rq-claims-out DIR`` also writes it as JSON and Markdown.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from rope_quant.defaults import DEFAULT_CORPUS, DEFAULT_MODEL
from rope_quant.io import atomic_write_text, markdown_table  # stdlib only: keeps the plugin light

MARKERS = {
    "theory": "CPU, seconds: sympy/hypothesis checks of the paper's lemma, theorem and propositions",
    "numerics": "CPU: calibration, angles, transforms, Hadamard kernels, quantisers, model pipeline",
    "e2e": "CPU, minutes: the paper's claims on the embedded model (SmolLM2-135M)",
    "gpu_e2e": "GPU: the paper's claims on real checkpoints given with --rq-model (skips without CUDA)",
    "bench": "pytest-benchmark timings; targets are reported as ratios, never asserted on time",
}
EMBEDDED_MODEL = DEFAULT_MODEL
_CLAIMS_KEY = "rq_claim"
_TABLE_KEY = "rq_table"
_STORE = pytest.StashKey["_Collector"]()
_OPTIONS = pytest.StashKey["RQOptions"]()


@dataclass(frozen=True)
class RQOptions:
    """The ``--rq-*`` command-line options, parsed once per session."""

    models: tuple[str, ...] = (EMBEDDED_MODEL,)
    corpus: str = DEFAULT_CORPUS
    seeds: tuple[int, ...] | None = None
    device: str = "auto"
    claims_out: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch  # deferred: heavy

        return "cuda" if torch.cuda.is_available() else "cpu"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("rope-quant", "rope_quant claims suite")
    group.addoption(
        "--rq-model", action="append", default=None, metavar="PATH|NAME",
        help=f"model to test (repeatable): a local HF checkpoint, a .gguf file, or '{EMBEDDED_MODEL}' "
        "(the default)",
    )
    group.addoption(
        "--rq-corpus", default=DEFAULT_CORPUS, metavar="NAME|PATH",
        help="corpus: pydoc (default), shakespeare, debian-reference, kjv, or a local WikiText-2/PG19 path",
    )
    group.addoption(
        "--rq-seeds", default=None, metavar="0,1,2",
        help="comma-separated seeds for paired experiments (default: each test's own budgeted set)",
    )
    group.addoption(
        "--rq-device", default="auto", metavar="cpu|cuda|auto", help="device for model tests (default auto)"
    )
    group.addoption(
        "--rq-claims-out", default=None, metavar="DIR",
        help="write the claims table to DIR/claims.json and DIR/claims.md",
    )


def _parse_seeds(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        seeds = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError as exc:
        raise pytest.UsageError(f"--rq-seeds expects comma-separated integers, got {text!r}") from exc
    if not seeds:
        raise pytest.UsageError("--rq-seeds is empty")
    return seeds


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    config.stash[_OPTIONS] = RQOptions(
        models=tuple(config.getoption("--rq-model") or (EMBEDDED_MODEL,)),
        corpus=config.getoption("--rq-corpus"),
        seeds=_parse_seeds(config.getoption("--rq-seeds")),
        device=config.getoption("--rq-device"),
        claims_out=config.getoption("--rq-claims-out"),
    )
    config.stash[_STORE] = _Collector()
    config.pluginmanager.register(config.stash[_STORE], "rope_quant_collector")


def options(config: pytest.Config) -> RQOptions:
    """The session's parsed ``--rq-*`` options (for hooks; tests use the ``rq_options`` fixture)."""
    return config.stash[_OPTIONS]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked ``gpu_e2e`` (this plugin's marker) cleanly where they cannot run; nothing else."""
    gpu_items = [it for it in items if it.get_closest_marker("gpu_e2e")]
    if not gpu_items:
        return
    reason = _gpu_skip_reason(config)
    if reason:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=reason))


def _gpu_skip_reason(config: pytest.Config) -> str | None:
    opts = options(config)
    if opts.device not in ("auto", "cuda") and not opts.device.startswith("cuda"):
        return f"gpu_e2e: --rq-device={opts.device} is not a CUDA device"
    try:
        import torch  # deferred: heavy
    except ImportError:
        return "gpu_e2e: torch is not installed"
    if not torch.cuda.is_available():
        return "gpu_e2e: CUDA is not available on this machine (torch.cuda.is_available() is False)"
    return None


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def rq_options(pytestconfig: pytest.Config) -> RQOptions:
    """The parsed ``--rq-*`` options."""
    return options(pytestconfig)


@pytest.fixture
def rq_claim(request: pytest.FixtureRequest):
    """Record one claim's outcome on the test report.

    ``rq_claim(claim, expected, measured, holds, model=None, **numbers)``; the verdict column combines
    ``holds`` with the test outcome (a claim recorded by an xfail test shows as not holding). ``model``: the
    model the claim was measured on (the table's model column; default the embedded model).
    ``holds=None`` records a claim the test could not decide at its budget (its estimate lies within the
    measured cross-machine spread of the decision boundary): the verdict reads "inconclusive at this budget".
    """

    def record(claim: str, expected: str, measured: str, holds: bool | None, model: str | None = None,
               **numbers: Any) -> None:
        request.node.user_properties.append(
            (_CLAIMS_KEY, {"claim": claim, "model": model or EMBEDDED_MODEL, "expected": expected,
                           "measured": measured,
                           "holds": None if holds is None else bool(holds), "numbers": _jsonable(numbers),
                           "test": request.node.nodeid})
        )

    return record


@pytest.fixture
def rq_record(request: pytest.FixtureRequest):
    """Attach one row of a named measurement table (benchmarks, paired tables) to the report."""

    def record(table: str, **row: Any) -> None:
        request.node.user_properties.append((_TABLE_KEY, {"table": table, "row": _jsonable(row)}))

    return record


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=lambda o: float(o) if hasattr(o, "__float__") else str(o)))


# ----------------------------------------------------------------------------- reporting


class _Collector:
    """Gathers claims and table rows from test reports (works under pytest-xdist too)."""

    def __init__(self) -> None:
        self.claims: list[dict[str, Any]] = []
        self.tables: dict[str, list[dict[str, Any]]] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "call" and not (report.when == "setup" and report.skipped):
            return
        outcome = "xfailed" if hasattr(report, "wasxfail") and report.skipped else report.outcome
        for key, value in report.user_properties:
            if key == _CLAIMS_KEY:
                self.claims.append({**value, "outcome": outcome})
            elif key == _TABLE_KEY:
                self.tables.setdefault(value["table"], []).append(value["row"])


def verdict(claim: dict[str, Any]) -> str:
    """Combine what the test measured with its outcome."""
    if claim["outcome"] == "failed":
        return "FAILED"
    if claim["holds"] is None and claim["outcome"] != "xfailed":
        return "inconclusive at this budget"
    if claim["outcome"] == "xfailed" or not claim["holds"]:
        return "does not hold (xfail)" if claim["outcome"] == "xfailed" else "does not hold"
    return "holds"


def claims_markdown(claims: list[dict[str, Any]]) -> str:
    rows = [{**c, "verdict": verdict(c)} for c in claims]
    return markdown_table(rows, ["claim", "model", "expected", "measured", "verdict"])


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    store = config.stash.get(_STORE, None)
    if store is None or hasattr(config, "workerinput"):  # pytest-xdist workers: the controller reports
        return
    claims, tables = store.claims, store.tables
    for title, rows in tables.items():
        terminalreporter.write_sep("-", f"rope_quant: {title}")
        columns = list(dict.fromkeys(k for r in rows for k in r))
        terminalreporter.write_line(markdown_table(rows, columns))
    if claims:
        terminalreporter.write_sep("=", "rope_quant claims table")
        terminalreporter.write_line(claims_markdown(claims))
    out = options(config).claims_out
    if out and (claims or tables):
        directory = Path(out)
        directory.mkdir(parents=True, exist_ok=True)
        payload = {"claims": [{**c, "verdict": verdict(c)} for c in claims], "tables": tables}
        atomic_write_text(directory / "claims.json", json.dumps(payload, indent=2))
        atomic_write_text(directory / "claims.md", claims_markdown(claims) + "\n")
        terminalreporter.write_line(f"claims written to {directory}/claims.json and claims.md")

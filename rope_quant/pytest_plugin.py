"""pytest plugin for rope_quant (entry point ``pytest11: rope_quant``).

A ``pytest11`` plugin is loaded by every pytest run in the environment, in every project, so this
one changes nothing that a project did not ask for: it registers the suite's marker names, the
``--rq-*`` options, the ``rq_options`` / ``rq_claim`` / ``rq_record`` / ``rq_machine`` / ``rq_run`` fixtures and
the claims table, and skips this suite's ``gpu_e2e`` tests (under this repository's ``tests/`` or using this
plugin's fixtures) where CUDA is unavailable; another project's ``gpu_e2e`` marker is left alone. What only the
rope_quant suite wants (marking tests by their ``tests/<layer>/`` directory, the hypothesis
profiles) lives in the repository's root ``conftest.py``. Like hypothesis' own plugin, this module
imports nothing heavy at import time: torch is only imported when a ``gpu_e2e`` test has been
selected and needs a CUDA check. Per-session state lives in ``config.stash``.

Tests attach measurements with the ``rq_claim`` / ``rq_record`` fixtures. The data travels on
``report.user_properties`` (so it survives pytest-xdist) and is printed by
``pytest_terminal_summary``; ``--rq-claims-out=DIR`` also writes it as JSON and Markdown. A registry front
describes its run with ``rq_run`` (the model and its fingerprint, the protocol, the device: the keys
``rope-quant report DIR`` writes), so the JSON says what the claims were measured on.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from rope_quant.defaults import DEFAULT_CORPUS, DEFAULT_FUTILITY, DEFAULT_MAX_SEEDS, DEFAULT_MODEL, DEFAULT_SHAPE, Shape
from rope_quant.io import atomic_write_text, markdown_table  # stdlib only: keeps the plugin light
from rope_quant.seeds import SeedSpecError, parse_seeds  # stdlib only

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
_MACHINE_KEY = "rq_machine"
_RUN_KEY = "rq_run"
#: The keys of a run's description (``rq_run``), written at the top of the claims JSON when the session measured
#: one model (``rope_quant.analysis.claims_report.RUN_KEYS``; a test keeps the two equal).
RUN_KEYS = ("model", "protocol", "device")
_STORE = pytest.StashKey["_Collector"]()
#: The claims JSON's layout: 2 adds ``schema`` and each decision's ``rule`` / ``float_order``
#: (rope_quant.analysis.reproduce reads both layouts).
CLAIMS_SCHEMA = 2
_OPTIONS = pytest.StashKey["RQOptions"]()


@dataclass(frozen=True)
class RQOptions:
    """The ``--rq-*`` command-line options, parsed once per session."""

    models: tuple[str, ...] = (EMBEDDED_MODEL,)
    corpus: str = DEFAULT_CORPUS
    seeds: tuple[int, ...] | None = None
    device: str = "auto"
    claims_out: str | None = None
    replicates: int | None = None
    until_decided: bool = False
    max_seeds: int = DEFAULT_MAX_SEEDS
    time_budget: float | None = None
    futility: float = DEFAULT_FUTILITY
    shape: str = DEFAULT_SHAPE.value
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
        "--rq-seeds", default=None, metavar="0,1,2|0-9",
        help="seeds for paired experiments: comma-separated integers and inclusive ranges, e.g. 0,1,2 or 0-9 "
        "or 0-4,7 (default: each test's own budgeted set)",
    )
    group.addoption(
        "--rq-replicates", default=None, metavar="K",
        help="numerical replicates: the first K seeds rebuilt with GPTQ in the other float mode (default 3); the "
        "float-order noise and bias are estimated from them (0 or 1: every replicated claim is inconclusive)",
    )
    group.addoption(
        "--rq-device", default="auto", metavar="cpu|cuda|auto", help="device for model tests (default auto)"
    )
    group.addoption(
        "--rq-claims-out", default=None, metavar="DIR",
        help="write the claims table to DIR/claims.json and DIR/claims.md",
    )
    group.addoption(
        "--rq-until-decided", action="store_true", default=False,
        help="after the seeds requested, add seeds (every one replicated) to the claims still inconclusive, "
        "deciding them by the sequential rule (docs/verdicts.md), until decided, --rq-max-seeds or --rq-time-budget",
    )
    group.addoption(
        "--rq-max-seeds", default=None, metavar="M",
        help=f"with --rq-until-decided: the most seeds a claim may use (default {DEFAULT_MAX_SEEDS}); a claim "
        "still open at M says why",
    )
    group.addoption(
        "--rq-time-budget", default=None, metavar="SECONDS",
        help="with --rq-until-decided: stop adding seeds when the next would pass this wall time (per session)",
    )
    group.addoption(
        "--rq-futility", default=None, metavar="P",
        help=f"with --rq-until-decided: stop a claim early when its chance of a decision by M is below P (default "
        f"{DEFAULT_FUTILITY:g}; 0 turns it off)",
    )
    group.addoption(
        "--rq-shape", default=DEFAULT_SHAPE.value, choices=[s.value for s in Shape],
        help=f"with --rq-until-decided: the sequential boundary (default {DEFAULT_SHAPE.value}: valid for skewed "
        "and heavy-tailed per-seed effects; normal: the Pocock t boundary, which assumes normal per-seed effects "
        "and needs fewer seeds; contamination_robust: also valid for a rare blow-up seed, more seeds; "
        "docs/verdicts.md)",
    )


def _number(text: str, option: str, kind: type, expected: str) -> Any:
    """``kind(text)``, or the usage error "OPTION: expected EXPECTED, got 'TEXT'"."""
    try:
        return kind(text)
    except ValueError:
        raise pytest.UsageError(f"{option}: expected {expected}, got {text!r}") from None


def _parse_replicates(text: str | None) -> int | None:
    """``--rq-replicates``: a whole number >= 0 (the e2e budget checks it against the seeds)."""
    if text is None:
        return None
    k = _number(text, "--rq-replicates", int, "a whole number >= 0")
    if k < 0:
        raise pytest.UsageError(f"--rq-replicates: expected a whole number >= 0, got {k}")
    return k


def _parse_seeds(text: str | None) -> tuple[int, ...] | None:
    """``--rq-seeds`` through :func:`rope_quant.seeds.parse_seeds` (ranges such as ``0-9``); a usage error
    naming the accepted forms otherwise."""
    if text is None:
        return None
    try:
        return parse_seeds(text)
    except SeedSpecError as exc:
        raise pytest.UsageError(f"--rq-seeds: {exc}") from exc


#: The seeds a claim runs with when ``--rq-seeds`` is not given (``tests/e2e/conftest.py``'s ``E2EBudget``).
DEFAULT_SEED_COUNT = 3


def _parse_until_decided(config: pytest.Config, seeds: tuple[int, ...] | None,
                         replicates: int | None) -> tuple[bool, int, float | None]:
    """``--rq-until-decided``, ``--rq-max-seeds``, ``--rq-time-budget``: usage errors for a time budget ≤ 0, an M
    that is not a whole number ≥ 2 or lies below the seeds given, and an until-decided run whose replicates
    cannot decide (``--rq-replicates`` 0 or 1, or fewer than the seeds: the sequential rule replicates every
    seed)."""
    until = bool(config.getoption("--rq-until-decided"))
    text, budget_text = config.getoption("--rq-max-seeds"), config.getoption("--rq-time-budget")
    budget = None
    if budget_text is not None:
        budget = _number(budget_text, "--rq-time-budget", float, "seconds (a number > 0)")
        if not budget > 0:
            raise pytest.UsageError(f"--rq-time-budget {budget_text}: must be a positive number of seconds")
    max_seeds = DEFAULT_MAX_SEEDS
    if text is not None:
        max_seeds = _number(text, "--rq-max-seeds", int, "a whole number >= 2")
    n = len(seeds) if seeds is not None else DEFAULT_SEED_COUNT
    if (text is not None or until) and max_seeds < max(n, 2):
        raise pytest.UsageError(f"--rq-max-seeds {max_seeds} is below the {n} seeds given: pass --rq-max-seeds "
                                f"{max(n, 2)} or more")
    if until and replicates is not None and replicates < n:
        why = ("the float-order noise and bias cannot be estimated, so the rule cannot decide" if replicates < 2
               else "the sequential rule replicates every seed")
        raise pytest.UsageError(f"--rq-until-decided with --rq-replicates {replicates}: {why}; drop "
                                f"--rq-replicates (every seed is replicated) or pass --rq-replicates {n}")
    return until, max_seeds, budget


def _parse_futility(text: str | None) -> float:
    """``--rq-futility``: a number in [0, 1) (0: no early stop)."""
    if text is None:
        return DEFAULT_FUTILITY
    value = _number(text, "--rq-futility", float, "a chance in [0, 1)")
    if not 0.0 <= value < 1.0:
        raise pytest.UsageError(f"--rq-futility {text}: must lie in [0, 1) (0 turns the early stop off)")
    return value


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    seeds = _parse_seeds(config.getoption("--rq-seeds"))
    replicates = _parse_replicates(config.getoption("--rq-replicates"))
    until, max_seeds, budget = _parse_until_decided(config, seeds, replicates)
    config.stash[_OPTIONS] = RQOptions(
        models=tuple(config.getoption("--rq-model") or (EMBEDDED_MODEL,)),
        corpus=config.getoption("--rq-corpus"),
        seeds=seeds,
        device=config.getoption("--rq-device"),
        claims_out=config.getoption("--rq-claims-out"),
        replicates=replicates,
        until_decided=until, max_seeds=max_seeds, time_budget=budget,
        futility=_parse_futility(config.getoption("--rq-futility")),
        shape=config.getoption("--rq-shape"),
    )
    config.stash[_STORE] = _Collector()
    config.pluginmanager.register(config.stash[_STORE], "rope_quant_collector")


def options(config: pytest.Config) -> RQOptions:
    """The session's parsed ``--rq-*`` options (for hooks; tests use the ``rq_options`` fixture)."""
    return config.stash[_OPTIONS]


#: The fixtures this plugin provides: a test that uses one belongs to this suite wherever it lives.
PLUGIN_FIXTURES = frozenset({"rq_options", "rq_claim", "rq_record", "rq_run"})
#: This repository's test tree (absent when the package is installed from a wheel).
SUITE_TESTS = Path(__file__).resolve().parents[1] / "tests"


def _ours(item: pytest.Item) -> bool:
    """True for this suite's tests: under this repository's ``tests/``, or using this plugin's fixtures."""
    if PLUGIN_FIXTURES.intersection(getattr(item, "fixturenames", ())):
        return True
    try:
        return Path(str(item.path)).resolve().is_relative_to(SUITE_TESTS)
    except (OSError, ValueError):
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip this suite's ``gpu_e2e`` tests cleanly where they cannot run; another project's tests that carry a
    marker of the same name are left alone."""
    gpu_items = [it for it in items if it.get_closest_marker("gpu_e2e") and _ours(it)]
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

    ``rq_claim(claim, expected, measured, holds=None, model=None, verdict=None, **numbers)``. ``verdict``: a
    :class:`rope_quant.core.verdict.Verdict` (or its ``to_dict()``), the one decision rule's outcome (holds,
    fails, inconclusive with the budget to decide, refuted); when given, ``holds`` follows from it. Without
    it, ``holds`` True / False reads holds / fails, and None a measurement recorded without a claim ("recorded
    (no claim)"; an undecided claim passes its ``verdict``, which carries the budget). The verdict column
    combines it with the test outcome (a failed test whose claim was not decided against reads FAILED).
    ``model``: the model the claim was measured on (default the embedded model). ``parts``: a claim made of
    parts (C4's steps, C7's lengths, App. F's settings) names each part's Verdict, so that ``report --against``
    compares the runs part by part. ``claim_id``: the registry id (``report --against`` matches two models'
    tables by it).
    """

    def record(claim: str, expected: str, measured: str, holds: bool | None = None, model: str | None = None,
               verdict: Any = None, parts: Mapping[str, Any] | None = None, claim_id: str | None = None,
               **numbers: Any) -> None:
        decided = None
        if verdict is not None:
            decided = _decision(verdict)
            holds = {"holds": True, "fails": False, "refuted": False}.get(decided["outcome"])
        entry = {"claim": claim, "id": claim_id, "model": model or EMBEDDED_MODEL, "expected": expected,
                 "measured": measured,
                 "holds": None if holds is None else bool(holds), "decision": decided,
                 "numbers": _jsonable(numbers), "test": request.node.nodeid}
        if parts:
            entry["parts"] = {str(name): _decision(v) for name, v in parts.items()}
        request.node.user_properties.append((_CLAIMS_KEY, entry))

    return record


@pytest.fixture
def rq_machine(request: pytest.FixtureRequest):
    """Attach the machine a measurement ran on (CPU, threads, BLAS, versions, float mode); the claims JSON
    records it under ``machine`` (the last one reported)."""

    def record(machine: dict[str, Any]) -> None:
        request.node.user_properties.append((_MACHINE_KEY, _jsonable(machine)))

    return record


@pytest.fixture
def rq_run(request: pytest.FixtureRequest):
    """Attach the description of the run a claim was measured in: ``{"model": {"name", "fingerprint", ...},
    "protocol": {...}, "device": {...}}`` (``rope_quant.analysis.claims_report.describe_run``). The claims JSON
    lists one per model under ``runs``, and writes its keys at the top when the session measured one model."""

    def record(about: Mapping[str, Any]) -> None:
        request.node.user_properties.append((_RUN_KEY, _jsonable(dict(about))))

    return record


@pytest.fixture
def rq_record(request: pytest.FixtureRequest):
    """Attach one row of a named measurement table (benchmarks, paired tables) to the report."""

    def record(table: str, **row: Any) -> None:
        request.node.user_properties.append((_TABLE_KEY, {"table": table, "row": _jsonable(row)}))

    return record


def _decision(verdict: Any) -> dict[str, Any]:
    """A Verdict (or its ``to_dict()``) as plain JSON."""
    return dict(_jsonable(verdict.to_dict() if hasattr(verdict, "to_dict") else verdict))


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=lambda o: float(o) if hasattr(o, "__float__") else str(o)))


# ----------------------------------------------------------------------------- reporting


class _Collector:
    """Gathers claims and table rows from test reports (works under pytest-xdist too)."""

    def __init__(self) -> None:
        self.claims: list[dict[str, Any]] = []
        self.tables: dict[str, list[dict[str, Any]]] = {}
        self.machine: dict[str, Any] | None = None
        self.runs: dict[str, dict[str, Any]] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "call" and not (report.when == "setup" and report.skipped):
            return
        outcome = "xfailed" if hasattr(report, "wasxfail") and report.skipped else report.outcome
        for key, value in report.user_properties:
            if key == _CLAIMS_KEY:
                self.claims.append({**value, "outcome": outcome})
            elif key == _TABLE_KEY:  # a row that two tests record (one measurement, two claims) is kept once
                rows = self.tables.setdefault(value["table"], [])
                if value["row"] not in rows:
                    rows.append(value["row"])
            elif key == _MACHINE_KEY:
                self.machine = value
            elif key == _RUN_KEY:  # one description per model (name and fingerprint)
                model = value.get("model") or {}
                self.runs.setdefault(json.dumps([model.get("name"), model.get("fingerprint")]), value)

    def payload(self) -> dict[str, Any]:
        """The claims JSON: schema, claims (with their verdict and budget columns), tables, machine, runs, and the
        run's keys at the top when one model was measured."""
        runs = list(self.runs.values())
        one = {k: runs[0][k] for k in RUN_KEYS if k in runs[0]} if len(runs) == 1 else {}
        return {"schema": CLAIMS_SCHEMA,
                "claims": [{**c, "verdict": verdict(c), "budget": budget(c)} for c in self.claims],
                "tables": self.tables, "machine": self.machine, **one, "runs": runs}


def verdict(claim: dict[str, Any]) -> str:
    """The verdict column: the decision rule's text (rope_quant.core.verdict) combined with the test outcome."""
    decision = claim.get("decision")
    xfail = " (xfail)" if claim["outcome"] == "xfailed" else ""
    if claim["outcome"] == "failed":
        if decision and decision["outcome"] in ("fails", "refuted"):
            return decision["text"]
        return "FAILED"
    if decision:
        return decision["text"] + xfail
    if claim["holds"] is None and not xfail:
        return "recorded (no claim)"
    return ("holds" if claim["holds"] and not xfail else "fails") + xfail


def budget(claim: dict[str, Any]) -> str:
    """The budget column: what would decide an inconclusive claim at 80% power (empty when decided)."""
    decision = claim.get("decision") or {}
    if decision.get("outcome") != "inconclusive":
        return ""
    if decision.get("stop"):  # the sequential rule's honest stop at M: its reason, not a fixed-n budget
        return decision["stop"]
    if decision.get("budget"):
        return decision["budget"]["text"]
    return decision.get("note", "")


def claims_markdown(claims: list[dict[str, Any]]) -> str:
    rows = [{**c, "verdict": verdict(c), "budget to decide": budget(c)} for c in claims]
    columns = ["claim", "model", "expected", "measured", "verdict"]
    if any(r["budget to decide"] for r in rows):
        columns.append("budget to decide")
    return markdown_table(rows, columns)


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
        atomic_write_text(directory / "claims.json", json.dumps(store.payload(), indent=2))
        atomic_write_text(directory / "claims.md", claims_markdown(claims) + "\n")
        terminalreporter.write_line(f"claims written to {directory}/claims.json and claims.md")

"""The pytest plugin itself: markers, options, gpu_e2e skips and the claims table (pytester); that it changes
nothing in another project; that the claims table survives pytest-xdist."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

CLAIMS_TESTS = '''
import pytest

def test_holds(rq_claim, rq_record):
    rq_claim("C0 (demo)", "a < b", "1.0 < 2.0", True, a=1.0, b=2.0)
    rq_record("demo table", name="x", value=3.5)
    assert 1.0 < 2.0

def test_records_the_same_row_again(rq_record):
    rq_record("demo table", name="x", value=3.5)
    rq_record("demo table", name="y", value=3.5)

@pytest.mark.xfail(reason="measured: a=3.0 >= b=2.0", strict=True)
def test_does_not_hold(rq_claim):
    rq_claim("C9 (demo)", "a < b", "3.0 < 2.0", False)
    assert 3.0 < 2.0
'''


def test_markers_are_registered(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--markers")
    for marker in ("theory", "numerics", "e2e", "gpu_e2e", "bench"):
        result.stdout.fnmatch_lines([f"@pytest.mark.{marker}:*"])


def test_gpu_e2e_skips_with_reason_without_cuda(pytester: pytest.Pytester) -> None:
    torch = pytest.importorskip("torch")
    pytester.makepyfile(
        test_rqplugin_gpu="import pytest\n@pytest.mark.gpu_e2e\ndef test_needs_gpu(rq_options):\n    assert False\n")
    result = pytester.runpytest("-rs", "--rq-device=cpu")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*gpu_e2e: --rq-device=cpu is not a CUDA device*"])
    if not torch.cuda.is_available():
        result = pytester.runpytest("-rs")
        result.assert_outcomes(skipped=1)
        result.stdout.fnmatch_lines(["*CUDA is not available*"])


def test_claims_table_printed_and_written(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_rqplugin_claims=CLAIMS_TESTS)
    out = pytester.path / "claims"
    result = pytester.runpytest(f"--rq-claims-out={out}")
    result.assert_outcomes(passed=2, xfailed=1)
    result.stdout.fnmatch_lines([
        "*rope_quant: demo table*",
        "*rope_quant claims table*",
        "*C0 (demo)*a < b*1.0 < 2.0*holds*",
        "*C9 (demo)*fails (xfail)*",
    ])
    payload = json.loads((out / "claims.json").read_text())
    verdicts = {c["claim"]: c["verdict"] for c in payload["claims"]}
    assert verdicts == {"C0 (demo)": "holds", "C9 (demo)": "fails (xfail)"}
    # the row recorded by two tests is kept once, a different row kept
    assert payload["tables"]["demo table"] == [{"name": "x", "value": 3.5}, {"name": "y", "value": 3.5}]
    assert "| C0 (demo) |" in (out / "claims.md").read_text()


def test_bad_seeds_option_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_rqplugin_x="def test_x():\n    pass\n")
    for bad in ("0,x", "", "3-1", "0,0"):
        result = pytester.runpytest(f"--rq-seeds={bad}")
        assert result.ret == pytest.ExitCode.USAGE_ERROR, bad
        result.stderr.fnmatch_lines(["*--rq-seeds: *expected comma-separated integers and inclusive ranges*"])


def test_replicates_option(pytester: pytest.Pytester) -> None:
    """``--rq-replicates K``: a whole number >= 0, or a usage error naming the option."""
    pytester.makepyfile(test_rqplugin_x="def test_x(rq_options):\n    assert rq_options.replicates == 3\n")
    pytester.runpytest("--rq-replicates=3").assert_outcomes(passed=1)
    for bad in ("x", "-1", "1.5"):
        result = pytester.runpytest(f"--rq-replicates={bad}")
        assert result.ret == pytest.ExitCode.USAGE_ERROR, bad
        result.stderr.fnmatch_lines(["*--rq-replicates: expected a whole number >= 0*"])


def test_seed_ranges_are_accepted(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_rqplugin_seeds="def test_x(rq_options):\n    assert rq_options.seeds == (0, 1, 2, 5)\n")
    pytester.runpytest("--rq-seeds=0-2,5").assert_outcomes(passed=1)


def test_until_decided_options(pytester: pytest.Pytester) -> None:
    """``--rq-until-decided`` with ``--rq-max-seeds`` (default 40), ``--rq-time-budget`` and ``--rq-futility``
    (default 0.1), parsed into rq_options; usage errors (touching nothing) for an M below the seeds given, a time
    budget of 0 or below, a futility outside [0, 1), and
    ``--rq-replicates`` 0, 1 or fewer than the seeds with ``--rq-until-decided`` (the rule cannot decide)."""
    pytester.makepyfile(test_rqplugin_x=(
        "def test_x(rq_options):\n"
        "    assert (rq_options.until_decided, rq_options.max_seeds, rq_options.time_budget, rq_options.futility) "
        "== (True, 12, 90.0, 0.0)\n"))
    pytester.runpytest("--rq-until-decided", "--rq-max-seeds=12", "--rq-time-budget=90",
                       "--rq-futility=0").assert_outcomes(passed=1)
    pytester.makepyfile(test_rqplugin_x=(
        "def test_x(rq_options):\n    assert not rq_options.until_decided and rq_options.max_seeds == 40\n"
        "    assert rq_options.futility == 0.1\n"))
    pytester.runpytest().assert_outcomes(passed=1)
    bad = [
        (["--rq-until-decided", "--rq-max-seeds=2"], "*--rq-max-seeds 2 is below the 3 seeds given*"),
        (["--rq-until-decided", "--rq-seeds=0-5", "--rq-max-seeds=4"], "*--rq-max-seeds 4 is below the 6 seeds*"),
        (["--rq-max-seeds=x"], "*--rq-max-seeds: expected a whole number >= 2*"),
        (["--rq-until-decided", "--rq-time-budget=0"], "*--rq-time-budget 0: must be a positive number*"),
        (["--rq-time-budget=-3"], "*--rq-time-budget -3: must be a positive number*"),
        (["--rq-until-decided", "--rq-futility=1"], "*--rq-futility 1: must lie in [[]0, 1)*"),
        (["--rq-futility=x"], "*--rq-futility: expected a chance in [[]0, 1)*"),
        (["--rq-until-decided", "--rq-replicates=0"], "*--rq-replicates 0: *the rule cannot decide*"),
        (["--rq-until-decided", "--rq-replicates=1"], "*--rq-replicates 1: *the rule cannot decide*"),
        (["--rq-until-decided", "--rq-replicates=2"], "*--rq-replicates 2: the sequential rule replicates every*"),
    ]
    for flags, line in bad:
        result = pytester.runpytest(*flags)
        assert result.ret == pytest.ExitCode.USAGE_ERROR, flags
        result.stderr.fnmatch_lines([line])
    assert not list(pytester.path.glob("**/claims.json"))


def test_a_stopped_claim_shows_its_reason_in_the_budget_column() -> None:
    """The sequential rule's stop at M is the claims table's last column and the JSON's ``stop``."""
    from rope_quant.claims_json import budget
    from rope_quant.core import sequential
    from rope_quant.core.verdict import Form
    from rope_quant.pytest_plugin import _decision

    v = sequential.decide(Form.NON_SUPERIOR, [0.2, -0.9, 1.1, 0.3], [0.1, -0.1, 0.0, 0.2], sequential.Plan(3, 4),
                          margin=0.154)
    claim = {"decision": _decision(v), "outcome": "passed", "holds": None}
    assert v.stop and budget(claim) == v.stop and claim["decision"]["stop"] == v.stop
    assert "open at the last look (4 seeds)" in budget(claim)


def test_plugin_module_imports_nothing_heavy() -> None:
    import subprocess
    import sys

    heavy = "('torch', 'transformers', 'numpy', 'scipy', 'sympy')"
    code = (f"import sys, rope_quant.pytest_plugin, rope_quant.core.verdict, rope_quant.core.sequential; "
            f"print(sorted(m for m in {heavy} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_test_module_basenames_are_unique() -> None:
    """pytest's default import mode imports test modules by basename (the test folders are not packages), so
    two files with one name in different layers stop the whole session at collection."""
    from collections import Counter
    from pathlib import Path

    names = Counter(p.name for p in (Path(__file__).parents[1]).rglob("test_*.py"))
    clashes = sorted(name for name, count in names.items() if count > 1)
    assert not clashes, f"test module basenames used more than once: {clashes}"


# ----------------------------------------------------------------------------- isolation from other projects

FOREIGN_CONFTEST = """
from hypothesis import settings

settings.register_profile("foreign", max_examples=7, deadline=None)
settings.load_profile("foreign")
"""

FOREIGN_TESTS = """
import pytest
from hypothesis import given, settings, strategies as st

RQ_MARKERS = ("theory", "numerics", "e2e", "gpu_e2e", "bench")
seen = []


def test_keeps_its_hypothesis_profile():
    assert settings().max_examples == 7


def test_gets_no_markers(request):
    assert [m for m in RQ_MARKERS if request.node.get_closest_marker(m)] == []
    assert [m.name for m in request.node.iter_markers()] == []


@given(st.integers())
def test_given_runs_its_own_budget(x):
    seen.append(x)


def test_budget_was_seven():
    assert len(seen) == 7


def test_fails_on_its_own():
    assert 1 == 2


@pytest.mark.skip(reason="its own skip")
def test_skips_on_its_own():
    pass
"""

_OUTCOME_LINE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|XFAIL|XPASS|ERROR)\b")


def _outcomes(result: pytest.RunResult) -> dict[str, str]:
    return {m[1]: m[2] for line in result.outlines if (m := _OUTCOME_LINE.match(line))}


def test_plugin_changes_nothing_in_another_project(pytester: pytest.Pytester, monkeypatch) -> None:
    """A foreign project with its own hypothesis profile and a ``tests/numerics`` directory: with the plugin
    loaded (as the installed ``pytest11`` entry point, in a fresh process) it keeps its profile, gets no
    markers, and every test has the outcome it has with ``-p no:rope_quant``."""
    monkeypatch.delenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    pytester.makeini("[pytest]\n")
    pytester.makeconftest(FOREIGN_CONFTEST)
    pytester.mkdir("tests")
    pytester.mkdir("tests/numerics")
    (pytester.path / "tests/numerics/test_rqforeign_layer.py").write_text(FOREIGN_TESTS)

    with_us = pytester.runpytest_subprocess("-v", "-p", "no:cacheprovider", "--rq-model=some-model")
    without_us = pytester.runpytest_subprocess("-v", "-p", "no:cacheprovider", "-p", "no:rope_quant")

    with_us.assert_outcomes(passed=4, failed=1, skipped=1)  # --rq-model accepted: the plugin is active
    assert _outcomes(with_us) == _outcomes(without_us)
    assert len(_outcomes(with_us)) == 6
    assert _outcomes(with_us)["tests/numerics/test_rqforeign_layer.py::test_fails_on_its_own"] == "FAILED"
    assert with_us.ret == without_us.ret == pytest.ExitCode.TESTS_FAILED
    # and the plugin really is the thing switched off: without it the option is unknown
    assert pytester.runpytest_subprocess("-p", "no:rope_quant", "--rq-model=x").ret == pytest.ExitCode.USAGE_ERROR


def test_this_suite_marks_layers_by_directory(request: pytest.FixtureRequest) -> None:
    """The layer marking the plugin no longer does still happens here, from the repository's conftest."""
    assert request.node.get_closest_marker("numerics") is not None
    assert request.node.get_closest_marker("theory") is None


def test_options_live_in_the_stash(pytestconfig: pytest.Config, rq_options) -> None:
    from rope_quant import pytest_plugin

    assert pytest_plugin.options(pytestconfig) is rq_options
    assert not hasattr(pytestconfig, "rq_options")


def test_write_atomic_uses_a_unique_temporary_name(tmp_path: Path) -> None:
    from rope_quant.io import atomic_write_text as _write_atomic

    stale = tmp_path / "claims.json.tmp"  # what another writer's fixed temporary name used to be
    stale.write_text("someone else's")
    _write_atomic(tmp_path / "claims.json", "one")
    _write_atomic(tmp_path / "claims.json", "two")
    assert (tmp_path / "claims.json").read_text() == "two"
    assert stale.read_text() == "someone else's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["claims.json", "claims.json.tmp"]


# ----------------------------------------------------------------------------- pytest-xdist

XDIST_CLAIMS_TESTS = CLAIMS_TESTS + '''

@pytest.mark.parametrize("i", range(6))
def test_many(rq_claim, rq_record, i):
    rq_claim(f"C{i + 1} (demo)", "i >= 0", f"i = {i}", True, i=i)
    rq_record("demo table", name=f"row{i}", value=float(i))

def test_fails(rq_claim):
    rq_claim("C7 (demo)", "1 == 2", "1 != 2", False)
    assert 1 == 2
'''


def _claims_table(directory: Path) -> dict:
    payload = json.loads((directory / "claims.json").read_text())
    payload["claims"].sort(key=lambda c: (c["claim"], c["test"]))
    for rows in payload["tables"].values():
        rows.sort(key=lambda r: json.dumps(r, sort_keys=True))
    return payload


def test_claims_table_survives_xdist(pytester: pytest.Pytester, monkeypatch) -> None:
    """The claims travel on ``report.user_properties``: ``-n 2`` gives the serial run's claims table."""
    pytest.importorskip("xdist")
    monkeypatch.delenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    pytester.makeini("[pytest]\n")
    pytester.makepyfile(test_rqplugin_xdist=XDIST_CLAIMS_TESTS)
    serial_out, xdist_out = pytester.path / "serial", pytester.path / "xdist"

    serial = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--rq-claims-out={serial_out}")
    parallel = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2", f"--rq-claims-out={xdist_out}")

    serial.assert_outcomes(passed=8, failed=1, xfailed=1)
    parallel.assert_outcomes(passed=8, failed=1, xfailed=1)
    parallel.stdout.fnmatch_lines(["*2 workers*", "*rope_quant claims table*", "*C9 (demo)*fails (xfail)*"])
    table = _claims_table(xdist_out)
    assert table == _claims_table(serial_out)
    assert len(table["claims"]) == 9
    assert {c["claim"]: c["verdict"] for c in table["claims"]}["C7 (demo)"] == "FAILED"
    assert len(table["tables"]["demo table"]) == 8  # 9 recorded: the row two tests record is kept once
    assert sorted(p.name for p in xdist_out.iterdir()) == ["claims.json", "claims.md"]


def test_measurements_without_a_claim_have_their_own_verdict(pytester: pytest.Pytester) -> None:
    """holds=None without a decision: a measurement recorded without a claim (the test itself passes); an
    undecided claim passes its Verdict instead (test_claims_table_carries_the_decision_rule_and_budget)."""
    from rope_quant.claims_json import verdict

    pytester.makepyfile(test_rqplugin_inconclusive='''
def test_undecided(rq_claim):
    rq_claim("M1 (demo)", "recorded", "whip vs random R1", None, low=-1.0, high=0.5)
''')
    out = pytester.path / "claims"
    result = pytester.runpytest(f"--rq-claims-out={out}")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*M1 (demo)*recorded (no claim)*"])
    payload = json.loads((out / "claims.json").read_text())
    assert [c["verdict"] for c in payload["claims"]] == ["recorded (no claim)"]
    assert payload["claims"][0]["holds"] is None
    base = {"claim": "c", "holds": None}
    assert verdict({**base, "outcome": "failed"}) == "FAILED"  # a failed test is never "inconclusive"
    assert verdict({**base, "holds": False, "outcome": "passed"}) == "fails"
    assert verdict({**base, "holds": True, "outcome": "passed"}) == "holds"


# ----------------------------------------------------------------------------- scope and verdicts

FOREIGN_GPU_TESTS = """
import pytest

@pytest.mark.gpu_e2e
def test_foreign_gpu_marker():
    assert True

@pytest.mark.gpu_e2e
def test_uses_our_fixture(rq_options):
    assert False
"""


def test_skip_hook_leaves_a_foreign_gpu_e2e_test_alone(pytester: pytest.Pytester) -> None:
    """A foreign project's ``gpu_e2e``-marked test runs; one that uses this plugin's fixtures is skipped."""
    pytester.makepyfile(test_rqforeign_gpu=FOREIGN_GPU_TESTS)
    result = pytester.runpytest("-rs", "-v", "--rq-device=cpu")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*test_foreign_gpu_marker PASSED*", "*not a CUDA device*"])


def test_this_suites_gpu_tests_are_ours() -> None:
    from rope_quant.pytest_plugin import SUITE_TESTS

    assert Path(__file__).resolve().is_relative_to(SUITE_TESTS)
    assert (SUITE_TESTS / "e2e" / "test_gpu_claims.py").is_file()


VERDICT_TESTS = """
from rope_quant.core.verdict import Form, decide, paired_claim

def test_open(rq_claim, rq_machine):
    rq_machine({"cpu_model": "demo cpu", "threads": 2})
    v = decide(Form.EQUIVALENT, [-1.0, 1.0, 0.2], margin=0.5, noise=0.1, tokens=6144)
    rq_claim("C2 (demo)", "equivalent", "wide", verdict=v)

def test_refuted(rq_claim):
    v = decide(Form.GREATER, [-3.0, -3.1, -2.9])
    rq_claim("C1 (demo)", "greater", "below", verdict=v)
    assert not v.failed

def test_one_seed(rq_claim):
    rq_claim("C3 (demo)", "less", "one seed", verdict=decide(Form.LESS, [-1.0]))

def test_replicated(rq_claim):
    v = paired_claim(Form.GREATER, [3.0, 3.1, 2.9], [0.0, 0.0, 0.0], replicates={0: (3.1, 0.0), 1: (3.0, 0.0)})
    rq_claim("C7 (demo)", "greater", "replicated", verdict=v)
    w = paired_claim(Form.GREATER, [3.0, 3.1, 2.9], [0.0, 0.0, 0.0], replicates="seed 0: OOM")
    rq_claim("C8 (demo)", "greater", "replicate failed", verdict=w)
    rq_claim("C9 (demo)", "both", "parts", verdict=w, parts={"L=1": v, "L=2": w})
"""


def test_claims_table_carries_the_decision_rule_and_budget(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_rqplugin_verdicts=VERDICT_TESTS)
    out = pytester.path / "claims"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--rq-claims-out={out}")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(["*budget to decide*", "*C2 (demo)*inconclusive*seeds at today's tokens*"])
    payload = json.loads((out / "claims.json").read_text())
    by = {c["claim"]: c for c in payload["claims"]}
    assert by["C1 (demo)"]["verdict"] == "refuted" and by["C1 (demo)"]["holds"] is False
    assert by["C2 (demo)"]["decision"]["budget"]["seeds"] > 3 and by["C2 (demo)"]["holds"] is None
    assert "tokens/cell at today's seeds" in by["C2 (demo)"]["budget"]
    assert by["C3 (demo)"]["verdict"] == "inconclusive: needs ≥ 2 seeds for an interval"
    assert payload["machine"] == {"cpu_model": "demo cpu", "threads": 2}
    from rope_quant.core.verdict import RULE_REPLICATES

    assert payload["schema"] == 2
    c7 = by["C7 (demo)"]["decision"]
    assert by["C7 (demo)"]["verdict"] == "holds" and c7["rule"] == RULE_REPLICATES
    assert c7["float_order"]["k"] == 2 and c7["float_order"]["bias"] == pytest.approx(0.0, abs=1e-12)
    assert by["C8 (demo)"]["verdict"].startswith("inconclusive: float-order replicate: seed 0: OOM")
    assert "parts" not in by["C8 (demo)"]
    assert {k: p["outcome"] for k, p in by["C9 (demo)"]["parts"].items()} == {"L=1": "holds", "L=2": "inconclusive"}
    assert by["C9 (demo)"]["parts"]["L=1"]["mean"] == pytest.approx(3.0)

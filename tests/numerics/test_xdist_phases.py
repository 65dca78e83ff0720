"""The README's ``pytest -n 2`` schedule (tests/_support/xdist_phases.py), on a small project run under xdist:
the e2e unit on one worker with nothing beside it, then the other modules on every worker at one torch thread."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("xdist")

ROOT = Path(__file__).resolve().parents[2]

_TEST = '''
import json, os, time, torch
def _log(name):
    start = time.time()
    time.sleep(0.4)
    with open(os.environ["PHASES_LOG"], "a") as f:
        f.write(json.dumps({{"worker": os.environ["PYTEST_XDIST_WORKER"], "test": name, "start": start,
                            "end": time.time(), "threads": torch.get_num_threads(),
                            "omp": os.environ.get("OMP_NUM_THREADS")}}) + "\\n")
{tests}
'''


def _module(prefix: str, n: int) -> str:
    return _TEST.format(tests="\n".join(f"def test_{prefix}{i}():\n    _log('{prefix}{i}')\n" for i in range(n)))


def test_the_e2e_unit_runs_alone_then_every_worker_takes_modules(pytester: pytest.Pytester, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "phases.jsonl"
    monkeypatch.setenv("PHASES_LOG", str(log))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    pytester.makeconftest('''
from tests._support.xdist_phases import PhasedScheduling, set_threads
def pytest_xdist_make_scheduler(config, log):
    return PhasedScheduling(config, log)
def pytest_runtest_setup(item):
    set_threads(item.nodeid)
''')
    pytester.mkdir("tests")
    for layer, modules in (("e2e", {"test_claims": 3, "test_more": 2}), ("numerics", {"test_a": 2, "test_b": 2}),
                           ("theory", {"test_c": 2})):
        (pytester.path / "tests" / layer).mkdir()
        for name, n in modules.items():
            (pytester.path / "tests" / layer / f"{name}.py").write_text(_module(f"{layer}_{name}_", n))
    result = pytester.runpytest_subprocess("-n", "2", "-p", "xdist", "-p", "no:cacheprovider", "tests")
    result.assert_outcomes(passed=11)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    first = [r for r in rows if r["test"].startswith("e2e")]
    rest = [r for r in rows if not r["test"].startswith("e2e")]
    assert len(first) == 5 and len({r["worker"] for r in first}) == 1, first
    assert min(r["start"] for r in rest) >= max(r["end"] for r in first), "a module ran beside the e2e unit"
    assert {r["worker"] for r in rest} == {"gw0", "gw1"}, "a held worker was never released"
    assert all(r["threads"] == 2 and r["omp"] == "2" for r in first), first
    assert all(r["threads"] == 1 and r["omp"] == "1" for r in rest), rest

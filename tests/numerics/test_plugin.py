"""The pytest plugin itself: markers, options, gpu_e2e skips and the claims table (pytester)."""

from __future__ import annotations

import json

import pytest

CLAIMS_TESTS = '''
import pytest

def test_holds(rq_claim, rq_record):
    rq_claim("C0 (demo)", "a < b", "1.0 < 2.0", True, a=1.0, b=2.0)
    rq_record("demo table", name="x", value=3.5)
    assert 1.0 < 2.0

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
        test_rqplugin_gpu="import pytest\n@pytest.mark.gpu_e2e\ndef test_needs_gpu():\n    assert False\n")
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
    result.assert_outcomes(passed=1, xfailed=1)
    result.stdout.fnmatch_lines([
        "*rope_quant: demo table*",
        "*rope_quant claims table*",
        "*C0 (demo)*a < b*1.0 < 2.0*holds*",
        "*C9 (demo)*does not hold (xfail)*",
    ])
    payload = json.loads((out / "claims.json").read_text())
    verdicts = {c["claim"]: c["verdict"] for c in payload["claims"]}
    assert verdicts == {"C0 (demo)": "holds", "C9 (demo)": "does not hold (xfail)"}
    assert payload["tables"]["demo table"] == [{"name": "x", "value": 3.5}]
    assert "| C0 (demo) |" in (out / "claims.md").read_text()


def test_bad_seeds_option_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_rqplugin_x="def test_x():\n    pass\n")
    result = pytester.runpytest("--rq-seeds=0,x")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--rq-seeds expects comma-separated integers*"])


def test_plugin_module_imports_nothing_heavy() -> None:
    import subprocess
    import sys

    heavy = "('torch', 'transformers', 'numpy', 'scipy', 'sympy')"
    code = f"import sys, rope_quant.pytest_plugin; print(sorted(m for m in {heavy} if m in sys.modules))"
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

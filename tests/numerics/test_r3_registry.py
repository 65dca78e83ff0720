"""The open R3 registry: ``transforms.register``, the ``rope_quant.r3`` entry-point
group, name clashes, and a foreign (fitted) transform run end to end through ``rope_quant.cli.main``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest

from rope_quant.core import transforms as T
from tests._support.reliability import save_tiny_model

ROOT = Path(__file__).resolve().parents[2]

FOREIGN = '''
"""A throwaway package that adds two R3 transforms to rope_quant through the entry-point group."""
import numpy as np
from rope_quant.core import transforms as T


def _fit(ctx):
    # one angle per layer: π/8 · (layer + 1) in every pair (a stand-in for a real fit)
    return [{"angles": np.full(ctx.head_dim // 2, np.pi / 8 * (layer + 1))} for layer in range(ctx.n_layers)]


def _make(d, angles=None, layout="rotate_half"):
    t = T.Pairwise(d, np.zeros(d // 2) if angles is None else angles, layout)
    t.name = "foreign_eighth"
    return t


SPEC = T.TransformSpec("foreign_eighth", _make, True, "M = ⊕_k G(π(l+1)/8)", ("angles",), needs_fit=True,
                       fit=_fit, doc="a foreign fitted pair rotation")
CLASH = T.TransformSpec("hadamard", lambda d, layout="rotate_half": T.Identity(d, layout), True, "M = I")


def broken():
    raise RuntimeError("this plugin is broken")
'''


def write_foreign_package(root: Path, clash: bool = False, broken: bool = False) -> Path:
    """``rq_foreign`` + ``rq_foreign-0.1.dist-info`` (METADATA, entry_points.txt) under ``root``."""
    (root / "rq_foreign").mkdir(parents=True, exist_ok=True)
    (root / "rq_foreign" / "__init__.py").write_text(FOREIGN)
    dist = root / "rq_foreign-0.1.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: rq-foreign\nVersion: 0.1\n")
    lines = ["[rope_quant.r3]", "foreign_eighth = rq_foreign:SPEC"]
    lines += ["hadamard_clash = rq_foreign:CLASH"] if clash else []
    lines += ["broken = rq_foreign:broken"] if broken else []
    (dist / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return root


# ----------------------------------------------------------------------------- register()


def _spec(name: str) -> T.TransformSpec:
    return T.TransformSpec(name, lambda d, layout="rotate_half": T.Identity(d, layout), True, "M = I",
                           source="tests")


def test_register_adds_a_name_everywhere_and_refuses_a_clash() -> None:
    T.register(_spec("test_identity_copy"))
    try:
        assert "test_identity_copy" in T.names()
        assert T.commutes_with_rope("test_identity_copy") is True
        assert not T.needs_angles("test_identity_copy") and not T.needs_fit("test_identity_copy")
        assert T.build("test_identity_copy", 8).matrix().shape == (8, 8)
        with pytest.raises(T.TransformNameClashError, match="'test_identity_copy' is already registered"):
            T.register(_spec("test_identity_copy"))
        with pytest.raises(T.TransformNameClashError, match="'hadamard' is already registered.*rope_quant"):
            T.register(_spec("hadamard"))
    finally:
        T.unregister("test_identity_copy")
    assert "test_identity_copy" not in T.names()
    with pytest.raises(T.TransformNameClashError, match="built in"):
        T.unregister("hadamard")


def test_unknown_names_get_the_closest_ones() -> None:
    with pytest.raises(T.UnknownTransformError, match="did you mean 'hadamard'"):
        T.build("hadamrd", 16)
    assert T.closest_names("pairwise_scale")[0] == "pairwise_scaled"


def test_a_spec_is_checked_when_declared() -> None:
    ident = lambda d, layout="rotate_half": T.Identity(d, layout)  # noqa: E731
    with pytest.raises(T.TransformParamError, match="identifier"):
        T.TransformSpec("bad name", ident, True, "M = I")
    with pytest.raises(T.TransformParamError, match="commutes_with_rope"):
        T.TransformSpec("x", ident, "yes", "M = I")
    with pytest.raises(T.TransformParamError, match="required"):
        T.TransformSpec("x", ident, True, "M = I", params=(), required=("angles",))
    with pytest.raises(T.TransformParamError, match="TransformSpec"):
        T.register("hadamard")


def test_entry_points_load_once_skip_clashes_and_broken_plugins(tmp_path: Path, monkeypatch) -> None:
    write_foreign_package(tmp_path, clash=True, broken=True)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            added = T.load_entry_points(force=True)
        assert added == ["foreign_eighth"]
        messages = [str(w.message) for w in seen if issubclass(w.category, T.RegistryWarning)]
        assert any("refusing R3 'hadamard'" in m and "hadamard_clash" in m for m in messages), messages
        assert any("'broken'" in m and "this plugin is broken" in m for m in messages), messages
        assert isinstance(T.build("hadamard", 16), T.FullHadamard)  # the built-in kept its meaning
        assert T.spec("foreign_eighth").source == "rq_foreign:SPEC" and T.needs_fit("foreign_eighth")
        assert T.load_entry_points() == []  # loaded once
    finally:
        if "foreign_eighth" in T.names():
            T.unregister("foreign_eighth")
        sys.modules.pop("rq_foreign", None)


# ----------------------------------------------------------------------------- end to end through the CLI




def test_a_foreign_fitted_transform_runs_compare_and_the_report(tmp_path: Path) -> None:
    """A package outside this repository, found only through its entry point, runs a sweep cell end to end
    (fit, online R3, record, paired report with its declared commutation) with no change to rope_quant."""
    model = save_tiny_model(tmp_path / "model")
    write_foreign_package(tmp_path / "plugin")
    out = tmp_path / "out"
    argv = ["compare", "--model", str(model), "--configs", "hadamard,foreign_eighth", "--out", str(out),
            "--seeds", "0,1", "--seqlen", "64", "--calib-windows", "2", "--eval-windows", "2", "--weights", "rtn",
            "--no-w-mse", "--no-figures", "--k-bits", "4"]
    code = textwrap.dedent(f"""
        import sys
        from rope_quant.cli import main
        sys.exit(main({argv!r}))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "plugin"), str(ROOT)]),
           "OMP_NUM_THREADS": "1", "ROPE_QUANT_CACHE_DIR": str(tmp_path / "corpus-cache")}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    ppl = summary["configs"]["foreign_eighth"]["ppl"]
    assert len(ppl) == 2 and all(np.isfinite(ppl))
    assert summary["paired"]["foreign_eighth"]["n"] == 2
    record = json.loads(next((out / "cells" / "foreign_eighth").glob("seed0-*.json")).read_text())
    assert record["config"]["online"]["transform"] == "foreign_eighth"
    assert "foreign_eighth" in run.stdout
    # without the plugin on the path the name is unknown, refused before any model loads
    env["PYTHONPATH"] = str(ROOT)
    bad = subprocess.run([sys.executable, "-c", code.replace(str(out), str(tmp_path / "out2"))], env=env,
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "foreign_eighth" in bad.stderr
    assert not (tmp_path / "out2" / "cells").exists()

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


# ----------------------------------------------------------------------------- foldability, declared by the spec


def test_each_builtin_declares_what_folds_and_what_stays_online():
    split = {n: T.foldability(n, 16, block=4) for n in T.names() if not n.startswith("foreign")}
    assert split["identity"] == T.Foldability(None, None)
    assert split["hadamard"] == T.Foldability(None, "hadamard")
    assert split["pairwise_plus_hadamard"] == T.Foldability("pairwise_only", "hadamard", T.INTO_PROJECTIONS)
    assert split["pairwise_plus_hadamard"].online_is_hadamard and not split["pairwise_only"].online_is_hadamard
    assert split["pairwise_only"] == T.Foldability("pairwise_only", None, T.INTO_PROJECTIONS)
    for scaled in ("pairwise_scaled", "prerope_channel_scale"):  # the scales go into the q/k norms
        assert split[scaled] == T.Foldability(scaled, None, T.INTO_PROJECTIONS_AND_NORMS)
    assert split["learned_orthogonal"] == T.Foldability(None, "learned_orthogonal")
    # a parameter-dependent entry: b = 2 stays inside the RoPE pairs (folds), b = 4 mixes pairs (online)
    assert T.foldability("block_hadamard", 16, block=2).folds and not split["block_hadamard"].folds
    assert split["block_hadamard"] == T.Foldability(None, "block_hadamard")


def test_the_fold_factor_of_pairwise_plus_hadamard_is_its_pairwise_part():
    angles = np.linspace(0.1, 0.8, 8)
    ph = T.build("pairwise_plus_hadamard", 16, angles=angles)
    part = T.fold_factor(ph)
    assert part is not None and part.name == "pairwise_only"
    np.testing.assert_array_equal(part.matrix(0, 1), T.build("pairwise_only", 16, angles=angles).matrix(0, 1))
    assert T.fold_factor(T.build("identity", 16)) is None and T.fold_factor(T.build("hadamard", 16)) is None
    scaled = T.build("pairwise_scaled", 16, angles=angles, scales=np.linspace(0.5, 2.0, 8))
    assert T.fold_factor(scaled) is scaled


def test_a_foreign_declaration_is_what_the_export_reads():
    from rope_quant.export.fold import r3_split

    spec = T.TransformSpec("foreign_split", lambda d, angles, layout="rotate_half": T.PairwisePlusHadamard(
        d, angles, layout), False, "M = H·P", ("angles",), ("angles",),
        folding=T.Foldability("pairwise_only", "hadamard", T.INTO_PROJECTIONS), source="tests")
    T.register(spec)
    try:
        assert r3_split("foreign_split", 16) == (True, "hadamard")
        assert r3_split("pairwise_plus_hadamard", 16) == (True, "hadamard")
        assert r3_split("learned_orthogonal", 16) == (False, "learned_orthogonal")
    finally:
        T.unregister("foreign_split")
    with pytest.raises(T.TransformParamError, match="folding must be a Foldability"):
        T.TransformSpec("bad_folding", spec.factory, True, "M", folding=("pairwise_only", None))  # type: ignore


def test_builtin_fits_are_named_on_their_specs():
    from rope_quant.calib import foldable

    for name in ("pairwise_scaled", "prerope_channel_scale", "learned_orthogonal"):
        assert T.fit_function(name) is getattr(foldable, f"fit_{name}")
    assert not hasattr(foldable, "FITS")
    with pytest.raises(T.TransformParamError, match="module:function"):
        T.TransformSpec("bad_fit", lambda d, layout="rotate_half": T.Identity(d, layout), True, "M", fit="nothing")


def test_no_r3_name_is_compared_outside_the_registry():
    """What folds and what stays online is read from the registry, never from an R3 name. ``identity`` and
    ``hadamard`` are also R1/R2 names (``RotationKind``): for those, only R3-side operands count."""
    import re

    package = Path(T.__file__).resolve().parents[2]
    own = "|".join(re.escape(n) for n in T.names() if n not in ("identity", "hadamard") and not n.startswith("foreign"))
    shared = r'(transform|r3|online|rest|split|\.name)\w*\s*(==|!=)\s*"(identity|hadamard)"'
    pattern = re.compile(rf'(==|!=)\s*"({own})"|"({own})"\s*(==|!=)|{shared}')
    found = [f"{p.relative_to(package)}:{i}" for p in package.rglob("*.py") if "transforms" not in p.parts
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, found
    assert pattern.search('if name == "pairwise_plus_hadamard":')  # the scan can fail
    assert pattern.search('if rest is not None and rest != "hadamard":')
    assert not pattern.search('if cfg.r1 != "identity":')

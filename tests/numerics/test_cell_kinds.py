"""Cell kinds are registered objects: every built-in kind round-trips through the manifest by
its tag, a kind from outside the package runs through the manifest, the runner and the cell function with no
change here, and nothing in ``sweep/`` or the CLI tells kinds apart by type-sniffing or loads them by importlib."""

from __future__ import annotations

import ast
import dataclasses
import json
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

import rope_quant
from rope_quant.experiment.config import RunConfig, StaticScope
from rope_quant.scoring.niah import NiahSpec
from rope_quant.sweep import cellkind, records
from rope_quant.sweep.cellkind import CellKind, CellKindName, SweepError, WrapsRun, config_dict, kind_of, register
from rope_quant.sweep.lm_eval import lm_eval_manifest
from rope_quant.sweep.manifest import (
    LongContextConfig,
    Manifest,
    build_manifest,
    load_manifest,
    reconcile,
    study_diff,
    write_manifest,
)
from rope_quant.sweep.niah import niah_manifest
from rope_quant.sweep.runner import run_cells
from rope_quant.sweep.static import static_manifest

BASE = RunConfig().override(eval_windows=2, seqlen=64)
SPEC = NiahSpec(lengths=(128, 256), depths=(0.0, 0.5), probes=2)


def _manifests() -> dict[str, Manifest]:
    return {
        CellKindName.RUN: build_manifest(BASE, {"hadamard": {"r3": "hadamard"}, "identity": {"r3": "identity"}},
                                         [0, 1], study="compare"),
        CellKindName.LONG_CONTEXT: Manifest([(n, LongContextConfig(BASE.override(seed=s, r3=n), (64, 128), eval_docs=4))
                                             for s in (0, 1) for n in ("hadamard", "identity")], study="long-context"),
        CellKindName.LM_EVAL: lm_eval_manifest(BASE, ["hadamard", "identity"], [0, 1], ["t1", "t2"], limit=3),
        CellKindName.NIAH: niah_manifest(BASE, ["hadamard"], [0, 1], SPEC),
        CellKindName.STATIC: static_manifest(BASE, ["hadamard", "pairwise_only"], [0], [64, 128],
                                             [None, StaticScope.BOTH], max_windows=2),
    }


@pytest.mark.parametrize("name", list(CellKindName))
def test_builtin_kinds_round_trip_through_the_manifest(name: CellKindName, tmp_path: Path) -> None:
    manifest = _manifests()[name]
    assert {kind_of(cfg).name for _, cfg in manifest} == {name.value}
    write_manifest(tmp_path, manifest)
    on_disk = json.loads((tmp_path / "manifest.json").read_text())
    again = load_manifest(tmp_path)
    assert [(n, type(c), c.key(), c) for n, c in again] == [(n, type(c), c.key(), c) for n, c in manifest]
    assert again.to_dict() == on_disk
    for entry in on_disk["cells"]:
        assert cellkind.kind_for_dict(entry["config"]).name == name.value


def test_the_registry_names_every_builtin_kind() -> None:
    import rope_quant.sweep.kinds.builtin  # noqa: F401

    assert set(cellkind.registered()) >= {k.value for k in CellKindName}
    assert cellkind.kind_named("niah").tag == "niah"
    with pytest.raises(SweepError, match="unknown cell kind 'nope'; registered: run"):
        cellkind.kind_named("nope")


@pytest.mark.parametrize("name", [CellKindName.LM_EVAL, CellKindName.NIAH])
def test_more_seeds_are_the_same_study(name: CellKindName) -> None:
    """The settings of a wrapping kind leave the run's seed out (before the kinds, an lm-eval or NIAH results
    directory refused more seeds as 'a different study')."""
    small = _manifests()[name]
    seeds = small.seeds()
    more = (lm_eval_manifest(BASE, ["hadamard", "identity"], [*seeds, 7], ["t1", "t2"], limit=3)
            if name == CellKindName.LM_EVAL else niah_manifest(BASE, ["hadamard"], [*seeds, 7], SPEC))
    assert study_diff(small, more) == []
    changed = (lm_eval_manifest(BASE, ["hadamard", "identity"], seeds, ["t1", "t2"], limit=4)
               if name == CellKindName.LM_EVAL else niah_manifest(BASE, ["hadamard"], seeds,
                                                                   dataclasses.replace(SPEC, probes=3)))
    assert study_diff(small, changed)  # a changed setting of the kind is still a different study


# ----------------------------------------------------------------------------- a kind from outside


@dataclasses.dataclass(frozen=True)
class EchoConfig(WrapsRun):
    """A foreign kind: the run scored by a constant (no model)."""

    run: Any
    value: float

    def key(self) -> str:
        return self._hash({"echo": self.value})

    def to_dict(self) -> dict[str, Any]:
        return {"run": config_dict(self.run), "echo": {"value": self.value}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EchoConfig:
        return cls(RunConfig.from_dict(dict(data["run"])), float(data["echo"]["value"]))


def _echo_evaluate(cfg: EchoConfig, ctx: cellkind.CellContext) -> dict[str, Any]:
    return {"echo": {"score": cfg.value + cfg.seed}}


@pytest.fixture
def echo_kind() -> Iterator[CellKind]:
    kind = register(CellKind("echo", EchoConfig, tag="echo", from_dict=EchoConfig.from_dict,
                             extra_settings=lambda cfg: {"echo": cfg.value}, evaluate=_echo_evaluate,
                             scored=lambda result: isinstance((result.get("echo") or {}).get("score"), float)))
    yield kind
    cellkind.unregister("echo")


def test_a_foreign_kind_runs_through_manifest_runner_and_cell_function(tmp_path: Path, echo_kind: CellKind) -> None:
    from rope_quant.sweep.cells import pipeline_cell_fn

    manifest = Manifest([(f"echo{v}", EchoConfig(BASE.override(seed=s), v)) for s in (0, 1) for v in (1.0, 2.0)],
                        study="echo")
    write_manifest(tmp_path, manifest)
    assert [c for _, c in load_manifest(tmp_path)] == [c for _, c in manifest]
    fn = pipeline_cell_fn(models=object())  # the echo kind never asks the context for a model
    run_cells(manifest, tmp_path, cell_fn=fn)
    st = records.status(tmp_path)
    assert st.done and len(st.complete) == 4  # the kind's own `scored` makes its records complete
    rec = records.read_record(records.cell_path(tmp_path, "echo2.0", manifest.cells[3][1]))
    assert rec["result"]["echo"]["score"] == 3.0
    changed = Manifest([("echo1.0", EchoConfig(BASE.override(seed=0), 1.0))], study="echo")
    assert reconcile(tmp_path, changed).added == 0
    assert study_diff(manifest, Manifest([("echo1.0", EchoConfig(BASE.override(seed=0, k_bits=3), 1.0))],
                                         study="echo"))


def test_a_record_is_complete_by_its_own_kind(echo_kind: CellKind) -> None:
    """The records ask the record's kind: a score another kind would accept does not complete an echo cell, and
    an lm-eval cell with only a perplexity is not scored; a record without a config falls back to any kind."""
    echo = EchoConfig(BASE, 1.0)
    key = echo.key()
    record = {"key": key, "config": config_dict(echo), "result": {"ppl": 3.0}}
    assert records.kind_of_record(record) is echo_kind
    assert not records.record_is_complete(record, key)  # a finite ppl is a plain run's score, not an echo's
    assert records.record_is_complete({**record, "result": {"echo": {"score": 2.0}}}, key)
    lm = {"key": "k", "config": {"run": config_dict(BASE), "lm_eval": {"tasks": ["x"]}}, "result": {"ppl": 3.0}}
    assert records.kind_of_record(lm).name == "lm-eval" and not records.record_is_complete(lm, "k")
    assert records.record_is_complete({"key": "k", "result": {"echo": {"score": 2.0}}}, "k")  # no config


def test_a_kind_names_its_report() -> None:
    from rope_quant.analysis import kind_reports, niah_report, static_report

    assert kind_reports.report_hook("niah") is niah_report.kind_report
    assert kind_reports.report_hook("static") is static_report.kind_report
    assert kind_reports.report_hook("long-context") is None and kind_reports.report_hook("run") is None
    with pytest.raises(SweepError, match="report must be a 'module:function' reference"):
        register(CellKind("bad-report", tag="bad_report", report="no_colon"))


def test_register_refuses_a_taken_name_type_or_tag(echo_kind: CellKind) -> None:
    with pytest.raises(SweepError, match="name 'echo', config type EchoConfig, tag 'echo' already registered"):
        register(echo_kind)
    with pytest.raises(SweepError, match="needs a tag"):
        register(CellKind("tagless", type("Tagless", (), {})))
    assert "tagless" not in cellkind.registered()


def test_an_unregistered_config_is_a_plain_run() -> None:
    assert kind_of(BASE) is cellkind.RUN
    assert cellkind.run_of(BASE) is BASE
    assert cellkind.run_of(LongContextConfig(BASE, (64,))) is BASE


# ----------------------------------------------------------------------------- no type-sniffing, no importlib

ROOT = Path(rope_quant.__file__).parent
KIND_TYPES = {"LongContextConfig", "LmEvalConfig", "NiahConfig", "StaticConfig", "WrapsRun", "_WrapsRun"}
KIND_ATTRS = {"static_fields", "lengths", "tasks", "spec", "run"}


def _sources() -> list[Path]:
    cli = [ROOT / "cli.py"] if (ROOT / "cli.py").is_file() else sorted((ROOT / "cli").rglob("*.py"))
    return sorted((ROOT / "sweep").rglob("*.py")) + cli


def _sniffing(source: str, label: str) -> list[str]:
    """isinstance checks against a kind's config type, hasattr checks of a kind's fields, importlib imports."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) == 2:
            what = ast.unparse(node.args[1])
            if node.func.id == "isinstance" and any(t in what for t in KIND_TYPES):
                found.append(f"{label}:{node.lineno}: {ast.unparse(node)}")
            if node.func.id == "hasattr" and what.strip("'\"") in KIND_ATTRS:
                found.append(f"{label}:{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            if any(n.split(".")[0] == "importlib" and not n.startswith("importlib.metadata") for n in names):
                found.append(f"{label}:{node.lineno}: imports importlib")  # entry points (metadata) are fine
    return found


def test_no_type_sniffing_on_cell_kinds_and_no_importlib() -> None:
    found = [f for path in _sources() for f in _sniffing(path.read_text(), str(path.relative_to(ROOT)))
             if "importlib" not in f or path.parent.name in ("sweep", "kinds")]
    assert not found, "\n".join(found)


def test_the_sniffing_check_can_fail() -> None:
    planted = ("from importlib.metadata import entry_points\nimport importlib\n"
               "if isinstance(cfg, LongContextConfig) or hasattr(cfg, 'static_fields'):\n"
               "    pass\nif isinstance(x, Mapping) or hasattr(cfg, 'to_dict'):\n    pass\n")
    assert [f.split(": ", 1)[1] for f in _sniffing(planted, "x")] == [
        "imports importlib", "isinstance(cfg, LongContextConfig)", "hasattr(cfg, 'static_fields')"]


# ----------------------------------------------------------------------------- each kind's report


def _fake_static(cfg) -> dict:
    from rope_quant.sweep.static import scope_name

    ppl = {"hadamard": 10.0, "pairwise_only": 11.0}[cfg.run.r3] + {"dynamic": 0.0, "both": 1.0}[
        scope_name(cfg.scope)] + 0.1 * cfg.seed + (0.02 * cfg.seed if cfg.run.r3 == "pairwise_only" else 0.0)
    return {"lengths": {str(L): {"ppl": ppl + L / 1000, "n_windows": 1} for L in cfg.lengths},
            "static": {"transductive": cfg.scope is not None, "deviations": []}}


def test_each_kind_in_a_results_directory_writes_its_report(tmp_path: Path) -> None:
    from rope_quant.analysis import kind_reports
    from rope_quant.analysis.static_report import write_static_report

    out = tmp_path / "static"
    manifest = static_manifest(BASE, ["hadamard", "pairwise_only"], [0, 1, 2], [64, 128], [None, StaticScope.BOTH],
                               max_windows=2)
    run_cells(manifest, out, cell_fn=_fake_static)
    assert kind_reports.kinds_in(out) == ["static"]
    (part,) = kind_reports.write_kind_reports(out, kind_reports.ReportOptions(level=0.8))
    assert part.kind == "static" and "Static per-channel control (A.6)" in part.markdown
    assert part.markdown == write_static_report(out, level=0.8) == (out / "static.md").read_text()
    plain = tmp_path / "plain"
    run_cells(_manifests()[CellKindName.RUN], plain, cell_fn=lambda cfg: {"ppl": 10.0 + cfg.seed})
    assert kind_reports.kinds_in(plain) == ["run"] and kind_reports.write_kind_reports(plain) == []


def test_a_foreign_kind_registers_its_report(tmp_path: Path, echo_kind: CellKind) -> None:
    from rope_quant.analysis import kind_reports

    manifest = Manifest([("echo1.0", EchoConfig(BASE.override(seed=s), 1.0)) for s in (0, 1)], study="echo")
    run_cells(manifest, tmp_path, cell_fn=lambda cfg: _echo_evaluate(cfg, None))
    kind_reports.register_report("echo", lambda root, opts: kind_reports.KindReport(
        "echo", f"{len(records.complete_records(root))} echoes at level {opts.level}"))
    try:
        with pytest.raises(SweepError, match="already has a report"):
            kind_reports.register_report("echo", lambda root, opts: None)
        (part,) = kind_reports.write_kind_reports(tmp_path, kind_reports.ReportOptions(level=0.5))
        assert part.markdown == "2 echoes at level 0.5"
    finally:
        kind_reports.unregister_report("echo")


# ----------------------------------------------------------------------------- a kind from an installed package

PLUGIN = '''
from dataclasses import dataclass
from typing import Any

from rope_quant.experiment.config import RunConfig
from rope_quant.sweep.cellkind import CellKind, WrapsRun, config_dict


@dataclass(frozen=True)
class TwiceConfig(WrapsRun):
    run: Any

    def key(self):
        return self._hash({"twice": True})

    def to_dict(self):
        return {"run": config_dict(self.run), "twice": True}

    @classmethod
    def from_dict(cls, data):
        return cls(RunConfig.from_dict(dict(data["run"])))


KIND = CellKind("twice", TwiceConfig, tag="twice", from_dict=TwiceConfig.from_dict,
                evaluate=lambda cfg, ctx: {"ppl": 2.0 * (1 + cfg.seed)})
'''


def test_an_installed_package_declares_a_kind_by_entry_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A throwaway distribution on sys.path (module + dist-info with an entry point): its kind is registered,
    its cells rebuild from manifest.json and run through the runner; a broken entry point only warns."""
    from rope_quant.sweep.kinds import builtin

    (tmp_path / "twice_kind.py").write_text(PLUGIN)
    info = tmp_path / "twice_kind-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: twice-kind\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        f"[{builtin.ENTRY_POINT_GROUP}]\ntwice = twice_kind:KIND\nbroken = twice_kind:NOPE\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.warns(UserWarning, match="'broken' .*not loaded"):
            assert builtin.load_entry_points() == ["twice"]
        import twice_kind

        cfg = twice_kind.TwiceConfig(BASE.override(seed=1))
        assert kind_of(cfg).name == "twice"
        out = tmp_path / "res"
        run_cells(Manifest([("twice", cfg)], study="twice"), out, cell_fn=lambda c: kind_of(c).evaluate(c, None))
        (again,) = [c for _, c in load_manifest(out)]
        assert again == cfg and records.status(out).done
        assert records.read_record(records.cell_path(out, "twice", cfg))["result"]["ppl"] == 4.0
        with pytest.warns(UserWarning, match="'broken'"):
            assert builtin.load_entry_points() == ["twice"]  # loading again registers nothing twice
    finally:
        cellkind.unregister("twice")
        sys.modules.pop("twice_kind", None)

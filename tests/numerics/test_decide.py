"""``rope-quant decide``: the sequential loop over a results directory (rope_quant.sweep.decide), on fake cells.

A fake config with a GPTQ float mode stands for ``RunConfig``; its cell function draws a perplexity from the seed,
the config's effect and the float mode, so the loop is exercised end to end (manifest growth, replicates,
resume, the stop at M) in milliseconds. The CLI's bad inputs run through ``rope-quant`` in a subprocess on a real
``RunConfig`` manifest (they exit 2 before any model is read).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rope_quant.sweep import decide
from rope_quant.sweep.manifest import MANIFEST_FILE, build_manifest, read_manifest
from rope_quant.sweep.records import complete_records

EFFECT = {"hadamard": 0.0, "worse": 3.0, "same": 0.0}


@dataclasses.dataclass(frozen=True)
class GPTQCell:
    model: str = "fake-model"
    seed: int = 0
    r3: str = "hadamard"
    float64: bool = False
    w_bits: int = 4  # GPTQ weights at 4 bits: the one replicate rule rebuilds the cell in the other float mode
    weights: str = "gptq"

    def key(self) -> str:
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:16]

    def weight_key(self) -> str:
        return f"{self.model}-s{self.seed}-{self.float64}"


def replicate(cfg: GPTQCell) -> GPTQCell:
    return dataclasses.replace(cfg, float64=not cfg.float64)


class Cells:
    """The fake cell function; counts its calls per (name-less) config."""

    def __init__(self, interrupt_after: int | None = None) -> None:
        self.calls: list[GPTQCell] = []
        self.interrupt_after = interrupt_after

    def __call__(self, cfg: GPTQCell) -> dict:
        if self.interrupt_after is not None and len(self.calls) >= self.interrupt_after:
            raise KeyboardInterrupt  # a kill: the runner leaves no record for this cell
        self.calls.append(cfg)
        rng = np.random.default_rng([cfg.seed, int(cfg.float64), len(cfg.r3)])
        seed_effect = np.random.default_rng(cfg.seed).normal(0, 1.0)  # shared by every config of the seed
        return {"ppl": 20.0 + seed_effect + EFFECT[cfg.r3] + rng.normal(0, 0.3), "n_tokens": 512}


def make_dir(tmp_path: Path, names=("hadamard", "worse", "same"), seeds=(0, 1, 2)) -> tuple[Path, object]:
    from rope_quant.sweep.runner import run_cells

    manifest = build_manifest(GPTQCell(), {n: {"r3": n} for n in names}, seeds, study="compare")
    out = tmp_path / "res"
    run_cells(manifest, out, cell_fn=Cells(), log=None)
    return out, manifest


def test_adds_seeds_only_for_open_claims_and_stops_at_m_with_the_reason(tmp_path: Path) -> None:
    """A clear effect (+3 PPL, seed sd 1) holds after few seeds; an effect of 0 runs to M = 8 and stops with its
    reason (futility off). Only the open claim's cells (config, control and both replicates) are added after the
    decided one stopped; decisions.json holds the verdicts; the progress lines name the open claims and the seeds."""
    out, manifest = make_dir(tmp_path)
    cells, lines = Cells(), []
    result = decide.decide_directory(out, manifest, max_seeds=8, futility=0.0, cell_fn=cells, replicate=replicate,
                                     log=lines.append)
    worse, same = result.verdicts["worse"], result.verdicts["same"]
    assert worse.outcome.value == "holds" and result.seeds["worse"] < 8, worse.text()
    assert same.outcome.value == "inconclusive" and result.seeds["same"] == 8 and same.stop, same.text()
    assert "open at the last look (8 seeds)" in same.text()
    late = {c.seed for c in cells.calls if c.r3 == "worse"}
    assert max(late) < 8 and max({c.seed for c in cells.calls if c.r3 == "same"}) == 7
    assert len({c for c in cells.calls}) == len(cells.calls)  # no cell computed twice
    saved = json.loads((out / decide.DECISIONS_FILE).read_text())
    assert saved["plan"]["first"] == 3 and saved["plan"]["max_seeds"] == 8
    assert {c["config"]: c["decision"]["outcome"] for c in saved["claims"]} == {"worse": "holds",
                                                                                 "same": "inconclusive"}
    assert saved["claims"][1]["decision"]["stop"] == same.stop
    assert lines and "open claim(s) (worse, same)" in lines[0] and "seeds so far" in lines[0]
    assert any("s per seed measured" in line and "ETA" in line for line in lines), lines
    names = {c["name"] for c in read_manifest(out)["cells"]}
    assert {"worse.float-order", "hadamard.float-order"} <= names
    table = decide.table(result, decide.config_claims(manifest))
    assert "| worse − hadamard > 0 |" in table and "holds" in table


def test_a_claim_far_from_decidable_stops_for_futility_before_m(tmp_path: Path) -> None:
    """The same directory with the default early stop: the null claim stops at 5 seeds (its chance of a decision
    by M = 8 is below 10%), says so, and no cell of it past seed 4 is built; decisions.json records the level."""
    out, manifest = make_dir(tmp_path)
    cells = Cells()
    result = decide.decide_directory(out, manifest, max_seeds=8, cell_fn=cells, replicate=replicate, log=None)
    same = result.verdicts["same"]
    assert same.stop.startswith("stopped for futility at 5 seeds") and result.seeds["same"] == 5, same.text()
    assert max({c.seed for c in cells.calls if c.r3 == "same"}) == 4
    assert result.verdicts["worse"].outcome.value == "holds"
    assert json.loads((out / decide.DECISIONS_FILE).read_text())["plan"]["futility"] == 0.1


def test_a_killed_run_resumes_without_recomputing(tmp_path: Path) -> None:
    """A run killed after 10 cells resumes with the same plan; every cell is computed once over both runs, and
    the outcome equals an uninterrupted run's."""
    out, manifest = make_dir(tmp_path)
    first = Cells(interrupt_after=10)
    with pytest.raises(KeyboardInterrupt):
        decide.decide_directory(out, manifest, max_seeds=6, cell_fn=first, replicate=replicate, log=None)
    second = Cells()
    result = decide.decide_directory(out, manifest, max_seeds=6, cell_fn=second, replicate=replicate, log=None)
    done = first.calls + second.calls
    assert len(set(done)) == len(done), "a finished cell was recomputed"
    ref_out, ref_manifest = make_dir(tmp_path / "ref")
    ref = decide.decide_directory(ref_out, ref_manifest, max_seeds=6, cell_fn=Cells(), replicate=replicate,
                                  log=None)
    assert {k: v.text() for k, v in result.verdicts.items()} == {k: v.text() for k, v in ref.verdicts.items()}
    assert len(complete_records(out)) == len(complete_records(ref_out))


def test_no_open_claim_builds_nothing(tmp_path: Path) -> None:
    out, manifest = make_dir(tmp_path, names=("hadamard", "worse"))
    decide.decide_directory(out, manifest, max_seeds=6, cell_fn=Cells(), replicate=replicate, log=None)
    before = (out / MANIFEST_FILE).read_text()
    again, lines = Cells(), []
    result = decide.decide_directory(out, manifest, max_seeds=6, cell_fn=again, replicate=replicate,
                                     log=lines.append)
    assert not result.built and again.calls == [] and "no open claim" in lines[0]
    assert (out / MANIFEST_FILE).read_text() == before


@pytest.mark.parametrize(("kw", "message"), [
    ({"max_seeds": 2}, "--max-seeds 2 is below the 3 seeds"),
    ({"max_seeds": 6, "time_budget": 0.0}, "--time-budget 0: must be a positive"),
    ({"max_seeds": 6, "time_budget": -5.0}, "--time-budget -5: must be a positive"),
    ({"max_seeds": 6, "replicate": lambda cfg: None}, "has no float-order replicate"),
])
def test_bad_input_touches_nothing(tmp_path: Path, kw: dict, message: str) -> None:
    out, manifest = make_dir(tmp_path)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    cells = Cells()
    with pytest.raises(decide.DecideError, match=message):
        decide.decide_directory(out, manifest, cell_fn=cells, **{"replicate": replicate, **kw})
    assert cells.calls == [] and {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_a_changed_m_after_looking_is_refused(tmp_path: Path) -> None:
    out, manifest = make_dir(tmp_path, names=("hadamard", "same"))
    decide.decide_directory(out, manifest, max_seeds=4, cell_fn=Cells(), replicate=replicate, log=None)
    with pytest.raises(decide.DecideError, match="fixed at --max-seeds 4"):
        decide.decide_directory(out, manifest, max_seeds=9, cell_fn=Cells(), replicate=replicate, log=None)


def _cli(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.run([sys.executable, "-m", "rope_quant.cli", *argv], capture_output=True, text=True, env=env,
                          timeout=300)


def _real_dir(tmp_path: Path, weights: str) -> Path:
    from rope_quant.experiment.config import RunConfig
    from rope_quant.sweep.manifest import write_manifest

    base = RunConfig.from_flat(model="smollm2-135m", weights=weights)
    out = tmp_path / weights
    write_manifest(out, build_manifest(base, {"hadamard": {"r3": "hadamard"}, "pairwise_only":
                                              {"r3": "pairwise_only"}}, (0, 1, 2), study="compare"))
    return out


@pytest.mark.parametrize(("weights", "flags", "message"), [
    ("gptq", ["--max-seeds", "2"], "error: --max-seeds 2 is below the 3 seeds"),
    ("gptq", ["--time-budget", "0"], "error: --time-budget 0: must be a positive number of seconds"),
    ("gptq", ["--futility", "1.5"], "error: --futility 1.5: must lie in [0, 1)"),
    ("rtn", [], "has no float-order replicate (its weights are not GPTQ)"),
])
def test_cli_bad_input_exits_2_and_touches_nothing(tmp_path: Path, weights: str, flags: list[str],
                                                   message: str) -> None:
    out = _real_dir(tmp_path, weights)
    before = sorted(p.name for p in out.rglob("*"))
    proc = _cli("decide", str(out), *flags)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in out.rglob("*")) == before


def test_cli_decides_a_real_manifest_with_fake_cells(tmp_path: Path, capsys) -> None:
    """``rope-quant decide DIR`` on a RunConfig manifest (GPTQ weights), cells computed by a fake function that
    reads the seed, the R3 and the GPTQ float mode: replicate cells flip ``gptq.float64``, the table prints, exit 0,
    and a second call finds no open claim."""
    from rope_quant.cli import main

    out = _real_dir(tmp_path, "gptq")
    seen: list[tuple[int, str, bool]] = []

    def cell(cfg) -> dict:
        flat = cfg.flat()
        seen.append((flat["seed"], flat["r3"], flat["gptq"].float64))
        shared = np.random.default_rng(flat["seed"]).normal(0, 1.0)
        noise = np.random.default_rng([flat["seed"], int(flat["gptq"].float64), len(flat["r3"])]).normal(0, 0.2)
        return {"ppl": 20.0 + shared + (3.0 if flat["r3"] == "pairwise_only" else 0.0) + noise, "n_tokens": 512}

    assert main(["decide", str(out), "--max-seeds", "5"], cell_fn=cell) == 0
    printed = capsys.readouterr().out
    assert "| pairwise_only − hadamard > 0 |" in printed and "holds" in printed, printed
    assert {f for _, _, f in seen} == {False, True} and len(set(seen)) == len(seen)  # each cell once, both orders
    assert main(["decide", str(out), "--max-seeds", "5"], cell_fn=cell) == 0
    assert "no open claim" in capsys.readouterr().out


def test_cells_of_another_kind_are_refused(tmp_path: Path, capsys) -> None:
    """A long-context (or NIAH, static, lm-eval) directory has no per-cell perplexity for decide to read: exit 2
    before anything is built, naming the kind and where its claims are decided."""
    from rope_quant.cli import main
    from rope_quant.experiment.config import RunConfig
    from rope_quant.sweep.kinds.long_context import LongContextConfig
    from rope_quant.sweep.manifest import Manifest, write_manifest

    run = RunConfig.from_flat(model="smollm2-135m", weights="gptq")
    cells = [(n, LongContextConfig(run.override(r3=n, seed=s), (1024,))) for s in (0, 1) for n in ("hadamard",
                                                                                                    "pairwise_only")]
    out = tmp_path / "lc"
    write_manifest(out, Manifest(cells=cells, study="long-context"))
    before = sorted(p.name for p in out.rglob("*"))
    assert main(["decide", str(out)]) == 2
    assert "error: cells of kind long-context" in capsys.readouterr().err
    assert sorted(p.name for p in out.rglob("*")) == before


def test_the_real_pipeline_on_a_tiny_llama_builds_float_order_replicates(embedded_model, tmp_path: Path) -> None:
    """decide over a GPTQ compare directory on a 2-layer Llama (the embedded tokenizer) through the real cell
    function: the replicate cells are the same cells with ``gptq.float64`` flipped (their records say so and their
    weight keys differ), every claim gets a sequential verdict, and each cell record is written once."""
    from rope_quant.corpora import token_streams
    from rope_quant.experiment.config import RunConfig
    from rope_quant.sweep.cells import pipeline_cell_fn
    from rope_quant.sweep.loaded_models import ModelCache
    from tests._support.models import tiny_base

    base = tiny_base(embedded_model)
    models = ModelCache()
    models.put("tiny", "cpu", base, {"pydoc": token_streams.load_corpus("pydoc", base[1])})
    run = RunConfig.from_flat(model="tiny", weights="gptq", r1="random_hadamard", seqlen=64, calib_windows=2,
                              eval_windows=2)
    manifest = build_manifest(run, {"hadamard": {"r3": "hadamard"}, "pairwise_only": {"r3": "pairwise_only"}},
                              (0, 1), study="compare")
    out = tmp_path / "tiny"
    try:
        fn = pipeline_cell_fn(out / "cache", artifacts=out, models=models)
        result = decide.decide_directory(out, manifest, max_seeds=3, cell_fn=fn, log=None)
    finally:
        models.clear()
    v = result.verdicts["pairwise_only"]
    assert v.rule == decide.sequential.RULE_SEQUENTIAL and v.n == result.seeds["pairwise_only"] >= 2, v.text()
    assert v.decided or v.stop, v.text()  # decided, or stopped at M = 3 with its reason
    recs = complete_records(out)
    by = {(r["name"], r["seed"]): r for r in recs}
    assert len(by) == len(recs) == 4 * result.seeds["pairwise_only"]
    for (name, seed), rec in by.items():
        float64 = rec["config"]["quant"]["w"]["gptq"]["float64"]
        assert float64 is name.endswith(decide.REPLICATE_SUFFIX), (name, seed)


def test_the_engine_reads_each_config_claim_as_the_rule_on_its_records(tmp_path: Path) -> None:
    """Each config claim's decision in decisions.json is the sequential rule itself on the records: the per-seed
    differences config − control and the float-order shifts, read from the cell records at the seeds the claim
    used (``core.sequential.decide``, the reference the engine must agree with, verdict dict for verdict dict)."""
    from rope_quant.core.sequential import Plan
    from rope_quant.core.sequential import decide as rule
    from rope_quant.core.verdict import Form

    out, manifest = make_dir(tmp_path)
    decide.decide_directory(out, manifest, max_seeds=8, futility=0.0, cell_fn=Cells(), replicate=replicate, log=None)
    ppl = {(r["name"], r["seed"]): r["result"]["ppl"] for r in complete_records(out)}
    saved = json.loads((out / decide.DECISIONS_FILE).read_text())
    plan = Plan(saved["plan"]["first"], saved["plan"]["max_seeds"], futility=0.0)
    suffix = decide.REPLICATE_SUFFIX
    for row in saved["claims"]:
        t, c, seeds = row["config"], row["control"], range(row["seeds"])
        diffs = [ppl[(t, s)] - ppl[(c, s)] for s in seeds]
        shifts = [(ppl[(t + suffix, s)] - ppl[(c + suffix, s)]) - d for s, d in zip(seeds, diffs, strict=True)]
        direct = json.loads(json.dumps(rule(Form.GREATER, diffs, shifts, plan).to_dict()))
        assert direct == row["decision"], row["config"]


def test_a_config_claim_is_the_comparators_config_with_overrides(tmp_path: Path) -> None:
    """App. F's lower-bits directory pairs each config with its own setting's control (not the comparator): each
    config claim's cells, read as the comparator's config with their overrides (the directory store), are the
    manifest's configs at every seed; deciding one adds only its config and control (no comparator cell)."""
    from rope_quant.experiment.config import RunConfig
    from rope_quant.sweep.claim_store import DirectoryStore
    from rope_quant.sweep.presets import lower_bits_manifest

    manifest = lower_bits_manifest(RunConfig.from_flat(model="smollm2-135m", weights="gptq"), (0, 1))
    claims = decide.config_claims(manifest)
    assert {c.id: decide.claim_control(c) for c in claims}["pairwise_only+W3A3KV3"] == "hadamard+W3A3KV3"
    store = DirectoryStore(tmp_path, manifest)
    keys = {(n, cfg.seed): cfg.key() for n, cfg in manifest.cells}
    for claim in claims:
        for name in claim.cell_names():
            for seed in (0, 1, 5):  # seed 5: not in the directory, the comparator's config at that seed
                got = store.config(claim.cells[name], seed).key()
                assert got == keys.get((name, seed), got) and (seed == 5 or (name, seed) in keys), (name, seed)
    assert store.config(claims[0].cells[claims[0].id], 5).seed == 5


def test_a_config_that_is_no_override_of_the_comparator_is_refused(tmp_path: Path) -> None:
    """A config whose settings the comparator's flat fields cannot rebuild is refused before anything is built."""
    bad = dataclasses.make_dataclass("Odd", [("seed", int, 0), ("r3", str, "x")], frozen=True)

    class Odd(bad):  # type: ignore[misc, valid-type]
        def key(self) -> str:
            return f"{self.seed}-{self.r3}-{id(self)}"  # a key no override reproduces

        def weight_key(self) -> str:
            return str(self.seed)

    manifest = build_manifest(Odd(), {"hadamard": {"r3": "hadamard"}, "other": {"r3": "other"}}, (0, 1),
                              study="compare")
    with pytest.raises(decide.DecideError, match="'other' is not the comparator"):
        decide.config_claims(manifest)

"""``rope-quant claims`` and ``report`` / ``decide`` on a claims directory, with a stand-in cell function.

The stand-in draws a perplexity from the seed (shared by the seed's cells), the R3, the estimator and the GPTQ float
mode, so that the claims have effects to find: pairwise_only is 2 PPL above hadamard, k_only 0.5 PPL below rows.
The sweep must write exactly the cells the claims read (treatment, control, their float-order replicates) and
resume without recomputing a complete cell; the report must write the engine's verdicts on the same directory in
the pytest plugin's claims JSON shape; bad input must stop before any cell runs.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from rope_quant import cli
from rope_quant.claims import engine, registry
from rope_quant.claims.premises import adapt, facts_of_checkpoint
from rope_quant.core import sequential
from rope_quant.core.verdict import Form, Outcome
from rope_quant.sweep.claim_store import DirectoryStore
from rope_quant.sweep.decide_plan import REPLICATE_SUFFIX
from rope_quant.sweep.manifest import read_manifest
from rope_quant.sweep.records import complete_records

TINY = ["--seqlen", "64", "--calib-windows", "1", "--eval-windows", "1", "--quiet"]
ENGINE_KEYS = ("claim", "id", "section", "statement", "model", "expected", "measured", "holds", "decision",
               "numbers", "parts", "verdict", "budget", "seeds", "rule")


def ppl(cfg) -> float:
    f = cfg.flat()
    shared = np.random.default_rng(f["seed"]).normal(0, 0.4)
    own = np.random.default_rng([f["seed"], len(f["r3"]), len(f["estimator"]), int(f["gptq"].float64)]).normal(0, 0.05)
    return float(14.0 + shared + own + 2.0 * (f["r3"] == "pairwise_only") - 0.5 * (f["estimator"] == "k_only"))


class Cells:
    """The stand-in cell function; records each config it computes (``kill_after``: a kill after that many)."""

    def __init__(self, kill_after: int | None = None) -> None:
        self.calls: list = []
        self.kill_after = kill_after

    def __call__(self, cfg) -> dict:
        if self.kill_after is not None and len(self.calls) >= self.kill_after:
            raise KeyboardInterrupt  # a killed run: this cell leaves no record
        self.calls.append(cfg)
        return self.result(cfg)

    def result(self, cfg) -> dict:
        """The cell's result (a subclass draws other numbers)."""
        value = ppl(cfg)
        return {"ppl": value, "n_tokens": 64, "k_range_mean": value / 4, "k_rel_err": value / 100, **whip_fit(cfg)}


def whip_fit(cfg) -> dict:
    """A whip R1's fit record, as a real cell writes it (A1-whip reads its losses); none for another R1."""
    if getattr(cfg, "flat", None) is None or cfg.flat().get("r1") != "whip":
        return {}
    return {"rotation_fit": {"kind": "whip", "loss_init": 296.0 + cfg.seed / 10, "loss_fit": 287.0, "steps": 20}}


def _ident(cfg) -> tuple:
    f = cfg.flat()
    return f["seed"], f["r3"], f["estimator"], f["gptq"].float64


def _claims(out: Path, *flags: str, cells: Cells | None = None) -> int:
    return cli.main(["claims", "--out", str(out), *TINY, *flags], cell_fn=cells or Cells())


@pytest.fixture(scope="module")
def swept(tmp_path_factory) -> Path:
    """A claims directory of C1 and C3 at seeds 0, 1, 2, every cell computed."""
    out = tmp_path_factory.mktemp("claims") / "c13"
    assert _claims(out, "--claims", "C1,C3", "--seeds", "0-2") == 0
    return out


def test_the_sweep_writes_each_claims_cells_and_their_replicates(tmp_path: Path, capsys) -> None:
    """C1 (pairwise_only vs hadamard, every seed) and C3 (k_only vs rows, rows being pairwise_only; paired) at two
    seeds: the comparator, pairwise_only and k_only, those C3's paired part reads each with its float-order
    replicate (GPTQ in the other float mode), each computed once; the plan (cells per claim, the cost estimate) is
    printed before the cells run."""
    out, cells = tmp_path / "cl", Cells()
    assert _claims(out, "--claims", "C1,C3", "--seeds", "0,1", cells=cells) == 0
    printed = capsys.readouterr().out
    configs = (("pairwise_only", "rows"), ("pairwise_only", "k_only"))
    expected = {(s, r3, est, f64) for s in (0, 1) for r3, est in configs for f64 in (False, True)}
    expected |= {(s, "hadamard", "rows", False) for s in (0, 1)}
    assert [_ident(c) for c in cells.calls if _ident(c) not in expected] == []
    assert sorted(map(_ident, cells.calls)) == sorted(expected)  # each once, none missing
    data = read_manifest(out)
    assert data["study"] == "claims" and data["comparator"] == "hadamard"
    names = {(c["name"], c["seed"]) for c in data["cells"]}
    base = {"pairwise_only", "pairwise_only+estimator=k_only"}
    assert names == {(n + rep, s) for n in base for rep in ("", REPLICATE_SUFFIX) for s in (0, 1)} | {
        ("hadamard", s) for s in (0, 1)}
    for rec in complete_records(out):
        assert rec["config"]["quant"]["w"]["gptq"]["float64"] is rec["name"].endswith(REPLICATE_SUFFIX)
    assert printed.index("claims plan: 2 claims") < printed.index("rope-quant claims: 10 cells")
    assert "| C3 | pairwise_only+estimator=k_only, pairwise_only+estimator=k_only.float-order, pairwise_only" in printed
    assert "cost estimate" in printed and (out / "claims.json").is_file()


def test_a_killed_run_resumes_computing_only_the_missing_cells(tmp_path: Path) -> None:
    """A run killed after five cells exits 130; the same command computes only the cells without a record (none of
    the five again); a record then lost alone is the only cell a third run computes."""
    out, first = tmp_path / "cl", Cells(kill_after=5)
    assert _claims(out, "--claims", "C1,C3", "--seeds", "0,1", cells=first) == 130
    second = Cells()
    assert _claims(out, "--claims", "C1,C3", "--seeds", "0,1", cells=second) == 0
    done = [_ident(c) for c in first.calls + second.calls]
    assert len(first.calls) == 5 and len(second.calls) == 5 and len(set(done)) == 10
    lost = next(p for p in (out / "cells" / "pairwise_only").glob("seed1-*.json"))
    lost.unlink()
    third = Cells()
    assert _claims(out, "--claims", "C1,C3", "--seeds", "0,1", cells=third) == 0
    assert [_ident(c) for c in third.calls] == [(1, "pairwise_only", "rows", False)]


def test_the_shards_split_the_cells(tmp_path: Path) -> None:
    out, cells = tmp_path / "cl", Cells()
    for i in range(2):
        assert _claims(out, "--claims", "C3", "--seeds", "0,1", "--shard", f"{i}/2", cells=cells) == 0
    # per seed: the comparator, k_only and rows (pairwise_only), the last two with their replicates
    assert len(cells.calls) == 10 and len({_ident(c) for c in cells.calls}) == 10


def test_report_writes_the_engines_verdicts_in_the_claims_json(swept: Path, tmp_path: Path, capsys) -> None:
    """``report DIR`` on a claims directory: each claim's row is ``engine.evaluate`` over the same directory at its
    seeds (C1 holds every seed, C3 holds); a claim of the paper the sweep did not plan (C2, and C4-ppl and C7 scored
    on the support windows and at long context) is left out with the reason, as pytest's table leaves out what it
    did not run; the model, protocol and device are named."""
    out = tmp_path / "copy"
    shutil.copytree(swept, out)
    (out / "claims.json").unlink()
    assert cli.main(["report", str(out)]) == 0
    printed = capsys.readouterr().out
    data = json.loads((out / "claims.json").read_text())
    rows = {r["id"]: r for r in data["claims"]}
    store = DirectoryStore(out)
    for cid in ("C1", "C3"):
        direct = json.loads(json.dumps(engine.evaluate(registry.get(cid), store, (0, 1, 2)).to_dict("smollm2-135m")))
        assert {k: rows[cid][k] for k in ENGINE_KEYS} == {k: direct[k] for k in ENGINE_KEYS}
    assert rows["C1"]["decision"]["outcome"] == "holds" and rows["C3"]["decision"]["outcome"] == "holds"
    left = {d["id"]: d["reason"] for d in data["left_out"]}
    assert "C2" not in rows and left["C2"].startswith(
        "not in this directory (its cells or their float-order replicates are not in the manifest): "
        "`rope-quant claims --claims C2` into it adds them")
    # C8 and A1-whip read C1's cells, C3-mean C3's: planned
    assert sorted(rows) == ["A1-whip", "C1", "C3", "C3-mean", "C8"]
    assert {i for i in left if registry.get(i).group == registry.PAPER
            and not left[i].startswith("not in this directory")} == set()
    runtime = set(registry.active().ids("llamacpp"))  # scored by llama.cpp: pytest's front decides them
    assert {i for i in runtime if i in left} == {"L1", "L2", "L3"}
    assert all("scored by llama.cpp" in left[i] for i in ("L1", "L2", "L3"))
    assert {"C4-ppl", "C7", "C7-8K"} <= set(left) and "C4-ppl" not in rows
    # at T = 64 (d = 64) KVQuant's and KIVI's streaming groups quantise under a quarter of the keys read
    assert {i for i in left if i.startswith("K-")} == {f"K-{s}-{r}-{b}" for s in ("kvquant", "kivi")
                                                     for r in ("id", "fold") for b in ("KV4", "W4A4KV4")}
    assert all("it needs evaluation windows of T = " in left[i] for i in left if i.startswith("K-"))
    assert data["model"]["name"] == "smollm2-135m" and data["model"]["fingerprint"]
    assert data["protocol"]["seeds"] == [0, 1, 2] and data["protocol"]["calibration_tokens"] == 64
    assert data["device"]["requested"] == "cpu" and data["schema"] == 2
    assert (out / "claims.md").read_text().strip() in printed and "left out: C7:" in printed


def test_a_missing_cell_reads_inconclusive_and_is_named(swept: Path, tmp_path: Path) -> None:
    """A record lost from the directory: the claims that read it are inconclusive, naming their cell and the seed
    (the report does not crash, nor read the claim at fewer seeds)."""
    out = tmp_path / "copy"
    shutil.copytree(swept, out)
    next((out / "cells" / "pairwise_only").glob("seed1-*.json")).unlink()
    assert cli.main(["report", str(out)]) == 0
    rows = {r["id"]: r for r in json.loads((out / "claims.json").read_text())["claims"]}
    for cid, cell in (("C1", "{r3=pairwise_only}"), ("C3", "{r3=pairwise_only, estimator=rows}")):
        assert rows[cid]["decision"]["outcome"] == "inconclusive", rows[cid]["verdict"]
        assert f"missing cell: no ppl for cell {cell} at seed 1" in rows[cid]["verdict"]


def test_the_claims_json_has_the_pytest_plugins_keys(swept: Path, pytester: pytest.Pytester) -> None:
    """The plugin's ``--rq-claims-out`` payload and row keys (a claim recorded with its id, a verdict, parts and its
    run's description, as a registry front records them) are all in the report's; the model (with its fingerprint),
    the protocol and the device carry the same keys on both paths; the Markdown table has the plugin's columns."""
    from rope_quant import claims_json, pytest_plugin
    from rope_quant.analysis import claims_report

    pytester.makepyfile(test_rq_shape=(
        "from rope_quant.analysis.claims_report import describe_run\n"
        "from rope_quant.core.verdict import deterministic\n"
        "from rope_quant.experiment.config import RunConfig\n"
        "from rope_quant.experiment.envinfo import device_description\n"
        "def test_claim(rq_claim, rq_machine, rq_run):\n"
        "    rq_machine({'cpu_model': 'x'})\n"
        "    rq_run(describe_run(RunConfig(model='m'), [0, 1], 'hadamard', device_description('cpu'),\n"
        "                        fingerprint='f0', name='paper'))\n"
        "    v = deterministic(True, 'a note')\n"
        "    rq_claim('C0 (demo)', 'a < b', '1 < 2', verdict=v, parts={'p': v}, claim_id='C0', a=1.0)\n"))
    plugin_out = pytester.path / "claims"
    pytester.runpytest(f"--rq-claims-out={plugin_out}").assert_outcomes(passed=1)
    plugin = json.loads((plugin_out / "claims.json").read_text())
    ours = json.loads((swept / "claims.json").read_text())
    assert set(plugin) <= set(ours), set(plugin) - set(ours)
    assert set(plugin["claims"][0]) <= set(ours["claims"][0]), set(plugin["claims"][0]) - set(ours["claims"][0])
    assert plugin["claims"][0]["id"] == "C0" and plugin["model"] == {
        "name": "m", "fingerprint": "f0", "fingerprint_basis": claims_report.FINGERPRINT_BASIS}
    for key in claims_report.RUN_KEYS:
        assert set(plugin[key]) == set(ours[key]), (key, set(plugin[key]) ^ set(ours[key]))
        assert plugin["runs"] == [{k: plugin[k] for k in claims_report.RUN_KEYS}]
        assert ours["runs"] == [{k: ours[k] for k in claims_report.RUN_KEYS}]
    assert ours["model"]["fingerprint"] and ours["protocol"]["name"] == "rope-quant claims"
    assert claims_report.CLAIMS_SCHEMA == pytest_plugin.CLAIMS_SCHEMA == claims_json.CLAIMS_SCHEMA == ours["schema"]
    assert claims_report.RUN_KEYS is claims_json.RUN_KEYS  # one schema: the report writes the plugin's keys
    header = (plugin_out / "claims.md").read_text().splitlines()[0]
    assert (swept / "claims.md").read_text().startswith(header)


def test_a_session_of_two_models_lists_each_run(pytester: pytest.Pytester) -> None:
    """Two models in one session: ``runs`` holds both descriptions, and no single ``model`` is written on top."""
    pytester.makepyfile(test_rq_two=(
        "import pytest\n"
        "@pytest.mark.parametrize('name', ['a', 'b'])\n"
        "def test_claim(rq_claim, rq_run, name):\n"
        "    rq_run({'model': {'name': name, 'fingerprint': name * 4}, 'protocol': {}, 'device': {}})\n"
        "    rq_claim('C0 (demo)', 'x', 'y', holds=True, model=name, claim_id='C0')\n"))
    out = pytester.path / "claims"
    pytester.runpytest(f"--rq-claims-out={out}").assert_outcomes(passed=2)
    data = json.loads((out / "claims.json").read_text())
    assert [r["model"]["name"] for r in data["runs"]] == ["a", "b"] and "model" not in data


@pytest.mark.parametrize(("flags", "message"), [
    (["--claims", "C1,C99"], "unknown claim 'C99'"),
    (["--claims", "App-f"], "did you mean 'App-F' or"),
    (["--seeds", "0"], "the claims need at least 2 seeds"),
    (["--claims", "C4-ppl", "--support-windows", "0"], "--support-windows must be an integer >= 1, got 0"),
])
def test_bad_input_is_refused_before_any_cell_runs(tmp_path: Path, capsys, flags: list[str], message: str) -> None:
    out, cells = tmp_path / "cl", Cells()
    assert _claims(out, *flags, cells=cells) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert cells.calls == [] and not out.exists()


def test_a_table_that_does_not_fit_is_refused_after_its_plan(tmp_path: Path, capsys, monkeypatch) -> None:
    """The claims plan (cells per claim, cost estimate) is printed, then the memory check refuses the run with the
    plan's remedy (exit 2) before any model loads or cell runs."""
    from rope_quant.planning import memory_check

    monkeypatch.setenv(memory_check.ENV_HOST, "0.01")  # 10 MiB of host RAM
    out, cells = tmp_path / "cl", Cells()
    assert _claims(out, "--claims", "C1", "--seeds", "0,1", cells=cells) == 2
    captured = capsys.readouterr()
    assert "claims plan: 1 claims" in captured.out and "cost estimate" in captured.out
    assert "the plan for this run does not fit: stage" in captured.err
    assert "use a smaller --calib-windows" in captured.err
    assert cells.calls == [] and not out.exists()


def test_a_model_that_refuses_r1_runs_the_claims_under_the_nearest_protocol(tmp_path: Path, capsys) -> None:
    """Gemma 3's sandwich norms refuse R1: without ``--r1`` the claims run with R1 = identity, as pytest's front runs
    them, said before anything runs (``compare`` refuses the same setting, naming the alternatives)."""
    out = tmp_path / "gemma"
    assert _claims(out, "--model", "gemma3-270m", "--claims", "C1", "--seeds", "0,1", "--dry-run") == 0
    printed = capsys.readouterr().out
    assert "note: R1 set to identity for gemma3-270m, the claims' nearest protocol" in printed
    assert "R1=identity" in printed and "post_attention_layernorm" in printed
    assert cli.main(["compare", "--model", "gemma3-270m", "--out", str(tmp_path / "c"), *TINY], cell_fn=Cells()) == 2
    assert "is refused for gemma3-270m" in capsys.readouterr().err


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path: Path, capsys) -> None:
    out, cells = tmp_path / "cl", Cells()
    assert _claims(out, "--dry-run", cells=cells) == 0
    printed = capsys.readouterr().out
    for text in ("claims plan: 23 claims at seeds 0,1,2", "| App-F |", "| C4-ppl |", "| C7-8K | pairwise_only+L=8192",
                 "cost estimate", "long context L=8192", "dry run: "):
        assert text in printed, text
    assert "left out" not in printed
    assert cells.calls == [] and not out.exists()


def test_help_lists_the_flags(capsys) -> None:
    assert cli.main(["claims", "--help"]) == 0
    text = capsys.readouterr().out
    for flag in ("--model", "--out", "--seeds", "--device", "--claims", "--dry-run", "--shard", "--slurm",
                 "--slurm-param", "--no-resume", "--weights"):
        assert flag in text, flag


def test_decide_adds_seeds_for_the_open_claim_only(swept: Path, tmp_path: Path, capsys) -> None:
    """``decide DIR`` on a claims directory of seeds 0, 1: C1 (every seed) is decided at the first look; C3 is open
    at two seeds (the rule's per-look t interval is wide) and gets seeds until it holds, each added seed holding
    only the comparator and C3's cells; each row is the engine's sequential reading at its seeds; a second run
    computes nothing."""
    out, cells = tmp_path / "two", Cells()
    assert _claims(out, "--claims", "C1,C3", "--seeds", "0,1", cells=Cells()) == 0
    assert cli.main(["decide", str(out), "--max-seeds", "6"], cell_fn=cells) == 0
    data = json.loads((out / "decisions.json").read_text())
    rows = {r["id"]: r for r in data["claims"]}
    assert rows["C1"]["seeds"] == [0, 1] and rows["C1"]["decision"]["outcome"] == "holds"
    assert rows["C3"]["decision"]["outcome"] == "holds" and len(rows["C3"]["seeds"]) > 2, rows["C3"]["verdict"]
    added = {(c["name"], c["seed"]) for c in read_manifest(out)["cells"] if c["seed"] >= 2}
    c3 = {"hadamard", "pairwise_only", "pairwise_only.float-order", "pairwise_only+estimator=k_only",
          "pairwise_only+estimator=k_only.float-order"}
    assert added == {(n, s) for n in c3 for s in rows["C3"]["seeds"][2:]}
    assert sorted(map(_ident, cells.calls)) == sorted(set(map(_ident, cells.calls)))
    plan = sequential.Plan(2, 6, futility=data["plan"]["futility"], shape=data["plan"]["shape"])
    direct = engine.evaluate(registry.get("C3"), DirectoryStore(out), rows["C3"]["seeds"], plan.with_parts(1))
    assert rows["C3"]["decision"] == json.loads(json.dumps(direct.verdict.to_dict()))
    assert rows["C3"]["rule"] == engine.RULE_SEQUENTIAL and direct.verdict.outcome is Outcome.HOLDS
    again = Cells()
    assert cli.main(["decide", str(out), "--max-seeds", "6"], cell_fn=again) == 0
    assert again.calls == [] and "decisions in" in capsys.readouterr().out


def test_a_cell_with_unquantised_weights_is_its_own_float_order_replicate(tmp_path: Path) -> None:
    """4-bit keys alone (weights none): no float-order replicate is built, and the store reads the cell itself as
    its replicate (a shift of 0, as the pytest front does), so the claim is decided instead of 'cannot be
    estimated'; RTN weights still have none."""
    out, cells = tmp_path / "kv4", Cells()
    assert _claims(out, "--claims", "K-sink-id-KV4", "--seeds", "0-2", cells=cells) == 0
    assert sum(c.quant.w.mode.value == "none" for c in cells.calls) == 6  # 2 cells x 3 seeds, no replicate
    store = DirectoryStore(out)
    claim = registry.get("K-sink-id-KV4")

    adapted = adapt(claim, facts_of_checkpoint("smollm2-135m"), seq_len=64)
    assert not isinstance(adapted, str)
    for name in ("scheme", "reference"):
        assert store.replicates(adapted.cells[name], (0, 1, 2)) == dict(
            zip((0, 1, 2), store.values(adapted.cells[name], (0, 1, 2)), strict=True))


def test_decide_refuses_a_claims_directory_without_replicates(tmp_path: Path, capsys) -> None:
    out, cells = tmp_path / "rtn", Cells()
    assert _claims(out, "--claims", "C3", "--seeds", "0,1", "--weights", "rtn", cells=cells) == 0
    assert all(not c.quant.w.gptq.float64 for c in cells.calls) and len(cells.calls) == 6
    assert cli.main(["decide", str(out)], cell_fn=Cells()) == 2
    assert "has no float-order replicate (its weights are not GPTQ)" in capsys.readouterr().err


def test_decide_stops_a_claim_whose_cell_fails(tmp_path: Path) -> None:
    """A cell that fails to compute at an added seed stops its claim there, naming the cell, instead of adding seeds
    to M; the other claims are read as before."""
    out = tmp_path / "fail"
    assert _claims(out, "--claims", "C1,C3", "--seeds", "0,1", cells=Cells()) == 0

    def failing(cfg) -> dict:
        if cfg.seed == 2 and cfg.estimator == "k_only":
            raise RuntimeError("simulated out of memory")
        return Cells()(cfg)

    assert cli.main(["decide", str(out), "--max-seeds", "6"], cell_fn=failing) == 0
    rows = {r["id"]: r for r in json.loads((out / "decisions.json").read_text())["claims"]}
    assert rows["C3"]["stopped"].startswith("a cell failed (no ppl for cell {r3=pairwise_only, estimator=k_only} at "
                                            "seed 2)"), rows["C3"]["stopped"]
    assert rows["C3"]["decision"]["outcome"] == "inconclusive" and rows["C1"]["decision"]["outcome"] == "holds"
    assert max(c["seed"] for c in read_manifest(out)["cells"]) == 2


def test_the_requested_table_is_written_when_other_claims_cannot_adapt(tmp_path: Path, capsys) -> None:
    """A tiny Llama with head_dim 16 (real cells, RTN weights): C1 and C8 are decided and written, and the key
    claims whose resolved widths cannot reach their target there (rope_pair_bits 3/4 averaging 4 − 32/16 = 2 bits),
    which nobody asked for, are left out with that reason, printed and in claims.json, instead of stopping the
    report with no table."""
    from tests._support.reliability import save_tiny_model

    model = save_tiny_model(tmp_path / "tiny16")
    out = tmp_path / "cl"
    code = cli.main(["claims", "--model", str(model), "--claims", "C1,C8", "--seeds", "0,1,2", "--weights", "rtn",
                     "--out", str(out), *TINY])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    data = json.loads((out / "claims.json").read_text())
    assert [r["id"] for r in data["claims"]] == ["C1", "C8", "A1-whip"]  # A1-whip reads C1's hadamard cell
    assert all(r["seeds"] == [0, 1, 2] and r["decision"]["outcome"] for r in data["claims"])
    left = {d["id"]: d["reason"] for d in data["left_out"]}
    pairbits = [c.id for c in registry.claims(registry.KEYS) if c.id.startswith("K-pairbits-")]
    assert pairbits and set(pairbits) <= set(left)
    for cid in pairbits:
        assert "its cells cannot adapt to head_dim 16" in left[cid], left[cid]
        assert "cannot average the target 2.0 bits" in left[cid], left[cid]
        assert f"left out: {cid}: " in printed.out


def _unequal_claim() -> registry.Claim:
    """A key claim at equal bits whose cells store unequal bits at d = 64 (KVQuant's G = 32: 5 bits, 4.5 for the
    reference)."""
    from rope_quant.claims.registry import Claim, MarginRule, Part, cell
    from rope_quant.core.verdict import Form

    return Claim("X-unequal", "x", "unequal bits", "nowhere",
                 {"scheme": cell(k_quant="kvquant_prerope", k_token_group=32), "reference": cell(r3="hadamard")},
                 (Part("p", "scheme", "reference", Form.NON_SUPERIOR, margin=MarginRule.equivalence("reference")),),
                 group=registry.KEYS, equal_bits=True)


def test_a_claim_nobody_asked_for_never_stops_the_table(tmp_path: Path, capsys) -> None:
    """An entry whose cells store unequal bits stops a run that asks for it, before any cell runs; a run asking
    for C1 alone writes C1's table and leaves that entry out with the reason (``report`` and ``decide`` read the
    same directory)."""
    with registry.temporary() as reg:
        reg.register(_unequal_claim())
        cells = Cells()
        assert _claims(tmp_path / "asked", "--claims", "C1,X-unequal", "--seeds", "0,1", cells=cells) == 2
        assert "X-unequal" in capsys.readouterr().err and cells.calls == []
        out = tmp_path / "c1"
        assert _claims(out, "--claims", "C1", "--seeds", "0,1") == 0
        data = json.loads((out / "claims.json").read_text())
        left = {d["id"]: d["reason"] for d in data["left_out"]}
        assert [r["id"] for r in data["claims"]] == ["C1", "C8", "A1-whip"]  # they read C1's cells: planned
        assert left["X-unequal"].startswith("it cannot be adapted to smollm2-135m: claim X-unequal, part 'p': its "
                                            "cells do not store equal bits"), left["X-unequal"]
        assert cli.main(["report", str(out)]) == 0
        assert "left out: X-unequal: it cannot be adapted to smollm2-135m" in capsys.readouterr().out


def test_a_new_claim_is_one_entry_that_both_fronts_find(tmp_path: Path, capsys) -> None:
    """One ``register(Claim(...))`` in a temporary registry: ``rope-quant claims`` selects it by id and plans its
    cells, and pytest's registry front parametrises one test per model for it, marked ``slow`` when (and only when)
    the entry says so; gone with the temporary registry."""
    from tests._support.registry_front import claim_params

    new = registry.Claim("X-new", "X (demo) k_only vs rows", "k_only below rows.", "nowhere",
                         {"k_only": registry.cell(r3="pairwise_only", estimator="k_only"),
                          "rows": registry.cell(r3="pairwise_only", estimator="rows")},
                         (registry.Part("k_only < rows", "k_only", "rows", Form.LESS),), slow=True)
    with registry.temporary():
        registry.register(new)
        registry.register(replace(new, id="X-fast", slow=False))
        assert _claims(tmp_path / "new", "--claims", "X-new", "--seeds", "0,1", "--dry-run") == 0
        printed = capsys.readouterr().out
        assert "claims plan: 1 claims at seeds 0,1" in printed
        row = next(line for line in printed.splitlines() if line.startswith("| X-new |"))
        assert set(row.strip("| ").split(" | ")[1].split(", ")) == {
            "pairwise_only", "pairwise_only.float-order", "pairwise_only+estimator=k_only",
            "pairwise_only+estimator=k_only.float-order"}
        params = {p.id: p for p in claim_params(["smollm2-135m", "/ckpt/Llama-3.2-1B"])}
        for model in ("smollm2-135m", "Llama-3.2-1B"):
            assert [m.name for m in params[f"{model}-X-new"].marks] == ["slow"]
            assert not params[f"{model}-X-fast"].marks
            assert [m.name for m in params[f"{model}-C6"].marks] == ["slow"] and not params[f"{model}-C1"].marks
    assert "X-new" not in registry.active().ids()
    assert not [p for p in claim_params(["smollm2-135m"]) if "X-new" in p.id]


def test_every_entry_of_paper_py_is_registered_in_its_order() -> None:
    """An entry is registered where it is defined: no ``Claim`` of paper.py is left out of the registry, and
    ``paper.PAPER`` is the registry's paper group in the claims table's order."""
    from rope_quant.claims import paper

    defined = [v for v in vars(paper).values() if isinstance(v, registry.Claim)]
    assert defined and all(registry.get(c.id) is c for c in defined)
    assert paper.PAPER == registry.claims(registry.PAPER)[: len(paper.PAPER)]
    assert [c.id for c in paper.PAPER] == ["C1", "C2", "C3", "C3-mean", "C4-ppl", "C4-K", "C4-ends", "C6", "C7",
                                           "C7-8K", "C8", "App-F", "A1-whip", "beyond-commuting", "beyond-range",
                                           "beyond-range-pph", "beyond-learned", "App-D", "App-G"]


@pytest.mark.parametrize("dry_run", [True, False], ids=["plan", "run"])
def test_the_checkpoint_is_read_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dry_run: bool) -> None:
    """``rope-quant claims`` reads the model's config once: its facts (premises, head_dim, the R1 refusal, the
    geometry) are built once and handed to the R1 default, the key-quantiser check, the claims that run, the cost
    plan, the memory check, the preflight and the report."""
    from rope_quant.model import loading

    reads: list[str] = []
    real = loading.load_config

    def counted(name: str, *args, **kwargs):
        reads.append(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(loading, "load_config", counted)
    flags = ["--claims", "C1,C3", "--seeds", "0,1", *(["--dry-run"] if dry_run else [])]
    assert _claims(tmp_path / "once", *flags) == 0
    assert reads == ["smollm2-135m"]

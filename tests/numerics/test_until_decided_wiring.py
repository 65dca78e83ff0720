"""The e2e claims' ``--rq-until-decided`` wiring (tests/_support/registry_front.py ``decide_claim`` over the e2e
conftest's ``Experiment``), on fake cells.

The e2e conftest's :class:`Experiment` is imported from its file and the registry's claims are decided as the
registry front decides them (tests/_support/registry_front.py: the engine over an ``ExperimentStore``); only
``pipeline.run_cell`` is replaced by a function that reads the seed, the R3 and GPTQ's float mode from the config,
so the path a claim takes (memoised cells, replicates of every seed, seeds added only while open, the sequential
rule) runs here in seconds. The embedded model itself is exercised by ``pytest -m e2e --rq-until-decided``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from rope_quant.claims import paper
from rope_quant.core.sequential import RULE_SEQUENTIAL, Plan
from rope_quant.core.verdict import RULE_REPLICATES, Outcome

E2E = Path(__file__).resolve().parents[1] / "e2e"


def _load(name: str, path: Path, monkeypatch):
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # dataclasses resolve their module; removed after the test
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def wiring(monkeypatch, tmp_path):
    conftest = _load("rq_e2e_conftest_wiring", E2E / "conftest.py", monkeypatch)
    built: list[tuple[int, str, bool, str]] = []

    def fake_run_cell(cfg, cache_dir=None, base=None, **_):
        flat = cfg.flat()
        built.append((flat["seed"], flat["r3"], flat["gptq"].float64, flat["estimator"]))
        shared = np.random.default_rng(flat["seed"]).normal(0, 1.0)  # the seed's weights and windows
        noise = np.random.default_rng([flat["seed"], int(flat["gptq"].float64), len(flat["r3"])]).normal(0, 0.03)
        step = {"hadamard": 0.0, "pairwise_plus_hadamard": 0.0, "pairwise_only": 3.0}[flat["r3"]]
        step -= 0.4 if flat["estimator"] == "k_only" else 0.0
        return {"ppl": 22.0 + shared + step + noise, "n_tokens": 12 * 511}  # seqlen − 1 targets per window

    monkeypatch.setattr("rope_quant.experiment.pipeline.run_cell", fake_run_cell)
    monkeypatch.setattr(conftest.Experiment, "quantized", lambda self, cfg: None)  # the fake cells build nothing

    def experiment(plan, time_budget=None):
        budget = conftest.E2EBudget(seeds=(0, 1, 2), replicates=3)
        return conftest.Experiment(None, str(tmp_path), budget, "pydoc", plan=plan, time_budget=time_budget)

    return experiment, built


def _decide(exp, claim):
    """``claim`` decided by the registry front (``decide_claim``: the engine over an ``ExperimentStore``, seeds added
    by ``claims.engine.until_decided`` under a plan): (verdict, ClaimResult)."""
    from tests._support.registry_front import Front, decide_claim

    return decide_claim(Front("m", exp, {claim.id: claim}, "plan"), claim.id, lambda *a, **kw: None, lambda _: None)


EQUIV = "pairwise_plus_hadamard ≡ hadamard"


def test_c2_until_decided_adds_replicated_seeds_only_while_open(wiring) -> None:
    """With a plan, C2 (equivalence within ±0.132 PPL, per-seed noise 0.03 around an effect of 0) is decided by
    the sequential rule after seeds were added; every cell (seed, R3, float mode) is built once, and every added
    seed carries its float-order replicate of both configs in the equivalence."""
    experiment, built = wiring
    verdict, result = _decide(experiment(Plan(3, 10)), paper.C2)
    equiv = result.part_verdicts[EQUIV]
    assert equiv.rule == RULE_SEQUENTIAL and equiv.outcome is Outcome.HOLDS, equiv.text()
    n = len(result.seeds)
    assert 3 < n <= 10 and result.seeds == tuple(range(n)) and equiv.n == n, (n, equiv.text())
    assert len(set(built)) == len(built), "a cell was computed twice"
    for seed in range(n):
        for r3 in ("hadamard", "pairwise_plus_hadamard"):
            assert {f for s, r, f, _ in built if (s, r) == (seed, r3)} == {True, False}
    assert max(s for s, *_ in built) == n - 1  # no seed past the decision


def test_without_the_mode_the_fixed_rule_reads_the_requested_seeds(wiring) -> None:
    experiment, built = wiring
    verdict, result = _decide(experiment(None), paper.C2)
    equiv = result.part_verdicts[EQUIV]
    assert equiv.rule == RULE_REPLICATES and result.seeds == (0, 1, 2) and equiv.n == 3
    assert max(s for s, *_ in built) == 2


def test_c3_until_decided_only_builds_its_own_cells(wiring) -> None:
    """C3 (k_only 0.4 PPL below rows, noise 0.03 per cell): decided by the sequential rule; the cells built are
    C3's own (pairwise_only under both estimators, both float orders), none of C2's."""
    experiment, built = wiring
    verdict, result = _decide(experiment(Plan(3, 10)), paper.C3)
    assert verdict.rule == RULE_SEQUENTIAL and verdict.outcome is Outcome.HOLDS, verdict.text()
    assert {r3 for _, r3, _, _ in built} == {"pairwise_only"}
    assert len(set(built)) == len(built) == 4 * len(result.seeds)  # decided at the first look here


def test_c7_stopped_by_the_time_budget_says_so_in_every_open_part(wiring, monkeypatch) -> None:
    """The registry front (``decide_claim``) re-reads a claim's parts at the seeds used after the loop: a stop on
    the time budget must reach each part still open (its verdict text in the row), not read as "open at look 1"."""
    from types import SimpleNamespace

    from tests._support.registry_front import Front, decide_claim

    experiment, _ = wiring

    def fake_long(self, seed=0, lengths=None, **overrides):
        flat = self.config(seed, **overrides).flat()
        noise = np.random.default_rng([seed, int(flat["gptq"].float64), len(flat["r3"])]).normal(0, 3.0)
        step = 3.0 if flat["r3"] == "pairwise_only" else 0.0
        return {n: SimpleNamespace(ppl=30.0 + step + noise, n_windows=1, n_tokens=n) for n in lengths}

    monkeypatch.setattr(type(experiment(None)), "long_context", fake_long)
    exp = experiment(Plan(3, 10), time_budget=1e-6)
    rows: list[dict] = []
    verdict, _ = decide_claim(Front("m", exp, {"C7": paper.C7}, "plan"), "C7",
                              lambda *args, **kw: rows.append(kw), lambda about: None)
    assert verdict.outcome is Outcome.INCONCLUSIVE and verdict.stop.startswith("time budget"), verdict.text()
    parts = {k: v for k, v in rows[0]["parts"].items() if k.startswith("L=")}
    assert parts and all(v.outcome is Outcome.INCONCLUSIVE for v in parts.values())
    assert all(v.stop.startswith("time budget") and "time budget" in v.text() for v in parts.values()), \
        [v.text() for v in parts.values()]


def test_the_store_reads_the_tokens_a_cell_scored(wiring) -> None:
    """The front's store reads a cell's scored tokens from the cell (12 windows × 511 targets), as the CLI's report
    reads them from a record, not the budget's 12 × 512: the two paths print the same budget to decide."""
    from tests._support.registry_front import ExperimentStore

    experiment, _ = wiring
    assert ExperimentStore(experiment(None)).tokens(paper.C2.cells["hadamard"]) == 12 * 511

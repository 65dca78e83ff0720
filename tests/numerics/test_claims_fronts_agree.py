"""The two fronts compute C4's support cells and C7's long-context cells by the same function: the per-seed
values ``rope-quant claims`` records (read back by the directory store) equal the pytest front's
(tests/_support/registry_front.py ``ExperimentStore`` over the e2e suite's ``Experiment``) for the same cell config
and seed, value for value.

Both run the real pipeline on one random Llama (2 layers, head_dim 64, byte tokens; RTN weights, 64-token windows,
one calibration window), the CLI over its config directory with the model injected, the front over the same
weights: C4-ppl's and C7's cells through the CLI, then one support cell (C4's ``b=2``) and one long cell (C7's
``pairwise_only`` at L = 1024) through the front.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from rope_quant import cli
from rope_quant.claims import registry
from rope_quant.claims.registry import cell, length_of, overrides_of, scoring_of
from rope_quant.sweep.cellkind import identity_fields, run_of
from rope_quant.sweep.claim_store import DirectoryStore
from rope_quant.sweep.loaded_models import ModelCache
from tests._support.models import ByteTokenizer

SEEDS = (0, 1)
FLAGS = ["--seqlen", "64", "--calib-windows", "1", "--eval-windows", "1", "--weights", "rtn", "--whip-epochs", "1",
         "--quiet"]


def _config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=8192)


def _base(*_: Any) -> tuple[Any, Any]:
    """The same random weights at every call (what the CLI's model cache loads and what the front holds)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(_config()).eval(), ByteTokenizer()


def _front_cell(claim_cell: Any, run: Any, exp: Any) -> Any:
    """The claim's cell as the front must be given it to build ``run``: the cell's overrides plus every setting in
    which the CLI's comparator differs from the front's base config (the CLI's flags), scored the same way."""
    mine = run.flat()
    theirs = exp.config(run.seed).flat()
    skip = {"seed", "eval_windows", *identity_fields(run)}
    base = {k: v for k, v in mine.items() if k not in skip and v != theirs.get(k)}
    return cell(scoring_of(claim_cell), length_of(claim_cell), **{**base, **overrides_of(claim_cell)})


def test_the_cli_and_the_pytest_front_give_equal_support_and_long_values(tmp_path: Path) -> None:
    from tests._support.registry_front import ExperimentStore
    from tests.e2e.conftest import E2EBudget, Experiment

    model_dir = tmp_path / "tiny"
    _config().save_pretrained(model_dir)
    out = tmp_path / "cli"
    argv = ["claims", "--model", str(model_dir), "--out", str(out), "--claims", "C4-ppl,C7",
            "--seeds", ",".join(map(str, SEEDS)), *FLAGS]
    assert cli.main(argv, models=ModelCache(_base)) == 0
    store = DirectoryStore(out)

    budget = E2EBudget(seeds=SEEDS, seqlen=64, calib_windows=1, eval_windows=1, replicates=0)
    exp = Experiment(_base(), str(tmp_path / "front-cache"), budget, "pydoc", model=str(model_dir))
    front = ExperimentStore(exp)
    assert (budget.support_windows, budget.long_windows) == (store.scoring.support_windows,
                                                            store.scoring.long_windows)
    cells = {"C4-ppl b=2": registry.get("C4-ppl").cells["b=2"],
             "C7 pairwise_only L=1024": registry.get("C7").cells["pairwise_only L=1024"]}
    for what, claim_cell in cells.items():
        configs = [store.config(claim_cell, s) for s in SEEDS]
        given = _front_cell(claim_cell, run_of(configs[0]), exp)
        for seed, cfg in zip(SEEDS, configs, strict=True):  # the same config: every setting but the content ids
            front_run = exp.config(seed, **front._overrides(given))
            ids = set(identity_fields(run_of(cfg)))
            assert {k: v for k, v in front_run.flat().items() if k not in ids} == \
                   {k: v for k, v in run_of(cfg).flat().items() if k not in ids}, what
        cli_values = store.values(claim_cell, SEEDS)
        front_values = front.values(given, SEEDS)
        assert cli_values == front_values, (what, cli_values, front_values)
        assert len(set(cli_values)) == len(SEEDS) and all(v > 1 for v in cli_values), cli_values  # scored, per seed
        assert front.tokens(given) == store.tokens(claim_cell), what
    rows = {r["id"] for r in json.loads((out / "claims.json").read_text())["claims"]}
    assert rows == {"C4-ppl", "C7", "C4-K", "A1-whip"}  # C4-K reads C4-ppl's cells, A1-whip the comparator's


def test_the_cli_and_the_pytest_front_give_equal_static_and_niah_values(tmp_path: Path) -> None:
    """App. D's static cells and App. G's NIAH cells (the quantised model's and FP's) through ``rope-quant claims``
    and through the front: one config per cell and seed, equal values, the CLI's rows read from them."""
    from tests._support.registry_front import ExperimentStore
    from tests.e2e.conftest import E2EBudget, Experiment

    model_dir = tmp_path / "tiny"
    _config().save_pretrained(model_dir)
    out = tmp_path / "cli"
    sizes = {"static_windows": 2, "static_eval_windows": 1, "niah_length": 512, "niah_probes": 1}
    argv = ["claims", "--model", str(model_dir), "--out", str(out), "--claims", "App-D,App-G",
            "--seeds", ",".join(map(str, SEEDS)), *FLAGS,
            *[a for k, v in sizes.items() for a in (f"--{k.replace('_', '-')}", str(v))]]
    assert cli.main(argv, models=ModelCache(_base)) == 0
    store = DirectoryStore(out)
    budget = E2EBudget(seeds=SEEDS, seqlen=64, calib_windows=1, eval_windows=1, replicates=0, **sizes)
    exp = Experiment(_base(), str(tmp_path / "front-cache"), budget, "pydoc", model=str(model_dir))
    front = ExperimentStore(exp)
    assert front.scoring() == store.scoring
    for claim_id, name, metric in (("App-D", "pairwise_only", "ppl"), ("App-G", "hadamard", "accuracy"),
                                   ("App-G", "fp", "accuracy")):
        claim_cell = registry.get(claim_id).cells[name]
        given = _front_cell(claim_cell, run_of(store.config(claim_cell, SEEDS[0])), exp)
        for seed in SEEDS:  # the same config: every setting but the content ids (the CLI resolves them)
            mine, theirs = front._swept(given, seed).to_dict(), store.config(claim_cell, seed).to_dict()
            ids = set(identity_fields(run_of(store.config(claim_cell, seed))))
            for d in (mine, theirs):
                d["run"] = {k: v for k, v in d["run"].items() if k not in ids}
            assert mine == theirs, (claim_id, name)
        cli_values = store.values(claim_cell, SEEDS, metric)
        assert cli_values == front.values(given, SEEDS, metric), (claim_id, name, cli_values)
        assert front.tokens(given) == store.tokens(claim_cell), (claim_id, name)
        if metric == "ppl":
            assert len(set(cli_values)) == len(SEEDS) and all(v > 1 for v in cli_values), cli_values
        else:
            assert all(0.0 <= v <= 1.0 for v in cli_values), cli_values
    rows = {r["id"]: r for r in json.loads((out / "claims.json").read_text())["claims"]}
    assert set(rows) >= {"App-D", "App-G"}
    assert "missing cell" not in rows["App-D"]["verdict"] + rows["App-G"]["verdict"]


def test_the_cli_defaults_are_the_pytest_fronts_sizes() -> None:
    """``rope-quant claims``'s default support and long-context sizes are the e2e budget's and the registry
    fronts' (tests/e2e/conftest.py ``E2EBudget``, tests/_support/registry_front.py ``FrontProtocol``)."""
    from rope_quant.sweep.claim_scoring import ScoringBudget
    from tests._support.registry_front import PAPER
    from tests.e2e.conftest import E2EBudget

    cli_sizes, e2e = ScoringBudget(), E2EBudget()
    assert (cli_sizes.support_windows, cli_sizes.long_windows, cli_sizes.long_corpus) == (
        e2e.support_windows, e2e.long_windows, e2e.long_corpus) == (PAPER.support_windows, PAPER.long_windows,
                                                                   "shakespeare")


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

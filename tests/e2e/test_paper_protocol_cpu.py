"""``gpu_e2e``'s parametrization on the CPU: the paper's protocol cut to a tiny budget, on a random-weight paper shape.

The path of ``pytest -m gpu_e2e`` (tests/e2e/test_gpu_claims.py), with the device ``cpu``: the protocol object
(:data:`~tests._support.registry_front.PAPER`, cut to 2 × 128 calibration tokens and 2 scored windows of 128;
seeds 0 and 1, each with its float-order replicate), the front (:func:`~tests._support.registry_front.open_front`:
premises and model-dependent values from the config, equal bits per key element at T = 128, the plan of the claims
table before the model loads, the paired experiment), the store, the engine and the claims row
(:func:`~tests._support.registry_front.decide_claim`). The model is Llama-3-8B's published shape
(head_dim 128, 4 query heads per KV head, RoPE base 5e5) narrowed to 4 query heads and cut to 2 layers and a
1024-row vocabulary, random weights, saved as a checkpoint with a pydoc-trained tokenizer.

Random weights decide nothing about the paper: the verdicts are read, not asserted. Asserted: the plan is printed
before the model loads and names the table; each claim's row is the engine's verdict over the cells the paper's
protocol defines at this budget (re-read independently through a memory store, C3 with its replicates), and the
plugin's claims JSON of that row names the model with the fingerprint of its files, the protocol and the device;
a claim whose premise the shape lacks (C4's head_dim 64) skips with its reason.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any

import pytest

from rope_quant.analysis import claims_report
from rope_quant.claims import engine, registry
from rope_quant.claims.registry import overrides_of
from rope_quant.claims.stores import MemoryStore
from rope_quant.experiment.identity import corpus_identity, model_identity
from rope_quant.pytest_plugin import RQOptions
from tests._support.registry_front import PAPER, Front, decide_claim, open_front

CPU_PAPER = replace(PAPER, name="paper, cut to a CPU budget", seqlen=128, calib_windows=2, eval_windows=2)
"""The paper's protocol object at a CPU budget (a few hundred tokens)."""
SEEDS = (0, 1)
CLAIMS = ("C1", "C8", "C3")
"""C1 and C8: parts without sampling error; C3: a paired part, read with the seeds' float-order replicates."""
SHAPE, LAYERS, HEADS, VOCAB = "llama-3-8b", 2, 4, 1024


@pytest.fixture(scope="module")
def cpu_front(tmp_path_factory, experiment_factory) -> tuple[Front, list[str]]:
    """The front of the narrowed shape on the CPU, and the order of events (the plan printed, the model loaded)."""
    from rope_quant.model import loading
    from tests._support.models import save_shape_checkpoint

    Experiment, E2EBudget = experiment_factory  # noqa: N806 (classes)
    ckpt = save_shape_checkpoint(tmp_path_factory.mktemp("shape") / f"{SHAPE}-narrow", SHAPE, LAYERS, VOCAB,
                                 heads=HEADS)
    events: list[str] = []
    load = loading.load_model
    options = RQOptions()  # the session's --rq-* options do not resize this test
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loading, "load_model", lambda *a, **k: events.append("load") or load(*a, **k))
        front = open_front(str(ckpt), "cpu", CPU_PAPER.budget(E2EBudget, options, SEEDS), corpus=options.corpus,
                           experiment_cls=Experiment, cache=str(tmp_path_factory.mktemp("cache")),
                           rq_options=options, protocol=CPU_PAPER.name, missing=pytest.fail,
                           log=lambda line: events.append("plan: " + line))
    return front, events


def test_the_plan_of_the_table_comes_before_the_model(cpu_front) -> None:
    front, events = cpu_front
    assert [e.split(":")[0] for e in events] == ["plan", "load"], events
    text = events[0]
    for needle in (f"registry claims plan: {front.model} on cpu, protocol {CPU_PAPER.name} (2 x 128 calibration",
                   "2 evaluation windows), seeds 0,1 (2 replicated in the other float order)",
                   "claims that run: C1, C2, C3,",
                   f"claims skipped: C4-ppl: model {front.model} lacks a premise: head_dim_64: head_dim 128",
                   "| GPTQ |", "| whip R1 |", "total: "):
        assert needle in text, (needle, text)


@pytest.mark.parametrize("claim_id", CLAIMS)
def test_a_registry_claim_on_the_paper_path(cpu_front, claim_id: str, rq_claim, rq_run, request) -> None:
    """The claim decided on the front, recorded as a claims row with its run; the same verdict from the cells
    re-read; the row and the run in the plugin's claims JSON."""
    front, _ = cpu_front
    exp = front.exp
    verdict, result = decide_claim(front, claim_id, rq_claim, rq_run)
    claim = registry.get(claim_id)
    assert result.seeds == SEEDS and result.rule == engine.RULE_FIXED
    if claim_id != "C3":  # parts without sampling error: decided either way
        assert verdict.outcome.value in ("holds", "fails")
    cfg = exp.config(0, r3="hadamard")
    assert (cfg.budget.seqlen, cfg.budget.calib_windows, cfg.budget.eval_windows) == (128, 2, 2)
    flat = cfg.flat()
    assert (flat["weights"], flat["r1"], flat["r2"], flat["r4"], flat["device"]) == (
        "gptq", "whip", "random_hadamard", True, "cpu")
    assert (flat["w_bits"], flat["a_bits"], flat["k_bits"], flat["v_bits"]) == (4, 4, 4, 4)
    store = MemoryStore(tokens=2 * 127)  # the scored tokens, as the front reads them from a cell's n_tokens
    for name in claim.cell_names():
        ov = overrides_of(claim.cells[name])
        for metric in {p.metric.value for p in claim.parts}:
            for seed in SEEDS:
                cell = exp.cell(seed, **ov)
                assert cell["n_tokens"] == 2 * 127, cell  # 2 windows of 128: 127 next-token predictions each
                assert math.isfinite(cell[metric])
                store.put(claim.cells[name], seed, cell[metric], metric=metric)
            if claim_id == "C3":  # every seed rebuilt with GPTQ in float64
                reps = exp.over_replicates(lambda seed, rep, ov=ov, m=metric: exp.cell(seed, **ov, **rep)[m])
                assert isinstance(reps, dict) and sorted(reps) == [0, 1], reps
                for index, value in reps.items():
                    store.put(claim.cells[name], SEEDS[index], value, metric=metric, replicate=True)
    again = engine.evaluate(claim, store, SEEDS)
    assert again.verdict.to_dict() == result.verdict.to_dict()
    rows = [v for k, v in request.node.user_properties if k == "rq_claim"]
    assert len(rows) == 1 and rows[0]["claim"] == claim.title and rows[0]["model"] == front.model
    assert rows[0]["decision"] == json.loads(json.dumps(verdict.to_dict()))
    numbers: dict[str, Any] = rows[0]["numbers"]
    assert set(numbers) == {p.name for p in claim.parts}
    assert all(len(n["treatment"]) == len(SEEDS) for n in numbers.values())
    if claim_id == "C3":
        assert numbers["ppl(k_only) − ppl(rows) < 0"]["replicates"].keys() == {"0", "1"}
        assert rows[0]["decision"]["float_order"]["k"] == 2
    payload = claims_json(request.node.user_properties)
    assert [(r["id"], r["model"], r["outcome"]) for r in payload["claims"]] == [(claim_id, front.model, "passed")]
    assert payload["model"] == {"name": front.model, "fingerprint": model_identity(front.model),
                                "fingerprint_basis": claims_report.FINGERPRINT_BASIS}
    assert payload["protocol"]["name"] == CPU_PAPER.name and payload["protocol"]["seeds"] == list(SEEDS)
    assert (payload["protocol"]["calibration_tokens"], payload["protocol"]["eval_tokens"]) == (256, 256)
    assert payload["protocol"]["corpus_id"] == corpus_identity("pydoc") and payload["device"]["requested"] == "cpu"
    assert payload["runs"] == [{k: payload[k] for k in claims_report.RUN_KEYS}]
    # a check of the path on random weights, not a measurement: its row stays out of the session's claims table
    request.node.user_properties[:] = [(k, v) for k, v in request.node.user_properties
                                       if k not in ("rq_claim", "rq_run")]


def claims_json(user_properties: list[tuple[str, Any]]) -> dict[str, Any]:
    """The plugin's claims JSON of one passed test with these report properties (its collector, fed one report)."""
    from types import SimpleNamespace

    from rope_quant import pytest_plugin

    collector = pytest_plugin._Collector()
    collector.pytest_runtest_logreport(SimpleNamespace(when="call", outcome="passed", skipped=False,
                                                       user_properties=user_properties))
    return json.loads(json.dumps(collector.payload()))


def test_a_claim_whose_premise_the_shape_lacks_skips_with_the_reason(cpu_front, rq_claim, rq_run) -> None:
    front, _ = cpu_front
    with pytest.raises(pytest.skip.Exception, match="C4-ppl on .*: model .* lacks a premise: "
                                                   r"head_dim_64: head_dim 128"):
        decide_claim(front, "C4-ppl", rq_claim, rq_run)

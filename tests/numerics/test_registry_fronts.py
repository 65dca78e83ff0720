"""The registry fronts (tests/_support/registry_front.py) before any model loads, and ``gpu_e2e``'s collection.

The plan of a checkpoint's whole claims table is made from its config alone: the claims that run and those that
skip (each adapted to the model's facts: the key claims' G = head_dim, mean width and best foldable R3 resolved,
their equal bits per key element checked at the budget's T, unequal bits refused before anything else), the cells
and weight builds of every claim at the seeds (float-order replicates included), the long-context cells at their
lengths; it is printed before the model loads, and a table that does not fit this machine is refused with the
plan's remedy. ``pytest -m gpu_e2e --collect-only`` lists one test per registry claim per model,
each model's in a row (its front is built once), and skips them without CUDA with the reason.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rope_quant.claims import registry, selection
from rope_quant.claims.premises import facts_of_checkpoint
from rope_quant.claims.registry import Claim, MarginRule, Part, cell
from rope_quant.core.verdict import Form
from rope_quant.planning import memory_check
from rope_quant.pytest_plugin import RQOptions
from tests._support.registry_front import open_front, table_configs

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m"  # embedded: its config is read without its weights


def _budget(seeds: tuple[int, ...] = (0, 1, 2)) -> Any:
    """The fields of the e2e suite's E2EBudget the front reads (its CPU defaults)."""
    return SimpleNamespace(seeds=seeds, replicates=len(seeds), seqlen=512, calib_windows=16, eval_windows=12,
                           support_windows=3, long_windows=1, gptq_float64=False)


def table_cells(model: str, corpus: str, device: str, budget: Any, claims: list[Claim]
                ) -> tuple[set[str], set[str], dict[int, int]]:
    """The front's table counted: its short-context cell keys, its weight builds and its cells per long-context L."""
    from rope_quant.claims.registry import Scoring

    configs = table_configs(model, corpus, device, budget, claims)
    lengths: dict[int, int] = {}
    for c in configs:
        if c.scoring is Scoring.LONG:
            lengths[int(c.length)] = lengths.get(int(c.length), 0) + 1
    return ({c.config.key() for c in configs if c.scoring is not Scoring.LONG},
            {c.config.weight_key() for c in configs}, lengths)


class Loaded(Exception):
    """Raised in place of loading the model: the plan has been made by then."""


def _front(monkeypatch: pytest.MonkeyPatch, lines: list[str], claims: list[Claim] | None = None,
           selected: list[str] | None = None) -> Any:
    from rope_quant.model import loading

    def refuse(*_: Any, **__: Any) -> Any:
        lines.append("load")
        raise Loaded

    monkeypatch.setattr(loading, "load_model", refuse)
    return open_front(MODEL, "cpu", _budget(), corpus="pydoc", experiment_cls=None, cache="unused",
                      rq_options=RQOptions(), protocol="e2e CPU budget", log=lines.append, claims=claims,
                      selected=selected)


def test_the_plan_of_the_whole_table_is_printed_before_the_model_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every claim runs on SmolLM2 (head_dim 64, R1 folds), the paper's and the key quantisers'; the builds are
    seeds × bit settings (App. F's three, and the key claims' unquantised weights) × float order (GPTQ's
    cells only: unquantised weights have no float-order step); C7's
    cells are planned at their lengths, one window each."""
    lines: list[str] = []
    with pytest.raises(Loaded):
        _front(monkeypatch, lines)
    assert len(lines) == 2 and lines[1] == "load", lines
    text = lines[0]
    assert f"registry claims plan: {MODEL} on cpu, protocol e2e CPU budget (16 x 512 calibration tokens" in text
    assert "claims that run: " + ", ".join(c.id for c in registry.claims()) in text and "skipped" not in text
    assert {registry.PAPER, registry.KEYS} <= {c.group for c in registry.claims()}
    # the paper's 120 short-context cells and 18 builds, the key claims' 108 and 9 (the next test),
    # sharing W4A4KV4's per-token reference (3 seeds x 2 float orders) and W4A4KV4's 6 builds
    # 222 of the paper and key claims, 12 of the llama.cpp claims (4 KV-only configs x 3 seeds), 6 of C4-ends
    # (pair_h2 on support windows and b=64 on 4-bit keys alone, 3 seeds each, no replicate: deterministic parts;
    # hadamard on 4-bit keys alone is the key claims' reference), 30 and 3 builds of App. I's (claims/cross_model.py:
    # per seed pairwise_only and k_only on 4-bit keys alone, C4's 6 blocks there on support windows, and W4A16KV4's
    # hadamard and pairwise_only, one GPTQ build without a replicate: every-seed parts), 6 and 3 builds of
    # beyond-learned (learned_orthogonal and hadamard on 4-bit keys alone as the foldable rows were measured: GPTQ's
    # weight mode at 16 bits, a build of its own per seed)
    assert "cells: 276 short-context cells over 27 weight builds (seed x bits x float order)" in text, text
    for length in (1024, 4096, 8192):
        row = next(line for line in text.splitlines() if line.startswith(f"| long context L={length} |"))
        assert row.endswith("| 12 |"), row  # 2 cells x 3 seeds x 2 float orders, one window each
    assert "| GPTQ |" in text and "total: " in text
    assert "collected here:" not in text  # every claim collected: nothing to name


def test_the_plan_names_the_claims_a_session_selects(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``-k`` choosing two claims the plan stays the whole table's and names the two collected."""
    lines: list[str] = []
    with pytest.raises(Loaded):
        _front(monkeypatch, lines, selected=["C1", "K-kivi-id-KV4", "not-a-claim"])
    total = len(registry.claims())
    assert f"collected here: 2 of the {total} (the plan below is the whole table's): C1, K-kivi-id-KV4" in lines[0]
    assert "cells: 276 short-context cells" in lines[0]


def test_the_key_claims_resolve_from_the_config_and_count_their_cells() -> None:
    """Before any model loads, the front's table holds each key claim resolved on SmolLM2's config (G = head_dim
    = 64, the mean width 4 − 32/64, the best foldable R3 of an architecture without q/k norms); its cells are told
    apart by their key quantiser: 8 schemes and 4 references per setting (the per-token rule, on KVQuant's groups,
    with sinks, on KIVI's tokens),
    each at 3 seeds, × 2 float orders under W4A4KV4 (GPTQ's); 4-bit keys alone has unquantised weights, so
    no float-order replicate and one build per seed."""
    facts = facts_of_checkpoint(MODEL)
    table = selection.table(registry.claims(registry.KEYS), facts, _budget().seqlen)
    assert list(table) == list(registry.active().ids(registry.KEYS)) and len(table) == 16
    kvquant, pairbits, fold = (table[i] for i in ("K-kvquant-id-KV4", "K-pairbits-id-W4A4KV4", "K-kivi-fold-KV4"))
    assert isinstance(kvquant, Claim) and isinstance(pairbits, Claim) and isinstance(fold, Claim)
    assert kvquant.cells["scheme"]["k_token_group"] == 64 and not kvquant.unresolved()
    assert pairbits.cells["scheme"]["k_avg_bits"] == 4 - 32 / 64
    assert fold.cells["scheme"]["r3"] == "pairwise_scaled" and fold.cells["scheme"]["k_residual"] == 64
    keys_, builds, lengths = table_cells(MODEL, "pydoc", "cpu", _budget(), [c for c in table.values()
                                                                          if isinstance(c, Claim)])
    assert kvquant.cells["reference"]["k_quant"] == "per_token_window" and kvquant.cells["reference"]["k_residual"] == 0
    assert (len(keys_), len(builds), lengths) == (12 * 3 + 12 * 3 * 2, 3 + 3 * 2, {})


def test_unequal_bits_fail_the_front_before_the_plan_and_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """A claim at equal bits whose cells store unequal bits at the budget's T (G = 32 at d = 64: 5 bits against the
    per-token rule's 4.5) fails the front naming the cells and their bits: no plan printed, no model loaded."""
    unequal = Claim("X-unequal", "x", "unequal bits", "nowhere",
                    {"scheme": cell(k_quant="kvquant_prerope", k_token_group=32), "reference": cell(r3="hadamard")},
                    (Part("p", "scheme", "reference", Form.NON_SUPERIOR, margin=MarginRule.equivalence("reference")),),
                    group=registry.KEYS, equal_bits=True)
    lines: list[str] = []
    with pytest.raises(pytest.fail.Exception, match=rf"{MODEL}: claim X-unequal, part 'p'.*at head_dim 64, T = 512 "
                                                    r".*scheme \{k_quant=kvquant_prerope, k_token_group=32\}: 5 bits"):
        _front(monkeypatch, lines, claims=[registry.get("K-kvquant-id-KV4"), unequal])
    assert lines == []


def test_a_table_that_does_not_fit_is_refused_with_the_remedy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(memory_check.ENV_HOST, "0.01")  # 10 MiB of host RAM
    lines: list[str] = []
    with pytest.raises(pytest.fail.Exception, match=rf"{MODEL} on cpu: the plan of the claims table does not fit "
                                                    r"this machine: stage '.*' needs .* GiB of host RAM, 0.0 GiB "
                                                    r"available: use a smaller --calib-windows"):
        _front(monkeypatch, lines)
    assert lines == []  # neither a plan printed as fitting nor a model loaded


def test_gpu_e2e_collects_one_test_per_registry_claim_per_model(tmp_path: Path) -> None:
    """``pytest -m gpu_e2e`` over two models (two Llama configs: ``--rq-model`` is checked before collection): each
    claim once per model, a model's claims in a row (collected, or run and each skipped without CUDA with the
    reason: one pytest process either way)."""
    import torch

    from tests._support.models import tiny_llama

    for name in ("a", "b"):
        tiny_llama().config.save_pretrained(tmp_path / name)
    cuda = torch.cuda.is_available()
    argv = [sys.executable, "-m", "pytest", "-m", "gpu_e2e", "tests/e2e/test_gpu_claims.py", "-p", "no:cacheprovider",
            f"--rq-model={tmp_path / 'a'}", f"--rq-model={tmp_path / 'b'}",
            *(["--collect-only", "-q"] if cuda else ["-v", "-rs"])]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    ids = [line.split("[", 1)[1].split("]", 1)[0] for line in out.stdout.splitlines()
           if line.startswith("tests/e2e/test_gpu_claims.py::test_gpu_registry_claim[")]
    assert ids == [f"{m}-{c.id}" for m in ("a", "b") for c in registry.claims()], out.stdout + out.stderr
    if not cuda:  # on a CUDA machine the run itself is the gpu_e2e layer's
        assert out.returncode == 0 and f"SKIPPED [{len(ids)}]" in out.stdout, out.stdout + out.stderr
        assert "gpu_e2e: CUDA is not available on this machine" in out.stdout


class _Exp:
    """The few members of the e2e suite's Experiment that ExperimentStore reads: a cell's ppl is 10 + its seed, plus
    1 when GPTQ runs in float64 (the replicate of a float32 cell)."""

    def __init__(self) -> None:
        self.budget = _budget((0, 1))
        self.replicate_seeds = (0, 1)
        self.built: list[Any] = []

    def config(self, seed: int = 0, **overrides: Any) -> Any:
        from rope_quant.experiment.config import RunConfig

        return RunConfig.from_flat(model=MODEL, seed=seed, seqlen=self.budget.seqlen, **overrides)

    def cell(self, seed: int, **overrides: Any) -> dict[str, float]:
        cfg = self.config(seed, **overrides)
        self.built.append(cfg)
        return {"ppl": 10.0 + seed + float(cfg.quant.w.gptq.float64)}

    def over_replicates(self, fn: Any) -> dict[int, Any]:
        from rope_quant.quant.rtn import GPTQConfig

        return {i: fn(s, {"gptq": GPTQConfig(float64=True)}) for i, s in enumerate(self.replicate_seeds)}


@pytest.mark.parametrize(("overrides", "kind"), [
    ({}, "rebuild"), ({"weights": "rtn"}, "none"), ({"weights": "none", "w_bits": 16}, "itself"),
    ({"w_bits": 16}, "itself")])
def test_every_front_reads_a_cells_replicate_by_the_one_rule(overrides: dict[str, Any], kind: str) -> None:
    """GPTQ weights: rebuilt in the other float mode; unquantised weights: the cell is its own replicate (a shift of
    0); RTN weights: none. The claims sweep's replicate cell (sweep/decide.py), the pytest front's store and its plan
    of the table's cells all follow experiment/replicate.py."""
    from rope_quant.experiment.replicate import Replicate, replicate_kind, replicate_overrides
    from rope_quant.sweep.decide import replicate_config
    from tests._support.registry_front import ExperimentStore

    exp = _Exp()
    cfg = exp.config(0, **overrides)
    assert replicate_kind(cfg) is Replicate(kind)
    rep = replicate_config(cfg)
    assert (rep is not None) == (kind == "rebuild")
    if rep is not None:
        assert rep.quant.w.gptq.float64 and rep.override(**replicate_overrides(rep)).key() == cfg.key()
    got = ExperimentStore(exp).replicates(cell(**overrides), (0, 1))
    assert got == {"rebuild": {0: 11.0, 1: 12.0}, "itself": {0: 10.0, 1: 11.0}, "none": None}[kind]
    claim = Claim("X", "x", "x", "x", {"t": cell(**overrides), "c": cell(r3="pairwise_only", **overrides)},
                  (Part("t < c", "t", "c", Form.LESS),))
    keys, builds, _ = table_cells(MODEL, "pydoc", "cpu", _budget((0, 1)), [claim])
    assert len(keys) == 4 * (2 if kind == "rebuild" else 1)  # 2 cells x 2 seeds, each with its rebuilt replicate


def test_a_left_out_claim_carries_its_kind_and_the_reason_both_fronts_print() -> None:
    """The table's left-out entries are typed: a claim scored by llama.cpp is not swept (``plain_only``, the CLI),
    one whose cells store unequal bits is not adapted (when nobody asked for it), one whose premise the model lacks
    is a premise; ``str()`` is the reason printed by the CLI and the pytest front alike."""
    facts = facts_of_checkpoint(MODEL)
    unequal = Claim("X-unequal", "x", "unequal bits", "nowhere",
                    {"scheme": cell(k_quant="kvquant_prerope", k_token_group=32), "reference": cell(r3="hadamard")},
                    (Part("p", "scheme", "reference", Form.NON_SUPERIOR, margin=MarginRule.equivalence("reference")),),
                    group=registry.KEYS, equal_bits=True)
    table = selection.table([registry.get("L1"), unequal], facts, 512, plain_only=True, requested=())
    runtime, adapted = table["L1"], table["X-unequal"]
    assert isinstance(runtime, selection.LeftOut) and runtime.kind is selection.LeftOutKind.NOT_SWEPT
    assert str(runtime).startswith("its cells are scored by llama.cpp")
    assert isinstance(adapted, selection.LeftOut) and adapted.kind is selection.LeftOutKind.NOT_ADAPTED
    assert str(adapted).startswith(f"it cannot be adapted to {MODEL}: claim X-unequal")
    from dataclasses import replace

    from rope_quant.claims.registry import Premise

    wide = replace(facts, premises={**facts.premises, Premise.HEAD_DIM_64: "head_dim 128"})
    premise = selection.table([registry.get("C4-ppl")], wide, 512)["C4-ppl"]
    assert isinstance(premise, selection.LeftOut) and premise.kind is selection.LeftOutKind.PREMISE
    assert str(premise).startswith(f"model {MODEL} lacks a premise: head_dim_64"), str(premise)

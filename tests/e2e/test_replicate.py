"""The numerical replicates of the e2e session (tests/e2e/conftest.py): the first k seeds, GPTQ in the other
float mode, every other field unchanged; no model needed."""

from __future__ import annotations

from typing import Any

import pytest


def _flat(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        return {k: v for key, val in obj.items() for k, v in _flat(val, f"{prefix}{key}.").items()}
    return {prefix[:-1]: obj}


def _diff(a: dict, b: dict) -> list[str]:
    fa, fb = _flat(a), _flat(b)
    return sorted(k for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k))


def test_replicate_flips_only_the_gptq_float_mode(experiment_factory) -> None:
    Experiment, E2EBudget = experiment_factory  # noqa: N806 (classes)
    for float64 in (False, True):
        exp = Experiment(None, "/nonexistent", E2EBudget(seeds=(4, 5), gptq_float64=float64, replicates=2), "pydoc")
        primary = exp.config(exp.replicate_seed, r3="hadamard")
        replicate = exp.config(exp.replicate_seed, **exp._replicate_overrides({"r3": "hadamard"}))
        assert exp.replicate_seed == 4
        assert primary.gptq.float64 is float64 and replicate.gptq.float64 is (not float64)
        assert _diff(primary.to_dict(), replicate.to_dict()) == ["quant.w.gptq.float64"]
        assert replicate.weight_key() != primary.weight_key() and replicate.key() != primary.key()
        assert exp.tokens() == 12 * 512 and exp.tokens(3) == 3 * 512


def test_replicates_are_the_first_k_seeds_and_k_is_checked(experiment_factory) -> None:
    Experiment, E2EBudget = experiment_factory  # noqa: N806 (classes)
    assert E2EBudget().replicates == 3  # the default: the noise and bias can be estimated
    exp = Experiment(None, "/nonexistent", E2EBudget(seeds=(4, 5, 6), replicates=2), "pydoc")
    assert exp.replicate_seeds == (4, 5)
    seen = exp.over_replicates(lambda seed, rep: (seed, rep["gptq"].float64))
    assert seen == {0: (4, True), 1: (5, True)}
    assert Experiment(None, "/x", E2EBudget(seeds=(4, 5), replicates=0), "pydoc").over_replicates(
        lambda seed, rep: seed) == {}
    assert E2EBudget.replicates_for(None, (7,)) == 1 and E2EBudget.replicates_for(None, (1, 2, 3)) == 3
    assert E2EBudget.replicates_for(None, (1, 2, 3, 4)) == 3
    assert E2EBudget.replicates_for(3, (1, 2, 3)) == 3
    for bad in (-1, 4):
        with pytest.raises(ValueError, match="--rq-replicates"):
            E2EBudget(seeds=(4, 5, 6), replicates=bad)


def test_a_replicate_that_fails_to_build_is_reported_not_raised(experiment_factory) -> None:
    Experiment, E2EBudget = experiment_factory  # noqa: N806 (classes)
    exp = Experiment(None, "/nonexistent", E2EBudget(seeds=(4, 5), replicates=2), "pydoc")

    def build(seed: int, rep: dict) -> float:
        if seed == 5:
            raise MemoryError("GPTQ float64 Hessian")
        return 1.0

    reason = exp.over_replicates(build)
    assert isinstance(reason, str) and "seed 5" in reason and "MemoryError: GPTQ float64 Hessian" in reason


def test_a_memoised_cell_is_computed_once_across_sessions_and_only_for_its_key(experiment_factory, tmp_path) -> None:
    """Experiment.memo: a second experiment on the same cache directory (a warm rerun, or a killed
    ``--rq-until-decided`` run resumed) reads the result back without computing it; another key, another model,
    another budget or another thread count computes; a corrupt memo file is recomputed and rewritten, never
    trusted."""
    import torch

    Experiment, E2EBudget = experiment_factory  # noqa: N806 (classes)
    calls: list[str] = []

    def compute(tag: str):
        return lambda: calls.append(tag) or {"ppl": float(len(calls)), "tag": tag}

    first = Experiment(None, str(tmp_path), E2EBudget(seeds=(0, 1, 2)), "pydoc")
    assert first.memo(("cell", 0), compute("a")) == {"ppl": 1.0, "tag": "a"}
    assert first.memo(("cell", 0), compute("again")) == {"ppl": 1.0, "tag": "a"} and calls == ["a"]
    resumed = Experiment(None, str(tmp_path), E2EBudget(seeds=(0, 1, 2, 3), replicates=4), "pydoc")
    assert resumed.memo(("cell", 0), compute("b"))["tag"] == "a" and calls == ["a"]
    assert resumed.memo(("cell", 1), compute("c"))["tag"] == "c"
    other_model = Experiment(None, str(tmp_path), E2EBudget(seeds=(0, 1, 2)), "pydoc", model="gemma-3-270m")
    assert other_model.memo(("cell", 0), compute("d"))["tag"] == "d"
    other_budget = Experiment(None, str(tmp_path), E2EBudget(seeds=(0, 1, 2), eval_windows=3), "pydoc")
    assert other_budget.memo(("cell", 0), compute("e"))["tag"] == "e" and calls == ["a", "c", "d", "e"]
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        more_threads = Experiment(None, str(tmp_path), E2EBudget(seeds=(0, 1, 2)), "pydoc")
        assert more_threads.memo(("cell", 0), compute("t"))["tag"] == "t"
    finally:
        torch.set_num_threads(threads)
    files = sorted((tmp_path / "cells-memo-v1").glob("*.pkl"))
    assert len(files) == 5
    for f in files:
        f.write_bytes(b"not a pickle")
    fresh = Experiment(None, str(tmp_path), E2EBudget(seeds=(0, 1, 2)), "pydoc")
    assert fresh.memo(("cell", 0), compute("f"))["tag"] == "f"
    assert Experiment(None, str(tmp_path), E2EBudget(seeds=(0, 1, 2)), "pydoc").memo(
        ("cell", 0), compute("g"))["tag"] == "f"


CHEAP = dict(weights="none", w_bits=16, r1="random_hadamard")


def test_r3_variants_of_a_seed_share_one_build_and_equal_a_fresh_one(experiment_factory, embedded_model,
                                                                      tmp_path) -> None:
    """Experiment.quantized: the second R3 variant of a seed reconfigures the first one's model in place (one
    build), and its cell equals a fresh build's to every bit (perplexity, per-window NLL, K diagnostics); other
    weights build anew and both stay kept. Unquantised weights, a random-Hadamard R1 and short windows keep the
    builds cheap; GPTQ and whip cells reuse the same way (the reuse key is the weights' and the statistics' keys)."""
    from rope_quant.experiment.pipeline import run_cell

    Experiment, E2EBudget = experiment_factory  # noqa: N806 (classes)
    budget = E2EBudget(seeds=(0,), replicates=0, seqlen=256, calib_windows=1, eval_windows=2)
    exp = Experiment(embedded_model, str(tmp_path), budget, "pydoc")
    exp.cell(0, r3="pairwise_only", **CHEAP)
    reused = exp.cell(0, r3="hadamard", **CHEAP)
    assert len(exp._models) == 1
    fresh = run_cell(exp.config(0, r3="hadamard", **CHEAP), cache_dir=str(tmp_path / "fresh"),
                     base=embedded_model)
    differ = sorted(k for k in fresh if k not in ("timing", "weight_cache_hit") and fresh[k] != reused[k])
    assert differ == [] and reused["ppl"] == fresh["ppl"] and reused["window_nll"] == fresh["window_nll"]
    exp.cell(1, r3="hadamard", **CHEAP)
    assert len(exp._models) == 2


def test_the_memo_digest_reads_the_code_that_computes_cells_and_no_assertion_module() -> None:
    """The cell memo's key (``source_digest``) covers every ``rope_quant`` module and every test module that hands
    ``memo`` a cell's computation, and leaves out the modules that select cells by overrides (held in the key)
    and assert on them: editing a claim's assertion must not recompute an hour of cells."""
    import re
    from pathlib import Path

    import rope_quant
    from tests.e2e import conftest

    sources = conftest.digest_sources()
    package = Path(rope_quant.__file__).parent
    assert {p for p in sources.values() if p.is_relative_to(package)} == set(package.rglob("*.py"))
    here = Path(conftest.__file__).resolve().parent
    repo = here.parents[1]
    computing = {str(p.relative_to(repo)) for p in [*here.glob("*.py"), *(repo / "tests/_support").glob("*.py")]
                 if re.search(r"\.memo\(", p.read_text()) and p.name != "test_replicate.py"}
    named = {name for name in sources if name.startswith("tests/")}
    assert computing <= named, computing - named
    assert "tests/e2e/test_claims.py" not in named and "tests/e2e/test_registry_claims.py" not in named
    assert all(sources[name].is_file() for name in named)

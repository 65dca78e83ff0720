"""The llama.cpp claims (rope_quant/claims/runtime.py) as registry entries: their cells, the relative margin of L3,
the K cache type a runtime cell asks llama.cpp for, and the engine deciding them over a store."""

from __future__ import annotations

import pytest

from rope_quant.claims import registry
from rope_quant.claims.engine import evaluate
from rope_quant.claims.registry import ClaimError, MarginRule, Scoring, scoring_of
from rope_quant.claims.runtime import CELLS, L3_TOLERANCE, RUNTIME_CLAIMS, RUNTIME_GROUP
from rope_quant.claims.stores import MemoryStore
from rope_quant.core.verdict import Outcome
from rope_quant.experiment.config import RunConfig
from rope_quant.runtime.cells import k_cache_type
from rope_quant.runtime.llamacpp import KCacheType, LlamaCppError


def test_the_runtime_entries_are_registered_slow_in_their_group():
    ids = registry.active().ids(RUNTIME_GROUP)
    assert ids == ("L1", "L2", "L3", "L1-sim", "L2-sim")
    assert all(c.slow for c in RUNTIME_CLAIMS)
    scored = {c.id: {scoring_of(cell) for cell in c.cells.values()} for c in RUNTIME_CLAIMS}
    assert scored["L1"] == scored["L2"] == {Scoring.RUNTIME}
    assert scored["L1-sim"] == scored["L2-sim"] == {Scoring.EVAL}
    assert scored["L3"] == {Scoring.RUNTIME, Scoring.EVAL}


def test_each_cell_builds_a_config_the_runtime_can_score():
    for name, (_r3, rotation) in CELLS.items():
        flat = {k: v for k, v in registry.get("L1").cells[name].items() if k != registry.SCORING}
        if not isinstance(flat["r3"], str) or flat["r3"].startswith("<"):
            flat["r3"] = "pairwise_only"  # the best foldable R3 is resolved per model (premises.adapt)
        cfg = RunConfig.from_flat(**flat)
        assert k_cache_type(cfg) is KCacheType.Q4_0
        assert cfg.online.runtime_rotation is rotation


def test_a_key_quantiser_llama_cpp_lacks_is_refused():
    with pytest.raises(LlamaCppError, match="not a K cache type of llama.cpp"):
        k_cache_type(RunConfig.from_flat(k_bits=4))
    assert k_cache_type(RunConfig.from_flat(k_bits=16)) is KCacheType.F16


def test_a_relative_margin_needs_a_comparator_and_a_positive_share():
    with pytest.raises(ClaimError, match="relative margin"):
        MarginRule.relative("", 0.02)
    with pytest.raises(ClaimError, match="relative margin"):
        MarginRule.relative("rt_on", 0.0)


def _adapted(claim_id: str) -> registry.Claim:
    from rope_quant.claims.premises import adapt, read_checkpoint

    got = adapt(registry.get(claim_id), read_checkpoint("smollm2-135m"), seq_len=512)
    assert not isinstance(got, str), got
    return got


def _store(values: dict[str, list[float]]) -> MemoryStore:
    store = MemoryStore(tokens=4096)
    for claim in map(_adapted, ("L1", "L2", "L3", "L1-sim", "L2-sim")):
        for name, cell in claim.cells.items():
            key = name.removeprefix("rt_").removeprefix("sim_")
            src = values[f"sim_{key}"] if name.startswith("sim_") or claim.id.endswith("-sim") else values[key]
            store.put_seeds(cell, [0, 1, 2], src, replicates={s: v for s, v in zip([0, 1, 2], src, strict=True)})
    return store


def test_the_engine_decides_l1_and_reads_l3_within_its_share():
    """The runtime's q4_0 cells (SmolLM2-like numbers) and simulated twins 1% off: L1 holds, L3 holds; twins 5%
    off: L3 is refuted (outside the 2% margin in every seed)."""
    rt = {"off": [14.5, 14.5, 14.5], "on": [12.6, 12.6, 12.6], "fold_off": [14.0, 14.1, 13.9],
          "fold_on": [12.5, 12.55, 12.52]}
    near = {f"sim_{k}": [x * 1.01 for x in v] for k, v in rt.items()}
    far = {f"sim_{k}": [x * 1.05 for x in v] for k, v in rt.items()}
    l1, l3 = _adapted("L1"), _adapted("L3")
    assert evaluate(l1, _store({**rt, **near}), [0, 1, 2]).verdict.outcome is Outcome.HOLDS
    assert evaluate(l3, _store({**rt, **near}), [0, 1, 2]).verdict.outcome is Outcome.HOLDS
    far_result = evaluate(l3, _store({**rt, **far}), [0, 1, 2])
    assert far_result.verdict.outcome is Outcome.REFUTED
    margin = far_result.parts[0].margin
    assert margin is not None and margin.value == pytest.approx(L3_TOLERANCE * 14.5)


def test_the_figure_reads_each_cell_of_l3_and_the_verdicts_of_its_model(tmp_path):
    """The figure's panel holds L3's per-seed numbers per cell (llama.cpp's as control, the simulator's as
    treatment) and the outcomes of L1–L3 of the same model; a JSON without L3 is refused with what to run."""
    import json

    from rope_quant.analysis.llamacpp_figure import llamacpp_figure, plot_llamacpp, runtime_panels

    def row(cid, outcome, numbers=None):
        return {"id": cid, "model": "m", "decision": {"outcome": outcome}, "numbers": numbers or {}}

    numbers = {f"ppl_sim({c}) ≡ ppl_llama.cpp({c}) within 2%": {"treatment": [10.0 + i, 10.5 + i],
                                                                 "control": [11.0 + i, 11.0 + i]}
               for i, c in enumerate(CELLS)}
    rows = [row("L1", "holds"), row("L2", "refuted"), row("L3", "inconclusive", numbers)]
    rows[2]["claim"] = "llama.cpp: the simulator agrees [on llama: best foldable R3: r3=pairwise_scaled, estimator=x]"
    (panel,) = runtime_panels(rows)
    assert panel.runtime["fold_off"] == [13.0, 13.0] and panel.simulated["on"] == [11.0, 11.5]
    assert panel.verdicts == {"L1": "holds", "L2": "refuted", "L3": "inconclusive"}
    fig = llamacpp_figure([panel])
    assert fig.axes[0].get_title() == "m (foldable R3: pairwise_scaled)\nL1 holds, L2 refuted, L3 inconclusive"
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()][0] == "no R3\nrotation off"
    (tmp_path / "claims.json").write_text(json.dumps({"claims": rows}))
    assert plot_llamacpp([tmp_path], tmp_path / "f.png").stat().st_size > 0
    with pytest.raises(ValueError, match=r"no L3 row"):
        llamacpp_figure(runtime_panels(rows[:2]))

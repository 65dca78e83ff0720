"""The claims layer (rope_quant.claims): the registry, the in-memory store and the one engine, on synthetic cells.

The engine must give exactly the verdict that the rule gives when called by hand (fixed-n and sequential), combine
parts like ``combine_all``, decide a claim that is nothing but a registry entry, name a missing cell and seed,
and refuse a taken id. The stores hold made-up perplexities: seed effects shared by a seed's cells, a per-cell
effect, and a float-order shift per replicate, drawn from fixed generators.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from rope_quant.claims import engine, paper, registry
from rope_quant.claims.registry import (
    Claim,
    ClaimError,
    Diff,
    DuplicateClaimError,
    Level,
    MarginRule,
    Metric,
    Part,
    Scoring,
    Statistic,
    UnknownClaimError,
    cell,
)
from rope_quant.claims.stores import MemoryStore, MissingCellError
from rope_quant.core import sequential, verdict
from rope_quant.core.verdict import Form, Outcome

REPO = Path(__file__).resolve().parents[2]
SEEDS = (2, 3, 5, 8, 13)  # not 0 … n − 1: a seed is not its index
HAD = cell(r3="hadamard")
PW = cell(r3="pairwise_only")
PPH = cell(r3="pairwise_plus_hadamard")


def _series(seed: int, effect: float, n: int = len(SEEDS), sd: float = 0.05, base: float = 14.0) -> list[float]:
    shared = np.random.default_rng(1000).normal(0, 0.4, n)  # the seeds' own effect, the same for every cell
    own = np.random.default_rng(seed).normal(0, sd, n)
    return [float(x) for x in base + shared + effect + own]


def _fill(store: MemoryStore, c: Mapping, values: Sequence[float], *, replicated: int = len(SEEDS),
          shift: float = 0.0, seed: int = 7, metric: str = Metric.PPL) -> list[float]:
    """``values`` at SEEDS, the first ``replicated`` seeds' replicates moved by ``shift`` plus noise; returns the
    replicate values (one per replicated seed)."""
    reps = [v + shift + float(e) for v, e in
            zip(values[:replicated], np.random.default_rng(seed).normal(0, 0.02, replicated), strict=True)]
    store.put_seeds(c, SEEDS, values, metric=metric, replicates=dict(zip(SEEDS[:replicated], reps, strict=True)))
    return reps


def _claim(claim_id: str, *parts: Part, cells: Mapping | None = None) -> Claim:
    return Claim(claim_id, f"{claim_id} title", "a statement", "§test",
                 cells or {"hadamard": HAD, "pairwise_only": PW, "pairwise_plus_hadamard": PPH}, parts)


ROW_KEYS = ("claim", "model", "expected", "measured", "holds", "decision", "numbers", "parts", "verdict", "budget")
"""The claims JSON row's keys that the engine gives (rope_quant/pytest_plugin.py, ``rq_claim``)."""
EQUIV = Part("pph ≡ hadamard", "pairwise_plus_hadamard", "hadamard", Form.EQUIVALENT,
             margin=MarginRule.equivalence("hadamard"))


@pytest.fixture()
def cells() -> tuple[MemoryStore, dict[str, list[float]], dict[str, list[float]]]:
    """A store of three cells at five seeds (every seed replicated) and the values put in it."""
    store = MemoryStore(tokens=6144)
    values = {"hadamard": _series(1, 0.0), "pairwise_only": _series(2, 2.0), "pairwise_plus_hadamard": _series(3, 0.01)}
    reps = {name: _fill(store, c, values[name], seed=10 + i, shift=0.03 * i)
            for i, (name, c) in enumerate((("hadamard", HAD), ("pairwise_only", PW), ("pairwise_plus_hadamard", PPH)))}
    return store, values, reps


def test_the_fixed_n_engine_gives_the_rules_verdict(cells) -> None:
    """An equivalence with the scaled margin, and a sign with only the first three seeds replicated: each equals
    ``verdict.paired_claim`` called with the same numbers, margin, tokens and seed-index replicates."""
    store, values, reps = cells
    result = engine.evaluate(_claim("T-equiv", EQUIV), store, SEEDS)
    margin = verdict.equivalence_margin(float(np.mean(values["hadamard"])))
    direct = verdict.paired_claim(Form.EQUIVALENT, values["pairwise_plus_hadamard"], values["hadamard"],
                                  replicates={i: (reps["pairwise_plus_hadamard"][i], reps["hadamard"][i])
                                              for i in range(len(SEEDS))}, margin=margin.value, tokens=6144)
    assert result.verdict == direct and result.part_verdicts["pph ≡ hadamard"] == direct
    assert result.parts[0].margin == margin and result.rule == engine.RULE_FIXED
    assert direct.float_order is not None and direct.float_order.k == len(SEEDS)

    partial = MemoryStore()
    pw_reps = _fill(partial, PW, values["pairwise_only"], replicated=3, seed=21, shift=0.1)
    had_reps = _fill(partial, HAD, values["hadamard"], replicated=3, seed=22)
    sign = engine.evaluate(_claim("T-sign", Part("gap", "pairwise_only", "hadamard", Form.GREATER)), partial, SEEDS)
    expected = verdict.paired_claim(Form.GREATER, values["pairwise_only"], values["hadamard"],
                                    replicates={i: (pw_reps[i], had_reps[i]) for i in range(3)})
    assert sign.verdict == expected and expected.float_order is not None and expected.float_order.k == 3


def test_the_sequential_engine_gives_the_sequential_rules_verdict(cells) -> None:
    """With a plan the engine reads the sequential rule at look len(seeds), as ``sequential.paired_claim`` does
    with the plan of a claim of 2 sampled parts (its refuted side at α/2); at the first look and at a later one
    (where futility is judged)."""
    store, values, reps = cells
    claim = _claim("T-seq", EQUIV, Part("gap", "pairwise_only", "hadamard", Form.GREATER))
    margin = verdict.equivalence_margin(float(np.mean(values["hadamard"]))).value
    for plan, n in ((sequential.Plan(5, 12), 5), (sequential.Plan(3, 8), 5)):
        result = engine.evaluate(claim, store, SEEDS[:n], plan)
        plan = plan.with_parts(2)
        pairs = {i: (reps["pairwise_plus_hadamard"][i], reps["hadamard"][i]) for i in range(n)}
        equiv = sequential.paired_claim(Form.EQUIVALENT, values["pairwise_plus_hadamard"][:n], values["hadamard"][:n],
                                        plan, replicates=pairs, margin=margin, tokens=6144)
        gap = sequential.paired_claim(Form.GREATER, values["pairwise_only"][:n], values["hadamard"][:n], plan,
                                      replicates={i: (reps["pairwise_only"][i], reps["hadamard"][i]) for i in range(n)},
                                      tokens=6144)
        assert result.part_verdicts == {"pph ≡ hadamard": equiv, "gap": gap}
        assert result.verdict == verdict.combine_all([equiv, gap]) and result.rule == engine.RULE_SEQUENTIAL
        assert gap.rule == sequential.RULE_SEQUENTIAL and gap.outcome is Outcome.HOLDS and gap.parts == 2
        assert result.verdict.claim_error.startswith("≤ 5% per side for the claim")
    assert engine.evaluate(claim, store, SEEDS).verdict.rule != sequential.RULE_SEQUENTIAL  # no plan: fixed-n


def test_a_claim_of_three_parts_combines_like_combine_all(cells) -> None:
    """A deterministic part that holds, a decided sign and an undecided equivalence: the claim reads
    combine_all of the three (inconclusive with the undecided part's budget), and a failing deterministic part
    makes it fail."""
    store, values, reps = cells
    every = Part("pw > had every seed", "pairwise_only", "hadamard", Form.GREATER, Statistic.EVERY_SEED)
    gap = Part("gap", "pairwise_only", "hadamard", Form.GREATER)
    tight = Part("pph ≡ had (tight)", "pairwise_plus_hadamard", "hadamard", Form.EQUIVALENT,
                 margin=MarginRule.fixed(0.02))
    result = engine.evaluate(_claim("T-three", every, gap, tight), store, SEEDS)
    pairs = {name: {i: (reps[name][i], reps["hadamard"][i]) for i in range(len(SEEDS))}
             for name in ("pairwise_only", "pairwise_plus_hadamard")}
    direct = [verdict.deterministic(all(p > h for p, h in zip(values["pairwise_only"], values["hadamard"],
                                                                strict=True)),
                                    "ppl(pairwise_only) > ppl(hadamard) in every seed"),
              verdict.paired_claim(Form.GREATER, values["pairwise_only"], values["hadamard"],
                                   replicates=pairs["pairwise_only"], tokens=6144),
              verdict.paired_claim(Form.EQUIVALENT, values["pairwise_plus_hadamard"], values["hadamard"],
                                   replicates=pairs["pairwise_plus_hadamard"], margin=0.02, tokens=6144)]
    assert [v.outcome for v in direct] == [Outcome.HOLDS, Outcome.HOLDS, Outcome.INCONCLUSIVE]
    assert list(result.part_verdicts.values()) == direct
    assert result.verdict == verdict.combine_all(direct) and result.verdict.outcome is Outcome.INCONCLUSIVE
    assert result.verdict.budget is not None

    wrong_way = Part("had > pw every seed", "hadamard", "pairwise_only", Form.GREATER, Statistic.EVERY_SEED)
    failed = engine.evaluate(_claim("T-fail", gap, tight, wrong_way), store, SEEDS)
    assert failed.verdict.outcome is Outcome.FAILS and failed.verdict.failed


def test_a_new_claim_is_one_registry_entry(cells) -> None:
    """A claim registered in a temporary registry is found by id and decided by the engine with no other code;
    it is gone once the block ends, and the paper's entries are there inside and after."""
    store, values, _ = cells
    new = _claim("X-new-claim", Part("pph worse than had", "pairwise_plus_hadamard", "hadamard", Form.LESS),
                 Part("pw above had on average", "pairwise_only", "hadamard", Form.GREATER, Statistic.MEANS))
    with registry.temporary() as reg:
        registry.register(new)
        assert registry.get("X-new-claim") is new and reg.ids()[-1] == "X-new-claim"
        assert paper.PaperClaim.C2 in registry.active().ids()
        result = engine.evaluate(registry.get("X-new-claim"), store, SEEDS)
    assert result.id == "X-new-claim" and len(result.parts) == 2
    assert result.part_verdicts["pw above had on average"].outcome is Outcome.HOLDS
    assert result.parts[0].verdict.mean == pytest.approx(np.mean(values["pairwise_plus_hadamard"])
                                                         - np.mean(values["hadamard"]))
    with pytest.raises(UnknownClaimError, match="no claim 'X-new-claim'"):
        registry.get("X-new-claim")
    assert registry.get("C2") is paper.C2
    with registry.temporary(empty=True):
        assert registry.claims() == ()


def test_a_replicate_that_failed_or_does_not_exist_reaches_the_rule(cells) -> None:
    """A failed replicate's reason (on either side) and a cell without replicates are passed to the rule as
    ``verdict.paired_claim`` takes them: the claim reads inconclusive and says why."""
    store, values, _ = cells
    claim = _claim("T-rep", Part("gap", "pairwise_only", "hadamard", Form.GREATER))
    why = "replicate of seed 2 failed to build: RuntimeError: out of memory"
    store.replicate_failed(HAD, why)
    result = engine.evaluate(claim, store, SEEDS)
    direct = verdict.paired_claim(Form.GREATER, values["pairwise_only"], values["hadamard"], replicates=why,
                                  tokens=6144)
    assert result.verdict == direct and why in result.verdict.text() and result.parts[0].replicates == why
    bare = MemoryStore()
    bare.put_seeds(PW, SEEDS, values["pairwise_only"])
    bare.put_seeds(HAD, SEEDS, values["hadamard"])
    none = engine.evaluate(claim, bare, SEEDS)
    assert none.verdict == verdict.paired_claim(Form.GREATER, values["pairwise_only"], values["hadamard"],
                                                replicates=None)
    assert none.verdict.outcome is Outcome.INCONCLUSIVE and "no numerical replicate" in none.verdict.text()


def test_a_missing_cell_names_the_cell_and_the_seed(cells) -> None:
    store, values, _ = cells
    claim = _claim("T-missing", Part("k_only < rows", "k_only", "rows", Form.LESS),
                   cells={"k_only": cell(r3="pairwise_only", estimator="k_only"),
                          "rows": cell(r3="pairwise_only", estimator="rows")})
    partial = MemoryStore()
    partial.put_seeds(claim.cells["rows"], SEEDS, values["hadamard"])
    partial.put_seeds(claim.cells["k_only"], SEEDS[:3], values["pairwise_only"][:3])
    with pytest.raises(KeyError) as caught:
        engine.evaluate(claim, partial, SEEDS)
    assert isinstance(caught.value, MissingCellError) and caught.value.seed == 8
    assert str(caught.value) == "no ppl for cell {r3=pairwise_only, estimator=k_only} at seed 8"
    with pytest.raises(MissingCellError, match=r"no k_range_mean for cell \{r3=hadamard\} at seed 2"):
        store.values(HAD, SEEDS, Metric.K_RANGE_MEAN)


def test_the_registry_refuses_a_taken_id_and_a_malformed_claim() -> None:
    with registry.temporary():
        with pytest.raises(DuplicateClaimError, match="'C2' is already registered"):
            registry.register(_claim("C2", EQUIV))
        registry.register(_claim("T-once", EQUIV))
        with pytest.raises(DuplicateClaimError, match="'T-once'"):
            registry.register(_claim("T-once", EQUIV))
    with pytest.raises(ClaimError, match="needs a margin"):
        Part("no margin", "a", "b", Form.EQUIVALENT)
    with pytest.raises(ClaimError, match="takes no margin"):
        Part("sign with a margin", "a", "b", Form.GREATER, margin=MarginRule.fixed(0.1))
    with pytest.raises(ClaimError, match="reserved cell key"):
        cell(r3="hadamard", scoring="support")
    with pytest.raises(ClaimError, match="needs a length"):
        cell(Scoring.LONG, r3="hadamard")
    with pytest.raises(ClaimError, match="no cell named pairwise_only"):
        _claim("T-unknown", Part("gap", "pairwise_only", "hadamard", Form.GREATER), cells={"hadamard": HAD})


def test_a_diff_side_is_app_fs_gap_of_gaps() -> None:
    """A part over two Diffs reads (pw − had at one setting) against (pw − had at another), replicates alike, as
    test_lower_bits_claims.py builds them by hand."""
    store = MemoryStore()
    claim = paper.APP_F
    vals = {name: _series(i, 1.5 * ("pairwise" in name) * (2 if "W3" in name else 1))
            for i, name in enumerate(claim.cells)}
    reps = {name: _fill(store, claim.cells[name], vals[name], seed=40 + i) for i, name in enumerate(claim.cells)}
    result = engine.evaluate(claim, store, SEEDS)
    g = {s: [p - h for p, h in zip(vals[f"pairwise_only {s}"], vals[f"hadamard {s}"], strict=True)]
         for s in ("W3A3KV3", "W4A4KV4")}
    r = {s: [p - h for p, h in zip(reps[f"pairwise_only {s}"], reps[f"hadamard {s}"], strict=True)]
         for s in ("W3A3KV3", "W4A4KV4")}
    direct = verdict.paired_claim(Form.GREATER, g["W3A3KV3"], g["W4A4KV4"],
                                  replicates={i: (r["W3A3KV3"][i], r["W4A4KV4"][i]) for i in range(len(SEEDS))})
    assert result.part_verdicts["gap W3A3KV3 > gap W4A4KV4"] == direct and direct.outcome is Outcome.HOLDS


def test_every_paper_entry_is_decided_over_a_store_of_its_cells() -> None:
    """Each registered entry of paper.py runs through the engine on synthetic values of its cells (every metric,
    support and long-context scorings included) and gives a JSON-able claims row; C2 equals test_claims.py's
    computation of it (robust part, then the TOST with the scaled margin)."""
    ids = [c.id for c in paper.PAPER]
    assert set(ids) <= set(registry.active().ids()) and len(ids) == len(set(ids))
    for claim in paper.PAPER:
        store = MemoryStore(tokens=lambda c: 512 * (int(c["length"]) if c.get("scoring") == Scoring.LONG else 12))
        for i, name in enumerate(claim.cell_names()):
            for metric in Metric:
                _fill(store, claim.cells[name], _series(i, 0.1 * i), seed=60 + i, metric=metric)
        row = engine.evaluate(claim, store, SEEDS).to_dict(model="smollm2-135m")
        assert json.loads(json.dumps(row))["claim"] == claim.title
        assert set(row["parts"]) == {p.name for p in claim.parts}
        assert set(ROW_KEYS) <= set(row) and row["model"] == "smollm2-135m"
        assert row["cells"] == {n: dict(c) for n, c in claim.cells.items()}  # the row says its own overrides
    assert paper.APP_F.cells and any(c.get("w_bits") == 3 for c in paper.APP_F.cells.values())
    store = MemoryStore(tokens=6144)
    vals = {"hadamard": _series(1, 0.0), "pairwise_plus_hadamard": _series(3, 0.01), "pairwise_only": _series(2, 2.0)}
    reps = {n: _fill(store, paper.C2.cells[n], vals[n], seed=80 + i) for i, n in enumerate(vals)}
    result = engine.evaluate(paper.C2, store, SEEDS)
    mean = float(np.mean(vals["pairwise_plus_hadamard"]) - np.mean(vals["hadamard"]))
    robust = verdict.deterministic(abs(mean) < 0.25 * float(np.mean(vals["pairwise_only"]) - np.mean(vals["hadamard"])),
                                   "robust part: |mean| < C1 gap/4")
    equiv = verdict.paired_claim(
        Form.EQUIVALENT, vals["pairwise_plus_hadamard"], vals["hadamard"], tokens=6144,
        margin=verdict.equivalence_margin(float(np.mean(vals["hadamard"]))).value,
        replicates={i: (reps["pairwise_plus_hadamard"][i], reps["hadamard"][i]) for i in range(len(SEEDS))})
    assert result.verdict == verdict.combine_all([robust, equiv]) and robust.outcome is Outcome.HOLDS
    far = MemoryStore()  # pairwise+hadamard halfway to pairwise_only: the robust part fails, and so does C2
    for i, (n, effect) in enumerate((("hadamard", 0.0), ("pairwise_plus_hadamard", 1.0), ("pairwise_only", 2.0))):
        _fill(far, paper.C2.cells[n], _series(i, effect), seed=90 + i)
    failed = engine.evaluate(paper.C2, far, SEEDS)
    assert failed.verdict.outcome is Outcome.FAILS and failed.verdict.note == "robust part: |mean| < C1 gap/4"


def test_the_paper_entries_match_their_sources() -> None:
    """App. F's cells are every bit setting of the sweep preset; C4's steps are b → 2b up to d_h with C2's scaled
    margin."""
    from rope_quant.defaults import LOWER_BIT_SETTINGS

    assert {name.split()[-1] for name in paper.APP_F.cells} == set(LOWER_BIT_SETTINGS)
    steps = [p for p in paper.C4_PPL.parts if p.statistic is Statistic.PAIRED]
    assert [p.name for p in steps] == ["b=2→4", "b=4→8", "b=8→16", "b=16→32", "b=32→64"]
    assert all(p.form is Form.NON_SUPERIOR and p.margin == MarginRule.equivalence("hadamard") for p in steps)
    assert isinstance(paper.APP_F.parts[-1].treatment, Diff)


def test_importing_the_claims_layer_stays_light() -> None:
    """No torch, numpy or scipy at import (the pytest plugin and the CLI may read the registry)."""
    code = ("import sys, rope_quant.claims.engine, rope_quant.claims.stores; "
            "print(sorted(m for m in ('torch', 'numpy', 'scipy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"


def test_a_results_directory_is_a_store(tmp_path: Path) -> None:
    """``sweep.claim_store.DirectoryStore`` reads a ``compare`` directory's complete records: C3's cells are the
    comparator's config with their overrides (the directory names them otherwise), the replicates are the
    ``.float-order`` cells; the verdict is the rule's on the recorded values. A cell the directory lacks is named
    with its seed; so is a cell scored on support windows, which a ``compare`` directory does not hold."""
    from rope_quant.experiment.config import RunConfig
    from rope_quant.sweep.claim_store import DirectoryStore
    from rope_quant.sweep.decide_plan import REPLICATE_SUFFIX, replicate_config
    from rope_quant.sweep.manifest import Manifest, build_manifest
    from rope_quant.sweep.runner import run_cells

    seeds = (0, 1, 2, 3)
    variants = {"hadamard": {"r3": "hadamard"}, "pw-rows": {"r3": "pairwise_only"},
                "pw-k": {"r3": "pairwise_only", "estimator": "k_only"}}
    plain = build_manifest(RunConfig.from_flat(seqlen=64), variants, seeds, study="compare")
    reps = [(n + REPLICATE_SUFFIX, replicate_config(c)) for n, c in plain.cells if n != "hadamard"]
    assert all(c is not None for _, c in reps)
    manifest = Manifest([*plain.cells, *reps], study="compare", comparator="hadamard")

    def ppl(cfg: RunConfig) -> float:
        flat = cfg.flat()
        shared = np.random.default_rng(cfg.seed).normal(0, 0.4)
        own = np.random.default_rng([cfg.seed, len(str(flat["r3"])), len(str(flat["estimator"]))]).normal(0, 0.05)
        return float(14.0 + shared + own + 2.0 * (flat["r3"] == "pairwise_only")
                     - 0.5 * (flat["estimator"] == "k_only") + 0.02 * cfg.quant.w.gptq.float64)

    run_cells(manifest, tmp_path, cell_fn=lambda cfg: {"ppl": ppl(cfg), "n_tokens": 4096}, log=None)
    store = DirectoryStore(tmp_path)
    result = engine.evaluate(paper.C3, store, seeds)
    by = {(n, cfg.seed): ppl(cfg) for n, cfg in manifest.cells}
    direct = verdict.paired_claim(
        Form.LESS, [by[("pw-k", s)] for s in seeds], [by[("pw-rows", s)] for s in seeds], tokens=4096,
        replicates={i: (by[("pw-k" + REPLICATE_SUFFIX, s)], by[("pw-rows" + REPLICATE_SUFFIX, s)])
                    for i, s in enumerate(seeds)})
    assert result.verdict == direct and direct.outcome is Outcome.HOLDS and result.parts[0].tokens == 4096
    with pytest.raises(MissingCellError, match=r"cell \{r3=pairwise_plus_hadamard\} at seed 0"):
        engine.evaluate(paper.C2, store, seeds)
    with pytest.raises(MissingCellError, match=r"cell \{r3=block_hadamard, r3_block=2, scoring=support\} at seed 0"):
        engine.evaluate(paper.C4_PPL, store, seeds)


def test_the_engine_records_the_outlier_flag_by_seed_number() -> None:
    """A sequential claim whose fifth seed blew up (+9 ppl among gaps of about +1): the part's and the claim's verdict
    carry the flag naming seed 13 (SEEDS[4]), the row's ``outlier`` says its 5% is not covered, and a claim with no
    such seed records none (rope_quant.core.outlier)."""
    store = MemoryStore(tokens=6144)
    had = [14.0, 14.2, 13.9, 14.1, 14.0]
    _fill(store, HAD, had, seed=31)
    _fill(store, PW, [h + g for h, g in zip(had, [1.1, 0.9, 1.0, 1.2, 9.0], strict=True)], seed=32)
    claim = _claim("T-blow", Part("gap", "pairwise_only", "hadamard", Form.GREATER))
    result = engine.evaluate(claim, store, SEEDS, sequential.Plan(3, 40))
    flag = result.verdict.outlier
    assert flag is not None and flag.seeds == (13,) and flag.indices == (4,)
    row = result.to_dict()
    assert row["outlier"].startswith("outlier: seed 13 (") and row["outlier"].endswith("its 5% is not covered")
    assert list(row["decision"]["outlier"]["seeds"]) == [13] and "seed 13" in row["verdict"]
    clean = MemoryStore(tokens=6144)
    _fill(clean, HAD, had, seed=31)
    _fill(clean, PW, [h + g for h, g in zip(had, [1.1, 0.9, 1.0, 1.2, 0.95], strict=True)], seed=32)
    quiet = engine.evaluate(claim, clean, SEEDS, sequential.Plan(3, 40))
    assert quiet.verdict.outlier is None and quiet.to_dict()["outlier"] == ""


def test_every_seed_reads_at_most_at_least_and_equivalence_within_a_margin() -> None:
    """The every-seed statistic per seed: ≤ (C4-K: non-increasing in b) holds on ties and fails on one seed above;
    ≡ within a relative margin (C4-ends) holds inside it and fails one seed outside; the control may read another
    metric of the same cell (A1-whip: the fitted loss against the start)."""
    small, big = cell(r3="block_hadamard", r3_block=4), cell(r3="block_hadamard", r3_block=2)
    store = MemoryStore()
    store.put_seeds(big, SEEDS, [10.0, 10.0, 10.0, 10.0, 10.0], metric=Metric.K_RANGE_MEAN)

    def decide(values: list[float], part: Part) -> Outcome:
        store.put_seeds(small, SEEDS, values, metric=part.metric)
        claim = Claim("X-every", "x", "x", "x", {"small": small, "big": big}, (part,), premises=())
        return engine.evaluate(claim, store, SEEDS).verdict.outcome

    at_most = Part("≤", "small", "big", Form.NON_SUPERIOR, Statistic.EVERY_SEED, metric=Metric.K_RANGE_MEAN)
    assert decide([9.0, 10.0, 9.5, 9.9, 10.0], at_most) is Outcome.HOLDS  # ties hold
    assert decide([9.0, 10.0, 9.5, 10.001, 9.0], at_most) is Outcome.FAILS
    at_least = Part("≥", "small", "big", Form.NON_INFERIOR, Statistic.EVERY_SEED, metric=Metric.K_RANGE_MEAN)
    assert decide([10.0, 10.5, 11.0, 10.0, 12.0], at_least) is Outcome.HOLDS
    assert decide([10.0, 9.99, 11.0, 10.0, 12.0], at_least) is Outcome.FAILS
    same = Part("≡", "small", "big", Form.EQUIVALENT, Statistic.EVERY_SEED, MarginRule.relative("big", 5e-3),
                metric=Metric.K_RANGE_MEAN)
    assert decide([10.04, 9.96, 10.0, 10.049, 9.951], same) is Outcome.HOLDS  # |t − c| ≤ 0.05 = 5e-3 · mean(c)
    assert decide([10.04, 9.96, 10.0, 10.051, 9.951], same) is Outcome.FAILS
    store.put_seeds(big, SEEDS, [296.0, 295.7, 296.0, 296.1, 295.9], metric=Metric.R1_LOSS_INIT)
    fit = Part("fit < start", "small", "big", Form.LESS, Statistic.EVERY_SEED, metric=Metric.R1_LOSS_FIT,
               control_metric=Metric.R1_LOSS_INIT)
    assert decide([287.1, 287.0, 287.5, 287.2, 287.3], fit) is Outcome.HOLDS
    assert decide([287.1, 287.0, 296.5, 287.2, 287.3], fit) is Outcome.FAILS


def test_every_seed_parts_refuse_what_they_cannot_read() -> None:
    with pytest.raises(ClaimError, match="needs a margin"):
        Part("p", "a", "b", Form.EQUIVALENT, Statistic.EVERY_SEED)
    with pytest.raises(ClaimError, match="takes no margin"):
        Part("p", "a", "b", Form.GREATER, Statistic.EVERY_SEED, MarginRule.fixed(0.1))
    with pytest.raises(ClaimError, match="one metric on both sides"):
        Part("p", "a", "b", Form.GREATER, control_metric=Metric.K_RANGE_MEAN)
    with pytest.raises(ClaimError, match="reads greater, less, non_superior, non_inferior, not equivalent"):
        Part("p", "a", "b", Form.EQUIVALENT, Statistic.MEANS)
    with pytest.raises(ClaimError, match="a level is the control"):
        Part("p", "a", Level(0.9), Form.GREATER)  # a paired part reads the replicates of cells
    with pytest.raises(ClaimError, match="a level is the control"):
        Part("p", Level(0.9), "a", Form.GREATER, Statistic.MEANS)


def test_a_level_is_a_constant_control_of_the_means() -> None:
    """App. G's premise: mean FP accuracy ≥ 0.9 (a tie holds, a mean below fails); the level reads no cell."""
    fp = cell(Scoring.NIAH_FP)
    part = Part("fp ≥ 0.9", "fp", Level(0.9), Form.NON_INFERIOR, Statistic.MEANS, metric=Metric.ACCURACY)
    claim = Claim("X-level", "x", "x", "x", {"fp": fp}, (part,), premises=())
    assert claim.cell_names() == ("fp",)
    store = MemoryStore()
    for values, outcome in (([0.92, 0.88, 0.90, 0.90, 0.90], Outcome.HOLDS),
                            ([1.0, 1.0, 1.0, 0.5, 0.9], Outcome.FAILS)):
        store.put_seeds(fp, SEEDS, values, metric=Metric.ACCURACY)
        result = engine.evaluate(claim, store, SEEDS)
        assert result.verdict.outcome is outcome, values
        assert result.parts[0].control == (0.9,) * len(SEEDS)
    assert "mean accuracy(fp) ≥ 0.9" in engine.evaluate(
        Claim("X-level", "x", "x", "x", {"fp": fp}, (replace(part, note=""),), premises=()), store, SEEDS).verdict.note


def test_a_metric_is_a_key_or_a_dotted_path_into_the_cell_record() -> None:
    record = {"ppl": 14.2, "rotation_fit": {"kind": "whip", "loss_init": 296.0, "loss_fit": 287.1}}
    assert registry.metric_value(record, Metric.PPL) == 14.2
    assert registry.metric_value(record, Metric.R1_LOSS_FIT) == 287.1
    with pytest.raises(KeyError, match="rotation_fit.loss_init"):
        registry.metric_value({"ppl": 1.0, "rotation_fit": {}}, Metric.R1_LOSS_INIT)
    with pytest.raises(KeyError, match="k_rel_err"):
        registry.metric_value(record, Metric.K_REL_ERR)

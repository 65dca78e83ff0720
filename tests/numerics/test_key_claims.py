"""The key-quantiser claims (rope_quant/claims/keys.py): one entry per scheme × R3 × setting, their model-dependent
values resolved from SmolLM2's and Gemma 3's configs, equal bits per key element asserted before any model loads
(and on the bits the cells measure), the pytest front and the CLI selecting them, and a pre-RoPE quantiser seeing
the key of W_K with a foldable R3 folded in."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rope_quant.claims import engine, keys, registry
from rope_quant.claims.bits import attended, check_equal_bits, key_bits
from rope_quant.claims.premises import BEST_FOLDABLE_R3, ModelFacts, adapt, facts_of_checkpoint, resolve
from rope_quant.claims.registry import Claim, ClaimError, MarginRule, Metric, Part, Premise, Resolve, cell
from rope_quant.claims.stores import MemoryStore
from rope_quant.core.verdict import Form, Outcome

pytestmark = pytest.mark.numerics

REPO = Path(__file__).resolve().parents[2]
T = 512  # the e2e budget's evaluation windows (tests/e2e/conftest.py: E2EBudget.seqlen)
SEEDS = (0, 1, 2)


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def facts(request) -> ModelFacts:
    from rope_quant.model.loading import ModelNotFoundError

    try:
        return facts_of_checkpoint(request.param)
    except ModelNotFoundError as exc:  # pragma: no cover - the embedded configs ship with the package
        pytest.skip(str(exc))


def test_one_entry_per_scheme_r3_and_setting_registered_on_import() -> None:
    ids = registry.active().ids(registry.KEYS)
    assert len(ids) == len(keys.SCHEMES) * len(keys.R3S) * len(keys.SETTINGS) == 16
    assert ids == tuple(c.id for c in keys.KEY_CLAIMS) and "K-kvquant-id-KV4" in ids and "K-kivi-fold-W4A4KV4" in ids
    assert registry.groups() == (registry.PAPER, registry.KEYS, "llamacpp")  # llama.cpp's: claims/runtime.py
    for claim in keys.KEY_CLAIMS:
        assert claim.equal_bits and claim.group == registry.KEYS
        (part,) = claim.parts
        assert part.form is Form.NON_SUPERIOR and part.margin == MarginRule.equivalence("reference")
        assert claim.cells["reference"]["r3"] == "hadamard"
        kv4 = claim.id.endswith("-KV4")
        assert claim.premises == ((Premise.ROPE,) if kv4 else (Premise.ROPE, Premise.R1_FOLDABLE))
        assert claim.cells["scheme"]["w_bits"] == (16 if kv4 else 4)
    assert registry.get("K-sink-id-KV4").cells["reference"]["k_sinks"] == keys.SINKS
    assert "the same 4 sinks in 16 bits" in registry.get("K-sink-id-KV4").title
    assert registry.get("K-kivi-id-KV4").cells["reference"]["k_quant"] == "per_token_window"


def test_every_key_claim_stores_equal_bits_on_smollm2_and_gemma3(facts: ModelFacts) -> None:
    """Resolved from the config alone: G = d, the mean width 4 − 32/d, the best foldable R3 by q/k norms; every
    compared pair stores the same bits at T = 512 (the reference's 4 + 32/d where a scheme can match it) and the
    same bits averaged over the window's query–key pairs. KIVI with G = R = 256 (Gemma 3) at T = 512 quantises
    0.2% of the keys its queries read: not run, with the T that would test it."""
    d = facts.head_dim
    assert d == (64 if facts.model_type == "llama" else 256)
    for claim in keys.KEY_CLAIMS:
        got = adapt(claim, facts, seq_len=T)
        if facts.model_type == "gemma3_text" and "-kivi-" in claim.id:
            assert isinstance(got, str) and "0.2%" in got and "evaluation windows of T = 1024" in got, got
            continue
        assert isinstance(got, Claim), got
        assert not got.unresolved()
        bits = check_equal_bits(got, d, T)
        assert bits["scheme"] == bits["reference"]
        read = {name: attended(got.cells[name], d, T) for name in ("scheme", "reference")}
        assert read["scheme"] == pytest.approx(read["reference"], abs=1e-9)
        scheme = got.cells["scheme"]
        if scheme["k_quant"] in ("kvquant_prerope", "rope_pair_bits"):
            assert bits["scheme"] == 4 + 32 / d
        if scheme["k_quant"] == "kvquant_prerope":  # the queries read the open group in 16 bits in both cells
            assert got.cells["reference"]["k_quant"] == "per_token_window" and got.cells["reference"]["k_residual"] == 0
            assert read["scheme"][1] == pytest.approx(0.877 if d == 64 else 0.503, abs=5e-4)
        if scheme["k_quant"] == "rope_pair_bits":
            assert scheme["k_avg_bits"] == 4 - 32 / d and (scheme["k_min_bits"], scheme["k_max_bits"]) == (3, 4)
        if scheme["k_quant"] == "kivi":
            n = d * ((T - d) // d)  # KIVI's quantised tokens with G = R = d
            assert scheme["k_token_group"] == scheme["k_residual"] == d
            assert bits["scheme"] == pytest.approx((n * (4 + 32 / d) + (T - n) * 16) / T)
        if scheme["k_quant"] == "sink":
            assert bits["scheme"] == pytest.approx((4 * 16 + (T - 4) * (4 + 32 / d)) / T)
        if "-fold-" in claim.id:
            expected = BEST_FOLDABLE_R3[facts.qk_norms]
            assert {k: scheme[k] for k in expected} == expected and "best foldable R3" in got.title
        else:
            assert scheme["r3"] == "identity"
        if claim.id.endswith("W4A4KV4") and facts.model_type == "gemma3_text":
            assert all(c["r1"] == "identity" for c in got.cells.values()) and "deviation" in got.title
    assert BEST_FOLDABLE_R3[facts.qk_norms]["r3"] == (
        "prerope_channel_scale" if facts.model_type == "gemma3_text" else "pairwise_scaled")


def _unequal() -> Claim:
    return Claim("X-unequal", "x", "unequal bits", "nowhere",
                 {"scheme": cell(k_quant="kvquant_prerope", k_token_group=32), "reference": cell(r3="hadamard")},
                 (Part("p", "scheme", "reference", Form.NON_SUPERIOR, margin=MarginRule.equivalence("reference")),),
                 group=registry.KEYS, equal_bits=True)


def test_an_unequal_entry_is_refused_before_any_model_loads(monkeypatch) -> None:
    """G = 32 at d = 64 stores 5 bits, the reference 4.5: adapt names both cells and their bits; nothing loads."""
    from rope_quant.model import loading

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(loading, "load_model", no_load)
    facts = ModelFacts({p: None for p in Premise}, head_dim=64, model_type="llama")
    with pytest.raises(ClaimError, match=r"X-unequal.*scheme \{k_quant=kvquant_prerope, k_token_group=32\}: 5 bits; "
                                         r"reference \{r3=hadamard\}: 4.5 bits"):
        adapt(_unequal(), facts, seq_len=T)
    assert key_bits(cell(k_quant="kvquant_prerope", k_token_group=32), 64, T) == 5.0
    with pytest.raises(ClaimError, match="seq_len"):
        adapt(_unequal(), facts)
    # KVQuant at G = d against the plain per-token rule: equal at T, unequal as the window's queries read them
    at_t = Claim("X-at-T", "x", "equal at T only", "nowhere",
                 {"scheme": cell(k_quant="kvquant_prerope", k_token_group=64), "reference": cell(r3="hadamard")},
                 _unequal().parts, group=registry.KEYS, equal_bits=True)
    assert key_bits(at_t.cells["scheme"], 64, T) == key_bits(at_t.cells["reference"], 64, T) == 4.5
    with pytest.raises(ClaimError, match=r"X-at-T.*averaged over the query–key pairs of a window of T = 512.*"
                                         r"scheme \{k_quant=kvquant_prerope, k_token_group=64\}: 5.91228 bits; "
                                         r"reference \{r3=hadamard\}: 4.5 bits"):
        adapt(at_t, facts, seq_len=T)
    with pytest.raises(ClaimError, match="ModelFacts"):
        adapt(keys.KEY_CLAIMS[0], facts.premises, seq_len=T)


def test_the_engine_refuses_an_unresolved_claim_and_unequal_measured_bits() -> None:
    claim = registry.get("K-pairbits-id-KV4")
    with pytest.raises(ClaimError, match=r"resolve them for the model first"):
        engine.evaluate(claim, MemoryStore(), SEEDS)
    facts = ModelFacts({p: None for p in Premise}, head_dim=64, model_type="llama")
    got = adapt(claim, facts, seq_len=T)
    assert isinstance(got, Claim)
    rng = np.random.default_rng(0)
    base = 14.0 + rng.normal(0, 0.3, len(SEEDS))
    values = {name: base + 0.01 * (name == "scheme") + rng.normal(0, 0.003, len(SEEDS))
              for name in ("scheme", "reference")}

    def store(measured: dict[str, list[float]] | None) -> MemoryStore:
        s = MemoryStore(tokens=12 * T)
        for name, vals in values.items():
            reps = {k: v + 1e-4 for k, v in zip(SEEDS, vals, strict=True)}
            s.put_seeds(got.cells[name], SEEDS, vals, replicates=reps)
            if measured is not None:
                s.put_seeds(got.cells[name], SEEDS, measured[name], metric=Metric.K_BITS)
        return s

    fine = engine.evaluate(got, store({"scheme": [4.5] * 3, "reference": [4.5] * 3}), SEEDS)
    assert fine.verdict.outcome is Outcome.HOLDS  # 0.01 above, far inside the ±0.05·14/ppl-scaled margin
    assert engine.evaluate(got, store(None), SEEDS).verdict == fine.verdict  # no measured bits: nothing to check
    with pytest.raises(ClaimError, match=r"as measured by the cells.*scheme .*: 4.5 / 4.51562 bits"):
        engine.evaluate(got, store({"scheme": [4.5, 4.515625, 4.5], "reference": [4.5] * 3}), SEEDS)


def test_resolution_names_what_it_chose_and_skips_what_cannot_run() -> None:
    claim = registry.get("K-kivi-fold-KV4")
    gemma = ModelFacts({p: None for p in Premise}, head_dim=256, qk_norms=True, model_type="gemma3_text")
    got = resolve(claim, gemma)
    assert isinstance(got, Claim)
    assert "G = head_dim: k_token_group=256, k_residual=256" in got.title
    assert "best foldable R3: r3=prerope_channel_scale" in got.title
    assert isinstance(resolve(claim, ModelFacts({})), str)  # no head_dim: the reason, not a guess
    bad = Claim("X-bad", "x", "x", "nowhere", {"a": cell(k_token_group=Resolve.BEST_FOLDABLE_R3), "b": cell()},
                (Part("p", "a", "b", Form.LESS),))
    with pytest.raises(ClaimError, match="value of 'r3'"):
        resolve(bad, gemma)


def test_the_cli_selects_the_key_group_and_plans_without_loading(tmp_path: Path, capsys) -> None:
    from rope_quant import cli
    from rope_quant.cli.claims import chosen_claims

    assert [c.id for c in chosen_claims("keys")] == list(registry.active().ids(registry.KEYS))
    assert [c.id for c in chosen_claims(None)] == list(registry.active().ids(registry.PAPER))
    assert [c.id for c in chosen_claims("C1,K-sink-id-KV4,keys")][:2] == ["C1", "K-sink-id-KV4"]
    out = tmp_path / "keys"
    code = cli.main(["claims", "--claims", "K-kvquant-id-KV4,K-kivi-fold-KV4", "--dry-run", "--out", str(out),
                     "--seqlen", "512", "--calib-windows", "1", "--eval-windows", "1", "--quiet"],
                    cell_fn=lambda cfg: pytest.fail("a cell ran"))
    printed = capsys.readouterr().out
    assert code == 0 and not out.exists()
    assert "K-kvquant-id-KV4" in printed and "k_quant=kvquant_prerope" in printed and "k_token_group=64" in printed
    assert "r3=pairwise_scaled" in printed or "pairwise_scaled" in printed


def test_the_pytest_front_runs_the_paper_claims_by_default_and_the_key_claims_in_slow_only() -> None:
    """On the default model the registry front is the paper's claims table: the claims CI's budget holds run by
    default (C1, C2, C3 and its mean sign, C4's perplexity steps, K metrics and endpoints, C8, A.1's whip fit), the
    rest of the paper's and every key claim in ``slow``."""
    def collect(*flags: str) -> list[str]:
        out = subprocess.run([sys.executable, "-m", "pytest", "tests/e2e/test_registry_claims.py", "--collect-only",
                              "-q", "-p", "no:cacheprovider", *flags], capture_output=True, text=True, cwd=REPO)
        return [line.split("[", 1)[1].rstrip("]") for line in out.stdout.splitlines() if "::" in line]

    assert collect() == [f"smollm2-135m-{c}" for c in ("C1", "C2", "C3", "C3-mean", "C4-ppl", "C4-K", "C4-ends", "C8",
                                                       "A1-whip")]
    slow = collect("--run-slow")
    assert slow == [f"smollm2-135m-{c.id}" for c in registry.claims()]
    assert [c.id for c in keys.KEY_CLAIMS] == [c.split("-", 2)[2] for c in slow if c.split("-", 2)[2].startswith("K-")]
    assert collect("--run-slow", "-k", "K-kvquant-id-KV4") == ["smollm2-135m-K-kvquant-id-KV4"]
    gemma = collect("--run-slow", "--rq-model", "gemma3-270m", "-k", "K- and KV4 and not W4A4")
    assert gemma == [f"gemma3-270m-{c.id}" for c in keys.KEY_CLAIMS if c.id.endswith("-KV4")]


def test_a_pre_rope_quantiser_sees_the_key_of_w_k_with_a_foldable_r3_folded_in() -> None:
    """kvquant_prerope with a RoPE-commuting R3 (pairwise_scaled) online equals kvquant_prerope on the model with
    that R3 folded into W_Q/W_K (the deployment), to float error; quantising the pre-R3 key instead (R3 a no-op for
    the quantiser) is another model."""
    from rope_quant.core import transforms as T
    from rope_quant.model import arch
    from rope_quant.quant import keys as keyq
    from rope_quant.quant.quantizers import QuantConfig
    from rope_quant.rotations import attention
    from rope_quant.rotations.fold_r3 import fold_r3
    from tests._support import tiny_llama

    model = tiny_llama(layers=2)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(4.0)
    geom = attention.check_model(model)
    rng = np.random.default_rng(3)
    transforms_ = [T.build("pairwise_scaled", 16, angles=rng.uniform(-1, 1, 8), scales=rng.uniform(0.5, 2.0, 8))
                   for _ in range(geom.n_layers)]
    option = keyq.option_from("kvquant_prerope", QuantConfig(bits=3), token_group=8)

    def quantizers(m):
        return [option.build(keyq.KeyQuantContext(16, 2, arch.layer_inv_freq(m, i, 16)[0]))
                for i in range(geom.n_layers)]

    folded = copy.deepcopy(model)
    fold_r3(folded, transforms_)
    ids = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(4))
    attention.install_attention(model, transforms_, key_quant=quantizers(model))
    attention.install_attention(folded, None, key_quant=quantizers(folded))
    with torch.no_grad():
        online, deployed = model(ids).logits, folded(ids).logits
        attention.install_attention(model, [T.build("identity", 16)] * geom.n_layers, key_quant=quantizers(model))
        pre_r3 = model(ids).logits  # the quantiser's view when R3 is ignored: the unrotated key
    float_error, other = (online - deployed).abs().max().item(), (online - pre_r3).abs().max().item()
    assert float_error < 1e-5  # measured 1.5e-7
    assert other > 1e-3 and other > 1000 * float_error  # measured 4.6e-3: the old behaviour is another model


def _row(model: str, claim_id: str, mean: float, outcome: str, *, with_id: bool) -> dict:
    decision = {"outcome": outcome, "mean": mean, "low": mean - 0.2, "high": mean + 0.2, "margin": 0.09,
                "float_order": {"low_b": mean - 0.3, "high_b": mean + 0.1}}
    row = {"claim": f"Keys: {claim_id}", "model": model, "decision": decision,
           "test": f"tests/e2e/test_registry_claims.py::test_registry_claim[{model}-{claim_id}]"}
    return {**row, "id": claim_id} if with_id else row


def test_the_figure_draws_one_point_per_key_claim_and_one_panel_per_model_and_setting(tmp_path: Path) -> None:
    """Two claims JSONs (the pytest plugin's rows name the claim in their test id, the report's in ``id``): every
    decided key claim is one point with the verdict's interval (the union with the replicate interval), in the
    panel of its model and setting; rows of other claims and undecided rows without an interval are left out."""
    from rope_quant.analysis.key_claims_figure import claim_parts, key_claims_figure, key_points, plot_key_claims

    rows = {"smol": [], "gemma": []}
    for i, claim in enumerate(keys.KEY_CLAIMS):
        rows["smol"].append(_row("smollm2-135m", claim.id, 0.1 * i, "holds", with_id=False))
        if claim.id.endswith("-KV4"):
            rows["gemma"].append(_row("gemma3-270m", claim.id, -0.5, "refuted", with_id=True))
        else:  # Gemma 3's W4A4KV4 runs without R1, the deviation in the row's title
            rows["gemma"].append({**_row("gemma3-270m", claim.id, 0.2, "inconclusive", with_id=True),
                                  "claim": f"Keys: {claim.id} [deviation: R1 refused by the architecture (gemma3_text "
                                           "has sandwich norms): every cell runs with r1=identity]"})
    rows["smol"].append({"claim": "C1", "model": "smollm2-135m", "decision": {"mean": 1.0, "low": 0.5, "high": 1.5},
                         "test": "tests/e2e/test_claims.py::test_c1"})
    rows["gemma"].append({**_row("gemma3-270m", "K-kivi-id-W4A4KV4", 0.0, "inconclusive", with_id=True),
                          "decision": {"outcome": "inconclusive", "mean": None, "low": None, "high": None}})
    paths = []
    for name, r in rows.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "claims.json").write_text(json.dumps({"schema": 2, "claims": r}))
        paths.append(tmp_path / name)
    points = key_points([row for p in paths for row in json.loads((p / "claims.json").read_text())["claims"]])
    assert len(points) == 16 + 16
    first = next(p for p in points if p.model == "smollm2-135m" and (p.scheme, p.r3, p.setting) == ("kvquant", "id",
                                                                                                      "KV4"))
    assert (first.low, first.high) == pytest.approx((-0.3, 0.2))  # the union of the two intervals
    fig = key_claims_figure(points)
    axes = fig.axes
    assert len(axes) == 4  # gemma KV4, gemma W4A4KV4, smollm2 KV4, smollm2 W4A4KV4
    assert [len(ax.containers) for ax in axes] == [8, 8, 8, 8]
    titles = [ax.get_title() for ax in axes]
    assert titles[1].endswith("\ndeviation: R1 refused by the architecture, R1 = identity"), titles[1]
    assert not any("deviation" in t for t in (titles[0], *titles[2:])), titles
    assert all(ax.get_legend() is not None for ax in axes)
    assert [t.get_text() for t in axes[0].get_xticklabels()] == ["kvquant", "pairbits", "sink", "kivi"]
    out = plot_key_claims(paths, tmp_path / "keys.png")
    assert out.is_file() and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert claim_parts("x[gemma3-270m-K-sink-fold-W4A4KV4]") == ("sink", "fold", "W4A4KV4")
    assert claim_parts("K-sink-fold-KV4x") is None
    with pytest.raises(ValueError, match="no key claim"):
        key_claims_figure([])


def test_a_key_claim_is_a_question_whose_refuted_answer_does_not_fail_its_test() -> None:
    """The key claims ask whether a scheme replaces the online Hadamard: refuted is an answer (the test passes and
    records it); a paper claim refuted fails its test; fails fails both."""
    from types import SimpleNamespace

    from rope_quant.core.verdict import Outcome

    key, paper = registry.get("K-pairbits-id-KV4"), registry.get("C1")
    assert key.question and not paper.question
    refuted, fails = (SimpleNamespace(outcome=o, failed=True) for o in (Outcome.REFUTED, Outcome.FAILS))
    holds = SimpleNamespace(outcome=Outcome.HOLDS, failed=False)
    assert not key.fails_test(refuted) and paper.fails_test(refuted)
    assert key.fails_test(fails) and paper.fails_test(fails)
    assert not key.fails_test(holds) and not paper.fails_test(holds)

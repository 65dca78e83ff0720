"""Which claims run on which architecture (rope_quant/claims/premises.py): the premises from a config alone, the
nearest protocol where only R1 is refused, and the skip otherwise."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import transformers
from packaging.version import Version

from rope_quant.claims import registry
from rope_quant.claims.premises import adapt, premises_of, protocol_for
from rope_quant.claims.registry import Claim, Part, Premise, cell
from rope_quant.core.verdict import Form

pytestmark = pytest.mark.numerics

NEW_TF = Version(transformers.__version__) >= Version("5.0")


def _llama(head_dim: int) -> SimpleNamespace:
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=4 * head_dim, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=head_dim)
    return SimpleNamespace(config=cfg)


def test_a_llama_checkpoint_meets_every_premise_at_head_dim_64() -> None:
    got = premises_of(_llama(64))
    assert got == {Premise.ROPE: None, Premise.R1_FOLDABLE: None, Premise.HEAD_DIM_64: None}
    fixed = [c for c in registry.claims(registry.PAPER) if not c.unresolved()]  # C4-K-kv's last block is d_h
    assert len(fixed) == len(registry.claims(registry.PAPER)) - 1
    assert all(adapt(c, got) is c for c in fixed)  # every paper claim without a model-dependent value runs as written
    small = premises_of(_llama(16))
    assert small[Premise.HEAD_DIM_64] is not None and "head_dim 16" in small[Premise.HEAD_DIM_64]
    assert isinstance(adapt(registry.get("C4-ppl"), small), str)  # C4's blocks end at 64: skipped with the reason
    assert adapt(registry.get("C2"), small) is registry.get("C2")


@pytest.mark.skipif(not NEW_TF, reason="the gemma3_text adapter reads transformers 5's layer-type RoPE layout")
def test_gemma3_runs_the_pipeline_claims_without_r1_and_names_it() -> None:
    """Gemma 3's sandwich norms refuse R1: a claim that needs only that premise runs with r1=identity in every
    cell, its title naming the deviation and the norms; C4-ppl also needs head_dim 64 (Gemma 3: 256) and skips."""
    cfg = transformers.Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                        layer_types=["sliding_attention", "full_attention"])
    got = premises_of(SimpleNamespace(config=cfg))
    assert got[Premise.ROPE] is None and "sandwich norms" in (got[Premise.R1_FOLDABLE] or "")
    c2 = adapt(registry.get("C2"), got)
    assert isinstance(c2, Claim) and "[deviation: R1 refused by the architecture" in c2.title
    assert all(c["r1"] == "identity" for c in c2.cells.values())
    assert registry.get("C2").cells["hadamard"].get("r1") is None  # the registered entry is unchanged
    skipped = adapt(registry.get("C4-ppl"), got)
    assert isinstance(skipped, str) and "head_dim 256" in skipped


def test_the_nearest_protocol_is_taken_only_for_r1() -> None:
    claim = Claim("X", "x", "a claim", "nowhere", {"a": cell(r3="hadamard"), "b": cell(r3="identity")},
                  (Part("a < b", "a", "b", Form.LESS),), (Premise.ROPE, Premise.R1_FOLDABLE))
    met = {p: None for p in Premise}
    assert protocol_for(claim, met).overrides == {} and not protocol_for(claim, met).skip
    no_r1 = {**met, Premise.R1_FOLDABLE: "sandwich norms"}
    assert protocol_for(claim, no_r1).overrides == {"r1": "identity"}
    no_rope = {**met, Premise.ROPE: "model type 'bert' is not supported"}
    assert protocol_for(claim, no_rope).skip.startswith("rope: model type 'bert'")
    # a claim whose cells set R1 is about R1 (A1-whip: the whip fit): no R1 means no claim, not r1=identity
    whip = protocol_for(registry.get("A1-whip"), no_r1)
    assert whip.overrides == {} and whip.skip == "r1_foldable: sandwich norms"

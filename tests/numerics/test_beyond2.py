"""``compare --configs beyond2``: the preset's cells, the gap-share statistic, and the whole family run
through the real pipeline on a tiny Llama (every fitted transform fitted, scored, reported)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rope_quant.analysis import gap_share as G
from rope_quant.analysis.report import read_csv_rows
from rope_quant.experiment.config import RunConfig
from rope_quant.sweep import presets


def test_the_preset_is_one_paired_holm_family() -> None:
    base = RunConfig()
    m = presets.beyond2_manifest(base, [0, 1])
    names = list(dict.fromkeys(n for n, _ in m.cells))
    assert names == ["hadamard", *presets.BEYOND2_VARIANTS]
    assert m.kind == "beyond" and list(m.family) == names[1:] and m.comparator == "hadamard"
    cells = {n: c for n, c in m.cells if c.seed == 1}
    assert cells["pairwise_scaled-range_per_head"].r3 == "pairwise_scaled"
    assert cells["pairwise_scaled-range_per_head"].objective == "range"
    assert cells["pairwise_scaled-variance_per_head"].objective == "variance"
    assert cells["learned_orthogonal"].estimator == "rows"  # the base's angle fields do not leak in
    # within a seed every cell shares the weights and the statistics: the comparison is paired
    assert len({c.weight_key() for c in cells.values()}) == 1 and len({c.stats_key() for c in cells.values()}) == 1


def test_gap_share_matches_its_definition_and_bootstraps_over_seeds() -> None:
    base, comp = [20.0, 21.0, 19.5, 20.5], [18.0, 19.0, 17.5, 18.5]
    assert G.gap_share(comp, base, comp)["share"] == pytest.approx(1.0)
    assert G.gap_share(base, base, comp)["share"] == pytest.approx(0.0)
    x = [19.0, 20.2, 18.4, 19.6]  # closes (1 + .8 + 1.1 + .9)/4 / 2 = 47.5%
    g = G.gap_share(x, base, comp)
    assert g["share"] == pytest.approx(0.475)
    assert g["low"] < 0.475 < g["high"] and g["high"] - g["low"] < 0.2
    assert G.gap_share(x, base, comp) == g  # seeded
    assert G.gap_share(x[:2], base[:2], comp[:2])["low"] is None  # too few seeds for a CI
    assert G.gap_share(x, comp, base)["share"] is None  # no gap to close


def test_gap_share_table_decides_equivalence_to_the_comparator_with_a_budget() -> None:
    """Foldable R3, per row: is the config's paired CI against hadamard inside the margin (the paper's ±0.05
    scaled by ppl 15/8.33 = ±0.090)? Holds, refuted, or inconclusive with the budget in seeds and tokens."""
    had = [15.0, 15.2, 14.9, 15.1]
    diffs = {"pairwise_only": [1.6, 1.5, 1.7, 1.4], "close": [0.001, -0.002, 0.0015, -0.001],
             "far": [0.30, 0.35, 0.32, 0.31], "open": [0.05, -0.10, 0.20, 0.0]}
    seeds = [0, 1, 2, 3]
    configs = {"hadamard": {"seeds": seeds, "ppl": had, "mean": float(np.mean(had))}}
    for name, d in diffs.items():
        ppl = [h + x for h, x in zip(had, d, strict=True)]
        configs[name] = {"seeds": seeds, "ppl": ppl, "mean": float(np.mean(ppl))}
    configs["open"]["r3_folds"] = [True, False, True, True]  # one seed's cell refused to fold: not foldable here
    summary = {"configs": configs, "comparator": "hadamard", "meta": {},
               "paired": {n: {"tokens": 2048} for n in diffs}}
    table = G.gap_share_table(summary)
    assert table is not None
    row = {r["config"]: r for r in table.rows}
    assert row["close"]["equivalent"] == "holds"
    assert row["far"]["equivalent"] == "refuted"
    assert row["open"]["equivalent"] == "inconclusive"
    assert row["open"]["foldable"] is False and row["close"]["foldable"] is None  # no record, unknown r3
    assert row["open"]["equivalence_budget_seeds"] > 4 and row["open"]["equivalence_budget_tokens"] > 2048
    md = table.markdown()
    assert "≡ hadamard (±0.090)" in md and "80% power to hold" in md and "refuted (worse: +0.320" in md


@pytest.fixture
def tiny_model(tmp_path: Path) -> Path:
    from pydoc_data.topics import topics

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([topics[k] for k in sorted(topics)[:40]], trainer=trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).eval().save_pretrained(tmp_path / "model")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def test_beyond2_runs_end_to_end_on_a_tiny_llama(tiny_model: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    """``compare --configs beyond2`` runs the family and writes the gap-share table and figure."""
    from rope_quant import cli
    from rope_quant.sweep.loaded_models import ModelCache

    monkeypatch.setenv("ROPE_QUANT_CACHE_DIR", str(tmp_path / "corpus-cache"))
    out = tmp_path / "out"
    code = cli.main(["compare", "--configs", "beyond2", "--model", str(tiny_model), "--out", str(out), "--seeds",
                     "0,1,2", "--seqlen", "64", "--calib-windows", "2", "--eval-windows", "2", "--weights", "rtn",
                     "--no-w-mse", "--w-bits", "16", "--a-bits", "16", "--k-bits", "4", "--v-bits", "16",
                     "--quiet"], models=ModelCache())
    printed = capsys.readouterr()
    assert code == 0, printed
    assert "Share of pairwise_only's gap" in printed.out
    written = read_csv_rows(out / "tables" / "gap-share.csv")
    assert {r["config"] for r in written} == set(presets.BEYOND2_VARIANTS)
    (out / "tables" / "gap-share.csv").unlink()  # `rope-quant report` on a beyond2 directory rewrites it
    assert cli.main(["report", str(out), "--no-figures"], models=ModelCache()) == 0
    assert read_csv_rows(out / "tables" / "gap-share.csv") == written
    assert (out / "figures" / "gap_share.png").stat().st_size > 1000
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["configs"]) == {"hadamard", *presets.BEYOND2_VARIANTS}
    assert set(summary["holm"]["family"]) == set(presets.BEYOND2_VARIANTS)
    for name, cfg in summary["configs"].items():
        assert len(cfg["ppl"]) == 3 and all(np.isfinite(cfg["ppl"])), name
        assert all(0 < e < 1 for e in cfg["k_rel_err"]), name
    # the fitted maps changed the keys: their K error differs from the unfitted start
    err = {n: np.mean(c["k_rel_err"]) for n, c in summary["configs"].items()}
    assert err["pairwise_scaled-range_per_head"] != err["pairwise_only-range_per_head"]
    assert err["learned_orthogonal"] != err["hadamard"]
    table = G.gap_share_table(summary)
    assert table is not None and {r["config"] for r in table.rows} == set(presets.BEYOND2_VARIANTS)
    row = {r["config"]: r for r in table.rows}
    assert row["pairwise_only"]["share"] in (0.0, None)
    assert row["learned_orthogonal"]["foldable"] is False and row["prerope_channel_scale"]["foldable"] is True
    # each cell recorded whether its R3 folds into this (norm-free) Llama: the commuting ones do
    assert summary["configs"]["pairwise_scaled-range_per_head"]["r3_folds"] == [True] * 3
    assert summary["configs"]["learned_orthogonal"]["r3_folds"] == [False] * 3
    png = G.plot_gap_share(table, tmp_path / "gap.png")
    assert png.stat().st_size > 1000
    (tmp_path / "gap.csv").write_text(table.csv())
    assert len(read_csv_rows(tmp_path / "gap.csv")) == len(presets.BEYOND2_VARIANTS)

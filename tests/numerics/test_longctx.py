"""The long-context protocol as specified (App. A.4, App. C): the first-64-document stream, the
window counts min(cap, ⌊N/L⌋), evaluation on corpora other than the calibration one, φ* matched to L under
every estimator, and the deviations the CLI prints."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rope_quant import cli
from rope_quant.corpora import sources, token_streams
from rope_quant.corpora.documents import SEPARATOR
from rope_quant.experiment.config import Estimator, RunConfig
from rope_quant.scoring import longctx
from rope_quant.sweep import presets
from rope_quant.sweep.manifest import LongContextConfig, SweepError, config_from_dict, read_manifest
from tests._support import tiny_base

PAPER_LENGTHS = tuple(2048 * 2 ** i for i in range(7))  # 2K ... 128K


class CharTokenizer:
    """One token per character (ids = code point mod 1000): N is the length of the joined text."""

    def get_vocab(self) -> dict[str, int]:
        return {"chars": 1000}

    def __call__(self, text: str, add_special_tokens: bool = False, verbose: bool = False) -> dict:
        assert add_special_tokens is False
        return {"input_ids": [ord(c) % 1000 for c in text]}


# ----------------------------------------------------------------------------- counts


def test_counts_on_a_stream_of_known_size_are_the_papers() -> None:
    """A 235,000-token stream (Proof-Pile's first 64 documents are in [229,376, 245,760) by the paper's counts)
    gives 24/24/24/14/7/3/1 windows at L = 2K ... 128K."""
    counts = longctx.window_counts(235_000, PAPER_LENGTHS)
    assert counts == longctx.PAPER_COUNTS
    assert [counts[L] for L in PAPER_LENGTHS] == [24, 24, 24, 14, 7, 3, 1]
    assert longctx.scored_tokens(counts)[16384] == 14 * 16383
    assert longctx.window_counts(235_000, (2048,), cap=4) == {2048: 4}  # the CPU budget knob
    assert longctx.window_counts(235_000, (2048,), cap=None) == {2048: 114}
    assert longctx.window_counts(1000, (2048,)) == {2048: 0}
    with pytest.raises(longctx.LongContextProtocolError, match="cap"):
        longctx.window_counts(1000, (64,), cap=0)
    with pytest.raises(longctx.LongContextProtocolError, match="length"):
        longctx.window_counts(1000, (1,))


def _pg19(root: Path, n_test: int) -> list[str]:
    (root / "train").mkdir(parents=True)
    (root / "test").mkdir()
    (root / "train" / "a.txt").write_text("calibration book " * 50)
    texts = []
    for i in range(n_test):
        text = f"book {i} " + "lorem ipsum " * (10 + i)
        (root / "test" / f"{i:03d}.txt").write_text(text)
        texts.append(text)
    return texts


def test_stream_is_the_first_64_documents_of_a_pg19_folder(tmp_path: Path) -> None:
    texts = _pg19(tmp_path / "pg19", 70)
    stream = longctx.eval_stream(tmp_path / "pg19", CharTokenizer(), cache_dir=tmp_path / "cache")
    joined = SEPARATOR.join(texts[:64])
    assert stream.n_tokens == len(joined)
    assert stream.ids.tolist() == [ord(c) % 1000 for c in joined]
    assert len(stream.documents) == 64 and stream.total_documents == 70
    assert stream.documents[0] == "test/000.txt" and stream.documents[-1] == "test/063.txt"
    again = longctx.eval_stream(tmp_path / "pg19", CharTokenizer(), cache_dir=tmp_path / "cache")  # cache hit
    assert again.ids.tolist() == stream.ids.tolist()
    assert len(list((tmp_path / "cache" / "corpora").glob("*.pt"))) == 1
    whole = longctx.eval_stream(tmp_path / "pg19", CharTokenizer(), None, use_cache=False)
    assert whole.n_tokens == len(SEPARATOR.join(texts)) and whole.describe()["max_documents"] is None
    record = longctx.protocol_record(stream, (256, 1024), 24, "pydoc")
    assert record["calib_corpus"] == "pydoc" and record["eval_corpus"] == str(tmp_path / "pg19")
    assert record["n_stream_tokens"] == len(joined) and record["n_documents"] == 64
    assert len(joined) // 1024 == 31  # more windows fit than the cap lets through at 1024
    assert record["windows"] == {"256": 24, "1024": 24}
    assert record["scored_tokens"] == {"256": 24 * 255, "1024": 24 * 1023}
    assert longctx.protocol_record(stream, (1024,), None, "pydoc")["windows"] == {"1024": 31}


def test_stream_of_a_proof_pile_jsonl_split_follows_the_same_rule(tmp_path: Path) -> None:
    root = tmp_path / "pp"
    root.mkdir()
    (root / "train.jsonl").write_text("\n".join(json.dumps({"text": f"train {i} " * 20}) for i in range(5)))
    lines = [f"theorem {i}: " + "x + y = z. " * (5 + i % 7) for i in range(80)]
    (root / "test.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in lines))
    stream = longctx.eval_stream(root, CharTokenizer(), use_cache=False)
    assert stream.n_tokens == len(SEPARATOR.join(lines[:64]))
    assert stream.documents[-1] == "test.jsonl:64" and stream.total_documents == 80
    with pytest.raises(longctx.LongContextProtocolError, match="max_documents"):
        longctx.eval_stream(root, CharTokenizer(), 0, use_cache=False)


# ----------------------------------------------------------------------------- corpora and deviations


def test_default_eval_corpora_differ_from_calibration() -> None:
    assert longctx.default_eval_corpora("pydoc", ["pydoc", "shakespeare", "kjv", "debian-reference"]) == (
        "shakespeare", "kjv")
    assert longctx.default_eval_corpora("shakespeare", ["pydoc", "shakespeare", "kjv", "debian-reference"]) == (
        "kjv", "debian-reference")
    assert longctx.default_eval_corpora("pydoc", ["pydoc", "shakespeare"]) == ("shakespeare",)
    assert longctx.default_eval_corpora("pydoc", ["pydoc"]) == ()


def test_deviations_name_every_departure_and_none_for_the_papers_settings() -> None:
    assert longctx.deviations(calib_corpus="wikitext2", eval_corpora=("proof-pile", "pg19"), max_documents=64,
                              cap=24, lengths=PAPER_LENGTHS) == []
    devs = longctx.deviations(calib_corpus="pydoc", eval_corpora=("pydoc",), max_documents=None, cap=4,
                              lengths=(1024, 4096), unmatched_phi_star=("x",))
    text = "; ".join(devs)
    for part in ("calibration corpus pydoc", "1 evaluation corpus instead of 2", "whole evaluation split",
                 "at most 4 windows", "length 1024 below", "φ* averaged over seqlen, not over L, in x"):
        assert part in text, text
    assert not any("evaluation corpus instead" in d for d in longctx.deviations(
        calib_corpus="pydoc", eval_corpora=("kjv",), max_documents=64, cap=24, lengths=(2048,),
        count_corpora=False))


# ----------------------------------------------------------------------------- manifests


@pytest.mark.parametrize("estimator", [e.value for e in Estimator])
def test_phi_star_is_matched_to_L_under_every_estimator(estimator: str) -> None:
    base = RunConfig.from_flat(angle="phi_star", estimator=estimator)
    m = presets.long_context_manifest(base, ("hadamard", "pairwise_only", "pairwise_plus_hadamard"), (0,),
                                      (1024, 2048))
    cells = dict(m.cells)
    assert cells["pairwise_only"].matched_average and cells["pairwise_plus_hadamard"].matched_average
    assert not cells["hadamard"].matched_average  # no angles to match
    assert cells["pairwise_only"].run.estimator == estimator
    fixed = presets.long_context_manifest(base.override(average_length=512), ("pairwise_only",), (0,), (1024,))
    assert not fixed.cells[0][1].matched_average  # an explicit averaging length is kept
    extra, meta = presets.phi_star_matched_cells(RunConfig(), (0, 1), (1024,), (estimator,))
    assert [n for n, _ in extra] == [f"pairwise_only-phi_star_{estimator}"] * 2
    assert all(c.matched_average and c.run.estimator == estimator and c.run.angle == "phi_star" for _, c in extra)
    assert meta[f"pairwise_only-phi_star_{estimator}"]["average_length"] == "L"


def test_per_corpus_pairs_each_config_with_its_corpus_comparator() -> None:
    m = presets.long_context_manifest(RunConfig(), ("hadamard", "pairwise_only"), (0, 1), (1024,))
    m = presets.with_eval_docs(presets.per_corpus(m, ("shakespeare", "kjv")), 64)
    assert m.names() == ["hadamard+shakespeare", "pairwise_only+shakespeare", "hadamard+kjv", "pairwise_only+kjv"]
    assert m.comparator == "hadamard+shakespeare"
    assert m.meta["pairwise_only+kjv"]["control"] == "hadamard+kjv"
    assert "control" not in m.meta["hadamard+kjv"]
    assert list(m.family) == ["pairwise_only+shakespeare", "pairwise_only+kjv"]
    cfg = dict(m.cells)["pairwise_only+kjv"]
    assert cfg.eval_corpus == "kjv" and cfg.eval_docs == 64 and cfg.run.corpus == "pydoc"
    again = config_from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg and again.key() == cfg.key()
    assert cfg.key() != LongContextConfig(cfg.run, cfg.lengths, eval_corpus="kjv").key()
    with pytest.raises(SweepError, match="eval_docs"):
        LongContextConfig(cfg.run, (1024,), eval_docs=0)


def _fake(cfg) -> dict:
    gap = 0.0 if cfg.run.r3 == "hadamard" else 0.5 + 0.01 * cfg.seed
    return {"lengths": {str(L): {"ppl": 20.0 + gap, "n_windows": 1, "n_tokens": L - 1} for L in cfg.lengths}}


def test_cli_defaults_to_other_corpora_and_prints_the_deviations(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(sources, "list_corpora", lambda include_unavailable=False: ["pydoc", "shakespeare", "kjv"])
    out = tmp_path / "lc"
    argv = ["long-context", "--seeds", "0,1", "--lengths", "1024,2048", "--out", str(out), "--quiet",
            "--no-figures", "--phi-star-estimators", "all"]
    assert cli.main(argv, cell_fn=_fake) == 0
    printed = capsys.readouterr().out
    assert "calibrate on pydoc; evaluate on shakespeare, kjv; stream = the first 64 documents" in printed
    assert "windows per L = min(4, N // L)" in printed
    assert "deviations from A.4: at most 4 windows per length instead of 24 (a budget knob); length 1024 " \
           "below the paper's shortest (2048)" in printed
    manifest = read_manifest(out)
    names = {c["name"] for c in manifest["cells"]}
    ests = [e.value for e in Estimator]
    assert names == {f"{n}+{c}" for c in ("shakespeare", "kjv")
                     for n in ("hadamard", "pairwise_only", *[f"pairwise_only-phi_star_{e}" for e in ests])}
    cells = {(c["name"], c["seed"]): config_from_dict(c["config"]) for c in manifest["cells"]}
    star = cells[("pairwise_only-phi_star_balanced+kjv", 1)]
    assert star.matched_average and star.eval_docs == 64 and star.eval_corpus == "kjv"
    lc = json.loads((out / "summary.json").read_text())["long_context"]
    assert lc["paired"]["2048"]["pairwise_only+kjv"]["comparator"] == "hadamard+kjv"
    assert lc["paired"]["2048"]["pairwise_only+kjv"]["mean"] == pytest.approx(0.505)

    capsys.readouterr()
    assert cli.main(["long-context", "--seeds", "0", "--lengths", "2048", "--eval-corpora", "pydoc",
                     "--eval-docs", "0", "--eval-windows", "24", "--out", str(tmp_path / "same"), "--quiet",
                     "--no-figures"], cell_fn=_fake) == 0
    printed = capsys.readouterr().out
    assert "evaluated on the calibration corpus pydoc" in printed and "whole evaluation split" in printed
    assert {c["name"] for c in read_manifest(tmp_path / "same")["cells"]} == {"hadamard", "pairwise_only"}
    assert cli.main(["long-context", "--seeds", "0", "--eval-docs", "-1", "--out", str(tmp_path / "bad")],
                    cell_fn=_fake) == 2


# ----------------------------------------------------------------------------- real pipeline (tiny model)


def tiny_llama(embedded_model):
    """A 2-layer Llama (head_dim 16, GQA 4:2) with the embedded model's tokenizer."""
    return tiny_base(embedded_model, max_positions=1024)


def test_matched_cells_under_every_estimator_record_the_protocol(embedded_model, tmp_path: Path) -> None:
    """Through the real cell function on a tiny Llama: for each estimator the matched φ* cell at L equals the φ*
    cell with averaging length L, and the record names both corpora, N, the windows and the scored tokens."""
    from rope_quant.sweep.cells import pipeline_cell_fn
    from rope_quant.sweep.loaded_models import ModelCache

    base = tiny_llama(embedded_model)
    corpus = token_streams.load_corpus("pydoc", base[1])
    models = ModelCache()
    models.put("tiny", "cpu", base, {"pydoc": corpus})
    fn = pipeline_cell_fn(models=models)
    lengths = (64, 256)
    stream = longctx.eval_stream("pydoc", base[1], 3)
    try:
        for est in ("rows", "k_only", "balanced", "per_head"):
            run = RunConfig.from_flat(model="tiny", r3="pairwise_only", estimator=est, angle="phi_star",
                                      weights="rtn", seqlen=64, calib_windows=2, eval_windows=2)
            res = fn(LongContextConfig(run, lengths, matched_average=True, eval_docs=3))
            for L in lengths:
                alone = fn(LongContextConfig(run.override(average_length=L), (L,), eval_docs=3))
                assert res["lengths"][str(L)]["ppl"] == pytest.approx(alone["lengths"][str(L)]["ppl"], rel=1e-6)
                assert res["lengths"][str(L)]["average_length"] == L
            fixed = fn(LongContextConfig(run, (256,), eval_docs=3))  # averaged over seqlen = 64
            assert fixed["lengths"]["256"]["ppl"] != pytest.approx(res["lengths"]["256"]["ppl"], rel=1e-9), est
            p = res["protocol"]
            assert (p["calib_corpus"], p["eval_corpus"], p["estimator"], p["matched_average"]) == (
                "pydoc", "pydoc", est, True)
            assert p["n_stream_tokens"] == stream.n_tokens and p["n_documents"] == 3
            assert p["windows"] == {str(L): min(2, stream.n_tokens // L) for L in lengths}
            assert p["scored_tokens"] == {str(L): p["windows"][str(L)] * (L - 1) for L in lengths}
            assert all(res["lengths"][str(L)]["n_windows"] == p["windows"][str(L)] for L in lengths)
            assert "first 3 documents" in "; ".join(p["deviations"])
            assert np.isfinite(res["lengths"]["256"]["ppl"])
    finally:
        models.clear()


def test_preflight_checks_lengths_against_the_evaluation_stream(tmp_path: Path) -> None:
    """The windows of a long-context cell are checked on the stream it scores (the other corpus's first
    documents), not on the calibration corpus's evaluation split."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rope_quant.sweep.loaded_models import ModelCache
    from rope_quant.sweep.preflight import PreflightError, preflight

    calib = tmp_path / "small.txt"
    calib.write_text("\n\n".join(["short calibration text. " * 40] * 5))  # eval side: ~1,000 characters
    texts = _pg19(tmp_path / "pg19", 70)
    n = len(SEPARATOR.join(texts[:64]))
    cfg = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    models = ModelCache(lambda model, device: (LlamaForCausalLM(cfg).eval(), CharTokenizer()))
    run = RunConfig.from_flat(corpus=str(calib), seqlen=32, calib_windows=1, eval_windows=24, r1="hadamard",
                              r2="hadamard")
    ok = presets.with_eval_docs(presets.long_context_manifest(run, ("hadamard",), (0,), (1024,),
                                                              eval_corpus=str(tmp_path / "pg19")), 64)
    notes = preflight(ok, models, load=True)  # 1024 > the calibration corpus's evaluation split: still fine
    assert not any("pg19" in note for note in notes)
    assert n // 8192 < 24
    few = presets.with_eval_docs(presets.long_context_manifest(run, ("hadamard",), (0,), (8192,),
                                                               eval_corpus=str(tmp_path / "pg19")), 64)
    assert any(f"{n // 8192} of at most 24 windows of 8192 tokens" in note for note in preflight(few, models,
                                                                                                   load=True))
    bad = presets.with_eval_docs(presets.long_context_manifest(run, ("hadamard",), (0,), (4 * n,),
                                                               eval_corpus=str(tmp_path / "pg19")), 64)
    with pytest.raises(PreflightError, match=f"has {n} tokens, fewer than one window of {4 * n} tokens"):
        preflight(bad, models, load=True)

"""lm-evaluation-harness as a real client of the quantised model, offline, on the embedded model.

* agreement: a local ``loglikelihood_rolling`` task over a few ``pydoc`` documents (``dataset_path: json``);
  lm-eval's per-document log-likelihood equals our evaluator's on the same tokens (one window, lm-eval's
  prefix token as BOS), on the full-precision model and on W16A16KV4 with hadamard and pairwise_only, whose
  paired difference the two harnesses also agree on;
* the activation quantisers (forward pre-hooks) are in effect under lm-eval too;
* ``rope-quant lm-eval`` end to end on a local multiple-choice task (the true next sentence of a ``pydoc``
  paragraph among 4): cells, the paired accuracy table, the figure, and resume;
* without lm-eval, a clear error naming the ``[eval]`` extra.
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

import pytest
import torch

from rope_quant import cli
from rope_quant.corpora import sources
from rope_quant.experiment import lm_eval as rle
from rope_quant.experiment import pipeline
from rope_quant.scoring import evaluate
from rope_quant.sweep.loaded_models import ModelCache

REL_TOL = 1e-4
W16A16KV4 = dict(w_bits=16, a_bits=16, k_bits=4, v_bits=16, weights="none", r1="none", r2="none", r4=False,
                 seqlen=128, calib_windows=2, eval_windows=1)


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in rle.OFFLINE_VARS:
        monkeypatch.setenv(var, "1")


@pytest.fixture(scope="module")
def lm_eval_installed():
    return pytest.importorskip("lm_eval", reason='lm-eval is an optional extra: pip install -e ".[eval]"')


# ----------------------------------------------------------------------------- local tasks


def pydoc_documents(tokenizer, n: int = 3, low: int = 48, high: int = 200) -> list[str]:
    """The first ``n`` pydoc evaluation documents of ``low``..``high`` tokens (disjoint from calibration)."""
    docs = []
    for doc in sources.load_text("pydoc").eval:
        text = doc.text.strip()
        if low <= len(tokenizer.encode(text, add_special_tokens=False)) <= high:
            docs.append(text)
        if len(docs) == n:
            return docs
    raise AssertionError("not enough short pydoc documents")


def write_rolling_task(folder: Path, docs: list[str], name: str = "pydoc_rolling") -> Path:
    """A ``loglikelihood_rolling`` task YAML over a JSONL of ``docs`` (like lm-eval's wikitext task)."""
    folder.mkdir(parents=True, exist_ok=True)
    jsonl = folder / f"{name}.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(docs)))
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {jsonl}\n"
        f"  cache_dir: {folder / 'hf-cache'}\ntest_split: test\noutput_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n  - metric: word_perplexity\n'
        "    aggregation: weighted_perplexity\n    higher_is_better: false\n")
    return folder


def _sentences(text: str) -> list[str]:
    flat = " ".join(text.split())
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", flat) if s.strip()]


def write_next_sentence_task(folder: Path, n_items: int = 8, seed: int = 0,
                             name: str = "pydoc_next_sentence") -> Path:
    """A 4-way multiple-choice task: which sentence follows (up to) two sentences of a pydoc paragraph; the 3
    distractors are sentences of other documents."""
    rng = random.Random(seed)
    docs = [_sentences(d.text) for d in sources.load_text("pydoc").eval]
    ok = [[s for s in doc if 6 <= len(s.split()) <= 24] for doc in docs]
    items = []
    for i, doc in enumerate(docs):
        pairs = [(j, b) for j, b in enumerate(doc[1:], 1) if b in ok[i] and sum(map(len, doc[max(0, j - 2):j])) < 400]
        if not pairs:
            continue
        j, true = pairs[0]
        context = " ".join(doc[max(0, j - 2):j])  # up to two sentences of the same paragraph
        pool = [s for j, other in enumerate(ok) if j != i for s in other]
        choices = [true, *rng.sample(pool, 3)]
        rng.shuffle(choices)
        items.append({"context": context, "choices": choices, "label": choices.index(true)})
        if len(items) == n_items:
            break
    folder.mkdir(parents=True, exist_ok=True)
    jsonl = folder / f"{name}.jsonl"
    jsonl.write_text("".join(json.dumps(item) + "\n" for item in items))
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {jsonl}\n"
        f"  cache_dir: {folder / 'hf-cache'}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: context\ndoc_to_choice: choices\ndoc_to_target: label\nmetric_list:\n"
        "  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
        "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n")
    return folder


# ----------------------------------------------------------------------------- helpers


def _lm_eval_loglikelihoods(model, tokenizer, folder: Path, task: str = "pydoc_rolling") -> list[float]:
    lm = rle.as_hflm(model, tokenizer, max_length=512)
    res = rle.evaluate_tasks(lm, [task], manager=rle.task_manager(folder, include_defaults=False))
    samples = sorted(res["samples"][task], key=lambda s: s["doc_id"])
    return [s["loglikelihood"] for s in samples]


def _our_loglikelihoods(model, tokenizer, docs: list[str]) -> list[float]:
    """Our evaluator on lm-eval's tokens: one window [prefix (BOS)] + the document without special tokens."""
    prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    out = []
    with torch.inference_mode():
        for text in docs:
            ids = torch.tensor([prefix, *tokenizer.encode(text, add_special_tokens=False)])
            out.append(-float(evaluate.window_nll_sum(model, ids)))
    return out


def _assert_agree(ours: list[float], theirs: list[float]) -> None:
    for a, b in zip(ours, theirs, strict=True):
        assert b == pytest.approx(a, rel=REL_TOL), (ours, theirs)


# ----------------------------------------------------------------------------- agreement


@pytest.mark.compat  # lm-eval's HFLM on this transformers
def test_full_precision_agreement(lm_eval_installed, embedded_model, tmp_path: Path) -> None:
    model, tok = embedded_model
    docs = pydoc_documents(tok)
    folder = write_rolling_task(tmp_path / "tasks", docs)
    theirs = _lm_eval_loglikelihoods(model, tok, folder)
    ours = _our_loglikelihoods(model, tok, docs)
    print("fp per-doc LL (ours, lm-eval):", list(zip(ours, theirs, strict=True)))
    _assert_agree(ours, theirs)


def test_quantized_agreement_and_paired_difference(lm_eval_installed, embedded_model, tmp_path: Path) -> None:
    """W16A16KV4, hadamard then pairwise_only (one build, reconfigured): same per-doc LL, same paired Δ."""
    model, tok = embedded_model
    docs = pydoc_documents(tok)
    folder = write_rolling_task(tmp_path / "tasks", docs)
    fp = _our_loglikelihoods(model, tok, docs)
    cfg = pipeline.RunConfig.from_flat(r3="hadamard", **W16A16KV4)
    hflm, qm = rle.quantized_lm(cfg, base=embedded_model)
    assert hflm.model is qm.model and qm.model.config._attn_implementation == "rq_sdpa"

    calls = []
    for st in qm.states:  # observers run inside our attention function: proof lm-eval goes through it
        st.observers.append(lambda layer, k, v: calls.append(layer))
    results = {}
    for r3 in ("hadamard", "pairwise_only"):
        if r3 != qm.cfg.r3:
            qm.reconfigure(cfg.override(r3=r3))
            for st in qm.states:  # reconfigure installs fresh attention states
                st.observers.append(lambda layer, k, v: calls.append(layer))
        calls.clear()
        theirs = _lm_eval_loglikelihoods(qm.model, qm.tokenizer, folder)
        assert len(calls) >= qm.geometry.n_layers * len(docs), "lm-eval bypassed the rq_sdpa attention"
        ours = _our_loglikelihoods(qm.model, qm.tokenizer, docs)
        print(f"{r3} per-doc LL (ours, lm-eval):", list(zip(ours, theirs, strict=True)))
        _assert_agree(ours, theirs)
        assert all(abs(q - f) > 1e-3 for q, f in zip(ours, fp, strict=True)), "KV4 changed nothing"
        results[r3] = (ours, theirs)
    (h_ours, h_theirs), (p_ours, p_theirs) = results["hadamard"], results["pairwise_only"]
    d_ours, d_theirs = sum(p_ours) - sum(h_ours), sum(p_theirs) - sum(h_theirs)
    print(f"paired Δ total LL (pairwise_only − hadamard): ours {d_ours:+.5f}, lm-eval {d_theirs:+.5f}")
    assert d_ours != 0 and (d_ours > 0) == (d_theirs > 0)
    assert d_theirs == pytest.approx(d_ours, abs=REL_TOL * abs(sum(h_ours)))
    for a, b in zip(h_ours, p_ours, strict=True):  # per document too
        i = h_ours.index(a)
        assert (p_theirs[i] - h_theirs[i]) == pytest.approx(b - a, abs=REL_TOL * abs(a))


def test_activation_quantizers_in_effect_under_lm_eval(lm_eval_installed, embedded_model, tmp_path: Path) -> None:
    """A4 (forward pre-hooks on every decoder linear): lm-eval scores the activation-quantised model."""
    model, tok = embedded_model
    docs = pydoc_documents(tok, n=1)
    folder = write_rolling_task(tmp_path / "tasks", docs)
    cfg = pipeline.RunConfig.from_flat(r3="hadamard", **{**W16A16KV4, "a_bits": 4, "k_bits": 16})
    hflm, qm = rle.quantized_lm(cfg, base=embedded_model)
    assert qm.act_handles
    res = rle.evaluate_tasks(hflm, ["pydoc_rolling"], manager=rle.task_manager(folder, include_defaults=False))
    theirs = [res["samples"]["pydoc_rolling"][0]["loglikelihood"]]
    ours = _our_loglikelihoods(qm.model, tok, docs)
    _assert_agree(ours, theirs)
    assert abs(theirs[0] - _our_loglikelihoods(model, tok, docs)[0]) > 1e-2


# ----------------------------------------------------------------------------- the CLI


def test_cli_multiple_choice_paired_accuracy_and_resume(lm_eval_installed, embedded_model, tmp_path: Path,
                                                        capsys, monkeypatch) -> None:
    folder = write_next_sentence_task(tmp_path / "tasks", n_items=8)
    models = ModelCache()
    models.put("smollm2-135m", "cpu", embedded_model)
    out = tmp_path / "lm"
    argv = ["lm-eval", "--out", str(out), "--configs", "hadamard,pairwise_only", "--seeds", "0,1",
            "--tasks", "pydoc_next_sentence", "--include-path", str(folder), "--only-include-path",
            "--w-bits", "16", "--a-bits", "16", "--k-bits", "4", "--v-bits", "16", "--weights", "none",
            "--seqlen", "128", "--calib-windows", "2", "--quiet"]
    code = cli.main(argv, models=models)
    printed = capsys.readouterr().out
    assert code == 0, printed
    cells = sorted((out / "cells").glob("*/seed*.json"))
    assert len(cells) == 4
    for path in cells:
        rec = json.loads(path.read_text())
        assert rec["status"] == "ok" and rec["config"]["lm_eval"]["tasks"] == ["pydoc_next_sentence"]
        acc = rec["result"]["tasks"]["pydoc_next_sentence"]["acc"]
        assert 0.0 <= acc <= 1.0 and len(rec["result"]["samples"]["pydoc_next_sentence"]) == 8
    summary = json.loads((out / "summary.json").read_text())
    lm = summary["lm_eval"]
    assert summary["kind"] == "lm-eval" and lm["tasks"] == ["pydoc_next_sentence"]
    assert lm["seeds"] == {"hadamard": [0, 1], "pairwise_only": [0, 1]}
    block = lm["paired"]["pydoc_next_sentence"]["acc"]["pairwise_only"]
    h, p = lm["configs"]["hadamard"]["pydoc_next_sentence"]["acc"], lm["configs"]["pairwise_only"][
        "pydoc_next_sentence"]["acc"]
    assert block["n"] == 2 and block["mean"] == pytest.approx(sum(p) / 2 - sum(h) / 2)
    assert block["low"] is not None and block["low"] <= block["mean"] <= block["high"]
    md = (out / "summary.md").read_text()
    assert "lm-eval metrics per seed, paired against hadamard" in md
    assert "| pydoc_next_sentence | acc | pairwise_only |" in md and "(comparator)" in md
    assert (out / "tables" / "lm-eval.csv").is_file()
    figure = out / "figures" / "lm-eval.png"
    assert figure.is_file() and f"figure: {figure}" in printed

    # resume: nothing is rebuilt or re-scored
    def boom(*args, **kwargs):
        raise AssertionError("a complete cell was recomputed")

    monkeypatch.setattr(rle, "evaluate_tasks", boom)
    monkeypatch.setattr(pipeline, "build_quantized_model", boom)
    assert cli.main(argv, models=models) == 0
    assert "4 already complete" in capsys.readouterr().out


@pytest.mark.compat  # the bridge's import path
def test_missing_lm_eval_names_the_extra(monkeypatch, tmp_path: Path, capsys) -> None:
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    monkeypatch.setitem(sys.modules, "lm_eval.models.huggingface", None)
    with pytest.raises(rle.LmEvalMissingError, match=re.escape('pip install -e ".[eval]"')):
        rle.require_lm_eval()
    code = cli.main(["lm-eval", "--out", str(tmp_path / "x"), "--tasks", "piqa", "--seeds", "0"])
    assert code == 2
    assert 'pip install -e ".[eval]"' in capsys.readouterr().err

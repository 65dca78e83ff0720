"""Content identity of a cell's inputs: what the model and the corpus *are*, not what they are called.

A cell's key, its weight cache and its statistics cache must change when the model files or the corpus
text change under the same name, and must not change when the same model is named by a relative and an
absolute path. :func:`resolve_identity` resolves a :class:`~rope_quant.experiment.config.RunConfig` once,
before a sweep runs (the CLI does it when it builds the base configuration): local paths become absolute,
and ``model_id`` / ``corpus_id`` get content hashes, which the keys then use in place of the names.

- :func:`model_identity`: SHA-256 over the files a checkpoint is loaded from (a ``.gguf`` file, or every
  top-level file of a Hugging Face directory but hidden and Markdown files: config, weights, tokenizer).
  Files up to :data:`WHOLE_FILE_LIMIT` are hashed whole; larger ones by their size and
  :data:`SAMPLES` evenly spaced 1 MiB chunks (first and last included), so a multi-GB checkpoint costs
  milliseconds. Per-file digests are cached per process by (path, size, mtime, inode).
- :func:`corpus_identity`: SHA-256 over the bytes of every file of a local corpus (relative names
  included); for embedded corpora and ``wikitext2`` over the loaded calibration and evaluation text
  (cached per process: installed data does not change under a running process).

The tokenizer is part of the model's files, so ``model_id`` covers it.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import Any

__all__ = ["WHOLE_FILE_LIMIT", "SAMPLES", "file_digest", "model_identity", "corpus_identity", "resolve_identity"]

#: Files up to this size are hashed whole; larger files are sampled.
WHOLE_FILE_LIMIT = 64 << 20
#: Number of 1 MiB chunks read from a large file (evenly spaced, first and last included).
SAMPLES = 32
_CHUNK = 1 << 20
_DIGITS = 16


def _hash_whole(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def _hash_sampled(path: Path, size: int) -> str:
    h = hashlib.sha256(f"sampled:{size}:{SAMPLES}\0".encode())
    last = size - _CHUNK
    with open(path, "rb") as fh:
        for i in range(SAMPLES):
            fh.seek(last * i // (SAMPLES - 1))
            h.update(fh.read(_CHUNK))
    return h.hexdigest()


@functools.lru_cache(maxsize=4096)
def _digest(path: str, size: int, mtime_ns: int, inode: int) -> str:
    p = Path(path)
    return _hash_whole(p) if size <= WHOLE_FILE_LIMIT else _hash_sampled(p, size)


def file_digest(path: str | os.PathLike[str]) -> str:
    """SHA-256 hex digest of a file's content (whole, or sampled above :data:`WHOLE_FILE_LIMIT`).

    Cached per process by (resolved path, size, mtime, inode): a rewritten file gets a new digest.
    Small files are hashed whole on every call, so a rewrite within the clock's resolution is still seen.
    """
    p = Path(path).resolve()
    st = p.stat()
    if st.st_size <= WHOLE_FILE_LIMIT:
        return _hash_whole(p)
    return _digest(str(p), st.st_size, st.st_mtime_ns, st.st_ino)


def _files_digest(files: list[Path], root: Path, tag: str) -> str:
    h = hashlib.sha256(f"rope_quant-{tag}-v1\0".encode())
    for f in sorted(files):
        h.update(f.relative_to(root).as_posix().encode("utf-8", "surrogatepass") + b"\0")
        h.update(file_digest(f).encode() + b"\0")
    return h.hexdigest()[:_DIGITS]


def _model_files(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir()
            if p.is_file() and not p.name.startswith(".") and p.suffix.lower() != ".md"]


def model_identity(name_or_path: str) -> str:
    """16 hex digits of SHA-256 over the model's files (see the module docstring); raises
    :class:`~rope_quant.model.loading.ModelNotFoundError` like ``load_model``."""
    from rope_quant.model.loading import resolve_model

    src = resolve_model(name_or_path)
    directory = src.directory.resolve()
    files = [directory / src.gguf_file] if src.gguf_file else _model_files(directory)
    return _files_digest(files, directory, "model")


@functools.lru_cache(maxsize=16)
def _named_corpus_identity(name: str) -> str:
    from rope_quant.corpora.sources import load_text

    split = load_text(name)
    h = hashlib.sha256(b"rope_quant-corpus-text-v1\0")
    for docs in (split.calib, split.eval):
        for doc in docs:
            h.update(doc.id.encode("utf-8", "surrogatepass") + b"\0")
            h.update(doc.text.encode("utf-8", "surrogatepass") + b"\0")
        h.update(b"\1")
    return h.hexdigest()[:_DIGITS]


def _local_corpus(name_or_path: str) -> Path | None:
    """The resolved path of a local corpus, or None for embedded / ``wikitext2`` names."""
    from rope_quant.corpora.sources import HF_WIKITEXT_NAMES, list_corpora

    key = str(name_or_path).lower()
    if key in list_corpora(include_unavailable=True) or key in HF_WIKITEXT_NAMES:
        return None
    path = Path(name_or_path).expanduser()
    return path.resolve() if path.exists() else None


def corpus_identity(name_or_path: str) -> str:
    """16 hex digits of SHA-256 over the corpus content (see the module docstring)."""
    path = _local_corpus(name_or_path)
    if path is None:
        return _named_corpus_identity(str(name_or_path).lower())
    if path.is_file():
        return _files_digest([path], path.parent, "corpus")
    files = [p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")]
    return _files_digest(files, path, "corpus")


def _normalised_model(name: str) -> str:
    from rope_quant.model.loading import EMBEDDED_MODELS

    if name.lower() in EMBEDDED_MODELS:
        return name.lower()
    return str(Path(name).expanduser().resolve())


def resolve_identity(cfg: Any) -> Any:
    """``cfg`` (a RunConfig) with local paths made absolute and ``model_id`` / ``corpus_id`` set from the
    content; the keys then follow the content, not the names (idempotent)."""
    model = _normalised_model(cfg.model)
    local = _local_corpus(cfg.corpus)
    corpus = str(local) if local is not None else cfg.corpus
    return cfg.override(model=model, corpus=corpus, model_id=model_identity(model),
                        corpus_id=corpus_identity(corpus))

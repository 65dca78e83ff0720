"""Token streams: a corpus (:mod:`rope_quant.corpora.sources`) tokenised into disjoint calibration and
evaluation streams, cached on disk, and the calibration windows drawn from them.

Each side's text is tokenised with ``add_special_tokens=False`` (transformers 4.x adds BOS otherwise). Token
streams are cached on disk (``<cache>/corpora/<name>-<hash>.pt``, written atomically); the hash covers the
tokenizer's full definition and the exact calibration and evaluation text.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rope_quant.corpora.documents import CorpusError, CorpusFormatError, TextSplit
from rope_quant.corpora.sources import load_text
from rope_quant.defaults import DEFAULT_CORPUS
from rope_quant.io import cache_root, load_tensors, read_cache, save_tensors

__all__ = [
    "CACHE_FORMAT",
    "StreamTooShortError",
    "SamplingError",
    "Corpus",
    "tokenizer_fingerprint",
    "default_cache_dir",
    "load_corpus",
    "calibration_windows",
]

CACHE_FORMAT = 1


class StreamTooShortError(CorpusError):
    """The token stream is shorter than the requested window."""


class SamplingError(CorpusError):
    """Invalid calibration sampling arguments (n, seqlen)."""


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

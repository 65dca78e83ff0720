"""The long-context protocol as specified (App. A.4, App. C): stream, window counts, corpora, deviations.

The paper calibrates on WikiText-2 and scores long context on Proof-Pile and PG19:

- **the evaluation stream** is the first :data:`EVAL_DOCUMENTS` (64) documents of the corpus's evaluation
  split, in the split's order, concatenated (``"\\n\\n"``, as every stream of :mod:`rope_quant.corpora.token_streams`)
  and tokenised without special tokens. Documents are the units :func:`rope_quant.corpora.sources.load_text`
  gives: a PG19 book (one ``.txt`` file, in sorted path order), a Proof-Pile JSON line, a pydoc topic, a KJV
  book, a Shakespeare play, a WikiText split (one document);
- **the windows**: at each context length L the first ``min(cap, ⌊N/L⌋)`` non-overlapping windows of the
  N-token stream are scored, ``cap`` = :data:`WINDOW_CAP` (24), each window scoring ``L - 1`` predictions.
  On Proof-Pile this gave 24/24/24/14/7/3/1 windows at L = 2K ... 128K;
- **calibration on another corpus than evaluation** (:func:`default_eval_corpora` picks the offline ones);
- **φ* with its averaging length matched to L** (``LongContextConfig.matched_average``; any estimator).

:func:`protocol_record` is what each long-context cell records (both corpora, N, documents, windows and
scored tokens per length); :func:`deviations` lists, in words, where a run departs from A.4.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rope_quant.corpora import sources, token_streams
from rope_quant.corpora.documents import SEPARATOR, CorpusFormatError, Document, TextSplit
from rope_quant.io import load_tensors, read_cache, save_tensors

#: Documents of the evaluation split concatenated into the long-context stream (App. A.4).
EVAL_DOCUMENTS = 64
#: Windows scored at most per context length (App. A.4).
WINDOW_CAP = 24
#: The paper's window counts on Proof-Pile at L = 2K, 4K, ..., 128K (App. C).
PAPER_COUNTS = {2048: 24, 4096: 24, 8192: 24, 16384: 14, 32768: 7, 65536: 3, 131072: 1}
#: Offline long-form evaluation corpora in order of preference (the first two installed ones that differ
#: from the calibration corpus are the default): Gutenberg plays (PG19-like) and the KJV books, then the
#: Debian reference chapters.
PREFERRED_EVAL_CORPORA = ("shakespeare", "kjv", "debian-reference")
#: How many evaluation corpora the paper uses (Proof-Pile and PG19).
PAPER_EVAL_CORPORA = 2
CACHE_FORMAT = 1


class LongContextProtocolError(ValueError):
    """Bad long-context protocol input (document count, cap, lengths)."""


@dataclass(frozen=True, eq=False)
class EvalStream:
    """The long-context evaluation stream of one corpus: ``ids`` (1-D int64) from ``documents`` (their ids,
    the first ``len(documents)`` of the ``total_documents`` of the evaluation split)."""

    corpus: str
    ids: torch.Tensor
    documents: tuple[str, ...]
    total_documents: int
    max_documents: int | None

    @property
    def n_tokens(self) -> int:
        return int(self.ids.numel())

    def describe(self) -> dict[str, Any]:
        """JSON-able description (no token ids): corpus, N, documents used / in the split."""
        docs = self.documents
        return {"eval_corpus": self.corpus, "n_stream_tokens": self.n_tokens, "n_documents": len(docs),
                "split_documents": self.total_documents, "max_documents": self.max_documents,
                "first_document": docs[0] if docs else None, "last_document": docs[-1] if docs else None}


def _check_count(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise LongContextProtocolError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def first_documents(split: TextSplit, max_documents: int | None = EVAL_DOCUMENTS) -> tuple[Document, ...]:
    """The first ``max_documents`` documents of ``split``'s evaluation side (all of them for None)."""
    if max_documents is None:
        return split.eval
    return split.eval[:_check_count("max_documents", max_documents)]


def _cache_path(cache_dir: Path, name: str, docs: Sequence[Document], tok_fp: str) -> Path:
    h = hashlib.sha256(f"rope_quant-longctx-v{CACHE_FORMAT}\0{tok_fp}\0".encode())
    for doc in docs:
        h.update(doc.id.encode("utf-8", "surrogatepass") + b"\0")
        h.update(doc.text.encode("utf-8", "surrogatepass") + b"\0")
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in name).strip("_")[-60:] or "corpus"
    return cache_dir / "corpora" / f"{safe}-first{len(docs)}-{h.hexdigest()[:20]}.pt"


def _read_cached(path: Path) -> torch.Tensor | None:
    def read(p: Path) -> torch.Tensor:
        blob = load_tensors(p)
        ids = blob["ids"]
        if blob.get("format") != CACHE_FORMAT or not (isinstance(ids, torch.Tensor) and ids.dtype == torch.long
                                                     and ids.dim() == 1):
            raise TypeError("unexpected cache content")
        return ids

    return read_cache(path, read, "long-context stream cache", "re-tokenising")


def eval_stream(
    name_or_path: str | os.PathLike, tokenizer: Any, max_documents: int | None = EVAL_DOCUMENTS, *,
    cache_dir: str | os.PathLike | None = None, use_cache: bool = True,
) -> EvalStream:
    """The A.4 evaluation stream of a corpus: its first ``max_documents`` evaluation documents, concatenated.

    ``max_documents=None`` takes the whole evaluation split (the former protocol, a deviation). Only the
    chosen documents are tokenised (a PG19 or Proof-Pile test split is never tokenised whole); the ids are
    cached under ``<cache>/corpora/`` (atomic), keyed by the tokenizer and the exact document texts.
    """
    split = sources.load_text(name_or_path)
    docs = first_documents(split, max_documents)
    if not docs:
        raise CorpusFormatError(f"corpus {split.name!r} has no evaluation documents")
    path = None
    ids = None
    if use_cache:
        root = Path(cache_dir).expanduser() if cache_dir is not None else token_streams.default_cache_dir()
        path = _cache_path(root, split.name, docs, token_streams.tokenizer_fingerprint(tokenizer))
        ids = _read_cached(path)
    if ids is None:
        text = SEPARATOR.join(d.text for d in docs)
        ids = torch.tensor(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"], dtype=torch.long)
        if ids.numel() == 0:
            raise CorpusFormatError(f"corpus {split.name!r}: the evaluation stream tokenised to nothing")
        if path is not None:
            save_tensors(path, {"format": CACHE_FORMAT, "name": split.name, "ids": ids}, "long-context stream cache")
    return EvalStream(str(name_or_path), ids, tuple(d.id for d in docs), len(split.eval), max_documents)


def window_counts(n_tokens: int, lengths: Iterable[int], cap: int | None = WINDOW_CAP) -> dict[int, int]:
    """``{L: min(cap, ⌊N/L⌋)}``: the windows scored at each length (App. A.4); ``cap=None`` scores all."""
    n = _check_count("n_tokens", int(n_tokens), 0)
    if cap is not None:
        _check_count("cap", cap)
    out = {}
    for length in lengths:
        L = _check_count("length", int(length), 2)
        out[L] = n // L if cap is None else min(cap, n // L)
    return out


def scored_tokens(counts: Mapping[int, int]) -> dict[int, int]:
    """Scored predictions per length: ``windows × (L - 1)``."""
    return {L: w * (L - 1) for L, w in counts.items()}


def protocol_record(stream: EvalStream, lengths: Iterable[int], cap: int | None, calib_corpus: str,
                    ) -> dict[str, Any]:
    """What a long-context cell records about its protocol: both corpora, N, the documents, the window cap,
    and the windows and scored tokens per length (keys are strings, as in the cell's ``lengths``)."""
    counts = window_counts(stream.n_tokens, lengths, cap)
    return {"calib_corpus": str(calib_corpus), **stream.describe(), "window_cap": cap,
            "windows": {str(L): w for L, w in counts.items()},
            "scored_tokens": {str(L): t for L, t in scored_tokens(counts).items()}}


def default_eval_corpora(calib_corpus: str, available: Sequence[str] | None = None) -> tuple[str, ...]:
    """The default long-context corpora: the first :data:`PAPER_EVAL_CORPORA` of
    :data:`PREFERRED_EVAL_CORPORA` that are installed and differ from ``calib_corpus`` (may be fewer)."""
    have = set(sources.list_corpora() if available is None else available)
    chosen = [c for c in PREFERRED_EVAL_CORPORA if c in have and c != calib_corpus]
    return tuple(chosen[:PAPER_EVAL_CORPORA])


def deviations(*, calib_corpus: str, eval_corpora: Sequence[str], max_documents: int | None,
               cap: int | None, lengths: Sequence[int], unmatched_phi_star: Sequence[str] = (),
               count_corpora: bool = True) -> list[str]:
    """Where a long-context run departs from A.4, in words (empty: none found). ``count_corpora=False``
    leaves out the study-level check of the number of evaluation corpora (one cell scores one corpus)."""
    out = []
    same = [c for c in eval_corpora if c == calib_corpus]
    if same:
        out.append(f"evaluated on the calibration corpus {calib_corpus} (its held-out split), not on a different "
                   "corpus")
    n_eval = len(set(eval_corpora))
    if count_corpora and n_eval < PAPER_EVAL_CORPORA:
        out.append(f"{n_eval} evaluation corpus instead of {PAPER_EVAL_CORPORA} (Proof-Pile and PG19 in the paper)")
    if max_documents is None:
        out.append("the whole evaluation split is the stream, not its first 64 documents")
    elif max_documents != EVAL_DOCUMENTS:
        out.append(f"the stream is the first {max_documents} documents, not 64")
    if cap is None:
        out.append("every window is scored (no cap of 24)")
    elif cap != WINDOW_CAP:
        out.append(f"at most {cap} windows per length instead of {WINDOW_CAP} (a budget knob)")
    short = [L for L in lengths if L < min(PAPER_COUNTS)]
    if short:
        out.append(f"length{'s' if len(short) > 1 else ''} {', '.join(map(str, short))} below the paper's "
                   f"shortest ({min(PAPER_COUNTS)})")
    if unmatched_phi_star:
        out.append("φ* averaged over seqlen, not over L, in " + ", ".join(unmatched_phi_star))
    return out

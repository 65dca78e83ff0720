"""A corpus's documents and the split rule: calibration and evaluation never share a document.

:class:`Document` (an identity and a text), :class:`TextSplit` (a corpus's two sides and the rule that cut them),
the corpus errors, and the rules that :mod:`rope_quant.corpora.sources` applies: a single-stream corpus is
de-duplicated by content, kept in order and cut at the first document boundary where the calibration side reaches
:data:`CALIB_FRACTION` of the characters (a single text: at the first blank line after it); a corpus with given
splits keeps them, less any evaluation document that repeats a calibration text. Stdlib only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

__all__ = [
    "CALIB_FRACTION",
    "SEPARATOR",
    "CorpusError",
    "UnknownCorpusError",
    "CorpusNotInstalledError",
    "CorpusFormatError",
    "Document",
    "TextSplit",
    "split_documents",
    "split_given",
]

CALIB_FRACTION = 0.8
SEPARATOR = "\n\n"


class CorpusError(ValueError):
    """Base class for corpus problems."""


class UnknownCorpusError(CorpusError):
    """Neither a known corpus name nor an existing local path."""


class CorpusNotInstalledError(CorpusError):
    """A known corpus whose package or cached data is not installed; the message says how to get it."""


class CorpusFormatError(CorpusError):
    """A local corpus exists but its files cannot be read as the expected format."""


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


def split_given(name: str, calib: Sequence[Document], evl: Sequence[Document], rule: str) -> TextSplit:
    """A corpus with given train/test documents; eval documents repeating a calib text are dropped."""
    calib_d = _dedup(calib)
    calib_keys = {d.text.strip() for d in calib_d}
    eval_d = [d for d in _dedup(evl) if d.text.strip() not in calib_keys]
    if not calib_d:
        raise CorpusFormatError(f"corpus {name!r}: the calibration (train) split is empty")
    if not eval_d:
        raise CorpusFormatError(f"corpus {name!r}: the evaluation split is empty")
    return TextSplit(name, tuple(calib_d), tuple(eval_d), rule)

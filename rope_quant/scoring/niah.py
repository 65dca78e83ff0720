"""Needle-in-a-haystack retrieval in the RULER format (App. G), offline.

One *probe* is a prompt of exactly ``length`` tokens::

    HEADER  haystack[:p]  NEEDLE  haystack[p:]  QUESTION

* the haystack is a contiguous slice of a corpus's evaluation token stream
  (:mod:`rope_quant.corpora.sources`: ``pydoc``, ``shakespeare``, ...), at a start drawn per probe;
* the needle is RULER's key-value sentence "The special magic number for X is N." with X an
  adjective-noun key and N a random ``digits``-digit number, inserted at depth ``d`` (a fraction of the
  haystack), moved forward to the next line or sentence end within :data:`SNAP_TOKENS` tokens;
* the question is RULER's: "What is the special magic number for X mentioned in the provided text? The
  special magic number for X mentioned in the provided text is" — the model completes it;
* greedy decoding (:func:`rope_quant.scoring.generate.greedy_generate`) of at most ``digits + 4``
  tokens, through the model's installed attention (the quantised KV cache is in effect);
* exact match: the first run of digits in the continuation equals N (``correct``). RULER's looser
  substring score (N anywhere in the continuation) is recorded too (``contains``).

Probes are deterministic per (seed, length, depth, probe index): :func:`make_probe` draws the key, the
number and the haystack offset from a generator seeded by those four values only, so every
configuration of a seed answers the same probes (paired design).

``template="plain"`` (default) gives the prompt as text to complete; ``template="chat"`` wraps header,
haystack and question in the tokenizer's chat template as the user turn and starts the assistant turn with
the answer prefix.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np
import torch
from torch import nn

from rope_quant.scoring.generate import greedy_generate

__all__ = [
    "NiahError",
    "Template",
    "NiahSpec",
    "Probe",
    "HEADER",
    "make_probe",
    "score",
    "run_probes",
    "accuracy_table",
]

HEADER = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
          "I will quiz you about the numbers afterwards.\n")
NEEDLE = "\nThe special magic number for {key} is {value}.\n"
QUESTION = "\nWhat is the special magic number for {key} mentioned in the provided text?"
ANSWER = " The special magic number for {key} mentioned in the provided text is"
#: How far (tokens) the needle may move forward to land after a newline or a sentence end.
SNAP_TOKENS = 32
_ADJECTIVES = ("amber", "brisk", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly",
               "keen", "lively", "mellow", "nimble", "odd", "pale", "quiet", "rusty", "silent", "tidy",
               "upbeat", "vivid", "wary", "young", "zesty")
_NOUNS = ("falcon", "harbor", "lantern", "meadow", "orchard", "pebble", "quarry", "river", "saddle",
          "thicket", "umbrella", "valley", "walnut", "anchor", "beacon", "canyon", "dolphin", "ember",
          "fjord", "glacier", "hammock", "island", "juniper", "kettle", "ledger")
_DIGITS = re.compile(r"\d+")


class NiahError(ValueError):
    """Bad NIAH input: a length too short for header, needle and question, a depth outside [0, 1], a
    haystack stream shorter than the prompt, a tokenizer without a chat template for ``template="chat"``."""


class Template(StrEnum):
    """How the prompt is presented: as text to complete, or in the tokenizer's chat template."""

    PLAIN = "plain"
    CHAT = "chat"


@dataclass(frozen=True)
class NiahSpec:
    """One NIAH evaluation: lengths × depths × probes on a haystack corpus (App. G: 5 depths × 20 probes).

    ``depths``: needle positions as fractions of the haystack (0 = its start, 1 = its end);
    ``digits``: length of the magic number (RULER: 7); ``max_new_tokens``: decoding budget (default
    ``digits + 4``).
    """

    lengths: tuple[int, ...]
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    probes: int = 20
    corpus: str = "pydoc"
    digits: int = 7
    template: Template = Template.PLAIN
    max_new_tokens: int | None = None

    def __post_init__(self) -> None:
        lengths = tuple(int(v) for v in self.lengths)
        if not lengths or len(set(lengths)) != len(lengths) or min(lengths) < 16:
            raise NiahError(f"lengths must be distinct integers >= 16, got {self.lengths!r}")
        depths = tuple(float(d) for d in self.depths)
        if not depths or len(set(depths)) != len(depths) or any(not 0.0 <= d <= 1.0 for d in depths):
            raise NiahError(f"depths must be distinct fractions in [0, 1], got {self.depths!r}")
        if isinstance(self.probes, bool) or not isinstance(self.probes, int) or self.probes < 1:
            raise NiahError(f"probes must be a positive integer, got {self.probes!r}")
        if isinstance(self.digits, bool) or not isinstance(self.digits, int) or not 1 <= self.digits <= 12:
            raise NiahError(f"digits must be an integer in 1..12, got {self.digits!r}")
        try:
            template = Template(self.template)
        except ValueError:
            raise NiahError(f"template must be one of {', '.join(t.value for t in Template)}, "
                            f"got {self.template!r}") from None
        if self.max_new_tokens is not None and (not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1):
            raise NiahError(f"max_new_tokens must be None or a positive integer, got {self.max_new_tokens!r}")
        object.__setattr__(self, "lengths", lengths)
        object.__setattr__(self, "depths", depths)
        object.__setattr__(self, "template", template)

    @property
    def new_tokens(self) -> int:
        return self.max_new_tokens if self.max_new_tokens is not None else self.digits + 4

    def to_dict(self) -> dict[str, Any]:
        return {"lengths": list(self.lengths), "depths": list(self.depths), "probes": self.probes,
                "corpus": self.corpus, "digits": self.digits, "template": self.template.value,
                "max_new_tokens": self.max_new_tokens}


@dataclass(frozen=True)
class Probe:
    """One NIAH prompt and its answer."""

    length: int
    depth: float
    index: int
    key: str
    value: str
    ids: torch.Tensor
    needle_at: int  # token offset of the needle in ``ids``
    haystack_start: int  # offset of the haystack slice in the corpus stream


def _rng(seed: int, length: int, depth: float, index: int) -> np.random.Generator:
    blob = f"niah|{int(seed)}|{int(length)}|{float(depth):.6f}|{int(index)}".encode()
    return np.random.default_rng(int.from_bytes(hashlib.sha256(blob).digest()[:8], "little"))


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _chat_frame(tokenizer: Any, answer: str) -> tuple[list[int], list[int]]:
    """Token ids before and after the user turn's text in the chat template, with ``answer`` starting the
    assistant turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise NiahError("template='chat' needs a tokenizer with a chat template; use template='plain'")
    marker = "\u2063NIAH\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                         add_generation_prompt=True)
    before, after = text.split(marker)
    return _encode(tokenizer, before), _encode(tokenizer, after + answer.lstrip())


def _snap(stream: torch.Tensor, at: int, tokenizer: Any) -> int:
    """Move an insertion point forward to just after a newline or sentence end (within SNAP_TOKENS)."""
    for j in range(at, min(at + SNAP_TOKENS, stream.numel()) + 1):
        if j == 0 or j == stream.numel():
            return j
        piece = tokenizer.decode([int(stream[j - 1])])
        if piece.endswith(("\n", ". ", ".", "? ", "! ")):
            return j
    return at


def make_probe(tokenizer: Any, stream: torch.Tensor, spec: NiahSpec, seed: int, length: int, depth: float,
               index: int) -> Probe:
    """The ``index``-th probe of (seed, length, depth): exactly ``length`` tokens ending with the question."""
    rng = _rng(seed, length, depth, index)
    key = f"{_ADJECTIVES[rng.integers(len(_ADJECTIVES))]}-{_NOUNS[rng.integers(len(_NOUNS))]}"
    value = str(int(rng.integers(10 ** (spec.digits - 1), 10 ** spec.digits)))
    needle = _encode(tokenizer, NEEDLE.format(key=key, value=value))
    if spec.template == Template.CHAT:
        head, tail = _chat_frame(tokenizer, ANSWER.format(key=key))
        head = head + _encode(tokenizer, HEADER)
        tail = _encode(tokenizer, QUESTION.format(key=key)) + tail
    else:
        head = _encode(tokenizer, HEADER)
        tail = _encode(tokenizer, QUESTION.format(key=key) + ANSWER.format(key=key))
    n_hay = length - len(head) - len(needle) - len(tail)
    if n_hay < 1:
        raise NiahError(f"length {length} leaves no room for a haystack (header, needle and question take "
                        f"{length - n_hay} tokens)")
    stream = torch.as_tensor(stream, dtype=torch.long)
    if stream.numel() < n_hay + SNAP_TOKENS:
        raise NiahError(f"the haystack stream has {stream.numel()} tokens; length {length} needs "
                        f"{n_hay + SNAP_TOKENS}")
    start = int(rng.integers(0, stream.numel() - n_hay + 1))
    hay = stream[start:start + n_hay]
    at = _snap(hay, int(round(depth * n_hay)), tokenizer)
    ids = torch.tensor(head + hay[:at].tolist() + needle + hay[at:].tolist() + tail, dtype=torch.long)
    assert ids.numel() == length
    return Probe(length, depth, index, key, value, ids, len(head) + at, start)


def score(text: str, value: str) -> dict[str, Any]:
    """Exact match (the first digit run equals ``value``) and RULER's substring match."""
    found = _DIGITS.search(text)
    return {"correct": bool(found and found.group() == value), "contains": value in text,
            "answer": found.group() if found else None}


def _stop_after_number(tokenizer: Any):
    """Stop once the continuation holds a digit run followed by something else (the answer is complete)."""
    def stop(tokens: list[int]) -> bool:
        return re.search(r"\d\D", tokenizer.decode(tokens)) is not None
    return stop


def run_probes(model: nn.Module, tokenizer: Any, stream: torch.Tensor, spec: NiahSpec, seed: int,
               lengths: Sequence[int] | None = None, progress: bool = False) -> list[dict[str, Any]]:
    """Answer every probe of ``spec`` (lengths × depths × probes) with greedy decoding; one record each."""
    from tqdm.auto import tqdm

    lengths = tuple(lengths) if lengths is not None else spec.lengths
    grid = [(L, d, i) for L in lengths for d in spec.depths for i in range(spec.probes)]
    eos = getattr(tokenizer, "eos_token_id", None)
    stop = _stop_after_number(tokenizer)
    records = []
    for length, depth, index in tqdm(grid, desc="niah", disable=not progress, leave=False):
        probe = make_probe(tokenizer, stream, spec, seed, length, depth, index)
        t = time.perf_counter()
        gen = greedy_generate(model, probe.ids, spec.new_tokens, eos_token_id=eos, stop=stop)
        text = tokenizer.decode(gen.tokens, skip_special_tokens=True)
        records.append({"length": length, "depth": depth, "probe": index, "key": probe.key, "value": probe.value,
                        "needle_at": probe.needle_at, "haystack_start": probe.haystack_start,
                        "output": text, **score(text, probe.value), "seconds": time.perf_counter() - t})
    return records


def accuracy_table(records: Sequence[dict[str, Any]], metric: str = "correct") -> dict[str, Any]:
    """Accuracy per length, and per (length, depth): ``{"by_length": {L: acc}, "by_depth": {L: {d: acc}},
    "n": {L: count}}`` (keys as strings, JSON-able)."""
    by_length: dict[str, list[float]] = {}
    by_depth: dict[str, dict[str, list[float]]] = {}
    for r in records:
        L, d = str(r["length"]), f"{float(r['depth']):g}"
        by_length.setdefault(L, []).append(float(r[metric]))
        by_depth.setdefault(L, {}).setdefault(d, []).append(float(r[metric]))
    return {"by_length": {L: float(np.mean(v)) for L, v in by_length.items()},
            "by_depth": {L: {d: float(np.mean(v)) for d, v in ds.items()} for L, ds in by_depth.items()},
            "n": {L: len(v) for L, v in by_length.items()}}

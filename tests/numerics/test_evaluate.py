"""Perplexity evaluation: exactness against full logits, blocked lm_head, windows, errors, long context."""

from __future__ import annotations

import math
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rope_quant.corpora.token_streams import load_corpus
from rope_quant.scoring.evaluate import (
    EmptyWindowSetError,
    InvalidWindowSpecError,
    NonFiniteNLLError,
    PPLResult,
    is_out_of_memory,
    long_context,
    perplexity,
)
from tests._support import tiny_llama

# HF causal-LM outputs (labels loss, base model + lm_head) and the GGUF-loaded model: compat
pytestmark = pytest.mark.compat

OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


@pytest.fixture(scope="module")
def tiny():
    """A small random Llama with a wide init so per-token NLLs vary (misalignment would show)."""
    return tiny_llama(101, hidden=32, intermediate=64, initializer_range=0.5)


@pytest.fixture(scope="module")
def stream():
    return torch.randint(0, 101, (300,), generator=torch.Generator().manual_seed(1))


class _FaultyBase(nn.Module):
    """Wraps a base model; ``hook(call_index, length)`` may raise or return a replacement hidden-state fn."""

    def __init__(self, inner: nn.Module, hook):
        super().__init__()
        self.inner, self.hook, self.calls = inner, hook, 0

    def forward(self, input_ids, **kwargs):
        action = self.hook(self.calls, input_ids.shape[1])
        self.calls += 1
        hidden = self.inner(input_ids=input_ids, **kwargs).last_hidden_state
        return types.SimpleNamespace(last_hidden_state=action(hidden) if action else hidden)


class _Faulty(nn.Module):
    """A causal-LM-shaped wrapper sharing the tiny model's modules (the tiny model is not modified)."""

    def __init__(self, lm: nn.Module, hook):
        super().__init__()
        self.model = _FaultyBase(lm.model, hook)
        self.lm_head = lm.lm_head
        self.config = lm.config


def _reference_nll(model, ids: torch.Tensor, seqlen: int, n: int, shift: int = 1) -> float:
    """Mean NLL from full float64 logits of model(ids); ``shift=0`` is a misaligned negative control."""
    total, count = 0.0, 0
    with torch.no_grad():
        for w in range(n):
            x = ids[w * seqlen:(w + 1) * seqlen].unsqueeze(0)
            logits = model(x).logits[0].double()
            pred = logits[:-1] if shift == 1 else logits[1:]
            total += float(F.cross_entropy(pred, x[0, 1:], reduction="sum"))
            count += seqlen - 1
    return total / count


@pytest.mark.parametrize("block_size", [1, 7, 47, 48, 1024])
def test_blocked_lm_head_matches_full_logits(tiny, stream, block_size):
    seqlen, n = 48, 6
    ref = _reference_nll(tiny, stream, seqlen, n)
    res = perplexity(tiny, stream, seqlen, block_size=block_size, progress=False)
    assert res.n_windows == n and res.n_tokens == n * (seqlen - 1) and res.seqlen == seqlen
    assert res.nll == pytest.approx(ref, rel=1e-6)
    assert res.ppl == pytest.approx(math.exp(ref), rel=1e-6)
    # the check has power: a target misalignment by one position is 1000x the tolerance away
    assert abs(_reference_nll(tiny, stream, seqlen, n, shift=0) - ref) > 1e-3 * ref


def test_matches_hf_labels_loss_and_window_bookkeeping(tiny, stream):
    seqlen = 40
    res = perplexity(tiny, stream, seqlen, max_windows=3, progress=False)
    with torch.no_grad():
        losses = [float(tiny(x[None], labels=x[None]).loss) for x in stream[: 3 * seqlen].view(3, seqlen)]
    assert res.n_windows == 3 and res.n_tokens == 3 * 39
    assert res.window_nll == pytest.approx(losses, rel=1e-5)
    assert res.nll == pytest.approx(sum(losses) / 3, rel=1e-5)
    # all windows by default (300 // 40 = 7), a (1, N) batch and a plain list are accepted
    assert perplexity(tiny, stream, seqlen, progress=False).n_windows == 7
    as_batch = perplexity(tiny, stream[None], seqlen, max_windows=3, progress=True)
    as_list = perplexity(tiny, stream.tolist(), seqlen, max_windows=3, progress=False)
    assert as_batch.nll == pytest.approx(res.nll, rel=1e-12)
    assert as_list.nll == pytest.approx(res.nll, rel=1e-12)


def test_empty_window_set_raises_never_one(tiny, stream):
    for kwargs in ({"ids": stream[:39], "seqlen": 40}, {"ids": stream, "seqlen": 40, "max_windows": 0},
                   {"ids": torch.zeros(0, dtype=torch.long), "seqlen": 8}):
        with pytest.raises(EmptyWindowSetError, match="no window to score"):
            perplexity(tiny, progress=False, **kwargs)
    assert issubclass(EmptyWindowSetError, ValueError)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"seqlen": 1}, "seqlen"),
        ({"seqlen": 16, "block_size": 0}, "block_size"),
        ({"seqlen": 16, "max_windows": -1}, "max_windows"),
    ],
)
def test_invalid_window_specs(tiny, stream, kwargs, match):
    with pytest.raises(InvalidWindowSpecError, match=match):
        perplexity(tiny, stream, progress=False, **kwargs)


def test_invalid_ids(tiny, stream):
    with pytest.raises(InvalidWindowSpecError, match="integer token ids"):
        perplexity(tiny, stream.float(), 16, progress=False)
    with pytest.raises(InvalidWindowSpecError, match="1-D"):
        perplexity(tiny, stream[:64].view(2, 32), 16, progress=False)
    with pytest.raises(InvalidWindowSpecError, match=r"\[0, 101\)"):
        perplexity(tiny, torch.full((32,), 101), 16, progress=False)
    with pytest.raises(InvalidWindowSpecError, match="lm_head"):
        perplexity(nn.Linear(2, 2), stream, 16, progress=False)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_nll_names_the_window(tiny, stream, bad):
    model = _Faulty(tiny, lambda call, L: (lambda h: h * bad) if call == 1 else None)
    with pytest.raises(NonFiniteNLLError, match=r"window 1 \(tokens 32\.\.63") as err:
        perplexity(model, stream, 32, progress=False)
    assert err.value.window == 1 and err.value.start == 32


@pytest.mark.parametrize(
    "exc, oom",
    [
        (OOM("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
        (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
        (MemoryError(), True),
        (ValueError("something else broke"), False),
    ],
)
def test_long_context_failure_at_one_length_is_recorded(tiny, stream, exc, oom):
    def hook(call, L):
        if L == 64:
            raise exc

    res = long_context(_Faulty(tiny, hook), stream, [32, 64, 128], progress=False)
    assert list(res) == [32, 64, 128]
    assert res[64] == {"error": type(exc).__name__, "message": str(exc), "length": 64, "oom": oom}
    assert isinstance(res[32], PPLResult) and res[32].n_windows == 300 // 32
    assert isinstance(res[128], PPLResult) and res[128].n_windows == 2 and res[128].n_tokens == 2 * 127
    # each length is independent: identical to a standalone evaluation
    assert res[128].nll == pytest.approx(perplexity(tiny, stream, 128, 24, progress=False).nll, rel=1e-12)
    assert is_out_of_memory(exc) is oom


def test_long_context_empty_nan_and_cap(tiny, stream):
    model = _Faulty(tiny, lambda call, L: (lambda h: h * float("nan")) if L == 16 else None)
    res = long_context(model, stream, [8, 16, 256, 400], progress=False)
    assert isinstance(res[8], PPLResult) and res[8].n_windows == 24 and res[8].n_tokens == 24 * 7  # capped
    assert res[16]["error"] == "NonFiniteNLLError" and "window 0" in res[16]["message"]
    assert isinstance(res[256], PPLResult) and res[256].n_windows == 1
    assert res[400]["error"] == "EmptyWindowSetError" and res[400]["length"] == 400 and not res[400]["oom"]
    assert "ppl" not in res[400]
    assert long_context(tiny, stream, [100], max_windows=2, progress=False)[100].n_windows == 2


def test_long_context_input_checks_and_interrupts(tiny, stream):
    with pytest.raises(InvalidWindowSpecError, match="distinct"):
        long_context(tiny, stream, [32, 32])
    with pytest.raises(InvalidWindowSpecError, match="length"):
        long_context(tiny, stream, [1])

    def interrupt(call, L):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        long_context(_Faulty(tiny, interrupt), stream, [32], progress=False)


def test_embedded_model_matches_direct_loss(embedded_model, tmp_path, rq_record):
    """Perplexity on pydoc (2 x 256 windows) equals exp(mean of model(ids, labels=ids).loss)."""
    model, tokenizer = embedded_model
    corpus = load_corpus("pydoc", tokenizer, cache_dir=tmp_path)
    seqlen = 256
    res = perplexity(model, corpus.eval_ids, seqlen, max_windows=2, block_size=128, progress=False)
    windows = corpus.eval_ids[: 2 * seqlen].view(2, seqlen)
    with torch.no_grad():
        losses = [float(model(x[None], labels=x[None]).loss) for x in windows]
    direct = sum(losses) / len(losses)
    assert res.n_windows == 2 and res.n_tokens == 2 * 255
    assert res.nll == pytest.approx(direct, rel=1e-4)
    assert 5.0 < res.ppl < 40.0, res.ppl
    rq_record("fp_perplexity", corpus="pydoc", seqlen=seqlen, n_windows=2, ppl=round(res.ppl, 3),
              direct_ppl=round(math.exp(direct), 3))

"""Perplexity: short-context windows and the long-context concatenated-stream protocol (App. A.4).

Both cut a token stream into non-overlapping windows of length ``L``; each window scores its ``L - 1``
next-token predictions, and perplexity is ``exp`` of the mean negative log-likelihood over every scored
token (summed in float64). Logits are never materialised for a whole long window: the base model
(:func:`rope_quant.model.arch.base_model`, which applies the final norm) gives hidden states, and the
lm_head (:func:`rope_quant.model.arch.lm_head`) is applied in blocks of ``block_size`` rows (default 1024)
with float32 cross-entropy.
Each window is one deferred-check window (:mod:`rope_quant.quant.deferred`): its NLL and every check of the
quantisers inside its forward come to the host in one transfer. A non-finite NLL raises
:class:`NonFiniteNLLError` naming the window; an empty window set raises
:class:`EmptyWindowSetError` (never a vacuous perplexity of 1.0).
"""

from __future__ import annotations

import gc
import logging
import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rope_quant.model import arch
from rope_quant.quant import deferred

DEFAULT_SEQLEN = 2048
DEFAULT_BLOCK = 1024
LONG_CONTEXT_MAX_WINDOWS = 24

log = logging.getLogger(__name__)


class EvaluationError(ValueError):
    """Base class for evaluation problems."""


class EmptyWindowSetError(EvaluationError):
    """No complete window fits in the stream (or ``max_windows`` is 0): there is nothing to score."""


class NonFiniteNLLError(EvaluationError):
    """A window's negative log-likelihood is NaN or infinite."""

    def __init__(self, message: str, window: int, start: int):
        super().__init__(message)
        self.window = window
        self.start = start


class InvalidWindowSpecError(EvaluationError):
    """Bad ``seqlen``, ``max_windows``, ``block_size`` or token ids."""


@dataclass(frozen=True)
class PPLResult:
    """Perplexity over ``n_windows`` windows of ``seqlen`` tokens (``n_tokens`` scored predictions).

    ``nll`` is the mean NLL per scored token (nats); ``ppl = exp(nll)``. ``window_nll`` holds each window's
    mean NLL, in stream order, for paired comparisons across configurations.
    """

    ppl: float
    nll: float
    n_windows: int
    n_tokens: int
    seqlen: int
    window_nll: tuple[float, ...] = ()


def _as_stream(ids: Any) -> torch.Tensor:
    t = torch.as_tensor(ids)
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1:
        raise InvalidWindowSpecError(
            f"ids must be a 1-D token stream (or shape (1, N)), got {tuple(t.shape)}"
        )
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise InvalidWindowSpecError(f"ids must be integer token ids, got dtype {t.dtype}")
    return t.to(torch.long)


def _check_positive(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidWindowSpecError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def eval_windows(ids: Any, seqlen: int, max_windows: int | None = None) -> torch.Tensor:
    """The windows :func:`perplexity` scores, shape (n, seqlen): the first ``max_windows`` (default all)
    non-overlapping ``seqlen`` windows of the stream ``ids``, in stream order. Another scorer (e.g. a runtime,
    :mod:`rope_quant.runtime.llamacpp`) takes these to score the same tokens."""
    stream = _as_stream(ids)
    _check_positive("seqlen", seqlen, 2)
    if max_windows is not None:
        _check_positive("max_windows", max_windows, 0)
    n_windows = stream.numel() // seqlen
    if max_windows is not None:
        n_windows = min(n_windows, max_windows)
    if n_windows == 0:
        raise EmptyWindowSetError(
            f"no window to score: stream of {stream.numel()} tokens, seqlen={seqlen}, "
            f"max_windows={max_windows}"
        )
    return stream[: n_windows * seqlen].reshape(n_windows, seqlen)


def _base_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The decoder stack (final norm included) and the output projection, from the architecture adapter."""
    try:
        return arch.base_model(model), arch.lm_head(model)
    except arch.ArchitectureError as exc:
        raise InvalidWindowSpecError(
            f"{type(model).__name__} exposes no decoder stack and lm_head the adapter knows: {exc}"
        ) from exc


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _show_progress(progress: bool | None) -> bool:
    if progress is not None:
        return progress
    stream = sys.stderr
    return bool(getattr(stream, "isatty", None) and stream.isatty())


def window_nll_sum(model: nn.Module, window: torch.Tensor, block_size: int = DEFAULT_BLOCK) -> torch.Tensor:
    """Sum (float64) of next-token NLLs of one window (1-D ids): L - 1 predictions, lm_head in blocks."""
    base, head = _base_and_head(model)
    out = base(input_ids=window.unsqueeze(0), use_cache=False)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    hidden = hidden[0, :-1]
    targets = window[1:].to(hidden.device)
    softcap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    total = torch.zeros((), dtype=torch.float64, device=hidden.device)
    for lo in range(0, hidden.shape[0], block_size):
        logits = head(hidden[lo:lo + block_size]).float()
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        nll = F.cross_entropy(logits, targets[lo:lo + block_size], reduction="none")
        total = total + nll.double().sum()
    return total


def perplexity(
    model: nn.Module,
    ids: Any,
    seqlen: int = DEFAULT_SEQLEN,
    max_windows: int | None = None,
    device: torch.device | str | None = None,
    *,
    block_size: int = DEFAULT_BLOCK,
    progress: bool | None = None,
) -> PPLResult:
    """Perplexity of ``model`` on the first ``max_windows`` non-overlapping ``seqlen`` windows of ``ids``.

    ``device`` is where input windows go (default or ``"auto"``: the model's device; the model itself is
    never moved or otherwise modified). ``progress`` shows a tqdm bar (default: only when stderr is a
    terminal).
    """
    stream = _as_stream(ids)
    _check_positive("seqlen", seqlen, 2)
    _check_positive("block_size", block_size, 1)
    if max_windows is not None:
        _check_positive("max_windows", max_windows, 0)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if stream.numel() and vocab is not None and (int(stream.min()) < 0 or int(stream.max()) >= vocab):
        raise InvalidWindowSpecError(
            f"token ids must lie in [0, {vocab}), got range [{int(stream.min())}, {int(stream.max())}]"
        )
    windows = eval_windows(stream, seqlen, max_windows)
    n_windows = windows.shape[0]
    dev = _model_device(model) if device is None or str(device) == "auto" else torch.device(device)

    from tqdm.auto import tqdm

    per_window: list[float] = []
    total = 0.0
    with torch.inference_mode(), tqdm(
        total=n_windows, desc=f"ppl L={seqlen}", unit="win", disable=not _show_progress(progress), leave=False
    ) as bar:
        for w in range(n_windows):
            window = windows[w].to(dev)
            # The quantisers' and diagnostics' checks are read with the NLL: one host read per window.
            def score(win: torch.Tensor = window) -> torch.Tensor:
                return window_nll_sum(model, win, block_size)
            nll_sum = deferred.run_checked(score, lambda t: (t,))[1][0]
            if not math.isfinite(nll_sum):
                raise NonFiniteNLLError(
                    f"non-finite NLL ({nll_sum}) in window {w} (tokens {w * seqlen}..{(w + 1) * seqlen - 1}, "
                    f"seqlen={seqlen})", window=w, start=w * seqlen,
                )
            total += nll_sum
            per_window.append(nll_sum / (seqlen - 1))
            bar.update(1)
    n_tokens = n_windows * (seqlen - 1)
    nll = total / n_tokens
    return PPLResult(math.exp(nll), nll, n_windows, n_tokens, seqlen, tuple(per_window))


def is_out_of_memory(exc: BaseException) -> bool:
    """True for torch/CUDA out-of-memory errors, RuntimeErrors saying "out of memory", and MemoryError."""
    oom_types = tuple(
        t for t in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None))
        if isinstance(t, type)
    )
    if isinstance(exc, MemoryError) or (oom_types and isinstance(exc, oom_types)):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def _release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def long_context(
    model: nn.Module,
    ids: Any,
    lengths: Iterable[int],
    max_windows: int = LONG_CONTEXT_MAX_WINDOWS,
    device: torch.device | str | None = None,
    *,
    block_size: int = DEFAULT_BLOCK,
    progress: bool | None = None,
) -> dict[int, PPLResult | dict[str, Any]]:
    """Concatenated-stream long-context perplexity (App. A.4), each length independent.

    At each ``L`` the first ``min(max_windows, N // L)`` non-overlapping windows are scored. A failure at
    one length (out of memory, an empty window set, a non-finite NLL, ...) becomes an entry
    ``{"error": type name, "message": str, "length": L, "oom": bool}`` and the other lengths still run.
    """
    stream = _as_stream(ids)
    lengths = [int(L) for L in lengths]
    if len(set(lengths)) != len(lengths):
        raise InvalidWindowSpecError(f"lengths must be distinct, got {lengths}")
    for L in lengths:
        _check_positive("length", L, 2)
    _check_positive("max_windows", max_windows, 1)
    results: dict[int, PPLResult | dict[str, Any]] = {}
    for L in lengths:
        failed = False
        try:
            results[L] = perplexity(model, stream, L, max_windows, device, block_size=block_size,
                                    progress=progress)
        except Exception as exc:  # recorded per length by design (App. A.4); KeyboardInterrupt still stops
            failed = True
            oom = is_out_of_memory(exc)
            log.warning("long-context L=%d failed: %s: %s", L, type(exc).__name__, exc)
            results[L] = {"error": type(exc).__name__, "message": str(exc), "length": L, "oom": oom}
        if failed:  # outside the handler, so the traceback's tensors are already released
            _release_memory()
    return results

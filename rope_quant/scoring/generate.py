"""Greedy decoding with a growing KV cache, through whatever attention the model has installed (App. G).

The NIAH task (:mod:`rope_quant.scoring.niah`) decodes its answer with the same quantised model the
perplexity path scores: the one :func:`rope_quant.experiment.pipeline.build_quantized_model` returns,
with the online R3 and the K/V quantisers of :mod:`rope_quant.rotations.attention` in the attention
function and the activation quantisers on the linears. Nothing here knows about quantisation.

The loop is explicit (no ``model.generate``, whose configuration handling differs across the supported
transformers versions): one prefill forward over the prompt into a fresh ``DynamicCache``, then one
forward per new token, so the cache grows one token at a time. The cache holds the raw post-RoPE keys
and values; at every step the attention function applies R3 and the (token-local, per-token) K/V
quantiser to the whole cache, so each cached token enters attention as ``Q(R3(k))`` exactly as in a
full forward over the same tokens: R3 and the quantiser act once on every key, never on an already
quantised one (tests/numerics/test_generate.py checks both the cache contents and the logits).

Sliding-window layers (Gemma 3): on transformers 5.x the cache is built from the model's config, so its
sliding layers keep only their window, and the masks come from the library's mask functions.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["GenerationError", "Generation", "new_cache", "cache_keyword", "greedy_generate"]


class GenerationError(ValueError):
    """Bad generation input (an empty or non-1-D prompt, a non-positive token budget)."""


@dataclass
class Generation:
    """The result of :func:`greedy_generate`.

    ``tokens``: the generated ids (without the prompt); ``step_logits``: with ``keep_logits``, the
    next-token logits (vocab,) that chose each generated token (float32, on CPU); ``stopped``: why the
    loop ended (``"eos"``, ``"stop"`` or ``"length"``).
    """

    tokens: list[int]
    step_logits: list[torch.Tensor] = field(default_factory=list)
    stopped: str = "length"


def new_cache(model: nn.Module):
    """A fresh ``DynamicCache`` shaped by the model's config (sliding layers on 5.x), else a plain one."""
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # 4.x: no config argument; sliding windows are applied by the mask alone
        return DynamicCache()


def _last_logits_kwargs(model: nn.Module) -> dict[str, int]:
    """Ask the model for the last position's logits only (saves an (L, vocab) matrix at long prompts)."""
    params = inspect.signature(model.forward).parameters
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in params:
            return {name: 1}
    return {}


def cache_keyword(model: nn.Module) -> str:
    """The KV cache's name in ``forward`` and its output: ``cache`` in transformers ≥ 5.x (where
    ``past_key_values`` is deprecated), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def greedy_generate(model: nn.Module, prompt: torch.Tensor | Sequence[int], max_new_tokens: int, *,
                    eos_token_id: int | Sequence[int] | None = None,
                    stop: Callable[[list[int]], bool] | None = None,
                    keep_logits: bool = False) -> Generation:
    """Greedy continuation of ``prompt`` (1-D ids) for at most ``max_new_tokens`` tokens.

    One prefill forward, then one forward per token with the growing cache. Ends early at an
    ``eos_token_id`` (kept in ``tokens``) or when ``stop(tokens)`` returns True. Ties in the argmax go to
    the lowest id (``torch.argmax``).
    """
    ids = torch.as_tensor(prompt, dtype=torch.long)
    if ids.dim() != 1 or ids.numel() == 0:
        raise GenerationError(f"prompt must be a non-empty 1-D sequence of token ids, got shape {tuple(ids.shape)}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    eos = set() if eos_token_id is None else (
        {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(t) for t in eos_token_id})
    device = next(model.parameters()).device
    extra = _last_logits_kwargs(model)
    cache_kw = cache_keyword(model)
    cache = new_cache(model)
    n = ids.numel()
    out = Generation(tokens=[])
    step_ids = ids.unsqueeze(0).to(device)
    positions = torch.arange(n, device=device)
    for _ in range(max_new_tokens):
        res = model(input_ids=step_ids, use_cache=True, cache_position=positions,
                    position_ids=positions.unsqueeze(0), **{cache_kw: cache}, **extra)
        cache = getattr(res, cache_kw)
        logits = res.logits[0, -1].float()
        token = int(torch.argmax(logits))
        out.tokens.append(token)
        if keep_logits:
            out.step_logits.append(logits.cpu())
        if token in eos:
            out.stopped = "eos"
            break
        if stop is not None and stop(out.tokens):
            out.stopped = "stop"
            break
        step_ids = torch.tensor([[token]], device=device)
        positions = positions[-1:] + 1
    return out

"""The cell's model (step 1): the checkpoint loaded, or a working copy of a given base model, streamed or not.

:func:`load_base` is what the export and the cells call; the copy is rebuilt from the base's config
(:mod:`rope_quant.model.working_copy`, no ``deepcopy``), and a weight-cache hit copies only
:func:`eager_names` (:func:`complete_copy` fills the rest on a miss).
"""

from __future__ import annotations

import copy
from typing import Any, cast

import torch
from torch import nn

from rope_quant.experiment.config import PipelineError, RunConfig
from rope_quant.model import arch

__all__ = ["load_base", "streams", "eager_names", "complete_copy"]


def load_base(cfg: RunConfig, base: tuple[nn.Module, Any] | None, partial: bool = False,
              stream: bool = False) -> tuple[nn.Module, Any]:
    """The cell's model: loaded from ``cfg.model``, or a working copy of ``base`` (never written).

    The copy is rebuilt from the base's config (:mod:`rope_quant.model.working_copy`, no ``deepcopy``); with
    ``partial`` only the parameters a weight-cache hit reads are copied (:func:`eager_names`), and the caller
    completes it with :func:`complete_copy` on a miss. With ``stream`` the weights stay in host RAM and each
    decoder layer visits ``cfg.runtime.device`` only for its forward (:mod:`rope_quant.model.offload`)."""
    device, dtype = ("cpu" if stream else cfg.runtime.device), cfg.runtime.dtype.torch
    if base is not None:
        from rope_quant.model import working_copy

        source, tokenizer = base
        model = working_copy.skeleton(source, device, dtype)
        if model is None:  # a class that does not rebuild from its config: the plain copy
            model = copy.deepcopy(source)
            model.to(device=device, dtype=dtype)
        else:
            working_copy.fill(model, source, eager_names(model) if partial else None)
    else:
        from rope_quant.model.loading import load_model

        model, tokenizer = load_model(cfg.model, device=device, dtype=dtype)
    model.eval()
    if stream:
        from rope_quant.model import offload

        offload.enable(model, cfg.runtime.device)
    return model, tokenizer


def streams(cfg: RunConfig, mode: str | None) -> bool:
    """Whether this build streams layers: ``--offload cpu`` (or the process default the CLI resolved from the
    plan) on a non-CPU device. On the CPU streaming is a no-op: the weights already live in host RAM."""
    from rope_quant.model import offload

    resolved = offload.default_mode() if mode is None else offload.OffloadMode(mode)
    if resolved == offload.OffloadMode.AUTO:
        raise PipelineError("offload='auto' must be resolved against the plan before the build")
    return resolved == offload.OffloadMode.CPU and str(cfg.runtime.device) != "cpu"


def eager_names(model: nn.Module) -> list[str]:
    """Parameters a weight-cache hit reads from the unrotated model: the embeddings, lm_head and the norm fused
    into it (rebuilt from R1, :func:`weight_cache.restore_rotated`) and the tensors of
    :func:`weight_cache.model_fingerprint`."""
    from rope_quant.model import working_copy

    last = len(arch.decoder_layers(model)) - 1
    head = arch.lm_head(model)
    head_norms = [p for _, norm, linears in arch.fusable_norms(model) if any(lin is head for lin in linears)
                  for p in norm.parameters()]  # fused into lm_head by rotate_embeddings
    tensors = (arch.embeddings(model).weight, head.weight, *head_norms, arch.attention(model, 0).q.weight,
               arch.mlp_parts(model, last).down.weight)
    return working_copy.parameter_names(model, tuple(cast(torch.Tensor, t) for t in tensors))


def complete_copy(model: nn.Module, base: tuple[nn.Module, Any] | None) -> None:
    """Copy every parameter of ``base`` into a partial working copy (a weight-cache miss)."""
    from rope_quant.model import working_copy

    if base is not None:
        working_copy.fill(model, base[0])

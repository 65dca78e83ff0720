"""A working copy of a loaded base model without ``copy.deepcopy`` (a copy per cell doubles host memory).

:func:`skeleton` builds the base's architecture from its config on the meta device (no initialisation, no
random numbers drawn), then allocates it uninitialised on the target device and dtype, with the base's buffers
(RoPE frequencies), its weight tying, its modules' plain attributes (``head_dim``, ``is_quantized``...) and its
``rq_*`` provenance attributes; a model whose modules, hooks or tensor shapes changed after loading is not
rebuilt (:func:`skeleton` returns None). :func:`fill` then copies the
parameters a caller needs from the base: all of them when the model is rebuilt from scratch, or only the few a
cache hit reads (the embeddings, which the weight cache leaves out, and the fingerprint's tensors) when every
other parameter comes from the weight cache. The values equal ``deepcopy(base).to(device, dtype)`` bit for bit
(the same casts), and the base is never written.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

__all__ = ["skeleton", "fill", "parameter_names"]


def _set_parameter(model: nn.Module, name: str, param: nn.Parameter) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, leaf, param)


_PLAIN = (bool, int, float, str, type(None))
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _layout(model: nn.Module) -> list[Any]:
    """Submodule names, types and plain attributes (e.g. ``head_dim``), hook counts, tensor names and shapes."""
    out: list[Any] = []
    for name, m in model.named_modules(remove_duplicate=False):
        plain = sorted((k, v) for k, v in vars(m).items()
                       if isinstance(v, _PLAIN) and k != "training" and not k.startswith("_"))
        out.append((name, type(m), plain, [len(getattr(m, h, {})) for h in _HOOKS]))
    out += [(n, tuple(t.shape)) for n, t in [*model.named_parameters(remove_duplicate=False),
                                             *model.named_buffers(remove_duplicate=False)]]
    return out


def skeleton(base: nn.Module, device: str | torch.device, dtype: torch.dtype) -> nn.Module | None:
    """``base``'s architecture on ``device`` in ``dtype`` (floating tensors), parameters uninitialised, buffers,
    tying and ``rq_*`` attributes taken from ``base``; ``None`` when the class cannot be rebuilt from its config
    to the same layout (modules, plain attributes, hooks, tensor shapes: a model changed after loading), and the
    caller then copies the model another way."""
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):  # no RNG draw, no memory
            model = type(base)(copy.deepcopy(base.config))
    except Exception as exc:  # noqa: BLE001 - any class that does not rebuild from its config: caller falls back
        log.debug("cannot rebuild %s from its config (%s)", type(base).__name__, exc)
        return None
    mine = dict(model.named_modules(remove_duplicate=False))
    for name, m in base.named_modules(remove_duplicate=False):  # plain attributes set after construction
        twin = mine.get(name)
        if twin is not None and type(twin) is type(m):
            for k, v in vars(m).items():
                if isinstance(v, _PLAIN) and not k.startswith("_"):
                    setattr(twin, k, v)
    if _layout(model) != _layout(base):  # changed after loading (a replaced module, a hook, a tensor's shape)
        log.debug("%s rebuilt from its config differs from the loaded model", type(base).__name__)
        return None
    model.to(dtype=dtype)  # on meta: only the dtypes change (floating tensors, as Module.to does)
    model.to_empty(device=device)
    first: dict[int, str] = {}
    for name, p in base.named_parameters(remove_duplicate=False):  # tied weights stay tied
        owner = first.setdefault(id(p), name)
        if owner != name:
            _set_parameter(model, name, model.get_parameter(owner))
    with torch.no_grad():
        for name, buf in base.named_buffers(remove_duplicate=False):
            model.get_buffer(name).copy_(buf)
    for key, value in vars(base).items():
        if key.startswith("rq_"):
            setattr(model, key, value)
    model.train(base.training)
    return model


def parameter_names(model: nn.Module, tensors: Iterable[torch.Tensor]) -> list[str]:
    """The parameter names of ``tensors`` (by identity) in ``model``."""
    wanted = {id(t) for t in tensors}
    return [n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in wanted]


def fill(model: nn.Module, base: nn.Module, names: Iterable[str] | None = None) -> None:
    """Copy the parameters ``names`` (default all) from ``base`` into ``model`` (cast to ``model``'s dtype)."""
    source = dict(base.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name in source if names is None else names:
            model.get_parameter(name).copy_(source[name])

"""Layer streaming (``--offload cpu``, for a model over device memory): the weights live on the host, each
streamed unit is moved to the compute device only for its own forward.

The streamed units are the token embedding, every decoder layer, the lm_head and every other module that owns
tensors (final norm, rotary embedding: a few kB), so between forwards every tensor is in host RAM and the
offline algebra (rotation folds, cache restores) sees a plain host model. A forward pre-hook (registered first)
evicts whichever unit is resident, brings its own unit in and moves the call's tensor arguments to the compute
device; a forward post-hook (registered last) evicts it again. At most one unit's weights are on the device at
any time, plus the activations, which stay there. Eviction copies the weights back, so a change made while a
unit was resident (GPTQ, :func:`resident`) is kept. :func:`resident` pins one unit for a stretch of work (GPTQ
runs every Hessian forward and the column loop of one layer on the device).

Every forward path of the pipeline goes through these hooks: whip sample collection, GPTQ's input capture,
calibration, evaluation. The function is unchanged (the same modules, the same arithmetic on the same device).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch
from torch import nn

from rope_quant.model import arch

__all__ = ["OffloadMode", "OffloadError", "Streamer", "enable", "disable", "streamer", "compute_device", "resident",
           "default_mode", "set_default_mode", "ENV_OFFLOAD"]

_ATTR = "rq_offload"


class OffloadMode(StrEnum):
    """``--offload``: none, cpu (stream layers from host RAM), auto (cpu when the plan says it must)."""

    NONE = "none"
    CPU = "cpu"
    AUTO = "auto"


class OffloadError(ValueError):
    """Streaming cannot be set up on this model (already streamed, or no decoder layers the adapter knows)."""


#: The resolved mode, for processes that did not resolve it themselves (Slurm array tasks, submitit workers):
#: :func:`set_default_mode` exports it, :func:`default_mode` reads it.
ENV_OFFLOAD = "ROPE_QUANT_OFFLOAD"


def default_mode() -> OffloadMode:
    """The process's resolved offload mode: :data:`ENV_OFFLOAD` (set by the CLI after its plan check, inherited
    by the processes it starts), else none."""
    text = os.environ.get(ENV_OFFLOAD, OffloadMode.NONE.value)
    try:
        mode = OffloadMode(text)
    except ValueError:
        raise OffloadError(f"{ENV_OFFLOAD} must be none or cpu, got {text!r}") from None
    if mode == OffloadMode.AUTO:
        raise OffloadError(f"{ENV_OFFLOAD}=auto: resolve it against the plan first (none or cpu)")
    return mode


@contextlib.contextmanager
def set_default_mode(mode: OffloadMode | str) -> Iterator[None]:
    """Within the block, :func:`default_mode` is ``mode`` (never auto: resolve it first), in this process and in
    the processes it starts (the environment variable, restored afterwards)."""
    mode = OffloadMode(mode)
    if mode == OffloadMode.AUTO:
        raise OffloadError("resolve --offload auto against the plan before running")
    saved = os.environ.get(ENV_OFFLOAD)
    os.environ[ENV_OFFLOAD] = mode.value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(ENV_OFFLOAD, None)
        else:
            os.environ[ENV_OFFLOAD] = saved


def _move(module: nn.Module, device: torch.device) -> None:
    """Parameters (in place: ``.data``, so hooks, attributes and tying keep pointing at them) and buffers."""
    for m in module.modules():
        for p in m._parameters.values():
            if p is not None and p.device != device:
                p.data = p.data.to(device)
        for k, b in m._buffers.items():
            if b is not None and b.device != device:
                m._buffers[k] = b.to(device)


def _to_device(value: Any, device: torch.device) -> Any:
    """Tensors, and plain tuples / lists / dicts of them, on ``device``; anything else (a cache object, a
    ``ModelOutput``, a named tuple) is passed as it is."""
    if torch.is_tensor(value):
        return value.to(device)
    if type(value) is tuple:
        return tuple(_to_device(v, device) for v in value)
    if type(value) is list:
        return [_to_device(v, device) for v in value]
    if type(value) is dict:
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


@dataclass
class Streamer:
    """The streaming state of one model: its units, which are resident, and a log for tests and benchmarks.

    ``events`` records ``("in" | "out", unit name)`` in order; ``max_resident`` is the most units ever resident
    at once (1 when streaming works).
    """

    device: torch.device
    host: torch.device
    units: dict[str, nn.Module]
    resident_units: list[str] = field(default_factory=list)
    pinned: set[str] = field(default_factory=set)
    events: list[tuple[str, str]] = field(default_factory=list)
    max_resident: int = 0
    handles: list[Any] = field(default_factory=list)

    def name_of(self, module: nn.Module) -> str | None:
        return next((n for n, m in self.units.items() if m is module), None)

    def bring_in(self, name: str) -> None:
        for other in list(self.resident_units):
            if other != name and other not in self.pinned:
                self.evict(other)
        if name not in self.resident_units:
            _move(self.units[name], self.device)
            self.resident_units.append(name)
            self.events.append(("in", name))
        self.max_resident = max(self.max_resident, len(self.resident_units))

    def evict(self, name: str) -> None:
        if name in self.resident_units and name not in self.pinned:
            _move(self.units[name], self.host)
            self.resident_units.remove(name)
            self.events.append(("out", name))

    def evict_all(self) -> None:
        for name in list(self.resident_units):
            self.evict(name)


def _owns_tensors(m: nn.Module) -> bool:
    return any(True for _ in m.parameters(recurse=False)) or any(True for _ in m.buffers(recurse=False))


def _units(model: nn.Module) -> dict[str, nn.Module]:
    """Embeddings, each decoder layer, lm_head, then every other module that owns tensors outside them (the
    final norm, the rotary embedding: tiny), by qualified name. Between forwards every tensor is on the host."""
    try:
        layers = arch.decoder_layers(model)
        units = {"embeddings": arch.embeddings(model)}
        units.update({f"layers.{i}": layer for i, layer in enumerate(layers)})
        units["lm_head"] = arch.lm_head(model)
    except arch.ArchitectureError as exc:
        raise OffloadError(f"cannot stream {type(model).__name__}: {exc}") from exc
    covered = {id(m) for u in units.values() for m in u.modules()}
    for name, m in model.named_modules():
        if id(m) not in covered and _owns_tensors(m):
            units[name] = m
            covered |= {id(x) for x in m.modules()}
    return units


def enable(model: nn.Module, device: torch.device | str, host: torch.device | str = "cpu") -> Streamer:
    """Stream ``model`` (its weights go to ``host``) through ``device``; returns the :class:`Streamer`."""
    if streamer(model) is not None:
        raise OffloadError("this model is already streamed")
    device, host = torch.device(device), torch.device(host)
    units = _units(model)
    st = Streamer(device, host, units)
    _move(model, host)
    for name, unit in units.items():
        def pre(_mod: nn.Module, args: tuple, kwargs: dict, _name: str = name) -> tuple[tuple, dict]:
            st.bring_in(_name)
            return _to_device(args, st.device), _to_device(kwargs, st.device)

        def post(_mod: nn.Module, _args: tuple, _out: Any, _name: str = name) -> None:
            st.evict(_name)

        st.handles.append(unit.register_forward_pre_hook(pre, with_kwargs=True, prepend=True))
        st.handles.append(unit.register_forward_hook(post))
    setattr(model, _ATTR, st)
    return st


def disable(model: nn.Module) -> None:
    """Stop streaming: remove the hooks and move every unit back to the host."""
    st = streamer(model)
    if st is None:
        return
    for h in st.handles:
        h.remove()
    st.pinned.clear()
    st.evict_all()
    delattr(model, _ATTR)


def streamer(model: nn.Module) -> Streamer | None:
    """The model's :class:`Streamer`, or None when it is not streamed."""
    return getattr(model, _ATTR, None)


def compute_device(model: nn.Module) -> torch.device:
    """Where the model computes: the streaming device, else the device of its first parameter."""
    st = streamer(model)
    if st is not None:
        return st.device
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


@contextlib.contextmanager
def resident(model: nn.Module, unit: nn.Module) -> Iterator[None]:
    """Keep ``unit`` (a streamed module of ``model``) on the compute device for the block, then evict it
    (writing back any change). A no-op when ``model`` is not streamed or ``unit`` is not one of its units."""
    st = streamer(model)
    name = None if st is None else st.name_of(unit)
    if st is None or name is None:
        yield
        return
    st.bring_in(name)
    st.pinned.add(name)
    try:
        yield
    finally:
        st.pinned.discard(name)
        st.evict(name)

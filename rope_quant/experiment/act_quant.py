"""The activation and static K/V quantisers of a cell: forward pre-hooks on every decoder linear (lm_head stays
16-bit) and the calibration forwards of the static control (App. A.6, D).

The dynamic quantiser is per-token asymmetric INT-a fake quantisation (:func:`install_activation_quantizers`);
on down_proj the online R4 Hadamard pre-hook (:mod:`rope_quant.rotations.online_r4`, ``prepend=True``) runs
first. The static control calibrates one per-channel quantiser per linear (:func:`static_quantizers`) or per
layer's K and V (:func:`kv_static_quantizers`) over the calibration windows (:func:`forward_windows`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rope_quant.experiment.config import PipelineError, RunConfig
from rope_quant.model import arch
from rope_quant.quant.quantizers import QuantConfig
from rope_quant.rotations import attention

__all__ = ["ACT_FLAG", "decoder_linears", "install_activation_quantizers", "remove_activation_quantizers",
           "forward_windows", "static_quantizers", "kv_static_quantizers", "heads_last", "HeadsQuantizer"]

#: The attribute a decoder linear carries while it has an activation quantiser.
ACT_FLAG = "rq_act_quant"


def decoder_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    attention.attention_modules(model)  # validates the architecture
    return list(arch.decoder_linears(model))


def install_activation_quantizers(model: nn.Module, spec: QuantConfig,
                                  static: dict[str, Callable[[torch.Tensor], torch.Tensor]] | None = None,
                                  ) -> list[torch.utils.hooks.RemovableHandle]:
    """Fake-quantise the input of every decoder-layer linear (lm_head excluded) with a forward pre-hook.

    Dynamic per-token INT-b as described by ``spec`` (``quant.fake_quant``: groups of ``group_size``
    channels, ``clip_ratio``; asymmetric unless ``symmetric``), or ``static[name]`` (a calibrated
    per-channel quantiser) where given. The hooks are appended after existing pre-hooks, so down_proj's
    online R4 Hadamard (registered with ``prepend=True``) runs first. Returns the handles.
    """
    from rope_quant.quant import diagnostic as qdiag
    from rope_quant.quant.quantizers import fake_quant, selected_step

    # q/k/v (and gate/up) read the same tensor: the dynamic quantiser runs once per input tensor and the others
    # reuse its output (same function of the same values, so bit-identical). The memo holds the last input (so
    # its identity cannot be reused by another tensor) and, outside inference mode, is invalidated by any
    # in-place change of it (``_version``; inference tensors carry no version counter).
    memo: dict[str, Any] = {"x": None, "version": None, "y": None}

    def version(x: torch.Tensor) -> int | None:
        return None if x.is_inference() else x._version

    def quantise_once(x: torch.Tensor, _spec: QuantConfig = spec) -> torch.Tensor:
        if memo["x"] is x and memo["version"] == version(x):
            return memo["y"]
        y = fake_quant(x, _spec)
        memo.update(x=x, version=version(x), y=y)
        if qdiag.active() is not None:  # App. E diagnostic: one record per evaluation (memo hits excluded)
            qdiag.observe(qdiag.Stream.ACT, qdiag.Rule.DYNAMIC, x, y, lambda: selected_step(x, _spec))
        return y

    handles = []
    for name, mod in decoder_linears(model):
        if getattr(mod, ACT_FLAG, False):
            raise PipelineError(f"{name} already has an activation quantiser")
        fn = None if static is None else static.get(name)
        if fn is None and not spec.enabled:
            continue
        def dynamic(_mod: nn.Module, args: tuple) -> tuple:
            return (quantise_once(args[0]),) + tuple(args[1:])

        def static_hook(_mod: nn.Module, args: tuple, _fn: Any = fn) -> tuple:
            y = _fn(args[0])
            if qdiag.active() is not None and hasattr(_fn, "step"):
                qdiag.observe(qdiag.Stream.ACT, qdiag.Rule.STATIC, args[0], y, _fn.step)
            return (y,) + tuple(args[1:])

        handles.append(mod.register_forward_pre_hook(dynamic if fn is None else static_hook))
        setattr(mod, ACT_FLAG, True)
    return handles


def remove_activation_quantizers(model: nn.Module, handles: list) -> None:
    """Remove the activation quantisers (``handles``) and their flags from every decoder linear."""
    for h in handles:
        h.remove()
    for _, mod in decoder_linears(model):
        if hasattr(mod, ACT_FLAG):
            delattr(mod, ACT_FLAG)


def forward_windows(model: nn.Module, windows: torch.Tensor, desc: str, progress: bool, batch: int = 1) -> None:
    """Run the decoder stack (no lm_head) over the windows, ``batch`` windows per forward, for hooks to observe."""
    from tqdm.auto import tqdm

    from rope_quant.model import offload

    base = getattr(model, "model", model)
    dev = offload.compute_device(model)
    batch = max(1, int(batch))
    # no_grad, not inference_mode: tensors cached by hooks/transforms during this pass must stay usable
    # by later forwards that run with autograd enabled.
    with torch.no_grad():
        for rows in tqdm(torch.split(windows, batch), desc=desc, disable=not progress, leave=False):
            base(input_ids=rows.to(dev), use_cache=False)


def static_quantizers(model: nn.Module, cfg: RunConfig, calib: torch.Tensor, progress: bool,
                      saved: dict | None = None) -> dict:
    """One static per-channel activation quantiser per decoder linear (App. A.6, D).

    Calibrated on the rotated full-precision model over the calibration windows (running per-channel
    min/max of each linear's input, after the R4 Hadamard on down_proj), or restored from ``saved``.
    """
    from rope_quant.quant.static import StaticChannelQuantizer

    a = cfg.quant.a
    quantizers: dict[str, Any] = {}
    handles = []
    if saved is not None:
        for name, mod in decoder_linears(model):
            q = StaticChannelQuantizer(mod.in_features, bits=a.bits, clip_ratio=a.clip_ratio, symmetric=a.symmetric)
            q.lo, q.hi = (t.clone() for t in saved[name])
            q.finalize()
            quantizers[name] = q
        return quantizers
    for name, mod in decoder_linears(model):
        q = StaticChannelQuantizer(mod.in_features, bits=a.bits, clip_ratio=a.clip_ratio, symmetric=a.symmetric)
        quantizers[name] = q

        def pre(_mod, args, _q=q):
            _q.observe(args[0])
        handles.append(mod.register_forward_pre_hook(pre))
    try:
        forward_windows(model, calib, "static act calibration", progress)
    finally:
        for h in handles:
            h.remove()
    for q in quantizers.values():
        q.finalize()
    return quantizers


def kv_static_quantizers(model: nn.Module, cfg: RunConfig, geom: attention.AttentionGeometry,
                         calib: torch.Tensor, progress: bool) -> tuple[list, list]:
    """Calibrate per-layer static per-channel K and V quantisers on post-R3 keys / values (App. A.6, D)."""
    from rope_quant.quant.static import StaticChannelQuantizer

    width = geom.head_dim * geom.n_kv_heads
    ks = [StaticChannelQuantizer(width, bits=cfg.quant.k.bits, clip_ratio=cfg.quant.k.clip_ratio,
                                 symmetric=cfg.quant.k.symmetric) for _ in range(geom.n_layers)]
    vs = [StaticChannelQuantizer(width, bits=cfg.quant.v.bits, clip_ratio=cfg.quant.v.clip_ratio,
                                 symmetric=cfg.quant.v.symmetric) for _ in range(geom.n_layers)]

    def observe(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        ks[layer].observe(heads_last(k))
        vs[layer].observe(heads_last(v))

    states = attention.attention_states(model)
    saved = [(s.k, s.v) for s in states]
    for s in states:
        s.k = s.v = QuantConfig()  # off: observe unquantised K and V
        s.observers.append(observe)
    try:
        forward_windows(model, calib, "static KV calibration", progress)
    finally:
        for s, (kq, vq) in zip(states, saved, strict=True):
            s.observers.remove(observe)
            s.k, s.v = kq, vq
    for q in ks + vs:
        q.finalize()
    return [HeadsQuantizer(q) for q in ks], [HeadsQuantizer(q) for q in vs]


def heads_last(x: torch.Tensor) -> torch.Tensor:
    """(b, H, L, d) -> (b, L, H*d): channels of all heads on the last axis."""
    b, h, length, d = x.shape
    return x.transpose(1, 2).reshape(b, length, h * d)


@dataclass
class HeadsQuantizer:
    """Apply a per-channel quantiser over (H*d) channels to a (b, H, L, d) tensor."""

    q: Any

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        b, h, length, d = x.shape
        y = self.q(heads_last(x))
        return y.reshape(b, length, h, d).transpose(1, 2)

    def step(self) -> torch.Tensor:
        """The per-channel steps of the wrapped quantiser (App. E diagnostic)."""
        return self.q.step()

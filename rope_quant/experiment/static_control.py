"""The static per-channel control as the paper ran it (App. A.6, D, H), applied to a built dynamic model.

A.6's protocol:

* one scale per channel (a per-channel range, hence one step Δ_c and zero point), estimated across the token
  dimension (:class:`~rope_quant.quant.static.StaticChannelQuantizer`: running min/max over every token);
* re-estimated for each (corpus, context length L) from up to :data:`PAPER_MAX_WINDOWS` non-overlapping
  windows of length L drawn from the **evaluation** corpus: the protocol is transductive (the scales have
  seen the evaluated text), and the paper says so. :func:`static_windows` takes the first
  min(max_windows, ⌊N/L⌋) windows of the stream, the same alignment as the scored windows;
* held fixed during evaluation (the quantisers are frozen: evaluation inputs never move them);
* scopes (:class:`~rope_quant.experiment.config.StaticScope`): ``both`` (activations into every decoder
  linear, and K/V), ``act``, ``kv``.

:attr:`StaticProtocol.CALIBRATION_SPLIT` is the named out-of-sample alternative the paper did not run: the
windows come from the calibration split of the calibration corpus, at the same target length.

The estimation pass runs the model with the quantisers in scope switched off (their full-precision inputs are
observed; the down_proj input after the online R4 Hadamard; K/V after R3) and the quantisers outside the scope
as they are during evaluation (dynamic). Weights are the dynamic pipeline's (GPTQ saw the dynamic activation
quantiser), shared with the dynamic cells of the same seed: only the activation/KV rule changes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch

from rope_quant.experiment.config import PipelineError, StaticScope
from rope_quant.quant.quantizers import QuantConfig
from rope_quant.quant.static import StaticChannelQuantizer

__all__ = ["PAPER_MAX_WINDOWS", "StaticProtocol", "StaticWindowsError", "StaticScales", "static_windows",
           "source_ids", "estimate_scales", "applied", "scope_parts"]

#: A.6: scales from up to 64 non-overlapping windows of the target length.
PAPER_MAX_WINDOWS = 64


class StaticProtocol(StrEnum):
    """Where the static scales come from."""

    #: A.6 as the paper ran it: windows of the evaluation corpus (transductive).
    TRANSDUCTIVE = "transductive"
    #: The out-of-sample alternative (not in the paper): windows of the calibration split of the calibration corpus.
    CALIBRATION_SPLIT = "calibration-split"


class StaticWindowsError(PipelineError):
    """No window of the target length fits the stream the static scales are estimated from."""


def scope_parts(scope: StaticScope | str) -> tuple[bool, bool]:
    """(activations static, K/V static) of a scope."""
    scope = StaticScope(scope)
    return scope in (StaticScope.ACT, StaticScope.BOTH), scope in (StaticScope.KV, StaticScope.BOTH)


def static_windows(ids: torch.Tensor, length: int, max_windows: int = PAPER_MAX_WINDOWS) -> torch.Tensor:
    """The first min(max_windows, ⌊N/length⌋) non-overlapping windows of a 1-D stream, shape (n, length)."""
    ids = torch.as_tensor(ids).flatten().to(torch.long)
    if isinstance(max_windows, bool) or not isinstance(max_windows, int) or max_windows < 1:
        raise PipelineError(f"static max_windows must be a positive integer, got {max_windows!r}")
    n = min(max_windows, ids.numel() // int(length))
    if n < 1:
        raise StaticWindowsError(f"the static scales need a window of {length} tokens; the stream has "
                                 f"{ids.numel()} tokens")
    return ids[: n * length].reshape(n, length)


def source_ids(protocol: StaticProtocol | str, eval_ids: torch.Tensor, calib_corpus: Any) -> torch.Tensor:
    """The stream the scales are estimated from: the evaluation stream (transductive, A.6) or the calibration
    split of the calibration corpus (out of sample)."""
    if StaticProtocol(protocol) == StaticProtocol.TRANSDUCTIVE:
        return eval_ids
    return calib_corpus.calib_ids


@dataclass
class StaticScales:
    """Frozen static quantisers of one (corpus, length): per linear (act) and per layer (K, V)."""

    scope: StaticScope
    act: dict[str, StaticChannelQuantizer] | None = None
    k: list[Any] | None = None
    v: list[Any] | None = None
    windows: int = 0
    length: int = 0
    estimate_s: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        """What a cell record keeps: scope, windows, tokens, channels, time."""
        n_act = sum(q.lo.numel() for q in (self.act or {}).values())  # type: ignore[union-attr]
        n_kv = sum(q.q.lo.numel() for q in (self.k or []) + (self.v or []))
        return {"scope": self.scope.value, "windows": self.windows, "length": self.length,
                "tokens": self.windows * self.length, "act_channels": n_act, "kv_channels": n_kv,
                "estimate_s": self.estimate_s, **self.info}


def _check(qm: Any) -> None:
    if qm.cfg.quant.static_scope is not None:
        raise PipelineError("the A.6 static control is applied to a model built with dynamic quantisers; this one "
                            f"was built with static_scope={qm.cfg.quant.static_scope.value}")


def estimate_scales(qm: Any, windows: torch.Tensor, scope: StaticScope | str, progress: bool = False) -> StaticScales:
    """Estimate frozen per-channel quantisers of ``scope`` on ``windows`` (n, L) through the built model ``qm``.

    The quantisers in scope are off during the pass (their inputs are observed), the others stay dynamic;
    everything is restored afterwards (the model computes what it computed before).
    """
    from rope_quant.experiment import act_quant

    _check(qm)
    scope = StaticScope(scope)
    act_on, kv_on = scope_parts(scope)
    model, cfg = qm.model, qm.cfg
    t = time.perf_counter()
    scales = StaticScales(scope=scope, windows=int(windows.shape[0]), length=int(windows.shape[1]))
    handles: list[Any] = []
    states = qm.states
    saved_kv = [(s.k, s.v) for s in states]
    observe_kv = None
    try:
        if act_on:
            a = cfg.quant.a
            act_quant.remove_activation_quantizers(model, qm.act_handles)
            qm.act_handles = []
            scales.act = {}
            for name, mod in act_quant.decoder_linears(model):
                q = StaticChannelQuantizer(mod.in_features, bits=a.bits, clip_ratio=a.clip_ratio,
                                           symmetric=a.symmetric)
                scales.act[name] = q
                handles.append(mod.register_forward_pre_hook(lambda _m, args, _q=q: _q.observe(args[0])))
        if kv_on:
            geom = qm.geometry
            width = geom.head_dim * geom.n_kv_heads
            ks = [StaticChannelQuantizer(width, bits=cfg.quant.k.bits, clip_ratio=cfg.quant.k.clip_ratio,
                                         symmetric=cfg.quant.k.symmetric) for _ in states]
            vs = [StaticChannelQuantizer(width, bits=cfg.quant.v.bits, clip_ratio=cfg.quant.v.clip_ratio,
                                         symmetric=cfg.quant.v.symmetric) for _ in states]

            def observe_kv(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
                ks[layer].observe(act_quant.heads_last(k))
                vs[layer].observe(act_quant.heads_last(v))

            for s in states:
                s.k = s.v = QuantConfig()
                s.observers.append(observe_kv)
        act_quant.forward_windows(model, windows, f"static {scope.value} scales (L={windows.shape[1]})", progress)
    finally:
        for h in handles:
            h.remove()
        if observe_kv is not None:
            for s in states:
                s.observers.remove(observe_kv)
        for s, (kq, vq) in zip(states, saved_kv, strict=True):
            s.k, s.v = kq, vq
        if act_on:
            qm.act_handles = act_quant.install_activation_quantizers(model, cfg.quant.a)
    for q in (scales.act or {}).values():
        q.finalize()
    if kv_on:
        for q in ks + vs:
            q.finalize()
        scales.k = [act_quant.HeadsQuantizer(q) for q in ks]
        scales.v = [act_quant.HeadsQuantizer(q) for q in vs]
    scales.estimate_s = time.perf_counter() - t
    return scales


@contextlib.contextmanager
def applied(qm: Any, scales: StaticScales | None) -> Iterator[Any]:
    """Within the block, ``qm.model`` quantises with the frozen static quantisers of ``scales`` in their scope
    (the others stay dynamic); on exit the dynamic quantisers are back. ``scales=None``: dynamic throughout."""
    from rope_quant.experiment import act_quant

    if scales is None:
        yield qm
        return
    _check(qm)
    model, cfg, states = qm.model, qm.cfg, qm.states
    saved = [(s.k_static, s.v_static) for s in states]
    swapped = False
    try:
        if scales.act is not None:
            act_quant.remove_activation_quantizers(model, qm.act_handles)
            qm.act_handles = act_quant.install_activation_quantizers(model, cfg.quant.a, static=scales.act)
            swapped = True
        if scales.k is not None and scales.v is not None:
            for s, kq, vq in zip(states, scales.k, scales.v, strict=True):
                s.k_static, s.v_static = kq, vq
        yield qm
    finally:
        for s, (kq, vq) in zip(states, saved, strict=True):
            s.k_static, s.v_static = kq, vq
        if swapped:
            act_quant.remove_activation_quantizers(model, qm.act_handles)
            qm.act_handles = act_quant.install_activation_quantizers(model, cfg.quant.a)

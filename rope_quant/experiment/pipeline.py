"""One quantised model per run configuration: the DartQuant-style W4A4KV4 pipeline with a chosen R3.

:func:`build_quantized_model` follows the natural path of the data (docs/ARCHITECTURE.md, "One cell"):

1. load the model (or a working copy of a given one, :mod:`rope_quant.model.working_copy`: on a weight-cache
   hit only the embeddings and the fingerprint's tensors are copied from it);
2. offline rotations R1/R2/R4 (:func:`rope_quant.rotations.offline.rotate_model`); by default the paper's
   (App. A.1, A.8): R1 fitted with the whip loss on the calibration windows (cached per model, seed, whip
   settings and windows), R2 the seeded random Hadamard, R4 the online Hadamard;
3. activation quantisers: a forward pre-hook on every decoder linear (lm_head stays 16-bit) doing
   per-token asymmetric dynamic INT-a fake quantisation (or the static per-channel control, App. A.6/D).
   On down_proj the online R4 Hadamard pre-hook is registered with ``prepend=True`` by rotation.py, so it
   runs before the quantiser;
4. weights: GPTQ (:mod:`rope_quant.quant.gptq`) or RTN, cached on disk per :meth:`RunConfig.weight_key`
   (integer codes and scales; the rotated embeddings and lm_head are left out and rebuilt from the cached R1 on
   a hit, checked against their sha256). GPTQ's
   Hessians see the inputs each linear actually sees (R4 and the activation quantiser included);
5. a calibration pass in collect mode over the same calibration windows (pre-RoPE q/k statistics and a
   sample of :data:`K_SAMPLE_ROWS` K tokens per layer with their positions);
6. R3 angles (:func:`rope_quant.calib.objectives.estimate_angles`; the angle rule φ̂, branch-matched φ̂ or
   φ* with the live ``inv_freq``, or the
   ``range`` objective's coordinate descent on the K sample) and the
   per-layer R3 from the registry (:mod:`rope_quant.core.transforms`); a fitted R3 (``needs_fit``, issue 24)
   gets its per-layer parameters from :func:`rope_quant.calib.foldable.fit_for` on the K sample;
7. the quantise-mode attention (:mod:`rope_quant.rotations.attention`): R3 on post-RoPE q/k, K/V quantisers.

Nothing in steps 1–5 depends on the R3 fields of the configuration: within a seed every R3 variant shares
the offline rotations, the quantised weights and the calibration sample (paired design), and the weight
cache is keyed accordingly. Cache files also carry the model's weight fingerprint and (where the
calibration sample shapes them) a hash of the calibration windows; an unreadable cache is warned about
(naming the file), recomputed and rewritten. :func:`run_cell` evaluates perplexity and K diagnostics on the
evaluation split.
The configuration (:class:`RunConfig`, its specs and keys) lives in :mod:`rope_quant.experiment.config`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from rope_quant.core import rope
from rope_quant.experiment import weight_cache
from rope_quant.experiment.config import (
    K_SAMPLE_ROWS,
    PipelineError,
    RunConfig,
    WeightMode,
)
from rope_quant.experiment.stages import StageName, stage
from rope_quant.io import atomic_writer
from rope_quant.model import arch
from rope_quant.quant import gptq
from rope_quant.quant.gptq import GPTQConfig
from rope_quant.quant.quantizers import QuantConfig
from rope_quant.rotations import attention
from rope_quant.rotations.offline import RotationKind

log = logging.getLogger(__name__)

model_fingerprint, data_fingerprint = weight_cache.model_fingerprint, weight_cache.data_fingerprint  # public API

__all__ = [
    "PipelineError",
    "RunConfig",
    "GPTQConfig",
    "K_SAMPLE_ROWS",
    "PipelineCounters",
    "QuantizedModel",
    "build_quantized_model",
    "run_cell",
    "install_activation_quantizers",
    "model_fingerprint",
    "data_fingerprint",
    "remove_activation_quantizers",
]


@dataclass
class PipelineCounters:
    """Work done by :func:`build_quantized_model` calls that share this object (tests check cache hits)."""

    weight_quantizations: int = 0
    weight_cache_hits: int = 0
    calibration_passes: int = 0


# ----------------------------------------------------------------------------- activation quantisers


_ACT_FLAG = "rq_act_quant"


def _decoder_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
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
    for name, mod in _decoder_linears(model):
        if getattr(mod, _ACT_FLAG, False):
            raise PipelineError(f"{name} already has an activation quantiser")
        fn = None if static is None else static.get(name)
        if fn is None and not spec.enabled:
            continue
        if fn is None:
            def hook(_mod, args):
                return (quantise_once(args[0]),) + tuple(args[1:])
        else:
            def hook(_mod, args, _fn=fn):
                y = _fn(args[0])
                if qdiag.active() is not None and hasattr(_fn, "step"):
                    qdiag.observe(qdiag.Stream.ACT, qdiag.Rule.STATIC, args[0], y, _fn.step)
                return (y,) + tuple(args[1:])
        handles.append(mod.register_forward_pre_hook(hook))
        setattr(mod, _ACT_FLAG, True)
    return handles


def remove_activation_quantizers(model: nn.Module, handles: list) -> None:
    for h in handles:
        h.remove()
    for _, mod in _decoder_linears(model):
        if hasattr(mod, _ACT_FLAG):
            delattr(mod, _ACT_FLAG)


# ----------------------------------------------------------------------------- result object


@dataclass
class QuantizedModel:
    """A model ready for evaluation, with everything that went into it."""

    model: nn.Module
    tokenizer: Any
    cfg: RunConfig
    angles: np.ndarray
    transforms: list[Any]
    stats: Any
    inv_freq: np.ndarray
    inv_freq_source: str
    geometry: attention.AttentionGeometry
    corpus: Any = None
    diagnostics: Any = None
    act_handles: list = field(default_factory=list)
    rotation: Any = None
    weight_cache_hit: bool = False
    weight_errors: dict[str, float] = field(default_factory=dict)
    timing: dict[str, float] = field(default_factory=dict)
    calib: torch.Tensor | None = None
    counters: PipelineCounters = field(default_factory=PipelineCounters)
    rotation_fit: dict = field(default_factory=dict)

    def reconfigure(self, cfg: RunConfig, progress: bool = False) -> QuantizedModel:
        """Switch this model to another R3 / K-V setting in place (steps 6-7 only) and return it.

        Only fields that change neither the weights nor the calibration statistics may differ (the R3
        fields, K/V bits/groups/clips, the static KV control, eval_windows); anything else raises
        :class:`PipelineError`. This is the paired design: every R3 variant reuses the same rotated,
        quantised model and the same calibration sample.
        """
        if cfg.weight_key() != self.cfg.weight_key() or cfg.stats_key() != self.cfg.stats_key():
            raise PipelineError("reconfigure() only changes R3 and K/V settings; the weights or the "
                                "calibration statistics of this configuration differ: build a new model")
        if cfg.quant.static_act != self.cfg.quant.static_act:
            raise PipelineError("reconfigure() cannot switch the static activation control")
        t = time.perf_counter()
        angles = _estimate_angles(cfg, self.stats, self.model)
        transforms_ = _build_transforms(cfg, self.geometry, angles, self.stats, self.model)
        self.timing["angles_s"] = time.perf_counter() - t
        t = time.perf_counter()
        attention.install_attention(self.model, transforms_, k=cfg.quant.k, v=cfg.quant.v)
        if cfg.quant.static_kv:
            if self.calib is None:
                raise PipelineError("the static KV control needs the calibration windows")
            k_static, v_static = _kv_static_quantizers(self.model, cfg, self.geometry, self.calib, progress)
            for st, kq, vq in zip(attention.attention_states(self.model), k_static, v_static, strict=True):
                st.k_static, st.v_static = kq, vq
        self.timing["attention_s"] = time.perf_counter() - t
        self.cfg, self.angles, self.transforms = cfg, angles, transforms_
        return self

    @property
    def states(self) -> list[attention.AttentionState]:
        return attention.attention_states(self.model)

    def attach_diagnostics(self, per_layer: bool = False):
        """Attach a fresh K diagnostics accumulator (bits = k_bits, or 4 when K is not quantised)."""
        from rope_quant.calib.diagnostics import KDiagnostics

        k = self.cfg.quant.k
        bits = k.bits if k.enabled else 4
        self.diagnostics = KDiagnostics(bits, k.group_size, k.clip_ratio, per_layer=per_layer)
        for st in self.states:
            st.diagnostics = self.diagnostics
        return self.diagnostics

    def detach_diagnostics(self) -> None:
        for st in self.states:
            st.diagnostics = None


# ----------------------------------------------------------------------------- build steps


def _load(cfg: RunConfig, base: tuple[nn.Module, Any] | None, partial: bool = False,
          stream: bool = False) -> tuple[nn.Module, Any]:
    """The cell's model: loaded from ``cfg.model``, or a working copy of ``base`` (never written).

    The copy is rebuilt from the base's config (:mod:`rope_quant.model.working_copy`, no ``deepcopy``); with
    ``partial`` only the parameters a weight-cache hit reads are copied (:func:`_eager_names`), and the
    caller completes it with :func:`_complete` on a miss. With ``stream`` the weights stay in host RAM and each
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
            working_copy.fill(model, source, _eager_names(model) if partial else None)
    else:
        from rope_quant.model.loading import load_model

        model, tokenizer = load_model(cfg.model, device=device, dtype=dtype)
    model.eval()
    if stream:
        from rope_quant.model import offload

        offload.enable(model, cfg.runtime.device)
    return model, tokenizer


def _streams(cfg: RunConfig, mode: str | None) -> bool:
    """Whether this build streams layers: ``--offload cpu`` (or the process default the CLI resolved from the
    plan) on a non-CPU device. On the CPU streaming is a no-op: the weights already live in host RAM."""
    from rope_quant.model import offload

    resolved = offload.default_mode() if mode is None else offload.OffloadMode(mode)
    if resolved == offload.OffloadMode.AUTO:
        raise PipelineError("offload='auto' must be resolved against the plan before the build")
    return resolved == offload.OffloadMode.CPU and str(cfg.runtime.device) != "cpu"


def _eager_names(model: nn.Module) -> list[str]:
    """Parameters a weight-cache hit reads from the unrotated model: the embeddings, lm_head and the norm fused
    into it (rebuilt from R1, :func:`weight_cache.restore_rotated`) and the tensors of
    :func:`weight_cache.model_fingerprint`."""
    from rope_quant.model import working_copy

    last = len(arch.decoder_layers(model)) - 1
    head = arch.lm_head(model)
    head_norms = [p for _, norm, linears in arch.fusable_norms(model) if any(lin is head for lin in linears)
                  for p in norm.parameters()]  # fused into lm_head by rotate_embeddings
    return working_copy.parameter_names(model, (arch.embeddings(model).weight, head.weight, *head_norms,
                                                arch.attention(model, 0).q.weight,
                                                arch.mlp_parts(model, last).down.weight))


def _complete(model: nn.Module, base: tuple[nn.Module, Any] | None) -> None:
    """Copy every parameter of ``base`` into a partial working copy (a weight-cache miss)."""
    from rope_quant.model import working_copy

    if base is not None:
        working_copy.fill(model, base[0])


def _forward_windows(model: nn.Module, windows: torch.Tensor, desc: str, progress: bool, batch: int = 1) -> None:
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


def calibration_batch(model: nn.Module, n_windows: int, seqlen: int) -> int:
    """Windows per calibration forward: 1 on the CPU (a batch there only adds memory; each window's
    arithmetic is the same), on a GPU as many as fit in
    :data:`rope_quant.experiment.plan_costs.CALIB_MEMORY_FRACTION` of the free memory
    (:func:`~rope_quant.experiment.plan_costs.calib_window_bytes` per window; the plan counts the same)."""
    from rope_quant.experiment import plan_costs
    from rope_quant.model import offload

    dev = offload.compute_device(model)
    if dev.type != "cuda" or n_windows <= 1:
        return 1
    d = arch.dims(model)
    itemsize = next(model.parameters()).element_size()
    window = plan_costs.calib_window_bytes(d.hidden, d.intermediate, d.n_heads, d.n_kv_heads, d.head_dim,
                                           itemsize, seqlen)
    free, _ = torch.cuda.mem_get_info(dev)
    return plan_costs.calibration_batch_for(free, window, n_windows)


def _check_rotations(model: nn.Module, cfg: RunConfig) -> None:
    """Refuse, before any expensive step, a rotation the architecture declares non-function-preserving."""
    from rope_quant.rotations.offline import check_function_preserving

    check_function_preserving(model, cfg.rotation.config(cfg.seed))


def _inv_freq(model: nn.Module, head_dim: int) -> tuple[np.ndarray, str]:
    """The RoPE frequencies: one (K,) vector when every layer shares it, else (n_layers, K), one row per layer
    (Gemma 3's sliding / full-attention bases), with a source naming each buffer and its layers. The angle
    estimators read each layer's own row from the model (:func:`rope_quant.model.arch.inv_freq_by_layer`)."""
    try:
        return arch.shared_inv_freq(model, head_dim=head_dim)
    except rope.AmbiguousInvFreqError:
        values, sources = arch.inv_freq_by_layer(model, head_dim=head_dim)
        return values, arch.describe_sources(sources)


def _whip_r1(model: nn.Module, cfg: RunConfig, calib: torch.Tensor, path: Path | None,
             progress: bool = False) -> tuple[torch.Tensor, dict]:
    """R1 fitted with the whip loss on the unrotated model (App. A.1), or read from its cache file.

    Returns the (hidden, hidden) float64 rotation and its fit log: the settings, the whip loss of the
    random-Hadamard initialisation and of the fit on every sample, the steps, the fit time, and whether
    it came from the cache.
    """
    from rope_quant.model import offload
    from rope_quant.rotations import whip

    saved = weight_cache.read_r1_cache(path)
    if saved is not None:
        return saved
    t = time.perf_counter()
    spec = cfg.rotation.whip
    with stage(StageName.WHIP_R1):
        fitted = whip.calibrate_model_rotations(model, calib, fit_r1=True, fit_r2=False, seed=cfg.seed,
                                                r1=spec.whip_config(), tokens_per_sample=spec.tokens_per_sample,
                                                device=offload.compute_device(model), progress=progress)
    res = fitted.r1_result
    fit_log = {"kind": "whip", "settings": dataclasses.asdict(spec), "loss_init": res.initial_loss,
               "loss_fit": res.final_loss, "steps": res.n_steps, "fit_s": time.perf_counter() - t,
               "cache_hit": False}
    if path is not None:
        with atomic_writer(path) as handle:
            torch.save({"r1": fitted.r1, "log": fit_log}, handle)
    return fitted.r1, fit_log


def _rotate(model: nn.Module, cfg: RunConfig, calib: torch.Tensor, r1_cache: Path | None,
            progress: bool = False) -> tuple[Any, dict]:
    """Offline R1/R2 (+ R4 weights and its online pre-hook) with :func:`rotation.rotate_model`; returns the
    rotation result and the R1 fit log (empty unless R1 is whip)."""
    from rope_quant.rotations.offline import rotate_model

    kwargs: dict[str, Any] = {}
    fit_log: dict = {}
    if cfg.rotation.r1 == RotationKind.WHIP:
        kwargs["r1_matrix"], fit_log = _whip_r1(model, cfg, calib, r1_cache, progress)
    if cfg.rotation.r2 == RotationKind.WHIP:  # a documented deviation from A.8
        kwargs.update(calib_ids=calib, whip_options=cfg.rotation.whip_options())
    with stage(StageName.ROTATION):
        return rotate_model(model, cfg.rotation.config(cfg.seed), **kwargs), fit_log


def _static_quantizers(model: nn.Module, cfg: RunConfig, calib: torch.Tensor, progress: bool,
                       saved: dict | None = None) -> dict:
    """One static per-channel activation quantiser per decoder linear (App. A.6, D).

    Calibrated on the rotated full-precision model over the calibration windows (running per-channel
    min/max of each linear's input, after the R4 Hadamard on down_proj), or restored from ``saved``.
    """
    from rope_quant.quant.quantizers import StaticChannelQuantizer

    a = cfg.quant.a
    quantizers: dict[str, Any] = {}
    handles = []
    if saved is not None:
        for name, mod in _decoder_linears(model):
            q = StaticChannelQuantizer(mod.in_features, bits=a.bits, clip_ratio=a.clip_ratio, symmetric=a.symmetric)
            q.lo, q.hi = (t.clone() for t in saved[name])
            q.finalize()
            quantizers[name] = q
        return quantizers
    for name, mod in _decoder_linears(model):
        q = StaticChannelQuantizer(mod.in_features, bits=a.bits, clip_ratio=a.clip_ratio, symmetric=a.symmetric)
        quantizers[name] = q

        def pre(_mod, args, _q=q):
            _q.observe(args[0])
        handles.append(mod.register_forward_pre_hook(pre))
    try:
        _forward_windows(model, calib, "static act calibration", progress)
    finally:
        for h in handles:
            h.remove()
    for q in quantizers.values():
        q.finalize()
    return quantizers


def _kv_static_quantizers(model: nn.Module, cfg: RunConfig, geom: attention.AttentionGeometry,
                          calib: torch.Tensor, progress: bool) -> tuple[list, list]:
    """Calibrate per-layer static per-channel K and V quantisers on post-R3 keys / values (App. A.6, D)."""
    from rope_quant.quant.quantizers import StaticChannelQuantizer

    width = geom.head_dim * geom.n_kv_heads
    ks = [StaticChannelQuantizer(width, bits=cfg.quant.k.bits, clip_ratio=cfg.quant.k.clip_ratio,
                                 symmetric=cfg.quant.k.symmetric) for _ in range(geom.n_layers)]
    vs = [StaticChannelQuantizer(width, bits=cfg.quant.v.bits, clip_ratio=cfg.quant.v.clip_ratio,
                                 symmetric=cfg.quant.v.symmetric) for _ in range(geom.n_layers)]

    def observe(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        ks[layer].observe(_heads_last(k))
        vs[layer].observe(_heads_last(v))

    states = attention.attention_states(model)
    saved = [(s.k, s.v) for s in states]
    for s in states:
        s.k = s.v = QuantConfig()  # off: observe unquantised K and V
        s.observers.append(observe)
    try:
        _forward_windows(model, calib, "static KV calibration", progress)
    finally:
        for s, (kq, vq) in zip(states, saved, strict=True):
            s.observers.remove(observe)
            s.k, s.v = kq, vq
    for q in ks + vs:
        q.finalize()
    return [_HeadsQuantizer(q) for q in ks], [_HeadsQuantizer(q) for q in vs]


def _heads_last(x: torch.Tensor) -> torch.Tensor:
    """(b, H, L, d) -> (b, L, H*d): channels of all heads on the last axis."""
    b, h, length, d = x.shape
    return x.transpose(1, 2).reshape(b, length, h * d)


@dataclass
class _HeadsQuantizer:
    """Apply a per-channel quantiser over (H*d) channels to a (b, H, L, d) tensor."""

    q: Any

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        b, h, length, d = x.shape
        y = self.q(_heads_last(x))
        return y.reshape(b, length, h, d).transpose(1, 2)

    def step(self) -> torch.Tensor:
        """The per-channel steps of the wrapped quantiser (App. E diagnostic)."""
        return self.q.step()


def _build_transforms(cfg: RunConfig, geom: attention.AttentionGeometry, angles: np.ndarray,
                      stats: Any = None, model: nn.Module | None = None) -> list[Any]:
    from rope_quant.core import transforms

    r3 = cfg.online
    fitted = _fit_transform_params(cfg, geom, angles, stats, model) if transforms.needs_fit(r3.transform) else None
    out = []
    for layer in range(geom.n_layers):
        params: dict[str, Any] = {"layout": "rotate_half"}
        if transforms.needs_angles(r3.transform):
            params["angles"] = angles[layer]
        if r3.block is not None:
            params["block"] = r3.block
        if fitted is not None:
            params.update(fitted[layer])
        try:
            out.append(transforms.build(r3.transform, geom.head_dim, **params))
        except transforms.TransformError as exc:
            if fitted is None:
                raise
            raise transforms.FitError(f"{r3.transform}: the fit of layer {layer} is unusable: {exc}") from exc
    return out


def _fit_transform_params(cfg: RunConfig, geom: attention.AttentionGeometry, angles: np.ndarray, stats: Any,
                          model: nn.Module | None) -> list[dict[str, Any]]:
    """Step 8 for a fitted R3 (issue 24): per-layer parameters from the K sample (:mod:`rope_quant.calib.foldable`)."""
    from rope_quant.calib.foldable import fit_for
    from rope_quant.calib.objectives import resolve_layer_inv_freq
    from rope_quant.core import transforms

    if stats is None or model is None:
        raise PipelineError(f"R3 {cfg.online.transform!r} is fitted: it needs the calibration statistics")
    inv_freq, _ = resolve_layer_inv_freq(model, geom.n_layers, head_dim=geom.head_dim)
    ctx = transforms.FitContext(stats=stats, inv_freq=np.asarray(inv_freq), n_layers=geom.n_layers,
                                n_kv_heads=geom.n_kv_heads, head_dim=geom.head_dim, layout="rotate_half",
                                angles=angles if transforms.needs_angles(cfg.online.transform) else None,
                                k_bits=cfg.quant.k.bits, seed=cfg.seed)
    return fit_for(cfg.online.transform, ctx)


def _estimate_angles(cfg: RunConfig, stats: Any, model: nn.Module) -> np.ndarray:
    from rope_quant.calib.objectives import AngleRule, estimate_angles

    r3 = cfg.online
    estimator, objective = r3.estimator.value, r3.objective.value
    if r3.angle == AngleRule.PHI_STAR:
        return estimate_angles(stats, estimator, objective, inv_freq=model,
                               average_length=r3.average_length or cfg.budget.seqlen)
    if r3.angle == AngleRule.PHI_HAT_BRANCH_MATCHED:
        return estimate_angles(stats, estimator, objective, branch_matched=True)
    if objective == "range":
        from rope_quant.core import transforms

        if not transforms.needs_angles(r3.transform):  # the fit is costly; an angle-free R3 ignores it
            return np.zeros((stats.n_layers, stats.n_pairs))
        return estimate_angles(stats, estimator, "range", inv_freq=model,
                               then_hadamard=r3.transform == "pairwise_plus_hadamard")
    return estimate_angles(stats, estimator, objective)


def _read_stats_cache(path: Path | None, expected: Any) -> Any:
    """The cached statistics at ``path``, or None (missing; or unreadable / of another shape: warned)."""
    from rope_quant.calib.errors import CalibrationError
    from rope_quant.calib.moments import CalibrationStats

    if path is None or not path.is_file():
        return None
    try:
        stats = CalibrationStats.load(path)
    except (CalibrationError, OSError) as exc:
        log.warning("ignoring unreadable statistics cache %s (%s); recomputing it", path, exc)
        return None
    if stats.config() != expected.config():
        log.warning("ignoring statistics cache %s: its shape %s does not match this model %s; recomputing it",
                    path, stats.config(), expected.config())
        return None
    return stats


def _calibrate(model: nn.Module, cfg: RunConfig, geom: attention.AttentionGeometry, calib: torch.Tensor,
               cache: Path | None, progress: bool, fingerprint: str, counters: PipelineCounters):
    """Collect mode: pre-RoPE q/k statistics over the calibration windows.

    Cached per (stats_key, model fingerprint, calibration-window hash); a corrupt cache is warned about,
    recomputed and rewritten.
    """
    from rope_quant.calib.moments import CalibrationStats

    name = f"stats-{cfg.stats_key()}-{fingerprint}-{weight_cache.data_fingerprint(calib)}.npz"
    spath = None if cache is None else cache / name

    def fresh() -> CalibrationStats:
        return CalibrationStats(geom.n_layers, geom.n_q_heads, geom.n_kv_heads, geom.head_dim,
                                sample_rows=K_SAMPLE_ROWS, sample_seed=cfg.seed)
    cached = _read_stats_cache(spath, fresh())
    if cached is not None:
        return cached

    def collect() -> CalibrationStats:
        stats = fresh()
        with attention.calibration_hooks(model, stats):
            _forward_windows(model, calib, "calibration", progress,
                             batch=calibration_batch(model, calib.shape[0], calib.shape[-1]))
        return stats
    # The activation quantisers' checks are read once for the whole pass (recomputed exactly if one asks).
    from rope_quant.quant import deferred
    stats = deferred.run_checked(collect)[0]
    stats.finalize()  # the one copy of the device accumulators to the host
    counters.calibration_passes += 1
    if spath is not None:
        stats.save(spath)
    return stats


def build_quantized_model(cfg: RunConfig, cache_dir: str | os.PathLike | None = None,
                          base: tuple[nn.Module, Any] | None = None, progress: bool = False,
                          corpus: Any = None, counters: PipelineCounters | None = None,
                          offload: str | None = None) -> QuantizedModel:
    """Build the quantised model of one cell (see the module docstring for the steps).

    ``base=(model, tokenizer)`` is copied (never written) instead of loading ``cfg.model`` (tests reuse one model).
    ``cache_dir`` caches the rotated, quantised state per :meth:`RunConfig.weight_key` (shared by every R3
    variant) and the calibration statistics per :meth:`RunConfig.stats_key`. ``corpus`` may pass an
    already-loaded corpus. ``counters`` (default: a fresh one, kept on the result as ``qm.counters``) counts
    weight quantisations, weight cache hits and calibration passes. ``offload`` ("none" | "cpu"; default the
    process's :func:`rope_quant.model.offload.default_mode`) streams one decoder layer at a time through a CUDA
    device (:mod:`rope_quant.model.offload`). Raises
    :class:`rope_quant.rotations.attention.UnsupportedAttentionError`,
    :class:`rope_quant.core.rope.OddHeadDimError` or :class:`rope_quant.core.rope.MissingInvFreqError` for models
    the pipeline cannot handle, before any expensive step.
    """
    from rope_quant.experiment import data

    counters = PipelineCounters() if counters is None else counters
    timing: dict[str, float] = {}
    t0 = time.perf_counter()
    torch.manual_seed(cfg.seed)
    partial = base is not None and cache_dir is not None  # a weight-cache hit needs only a few base tensors
    stream = _streams(cfg, offload)
    with stage(StageName.LOAD):
        model, tokenizer = _load(cfg, base, partial=partial, stream=stream)
    geom = attention.check_model(model)  # clear errors before any expensive step
    _check_rotations(model, cfg)
    inv_freq, inv_source = _inv_freq(model, geom.head_dim)
    fingerprint = weight_cache.model_fingerprint(model) if cache_dir is not None else ""
    if corpus is None:
        corpus = data.load_corpus(cfg.corpus, tokenizer)
    calib = data.calibration_windows(corpus, cfg.budget.calib_windows, cfg.budget.seqlen, cfg.seed)
    cache = Path(cache_dir) if cache_dir is not None else None
    timing["load_s"] = time.perf_counter() - t0

    # 2. offline rotations (+ the online R4 pre-hook); a cache hit restores the rotated quantised state
    t = time.perf_counter()
    data_fp = weight_cache.data_fingerprint(calib) if cache is not None else ""
    wpath = weight_cache.weight_cache_path(cache, cfg, fingerprint, data_fp)
    r1_cache = weight_cache.r1_cache_path(cache, cfg, fingerprint, data_fp)
    cached = weight_cache.read_weight_cache(wpath, cfg)
    rotation_fit: dict = {}
    if cached is not None:
        try:
            rotation = weight_cache.restore_rotated(model, cfg, cached)
        except weight_cache.WeightCacheMismatch as exc:  # e.g. another BLAS: recompute; the restore changed the model
            log.warning("ignoring weight cache %s (%s); recomputing it", wpath, exc)
            cached = None
            model, tokenizer = _load(cfg, base, stream=stream)
            partial = False
    if cached is not None and cfg.rotation.r1 == RotationKind.WHIP:  # the fit log only: the weights hold R1
        hit_log = weight_cache.hit_fit_log(r1_cache, cached)
        if hit_log is None:  # R1 file damaged or gone, and a weight cache without the fit log: refit, recompute
            log.warning("R1 cache %s cannot be rebuilt from weight cache %s; refitting R1 and recomputing the "
                        "weights", r1_cache, wpath)
            cached = None
            model, tokenizer = _load(cfg, base, stream=stream)
            partial = False
        else:
            rotation_fit = hit_log
    if cached is None:
        if partial:
            _complete(model, base)
        rotation, rotation_fit = _rotate(model, cfg, calib, r1_cache, progress)
    timing["rotate_s"] = time.perf_counter() - t

    # 3. activation quantisers (static ranges come from the rotated fp model, before the weights change)
    t = time.perf_counter()
    static_act = None
    if cfg.quant.static_act:
        with stage(StageName.STATIC_RANGES):
            static_act = _static_quantizers(model, cfg, calib, progress,
                                            saved=None if cached is None else cached.get("static_act"))
    act_handles = install_activation_quantizers(model, cfg.quant.a, static=static_act)
    timing["act_calib_s"] = time.perf_counter() - t

    # 4. weights (GPTQ Hessians see R4 and the activation quantisers installed above)
    t = time.perf_counter()
    errors: dict[str, float] = {}
    if cached is not None:
        errors = dict(cached.get("errors") or {})
        counters.weight_cache_hits += 1
    else:
        w = cfg.quant.w
        if w.mode == WeightMode.GPTQ:
            with stage(StageName.GPTQ):
                errors = gptq.quantize_model_gptq(model, calib, w.bits, w.gptq, clip_ratio=w.clip,
                                                  progress=progress)
            counters.weight_quantizations += 1
        elif w.mode == WeightMode.RTN:
            with stage(StageName.RTN):
                gptq.quantize_model_rtn(model, w.bits, w.gptq.group_size, w.gptq.mse, w.clip, cfg=w.gptq)
            counters.weight_quantizations += 1
        if wpath is not None:
            weight_cache.save_weights(wpath, cfg, model, rotation, errors, static_act, rotation_fit)
    timing["weights_s"] = time.perf_counter() - t

    # 5. calibration statistics (pre-RoPE q/k) on the same windows
    t = time.perf_counter()
    with stage(StageName.CALIBRATION):
        stats = _calibrate(model, cfg, geom, calib, cache, progress, fingerprint, counters)
    timing["calibration_s"] = time.perf_counter() - t

    qm = QuantizedModel(
        model=model, tokenizer=tokenizer, cfg=cfg, angles=np.zeros((geom.n_layers, geom.head_dim // 2)),
        transforms=[], stats=stats, inv_freq=inv_freq, inv_freq_source=inv_source, geometry=geom,
        corpus=corpus, act_handles=act_handles, rotation=rotation, weight_cache_hit=cached is not None,
        weight_errors=errors, timing=timing, calib=calib, counters=counters, rotation_fit=rotation_fit,
    )
    # 6-7. angles, R3 and the quantise-mode attention
    qm.reconfigure(cfg, progress=progress)
    timing["build_s"] = time.perf_counter() - t0
    return qm


def angles_summary(angles: np.ndarray) -> dict[str, Any]:
    """Small JSON-able summary of an angle array (radians)."""
    a = np.abs(np.asarray(angles, dtype=np.float64))
    return {"shape": list(a.shape), "mean_abs": float(a.mean()), "max_abs": float(a.max()),
            "frac_below_0.01": float((a < 0.01).mean())}


def _fold_status(qm: QuantizedModel) -> dict[str, Any]:
    """Whether this cell's R3 folds into this model's W_Q/W_K (or q/k norms), and why not (issue 24)."""
    from rope_quant.rotations.fold_r3 import fold_refusal

    if not qm.transforms:
        return {"r3_folds": None, "r3_fold_refusal": None}
    reason = fold_refusal(qm.model, qm.transforms)
    return {"r3_folds": reason is None, "r3_fold_refusal": reason}


def run_cell(cfg: RunConfig, cache_dir: str | os.PathLike | None = None,
             base: tuple[nn.Module, Any] | None = None, progress: bool = False,
             qm: QuantizedModel | None = None, corpus: Any = None) -> dict[str, Any]:
    """Build (unless ``qm`` is given) and evaluate one cell: perplexity and K diagnostics (JSON-able dict)."""
    from rope_quant.experiment import evaluate

    if qm is None:
        qm = build_quantized_model(cfg, cache_dir=cache_dir, base=base, progress=progress, corpus=corpus)
    diag = qm.attach_diagnostics()
    t = time.perf_counter()
    try:
        with stage(StageName.EVALUATION):
            res = evaluate.perplexity(qm.model, qm.corpus.eval_ids, cfg.budget.seqlen,
                                      max_windows=cfg.budget.eval_windows, device=cfg.runtime.device,
                                      progress=progress)
    finally:
        qm.detach_diagnostics()
    eval_s = time.perf_counter() - t
    summary = diag.summary()
    out = {
        "key": cfg.key(), "weight_key": cfg.weight_key(), "config": cfg.to_dict(),
        "ppl": res.ppl, "nll": res.nll, "n_windows": res.n_windows, "n_tokens": res.n_tokens,
        "seqlen": res.seqlen, "window_nll": list(res.window_nll),
        "k_range_mean": summary["k_range_mean"], "k_range_max": summary["k_range_max"],
        "delta_mean": summary["delta_mean"], "k_rel_err": summary["k_rel_err"],
        "diag_bits": diag.bits,
        "angles": angles_summary(qm.angles), "inv_freq_source": qm.inv_freq_source,
        "weight_cache_hit": qm.weight_cache_hit, "rotation_fit": qm.rotation_fit,
        "timing": {**qm.timing, "eval_s": eval_s}, **_fold_status(qm),
    }
    return json.loads(json.dumps(out, default=float))

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
   sample of :data:`K_SAMPLE_ROWS` K tokens per layer with their positions); a GPTQ build gathers them in
   GPTQ's own pass of each quantised layer instead, bit for bit the same
   (:class:`~rope_quant.experiment.calibrate.DuringGPTQ`; not where the pass batches windows, on a GPU);
6. R3 angles (:func:`rope_quant.calib.objectives.estimate_angles`; the angle rule φ̂, branch-matched φ̂ or
   φ* with the live ``inv_freq``, or the
   ``range`` objective's coordinate descent on the K sample) and the
   per-layer R3 from the registry (:mod:`rope_quant.core.transforms`); a fitted R3 (``needs_fit``)
   gets its per-layer parameters from :func:`rope_quant.calib.foldable.fit_for` on the K sample;
7. the quantise-mode attention (:mod:`rope_quant.rotations.attention`): R3 on post-RoPE q/k, K/V quantisers.

Nothing in steps 1–5 depends on the R3 fields of the configuration: within a seed every R3 variant shares
the offline rotations, the quantised weights and the calibration sample (paired design), and the weight
cache is keyed accordingly. Cache files also carry the model's weight fingerprint and (where the
calibration sample shapes them) a hash of the calibration windows; an unreadable cache is warned about
(naming the file), recomputed and rewritten. :func:`run_cell` evaluates perplexity and K diagnostics on the
evaluation split.
The configuration (:class:`RunConfig`, its specs and keys) lives in :mod:`rope_quant.experiment.config`; step 1
in :mod:`~rope_quant.experiment.base_model` (:func:`load_base`), the activation and static K/V quantisers in
:mod:`~rope_quant.experiment.act_quant`, steps 5–6 (calibration pass, angles, R3) in
:mod:`~rope_quant.experiment.calibrate`, the weight caches in :mod:`~rope_quant.experiment.weight_cache`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from rope_quant.experiment import weight_cache
from rope_quant.experiment.act_quant import (
    install_activation_quantizers,
    kv_static_quantizers,
    remove_activation_quantizers,
    static_quantizers,
)
from rope_quant.experiment.base_model import complete_copy, load_base, streams
from rope_quant.experiment.calibrate import (
    angles_for,
    build_transforms,
    calibrate,
    during_gptq,
    rope_frequencies,
    stats_path,
)
from rope_quant.experiment.config import (
    K_SAMPLE_ROWS,
    PipelineError,
    RunConfig,
    WeightMode,
)
from rope_quant.experiment.key_quant import key_bits_per_element, key_quantizers
from rope_quant.io import save_tensors
from rope_quant.planning.stages import StageName, stage
from rope_quant.quant import gptq, rtn
from rope_quant.quant.rtn import GPTQConfig
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
    "load_base",
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
        fields, K/V bits/groups/clips, the key quantiser, the static KV control, eval_windows); anything else raises
        :class:`PipelineError`. This is the paired design: every R3 variant reuses the same rotated,
        quantised model and the same calibration sample.
        """
        if cfg.weight_key() != self.cfg.weight_key() or cfg.stats_key() != self.cfg.stats_key():
            raise PipelineError("reconfigure() only changes R3 and K/V settings; the weights or the "
                                "calibration statistics of this configuration differ: build a new model")
        if cfg.quant.static_act != self.cfg.quant.static_act:
            raise PipelineError("reconfigure() cannot switch the static activation control")
        t = time.perf_counter()
        angles = angles_for(cfg, self.stats, self.model)
        transforms_ = build_transforms(cfg, self.geometry, angles, self.stats, self.model)
        self.timing["angles_s"] = time.perf_counter() - t
        t = time.perf_counter()
        try:
            attention.install_attention(self.model, transforms_, k=cfg.quant.k, v=cfg.quant.v,
                                        runtime_rotation=cfg.online.runtime_rotation)
        except attention.AttentionWrapError as exc:
            raise PipelineError(str(exc)) from None
        key_quant = key_quantizers(self.model, cfg, self.geometry, self.calib, progress)
        if key_quant is not None:  # another key quantiser than the paper's per-token rule (k_quant)
            for st, kq in zip(attention.attention_states(self.model), key_quant, strict=True):
                st.key_quant = kq
        if cfg.quant.static_kv:
            if self.calib is None:
                raise PipelineError("the static KV control needs the calibration windows")
            k_static, v_static = kv_static_quantizers(self.model, cfg, self.geometry, self.calib, progress)
            for st, kq, vq in zip(attention.attention_states(self.model), k_static, v_static, strict=True):
                st.k_static, st.v_static = kq, vq
        self.timing["attention_s"] = time.perf_counter() - t
        self.cfg, self.angles, self.transforms = cfg, angles, transforms_
        return self

    def strip_hooks(self, keep_r4_hook: bool = False) -> nn.Module:
        """Remove every rope_quant hook (activation quantisers, the quantised attention and, unless
        ``keep_r4_hook``, the online R4) from :attr:`model` in place and return it: the plain model, as the export
        writes it."""
        remove_activation_quantizers(self.model, self.act_handles)
        self.act_handles = []
        attention.uninstall_attention(self.model)
        if self.rotation is not None and not keep_r4_hook:
            for h in self.rotation.r4_handles:
                h.remove()
            self.rotation.r4_handles = []
        return self.model

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


def _check_rotations(model: nn.Module, cfg: RunConfig) -> None:
    """Refuse, before any expensive step, a rotation the architecture declares non-function-preserving."""
    from rope_quant.rotations.offline import check_function_preserving

    check_function_preserving(model, cfg.rotation.config(cfg.seed))


def _whip_r1(model: nn.Module, cfg: RunConfig, calib: torch.Tensor, path: Path | None,
             progress: bool = False) -> tuple[torch.Tensor, dict]:
    """R1 fitted with the whip loss on the unrotated model (App. A.1), or read from its cache file.

    Returns the (hidden, hidden) float64 rotation and its fit log: the settings, the whip loss of the
    random-Hadamard initialisation and of the fit on every sample, the steps, the fit time, and whether
    it came from the cache.
    """
    from rope_quant.model import offload
    from rope_quant.rotations import whip_model

    saved = weight_cache.read_r1_cache(path)
    if saved is not None:
        return saved
    t = time.perf_counter()
    spec = cfg.rotation.whip
    with stage(StageName.WHIP_R1):
        fitted = whip_model.calibrate_model_rotations(model, calib, fit_r1=True, fit_r2=False, seed=cfg.seed,
                                                      r1=spec.whip_config(), tokens_per_sample=spec.tokens_per_sample,
                                                      device=offload.compute_device(model), progress=progress)
    res = fitted.r1_result
    fit_log = {"kind": "whip", "settings": dataclasses.asdict(spec), "loss_init": res.initial_loss,
               "loss_fit": res.final_loss, "steps": res.n_steps, "fit_s": time.perf_counter() - t,
               "cache_hit": False}
    if path is not None:
        save_tensors(path, {"r1": fitted.r1, "log": fit_log}, "R1 cache")
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
    from rope_quant.corpora import token_streams

    counters = PipelineCounters() if counters is None else counters
    timing: dict[str, float] = {}
    t0 = time.perf_counter()
    torch.manual_seed(cfg.seed)
    partial = base is not None and cache_dir is not None  # a weight-cache hit needs only a few base tensors
    stream = streams(cfg, offload)
    with stage(StageName.LOAD):
        model, tokenizer = load_base(cfg, base, partial=partial, stream=stream)
    geom = attention.check_model(model)  # clear errors before any expensive step
    _check_rotations(model, cfg)
    inv_freq, inv_source = rope_frequencies(model, geom.head_dim)
    fingerprint = weight_cache.model_fingerprint(model) if cache_dir is not None else ""
    if corpus is None:
        corpus = token_streams.load_corpus(cfg.corpus, tokenizer)
    calib = token_streams.calibration_windows(corpus, cfg.budget.calib_windows, cfg.budget.seqlen, cfg.seed)
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
            model, tokenizer = load_base(cfg, base, stream=stream)
            partial = False
    if cached is not None and cfg.rotation.r1 == RotationKind.WHIP:  # the fit log only: the weights hold R1
        hit_log = weight_cache.hit_fit_log(r1_cache, cached)
        if hit_log is None:  # R1 file damaged or gone, and a weight cache without the fit log: refit, recompute
            log.warning("R1 cache %s cannot be rebuilt from weight cache %s; refitting R1 and recomputing the "
                        "weights", r1_cache, wpath)
            cached = None
            model, tokenizer = load_base(cfg, base, stream=stream)
            partial = False
        else:
            rotation_fit = hit_log
    if cached is None:
        if partial:
            complete_copy(model, base)
        rotation, rotation_fit = _rotate(model, cfg, calib, r1_cache, progress)
    timing["rotate_s"] = time.perf_counter() - t

    # 3. activation quantisers (static ranges come from the rotated fp model, before the weights change)
    t = time.perf_counter()
    static_act = None
    if cfg.quant.static_act:
        with stage(StageName.STATIC_RANGES):
            static_act = static_quantizers(model, cfg, calib, progress,
                                            saved=None if cached is None else cached.get("static_act"))
    act_handles = install_activation_quantizers(model, cfg.quant.a, static=static_act)
    timing["act_calib_s"] = time.perf_counter() - t

    # 4. weights (GPTQ Hessians see R4 and the activation quantisers installed above); a GPTQ build collects
    # step 5's statistics in its own pass of each quantised layer
    t = time.perf_counter()
    errors: dict[str, float] = {}
    fused = None
    if cached is not None:
        errors = dict(cached.get("errors") or {})
        counters.weight_cache_hits += 1
    else:
        w = cfg.quant.w
        if w.mode == WeightMode.GPTQ:
            fused = during_gptq(model, cfg, geom, calib, stats_path(cfg, cache, fingerprint, calib))
            with stage(StageName.GPTQ), fused.hooks(model) if fused is not None else contextlib.nullcontext():
                errors = gptq.quantize_model_gptq(model, calib, w.bits, w.gptq, clip_ratio=w.clip,
                                                  progress=progress,
                                                  observe=None if fused is None else fused.observe)
            counters.weight_quantizations += 1
        elif w.mode == WeightMode.RTN:
            with stage(StageName.RTN):
                rtn.quantize_model_rtn(model, w.bits, w.gptq.group_size, w.gptq.mse, w.clip, cfg=w.gptq)
            counters.weight_quantizations += 1
        if wpath is not None:
            weight_cache.save_weights(wpath, cfg, model, rotation, errors, static_act, rotation_fit)
    timing["weights_s"] = time.perf_counter() - t

    # 5. calibration statistics (pre-RoPE q/k) on the same windows
    t = time.perf_counter()
    with stage(StageName.CALIBRATION):
        stats = calibrate(model, cfg, geom, calib, cache, progress, fingerprint, counters,
                          collected=None if fused is None else fused.result())
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
    """Whether this cell's R3 folds into this model's W_Q/W_K (or q/k norms), and why not (``r3_folds``)."""
    from rope_quant.rotations.fold_r3 import fold_refusal

    if not qm.transforms:
        return {"r3_folds": None, "r3_fold_refusal": None}
    reason = fold_refusal(qm.model, qm.transforms)
    return {"r3_folds": reason is None, "r3_fold_refusal": reason}


def run_cell(cfg: RunConfig, cache_dir: str | os.PathLike | None = None,
             base: tuple[nn.Module, Any] | None = None, progress: bool = False,
             qm: QuantizedModel | None = None, corpus: Any = None) -> dict[str, Any]:
    """Build (unless ``qm`` is given) and evaluate one cell: perplexity and K diagnostics (JSON-able dict)."""
    from rope_quant.scoring import evaluate

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
    k_bits = key_bits_per_element(qm.model, cfg, qm.geometry.head_dim, res.seqlen)
    if k_bits is not None:  # the key cache's bits per element at the evaluation windows' length (claims: equal bits)
        out["k_bits_per_element"] = k_bits
    return json.loads(json.dumps(out, default=float))

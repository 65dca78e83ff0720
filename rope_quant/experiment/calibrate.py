"""Steps 5–6 of a cell: the calibration pass (pre-RoPE q/k statistics and the K sample, cached), the R3
angles and the per-layer R3 transforms from the registry (a fitted R3's parameters from its spec's fit).

A GPTQ build collects the statistics inside GPTQ's own pass instead (:class:`DuringGPTQ`): after a layer's q/k/v
are quantised, GPTQ runs its attention once over the calibration windows, which is what the calibration pass
would compute for that layer, window by window, with the same weights, quantisers and inputs.

Nothing here changes the weights: every R3 variant of a seed reuses the same statistics (paired design), and
:meth:`rope_quant.experiment.pipeline.QuantizedModel.reconfigure` reruns only :func:`angles_for` and
:func:`build_transforms`.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from rope_quant.core import rope
from rope_quant.experiment import weight_cache
from rope_quant.experiment.act_quant import forward_windows
from rope_quant.experiment.config import K_SAMPLE_ROWS, PipelineError, RunConfig
from rope_quant.io import cache_log, read_cache
from rope_quant.model import arch
from rope_quant.rotations import attention

__all__ = ["rope_frequencies", "build_transforms", "fit_transform_params", "angles_for", "read_stats_cache",
           "calibration_batch", "stats_path", "DuringGPTQ", "during_gptq", "calibrate"]


def rope_frequencies(model: nn.Module, head_dim: int) -> tuple[np.ndarray, str]:
    """The RoPE frequencies: one (K,) vector when every layer shares it, else (n_layers, K), one row per layer
    (Gemma 3's sliding / full-attention bases), with a source naming each buffer and its layers. The angle
    estimators read each layer's own row from the model (:func:`rope_quant.model.arch.inv_freq_by_layer`)."""
    try:
        return arch.shared_inv_freq(model, head_dim=head_dim)
    except rope.AmbiguousInvFreqError:
        values, sources = arch.inv_freq_by_layer(model, head_dim=head_dim)
        return values, arch.describe_sources(sources)


def build_transforms(cfg: RunConfig, geom: attention.AttentionGeometry, angles: np.ndarray,
                     stats: Any = None, model: nn.Module | None = None) -> list[Any]:
    from rope_quant.core import transforms

    r3 = cfg.online
    fitted = fit_transform_params(cfg, geom, angles, stats, model) if transforms.needs_fit(r3.transform) else None
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


def fit_transform_params(cfg: RunConfig, geom: attention.AttentionGeometry, angles: np.ndarray, stats: Any,
                         model: nn.Module | None) -> list[dict[str, Any]]:
    """Step 8 for a fitted R3: per-layer parameters from the K sample (:mod:`rope_quant.calib.foldable`)."""
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


def angles_for(cfg: RunConfig, stats: Any, model: nn.Module) -> np.ndarray:
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
                               then_hadamard=transforms.foldability(r3.transform).online_is_hadamard)
    return estimate_angles(stats, estimator, objective)


def read_stats_cache(path: Path | None, expected: Any) -> Any:
    """The cached statistics at ``path``, or None (missing; or unreadable / of another shape: warned on the
    cache's one channel, :data:`rope_quant.io.cache_log`)."""
    from rope_quant.calib.stats import CalibrationStats

    stats = read_cache(path, CalibrationStats.load, "statistics cache", "recomputing it")
    if stats is not None and stats.config() != expected.config():
        cache_log.warning("ignoring statistics cache %s: its shape %s does not match this model %s; recomputing it",
                          path, stats.config(), expected.config())
        return None
    return stats


def calibration_batch(model: nn.Module, n_windows: int, seqlen: int) -> int:
    """Windows per calibration forward: 1 on the CPU (a batch there only adds memory; each window's
    arithmetic is the same), on a GPU as many as fit in
    :data:`rope_quant.planning.plan_costs.CALIB_MEMORY_FRACTION` of the free memory
    (:func:`~rope_quant.planning.plan_costs.calib_window_bytes` per window; the plan counts the same)."""
    from rope_quant.model import offload
    from rope_quant.planning import plan_costs

    dev = offload.compute_device(model)
    if dev.type != "cuda" or n_windows <= 1:
        return 1
    d = arch.dims(model)
    itemsize = next(model.parameters()).element_size()
    window = plan_costs.calib_window_bytes(d.hidden, d.intermediate, d.n_heads, d.n_kv_heads, d.head_dim,
                                           itemsize, seqlen)
    free, _ = torch.cuda.mem_get_info(dev)
    return plan_costs.calibration_batch_for(free, window, n_windows)


def stats_path(cfg: RunConfig, cache: Path | None, fingerprint: str, calib: torch.Tensor) -> Path | None:
    """The statistics cache file: per (stats_key, model fingerprint, calibration-window hash)."""
    name = f"stats-{cfg.stats_key()}-{fingerprint}-{weight_cache.data_fingerprint(calib)}.npz"
    return None if cache is None else cache / name


def _fresh(cfg: RunConfig, geom: attention.AttentionGeometry) -> Any:
    from rope_quant.calib.stats import CalibrationStats

    return CalibrationStats(geom.n_layers, geom.n_q_heads, geom.n_kv_heads, geom.head_dim,
                            sample_rows=K_SAMPLE_ROWS, sample_seed=cfg.seed)


class DuringGPTQ:
    """The calibration statistics collected in GPTQ's pass (``quantize_model_gptq(observe=...)``).

    The projection hooks of :func:`rope_quant.rotations.attention.calibration_hooks` stay on for the whole of
    GPTQ (:meth:`hooks`); an update reaches the statistics only while :meth:`observe` has its layer open (GPTQ's
    one pass of that layer's attention with q/k/v quantised), and is counted. :meth:`result` is the statistics
    when every layer gave each stream exactly one update per window, else None (a pass GPTQ repeated, a layer
    it skipped): the calibration pass then runs on its own.
    """

    def __init__(self, stats: Any, n_windows: int) -> None:
        self.stats, self.n_windows = stats, n_windows
        self.layer: int | None = None
        self.calls: Counter[tuple[int, str]] = Counter()

    def update(self, layer: int, stream: str, x: Any) -> None:
        if layer == self.layer:
            self.calls[layer, stream] += 1
            self.stats.update(layer, stream, x)

    @contextlib.contextmanager
    def observe(self, layer: int) -> Iterator[None]:
        self.layer = layer
        try:
            yield
        finally:
            self.layer = None

    @contextlib.contextmanager
    def hooks(self, model: nn.Module) -> Iterator[None]:
        with attention.calibration_hooks(model, self):
            yield

    def result(self) -> Any:
        expected = {(li, s): self.n_windows for li in range(self.stats.n_layers) for s in ("q", "k")}
        return self.stats if dict(self.calls) == expected else None


def during_gptq(model: nn.Module, cfg: RunConfig, geom: attention.AttentionGeometry, calib: torch.Tensor,
                path: Path | None) -> DuringGPTQ | None:
    """A :class:`DuringGPTQ` for this build, or None where the statistics are cached or the calibration pass
    batches windows (on a GPU: GPTQ runs one window at a time, and the statistics must not depend on which pass
    collected them)."""
    if path is not None and path.is_file():
        return None
    if calibration_batch(model, calib.shape[0], calib.shape[-1]) != 1:
        return None
    return DuringGPTQ(_fresh(cfg, geom), calib.shape[0])


def calibrate(model: nn.Module, cfg: RunConfig, geom: attention.AttentionGeometry, calib: torch.Tensor,
              cache: Path | None, progress: bool, fingerprint: str, counters: Any,
              collected: Any = None) -> Any:
    """Collect mode: pre-RoPE q/k statistics over the calibration windows.

    Cached per :func:`stats_path`; a corrupt cache is warned about, recomputed and rewritten. ``collected``:
    the statistics GPTQ's pass gathered (:meth:`DuringGPTQ.result`), used (and cached) instead of a pass.
    """
    spath = stats_path(cfg, cache, fingerprint, calib)
    cached = read_stats_cache(spath, _fresh(cfg, geom))
    if cached is not None:
        return cached

    def collect() -> Any:
        stats = _fresh(cfg, geom)
        with attention.calibration_hooks(model, stats):
            forward_windows(model, calib, "calibration", progress,
                             batch=calibration_batch(model, calib.shape[0], calib.shape[-1]))
        return stats
    # The activation quantisers' checks are read once for the whole pass (recomputed exactly if one asks).
    from rope_quant.quant import deferred
    stats = collected if collected is not None else deferred.run_checked(collect)[0]
    stats.finalize()  # the one copy of the device accumulators to the host
    counters.calibration_passes += 1
    if spath is not None:
        stats.save(spath)
    return stats

"""DartQuant's whip on a model: the calibration samples collected through hooks, then the fits.

The samples (DartQuant Sec. 3.2; the released data script): for R1, the unit-RMS-normalised residual stream
entering every layer's attention and MLP norm, pooled over layers (:func:`collect_r1_samples`); for R2, each
layer's per-head values (v_proj outputs, or the o_proj inputs as in the released code,
:func:`collect_r2_samples`). The decoder runs without its lm_head. :func:`calibrate_model_rotations` collects
them and fits R1 and R2 with :func:`rope_quant.rotations.whip.fit_rotation` (the loss, the QR parameterisation
and the training loop live there).
"""

from __future__ import annotations

import torch
from torch import nn

from rope_quant.model import arch
from rope_quant.rotations.whip import CalibratedRotations, WhipConfig, WhipError, _fits_on, fit_rotation

__all__ = ["collect_r1_samples", "collect_r2_samples", "calibrate_model_rotations"]


def _norm_eps(norm: nn.Module) -> float:
    for name in ("variance_epsilon", "eps"):
        v = getattr(norm, name, None)
        if isinstance(v, (int, float)):
            return float(v)
    return 1e-6


def _check_ids(ids: torch.Tensor) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
        raise WhipError("calibration ids must be an integer tensor of shape (n_windows, seqlen)")
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.numel() == 0:
        raise WhipError(f"calibration ids must be (n_windows, seqlen), got {tuple(ids.shape)}")
    return ids.long()


def _forward(model: nn.Module, ids: torch.Tensor, handles: list) -> None:
    """Run the decoder stack only (the hooks read inside the layers; no lm_head, no logits), then remove the
    hooks' ``handles``, also when the forward raises."""
    try:
        device = next(model.parameters()).device
        base = getattr(model, "model", model)
        with torch.no_grad():
            for row in ids:
                base(input_ids=row[None].to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()


def collect_r1_samples(
    model: nn.Module,
    ids: torch.Tensor,
    tokens_per_sample: int = 64,
    seed: int = 0,
    normalize: bool = True,
) -> torch.Tensor:
    """Residual-stream inputs of every layer's input/post-attention norm, pooled: (N, T, hidden) float32, on the
    model's device where they fit (:data:`SAMPLES_GPU_SHARE`), else on the host.

    One sample per (window, layer, norm) with ``tokens_per_sample`` tokens drawn without replacement
    (all when the window is shorter). ``normalize``: divide by the RMS (``x / sqrt(mean x² + eps)``),
    i.e. the unit-weight RMSNorm output that q/k/v and gate/up read once norms are fused (what the
    released data script hooks). The values do not depend on norm fusion, untying or R2.
    """
    ids = _check_ids(ids)
    if tokens_per_sample < 1:
        raise WhipError(f"tokens_per_sample must be positive, got {tokens_per_sample}")
    gen = torch.Generator().manual_seed(int(seed))
    out: list[torch.Tensor] = []
    device = next(model.parameters()).device
    n_layers = len(arch.decoder_layers(model))
    nbytes = ids.shape[0] * 2 * n_layers * min(tokens_per_sample, ids.shape[1]) * arch.dims(model).hidden * 4
    keep = device if _fits_on(device, nbytes) else torch.device("cpu")  # where the fit will read them

    def hook(norm: nn.Module, args: tuple) -> None:
        x = args[0].detach()[0].to(torch.float32)  # (seq, hidden), batch of one window
        if normalize:
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + _norm_eps(norm))
        k = min(tokens_per_sample, x.shape[0])
        idx = torch.randperm(x.shape[0], generator=gen)[:k].sort().values
        out.append(x[idx.to(x.device)].to(keep))

    handles = []
    for i in range(len(arch.decoder_layers(model))):
        norms = arch.layer_norms(model, i)
        handles.append(norms.pre_attn.register_forward_pre_hook(hook))
        handles.append(norms.pre_mlp.register_forward_pre_hook(hook))
    _forward(model, ids, handles)
    t = min(s.shape[0] for s in out)
    return torch.stack([s[:t] for s in out])


def collect_r2_samples(model: nn.Module, ids: torch.Tensor, source: str = "v_proj") -> list[torch.Tensor]:
    """Per-layer per-head values: a list over layers of (n_windows, seq, H, head_dim) float32.

    ``source="v_proj"``: v_proj outputs (H = n_kv heads, the brief's choice); ``"o_proj_input"``: the
    attention output entering o_proj (H = n_q heads; the released code's choice). Both are rotated by
    the same per-KV-head R2, and neither depends on norm fusion or R1.
    """
    if source not in ("v_proj", "o_proj_input"):
        raise WhipError(f"R2 source must be 'v_proj' or 'o_proj_input', got {source!r}")
    ids = _check_ids(ids)
    dims = arch.dims(model)
    layers = arch.decoder_layers(model)
    store: list[list[torch.Tensor]] = [[] for _ in layers]
    handles = []
    for li in range(len(layers)):
        attn = arch.attention(model, li)
        if source == "v_proj":
            def hook(mod, args, output, li=li):
                store[li].append(output.detach()[0].to(torch.float32).cpu())

            handles.append(attn.v.register_forward_hook(hook))
        else:
            def pre(mod, args, li=li):
                store[li].append(args[0].detach()[0].to(torch.float32).cpu())

            handles.append(attn.o.register_forward_pre_hook(pre))
    _forward(model, ids, handles)
    heads = dims.n_kv_heads if source == "v_proj" else dims.n_heads
    return [torch.stack(s).reshape(len(s), -1, heads, dims.head_dim) for s in store]


def calibrate_model_rotations(
    model: nn.Module,
    ids: torch.Tensor,
    fit_r1: bool = True,
    fit_r2: bool = True,
    seed: int = 0,
    r1: WhipConfig | None = None,
    r2: WhipConfig | None = None,
    tokens_per_sample: int = 64,
    r2_source: str = "v_proj",
    r1_normalize: bool = True,
    device: torch.device | str | None = None,
    progress: bool = False,
) -> CalibratedRotations:
    """Fit DartQuant R1 (pooled over layers) and per-layer R2 on calibration windows ``ids``.

    Run on the unrotated model (or any model with only untie/fuse applied): the collected activations are
    the ones R1/R2 will then rotate. ``device``: where the fits run (default: the CPU, where the samples are
    collected; pass the model's CUDA device on a GPU node). Returns float64 matrices in the row convention of
    :func:`rope_quant.rotations.offline.apply_r1` / :func:`rope_quant.rotations.offline.apply_r2`.
    """
    dims = arch.dims(model)
    out = CalibratedRotations(r1=None, r2=None)
    if fit_r1:
        samples = collect_r1_samples(model, ids, tokens_per_sample=tokens_per_sample, seed=seed,
                                     normalize=r1_normalize)
        res = fit_rotation(samples, n=dims.hidden, seed=seed, cfg=r1 or WhipConfig(), device=device,
                           progress=progress)
        out.r1, out.r1_result = res.rotation, res
    if fit_r2:
        per_layer = collect_r2_samples(model, ids, source=r2_source)
        mats = []
        for li, x in enumerate(per_layer):
            res = fit_rotation(x, n=dims.head_dim, seed=seed + 1 + li, cfg=r2 or WhipConfig(),
                               groups=dims.n_kv_heads, device=device)
            out.r2_results.append(res)
            mats.append(res.rotation)
        out.r2 = torch.stack(mats)
    return out

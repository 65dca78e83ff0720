"""Fits of the foldable R3 transforms on the pre-RoPE K sample (``pairwise_scaled``, ``prerope_channel_scale``,
``learned_orthogonal``; equations in :mod:`rope_quant.core.transforms.foldable`).

All three act per layer and KV head on the post-RoPE keys y = R_m k of the K sample (the sample stores k and
its position m). The 4-bit K quantiser is dynamic per token over the whole head (asymmetric min–max), so it is
scale-equivariant: only the SHAPE of each token's vector matters.

* Pair scales (``pairwise_scaled``): the pair radius ρ_k = max over tokens of |(y_a, y_b)| is invariant under
  RoPE and under G(φ_k). Scales s_k = (ρ_k / gm(ρ))^{-α} (gm: geometric mean over the head's pairs, so α = 0
  is pairwise_only and α = 1 equalises the pairs' ranges). α is chosen per layer and KV head from
  :data:`ALPHAS` by the query-weighted 4-bit K error that the logits see,
  E = Σ_tokens Σ_k w_k / s_k² · |e_k|², e = Q(S G y) − S G y, w_k = E|q_pair k|² (the Q moments),
  because the query carries 1/s_k. α = 0 is in the grid, so the fit is never worse than pairwise_only on E.
* ``prerope_channel_scale``: the same scales with α fixed to 1/2 and φ = 0 (SmoothAttention's migration
  strength), a KVQuant-style baseline with no fit of its own.
* ``learned_orthogonal``: M_h = C(B_h)·H_d/√d with the Cayley map C(B) = (I − B)^{-1}(I + B), B = A − Aᵀ,
  fitted by Adam (``steps``, seeded row subsample) on Σ_h mean_tokens range(M_h y)² / mean |y|², the square of
  the quantiser's range, which sets the per-token step; every ``check_every`` steps the 4-bit relative K error
  of each head is measured and the best iterate kept (the Hadamard start included), so the fit is never worse
  than the Hadamard on the sample. A non-finite loss raises :class:`~rope_quant.core.transforms.FitError`
  naming the layer and head.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from rope_quant.core import transforms
from rope_quant.core.hadamard import hadamard_matrix
from rope_quant.core.rope import pair_indices
from rope_quant.core.threads import one_cpu_thread
from rope_quant.quant.quantizers import fake_quant_per_token

__all__ = ["ALPHAS", "SMOOTH_ALPHA", "fit_for", "post_rope", "query_weights", "pair_radius",
           "fit_pair_scales", "fit_pairwise_scaled", "fit_prerope_channel_scale", "fit_learned_orthogonal"]

#: Candidate exponents α of the pair scales s_k = (ρ_k / gm ρ)^{-α}.
ALPHAS = (0.0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)
#: SmoothAttention's migration strength, used by ``prerope_channel_scale``.
SMOOTH_ALPHA = 0.5
#: ``learned_orthogonal`` defaults: Adam steps, learning rate, rows per fit, evaluation period.
ORTHO_STEPS, ORTHO_LR, ORTHO_ROWS, ORTHO_CHECK = 300, 5e-3, 1024, 25


def _bits(ctx: transforms.FitContext) -> int:
    return int(ctx.k_bits) if ctx.k_bits < 16 else 4


def post_rope(rows: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, layout: str) -> torch.Tensor:
    """y = R_m k for sample rows (N, H, d) at positions (N,), as float64 (H, N, d)."""
    x = torch.as_tensor(np.asarray(rows, dtype=np.float64)).transpose(0, 1).contiguous()
    ia, ib = pair_indices(x.shape[-1], layout)
    theta = torch.as_tensor(np.outer(np.asarray(positions, np.float64), np.asarray(inv_freq, np.float64)))
    c, s = torch.cos(theta), torch.sin(theta)
    a, b = x[..., ia], x[..., ib]
    y = torch.empty_like(x)
    y[..., ia] = a * c - b * s
    y[..., ib] = a * s + b * c
    return y


def query_weights(stats: Any, layer: int, n_kv_heads: int) -> np.ndarray:
    """w (H_kv, K): the mean E|q_pair|² of each pair over the Q heads of each GQA group (ones if Q is empty)."""
    try:
        raw = stats.raw_moments("q")
    except Exception:  # no Q stream collected
        return np.ones((n_kv_heads, stats.n_pairs))
    n = float(raw["n"][layer])
    if n <= 0:
        return np.ones((n_kv_heads, stats.n_pairs))
    e2 = (raw["sum_aa"][layer] + raw["sum_bb"][layer]) / n  # (H_q, K)
    w = e2.reshape(n_kv_heads, -1, e2.shape[-1]).mean(axis=1)
    return np.where(np.isfinite(w) & (w > 0), w, 1.0)


def pair_radius(y: torch.Tensor, layout: str) -> torch.Tensor:
    """ρ (H, K): max over tokens of each pair's norm (invariant under RoPE and G(φ))."""
    ia, ib = pair_indices(y.shape[-1], layout)
    return torch.sqrt(y[..., ia] ** 2 + y[..., ib] ** 2).amax(dim=-2)


def _scales(rho: torch.Tensor, alpha: float) -> torch.Tensor:
    live = rho > 0
    logr = torch.where(live, torch.log(rho.clamp_min(1e-300)), torch.zeros_like(rho))
    gm = (logr * live).sum(-1, keepdim=True) / live.sum(-1, keepdim=True).clamp_min(1)
    return torch.where(live, torch.exp(-alpha * (logr - gm)), torch.ones_like(rho))


def _weighted_error(y: torch.Tensor, s: torch.Tensor, w: torch.Tensor, bits: int, layout: str) -> torch.Tensor:
    """Per head: Σ_tokens Σ_k w_k / s_k² |e_k|² with e = Q(S y) − S y (y post-RoPE, post-G), shape (H,)."""
    ia, ib = pair_indices(y.shape[-1], layout)
    full = torch.empty(s.shape[0], y.shape[-1], dtype=y.dtype)
    full[:, ia], full[:, ib] = s, s
    z = y * full[:, None, :]
    e2 = (fake_quant_per_token(z, bits) - z) ** 2
    pair = e2[..., ia] + e2[..., ib]  # (H, N, K)
    return (pair * (w / s**2)[:, None, :]).sum(dim=(-1, -2))


def fit_pair_scales(y: torch.Tensor, w: np.ndarray, bits: int, layout: str,
                    alphas: tuple[float, ...] = ALPHAS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Scales (H, K), chosen α (H,) and the error of every α (len(alphas), H) for post-G keys y (H, N, d)."""
    rho = pair_radius(y, layout)
    wt = torch.as_tensor(w, dtype=y.dtype)
    errs = torch.stack([_weighted_error(y, _scales(rho, a), wt, bits, layout) for a in alphas])
    best = errs.argmin(dim=0)
    alpha = torch.as_tensor(alphas, dtype=y.dtype)[best]
    scales = torch.stack([_scales(rho[h:h + 1], float(alpha[h]))[0] for h in range(rho.shape[0])])
    return scales.numpy(), alpha.numpy(), errs.numpy()


def _samples(ctx: transforms.FitContext, layer: int) -> torch.Tensor:
    """The post-RoPE K sample of ``layer`` (H_kv, N, d); a non-finite head raises FitError naming it."""
    rows, positions = ctx.stats.k_sample(layer)
    bad = ~np.isfinite(rows).all(axis=(0, 2))
    if bad.any():
        raise transforms.FitError(f"the fit of layer {layer} head {int(np.flatnonzero(bad)[0])}: the K sample "
                                  "holds NaN or infinite values")
    return post_rope(rows, positions, ctx.inv_freq[layer], ctx.layout)


def fit_pairwise_scaled(ctx: transforms.FitContext) -> list[dict[str, Any]]:
    """Per layer: the estimated angles (per KV head) and the pair scales of the query-weighted K error."""
    if ctx.angles is None:
        raise transforms.FitError("pairwise_scaled: the fit needs the estimated angles")
    out = []
    for layer in range(ctx.n_layers):
        ang = np.asarray(ctx.angles[layer], dtype=np.float64)
        ang = np.broadcast_to(ang, (ctx.n_kv_heads, ctx.head_dim // 2)).copy()
        y = transforms.build("pairwise_only", ctx.head_dim, angles=ang, layout=ctx.layout).apply(_samples(ctx, layer))
        scales, _, _ = fit_pair_scales(y, query_weights(ctx.stats, layer, ctx.n_kv_heads), _bits(ctx), ctx.layout)
        out.append({"angles": ang, "scales": scales})
    return out


def fit_prerope_channel_scale(ctx: transforms.FitContext) -> list[dict[str, Any]]:
    """Per layer: pair-tied scales s_k = (ρ_k / gm ρ)^{-1/2} per KV head (no angle, no search)."""
    return [{"scales": _scales(pair_radius(_samples(ctx, layer), ctx.layout), SMOOTH_ALPHA).numpy()}
            for layer in range(ctx.n_layers)]


def _range(y: torch.Tensor) -> torch.Tensor:
    lo, hi = torch.aminmax(y, dim=-1) if not y.requires_grad else (y.amin(-1), y.amax(-1))
    return hi.clamp(min=0.0) - lo.clamp(max=0.0)


def _rel_error(y: torch.Tensor, bits: int) -> torch.Tensor:
    """Per head (H,): Σ|Q(y) − y|² / Σ|y|² over tokens."""
    return ((fake_quant_per_token(y, bits) - y) ** 2).sum((-1, -2)) / (y**2).sum((-1, -2)).clamp_min(1e-300)


def fit_learned_orthogonal(ctx: transforms.FitContext) -> list[dict[str, Any]]:
    """Per layer: orthogonal (H_kv, d, d) matrices from the Hadamard start (module docstring)."""
    opts = dict(ctx.options)
    steps, lr = int(opts.get("steps", ORTHO_STEPS)), float(opts.get("lr", ORTHO_LR))
    n_rows, every = int(opts.get("rows", ORTHO_ROWS)), int(opts.get("check_every", ORTHO_CHECK))
    d, bits = ctx.head_dim, _bits(ctx)
    h0 = hadamard_matrix(d).to(torch.float64) / math.sqrt(d)
    eye = torch.eye(d, dtype=torch.float64)
    gen = torch.Generator().manual_seed(int(ctx.seed))
    out = []
    for layer in range(ctx.n_layers):
        y = _samples(ctx, layer)  # (H, N, d)
        if y.shape[1] > n_rows:
            y = y[:, torch.randperm(y.shape[1], generator=gen)[:n_rows]]
        norm2 = (y**2).sum(-1).mean(-1).clamp_min(1e-300)  # (H,)
        a = torch.zeros(y.shape[0], d, d, dtype=torch.float64, requires_grad=True)
        opt = torch.optim.Adam([a], lr=lr)

        def matrices(a: torch.Tensor) -> torch.Tensor:
            b = a - a.transpose(-1, -2)
            with one_cpu_thread(b.device):  # LAPACK's rounding follows the thread count (rope_quant.core.threads)
                return torch.linalg.solve(eye - b, eye + b) @ h0

        with torch.no_grad():
            best_m = matrices(a).detach().clone()
            best_err = _rel_error(y @ best_m.transpose(-1, -2), bits)
        for step in range(1, steps + 1):
            opt.zero_grad()
            m = matrices(a)
            loss_h = (_range(y @ m.transpose(-1, -2)) ** 2).mean(-1) / norm2
            bad = ~torch.isfinite(loss_h)
            if bad.any():
                raise transforms.FitError(f"learned_orthogonal: the fit of layer {layer} head "
                                          f"{int(bad.nonzero()[0])} diverged (non-finite loss at step {step})")
            loss_h.sum().backward()
            opt.step()
            if step % every == 0 or step == steps:
                with torch.no_grad():
                    m = matrices(a)
                    err = _rel_error(y @ m.transpose(-1, -2), bits)
                    better = torch.isfinite(err) & (err < best_err)
                    best_m[better], best_err[better] = m[better], err[better]
        out.append({"matrices": best_m.numpy()})
    return out


def fit_for(name: str, ctx: transforms.FitContext) -> list[dict[str, Any]]:
    """Fit ``name``'s per-layer parameters (its spec's ``fit``: the built-ins name this module's functions),
    checked by :func:`~rope_quant.core.transforms.check_fit` (a non-finite value names the layer and head)."""
    fit = transforms.fit_function(name)
    if fit is None:
        raise transforms.FitError(f"{name}: declares needs_fit but has no fit function")
    params: Any = fit(ctx)
    if isinstance(params, Mapping):
        raise transforms.FitError(f"{name}: a fit returns one parameter dict per layer, got one mapping")
    return transforms.check_fit(name, list(params), ctx.n_layers, ctx.n_kv_heads)

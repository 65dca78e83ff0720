"""Frozen reference: the range-objective fit exactly as rope_quant.calib.objectives had it at commit 0a3b657
(float32 prefilter + float64 re-scoring, per-layer loops, rest-of-head extremes by gather + aminmax). The fast
path (tests/numerics/test_range_fastpath.py) is compared against it; do not optimise this file."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from rope_quant.calib.objectives import (
    RANGE_GRID_SIZE,
    RANGE_REFINE,
    RANGE_SWEEPS,
    AngleEstimationError,
    RangeFit,
    group_range,
)
from rope_quant.core.rope import check_frequencies, pair_indices


def reference_fit_range_angles(
    rows: Any, positions: Any, inv_freq: Any, *, per_head: bool = False, then_hadamard: bool = False,
    layout: str = "rotate_half", grid_size: int = RANGE_GRID_SIZE, refine: int = RANGE_REFINE,
    sweeps: int = RANGE_SWEEPS, init: Any = None, exact: bool = False,
) -> RangeFit:
    """Coordinate descent on the range objective (module docstring) for one layer.

    ``rows``: pre-RoPE keys (N, H_kv, d); ``positions``: (N,) RoPE positions. Each pair step scores the
    current angle first, so the objective never increases (ties keep the current angle).

    Every candidate angle is scored in float64 when ``exact``; by default (same choices, much faster) the
    candidates are first scored in float32 on the (token, head) entries whose range can depend on the pair
    (an entry whose rest-of-class extremes dominate the pair's norm contributes a constant), and only the
    candidates within a margin of the best (1e-5 of the movable entries' sum, ~80× their float32 error
    bound, plus 1e-12 of the score) are re-scored in float64 exactly as with ``exact``. The choice can
    differ only if the float32 error exceeds that margin; tests/numerics/test_range_fast.py
    checks the angles against ``exact=True`` to 1e-6 rad.
    """
    x = torch.as_tensor(np.asarray(rows, dtype=np.float64))
    if x.ndim != 3 or x.shape[0] == 0:
        raise AngleEstimationError(f"range objective: rows must be (N > 0, H_kv, head_dim), got {tuple(x.shape)}")
    n_tok, n_heads, d = x.shape
    freqs = check_frequencies(inv_freq)
    ia, ib = pair_indices(d, layout)
    if freqs.size != ia.size:
        raise AngleEstimationError(f"inv_freq has {freqs.size} frequencies, head_dim {d} has {ia.size} pairs")
    pos = torch.as_tensor(np.asarray(positions, dtype=np.float64))
    if pos.shape != (n_tok,):
        raise AngleEstimationError(f"positions must have shape ({n_tok},), got {tuple(pos.shape)}")
    if int(grid_size) != grid_size or grid_size < 4 or refine < 0 or sweeps < 1:
        raise AngleEstimationError("range objective needs grid_size >= 4, refine >= 0, sweeps >= 1")
    n_pairs = ia.size
    rows_ = n_heads if per_head else 1
    phi = torch.zeros(rows_, n_pairs, dtype=torch.float64)
    if init is not None:
        start = np.asarray(init, dtype=np.float64)
        if start.shape not in ((n_pairs,), (rows_, n_pairs)) or not np.all(np.isfinite(start)):
            raise AngleEstimationError(f"init must be finite with shape ({n_pairs},) or ({rows_}, {n_pairs}), "
                                       f"got {start.shape}")
        phi += torch.as_tensor(start)
    psi = pos[:, None] * torch.as_tensor(freqs)[None, :]  # (N, K) RoPE phases m·θ_k
    a, b = x[..., ia], x[..., ib]  # (N, H, K)
    mix = torch.eye(d, dtype=torch.float64)  # what follows the pair rotations: I, or the Hadamard
    if then_hadamard:
        from rope_quant.core import hadamard as _hd

        mix = _hd.hadamard_matrix(d).to(torch.float64) / math.sqrt(d)

    def pair_out(p: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Both outputs of pair k for angles p (C, rows_) -> (C, N, H)."""
        ang = p[:, None, :] + psi[None, :, k, None]  # (C, N, rows_)
        c, s = torch.cos(ang), torch.sin(ang)
        return c * a[None, :, :, k] - s * b[None, :, :, k], s * a[None, :, :, k] + c * b[None, :, :, k]

    def full(p: torch.Tensor) -> torch.Tensor:
        """y = M R_m k for all tokens (N, H, d) at angles p (rows_, K)."""
        ang = p[None, :, :] + psi[:, None, :]  # (N, rows_, K)
        c, s = torch.cos(ang), torch.sin(ang)
        y = torch.empty_like(x)
        y[..., ia], y[..., ib] = c * a - s * b, s * a + c * b
        return y @ mix.T

    step = 2 * math.pi / grid_size
    grid = torch.arange(grid_size, dtype=torch.float64) * step - math.pi + step
    fine = torch.linspace(-step, step, refine + 2, dtype=torch.float64)[1:-1] if refine else None
    y = full(phi)  # the quantised keys M·R_m·k (after the Hadamard when then_hadamard)
    trace = [float(group_range(y).mean())]
    if exact:
        select = _best_candidate
    else:
        # float32 prefilter on the RoPE'd pairs (A, B) = R(ψ)(a, b), so pair k's outputs are G(φ)(A, B)
        cpsi, spsi = torch.cos(psi)[:, None, :], torch.sin(psi)[:, None, :]
        rope_a, rope_b = a * cpsi - b * spsi, a * spsi + b * cpsi  # (N, H, K) float64
        ab32 = torch.stack([rope_a, rope_b]).to(torch.float32)  # (2, N, H, K)
        rho = torch.hypot(rope_a, rope_b)
        heads = list(range(n_heads)) if per_head else [None]
    identity = not then_hadamard
    if identity:
        keep = np.ones(d, dtype=bool)
        rest_idx = []
        for k in range(n_pairs):
            keep[:] = True
            keep[[ia[k], ib[k]]] = False
            rest_idx.append(torch.as_tensor(np.flatnonzero(keep)))
        unit = torch.tensor([[0.0, 0.0], [0.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    for _ in range(int(sweeps)):
        for k in range(n_pairs):
            # y = y_rest + u1·mix[:, a_k] + u2·mix[:, b_k]; channels sharing a coefficient pair form a class
            cols = mix[:, [ia[k], ib[k]]]  # (d, 2)
            old1, old2 = pair_out(phi[None, :, k], k)
            if identity and not exact:
                # Only the pair's two channels hold a non-zero coefficient: the same classes and y as below,
                # without touching the other d - 2 channels (their y_rest is y minus ±0).
                r0a, r0b = y[..., ia[k]] - old1[0], y[..., ib[k]] - old2[0]
                classes = [(unit[1], r0b, r0b), (unit[2], r0a, r0a)]
                if d > 2:
                    rest_lo, rest_hi = torch.aminmax(y.index_select(-1, rest_idx[k]), dim=-1)
                    classes.insert(0, (unit[0], rest_hi, rest_lo))
            else:
                y_rest = y - old1[0, ..., None] * cols[:, 0] - old2[0, ..., None] * cols[:, 1]
                coef, which = torch.unique(cols, dim=0, return_inverse=True)
                classes = [(coef[j], y_rest[..., which == j].amax(-1), y_rest[..., which == j].amin(-1))
                           for j in range(coef.shape[0])]
            if not exact:
                def select(c, u1, u2, classes_, per_head_, _k=k):
                    return _prefiltered_best(c, _k, classes_, per_head_, ab32[..., _k], rho[..., _k], heads,
                                             lambda cc: pair_out(cc, _k))
            current = phi[:, k]
            cands = torch.cat([current[None, :], grid[:, None].expand(-1, rows_)])
            best = select(cands, *((None, None) if not exact else pair_out(cands, k)), classes, per_head)
            if fine is not None:
                cands = torch.cat([best[None, :], best[None, :] + fine[:, None]])
                best = select(cands, *((None, None) if not exact else pair_out(cands, k)), classes, per_head)
            phi[:, k] = best
            u1, u2 = pair_out(best[None, :], k)
            if identity and not exact:
                y[..., ia[k]] = r0a + u1[0]
                y[..., ib[k]] = r0b + u2[0]
            else:
                y = y_rest + u1[0, ..., None] * cols[:, 0] + u2[0, ..., None] * cols[:, 1]
        y = full(phi)
        trace.append(float(group_range(y).mean()))
    wrapped = torch.remainder(phi + math.pi, 2 * math.pi) - math.pi
    wrapped = torch.where(wrapped == -math.pi, torch.full_like(wrapped, math.pi), wrapped)
    out = wrapped.numpy()
    return RangeFit(out if per_head else out[0], trace)


_PREFILTER_MARGIN = 1e-5


def _prefiltered_best(cands: torch.Tensor, k: int, classes: list, per_head: bool, ab: torch.Tensor,
                      rho: torch.Tensor, heads: list[list[int]], pair_out: Any) -> torch.Tensor:
    """:func:`_best_candidate` of ``cands`` (C, rows) via a float32 prefilter (see :func:`fit_range_angles`).

    ``ab`` (2, N, H) float32: pair k after RoPE; ``rho`` (N, H) float64: its norm; ``heads``: the head of
    each row of ``cands`` (None: every head); ``pair_out(c)``: the float64 outputs (C', N, rows) of ``c``.
    """
    best = cands[0].clone()
    cos, sin = torch.cos(cands).to(torch.float32), torch.sin(cands).to(torch.float32)
    for row, head in enumerate(heads):
        def sub(t: torch.Tensor, head: int | None = head) -> torch.Tensor:
            """The (token[, head]) entries of this row, flattened."""
            return t.reshape(-1) if head is None else t[:, head]

        r = sub(rho) * (1 + _PREFILTER_MARGIN)
        const_hi = torch.zeros_like(r)
        const_lo = torch.zeros_like(r)
        moving = []
        for c, cmax, cmin in classes:
            norm = float(torch.hypot(c[0], c[1]))
            if norm == 0.0:
                const_hi = torch.maximum(const_hi, sub(cmax))
                const_lo = torch.minimum(const_lo, sub(cmin))
            else:
                moving.append((c, sub(cmax), sub(cmin), norm))
        active = torch.zeros_like(r, dtype=torch.bool)
        for _, cmax, cmin, norm in moving:
            active |= (cmax + norm * r > const_hi) | (cmin - norm * r < const_lo)
        const = float((const_hi - const_lo)[~active].sum())
        idx = active.nonzero()[:, 0]
        if not idx.numel():  # no entry can move: every candidate scores the same, the first one is kept
            continue
        sums = torch.full((cands.shape[0],), const, dtype=torch.float64)
        if idx.numel():
            a_, b_ = (sub(ab[i]).index_select(0, idx) for i in range(2))
            cs, sn = cos[:, row][:, None], sin[:, row][:, None]
            u1, u2 = cs * a_ - sn * b_, sn * a_ + cs * b_  # (C, n_active)
            hi = const_hi.index_select(0, idx).to(torch.float32).expand_as(u1)
            lo = const_lo.index_select(0, idx).to(torch.float32).expand_as(u1)
            for c, cmax, cmin, _ in moving:
                shift = float(c[0]) * u1 + float(c[1]) * u2
                hi = torch.maximum(hi, cmax.index_select(0, idx).to(torch.float32) + shift)
                lo = torch.minimum(lo, cmin.index_select(0, idx).to(torch.float32) + shift)
            moved = (hi - lo).sum(dim=1, dtype=torch.float64)  # each term's float32 error is ~eps·its size
            sums += moved
        low = float(sums.min())
        margin = _PREFILTER_MARGIN * float(moved.max()) + 1e-12 * abs(low) + 1e-300
        near = (sums <= low + margin).nonzero()[:, 0]
        c_near = cands.index_select(0, near)
        if near.numel() == 1 or bool((c_near[:, row] == c_near[0, row]).all()):  # equal angles: equal scores
            best[row] = c_near[0, row]
            continue
        best[row] = _best_candidate(c_near, *pair_out(c_near), classes, per_head)[row]
    return best


def _best_candidate(cands: torch.Tensor, u1: torch.Tensor, u2: torch.Tensor, classes: list,
                    per_head: bool) -> torch.Tensor:
    """The candidate angle (C, rows) with the least mean range; ties keep the first (the current angle).

    ``u1, u2`` (C, N, H): the pair's outputs per candidate; ``classes``: (coefficients (2,), max, min
    of the rest of the channel class (N, H)), so a class's extreme is max + c1·u1 + c2·u2.
    """
    hi = lo = None
    for c, cmax, cmin in classes:
        shift = c[0] * u1 + c[1] * u2
        hi = cmax + shift if hi is None else torch.maximum(hi, cmax + shift)
        lo = cmin + shift if lo is None else torch.minimum(lo, cmin + shift)
    r = hi.clamp(min=0.0) - lo.clamp(max=0.0)
    score = r.mean(dim=1) if per_head else r.mean(dim=(1, 2))[:, None]
    return cands.gather(0, score.argmin(0, keepdim=True))[0]

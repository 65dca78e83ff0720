"""The fast coordinate descent behind :func:`rope_quant.calib.objectives.fit_range_angles` (§6's range objective).

Same candidates, the same float64 scores and therefore the same angles as the all-float64 descent
(``exact=True``); only the bookkeeping around those scores is cheaper:

- the rest-of-head extremes of pair k (``pairwise_only``) come from prefix/suffix maxima of the per-pair
  extremes (max is exact, so they equal the gather + ``aminmax`` over the other d − 2 channels bit for bit);
- with the Hadamard, the class structure of every pair is built once and each class's extremes come from one
  gather that makes the classes contiguous (instead of a boolean-mask copy per class and extreme);
- the float32 prefilter gathers the movable (token, head) entries once per step and scores every candidate
  on them; only the candidates within its margin (1e-5 of the movable entries' sum, ~80× their float32 error
  bound) are re-scored in float64 on every entry, with :func:`best_candidate` exactly as the exact descent does.

The choice can differ from ``exact=True`` only if the float32 error exceeds that margin;
tests/numerics/test_range_fastpath.py checks it against the frozen previous implementation and ``exact=True``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

PREFILTER_MARGIN = 1e-5


def best_candidate(cands: torch.Tensor, u1: torch.Tensor, u2: torch.Tensor, classes: list,
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


class _ClassLayout:
    """Pair k's channel classes under the mix M: the distinct rows (c1, c2) of M[:, (a_k, b_k)] and a
    channel permutation that makes each class contiguous (``equal``: all classes the same size)."""

    def __init__(self, cols: torch.Tensor) -> None:
        self.cols = cols
        self.coef, which = torch.unique(cols, dim=0, return_inverse=True)
        self.which = which
        counts = torch.bincount(which, minlength=self.coef.shape[0])
        self.equal = bool((counts == counts[0]).all())
        self.perm = torch.argsort(which, stable=True)
        self.size = int(counts[0])


def descend(x: torch.Tensor, psi: torch.Tensor, phi: torch.Tensor, ia: np.ndarray, ib: np.ndarray,
            mix: torch.Tensor | None, grid: torch.Tensor, fine: torch.Tensor | None, sweeps: int,
            per_head: bool, score) -> list[float]:
    """Coordinate descent of one layer in place on ``phi`` (rows, K); returns the trace of ``score(y)``
    (the objective at the start and after every sweep).

    ``x`` (N, H, d) float64 pre-RoPE keys, ``psi`` (N, K) RoPE phases, ``mix``: the Hadamard (d, d) or None
    for the identity. Each sweep starts from y recomputed by the caller's formula (``_full``).
    """
    n_tok, n_heads, d = x.shape
    n_pairs = ia.size
    rows_ = phi.shape[0]
    a, b = x[..., ia], x[..., ib]
    a_k = [a[..., k] for k in range(n_pairs)]
    b_k = [b[..., k] for k in range(n_pairs)]
    psi_k = [psi[:, k, None] for k in range(n_pairs)]

    def pair_out(p: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Both outputs of pair k for angles p (C, rows_) -> (C, N, H) (the exact descent's formula)."""
        ang = p[:, None, :] + psi_k[k][None]
        c, s = torch.cos(ang), torch.sin(ang)
        return c * a_k[k][None] - s * b_k[k][None], s * a_k[k][None] + c * b_k[k][None]

    cpsi, spsi = torch.cos(psi)[:, None, :], torch.sin(psi)[:, None, :]
    rope_a, rope_b = a * cpsi - b * spsi, a * spsi + b * cpsi  # (N, H, K) float64
    ab32 = torch.stack([rope_a, rope_b]).to(torch.float32)  # (2, N, H, K)
    rho = torch.hypot(rope_a, rope_b)
    identity = mix is None
    unit = torch.tensor([[0.0, 0.0], [0.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    layouts = None if identity else [_ClassLayout(mix[:, [ia[k], ib[k]]]) for k in range(n_pairs)]
    heads = list(range(n_heads)) if per_head else [None]
    y = _full(x, phi, psi, ia, ib, mix)
    trace = [score(y)]
    for _ in range(int(sweeps)):
        if identity and d > 2:
            ya, yb = y[..., ia], y[..., ib]
            suf_hi = torch.maximum(ya, yb).flip(-1).cummax(-1).values.flip(-1)
            suf_lo = torch.minimum(ya, yb).flip(-1).cummin(-1).values.flip(-1)
            pre_hi = pre_lo = None
        for k in range(n_pairs):
            old1, old2 = pair_out(phi[None, :, k], k)
            if identity:
                r0a, r0b = y[..., ia[k]] - old1[0], y[..., ib[k]] - old2[0]
                classes = [(unit[1], r0b, r0b), (unit[2], r0a, r0a)]
                if d > 2:
                    his = [t for t in (pre_hi, suf_hi[..., k + 1] if k + 1 < n_pairs else None) if t is not None]
                    los = [t for t in (pre_lo, suf_lo[..., k + 1] if k + 1 < n_pairs else None) if t is not None]
                    rest_hi = his[0] if len(his) == 1 else torch.maximum(*his)
                    rest_lo = los[0] if len(los) == 1 else torch.minimum(*los)
                    classes.insert(0, (unit[0], rest_hi, rest_lo))
            else:
                lay = layouts[k]
                cols = lay.cols
                t1, t2 = old1[0, ..., None] * cols[:, 0], old2[0, ..., None] * cols[:, 1]
                y_rest = y - t1 - t2
                if lay.equal:  # classes contiguous after one gather (max/min are exact: the same extremes)
                    g = y_rest.index_select(-1, lay.perm).view(n_tok, n_heads, lay.coef.shape[0], lay.size)
                    gmin, gmax = torch.aminmax(g, dim=-1)
                    classes = [(lay.coef[j], gmax[..., j], gmin[..., j]) for j in range(lay.coef.shape[0])]
                else:
                    classes = [(lay.coef[j], y_rest[..., lay.which == j].amax(-1),
                                y_rest[..., lay.which == j].amin(-1)) for j in range(lay.coef.shape[0])]
            current = phi[:, k]
            cands = torch.cat([current[None, :], grid[:, None].expand(-1, rows_)])
            best = _prefiltered_best(cands, classes, per_head, ab32[..., k], rho[..., k], heads,
                                     lambda cc, _k=k: pair_out(cc, _k))
            if fine is not None:
                cands = torch.cat([best[None, :], best[None, :] + fine[:, None]])
                best = _prefiltered_best(cands, classes, per_head, ab32[..., k], rho[..., k], heads,
                                         lambda cc, _k=k: pair_out(cc, _k))
            phi[:, k] = best
            u1, u2 = pair_out(best[None, :], k)
            if identity:
                y[..., ia[k]] = r0a + u1[0]
                y[..., ib[k]] = r0b + u2[0]
                if d > 2:
                    new_hi, new_lo = torch.maximum(y[..., ia[k]], y[..., ib[k]]), torch.minimum(y[..., ia[k]],
                                                                                               y[..., ib[k]])
                    pre_hi = new_hi if pre_hi is None else torch.maximum(pre_hi, new_hi)
                    pre_lo = new_lo if pre_lo is None else torch.minimum(pre_lo, new_lo)
            else:
                y = y_rest + u1[0, ..., None] * cols[:, 0] + u2[0, ..., None] * cols[:, 1]
        y = _full(x, phi, psi, ia, ib, mix)
        trace.append(score(y))
    return trace


def _full(x: torch.Tensor, p: torch.Tensor, psi: torch.Tensor, ia: np.ndarray, ib: np.ndarray,
          mix: torch.Tensor | None) -> torch.Tensor:
    """y = M R_m k for all tokens (N, H, d) at angles p (rows, K): the exact descent's formula."""
    a, b = x[..., ia], x[..., ib]
    ang = p[None, :, :] + psi[:, None, :]  # (N, rows, K)
    c, s = torch.cos(ang), torch.sin(ang)
    y = torch.empty_like(x)
    y[..., ia], y[..., ib] = c * a - s * b, s * a + c * b
    if mix is None:
        return y
    return y @ mix.T


def _prefiltered_best(cands: torch.Tensor, classes: list, per_head: bool, ab: torch.Tensor, rho: torch.Tensor,
                      heads: list, pair_out) -> torch.Tensor:
    """:func:`best_candidate` of ``cands`` (C, rows) via the float32 prefilter (module docstring).

    ``ab`` (2, N, H) float32: the pair after RoPE; ``rho`` (N, H) float64: its norm; ``heads``: the head of
    each row of ``cands`` (None: every head); ``pair_out(c)``: the float64 outputs (C', N, rows) of ``c``.
    """
    best = cands[0].clone()
    cos, sin = torch.cos(cands).to(torch.float32), torch.sin(cands).to(torch.float32)
    fixed = [(cmax, cmin) for c, cmax, cmin in classes if float(torch.hypot(c[0], c[1])) == 0.0]
    moving = [(c, cmax, cmin, float(torch.hypot(c[0], c[1]))) for c, cmax, cmin in classes
              if float(torch.hypot(c[0], c[1])) != 0.0]
    zero = torch.zeros_like(rho)
    const_hi, const_lo = zero, zero
    for cmax, cmin in fixed:
        const_hi = torch.maximum(const_hi, cmax)
        const_lo = torch.minimum(const_lo, cmin)
    r = rho * (1 + PREFILTER_MARGIN)
    active = torch.zeros_like(rho, dtype=torch.bool)
    for _, cmax, cmin, norm in moving:
        active |= (cmax + norm * r > const_hi) | (cmin - norm * r < const_lo)
    width = const_hi - const_lo
    # every per-entry quantity the float32 scores need, gathered once per row
    parts = [ab[0], ab[1], const_hi, const_lo] + [t for _, cmax, cmin, _ in moving for t in (cmax, cmin)]
    table = torch.stack([t.to(torch.float32) for t in parts])  # (P, N, H) float32
    for row, head in enumerate(heads):
        act = active.reshape(-1) if head is None else active[:, head]
        idx = act.nonzero()[:, 0]
        if not idx.numel():  # no entry can move: every candidate scores the same, the first one is kept
            continue
        w = width.reshape(-1) if head is None else width[:, head]
        const = float(w[~act].sum())
        sub = (table.reshape(table.shape[0], -1) if head is None else table[:, :, head]).index_select(1, idx)
        a_, b_ = sub[0], sub[1]
        cs, sn = cos[:, row][:, None], sin[:, row][:, None]
        u1, u2 = cs * a_ - sn * b_, sn * a_ + cs * b_  # (C, n_active)
        hi = lo = None
        for j, (c, _, _, _) in enumerate(moving):
            c0, c1 = float(c[0]), float(c[1])
            if c1 == 0.0:
                shift = u1 if c0 == 1.0 else c0 * u1
            elif c0 == 0.0:
                shift = u2 if c1 == 1.0 else c1 * u2
            else:
                shift = c0 * u1 + c1 * u2
            h_, l_ = sub[4 + 2 * j] + shift, sub[5 + 2 * j] + shift
            hi = torch.maximum(sub[2], h_) if hi is None else torch.maximum(hi, h_)
            lo = torch.minimum(sub[3], l_) if lo is None else torch.minimum(lo, l_)
        moved = (hi - lo).sum(dim=1, dtype=torch.float64)  # each term's float32 error is ~eps·its size
        sums = moved + const
        low = float(sums.min())
        margin = PREFILTER_MARGIN * float(moved.max()) + 1e-12 * abs(low) + 1e-300
        near = (sums <= low + margin).nonzero()[:, 0]
        c_near = cands.index_select(0, near)
        if near.numel() == 1 or bool((c_near[:, row] == c_near[0, row]).all()):  # equal angles: equal scores
            best[row] = c_near[0, row]
            continue
        best[row] = best_candidate(c_near, *pair_out(c_near), classes, per_head)[row]
    return best


def wrap(phi: torch.Tensor) -> torch.Tensor:
    """Angles to (-π, π] (as the exact descent reports them)."""
    wrapped = torch.remainder(phi + math.pi, 2 * math.pi) - math.pi
    return torch.where(wrapped == -math.pi, torch.full_like(wrapped, math.pi), wrapped)

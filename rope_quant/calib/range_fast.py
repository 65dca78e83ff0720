"""The fast coordinate descent behind :func:`rope_quant.calib.objectives.fit_range_angles` (§6's range objective).

Same candidates, the same float64 scores and therefore the same angles as the all-float64 descent
(``exact=True``); only the bookkeeping around those scores is cheaper, and a batch of layers shares every
tensor operation (the layers stay independent):

- keys, RoPE phases and (``pairwise_only``) the pair channels of y are stored pair-major, so a pair step reads
  and writes contiguous (L, N, H) blocks;
- the rest-of-head extremes of pair k (``pairwise_only``) come from prefix/suffix maxima of the per-pair
  extremes (max is exact, so they equal the gather + ``aminmax`` over the other d − 2 channels bit for bit);
- with the Hadamard, the class structure of every pair is built once and each class's extremes come from one
  gather that makes the classes contiguous (instead of a boolean-mask copy per class and extreme);
- the float32 prefilter scores every candidate on the movable (token, head) entries of all layers, kept ragged
  on one axis; offsets shared by the layers (the grid, the refinement around each layer's best) are one row of
  cosines; per-layer sums come from one float64 running sum. Only the candidates within its margin (1e-5 of
  the movable entries' sum, ~80× their float32 error bound) are re-scored in float64: each movable entry's
  range by the exact descent's formula, every other entry's range filled in as its constant width (the value
  the exact descent computes for it), then the exact descent's per-candidate mean, so scores and ties agree
  bit for bit.

The choice can differ from ``exact=True`` only if the float32 error exceeds that margin;
tests/numerics/test_range_fastpath.py checks it against the frozen previous implementation and ``exact=True``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

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
            per_head: bool, score: Callable[[torch.Tensor], float]) -> list[list[float]]:
    """Coordinate descent of L layers at once, in place on ``phi`` (L, rows, K); returns each layer's trace of
    ``score(y)`` (the objective at the start and after every sweep).

    ``x`` (L, N, H, d) float64 pre-RoPE keys, ``psi`` (L, N, K) RoPE phases, ``mix``: the Hadamard (d, d) or
    None for the identity. Each sweep starts from y = M R_m k recomputed at the current angles, as the exact
    descent does; the layers are independent, batched only to share every tensor operation.
    """
    n_layers, n_tok, n_heads, d = x.shape
    n_pairs = ia.size
    rows_ = phi.shape[1]
    # pair-major copies (K, L, N, H): pair k's channels and phases are contiguous
    a_pm = x.index_select(-1, torch.as_tensor(ia)).permute(3, 0, 1, 2).contiguous()
    b_pm = x.index_select(-1, torch.as_tensor(ib)).permute(3, 0, 1, 2).contiguous()
    psi_pm = psi.permute(2, 0, 1)[..., None].contiguous()  # (K, L, N, 1)
    a_k, b_k, psi_k = list(a_pm), list(b_pm), list(psi_pm)

    def pair_out(p: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Both outputs of pair k for angles p (L, C, rows) -> (L, C, N, H), with the exact descent's formula."""
        ang = p[:, :, None, :] + psi_k[k][:, None]
        c, s = torch.cos(ang), torch.sin(ang)
        ak, bk = a_k[k][:, None], b_k[k][:, None]
        return c * ak - s * bk, s * ak + c * bk

    cpsi, spsi = torch.cos(psi_pm), torch.sin(psi_pm)
    rope_a, rope_b = a_pm * cpsi - b_pm * spsi, a_pm * spsi + b_pm * cpsi  # (K, L, N, H) float64
    ab32 = torch.stack([rope_a, rope_b], dim=1).to(torch.float32)  # (K, 2, L, N, H)
    rho = torch.hypot(rope_a, rope_b)
    identity = mix is None
    unit = torch.tensor([[0.0, 0.0], [0.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    layouts = None if identity else [_ClassLayout(mix[:, [ia[k], ib[k]]]) for k in range(n_pairs)]
    heads = list(range(n_heads)) if per_head else [None]
    order = torch.as_tensor(np.argsort(np.concatenate([ia, ib])))  # [a-channels, b-channels] -> channels

    def full(p: torch.Tensor) -> tuple:
        """y = M R_m k at angles p (L, rows, K), as the exact descent's formula: (y (L, N, H, d), with the
        channels in the order [a_k.., b_k..] for the identity (the range does not depend on it), and the
        per-pair lists of the a and b channels (L, N, H) for the identity)."""
        ang = p.permute(2, 0, 1)[:, :, None, :] + psi_pm  # (K, L, N, rows)
        c, s = torch.cos(ang), torch.sin(ang)
        ya, yb = c * a_pm - s * b_pm, s * a_pm + c * b_pm  # (K, L, N, H)
        y = torch.cat([ya, yb]).permute(1, 2, 3, 0)
        if not identity:
            return y.index_select(-1, order) @ mix.T, None, None
        return y, list(ya), list(yb)

    y, ya_k, yb_k = full(phi)
    traces = [[score(y[layer])] for layer in range(n_layers)]
    for _ in range(int(sweeps)):
        if identity and d > 2:
            # suf_hi[k] = max over the channels of pairs k.. (max is exact: the same as aminmax over them)
            suf_hi, suf_lo = [None] * (n_pairs + 1), [None] * (n_pairs + 1)
            for j in range(n_pairs - 1, 0, -1):
                hj, lj = torch.maximum(ya_k[j], yb_k[j]), torch.minimum(ya_k[j], yb_k[j])
                suf_hi[j] = hj if suf_hi[j + 1] is None else torch.maximum(suf_hi[j + 1], hj)
                suf_lo[j] = lj if suf_lo[j + 1] is None else torch.minimum(suf_lo[j + 1], lj)
            pre_hi = pre_lo = None
        for k in range(n_pairs):
            old1, old2 = pair_out(phi[:, None, :, k], k)
            old1, old2 = old1[:, 0], old2[:, 0]  # (L, N, H)
            if identity:
                r0a, r0b = ya_k[k] - old1, yb_k[k] - old2
                classes = [(unit[1], r0b, r0b), (unit[2], r0a, r0a)]
                if d > 2:
                    his = [t for t in (pre_hi, suf_hi[k + 1]) if t is not None]
                    los = [t for t in (pre_lo, suf_lo[k + 1]) if t is not None]
                    rest_hi = his[0] if len(his) == 1 else torch.maximum(*his)
                    rest_lo = los[0] if len(los) == 1 else torch.minimum(*los)
                    classes.insert(0, (unit[0], rest_hi, rest_lo))
            else:
                lay = layouts[k]
                cols = lay.cols
                y_rest = y - old1[..., None] * cols[:, 0] - old2[..., None] * cols[:, 1]
                if lay.equal:  # classes contiguous after one gather (max/min are exact: the same extremes)
                    g = y_rest.index_select(-1, lay.perm).view(*y.shape[:-1], lay.coef.shape[0], lay.size)
                    gmin, gmax = torch.aminmax(g, dim=-1)
                    classes = [(lay.coef[j], gmax[..., j], gmin[..., j]) for j in range(lay.coef.shape[0])]
                else:
                    classes = [(lay.coef[j], y_rest[..., lay.which == j].amax(-1),
                                y_rest[..., lay.which == j].amin(-1)) for j in range(lay.coef.shape[0])]
            prep = _Prefilter(classes, ab32[k], rho[k], heads, a_k[k], b_k[k], psi_k[k])
            current = phi[:, :, k]
            cands = torch.cat([current[:, None, :], grid[None, :, None].expand(n_layers, -1, rows_)], dim=1)
            best = prep.best(cands, quarters=grid.numel())
            if fine is not None:
                cands = torch.cat([best[:, None, :], best[:, None, :] + fine[None, :, None]], dim=1)
                best = prep.best(cands, base=best)
            phi[:, :, k] = best
            u1, u2 = pair_out(best[:, None, :], k)
            if identity:
                ya_k[k], yb_k[k] = r0a + u1[:, 0], r0b + u2[:, 0]
                if d > 2:
                    ua, ub = ya_k[k], yb_k[k]
                    new_hi, new_lo = torch.maximum(ua, ub), torch.minimum(ua, ub)
                    pre_hi = new_hi if pre_hi is None else torch.maximum(pre_hi, new_hi)
                    pre_lo = new_lo if pre_lo is None else torch.minimum(pre_lo, new_lo)
            else:
                y = y_rest + u1[:, 0, ..., None] * cols[:, 0] + u2[:, 0, ..., None] * cols[:, 1]
        y, ya_k, yb_k = full(phi)
        for layer in range(n_layers):
            traces[layer].append(score(y[layer]))
    return traces


class _Prefilter:
    """The float32 prefilter of one pair step for all layers at once (module docstring): which (token, head)
    entries can move, their float32 table, and the float64 re-scoring of the near candidates on them.

    The entries of all layers are kept ragged (one flat axis with a layer index), so every operation covers
    every layer without padding."""

    def __init__(self, classes: list, ab: torch.Tensor, rho: torch.Tensor, heads: list, a_k: torch.Tensor,
                 b_k: torch.Tensor, psi_k: torch.Tensor) -> None:
        self.classes, self.heads = classes, heads
        self.a_k, self.b_k, self.psi_k = a_k, b_k, psi_k  # (L, N, H), (L, N, H), (L, N, 1) float64
        norms = [float(torch.hypot(c[0], c[1])) for c, _, _ in classes]
        self.moving = [(float(c[0]), float(c[1])) for (c, _, _), n in zip(classes, norms, strict=True) if n != 0.0]
        const_hi = const_lo = torch.zeros_like(rho)
        for (_, cmax, cmin), n in zip(classes, norms, strict=True):
            if n == 0.0:
                const_hi, const_lo = torch.maximum(const_hi, cmax), torch.minimum(const_lo, cmin)
        r = rho * (1 + PREFILTER_MARGIN)
        active = None
        for (_, cmax, cmin), n in zip(classes, norms, strict=True):
            if n != 0.0:
                nr = r if n == 1.0 else n * r
                up = (cmax + nr > const_hi) if cmax.any() else (nr > const_hi)
                down = (cmin - nr < const_lo) if cmin.any() else (nr > -const_lo)
                up |= down
                active = up if active is None else active.logical_or_(up)
        if active is None:  # no class moves with the pair
            active = torch.zeros_like(rho, dtype=torch.bool)
        self.active, self.width = active, const_hi.clamp(min=0.0) - const_lo.clamp(max=0.0)
        # a class of one channel (pairwise_only: the pair's own two channels) has max = min, usually exactly 0
        self.same_extremes = [cmax is cmin for (_, cmax, cmin), n in zip(classes, norms, strict=True) if n != 0.0]
        self.zero_extremes = [bool(same) and not bool(cmax.any())
                              for same, (_, cmax, _) in zip(self.same_extremes,
                                                            [cl for cl, n in zip(classes, norms, strict=True)
                                                             if n != 0.0], strict=True)]
        self.pair_only = (sorted(self.moving) == [(0.0, 1.0), (1.0, 0.0)]
                          and all(self.same_extremes) and all(self.zero_extremes))
        # every moving class (±h, ±h) with both signs of c0·c1 present: the Hadamard's structure
        mags = {abs(c) for cc in self.moving for c in cc}
        self.hadamard_like = (next(iter(mags)) if len(mags) == 1 and 0.0 not in mags
                              and {c0 * c1 > 0 for c0, c1 in self.moving} == {True, False} else 0.0)
        parts = [ab[0], ab[1], const_hi, const_lo]
        parts += [t for (_, cmax, cmin), n in zip(classes, norms, strict=True) if n != 0.0 for t in (cmax, cmin)]
        self.parts = parts  # (L, N, H) each: gathered on the movable entries, then cast to float32
        self._entries: dict = {}

    def _flat(self, head: int | None) -> tuple:
        """The movable entries of every layer for one row (head None: all heads): flat indices into (L, N, H),
        their layer, token and head, and their float32 table (P, A)."""
        if head not in self._entries:
            n_layers, n_tok, n_heads = self.active.shape
            act = self.active if head is None else self.active[:, :, head:head + 1]
            nz = act.nonzero()  # (A, 3): layer, token, head (row-major: each layer's entries in order)
            layer, tok, hd = nz[:, 0], nz[:, 1], nz[:, 2] + (0 if head is None else head)
            flat = (layer * n_tok + tok) * n_heads + hd
            sub = torch.stack([t.reshape(-1).index_select(0, flat) for t in self.parts]).to(torch.float32)
            ends = torch.bincount(layer, minlength=n_layers).cumsum(0)  # each layer's entries end here
            self._entries[head] = (flat, layer, tok, sub, ends)
        return self._entries[head]

    def best(self, cands: torch.Tensor, base: torch.Tensor | None = None, quarters: int = 0) -> torch.Tensor:
        """The candidate (L, C, rows) with the least mean range per layer and row; ties keep the first.

        ``base`` (L, rows): for the float32 scores the entries are first turned by it, and the candidates taken
        relative to it, so that offsets shared by every layer (the grid; the refinement around the best) are
        one row of cosines for all entries. ``quarters``: the candidates after the first are the grid of that
        size (a multiple of 4), so its four quarter-turns of the pair's own channels share one set of outputs."""
        n_layers, n_cands, _ = cands.shape
        best = cands[:, 0].clone()
        rel = cands if base is None else cands - base[:, None]
        for row, head in enumerate(self.heads):
            flat, layer, tok, sub, ends = self._flat(head)
            if not flat.numel():  # no entry of any layer can move: every candidate ties, the first one is kept
                continue
            ea, eb = sub[0], sub[1]
            if base is not None:  # turn each entry by its layer's base angle (float32; the margin covers it)
                cb = torch.cos(base[:, row]).to(torch.float32).index_select(0, layer)
                sb = torch.sin(base[:, row]).to(torch.float32).index_select(0, layer)
                ea, eb = cb * sub[0] - sb * sub[1], sb * sub[0] + cb * sub[1]
            shared = (rel[:, :, row] == rel[:1, :, row]).all(0)  # (C,) offsets every layer shares
            moved = torch.empty(n_cands, n_layers, dtype=torch.float64)
            col_sets = [shared.nonzero()[:, 0], (~shared).nonzero()[:, 0]]
            if (quarters and self.pair_only and quarters % 4 == 0 and n_cands == quarters + 1
                    and bool(shared[1:].all())):
                q = quarters // 4
                ang = rel[0, 1:1 + q, row]
                cs, sn = torch.cos(ang)[:, None].to(torch.float32), torch.sin(ang)[:, None].to(torch.float32)
                moved[1:] = self._moved32_quarters(cs, sn, ea, eb, sub, ends)
                col_sets = [torch.zeros(1, dtype=torch.long)]
            for cols in col_sets:
                if not cols.numel():
                    continue
                ang = rel[:, :, row].index_select(1, cols)  # (L, C_x)
                if bool(shared[cols[0]]):
                    cs, sn = torch.cos(ang[0])[:, None], torch.sin(ang[0])[:, None]  # (C_x, 1)
                else:
                    cs, sn = torch.cos(ang).T.index_select(1, layer), torch.sin(ang).T.index_select(1, layer)
                moved[cols] = self._moved32(cs.to(torch.float32), sn.to(torch.float32), ea, eb, sub, ends)
            low = moved.min(0).values
            margin = PREFILTER_MARGIN * moved.max(0).values + 1e-12 * low.abs() + 1e-300
            near = (moved <= low + margin).T  # (L, C); a layer with no movable entry: all tie -> the first
            n_near = near.sum(1)
            width = int(n_near.max())
            pos = torch.argsort((~near).to(torch.int8), dim=1, stable=True)[:, :width]
            pos = torch.where(torch.arange(width)[None, :] >= n_near[:, None], pos[:, :1], pos)
            c_near = cands[:, :, row].gather(1, pos)  # (L, C'): the near angles in order, padded with the first
            best[:, row] = c_near[:, 0]
            if width > 1:
                multi = (c_near != c_near[:, :1]).any(1)  # layers left with distinct near angles
                if bool(multi.any()):
                    pick = self._exact(c_near, multi, flat, layer, tok, head)
                    best[multi, row] = pick[multi]
        return best

    def _moved32_quarters(self, cs: torch.Tensor, sn: torch.Tensor, ea: torch.Tensor, eb: torch.Tensor,
                          sub: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """:meth:`_moved32` of the grid (4q, L) for ``pairwise_only`` (the pair's own two channels, zero rest
        of class) from its first quarter (cs, sn (q, 1)): a quarter turn maps (u1, u2) to (−u2, u1)."""
        u1 = torch.addcmul(cs * ea, sn, eb, value=-1.0)
        u2 = torch.addcmul(sn * ea, cs, eb)
        hi_c, lo_c = sub[2], sub[3]
        nu2 = u2.neg()
        big, small = torch.maximum(u1, u2), torch.minimum(u1, u2)  # turn 0: (u1, u2)
        big1, small1 = torch.maximum(u1, nu2), torch.minimum(u1, nu2)  # turn 1: (−u2, u1)
        # turn 2: (−u1, −u2): max −small, min −big; turn 3: (u2, −u1): max −small1, min −big1
        out = []
        for mx, mn in ((big, small), (big1, small1), (small.neg(), big.neg()), (small1.neg(), big1.neg())):
            out.append(_segment_sums(torch.maximum(hi_c, mx) - torch.minimum(lo_c, mn), ends))
        return torch.cat(out)

    def _moved32(self, cs: torch.Tensor, sn: torch.Tensor, ea: torch.Tensor, eb: torch.Tensor, sub: torch.Tensor,
                 ends: torch.Tensor) -> torch.Tensor:
        """Float32 sums over each layer's movable entries of their range (C_x, L), for the candidates whose
        cosines and sines (C_x, 1 or A) turn the entries (ea, eb) (A,); any rounding order (the margin covers it)."""
        hi, lo = sub[2], sub[3]
        if self.hadamard_like:
            # classes (±h, ±h): shifts ±h(u1 + u2), ±h(u1 − u2), straight from the candidates' (c ± s)
            h = self.hadamard_like
            p, q = (cs + sn) * h, (cs - sn) * h
            w = {1: torch.addcmul(p * ea, q, eb), -1: torch.addcmul(q * ea, p, eb, value=-1.0)}
            for j, (c0, c1) in enumerate(self.moving):
                shift = w[1 if c0 == c1 else -1]
                cmax, cmin = sub[4 + 2 * j], sub[5 + 2 * j]
                if c0 > 0:
                    hi, lo = torch.maximum(hi, cmax + shift), torch.minimum(lo, cmin + shift)
                else:
                    hi, lo = torch.maximum(hi, cmax - shift), torch.minimum(lo, cmin - shift)
        else:
            u1 = torch.addcmul(cs * ea, sn, eb, value=-1.0)  # u1 = c·a − s·b, u2 = s·a + c·b
            u2 = torch.addcmul(sn * ea, cs, eb)
            for j, (c0, c1) in enumerate(self.moving):
                shift = _shift(c0, c1, u1, u2)
                cmax, cmin = sub[4 + 2 * j], sub[5 + 2 * j]
                if self.same_extremes[j] and self.zero_extremes[j]:
                    hi, lo = torch.maximum(hi, shift), torch.minimum(lo, shift)
                elif self.same_extremes[j]:
                    v = cmax + shift
                    hi, lo = torch.maximum(hi, v), torch.minimum(lo, v)
                else:
                    hi, lo = torch.maximum(hi, cmax + shift), torch.minimum(lo, cmin + shift)
        return _segment_sums(hi - lo, ends)

    def _exact(self, c_near: torch.Tensor, multi: torch.Tensor, flat: torch.Tensor, layer: torch.Tensor,
               tok: torch.Tensor, head: int | None) -> torch.Tensor:
        """Float64 scores of the near angles (L, C') of the layers ``multi``, each movable entry's range by the
        exact descent's formula; returns each layer's first best angle (L,)."""
        keep = multi.index_select(0, layer)
        flat, layer, tok = flat[keep], layer[keep], tok[keep]
        n_layers, width = c_near.shape
        ang = c_near.T.index_select(1, layer) + self.psi_k.reshape(-1).index_select(0, layer * self.psi_k.shape[1]
                                                                                    + tok)  # (C', A)
        c, s = torch.cos(ang), torch.sin(ang)
        ak, bk = self.a_k.reshape(-1).index_select(0, flat), self.b_k.reshape(-1).index_select(0, flat)
        u1, u2 = c * ak - s * bk, s * ak + c * bk
        hi = lo = None
        for cf, cmax, cmin in self.classes:
            shift = _shift(float(cf[0]), float(cf[1]), u1, u2)  # x·1 + y·0 = x: the same values
            mx, mn = cmax.reshape(-1).index_select(0, flat), cmin.reshape(-1).index_select(0, flat)
            hi = mx + shift if hi is None else torch.maximum(hi, mx + shift)
            lo = mn + shift if lo is None else torch.minimum(lo, mn + shift)
        r = hi.clamp(min=0.0) - lo.clamp(max=0.0)  # (C', A)
        # Every other entry's range is its constant width (the pair stays below its extremes) exactly as the
        # exact descent computes it: fill them in and take the same float64 mean over (token, head) per
        # candidate, so the scores, ties included, are the exact descent's bit for bit.
        sel = multi.nonzero()[:, 0]
        slot = torch.full((n_layers,), -1, dtype=torch.long)
        slot[sel] = torch.arange(sel.numel())
        n_tok, n_heads = self.width.shape[1:]
        rows = self.width.index_select(0, sel)[:, None].expand(-1, width, -1, -1).clone()  # (L', C', N, H)
        hd = flat % n_heads
        rows.permute(0, 2, 3, 1).index_put_((slot.index_select(0, layer), tok, hd), r.T)
        if head is None:
            score = rows.mean(dim=(2, 3))  # (L', C')
        else:
            score = rows.mean(dim=2)[..., head]
        best = c_near[:, 0].clone()
        best[sel] = c_near.index_select(0, sel).gather(1, score.argmin(1)[:, None])[:, 0]
        return best


def _segment_sums(r: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Per-layer sums (C, L) of float32 terms r (C, A) whose layers end at ``ends``, from one float64 running
    sum (its error, ~1e-14 of the total, is far below the margin; each term's float32 error is ~eps·its size)."""
    run = torch.cumsum(r, dim=1, dtype=torch.float64)
    upto = torch.where(ends > 0, run[:, (ends - 1).clamp(min=0)], 0.0)  # (C, L) the sum up to each end
    return torch.diff(upto, dim=1, prepend=torch.zeros_like(upto[:, :1]))


def _shift(c0: float, c1: float, u1: torch.Tensor, u2: torch.Tensor) -> torch.Tensor:
    """c0·u1 + c1·u2 without the multiplications by 0 or 1."""
    if c1 == 0.0:
        return u1 if c0 == 1.0 else c0 * u1
    if c0 == 0.0:
        return u2 if c1 == 1.0 else c1 * u2
    return c0 * u1 + c1 * u2


def wrap(phi: torch.Tensor) -> torch.Tensor:
    """Angles to (-π, π] (as the exact descent reports them)."""
    wrapped = torch.remainder(phi + math.pi, 2 * math.pi) - math.pi
    return torch.where(wrapped == -math.pi, torch.full_like(wrapped, math.pi), wrapped)

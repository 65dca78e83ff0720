"""Searches that find the ±1 sequences behind the Goethals–Seidel Hadamard orders of
:mod:`rope_quant.core.hadamard_orders` (nothing is stored: every run finds the same sequences, deterministically).

* :func:`gs_sequences` (order 4t, t in :data:`GS_MULTIPLIERS`): four circulant ±1 sequences of length t whose
  periodic autocorrelations (PAF) sum to 0, constant on the orbits of a multiplier group G ≤ Z_t^* (−1 ∈ G:
  symmetric sequences, i.e. Williamson matrices). Meet in the middle over the row-sum decomposition
  4t = a² + b² + c² + d², pruned by the power spectral density (PSD ≤ 4t at every frequency).
* :func:`turyn_sequences` (order 4(3n−1), n in :data:`TURYN_LENGTHS`): Turyn-type sequences TT(n), X, Y, Z of
  length n and W of length n−1 with N_X + N_Y + 2N_Z + 2N_W = 0 (aperiodic autocorrelations). They give base
  sequences (Z;W, Z;−W, X, Y), then T-sequences of length 3n−1, then four ±1 sequences with zero periodic
  autocorrelation sum (:func:`t_sequence_quadruple`). This serves t = 47 and 59, where Williamson matrices do
  not exist and Z_t^* has no multiplier group that shrinks the search.

Costs on a 2-core AMD EPYC (lscpu), 1 thread, busy (load 8–10; 2026-11-28): t = 23 / 29 / 39 / 43: 0.1 / 1.8 / 5.5 /
0.01 s; TT(16) 0.6 s; TT(20) 15–34 s with a peak RSS of 0.42 GB. Each result is cached in memory for the
process, and each search runs only when its order is first built.
"""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np

__all__ = ["GS_MULTIPLIERS", "TURYN_LENGTHS", "SearchSetupError", "gs_sequences", "turyn_sequences",
           "t_sequence_quadruple"]


class SearchSetupError(ValueError):
    """No search is set up for this length."""


#: t → generators of the multiplier group G ≤ Z_t^* whose orbits the search runs over (order 4t).
#: Each entry is a search space, not a result.
GS_MULTIPLIERS: dict[int, tuple[int, ...]] = {
    23: (22,),  # G = {±1}: 4096 symmetric sequences (order 92)
    29: (28,),  # G = {±1} (order 116)
    39: (16,),  # G = {1, 16, 22}, odd order: not symmetric (order 156)
    43: (42, 6),  # G = {±1, ±6, ±36} (order 172)
}
#: n of the Turyn-type sequences TT(n) searched for t = 3n − 1 (orders 4·47 = 188 and 4·59 = 236).
TURYN_LENGTHS: tuple[int, ...] = (16, 20)


def _hash_rows(x: np.ndarray) -> np.ndarray:
    """A 64-bit linear hash of each integer row (splitmix64 weights); h(a) + h(b) = h(a + b) mod 2^64."""
    weights = []
    z = 0
    for _ in range(x.shape[1]):
        z = (z + 0x9E3779B97F4A7C15) % 2**64
        v = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
        v = ((v ^ (v >> 27)) * 0x94D049BB133111EB) % 2**64
        weights.append(v ^ (v >> 31))
    w = np.array(weights, dtype=np.uint64)
    out = np.empty(len(x), dtype=np.uint64)
    for s in range(0, len(x), 1 << 18):  # chunks: the int64 copy of a narrow-typed x stays small
        out[s:s + (1 << 18)] = (x[s:s + (1 << 18)].astype(np.int64).view(np.uint64) * w).sum(axis=1, dtype=np.uint64)
    return out


def _first_match(left: np.ndarray, right: np.ndarray) -> tuple[int, int] | None:
    """The first (p, q) (by q, then p) with left[p] == right[q] as integer rows, or None."""
    hl, hr = _hash_rows(left), _hash_rows(right)
    order = np.argsort(hl, kind="stable")
    hl_sorted = hl[order]
    lo = np.searchsorted(hl_sorted, hr, side="left")
    hi = np.searchsorted(hl_sorted, hr, side="right")
    for q in np.nonzero(hi > lo)[0]:
        for p in order[lo[q]:hi[q]]:
            if np.array_equal(left[p], right[q]):
                return int(p), int(q)
    return None


def _psd(seqs: np.ndarray, points: int = 0) -> np.ndarray:
    """|DFT|² of each row (zero-padded to ``points`` when given: the aperiodic spectrum's samples)."""
    spec = np.fft.rfft(seqs.astype(np.float64), n=points or None, axis=1)
    return spec.real**2 + spec.imag**2


def _pairs(psd_a: np.ndarray, psd_b: np.ndarray, bound: float) -> tuple[np.ndarray, np.ndarray]:
    """All row pairs (i, j) with psd_a[i] + psd_b[j] ≤ bound at every frequency: a coarse float32 pass on a few
    frequencies (with slack, so it only prunes), then every frequency in float64; chunked for memory."""
    keep_i, keep_j = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    if not len(psd_a) or not len(psd_b):
        return keep_i[0], keep_j[0]
    coarse = np.arange(1, psd_a.shape[1], max(1, psd_a.shape[1] // 6))
    pa_c, pb_c = psd_a[:, coarse].astype(np.float32), psd_b[:, coarse].astype(np.float32)
    slack = np.float32(bound * (1 + 1e-5))
    chunk = max(1, 4_000_000 // (len(psd_b) * len(coarse)))
    for s in range(0, len(psd_a), chunk):
        ii, jj = np.nonzero((pa_c[s:s + chunk, None, :] + pb_c[None] <= slack).all(-1))
        ii += s
        fine = (psd_a[ii] + psd_b[jj] <= bound).all(-1)
        keep_i.append(ii[fine])
        keep_j.append(jj[fine])
    return np.concatenate(keep_i), np.concatenate(keep_j)


# ----------------------------------------------------------------------------------------------------------
# Periodic: multiplier-orbit search (Williamson and Goethals–Seidel sequences)
# ----------------------------------------------------------------------------------------------------------


def _orbits(t: int, gens: tuple[int, ...]) -> list[list[int]]:
    """Orbits of the multiplicative group generated by ``gens`` acting on Z_t (0 is its own orbit)."""
    group = {1}
    while True:
        grown = group | {(h * g) % t for h in group for g in gens}
        if grown == group:
            break
        group = grown
    seen: set[int] = set()
    orbits: list[list[int]] = []
    for x in range(t):
        if x not in seen:
            orbit = sorted({(h * x) % t for h in group})
            seen.update(orbit)
            orbits.append(orbit)
    return orbits


def _sum_decompositions(t: int) -> list[tuple[int, int, int, int]]:
    """4t = a² + b² + c² + d² with a ≥ b ≥ c ≥ d ≥ 1 odd (t odd: every ±1 sequence of length t has odd sum)."""
    out = []
    for a, b, c in itertools.product(range(1, math.isqrt(4 * t) + 1, 2), repeat=3):
        if a >= b >= c:
            d2 = 4 * t - a * a - b * b - c * c
            d = math.isqrt(max(d2, 0))
            if d2 > 0 and d * d == d2 and d <= c and d % 2 == 1:
                out.append((a, b, c, d))
    return out


@functools.cache
def gs_sequences(t: int) -> tuple[tuple[int, ...], ...]:
    """Four ±1 sequences of length t, constant on the orbits of :data:`GS_MULTIPLIERS` [t], whose periodic
    autocorrelations sum to 0 at every nonzero shift (the first match of the search; deterministic)."""
    if t not in GS_MULTIPLIERS:
        raise SearchSetupError(f"no multiplier-orbit search is set up for t = {t} (order {4 * t})")
    orbits = _orbits(t, GS_MULTIPLIERS[t])
    r = len(orbits)
    member = np.zeros((r, t), dtype=np.int64)
    for j, orbit in enumerate(orbits):
        member[j, orbit] = 1
    signs = ((np.arange(1 << r)[:, None] >> np.arange(r)) & 1) * 2 - 1
    seqs = signs @ member  # (2^r, t), entries ±1
    sums = seqs.sum(axis=1)
    psd = _psd(seqs)
    bound = 4 * t + 1e-6
    shifts = [o[0] for o in orbits if o[0] != 0]  # the PAF is constant on orbits too
    paf = np.stack([(seqs * np.roll(seqs, -s, axis=1)).sum(axis=1) for s in shifts], axis=1).astype(np.int16)
    fits = (psd <= bound).all(axis=1)
    for a, b, c, d in _sum_decompositions(t):
        idx = {v: np.nonzero(fits & (sums == v))[0] for v in (a, b, c, d)}
        i1, j1 = (idx[v][p] for v, p in zip((a, b), _pairs(psd[idx[a]], psd[idx[b]], bound), strict=True))
        i2, j2 = (idx[v][p] for v, p in zip((c, d), _pairs(psd[idx[c]], psd[idx[d]], bound), strict=True))
        match = _first_match(paf[i1] + paf[j1], -(paf[i2] + paf[j2]))
        if match is not None:
            p, q = match
            return tuple(tuple(int(v) for v in seqs[i]) for i in (i1[p], j1[p], i2[q], j2[q]))
    raise AssertionError(f"the multiplier-orbit search found no sequences for t = {t}")  # pragma: no cover


# ----------------------------------------------------------------------------------------------------------
# Aperiodic: Turyn-type sequences → T-sequences
# ----------------------------------------------------------------------------------------------------------


def _normalised_sequences(length: int) -> np.ndarray:
    """Every ±1 sequence of the length whose first entry is +1 (negation keeps autocorrelations), int8."""
    bits = (np.arange(1 << (length - 1), dtype=np.int64)[:, None] >> np.arange(length - 1)) & 1
    return np.concatenate([np.ones((len(bits), 1), np.int8), (1 - 2 * bits).astype(np.int8)], axis=1)


def _reversal_representatives(seqs: np.ndarray) -> np.ndarray:
    """Mask of the rows kept when a sequence and its reversal (renormalised to start with +1) count once:
    reversal keeps the aperiodic autocorrelation and the spectrum's modulus, so no solution is lost."""
    bits = (1 - seqs.astype(np.int64)) // 2
    rev = seqs[:, ::-1].astype(np.int64) * seqs[:, -1:].astype(np.int64)
    weights = 1 << np.arange(seqs.shape[1], dtype=np.int64)
    return (bits @ weights) <= (((1 - rev) // 2) @ weights)


def _aperiodic(seqs: np.ndarray, shifts: int) -> np.ndarray:
    """N(s) = Σ_i x_i x_{i+s} for s = 1 … shifts (0 beyond the length), int64."""
    x = seqs.astype(np.int64)
    length = x.shape[1]
    cols = [(x[:, : length - s] * x[:, s:]).sum(axis=1) if s < length else np.zeros(len(x), np.int64)
            for s in range(1, shifts + 1)]
    return np.stack(cols, axis=1)


@functools.cache
def turyn_sequences(n: int) -> tuple[tuple[int, ...], ...]:
    """Turyn-type sequences TT(n): (X, Y, Z, W), lengths n, n, n, n−1, N_X + N_Y + 2N_Z + 2N_W = 0.

    Deterministic meet in the middle: for each sum decomposition 6n − 2 = x² + y² + 2z² + 2w² (fewest (Z, W)
    candidates first), the pairs (Z, W) with 2(PSD_Z + PSD_W) ≤ 6n − 2 give targets −2(N_Z + N_W); a linear
    hash of N finds X, Y with N_X + N_Y equal to a target, checked exactly.
    """
    if n not in TURYN_LENGTHS:
        raise SearchSetupError(f"no Turyn-type search is set up for n = {n} (order {4 * (3 * n - 1)})")
    full, short = _normalised_sequences(n), _normalised_sequences(n - 1)
    full_rep, short_rep = _reversal_representatives(full), _reversal_representatives(short)
    sum_full, sum_short = np.abs(full.sum(axis=1, dtype=np.int64)), np.abs(short.sum(axis=1, dtype=np.int64))
    target = 6 * n - 2
    points = 128  # samples of the aperiodic spectrum (|X(e^{iθ})|² ≤ bound at every θ)
    decomps = [(x, y, z, w) for x, y, z in itertools.product(range(n + 1), repeat=3)
               if x >= y and (x - n) % 2 == 0 and (y - n) % 2 == 0 and (z - n) % 2 == 0
               for w in [math.isqrt(max(0, (target - x * x - y * y - 2 * z * z) // 2))]
               if x * x + y * y + 2 * z * z + 2 * w * w == target and (w - n + 1) % 2 == 0]
    decomps.sort(key=lambda d: (int((sum_full == d[2]).sum()) * int((sum_short == d[3]).sum()), d))
    for x, y, z, w in decomps:
        iz, iw = np.nonzero((sum_full == z) & full_rep)[0], np.nonzero((sum_short == w) & short_rep)[0]
        psd_z, psd_w = _psd(full[iz], points), _psd(short[iw], points)
        half = target / 2 + 1e-6
        fit_z, fit_w = (psd_z <= half).all(1), (psd_w <= half).all(1)
        pz, pw = _pairs(psd_z[fit_z], psd_w[fit_w], half)
        zi, wi = iz[fit_z][pz], iw[fit_w][pw]
        if not len(zi):
            continue
        goals = -2 * (_aperiodic(full[zi], n - 1) + _aperiodic(short[wi], n - 1))
        room = target - 2 * (_psd(full[zi], points) + _psd(short[wi], points))  # PSD_X + PSD_Y at each θ
        ix, iy = np.nonzero((sum_full == x) & full_rep)[0], np.nonzero((sum_full == y) & full_rep)[0]
        psd_x, psd_y = _psd(full[ix], points), _psd(full[iy], points)
        coarse = np.arange(1, psd_x.shape[1], 4)
        psd_x, psd_y = np.ascontiguousarray(psd_x[:, coarse]), np.ascontiguousarray(psd_y[:, coarse])
        nx, ny = _aperiodic(full[ix], n - 1), _aperiodic(full[iy], n - 1)
        hx, hy = _hash_rows(nx), _hash_rows(ny)
        for k in range(len(goals)):
            limit = room[k, coarse] + 1e-6
            cx = np.nonzero((psd_x <= limit).all(1))[0]
            cy = np.nonzero((psd_y <= limit).all(1))[0]
            if not len(cx) or not len(cy):
                continue
            order = cy[np.argsort(hy[cy], kind="stable")]
            hy_sorted = hy[order]
            need = _hash_rows(goals[k:k + 1])[0] - hx[cx]  # wraps mod 2^64, as the hash does
            pos = np.minimum(np.searchsorted(hy_sorted, need), len(hy_sorted) - 1)
            for q in np.nonzero(hy_sorted[pos] == need)[0]:
                px, py = cx[q], order[pos[q]]
                if np.array_equal(nx[px] + ny[py], goals[k]):
                    return tuple(tuple(int(v) for v in s)
                                 for s in (full[ix[px]], full[iy[py]], full[zi[k]], short[wi[k]]))
    raise AssertionError(f"the Turyn-type search found no TT({n})")  # pragma: no cover


def t_sequence_quadruple(n: int) -> tuple[tuple[int, ...], ...]:
    """Four ±1 sequences of length t = 3n − 1 with zero aperiodic (so periodic) autocorrelation sum, from TT(n).

    Base sequences A = Z;W, B = Z;−W, C = X, D = Y (N_A + N_B + N_C + N_D = 0) give T-sequences
    T_1 = ((A+B)/2; 0_n), T_2 = ((A−B)/2; 0_n), T_3 = (0_{2n−1}; (C+D)/2), T_4 = (0_{2n−1}; (C−D)/2); exactly one
    is nonzero at each position, so the rows of H_4·(T_1, …, T_4) are ±1 with Σ N = 4 Σ N_{T_j} = 0.
    """
    x, y, z, w = (np.array(s, dtype=np.int64) for s in turyn_sequences(n))
    a, b = np.concatenate([z, w]), np.concatenate([z, -w])
    pad_a, pad_c = np.zeros(len(x), np.int64), np.zeros(len(a), np.int64)
    ts = np.stack([np.concatenate([(a + b) // 2, pad_a]), np.concatenate([(a - b) // 2, pad_a]),
                   np.concatenate([pad_c, (x + y) // 2]), np.concatenate([pad_c, (x - y) // 2])])
    h4 = np.array([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]], dtype=np.int64)
    return tuple(tuple(int(v) for v in row) for row in h4 @ ts)

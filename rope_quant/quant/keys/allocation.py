"""rope_pair_bits' allocation: integer widths per RoPE pair from the pairs' energies (reverse water-filling of
transform coding, Huang & Schultheiss 1963; Gersho & Gray 1992, Ch. 8)."""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from rope_quant.quant.keys.base import KeyQuantError, _bits


def pair_energies(sum_aa: np.ndarray, sum_bb: np.ndarray, n: np.ndarray | float) -> np.ndarray:
    """Mean energy E[a² + b²] of every RoPE pair from raw moment sums (e.g. CalibrationStats.raw_moments("k"):
    sum_aa, sum_bb (L, H, K), n (L,)). RoPE turns a pair without changing a² + b², so pre- and post-RoPE energies
    agree; an R3 that mixes pairs changes them (the pipeline measures post-R3 keys instead)."""
    aa, bb = np.asarray(sum_aa, dtype=np.float64), np.asarray(sum_bb, dtype=np.float64)
    rows = np.asarray(n, dtype=np.float64)
    rows = rows.reshape(rows.shape + (1,) * (aa.ndim - rows.ndim))
    if np.any(rows <= 0):
        raise KeyQuantError("pair energies need at least one row per layer")
    return (aa + bb) / rows


def allocate_pair_bits(energies: Any, target: float, min_bits: int = 2, max_bits: int = 8) -> np.ndarray:
    """Integer bit widths per RoPE pair whose mean is exactly ``target``, more bits to higher-energy pairs.

    ``energies``: (..., K) non-negative (one allocation per leading index, e.g. per layer and KV head).
    Greedy marginal allocation on log2 energy: every pair starts at ``min_bits``; each of the K·(target −
    min_bits) added bits goes to the pair with the largest log2 E_k − 2 b_k below ``max_bits`` (the largest
    drop of the high-rate error E_k·4^(−b_k); ties to the lower pair index). This is the integer optimum of
    Σ_k E_k·4^(−b_k) under the budget (the marginal gains decrease), and E_i > E_j gives b_i >= b_j.
    Raises :class:`KeyQuantError` when integer widths in [min_bits, max_bits] cannot average ``target``
    (outside the range, or K·target not an integer).
    """
    lo, hi = _bits(min_bits, "k_min_bits"), _bits(max_bits, "k_max_bits")
    if lo > hi:
        raise KeyQuantError(f"k_min_bits {lo} exceeds k_max_bits {hi}")
    e = np.asarray(energies, dtype=np.float64)
    if e.ndim < 1 or e.shape[-1] < 1:
        raise KeyQuantError(f"energies must have a last axis of pairs, got shape {e.shape}")
    if not np.all(np.isfinite(e)) or np.any(e < 0):
        raise KeyQuantError("pair energies must be finite and non-negative")
    k = e.shape[-1]
    budget = _pair_budget(target, k, lo, hi)
    rows = e.reshape(-1, k)
    widths = np.full(rows.shape, lo, dtype=np.int64)
    score = np.log2(np.maximum(rows, np.finfo(np.float64).tiny)) - 2.0 * lo
    idx = np.arange(rows.shape[0])
    for _ in range(budget - k * lo):
        pick = np.argmax(np.where(widths < hi, score, -np.inf), axis=-1)
        widths[idx, pick] += 1
        score[idx, pick] -= 2.0
    return widths.reshape(e.shape)


def _pair_budget(target: float, k: int, lo: int, hi: int) -> int:
    """K·target as an integer number of bits per pair set, or KeyQuantError naming why it is unreachable."""
    if isinstance(target, bool) or not isinstance(target, numbers.Real) or not math.isfinite(target):
        raise KeyQuantError(f"the rope_pair_bits target must be a finite number, got {target!r}")
    if not lo <= target <= hi:
        raise KeyQuantError(f"rope_pair_bits: integer widths in [{lo}, {hi}] (k_min_bits, k_max_bits) cannot "
                            f"average {target} bits")
    total = k * float(target)
    if abs(total - round(total)) > 1e-9:
        raise KeyQuantError(f"rope_pair_bits: integer widths over {k} pairs cannot average {target} bits "
                            f"({k} × {target} = {total:g} is not an integer)")
    return int(round(total))

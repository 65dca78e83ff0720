"""Synthetic pre-RoPE key rows for the range objective's tests."""

from __future__ import annotations

import numpy as np


def range_keys(seed: int, n: int = 300, heads: int = 2, d: int = 16) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows (n, heads, d), positions (n,), inv_freq (d/2,)): Student-t rows with two outlier channels, so most
    entries' range is set by them."""
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.normal(0, 1, d))
    scale[rng.integers(0, d, 2)] *= 6  # outlier channels: most entries' range is set by them
    rows = rng.standard_t(5, (n, heads, d)) * scale + rng.standard_normal(d) * 2
    return rows, rng.integers(0, 512, n), 10000.0 ** (-np.arange(0, d, 2) / d)

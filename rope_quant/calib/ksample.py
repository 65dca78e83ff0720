"""A uniform sample of whole pre-RoPE K tokens per layer, with their positions (for the ``range`` objective).

Each kept row holds every KV head and every channel of one token, stored as float32, together with the
token's position (its index along the sequence axis, the second-to-last axis of the k_proj output): the
``range`` objective needs the RoPE phase m·θ_k of every row. Sampling is bottom-k on seeded uniform keys,
so it is uniform without replacement; merging keeps the smallest keys of the union, again a uniform sample
of every row either side saw. Each layer draws its keys from its own generator (seeded by (seed, layer)), so
the sample does not depend on how many windows a forward holds (the layers of one forward would otherwise
interleave their draws differently for every batch size).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from rope_quant.calib.errors import (
    CalibrationError,
    CalibrationShapeError,
    EmptyStatisticsError,
    IncompatibleStatsError,
    StatsFileError,
    check_layer,
)


class KSample:
    """Bottom-k sample of at most ``size`` K tokens per layer; ``size`` = 0 keeps nothing."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, size: int = 0, seed: int = 0) -> None:
        if int(size) != size or size < 0:
            raise CalibrationShapeError(f"sample_rows must be a non-negative integer, got {size!r}")
        self.n_layers, self.n_kv_heads, self.head_dim = int(n_layers), int(n_kv_heads), int(head_dim)
        self.size, self.seed = int(size), int(seed)
        if self.seed < 0:
            raise CalibrationShapeError(f"sample_seed must be a non-negative integer, got {seed!r}")
        self._rngs = [np.random.default_rng([self.seed, layer]) for layer in range(self.n_layers)]
        # per layer: (keys (n,), positions (n,), rows (n, H_kv, d) float32), bottom-k by key
        self._sample: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = [
            (np.zeros(0), np.zeros(0, dtype=np.int64), np.zeros((0, self.n_kv_heads, self.head_dim), np.float32))
            for _ in range(self.n_layers)
        ]

    def config(self) -> dict[str, Any]:
        """The shape of the sample (the seed is left out: processes sample with their own seeds)."""
        return {"n_layers": self.n_layers, "n_kv_heads": self.n_kv_heads, "head_dim": self.head_dim,
                "size": self.size}

    def update(self, layer: int, shape: tuple[int, ...], rows: np.ndarray) -> None:
        """Offer the K rows (N, H_kv, d) of one k_proj output of ``shape`` (..., seq, H_kv*d)."""
        if not self.size:
            return
        if len(shape) < 2:
            raise CalibrationShapeError(
                f"layer {layer}: the K sample needs a sequence axis, input (..., seq, H*d), got {shape}"
            )
        positions = np.broadcast_to(np.arange(shape[-2]), shape[:-1]).reshape(-1)
        self.push(layer, self.draw_keys(layer, shape), positions, rows)

    def draw_keys(self, layer: int, shape: tuple[int, ...]) -> np.ndarray:
        """The uniform keys of the rows of one k_proj output of ``shape`` (..., seq, H_kv*d), from the
        layer's generator (float64, one per row; checks the sequence axis)."""
        if len(shape) < 2:
            raise CalibrationShapeError(
                f"layer {layer}: the K sample needs a sequence axis, input (..., seq, H*d), got {shape}"
            )
        return self._rngs[layer].random(int(np.prod(shape[:-1], dtype=np.int64)))

    def push(self, layer: int, keys: np.ndarray, positions: np.ndarray, rows: np.ndarray) -> None:
        """Keep the ``size`` rows with the smallest keys of the kept and the new rows (stored as float32).

        Only the kept new rows are copied (and cast); the selection is the same as on the whole union.
        """
        old_keys, old_pos, old_rows = self._sample[layer]
        n_old = old_keys.size
        keys = np.concatenate([old_keys, keys])
        positions = np.concatenate([old_pos, positions])
        if keys.size > self.size:
            keep = np.argpartition(keys, self.size - 1)[: self.size]
            keep.sort()
        else:
            keep = np.arange(keys.size)
        split = int(np.searchsorted(keep, n_old))
        picked = np.asarray(rows)[keep[split:] - n_old].astype(np.float32)
        kept_rows = np.concatenate([old_rows[keep[:split]], picked.reshape(-1, *old_rows.shape[1:])])
        self._sample[layer] = (keys[keep], positions[keep], kept_rows)

    def sample(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The sample of a layer: pre-RoPE rows (n, H_kv, head_dim) float64 and positions (n,) int64."""
        layer = check_layer(layer, self.n_layers)
        if not self.size:
            raise CalibrationError("no K sample was kept: build CalibrationStats with sample_rows > 0")
        _, positions, rows = self._sample[layer]
        if rows.shape[0] == 0:
            raise EmptyStatisticsError(f"layer {layer}: the K sample is empty (no K rows seen)")
        return rows.astype(np.float64), positions.copy()

    def merge(self, other: KSample) -> KSample:
        """Keep the smallest keys of the union with ``other``'s sample, in place. Returns self."""
        if not isinstance(other, KSample) or other.config() != self.config():
            theirs = other.config() if isinstance(other, KSample) else type(other).__name__
            raise IncompatibleStatsError(f"cannot merge K sample {theirs} into {self.config()}")
        if self.size:
            for layer in range(self.n_layers):
                self.push(layer, *other._sample[layer])
        return self

    def copy_rng_state(self, other: KSample) -> None:
        """Continue ``other``'s key stream (for an exact copy)."""
        for mine, theirs in zip(self._rngs, other._rngs, strict=True):
            mine.bit_generator.state = theirs.bit_generator.state

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The file section: ``sample_{layer}_keys``, ``_pos`` and ``_rows`` per layer (nothing if size = 0)."""
        arrays: dict[str, np.ndarray] = {}
        for layer, (keys, positions, rows) in enumerate(self._sample):
            if self.size:
                arrays[f"sample_{layer}_keys"], arrays[f"sample_{layer}_pos"] = keys, positions
                arrays[f"sample_{layer}_rows"] = rows
        return arrays

    def load_arrays(self, data: Mapping[str, Any]) -> None:
        """Fill from a file section written by :meth:`to_arrays` (KeyError/StatsFileError if malformed)."""
        for layer in range(self.n_layers if self.size else 0):
            rows = np.asarray(data[f"sample_{layer}_rows"], dtype=np.float32)
            if rows.shape[1:] != (self.n_kv_heads, self.head_dim):
                raise StatsFileError(f"sample_{layer}_rows has shape {rows.shape}")
            self._sample[layer] = (np.asarray(data[f"sample_{layer}_keys"], dtype=np.float64),
                                   np.asarray(data[f"sample_{layer}_pos"], dtype=np.int64), rows)

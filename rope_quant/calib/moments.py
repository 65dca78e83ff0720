"""Streaming calibration statistics of the pre-RoPE query/key frequency pairs (App. A.2.1).

For every (layer, stream Q|K, head, frequency pair k) the accumulator holds, in float64 on the CPU,
the row count n, the raw sums Σa, Σb, Σa², Σb², Σab of the pair's two channels (a, b), and an
equivalent merge-stable form: the means and the *centred* co-moments
M_aa = Σ(a-ā)², M_bb = Σ(b-b̄)², M_ab = Σ(a-ā)(b-b̄), combined with the pairwise update of
Chan, Golub & LeVeque (1979). In exact arithmetic the centred form equals the paper's raw-moment rule
(Σa²/n - (Σa/n)², ...); in floating point it keeps the covariance accurate when |mean| ≫ sd, where
the raw rule cancels catastrophically. Pooled covariances (:meth:`CalibrationStats.pooled`) use the
stable form; :meth:`CalibrationStats.pooled_raw` reproduces the paper's raw-moment arithmetic for the
φ* verifier (App. A.5).

Per-head accumulators are kept (H is small), so every pooling rule is derived after the fact:

- ``rows`` (default): add the raw sums of all Q and K heads, then centre once. Rows are weighted by
  count, so the Q:K weight ratio follows the head counts (3:1 for 9 Q heads and 3 KV heads).
- ``k_only``: the K stream alone (all KV heads).
- ``balanced``: equal stream weights on the first and uncentred second moments: average the
  per-stream normalised raw moments m1_s = Σx/n_s, m2_s = Σxxᵀ/n_s over s ∈ {Q, K}, then centre once:
  Σ = (m2_Q + m2_K)/2 - m̄ m̄ᵀ with m̄ = (m1_Q + m1_K)/2. (Stable form: (C_Q + C_K)/2 + δδᵀ/4, δ = μ_Q - μ_K.)
- ``per_head``: one covariance per KV head h (for φ_{h,k}): K head h's rows plus the rows of the Q
  heads of its GQA group, pooled like ``rows``; arrays of shape (L, H_kv, K).

Optionally a per-(layer, pair) candidate set of the ``topk`` rows with the largest |a|+|b| is kept
(K stream by default) for the grid objectives of :mod:`rope_quant.calib.objectives`; merging re-ranks.

With ``sample_rows`` > 0 a uniform sample of whole pre-RoPE K tokens (every KV head, every channel) is
kept per layer together with each token's position (its index along the sequence axis, the
second-to-last axis of the k_proj output): the ``range`` objective needs the RoPE phase m·θ_k of every
row. Sampling is bottom-k on seeded uniform keys, so it is uniform without replacement; merging keeps the
smallest keys of the union, again a uniform sample of every row either side saw.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rope_quant.core.angles import PairCov
from rope_quant.core.rope import check_head_dim, check_layout, pair_indices
from rope_quant.io import atomic_write_bytes
from rope_quant.model import arch

STREAMS = ("q", "k")
POOLING_RULES = ("rows", "k_only", "balanced", "per_head")
_FORMAT_VERSION = 2
_READABLE_VERSIONS = (1, 2)  # version 1 files have no K sample
_STABLE = ("mean_a", "mean_b", "m2_aa", "m2_bb", "m2_ab")
_RAW = ("sum_a", "sum_b", "sum_aa", "sum_bb", "sum_ab")


class CalibrationError(ValueError):
    """Base class for bad calibration input or state."""


class NonFiniteCalibrationError(CalibrationError):
    """The calibration input of a (layer, stream) holds NaN or Inf values."""


class CalibrationShapeError(CalibrationError):
    """The calibration input or configuration has the wrong shape."""


class UnknownStreamError(CalibrationError):
    """A stream other than 'q' or 'k' was named."""


class UnknownPoolingRuleError(CalibrationError):
    """A pooling rule outside :data:`POOLING_RULES` was named."""


class EmptyStatisticsError(CalibrationError):
    """A covariance was asked for a layer/stream that has seen no rows."""


class IncompatibleStatsError(CalibrationError):
    """Two accumulators with different configurations were merged."""


class StatsFileError(CalibrationError):
    """A saved statistics file is malformed or of an unknown version."""


class MissingStatsFileError(FileNotFoundError, CalibrationError):
    """A statistics file does not exist."""


def _to_numpy64(x: Any) -> np.ndarray:
    """float64 CPU numpy copy of a torch tensor or array-like (no torch import unless given one)."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        import torch

        return x.detach().to(device="cpu", dtype=torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def _chan_merge(
    n1: np.ndarray, s1: dict[str, np.ndarray], n2: np.ndarray, s2: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Pairwise update (Chan et al.) of means and centred co-moments of two disjoint row sets.

    ``n1``/``n2`` broadcast against the moment arrays; empty sides (n = 0) are handled exactly.
    """
    n = n1 + n2
    safe = np.where(n > 0, n, 1).astype(np.float64)
    w2 = np.where(n > 0, n2 / safe, 0.0)
    cross = np.where(n > 0, (n1.astype(np.float64) * n2) / safe, 0.0)
    da = s2["mean_a"] - s1["mean_a"]
    db = s2["mean_b"] - s1["mean_b"]
    return {
        "mean_a": s1["mean_a"] + da * w2,
        "mean_b": s1["mean_b"] + db * w2,
        "m2_aa": s1["m2_aa"] + s2["m2_aa"] + da * da * cross,
        "m2_bb": s1["m2_bb"] + s2["m2_bb"] + db * db * cross,
        "m2_ab": s1["m2_ab"] + s2["m2_ab"] + da * db * cross,
    }


def _pool_stable(
    n: np.ndarray, s: dict[str, np.ndarray], axis: int
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Combine groups along ``axis`` (multi-group Chan update: add the raw sums, then centre once).

    M_total = Σ_g M_g + Σ_g n_g (μ_g - μ)(μ_g - μ)ᵀ, μ = Σ_g n_g μ_g / N. ``n`` broadcasts against ``s``.
    """
    n = np.broadcast_to(n, s["mean_a"].shape).astype(np.float64)
    total = n.sum(axis=axis)
    safe = np.where(total > 0, total, 1.0)
    mean_a = (n * s["mean_a"]).sum(axis=axis) / safe
    mean_b = (n * s["mean_b"]).sum(axis=axis) / safe
    da = s["mean_a"] - np.expand_dims(mean_a, axis)
    db = s["mean_b"] - np.expand_dims(mean_b, axis)
    out = {
        "mean_a": mean_a,
        "mean_b": mean_b,
        "m2_aa": s["m2_aa"].sum(axis=axis) + (n * da * da).sum(axis=axis),
        "m2_bb": s["m2_bb"].sum(axis=axis) + (n * db * db).sum(axis=axis),
        "m2_ab": s["m2_ab"].sum(axis=axis) + (n * da * db).sum(axis=axis),
    }
    return total, out


def _pool_raw(n: np.ndarray, s: dict[str, np.ndarray], axis: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Add the raw sums of the groups along ``axis`` (the paper's aggregation, App. A.2.1)."""
    n = np.broadcast_to(n, s["sum_a"].shape).astype(np.float64)
    return n.sum(axis=axis), {key: s[key].sum(axis=axis) for key in _RAW}


def _check_nonempty(total: np.ndarray, what: str) -> None:
    """Raise EmptyStatisticsError naming the layers without rows (``total`` has the layer axis first)."""
    flat = np.asarray(total).reshape(total.shape[0], -1)
    empty = np.flatnonzero((flat <= 0).any(axis=1))
    if empty.size:
        raise EmptyStatisticsError(f"no calibration rows for {what} in layer(s) {empty.tolist()}")


def _cov_from_stable(total: np.ndarray, s: dict[str, np.ndarray]) -> PairCov:
    return PairCov(s["m2_aa"] / total, s["m2_bb"] / total, s["m2_ab"] / total)


def _cov_from_raw(total: np.ndarray, s: dict[str, np.ndarray]) -> PairCov:
    """Σ = E[xxᵀ] - E[x]E[x]ᵀ from raw sums, exactly the paper's rule (no clamping)."""
    ma, mb = s["sum_a"] / total, s["sum_b"] / total
    return PairCov(
        s["sum_aa"] / total - ma * ma, s["sum_bb"] / total - mb * mb, s["sum_ab"] / total - ma * mb
    )


class CalibrationStats:
    """Mergeable float64 accumulators per (layer, stream, head, frequency pair) (App. A.2.1).

    ``update(layer, stream, x)`` takes a q_proj ("q", ``n_q_heads``) or k_proj ("k", ``n_kv_heads``)
    output before RoPE, shape (..., H*head_dim) in the model's native ``layout``; every leading axis
    (samples, positions) is folded into rows. The count n is shared by all heads and pairs of a
    (layer, stream), so it is stored once per (layer, stream).
    """

    def __init__(
        self,
        n_layers: int,
        n_q_heads: int,
        n_kv_heads: int,
        head_dim: int,
        layout: str = "rotate_half",
        topk: int = 256,
        topk_streams: Sequence[str] = ("k",),
        sample_rows: int = 0,
        sample_seed: int = 0,
    ) -> None:
        for name, value in (("n_layers", n_layers), ("n_q_heads", n_q_heads), ("n_kv_heads", n_kv_heads)):
            if int(value) != value or value < 1:
                raise CalibrationShapeError(f"{name} must be a positive integer, got {value!r}")
        if n_q_heads % n_kv_heads:
            raise CalibrationShapeError(
                f"n_q_heads={n_q_heads} is not a multiple of n_kv_heads={n_kv_heads} (GQA groups)"
            )
        if int(topk) != topk or topk < 0:
            raise CalibrationShapeError(f"topk must be a non-negative integer, got {topk!r}")
        if int(sample_rows) != sample_rows or sample_rows < 0:
            raise CalibrationShapeError(f"sample_rows must be a non-negative integer, got {sample_rows!r}")
        streams = tuple(topk_streams)
        for st in streams:
            if st not in STREAMS:
                raise UnknownStreamError(f"topk_streams: unknown stream {st!r}; expected one of {STREAMS}")
        self.n_pairs = check_head_dim(int(head_dim))
        self.layout = check_layout(layout)
        self.n_layers, self.n_q_heads, self.n_kv_heads = int(n_layers), int(n_q_heads), int(n_kv_heads)
        self.head_dim = int(head_dim)
        self.topk = int(topk)
        self.topk_streams = streams
        self._idx_a, self._idx_b = pair_indices(self.head_dim, self.layout)
        self._n: dict[str, np.ndarray] = {}
        self._acc: dict[str, dict[str, np.ndarray]] = {}
        for st in STREAMS:
            shape = (self.n_layers, self.heads(st), self.n_pairs)
            self._n[st] = np.zeros(self.n_layers, dtype=np.int64)
            self._acc[st] = {key: np.zeros(shape) for key in _STABLE + _RAW}
        self._cand = np.zeros((self.n_layers, self.topk, self.n_pairs, 2))
        self._cand_count = np.zeros(self.n_layers, dtype=np.int64)
        self.sample_rows, self.sample_seed = int(sample_rows), int(sample_seed)
        self._rng = np.random.default_rng(self.sample_seed)
        # per layer: (keys (n,), positions (n,), rows (n, H_kv, d) float32), bottom-k by key
        self._sample: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = [
            (np.zeros(0), np.zeros(0, dtype=np.int64), np.zeros((0, self.n_kv_heads, self.head_dim), np.float32))
            for _ in range(self.n_layers)
        ]

    # ------------------------------------------------------------------ configuration helpers

    def heads(self, stream: str) -> int:
        """Number of heads of a stream (Q: n_q_heads, K: n_kv_heads)."""
        return self.n_q_heads if self._stream(stream) == "q" else self.n_kv_heads

    @property
    def group_size(self) -> int:
        """Q heads per KV head (GQA group size)."""
        return self.n_q_heads // self.n_kv_heads

    def config(self) -> dict[str, Any]:
        return {
            "n_layers": self.n_layers,
            "n_q_heads": self.n_q_heads,
            "n_kv_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "layout": self.layout,
            "topk": self.topk,
            "topk_streams": list(self.topk_streams),
            "sample_rows": self.sample_rows,
            "sample_seed": self.sample_seed,
        }

    @staticmethod
    def _stream(stream: str) -> str:
        if stream not in STREAMS:
            raise UnknownStreamError(f"unknown stream {stream!r}; expected 'q' or 'k'")
        return stream

    def _layer(self, layer: int) -> int:
        if isinstance(layer, bool) or int(layer) != layer or not 0 <= layer < self.n_layers:
            raise CalibrationShapeError(f"layer {layer!r} is outside 0..{self.n_layers - 1}")
        return int(layer)

    def n_rows(self, stream: str) -> np.ndarray:
        """Rows seen per layer for ``stream`` (each row holds every head of that stream)."""
        return self._n[self._stream(stream)].copy()

    # ------------------------------------------------------------------ accumulation

    def update(self, layer: int, stream: str, x: Any) -> None:
        """Accumulate one batch of q_proj/k_proj outputs (pre-RoPE), shape (..., H*head_dim)."""
        stream = self._stream(stream)
        layer = self._layer(layer)
        H, d = self.heads(stream), self.head_dim
        arr = _to_numpy64(x)
        if arr.ndim < 1 or arr.shape[-1] != H * d:
            raise CalibrationShapeError(
                f"layer {layer}, stream {stream!r}: expected input of shape (..., {H}*{d}={H * d}) "
                f"({H} heads of dim {d}), got {tuple(arr.shape)}"
            )
        finite = np.isfinite(arr)
        if not finite.all():
            bad = int(arr.size - np.count_nonzero(finite))
            raise NonFiniteCalibrationError(
                f"layer {layer}, stream {stream!r}: {bad} non-finite value(s) (NaN/Inf) "
                "in the calibration input"
            )
        rows = arr.reshape(-1, H, d)
        if rows.shape[0] == 0:
            return
        a, b = rows[:, :, self._idx_a], rows[:, :, self._idx_b]  # (N, H, K)
        nb = rows.shape[0]
        batch = self._batch_moments(a, b)
        acc = self._acc[stream]
        old = {key: acc[key][layer] for key in _STABLE}
        merged = _chan_merge(np.int64(self._n[stream][layer]), old, np.int64(nb), batch)
        for key in _STABLE:
            acc[key][layer] = merged[key]
        acc["sum_a"][layer] += a.sum(axis=0)
        acc["sum_b"][layer] += b.sum(axis=0)
        acc["sum_aa"][layer] += np.einsum("nhk,nhk->hk", a, a)
        acc["sum_bb"][layer] += np.einsum("nhk,nhk->hk", b, b)
        acc["sum_ab"][layer] += np.einsum("nhk,nhk->hk", a, b)
        self._n[stream][layer] += nb
        if self.topk and stream in self.topk_streams:
            new = np.stack([a, b], axis=-1).reshape(-1, self.n_pairs, 2)  # rows = (token, head)
            self._push_candidates(layer, new)
        if self.sample_rows and stream == "k":
            if arr.ndim < 2:
                raise CalibrationShapeError(
                    f"layer {layer}: the K sample needs a sequence axis, input (..., seq, H*d), got {arr.shape}"
                )
            seq = arr.shape[-2]
            positions = np.broadcast_to(np.arange(seq), arr.shape[:-1]).reshape(-1)
            keys = self._rng.random(positions.size)
            self._push_sample(layer, keys, positions, rows.astype(np.float32))

    def _push_sample(self, layer: int, keys: np.ndarray, positions: np.ndarray, rows: np.ndarray) -> None:
        """Keep the ``sample_rows`` rows with the smallest keys of the kept and the new rows."""
        old = self._sample[layer]
        keys = np.concatenate([old[0], keys])
        positions = np.concatenate([old[1], positions])
        rows = np.concatenate([old[2], rows])
        if keys.size > self.sample_rows:
            keep = np.argpartition(keys, self.sample_rows - 1)[: self.sample_rows]
            keep.sort()
            keys, positions, rows = keys[keep], positions[keep], rows[keep]
        self._sample[layer] = (keys, positions, rows)

    def k_sample(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The K sample of a layer: pre-RoPE rows (n, H_kv, head_dim) float64 and positions (n,) int64."""
        layer = self._layer(layer)
        if not self.sample_rows:
            raise CalibrationError("no K sample was kept: build CalibrationStats with sample_rows > 0")
        _, positions, rows = self._sample[layer]
        if rows.shape[0] == 0:
            raise EmptyStatisticsError(f"layer {layer}: the K sample is empty (no K rows seen)")
        return rows.astype(np.float64), positions.copy()

    @staticmethod
    def _batch_moments(a: np.ndarray, b: np.ndarray) -> dict[str, np.ndarray]:
        """Means and centred co-moments of one batch; a constant column gets its value as mean exactly."""
        mean_a, mean_b = a.mean(axis=0), b.mean(axis=0)
        mean_a = np.where(a.max(axis=0) == a.min(axis=0), a[0], mean_a)
        mean_b = np.where(b.max(axis=0) == b.min(axis=0), b[0], mean_b)
        da, db = a - mean_a, b - mean_b
        return {
            "mean_a": mean_a,
            "mean_b": mean_b,
            "m2_aa": np.einsum("nhk,nhk->hk", da, da),
            "m2_bb": np.einsum("nhk,nhk->hk", db, db),
            "m2_ab": np.einsum("nhk,nhk->hk", da, db),
        }

    def _push_candidates(self, layer: int, new: np.ndarray) -> None:
        """Re-rank the union of kept and new rows (M, K, 2) by |a|+|b| per pair; keep the top k."""
        count = int(self._cand_count[layer])
        union = np.concatenate([self._cand[layer, :count], new], axis=0)
        keep = min(self.topk, union.shape[0])
        score = np.abs(union).sum(axis=-1)  # (M, K)
        if union.shape[0] > keep:
            idx = np.argpartition(-score, keep - 1, axis=0)[:keep]
        else:
            idx = np.broadcast_to(np.arange(keep)[:, None], score.shape).copy()
        kept_score = np.take_along_axis(score, idx, axis=0)
        order = np.argsort(-kept_score, axis=0, kind="stable")
        idx = np.take_along_axis(idx, order, axis=0)
        self._cand[layer, :keep] = np.take_along_axis(union, idx[:, :, None], axis=0)
        self._cand_count[layer] = keep

    def candidates(self, layer: int) -> np.ndarray:
        """Top-k candidate rows of a layer, shape (n_kept, K, 2) as (a, b), sorted by |a|+|b| descending."""
        layer = self._layer(layer)
        if not self.topk:
            raise CalibrationError("no candidate sets were kept (topk=0)")
        return self._cand[layer, : int(self._cand_count[layer])].copy()

    # ------------------------------------------------------------------ merging and persistence

    def merge(self, other: CalibrationStats) -> CalibrationStats:
        """Fold ``other`` (disjoint rows) into ``self`` in place (Chan update, summed raw sums).

        Returns self.
        """
        if not isinstance(other, CalibrationStats):
            raise IncompatibleStatsError(f"cannot merge {type(other).__name__} into CalibrationStats")
        mine, theirs = self.config(), other.config()
        mine.pop("sample_seed")
        theirs.pop("sample_seed")  # processes sample with their own seeds
        if mine != theirs:
            raise IncompatibleStatsError(f"configurations differ: {mine} vs {theirs}")
        for st in STREAMS:
            n1 = self._n[st][:, None, None]
            n2 = other._n[st][:, None, None]
            merged = _chan_merge(n1, self._acc[st], n2, other._acc[st])
            for key in _STABLE:
                self._acc[st][key] = merged[key]
            for key in _RAW:
                self._acc[st][key] = self._acc[st][key] + other._acc[st][key]
            self._n[st] = self._n[st] + other._n[st]
        if self.topk:
            for layer in range(self.n_layers):
                count = int(other._cand_count[layer])
                if count:
                    self._push_candidates(layer, other._cand[layer, :count])
        if self.sample_rows:
            for layer in range(self.n_layers):
                self._push_sample(layer, *other._sample[layer])
        return self

    def copy(self) -> CalibrationStats:
        """Deep copy."""
        out = CalibrationStats(**{**self.config(), "topk_streams": tuple(self.topk_streams)})
        out.merge(self)
        out._rng.bit_generator.state = self._rng.bit_generator.state
        return out

    def save(self, path: str | os.PathLike) -> Path:
        """Write the accumulators to a .npz file atomically (:func:`rope_quant.io.atomic_write_bytes`)."""
        path = Path(path)
        arrays: dict[str, np.ndarray] = {
            "meta": np.array(json.dumps({"version": _FORMAT_VERSION, **self.config()})),
            "cand": self._cand,
            "cand_count": self._cand_count,
        }
        for layer, (keys, positions, rows) in enumerate(self._sample):
            if self.sample_rows:
                arrays[f"sample_{layer}_keys"], arrays[f"sample_{layer}_pos"] = keys, positions
                arrays[f"sample_{layer}_rows"] = rows
        for st in STREAMS:
            arrays[f"{st}_n"] = self._n[st]
            for key in _STABLE + _RAW:
                arrays[f"{st}_{key}"] = self._acc[st][key]
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        atomic_write_bytes(path, buf.getvalue())
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> CalibrationStats:
        """Read accumulators written by :meth:`save`."""
        path = Path(path)
        if not path.is_file():
            raise MissingStatsFileError(f"calibration statistics file {str(path)!r} does not exist")
        try:
            with np.load(path, allow_pickle=False) as data:
                meta = json.loads(str(data["meta"]))
                if meta.pop("version", None) not in _READABLE_VERSIONS:
                    raise StatsFileError(f"{path}: unknown statistics format version")
                meta["topk_streams"] = tuple(meta["topk_streams"])
                out = cls(**meta)
                for st in STREAMS:
                    n = np.asarray(data[f"{st}_n"], dtype=np.int64)
                    if n.shape != out._n[st].shape:
                        raise StatsFileError(
                            f"{path}: {st}_n has shape {n.shape}, expected {out._n[st].shape}"
                        )
                    out._n[st] = n
                    for key in _STABLE + _RAW:
                        arr = np.asarray(data[f"{st}_{key}"], dtype=np.float64)
                        if arr.shape != out._acc[st][key].shape:
                            raise StatsFileError(f"{path}: {st}_{key} has shape {arr.shape}")
                        out._acc[st][key] = arr
                out._cand = np.asarray(data["cand"], dtype=np.float64).reshape(out._cand.shape)
                out._cand_count = np.asarray(data["cand_count"], dtype=np.int64)
                for layer in range(out.n_layers if out.sample_rows else 0):
                    rows = np.asarray(data[f"sample_{layer}_rows"], dtype=np.float32)
                    if rows.shape[1:] != (out.n_kv_heads, out.head_dim):
                        raise StatsFileError(f"{path}: sample_{layer}_rows has shape {rows.shape}")
                    out._sample[layer] = (np.asarray(data[f"sample_{layer}_keys"], dtype=np.float64),
                                          np.asarray(data[f"sample_{layer}_pos"], dtype=np.int64), rows)
        except (KeyError, ValueError, OSError) as exc:
            if isinstance(exc, CalibrationError):
                raise
            raise StatsFileError(f"{path} is not a valid calibration statistics file: {exc}") from exc
        return out

    # ------------------------------------------------------------------ pooled covariances

    def raw_moments(self, stream: str) -> dict[str, np.ndarray]:
        """The raw-moment sums of a stream: n (L,), sum_a, sum_b, sum_aa, sum_bb, sum_ab (L, H, K)."""
        st = self._stream(stream)
        return {"n": self._n[st].copy(), **{key: self._acc[st][key].copy() for key in _RAW}}

    def _grouped(self, rule: str, keys: tuple[str, ...]) -> tuple[np.ndarray, dict[str, np.ndarray], int]:
        """Per-head arrays arranged for ``rule``: (counts, arrays, group axis)."""
        L, K, g = self.n_layers, self.n_pairs, self.group_size
        nq = np.broadcast_to(self._n["q"][:, None, None], (L, self.n_q_heads, 1))
        nk = np.broadcast_to(self._n["k"][:, None, None], (L, self.n_kv_heads, 1))
        q, k = self._acc["q"], self._acc["k"]
        if rule == "rows":
            return (
                np.concatenate([nq, nk], axis=1),
                {key: np.concatenate([q[key], k[key]], axis=1) for key in keys},
                1,
            )
        if rule == "per_head":
            Hk = self.n_kv_heads
            n = np.concatenate([nq.reshape(L, Hk, g, 1), nk.reshape(L, Hk, 1, 1)], axis=2)
            arrays = {
                key: np.concatenate([q[key].reshape(L, Hk, g, K), k[key].reshape(L, Hk, 1, K)], axis=2)
                for key in keys
            }
            return n, arrays, 2
        raise AssertionError(rule)

    def _check_rule(self, rule: str) -> None:
        if rule not in POOLING_RULES:
            raise UnknownPoolingRuleError(f"unknown pooling rule {rule!r}; expected one of {POOLING_RULES}")

    def pooled(self, rule: str = "rows") -> PairCov:
        """Pooled per-pair covariance (divide by n) with the merge-stable moments.

        Shapes (n_layers, K), or (n_layers, n_kv_heads, K) for ``per_head``.
        """
        self._check_rule(rule)
        if rule == "k_only":
            n = self._n["k"][:, None, None]
            total, s = _pool_stable(n, self._acc["k"], axis=1)
            _check_nonempty(total, "stream 'k'")
            return _cov_from_stable(total, s)
        if rule == "balanced":
            covs, means = [], []
            for st in STREAMS:
                total, s = _pool_stable(self._n[st][:, None, None], self._acc[st], axis=1)
                _check_nonempty(total, f"stream {st!r} (balanced pooling needs both streams)")
                covs.append(_cov_from_stable(total, s))
                means.append((s["mean_a"], s["mean_b"]))
            da = means[0][0] - means[1][0]
            db = means[0][1] - means[1][1]
            return PairCov(
                (covs[0].s11 + covs[1].s11) / 2 + da * da / 4,
                (covs[0].s22 + covs[1].s22) / 2 + db * db / 4,
                (covs[0].s12 + covs[1].s12) / 2 + da * db / 4,
            )
        n, arrays, axis = self._grouped(rule, _STABLE)
        total, s = _pool_stable(n, arrays, axis=axis)
        _check_nonempty(total, "the Q and K streams")
        return _cov_from_stable(total, s)

    def pooled_raw(self, rule: str = "rows") -> PairCov:
        """The same pooled covariance reconstructed from the raw-moment sums (the paper's arithmetic).

        Equal to :meth:`pooled` in exact arithmetic; used by the φ* verifier (App. A.5).
        """
        self._check_rule(rule)
        if rule == "k_only":
            total, s = _pool_raw(self._n["k"][:, None, None], self._acc["k"], axis=1)
            _check_nonempty(total, "stream 'k'")
            return _cov_from_raw(total, s)
        if rule == "balanced":
            m1a, m1b, m2aa, m2bb, m2ab = 0.0, 0.0, 0.0, 0.0, 0.0
            for st in STREAMS:
                total, s = _pool_raw(self._n[st][:, None, None], self._acc[st], axis=1)
                _check_nonempty(total, f"stream {st!r} (balanced pooling needs both streams)")
                m1a = m1a + s["sum_a"] / total / 2
                m1b = m1b + s["sum_b"] / total / 2
                m2aa = m2aa + s["sum_aa"] / total / 2
                m2bb = m2bb + s["sum_bb"] / total / 2
                m2ab = m2ab + s["sum_ab"] / total / 2
            return PairCov(m2aa - m1a * m1a, m2bb - m1b * m1b, m2ab - m1a * m1b)
        n, arrays, axis = self._grouped(rule, _RAW)
        total, s = _pool_raw(n, arrays, axis=axis)
        _check_nonempty(total, "the Q and K streams")
        return _cov_from_raw(total, s)

    def pooled_mean(self, rule: str = "rows") -> tuple[np.ndarray, np.ndarray]:
        """Pooled pair means (ā, b̄) under ``rule`` (``balanced``: the average of the two stream means)."""
        self._check_rule(rule)
        if rule == "k_only":
            total, s = _pool_stable(self._n["k"][:, None, None], self._acc["k"], axis=1)
            _check_nonempty(total, "stream 'k'")
            return s["mean_a"], s["mean_b"]
        if rule == "balanced":
            parts = [_pool_stable(self._n[st][:, None, None], self._acc[st], axis=1) for st in STREAMS]
            for st, (total, _) in zip(STREAMS, parts, strict=True):
                _check_nonempty(total, f"stream {st!r}")
            return (
                (parts[0][1]["mean_a"] + parts[1][1]["mean_a"]) / 2,
                (parts[0][1]["mean_b"] + parts[1][1]["mean_b"]) / 2,
            )
        n, arrays, axis = self._grouped(rule, _STABLE)
        total, s = _pool_stable(n, arrays, axis=axis)
        _check_nonempty(total, "the Q and K streams")
        return s["mean_a"], s["mean_b"]


def merge_all(stats: Iterable[CalibrationStats]) -> CalibrationStats:
    """Merge several accumulators (e.g. from different processes) into a new one."""
    items = list(stats)
    if not items:
        raise CalibrationError("merge_all needs at least one CalibrationStats")
    out = items[0].copy()
    for other in items[1:]:
        out.merge(other)
    return out


def register_projection_hooks(model: Any, stats: CalibrationStats) -> list[Any]:
    """Feed ``stats`` from forward hooks on every layer's pre-RoPE query/key module.

    The modules come from :func:`rope_quant.model.arch.attention_modules`: q_proj/k_proj, or the per-head
    q/k norms where the family has them (what RoPE actually rotates; their (..., H, d) outputs are
    flattened to (..., H*d)). Returns the hook handles; call ``handle.remove()`` on each when done.
    """
    try:
        parts = arch.attention_modules(model)
    except arch.ArchitectureError as exc:
        raise CalibrationShapeError(f"cannot find the attention modules: {exc}") from exc
    handles = []
    for position, attn in enumerate(parts):
        layer = position if attn.layer_idx is None else attn.layer_idx
        for stream in ("q", "k"):
            mod, per_head = attn.pre_rope(stream)

            def hook(_mod: Any, _inp: Any, out: Any, layer: int = layer, stream: str = stream,
                     per_head: bool = per_head) -> None:
                stats.update(layer, stream, out.flatten(-2) if per_head else out)

            handles.append(mod.register_forward_hook(hook))
    return handles

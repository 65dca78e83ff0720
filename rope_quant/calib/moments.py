"""Streaming calibration statistics of the pre-RoPE query/key frequency pairs (App. A.2.1).

For every (layer, stream Q|K, head, frequency pair k) :class:`PairMoments` holds, in float64 on the CPU,
the row count n, the raw sums Σa, Σb, Σa², Σb², Σab of the pair's two channels (a, b), and an
equivalent merge-stable form: the means and the *centred* co-moments
M_aa = Σ(a-ā)², M_bb = Σ(b-b̄)², M_ab = Σ(a-ā)(b-b̄), combined with the pairwise update of
Chan, Golub & LeVeque (1979). In exact arithmetic the centred form equals the paper's raw-moment rule
(Σa²/n - (Σa/n)², ...); in floating point it keeps the covariance accurate when |mean| ≫ sd, where
the raw rule cancels catastrophically. Pooled covariances (:meth:`PairMoments.pooled`) use the
stable form; :meth:`PairMoments.pooled_raw` reproduces the paper's raw-moment arithmetic for the
φ* verifier (App. A.5).

Per-head accumulators are kept (H is small), so every pooling rule of :mod:`rope_quant.calib.rules`
(``rows``, ``k_only``, ``balanced``, ``per_head``) is derived after the fact from that one table.

:class:`CalibrationStats` composes the moments with the two optional components fed from the same
forward passes: the top-k candidate rows of the grid objectives (:mod:`rope_quant.calib.candidates`)
and the uniform K-token sample of the ``range`` objective (:mod:`rope_quant.calib.ksample`). It owns
the statistics file (format v2; v1 files, which have no K sample, still load): each component writes
and reads its own section of the arrays.
"""

from __future__ import annotations

import io
import json
import os
import zipfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rope_quant.calib.candidates import TopKCandidates
from rope_quant.calib.device_acc import DeviceAccumulator
from rope_quant.calib.errors import (
    CalibrationError,
    CalibrationShapeError,
    EmptyStatisticsError,
    IncompatibleStatsError,
    MissingStatsFileError,
    NonFiniteCalibrationError,
    StatsFileError,
    UnknownPoolingRuleError,
    UnknownStreamError,
    check_layer,
)
from rope_quant.calib.ksample import KSample
from rope_quant.calib.rules import POOLING, POOLING_RULES, STREAMS, PoolingRule, PoolSpec, check_stream, pool_spec
from rope_quant.core.angles import PairCov
from rope_quant.core.rope import check_head_dim, check_layout, pair_indices
from rope_quant.io import atomic_write_bytes
from rope_quant.model import arch

__all__ = [
    "POOLING",
    "POOLING_RULES",
    "STREAMS",
    "CalibrationError",
    "CalibrationShapeError",
    "CalibrationStats",
    "EmptyStatisticsError",
    "IncompatibleStatsError",
    "KSample",
    "MissingStatsFileError",
    "NonFiniteCalibrationError",
    "PairMoments",
    "PoolSpec",
    "PoolingRule",
    "StatsFileError",
    "TopKCandidates",
    "UnknownPoolingRuleError",
    "UnknownStreamError",
    "merge_all",
    "register_projection_hooks",
]

_FORMAT_VERSION = 2
_READABLE_VERSIONS = (1, 2)  # version 1 files have no K sample
_STABLE = ("mean_a", "mean_b", "m2_aa", "m2_bb", "m2_ab")
_RAW = ("sum_a", "sum_b", "sum_aa", "sum_bb", "sum_ab")
_Pooler = Callable[[np.ndarray, dict[str, np.ndarray], int], tuple[np.ndarray, dict[str, np.ndarray]]]


def _to_numpy_float(x: Any) -> np.ndarray:
    """A float32 or float64 CPU numpy view (a copy only where it must be) of a tensor or array-like.

    Every value converts exactly: float32/float64 as they are, bf16/fp16 widened to float32, anything
    else to float64. Callers widen to float64 where they compute, in numpy (on CPU many times faster
    than ``Tensor.to(float64)``).
    """
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        import torch

        t = x.detach().cpu()
        if t.dtype not in (torch.float32, torch.float64):
            t = t.to(torch.float32 if t.dtype.is_floating_point and t.dtype.itemsize < 4 else torch.float64)
        return t.numpy()
    arr = np.asarray(x)
    return arr if arr.dtype in (np.float32, np.float64) else arr.astype(np.float64)


def _as_slice(idx: np.ndarray) -> slice | np.ndarray:
    """An arithmetic index sequence as the equivalent slice (a strided copy is much cheaper than a gather)."""
    if idx.size > 1 and np.all(np.diff(idx) == idx[1] - idx[0]) and idx[1] > idx[0]:
        return slice(int(idx[0]), int(idx[-1]) + 1, int(idx[1] - idx[0]))
    return idx


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



def _mean_exact_constant(x: np.ndarray, total: np.ndarray) -> np.ndarray:
    """Column means of ``x`` (N, ...) from its column sums (``x.mean(axis=0)`` bit for bit); a constant
    column gets its value exactly.

    A column is constant iff its max equals its min; only the columns whose first, second and last rows
    agree can be, so max/min run on those alone (none, for real activations) instead of on every column.
    """
    mean = total / x.shape[0]
    maybe = (x[0] == x[-1]) & (x[0] == x[min(1, x.shape[0] - 1)])
    if maybe.any():
        cols = x[:, maybe]
        const = np.zeros_like(maybe)
        const[maybe] = cols.max(axis=0) == cols.min(axis=0)
        mean = np.where(const, x[0], mean)
    return mean


def _check_geometry(n_layers: int, n_q_heads: int, n_kv_heads: int) -> None:
    """Positive layer/head counts with whole GQA groups, else CalibrationShapeError."""
    for name, value in (("n_layers", n_layers), ("n_q_heads", n_q_heads), ("n_kv_heads", n_kv_heads)):
        if int(value) != value or value < 1:
            raise CalibrationShapeError(f"{name} must be a positive integer, got {value!r}")
    if n_q_heads % n_kv_heads:
        raise CalibrationShapeError(
            f"n_q_heads={n_q_heads} is not a multiple of n_kv_heads={n_kv_heads} (GQA groups)"
        )


class PairMoments:
    """Mergeable float64 moments per (layer, stream, head, frequency pair) and their pooling (App. A.2.1).

    The count n is shared by all heads and pairs of a (layer, stream), so it is stored once per
    (layer, stream). :meth:`update` takes the pair channels a, b of shape (N, H, K) of one batch.
    """

    def __init__(self, n_layers: int, n_q_heads: int, n_kv_heads: int, n_pairs: int) -> None:
        _check_geometry(n_layers, n_q_heads, n_kv_heads)
        self.n_layers, self.n_q_heads, self.n_kv_heads = int(n_layers), int(n_q_heads), int(n_kv_heads)
        self.n_pairs = int(n_pairs)
        self._n: dict[str, np.ndarray] = {}
        self._acc: dict[str, dict[str, np.ndarray]] = {}
        for st in STREAMS:
            shape = (self.n_layers, self.heads(st), self.n_pairs)
            self._n[st] = np.zeros(self.n_layers, dtype=np.int64)
            self._acc[st] = {key: np.zeros(shape) for key in _STABLE + _RAW}

    def config(self) -> dict[str, Any]:
        return {"n_layers": self.n_layers, "n_q_heads": self.n_q_heads, "n_kv_heads": self.n_kv_heads,
                "n_pairs": self.n_pairs}

    def heads(self, stream: str) -> int:
        """Number of heads of a stream (Q: n_q_heads, K: n_kv_heads)."""
        return self.n_q_heads if check_stream(stream) == "q" else self.n_kv_heads

    @property
    def group_size(self) -> int:
        """Q heads per KV head (GQA group size)."""
        return self.n_q_heads // self.n_kv_heads

    def n_rows(self, stream: str) -> np.ndarray:
        """Rows seen per layer for ``stream`` (each row holds every head of that stream)."""
        return self._n[check_stream(stream)].copy()

    # ------------------------------------------------------------------ accumulation

    def update(
        self,
        layer: int,
        stream: str,
        a: np.ndarray,
        b: np.ndarray,
        sums: tuple[np.ndarray, np.ndarray] | None = None,
        overwrite: bool = False,
    ) -> None:
        """Fold one batch of pair channels a, b (N, H, K) float64 into (layer, stream).

        ``sums`` = (a.sum(axis=0), b.sum(axis=0)) when the caller already has them (one pass fewer; the
        batch mean is that sum divided by N, exactly what ``mean`` computes). With ``overwrite`` the
        caller's a and b are centred in place (no temporaries; same values as ``a - mean``).
        """
        stream = check_stream(stream)
        layer = check_layer(layer, self.n_layers)
        nb = a.shape[0]
        sum_a, sum_b = (a.sum(axis=0), b.sum(axis=0)) if sums is None else sums
        acc = self._acc[stream]
        acc["sum_a"][layer] += sum_a
        acc["sum_b"][layer] += sum_b
        acc["sum_aa"][layer] += np.einsum("nhk,nhk->hk", a, a)
        acc["sum_bb"][layer] += np.einsum("nhk,nhk->hk", b, b)
        acc["sum_ab"][layer] += np.einsum("nhk,nhk->hk", a, b)
        batch = self._batch_moments(a, b, sum_a, sum_b, overwrite)
        old = {key: acc[key][layer] for key in _STABLE}
        merged = _chan_merge(np.int64(self._n[stream][layer]), old, np.int64(nb), batch)
        for key in _STABLE:
            acc[key][layer] = merged[key]
        self._n[stream][layer] += nb

    def fold(self, layer: int, stream: str, n: int, arrays: Mapping[str, np.ndarray]) -> None:
        """Fold the moments of ``n`` rows accumulated elsewhere (a device accumulator: means, centred
        co-moments and raw sums, (H, K) each) into (layer, stream), with the same merge as :meth:`update`."""
        acc = self._acc[stream]
        for key in _RAW:
            acc[key][layer] += arrays[key]
        old = {key: acc[key][layer] for key in _STABLE}
        merged = _chan_merge(np.int64(self._n[stream][layer]), old, np.int64(n), dict(arrays))
        for key in _STABLE:
            acc[key][layer] = merged[key]
        self._n[stream][layer] += n

    @staticmethod
    def _batch_moments(
        a: np.ndarray, b: np.ndarray, sum_a: np.ndarray, sum_b: np.ndarray, overwrite: bool = False
    ) -> dict[str, np.ndarray]:
        """Means and centred co-moments of one batch; a constant column gets its value as mean exactly."""
        mean_a = _mean_exact_constant(a, sum_a)
        mean_b = _mean_exact_constant(b, sum_b)
        if overwrite:
            da, db = np.subtract(a, mean_a, out=a), np.subtract(b, mean_b, out=b)
        else:
            da, db = a - mean_a, b - mean_b
        return {
            "mean_a": mean_a,
            "mean_b": mean_b,
            "m2_aa": np.einsum("nhk,nhk->hk", da, da),
            "m2_bb": np.einsum("nhk,nhk->hk", db, db),
            "m2_ab": np.einsum("nhk,nhk->hk", da, db),
        }

    def merge(self, other: PairMoments) -> PairMoments:
        """Fold ``other`` (disjoint rows) into ``self`` in place (Chan update, summed raw sums). Returns self."""
        if not isinstance(other, PairMoments) or other.config() != self.config():
            theirs = other.config() if isinstance(other, PairMoments) else type(other).__name__
            raise IncompatibleStatsError(f"cannot merge moments {theirs} into {self.config()}")
        for st in STREAMS:
            n1 = self._n[st][:, None, None]
            n2 = other._n[st][:, None, None]
            merged = _chan_merge(n1, self._acc[st], n2, other._acc[st])
            for key in _STABLE:
                self._acc[st][key] = merged[key]
            for key in _RAW:
                self._acc[st][key] = self._acc[st][key] + other._acc[st][key]
            self._n[st] = self._n[st] + other._n[st]
        return self

    # ------------------------------------------------------------------ file section

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The file section: ``{q,k}_n`` (L,) and ``{q,k}_{moment}`` (L, H, K) for every stable and raw moment."""
        arrays: dict[str, np.ndarray] = {}
        for st in STREAMS:
            arrays[f"{st}_n"] = self._n[st]
            for key in _STABLE + _RAW:
                arrays[f"{st}_{key}"] = self._acc[st][key]
        return arrays

    def load_arrays(self, data: Mapping[str, Any]) -> None:
        """Fill from a file section written by :meth:`to_arrays` (KeyError/StatsFileError if malformed)."""
        for st in STREAMS:
            n = np.asarray(data[f"{st}_n"], dtype=np.int64)
            if n.shape != self._n[st].shape:
                raise StatsFileError(f"{st}_n has shape {n.shape}, expected {self._n[st].shape}")
            self._n[st] = n
            for key in _STABLE + _RAW:
                arr = np.asarray(data[f"{st}_{key}"], dtype=np.float64)
                if arr.shape != self._acc[st][key].shape:
                    raise StatsFileError(f"{st}_{key} has shape {arr.shape}")
                self._acc[st][key] = arr

    # ------------------------------------------------------------------ pooled covariances

    def raw_moments(self, stream: str) -> dict[str, np.ndarray]:
        """The raw-moment sums of a stream: n (L,), sum_a, sum_b, sum_aa, sum_bb, sum_ab (L, H, K)."""
        st = check_stream(stream)
        return {"n": self._n[st].copy(), **{key: self._acc[st][key].copy() for key in _RAW}}

    def _grouped(
        self, streams: tuple[str, ...], per_kv_head: bool, keys: tuple[str, ...]
    ) -> tuple[np.ndarray, dict[str, np.ndarray], int]:
        """Per-head counts and arrays of ``streams`` side by side along the group axis: (counts, arrays, axis).

        One group per layer (axis 1, every head), or with ``per_kv_head`` one per KV head (axis 2: the
        Q heads of its GQA group, then the K head).
        """
        L, K, Hk = self.n_layers, self.n_pairs, self.n_kv_heads
        counts = [np.broadcast_to(self._n[st][:, None, None], (L, self.heads(st), 1)) for st in streams]
        arrays = [self._acc[st] for st in streams]
        if not per_kv_head:
            return (
                np.concatenate(counts, axis=1),
                {key: np.concatenate([acc[key] for acc in arrays], axis=1) for key in keys},
                1,
            )
        per = [self.heads(st) // Hk for st in streams]
        return (
            np.concatenate([c.reshape(L, Hk, g, 1) for c, g in zip(counts, per, strict=True)], axis=2),
            {
                key: np.concatenate([acc[key].reshape(L, Hk, g, K) for acc, g in zip(arrays, per, strict=True)],
                                    axis=2)
                for key in keys
            },
            2,
        )

    def _pool_parts(
        self, rule: str, keys: tuple[str, ...], pool: _Pooler
    ) -> tuple[PoolSpec, list[tuple[np.ndarray, dict[str, np.ndarray]]]]:
        """Look ``rule`` up in :data:`POOLING` and pool its rows: one (total, moments) part per row set.

        Rows weighted by count form one part; equal stream weights give one part per stream, in table order.
        """
        spec = pool_spec(rule)
        row_sets = [(st,) for st in spec.streams] if spec.equal_stream_weights else [spec.streams]
        parts = []
        for streams in row_sets:
            n, arrays, axis = self._grouped(streams, spec.per_kv_head, keys)
            total, s = pool(n, arrays, axis)
            if len(streams) > 1:
                what = "the " + " and ".join(st.upper() for st in streams) + " streams"
            else:
                what = f"stream {streams[0]!r}"
                if spec.equal_stream_weights:
                    what += f" ({PoolingRule(rule)} pooling needs both streams)"
            _check_nonempty(total, what)
            parts.append((total, s))
        return spec, parts

    def per_head(self, stream: str) -> PairCov:
        """Unpooled per-head covariance of one stream (merge-stable moments / n), shapes (n_layers, H, K)."""
        st = check_stream(stream)
        _check_nonempty(self._n[st], f"stream {st!r}")
        n = self._n[st][:, None, None].astype(np.float64)
        acc = self._acc[st]
        return PairCov(acc["m2_aa"] / n, acc["m2_bb"] / n, acc["m2_ab"] / n)

    def pooled(self, rule: str = "rows") -> PairCov:
        """Pooled per-pair covariance (divide by n) with the merge-stable moments.

        Shapes (n_layers, K), or (n_layers, n_kv_heads, K) for ``per_head``.
        """
        spec, parts = self._pool_parts(rule, _STABLE, _pool_stable)
        covs = [_cov_from_stable(total, s) for total, s in parts]
        if not spec.equal_stream_weights:
            return covs[0]
        (_, s0), (_, s1) = parts
        da = s0["mean_a"] - s1["mean_a"]
        db = s0["mean_b"] - s1["mean_b"]
        return PairCov(
            (covs[0].s11 + covs[1].s11) / 2 + da * da / 4,
            (covs[0].s22 + covs[1].s22) / 2 + db * db / 4,
            (covs[0].s12 + covs[1].s12) / 2 + da * db / 4,
        )

    def pooled_raw(self, rule: str = "rows") -> PairCov:
        """The same pooled covariance reconstructed from the raw-moment sums (the paper's arithmetic).

        Equal to :meth:`pooled` in exact arithmetic; used by the φ* verifier (App. A.5).
        """
        spec, parts = self._pool_parts(rule, _RAW, _pool_raw)
        if not spec.equal_stream_weights:
            return _cov_from_raw(*parts[0])
        m1a, m1b, m2aa, m2bb, m2ab = 0.0, 0.0, 0.0, 0.0, 0.0
        w = len(parts)
        for total, s in parts:
            m1a = m1a + s["sum_a"] / total / w
            m1b = m1b + s["sum_b"] / total / w
            m2aa = m2aa + s["sum_aa"] / total / w
            m2bb = m2bb + s["sum_bb"] / total / w
            m2ab = m2ab + s["sum_ab"] / total / w
        return PairCov(m2aa - m1a * m1a, m2bb - m1b * m1b, m2ab - m1a * m1b)

    def pooled_mean(self, rule: str = "rows") -> tuple[np.ndarray, np.ndarray]:
        """Pooled pair means (ā, b̄) under ``rule`` (``balanced``: the average of the two stream means)."""
        spec, parts = self._pool_parts(rule, _STABLE, _pool_stable)
        if not spec.equal_stream_weights:
            return parts[0][1]["mean_a"], parts[0][1]["mean_b"]
        (_, s0), (_, s1) = parts
        return (s0["mean_a"] + s1["mean_a"]) / 2, (s0["mean_b"] + s1["mean_b"]) / 2


class CalibrationStats:
    """The calibration statistics of one model: pair moments, top-k candidates and K sample (App. A.2.1).

    ``update(layer, stream, x)`` takes a q_proj ("q", ``n_q_heads``) or k_proj ("k", ``n_kv_heads``)
    output before RoPE, shape (..., H*head_dim) in the model's native ``layout``; every leading axis
    (samples, positions) is folded into rows and fed to :attr:`moments`, to :attr:`topk_candidates`
    (``topk`` rows per (layer, pair) from ``topk_streams``; ``topk`` = 0 keeps none) and, for K, to
    :attr:`ksample` (``sample_rows`` tokens per layer; 0 keeps none).
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
        _check_geometry(n_layers, n_q_heads, n_kv_heads)
        self.n_pairs = check_head_dim(int(head_dim))
        self.layout = check_layout(layout)
        self.n_layers, self.n_q_heads, self.n_kv_heads = int(n_layers), int(n_q_heads), int(n_kv_heads)
        self.head_dim = int(head_dim)
        self._moments = PairMoments(self.n_layers, self.n_q_heads, self.n_kv_heads, self.n_pairs)
        self._topk_candidates = TopKCandidates(self.n_layers, self.n_pairs, topk, topk_streams)
        self._ksample = KSample(self.n_layers, self.n_kv_heads, self.head_dim, sample_rows, sample_seed)
        self.topk, self.topk_streams = self._topk_candidates.topk, self._topk_candidates.streams
        self.sample_rows, self.sample_seed = self._ksample.size, self._ksample.seed
        self._idx_a, self._idx_b = pair_indices(self.head_dim, self.layout)
        self._sel_a, self._sel_b = _as_slice(self._idx_a), _as_slice(self._idx_b)
        self._device = DeviceAccumulator(self.n_pairs, self.topk, self.topk_streams, self.sample_rows)

    # ------------------------------------------------------------------ the host components (device rows folded in)

    @property
    def moments(self) -> PairMoments:
        """The pair moments (rows accumulated on a device are copied in first)."""
        self.finalize()
        return self._moments

    @property
    def topk_candidates(self) -> TopKCandidates:
        """The top-k candidate rows (rows accumulated on a device are copied in first)."""
        self.finalize()
        return self._topk_candidates

    @property
    def ksample(self) -> KSample:
        """The K sample (rows accumulated on a device are copied in first)."""
        self.finalize()
        return self._ksample

    def finalize(self) -> None:
        """Copy what torch batches accumulated on their device to the host (one transfer) and fold it in.

        Every reader calls this first; a calibration pass calls it once at its end. Raises
        :class:`NonFiniteCalibrationError` naming the (layer, stream) if a device batch held NaN/Inf (the
        device rows are then dropped: the host statistics keep only what was folded in before).
        """
        if self._device.empty():
            return
        drained = self._device.drain()
        bad = {where: count for where, count in drained.bad.items() if count}
        if bad:
            where = ", ".join(f"layer {layer}, stream {st!r}: non-finite values (NaN/Inf) in {count} "
                              "(head, pair) column(s)" for (layer, st), count in sorted(bad.items()))
            raise NonFiniteCalibrationError(f"{where} in the calibration input")
        for (layer, stream), (n, arrays) in sorted(drained.moments.items()):
            self._moments.fold(layer, stream, n, arrays)
        for layer, rows in sorted(drained.candidates.items()):
            self._topk_candidates.push(layer, rows)
        for layer, (keys, positions, rows) in sorted(drained.sample.items()):
            self._ksample.push(layer, keys, positions, rows)

    # ------------------------------------------------------------------ configuration helpers

    def heads(self, stream: str) -> int:
        """Number of heads of a stream (Q: n_q_heads, K: n_kv_heads)."""
        return self._moments.heads(stream)

    @property
    def group_size(self) -> int:
        """Q heads per KV head (GQA group size)."""
        return self._moments.group_size

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

    def n_rows(self, stream: str) -> np.ndarray:
        """Rows seen per layer for ``stream`` (each row holds every head of that stream)."""
        return self.moments.n_rows(stream)

    # ------------------------------------------------------------------ accumulation

    def update(self, layer: int, stream: str, x: Any) -> None:
        """Accumulate one batch of q_proj/k_proj outputs (pre-RoPE), shape (..., H*head_dim).

        A torch tensor is accumulated on its own device (:mod:`rope_quant.calib.device_acc`, no host
        synchronisation; a NaN/Inf is reported by :meth:`finalize`); anything else on the host in numpy (a
        NaN/Inf raises at once).
        """
        stream = check_stream(stream)
        layer = check_layer(layer, self.n_layers)
        H, d = self.heads(stream), self.head_dim
        if isinstance(x, torch.Tensor):
            self._update_device(layer, stream, x.detach())
            return
        arr = _to_numpy_float(x)  # float32 or float64; widened to float64 below while selecting the pairs
        self._check_shape(layer, stream, arr.shape)
        rows = arr.reshape(-1, H, d)
        if rows.shape[0] == 0:
            return
        # (N, H, K) C-contiguous float64 copies, the layout the fancy-index gather gave (the einsums see it)
        a = np.array(rows[:, :, self._sel_a], dtype=np.float64, order="C")
        b = np.array(rows[:, :, self._sel_b], dtype=np.float64, order="C")
        sums = a.sum(axis=0), b.sum(axis=0)
        # A non-finite input makes its column's sum non-finite (float64 sums of the rows cannot overflow
        # otherwise short of ~1e308 inputs), so the full elementwise check runs only when a sum is.
        if not (np.isfinite(sums[0]).all() and np.isfinite(sums[1]).all()):
            finite = np.isfinite(arr)
            if not finite.all():
                bad = int(arr.size - np.count_nonzero(finite))
                raise NonFiniteCalibrationError(
                    f"layer {layer}, stream {stream!r}: {bad} non-finite value(s) (NaN/Inf) "
                    "in the calibration input"
                )
        self.finalize()  # device rows first, so the host sees every batch in order
        self._topk_candidates.update(layer, stream, a, b)
        if stream == "k":
            self._ksample.update(layer, arr.shape, rows)  # float32 rows cast exactly as before
        self._moments.update(layer, stream, a, b, sums=sums, overwrite=True)  # centres a, b in place

    def _check_shape(self, layer: int, stream: str, shape: tuple[int, ...]) -> None:
        H, d = self.heads(stream), self.head_dim
        if len(shape) < 1 or shape[-1] != H * d:
            raise CalibrationShapeError(
                f"layer {layer}, stream {stream!r}: expected input of shape (..., {H}*{d}={H * d}) "
                f"({H} heads of dim {d}), got {tuple(shape)}"
            )

    def _update_device(self, layer: int, stream: str, x: torch.Tensor) -> None:
        """:meth:`update` for a torch tensor: shape checks on the host, arithmetic on ``x.device``."""
        H, d = self.heads(stream), self.head_dim
        self._check_shape(layer, stream, x.shape)
        rows = x.reshape(-1, H, d)
        if rows.shape[0] == 0:
            return
        keys = None
        if stream == "k" and self.sample_rows:
            keys = self._ksample.draw_keys(layer, tuple(x.shape))
        self._device.update(layer, stream, x, rows, self._sel_a, self._sel_b, keys)

    def candidates(self, layer: int) -> np.ndarray:
        """Top-k candidate rows of a layer, shape (n_kept, K, 2) as (a, b), sorted by |a|+|b| descending."""
        return self.topk_candidates.candidates(layer)

    def k_sample(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The K sample of a layer: pre-RoPE rows (n, H_kv, head_dim) float64 and positions (n,) int64."""
        return self.ksample.sample(layer)

    # ------------------------------------------------------------------ merging and persistence

    def merge(self, other: CalibrationStats) -> CalibrationStats:
        """Fold ``other`` (disjoint rows) into ``self`` in place, component by component.

        Returns self.
        """
        if not isinstance(other, CalibrationStats):
            raise IncompatibleStatsError(f"cannot merge {type(other).__name__} into CalibrationStats")
        mine, theirs = self.config(), other.config()
        mine.pop("sample_seed")
        theirs.pop("sample_seed")  # processes sample with their own seeds
        if mine != theirs:
            raise IncompatibleStatsError(f"configurations differ: {mine} vs {theirs}")
        self.moments.merge(other.moments)
        self.topk_candidates.merge(other.topk_candidates)
        self.ksample.merge(other.ksample)
        return self

    def copy(self) -> CalibrationStats:
        """Deep copy."""
        out = CalibrationStats(**{**self.config(), "topk_streams": tuple(self.topk_streams)})
        out.merge(self)
        out.ksample.copy_rng_state(self.ksample)
        return out

    def save(self, path: str | os.PathLike, k_sample: bool = True) -> Path:
        """Write the accumulators to a .npz file atomically (:func:`rope_quant.io.atomic_write_bytes`).

        ``k_sample=False`` leaves the K sample out (it is most of the file; the file then loads as
        statistics with ``sample_rows=0``, the moments and candidates unchanged).
        """
        path = Path(path)
        config = self.config() if k_sample else {**self.config(), "sample_rows": 0}
        arrays: dict[str, np.ndarray] = {
            "meta": np.array(json.dumps({"version": _FORMAT_VERSION, **config})),
            **self.topk_candidates.to_arrays(),
            **(self.ksample.to_arrays() if k_sample else {}),
            **self.moments.to_arrays(),
        }
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        atomic_write_bytes(path, buf.getvalue())
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> CalibrationStats:
        """Read accumulators written by :meth:`save`; a truncated or malformed file raises
        :class:`StatsFileError` naming it."""
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
                try:
                    for part in (out.moments, out.topk_candidates, out.ksample):
                        part.load_arrays(data)
                except StatsFileError as exc:
                    raise StatsFileError(f"{path}: {exc}") from exc
        except (KeyError, ValueError, OSError, EOFError, TypeError, zipfile.BadZipFile) as exc:
            if isinstance(exc, CalibrationError):
                raise
            raise StatsFileError(f"{path} is not a valid calibration statistics file "
                                 f"({type(exc).__name__}: {exc})") from exc
        return out

    # ------------------------------------------------------------------ pooled covariances

    def raw_moments(self, stream: str) -> dict[str, np.ndarray]:
        """The raw-moment sums of a stream: n (L,), sum_a, sum_b, sum_aa, sum_bb, sum_ab (L, H, K)."""
        return self.moments.raw_moments(stream)

    def per_head(self, stream: str) -> PairCov:
        """Unpooled per-head covariance of one stream (see :meth:`PairMoments.per_head`)."""
        return self.moments.per_head(stream)

    def pooled(self, rule: str = "rows") -> PairCov:
        """Pooled per-pair covariance under ``rule`` (see :meth:`PairMoments.pooled`)."""
        return self.moments.pooled(rule)

    def pooled_raw(self, rule: str = "rows") -> PairCov:
        """The pooled covariance from the raw-moment sums (see :meth:`PairMoments.pooled_raw`)."""
        return self.moments.pooled_raw(rule)

    def pooled_mean(self, rule: str = "rows") -> tuple[np.ndarray, np.ndarray]:
        """Pooled pair means (ā, b̄) under ``rule`` (see :meth:`PairMoments.pooled_mean`)."""
        return self.moments.pooled_mean(rule)


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
    q/k norms where the family has them (what RoPE actually rotates; their (..., L, H, d) outputs, or
    (b, H, L, d) ones transposed first where the family norms after the head transpose, are flattened to
    (..., L, H*d)). Returns the hook handles; call ``handle.remove()`` on each when done.
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
            heads_first = per_head and attn.norm_heads_first  # Gemma 3: (b, H, L, d) -> (b, L, H, d) first

            def hook(_mod: Any, _inp: Any, out: Any, layer: int = layer, stream: str = stream,
                     per_head: bool = per_head, heads_first: bool = heads_first) -> None:
                if heads_first:
                    out = out.transpose(-3, -2)
                stats.update(layer, stream, out.flatten(-2) if per_head else out)

            handles.append(mod.register_forward_hook(hook))
    return handles

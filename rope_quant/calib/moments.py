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

The statistics of a model (these moments with the top-k candidates and the K sample) and their file are
:class:`rope_quant.calib.stats.CalibrationStats`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from rope_quant.calib.candidates import TopKCandidates
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

__all__ = [
    "POOLING",
    "POOLING_RULES",
    "STREAMS",
    "CalibrationError",
    "CalibrationShapeError",
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
]

_STABLE = ("mean_a", "mean_b", "m2_aa", "m2_bb", "m2_ab")
_RAW = ("sum_a", "sum_b", "sum_aa", "sum_bb", "sum_ab")
_Pooler = Callable[[np.ndarray, dict[str, np.ndarray], int], tuple[np.ndarray, dict[str, np.ndarray]]]


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

"""A frozen copy of the host (numpy, float64) calibration update, written plainly: the specification that the
device path (:mod:`rope_quant.calib.device_acc`) and the host fast path are compared against.

One float64 copy, max/min for constant columns, ``mean``, the elementwise finiteness check, the Chan et al.
merge, the top-k on the stacked union (|a|+|b|, ties by row index), and the bottom-k K sample cast to float32
before selection. The K sample's keys come from one generator per layer seeded by (seed, layer), as
:class:`rope_quant.calib.ksample.KSample` draws them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rope_quant.calib.moments import NonFiniteCalibrationError, _chan_merge
from rope_quant.core.rope import pair_indices

MOMENT_KEYS = ("mean_a", "mean_b", "m2_aa", "m2_bb", "m2_ab", "sum_a", "sum_b", "sum_aa", "sum_bb", "sum_ab")


class ReferenceStats:
    """The update of moments, candidates and K sample of ``CalibrationStats`` before the device path."""

    def __init__(self, n_layers: int, n_q: int, n_kv: int, head_dim: int, layout: str, topk: int,
                 sample_rows: int, seed: int = 0) -> None:
        self.L, self.HQ, self.HK, self.D, self.K = n_layers, n_q, n_kv, head_dim, head_dim // 2
        self.ia, self.ib = pair_indices(head_dim, layout)
        self.n = {st: np.zeros(n_layers, np.int64) for st in "qk"}
        self.acc = {st: {k: np.zeros((n_layers, n_q if st == "q" else n_kv, self.K)) for k in MOMENT_KEYS}
                    for st in "qk"}
        self.topk, self.cand, self.count = topk, np.zeros((n_layers, topk, self.K, 2)), np.zeros(n_layers, np.int64)
        self.size = sample_rows
        self.rngs = [np.random.default_rng([seed, layer]) for layer in range(n_layers)]
        self.sample = [(np.zeros(0), np.zeros(0, np.int64), np.zeros((0, n_kv, head_dim), np.float32))
                       for _ in range(n_layers)]

    def update(self, layer: int, stream: str, x: Any) -> None:
        H, D, K = (self.HQ if stream == "q" else self.HK), self.D, self.K
        if isinstance(x, torch.Tensor):
            arr = x.detach().to(torch.float64).numpy()
        else:
            arr = np.asarray(x, np.float64)
        if not np.isfinite(arr).all():
            raise NonFiniteCalibrationError("non-finite")
        rows = arr.reshape(-1, H, D)
        a, b = rows[:, :, self.ia], rows[:, :, self.ib]
        mean_a = np.where(a.max(axis=0) == a.min(axis=0), a[0], a.mean(axis=0))
        mean_b = np.where(b.max(axis=0) == b.min(axis=0), b[0], b.mean(axis=0))
        da, db = a - mean_a, b - mean_b
        batch = {"mean_a": mean_a, "mean_b": mean_b, "m2_aa": np.einsum("nhk,nhk->hk", da, da),
                 "m2_bb": np.einsum("nhk,nhk->hk", db, db), "m2_ab": np.einsum("nhk,nhk->hk", da, db)}
        acc = self.acc[stream]
        old = {k: acc[k][layer] for k in batch}
        merged = _chan_merge(np.int64(self.n[stream][layer]), old, np.int64(a.shape[0]), batch)
        for k in batch:
            acc[k][layer] = merged[k]
        acc["sum_a"][layer] += a.sum(axis=0)
        acc["sum_b"][layer] += b.sum(axis=0)
        acc["sum_aa"][layer] += np.einsum("nhk,nhk->hk", a, a)
        acc["sum_bb"][layer] += np.einsum("nhk,nhk->hk", b, b)
        acc["sum_ab"][layer] += np.einsum("nhk,nhk->hk", a, b)
        self.n[stream][layer] += a.shape[0]
        if stream != "k":
            return
        if self.topk:
            count = int(self.count[layer])
            union = np.concatenate([self.cand[layer, :count], np.stack([a, b], -1).reshape(-1, K, 2)])
            keep = min(self.topk, union.shape[0])
            score = np.abs(union).sum(axis=-1)
            if union.shape[0] > keep:
                idx = np.argpartition(-score, keep - 1, axis=0)[:keep]
            else:
                idx = np.broadcast_to(np.arange(keep)[:, None], score.shape).copy()
            order = np.argsort(-np.take_along_axis(score, idx, axis=0), axis=0, kind="stable")
            idx = np.take_along_axis(idx, order, axis=0)
            self.cand[layer, :keep] = np.take_along_axis(union, idx[:, :, None], axis=0)
            self.count[layer] = keep
        if self.size:
            positions = np.broadcast_to(np.arange(arr.shape[-2]), arr.shape[:-1]).reshape(-1)
            old_s = self.sample[layer]
            keys = np.concatenate([old_s[0], self.rngs[layer].random(positions.size)])
            pos = np.concatenate([old_s[1], positions])
            kept = np.concatenate([old_s[2], rows.astype(np.float32)])
            if keys.size > self.size:
                sel = np.argpartition(keys, self.size - 1)[: self.size]
                sel.sort()
                keys, pos, kept = keys[sel], pos[sel], kept[sel]
            self.sample[layer] = (keys, pos, kept)

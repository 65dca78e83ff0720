"""The calibration pass's fast path is bit-identical to the plain float64 arithmetic it replaced.

``_Reference`` below is that arithmetic written out directly (one float64 copy, max/min for constant
columns, ``mean``, the elementwise finiteness check, the top-k on the stacked union, the K sample cast
before selection). Every array of the statistics file must match it bit for bit, on inputs that exercise
the special cases: constant columns, |mean| >> sd, exact zeros of both signs, bf16 and numpy inputs,
several batches per layer, both RoPE layouts.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rope_quant.calib.moments import CalibrationStats, NonFiniteCalibrationError, _chan_merge
from rope_quant.core.rope import pair_indices

L, HQ, HK, D = 2, 4, 2, 8
K = D // 2


class _Reference:
    """The earlier update of moments, candidates and K sample, written plainly (the specification)."""

    def __init__(self, layout: str, topk: int, sample_rows: int, seed: int = 0) -> None:
        self.ia, self.ib = pair_indices(D, layout)
        self.n = {st: np.zeros(L, np.int64) for st in "qk"}
        keys = ("mean_a", "mean_b", "m2_aa", "m2_bb", "m2_ab", "sum_a", "sum_b", "sum_aa", "sum_bb", "sum_ab")
        self.acc = {st: {k: np.zeros((L, HQ if st == "q" else HK, K)) for k in keys} for st in "qk"}
        self.topk, self.cand, self.count = topk, np.zeros((L, topk, K, 2)), np.zeros(L, np.int64)
        self.size, self.rng = sample_rows, np.random.default_rng(seed)
        self.sample = [(np.zeros(0), np.zeros(0, np.int64), np.zeros((0, HK, D), np.float32)) for _ in range(L)]

    def update(self, layer: int, stream: str, x) -> None:
        H = HQ if stream == "q" else HK
        arr = x.detach().to(torch.float64).numpy() if isinstance(x, torch.Tensor) else np.asarray(x, np.float64)
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
            old = self.sample[layer]
            keys = np.concatenate([old[0], self.rng.random(positions.size)])
            pos = np.concatenate([old[1], positions])
            kept = np.concatenate([old[2], rows.astype(np.float32)])
            if keys.size > self.size:
                sel = np.argpartition(keys, self.size - 1)[: self.size]
                sel.sort()
                keys, pos, kept = keys[sel], pos[sel], kept[sel]
            self.sample[layer] = (keys, pos, kept)


def _batches(kind: str, seed: int):
    """(layer, stream, input) triples of one calibration run of the given kind."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(3):  # several batches per layer
        for layer in range(L):
            for st, H in (("q", HQ), ("k", HK)):
                n = int(torch.randint(1, 40, (1,), generator=g))
                x = torch.randn(2, n, H * D, generator=g) * torch.rand(H * D, generator=g) * 5
                if kind == "offset":
                    x = x * 1e-3 + 300.0  # |mean| >> sd
                elif kind == "constant":
                    x[..., ::3] = 0.75  # constant columns
                    x[..., 1] = -0.0
                    x[0, 0, 2] = x[-1, -1, 2] = x[0, min(1, n - 1), 2] = 4.0  # first/second/last agree only
                elif kind == "bf16":
                    x = x.to(torch.bfloat16)
                elif kind == "numpy":
                    x = x.numpy().astype(np.float64)
                out.append((layer, st, x))
    return out


@pytest.mark.parametrize("layout", ["rotate_half", "interleaved"])
@pytest.mark.parametrize("kind", ["plain", "offset", "constant", "bf16", "numpy"])
def test_calibration_update_bit_identical(kind: str, layout: str) -> None:
    fast = CalibrationStats(L, HQ, HK, D, layout=layout, topk=16, sample_rows=24)
    ref = _Reference(layout, topk=16, sample_rows=24)
    for layer, st, x in _batches(kind, seed=hash((kind, layout)) % 1000):
        fast.update(layer, st, x)
        ref.update(layer, st, x)
    got = fast.moments.to_arrays()
    for st in "qk":
        assert np.array_equal(got[f"{st}_n"], ref.n[st])
        for key, want in ref.acc[st].items():
            assert got[f"{st}_{key}"].tobytes() == want.tobytes(), (kind, layout, st, key)
    assert fast.topk_candidates.to_arrays()["cand"].tobytes() == ref.cand.tobytes()
    assert np.array_equal(fast.topk_candidates.to_arrays()["cand_count"], ref.count)
    arrays = fast.ksample.to_arrays()
    for layer, (keys, pos, rows) in enumerate(ref.sample):
        assert arrays[f"sample_{layer}_keys"].tobytes() == keys.tobytes()
        assert np.array_equal(arrays[f"sample_{layer}_pos"], pos)
        assert arrays[f"sample_{layer}_rows"].tobytes() == rows.tobytes()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_still_refused_and_nothing_lost(bad: float) -> None:
    """The finiteness check now reads the column sums first; a bad value still raises and changes nothing."""
    stats = CalibrationStats(L, HQ, HK, D, sample_rows=8)
    stats.update(0, "k", torch.randn(1, 5, HK * D))
    before = {k: v.copy() for k, v in stats.moments.to_arrays().items()}
    x = torch.randn(1, 5, HK * D)
    x[0, 3, 5] = bad
    with pytest.raises(NonFiniteCalibrationError, match="1 non-finite"):
        stats.update(0, "k", x)
    for k, v in stats.moments.to_arrays().items():
        assert np.array_equal(v, before[k]), k


def test_huge_finite_inputs_whose_sums_overflow_are_accepted() -> None:
    """Sums that overflow to inf from finite inputs go through the elementwise check and are accepted."""
    stats = CalibrationStats(1, 1, 1, D)
    x = np.full((3, D), 1e308)
    with np.errstate(over="ignore", invalid="ignore"):
        stats.update(0, "k", x)
    assert stats.n_rows("k")[0] == 3


def test_save_without_the_k_sample_keeps_moments_and_candidates(tmp_path):
    """The artefact copy of the statistics (sweep/cells.py) leaves the K sample out, nothing else."""
    stats = CalibrationStats(L, HQ, HK, D, topk=4, sample_rows=16)
    for layer, st, x in _batches("plain", seed=3):
        stats.update(layer, st, x)
    full, slim = tmp_path / "full.npz", tmp_path / "slim.npz"
    stats.save(full)
    stats.save(slim, k_sample=False)
    assert slim.stat().st_size < full.stat().st_size
    back = CalibrationStats.load(slim)
    assert back.sample_rows == 0
    for key, value in stats.moments.to_arrays().items():
        assert back.moments.to_arrays()[key].tobytes() == value.tobytes(), key
    for layer in range(L):
        assert stats.candidates(layer).tobytes() == back.candidates(layer).tobytes()
    assert CalibrationStats.load(full).k_sample(0)[0].tobytes() == stats.k_sample(0)[0].tobytes()

"""The calibration update equals the plain float64 arithmetic it replaced.

:class:`tests._support.calib_reference.ReferenceStats` is that arithmetic written out directly (one float64
copy, max/min for constant columns, ``mean``, the elementwise finiteness check, the top-k on the stacked union,
the K sample cast before selection). The host (numpy input) path must match it bit for bit; the device path
(torch input, accumulated with torch on the tensor's device) must match it to float64 rounding in the moments
(the same terms summed in another order) and bit for bit in the counts, candidates and K sample. The inputs
exercise the special cases: constant columns, |mean| >> sd, exact zeros of both signs, bf16 and numpy inputs,
several batches per layer, both RoPE layouts.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rope_quant.calib.moments import NonFiniteCalibrationError
from rope_quant.calib.stats import CalibrationStats
from tests._support.calib_reference import ReferenceStats

L, HQ, HK, D = 2, 4, 2, 8
K = D // 2


def _Reference(layout: str, topk: int, sample_rows: int, seed: int = 0) -> ReferenceStats:
    return ReferenceStats(L, HQ, HK, D, layout, topk, sample_rows, seed)


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


def _assert_same_candidates(got: np.ndarray, want: np.ndarray) -> None:
    """Same scores |a|+|b| bit for bit in the same order, and the same rows wherever the choice is unique.

    Rows tied with the last kept score may be any of the tied rows (the reference's argpartition picks one
    arbitrarily), and rows of equal score may come in any order (the reference orders them as argpartition
    returned them); every row scoring above the boundary is kept by both, compared as sets.
    """
    s_got, s_want = np.abs(got).sum(-1), np.abs(want).sum(-1)
    assert s_got.tobytes() == s_want.tobytes()
    for layer in range(got.shape[0]):
        for pair in range(got.shape[2]):
            unique = s_want[layer, :, pair] > s_want[layer, -1, pair]  # above the boundary score
            g, w = got[layer, unique, pair], want[layer, unique, pair]
            assert np.array_equal(g[np.lexsort(g.T)], w[np.lexsort(w.T)])


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
            if kind == "numpy":  # the host path: the very same numpy arithmetic
                assert got[f"{st}_{key}"].tobytes() == want.tobytes(), (kind, layout, st, key)
            else:  # the device path: float64 rounding of sums over <= 80 rows (a few ulp of the largest term)
                scale = np.abs(ref.acc[st]["sum_aa" if "a" in key else "sum_bb"]).max() + 1.0
                np.testing.assert_allclose(got[f"{st}_{key}"], want, rtol=1e-13, atol=1e-15 * scale,
                                           err_msg=f"{kind} {layout} {st} {key}")
    cand = fast.topk_candidates.to_arrays()["cand"]
    if kind == "numpy":
        assert cand.tobytes() == ref.cand.tobytes()
    else:
        _assert_same_candidates(cand, ref.cand)
    assert np.array_equal(fast.topk_candidates.to_arrays()["cand_count"], ref.count)
    arrays = fast.ksample.to_arrays()
    for layer, (keys, pos, rows) in enumerate(ref.sample):
        assert arrays[f"sample_{layer}_keys"].tobytes() == keys.tobytes()
        assert np.array_equal(arrays[f"sample_{layer}_pos"], pos)
        assert arrays[f"sample_{layer}_rows"].tobytes() == rows.tobytes()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_still_refused_and_nothing_lost(bad: float) -> None:
    """Host path: the finiteness check reads the column sums first; a bad value raises and changes nothing."""
    stats = CalibrationStats(L, HQ, HK, D, sample_rows=8)
    stats.update(0, "k", torch.randn(1, 5, HK * D).numpy())
    before = {k: v.copy() for k, v in stats.moments.to_arrays().items()}
    x = torch.randn(1, 5, HK * D)
    x[0, 3, 5] = bad
    with pytest.raises(NonFiniteCalibrationError, match="1 non-finite"):
        stats.update(0, "k", x.numpy())
    for k, v in stats.moments.to_arrays().items():
        assert np.array_equal(v, before[k]), k


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_on_the_device_reported_at_finalize(bad: float) -> None:
    """Device path: the update never reads the device; finalize names layer, stream and count, and the host
    statistics keep only what was folded in before (the device rows of the pass are dropped)."""
    stats = CalibrationStats(L, HQ, HK, D, sample_rows=8)
    stats.update(0, "k", torch.randn(1, 5, HK * D))
    before = {k: v.copy() for k, v in stats.moments.to_arrays().items()}  # finalized: folded into the host
    x = torch.randn(1, 5, HK * D)
    x[0, 3, 5] = bad
    stats.update(1, "k", torch.randn(1, 5, HK * D))
    stats.update(1, "k", x)  # no error yet: nothing was read on the host
    with pytest.raises(NonFiniteCalibrationError, match=r"layer 1, stream 'k': non-finite values \(NaN/Inf\) in 1 "):
        stats.finalize()
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


def test_cpu_update_runs_on_one_thread_and_restores_the_thread_count(monkeypatch) -> None:
    """A CPU tensor's statistics update runs on one intra-op thread (2-thread barriers on a loaded 2-core machine
    made it ~14x slower), the process's count comes back, also when the update raises, and the statistics are
    then the same bits whatever the thread count."""
    from rope_quant.calib.device_acc import DeviceAccumulator

    seen: list[int] = []
    real = DeviceAccumulator.update

    def spy(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        if len(seen) == 3:  # the third call fails inside the update
            raise RuntimeError("boom")
        return real(self, *args, **kwargs)

    threads = torch.get_num_threads()
    x = torch.randn(1, 300, HK * D, generator=torch.Generator().manual_seed(4))
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            stats = CalibrationStats(L, HQ, HK, D, sample_rows=8)
            with monkeypatch.context() as m:
                m.setattr(DeviceAccumulator, "update", spy)
                stats.update(0, "k", x)
            assert torch.get_num_threads() == n
            results.append(stats.moments.to_arrays())
        assert seen == [1, 1]
        for key, value in results[0].items():
            assert value.tobytes() == results[1][key].tobytes(), key
        torch.set_num_threads(2)
        stats = CalibrationStats(L, HQ, HK, D, sample_rows=8)
        with monkeypatch.context() as m, pytest.raises(RuntimeError, match="boom"):
            m.setattr(DeviceAccumulator, "update", spy)
            stats.update(0, "k", x)
        assert seen == [1, 1, 1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)

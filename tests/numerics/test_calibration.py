"""Calibration statistics (App. A.2.1): pooling rules, merging, numerical robustness, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rope_quant.calib.moments import (
    CalibrationShapeError,
    EmptyStatisticsError,
    IncompatibleStatsError,
    MissingStatsFileError,
    NonFiniteCalibrationError,
    StatsFileError,
    UnknownPoolingRuleError,
    UnknownStreamError,
)
from rope_quant.calib.stats import CalibrationStats, merge_all
from rope_quant.core.rope import OddHeadDimError, UnsupportedLayoutError, layout_permutation, pair_indices

L, HQ, HK, D = 2, 9, 3, 8
K = D // 2


def make_data(seed: int, n_tokens: int = 40, offset: float = 0.0):
    """Per-layer Q (n, HQ*D) and K (n, HK*D) with head- and stream-dependent means and correlations."""
    rng = np.random.default_rng(seed)
    data = {}
    for layer in range(L):
        for stream, heads in (("q", HQ), ("k", HK)):
            mix = rng.normal(size=(heads, D, D)) * rng.uniform(0.2, 2.0, size=(heads, 1, D))
            z = np.einsum("nhd,hed->nhe", rng.normal(size=(n_tokens, heads, D)), mix)
            mean = rng.normal(scale=3.0, size=(heads, D)) + offset
            data[layer, stream] = (z + mean).reshape(n_tokens, heads * D)
    return data


def feed(stats: CalibrationStats, data, rows: slice = slice(None)) -> CalibrationStats:
    for (layer, stream), x in data.items():
        stats.update(layer, stream, x[rows])
    return stats


def pair_rows(x: np.ndarray, heads: int, head_idx=None, layout: str = "rotate_half"):
    """(a, b) rows of every pair, with (token, head) folded: shapes (n*h, K)."""
    r = x.reshape(x.shape[0], heads, D)
    if head_idx is not None:
        r = r[:, head_idx]
    r = r.reshape(-1, D)
    ia, ib = pair_indices(D, layout)
    return r[:, ia], r[:, ib]


def direct_cov(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(3, K): s11, s22, s12 by np.cov with bias (divide by n) per pair."""
    out = np.empty((3, a.shape[1]))
    for k in range(a.shape[1]):
        c = np.cov(np.stack([a[:, k], b[:, k]]), bias=True)
        out[:, k] = c[0, 0], c[1, 1], c[0, 1]
    return out


def as_array(cov) -> np.ndarray:
    return np.stack([np.asarray(v) for v in cov])


@pytest.fixture(scope="module")
def data():
    return make_data(0)


@pytest.fixture(scope="module")
def stats(data):
    return feed(CalibrationStats(L, HQ, HK, D), data)


@pytest.mark.parametrize("raw", [False, True])
def test_rows_matches_direct_covariance_of_concatenated_rows(stats, data, raw):
    cov = as_array(stats.pooled_raw("rows") if raw else stats.pooled("rows"))
    assert cov.shape == (3, L, K)
    for layer in range(L):
        qa, qb = pair_rows(data[layer, "q"], HQ)
        ka, kb = pair_rows(data[layer, "k"], HK)
        ref = direct_cov(np.concatenate([qa, ka]), np.concatenate([qb, kb]))
        np.testing.assert_allclose(cov[:, layer], ref, rtol=1e-10, atol=1e-10)


def test_k_only_matches_direct_covariance(stats, data):
    cov = as_array(stats.pooled("k_only"))
    for layer in range(L):
        ref = direct_cov(*pair_rows(data[layer, "k"], HK))
        np.testing.assert_allclose(cov[:, layer], ref, rtol=1e-10, atol=1e-10)


def test_row_ratio_follows_head_counts():
    """Q rows a=+1, K rows a=-1: 9 Q heads vs 3 KV heads weight Q:K = 3:1, so mean 0.5, var 0.75."""
    n = 16
    s = CalibrationStats(1, HQ, HK, D)
    s.update(0, "q", np.ones((n, HQ * D)))
    s.update(0, "k", -np.ones((n, HK * D)))
    assert s.n_rows("q")[0] * HQ == 3 * s.n_rows("k")[0] * HK
    mean_a, _ = s.pooled_mean("rows")
    np.testing.assert_allclose(mean_a, 0.5, rtol=0, atol=1e-15)
    cov = s.pooled("rows")
    np.testing.assert_allclose(cov.s11, 0.75, atol=1e-15)  # 4 w (1 - w) with w = 3/4
    np.testing.assert_allclose(cov.s12, 0.75, atol=1e-15)  # a and b move together
    # Equal stream weights (balanced) give w = 1/2 instead: variance 1.
    np.testing.assert_allclose(s.pooled("balanced").s11, 1.0, atol=1e-15)
    np.testing.assert_allclose(s.pooled_raw("rows").s11, 0.75, atol=1e-15)


@pytest.mark.parametrize("raw", [False, True])
def test_balanced_matches_definition(stats, data, raw):
    """Average the per-stream normalised raw moments m1 = E[x], m2 = E[x xᵀ], then centre once."""
    cov = as_array(stats.pooled_raw("balanced") if raw else stats.pooled("balanced"))
    for layer in range(L):
        m1a = m1b = m2aa = m2bb = m2ab = 0.0
        for stream, heads in (("q", HQ), ("k", HK)):
            a, b = pair_rows(data[layer, stream], heads)
            m1a = m1a + a.mean(0) / 2
            m1b = m1b + b.mean(0) / 2
            m2aa = m2aa + (a * a).mean(0) / 2
            m2bb = m2bb + (b * b).mean(0) / 2
            m2ab = m2ab + (a * b).mean(0) / 2
        ref = np.stack([m2aa - m1a * m1a, m2bb - m1b * m1b, m2ab - m1a * m1b])
        np.testing.assert_allclose(cov[:, layer], ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("raw", [False, True])
def test_per_head_matches_direct_group_computation(stats, data, raw):
    cov = as_array(stats.pooled_raw("per_head") if raw else stats.pooled("per_head"))
    assert cov.shape == (3, L, HK, K)
    g = HQ // HK
    for layer in range(L):
        for h in range(HK):
            qa, qb = pair_rows(data[layer, "q"], HQ, head_idx=slice(h * g, (h + 1) * g))
            ka, kb = pair_rows(data[layer, "k"], HK, head_idx=slice(h, h + 1))
            ref = direct_cov(np.concatenate([qa, ka]), np.concatenate([qb, kb]))
            np.testing.assert_allclose(cov[:, layer, h], ref, rtol=1e-10, atol=1e-10)


def test_interleaved_layout_gives_the_same_pairs(data):
    """Feeding the same pairs in the interleaved layout gives the same pooled covariances."""
    perm = layout_permutation(D, "rotate_half", "interleaved")
    inter = {}
    for (layer, stream), x in data.items():
        heads = HQ if stream == "q" else HK
        inter[layer, stream] = x.reshape(-1, heads, D)[:, :, perm].reshape(x.shape)
    a = feed(CalibrationStats(L, HQ, HK, D, layout="interleaved"), inter)
    b = feed(CalibrationStats(L, HQ, HK, D), data)
    for rule in ("rows", "per_head", "balanced", "k_only"):
        np.testing.assert_allclose(as_array(a.pooled(rule)), as_array(b.pooled(rule)), rtol=1e-12, atol=1e-12)


@given(cuts=st.lists(st.integers(0, 40), min_size=0, max_size=6))
def test_merge_across_arbitrary_chunks_equals_single_pass(data, stats, cuts):
    bounds = [0, *sorted(cuts), 40]
    parts = [
        feed(CalibrationStats(L, HQ, HK, D), data, slice(lo, hi))
        for lo, hi in zip(bounds, bounds[1:], strict=False)
    ]
    merged = merge_all(parts)
    for rule in ("rows", "k_only", "balanced", "per_head"):
        np.testing.assert_allclose(
            as_array(merged.pooled(rule)), as_array(stats.pooled(rule)), rtol=1e-11, atol=1e-11
        )
        np.testing.assert_allclose(
            as_array(merged.pooled_raw(rule)), as_array(stats.pooled_raw(rule)), rtol=1e-11, atol=1e-11
        )
    for stream in ("q", "k"):
        np.testing.assert_array_equal(merged.n_rows(stream), stats.n_rows(stream))
    for layer in range(L):
        np.testing.assert_array_equal(merged.candidates(layer), stats.candidates(layer))


def test_streaming_updates_equal_one_batch(data, stats):
    s = CalibrationStats(L, HQ, HK, D)
    for lo in range(0, 40, 7):
        feed(s, data, slice(lo, lo + 7))
    for rule in ("rows", "per_head"):
        np.testing.assert_allclose(
            as_array(s.pooled(rule)), as_array(stats.pooled(rule)), rtol=1e-11, atol=1e-11
        )


@pytest.mark.parametrize("offset", [1e4, 1e7])
def test_large_offset_keeps_the_covariance_accurate(offset):
    """|mean| ≫ sd: compare with the covariance of the exactly known centred data (x - offset is exact)."""
    rng = np.random.default_rng(3)
    n = 4000
    z = rng.normal(size=(n, HK * D)) @ np.diag(rng.uniform(0.5, 1.5, HK * D))
    z[:, K:D] += 0.6 * z[:, :K]  # correlate a and b of head 0
    x = offset + z
    centred = x - offset  # exact: x lies within a factor 2 of offset (Sterbenz)
    s = CalibrationStats(1, HK, HK, D)
    for lo in range(0, n, 512):
        s.update(0, "k", x[lo : lo + 512])
    ref = direct_cov(*pair_rows(centred, HK))
    got = as_array(s.pooled("k_only"))[:, 0]
    np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-9)
    if offset == 1e4:  # the paper's raw-moment rule is still fine at realistic offsets
        np.testing.assert_allclose(as_array(s.pooled_raw("k_only"))[:, 0], ref, rtol=1e-5, atol=1e-5)


def test_constant_band_has_exactly_zero_variance():
    s = CalibrationStats(1, 1, 1, D)
    x = np.full((30, D), 0.1)
    x[:, 1] = np.arange(30)
    for lo in range(0, 30, 7):
        s.update(0, "q", x[lo : lo + 7])
        s.update(0, "k", x[lo : lo + 7] * 1.0)
    cov = s.pooled("rows")
    assert cov.s11[0, 0] == 0 and cov.s22[0, 0] == 0 and cov.s12[0, 0] == 0
    assert cov.s11[0, 1] > 0


def test_torch_input_matches_numpy(data):
    a = CalibrationStats(L, HQ, HK, D)
    b = CalibrationStats(L, HQ, HK, D)
    for (layer, stream), x in data.items():
        xt = torch.from_numpy(x.astype(np.float32)).reshape(4, 10, -1)  # (batch, seq, H*d)
        a.update(layer, stream, xt)
        b.update(layer, stream, xt.numpy().astype(np.float64))
    np.testing.assert_allclose(as_array(a.pooled()), as_array(b.pooled()), rtol=1e-12)


def test_candidates_are_the_top_rows_by_l1_norm(data, stats):
    small = feed(CalibrationStats(L, HQ, HK, D, topk=5), data)
    for layer in range(L):
        a, b = pair_rows(data[layer, "k"], HK)
        cand = small.candidates(layer)
        assert cand.shape == (5, K, 2)
        for k in range(K):
            score = np.abs(a[:, k]) + np.abs(b[:, k])
            ref = np.sort(score)[::-1][:5]
            np.testing.assert_allclose(np.abs(cand[:, k]).sum(-1), ref, rtol=1e-15)
        # fewer rows than k: everything is kept
        assert stats.candidates(layer).shape == (40 * HK, K, 2)


def test_save_load_round_trip(tmp_path, stats):
    path = stats.save(tmp_path / "stats.npz")
    assert not list(tmp_path.glob("*.tmp*"))
    back = CalibrationStats.load(path)
    assert back.config() == stats.config()
    for rule in ("rows", "per_head", "balanced"):
        np.testing.assert_array_equal(as_array(back.pooled(rule)), as_array(stats.pooled(rule)))
    np.testing.assert_array_equal(back.raw_moments("k")["sum_aa"], stats.raw_moments("k")["sum_aa"])
    np.testing.assert_array_equal(back.candidates(1), stats.candidates(1))


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_names_layer_and_stream(bad):
    s = CalibrationStats(L, HQ, HK, D)
    x = np.zeros((3, HK * D))
    x[1, 5] = bad
    with pytest.raises(NonFiniteCalibrationError, match=r"layer 1, stream 'k'"):
        s.update(1, "k", x)
    s.update(0, "q", torch.full((2, HQ * D), float(bad)))  # a tensor is checked on its device, read at finalize
    every_column = rf"layer 0, stream 'q': non-finite values \(NaN/Inf\) in {HQ * D // 2} "
    with pytest.raises(NonFiniteCalibrationError, match=every_column):
        s.finalize()
    assert s.n_rows("k").sum() == 0 and s.n_rows("q").sum() == 0  # nothing was accumulated


def test_wrong_shapes_and_names_raise_specific_errors(tmp_path):
    s = CalibrationStats(L, HQ, HK, D)
    with pytest.raises(CalibrationShapeError, match=r"stream 'k'.*3\*8=24"):
        s.update(0, "k", np.zeros((4, HQ * D)))
    with pytest.raises(CalibrationShapeError, match="layer"):
        s.update(L, "q", np.zeros((4, HQ * D)))
    with pytest.raises(UnknownStreamError):
        s.update(0, "v", np.zeros((4, HK * D)))
    with pytest.raises(CalibrationShapeError, match="multiple"):
        CalibrationStats(L, 8, 3, D)
    with pytest.raises(OddHeadDimError):
        CalibrationStats(L, HQ, HK, 7)
    with pytest.raises(UnsupportedLayoutError):
        CalibrationStats(L, HQ, HK, D, layout="gptj")
    with pytest.raises(UnknownPoolingRuleError):
        s.pooled("median")
    with pytest.raises(EmptyStatisticsError, match=r"layer\(s\) \[0, 1\]"):
        s.pooled("rows")
    s.update(0, "k", np.ones((2, HK * D)))
    with pytest.raises(EmptyStatisticsError, match="stream 'q'"):
        s.pooled("balanced")
    with pytest.raises(IncompatibleStatsError):
        s.merge(CalibrationStats(L, HQ, HK, 2 * D))
    with pytest.raises(MissingStatsFileError):
        CalibrationStats.load(tmp_path / "nope.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip file")
    with pytest.raises(StatsFileError):
        CalibrationStats.load(tmp_path / "junk.npz")
    for err in (NonFiniteCalibrationError, CalibrationShapeError, MissingStatsFileError):
        assert issubclass(err, ValueError)

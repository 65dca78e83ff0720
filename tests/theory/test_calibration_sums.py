"""The calibration-only proposition: five streaming sums (with n) determine each pair's covariance,
hence phi_hat and phi*, independently of how the calibration stream is chunked.

The statement is checked in plain numpy (``five_sums``, ``cov_from_sums``); the bridge tests then hold
rope_quant.calib.moments.PairMoments and rope_quant.calib.stats.CalibrationStats to those same helpers: their
raw sums are the five sums, their pooled covariances (stable and raw) are ``cov_from_sums`` of them, and
chunking / merging does not change them.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rope_quant.calib.moments import PairMoments
from rope_quant.calib.stats import CalibrationStats
from rope_quant.core.angles import PairCov, equalising_angle, jacobi_angle
from rope_quant.core.rope import pair_indices


def five_sums(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(n, sum a, sum b, sum a^2, sum b^2, sum ab) per pair; a, b of shape (rows, K)."""
    return np.stack([np.full(a.shape[1], a.shape[0], dtype=np.float64), a.sum(0), b.sum(0),
                     (a * a).sum(0), (b * b).sum(0), (a * b).sum(0)])


def cov_from_sums(s: np.ndarray) -> PairCov:
    n, sa, sb, saa, sbb, sab = s
    ma, mb = sa / n, sb / n
    return PairCov(saa / n - ma * ma, sbb / n - mb * mb, sab / n - ma * mb)


@settings(max_examples=30, deadline=None)
@given(
    st.integers(2, 120),
    st.integers(1, 8),
    st.integers(0, 2**32 - 1),
    st.lists(st.integers(0, 120), max_size=8),
    st.floats(-3.0, 3.0),
)
def test_streaming_sums_reproduce_batch_covariance(n, k, seed, cuts, shift):
    rng = np.random.default_rng(seed)
    mix = rng.standard_normal((2, 2))
    z = rng.standard_normal((n, k, 2)) @ mix.T + shift
    a, b = z[..., 0], z[..., 1]
    bounds = sorted({0, n, *(c for c in cuts if c < n)})
    total = np.zeros((6, k))
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        total += five_sums(a[lo:hi], b[lo:hi])  # chunks merged by adding the sums
    streamed = cov_from_sums(total)
    batch = [np.cov(np.stack([a[:, j], b[:, j]]), bias=True) for j in range(k)]
    scale = max(1.0, float(np.abs(z).max()) ** 2)
    for j in range(k):
        assert abs(streamed.s11[j] - batch[j][0, 0]) <= 1e-11 * scale
        assert abs(streamed.s22[j] - batch[j][1, 1]) <= 1e-11 * scale
        assert abs(streamed.s12[j] - batch[j][0, 1]) <= 1e-11 * scale
    assert total[0, 0] == n
    # the angles depend on the data only through the sums
    batch_cov = PairCov(*(np.array([m[i] for m in batch]) for i in ((0, 0), (1, 1), (0, 1))))
    C, S = np.cos(np.arange(k)), 0.5 * np.sin(np.arange(k))
    gap = np.hypot(batch_cov.s11 - batch_cov.s22, 2 * batch_cov.s12)
    ok = gap > 1e-6 * scale  # angles are only well conditioned away from isotropy
    for got, want in ((jacobi_angle(*streamed), jacobi_angle(*batch_cov)),
                      (equalising_angle(streamed, C, S), equalising_angle(batch_cov, C, S))):
        diff = np.angle(np.exp(4j * (got - want)))  # compare modulo pi/2
        assert np.all(np.abs(diff[ok]) < 1e-6)


def test_chunk_order_does_not_matter():
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((2, 64, 3))
    forward = five_sums(a[:10], b[:10]) + five_sums(a[10:], b[10:])
    backward = five_sums(a[10:], b[10:]) + five_sums(a[:10], b[:10])
    whole = five_sums(a, b)
    assert np.allclose(forward, whole) and np.allclose(backward, whole)
    # and a wrong merge (averaging chunk covariances instead of adding sums) differs in general
    c1, c2 = cov_from_sums(five_sums(a[:10], b[:10])), cov_from_sums(five_sums(a[10:], b[10:]))
    naive = (c1.s11 + c2.s11) / 2
    assert not np.allclose(naive, cov_from_sums(whole).s11)


# ----------------------------------------------------------------------------- bridges to calib.moments and calib.stats


def _chunks(n: int, cuts: list[int]) -> list[tuple[int, int]]:
    bounds = sorted({0, n, *(c for c in cuts if 0 < c < n)})
    return list(zip(bounds[:-1], bounds[1:], strict=True))


@settings(max_examples=20, deadline=None)
@given(st.integers(2, 80), st.integers(1, 3), st.integers(0, 2**32 - 1), st.lists(st.integers(0, 80), max_size=5),
       st.floats(-3.0, 3.0))
def test_bridge_pair_moments_hold_the_five_sums(n, heads, seed, cuts, shift):
    """PairMoments fed in chunks: raw_moments are the five sums of all rows, and pooled / pooled_raw
    ('k_only', one KV head) are cov_from_sums of them."""
    rng = np.random.default_rng(seed)
    k = 4
    z = rng.standard_normal((n, heads, k, 2)) @ rng.standard_normal((2, 2)).T + shift
    a, b = z[..., 0], z[..., 1]  # (N, H, K)
    pm = PairMoments(1, heads, heads, k)
    for lo, hi in _chunks(n, cuts):
        pm.update(0, "k", a[lo:hi], b[lo:hi])
    raw = pm.raw_moments("k")
    assert raw["n"][0] == n
    scale = max(1.0, float(np.abs(z).max()) ** 2)
    for h in range(heads):
        want = five_sums(a[:, h], b[:, h])
        got = np.stack([np.full(k, raw["n"][0], dtype=np.float64)]
                       + [raw[key][0, h] for key in ("sum_a", "sum_b", "sum_aa", "sum_bb", "sum_ab")])
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * n * scale)
    # pooled over every K head: the five sums of all (row, head) pairs
    pooled_sums = five_sums(a.reshape(-1, k), b.reshape(-1, k))
    want_cov = cov_from_sums(pooled_sums)
    for got_cov in (pm.pooled("k_only"), pm.pooled_raw("k_only")):
        for g, w in zip(got_cov, want_cov, strict=True):
            np.testing.assert_allclose(g[0], w, rtol=0, atol=1e-10 * scale)


def test_bridge_merge_is_adding_the_sums():
    """Merging two accumulators (disjoint rows, in either order) equals feeding all rows: the sums add."""
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((2, 90, 2, 3)) * 3 + 1.5
    parts = [PairMoments(1, 2, 2, 3) for _ in range(3)]
    parts[0].update(0, "k", a[:40], b[:40])
    parts[1].update(0, "k", a[40:], b[40:])
    parts[2].update(0, "k", a, b)
    whole = parts[2]
    for first, second in ((0, 1), (1, 0)):
        merged = PairMoments(1, 2, 2, 3).merge(parts[first]).merge(parts[second])
        for key, val in merged.raw_moments("k").items():
            np.testing.assert_allclose(val, whole.raw_moments("k")[key], rtol=1e-12)
        want = cov_from_sums(five_sums(a.reshape(-1, 3), b.reshape(-1, 3)))
        for g, w in zip(merged.pooled("k_only"), want, strict=True):
            np.testing.assert_allclose(g[0], w, rtol=1e-10)
    # the naive merge the proposition rules out (averaging chunk covariances) differs from the accumulators
    c1, c2 = (cov_from_sums(five_sums(a[s].reshape(-1, 3), b[s].reshape(-1, 3))) for s in (slice(0, 40), slice(40, 90)))
    assert not np.allclose((c1.s11 + c2.s11) / 2, whole.pooled("k_only").s11[0])


@pytest.mark.parametrize("layout", ["rotate_half", "interleaved"])
def test_bridge_calibration_stats_angles_depend_only_on_the_sums(layout):
    """CalibrationStats: the 'rows' pooled covariance is cov_from_sums of the Q and K rows' five sums (pairs
    taken in ``layout``), so phi_hat from the accumulator equals phi_hat from the sums."""
    rng = np.random.default_rng(5)
    d, hq, hk = 8, 4, 2
    ia, ib = pair_indices(d, layout)
    xs = {"q": rng.standard_normal((70, hq, d)) * np.exp(rng.normal(size=d)) + rng.normal(size=d),
          "k": rng.standard_normal((50, hk, d)) * np.exp(rng.normal(size=d))}
    stats = CalibrationStats(1, hq, hk, d, layout=layout, topk=0)
    for st_name, x in xs.items():
        for lo, hi in ((0, 13), (13, x.shape[0])):
            stats.update(0, st_name, x[lo:hi].reshape(hi - lo, -1))
    a = np.concatenate([x[..., ia].reshape(-1, d // 2) for x in xs.values()])
    b = np.concatenate([x[..., ib].reshape(-1, d // 2) for x in xs.values()])
    want = cov_from_sums(five_sums(a, b))
    got = stats.pooled("rows")
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g[0], w, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(jacobi_angle(*(v[0] for v in got)), jacobi_angle(*want), atol=1e-9)

"""The calibration-only proposition: five streaming sums (with n) determine each pair's covariance,
hence phi_hat and phi*, independently of how the calibration stream is chunked.

Plain numpy on purpose: this checks the statement, not rope_quant.calib.moments's implementation.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from rope_quant.core.angles import PairCov, equalising_angle, jacobi_angle


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

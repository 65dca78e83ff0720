"""Hypothesis properties of rope_quant.core.angles and rope_quant.core.rope (Theorem, Eq. Sigmatilde, Eq. CkSk)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from rope_quant.core import angles as A
from rope_quant.core.rope import (
    LAYOUTS,
    layout_permutation,
    pair_indices,
    phase_averages,
    rope_matrix,
)

REL = 1e-10


@st.composite
def spd_pair(draw) -> A.PairCov:
    """A random SPD 2x2 covariance; log-uniform scales over six decades, |rho| < 1."""
    l1 = draw(st.floats(-3.0, 3.0))
    l2 = draw(st.floats(-3.0, 3.0))
    rho = draw(st.floats(-0.999, 0.999))
    s1, s2 = 10.0**l1, 10.0**l2
    return A.PairCov(s1 * s1, s2 * s2, rho * s1 * s2)


@st.composite
def phase(draw) -> tuple[float, float]:
    """(C, S) anywhere in the closed unit disc (C^2 + S^2 <= 1)."""
    r = draw(st.floats(0.0, 1.0))
    g = draw(st.floats(-math.pi, math.pi))
    return r * math.cos(g), r * math.sin(g)


def scale(cov: A.PairCov) -> float:
    return (cov.s11 + cov.s22) / 2


def surrogate_by_averaging(cov: A.PairCov, theta: float, L: int) -> np.ndarray:
    sig = np.array([[cov.s11, cov.s12], [cov.s12, cov.s22]])
    R = rope_matrix(np.array([theta]), np.arange(L))  # (L, 2, 2)
    return np.mean(R @ sig @ np.swapaxes(R, -1, -2), axis=0)


# ----------------------------------------------------------------------------- Theorem numerics


@given(spd_pair(), phase())
def test_phi_star_attains_lambda_bar(cov, cs):
    C, S = cs
    phi = A.equalising_angle(cov, C, S)
    sur = A.surrogate_covariance(cov, C, S)
    lam = A.analytic_minimum(cov)
    assert lam == pytest.approx(scale(cov))
    assert A.minimax_variance(sur, phi) - lam <= REL * scale(cov)
    assert A.minimax_excess(cov, phi, C, S) <= REL * scale(cov)
    v1, v2 = A.rotated_variances(sur, phi)
    assert abs(v1 - v2) <= 2 * REL * scale(cov)  # equalised
    assert -math.pi / 4 <= phi < math.pi / 4


@given(spd_pair(), phase(), st.floats(-10.0, 10.0))
def test_no_angle_beats_lambda_bar(cov, cs, phi):
    C, S = cs
    sur = A.surrogate_covariance(cov, C, S)
    mm = A.minimax_variance(sur, phi)
    assert mm >= A.analytic_minimum(cov) * (1 - 1e-14)
    excess = A.minimax_excess(cov, phi, C, S)
    assert excess == pytest.approx(mm - A.analytic_minimum(cov), abs=1e-12 * scale(cov))
    v1, v2 = A.rotated_variances(sur, phi)
    assert v1 + v2 == pytest.approx(cov.s11 + cov.s22, rel=1e-12)  # trace invariance


@given(spd_pair(), phase())
def test_phi_star_is_phi_hat_shifted_by_half_phase(cov, cs):
    C, S = cs
    assume(C * C + S * S > 1e-6)
    p, q = (cov.s11 - cov.s22) / 2, cov.s12
    assume(math.hypot(p, q) > 1e-6 * scale(cov))
    phi_star = A.equalising_angle(cov, C, S)
    rel = A.jacobi_angle(*cov) - 0.5 * math.atan2(S, C)
    # equal modulo pi/2  <=>  exp(4 i phi) equal
    assert math.cos(4 * phi_star) == pytest.approx(math.cos(4 * rel), abs=1e-9)
    assert math.sin(4 * phi_star) == pytest.approx(math.sin(4 * rel), abs=1e-9)


@given(spd_pair(), phase())
def test_excess_of_phi_hat_closed_form(cov, cs):
    C, S = cs
    phi_hat = A.jacobi_angle(*cov)
    claimed = 0.5 * abs(S) * math.hypot(cov.s11 - cov.s22, 2 * cov.s12)
    assert A.minimax_excess(cov, phi_hat, C, S) == pytest.approx(claimed, rel=1e-9, abs=1e-13 * scale(cov))
    # branch matching (wrap) does not change it: the objective has period pi/2
    assert A.minimax_excess(cov, A.wrap_angle(phi_hat), C, S) == pytest.approx(claimed, rel=1e-9,
                                                                               abs=1e-13 * scale(cov))


@given(spd_pair(), phase())
def test_h2_excess_is_abs_offdiagonal(cov, cs):
    C, S = cs
    sur = A.surrogate_covariance(cov, C, S)
    lo, hi = A.h2_variances(cov, C, S)
    assert max(lo, hi) - A.analytic_minimum(cov) == pytest.approx(abs(sur.s12), abs=1e-12 * scale(cov))
    assert (lo, hi) == pytest.approx(A.rotated_variances(sur, math.pi / 4), rel=1e-12, abs=1e-14 * scale(cov))
    assert A.minimax_excess(cov, math.pi / 4, C, S) == pytest.approx(abs(sur.s12), abs=1e-12 * scale(cov))


@given(spd_pair())
def test_jacobi_angle_equalises_and_isotropic_is_identity(cov):
    v1, v2 = A.rotated_variances(cov, A.jacobi_angle(*cov))
    assert v1 == pytest.approx(v2, rel=1e-9, abs=1e-12 * scale(cov))
    assert A.jacobi_angle(cov.s11, cov.s11, 0.0) == 0.0  # atan2(0, 0) -> identity
    assert A.equalising_angle(A.PairCov(2.0, 2.0, 0.0), 0.3, 0.4) == 0.0


@given(st.floats(-1e3, 1e3))
def test_wrap_range_and_congruence(x):
    w = A.wrap_angle(x)
    assert -math.pi / 4 <= w < math.pi / 4
    k = (x - w) / (math.pi / 2)
    assert abs(k - round(k)) < 1e-9 * max(1.0, abs(x))


def test_wrap_edges():
    q = math.pi / 4
    assert A.wrap_angle(-q) == -q
    assert A.wrap_angle(q) == pytest.approx(-q)
    assert A.wrap_angle(np.nextafter(q, 0)) < q
    assert A.wrap_angle(np.nextafter(-q, -1)) < q


@settings(max_examples=20, deadline=None)
@given(spd_pair(), st.floats(1e-3, 3.0), st.integers(1, 40))
def test_surrogate_equals_average_of_rotated_covariances(cov, theta, L):
    avg = surrogate_by_averaging(cov, theta, L)
    C, S = phase_averages(np.array([theta]), L)
    sur = A.surrogate_covariance(cov, C[0], S[0])
    tol = 1e-12 * scale(cov)
    assert sur.s11 == pytest.approx(avg[0, 0], abs=tol)
    assert sur.s22 == pytest.approx(avg[1, 1], abs=tol)
    assert sur.s12 == pytest.approx(avg[0, 1], abs=tol)


def test_givens_orientation_and_shapes():
    G = A.givens(np.array([0.3, -1.0]))
    assert G.shape == (2, 2, 2)
    assert np.allclose(G[0], [[math.cos(0.3), -math.sin(0.3)], [math.sin(0.3), math.cos(0.3)]])
    assert np.allclose(G @ np.swapaxes(G, -1, -2), np.eye(2))
    # rotated_variances is the diagonal of G Sigma G^T
    cov = A.PairCov(3.0, 1.0, 0.4)
    sig = np.array([[3.0, 0.4], [0.4, 1.0]])
    out = A.givens(0.7) @ sig @ A.givens(0.7).T
    assert A.rotated_variances(cov, 0.7) == pytest.approx((out[0, 0], out[1, 1]))


def test_vectorised_numpy_and_torch_agree():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    shape = (3, 2, 16)  # (layers, kv heads, K)
    s1, s2 = rng.uniform(0.1, 4, shape), rng.uniform(0.1, 4, shape)
    rho = rng.uniform(-0.9, 0.9, shape)
    cov = A.PairCov(s1**2, s2**2, rho * s1 * s2)
    C, S = phase_averages(10000.0 ** (-np.arange(16) / 16), 512)
    phi_np = A.equalising_angle(cov, C, S)
    assert phi_np.shape == shape
    cov_t = A.PairCov(*(torch.tensor(v) for v in cov))
    phi_t = A.equalising_angle(cov_t, C, S)
    assert isinstance(phi_t, torch.Tensor) and phi_t.dtype == torch.float64
    assert np.allclose(phi_t.numpy(), phi_np, atol=1e-12)
    ex_np = A.minimax_excess(cov, phi_np, C, S)
    ex_t = A.minimax_excess(cov_t, phi_t, torch.tensor(C), torch.tensor(S))
    assert np.allclose(ex_t.numpy(), ex_np, atol=1e-12)
    assert np.all(ex_np <= 1e-10 * A.analytic_minimum(cov))
    # per-element agreement with the scalar path
    i = (1, 0, 5)
    one = A.equalising_angle(A.PairCov(*(float(v[i]) for v in cov)), C[5], S[5])
    assert one == pytest.approx(phi_np[i], abs=1e-14)


# ----------------------------------------------------------------------------- (..., 2, 2) covariance stacks


def _stack(cov: A.PairCov) -> np.ndarray:
    """The (..., 2, 2) matrices of a PairCov of arrays."""
    s11, s22, s12 = (np.asarray(v, dtype=np.float64) for v in cov)
    return np.stack([np.stack([s11, s12], -1), np.stack([s12, s22], -1)], -2)


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([(), (30,), (3, 2, 16)]))
def test_matrix_stack_gives_the_same_results_as_the_triple(seed, shape):
    """Every ``cov`` argument of core.angles takes a (..., 2, 2) stack and agrees with the triple exactly."""
    rng = np.random.default_rng(seed)
    s1, s2 = rng.uniform(0.1, 4, shape), rng.uniform(0.1, 4, shape)
    rho = rng.uniform(-0.9, 0.9, shape)
    cov = A.PairCov(s1**2, s2**2, rho * s1 * s2)
    mats = _stack(cov)
    assert mats.shape == shape + (2, 2)
    C, S = rng.uniform(-0.6, 0.6, shape), rng.uniform(-0.6, 0.6, shape)
    phi = rng.uniform(-1, 1, shape)
    for fn, args in ((A.surrogate_covariance, (C, S)), (A.equalising_angle, (C, S)),
                     (A.rotated_variances, (phi,)), (A.minimax_variance, (phi,)), (A.analytic_minimum, ()),
                     (A.minimax_excess, (phi, C, S)), (A.h2_variances, (C, S))):
        want, got = fn(cov, *args), fn(mats, *args)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=fn.__name__)
        if shape[:1] != (3,):  # a nested list of length 3 is read as the triple (s11, s22, s12)
            np.testing.assert_array_equal(np.asarray(fn(mats.tolist(), *args)), np.asarray(want))
    assert A.as_pair_cov(mats).s12.shape == shape


def test_matrix_stack_from_torch_keeps_the_backend():
    torch = pytest.importorskip("torch")
    mats = torch.tensor([[[4.0, 1.0], [1.0, 2.0]], [[1.0, -0.5], [-0.5, 3.0]]])
    phi = A.equalising_angle(mats, 0.3, 0.2)
    assert isinstance(phi, torch.Tensor) and phi.dtype == torch.float32
    want = A.equalising_angle(A.PairCov(np.array([4.0, 1.0]), np.array([2.0, 3.0]), np.array([1.0, -0.5])),
                              0.3, 0.2)
    assert np.allclose(phi.numpy(), want, atol=1e-6)


@pytest.mark.parametrize("bad, what", [
    (np.array([[[1.0, 0.5], [0.4, 2.0]]]), "not symmetric"),
    (np.array([[1.0, 0.5], [0.5 + 1e-6, 2.0]]), "not symmetric"),
    (np.array([[[1.0, np.nan], [0.3, 1.0]]]), "not symmetric"),
    (np.ones((4, 3, 3)), r"\(4, 3, 3\)"),
    (np.ones((5, 2)), r"\(5, 2\)"),
    ((1.0, 2.0), "2, 2"),
    ([np.ones(3), np.ones(3), np.ones(3), np.ones(3)], "2, 2"),
])
def test_bad_covariance_forms_name_the_expected_shapes(bad, what):
    for fn in (A.surrogate_covariance, A.minimax_excess):
        args = (bad, 1.0, 0.0) if fn is A.surrogate_covariance else (bad, 0.1)
        with pytest.raises(A.PairCovShapeError, match=what) as info:
            fn(*args)
        assert "(..., 2, 2)" in str(info.value) and "(s11, s22, s12)" in str(info.value)


def test_rounding_level_asymmetry_is_accepted():
    """A stack computed as B D B^T is symmetric only up to rounding; it is read, s12 the mean of both."""
    rng = np.random.default_rng(3)
    B = rng.standard_normal((10, 2, 2))
    mats = np.einsum("nij,jk,nlk->nil", B, np.diag([2.0, 0.5]), B)  # B D B^T: symmetric up to rounding
    cov = A.as_pair_cov(mats)
    assert np.allclose(cov.s12, mats[:, 0, 1]) and np.allclose(cov.s12, mats[:, 1, 0])


# ----------------------------------------------------------------------------- layout invariance


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 16), st.integers(0, 2**32 - 1), st.integers(1, 64))
def test_per_pair_statements_invariant_under_layout(k, seed, L):
    """Pair covariances, phi*, excess and the dense per-pair rotation are layout-equivariant."""
    d = 2 * k
    rng = np.random.default_rng(seed)
    x_rh = rng.standard_normal((50, d)) @ rng.standard_normal((d, d))
    perm = layout_permutation(d, "rotate_half", "interleaved")
    x_il = x_rh[:, perm]
    theta = 10000.0 ** (-np.arange(k) / k)
    C, S = phase_averages(theta, L)
    results = {}
    for layout, x in (("rotate_half", x_rh), ("interleaved", x_il)):
        ia, ib = pair_indices(d, layout)
        cov = A.PairCov(x[:, ia].var(0), x[:, ib].var(0), ((x[:, ia] - x[:, ia].mean(0)) *
                                                           (x[:, ib] - x[:, ib].mean(0))).mean(0))
        phi = A.equalising_angle(cov, C, S)
        M = np.eye(d)
        M[ia, ia], M[ia, ib], M[ib, ia], M[ib, ib] = np.cos(phi), -np.sin(phi), np.sin(phi), np.cos(phi)
        results[layout] = (cov, phi, A.minimax_excess(cov, phi, C, S), M)
    (c1, p1, e1, m1), (c2, p2, e2, m2) = results["rotate_half"], results["interleaved"]
    for a, b in zip(c1, c2, strict=True):
        assert np.allclose(a, b, rtol=1e-12)
    assert np.allclose(p1, p2, atol=1e-12) and np.allclose(e1, e2, atol=1e-9)
    P = np.eye(d)[perm]
    assert np.allclose(P @ m1 @ P.T, m2)
    # transforming then permuting = permuting then transforming
    assert np.allclose((x_rh @ m1.T)[:, perm], x_il @ m2.T)


def test_layout_permutation_roundtrip_and_pairs():
    for d in (2, 8, 64):
        p = layout_permutation(d, "rotate_half", "interleaved")
        q = layout_permutation(d, "interleaved", "rotate_half")
        x = np.arange(d)
        assert np.array_equal(x[p][q], x)
        assert np.array_equal(layout_permutation(d, "rotate_half", "rotate_half"), x)
        for src, dst in ((LAYOUTS[0], LAYOUTS[1]), (LAYOUTS[1], LAYOUTS[0])):
            perm = layout_permutation(d, src, dst)
            sa, sb = pair_indices(d, src)
            da, db = pair_indices(d, dst)
            assert np.array_equal(perm[da], sa) and np.array_equal(perm[db], sb)
    assert list(pair_indices(8, "rotate_half")[1]) == [4, 5, 6, 7]
    assert list(pair_indices(8, "interleaved")[0]) == [0, 2, 4, 6]


# ----------------------------------------------------------------------------- RoPE matrix / phase averages


def _hf_rope_rotate_half(x: np.ndarray, theta: np.ndarray, m: int) -> np.ndarray:
    """HF: q * cos + rotate_half(q) * sin with cos/sin = cat(freqs, freqs)."""
    freqs = np.concatenate([m * theta, m * theta])
    half = x.shape[-1] // 2
    rot_half = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * np.cos(freqs) + rot_half * np.sin(freqs)


@given(st.integers(1, 32), st.integers(0, 5000), st.integers(0, 2**32 - 1))
def test_rope_matrix_matches_hf_formula(k, m, seed):
    theta = 100000.0 ** (-np.arange(k) / k)
    x = np.random.default_rng(seed).standard_normal(2 * k)
    assert np.allclose(rope_matrix(theta, m) @ x, _hf_rope_rotate_half(x, theta, m), atol=1e-10)
    R = rope_matrix(theta, m, "interleaved")
    assert np.allclose(R @ R.T, np.eye(2 * k), atol=1e-12)
    assert np.allclose(rope_matrix(theta, m) @ rope_matrix(theta, 3), rope_matrix(theta, m + 3), atol=1e-9)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(0.0, 3.5), min_size=1, max_size=32), st.integers(1, 20000))
def test_phase_averages_closed_form_matches_sum(theta, L):
    theta = np.asarray(theta)
    C, S = phase_averages(theta, L)
    C2, S2 = phase_averages(theta, L, method="sum")
    assert np.allclose(C, C2, atol=1e-11) and np.allclose(S, S2, atol=1e-11)
    assert np.all(C * C + S * S <= 1 + 1e-12)
    m = np.arange(min(L, 50))
    if L <= 50:
        assert np.allclose(C, np.cos(2 * m[:, None] * theta).mean(0), atol=1e-12)


def test_phase_averages_edges_and_long_windows():
    theta = 500000.0 ** (-np.arange(16) / 16) / np.r_[np.ones(8), np.full(8, 32.0)]
    C, S = phase_averages(theta, 1)
    assert np.all(C == 1.0) and np.all(S == 0.0)
    C0, S0 = phase_averages(np.array([0.0, 1.0]), 10)
    assert C0[0] == 1.0 and S0[0] == 0.0
    for L in (4096, 1_000_000):
        C, S = phase_averages(theta, L)
        C2, S2 = phase_averages(theta, L, method="sum")
        assert np.allclose(C, C2, atol=1e-11) and np.allclose(S, S2, atol=1e-11)
    # high frequencies average out over a long window; the lowest barely rotates (C ~ 1)
    C, S = phase_averages(theta, 1_000_000)
    assert abs(C[0]) < 1e-5 and abs(C[-1]) > 0.5

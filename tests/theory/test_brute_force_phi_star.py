"""The closed-form φ* and λ̄ (Theorem (ii), (iv)) against the independent brute force of
:func:`rope_quant.calib.verify.brute_force_phi_star` (explicit R_m products, grid + golden section)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rope_quant.calib.verify import (
    BruteForcePhiStar,
    VerificationError,
    VerificationShapeError,
    brute_force_phi_star,
    position_averaged_covariance,
    position_averaged_minimax,
    verify_phi_star,
)
from rope_quant.core import angles as A
from rope_quant.core.rope import phase_averages, rope_matrix

K = 6


def random_covariances(rng: np.random.Generator, shape: tuple[int, ...]) -> A.PairCov:
    """SPD pairs with scales over three decades and |rho| < 0.95."""
    s1, s2 = 10.0 ** rng.uniform(-1.5, 1.5, shape), 10.0 ** rng.uniform(-1.5, 1.5, shape)
    rho = rng.uniform(-0.95, 0.95, shape)
    return A.PairCov(s1 * s1, s2 * s2, rho * s1 * s2)


def frequencies(rng: np.random.Generator) -> np.ndarray:
    """Two RoPE-like frequencies (one slow), and four random ones in (0, pi)."""
    return np.concatenate([[1.0, 1e4 ** -0.9], rng.uniform(0.01, 3.1, K - 2)])


def mod_half_pi(x: np.ndarray) -> np.ndarray:
    """Distance of x from 0 modulo pi/2 (the objective's period: G(phi + pi/2) swaps the two outputs)."""
    return np.abs(np.angle(np.exp(4j * np.asarray(x)))) / 4


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([1, 2, 7, 64, 2048]))
def test_brute_force_agrees_with_the_closed_forms(seed, length):
    rng = np.random.default_rng(seed)
    cov = random_covariances(rng, (4, K))
    theta = frequencies(rng)
    phi, obj = brute_force_phi_star(*cov, theta, length)
    assert phi.shape == obj.shape == (4, K)
    assert np.all(phi >= -math.pi / 4) and np.all(phi < math.pi / 4)
    C, S = phase_averages(theta, length)
    phi_star = A.equalising_angle(cov, C, S)
    lam = A.analytic_minimum(cov)
    np.testing.assert_allclose(obj, lam, rtol=1e-6)  # Theorem (iv): the minimum is lambda_bar
    np.testing.assert_allclose(obj, A.minimax_variance(A.surrogate_covariance(cov, C, S), phi_star), rtol=1e-6)
    # the angle is unique modulo pi/2 where the surrogate is not isotropic: r~ = |p~ + i q~| > 0
    sur = A.surrogate_covariance(cov, C, S)
    r_t = np.hypot(sur.s11 - sur.s22, 2 * sur.s12) / 2
    # (long windows average the fast pairs close to isotropy: r~ ~ r / (L sin theta))
    ok = r_t > 1e-5 * lam
    assert ok.mean() >= 0.25
    assert mod_half_pi(phi - phi_star)[ok].max() < 1e-6


def test_brute_force_separates_phi_star_from_phi_hat():
    """At L = 2048 the Jacobi angle phi_hat is not optimal for the fast pairs, and the brute force sees it."""
    rng = np.random.default_rng(0)
    cov = random_covariances(rng, (3, K))
    theta = frequencies(rng)
    phi, obj = brute_force_phi_star(*cov, theta, 2048)
    phi_hat = A.wrap_angle(A.jacobi_angle(*cov))
    at_hat = position_averaged_minimax(*cov, theta, 2048, phi_hat)
    assert np.all(obj <= at_hat * (1 + 1e-12))
    assert np.mean(mod_half_pi(phi - phi_hat) > 1e-3) > 0.3
    assert np.max((at_hat - obj) / obj) > 1e-3


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 40), st.floats(-3.0, 3.0))
def test_position_averaged_objective_is_the_mean_over_positions(seed, length, phi):
    """The objective equals max_i mean_m diag(G R_m Sigma R_m^T G^T), summed position by position here."""
    rng = np.random.default_rng(seed)
    cov = random_covariances(rng, (K,))
    theta = frequencies(rng)
    G = A.givens(phi)
    total = np.zeros((K, 2))
    for m in range(length):
        R = rope_matrix(theta, m, "interleaved")
        for k in range(K):
            sig = np.array([[cov.s11[k], cov.s12[k]], [cov.s12[k], cov.s22[k]]])
            Rk = R[2 * k:2 * k + 2, 2 * k:2 * k + 2]
            total[k] += np.diag(G @ Rk @ sig @ Rk.T @ G.T)
    want = (total / length).max(axis=1)
    got = position_averaged_minimax(*cov, theta, length, phi)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    t11, t22, t12 = position_averaged_covariance(*cov, theta, length)
    np.testing.assert_allclose(t11 + t22, cov.s11 + cov.s22, rtol=1e-12)  # trace kept


def test_result_type_and_argument_checks():
    out = brute_force_phi_star(2.0, 1.0, 0.3, [0.5], 16)
    assert isinstance(out, BruteForcePhiStar) and out.phi.shape == (1,)
    with pytest.raises(VerificationShapeError, match="pairs"):
        brute_force_phi_star(np.ones(3), np.ones(3), np.zeros(3), [0.1, 0.2], 8)
    with pytest.raises(VerificationError, match="length"):
        brute_force_phi_star(2.0, 1.0, 0.3, [0.5], 0)
    with pytest.raises(VerificationError, match="grid"):
        brute_force_phi_star(2.0, 1.0, 0.3, [0.5], 8, grid=2)


def test_verifier_reads_a_matrix_stack_like_the_triple():
    """verify_phi_star takes the (L, K, 2, 2) stack too (L = 3 layers: the case a row-unpacking would misread)."""
    rng = np.random.default_rng(1)
    cov = random_covariances(rng, (3, K))
    theta = frequencies(rng)
    C, S = phase_averages(theta, 64)
    phi = A.equalising_angle(cov, C, S)
    mats = np.stack([np.stack([cov.s11, cov.s12], -1), np.stack([cov.s12, cov.s22], -1)], -2)
    by_triple = verify_phi_star(phi, cov, theta, 64)
    by_stack = verify_phi_star(phi, mats, theta, 64)
    assert by_stack.verified and by_triple.verified
    for key in ("s11", "s22", "s12", "excess"):
        np.testing.assert_array_equal(by_stack.arrays[key], by_triple.arrays[key])

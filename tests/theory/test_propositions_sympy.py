"""§3's propositions in sympy: H2 domination, the shared angle, and the Lemma part (a).

The derivations are helpers used by the proof tests and by bridge tests (``test_bridge_*``) that lambdify
them against rope_quant.core.angles, rope_quant.core.rope and the R3 registry (rope_quant.core.transforms).
"""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp
import torch

from rope_quant.core import angles as A
from rope_quant.core import transforms
from rope_quant.core.rope import LAYOUTS, layout_permutation, pair_indices, rope_matrix


def rot(x: sp.Expr) -> sp.Matrix:
    return sp.Matrix([[sp.cos(x), -sp.sin(x)], [sp.sin(x), sp.cos(x)]])


def blockdiag(*blocks: sp.Matrix) -> sp.Matrix:
    return sp.diag(*blocks)


def surrogate():
    P, Q, t = sp.symbols("P Q t", real=True)
    return sp.Matrix([[t + P, Q], [Q, t - P]]), P, Q, t


RAW_H2 = sp.Matrix([[1, 1], [1, -1]]) / sp.sqrt(2)


def h2_outputs(sur: sp.Matrix, base: sp.Matrix) -> tuple[sp.Expr, sp.Expr]:
    """The two output variances diag(B Sig~ B^T) of a fixed 2x2 base B (G(pi/4) or the raw H2)."""
    out = base * sur * base.T
    return out[0, 0], out[1, 1]


def h2_excess(sur: sp.Matrix, t: sp.Expr) -> sp.Expr:
    """Per-pair H2's minimax excess max(outputs) - lambda_bar."""
    return sp.Max(*h2_outputs(sur, rot(sp.pi / 4))) - t


def band_score():
    """The 2-pair band score (G_Q R_m q)^T (G_K R_n k) and its relative form q^T R_{n-m} G(Delta) k.

    Returns (lhs, rhs, symbols) with symbols (a, a2, b, b2, phi_Q, phi_Q2, phi_K, phi_K2, q1..4, k1..4):
    a = m theta_1, a2 = m theta_2, b = n theta_1, b2 = n theta_2.
    """
    a, b, phq, phk = sp.symbols("a b phi_Q phi_K", real=True)
    a2, b2, phq2, phk2 = sp.symbols("a2 b2 phi_Q2 phi_K2", real=True)
    q4 = sp.Matrix(sp.symbols("q1:5", real=True))
    k4 = sp.Matrix(sp.symbols("k1:5", real=True))
    GQ, GK = blockdiag(rot(phq), rot(phq2)), blockdiag(rot(phk), rot(phk2))
    Rm, Rn = blockdiag(rot(a), rot(a2)), blockdiag(rot(b), rot(b2))
    lhs = ((GQ * Rm * q4).T * (GK * Rn * k4))[0, 0]
    rel = blockdiag(rot(b - a), rot(b2 - a2))
    delta = blockdiag(rot(phk - phq), rot(phk2 - phq2))
    rhs = (q4.T * rel * delta * k4)[0, 0]
    return lhs, rhs, (a, a2, b, b2, phq, phq2, phk, phk2, *q4, *k4)


def lemma_a_matrices(n_pairs: int = 3) -> tuple[sp.Matrix, sp.Matrix, tuple, tuple]:
    """Lemma (a)'s objects in pair-interleaved coordinates: G = blockdiag(G(phi_k)), R = blockdiag(R(a_k))."""
    phis = sp.symbols(f"phi1:{n_pairs + 1}", real=True)
    angs = sp.symbols(f"a1:{n_pairs + 1}", real=True)
    return blockdiag(*(rot(x) for x in phis)), blockdiag(*(rot(x) for x in angs)), phis, angs


def to_interleaved(M: np.ndarray, layout: str) -> np.ndarray:
    """A d x d channel-space matrix in ``layout`` rewritten in the interleaved order (pair k = 2k, 2k+1)."""
    P = np.eye(M.shape[0])[layout_permutation(M.shape[0], layout, "interleaved")]
    return P @ M @ P.T


# ----------------------------------------------------------------------------- H2 proposition


def test_h2_minimax_is_lambda_bar_plus_abs_offdiag(trig_zero):
    """Per-pair H2 = G(pi/4): output variances t -/+ Sig~12, so minimax = lambda_bar + |Sig~12|."""
    sur, P, Q, t = surrogate()
    out = h2_outputs(sur, rot(sp.pi / 4))
    assert sp.simplify(out[0] - (t - Q)) == 0
    assert sp.simplify(out[1] - (t + Q)) == 0
    excess = h2_excess(sur, t)
    assert sp.simplify((excess - sp.Abs(Q)).rewrite(sp.Piecewise)) == 0
    # the fixed Hadamard reflection [[1, 1], [1, -1]]/sqrt2 gives the same pair of variances, swapped
    outh = h2_outputs(sur, RAW_H2)
    assert sp.simplify(outh[0] - out[1]) == 0 and sp.simplify(outh[1] - out[0]) == 0


def test_h2_strictly_dominated_iff_offdiag_nonzero():
    """H2's excess |Sig~12| is > 0 iff Sig~12 != 0, while phi* attains lambda_bar (excess 0)."""
    sur, P, Q, t = surrogate()
    excess_h2 = sp.Abs(Q)
    phi = sp.atan2(2 * P, 2 * Q) / 2  # phi* on the surrogate
    gap_star = sp.simplify(P * sp.cos(2 * phi) - Q * sp.sin(2 * phi))  # (d+ - d-)/2 at phi*
    assert gap_star == 0
    # strict domination <=> excess_h2 > 0 <=> Q != 0 (over the reals)
    assert sp.solveset(excess_h2 > 0, Q, sp.S.Reals) == sp.Union(
        sp.Interval.open(-sp.oo, 0), sp.Interval.open(0, sp.oo))
    assert sp.solveset(sp.Eq(excess_h2, 0), Q, sp.S.Reals) == sp.FiniteSet(0)
    # and when Sig~12 = 0, H2 still ties (it is then an optimal angle): d+ = d- = t
    assert sp.simplify(excess_h2.subs(Q, 0)) == 0


# ----------------------------------------------------------------------------- shared angle


def test_shared_angle_band_score(trig_zero):
    """(G(phQ) R_m q)^T (G(phK) R_n k) = q^T R_{n-m} G(phK - phQ) k, for one pair and a 2-pair band."""
    a, b, phq, phk = sp.symbols("a b phi_Q phi_K", real=True)  # a = m theta, b = n theta
    q = sp.Matrix(sp.symbols("q1 q2", real=True))
    k = sp.Matrix(sp.symbols("k1 k2", real=True))
    lhs = ((rot(phq) * rot(a) * q).T * (rot(phk) * rot(b) * k))[0, 0]
    rhs = (q.T * rot(b - a) * rot(phk - phq) * k)[0, 0]
    assert trig_zero(lhs - rhs)
    # a band of two pairs with their own frequencies and angles
    lhs4, rhs4, _ = band_score()
    assert trig_zero(lhs4 - rhs4)


def test_shared_angle_relative_form_iff_angles_agree(trig_zero):
    """The score has RoPE's relative form q^T R_{n-m} k for all q, k, m, n iff phi_K = phi_Q (mod 2 pi).

    The bilinear form of the score is R_{n-m} G(Delta), Delta = phi_K - phi_Q; it equals R_{n-m}
    iff G(Delta) = I iff cos Delta = 1 (then sin Delta = 0), i.e. Delta in 2 pi Z.
    """
    a, b, d = sp.symbols("a b Delta", real=True)
    form = rot(b - a) * rot(d)
    residual = form - rot(b - a)
    # residual = R_{n-m} (G(Delta) - I); R_{n-m} is invertible, so residual = 0 iff G(Delta) = I
    assert all(trig_zero(e) for e in (residual - rot(b - a) * (rot(d) - sp.eye(2))))
    assert all(trig_zero(e) for e in (rot(b - a).T * rot(b - a) - sp.eye(2)))
    # G(Delta) = I  <=>  cos(Delta) = 1 (and then sin Delta = 0): the solutions are 2 pi Z
    sols = sp.solveset(sp.Eq(sp.cos(d), 1), d, sp.Interval(-7, 7))
    assert sols == sp.FiniteSet(-2 * sp.pi, 0, 2 * sp.pi)
    assert all(sp.simplify(e) == 0 for e in (rot(d) - sp.eye(2)).subs(d, 2 * sp.pi))
    assert any(sp.simplify(e) != 0 for e in (rot(d) - sp.eye(2)).subs(d, sp.pi))  # Delta = pi is not enough
    # With unequal angles the score still depends on (m, n) only through n - m (the product
    # R_{n-m} G(Delta) above), but it is no longer the model's score: a concrete witness
    q = sp.Matrix([1, 0])
    k = sp.Matrix([1, 0])
    witness = (q.T * rot(b - a) * rot(sp.pi / 3) * k)[0, 0] - (q.T * rot(b - a) * k)[0, 0]
    assert sp.simplify(witness.subs({a: 0, b: 0})) != 0


# ----------------------------------------------------------------------------- Lemma (a)


def test_lemma_a_per_pair_rotation_commutes_with_rope(trig_zero):
    """G(phi) commutes with R_m per pair, and so does blockdiag(G(phi_k)) with blockdiag(R(m theta_k))."""
    phi, a = sp.symbols("phi a", real=True)
    comm = rot(phi) * rot(a) - rot(a) * rot(phi)
    assert all(trig_zero(e) for e in comm)
    G, R, _, _ = lemma_a_matrices(3)
    assert all(trig_zero(e) for e in (G * R - R * G))
    # a reflection in one pair does not commute (the check can fail)
    F = blockdiag(sp.Matrix([[1, 0], [0, -1]]), sp.eye(2), sp.eye(2))
    assert not all(trig_zero(e) for e in (F * R - R * F))


# ----------------------------------------------------------------------------- bridges to the implementation


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bridge_h2_outputs_and_excess(seed):
    """The derived H2 outputs (t -/+ Q) and excess |Q| against angles.h2_variances and angles.minimax_excess,
    on the library's own surrogate (bridged to the Theorem's derivation in test_theorem_sympy)."""
    rng = np.random.default_rng(seed)
    s1, s2, rho = 10 ** rng.uniform(-1, 1, 32), 10 ** rng.uniform(-1, 1, 32), rng.uniform(-0.99, 0.99, 32)
    cov = A.PairCov(s1 * s1, s2 * s2, rho * s1 * s2)
    r, g = np.sqrt(rng.uniform(0, 1, 32)), rng.uniform(-np.pi, np.pi, 32)
    C, S = r * np.cos(g), r * np.sin(g)
    sur_sym, P, Q, t = surrogate()
    sur = A.surrogate_covariance(cov, C, S)
    pqt = ((sur.s11 - sur.s22) / 2, sur.s12, (sur.s11 + sur.s22) / 2)
    lo, hi = (sp.lambdify((P, Q, t), e, "numpy")(*pqt) for e in h2_outputs(sur_sym, rot(sp.pi / 4)))
    got_lo, got_hi = A.h2_variances(cov, C, S)
    tol = 1e-12 * (s1 * s1 + s2 * s2).max()
    np.testing.assert_allclose(got_lo, lo, atol=tol)
    np.testing.assert_allclose(got_hi, hi, atol=tol)
    excess = sp.lambdify((P, Q, t), h2_excess(sur_sym, t), "numpy")(*pqt)
    np.testing.assert_allclose(A.minimax_excess(cov, np.pi / 4, C, S), excess, atol=tol)
    np.testing.assert_allclose(A.minimax_variance(sur, np.pi / 4), excess + pqt[2], rtol=1e-12)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bridge_h2_bases_are_the_registry_pair_transforms(layout):
    """G(pi/4) and the raw H2 of the derivation are what ``pair_h2`` / ``pair_h2_raw`` put on every pair."""
    d = 6
    ia, ib = pair_indices(d, layout)
    for name, base in (("pair_h2", rot(sp.pi / 4)), ("pair_h2_raw", RAW_H2)):
        M = transforms.build(name, d, layout=layout).matrix()
        want = np.array(base.evalf(), dtype=np.float64)
        for k in range(d // 2):
            block = M[np.ix_([ia[k], ib[k]], [ia[k], ib[k]])]
            np.testing.assert_allclose(block, want, atol=1e-15, err_msg=name)
        np.testing.assert_allclose(np.abs(M).sum(), d // 2 * np.abs(want).sum())  # nothing outside the pairs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bridge_shared_angle_band_score(seed):
    """The derived 2-pair band score against the registry's ``pairwise_only`` matrices (and ``apply``) with
    core.rope.rope_matrix, and its relative form q^T R_{n-m} k when the Q and K angles are shared."""
    rng = np.random.default_rng(seed)
    theta = rng.uniform(0.05, 3.0, 2)
    m, n = rng.integers(0, 4096, 2)
    ph_q, ph_k = rng.uniform(-np.pi, np.pi, (2, 2))
    q, k = rng.standard_normal((2, 4))
    lhs, rhs, symbols = band_score()
    lhs_f = sp.lambdify(symbols, lhs, "numpy")
    rhs_f = sp.lambdify(symbols, rhs, "numpy")
    phases = (m * theta[0], m * theta[1], n * theta[0], n * theta[1])

    def score(phq: np.ndarray, phk: np.ndarray) -> float:
        tq = transforms.build("pairwise_only", 4, angles=phq, layout="interleaved")
        tk = transforms.build("pairwise_only", 4, angles=phk, layout="interleaved")
        rq = rope_matrix(theta, m, "interleaved") @ q
        rk = rope_matrix(theta, n, "interleaved") @ k
        by_matrix = (tq.matrix() @ rq) @ (tk.matrix() @ rk)
        by_apply = float((tq.apply(torch.tensor(rq)[None, None]) * tk.apply(torch.tensor(rk)[None, None])).sum())
        assert by_apply == pytest.approx(by_matrix, rel=1e-12, abs=1e-12)
        return by_matrix

    for phq, phk in ((ph_q, ph_k), (ph_q, ph_q)):
        args = (*phases, *phq, *phk, *q, *k)
        assert score(phq, phk) == pytest.approx(lhs_f(*args), rel=1e-9, abs=1e-9)
        assert score(phq, phk) == pytest.approx(rhs_f(*args), rel=1e-9, abs=1e-9)
    relative = q @ rope_matrix(theta, n - m, "interleaved") @ k
    assert score(ph_q, ph_q) == pytest.approx(relative, rel=1e-9, abs=1e-9)
    assert score(ph_q, ph_k) != pytest.approx(relative, rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("seed", [0, 1])
def test_bridge_lemma_a_matrices_are_pairwise_only_and_rope(layout, seed):
    """Lemma (a)'s blockdiag(G(phi_k)) and blockdiag(R(m theta_k)) are the registry's ``pairwise_only`` matrix
    and core.rope.rope_matrix (in the interleaved order of either layout)."""
    rng = np.random.default_rng(seed)
    G, R, phis, angs = lemma_a_matrices(3)
    phi = rng.uniform(-np.pi, np.pi, 3)
    theta, m = rng.uniform(0.01, 3.0, 3), int(rng.integers(0, 10000))
    M = transforms.build("pairwise_only", 6, angles=phi, layout=layout).matrix()
    np.testing.assert_allclose(to_interleaved(M, layout), sp.lambdify(phis, G, "numpy")(*phi), atol=1e-15)
    Rm = rope_matrix(theta, m, layout)
    np.testing.assert_allclose(to_interleaved(Rm, layout), sp.lambdify(angs, R, "numpy")(*(m * theta)),
                               atol=1e-12)
    np.testing.assert_allclose(M @ Rm, Rm @ M, atol=1e-12)

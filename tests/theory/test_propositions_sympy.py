"""§3's propositions in sympy: H2 domination, the shared angle, and the Lemma part (a)."""

from __future__ import annotations

import sympy as sp


def rot(x: sp.Expr) -> sp.Matrix:
    return sp.Matrix([[sp.cos(x), -sp.sin(x)], [sp.sin(x), sp.cos(x)]])


def blockdiag(*blocks: sp.Matrix) -> sp.Matrix:
    return sp.diag(*blocks)


def surrogate():
    P, Q, t = sp.symbols("P Q t", real=True)
    return sp.Matrix([[t + P, Q], [Q, t - P]]), P, Q, t


# ----------------------------------------------------------------------------- H2 proposition


def test_h2_minimax_is_lambda_bar_plus_abs_offdiag(trig_zero):
    """Per-pair H2 = G(pi/4): output variances t -/+ Sig~12, so minimax = lambda_bar + |Sig~12|."""
    sur, P, Q, t = surrogate()
    out = rot(sp.pi / 4) * sur * rot(sp.pi / 4).T
    assert sp.simplify(out[0, 0] - (t - Q)) == 0
    assert sp.simplify(out[1, 1] - (t + Q)) == 0
    excess = sp.Max(out[0, 0], out[1, 1]) - t
    assert sp.simplify((excess - sp.Abs(Q)).rewrite(sp.Piecewise)) == 0
    # the fixed Hadamard reflection [[1, 1], [1, -1]]/sqrt2 gives the same pair of variances, swapped
    H = sp.Matrix([[1, 1], [1, -1]]) / sp.sqrt(2)
    outh = H * sur * H.T
    assert sp.simplify(outh[0, 0] - out[1, 1]) == 0 and sp.simplify(outh[1, 1] - out[0, 0]) == 0


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
    a2, b2, phq2, phk2 = sp.symbols("a2 b2 phi_Q2 phi_K2", real=True)
    q4 = sp.Matrix(sp.symbols("q1:5", real=True))
    k4 = sp.Matrix(sp.symbols("k1:5", real=True))
    GQ, GK = blockdiag(rot(phq), rot(phq2)), blockdiag(rot(phk), rot(phk2))
    Rm, Rn = blockdiag(rot(a), rot(a2)), blockdiag(rot(b), rot(b2))
    lhs4 = ((GQ * Rm * q4).T * (GK * Rn * k4))[0, 0]
    rel = blockdiag(rot(b - a), rot(b2 - a2))
    delta = blockdiag(rot(phk - phq), rot(phk2 - phq2))
    rhs4 = (q4.T * rel * delta * k4)[0, 0]
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
    phis = sp.symbols("phi1:4", real=True)
    angs = sp.symbols("a1:4", real=True)
    G = blockdiag(*(rot(x) for x in phis))
    R = blockdiag(*(rot(x) for x in angs))
    assert all(trig_zero(e) for e in (G * R - R * G))
    # a reflection in one pair does not commute (the check can fail)
    F = blockdiag(sp.Matrix([[1, 0], [0, -1]]), sp.eye(2), sp.eye(2))
    assert not all(trig_zero(e) for e in (F * R - R * F))

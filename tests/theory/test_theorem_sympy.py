"""The Theorem of §3 (steps (0), (ii), (iii), (iv) and the phi* / excess corollaries), in sympy.

Notation as in rope_quant.core.angles: Sigma = [[s1^2, rho s1 s2], [rho s1 s2, s2^2]],
p = (s1^2 - s2^2)/2, q = rho s1 s2, t = (s1^2 + s2^2)/2, and G(x) = R(x) = [[cos, -sin], [sin, cos]].
"""

from __future__ import annotations

import sympy as sp


def rot(x: sp.Expr) -> sp.Matrix:
    return sp.Matrix([[sp.cos(x), -sp.sin(x)], [sp.sin(x), sp.cos(x)]])


def refl(x: sp.Expr) -> sp.Matrix:
    """A general element of O(2) \\ SO(2): G(x) diag(1, -1)."""
    return rot(x) * sp.diag(1, -1)


def sigma(sym) -> tuple[sp.Matrix, sp.Expr, sp.Expr, sp.Expr]:
    s1, s2, rho = sym["s1"], sym["s2"], sym["rho"]
    cov = sp.Matrix([[s1**2, rho * s1 * s2], [rho * s1 * s2, s2**2]])
    p = (s1**2 - s2**2) / 2
    q = rho * s1 * s2
    t = (s1**2 + s2**2) / 2
    return cov, p, q, t


def pair_surrogate_symbols():
    """Generic surrogate entries: Sig~ = [[t + P, Q], [Q, t - P]]."""
    P, Q, t = sp.symbols("P Q t", real=True)
    return sp.Matrix([[t + P, Q], [Q, t - P]]), P, Q, t


# ----------------------------------------------------------------------------- step (0)


def test_step0_entries_of_rotated_covariance(sym, trig_zero):
    """R_a Sigma R_a^T = [[t + p cos2a - q sin2a, p sin2a + q cos2a], [., t - p cos2a + q sin2a]]."""
    cov, p, q, t = sigma(sym)
    a = sym["alpha"]
    out = rot(a) * cov * rot(a).T
    assert trig_zero(out[0, 0] - (t + p * sp.cos(2 * a) - q * sp.sin(2 * a)))
    assert trig_zero(out[1, 1] - (t - p * sp.cos(2 * a) + q * sp.sin(2 * a)))
    assert trig_zero(out[0, 1] - (p * sp.sin(2 * a) + q * sp.cos(2 * a)))
    assert trig_zero(out[1, 0] - out[0, 1])
    # the check can fail: a wrong sign on q is caught
    assert not trig_zero(out[0, 1] - (p * sp.sin(2 * a) - q * sp.cos(2 * a)))


def test_step0_phase_average_is_affine_in_C_S(sym):
    """Each entry is affine in (cos 2a, sin 2a), so averaging over m replaces them by (C, S)."""
    cov, p, q, t = sigma(sym)
    a = sym["alpha"]
    x, y = sp.symbols("x y", real=True)
    out = sp.expand(sp.expand_trig(rot(a) * cov * rot(a).T))
    # write cos^2 a = (1 + x)/2, sin^2 a = (1 - x)/2, sin a cos a = y/2 with x = cos 2a, y = sin 2a
    ca, sa = sp.cos(a), sp.sin(a)
    repl = {ca**2: (1 + x) / 2, sa**2: (1 - x) / 2, sa * ca: y / 2}
    for entry in out:
        lin = sp.expand(sp.expand(entry).subs(repl))
        assert lin.free_symbols.isdisjoint({a}), entry
        poly = sp.Poly(lin, x, y)
        assert poly.total_degree() <= 1
    C, S = sym["C"], sym["S"]
    avg = [sp.expand(sp.expand(e).subs(repl)).subs({x: C, y: S}) for e in out]
    p_t, q_t = p * C - q * S, p * S + q * C
    assert sp.expand(avg[0] - (t + p_t)) == 0
    assert sp.expand(avg[3] - (t - p_t)) == 0
    assert sp.expand(avg[1] - q_t) == 0
    assert sp.expand(avg[0] + avg[3] - cov.trace()) == 0  # trace kept


def test_step0_average_over_positions_matches_closed_entries(sym, trig_zero):
    """Concrete L (1..4), symbolic theta: mean_m R_m Sigma R_m^T has p~ = pC - qS, q~ = pS + qC."""
    cov, p, q, t = sigma(sym)
    th = sym["a"]
    for L in range(1, 5):
        avg = sum((rot(m * th) * cov * rot(m * th).T for m in range(L)), sp.zeros(2, 2)) / L
        C = sum(sp.cos(2 * m * th) for m in range(L)) / L
        S = sum(sp.sin(2 * m * th) for m in range(L)) / L
        assert trig_zero(avg[0, 0] - avg[1, 1] - 2 * (p * C - q * S))
        assert trig_zero(avg[0, 1] - (p * S + q * C))
        assert trig_zero(avg.trace() - 2 * t)


# ----------------------------------------------------------------------------- (ii)


def test_ii_equalising_condition(sym, trig_zero):
    """d+ - d- = 2 (P cos 2phi - Q sin 2phi) = 2 r sin(beta - 2 phi) with (P, Q) = r (sin beta, cos beta):
    the two rotated variances are equal iff 2 phi = beta (mod pi)."""
    sur, P, Q, t = pair_surrogate_symbols()
    phi = sym["phi"]
    out = rot(phi) * sur * rot(phi).T
    diff = out[0, 0] - out[1, 1]
    assert trig_zero(diff - 2 * (P * sp.cos(2 * phi) - Q * sp.sin(2 * phi)))
    r, beta = sp.Symbol("r", positive=True), sp.Symbol("beta", real=True)
    polar = diff.subs({P: r * sp.sin(beta), Q: r * sp.cos(beta)})
    assert trig_zero(polar - 2 * r * sp.sin(beta - 2 * phi))
    # zeros of r sin(beta - 2 phi): exactly beta - 2 phi in pi Z (sympy's solver over the reals)
    k = sp.Symbol("k", real=True)
    sols = sp.solveset(sp.sin(k), k, sp.Interval(-4, 4))
    assert sols == sp.FiniteSet(-sp.pi, 0, sp.pi)


def test_ii_atan2_root_satisfies_it(sym):
    """phi = 0.5 atan2(Sig~11 - Sig~22, 2 Sig~12) equalises the two variances."""
    sur, P, Q, t = pair_surrogate_symbols()
    phi = sym["phi"]
    f = 2 * (P * sp.cos(2 * phi) - Q * sp.sin(2 * phi))  # = d+ - d- (previous test)
    root = sp.atan2(sur[0, 0] - sur[1, 1], 2 * sur[0, 1]) / 2
    assert sp.simplify(f.subs(phi, root)) == 0
    # while a perturbed angle does not (the check can fail)
    assert sp.simplify(f.subs(phi, root + sp.Rational(1, 10)).subs({P: 1, Q: 2})) != 0


# ----------------------------------------------------------------------------- (iii)


def test_iii_max_of_rotated_variances():
    """max(d+, d-) = (d+ + d-)/2 + |f|/2 with f = d+ - d-, and d+ is the max iff f >= 0."""
    dp, dm = sp.symbols("d_plus d_minus", real=True)
    f = dp - dm
    assert sp.simplify((sp.Max(dp, dm) - (dp + dm) / 2 - sp.Abs(f) / 2).rewrite(sp.Piecewise)) == 0
    g = sp.Symbol("g", nonnegative=True)
    h = sp.Symbol("h", negative=True)
    assert sp.Max(dm + g, dm) == dm + g  # f = g >= 0: the d+ branch
    assert sp.Max(dm + h, dm) == dm  # f < 0: the d- branch


def test_iii_sum_is_trace_so_max_is_mean_plus_half_gap(sym, trig_zero):
    sur, P, Q, t = pair_surrogate_symbols()
    phi = sym["phi"]
    out = rot(phi) * sur * rot(phi).T
    lam = list(sur.eigenvals().keys())
    assert len(lam) == 2
    assert sp.simplify(sum(lam) - 2 * t) == 0  # lambda1 + lambda2
    assert trig_zero(out[0, 0] + out[1, 1] - sum(lam))
    f = out[0, 0] - out[1, 1]
    mx = sp.Max(out[0, 0], out[1, 1])
    piecewise = sp.Piecewise((out[0, 0], f >= 0), (out[1, 1], True))
    target = sum(lam) / 2 + sp.Abs(f) / 2
    # evaluate at a few exact points (Max of trig expressions does not simplify symbolically)
    for vals in ({P: 3, Q: -2, t: 7, phi: sp.pi / 7}, {P: -1, Q: 5, t: 9, phi: -sp.pi / 5}):
        assert sp.simplify((mx - target).subs(vals)) == 0
        assert sp.simplify((piecewise - mx).subs(vals)) == 0


# ----------------------------------------------------------------------------- (iv)


def test_iv_trace_invariance_lower_bound_and_attainment(sym, trig_zero):
    """Over SO(2): d+ + d- = tr Sigma~ = tr Sigma, so max >= lambda_bar = (s1^2 + s2^2)/2,
    with equality at phi*."""
    cov, p, q, t = sigma(sym)
    C, S, phi = sym["C"], sym["S"], sym["phi"]
    P, Q = p * C - q * S, p * S + q * C
    sur = sp.Matrix([[t + P, Q], [Q, t - P]])
    assert sp.expand(sur.trace() - cov.trace()) == 0
    lam_bar = (sym["s1"] ** 2 + sym["s2"] ** 2) / 2
    assert sp.simplify(sum(cov.eigenvals().keys()) / 2 - lam_bar) == 0
    out = rot(phi) * sur * rot(phi).T
    assert trig_zero(out.trace() - 2 * lam_bar)
    f = 2 * (P * sp.cos(2 * phi) - Q * sp.sin(2 * phi))
    assert trig_zero(out[0, 0] - out[1, 1] - f)
    # max = lambda_bar + |f|/2 >= lambda_bar, and = lambda_bar iff f = 0, which phi* achieves
    phi_star = sp.atan2(P, Q) / 2
    assert sp.simplify(f.subs(phi, phi_star)) == 0
    assert sp.simplify((lam_bar + sp.Abs(f) / 2).subs(phi, phi_star) - lam_bar) == 0


def test_iv_reflections_cannot_beat_lambda_bar(sym, trig_zero):
    """O(2) optimality: for every reflection F(x) = G(x) diag(1,-1), the diagonal of F Sig~ F^T
    also sums to the trace, so its max is >= lambda_bar (ties possible, never below)."""
    sur, P, Q, t = pair_surrogate_symbols()
    x = sym["phi"]
    F = refl(x)
    assert trig_zero((F.T * F - sp.eye(2))[0, 0]) and trig_zero((F.T * F)[0, 1])
    assert trig_zero(F.det() + 1)
    out = F * sur * F.T
    assert trig_zero(out.trace() - 2 * t)
    gap = out[0, 0] - out[1, 1]
    assert trig_zero(gap - 2 * (P * sp.cos(2 * x) + Q * sp.sin(2 * x)))
    # max(d+, d-) - lambda_bar = |gap|/2 >= 0
    assert sp.simplify((sp.Max(out[0, 0], out[1, 1]) - t - sp.Abs(gap) / 2).subs(
        {P: 2, Q: -3, t: 10, x: sp.pi / 9})) == 0


# ----------------------------------------------------------------------------- phi* and excess


def _norm_subs(p, q, C, S):
    """sqrt(p~^2 + q~^2) = sqrt(p^2 + q^2) sqrt(C^2 + S^2) (|z (C - iS)| = |z| |C + iS|)."""
    pt, qt = p * C - q * S, p * S + q * C
    assert sp.expand(pt**2 + qt**2 - (p**2 + q**2) * (C**2 + S**2)) == 0
    return {sp.sqrt(pt**2 + qt**2): sp.sqrt(p**2 + q**2) * sp.sqrt(C**2 + S**2),
            sp.sqrt(sp.expand(pt**2 + qt**2)): sp.sqrt(p**2 + q**2) * sp.sqrt(C**2 + S**2)}


def test_phi_star_is_phi_hat_minus_half_phase():
    """q~ + i p~ = (C - iS)(q + ip), so 2 phi* = 2 phi_hat - atan2(S, C) (mod 2 pi),
    i.e. phi* = phi_hat - atan2(S, C)/2 (mod pi, hence mod pi/2)."""
    p, q, C, S = sp.symbols("p q C S", real=True)
    pt, qt = p * C - q * S, p * S + q * C
    assert sp.expand(qt + sp.I * pt - (C - sp.I * S) * (q + sp.I * p)) == 0
    two_star = sp.atan2(pt, qt)
    two_rel = sp.atan2(p, q) - sp.atan2(S, C)
    norm = _norm_subs(p, q, C, S)
    for fn in (sp.cos, sp.sin):
        d = sp.expand_trig(fn(two_star) - fn(two_rel)).subs(norm)
        assert sp.simplify(d) == 0
    # and the identity is specific: dropping the phase shift breaks it
    d_bad = sp.expand_trig(sp.cos(two_star) - sp.cos(sp.atan2(p, q))).subs(norm)
    assert sp.simplify(d_bad.subs({p: 1, q: 2, C: sp.Rational(1, 2), S: sp.Rational(1, 3)})) != 0


def test_excess_of_phi_hat(sym):
    """minimax(phi_hat) - lambda_bar = |S|/2 sqrt((s1^2 - s2^2)^2 + (2 rho s1 s2)^2)."""
    cov, p, q, t = sigma(sym)
    C, S = sym["C"], sym["S"]
    P, Q = p * C - q * S, p * S + q * C
    r = sp.sqrt(p**2 + q**2)
    # cos 2 phi_hat, sin 2 phi_hat for phi_hat = atan2(s11 - s22, 2 s12)/2 = atan2(p, q)/2
    c2, s2 = sp.cos(sp.atan2(p, q)), sp.sin(sp.atan2(p, q))
    assert sp.simplify(c2 - q / r) == 0 and sp.simplify(s2 - p / r) == 0
    half_gap = P * c2 - Q * s2  # (d+ - d-)/2 on the surrogate at phi_hat
    assert sp.simplify(half_gap + S * r) == 0
    s1_, s2_, rho = sym["s1"], sym["s2"], sym["rho"]
    # excess = |half_gap| and the claim are both >= 0, so compare squares
    claimed_sq = S**2 / 4 * ((s1_**2 - s2_**2) ** 2 + (2 * rho * s1_ * s2_) ** 2)
    assert sp.simplify(sp.expand(half_gap**2 - claimed_sq)) == 0
    assert sp.simplify(sp.expand(half_gap**2 - 4 * claimed_sq)) != 0  # |S| sqrt(.) (no 1/2) fails

"""The Theorem of §3 (steps (0), (ii), (iii), (iv) and the phi* / excess corollaries), in sympy.

Notation as in rope_quant.core.angles: Sigma = [[s1^2, rho s1 s2], [rho s1 s2, s2^2]],
p = (s1^2 - s2^2)/2, q = rho s1 s2, t = (s1^2 + s2^2)/2, and G(x) = R(x) = [[cos, -sin], [sin, cos]].

Each derivation is a helper below, used twice: by the proof test (the algebra, in sympy) and by a bridge
test (``test_bridge_*``) that ``sympy.lambdify``-s the very expression the proof derived and evaluates it
against the implementation (rope_quant.core.angles, rope_quant.core.rope) on seeded random inputs.
"""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp

from rope_quant.core import angles as A
from rope_quant.core.rope import phase_averages


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


# ----------------------------------------------------------------------------- the derivations


def rotated_covariance(sym) -> sp.Matrix:
    """Step (0): R_alpha Sigma R_alpha^T."""
    cov = sigma(sym)[0]
    a = sym["alpha"]
    return rot(a) * cov * rot(a).T


def phase_averaged_surrogate(sym) -> sp.Matrix:
    """Step (0): each entry of R_a Sigma R_a^T is affine in (cos 2a, sin 2a), so mean_m R_m Sigma R_m^T is the
    same entry with (cos 2a, sin 2a) -> (C, S). Returns that matrix in (sigma1, sigma2, rho, C, S); raises
    if an entry is not affine (the proof test checks this helper's premise explicitly as well)."""
    a = sym["alpha"]
    x, y = sp.symbols("x y", real=True)
    out = sp.expand(sp.expand_trig(rotated_covariance(sym)))
    ca, sa = sp.cos(a), sp.sin(a)
    repl = {ca**2: (1 + x) / 2, sa**2: (1 - x) / 2, sa * ca: y / 2}
    lin = [sp.expand(sp.expand(e).subs(repl)) for e in out]
    for e in lin:
        if not e.free_symbols.isdisjoint({a}) or sp.Poly(e, x, y).total_degree() > 1:
            raise AssertionError(f"entry {e} is not affine in (cos 2a, sin 2a)")
    return sp.Matrix(2, 2, [e.subs({x: sym["C"], y: sym["S"]}) for e in lin])


def position_average(sym, length: int) -> tuple[sp.Matrix, sp.Expr, sp.Expr]:
    """For a concrete L and symbolic theta (``sym['a']``): (mean_{m<L} R_m Sigma R_m^T, C, S) as explicit sums."""
    cov = sigma(sym)[0]
    th = sym["a"]
    avg = sum((rot(m * th) * cov * rot(m * th).T for m in range(length)), sp.zeros(2, 2)) / length
    C = sum(sp.cos(2 * m * th) for m in range(length)) / length
    S = sum(sp.sin(2 * m * th) for m in range(length)) / length
    return avg, C, S


def equalising_root(sur: sp.Matrix) -> sp.Expr:
    """(ii): phi = 0.5 atan2(Sig~11 - Sig~22, 2 Sig~12)."""
    return sp.atan2(sur[0, 0] - sur[1, 1], 2 * sur[0, 1]) / 2


def rotated_diagonal(sur: sp.Matrix, phi: sp.Expr) -> tuple[sp.Expr, sp.Expr]:
    """(iii): the two output variances d+, d- = diag(G(phi) Sig~ G(phi)^T)."""
    out = rot(phi) * sur * rot(phi).T
    return out[0, 0], out[1, 1]


def worst_variance(sur: sp.Matrix, phi: sp.Expr) -> sp.Expr:
    """(iii): the minimax objective max(d+, d-)."""
    return sp.Max(*rotated_diagonal(sur, phi))


def lambda_bar(cov: sp.Matrix) -> sp.Expr:
    """(iv): lambda_bar = (lambda1 + lambda2)/2, from the eigenvalues of Sigma."""
    lam = cov.eigenvals(multiple=True)
    return sum(lam) / 2


def phi_star_relative(p: sp.Expr, q: sp.Expr, C: sp.Expr, S: sp.Expr) -> sp.Expr:
    """Corollary: phi* = phi_hat - atan2(S, C)/2 (mod pi/2), phi_hat = atan2(p, q)/2."""
    return (sp.atan2(p, q) - sp.atan2(S, C)) / 2


def phi_hat_excess_squared(sym) -> sp.Expr:
    """Corollary: (minimax(phi_hat) - lambda_bar)^2 = S^2/4 ((s1^2 - s2^2)^2 + (2 rho s1 s2)^2)."""
    s1_, s2_, rho = sym["s1"], sym["s2"], sym["rho"]
    return sym["S"] ** 2 / 4 * ((s1_**2 - s2_**2) ** 2 + (2 * rho * s1_ * s2_) ** 2)


# ----------------------------------------------------------------------------- bridge helpers


def random_inputs(seed: int, n: int = 64) -> dict[str, np.ndarray]:
    """Seeded sigma1, sigma2 (three decades), rho, phi, and (C, S) in the unit disc."""
    rng = np.random.default_rng(seed)
    r, g = np.sqrt(rng.uniform(0, 1, n)), rng.uniform(-np.pi, np.pi, n)
    return {"s1": 10 ** rng.uniform(-1, 1, n), "s2": 10 ** rng.uniform(-1, 1, n), "rho": rng.uniform(-0.99, 0.99, n),
            "phi": rng.uniform(-4, 4, n), "C": r * np.cos(g), "S": r * np.sin(g)}


def cov_of(v: dict[str, np.ndarray]) -> A.PairCov:
    return A.PairCov(v["s1"] ** 2, v["s2"] ** 2, v["rho"] * v["s1"] * v["s2"])


def lam(sym, names: str, expr: sp.Expr):
    """lambdify ``expr`` in the named symbols of ``sym`` (space separated), numpy backend."""
    return sp.lambdify([sym[k] for k in names.split()], expr, "numpy")


def mod_half_pi(x: np.ndarray) -> np.ndarray:
    """|x| modulo pi/2 (the minimax objective's period)."""
    return np.abs(np.angle(np.exp(4j * np.asarray(x)))) / 4


# ----------------------------------------------------------------------------- step (0)


def test_step0_entries_of_rotated_covariance(sym, trig_zero):
    """R_a Sigma R_a^T = [[t + p cos2a - q sin2a, p sin2a + q cos2a], [., t - p cos2a + q sin2a]]."""
    cov, p, q, t = sigma(sym)
    a = sym["alpha"]
    out = rotated_covariance(sym)
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
    out = sp.expand(sp.expand_trig(rotated_covariance(sym)))
    # write cos^2 a = (1 + x)/2, sin^2 a = (1 - x)/2, sin a cos a = y/2 with x = cos 2a, y = sin 2a
    ca, sa = sp.cos(a), sp.sin(a)
    repl = {ca**2: (1 + x) / 2, sa**2: (1 - x) / 2, sa * ca: y / 2}
    for entry in out:
        lin = sp.expand(sp.expand(entry).subs(repl))
        assert lin.free_symbols.isdisjoint({a}), entry
        poly = sp.Poly(lin, x, y)
        assert poly.total_degree() <= 1
    C, S = sym["C"], sym["S"]
    avg = list(phase_averaged_surrogate(sym))
    p_t, q_t = p * C - q * S, p * S + q * C
    assert sp.expand(avg[0] - (t + p_t)) == 0
    assert sp.expand(avg[3] - (t - p_t)) == 0
    assert sp.expand(avg[1] - q_t) == 0
    assert sp.expand(avg[0] + avg[3] - cov.trace()) == 0  # trace kept


def test_step0_average_over_positions_matches_closed_entries(sym, trig_zero):
    """Concrete L (1..4), symbolic theta: mean_m R_m Sigma R_m^T has p~ = pC - qS, q~ = pS + qC."""
    cov, p, q, t = sigma(sym)
    for L in range(1, 5):
        avg, C, S = position_average(sym, L)
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
    root = equalising_root(sur)
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
    d_plus, d_minus = rotated_diagonal(sur, phi)
    lam = list(sur.eigenvals().keys())
    assert len(lam) == 2
    assert sp.simplify(sum(lam) - 2 * t) == 0  # lambda1 + lambda2
    assert sp.simplify(lambda_bar(sur) - t) == 0
    assert trig_zero(d_plus + d_minus - sum(lam))
    f = d_plus - d_minus
    mx = worst_variance(sur, phi)
    piecewise = sp.Piecewise((d_plus, f >= 0), (d_minus, True))
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
    assert sp.simplify(lambda_bar(cov) - lam_bar) == 0
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
    two_rel = 2 * phi_star_relative(p, q, C, S)
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
    # excess = |half_gap| and the claim are both >= 0, so compare squares
    claimed_sq = phi_hat_excess_squared(sym)
    assert sp.simplify(sp.expand(half_gap**2 - claimed_sq)) == 0
    assert sp.simplify(sp.expand(half_gap**2 - 4 * claimed_sq)) != 0  # |S| sqrt(.) (no 1/2) fails


# ----------------------------------------------------------------------------- bridges to the implementation

SEEDS = [0, 1, 2]


@pytest.mark.parametrize("seed", SEEDS)
def test_bridge_step0_rotated_covariance(sym, seed):
    """The derived R_a Sigma R_a^T against angles.givens and angles.rotated_variances."""
    v = random_inputs(seed)
    out = lam(sym, "s1 s2 rho alpha", rotated_covariance(sym))
    got = np.stack([out(*(v[k][i] for k in ("s1", "s2", "rho")), v["phi"][i]) for i in range(8)])
    cov = cov_of(v)
    v1, v2 = A.rotated_variances(cov, v["phi"])
    np.testing.assert_allclose(got[:, 0, 0], v1[:8], rtol=1e-12)
    np.testing.assert_allclose(got[:, 1, 1], v2[:8], rtol=1e-12)
    G = A.givens(v["phi"][:8])
    sig = np.stack([[cov.s11[:8], cov.s12[:8]], [cov.s12[:8], cov.s22[:8]]]).transpose(2, 0, 1)
    np.testing.assert_allclose(G @ sig @ np.swapaxes(G, -1, -2), got, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lam(sym, "alpha", rot(sym["alpha"]))(0.37), A.givens(0.37), rtol=1e-15)


@pytest.mark.parametrize("seed", SEEDS)
def test_bridge_step0_surrogate(sym, seed):
    """The derived Sig~(C, S) against angles.surrogate_covariance."""
    v = random_inputs(seed)
    sur = lam(sym, "s1 s2 rho C S", phase_averaged_surrogate(sym))
    got = np.stack([sur(*(v[k][i] for k in ("s1", "s2", "rho", "C", "S"))) for i in range(16)])
    want = A.surrogate_covariance(cov_of(v), v["C"], v["S"])
    scale = (v["s1"] ** 2 + v["s2"] ** 2)[:16]
    for (i, j), w in (((0, 0), want.s11), ((1, 1), want.s22), ((0, 1), want.s12), ((1, 0), want.s12)):
        np.testing.assert_allclose(got[:, i, j], w[:16], rtol=0, atol=1e-13 * scale.max())


@pytest.mark.parametrize("length", [1, 2, 3, 4])
def test_bridge_position_average_and_phase_averages(sym, length):
    """The derived mean_{m<L} R_m Sigma R_m^T (explicit sums, symbolic theta) against
    rope.phase_averages + angles.surrogate_covariance, and its (C, S) sums against phase_averages."""
    v = random_inputs(10 + length, n=12)
    theta = np.random.default_rng(length).uniform(0.01, 3.1, 12)
    avg, C_expr, S_expr = position_average(sym, length)
    avg_f, c_f, s_f = lam(sym, "s1 s2 rho a", avg), lam(sym, "a", C_expr), lam(sym, "a", S_expr)
    C, S = phase_averages(theta, length)
    np.testing.assert_allclose(c_f(theta), C, atol=1e-13)
    np.testing.assert_allclose(s_f(theta), S, atol=1e-13)
    sur = A.surrogate_covariance(cov_of(v), C, S)
    for i in range(12):
        got = avg_f(v["s1"][i], v["s2"][i], v["rho"][i], theta[i])
        tol = 1e-12 * (v["s1"][i] ** 2 + v["s2"][i] ** 2)
        assert got[0, 0] == pytest.approx(sur.s11[i], abs=tol)
        assert got[1, 1] == pytest.approx(sur.s22[i], abs=tol)
        assert got[0, 1] == pytest.approx(sur.s12[i], abs=tol)


@pytest.mark.parametrize("seed", SEEDS)
def test_bridge_phi_star_and_jacobi_angle(sym, seed):
    """(ii)'s root on the derived surrogate against angles.equalising_angle (mod pi/2, as it is wrapped) and,
    at (C, S) = (1, 0), against angles.jacobi_angle exactly (both unwrapped)."""
    v = random_inputs(seed)
    root = equalising_root(phase_averaged_surrogate(sym))
    star = lam(sym, "s1 s2 rho C S", root)(v["s1"], v["s2"], v["rho"], v["C"], v["S"])
    cov = cov_of(v)
    got = A.equalising_angle(cov, v["C"], v["S"])
    assert np.all((got >= -np.pi / 4) & (got < np.pi / 4))
    np.testing.assert_array_less(mod_half_pi(got - star), 1e-9)
    hat = lam(sym, "s1 s2 rho", root.subs({sym["C"]: 1, sym["S"]: 0}))(v["s1"], v["s2"], v["rho"])
    np.testing.assert_allclose(A.jacobi_angle(*cov), hat, rtol=0, atol=1e-12)
    rel = phi_star_relative((sym["s1"] ** 2 - sym["s2"] ** 2) / 2, sym["rho"] * sym["s1"] * sym["s2"],
                            sym["C"], sym["S"])
    rel_v = lam(sym, "s1 s2 rho C S", rel)(v["s1"], v["s2"], v["rho"], v["C"], v["S"])
    np.testing.assert_array_less(mod_half_pi(got - rel_v), 1e-9)


@pytest.mark.parametrize("seed", SEEDS)
def test_bridge_minimax_excess_and_lambda_bar(sym, seed):
    """(iii)'s max(d+, d-) on the derived surrogate and (iv)'s lambda_bar against angles.minimax_variance,
    angles.minimax_excess and angles.analytic_minimum, at random angles."""
    v = random_inputs(seed)
    sur = phase_averaged_surrogate(sym)
    args = (v["s1"], v["s2"], v["rho"], v["C"], v["S"], v["phi"])
    worst = lam(sym, "s1 s2 rho C S phi", worst_variance(sur, sym["phi"]))(*args)
    lam_bar = lam(sym, "s1 s2 rho", lambda_bar(sigma(sym)[0]))(v["s1"], v["s2"], v["rho"])
    cov = cov_of(v)
    scale = v["s1"] ** 2 + v["s2"] ** 2
    np.testing.assert_allclose(A.analytic_minimum(cov), lam_bar, rtol=1e-12)
    got_sur = A.surrogate_covariance(cov, v["C"], v["S"])
    np.testing.assert_allclose(A.minimax_variance(got_sur, v["phi"]), worst, rtol=1e-12)
    np.testing.assert_allclose(A.minimax_excess(cov, v["phi"], v["C"], v["S"]), worst - lam_bar,
                               rtol=0, atol=1e-12 * scale.max())


@pytest.mark.parametrize("seed", SEEDS)
def test_bridge_excess_of_phi_hat(sym, seed):
    """The phi_hat excess corollary, sqrt of the derived square, against angles.minimax_excess(phi_hat)."""
    v = random_inputs(seed)
    claimed = np.sqrt(lam(sym, "s1 s2 rho S", phi_hat_excess_squared(sym))(v["s1"], v["s2"], v["rho"], v["S"]))
    cov = cov_of(v)
    got = A.minimax_excess(cov, A.jacobi_angle(*cov), v["C"], v["S"])
    np.testing.assert_allclose(got, claimed, rtol=1e-9, atol=1e-13 * (v["s1"] ** 2 + v["s2"] ** 2).max())

"""Foldable R3 in theory: the foldable R3 maps commute with RoPE where they claim to, and keep q·k.

Symbolic (sympy) on one RoPE pair and on a two-pair head, then hypothesis on the registry's dense matrices
(``matrix`` = M_k, ``query_matrix`` = M_q) at random angles, scales, frequencies and positions.
"""

from __future__ import annotations

import numpy as np
import sympy as sp
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from rope_quant.core import transforms
from rope_quant.core.rope import LAYOUTS, rope_matrix


def rot(x: sp.Expr) -> sp.Matrix:
    return sp.Matrix([[sp.cos(x), -sp.sin(x)], [sp.sin(x), sp.cos(x)]])


def test_a_pair_tied_scale_times_a_givens_commutes_and_keeps_the_score() -> None:
    """M_k = s·G(φ) commutes with R(θ) for every θ; M_q = M_k^{-T} = G(φ)/s; (M_q q)·(M_k k) = q·k."""
    s = sp.symbols("s", positive=True)
    phi, theta = sp.symbols("phi theta", real=True)
    q = sp.Matrix(sp.symbols("q0 q1", real=True))
    k = sp.Matrix(sp.symbols("k0 k1", real=True))
    mk = s * rot(phi)
    mq = mk.inv().T
    assert sp.simplify(mq - rot(phi) / s) == sp.zeros(2, 2)
    assert sp.simplify(mk * rot(theta) - rot(theta) * mk) == sp.zeros(2, 2)
    assert sp.simplify(mq * rot(theta) - rot(theta) * mq) == sp.zeros(2, 2)
    assert sp.simplify((mq * q).dot(mk * k) - q.dot(k)) == 0


def test_an_untied_scale_commutes_only_when_tied() -> None:
    """diag(a, b) R(θ) = R(θ) diag(a, b) for all θ iff a = b: why prerope_channel_scale ties its scales."""
    a, b = sp.symbols("a b", positive=True)
    theta = sp.symbols("theta", real=True)
    gap = sp.simplify(sp.diag(a, b) * rot(theta) - rot(theta) * sp.diag(a, b))
    assert gap != sp.zeros(2, 2)
    assert sp.solve(list(gap.subs(theta, sp.pi / 2)), [b], dict=True) == [{b: a}]
    assert sp.simplify(gap.subs(b, a)) == sp.zeros(2, 2)


def test_scaled_pairs_of_different_frequencies_commute_blockwise() -> None:
    """Two pairs, two frequencies, two scales: M = s1 G(φ1) ⊕ s2 G(φ2) commutes with R(θ1) ⊕ R(θ2)."""
    s1, s2 = sp.symbols("s1 s2", positive=True)
    p1, p2, t1, t2 = sp.symbols("p1 p2 t1 t2", real=True)
    m = sp.diag(s1 * rot(p1), s2 * rot(p2))
    r = sp.diag(rot(t1), rot(t2))
    assert sp.simplify(m * r - r * m) == sp.zeros(4, 4)


def test_the_cayley_map_is_orthogonal() -> None:
    """C(B) = (I − B)^{-1}(I + B) with B = −Bᵀ is orthogonal (learned_orthogonal's parametrisation)."""
    x, y, z = sp.symbols("x y z", real=True)
    b = sp.Matrix([[0, x, y], [-x, 0, z], [-y, -z, 0]])
    c = (sp.eye(3) - b).inv() * (sp.eye(3) + b)
    assert sp.simplify(c * c.T) == sp.eye(3)


# ----------------------------------------------------------------------------- hypothesis on the registry


def _freqs(rng: np.random.Generator, k: int) -> np.ndarray:
    return np.sort(rng.uniform(0.01, 3.0, k))[::-1] * (1 + 1e-3 * np.arange(k))


@settings(max_examples=25, deadline=None)
@given(st.sampled_from([4, 8, 16]), st.sampled_from(LAYOUTS), st.integers(0, 2**31 - 1), st.integers(1, 3))
def test_registry_maps_commute_as_declared_and_keep_every_score(d: int, layout: str, seed: int, heads: int) -> None:
    rng = np.random.default_rng(seed)
    k = d // 2
    qmat, _ = np.linalg.qr(rng.normal(size=(heads, d, d)))
    cases = [
        transforms.build("pairwise_scaled", d, angles=rng.uniform(-np.pi, np.pi, (heads, k)),
                         scales=np.exp(rng.normal(0, 1, (heads, k))), layout=layout),
        transforms.build("prerope_channel_scale", d, scales=np.exp(rng.normal(0, 1, (heads, k))), layout=layout),
        transforms.build("learned_orthogonal", d, matrices=qmat, layout=layout),
    ]
    freqs = _freqs(rng, k)
    positions = rng.integers(1, 10_000, 3)
    q, kk = rng.normal(size=d), rng.normal(size=d)
    for t in cases:
        assert transforms.commutes_with_rope(t.name) == t.commutes_with_rope
        for h in range(heads):
            mk, mq = t.matrix(h, heads), t.query_matrix(h, heads)
            assert abs((mq @ q) @ (mk @ kk) - q @ kk) < 1e-9 * (1 + abs(q @ kk)) * max(1.0, np.abs(mk).max()) ** 2
            gap = max(np.abs(m @ rope_matrix(freqs, p, layout) - rope_matrix(freqs, p, layout) @ m).max()
                      for m in (mk, mq) for p in positions)
            if t.commutes_with_rope:
                assert gap < 1e-9 * max(1.0, np.abs(mk).max(), np.abs(mq).max())
            else:  # a random orthogonal matrix mixes pairs of different frequencies
                assert gap > 1e-6


@settings(max_examples=25, deadline=None)
@given(arrays(np.float64, 4, elements=st.floats(-50, 50)), st.sampled_from(LAYOUTS))
def test_non_positive_or_non_finite_scales_are_refused(raw: np.ndarray, layout: str) -> None:
    bad = raw.copy()
    bad[0] = -abs(bad[0])  # ≤ 0
    for scales in (bad, np.r_[raw[:3], np.nan]):
        try:
            transforms.build("prerope_channel_scale", 8, scales=scales, layout=layout)
        except transforms.ScaleError:
            continue
        raise AssertionError(f"scales {scales} were accepted")

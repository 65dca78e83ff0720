"""The Lemma's converse (part (b)), by machine: for pairwise-distinct theta_k in (0, pi), the
commutant of R_1 in O(d) is exactly SO(2)^K; and the counterexamples when the precondition fails.

Dimensions are null-space dimensions (numpy SVD, with a tolerance) of the linear map
``X -> R X - X R``: over all d x d matrices (the commutant algebra, expected ``2K`` = span{I, J}
per pair) and over skew-symmetric matrices (the Lie algebra of the commutant in O(d), expected
``K``). For large d the map is split exactly into its 2x2-block pieces (R is block diagonal in
pair coordinates, so ``(RX - XR)_{jk} = R_j X_jk - X_jk R_k``); for small d the dense
``d^2 x d^2`` map is checked in the channel (rotate_half / interleaved) layout as well.

:func:`block_kernels` (the null-space projectors of those block maps) is the derived commutant; the proof
tests show it is span{I, J} on the diagonal blocks and 0 elsewhere, and the bridge test decides with it,
and by direct commutation, whether every R3 registry transform commutes with RoPE, against the
transform's declared ``commutes_with_rope``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rope_quant.core import transforms
from rope_quant.core.rope import LAYOUTS, layout_permutation, pair_indices, rope_matrix

TOL = 1e-9
J2 = np.array([[0.0, -1.0], [1.0, 0.0]])


# ----------------------------------------------------------------------------- helpers


def rot2(theta: np.ndarray) -> np.ndarray:
    c, s = np.cos(theta), np.sin(theta)
    return np.stack([np.stack([c, -s], -1), np.stack([s, c], -1)], -2)


def block_maps(theta: np.ndarray) -> np.ndarray:
    """(K, K, 4, 4): the map X_jk -> R_j X_jk - X_jk R_k on column-major vec(X_jk)."""
    R = rot2(theta)  # (K, 2, 2)
    eye = np.eye(2)
    left = np.einsum("ab,jcd->jacbd", eye, R).reshape(-1, 4, 4)  # I (x) R_j
    right = np.einsum("kdc,ab->kcadb", R, eye).reshape(-1, 4, 4)  # R_k^T (x) I
    return left[:, None] - right[None, :]


def nullity(mats: np.ndarray, tol: float = TOL) -> np.ndarray:
    sv = np.linalg.svd(mats, compute_uv=False)
    return (sv <= tol * max(1.0, float(np.max(sv, initial=0.0)))).sum(-1) + (mats.shape[-1] - sv.shape[-1])


def block_kernels(theta: np.ndarray, tol: float = TOL) -> np.ndarray:
    """(K, K, 4, 4): orthogonal projectors onto the null space of each block map (the commutant, block by block,
    on column-major vec(X_jk) in pair-interleaved coordinates)."""
    maps = block_maps(theta)
    _, sv, vh = np.linalg.svd(maps)
    null = sv <= tol * max(1.0, float(sv.max()))
    basis = vh * null[..., None]  # keep the right-singular vectors of the zero singular values
    return np.einsum("...ai,...aj->...ij", basis, basis)


def commutant_residual(M: np.ndarray, theta: np.ndarray, layout: str) -> float:
    """Distance of a channel-space d x d matrix from the commutant of R_1 (relative to ||M||_F)."""
    d = M.shape[0]
    P = np.eye(d)[layout_permutation(d, layout, "interleaved")]
    X = P @ M @ P.T  # pair-interleaved coordinates: block (j, k) = X[2j:2j+2, 2k:2k+2]
    k = d // 2
    blocks = X.reshape(k, 2, k, 2).transpose(0, 2, 3, 1).reshape(k, k, 4)  # column-major vec of each block
    proj = np.einsum("jkab,jkb->jka", block_kernels(theta), blocks)
    return float(np.linalg.norm(blocks - proj) / np.linalg.norm(M))


def commutant_dims_blocks(theta: np.ndarray) -> tuple[int, int]:
    """(dim of the commutant algebra, dim of its skew part) via the exact block split."""
    maps = block_maps(theta)
    null = nullity(maps)  # (K, K)
    linear = int(null.sum())
    k = theta.size
    # skew part: diagonal blocks are multiples of J (1-dim); off-diagonal (j<k) blocks are free,
    # with X_kj = -X_jk^T determined by them (and satisfying its own equation iff X_jk does).
    R = rot2(theta)
    diag_skew = (np.linalg.norm(R @ J2 - J2 @ R, axis=(-2, -1)) <= TOL).sum()
    upper = null[np.triu_indices(k, 1)].sum()
    return linear, int(diag_skew + upper)


def commutator_map(R: np.ndarray) -> np.ndarray:
    """Dense d^2 x d^2 matrix of X -> R X - X R on column-major vec(X)."""
    d = R.shape[0]
    eye = np.eye(d)
    return np.kron(eye, R) - np.kron(R.T, eye)


def skew_basis(d: int) -> np.ndarray:
    cols = []
    for i in range(d):
        for j in range(i + 1, d):
            E = np.zeros((d, d))
            E[i, j], E[j, i] = 1.0, -1.0
            cols.append(E.reshape(-1, order="F"))
    return np.array(cols).T.reshape(d * d, -1)


def commutant_dims_dense(R: np.ndarray) -> tuple[int, int]:
    L = commutator_map(R)
    d = R.shape[0]
    linear = int(nullity(L))
    if d < 2:
        return linear, 0
    skew = int(nullity(L @ skew_basis(d)))
    return linear, skew


@st.composite
def distinct_frequencies(draw, max_pairs: int = 64) -> np.ndarray:
    """K pairwise-distinct angles in (0, pi), separated by a margin from each other and from 0, pi."""
    k = draw(st.integers(1, max_pairs))
    weights = draw(st.lists(st.floats(1.0, 10.0), min_size=k + 1, max_size=k + 1))
    cum = np.cumsum(weights)
    theta = np.pi * cum[:-1] / cum[-1]
    order = draw(st.permutations(list(range(k))))
    return theta[np.array(order, dtype=int)]


# ----------------------------------------------------------------------------- part (b)


@settings(max_examples=30, deadline=None)
@given(distinct_frequencies(64))
def test_commutant_is_so2_power_k(theta):
    """d_h = 2K from 2 to 128: commutant algebra = sum of span{I, J} (dim 2K); skew part dim K."""
    k = theta.size
    linear, skew = commutant_dims_blocks(theta)
    assert linear == 2 * k
    assert skew == k
    # within each pair the kernel is exactly span{I, J}: every orthogonal element a I + b J has
    # a^2 + b^2 = 1, det = +1, so the commutant in O(d) holds no reflections
    maps = block_maps(theta)
    diag = maps[np.arange(k), np.arange(k)]  # (K, 4, 4)
    _, sv, vh = np.linalg.svd(diag)
    kernel = vh[:, 2:, :]  # the two smallest singular directions per pair
    assert np.all(sv[:, 2:] <= TOL)
    span = np.stack([np.eye(2).reshape(-1, order="F"), J2.reshape(-1, order="F")])  # (2, 4), orthogonal rows
    proj = kernel @ span.T @ span / 2.0  # project onto span{I, J} (each row has norm^2 2)
    assert np.allclose(proj, kernel, atol=1e-10)
    # the same statement for the whole commutant, through block_kernels: span{I, J} on the diagonal, 0 elsewhere
    kernels = block_kernels(theta)
    want = np.zeros_like(kernels)
    want[np.arange(k), np.arange(k)] = span.T @ span / 2.0
    assert np.allclose(kernels, want, atol=1e-8)


@settings(max_examples=30, deadline=None)
@given(distinct_frequencies(8), st.sampled_from(LAYOUTS))
def test_dense_commutant_matches_block_count(theta, layout):
    """d <= 16, in channel layout: the dense d^2 x d^2 map gives the same dimensions."""
    R = rope_matrix(theta, 1, layout)
    assert commutant_dims_dense(R) == commutant_dims_blocks(theta) == (2 * theta.size, theta.size)


@settings(max_examples=30, deadline=None)
@given(distinct_frequencies(64), st.sampled_from(LAYOUTS), st.data())
def test_pair_reflection_does_not_commute(theta, layout, data):
    """A reflection diag(1, -1) inside any pair fails to commute with R_1; SO(2)^K elements do commute."""
    d = 2 * theta.size
    idx_a, idx_b = pair_indices(d, layout)
    R = rope_matrix(theta, 1, layout)
    k = data.draw(st.integers(0, theta.size - 1))
    F = np.eye(d)
    F[idx_b[k], idx_b[k]] = -1.0
    assert np.linalg.norm(R @ F - F @ R) > 1e-6
    phis = np.asarray(data.draw(st.lists(st.floats(-np.pi, np.pi), min_size=theta.size, max_size=theta.size)))
    G = rope_matrix(np.ones_like(phis), 0, layout)  # identity of the right size
    G[idx_a, idx_a], G[idx_a, idx_b] = np.cos(phis), -np.sin(phis)
    G[idx_b, idx_a], G[idx_b, idx_b] = np.sin(phis), np.cos(phis)
    assert np.allclose(G @ R, R @ G, atol=1e-12)


@pytest.mark.parametrize("base,d", [(1e4, 64), (1e5, 64), (1e4, 128), (5e5, 128)])
def test_real_rope_frequencies_have_so2_commutant(base, d):
    """The precondition holds for RoPE's own frequencies base^(-2k/d), which lie in (0, 1]."""
    theta = base ** (-np.arange(0, d, 2) / d)
    linear, skew = commutant_dims_blocks(theta)
    assert (linear, skew) == (d, d // 2)


# ----------------------------------------------------------------------------- counterexamples


@settings(max_examples=20, deadline=None)
@given(distinct_frequencies(16), st.data())
def test_repeated_frequency_enlarges_commutant(theta, data):
    if theta.size < 2:
        theta = np.array([0.7, 1.9])
    i, j = data.draw(st.permutations(list(range(theta.size))))[:2]
    theta = theta.copy()
    theta[j] = theta[i]
    k = theta.size
    linear, skew = commutant_dims_blocks(theta)
    assert linear == 2 * k + 4 and skew == k + 2  # the repeated pair mixes: u(2) instead of u(1)^2
    if k <= 8:
        assert commutant_dims_dense(rope_matrix(theta, 1, "rotate_half")) == (linear, skew)


@pytest.mark.parametrize("edge", [0.0, np.pi])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_theta_zero_or_pi_admits_reflections(edge, layout):
    theta = np.array([0.3, edge, 1.1, 2.0])
    d = 2 * theta.size
    R = rope_matrix(theta, 1, layout)
    linear, skew = commutant_dims_dense(R)
    # the algebra grows (all of M_2 in that pair) while the Lie algebra does not (so(2) = span{J}):
    # the extra orthogonal elements form a second component of O(2), the reflections
    assert linear == 2 * theta.size + 2 and skew == theta.size
    _, idx_b = pair_indices(d, layout)
    F = np.eye(d)
    F[idx_b[1], idx_b[1]] = -1.0  # a reflection in the degenerate pair
    assert np.linalg.det(F) == pytest.approx(-1.0)
    assert np.allclose(R @ F, F @ R, atol=1e-12)


def test_layout_permutation_conjugates_rope():
    theta = np.array([0.2, 0.9, 1.7])
    perm = layout_permutation(6, "rotate_half", "interleaved")
    P = np.eye(6)[perm]  # x_dst = P x_src
    assert np.allclose(P @ rope_matrix(theta, 5, "rotate_half") @ P.T, rope_matrix(theta, 5, "interleaved"))


# ----------------------------------------------------------------------------- bridge: the R3 registry


def registry_cases(head_dim: int, rng: np.random.Generator) -> list[tuple[str, dict]]:
    """Every registry name with every valid parameter shape at ``head_dim`` (all block sizes; (K,) and
    (H_kv, K) angles)."""
    k = head_dim // 2
    cases: list[tuple[str, dict]] = []
    for name in transforms.names():
        if transforms.needs_block(name):
            cases += [(name, {"block": b}) for b in (2**i for i in range(1, 8)) if b <= head_dim]
        elif transforms.needs_angles(name):
            cases += [(name, {"angles": rng.uniform(-np.pi, np.pi, k)}),
                      (name, {"angles": rng.uniform(-np.pi, np.pi, (2, k))})]
        else:
            cases.append((name, {}))
    return cases


@pytest.mark.parametrize("head_dim", [8, 16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bridge_registry_declares_what_the_commutant_says(head_dim, layout):
    """For every R3 transform: declared ``commutes_with_rope`` == (M in the derived commutant) == (M R_m = R_m M
    at random positions), with distinct random frequencies and with RoPE's own base^(-2k/d)."""
    rng = np.random.default_rng(head_dim)
    cum = np.cumsum(rng.uniform(1.0, 10.0, head_dim // 2 + 1))
    thetas = [np.pi * cum[:-1] / cum[-1], 1e4 ** (-np.arange(0, head_dim, 2) / head_dim)]  # distinct, in (0, pi)
    seen: dict[str, set[bool]] = {}
    for name, params in registry_cases(head_dim, rng):
        tr = transforms.build(name, head_dim, layout=layout, **params)
        declared = tr.commutes_with_rope
        assert transforms.commutes_with_rope(name, head_dim, layout=layout, **params) == declared
        rows = max(1, tr.n_angle_rows)
        for head in range(rows):
            M = tr.matrix(head)
            assert np.allclose(M @ M.T, np.eye(head_dim), atol=1e-12)
            for theta in thetas:
                in_commutant = commutant_residual(M, theta, layout) < 1e-8
                gaps = [np.linalg.norm(M @ rope_matrix(theta, m, layout) - rope_matrix(theta, m, layout) @ M)
                        for m in (1, *rng.integers(2, 5000, 4))]
                commutes = max(gaps) < 1e-9
                assert declared == in_commutant == commutes, (name, params, layout, head)
        seen.setdefault(name, set()).add(declared)
    assert set(seen) == set(transforms.names())  # every registry entry was checked
    assert {True, False} <= set().union(*seen.values())  # both verdicts occur: the check can fail

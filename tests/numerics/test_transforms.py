"""The R3 registry (rope_quant.core.transforms): orthogonality, q·k invariance, RoPE commutation, layouts, GQA."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rope_quant.core import transforms as T
from rope_quant.core.hadamard import hadamard_matrix
from rope_quant.core.rope import (
    OddHeadDimError,
    UnsupportedLayoutError,
    layout_permutation,
    rope_matrix,
)
from rope_quant.quant.quantizers import fake_quant_per_token, quant_step

D = 64
K = D // 2
H_Q, H_KV = 9, 3  # SmolLM2-135M
LAYOUTS = ("rotate_half", "interleaved")
SMOL_INV_FREQ = 1e5 ** (-2.0 * np.arange(K) / D)
POSITIONS = (1, 2, 7, 100, 4095)
ANGLES = np.random.default_rng(0).uniform(-math.pi / 4, math.pi / 4, (H_KV, K))


def _variants() -> list[tuple[str, dict]]:
    out: list[tuple[str, dict]] = []
    for name in T.names():
        if T.needs_block(name):
            out += [(name, {"block": b}) for b in (2, 4, 8, D)]
        elif T.needs_angles(name):
            out += [(name, {"angles": ANGLES[0]}), (name, {"angles": ANGLES})]
        else:
            out.append((name, {}))
    return out


VARIANTS = _variants()
IDS = [
    f"{n}-{'perhead' if np.ndim(p.get('angles', 0)) == 2 else p.get('block', 'shared')}" for n, p in VARIANTS
]


def _random_freqs(seed: int) -> np.ndarray:
    freqs = np.random.default_rng(seed).uniform(0.01, 3.0, K)
    assert len(set(freqs.tolist())) == K
    return freqs


def _commutes_numerically(t: T.R3Transform, layout: str) -> bool:
    """max |M R_m − R_m M| over several m and two frequency sets (SmolLM2-like and random distinct)."""
    err = 0.0
    for freqs in (SMOL_INV_FREQ, _random_freqs(1)):
        for head in range(max(t.n_angle_rows, 1)):
            m = t.matrix(head)
            for pos in POSITIONS:
                r = rope_matrix(freqs, pos, layout)
                err = max(err, float(np.abs(m @ r - r @ m).max()))
    return err < 1e-10


def test_registry_names() -> None:
    assert set(T.names()) == {
        "identity",
        "hadamard",
        "pairwise_only",
        "pairwise_plus_hadamard",
        "pair_h2",
        "block_hadamard",
        "block_hadamard_contiguous",
        "pair_h2_raw",
        "block_hadamard_raw",
        "pairwise_scaled",
        "prerope_channel_scale",
        "learned_orthogonal",
    }
    assert T.needs_fit("pairwise_scaled") and not T.needs_fit("pairwise_only")
    assert T.needs_angles("pairwise_only") and T.needs_angles("pairwise_plus_hadamard")
    assert not T.needs_angles("hadamard") and T.needs_block("block_hadamard_raw")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("name", "params"), VARIANTS, ids=IDS)
def test_orthogonal_apply_matches_matrix_and_preserves_scores(name: str, params: dict, layout: str) -> None:
    t = T.build(name, D, layout=layout, **params)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, H_Q, 5, D, generator=gen, dtype=torch.float64)
    k = torch.randn(2, H_KV, 5, D, generator=gen, dtype=torch.float64)
    tq, tk = t.apply(q), t.apply(k)
    for h in range(H_Q):
        m = t.matrix(h, n_heads=H_Q)
        np.testing.assert_allclose(m @ m.T, np.eye(D), atol=1e-12)
        np.testing.assert_allclose(tq[:, h].numpy(), q[:, h].numpy() @ m.T, atol=1e-12)
    for h in range(H_KV):
        np.testing.assert_allclose(
            tk[:, h].numpy(), k[:, h].numpy() @ t.matrix(h, n_heads=H_KV).T, atol=1e-12
        )
    # q·k of every Q head with its KV group's key is unchanged (GQA: head h -> KV head h // 3).
    kk = k.repeat_interleave(H_Q // H_KV, dim=1)
    tkk = tk.repeat_interleave(H_Q // H_KV, dim=1)
    torch.testing.assert_close(tq @ tkk.transpose(-1, -2), q @ kk.transpose(-1, -2), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("name", "params"), VARIANTS, ids=IDS)
def test_declared_commutation_matches_numeric_check(name: str, params: dict, layout: str) -> None:
    t = T.build(name, D, layout=layout, **params)
    assert t.commutes_with_rope == _commutes_numerically(t, layout)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_expected_commutation_pattern(layout: str) -> None:
    """Lemma: only per-pair SO(2) rotations commute; raw H2 is a reflection, b > 2 mixes frequencies."""

    def flag(name: str, **p) -> tuple[bool, bool]:
        t = T.build(name, D, layout=layout, **p)
        return t.commutes_with_rope, _commutes_numerically(t, layout)

    for name, p in [
        ("identity", {}),
        ("pairwise_only", {"angles": ANGLES}),
        ("pair_h2", {}),
        ("block_hadamard", {"block": 2}),
    ]:
        assert flag(name, **p) == (True, True), name
    for name, p in [
        ("hadamard", {}),
        ("pairwise_plus_hadamard", {"angles": ANGLES}),
        ("pair_h2_raw", {}),
        ("block_hadamard_raw", {"block": 2}),
        ("block_hadamard_raw", {"block": 8}),
    ]:
        assert flag(name, **p) == (False, False), name
    for b in (4, 8, 16, 32, 64):
        assert flag("block_hadamard", block=b) == (False, False), b
    # The channel-contiguous control pairs neighbouring channels: a RoPE pair only in the interleaved layout.
    expected = layout == "interleaved"
    assert flag("block_hadamard_contiguous", block=2) == (expected, expected)


def test_raw_h2_is_reflection_of_so2_orientation() -> None:
    """H2 = G(π/4)·diag(1, −1) in each pair: det −1 per pair, so R(θ) is conjugated to R(−θ)."""
    for layout in LAYOUTS:
        raw = T.build("pair_h2_raw", D, layout=layout).matrix()
        so2 = T.build("pair_h2", D, layout=layout).matrix()
        a, b = T.interleave_permutation(D, layout)[0::2], T.interleave_permutation(D, layout)[1::2]
        flip = np.eye(D)
        flip[b, b] = -1.0
        np.testing.assert_allclose(raw, so2 @ flip, atol=1e-15)
        r = rope_matrix(SMOL_INV_FREQ, 3, layout)
        r_neg = rope_matrix(SMOL_INV_FREQ, -3, layout)
        np.testing.assert_allclose(raw @ r @ raw.T, r_neg, atol=1e-12)
        assert np.allclose(np.linalg.det(raw[np.ix_([a[0], b[0]], [a[0], b[0]])]), -1.0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_block2_equals_pair_h2_equals_pairwise_pi4(layout: str) -> None:
    x = torch.randn(1, H_KV, 6, D, generator=torch.Generator().manual_seed(2))
    b2 = T.build("block_hadamard", D, block=2, layout=layout)
    h2 = T.build("pair_h2", D, layout=layout)
    pw = T.build("pairwise_only", D, angles=np.full(K, math.pi / 4), layout=layout)
    np.testing.assert_allclose(b2.matrix(), h2.matrix(), atol=0)
    np.testing.assert_allclose(b2.matrix(), pw.matrix(), atol=1e-15)
    torch.testing.assert_close(b2.apply(x), h2.apply(x), rtol=0, atol=0)
    torch.testing.assert_close(b2.apply(x), pw.apply(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_block_full_head_is_permuted_hadamard(layout: str) -> None:
    """block_hadamard(d) = P · H_d/√d with P a fixed signed permutation on the output side."""
    blk = T.build("block_hadamard", D, block=D, layout=layout).matrix()
    had = T.build("hadamard", D, layout=layout).matrix()
    p = blk @ had.T
    assert np.allclose(np.abs(p).sum(0), 1.0) and np.allclose(np.abs(p).sum(1), 1.0)
    assert np.allclose(np.abs(p).max(1), 1.0)
    np.testing.assert_allclose(p @ had, blk, atol=1e-12)
    # The raw orientation at b = d is exactly the Sylvester Hadamard (the interleave is its symmetry).
    raw = T.build("block_hadamard_raw", D, block=D, layout=layout).matrix()
    np.testing.assert_allclose(raw, hadamard_matrix(D).numpy() / math.sqrt(D), atol=1e-12)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_block_full_head_matches_hadamard_k_range_and_error(layout: str) -> None:
    """A signed permutation of each head vector leaves the per-token range and 4-bit error unchanged."""
    k = torch.randn(2, H_KV, 64, D, generator=torch.Generator().manual_seed(3)) * torch.linspace(0.2, 4.0, D)
    kb = T.build("block_hadamard", D, block=D, layout=layout).apply(k)
    kh = T.build("hadamard", D, layout=layout).apply(k)
    _, rb = quant_step(kb, 4, D)
    _, rh = quant_step(kh, 4, D)
    torch.testing.assert_close(rb, rh, rtol=1e-5, atol=1e-5)
    eb = (fake_quant_per_token(kb, 4, D) - kb).pow(2).sum()
    eh = (fake_quant_per_token(kh, 4, D) - kh).pow(2).sum()
    torch.testing.assert_close(eb, eh, rtol=1e-4, atol=1e-6)
    # Not a tautology: a pairwise rotation changes both.
    kp = T.build("pairwise_only", D, angles=ANGLES[0], layout=layout).apply(k)
    assert not torch.allclose(quant_step(kp, 4, D)[1], rh, rtol=1e-3)


def test_per_head_angles_follow_gqa_groups() -> None:
    t = T.build("pairwise_only", D, angles=ANGLES)
    q = torch.randn(1, H_Q, 4, D, generator=torch.Generator().manual_seed(4))
    tq = t.apply(q)
    for h in range(H_Q):
        row = h // (H_Q // H_KV)
        shared = T.build("pairwise_only", D, angles=ANGLES[row])
        torch.testing.assert_close(tq[:, h], shared.apply(q[:, h]), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(t.matrix(h, n_heads=H_Q), shared.matrix(), atol=0)
    with pytest.raises(T.HeadMismatchError, match="multiple"):
        t.apply(torch.randn(1, 4, 2, D))
    with pytest.raises(T.HeadMismatchError):
        t.matrix(9, n_heads=H_Q)


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("identity", {}),
        ("hadamard", {}),
        ("pairwise_only", {"angles": ANGLES}),
        ("pairwise_plus_hadamard", {"angles": ANGLES}),
        ("pair_h2", {}),
        ("pair_h2_raw", {}),
        ("block_hadamard", {"block": 4}),
        ("block_hadamard", {"block": D}),
        ("block_hadamard_raw", {"block": 8}),
    ],
)
def test_layouts_are_permutation_conjugate(name: str, params: dict) -> None:
    """Angles in the interleaved layout give the permutation conjugate of the rotate_half transform."""
    perm = layout_permutation(D, "rotate_half", "interleaved")  # x_int = x_rh[..., perm]
    pi = np.zeros((D, D))
    pi[np.arange(D), perm] = 1.0  # x_int = Π x_rh
    rh = T.build(name, D, layout="rotate_half", **params)
    il = T.build(name, D, layout="interleaved", **params)
    for h in range(max(rh.n_angle_rows, 1)):
        np.testing.assert_allclose(il.matrix(h), pi @ rh.matrix(h) @ pi.T, atol=1e-14)
    x = torch.randn(1, H_KV, 5, D, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    torch.testing.assert_close(il.apply(x[..., perm]), rh.apply(x)[..., perm], rtol=1e-12, atol=1e-12)


def test_contiguous_control_is_not_layout_conjugate() -> None:
    """The contiguous-block control acts on native channel order, so its meaning changes with the layout.

    (The Sylvester H_d is itself invariant under the pair-interleave shuffle, H_2 ⊗ H_{d/2} ~ H_{d/2} ⊗ H_2,
    which is why ``hadamard`` is in the conjugate list above.)
    """
    perm = layout_permutation(D, "rotate_half", "interleaved")
    pi = np.zeros((D, D))
    pi[np.arange(D), perm] = 1.0
    for name, p in [("block_hadamard_contiguous", {"block": 2}), ("block_hadamard_contiguous", {"block": 8})]:
        rh = T.build(name, D, layout="rotate_half", **p).matrix()
        il = T.build(name, D, layout="interleaved", **p).matrix()
        assert not np.allclose(il, pi @ rh @ pi.T)


def test_pairwise_plus_hadamard_is_composition() -> None:
    x = torch.randn(2, H_Q, 3, D, generator=torch.Generator().manual_seed(6))
    pw = T.build("pairwise_only", D, angles=ANGLES)
    ph = T.build("pairwise_plus_hadamard", D, angles=ANGLES)
    had = T.build("hadamard", D)
    torch.testing.assert_close(ph.apply(x), had.apply(pw.apply(x)), rtol=1e-6, atol=1e-6)


@given(
    phi=st.lists(st.floats(-math.pi, math.pi, allow_nan=False), min_size=K, max_size=K),
    layout=st.sampled_from(LAYOUTS),
)
def test_pairwise_commutes_for_any_angles(phi: list[float], layout: str) -> None:
    t = T.build("pairwise_only", D, angles=np.array(phi), layout=layout)
    m = t.matrix()
    np.testing.assert_allclose(m @ m.T, np.eye(D), atol=1e-12)
    r = rope_matrix(_random_freqs(2), 11, layout)
    np.testing.assert_allclose(m @ r, r @ m, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("hadamard", {}),
        ("pairwise_plus_hadamard", {"angles": ANGLES}),
        ("block_hadamard", {"block": 8}),
        ("pair_h2_raw", {}),
    ],
)
def test_dtypes_preserved(dtype: torch.dtype, name: str, params: dict) -> None:
    t = T.build(name, D, **params)
    x = torch.randn(1, H_Q, 7, D, generator=torch.Generator().manual_seed(7))
    y = t.apply(x.to(dtype))
    assert y.dtype == dtype and y.shape == x.shape
    ref = t.apply(x.double())
    tol = {torch.float16: 1e-2, torch.bfloat16: 8e-2, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol)


def test_other_head_dims() -> None:
    for d in (2, 8, 128, 96):
        t = T.build("pairwise_plus_hadamard", d, angles=np.linspace(-0.5, 0.5, d // 2))
        m = t.matrix()
        np.testing.assert_allclose(m @ m.T, np.eye(d), atol=1e-12)
        x = torch.randn(1, 2, 3, d, dtype=torch.float64)
        np.testing.assert_allclose(t.apply(x).numpy(), x.numpy() @ m.T, atol=1e-12)
    t = T.build("block_hadamard", 96, block=32)
    np.testing.assert_allclose(t.matrix() @ t.matrix().T, np.eye(96), atol=1e-12)


def test_bad_inputs_raise_specific_errors() -> None:
    with pytest.raises(OddHeadDimError):
        T.build("hadamard", 63)
    with pytest.raises(OddHeadDimError):
        T.build("pairwise_only", 0, angles=np.zeros(0))
    with pytest.raises(UnsupportedLayoutError):
        T.build("pair_h2", D, layout="neox")
    with pytest.raises(T.UnknownTransformError, match="expected one of"):
        T.build("rotate", D)
    for b in (0, 1, 3, 6, 128, True, 2.0):
        with pytest.raises(T.InvalidBlockSizeError, match="power of two"):
            T.build("block_hadamard", D, block=b)
    with pytest.raises(T.InvalidBlockSizeError):
        T.build("block_hadamard", 96, block=64)  # does not divide
    with pytest.raises(T.TransformParamError, match="missing"):
        T.build("pairwise_only", D)
    with pytest.raises(T.TransformParamError, match="missing"):
        T.build("block_hadamard", D)
    with pytest.raises(T.TransformParamError, match="unexpected"):
        T.build("hadamard", D, block=4)
    with pytest.raises(T.AngleShapeError):
        T.build("pairwise_only", D, angles=np.zeros(K + 1))
    with pytest.raises(T.AngleShapeError):
        T.build("pairwise_only", D, angles=np.zeros((2, 3, K)))
    with pytest.raises(T.AngleShapeError, match="NaN"):
        T.build("pairwise_only", D, angles=np.full(K, np.nan))
    with pytest.raises(T.HeadMismatchError):
        T.build("hadamard", D).apply(torch.zeros(1, 1, 2, 32))
    with pytest.raises(ValueError):
        T.build("pair_h2", D).apply(torch.zeros(1, 1, 2, D, dtype=torch.int64))
    for err in (T.UnknownTransformError, T.InvalidBlockSizeError, T.AngleShapeError, T.HeadMismatchError):
        assert issubclass(err, ValueError)


def test_autograd_path_matches_inplace_path() -> None:
    t = T.build("pairwise_only", D, angles=ANGLES, layout="interleaved")
    x = torch.randn(1, H_Q, 4, D, generator=torch.Generator().manual_seed(8), requires_grad=True)
    y = t.apply(x)
    y.square().sum().backward()
    torch.testing.assert_close(y.detach(), t.apply(x.detach()), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, 2 * x.detach(), rtol=1e-5, atol=1e-5)  # orthogonal: d|Mx|²/dx = 2x


def test_cached_tables_built_in_inference_mode_are_usable_with_autograd() -> None:
    """Regression: a cache first filled under torch.inference_mode must not poison later autograd forwards."""
    import numpy as np
    import torch

    from rope_quant.core import transforms

    t = transforms.build("pairwise_plus_hadamard", 64, angles=np.linspace(-0.5, 0.5, 32))
    with torch.inference_mode():
        t.apply(torch.randn(1, 3, 4, 64))
    x = torch.randn(1, 3, 4, 64, requires_grad=True)
    t.apply(x).square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()

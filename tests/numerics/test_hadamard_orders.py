"""Constructed Hadamard orders (rope_quant.core.hadamard_orders / hadamard_search): every multiple of 4 up to 256,
exact in integer arithmetic; the matrices that the embedded models and the recorded numbers use are pinned."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
import torch

from rope_quant.core import hadamard as hd
from rope_quant.core import hadamard_orders as ho
from rope_quant.core import hadamard_search as hs

ORDERS = tuple(range(4, 257, 4))
#: The 11 orders that had no construction at commit f831d19 (2026-11-28).
NEW_ORDERS = (52, 92, 100, 116, 156, 172, 184, 188, 232, 236, 244)

#: sha256 of the int8 matrix (row-major), computed at commit f831d19 before the new constructions: the orders
#: of the embedded SmolLM2 (64, 192, 576, 1536) and Gemma 3 (256, 640, 1024, 2048), the Paley factors, and
#: the paper-scale widths up to 4096.
PINNED_FULL = {
    12: "96c4e95b8f52c8ded50751d31b62e70c1d87a25db8917a1605dfa8e032d60b2d",
    20: "e5d1e5dd287996d7cc1cab63ec70294cd29f10841a9816602e63cd7f542b5039",
    28: "a24c9c5912c711a9bad9f9a9ee25a5fa088b3effa4e660143e5272d3fe4290b1",
    36: "1a7aed2f42a8c71de2ae13e765a6df2c2023519ef899b00d5d0baa7ee26f341b",
    44: "f67bcf7e314abc9646ee7f0de2ee22cfaaae399e61b5132d447206ac1ac32ab8",
    60: "249ae98f22299deaaaab22b2c8caa11dae74d002977688206472a19585d674a4",
    64: "4be469934f00a70b701ba4d1d2f489d817feb9fce017ad0decb3433bb851aae0",
    128: "6c75072bc838cd31cf9d36107ed40203803153bb786269c7ef3e53e17ba46fee",
    192: "66e83e10476747e35d34a00c61571092e8978f72674d0822895ffbc1cad3bfa1",
    256: "48e8331c828232b2d80b2d9f39b388a49c074fd94a6688a58f8a872a7d1c12f9",
    576: "4fc7e4b139b2557537645e5ce9d5bf0d5edb9ca257a1769bb9754ea4d33ea1bc",
    640: "fce697ae91c6924999d3bfaa2e2820fc4b59eedeaf2337d5622d0612bff5107f",
    1024: "5a173b88a228b188b33834779879f49d602f43520e6c56c581d8adeb206732d7",
    1536: "cfab86945d864db6caeec2780560e0ff553f2a27fbdaf837624978fc8b49988a",
    2048: "1b0bbe0b93141d457a5eaacf3e9593a71b5bfa389219937d47c97082ff3e51dc",
    3584: "799241077fc65c703f7345b205181a9f3b96e3cc7cf0f4aa450239056e75f766",
    4096: "1d9ba72dad9df866357b12ee4d9abc39da0bd29b009ac04fab6b1cbb994c97b2",
}
#: The same at the larger paper-scale widths, over 64 evenly spaced columns of H (H e_i by the transform).
PINNED_COLUMNS = {
    8192: "8b05b4d9dfe0d34f09b6127b90a7dd4589eb29a9aa73b78b8bbf802462e312a2",
    14336: "aac04a6cb31f80c87d2ff2f27b3a14dc928cdf0702d9199fbfabc1074312df85",
    18944: "a7c74f5075f2d6f955b1f85fd841445d1ddfe84c0f3dd98d9f358d46fbb65246",
    28672: "4b2cd5cd63562fbbb0e9ea15203ef6af1b415ac0772d0d303bb972abdfcf07f4",
}

#: sha256 of the new orders' int8 matrices as first built (2026-11-28): the searches are deterministic, so a
#: change here means a construction or a search moved, and with it any number measured at these orders.
PINNED_NEW = {
    52: "e2278b13940b11ea09e5bdada5f105cd90ed9c8c97d8d1b2f69d98cb0b46da9e",
    92: "42be87f48155fa5efecaccb13be8905eb76a8f51446bb900d5dd49fa35bbca2a",
    100: "89d400ecb6ea82c83b28372532f15618bf86caf0c2d68085fc84d97193cbcd23",
    116: "e6044a84e7b2871851c721c351162b57b330a7ada7350edfc6450280519dfceb",
    156: "d1f2cd271044f6e5e27a10689a6cb9e1ce6441751987fdf91747f7329f02b7ac",
    172: "186330f6b0a438fe454798e6143fe5513e15de128e3258c84005b91a323f2448",
    184: "84a57ec9e4b88761a0e35b36a961a2448ddbc7ba861f7963375942795ee37f58",
    188: "29e59467abccb850f826d4c85c2bd71b39d178402a6e3fad07c7ec4daee38086",
    232: "7eef836bb4ac441cd58687b3ff243600588c8fdcc21b460138a27eb6d2b11e03",
    236: "56bde52a0bce1761d7705d80140c4829372d8c3d72c3f54c6782f15f63044729",
    244: "dc4cc2cde524634dd36a17a97667bc20fb39bc02903fa827ba6d5200273f7292",
}


def _sha(h: torch.Tensor) -> str:
    return hashlib.sha256(h.to(torch.int8).numpy().tobytes()).hexdigest()


def _assert_hadamard(h: torch.Tensor, n: int) -> None:
    assert h.dtype == torch.int64 and h.shape == (n, n)
    assert bool(((h == 1) | (h == -1)).all())
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.int64))


@pytest.mark.parametrize("n", ORDERS)
def test_every_multiple_of_four_up_to_256_is_an_exact_hadamard_matrix(n: int) -> None:
    assert hd.is_supported_order(n)
    _assert_hadamard(hd.hadamard_matrix(n, dtype=torch.int64), n)


@pytest.mark.parametrize("n", ORDERS)
def test_transform_matches_the_dense_matrix(n: int) -> None:
    """hadamard_transform (H_K ⊗ H_{2^m} kernels) equals x @ Hᵀ/√n, at n and at 2n (one Sylvester doubling)."""
    for size in (n, 2 * n):
        gen = torch.Generator().manual_seed(size)
        x = torch.randn(3, 5, size, generator=gen, dtype=torch.float64)
        h = hd.hadamard_matrix(size)
        torch.testing.assert_close(hd.hadamard_transform(x), x @ h.T / math.sqrt(size), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(hd.hadamard_transform(x, normalize=False), x @ h.T, rtol=1e-12, atol=1e-10)


@pytest.mark.parametrize("n", sorted(PINNED_FULL))
def test_matrices_in_use_are_unchanged(n: int) -> None:
    """The new constructions must not move any matrix the embedded models or the recorded numbers use."""
    assert _sha(hd.hadamard_matrix(n, dtype=torch.int64)) == PINNED_FULL[n]


@pytest.mark.parametrize("n", NEW_ORDERS)
def test_new_orders_are_reproducible(n: int) -> None:
    assert _sha(hd.hadamard_matrix(n, dtype=torch.int64)) == PINNED_NEW[n]


@pytest.mark.parametrize("n", sorted(PINNED_COLUMNS))
def test_large_widths_are_unchanged(n: int) -> None:
    idx = torch.linspace(0, n - 1, 64).round().long()
    x = torch.zeros(64, n, dtype=torch.float64)
    x[torch.arange(64), idx] = 1
    cols = hd.hadamard_transform(x, normalize=False)  # row i = column idx[i] of H, exactly ±1
    assert bool(((cols == 1) | (cols == -1)).all())
    assert _sha(cols) == PINNED_COLUMNS[n]


def test_which_construction_serves_each_new_order() -> None:
    kinds = {k: ho.construction(k) for k in NEW_ORDERS}
    assert ho.paley_order(52) == ("II", 25) and ho.paley_order(100) == ("II", 49)
    assert ho.paley_order(244) == ("I", 243)  # 3^5
    assert ho.paley_order(28) == ("II", 13)  # a prime beats the prime power 27
    assert ho.paley_order(344) == ("I", 343) and ho.paley_order_prime(344) is None  # 7^3
    gs = {k for k, c in kinds.items() if c is ho.Construction.GOETHALS_SEIDEL}
    assert gs == {92, 116, 156, 172, 188, 236}
    assert hd.hadamard_order(184) == (92, 1) and hd.hadamard_order(232) == (116, 1)  # Sylvester doubling


@pytest.mark.parametrize(("p", "k"), [(5, 2), (7, 2), (11, 2), (3, 3), (7, 3), (3, 4), (3, 5), (2, 7)])
def test_irreducible_polynomial_is_irreducible(p: int, k: int) -> None:
    sympy = pytest.importorskip("sympy")
    f = ho.irreducible_polynomial(p, k)
    assert len(f) == k + 1 and f[-1] == 1
    assert sympy.Poly(list(reversed(f)), sympy.Symbol("x"), modulus=p).is_irreducible


@pytest.mark.parametrize("t", sorted(hs.GS_MULTIPLIERS))
def test_orbit_search_sequences_have_zero_periodic_autocorrelation_sum(t: int) -> None:
    seqs = np.array(hs.gs_sequences(t))
    assert seqs.shape == (4, t) and bool((np.abs(seqs) == 1).all())
    paf = sum(np.array([(s * np.roll(s, -j)).sum() for j in range(1, t)]) for s in seqs)
    assert not paf.any()
    assert sum(int(s.sum()) ** 2 for s in seqs) == 4 * t


def test_search_is_deterministic() -> None:
    """A fresh search (not the cached result) returns the same sequences."""
    assert hs.gs_sequences.__wrapped__(29) == hs.gs_sequences(29)
    assert hs.turyn_sequences.__wrapped__(16) == hs.turyn_sequences(16)


@pytest.mark.parametrize("n", hs.TURYN_LENGTHS)
def test_turyn_sequences_and_their_t_sequence_quadruple(n: int) -> None:
    x, y, z, w = (np.array(s) for s in hs.turyn_sequences(n))
    assert (len(x), len(y), len(z), len(w)) == (n, n, n, n - 1)

    def aper(s: np.ndarray, j: int) -> int:
        return int((s[: len(s) - j] * s[j:]).sum()) if j < len(s) else 0

    for j in range(1, n):
        assert aper(x, j) + aper(y, j) + 2 * aper(z, j) + 2 * aper(w, j) == 0
    quad = np.array(hs.t_sequence_quadruple(n))
    t = 3 * n - 1
    assert quad.shape == (4, t) and bool((np.abs(quad) == 1).all())
    for j in range(1, t):
        assert sum(aper(s, j) for s in quad) == 0


def test_unset_search_lengths_are_refused() -> None:
    with pytest.raises(hs.SearchSetupError, match="t = 67"):
        hs.gs_sequences(67)
    with pytest.raises(hs.SearchSetupError, match="n = 12"):
        hs.turyn_sequences(12)
    assert not hd.is_supported_order(268)  # 4·67: no construction here


@pytest.mark.parametrize("n", NEW_ORDERS)
def test_cross_check_against_compressed_tensors(n: int) -> None:
    """compressed-tensors ([export] extra) ships Hadamard matrices from a library of tables: used here only as a
    cross-check that an order exists and that both matrices are Hadamard (they need not be equal)."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.transform.utils.hadamard import _fetch_hadamard_divisor

    theirs = _fetch_hadamard_divisor(n, torch.float64)
    assert theirs is not None and theirs.shape == (n, n)
    theirs = theirs.round().to(torch.int64)
    _assert_hadamard(theirs, n)
    _assert_hadamard(hd.hadamard_matrix(n, dtype=torch.int64), n)

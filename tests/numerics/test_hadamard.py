"""Hadamard kernels and constructed orders (rope_quant.core.hadamard)."""

from __future__ import annotations

import math

import pytest
import torch

from rope_quant.core import hadamard as hd
from rope_quant.core.hadamard import (
    NonFloatTensorError,
    UnsupportedHadamardOrderError,
    dense_hadamard_transform,
    fwht,
    hadamard_matrix,
    hadamard_order,
    hadamard_transform,
    random_hadamard,
)

PAPER_K = (12, 20, 28, 36, 44, 60)


def _sylvester_rows(rows: torch.Tensor, n: int) -> torch.Tensor:
    """Sylvester rows from the closed form H[i, j] = (-1)^popcount(i & j) (independent of hd)."""
    j = torch.arange(n)
    bits = rows[:, None] & j[None, :]
    parity = torch.zeros_like(bits)
    while bool(bits.any()):
        parity ^= bits & 1
        bits = bits >> 1
    return (1 - 2 * parity).to(torch.float64)


# ------------------------------------------------------------------------------------------- constructions


@pytest.mark.parametrize("k", PAPER_K)
@pytest.mark.parametrize("m", [0, 1, 2, 3])
def test_constructed_matrix_is_hadamard_exactly(k: int, m: int) -> None:
    n = k << m
    h = hadamard_matrix(n, dtype=torch.int64)
    assert h.shape == (n, n)
    assert bool(((h == 1) | (h == -1)).all())
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.int64))


@pytest.mark.parametrize("n", [1, 2, 4, 8, 64, 256, 512])
def test_sylvester_matrix_exact_and_closed_form(n: int) -> None:
    h = hadamard_matrix(n, dtype=torch.int64)
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.int64))
    assert torch.equal(h.to(torch.float64), _sylvester_rows(torch.arange(n), n))


def test_both_paley_constructions_are_exercised() -> None:
    kinds = {k: hd.paley_order_prime(k) for k in PAPER_K}
    assert kinds[12] == ("I", 11) and kinds[20] == ("I", 19) and kinds[44] == ("I", 43)
    assert kinds[60] == ("I", 59)
    assert kinds[28] == ("II", 13) and kinds[36] == ("II", 17)


@pytest.mark.parametrize(
    ("n", "expected"),
    [(576, (36, 4)), (1536, (12, 7)), (14336, (28, 9)), (4096, (1, 12)), (12, (12, 0)), (40, (20, 1)),
     (11008, (172, 6)), (18944, (148, 7)), (104, (52, 1))],
)
def test_model_dimensions_decompose(n: int, expected: tuple[int, int]) -> None:
    """SmolLM2 hidden 576 and intermediate 1536, Llama-3.1-8B/Mistral intermediate 14336, Llama-2-7B / Qwen2.5-3B
    intermediate 11008 = 172·64 (Goethals–Seidel), Qwen2.5-7B 18944 = 148·128; 104 = 52·2 (Paley II over GF(25))."""
    assert hadamard_order(n) == expected
    assert hd.is_supported_order(n)


@pytest.mark.parametrize("n", [0, -4, 3, 5, 6, 10, 14, 22, 268, 536])
def test_unsupported_orders_raise(n: int) -> None:
    assert not hd.is_supported_order(n)
    with pytest.raises(UnsupportedHadamardOrderError, match="order"):
        hadamard_order(n)
    if n > 0:
        with pytest.raises(UnsupportedHadamardOrderError):
            hadamard_transform(torch.zeros(2, n))
        with pytest.raises(UnsupportedHadamardOrderError):
            hadamard_matrix(n)


def test_fwht_rejects_non_power_of_two_and_integers() -> None:
    with pytest.raises(UnsupportedHadamardOrderError):
        fwht(torch.zeros(3, 12))
    with pytest.raises(NonFloatTensorError):
        hadamard_transform(torch.zeros(3, 8, dtype=torch.int64))
    with pytest.raises(ValueError):  # NonFloatTensorError is a ValueError too
        fwht(torch.zeros(3, 8, dtype=torch.int32))


def test_hadamard_matrix_cache_is_not_aliased() -> None:
    h = hadamard_matrix(16)
    h.zero_()
    assert bool((hadamard_matrix(16).abs() == 1).all())
    x = torch.randn(4, 16, dtype=torch.float64)
    assert torch.allclose(hadamard_transform(x), x @ _sylvester_rows(torch.arange(16), 16).T / 4.0)


# ----------------------------------------------------------------------------------------------- kernels


@pytest.mark.parametrize("n", [2**p for p in range(1, 11)])
def test_fwht_matches_dense_small(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(5, 3, n, generator=gen)
    ref = x.double() @ _sylvester_rows(torch.arange(n), n).T / math.sqrt(n)
    for y in (fwht(x), hadamard_transform(x), dense_hadamard_transform(x)):
        assert y.dtype == torch.float32 and y.shape == x.shape
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [2048, 4096, 8192, 16384, 32768])
def test_fwht_matches_dense_rows_large(n: int) -> None:
    """Large sizes take the radix path; compare against 16 closed-form rows of H (no n×n matrix)."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(3, n, generator=gen)
    y = fwht(x)
    rows = torch.randint(0, n, (16,), generator=gen)
    ref = x.double() @ _sylvester_rows(rows, n).T / math.sqrt(n)
    torch.testing.assert_close(y[:, rows].double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=0)
    torch.testing.assert_close(fwht(y), x, rtol=1e-4, atol=1e-4)  # Sylvester H/√n is an involution


@pytest.mark.parametrize("k", [12, 20, 28, 36, 44, 60])
@pytest.mark.parametrize("m", [0, 1, 3, 5])
def test_kronecker_transform_matches_dense(k: int, m: int) -> None:
    n = k << m
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(2, 4, n, generator=gen)
    h = hadamard_matrix(n)  # float64 ±1
    ref = x.double() @ h.T / math.sqrt(n)
    torch.testing.assert_close(hadamard_transform(x).double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dense_hadamard_transform(x).double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        hadamard_transform(x, normalize=False).double(), x.double() @ h.T, rtol=1e-5, atol=1e-4
    )


def test_kronecker_transform_at_14336_rows() -> None:
    """14336 = 28·512: compare a few rows against H_28 ⊗ H_512 built from the closed forms."""
    n, k, p = 14336, 28, 512
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, n, generator=gen, dtype=torch.float64)
    y = hadamard_transform(x)
    rows = torch.randint(0, n, (8,), generator=gen)
    h28 = hadamard_matrix(k)
    hrows = torch.kron(h28[rows // p], torch.ones(1, p, dtype=torch.float64))
    hrows = hrows * _sylvester_rows(rows % p, p).repeat(1, k)
    torch.testing.assert_close(y[:, rows], x @ hrows.T / math.sqrt(n), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-12, atol=0)


@pytest.mark.parametrize("n", [2104, 2 * 2104])
def test_large_paley_factor_is_one_gemm_and_exact(n: int) -> None:
    """2104 = 1052·2 (no smaller K for the odd part 263): the large-factor GEMM path equals x @ Hᵀ/√n in float64."""
    k, m = hadamard_order(n)
    assert k == 1052 and k > hd.DENSE_MAX  # the path under test
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(2, 3, n, generator=gen, dtype=torch.float64)
    ref = x @ hadamard_matrix(n).T / math.sqrt(n)
    torch.testing.assert_close(hadamard_transform(x), ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(hadamard_transform(x[0, 0]), ref[0, 0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("n", [64, 1024, 96])
def test_transform_keeps_dtype(dtype: torch.dtype, n: int) -> None:
    x = torch.randn(7, n, generator=torch.Generator().manual_seed(1))
    y = hadamard_transform(x.to(dtype))
    assert y.dtype == dtype and y.shape == x.shape
    tol = {torch.float16: 1e-2, torch.bfloat16: 6e-2, torch.float64: 1e-6}[dtype]
    torch.testing.assert_close(y.double(), hadamard_transform(x.double()), rtol=tol, atol=tol)


def test_radix_split_shapes() -> None:
    for n in [512, 1024, 8192, 32768, 1 << 20]:
        parts = hd._radix_split(n)
        assert math.prod(parts) == n and len(parts) >= 2
        assert all(p & (p - 1) == 0 and p <= hd.RADIX_MAX for p in parts)
    assert hd._radix_split(hd.DENSE_MAX) == [hd.DENSE_MAX]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available on this machine")
@pytest.mark.parametrize("n", [64, 128, 576, 4096])
def test_cuda_path_matches_cpu(n: int) -> None:  # pragma: no cover - needs a GPU
    x = torch.randn(33, n, generator=torch.Generator().manual_seed(n))
    y = hadamard_transform(x.cuda()).cpu()
    torch.testing.assert_close(y, hadamard_transform(x), rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------------------- random_hadamard


@pytest.mark.parametrize("n", [64, 576])
def test_random_hadamard_orthogonal_and_seeded(n: int) -> None:
    q = random_hadamard(n, seed=3, dtype=torch.float64)
    torch.testing.assert_close(q @ q.T, torch.eye(n, dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.equal(q, random_hadamard(n, seed=3, dtype=torch.float64))
    assert not torch.equal(q, random_hadamard(n, seed=4, dtype=torch.float64))
    signs = (q / (hadamard_matrix(n, dtype=torch.float64) / math.sqrt(n))).round()
    assert bool((signs == signs[:, :1]).all())  # one sign per row: diag(s) · H/√n (QuaRot)
    col = signs[:, 0]
    assert bool((col.abs() == 1).all()) and bool((col == -1).any()) and bool((col == 1).any())
    assert random_hadamard(n, seed=3).dtype == torch.float32


@pytest.mark.parametrize("n", [64, 576])
def test_random_hadamard_magnitudes_change_with_the_seed(n: int) -> None:
    """QuaRot's diag(s)·H (since 2bbd27c): the signs act before the mixing, so |x·R| depends on the seed (with
    H·diag(s) it would not: only output signs flip, and the quantisers would never see rotation randomness)."""
    x = torch.linspace(-1.0, 2.0, n, dtype=torch.float64) ** 3  # unequal entries
    r0, r1 = random_hadamard(n, 0, torch.float64), random_hadamard(n, 1, torch.float64)
    for r in (r0, r1):
        torch.testing.assert_close(r.T @ r, torch.eye(n, dtype=torch.float64), rtol=0, atol=1e-12)
    a0, a1 = (x @ r0).abs(), (x @ r1).abs()
    assert not torch.allclose(a0, a1, atol=1e-6), "random Hadamard magnitudes do not depend on the seed"
    assert torch.isclose(a0.norm(), a1.norm(), rtol=1e-12)  # both are rotations of the same x

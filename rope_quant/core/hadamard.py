"""Walsh–Hadamard transforms and Hadamard matrices of constructed orders.

The online rotations of the pipeline (R3 on post-RoPE q/k, R4 on the down_proj input) and the offline R1
need a Hadamard matrix of order n acting on the last dimension of a tensor.

* Powers of two use the Sylvester matrix H_{2^m} = H_2^{⊗m} (natural ordering), applied by
  :func:`fwht`, a pure-torch radix transform: H_n = H_{r_1} ⊗ … ⊗ H_{r_t} with small cached dense factors,
  one batched matmul per factor. Small n use a single dense factor (a dense matmul is the fastest
  CPU kernel there); large n use two or three factors (n·Σr_i flops per row instead of n²).
* Orders n = K·2^m use H_K ⊗ H_{2^m} with the smallest constructible K (:mod:`.hadamard_orders`): Paley I/II
  over GF(q) for prime powers q, and Goethals–Seidel matrices whose sequences a deterministic search finds
  (:mod:`.hadamard_search`); every multiple of 4 up to 256 is built. Examples: SmolLM2 hidden 576 = 36·16 and
  intermediate 1536 = 12·128, Llama-3.1-8B / Mistral intermediate 14336 = 28·512, Llama-2-7B / Qwen2.5-3B
  intermediate 11008 = 172·64 (it was 5504·2 before K = 172 was built: R4 at 1.2–1.5× the down_proj matmul,
  now 0.075–0.081× at 1 thread; docs/measurements.md). The transform applies H_K as one small matmul on the K axis
  and H_{2^m} by :func:`fwht`; a K above 256 (no smaller K for that odd part) as one GEMM.
* On CUDA, the ``fast-hadamard-transform`` kernel is used for the power-of-two factor when it is importable.

Every matrix here is the same one whichever kernel applies it, so an offline rotation fused into weights
(:func:`hadamard_matrix`) and its online counterpart (:func:`hadamard_transform`) always agree.
"""

from __future__ import annotations

import functools
import math

import torch

from rope_quant.core.hadamard_orders import (
    UnsupportedHadamardOrderError,
    hadamard_order,
    integer_hadamard,
    is_supported_order,
    paley_order,
    paley_order_prime,
)

__all__ = [
    "UnsupportedHadamardOrderError",
    "NonFloatTensorError",
    "hadamard_matrix",
    "hadamard_transform",
    "fwht",
    "dense_hadamard_transform",
    "random_hadamard",
    "hadamard_order",
    "is_supported_order",
    "paley_order_prime",
    "paley_order",
    "fast_kernel_available",
]

#: Largest power-of-two size handled by one dense matmul in :func:`fwht`.
DENSE_MAX = 256
#: Largest order whose dense matrix is cached per (n, device, dtype).
CACHE_MAX = 4096
#: Largest radix factor used when :func:`fwht` splits a larger power of two.
RADIX_MAX = 128


class NonFloatTensorError(TypeError, ValueError):
    """A rotation or quantiser was given an integer/bool tensor."""


def hadamard_matrix(
    n: int, dtype: torch.dtype = torch.float64, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Unnormalised Hadamard matrix of order n (entries ±1, H Hᵀ = n I): H_K ⊗ Sylvester (Sec. 2 / App. A).

    ``dtype=torch.int64`` gives the exact integer matrix.
    """
    if n <= CACHE_MAX:
        return _cached_matrix(n, torch.device(device), dtype, False).clone()
    return _build_matrix(n, torch.device(device), dtype, False)


def _build_matrix(n: int, device: torch.device, dtype: torch.dtype, normalize: bool) -> torch.Tensor:
    h = integer_hadamard(n)
    if normalize:
        out = h.to(torch.float64) / math.sqrt(n)
    else:
        out = h
    return out.to(device=device, dtype=dtype)


@functools.lru_cache(maxsize=256)
def _cached_matrix(n: int, device: torch.device, dtype: torch.dtype, normalize: bool) -> torch.Tensor:
    """Per-(n, device, dtype) cache of the small factors the kernels use (read-only: never mutate).

    Built outside ``torch.inference_mode`` so that a factor first made during evaluation can still be
    used later by a forward that records autograd (an inference tensor cannot be saved for backward).
    """
    with torch.inference_mode(False):
        return _build_matrix(n, device, dtype, normalize)


def _factor(n: int, x: torch.Tensor, normalize: bool) -> torch.Tensor:
    """Cached (optionally normalised) Hadamard factor matching x's device and dtype."""
    return _cached_matrix(n, x.device, x.dtype, normalize)


# ----------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _fast_kernel():
    try:
        import fast_hadamard_transform  # type: ignore[import-not-found]
    except ImportError:
        return None
    return fast_hadamard_transform.hadamard_transform


def fast_kernel_available() -> bool:
    """True when the CUDA ``fast-hadamard-transform`` package is importable."""
    return _fast_kernel() is not None


def _check_float(x: torch.Tensor) -> None:
    if not torch.is_floating_point(x):
        raise NonFloatTensorError(f"Hadamard transforms need a floating-point tensor, got {x.dtype}")


def _radix_split(n: int) -> list[int]:
    """Split a power of two n into near-equal power-of-two factors, each ≤ RADIX_MAX."""
    m = n.bit_length() - 1
    if n <= DENSE_MAX:
        return [n]
    r_bits = RADIX_MAX.bit_length() - 1
    t = -(-m // r_bits)  # number of factors
    base, extra = divmod(m, t)
    return [1 << (base + (1 if i < extra else 0)) for i in range(t)]


def _apply_factors(x: torch.Tensor, factors: list[torch.Tensor]) -> torch.Tensor:
    """y = (F_1 ⊗ … ⊗ F_t) x along the last dim (row-major index), for symmetric factors F_i.

    Each step views the row as (r, rest), applies F to the leading axis and moves it to the end; after t
    steps the axis order is restored.
    """
    shape = x.shape
    n = shape[-1]
    y = x.reshape(-1, n)
    for f in factors:
        r = f.shape[0]
        y = torch.matmul(y.view(-1, r, n // r).transpose(1, 2), f)  # (B, rest, r), F symmetric
        y = y.reshape(-1, n)
    return y.view(shape)


def dense_hadamard_transform(x: torch.Tensor, normalize: bool = True) -> torch.Tensor:
    """Reference: x @ Hᵀ with the cached dense matrix (H symmetric for Sylvester, not for Paley)."""
    _check_float(x)
    n = x.shape[-1]
    h = _factor(n, x, normalize) if n <= CACHE_MAX else _build_matrix(n, x.device, x.dtype, normalize)
    return torch.matmul(x, h.T)


def fwht(x: torch.Tensor, normalize: bool = True) -> torch.Tensor:
    """Pure-torch fast Walsh–Hadamard transform along the last dim (size a power of two), any batch shape.

    Sylvester-ordered: fwht(x) == x @ H_n (H_n symmetric), divided by √n when ``normalize``.
    """
    _check_float(x)
    n = x.shape[-1]
    if n < 1 or n & (n - 1):
        raise UnsupportedHadamardOrderError(f"fwht needs a power-of-two size, got {n}")
    if n == 1:
        return x.clone()
    sizes = _radix_split(n)
    if len(sizes) == 1:
        return torch.matmul(x, _factor(n, x, normalize))
    factors = [_factor(r, x, normalize) for r in sizes]
    return _apply_factors(x, factors)


def _pow2_transform(x: torch.Tensor, normalize: bool) -> torch.Tensor:
    n = x.shape[-1]
    kernel = _fast_kernel()
    if (
        kernel is not None
        and x.is_cuda
        and n > 1
        and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and n <= 32768
    ):
        scale = 1.0 / math.sqrt(n) if normalize else 1.0
        return kernel(x.contiguous(), scale)
    return fwht(x, normalize)


def hadamard_transform(x: torch.Tensor, normalize: bool = True) -> torch.Tensor:
    """y = H_n x along the last dim (y = x @ H_nᵀ), normalised by 1/√n by default.

    n = 2^m: fast kernel on CUDA when installed, else :func:`fwht`. n = K·2^m: (H_K ⊗ H_{2^m}) via a dense
    K×K matmul on the leading factor and the power-of-two transform on the trailing one.
    """
    _check_float(x)
    n = x.shape[-1]
    k, m = hadamard_order(n)
    if k == 1:
        return _pow2_transform(x, normalize)
    p = 1 << m
    hk = _factor(k, x, normalize)
    shape = x.shape
    y = x.reshape(*shape[:-1], k, p)
    if p > 1:
        y = _pow2_transform(y, normalize)
    if k <= DENSE_MAX:
        y = torch.matmul(hk, y)  # H_K acts on the K axis: (k,k) @ (..., k, p)
        return y.reshape(shape)
    # A large Paley factor (K > 256, e.g. 2104 = 1052·2): one GEMM over every (row, p) pair; the batched
    # (k,k) @ (k,p) form above would read the k×k matrix once per row (memory bound, ~20× slower at k = 5504).
    y = torch.matmul(y.transpose(-1, -2).reshape(-1, k), hk.T)
    return y.reshape(*shape[:-1], p, k).transpose(-1, -2).reshape(shape)


def random_hadamard(n: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Seeded random Hadamard rotation (QuaRot's convention): Q = diag(s) · H_n/√n, s_i = ±1.

    The signs act on the input channels before the Hadamard mixes them, so for a row x,
    ``x @ Q = (x ⊙ s) @ H``: the magnitudes |x @ Q| change with the seed. (The transposed convention
    H · diag(s) only flips output signs, leaving |x @ Q| the same for every seed.)
    """
    gen = torch.Generator().manual_seed(int(seed))
    signs = torch.randint(0, 2, (n,), generator=gen, dtype=torch.int64) * 2 - 1
    h = _build_matrix(n, torch.device("cpu"), torch.float64, True)
    return (signs.to(torch.float64)[:, None] * h).to(dtype)

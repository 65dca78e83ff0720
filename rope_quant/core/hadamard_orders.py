"""Constructed Hadamard matrices of the small orders K that :mod:`rope_quant.core.hadamard` combines with
Sylvester powers (H_n = H_K ⊗ H_{2^m}); integer arithmetic throughout, so every matrix is exact.

* **Paley I** (q ≡ 3 mod 4 a prime power, order q+1) and **Paley II** (q ≡ 1 mod 4, order 2(q+1)), from the
  quadratic character of GF(q). GF(p^k) is GF(p)[x]/(f) with f the first monic irreducible of degree k in
  the order :func:`irreducible_polynomial` searches; for a prime q this is today's Jacobsthal matrix mod q.
  A prime q is preferred to a prime power for the same order (order 28 stays Paley II of q = 13).
* **Goethals–Seidel** (order 4t): four circulant ±1 matrices A, B, C, D of order t with
  AAᵀ + BBᵀ + CCᵀ + DDᵀ = 4t·I, placed in the Goethals–Seidel array. The four sequences are *found* by the
  deterministic searches of :mod:`rope_quant.core.hadamard_search` (Williamson / multiplier-orbit sequences for
  t = 23, 29, 39, 43; Turyn-type sequences TT(16), TT(20) for t = 47, 59), never stored; the first call per
  order takes from 0.01 s to 15–34 s (t = 59), and the result is cached in memory.

With Sylvester doubling (H_K ⊗ H_2, e.g. 184 = 92·2, 232 = 116·2) every multiple of 4 up to 256 is built.
"""

from __future__ import annotations

import functools
import itertools
import math
from enum import StrEnum

import numpy as np
import torch

from rope_quant.core.hadamard_search import GS_MULTIPLIERS, TURYN_LENGTHS, gs_sequences, t_sequence_quadruple

__all__ = [
    "UnsupportedHadamardOrderError",
    "Construction",
    "paley_order_prime",
    "paley_order",
    "construction",
    "hadamard_order",
    "is_supported_order",
    "irreducible_polynomial",
    "circulant_quadruple",
    "integer_hadamard",
]


class UnsupportedHadamardOrderError(ValueError):
    """No Hadamard matrix of this order can be built here (see :func:`hadamard_order`)."""


class Construction(StrEnum):
    """How a Hadamard matrix of order K is built."""

    SYLVESTER = "sylvester"
    PALEY_I = "paley-I"
    PALEY_II = "paley-II"
    GOETHALS_SEIDEL = "goethals-seidel"


# ----------------------------------------------------------------------------------------------------------
# Which construction serves an order
# ----------------------------------------------------------------------------------------------------------


def _is_prime(q: int) -> bool:
    if q < 2:
        return False
    if q % 2 == 0:
        return q == 2
    f = 3
    while f * f <= q:
        if q % f == 0:
            return False
        f += 2
    return True


def _prime_power(q: int) -> tuple[int, int] | None:
    """(p, k) with q = p^k, p prime, k ≥ 1; None otherwise."""
    if q < 2:
        return None
    p = next((f for f in range(2, math.isqrt(q) + 1) if q % f == 0), q)  # the smallest prime factor
    k = 0
    while q % p == 0:
        q //= p
        k += 1
    return (p, k) if q == 1 else None


def paley_order_prime(k: int) -> tuple[str, int] | None:
    """Return ("I", q) or ("II", q) if order k has a Paley construction from a prime q, else None."""
    if k >= 4 and _is_prime(k - 1) and (k - 1) % 4 == 3:
        return ("I", k - 1)
    if k % 2 == 0 and k >= 12 and _is_prime(k // 2 - 1) and (k // 2 - 1) % 4 == 1:
        return ("II", k // 2 - 1)
    return None


def paley_order(k: int) -> tuple[str, int] | None:
    """Like :func:`paley_order_prime` with q a prime power; a prime q wins (both kinds) over a prime power."""
    prime = paley_order_prime(k)
    if prime is not None:
        return prime
    if k >= 4 and (k - 1) % 4 == 3 and _prime_power(k - 1) is not None:
        return ("I", k - 1)
    if k % 2 == 0 and k >= 12 and (k // 2 - 1) % 4 == 1 and _prime_power(k // 2 - 1) is not None:
        return ("II", k // 2 - 1)
    return None


@functools.lru_cache(maxsize=4096)
def construction(k: int) -> Construction | None:
    """The construction this module uses for order k (None: no matrix of order k here)."""
    if k in (1, 2):
        return Construction.SYLVESTER
    paley = paley_order(k)
    if paley is not None:
        return Construction.PALEY_I if paley[0] == "I" else Construction.PALEY_II
    if k % 4 == 0 and k // 4 in _GS_LENGTHS:
        return Construction.GOETHALS_SEIDEL
    return None


#: t → how its four circulant sequences are found (multiplier-orbit search, or TT(n) with t = 3n − 1).
_GS_LENGTHS: dict[int, tuple[str, int]] = {
    **{t: ("orbits", t) for t in GS_MULTIPLIERS},
    **{3 * n - 1: ("turyn", n) for n in TURYN_LENGTHS},
}


def circulant_quadruple(t: int) -> tuple[tuple[int, ...], ...]:
    """Four ±1 sequences of length t with zero periodic autocorrelation sum (:mod:`.hadamard_search`)."""
    how, arg = _GS_LENGTHS[t]
    return gs_sequences(arg) if how == "orbits" else t_sequence_quadruple(arg)


def hadamard_order(n: int) -> tuple[int, int]:
    """Decompose n = K·2^m with K = 1 (Sylvester) or a constructed order (:func:`construction`); smallest K wins.

    Raises UnsupportedHadamardOrderError when no such decomposition exists.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise UnsupportedHadamardOrderError(f"Hadamard order must be a positive integer, got {n!r}")
    return _decompose(int(n))


@functools.lru_cache(maxsize=4096)
def _decompose(n: int) -> tuple[int, int]:
    m_max = (n & -n).bit_length() - 1
    for m in range(m_max, -1, -1):
        k = n >> m
        if k == 1 or (k > 2 and construction(k) is not None):
            return k, m
    raise UnsupportedHadamardOrderError(
        f"no Hadamard matrix of order {n} is available: supported orders are K·2^m with K = 1 (Sylvester), "
        "a Paley order K = q+1 (q a prime power ≡ 3 mod 4) or K = 2(q+1) (q a prime power ≡ 1 mod 4), or "
        f"K = 4t with t in {sorted(_GS_LENGTHS)} (Goethals–Seidel): every multiple of 4 up to 256"
    )


def is_supported_order(n: int) -> bool:
    """True when :func:`integer_hadamard` can build order n."""
    try:
        hadamard_order(n)
    except UnsupportedHadamardOrderError:
        return False
    return True


# ----------------------------------------------------------------------------------------------------------
# Paley over GF(q)
# ----------------------------------------------------------------------------------------------------------


def _poly_mod(a: list[int], f: list[int], p: int) -> list[int]:
    """a mod f over GF(p); coefficient lists, lowest degree first, f monic."""
    a = list(a)
    df = len(f) - 1
    for i in range(len(a) - 1, df - 1, -1):
        c = a[i] % p
        if c:
            for j in range(df + 1):
                a[i - df + j] = (a[i - df + j] - c * f[j]) % p
    return [c % p for c in a[:df]] + [0] * max(0, df - len(a))


def _monic(p: int, d: int) -> list[list[int]]:
    """All monic polynomials of degree d over GF(p), lowest coefficient varying fastest."""
    return [list(c) + [1] for c in itertools.product(range(p), repeat=d)] if d else [[1]]


def irreducible_polynomial(p: int, k: int) -> tuple[int, ...]:
    """The first monic irreducible polynomial of degree k over GF(p) (coefficients lowest first), by search.

    Candidates come in ``itertools.product`` order of (c_0, …, c_{k−1}); a candidate is irreducible when no
    monic polynomial of degree 1 … k/2 divides it.
    """
    for f in _monic(p, k):
        if all(any(_poly_mod(f, g, p)) for d in range(1, k // 2 + 1) for g in _monic(p, d)):
            return tuple(f)
    raise AssertionError(f"no irreducible polynomial of degree {k} over GF({p})")  # pragma: no cover


def _quadratic_character(q: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """χ over the elements of GF(q), their base-p digits (q, k) and the digit weights p^i (element x ↔ digits)."""
    pk = _prime_power(q)
    if pk is None:  # pragma: no cover - guarded by paley_order
        raise UnsupportedHadamardOrderError(f"{q} is not a prime power")
    p, k = pk
    digits = np.array([[(x // p**i) % p for i in range(k)] for x in range(q)], dtype=np.int64)
    f = list(irreducible_polynomial(p, k)) if k > 1 else [0, 1]
    weights = np.array([p**i for i in range(k)], dtype=np.int64)
    chi = -np.ones(q, dtype=np.int64)
    chi[0] = 0
    for x in range(1, q):
        a = [int(c) for c in digits[x]]
        sq = [0] * (2 * k - 1)
        for i, j in itertools.product(range(k), repeat=2):
            sq[i + j] += a[i] * a[j]
        chi[int(np.dot(_poly_mod(sq, f, p), weights)) if k > 1 else (x * x) % q] = 1
    return chi, digits, weights


def _jacobsthal(q: int) -> torch.Tensor:
    """Jacobsthal matrix Q_ij = χ(x_j − x_i) over GF(q) (χ(0) = 0), int64; for a prime q, χ(j − i mod q)."""
    chi, digits, weights = _quadratic_character(q)
    p = int(weights[1]) if len(weights) > 1 else q
    diff = ((digits[None, :, :] - digits[:, None, :]) % p) @ weights  # index of x_j − x_i
    return torch.from_numpy(chi[diff])


def _paley(k: int) -> torch.Tensor:
    """Paley I/II Hadamard matrix of order k, int64 entries ±1."""
    kind_q = paley_order(k)
    if kind_q is None:  # pragma: no cover - guarded by construction()
        raise UnsupportedHadamardOrderError(f"order {k} has no Paley construction")
    kind, q = kind_q
    c = torch.zeros(q + 1, q + 1, dtype=torch.int64)
    c[0, 1:] = 1
    c[1:, 1:] = _jacobsthal(q)
    if kind == "I":
        # Q antisymmetric (q ≡ 3 mod 4); S = [[0, 1ᵀ], [−1, Q]] is a skew conference matrix; H = I + S.
        c[1:, 0] = -1
        return torch.eye(q + 1, dtype=torch.int64) + c
    # Q symmetric (q ≡ 1 mod 4); C = [[0, 1ᵀ], [1, Q]] symmetric conference matrix;
    # replace 0 by [[1, −1], [−1, −1]] and ±1 by ±[[1, 1], [1, −1]].
    c[1:, 0] = 1
    h2 = torch.tensor([[1, 1], [1, -1]], dtype=torch.int64)
    d2 = torch.tensor([[1, -1], [-1, -1]], dtype=torch.int64)
    return torch.kron(c, h2) + torch.kron(torch.eye(q + 1, dtype=torch.int64), d2)


# ----------------------------------------------------------------------------------------------------------
# Goethals–Seidel: four circulants found by search
# ----------------------------------------------------------------------------------------------------------


def _circulant(a: torch.Tensor) -> torch.Tensor:
    """C[i, j] = a[(j − i) mod t]."""
    t = a.shape[0]
    i = torch.arange(t)
    return a[(i[None, :] - i[:, None]) % t]


def _goethals_seidel(k: int) -> torch.Tensor:
    """Goethals–Seidel array of the four circulants of :func:`circulant_quadruple` (order k = 4t), int64:
    AAᵀ + BBᵀ + CCᵀ + DDᵀ = 4t·I makes the array Hadamard (circulants commute; R is the back-diagonal)."""
    t = k // 4
    a, b, c, d = (_circulant(torch.tensor(s, dtype=torch.int64)) for s in circulant_quadruple(t))
    rev = torch.eye(t, dtype=torch.int64).flip(1)  # back-diagonal R: circulant·R is symmetric
    return torch.cat([
        torch.cat([a, b @ rev, c @ rev, d @ rev], 1),
        torch.cat([-b @ rev, a, d.T @ rev, -c.T @ rev], 1),
        torch.cat([-c @ rev, -d.T @ rev, a, b.T @ rev], 1),
        torch.cat([-d @ rev, c.T @ rev, -b.T @ rev, a], 1),
    ], 0)


# ----------------------------------------------------------------------------------------------------------
# Assembly
# ----------------------------------------------------------------------------------------------------------


def _sylvester(p: int) -> torch.Tensor:
    """Sylvester Hadamard matrix of order p = 2^m (natural ordering), int64."""
    h = torch.ones(1, 1, dtype=torch.int64)
    while h.shape[0] < p:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@functools.lru_cache(maxsize=64)
def _small_order(k: int) -> torch.Tensor:
    """The matrix of a non-power-of-two order K (read-only: never mutate)."""
    kind = construction(k)
    if kind is Construction.GOETHALS_SEIDEL:
        return _goethals_seidel(k)
    return _paley(k)


def integer_hadamard(n: int) -> torch.Tensor:
    """Exact int64 Hadamard matrix of order n = K·2^m (:func:`hadamard_order`): H_K ⊗ H_{2^m}."""
    k, m = hadamard_order(n)
    syl = _sylvester(1 << m)
    if k == 1:
        return syl
    return torch.kron(_small_order(k), syl)

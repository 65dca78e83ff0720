"""The factorisations behind GPTQ and the whip fit give the same bits at any CPU thread count
(:mod:`rope_quant.core.threads`).

LAPACK's blocked Cholesky rounds differently at 1 and 2 OpenMP threads (measured on the 2-core Xeon,
2026-12-06: 105,729 of 331,776 entries of a 576 × 576 factor differ), and 4-bit GPTQ codes amplify that into
another perplexity (one SmolLM2 seed's weights: 16% of the codes, ppl 27.150 against 27.463; after the change a
fresh build at 2 threads, whip fit included, equals the 1-thread weights bit for bit). Each test runs the same call
at 1 and at 2 threads and compares bit for bit; the factor and QR tests failed on this machine before the
factorisations ran on one thread.
"""

from __future__ import annotations

import pytest
import torch

from rope_quant.core.threads import one_cpu_thread
from rope_quant.quant.gptq_solve import _upper_inverse_factor
from rope_quant.rotations.whip import qr_orthogonal


def _spd(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4 * n, n, generator=g) * torch.linspace(0.1, 3.0, n)
    return x.T @ x / (4 * n) + 1e-3 * torch.eye(n)


def _at(threads: int, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def test_one_cpu_thread_restores_the_thread_count_and_leaves_accelerators_alone() -> None:
    def inside(device: str) -> int:
        with one_cpu_thread(device):
            return torch.get_num_threads()

    assert _at(2, lambda: (inside("cpu"), torch.get_num_threads())) == (1, 2)
    assert _at(2, lambda: inside("meta")) == 2


@pytest.mark.parametrize("n", [576, 1536])
def test_the_inverse_hessian_factor_is_the_same_at_one_and_two_threads(n: int) -> None:
    h = _spd(n, seed=n)
    one = _at(1, lambda: _upper_inverse_factor(h))
    two = _at(2, lambda: _upper_inverse_factor(h))
    assert torch.equal(one[0], two[0]) and int(one[1]) == int(two[1]) == 0


@pytest.mark.parametrize("method", ["cholesky", "householder"])
def test_whip_qr_is_the_same_at_one_and_two_threads(method: str) -> None:
    g = torch.Generator().manual_seed(3)
    a = torch.linalg.qr(torch.randn(576, 576, generator=g, dtype=torch.float64))[0] + \
        1e-3 * torch.randn(576, 576, generator=g, dtype=torch.float64)
    one = _at(1, lambda: qr_orthogonal(a, method))
    two = _at(2, lambda: qr_orthogonal(a, method))
    assert torch.equal(one, two)

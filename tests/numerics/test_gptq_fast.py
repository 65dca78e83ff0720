"""GPTQ at the floor: the transposed, host-sync-free column loop, stacked solves of linears that share a
Hessian, and the bf16-input Hessian with its validation (GPTQ's proxy loss within 0.5% of float32's)."""

from __future__ import annotations

import math

import pytest
import torch

from rope_quant.quant import gptq, gptq_solve, hessian_check, rtn
from rope_quant.quant.gptq import HessianAccumulator
from rope_quant.quant.rtn import GPTQConfig, GPTQError

# ----------------------------------------------------------------------------- reference (the plain algorithm)


def ref_gptq(W: torch.Tensor, H: torch.Tensor, bits: int, cfg: GPTQConfig) -> torch.Tensor:
    """Frantar et al. 2022, Alg. 1 column by column (no lazy batches), static per-row / per-group scales."""
    W = W.clone().to(cfg.dtype)
    H = H.clone().to(cfg.dtype)
    n = W.shape[1]
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    gs = n if cfg.group_size == -1 else cfg.group_size
    scales = rtn._group_scales(W, bits, cfg.group_size, cfg.mse, 1.0, cfg.grid, cfg.max_shrink)
    group = torch.arange(n) // gs
    perm = torch.argsort(torch.diag(H), descending=True) if cfg.act_order else torch.arange(n)
    W, H, group = W[:, perm], H[perm][:, perm], group[perm]
    damp = cfg.percdamp * torch.mean(torch.diag(H)).item()
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H + damp * torch.eye(n, dtype=H.dtype))),
                              upper=True)
    Q = torch.zeros_like(W)
    for j in range(n):
        s = scales[:, int(group[j])]
        Q[:, j] = rtn.quantize_with_scales(W[:, j], s, bits)
        err = (W[:, j] - Q[:, j]) / U[j, j]
        W[:, j:] -= torch.outer(err, U[j, j:])
    return Q[:, torch.argsort(perm)]


def _problem(out_f: int = 48, in_f: int = 96, n: int = 400, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(in_f, in_f, generator=g) / math.sqrt(in_f) + torch.eye(in_f)
    X = (torch.randn(n, in_f, generator=g) @ mix) * torch.linspace(0.2, 3.0, in_f)
    X[:, 7] = 0.0  # a dead input
    W = torch.randn(out_f, in_f, generator=g)
    acc = HessianAccumulator(in_f, dtype=dtype)
    acc.add(X.to(dtype))
    return W.to(dtype), X, acc.H


CFGS = [GPTQConfig(grid=20), GPTQConfig(grid=20, act_order=False), GPTQConfig(grid=20, group_size=32),
        GPTQConfig(grid=20, group_size=32, act_order=False, blocksize=16)]


@pytest.mark.parametrize("cfg", CFGS[:2])
def test_column_loop_matches_the_plain_algorithm_in_float64(cfg: GPTQConfig) -> None:
    W, _, H = _problem(dtype=torch.float64)
    # the reference searches scales on the weights' own error; the Hessian-diagonal objective's search is
    # checked against a float64 brute force in test_weight_scale.py
    cfg = GPTQConfig(**{**cfg.__dict__, "float64": True, "blocksize": 16, "objective": "weight"})
    got = gptq.gptq_quantize(W, H, 4, cfg)
    want = ref_gptq(W, H, 4, cfg).to(W.dtype)
    # the same codes everywhere (a rounding tie could flip one; none does on this seed)
    assert torch.equal(got, want)


@pytest.mark.parametrize("cfg", CFGS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_stacked_rows_equal_separate_solves(cfg: GPTQConfig, dtype: torch.dtype) -> None:
    """q/k/v (different row counts) with one Hessian: one stacked solve = three solves, codes and scales too."""
    cfg = GPTQConfig(**{**cfg.__dict__, "float64": dtype == torch.float64})
    Wq, _, H = _problem(48, dtype=dtype)
    Wk, Wv = _problem(16, seed=1, dtype=dtype)[0], _problem(24, seed=2, dtype=dtype)[0]
    calls = gptq.GPTQ_CALLS["linear"]
    stacked = gptq_solve._gptq_stacked([Wq, Wk, Wv], H, 4, cfg, 1.0)
    assert gptq.GPTQ_CALLS["linear"] == calls + 1  # one factorisation and one column loop
    for W, (Q, C, S, finite) in zip((Wq, Wk, Wv), stacked, strict=True):
        Q1, C1, S1 = gptq_solve._gptq(W, H, 4, cfg, 1.0)
        assert bool(finite) and Q.shape == W.shape and Q.dtype == W.dtype
        if dtype == torch.float64:
            torch.testing.assert_close(Q, Q1, rtol=0, atol=1e-12)
        else:
            torch.testing.assert_close(Q, Q1, rtol=0, atol=1e-5)
        assert torch.equal(C, C1) and torch.equal(S, S1)
    pub = gptq.gptq_quantize_shared([Wq, Wk, Wv], H, 4, cfg)
    assert all(torch.equal(a, r[0]) for a, r in zip(pub, stacked, strict=True))


def test_stacked_solve_refuses_mismatched_weights() -> None:
    W, _, H = _problem()
    with pytest.raises(GPTQError, match="one width"):
        gptq.gptq_quantize_shared([W, W.double()], H, 4)


def test_not_positive_definite_hessian_keeps_its_clear_error() -> None:
    H = -torch.eye(8)
    with pytest.raises(GPTQError, match="not positive definite"):
        gptq.gptq_quantize(torch.randn(4, 8), H, 4, GPTQConfig(percdamp=0.0))


def test_model_gptq_stacks_shared_hessians_and_matches_unstacked(monkeypatch) -> None:
    from tests._support import tiny_llama

    model = tiny_llama(128, seed=0, intermediate=96, max_positions=64)
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    windows = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(3))
    import copy
    other = copy.deepcopy(model)
    calls = gptq.GPTQ_CALLS["linear"]
    e_stack = gptq.quantize_model_gptq(model, windows, 4, GPTQConfig(grid=10), progress=False)
    stacked_calls = gptq.GPTQ_CALLS["linear"] - calls
    monkeypatch.setattr(gptq, "STACK_SHARED", False)
    calls = gptq.GPTQ_CALLS["linear"]
    e_sep = gptq.quantize_model_gptq(other, windows, 4, GPTQConfig(grid=10), progress=False)
    assert (stacked_calls, gptq.GPTQ_CALLS["linear"] - calls) == (2 * 4, 2 * 7)  # qkv, o, gate+up, down
    assert e_stack.keys() == e_sep.keys()
    for k in e_stack:
        assert e_stack[k] == pytest.approx(e_sep[k], rel=1e-5)
    for (n, a), b in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=n)
    assert any(not torch.equal(model.state_dict()[k], ref[k]) for k in ref)


# ----------------------------------------------------------------------------- the bf16-input Hessian


def test_bf16_hessian_is_off_by_default_and_is_the_product_of_rounded_inputs() -> None:
    assert GPTQConfig().hessian_bf16 is False
    _, X, H32 = _problem()
    acc = HessianAccumulator(X.shape[1], bf16_inputs=True)
    acc.add(X[:150])
    acc.add(X[150:])
    Xb = X.to(torch.bfloat16).float()
    torch.testing.assert_close(acc.H, 2 * Xb.T @ Xb / X.shape[0], rtol=1e-5, atol=1e-5)
    assert not torch.equal(acc.H, H32)


def test_validate_fast_hessian_passes_bf16_and_catches_a_bad_hessian() -> None:
    W, X, _ = _problem(64, 128, n=1024)
    check = hessian_check.validate_fast_hessian(W, X, 4, GPTQConfig(grid=20))
    assert check.ok, check
    assert abs(check.rel_diff) < 0.005 and check.loss_fp32 > 0
    # A Hessian from a quarter of the samples: GPTQ's loss rises well past 0.5%, and the check says so.
    check_bad = hessian_check.validate_fast_hessian(W, X, 4, GPTQConfig(grid=20),
                                           fast=lambda x: 2 * x[:32].T @ x[:32] / 32)
    assert not check_bad.ok and check_bad.rel_diff > 0.005, check_bad
    # identical Hessians: zero difference
    same = hessian_check.validate_fast_hessian(W, X, 4, GPTQConfig(grid=20), fast=lambda x: 2 * x.T @ x / x.shape[0])
    assert abs(same.rel_diff) < 1e-6


def test_proxy_loss_is_the_trace_formula() -> None:
    W, _, H = _problem(8, 16, n=64)
    Q = rtn.rtn_quantize(W, 4)
    D = (W - Q).double()
    want = float(torch.trace(D @ H.double() @ D.T))
    assert float(hessian_check.proxy_loss(W, Q, H)) == pytest.approx(want, rel=1e-12)

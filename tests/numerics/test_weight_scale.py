"""The weight-scale search's options (rope_quant.quant.gptq): Lp norm, shrink bound, GPTQ's diagonal proxy
objective, the full-range max/(2^(b-1) - 1/2) scale; bad input (zero rows, huge outliers, Hessians that cannot be
factorised) and the cache keys that must follow every option."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from rope_quant.experiment.config import RunConfig
from rope_quant.quant import gptq, gptq_solve, rtn
from rope_quant.quant.rtn import GPTQConfig, GPTQError, ScaleObjective, weight_scales

#: Every search option the config offers, alone and combined (the bad-input tests run each of them).
OPTIONS = [
    {},
    {"mse": False},
    {"p_norm": 2.4},
    {"max_shrink": 0.2},
    {"full_range": True},
    {"mse": False, "full_range": True},
    {"objective": ScaleObjective.HESSIAN_DIAG},
    {"p_norm": 2.4, "max_shrink": 0.2, "full_range": True, "objective": ScaleObjective.HESSIAN_DIAG},
]


def _denominator(bits: int, cfg: GPTQConfig) -> float:
    qmax = 2 ** (bits - 1) - 1
    return qmax + 0.5 if cfg.full_range else qmax


def _bad_rows(in_f: int = 256) -> torch.Tensor:
    """Row 0 all zeros, row 1 one huge outlier (1e4 x the rest), row 2 a plain Gaussian row."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(3, in_f, generator=g) * 0.02
    w[0] = 0.0
    w[1, 17] = 1e4 * w[1].abs().max()
    return w


def _check_scales(w: torch.Tensor, s: torch.Tensor, bits: int, cfg: GPTQConfig, gs: int) -> None:
    """Finite positive scales, and max|w| of every row (group) mapped no further past the grid than the
    shrink allows: max|w| / s <= denominator / (1 - max_shrink) (exactly ``denominator`` without the search)."""
    assert torch.isfinite(s).all() and (s > 0).all()
    amax = w.abs().reshape(w.shape[0], -1, gs).amax(dim=2)
    limit = _denominator(bits, cfg) / (1.0 - cfg.max_shrink if cfg.mse else 1.0)
    assert float((amax / s).max()) <= limit * (1 + 1e-5), (cfg, float((amax / s).max()), limit)


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_zero_and_outlier_rows_give_finite_scales_within_the_shrink(bits, opts):
    cfg = GPTQConfig(**opts)
    w = _bad_rows()
    hdiag = torch.rand(w.shape[1], generator=torch.Generator().manual_seed(4)) + 0.1
    s = weight_scales(w, bits, cfg.mse, 1.0, cfg.grid, cfg.max_shrink, norm=cfg.p_norm, full_range=cfg.full_range,
                      col_weight=hdiag if cfg.objective == ScaleObjective.HESSIAN_DIAG else None)
    _check_scales(w, s, bits, cfg, w.shape[1])
    # The outlier itself stays representable to within half a step: its code is in range and not clipped away.
    codes = rtn._int_codes(w, s, bits)
    qmax = 2 ** (bits - 1) - 1
    assert codes.min() >= -qmax - 1 and codes.max() <= qmax
    assert float((codes[1, 17] * s[1, 0] - w[1, 17]).abs() / w[1, 17].abs()) <= cfg.max_shrink + 1e-6


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
@pytest.mark.parametrize("group_size", [-1, 64])
@pytest.mark.parametrize("act_order", [True, False])
def test_gptq_on_zero_and_outlier_rows_keeps_codes_in_range(opts, group_size, act_order):
    bits = 4
    cfg = GPTQConfig(group_size=group_size, act_order=act_order, **opts)
    g = torch.Generator().manual_seed(5)
    W = torch.cat([_bad_rows(), torch.randn(5, 256, generator=g)])
    X = torch.randn(600, 256, generator=g)
    X[:, :3] *= 10.0
    H = 2 * X.T @ X / X.shape[0]
    Q, C, S = gptq_solve._gptq(W, H, bits, cfg, 1.0)
    assert torch.isfinite(Q).all() and torch.isfinite(S).all() and (S > 0).all()
    assert C.min() >= -8 and C.max() <= 7
    assert torch.all(Q[0] == 0)  # the zero row stays zero
    gs = 256 if group_size == -1 else group_size
    if act_order or group_size == -1:  # static scales: computed on the original weights
        _check_scales(W, S.float(), bits, cfg, gs)


@pytest.mark.parametrize("opts", OPTIONS[1:], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_a_hessian_that_cannot_be_factorised_raises_for_every_option(opts):
    """No silent fall-back to round-to-nearest: GPTQ's clear error stays whatever the scale search."""
    W = torch.randn(8, 16)
    nan = torch.eye(16)
    nan[0, 0] = float("nan")
    with pytest.raises(GPTQError, match="NaN"):
        gptq.gptq_quantize(W, nan, 4, GPTQConfig(**opts))
    with pytest.raises(GPTQError, match="not positive definite"):
        gptq.gptq_quantize(W, -torch.eye(16), 4, GPTQConfig(**opts))


def _brute_force_ratio(row: torch.Tensor, bits: int, cfg: GPTQConfig, weight: torch.Tensor | None) -> float:
    """The search's argmin written out in float64: every ratio, ties to the larger ratio."""
    qmax = 2 ** (bits - 1) - 1
    amax = float(row.abs().max())
    c = torch.ones_like(row, dtype=torch.float64) if weight is None else weight.double()
    best, best_err = 1.0, math.inf
    for i in range(int(cfg.max_shrink * cfg.grid) + 1):
        r = 1.0 - i / cfg.grid
        s = r * amax / _denominator(bits, cfg)
        q = torch.clamp(torch.round(row.double() / s), -qmax - 1, qmax) * s
        err = float((c * (row.double() - q).abs() ** cfg.p_norm).sum())
        if err < best_err * (1 - 1e-9):
            best, best_err = r, err
    return best


@pytest.mark.parametrize("bits,norm,objective", list(itertools.product(
    [3, 4], [2.0, 2.4, 3.0], [ScaleObjective.WEIGHT, ScaleObjective.HESSIAN_DIAG])))
def test_search_minimises_the_configured_objective(bits, norm, objective):
    """The chosen ratio is the float64 argmin of sum_j c_j |w_j - q_j|^p (c = H's diagonal or 1)."""
    cfg = GPTQConfig(p_norm=norm, objective=objective, grid=50, max_shrink=0.5)
    g = torch.Generator().manual_seed(int(norm * 10) + bits)
    w = torch.randn(24, 96, generator=g) * torch.linspace(0.2, 3.0, 96) ** 2  # heavy-tailed columns
    weight = torch.rand(96, generator=g) ** 4 if objective == ScaleObjective.HESSIAN_DIAG else None
    s = weight_scales(w, bits, True, 1.0, cfg.grid, cfg.max_shrink, norm=norm, col_weight=weight)
    got = (s[:, 0] * _denominator(bits, cfg) / w.abs().amax(dim=1)).tolist()
    want = [_brute_force_ratio(row, bits, cfg, weight) for row in w]
    assert got == pytest.approx(want, abs=1e-6)
    # The options are not decorative: the Hessian weighting or the norm moves some row's choice.
    if objective == ScaleObjective.HESSIAN_DIAG or norm != 2.0:
        plain = weight_scales(w, bits, True, 1.0, cfg.grid, cfg.max_shrink)
        assert not torch.equal(plain, s)


def test_full_range_scale_is_max_over_qmax_plus_half():
    """max|w| / (2^(b-1) - 1/2): both extremes land half a step from the grid's ends (+max|w| on 2^(b-1) - 1,
    -max|w| at the rounding tie between -2^(b-1) + 1 and -2^(b-1)): a finer step than max|w| / (2^(b-1) - 1) at
    the same worst-case error on the extremes."""
    w = torch.tensor([[-1.0, 1.0, 0.25], [1.0, -1.0, 0.5], [-3.0, 0.1, 2.9]])
    for bits in (3, 4):
        qmax = 2 ** (bits - 1) - 1
        s = weight_scales(w, bits, mse=False, full_range=True)
        assert torch.allclose(s[:, 0], w.abs().amax(dim=1) / (qmax + 0.5))
        codes = rtn._int_codes(w, s, bits)
        assert codes.min() >= -qmax - 1 and codes.max() <= qmax
        err = (codes * s - w).abs()
        assert torch.all(err <= s / 2 * (1 + 1e-5))
        plain = weight_scales(w, bits, mse=False)
        assert torch.all(s < plain)
        # A search ratio below (2^(b-1) - 1/2) / 2^(b-1) puts -max|w| past the tie: the code -2^(b-1) is spent.
        r = 0.9
        assert rtn._int_codes(w, s * r, bits)[0, 0] == -qmax - 1


def test_bad_search_settings_raise():
    for bad in ({"p_norm": 0.5}, {"p_norm": float("inf")}, {"p_norm": True}, {"objective": "hessian"},
                {"full_range": 1}, {"max_shrink": 1.0}, {"grid": 0}):
        with pytest.raises(GPTQError):
            GPTQConfig(**bad)
    assert GPTQConfig(objective="hessian_diag").objective is ScaleObjective.HESSIAN_DIAG
    with pytest.raises(GPTQError, match="col_weight"):
        weight_scales(torch.randn(4, 8), 4, col_weight=torch.ones(7))


def test_rtn_follows_the_configured_search():
    """RTN takes the config's rtn-marked search fields (the weight key already hashes them)."""
    g = torch.Generator().manual_seed(6)
    w = torch.randn(64, 128, generator=g) * torch.linspace(0.1, 4.0, 128)
    base = w.clone()
    rtn._rtn_in_place(base, 4, -1, True, 1.0)
    for opts in ({"p_norm": 3.0}, {"max_shrink": 0.1}, {"full_range": True}):
        other = w.clone()
        _, scales = rtn._rtn_in_place(other, 4, -1, True, 1.0, GPTQConfig(**opts))
        assert not torch.equal(other, base), opts
        want = rtn._group_scales(w, 4, -1, True, 1.0, 100, opts.get("max_shrink", 0.8),
                                  norm=opts.get("p_norm", 2.0), full_range=opts.get("full_range", False))
        assert torch.equal(scales, want)


def test_auto_objective_follows_r1():
    """``auto``: the weights' own error on an R1-rotated model (bit for bit the explicit ``weight``), GPTQ's
    diagonal proxy on an unrotated one (bit for bit ``hessian_diag``)."""
    from rope_quant.rotations.offline import RotationConfig, rotate_model
    from tests._support import tiny_llama

    windows = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(7))
    assert GPTQConfig().objective is ScaleObjective.AUTO

    def quantised(r1: str | None, objective: ScaleObjective) -> list[torch.Tensor]:
        model = tiny_llama()
        if r1 is not None:
            rotate_model(model, RotationConfig(r1=r1, r2="identity", r4=False, seed=0))
        gptq.quantize_model_gptq(model, windows, 3, GPTQConfig(objective=objective), progress=False)
        return [m.weight.detach().clone() for m in model.modules() if isinstance(m, torch.nn.Linear)]

    for r1, explicit in ((None, ScaleObjective.HESSIAN_DIAG), ("identity", ScaleObjective.HESSIAN_DIAG),
                         ("random_hadamard", ScaleObjective.WEIGHT)):
        auto, want = quantised(r1, ScaleObjective.AUTO), quantised(r1, explicit)
        assert all(torch.equal(a, b) for a, b in zip(auto, want, strict=True)), r1
    # The two objectives do differ on this model (the check above can fail).
    other = quantised(None, ScaleObjective.WEIGHT)
    assert not all(torch.equal(a, b) for a, b in zip(quantised(None, ScaleObjective.AUTO), other, strict=True))


def test_weight_keys_follow_every_search_option():
    """A stale weight cache is never reused: each option changes the GPTQ weight key; RTN's key follows the
    options that shape RTN's scales and ignores the Hessian objective (RTN has none)."""
    gp, rtn = RunConfig(), RunConfig().override(weights="rtn")
    other_objective = next(o for o in ScaleObjective if o != GPTQConfig().objective)
    for opts, shapes_rtn in (({"p_norm": 2.4}, True), ({"full_range": True}, True), ({"max_shrink": 0.2}, True),
                             ({"objective": other_objective.value}, False)):
        changed = GPTQConfig(**opts)
        assert gp.override(gptq=changed).weight_key() != gp.weight_key(), opts
        assert gp.override(gptq=changed).key() != gp.key(), opts
        assert (rtn.override(gptq=changed).weight_key() != rtn.weight_key()) == shapes_rtn, opts
    # Round trip through the flat (JSON) form keeps the enum and the key.
    cfg = gp.override(gptq=GPTQConfig(objective=ScaleObjective.HESSIAN_DIAG, p_norm=2.4))
    again = RunConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg and again.weight_key() == cfg.weight_key()

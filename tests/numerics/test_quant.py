"""Quantisers (rope_quant.quant.quantizers): dynamic per-token, static per-channel; weight RTN (quant.gptq)."""

from __future__ import annotations

import math

import pytest
import torch

from rope_quant.quant.quantizers import (
    NotCalibratedError,
    QuantConfig,
    QuantConfigError,
    fake_quant,
    fake_quant_per_token,
    quant_step,
)
from rope_quant.quant.rtn import rtn_quantize
from rope_quant.quant.static import StaticChannelQuantizer


def _x(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * torch.rand(*shape[:-1], 1, generator=g) * 3).to(dtype)


def _slow_asym(row: list[float], bits: int, clip: float) -> list[float]:
    """Reference asymmetric quantiser on one group, element by element (0 in range, clipped)."""
    lo = min(min(row), 0.0) * clip
    hi = max(max(row), 0.0) * clip
    maxq = 2**bits - 1
    if hi - lo == 0:
        return list(row)
    delta = (hi - lo) / maxq
    zero = round(-lo / delta)
    return [(min(max(round(v / delta) + zero, 0), maxq) - zero) * delta for v in row]


def _slow_sym(row: list[float], bits: int, clip: float) -> list[float]:
    maxq = 2 ** (bits - 1) - 1
    amax = max(abs(v) for v in row) * clip
    if amax == 0:
        return list(row)
    delta = amax / maxq
    return [min(max(round(v / delta), -maxq - 1), maxq) * delta for v in row]


# --------------------------------------------------------------------------------------------- dynamic


@pytest.mark.parametrize("bits", [16, 32])
def test_off_is_exact(bits: int) -> None:
    x = _x(3, 5, 64)
    assert torch.equal(fake_quant_per_token(x, bits, 16, 0.9), x)
    assert torch.equal(fake_quant(x, QuantConfig(bits=bits)), x)
    assert not QuantConfig().enabled and QuantConfig(bits=4).enabled


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group", [-1, 16, 32, 64])
def test_error_at_most_half_step(bits: int, group: int) -> None:
    x = _x(4, 7, 64, seed=bits)
    y = fake_quant_per_token(x, bits, group)
    delta, rng = quant_step(x, bits, group)
    n_groups = 1 if group == -1 else 64 // group
    assert delta.shape == (4, 7, n_groups) and rng.shape == (4, 7, n_groups)
    gs = 64 // n_groups
    err = (y - x).abs().reshape(4, 7, n_groups, gs).amax(-1)
    assert bool((err <= delta / 2 * (1 + 1e-5) + 1e-7).all())
    # at most 2^b distinct levels per group, and the error is not trivially zero
    for row in y.reshape(-1, gs)[:20]:
        assert row.unique().numel() <= 2**bits
    assert float(err.max()) > 0
    torch.testing.assert_close(delta, rng / (2**bits - 1))


def test_step_tracks_range_including_zero() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0], [-4.0, -1.0, 2.0, 0.5]])
    delta, rng = quant_step(x, 2, -1)
    torch.testing.assert_close(rng[:, 0], torch.tensor([4.0, 6.0]))  # [0, 4] and [-4, 2]
    torch.testing.assert_close(delta[:, 0], torch.tensor([4.0, 6.0]) / 3)


@pytest.mark.parametrize("group", [8, 32])
def test_groups_are_independent(group: int) -> None:
    x = _x(3, 128, seed=5)
    y = fake_quant_per_token(x, 4, group)
    ref = fake_quant_per_token(x.reshape(3, 128 // group, group), 4, -1).reshape(3, 128)
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    # a large outlier in one group does not change the others
    x2 = x.clone()
    x2[:, 0] = 1e3
    y2 = fake_quant_per_token(x2, 4, group)
    torch.testing.assert_close(y2[:, group:], y[:, group:], rtol=0, atol=0)
    assert not torch.allclose(y2[:, 1:group], y[:, 1:group])


def test_bad_group_and_settings_raise() -> None:
    x = _x(2, 64)
    with pytest.raises(QuantConfigError, match="divide"):
        fake_quant_per_token(x, 4, 24)
    with pytest.raises(QuantConfigError):
        fake_quant_per_token(x, 0)
    with pytest.raises(QuantConfigError):
        fake_quant_per_token(x, 4, clip_ratio=1.5)
    with pytest.raises(QuantConfigError):
        fake_quant_per_token(x, 4, clip_ratio=0.0)
    with pytest.raises(QuantConfigError):
        QuantConfig(bits=4, group_size=0)
    with pytest.raises(ValueError):
        fake_quant_per_token(torch.ones(2, 4, dtype=torch.int32), 4)
    assert issubclass(QuantConfigError, ValueError) and issubclass(NotCalibratedError, ValueError)


@pytest.mark.parametrize("clip", [0.5, 0.8, 0.95])
def test_clip_ratio_shrinks_range_and_clamps(clip: float) -> None:
    x = _x(6, 64, seed=7)
    bits = 4
    y = fake_quant_per_token(x, bits, -1, clip)
    _, rng_full = quant_step(x, bits)
    delta, rng = quant_step(x, bits, -1, clip)
    torch.testing.assert_close(rng, rng_full * clip)
    lo = x.amin(-1, keepdim=True).clamp(max=0) * clip
    hi = x.amax(-1, keepdim=True).clamp(min=0) * clip
    assert bool((y >= lo - delta).all()) and bool((y <= hi + delta).all())
    inside = (x >= lo) & (x <= hi)
    err = (y - x).abs()
    assert bool((err[inside] <= (delta / 2).expand_as(x)[inside] * (1 + 1e-5)).all())
    outside = ~inside
    assert bool(outside.any())
    assert bool((err[outside] > 0).all())  # clipped values are clamped, not reproduced


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("value", [0.0, 3.3, -2.5, 1e-8])
def test_constant_rows_reconstruct_exactly(dtype: torch.dtype, value: float) -> None:
    x = torch.full((3, 32), value, dtype=dtype)
    for sym in (False, True):
        y = fake_quant_per_token(x, 4, 16, symmetric=sym)
        assert y.dtype == dtype and not bool(y.isnan().any())
        torch.testing.assert_close(y.double(), x.double(), rtol=1e-6, atol=0)
    delta, rng = quant_step(torch.zeros(2, 8), 4)
    assert not bool(delta.isnan().any()) and float(rng.abs().max()) == 0.0


def test_zero_is_exactly_representable() -> None:
    x = _x(5, 64, seed=9)
    x[:, ::7] = 0.0
    y = fake_quant_per_token(x, 3, 16)
    assert bool((y[:, ::7] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_dtypes_match_float32(dtype: torch.dtype) -> None:
    x = _x(4, 64, seed=10, dtype=dtype)
    y = fake_quant_per_token(x, 4, 32)
    assert y.dtype == dtype
    ref = fake_quant_per_token(x.float(), 4, 32).to(dtype)
    torch.testing.assert_close(y, ref, rtol=0, atol=0)


def test_dynamic_matches_slow_reference() -> None:
    x = _x(6, 48, seed=11, dtype=torch.float64)
    for bits, group, clip in [(4, -1, 1.0), (3, 16, 0.9), (8, 24, 1.0), (2, 12, 0.7)]:
        y = fake_quant_per_token(x, bits, group, clip)
        gs = 48 if group == -1 else group
        ref = [
            [v for j in range(0, 48, gs) for v in _slow_asym(row[j : j + gs], bits, clip)]
            for row in x.tolist()
        ]
        torch.testing.assert_close(y, torch.tensor(ref, dtype=torch.float64), rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------------- RTN


@pytest.mark.parametrize(
    ("bits", "group", "sym", "clip"),
    [(4, -1, True, 1.0), (4, 32, True, 0.9), (3, 16, False, 1.0), (8, -1, False, 0.8), (2, 64, True, 1.0)],
)
def test_grouped_rows_match_slow_reference(bits: int, group: int, sym: bool, clip: float) -> None:
    w = _x(12, 128, seed=bits + group, dtype=torch.float64)
    y = fake_quant_per_token(w, bits, group, clip, symmetric=sym)
    gs = 128 if group == -1 else group
    slow = _slow_sym if sym else _slow_asym
    ref = [[v for j in range(0, 128, gs) for v in slow(row[j : j + gs], bits, clip)] for row in w.tolist()]
    torch.testing.assert_close(y, torch.tensor(ref, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_rtn_symmetric_levels_and_per_row_scale() -> None:
    w = _x(8, 64, seed=13)
    w[3] *= 100.0  # one big output channel must not change the others
    y = rtn_quantize(w, 4, mse=False)
    scale = w.abs().amax(-1, keepdim=True) / 7
    q = y / scale
    torch.testing.assert_close(q, q.round(), rtol=0, atol=1e-4)
    assert float(q.min()) >= -8 and float(q.max()) <= 7
    y_rest = rtn_quantize(torch.cat([w[:3], w[4:]]), 4, mse=False)
    torch.testing.assert_close(torch.cat([y[:3], y[4:]]), y_rest, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------- static


def test_static_per_channel_equals_dynamic_on_transposed_data() -> None:
    x = _x(3, 40, 16, seed=14)
    q = StaticChannelQuantizer(16, bits=4)
    q.observe(x[0])
    q.observe(x[1:])
    q.finalize()
    y = q(x)
    ref = fake_quant_per_token(x.reshape(-1, 16).T.contiguous(), 4).T.reshape(x.shape)
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-6)


def test_static_ranges_are_frozen_and_clamp() -> None:
    calib = torch.linspace(-1.0, 1.0, 64).reshape(16, 4)
    q = StaticChannelQuantizer(4, bits=4, clip_ratio=1.0)
    q.observe(calib)
    q.finalize()
    big = torch.full((2, 4), 10.0)
    out = q(big)
    hi = calib.amax(0).expand(2, 4)
    lo = calib.amin(0).clamp(max=0)
    step = (hi[0] - lo) / 15
    torch.testing.assert_close(out, q(hi), rtol=0, atol=0)  # clamped to the top level
    assert bool(((out - hi).abs() <= step / 2 + 1e-6).all())
    assert bool((q(-big) == q(lo.expand(2, 4))).all())
    with pytest.raises(QuantConfigError, match="frozen"):
        q.observe(big)
    with pytest.raises(QuantConfigError):
        q(torch.zeros(2, 5))


def test_static_merge_and_errors() -> None:
    a, b = _x(10, 8, seed=15), _x(10, 8, seed=16)
    q1, q2, q12 = (StaticChannelQuantizer(8, bits=3) for _ in range(3))
    q1.observe(a)
    q2.observe(b)
    q12.observe(torch.cat([a, b]))
    q1.merge(q2)
    torch.testing.assert_close(q1.lo, q12.lo)
    torch.testing.assert_close(q1.hi, q12.hi)
    torch.testing.assert_close(q1(a), q12(a))
    with pytest.raises(NotCalibratedError):
        StaticChannelQuantizer(8, bits=4)(a)
    with pytest.raises(NotCalibratedError):
        StaticChannelQuantizer(8, bits=4).finalize()
    assert torch.equal(StaticChannelQuantizer(8, bits=16)(a), a)


def test_static_symmetric_and_half() -> None:
    x = _x(32, 8, seed=17)
    q = StaticChannelQuantizer(8, bits=4, symmetric=True)
    q.observe(x)
    y = q(x.to(torch.bfloat16))
    assert y.dtype == torch.bfloat16
    amax = x.abs().amax(0)
    step = amax / 7
    torch.testing.assert_close(y.float() / step, (y.float() / step).round(), rtol=0, atol=0.05)
    assert bool(((y.float() - x).abs() <= step / 2 + 0.02 * amax).all())
    assert math.isfinite(float(y.float().sum()))


# ----------------------------------------------------------------------------- non-finite policy (one rule)

_NAN_ROW = [0.5, math.nan, 2.0, 0.25, -3.0, 1.7]


def _plain_asym(x: torch.Tensor, bits: int, clip: float = 1.0) -> torch.Tensor:
    """The textbook tensor formulas with no guards beyond the zero range (the finite fast path must equal it)."""
    lo, hi = torch.aminmax(x, dim=-1, keepdim=True)
    lo, hi = lo.clamp(max=0.0) * clip, hi.clamp(min=0.0) * clip
    maxq = (1 << bits) - 1
    delta = (hi - lo) / maxq
    delta = torch.where(delta > 0, delta, torch.ones_like(delta))
    zero = torch.round(-lo / delta)
    return torch.clamp(torch.round(x / delta), -zero, maxq - zero) * delta


@pytest.mark.parametrize("symmetric", [False, True])
def test_nan_stays_where_it_was_and_neighbours_use_the_finite_range(symmetric):
    x = torch.tensor([_NAN_ROW])
    y = fake_quant_per_token(x, 4, symmetric=symmetric)
    finite = torch.tensor([[v for v in _NAN_ROW if not math.isnan(v)]])
    expected = fake_quant_per_token(finite, 4, symmetric=symmetric)
    assert bool(y[0, 1].isnan())
    keep = [0, 2, 3, 4, 5]
    assert torch.equal(y[0, keep], expected[0])
    # The old failure: a NaN step replaced by 1.0 rounded 0.5 to 0 and 0.25 to 0 on a unit grid.
    assert float(y[0, 0]) != 0.0 and float(y[0, 3]) != 0.0


def test_symmetric_nan_policy_matches_the_asymmetric_one():
    w = torch.tensor([_NAN_ROW, [1.0, -2.0, 0.5, 0.0, 3.0, -1.0]])
    y = fake_quant_per_token(w, 4, symmetric=True)
    assert bool(y[0, 1].isnan()) and int(y.isnan().sum()) == 1
    assert torch.equal(y[1], fake_quant_per_token(w[1:], 4, symmetric=True)[0])


@pytest.mark.parametrize("value", [math.inf, -math.inf])
def test_inf_passes_through_and_does_not_flatten_the_group(value):
    x = torch.tensor([[1.0, value, -0.5, 0.25]])
    y = fake_quant_per_token(x, 4)
    assert float(y[0, 1]) == value
    assert torch.equal(y[0, [0, 2, 3]], fake_quant_per_token(torch.tensor([[1.0, -0.5, 0.25]]), 4)[0])


@pytest.mark.parametrize("symmetric", [False, True])
def test_float32_extremes_do_not_overflow(symmetric):
    x = torch.tensor([[3e38, -3e38, 1.0, 0.0]])
    y = fake_quant_per_token(x, 4, symmetric=symmetric)
    assert bool(torch.isfinite(y).all()), y
    # within one quantiser step of the input at the extremes (step = 6e38/15 or 3e38/7)
    step = 6e38 / 15 if not symmetric else 3e38 / 7
    assert float((y[0, :2] - x[0, :2]).abs().max()) <= step
    delta, _ = quant_step(x, 4)
    assert bool(torch.isfinite(delta).all()) and math.isclose(float(delta), 6e38 / 15, rel_tol=1e-6)


def test_static_observe_rejects_nonfinite_calibration_and_stays_usable():
    from rope_quant.quant.quantizers import NonFiniteInputError

    q = StaticChannelQuantizer(6, bits=4)
    with pytest.raises(NonFiniteInputError, match=r"NaN/inf in 1 channel\(s\) \(first: \[1\]\)"):
        q.observe(torch.tensor([_NAN_ROW]))
    assert not q.calibrated  # the bad batch left no trace
    q.observe(torch.tensor([[0.5, 1.0, 2.0, 0.25, -3.0, 1.7]]))
    y = q(torch.tensor([_NAN_ROW]))
    assert bool(y[0, 1].isnan()) and int(y.isnan().sum()) == 1


def test_static_extreme_ranges_do_not_overflow():
    q = StaticChannelQuantizer(2, bits=4)
    q.observe(torch.tensor([[3e38, -3e38], [-3e38, 3e38]]))
    y = q(torch.tensor([[3e38, -3e38]]))
    assert bool(torch.isfinite(y).all()), y


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_finite_fast_path_is_bit_identical_to_the_plain_formulas(bits):
    x = _x(64, 96, seed=bits)
    assert torch.equal(fake_quant_per_token(x, bits), _plain_asym(x, bits))
    assert torch.equal(fake_quant_per_token(x, bits, clip_ratio=0.9), _plain_asym(x, bits, 0.9))


@pytest.mark.parametrize("mse", [False, True])
def test_rtn_weight_nan_policy_matches_the_dynamic_quantiser(mse):
    """RTN (rtn.rtn_quantize): NaN stays where it was, the rest of the row keeps its finite-row scale."""
    w = torch.tensor([_NAN_ROW, [1.0, -2.0, 0.5, 0.0, 3.0, -1.0]])
    y = rtn_quantize(w, 4, mse=mse)
    assert bool(y[0, 1].isnan()) and int(y.isnan().sum()) == 1
    finite_row = torch.tensor([[0.5, 0.0, 2.0, 0.25, -3.0, 1.7]])  # the NaN as 0: the same row range
    expected = rtn_quantize(finite_row, 4, mse=mse)[0]
    assert torch.equal(y[0, [0, 2, 3, 4, 5]], expected[[0, 2, 3, 4, 5]])
    assert torch.equal(y[1], rtn_quantize(w[1:], 4, mse=mse)[0])
    big = rtn_quantize(torch.tensor([[3e38, -3e38, 1.0, 0.0]]), 4, mse=mse)
    assert bool(torch.isfinite(big).all()), big

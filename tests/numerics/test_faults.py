"""Issue 26, fault by fault (library side): quantisers never overflow, a study directory is owned by one run,
cells are claimed, caches heal, checkpoint errors name the culprit; and the cases that already held (kill -9
mid-sweep with a bit-identical resume, damaged records, a corpus changed under the same path).

Everything here runs on stub cell functions or a tiny random Llama (no embedded model).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rope_quant.quant.gptq import GPTQError, _rtn, rtn_quantize
from rope_quant.quant.quantizers import StaticChannelQuantizer, fake_quant_per_token

# ----------------------------------------------------------------------------- quantisers never overflow

F32_MAX = torch.finfo(torch.float32).max
HALF = [torch.float16, torch.bfloat16, torch.float32]


def _finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


@pytest.mark.parametrize("row", [[3.4028e38, -3.4028e38, 1.0, 0.5], [3.4028e38, -3.4e36, 1.0, 0.0]])
def test_issue26_asym_per_token_near_float32_max_is_finite(row):
    """Issue 26 wrong case 3: these gave -inf and +inf (the rounded zero point puts a grid end past the max)."""
    x = torch.tensor([row])
    y = fake_quant_per_token(x, 4)
    assert _finite(y), y
    step = (max(row) - min(min(row), 0.0)) / 15
    assert float((y.double() - x.double()).abs().max()) <= step  # still a quantiser: within one step


def test_issue26_asym_per_token_float16_max_is_finite():
    """Issue 26 wrong case 4: float16 [65504, -65504, 1, .5] gave -inf; now saturates at -65504."""
    x = torch.tensor([[65504.0, -65504.0, 1.0, 0.5]], dtype=torch.float16)
    y = fake_quant_per_token(x, 4)
    assert _finite(y), y
    assert float(y[0, 1]) == -65504.0


@pytest.mark.parametrize("dtype,big", [(torch.float16, -65440.0), (torch.float32, -3.3994e38)])
def test_issue26_rtn_mse_clip_search_near_dtype_max_is_finite(dtype, big):
    """Issue 26 wrong cases 5 and 6: a row where the MSE search picks a ratio < 1 used code −8 ·
    scale = −8/7·0.9x·max|w| past the dtype's maximum. Codes × scales still reproduce the output."""
    gen = torch.Generator().manual_seed(3)
    w = (torch.rand(4, 16, generator=gen) * 2 - 1) * abs(big) * 0.6
    w[:, 0] = big
    w = w.to(dtype)
    assert _finite(w)
    for mse in (True, False):
        out, codes, scales = _rtn(w, 4, -1, mse, 1.0, 100, 0.8)
        assert _finite(out), (mse, out)
        assert torch.equal((codes * scales).to(dtype), out)
        assert float(codes.min()) >= -8 and float(codes.max()) <= 7


def test_rtn_normal_rows_keep_their_bits_when_another_row_overflows():
    """Only the overflowing row is requantised (symmetric grid); the others are the plain path's bits."""
    gen = torch.Generator().manual_seed(0)
    normal = torch.randn(3, 32, generator=gen)
    extreme = torch.randn(1, 32, generator=gen) * 1e38
    extreme[0, 0] = -3.3994e38
    both = rtn_quantize(torch.cat([normal, extreme]), 4)
    assert _finite(both)
    assert torch.equal(both[:3], rtn_quantize(normal, 4))


@pytest.mark.parametrize("shape", [(3, 0), (0, 0)])
def test_rtn_zero_column_weight_is_a_clear_error(shape):
    """Issue 26 traceback: rtn_quantize on a 0-column weight raised ZeroDivisionError."""
    with pytest.raises(GPTQError, match=r"at least one column, got shape \(" + str(shape[0]) + ", 0\\)"):
        rtn_quantize(torch.zeros(shape), 4)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("symmetric", [False, True])
def test_static_quantizer_near_dtype_max_is_finite(dtype, symmetric):
    lim = torch.finfo(dtype).max
    q = StaticChannelQuantizer(3, bits=4, symmetric=symmetric)
    q.observe(torch.tensor([[lim, -lim, 1.0], [-lim, lim * 0.9, -2.0]], dtype=dtype))
    y = q(torch.tensor([[lim, -lim, 0.5], [-lim, lim, -2.0]], dtype=dtype))
    assert _finite(y), y


def _dtype_floats(dtype: torch.dtype):
    lim = float(torch.finfo(dtype).max)
    width = 16 if dtype == torch.float16 else 32
    extremes = st.sampled_from([lim, -lim, lim * 0.999, -lim * 0.999, lim / 2, -lim / 2, 0.0, -0.0, 1.0, 0.5])
    return st.one_of(extremes, st.floats(-lim, lim, width=width, allow_nan=False, allow_infinity=False))


@settings(max_examples=120, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(HALF), bits=st.sampled_from([2, 3, 4, 8]),
       gsize=st.sampled_from([1, 2, 4, 7]), groups=st.integers(1, 3), rows=st.integers(1, 3),
       clip=st.sampled_from([1.0, 0.9]), symmetric=st.booleans())
def test_finite_input_gives_finite_output_up_to_each_dtype_max(data, dtype, bits, gsize, groups, rows, clip,
                                                               symmetric):
    """Dynamic (sym/asym, grouped), static and RTN (with and without the MSE search): finite in, finite out."""
    n = gsize * groups
    vals = data.draw(st.lists(_dtype_floats(dtype), min_size=rows * n, max_size=rows * n))
    x = torch.tensor(vals, dtype=torch.float64).to(dtype).reshape(rows, n)
    assert _finite(x)
    for group in (-1, gsize):
        assert _finite(fake_quant_per_token(x, bits, group, clip, symmetric=symmetric)), (group, x)
    q = StaticChannelQuantizer(n, bits=bits, clip_ratio=clip, symmetric=symmetric)
    q.observe(x)
    assert _finite(q(x)), x
    if bits >= 2:
        for mse in (True, False):
            for group in (-1, gsize):
                out, codes, scales = _rtn(x, bits, group, mse, clip, 20, 0.8)
                assert _finite(out), (mse, group, x)
                col = scales.repeat_interleave(n if group == -1 else group, dim=1)[:, :n]
                assert torch.equal((codes * col).to(dtype), out)


def test_normal_range_rows_are_untouched_by_the_overflow_repair():
    """A call holding one extreme token keeps every other token's bits (only the overflowing group is redone)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, 64, generator=gen)
    extreme = x.clone()
    extreme[5] = torch.linspace(-F32_MAX, F32_MAX, 64, dtype=torch.float64).float()
    assert _finite(extreme)
    for symmetric in (False, True):
        a = fake_quant_per_token(x, 4, symmetric=symmetric)
        b = fake_quant_per_token(extreme, 4, symmetric=symmetric)
        assert _finite(b)
        keep = [i for i in range(16) if i != 5]
        assert torch.equal(a[keep].view(torch.int32), b[keep].view(torch.int32))
        assert math.isfinite(float(b[5].abs().max()))

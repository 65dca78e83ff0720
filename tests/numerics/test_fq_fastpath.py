"""The dynamic fake quantiser's fast path is bit-identical to the arithmetic it replaced.

``ref_fake_quant`` below is the earlier code written out plainly (the specification): ``aminmax`` for the
range, ``abs().amax()`` for the symmetric scale, one ``clamp_`` with the two tensor bounds. The fast path
(``amin`` + ``amax``, ``max(amax, −amin)``, ``clamp_min_`` + ``clamp_max_`` when no bound is ±0) must give
the same bits: compared as integers, so the sign of every zero and the payload of every passed-through
NaN count, on seeded and hypothesis inputs with exact zeros of both signs, one-signed and all-zero groups,
NaN/±inf, magnitudes near the float32 limit, group sizes that do and do not fill a SIMD vector, clip
ratios, both sym and asym, half-precision inputs, and strided (transposed) K/V-like tensors. The last
tests check the logits of a tiny random Llama at W4A4KV4 against the reference patched into the module.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaForCausalLM

from rope_quant.quant import quantizers as Q
from rope_quant.quant.static import StaticChannelQuantizer
from tests._support import tiny_llama

# ----------------------------------------------------------------------------- the reference (old code)


def _ref_step(hi: torch.Tensor, lo: torch.Tensor, levels: int) -> torch.Tensor:
    delta = (hi - lo) / levels
    if not bool(torch.isfinite(delta).all()):
        delta = torch.where(torch.isfinite(delta), delta, hi / levels - lo / levels)
    return delta


def _ref_finite_or_zero(g: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(g), g, torch.zeros_like(g))


def ref_asym_range(g: torch.Tensor, clip: float) -> tuple[torch.Tensor, torch.Tensor, bool]:
    lo, hi = torch.aminmax(g, dim=-1, keepdim=True)
    finite = bool(torch.isfinite(lo).all()) and bool(torch.isfinite(hi).all())
    if not finite:
        lo, hi = torch.aminmax(_ref_finite_or_zero(g), dim=-1, keepdim=True)
    lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)
    if clip != 1.0:
        lo, hi = lo * clip, hi * clip
    return lo, hi, finite


def ref_sym_amax(g: torch.Tensor, clip: float) -> tuple[torch.Tensor, bool]:
    amax = g.abs().amax(dim=-1, keepdim=True)
    finite = bool(torch.isfinite(amax).all())
    if not finite:
        amax = _ref_finite_or_zero(g).abs().amax(dim=-1, keepdim=True)
    return amax * clip, finite


def ref_fq_asym(g: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int) -> torch.Tensor:
    maxq = (1 << bits) - 1
    delta = _ref_step(hi, lo, maxq)
    delta = torch.where(delta > 0, delta, torch.ones_like(delta))
    zero = torch.round(-lo / delta)
    q = torch.div(g, delta)
    q.round_()
    q.clamp_(min=-zero, max=maxq - zero)
    return q.mul_(delta)


def ref_fq_sym(g: torch.Tensor, amax: torch.Tensor, bits: int) -> torch.Tensor:
    maxq = (1 << (bits - 1)) - 1
    delta = _ref_step(amax, torch.zeros_like(amax), maxq)
    delta = torch.where(delta > 0, delta, torch.ones_like(delta))
    q = torch.div(g, delta)
    q.round_()
    q.clamp_(-maxq - 1, maxq)
    return q.mul_(delta)


def ref_fake_quant(x: torch.Tensor, bits: int, group: int = -1, clip: float = 1.0, *,
                   symmetric: bool = False) -> torch.Tensor:
    if bits >= 16:
        return x
    w = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    n = w.shape[-1]
    gs = n if group == -1 else group
    g = w.reshape(*w.shape[:-1], n // gs, gs)
    if symmetric:
        amax, finite = ref_sym_amax(g, clip)
        out = ref_fq_sym(g, amax, bits)
    else:
        lo, hi, finite = ref_asym_range(g, clip)
        out = ref_fq_asym(g, lo, hi, bits)
    if not finite:
        out = torch.where(torch.isfinite(g), out, g)
    return _ref_saturate(out.reshape(x.shape).to(x.dtype), x, gs, bits, clip, symmetric)


def _ref_saturate(out: torch.Tensor, x: torch.Tensor, gs: int, bits: int, clip: float,
                  symmetric: bool) -> torch.Tensor:
    """The 0.2.0 overflow rule: a group whose finite inputs came out ±inf is the float64 result, saturated
    at the dtype's largest finite value (float64 itself never overflows here)."""
    shape = (*x.shape[:-1], x.shape[-1] // gs, gs)
    bad = (torch.isinf(out) & torch.isfinite(x)).reshape(shape).any(dim=-1, keepdim=True)
    if not bool(bad.any()):
        return out
    x64 = x.double()
    lim = torch.finfo(x.dtype).max
    fix = torch.where(torch.isfinite(x64), ref_fake_quant(x64, bits, gs, clip, symmetric=symmetric)
                      .clamp(-lim, lim), x64).to(x.dtype)
    return torch.where(bad, fix.reshape(shape), out.reshape(shape)).reshape(x.shape)


# ----------------------------------------------------------------------------- helpers

_INT = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
        torch.float64: torch.int64}


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """Equal as bit patterns (sign of zero and NaN payload included)."""
    assert a.dtype == b.dtype and a.shape == b.shape, what
    ia, ib = a.contiguous().view(_INT[a.dtype]), b.contiguous().view(_INT[b.dtype])
    if not torch.equal(ia, ib):
        bad = (ia != ib).nonzero()[:4].tolist()
        raise AssertionError(f"{what}: bits differ at {bad}: {a.flatten()[:8]} vs {b.flatten()[:8]}")


def _special(x: torch.Tensor, mode: str, gen: torch.Generator) -> torch.Tensor:
    """Rows that exercise every branch: one-signed, ±0 heavy, all-zero, non-finite, huge, tiny."""
    u = torch.rand(x.shape, generator=gen)
    if mode == "nonneg":
        x = x.abs()
    elif mode == "nonpos":
        x = -x.abs()
    elif mode == "pos_zeros":
        x = torch.where(u < 0.4, torch.zeros_like(x), x)
    elif mode == "neg_zeros":
        x = torch.where(u < 0.4, torch.full_like(x, -0.0), x)
    elif mode == "nonneg_signed_zeros":
        x = torch.where(u < 0.3, torch.full_like(x, -0.0), torch.where(u < 0.6, torch.zeros_like(x), x.abs()))
    elif mode == "all_zero":
        x = torch.where(u < 0.5, torch.full_like(x, -0.0), torch.zeros_like(x))
    elif mode == "nonfinite":
        x = x.clone()
        x[u < 0.04] = float("nan")
        x[(u >= 0.04) & (u < 0.07)] = float("inf")
        x[(u >= 0.07) & (u < 0.10)] = -float("inf")
    elif mode == "huge":
        x = x / x.abs().amax() * 3.0e38
    elif mode == "tiny":
        x = x * 1e-40  # subnormal
    elif mode == "small_negative_min":  # zero point rounds to 0 with a negative (nonzero) minimum
        x = torch.where(u < 0.1, -x.abs() * 1e-3, x.abs())
    return x


MODES = ["plain", "nonneg", "nonpos", "pos_zeros", "neg_zeros", "nonneg_signed_zeros", "all_zero", "nonfinite",
         "huge", "tiny", "small_negative_min"]


def _inputs(seed: int, rows: int, n: int, mode: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scale = torch.rand(rows, 1, generator=gen) * 10.0 ** torch.randint(-3, 4, (rows, 1), generator=gen)
    x = torch.randn(rows, n, generator=gen) * scale
    # mix row types so a single call holds rows of several kinds (the checks are per call, not per row)
    return torch.where(torch.arange(rows)[:, None] % 3 == 0, x, _special(x, mode, gen))


# ----------------------------------------------------------------------------- seeded sweeps


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("symmetric", [False, True])
def test_fake_quant_matches_reference_bit_for_bit(mode: str, symmetric: bool) -> None:
    for seed, (n, groups) in enumerate([(64, (-1, 16, 8)), (576, (-1, 64, 32)), (51, (-1, 17, 3)),
                                        (40, (-1, 20, 5, 1)), (7, (-1, 7))]):
        x = _inputs(seed, 37, n, mode)
        for bits, group, clip in itertools.product((2, 3, 4, 8), groups, (1.0, 0.9, 0.5)):
            want = ref_fake_quant(x, bits, group, clip, symmetric=symmetric)
            got = Q.fake_quant_per_token(x, bits, group, clip, symmetric=symmetric)
            assert_bits_equal(got, want, f"{mode} n={n} bits={bits} group={group} clip={clip}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_match_reference(dtype: torch.dtype) -> None:
    for mode in MODES:
        x = _inputs(3, 24, 64, mode).clamp(-6e4, 6e4).to(dtype)
        for symmetric in (False, True):
            assert_bits_equal(Q.fake_quant_per_token(x, 4, -1, 0.9, symmetric=symmetric),
                              ref_fake_quant(x, 4, -1, 0.9, symmetric=symmetric), f"{dtype} {mode}")


def test_strided_kv_layout_matches_reference() -> None:
    """value_states in attention are (b, H, L, d) views of a (b, L, H, d) tensor: not contiguous."""
    gen = torch.Generator().manual_seed(5)
    for mode in MODES:
        base = _special(torch.randn(2, 33, 3, 64, generator=gen), mode, gen)
        v = base.transpose(1, 2)
        assert not v.is_contiguous()
        for group in (-1, 32):
            assert_bits_equal(Q.fake_quant_per_token(v, 4, group), ref_fake_quant(v, 4, group), mode)


def test_step_diagnostics_match_reference() -> None:
    """quant_step / selected_step share the range code: same bits as the reference range."""
    for mode in MODES:
        x = _inputs(11, 20, 64, mode)
        if mode == "nonfinite":
            x = torch.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0)
        g = x.reshape(20, 4, 16)
        lo, hi, _ = ref_asym_range(g, 0.9)
        step, span = Q.quant_step(x, 4, 16, 0.9)
        assert_bits_equal(step, _ref_step(hi, lo, 15).squeeze(-1), mode)
        assert_bits_equal(span, (hi - lo).squeeze(-1), mode)
        for symmetric in (False, True):
            cfg = Q.QuantConfig(bits=4, group_size=16, clip_ratio=0.9, symmetric=symmetric)
            if symmetric:
                amax, _ = ref_sym_amax(g, 0.9)
                d = _ref_step(amax, torch.zeros_like(amax), 7)
            else:
                d = _ref_step(hi, lo, 15)
            want = torch.where(d > 0, d, torch.ones_like(d)).squeeze(-1)
            assert_bits_equal(Q.selected_step(x, cfg), want, f"{mode} sym={symmetric}")


def test_static_channel_quantizer_matches_reference() -> None:
    """The static control shares _fq_asym/_fq_sym (per-channel bounds, some of them ±0)."""
    gen = torch.Generator().manual_seed(2)
    calib = torch.randn(64, 48, generator=gen)
    calib[:, :6] = calib[:, :6].abs()  # channels with lo = 0 (zero point 0)
    calib[:, 6:12] = -calib[:, 6:12].abs()  # channels with hi = 0 (zero point = maxq)
    for mode in MODES:
        x = _special(torch.randn(9, 48, generator=gen) * 2, mode, gen)
        for symmetric in (False, True):
            q = StaticChannelQuantizer(48, bits=4, clip_ratio=0.9, symmetric=symmetric)
            q.observe(calib)
            q.finalize()
            a, b = q._params
            want = ref_fq_sym(x, a, 4) if symmetric else ref_fq_asym(x, a, b, 4)
            if not bool(torch.isfinite(x).all()):
                want = torch.where(torch.isfinite(x), want, x)
            assert_bits_equal(q(x), want, f"static {mode} sym={symmetric}")


# ----------------------------------------------------------------------------- hypothesis

_floats = st.one_of(
    st.floats(width=32, allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 1e-45, -1e-45, 3.4e38, -3.4e38]),
)


@settings(max_examples=300, deadline=None)
@given(
    rows=st.integers(1, 4),
    groups=st.integers(1, 3),
    gsize=st.sampled_from([1, 2, 3, 8, 16, 17, 32]),
    data=st.data(),
    bits=st.sampled_from([2, 3, 4, 8]),
    clip=st.sampled_from([1.0, 0.95, 0.5, 1e-3]),
    symmetric=st.booleans(),
)
def test_fake_quant_matches_reference_on_arbitrary_floats(rows, groups, gsize, data, bits, clip, symmetric):
    n = groups * gsize
    vals = data.draw(st.lists(_floats, min_size=rows * n, max_size=rows * n))
    x = torch.tensor(vals, dtype=torch.float32).reshape(rows, n)
    for group in (-1, gsize):
        assert_bits_equal(Q.fake_quant_per_token(x, bits, group, clip, symmetric=symmetric),
                          ref_fake_quant(x, bits, group, clip, symmetric=symmetric))


# ----------------------------------------------------------------------------- the fast path is taken


def test_per_token_groups_take_the_vectorised_rows_clamp(monkeypatch) -> None:
    """Per-token groups (one (Δ, z) per group of > 1 contiguous channels) take the quarter-bound clamp before
    rounding, in the exact and the deferred path, whether or not a zero point is 0 or 2^b − 1 (so the
    comparisons above test it, not the fallback); groups of one channel and per-channel (static) bounds keep
    the plain clamp, whose tie rule differs there."""
    from rope_quant.quant import deferred

    rows: list[bool] = []
    plain: list[bool] = []
    real_rows, real_plain = Q._round_clamp_rows, Q._clamp_between

    def spy_rows(v, zero, maxq, lower):
        rows.append(lower)
        return real_rows(v, zero, maxq, lower)

    def spy_plain(q, low, high, zero_sign_free):
        plain.append(zero_sign_free)
        return real_plain(q, low, high, zero_sign_free)

    monkeypatch.setattr(Q, "_round_clamp_rows", spy_rows)
    monkeypatch.setattr(Q, "_clamp_between", spy_plain)
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
    Q.fake_quant_per_token(x, 4)
    Q.fake_quant_per_token(torch.cat([x, x[:1].abs(), -x[:1].abs()]), 4, clip_ratio=0.9)
    with deferred.deferred_checks():
        Q.fake_quant_per_token(x, 4)
    assert rows == [False, True, False] and plain == []
    Q.fake_quant_per_token(x, 4, group_size=1)
    q = StaticChannelQuantizer(64, bits=4)
    q.observe(x)
    q(x)
    assert rows == [False, True, False] and len(plain) == 2


# ----------------------------------------------------------------------------- logits of a tiny Llama


def _tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    return tiny_llama(96, seed=seed, max_positions=256)


def _w4a4kv4_logits(a_cfg: Q.QuantConfig, kv_cfg: Q.QuantConfig) -> torch.Tensor:
    from rope_quant.experiment.pipeline import install_activation_quantizers
    from rope_quant.quant.rtn import quantize_model_rtn
    from rope_quant.rotations import attention

    model = _tiny_llama()
    quantize_model_rtn(model, 4, -1, False, 1.0)
    install_activation_quantizers(model, a_cfg)
    attention.install_attention(model, None, k=kv_cfg, v=kv_cfg)
    ids = torch.randint(0, 96, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.compat
@pytest.mark.parametrize("symmetric,group,clip", [(False, -1, 1.0), (False, 16, 0.9), (True, 16, 0.9)])
def test_tiny_llama_w4a4kv4_logits_unchanged(monkeypatch, symmetric: bool, group: int, clip: float) -> None:
    a_cfg = Q.QuantConfig(bits=4, group_size=group, clip_ratio=clip, symmetric=symmetric)
    kv_cfg = Q.QuantConfig(bits=4, group_size=-1, clip_ratio=clip, symmetric=symmetric)
    new = _w4a4kv4_logits(a_cfg, kv_cfg)
    with monkeypatch.context() as m:
        m.setattr(Q, "_asym_range", ref_asym_range)
        m.setattr(Q, "_sym_amax", ref_sym_amax)
        m.setattr(Q, "_fq_asym", lambda g, lo, hi, bits, lower=True: ref_fq_asym(g, lo, hi, bits))
        m.setattr(Q, "_fq_sym", ref_fq_sym)
        old = _w4a4kv4_logits(a_cfg, kv_cfg)
    with torch.no_grad():
        unquantised = _tiny_llama()(torch.randint(0, 96, (2, 48), generator=torch.Generator().manual_seed(1))).logits
    assert torch.isfinite(new).all()
    assert not torch.equal(new, unquantised)  # the quantisers did act
    assert_bits_equal(new, old, "logits")

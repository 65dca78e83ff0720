"""Deferred checks (rope_quant.quant.deferred): inside a window the quantisers and the K diagnostics read
nothing on the host, and what the window's owner gets after its one read equals the per-call exact path bit
for bit (sign of zero and NaN payload included), or the window says it must be recomputed."""

from __future__ import annotations

import itertools

import pytest
import torch

from rope_quant.calib.diagnostics import KDiagnostics, NonFiniteKeysError
from rope_quant.quant import deferred
from rope_quant.quant import quantizers as Q
from rope_quant.quant.static import StaticChannelQuantizer
from tests._support.host_syncs import count_host_syncs


def _rows(seed: int, rows: int, n: int, mode: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=gen) * 10.0 ** torch.randint(-3, 4, (rows, 1), generator=gen)
    u = torch.rand(rows, n, generator=gen)
    if mode == "nonneg":
        x = x.abs()
    elif mode == "nonpos":
        x = -x.abs()
    elif mode == "signed_zeros":
        x = torch.where(u < 0.3, torch.full_like(x, -0.0), torch.where(u < 0.6, torch.zeros_like(x), x))
    elif mode == "all_zero":
        x = torch.where(u < 0.5, torch.full_like(x, -0.0), torch.zeros_like(x))
    elif mode == "small_negative_min":
        x = torch.where(u < 0.1, -x.abs() * 1e-3, x.abs())
    elif mode == "nonfinite":
        x[u < 0.05] = float("nan")
        x[(u >= 0.05) & (u < 0.08)] = float("inf")
    elif mode == "huge":
        x = x / x.abs().amax() * 3.0e38
    elif mode == "tiny":
        x = x * 1e-40
    return torch.where(torch.arange(rows)[:, None] % 3 == 0, torch.randn(rows, n, generator=gen), x)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    it = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[a.dtype]
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(it), b.contiguous().view(it))


FINITE = ["plain", "nonneg", "nonpos", "signed_zeros", "all_zero", "small_negative_min"]


@pytest.mark.parametrize("mode", FINITE + ["nonfinite", "huge", "tiny"])
@pytest.mark.parametrize("symmetric", [False, True])
def test_deferred_fake_quant_is_the_exact_path_or_asks_for_it(mode: str, symmetric: bool) -> None:
    reruns = 0
    for seed, (n, groups) in enumerate([(64, (-1, 16, 8)), (51, (-1, 17, 3)), (40, (-1, 5, 1))]):
        x = _rows(seed, 30, n, mode)
        dtypes = (torch.float32, torch.float16)
        for bits, group, clip, dtype in itertools.product((2, 4, 8), groups, (1.0, 0.9), dtypes):
            xd = x.clamp(-6e4, 6e4).to(dtype) if dtype == torch.float16 and mode != "huge" else x.to(dtype)
            want = Q.fake_quant_per_token(xd, bits, group, clip, symmetric=symmetric)
            with count_host_syncs() as c, deferred.deferred_checks() as win:
                got = Q.fake_quant_per_token(xd, bits, group, clip, symmetric=symmetric)
            assert sum(c.values()) == 0
            _, rerun = win.read()
            reruns += rerun
            if not rerun:
                assert _same_bits(got, want), (mode, n, bits, group, clip, dtype)
            else:  # the owner recomputes: the exact path is what it then gets
                with deferred.exact_checks():
                    again = Q.fake_quant_per_token(xd, bits, group, clip, symmetric=symmetric)
                assert _same_bits(again, want)
    if mode in FINITE:
        assert reruns == 0, mode  # ordinary inputs never pay for a recomputation
    elif mode in ("nonfinite", "huge"):
        assert reruns > 0, mode


def test_run_checked_recomputes_a_flagged_window_exactly() -> None:
    x = _rows(0, 12, 64, "nonfinite")
    calls = {"n": 0}

    def fn() -> torch.Tensor:
        calls["n"] += 1
        return Q.fake_quant_per_token(x, 4)
    out, _ = deferred.run_checked(fn)
    assert calls["n"] == 2 and _same_bits(out, Q.fake_quant_per_token(x, 4))
    calls["n"] = 0
    y = _rows(1, 12, 64, "plain")
    out, vals = deferred.run_checked(lambda: (calls.__setitem__("n", calls["n"] + 1), Q.fake_quant_per_token(y, 4))[1],
                                     lambda t: (t.sum(),))
    assert calls["n"] == 1 and vals == [float(out.sum())]


def test_deferred_k_diagnostics_equal_the_direct_ones_and_raise_on_nonfinite_keys() -> None:
    g = torch.Generator().manual_seed(0)
    ks = [torch.randn(1, 2, 9, 16, generator=g) * (1 + i) for i in range(3)]
    direct, lazy = KDiagnostics(4, per_layer=True), KDiagnostics(4, per_layer=True)
    for i, k in enumerate(ks):
        direct.update(k, layer=i % 2)
    with count_host_syncs() as c, deferred.deferred_checks() as win:
        for i, k in enumerate(ks):
            assert lazy.update(k, layer=i % 2) is None
    assert sum(c.values()) == 0
    win.read()
    a, b = direct.summary(), lazy.summary()
    assert a.keys() == b.keys()
    for key in ("k_range_mean", "k_range_max", "delta_mean", "k_rel_err", "n_groups"):
        assert b[key] == pytest.approx(a[key], rel=1e-12), key
    assert b["per_layer"].keys() == a["per_layer"].keys()
    bad = ks[0].clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(NonFiniteKeysError):
        direct.update(bad, layer=0)
    before = lazy.summary()["n_groups"]
    with deferred.deferred_checks() as win:
        lazy.update(bad, layer=0)
    with pytest.raises(NonFiniteKeysError):
        win.read()
    assert lazy.summary()["n_groups"] == before  # the refused window added nothing


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("mode", FINITE + ["nonfinite"])
def test_deferred_static_quantiser_is_the_exact_path_or_asks_for_it(symmetric: bool, mode: str) -> None:
    calib = _rows(0, 40, 24, "plain" if mode == "nonfinite" else mode)
    q = StaticChannelQuantizer(24, bits=4, clip_ratio=0.9, symmetric=symmetric)
    q.observe(calib)
    q.finalize()
    x = _rows(1, 30, 24, mode) * 1.5  # beyond the frozen ranges too
    want = q(x)
    with count_host_syncs() as c, deferred.deferred_checks() as win:
        got = q(x)
    assert sum(c.values()) == 0
    rerun = win.read()[1]
    assert rerun == (mode == "nonfinite")
    if not rerun:
        assert _same_bits(got, want), mode


@pytest.mark.parametrize("symmetric", [False, True])
def test_deferred_selected_step_equals_the_direct_one(symmetric: bool) -> None:
    for mode in FINITE:
        x = _rows(2, 20, 64, mode)
        for bits, group, clip in itertools.product((2, 4), (-1, 16), (1.0, 0.8)):
            cfg = Q.QuantConfig(bits=bits, group_size=group, clip_ratio=clip, symmetric=symmetric)
            want = Q.selected_step(x, cfg)
            with count_host_syncs() as c, deferred.deferred_checks() as win:
                got = Q.selected_step(x, cfg)
            assert sum(c.values()) == 0 and not win.read()[1]
            assert torch.equal(got, want), (mode, bits, group, clip)


def _quantised_tiny():  # type: ignore[no-untyped-def]
    from rope_quant.experiment.pipeline import install_activation_quantizers
    from rope_quant.rotations import attention
    from tests._support import tiny_llama

    model = tiny_llama(96, layers=2)
    install_activation_quantizers(model, Q.QuantConfig(bits=4))
    diag = KDiagnostics(4, per_layer=True)
    attention.install_attention(model, k=Q.QuantConfig(bits=4), v=Q.QuantConfig(bits=4), diagnostics=diag)
    return model, diag


def test_perplexity_windows_equal_the_exact_path_and_nonfinite_keys_still_raise() -> None:
    from rope_quant.scoring.evaluate import perplexity, window_nll_sum

    model, diag = _quantised_tiny()
    stream = torch.randint(0, 96, (96,), generator=torch.Generator().manual_seed(0))
    res = perplexity(model, stream, 32, progress=False)
    lazy = diag.summary()
    diag.reset()
    with torch.inference_mode(), deferred.exact_checks():
        exact = [float(window_nll_sum(model, stream[w * 32:(w + 1) * 32])) / 31 for w in range(3)]
    assert list(res.window_nll) == exact  # the same floats
    direct = diag.summary()
    for key in ("k_range_mean", "k_range_max", "delta_mean", "k_rel_err", "n_groups"):
        assert lazy[key] == pytest.approx(direct[key], rel=1e-12), key
    calls = {"n": 0}

    def nan_in_second_window(_m, _i, out):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        return out * float("nan") if calls["n"] == 2 else out
    model.model.layers[1].self_attn.k_proj.register_forward_hook(nan_in_second_window)
    with pytest.raises(NonFiniteKeysError):
        perplexity(model, stream, 32, progress=False)

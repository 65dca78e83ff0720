"""Streaming K diagnostics after R3: range, quantiser step, relative K quantisation error."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rope_quant.calib.diagnostics import DiagnosticsError, KDiagnostics, NonFiniteKeysError
from rope_quant.core.hadamard import hadamard_transform
from rope_quant.quant.quantizers import fake_quant_per_token

SUMMARY_KEYS = ("k_range_mean", "k_range_max", "delta_mean", "k_rel_err")


def keys(seed: int, shape=(2, 3, 40, 64), outliers: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(shape, generator=g)
    if outliers:
        k[..., [3, 17, 40]] *= 25.0
    return k


def direct(k: torch.Tensor, bits: int, group_size: int, clip: float) -> dict[str, float]:
    """The definitions, computed in one shot."""
    d = k.shape[-1]
    gs = d if group_size == -1 else group_size
    grouped = k.double().reshape(-1, gs)
    rng = grouped.max(-1).values - grouped.min(-1).values
    assert bool((grouped.min(-1).values < 0).all() and (grouped.max(-1).values > 0).all())  # straddle 0
    q = fake_quant_per_token(k, bits, group_size, clip).double()
    return {
        "k_range_mean": float(rng.mean()),
        "k_range_max": float(rng.max()),
        "delta_mean": float((rng * clip / (2**bits - 1)).mean()),
        "k_rel_err": float(((k.double() - q) ** 2).sum() / (k.double() ** 2).sum()),
    }


@pytest.mark.parametrize(("bits", "group_size", "clip"), [(4, -1, 1.0), (3, 16, 0.9), (8, 32, 1.0)])
def test_summary_matches_the_definitions(bits, group_size, clip):
    k = keys(0)
    diag = KDiagnostics(bits, group_size, clip)
    diag.update(k)
    got = diag.summary()
    ref = direct(k, bits, group_size, clip)
    for key in SUMMARY_KEYS:
        assert got[key] == pytest.approx(ref[key], rel=1e-6), key
    assert got["n_groups"] == k.numel() // (64 if group_size == -1 else group_size)
    assert got["k_rel_err"] > 0


def test_streaming_equals_one_shot():
    layers = [keys(1), keys(2, outliers=True)]
    stream = KDiagnostics(4, 16, per_layer=True)
    for layer, k in enumerate(layers):
        for lo in range(0, 40, 9):  # chunks along the sequence
            stream.update(k[:, :, lo : lo + 9], layer=layer)
    one = KDiagnostics(4, 16)
    one.update(torch.cat([k.reshape(-1, 64) for k in layers]))
    s, o = stream.summary(), one.summary()
    for key in SUMMARY_KEYS:
        assert s[key] == pytest.approx(o[key], rel=1e-12), key
    assert s["n_groups"] == o["n_groups"]
    for layer, k in enumerate(layers):
        alone = KDiagnostics(4, 16)
        alone.update(k)
        for key in SUMMARY_KEYS:
            assert s["per_layer"][layer][key] == pytest.approx(alone.summary()[key], rel=1e-12), key
    merged = KDiagnostics(4, 16, per_layer=True)
    for layer, k in enumerate(layers):
        part = KDiagnostics(4, 16, per_layer=True)
        part.update(k, layer=layer)
        merged.merge(part)
    assert merged.summary()["k_rel_err"] == pytest.approx(s["k_rel_err"], rel=1e-12)


def test_relative_error_is_zero_at_16_bits():
    diag = KDiagnostics(16)
    diag.update(keys(3, outliers=True))
    assert diag.summary()["k_rel_err"] == 0.0
    four = KDiagnostics(4)
    four.update(keys(3, outliers=True))
    eight = KDiagnostics(8)
    eight.update(keys(3, outliers=True))
    assert four.summary()["k_rel_err"] > eight.summary()["k_rel_err"] > 0


def test_hadamard_lowers_range_and_error_for_outlier_channels():
    k = keys(4, outliers=True)
    raw, had = KDiagnostics(4), KDiagnostics(4)
    raw.update(k)
    had.update(hadamard_transform(k))
    r, h = raw.summary(), had.summary()
    assert h["k_range_mean"] < 0.5 * r["k_range_mean"]
    assert h["delta_mean"] < r["delta_mean"]
    assert h["k_rel_err"] < r["k_rel_err"]


def test_step_uses_the_quantiser_range_when_a_group_misses_zero():
    """The asymmetric quantiser's range contains 0: Δ = max·clip/(2^b - 1) here, while range = max - min."""
    diag = KDiagnostics(4, clip_ratio=0.5)
    diag.update(torch.tensor([[1.0, 2.0, 3.0, 5.0]]))
    s = diag.summary()
    assert s["k_range_mean"] == 4.0 and s["k_range_max"] == 4.0
    assert s["delta_mean"] == pytest.approx(5.0 * 0.5 / 15)


def test_bad_input():
    with pytest.raises(NonFiniteKeysError):
        KDiagnostics(4).update(torch.tensor([[1.0, math.nan]]))
    with pytest.raises(DiagnosticsError, match="group_size"):
        KDiagnostics(4, group_size=24).update(keys(0))
    with pytest.raises(DiagnosticsError):
        KDiagnostics(0)
    with pytest.raises(DiagnosticsError, match="layer"):
        KDiagnostics(4, per_layer=True).update(keys(0))
    empty = KDiagnostics(4).summary()
    assert empty["n_groups"] == 0 and np.isnan(empty["k_range_mean"])

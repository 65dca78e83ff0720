"""Angle estimation (paper §3, App. A.2): φ̂, φ*, branch-matched φ̂, and the grid objectives."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rope_quant.calib.errors import CalibrationError
from rope_quant.calib.objectives import (
    AngleEstimationError,
    GridEstimatorError,
    UnknownObjectiveError,
    angle_grid,
    estimate_angles,
    grid_estimators,
    grid_search,
    objective_scores,
)
from rope_quant.calib.stats import CalibrationStats
from rope_quant.core.angles import jacobi_angle, wrap_angle
from rope_quant.core.rope import NonDistinctFrequencyError

N_LAYERS, HQ, HK, D = 3, 9, 3, 64
K = D // 2
AVG_LEN = 2048
INV_FREQ = 1e5 ** (-2.0 * np.arange(K) / D)  # SmolLM2-like: rope_theta 1e5, head_dim 64


def synthetic_stats(seed: int = 0, n_tokens: int = 256, topk: int = 256) -> CalibrationStats:
    """Non-isotropic pairs: unequal, log-normal channel scales per (layer, pair), mild correlation."""
    rng = np.random.default_rng(seed)
    s = CalibrationStats(N_LAYERS, HQ, HK, D, topk=topk)
    for layer in range(N_LAYERS):
        scale = np.exp(rng.normal(scale=1.0, size=D))
        rho = rng.uniform(-0.4, 0.4, size=K)
        for stream, heads in (("q", HQ), ("k", HK)):
            z = rng.normal(size=(n_tokens, heads, D))
            z[:, :, K:] = rho * z[:, :, :K] + np.sqrt(1 - rho**2) * z[:, :, K:]
            x = z * scale + rng.normal(scale=0.5, size=D)
            s.update(layer, stream, x.reshape(n_tokens, heads * D))
    return s


def explicit_surrogate(cov, inv_freq, length):
    """(1/L) Σ_m R_m Σ R_mᵀ from explicit 2x2 matrices: returns (..., K, 2, 2)."""
    s11, s22, s12 = (np.asarray(v) for v in cov)
    sig = np.stack([np.stack([s11, s12], -1), np.stack([s12, s22], -1)], -2)
    ang = np.arange(length)[:, None] * inv_freq[None, :]
    c, s = np.cos(ang), np.sin(ang)
    R = np.stack([np.stack([c, -s], -1), np.stack([s, c], -1)], -2)  # (m, K, 2, 2)
    return np.einsum("mkij,...kjl,mkpl->...kip", R, sig, R) / length


def explicit_excess(cov, phi, inv_freq, length):
    """max diag(G(φ) Σ̃ G(φ)ᵀ) - (s11 + s22)/2 with explicit matrices."""
    sur = explicit_surrogate(cov, inv_freq, length)
    phi = np.broadcast_to(phi, sur.shape[:-2])
    c, s = np.cos(phi), np.sin(phi)
    G = np.stack([np.stack([c, -s], -1), np.stack([s, c], -1)], -2)
    out = G @ sur @ np.swapaxes(G, -1, -2)
    return np.maximum(out[..., 0, 0], out[..., 1, 1]) - (np.asarray(cov[0]) + np.asarray(cov[1])) / 2


@pytest.fixture(scope="module")
def stats():
    return synthetic_stats()


def test_phi_star_attains_the_analytic_minimum(stats):
    phi = estimate_angles(stats, inv_freq=INV_FREQ, average_length=AVG_LEN)
    assert phi.shape == (N_LAYERS, K)
    assert np.all(phi >= -math.pi / 4) and np.all(phi < math.pi / 4)
    cov = stats.pooled("rows")
    lam = (cov.s11 + cov.s22) / 2
    rel = explicit_excess(cov, phi, INV_FREQ, AVG_LEN) / lam
    assert rel.max() <= 5e-5
    assert rel.min() >= -1e-12  # λ̄ is a lower bound


def test_phi_hat_excess_is_half_abs_S_times_r(stats):
    cov = stats.pooled("rows")
    phi_hat = estimate_angles(stats)
    ang = 2 * np.arange(AVG_LEN)[:, None] * INV_FREQ
    S = np.sin(ang).mean(0)
    r = np.sqrt((cov.s11 - cov.s22) ** 2 + (2 * cov.s12) ** 2)
    np.testing.assert_allclose(
        explicit_excess(cov, phi_hat, INV_FREQ, AVG_LEN), 0.5 * np.abs(S) * r, rtol=1e-9, atol=1e-12
    )


def test_excess_ordering_identity_h2_phi_hat_phi_star(stats, rq_record):
    cov = stats.pooled("rows")
    lam = (cov.s11 + cov.s22) / 2
    rules = {
        "identity": np.zeros((N_LAYERS, K)),
        "H2": np.full((N_LAYERS, K), -math.pi / 4),  # the per-pair H2 has G(-π/4)'s output variances
        "phi_hat": estimate_angles(stats),
        "phi_hat_branch_matched": estimate_angles(stats, branch_matched=True),
        "phi_star": estimate_angles(stats, inv_freq=INV_FREQ, average_length=AVG_LEN),
    }
    mean = {
        name: float((explicit_excess(cov, phi, INV_FREQ, AVG_LEN) / lam).mean())
        for name, phi in rules.items()
    }
    for name, value in mean.items():
        rq_record(
            "synthetic excess per angle rule (relative to lambda_bar)", rule=name, mean_rel_excess=value
        )
    assert mean["identity"] > mean["H2"] > mean["phi_hat"] > mean["phi_star"]
    assert mean["phi_hat_branch_matched"] == pytest.approx(mean["phi_hat"], rel=1e-9)  # π/2-periodic


def test_branch_matched_is_wrapped_phi_hat(stats):
    phi_hat = estimate_angles(stats)
    bm = estimate_angles(stats, branch_matched=True, inv_freq=INV_FREQ, average_length=AVG_LEN)
    np.testing.assert_allclose(bm, wrap_angle(phi_hat), atol=0)
    assert np.all(bm >= -math.pi / 4) and np.all(bm < math.pi / 4)
    cov = stats.pooled("rows")
    np.testing.assert_allclose(phi_hat, jacobi_angle(*cov), atol=0)


def test_phi_star_from_a_module_buffer_equals_the_array(stats):
    rotary = torch.nn.Module()
    rotary.register_buffer("inv_freq", torch.tensor(INV_FREQ, dtype=torch.float64))
    a = estimate_angles(stats, inv_freq=rotary, average_length=AVG_LEN)
    b = estimate_angles(stats, inv_freq=INV_FREQ, average_length=AVG_LEN)
    np.testing.assert_array_equal(a, b)


def test_per_head_estimator_shapes_and_values(stats):
    phi = estimate_angles(stats, "per_head", inv_freq=INV_FREQ, average_length=AVG_LEN)
    assert phi.shape == (N_LAYERS, HK, K)
    cov = stats.pooled("per_head")
    lam = (cov.s11 + cov.s22) / 2
    assert (explicit_excess(cov, phi, INV_FREQ, AVG_LEN) / lam).max() <= 5e-5
    np.testing.assert_allclose(estimate_angles(stats, "per_head"), jacobi_angle(*cov), atol=0)
    for rule in ("k_only", "balanced"):
        assert estimate_angles(stats, rule).shape == (N_LAYERS, K)


# ----------------------------------------------------------------------------- grid objectives


def test_angle_grid():
    g = angle_grid(200)
    assert g.shape == (200,)
    assert g[0] > -math.pi / 4 and g[-1] == pytest.approx(math.pi / 4, abs=1e-15)
    assert 0.0 in g
    np.testing.assert_allclose(np.diff(g), math.pi / 400)


def test_objective_scores_match_their_definitions():
    rng = np.random.default_rng(1)
    cand = rng.normal(size=(50, 4, 2))
    phi = 0.3
    y1 = math.cos(phi) * cand[..., 0] - math.sin(phi) * cand[..., 1]
    y2 = math.sin(phi) * cand[..., 0] + math.cos(phi) * cand[..., 1]
    both = np.abs(np.concatenate([y1, y2]))
    np.testing.assert_allclose(objective_scores(cand, [phi], "linf")[0], both.max(0))
    np.testing.assert_allclose(
        objective_scores(cand, [phi], "l2max")[0], np.maximum((y1**2).mean(0), (y2**2).mean(0))
    )
    np.testing.assert_allclose(
        objective_scores(cand, [phi], "quantile", 0.99)[0], np.quantile(both, 0.99, axis=0)
    )


def outlier_stats(seed: int = 2, topk_streams: tuple[str, ...] = ("k",)) -> CalibrationStats:
    """K rows whose bulk covariance and whose heavy-tailed outliers point in different directions."""
    rng = np.random.default_rng(seed)
    s = CalibrationStats(2, 3, 3, 16, topk=64, topk_streams=topk_streams)
    for layer in range(2):
        for stream in ("q", "k"):
            z = rng.normal(size=(400, 3, 16)) * np.exp(rng.normal(size=16))
            spikes = rng.standard_t(2, size=(400, 3, 8))
            direction = rng.uniform(-math.pi, math.pi, size=8)
            z[:, :, :8] += np.cos(direction) * spikes
            z[:, :, 8:] += np.sin(direction) * spikes
            s.update(layer, stream, z.reshape(400, 48))
    return s


@pytest.mark.parametrize("objective", ["linf", "l2max", "quantile"])
def test_grid_angle_scores_no_worse_than_phi_hat_and_identity(objective):
    s = outlier_stats()
    phi = estimate_angles(s, "k_only", objective=objective)
    assert phi.shape == (2, 8)
    assert np.all(phi > -math.pi / 4) and np.all(phi <= math.pi / 4 + 1e-15)
    phi_hat = wrap_angle(estimate_angles(s))
    for layer in range(2):
        cand = s.candidates(layer)
        best = objective_scores(cand, phi[layer][None, :], objective)[0]
        at_zero = objective_scores(cand, np.zeros((1, 8)), objective)[0]
        at_hat = objective_scores(cand, phi_hat[layer][None, :], objective)[0]
        norm = np.sqrt((cand**2).sum(-1)).max(0)
        lipschitz = 2 * (norm**2) if objective == "l2max" else norm
        half_step = math.pi / 400 / 2
        assert np.all(best <= at_zero * (1 + 1e-12))  # 0 is on the grid
        assert np.all(best <= at_hat + lipschitz * half_step)
        grid_scores = objective_scores(cand, angle_grid(), objective)
        np.testing.assert_allclose(best, grid_scores.min(0), rtol=1e-12)
    assert np.mean(best < at_hat) > 0.5  # the outliers make φ̂ a poor choice for most pairs


def test_grid_objectives_reject_per_head_and_phase_arguments():
    s = outlier_stats()
    with pytest.raises(AngleEstimationError, match="per-head"):
        estimate_angles(s, "per_head", objective="linf")
    with pytest.raises(AngleEstimationError, match="variance"):
        estimate_angles(s, "k_only", objective="linf", inv_freq=INV_FREQ[:8], average_length=16)


def _grid_by_hand(rows_by_stream: dict[str, np.ndarray], streams: tuple[str, ...], topk: int,
                  objective: str) -> np.ndarray:
    """Grid angles of one layer from the top-k |a|+|b| rows of ``streams`` (rows (N, H, d) per stream)."""
    k = 8
    parts = [np.stack([x[..., :k], x[..., k:]], -1).reshape(-1, k, 2) for st, x in rows_by_stream.items()
             if st in streams]
    union = np.concatenate(parts)
    score = np.abs(union).sum(-1)
    idx = np.argsort(-score, axis=0, kind="stable")[:topk]
    return grid_search(np.take_along_axis(union, idx[:, :, None], axis=0), objective)


@pytest.mark.parametrize("objective", ["linf", "l2max", "quantile"])
@pytest.mark.parametrize("topk_streams, honoured", [(("k",), "k_only"), (("q", "k"), "rows"), (("q",), None)])
def test_grid_objectives_honour_exactly_the_estimator_their_candidates_pool(objective, topk_streams, honoured):
    """Accepted: the estimator pooling the candidate streams, scored on exactly those streams' top-k rows.
    Refused (GridEstimatorError, a CalibrationError): every other estimator, naming the valid ones."""
    rng = np.random.default_rng(7)
    s = CalibrationStats(1, 3, 3, 16, topk=32, topk_streams=topk_streams)
    rows = {"q": rng.standard_t(2, size=(120, 3, 16)) * np.exp(rng.normal(size=16)),
            "k": rng.standard_t(2, size=(120, 3, 16)) * np.exp(rng.normal(size=16))}
    for st, x in rows.items():
        s.update(0, st, x.reshape(120, 48))
    assert grid_estimators(s) == (() if honoured is None else (honoured,))
    if honoured is not None:
        phi = estimate_angles(s, honoured, objective=objective)
        np.testing.assert_array_equal(phi[0], _grid_by_hand(rows, topk_streams, 32, objective))
        # the candidates really differ by stream, so honouring the estimator changes the angles
        other = ("k",) if topk_streams == ("q", "k") else ("q", "k")
        assert not np.array_equal(phi[0], _grid_by_hand(rows, other, 32, objective))
    for est in ("rows", "k_only", "balanced", "per_head"):
        if est == honoured:
            continue
        with pytest.raises(GridEstimatorError, match=f"estimator '{est}'") as info:
            estimate_angles(s, est, objective=objective)
        assert isinstance(info.value, CalibrationError)
        assert f"valid estimators with a grid objective for these statistics: {list(grid_estimators(s))}" in str(
            info.value)
    with pytest.raises(UnknownObjectiveError):
        estimate_angles(s, objective="l1")


# ----------------------------------------------------------------------------- bad input / degenerate bands


def test_zero_variance_band_gets_the_identity_angle():
    s = CalibrationStats(1, 3, 3, 8, topk=16)
    rng = np.random.default_rng(0)
    for stream in ("q", "k"):
        x = rng.normal(size=(50, 3, 8)) * 3
        x[:, :, 1] = 0.7  # pair 1 is a constant band: (a, b) = (0.7, -2.0) on every row
        x[:, :, 5] = -2.0
        s.update(0, stream, x.reshape(50, 24))
    inv = 1e4 ** (-np.arange(4) / 4)
    for kwargs in (
        {},
        {"branch_matched": True},
        {"inv_freq": inv, "average_length": 64},
        {"objective": "linf", "estimator": "k_only"},
        {"objective": "l2max", "estimator": "k_only"},
        {"objective": "quantile", "estimator": "k_only"},
    ):
        phi = estimate_angles(s, **kwargs)
        assert phi[0, 1] == 0.0, kwargs
        assert np.any(phi[0] != 0.0), kwargs


def test_non_distinct_frequencies_are_rejected_when_phi_star_is_asked(stats):
    bad = INV_FREQ.copy()
    bad[5] = bad[4]
    with pytest.raises(NonDistinctFrequencyError):
        estimate_angles(stats, inv_freq=bad, average_length=AVG_LEN)
    with pytest.raises(AngleEstimationError, match="both"):
        estimate_angles(stats, inv_freq=INV_FREQ)
    with pytest.raises(AngleEstimationError, match="frequencies"):
        estimate_angles(stats, inv_freq=INV_FREQ[:10], average_length=AVG_LEN)

"""φ* verification (App. A.5 and J): artifacts, failure modes, and SmolLM2's own covariances."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
import torch

from rope_quant.calib.objectives import estimate_angles
from rope_quant.calib.stats import CalibrationStats, register_projection_hooks
from rope_quant.calib.verify import (
    CSV_COLUMNS,
    MissingArtifactError,
    VerificationShapeError,
    save_frequencies,
    verify_files,
    verify_phi_star,
    write_artifacts,
)
from rope_quant.core.rope import NonDistinctFrequencyError, find_inv_freq, phase_averages

N_LAYERS, HQ, HK, D = 2, 6, 2, 32
K = D // 2
AVG_LEN = 2048
INV_FREQ = 1e5 ** (-2.0 * np.arange(K) / D)


@pytest.fixture(scope="module")
def stats() -> CalibrationStats:
    rng = np.random.default_rng(7)
    s = CalibrationStats(N_LAYERS, HQ, HK, D, topk=0)
    for layer in range(N_LAYERS):
        scale = np.exp(rng.normal(size=D))
        for stream, heads in (("q", HQ), ("k", HK)):
            x = rng.normal(size=(300, heads, D)) * scale
            x[:, :, K:] += 0.3 * x[:, :, :K]
            s.update(layer, stream, (x + rng.normal(size=D)).reshape(300, heads * D))
    return s


@pytest.fixture(scope="module")
def phi_star(stats) -> np.ndarray:
    return estimate_angles(stats, inv_freq=INV_FREQ, average_length=AVG_LEN)


def read_csv(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def test_phi_star_is_verified_and_artifacts_are_written(stats, phi_star, tmp_path):
    result = verify_phi_star(phi_star, stats, INV_FREQ, AVG_LEN)
    assert result.verified
    csv_path, json_path = write_artifacts(result, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["phi_star_pairs.csv", "phi_star_summary.json"]
    rows = read_csv(csv_path)
    assert list(rows[0]) == list(CSV_COLUMNS)
    assert len(rows) == N_LAYERS * K
    for row in rows:
        vals = {k: float(v) for k, v in row.items()}
        assert vals["excess"] == pytest.approx(vals["minimax"] - vals["lambda_bar"], abs=1e-12)
        r = math.hypot(vals["s11"] - vals["s22"], 2 * vals["s12"])
        assert vals["excess_phi_hat"] == pytest.approx(0.5 * abs(vals["S"]) * r, rel=1e-8, abs=1e-12)
        assert vals["excess_identity"] >= vals["excess"] - 1e-12
    summary = json.loads(json_path.read_text())
    assert summary["phi_star_verified"] is True
    assert summary["tolerance"] == 5e-5
    assert summary["worst_excess"] <= 5e-5
    assert "relative" in summary["excess_measure"] and "lambda_bar" in summary["excess_measure"]
    assert summary["frequency_source"] == "given array"
    assert set(summary["comparison"]) == {"stored", "identity", "h2", "phi_hat"}
    assert (
        summary["comparison"]["identity"]["mean_rel_excess"]
        > summary["comparison"]["stored"]["mean_rel_excess"]
    )


def test_verifier_uses_raw_moment_covariances_and_matches_closed_forms(stats, phi_star):
    result = verify_phi_star(phi_star, stats, INV_FREQ, AVG_LEN)
    raw = stats.pooled_raw("rows")
    np.testing.assert_array_equal(result.arrays["s11"], raw.s11)
    C, S = phase_averages(INV_FREQ, AVG_LEN)  # closed form; the verifier sums positions directly
    np.testing.assert_allclose(result.arrays["C"][0], C, atol=1e-12)
    np.testing.assert_allclose(result.arrays["S"][0], S, atol=1e-12)
    assert result.summary["trace_check_max_abs"] < 1e-12


@pytest.mark.parametrize("perturb", ["offset", "phi_hat", "identity"])
def test_a_wrong_angle_is_not_verified(stats, phi_star, perturb, tmp_path):
    if perturb == "offset":
        wrong = phi_star.copy()
        wrong[1, 3] += 0.05
    elif perturb == "phi_hat":
        wrong = estimate_angles(stats)
    else:
        wrong = np.zeros_like(phi_star)
    result = verify_phi_star(wrong, stats, INV_FREQ, AVG_LEN)
    assert not result.verified
    _, json_path = write_artifacts(result, tmp_path)
    summary = json.loads(json_path.read_text())
    assert summary["phi_star_verified"] is False
    assert summary["worst_excess"] > 5e-5
    if perturb == "offset":
        assert summary["worst_location"] == {"layer": 1, "pair": 3}


def test_per_head_angles_get_a_head_column(stats, tmp_path):
    phi = estimate_angles(stats, "per_head", inv_freq=INV_FREQ, average_length=AVG_LEN)
    result = verify_phi_star(phi, stats, INV_FREQ, AVG_LEN, rule="per_head")
    assert result.verified
    csv_path, _ = write_artifacts(result, tmp_path, prefix="per_head")
    rows = read_csv(csv_path)
    assert list(rows[0])[:3] == ["layer", "head", "pair"]
    assert len(rows) == N_LAYERS * HK * K


def test_file_based_verification_and_missing_artifacts(stats, phi_star, tmp_path):
    angles_p = tmp_path / "angles.npy"
    np.save(angles_p, phi_star)
    stats_p = stats.save(tmp_path / "stats.npz")
    freq_p = save_frequencies(tmp_path / "inv_freq.json", INV_FREQ, "model.rotary_emb.inv_freq")
    out = tmp_path / "out"
    result = verify_files(angles_p, stats_p, freq_p, AVG_LEN, out)
    assert result.verified
    summary = json.loads((out / "phi_star_summary.json").read_text())
    assert summary["frequency_source"] == "model.rotary_emb.inv_freq"
    for which, args in (
        ("angles", (tmp_path / "no.npy", stats_p, freq_p)),
        ("calibration statistics", (angles_p, tmp_path / "no.npz", freq_p)),
        ("frequencies", (angles_p, stats_p, tmp_path / "no.json")),
    ):
        with pytest.raises(MissingArtifactError, match=f"{which} file"):
            verify_files(*args, AVG_LEN, tmp_path / "out2")
    assert not (tmp_path / "out2").exists()
    assert issubclass(MissingArtifactError, ValueError) and issubclass(
        MissingArtifactError, FileNotFoundError
    )


def test_bad_inputs(stats, phi_star):
    with pytest.raises(VerificationShapeError):
        verify_phi_star(phi_star[:, :-1], stats, INV_FREQ, AVG_LEN)
    with pytest.raises(VerificationShapeError):
        verify_phi_star(phi_star, stats, INV_FREQ[:-1], AVG_LEN)
    bad = INV_FREQ.copy()
    bad[2] = bad[1]
    with pytest.raises(NonDistinctFrequencyError):
        verify_phi_star(phi_star, stats, bad, AVG_LEN)


# ----------------------------------------------------------------------------- the embedded model


def _pydoc_ids(tokenizer, n_tokens: int) -> torch.Tensor:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics.values())[:40_000]
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
    assert ids.numel() >= n_tokens
    return ids[:n_tokens]


def test_phi_star_attains_lambda_bar_on_smollm2(embedded_model, rq_record, tmp_path):
    """φ* on SmolLM2's own pooled covariances (2×256 pydoc tokens) and its live inv_freq buffer."""
    model, tokenizer = embedded_model
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    stats = CalibrationStats(
        cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim
    )
    ids = _pydoc_ids(tokenizer, 512).reshape(2, 256)
    handles = register_projection_hooks(model, stats)
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    assert all(
        not proj._forward_hooks
        for layer in model.model.layers
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj)
    )
    assert np.all(stats.n_rows("q") == 512) and np.all(stats.n_rows("k") == 512)

    inv_freq, source = find_inv_freq(model, head_dim=head_dim)
    phi_star = estimate_angles(stats, inv_freq=model, average_length=AVG_LEN)
    result = verify_phi_star(phi_star, stats, model, AVG_LEN)
    _, json_path = write_artifacts(result, tmp_path)
    summary = json.loads(json_path.read_text())
    assert summary["phi_star_verified"] is True
    assert summary["worst_excess"] <= 5e-5
    assert source in summary["frequency_source"]
    np.testing.assert_allclose(result.arrays["theta"][0], inv_freq)

    rules = {
        "identity": np.zeros_like(phi_star),
        "H2": np.full_like(phi_star, -math.pi / 4),
        "phi_hat": estimate_angles(stats),
        "phi_hat_branch_matched": estimate_angles(stats, branch_matched=True),
        "phi_star": phi_star,
    }
    means = {}
    for name, phi in rules.items():
        res = verify_phi_star(phi, stats, inv_freq, AVG_LEN)
        rel = res.arrays["excess"] / res.arrays["lambda_bar"]
        means[name] = float(rel.mean())
        rq_record(
            "excess per angle rule (SmolLM2-135M, 2x256 pydoc tokens, L=2048, rows pooling)",
            rule=name,
            mean_rel_excess=f"{rel.mean():.3e}",
            max_rel_excess=f"{rel.max():.3e}",
            mean_abs_excess=f"{res.arrays['excess'].mean():.3e}",
            max_abs_excess=f"{res.arrays['excess'].max():.3e}",
            verified=res.verified,
        )
    assert means["phi_star"] < means["phi_hat"] < means["identity"]
    assert means["phi_star"] <= 5e-5

"""Beyond the paper: the K sample, the ``range`` objective (coordinate descent on the K quantiser's
tokenwise range), head-dependent angles, K-only φ* with a length-matched averaging window, and the
``beyond`` presets of ``rope-quant compare`` / ``long-context``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from rope_quant import cli
from rope_quant.calib.moments import CalibrationError, CalibrationShapeError
from rope_quant.calib.objectives import (
    AngleEstimationError,
    estimate_angles,
    fit_range_angles,
    mean_group_range,
)
from rope_quant.calib.stats import CalibrationStats
from rope_quant.core import transforms
from rope_quant.core.rope import NonDistinctFrequencyError, rope_matrix
from rope_quant.experiment.pipeline import PipelineError, RunConfig
from rope_quant.sweep import presets
from rope_quant.sweep.cells import pipeline_cell_fn
from rope_quant.sweep.loaded_models import ModelCache
from rope_quant.sweep.manifest import LongContextConfig, SweepError, config_from_dict
from tests._support import tiny_base

D, H_KV, H_Q = 16, 2, 6


def keys(n: int = 48, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Keys with a per-channel scale and offset (outlier channels, non-zero mean), positions, frequencies."""
    rng = np.random.default_rng(seed)
    scale = np.linspace(0.2, 3.0, D)
    rows = rng.standard_normal((n, H_KV, D)) * scale + np.linspace(-1.0, 2.0, D)
    positions = rng.integers(0, 400, n)
    inv_freq = 10000.0 ** (-np.arange(0, D, 2) / D)
    return rows, positions, inv_freq


# ----------------------------------------------------------------------------- K sample


def test_k_sample_keeps_true_rows_with_their_positions(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 40, H_KV * D))
    stats = CalibrationStats(2, H_Q, H_KV, D, sample_rows=50)
    stats.update(0, "k", x)
    stats.update(0, "q", rng.standard_normal((3, 40, H_Q * D)))  # Q rows are never sampled
    rows, positions = stats.k_sample(0)
    assert rows.shape == (50, H_KV, D) and positions.shape == (50,)
    assert positions.min() >= 0 and positions.max() < 40
    flat = x.reshape(120, H_KV, D).astype(np.float32)
    for row, pos in zip(rows, positions, strict=True):  # every kept row is an input row at its position
        hits = [i for i in range(pos, 120, 40) if np.array_equal(flat[i], row.astype(np.float32))]
        assert hits, pos
    with pytest.raises(CalibrationError, match="empty"):
        stats.k_sample(1)
    loaded = CalibrationStats.load(stats.save(tmp_path / "s.npz"))
    assert np.array_equal(loaded.k_sample(0)[0], rows) and np.array_equal(loaded.k_sample(0)[1], positions)
    merged = stats.copy().merge(CalibrationStats(2, H_Q, H_KV, D, sample_rows=50, sample_seed=7))
    assert np.array_equal(merged.k_sample(0)[0], rows)  # merging an empty sample changes nothing


def test_k_sample_is_uniform_over_positions():
    stats = CalibrationStats(1, 2, 1, 4, sample_rows=2000)
    for _ in range(10):
        stats.update(0, "k", np.ones((8, 100, 4)))
    _, positions = stats.k_sample(0)
    counts = np.bincount(positions // 25, minlength=4)  # 4 bins of 25 positions, 500 expected each
    assert counts.sum() == 2000 and np.all(np.abs(counts - 500) < 90), counts


def test_k_sample_errors():
    with pytest.raises(CalibrationError, match="sample_rows > 0"):
        CalibrationStats(1, 2, 1, 4).k_sample(0)
    with pytest.raises(CalibrationShapeError, match="sample_rows"):
        CalibrationStats(1, 2, 1, 4, sample_rows=-1)
    with pytest.raises(CalibrationShapeError, match="sequence axis"):
        CalibrationStats(1, 2, 1, 4, sample_rows=4).update(0, "k", np.ones(4))


# ----------------------------------------------------------------------------- range objective


@pytest.mark.parametrize("then_hadamard", [False, True])
@pytest.mark.parametrize("per_head", [False, True])
def test_range_fit_matches_the_dense_objective_and_never_increases(per_head, then_hadamard, rq_record):
    rows, positions, inv_freq = keys()
    fit = fit_range_angles(rows, positions, inv_freq, per_head=per_head, then_hadamard=then_hadamard)
    assert fit.angles.shape == ((H_KV, D // 2) if per_head else (D // 2,))
    assert np.all(fit.angles > -np.pi) and np.all(fit.angles <= np.pi)
    dense_fit = mean_group_range(rows, positions, inv_freq, fit.angles, then_hadamard)
    dense_zero = mean_group_range(rows, positions, inv_freq, np.zeros_like(fit.angles), then_hadamard)
    assert fit.trace[0] == pytest.approx(dense_zero, rel=1e-12)  # the fast path is the objective
    assert fit.trace[-1] == pytest.approx(dense_fit, rel=1e-12)
    assert all(b <= a + 1e-12 for a, b in zip(fit.trace, fit.trace[1:], strict=False))
    assert fit.trace[-1] < 0.97 * fit.trace[0]  # these keys have a lot of range to remove
    rq_record("range objective: coordinate descent on synthetic keys", per_head=per_head,
              then_hadamard=then_hadamard, start=fit.trace[0], end=fit.trace[-1])


def test_range_fit_from_phi_hat_is_no_worse_than_phi_hat():
    rows, positions, inv_freq = keys(seed=3)
    stats = CalibrationStats(1, H_Q, H_KV, D, sample_rows=0)
    stats.update(0, "k", rows.reshape(-1, H_KV * D))
    phi_hat = estimate_angles(stats, "k_only")[0]
    fit = fit_range_angles(rows, positions, inv_freq, init=phi_hat)
    assert fit.trace[0] == pytest.approx(mean_group_range(rows, positions, inv_freq, phi_hat), rel=1e-12)
    assert fit.trace[-1] <= fit.trace[0] + 1e-12


def test_per_head_range_from_the_shared_angles_is_no_worse():
    rows, positions, inv_freq = keys(seed=4)
    shared = fit_range_angles(rows, positions, inv_freq)
    per_head = fit_range_angles(rows, positions, inv_freq, per_head=True, init=np.tile(shared.angles, (H_KV, 1)))
    assert per_head.trace[0] == pytest.approx(shared.trace[-1], rel=1e-12)
    assert per_head.trace[-1] <= shared.trace[-1] + 1e-12


def test_one_pair_range_fit_finds_the_global_minimum():
    """d = 2 has one pair, so coordinate descent is a plain search: compare with a 20 000-point scan."""
    rng = np.random.default_rng(5)
    rows = rng.standard_normal((64, 1, 2)) * [0.3, 2.0] + [0.5, 1.0]
    positions = rng.integers(0, 50, 64)
    inv_freq = np.array([0.3])
    fit = fit_range_angles(rows, positions, inv_freq, grid_size=64, refine=16, sweeps=1)
    scan = np.linspace(-np.pi, np.pi, 20001)
    values = [mean_group_range(rows, positions, inv_freq, np.array([p])) for p in scan[::50]]
    coarse_best = scan[::50][int(np.argmin(values))]
    fine = np.linspace(coarse_best - 0.02, coarse_best + 0.02, 201)
    best = min(mean_group_range(rows, positions, inv_freq, np.array([p])) for p in fine)
    assert fit.trace[-1] <= best * (1 + 2e-3)


@pytest.mark.parametrize("per_head", [False, True])
def test_range_angles_give_valid_r3_maps(per_head):
    """Orthogonality, commutation with RoPE (pairwise only) and q·k preservation with GQA Q heads."""
    rows, positions, inv_freq = keys(seed=6)
    angles = fit_range_angles(rows, positions, inv_freq, per_head=per_head).angles
    rng = np.random.default_rng(0)
    q = torch.randn(1, H_Q, 5, D, dtype=torch.float64)
    k = torch.randn(1, H_KV, 5, D, dtype=torch.float64)
    k_rep = k.repeat_interleave(H_Q // H_KV, dim=1)
    for name in ("pairwise_only", "pairwise_plus_hadamard"):
        tr = transforms.build(name, D, angles=angles)
        for head in range(H_Q):
            m = tr.matrix(head, H_Q)
            assert np.allclose(m @ m.T, np.eye(D), atol=1e-12)
            rm = rope_matrix(inv_freq, int(rng.integers(1, 1000)))
            assert np.allclose(m @ rm, rm @ m, atol=1e-10) == tr.commutes_with_rope
        scores = tr.apply(q) @ tr.apply(k_rep).transpose(-1, -2)
        assert torch.allclose(scores, q @ k_rep.transpose(-1, -2), atol=1e-10)
        if per_head:  # a Q head uses its KV group's angles
            assert np.allclose(tr.matrix(H_Q - 1, H_Q), tr.matrix(H_KV - 1))


def test_range_objective_bad_input():
    rows, positions, inv_freq = keys()
    with pytest.raises(NonDistinctFrequencyError):
        fit_range_angles(rows, positions, np.full(D // 2, 0.5))
    with pytest.raises(AngleEstimationError, match="frequencies"):
        fit_range_angles(rows, positions, inv_freq[:-1])
    with pytest.raises(AngleEstimationError, match="positions"):
        fit_range_angles(rows, positions[:-1], inv_freq)
    with pytest.raises(AngleEstimationError, match="rows"):
        fit_range_angles(rows[:0], positions[:0], inv_freq)
    with pytest.raises(AngleEstimationError, match="init"):
        fit_range_angles(rows, positions, inv_freq, init=np.zeros((H_KV, D // 2)))  # shared fit, per-head init
    stats = CalibrationStats(1, H_Q, H_KV, D, sample_rows=8)
    stats.update(0, "k", rows.reshape(1, -1, H_KV * D))
    with pytest.raises(AngleEstimationError, match="inv_freq"):
        estimate_angles(stats, "k_only", "range")
    with pytest.raises(AngleEstimationError, match="variance"):
        estimate_angles(stats, "k_only", "range", inv_freq=inv_freq, average_length=64)
    with pytest.raises(AngleEstimationError, match="range"):
        estimate_angles(stats, "k_only", "variance", then_hadamard=True)
    with pytest.raises(CalibrationError, match="sample_rows"):
        estimate_angles(CalibrationStats(1, H_Q, H_KV, D), "k_only", "range", inv_freq=inv_freq)
    with pytest.raises(PipelineError, match="angle rule"):
        RunConfig.from_flat(r3="pairwise_only", objective="range", position_average=True)
    with pytest.raises(PipelineError, match="angle rule"):
        RunConfig.from_flat(r3="pairwise_only", objective="linf", estimator="k_only", angle="phi_hat_branch_matched")
    with pytest.raises(PipelineError, match="needs estimator 'k_only'"):  # grid objectives score K candidates
        RunConfig.from_flat(r3="pairwise_only", objective="quantile", estimator="rows")
    with pytest.raises(PipelineError, match="k_group"):
        RunConfig.from_flat(r3="pairwise_only", objective="range", k_group=32)


def test_estimate_angles_range_uses_every_layer_and_the_pooling_rule():
    rows, positions, inv_freq = keys(n=40)
    stats = CalibrationStats(2, H_Q, H_KV, D, sample_rows=40)
    for layer in range(2):
        stats.update(layer, "k", (rows * (1 + layer)).reshape(1, 40, H_KV * D))
    shared = estimate_angles(stats, "k_only", "range", inv_freq=inv_freq)
    per_head = estimate_angles(stats, "per_head", "range", inv_freq=inv_freq, then_hadamard=True)
    assert shared.shape == (2, D // 2) and per_head.shape == (2, H_KV, D // 2)
    r, p = stats.k_sample(1)
    expect = fit_range_angles(r, p, inv_freq, per_head=True, then_hadamard=True).angles
    assert np.array_equal(per_head[1], expect)


# ----------------------------------------------------------------------------- presets


def test_beyond_manifest_covers_every_variant_with_clean_fields():
    base = RunConfig.from_flat(estimator="balanced", objective="variance", position_average=True, average_length=99)
    manifest = presets.beyond_manifest(base, (0, 1))
    names = manifest.names()
    assert names[0] == "hadamard" and len(names) == 1 + 2 * len(presets.BEYOND_ANGLES)
    assert len(manifest) == 2 * len(names) and manifest.kind == "beyond"
    cells = {(n, c.seed): c for n, c in manifest}
    rh = cells[("pairwise_plus_hadamard-range_per_head", 1)]
    assert (rh.r3, rh.estimator, rh.objective, rh.position_average) == (
        "pairwise_plus_hadamard", "per_head", "range", False)
    star = cells[("pairwise_only-phi_star_k_only", 0)]
    assert (star.estimator, star.position_average, star.average_length, star.objective) == (
        "k_only", True, None, "variance")
    assert cells[("pairwise_only-rows", 0)].estimator == "rows"
    assert len({c.weight_key() for (_, s), c in cells.items() if s == 0}) == 1  # one model per seed


def test_beyond_long_context_manifest_has_the_matched_phi_star_cell():
    manifest = presets.beyond_long_context_manifest(RunConfig(), (0,), (1024, 2048))
    cells = dict(manifest.cells)
    matched = cells["pairwise_only-phi_star_k_only-matched"]
    fixed = cells["pairwise_only-phi_star_k_only"]
    assert matched.matched_average and not fixed.matched_average
    assert matched.run == fixed.run and matched.key() != fixed.key()
    again = config_from_dict(json.loads(json.dumps(matched.to_dict())))
    assert again == matched and again.key() == matched.key()
    with pytest.raises(SweepError, match="phi_star"):
        LongContextConfig(RunConfig(), (512,), matched_average=True)


def test_cli_compare_beyond_preset(tmp_path: Path, capsys):
    calls = []

    def fake(cfg):
        calls.append(cfg)
        if isinstance(cfg, LongContextConfig):
            return {"lengths": {str(L): {"ppl": 20.0 + cfg.seed} for L in cfg.lengths}, "k_range_mean": 1.0}
        bonus = {"hadamard": 0.0}.get(cfg.r3, 1.0) - (0.5 if cfg.objective == "range" else 0.0)
        return {"ppl": 20.0 + bonus + 0.1 * cfg.seed, "k_range_mean": 2.0, "k_rel_err": 0.1}

    out = tmp_path / "beyond"
    assert cli.main(["compare", "--configs", "beyond", "--seeds", "0,1", "--out", str(out), "--no-figures"],
                    cell_fn=fake) == 0
    assert len(calls) == 2 * (1 + 2 * len(presets.BEYOND_ANGLES))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["kind"] == "beyond"
    assert summary["paired"]["pairwise_only-range"]["mean"] == pytest.approx(0.5)
    assert summary["paired"]["pairwise_only-rows"]["mean"] == pytest.approx(1.0)
    printed = capsys.readouterr().out
    assert "Beyond the paper" in printed and "pairwise_plus_hadamard-range_per_head" in json.dumps(summary)
    from rope_quant.analysis import report

    written = report.write_report(out)
    assert any(f.endswith("figures/beyond.png") for f in written["files"])
    table = {r["config"]: r for r in report.beyond_table(written["summary"]).rows}
    assert table["pairwise_only-range"]["commutes"] is True
    assert table["pairwise_plus_hadamard-rows"]["commutes"] is False
    assert table["pairwise_only-phi_star_k_only"]["angles"] == "φ* (k_only)"
    assert table["pairwise_only-range_per_head"]["angles"] == "range (per_head)"
    assert table["pairwise_only-range"]["delta"] == pytest.approx(0.5)
    assert report.estimators_table(written["summary"]) is None  # the beyond table replaces it
    calls.clear()
    lc = tmp_path / "lc"
    assert cli.main(["long-context", "--configs", "beyond", "--seeds", "0", "--lengths", "64,128",
                     "--eval-corpora", "shakespeare", "--out", str(lc), "--no-figures"], cell_fn=fake) == 0
    assert sum(isinstance(c, LongContextConfig) and c.matched_average for c in calls) == 1
    assert len(calls) == len(presets.BEYOND_LONG) + 2


def test_cli_objective_flag_reaches_the_cells(tmp_path: Path):
    calls = []

    def fake(cfg):
        calls.append(cfg)
        return {"ppl": 10.0}

    assert cli.main(["compare", "--configs", "hadamard,pairwise_only", "--objective", "range",
                     "--estimator", "per_head", "--seeds", "0", "--out", str(tmp_path), "--no-figures"],
                    cell_fn=fake) == 0
    assert {(c.r3, c.objective, c.estimator) for c in calls} == {
        ("hadamard", "range", "per_head"), ("pairwise_only", "range", "per_head")}


# ----------------------------------------------------------------------------- real pipeline


def tiny_llama(embedded_model):
    return tiny_base(embedded_model, max_positions=1024)


def test_matched_phi_star_cell_equals_separate_phi_star_cells(embedded_model, tmp_path):
    """The matched cell at L is the φ* cell with average_length = L; range cells build and run."""
    from rope_quant.corpora import token_streams

    base = tiny_llama(embedded_model)
    corpus = token_streams.load_corpus("pydoc", base[1])
    run = RunConfig.from_flat(model="tiny", r3="pairwise_only", estimator="k_only", position_average=True,
                              weights="rtn", w_bits=4, seqlen=64, calib_windows=4, eval_windows=2)
    models = ModelCache()
    models.put("tiny", "cpu", base, {"pydoc": corpus})
    fn = pipeline_cell_fn(models=models)
    try:
        matched = fn(LongContextConfig(run, (64, 128), matched_average=True))
        for length in (64, 128):
            alone = fn(LongContextConfig(run.override(average_length=length), (length,)))
            assert matched["lengths"][str(length)]["ppl"] == pytest.approx(alone["lengths"][str(length)]["ppl"],
                                                                           rel=1e-6)
        fixed = fn(LongContextConfig(run, (128,)))  # average_length = seqlen = 64
        assert fixed["lengths"]["128"]["ppl"] != pytest.approx(matched["lengths"]["128"]["ppl"], rel=1e-9)
        for r3 in ("pairwise_only", "pairwise_plus_hadamard"):
            cfg = run.override(r3=r3, position_average=False, estimator="per_head", objective="range")
            res = fn(cfg)
            assert np.isfinite(res["ppl"]) and res["angles"]["shape"] == [2, 2, 8]
        had = fn(run.override(r3="hadamard", position_average=False, objective="range"))
        assert had["angles"]["max_abs"] == 0.0  # an angle-free R3 skips the fit
    finally:
        models.clear()


def test_estimators_command_with_the_range_objective(tmp_path: Path):
    calls = []

    def fake(cfg):
        calls.append(cfg)
        return {"ppl": 10.0}

    assert cli.main(["estimators", "--objective", "range", "--estimators", "k_only,per_head", "--phi-star",
                     "--seeds", "0", "--out", str(tmp_path), "--no-figures"], cell_fn=fake) == 0
    got = {(c.r3, c.estimator, c.objective, c.position_average) for c in calls}
    assert ("pairwise_only", "per_head", "range", False) in got
    assert ("pairwise_only", "rows", "variance", True) in got  # φ* stays a variance-objective angle
    assert cli.main(["run", "--config", "pairwise_only", "--objective", "range", "--phi-star",
                     "--out", str(tmp_path / "bad")], cell_fn=fake) == 2

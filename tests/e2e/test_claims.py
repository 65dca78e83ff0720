"""The paper's statements on the embedded model (SmolLM2-135M, CPU) that are not registry claims, through the
public API.

The paper's claims (C1–C8, App. F, the beyond-the-paper rows) are entries of the registry
(``rope_quant/claims/paper.py``), decided on every model, this one included, by
``tests/e2e/test_registry_claims.py`` through the engine. This module keeps what is not a paired claim over
cells: C4's K metrics and block endpoints, C5's closed forms (a brute-force check of φ*), C6's surrogate part,
and A.1's whip fit (C3's mean sign is the registry entry C3-mean). Each runs in the session's ``experiment``
(tests/e2e/conftest.py), sharing the registry claims' memoised cells, attaches its numbers with ``rq_claim`` (or
``rq_record``) and asserts.

Budget: see ``E2EBudget`` (3 seeds, 12 x 512 scored tokens per cell, 16 x 512 calibration tokens), on the paper's
pipeline (App. A.1, A.8): R1 fitted with whip, R2 at its random-Hadamard initialisation, R4 online Hadamard,
GPTQ weights, dynamic W4A4KV4.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from rope_quant.claims.paper import BLOCKS, PHI_STAR
from rope_quant.core import stats
from rope_quant.core.verdict import deterministic
from rope_quant.defaults import KEYS_ALONE


def _fmt(values) -> str:
    return "[" + ", ".join(f"{v:.3f}" for v in values) + "]"


def _ci_text(ci: stats.PairedCI) -> str:
    return f"{ci.mean:+.3f} (90% CI {ci.low:+.3f}, {ci.high:+.3f}; n={ci.n})"


def _support_rows(experiment, seed: int) -> dict[str, dict]:
    """C4's cells at one seed, on the paper's W4A4KV4 configuration, scored on ``support_windows`` windows."""
    w = dict(eval_windows=experiment.budget.support_windows)
    rows = {f"b={b}": experiment.cell(seed, r3="block_hadamard", r3_block=b, **w) for b in BLOCKS}
    rows["hadamard"] = experiment.cell(seed, r3="hadamard", **w)
    rows["pair_h2"] = experiment.cell(seed, r3="pair_h2", **w)
    return rows


def _support_series(experiment, rq_record) -> dict[str, list[list[float]]]:
    """Per seed: K range, K error and ppl gap to hadamard for b = 2 … d_h (Table M on W4A4KV4)."""
    out: dict[str, list[list[float]]] = {"range": [], "error": [], "gap": []}
    for seed in experiment.budget.seeds:
        rows = _support_rows(experiment, seed)
        had_ppl = rows["hadamard"]["ppl"]
        for b in BLOCKS:
            r = rows[f"b={b}"]
            rq_record("Table M: mixing support (W4A4KV4)", seed=seed, b=b, k_range_mean=r["k_range_mean"],
                      k_rel_err=r["k_rel_err"], ppl=r["ppl"], gap_vs_hadamard=r["ppl"] - had_ppl)
        out["range"].append([rows[f"b={b}"]["k_range_mean"] for b in BLOCKS])
        out["error"].append([rows[f"b={b}"]["k_rel_err"] for b in BLOCKS])
        out["gap"].append([rows[f"b={b}"]["ppl"] - had_ppl for b in BLOCKS])
    return out


def _seed_mean(series: list[list[float]]) -> list[float]:
    return [float(v) for v in np.mean(np.asarray(series), axis=0)]


def _non_increasing(x: list[float]) -> bool:
    return all(x[i + 1] <= x[i] for i in range(len(x) - 1))


def test_c4_k_range_and_error_non_increasing_in_block_size(experiment, rq_claim, rq_record) -> None:
    """C4 (Table M): K range and relative K error are non-increasing in block size b (2 … d_h), in every
    seed, on the paper's W4A4KV4 configuration (whip R1, GPTQ)."""
    series = _support_series(experiment, rq_record)
    holds = all(_non_increasing(s) for s in series["range"]) and all(_non_increasing(s) for s in series["error"])
    rq_claim("C4 (Table M) K range / K error vs b=2…64, W4A4KV4", "non-increasing in b, every seed",
             f"seed-mean range {_fmt(_seed_mean(series['range']))}; "
             f"err {_fmt([e * 100 for e in _seed_mean(series['error'])])}%", verdict=deterministic(holds),
             ranges=series["range"], errors=series["error"])
    assert holds, series


#: b = d_h against the full Hadamard, relative perplexity, on 4-bit keys alone (W16A16K4V16), where the cause is
#: measured (2026-11-23, 2bbd27c): b = d_h is P·H with P the swap inside each rotate_half pair; its 4-bit K codes equal
#: the Hadamard's, and with 16-bit keys the perplexities agree to 8e-8. With 4-bit keys any ulp-level difference
#: (the kernel, the q·k summation order that P changes, even a 6e-8 relative jitter) flips a first K code a few
#: layers down and the flips spread to ~5% of the codes: eight variants that are all exactly H in exact
#: arithmetic scored 13.215–13.280 (sd 0.155%; a difference of two has sd 0.22%; largest spread 0.49%). 1% is
#: ~4.5 sd. Under W4A4KV4 the activation quantisers add more rounding decisions for the same noise to flip, so
#: there the endpoint is asserted on the K metrics and its perplexity difference is recorded.
C4_ENDPOINT_PPL_TOL = 1e-2


def test_c4_block_endpoints_match(experiment, rq_claim) -> None:
    """C4 (Table M): b = 2 matches pair_h2 and b = d_h matches hadamard.

    b = 2 is the same matrix as pair_h2 and matches to rounding (every seed, W4A4KV4). b = d_h is the full
    Hadamard followed by an output permutation: K metrics agree to 5e-3 (every seed, W4A4KV4), and perplexity
    within :data:`C4_ENDPOINT_PPL_TOL` on 4-bit keys alone (seed 0, 12 windows), the float-order noise that
    4-bit K rounding amplifies (measured cause in the constant's comment).
    """
    b2 = k64 = p64_w4 = 0.0  # K metrics under W4A4KV4 move with upstream code flips: 5.0e-4 / 1.3e-3 measured
    for seed in experiment.budget.seeds:
        rows = _support_rows(experiment, seed)

        def rel(a: str, b: str, metric: str, rows=rows) -> float:
            return abs(rows[a][metric] - rows[b][metric]) / abs(rows[b][metric])

        b2 = max(b2, *(rel("b=2", "pair_h2", m) for m in ("k_range_mean", "k_rel_err", "ppl")))
        k64 = max(k64, *(rel("b=64", "hadamard", m) for m in ("k_range_mean", "k_rel_err")))
        p64_w4 = max(p64_w4, rel("b=64", "hadamard", "ppl"))
    k_only_64 = experiment.cell(0, r3="block_hadamard", r3_block=64, **KEYS_ALONE)["ppl"]
    k_only_had = experiment.cell(0, r3="hadamard", **KEYS_ALONE)["ppl"]
    p64 = abs(k_only_64 - k_only_had) / k_only_had
    holds = b2 <= 1e-6 and k64 <= 5e-3 and p64 <= C4_ENDPOINT_PPL_TOL
    rq_claim("C4 (Table M) endpoints b=2 ≡ pair_h2, b=d_h ≡ hadamard",
             f"b=2: 1e-6; b=64: K metrics 5e-3 (W4A4KV4), ppl {C4_ENDPOINT_PPL_TOL:.0e} (4-bit keys alone)",
             f"b=2 {b2:.1e}; b=64 K {k64:.1e}, ppl {p64:.1e} (K-only; W4A4KV4 worst seed {p64_w4:.1e})",
             verdict=deterministic(holds),
             b2=b2, k64=k64, p64=p64, p64_w4a4kv4=p64_w4)
    assert holds


def _excess_table(experiment) -> dict[str, Any]:
    """Relative excess over λ̄ per angle rule, on the embedded model's own calibration statistics (App. J)."""
    from rope_quant.calib.stats import CalibrationStats
    from rope_quant.core import angles, rope
    from rope_quant.experiment.pipeline import build_quantized_model

    cfg = experiment.config(0, **PHI_STAR)
    qm = build_quantized_model(cfg, cache_dir=experiment.cache_dir, base=experiment.base)
    assert isinstance(qm.stats, CalibrationStats)
    cov = qm.stats.pooled("rows")
    inv_freq, _ = rope.find_inv_freq(qm.model)
    c, s = rope.phase_averages(inv_freq, cfg.seqlen)
    lam = angles.analytic_minimum(cov)
    phi_hat = angles.jacobi_angle(cov.s11, cov.s22, cov.s12)
    rules = {"identity": np.zeros_like(cov.s11), "H2": np.full_like(cov.s11, np.pi / 4),
             "phi_hat": phi_hat, "phi_hat_branch_matched": angles.wrap_angle(phi_hat), "phi_star": qm.angles}
    return {"excess": {name: angles.minimax_excess(cov, phi, c, s) / lam for name, phi in rules.items()},
            "cov": cov, "inv_freq": np.asarray(inv_freq, dtype=np.float64), "length": cfg.seqlen,
            "phi_star": np.asarray(qm.angles), "lam": lam}


def test_c5_phi_star_attains_minimum_and_excess_ordering(experiment, rq_claim, rq_record) -> None:
    """C5 (App. J): φ* attains the minimum of the position-averaged objective, checked by an independent
    brute-force minimisation over a fine angle grid (not the closed forms that compute φ*), and the excess
    ordering is identity > H2 > φ̂ > φ*."""
    from rope_quant.calib.verify import brute_force_phi_star, position_averaged_minimax

    table = _excess_table(experiment)
    ex = table["excess"]
    for name, e in ex.items():
        rq_record("App. J: relative excess over λ̄ (rows pooling, L=seqlen)", rule=name,
                  mean=float(e.mean()), max=float(e.max()))
    cov, layers = table["cov"], range(0, table["phi_star"].shape[0], 5)
    worst = 0.0
    for layer in layers:  # every 5th layer: 6 layers x 32 pairs, each minimised by brute force
        args = (cov.s11[layer], cov.s22[layer], cov.s12[layer], table["inv_freq"], table["length"])
        bf = brute_force_phi_star(*args)
        closed = position_averaged_minimax(*args, table["phi_star"][layer])
        worst = max(worst, float(np.max((closed - bf.objective) / np.abs(bf.objective))))
    means = {k: float(v.mean()) for k, v in ex.items()}
    attained = worst <= 1e-6
    ordering = means["identity"] > means["H2"] > means["phi_hat"] > means["phi_star"]
    rq_claim("C5 (App. J) φ* attains the minimum (brute force); excess identity > H2 > φ̂ > φ*",
             "objective(φ*) ≤ brute-force minimum · (1 + 1e-6); ordering",
             "mean excess " + ", ".join(f"{k} {v:.3e}" for k, v in means.items() if k != "phi_hat_branch_matched")
             + f"; φ* vs brute force {worst:+.1e} (relative)", verdict=deterministic(attained and ordering),
             worst=worst, **means)
    assert attained, f"φ* is above the brute-force minimum by {worst:.2e} (relative)"
    assert ordering, means


def test_c6_phi_star_has_the_lower_surrogate_excess(experiment, rq_record) -> None:
    """C6 (§5, App. J), its surrogate part beside the registry row (which decides the perplexity part): φ* has a
    lower position-averaged objective than the branch-matched φ̂ control on seed 0's calibration statistics (a
    closed form, identical on every machine)."""
    ex = _excess_table(experiment)["excess"]
    star, control = float(ex["phi_star"].mean()), float(ex["phi_hat_branch_matched"].mean())
    rq_record("C6: surrogate excess over λ̄ (seed 0)", phi_star=star, phi_hat_branch_matched=control)
    assert star < control, (star, control)


def test_whip_r1_lowers_its_loss(experiment, rq_claim) -> None:
    """A.1: R1 is a fitted whip rotation (not its random-Hadamard initialisation): the fit lowers the whip
    loss on its calibration samples in every seed. The cell records carry the loss before and after."""
    fits = [experiment.cell(seed, r3="hadamard")["rotation_fit"] for seed in experiment.budget.seeds]
    init, fit = [f["loss_init"] for f in fits], [f["loss_fit"] for f in fits]
    holds = all(f["kind"] == "whip" and f["steps"] > 0 for f in fits) and all(
        b < a for a, b in zip(init, fit, strict=True))
    rq_claim("A.1 whip R1 fit", "whip loss after the fit < at its random-Hadamard init, every seed",
             f"loss {_fmt(init)} -> {_fmt(fit)}; steps {[f['steps'] for f in fits]}", verdict=deterministic(holds),
             init=init, fit=fit)
    assert holds, fits


@pytest.mark.slow
def test_whip_r1_against_random_hadamard_r1(experiment, rq_claim) -> None:
    """Measured, not a claim of the paper: W4A4KV4 perplexity (hadamard R3) with whip R1 against QuaRot's
    random-Hadamard R1, 3 seeds, paired. Asserted: both build and score (finite perplexities)."""
    whip = experiment.per_seed(r3="hadamard")
    rand = experiment.per_seed(r3="hadamard", r1="random_hadamard")
    ci = stats.paired_ci(whip, rand)
    rq_claim("Measured: whip R1 vs random-Hadamard R1 (W4A4KV4, hadamard R3)", "recorded (no claim)",
             f"whip {_fmt(whip)} vs random_hadamard {_fmt(rand)}; diff {_ci_text(ci)}", None,
             whip=whip, random_hadamard=rand)
    assert all(np.isfinite(whip)) and all(np.isfinite(rand))

"""The paper's claims on the embedded model (SmolLM2-135M, CPU), through the public API.

Each test names its claim (table or section), runs the paired experiment through ``tests/e2e/conftest.py``'s
session ``experiment`` (``pipeline.run_cell``), attaches the measured numbers with ``rq_claim`` and asserts.
The plugin prints the claims table at the end of the session (``--rq-claims-out DIR`` writes it).

Budget: see ``E2EBudget`` (3 seeds, 12 x 512 scored tokens per cell, 16 x 512 calibration tokens).
"""

from __future__ import annotations

import numpy as np
import pytest

from rope_quant.core import stats

W4A4KV4 = {}  # the RunConfig defaults: W4A4KV4, GPTQ weights, R1/R2 random Hadamard, online R4
K_ONLY = dict(w_bits=16, a_bits=16, k_bits=4, v_bits=16, weights="none", r1="none", r2="none", r4=False)


def _fmt(values) -> str:
    return "[" + ", ".join(f"{v:.3f}" for v in values) + "]"


def _ci_text(ci: stats.PairedCI) -> str:
    return f"{ci.mean:+.3f} (90% CI {ci.low:+.3f}, {ci.high:+.3f}; n={ci.n})"


def equivalence_margin(hadamard_ppl: list[float]) -> float:
    """C2's margin: 0.6% of the Hadamard perplexity.

    The paper's ±0.05 PPL margin sits on WikiText-2 perplexities of about 6–9 for its Llama/Mistral
    checkpoints, i.e. roughly 0.6–0.8% of the comparator. The embedded model under W4A4KV4 sits near 20 PPL
    on pydoc windows, so the same relative tolerance is about ±0.12 PPL. A paired difference of two variants
    that share weights, rotations and windows is far less noisy than either perplexity, which is why a
    relative margin of this size is still a strict test at 12 x 512 scored tokens per cell.
    """
    return 0.006 * float(np.mean(hadamard_ppl))


def test_c1_pairwise_only_worse_than_hadamard(experiment, rq_claim) -> None:
    """C1 (Table 1): pairwise_only has higher perplexity than hadamard in every seed, under W4A4KV4."""
    had = experiment.per_seed(r3="hadamard")
    pw = experiment.per_seed(r3="pairwise_only")
    ci = stats.paired_ci(pw, had)
    holds = all(p > h for p, h in zip(pw, had, strict=True))
    rq_claim("C1 (Table 1) pairwise_only vs hadamard, W4A4KV4", "ppl(pairwise_only) > ppl(hadamard) every seed",
             f"pw {_fmt(pw)} vs had {_fmt(had)}; diff {_ci_text(ci)}", holds, pairwise_only=pw, hadamard=had)
    assert holds, f"pairwise_only {pw} not above hadamard {had} in every seed"


@pytest.mark.xfail(
    reason="measured 2026-11-22 on CPU, 3 seeds x 12x512 tokens, 2 threads (the CI setting): pph [23.720, "
    "23.636, 23.387] vs hadamard [22.982, 23.968, 23.164], diff +0.210 with 90% CI (-0.694, +1.113), wider than "
    "the ±0.140 margin (1 thread: diff +0.041, CI -0.792, +0.874): centred near zero but equivalence is not "
    "resolvable at this token budget (seed-to-seed spread of the paired difference ~0.5 PPL); gpu_e2e checks "
    "it at the paper's protocol sizes",
    strict=True)
def test_c2_pairwise_plus_hadamard_equivalent_to_hadamard(experiment, rq_claim) -> None:
    """C2 (Table 1, TOST): pairwise_plus_hadamard − hadamard has its paired 90% CI inside the margin."""
    had = experiment.per_seed(r3="hadamard")
    pph = experiment.per_seed(r3="pairwise_plus_hadamard")
    ci = stats.paired_ci(pph, had)
    margin = equivalence_margin(had)
    holds = stats.equivalent(ci, margin)
    rq_claim("C2 (Table 1, TOST) pairwise+hadamard ≡ hadamard", f"90% CI within ±{margin:.3f} PPL",
             f"diff {_ci_text(ci)}", holds, margin=margin, pairwise_plus_hadamard=pph, hadamard=had)
    assert holds, f"paired CI ({ci.low:.4f}, {ci.high:.4f}) not inside ±{margin:.4f}"


def test_c3_k_only_estimator_beats_rows(experiment, rq_claim) -> None:
    """C3 (estimators, App. L): pairwise_only with the k_only estimator has lower perplexity than with rows."""
    rows = experiment.per_seed(r3="pairwise_only", estimator="rows")
    k_only = experiment.per_seed(r3="pairwise_only", estimator="k_only")
    ci = stats.paired_ci(k_only, rows)
    holds = ci.mean < 0
    rq_claim("C3 (App. L) k_only vs rows estimator", "mean ppl(k_only) − ppl(rows) < 0",
             f"k_only {_fmt(k_only)} vs rows {_fmt(rows)}; diff {_ci_text(ci)}", holds, k_only=k_only, rows=rows)
    assert holds


BLOCKS = (2, 4, 8, 16, 32, 64)


def _support_rows(experiment) -> dict[str, dict]:
    rows = {f"b={b}": experiment.cell(0, r3="block_hadamard", r3_block=b, **K_ONLY) for b in BLOCKS}
    rows["hadamard"] = experiment.cell(0, r3="hadamard", **K_ONLY)
    rows["pair_h2"] = experiment.cell(0, r3="pair_h2", **K_ONLY)
    return rows


def _support_series(experiment, rq_record) -> dict[str, list[float]]:
    rows = _support_rows(experiment)
    had_ppl = rows["hadamard"]["ppl"]
    for b in BLOCKS:
        r = rows[f"b={b}"]
        rq_record("Table M: mixing support (K-only, seed 0)", b=b, k_range_mean=r["k_range_mean"],
                  k_rel_err=r["k_rel_err"], ppl=r["ppl"], gap_vs_hadamard=r["ppl"] - had_ppl)
    return {"range": [rows[f"b={b}"]["k_range_mean"] for b in BLOCKS],
            "error": [rows[f"b={b}"]["k_rel_err"] for b in BLOCKS],
            "gap": [rows[f"b={b}"]["ppl"] - had_ppl for b in BLOCKS]}


def _non_increasing(x: list[float]) -> bool:
    return all(x[i + 1] <= x[i] for i in range(len(x) - 1))


def test_c4_k_range_and_error_non_increasing_in_block_size(experiment, rq_claim, rq_record) -> None:
    """C4 (Table M): K range and relative K error are non-increasing in block size b (2 … d_h).

    Measured under 4-bit keys only (W16A16K4V16): R1/R2/R4 leave the keys unchanged (k = W_K·x is invariant
    under the residual rotation), so this isolates R3's mixing support from weight/activation noise.
    """
    series = _support_series(experiment, rq_record)
    holds = _non_increasing(series["range"]) and _non_increasing(series["error"])
    rq_claim("C4 (Table M) K range / K error vs b=2…64", "non-increasing in b",
             f"range {_fmt(series['range'])}; err {_fmt([e * 100 for e in series['error']])}%", holds,
             ranges=series["range"], errors=series["error"])
    assert holds, series


@pytest.mark.xfail(
    reason="measured 2026-11-22, K-only 4-bit keys, seed 0, 12x512 pydoc tokens: gap vs hadamard for "
    "b=2,4,8,16,32,64 = [1.389, 0.930, 0.326, 0.159, 0.174, -0.037]: non-increasing except b=16 -> 32 "
    "(+0.015 PPL), inside the evaluation noise at this token budget",
    strict=True)
def test_c4_perplexity_gap_non_increasing_in_block_size(experiment, rq_claim, rq_record) -> None:
    """C4 (Table M): the perplexity gap to hadamard is non-increasing in block size b."""
    gaps = _support_series(experiment, rq_record)["gap"]
    holds = _non_increasing(gaps)
    rq_claim("C4 (Table M) ppl gap vs b=2…64", "non-increasing in b", f"gap {_fmt(gaps)}", holds, gaps=gaps)
    assert holds, gaps


def test_c4_block_endpoints_match(experiment, rq_claim) -> None:
    """C4 (Table M): b = 2 matches pair_h2 and b = d_h matches hadamard.

    b = 2 is the same matrix as pair_h2 and matches to rounding. b = d_h equals the full Hadamard up to an
    output-side permutation (a swap inside each pair), so K range and K error agree to float rounding
    (measured: 3.8e-5 and 9.3e-5 relative); the perplexities differ by 0.28% (13.263 vs 13.301, measured),
    presumably through 4-bit rounding decisions flipped by the different float paths (block Kronecker form
    vs FWHT) — not investigated further, so the perplexity tolerance is 1%.
    """
    rows = _support_rows(experiment)

    def rel(a: str, b: str, metric: str) -> float:
        return abs(rows[a][metric] - rows[b][metric]) / abs(rows[b][metric])

    b2 = max(rel("b=2", "pair_h2", m) for m in ("k_range_mean", "k_rel_err", "ppl"))
    k64 = max(rel("b=64", "hadamard", m) for m in ("k_range_mean", "k_rel_err"))
    p64 = rel("b=64", "hadamard", "ppl")
    holds = b2 <= 1e-6 and k64 <= 1e-3 and p64 <= 1e-2
    rq_claim("C4 (Table M) endpoints b=2 ≡ pair_h2, b=d_h ≡ hadamard",
             "b=2: 1e-6; b=64: K metrics 1e-3, ppl 1e-2 (relative)",
             f"b=2 {b2:.1e}; b=64 K {k64:.1e}, ppl {p64:.1e}", holds, b2=b2, k64=k64, p64=p64)
    assert holds


def _excess_table(experiment) -> dict[str, np.ndarray]:
    """Relative excess over λ̄ per angle rule, on the embedded model's own calibration statistics (App. J)."""
    from rope_quant.calib.moments import CalibrationStats
    from rope_quant.core import angles, rope
    from rope_quant.experiment.pipeline import build_quantized_model

    cfg = experiment.config(0, r3="pairwise_only", position_average=True, **K_ONLY)
    qm = build_quantized_model(cfg, cache_dir=experiment.cache_dir, base=experiment.base)
    assert isinstance(qm.stats, CalibrationStats)
    cov = qm.stats.pooled("rows")
    inv_freq, _ = rope.find_inv_freq(qm.model)
    c, s = rope.phase_averages(inv_freq, cfg.seqlen)
    lam = angles.analytic_minimum(cov)
    rules = {"identity": np.zeros_like(cov.s11), "H2": np.full_like(cov.s11, np.pi / 4),
             "phi_hat": angles.jacobi_angle(cov.s11, cov.s22, cov.s12), "phi_star": qm.angles}
    return {name: angles.minimax_excess(cov, phi, c, s) / lam for name, phi in rules.items()}


def test_c5_phi_star_attains_minimum_and_excess_ordering(experiment, rq_claim, rq_record) -> None:
    """C5 (App. J): φ* attains λ̄ (excess ≤ 5e-5) and the excess ordering is identity > H2 > φ̂ > φ*."""
    ex = _excess_table(experiment)
    for name, e in ex.items():
        rq_record("App. J: relative excess over λ̄ (rows pooling, L=seqlen)", rule=name,
                  mean=float(e.mean()), max=float(e.max()))
    means = {k: float(v.mean()) for k, v in ex.items()}
    attained = float(ex["phi_star"].max()) <= 5e-5
    ordering = means["identity"] > means["H2"] > means["phi_hat"] > means["phi_star"]
    rq_claim("C5 (App. J) φ* attains λ̄; excess identity > H2 > φ̂ > φ*", "max excess(φ*) ≤ 5e-5; ordering",
             "mean excess " + ", ".join(f"{k} {v:.3e}" for k, v in means.items())
             + f"; max φ* {float(ex['phi_star'].max()):.1e}", attained and ordering, **means)
    assert attained
    assert ordering, means


# How far C6's decision statistic (the upper end of the 90% CI of ppl(φ*) − ppl(φ̂)) moved between runs of the
# same code: 2 threads -0.149 vs 1 thread -0.354 (one machine, 2026-11-22) and -0.149 vs +0.847 between two
# 2-core machines (Intel-class vs AMD EPYC, GPTQ's floating-point order; issue 11 §0). A verdict is decided only
# when the statistic sits farther than this from its boundary (0); otherwise it is "inconclusive at this budget".
C6_CROSS_MACHINE_SPREAD = 1.0


def c6_ppl_verdict(ci: stats.PairedCI, spread: float = C6_CROSS_MACHINE_SPREAD) -> bool | None:
    """The paper's "no perplexity gain from φ*" as a three-way verdict at this budget.

    True: no significant gain even if the CI moved by ``spread`` (ci.high ≥ spread); False: a gain beyond the
    spread (ci.high < −spread); None: inconclusive (the CI's upper end is within ``spread`` of 0).
    """
    if ci.high >= spread:
        return True
    if ci.high < -spread:
        return False
    return None


def test_c6_verdict_rule_can_decide_both_ways() -> None:
    def ci(low: float, high: float) -> stats.PairedCI:
        return stats.PairedCI(n=3, mean=(low + high) / 2, sd=0.1, low=low, high=high, level=0.9)

    assert c6_ppl_verdict(ci(0.5, 2.5)) is True
    assert c6_ppl_verdict(ci(-4.0, -2.0)) is False
    assert c6_ppl_verdict(ci(-0.685, -0.149)) is None  # the 2026-11-22 measurement
    assert c6_ppl_verdict(ci(-2.032, 0.847)) is None  # the AMD EPYC measurement


def test_c6_objective_mismatch(experiment, rq_claim) -> None:
    """C6 (§5): φ* has the lower surrogate objective than φ̂, but does not beat φ̂ in perplexity.

    The surrogate part is robust (closed form, identical on every machine) and is asserted. The perplexity
    part is decided only outside the measured cross-machine spread (:data:`C6_CROSS_MACHINE_SPREAD`); a
    decided gain of φ* fails the test, an undecided one is reported as inconclusive with its interval.
    """
    ex = _excess_table(experiment)
    phi_hat = experiment.per_seed(r3="pairwise_only")
    phi_star = experiment.per_seed(r3="pairwise_only", position_average=True)
    ci = stats.paired_ci(phi_star, phi_hat)
    lower_objective = float(ex["phi_star"].mean()) < float(ex["phi_hat"].mean())
    no_ppl_gain = c6_ppl_verdict(ci)
    holds = None if no_ppl_gain is None else (lower_objective and no_ppl_gain)
    rq_claim("C6 (§5) objective mismatch: φ* vs φ̂",
             f"lower surrogate excess (asserted); no ppl gain, decided beyond ±{C6_CROSS_MACHINE_SPREAD} PPL",
             f"excess {float(ex['phi_star'].mean()):.1e} vs {float(ex['phi_hat'].mean()):.1e}; "
             f"ppl diff {_ci_text(ci)}", holds if lower_objective else False, phi_star=phi_star, phi_hat=phi_hat)
    assert lower_objective
    assert no_ppl_gain is not False, f"φ* beats φ̂ beyond the cross-machine spread: {ci}"


def test_c7_long_context_gap_positive(experiment, rq_claim, rq_record, e2e_budget) -> None:
    """C7 (long context, App. A.4): the pairwise_only − hadamard gap is positive at every evaluated L."""
    had = experiment.long_context(0, r3="hadamard")
    pw = experiment.long_context(0, r3="pairwise_only")
    gaps = {}
    for length in e2e_budget.long_lengths:
        h, p = had[length], pw[length]
        assert not isinstance(h, dict) and not isinstance(p, dict), f"L={length} failed: {h} / {p}"
        gaps[length] = p.ppl - h.ppl
        rq_record("Long context (W4A4KV4, shakespeare, seed 0)", L=length, hadamard=h.ppl, pairwise_only=p.ppl,
                  gap=gaps[length], n_windows=h.n_windows, n_tokens=h.n_tokens)
    holds = all(g > 0 for g in gaps.values())
    rq_claim("C7 (long context) gap pairwise_only − hadamard", "> 0 at every L up to 8192",
             ", ".join(f"L={k}: {v:+.3f}" for k, v in gaps.items()), holds, **{str(k): v for k, v in gaps.items()})
    assert holds


def test_c8_k_diagnostics_favour_hadamard(experiment, rq_claim) -> None:
    """C8 (Table E): K range and relative K error are lower under hadamard than pairwise_only, every seed."""
    rng_h, rng_p = experiment.per_seed("k_range_mean", r3="hadamard"), experiment.per_seed(
        "k_range_mean", r3="pairwise_only")
    err_h, err_p = experiment.per_seed("k_rel_err", r3="hadamard"), experiment.per_seed(
        "k_rel_err", r3="pairwise_only")
    holds = all(h < p for h, p in zip(rng_h, rng_p, strict=True)) and all(
        h < p for h, p in zip(err_h, err_p, strict=True))
    rq_claim("C8 (Table E) K range / K error", "hadamard < pairwise_only every seed",
             f"range {_fmt(rng_h)} vs {_fmt(rng_p)}; err {_fmt(err_h)} vs {_fmt(err_p)}", holds)
    assert holds

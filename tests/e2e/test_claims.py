"""The paper's claims on the embedded model (SmolLM2-135M, CPU), through the public API.

Each test names its claim (table or section), runs the paired experiment through ``tests/e2e/conftest.py``'s
session ``experiment`` (``pipeline.run_cell``), attaches the measured numbers with ``rq_claim`` and asserts.
The plugin prints the claims table at the end of the session (``--rq-claims-out=DIR`` writes it).

Budget: see ``E2EBudget`` (3 seeds, 12 x 512 scored tokens per cell, 16 x 512 calibration tokens). Every
claim runs on the paper's pipeline (App. A.1, A.8): R1 fitted with whip, R2 at its random-Hadamard
initialisation, R4 online Hadamard, GPTQ weights, dynamic W4A4KV4.

**Verdicts.** Every claim is decided by the one rule of :mod:`rope_quant.core.verdict` (holds, fails,
inconclusive with the budget to decide at 80% power, refuted; docs/verdicts.md): the union of the paired
interval over the seeds and its float-order replicate interval. The float-order noise and bias are measured by
the run itself: the first ``--rq-replicates`` seeds rebuilt with GPTQ in the other float mode
(``Experiment.replicate_pairs``, one GPTQ build per replicated seed shared by every claim family). A test fails
on fails or refuted, never on inconclusive, and still asserts each claim's robust part.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from rope_quant.core import stats
from rope_quant.core.verdict import Form, Verdict, combine_all, deterministic, equivalence_margin

W4A4KV4 = {}  # the RunConfig defaults: W4A4KV4, GPTQ weights, R1 whip, R2 random Hadamard, online R4
PHI_STAR = dict(r3="pairwise_only", angle="phi_star")
PHI_HAT_BM = dict(r3="pairwise_only", angle="phi_hat_branch_matched")

def _fmt(values) -> str:
    return "[" + ", ".join(f"{v:.3f}" for v in values) + "]"


def _ci_text(ci: stats.PairedCI) -> str:
    return f"{ci.mean:+.3f} (90% CI {ci.low:+.3f}, {ci.high:+.3f}; n={ci.n})"


def _verdict_ci(v: Verdict) -> str:
    if v.low is None or v.high is None:
        return f"{v.mean:+.3f} (n={v.n})" if v.mean is not None else f"n={v.n}"
    return f"{v.mean:+.3f} ({v.ci_name} {v.low:+.3f}, {v.high:+.3f}; n={v.n})"


def _spread_text(v: Verdict) -> str:
    return v.float_order.text() if v.float_order is not None else "float order: –"


def test_c1_pairwise_only_worse_than_hadamard(experiment, rq_claim) -> None:
    """C1 (Table 1): pairwise_only has higher perplexity than hadamard in every seed, under W4A4KV4 (a
    criterion without sampling error: holds or fails)."""
    had = experiment.per_seed(r3="hadamard")
    pw = experiment.per_seed(r3="pairwise_only")
    ci = stats.paired_ci(pw, had) if len(had) > 1 else None
    holds = all(p > h for p, h in zip(pw, had, strict=True))
    verdict = deterministic(holds)
    rq_claim("C1 (Table 1) pairwise_only vs hadamard, W4A4KV4", "ppl(pairwise_only) > ppl(hadamard) every seed",
             f"pw {_fmt(pw)} vs had {_fmt(had)}" + (f"; diff {_ci_text(ci)}" if ci else ""), verdict=verdict,
             pairwise_only=pw, hadamard=had, stat=min(p - h for p, h in zip(pw, had, strict=True)))
    assert holds, f"pairwise_only {pw} not above hadamard {had} in every seed"


def _c2(experiment) -> tuple[Verdict, Verdict, Any, dict[str, Any]]:
    """C2 at the experiment's seeds: (combined verdict, the equivalence part, the margin, the numbers)."""
    had = experiment.per_seed(r3="hadamard")
    pph = experiment.per_seed(r3="pairwise_plus_hadamard")
    pw = experiment.per_seed(r3="pairwise_only")
    margin = equivalence_margin(float(np.mean(had)))
    equiv = experiment.paired_claim(Form.EQUIVALENT, pph, had, margin=margin.value, tokens=experiment.tokens(),
                                    replicates=experiment.replicate_pairs({"r3": "pairwise_plus_hadamard"},
                                                                          {"r3": "hadamard"}))
    mean, c1_gap = float(np.mean(pph) - np.mean(had)), float(np.mean(pw) - np.mean(had))
    robust = abs(mean) < 0.25 * c1_gap
    verdict = combine_all([deterministic(robust, "robust part: |mean| >= C1 gap/4"), equiv])
    return verdict, equiv, margin, dict(had=had, pph=pph, mean=mean, c1_gap=c1_gap, robust=robust)


def test_c2_pairwise_plus_hadamard_equivalent_to_hadamard(experiment, rq_claim) -> None:
    """C2 (Table 1, TOST): the paired 90% CI of pairwise_plus_hadamard − hadamard lies inside the margin
    (:func:`rope_quant.core.verdict.equivalence_margin`: the paper's ±0.05 PPL scaled by the ppl ratio).

    Decided by the rule with the run's float-order replicates; the robust part is asserted: the pairwise+Hadamard
    mean sits near the Hadamard's, far closer than pairwise_only's (less than a quarter of C1's gap). With
    ``--rq-until-decided`` seeds are added (every one replicated) while the equivalence is inconclusive, under
    the sequential rule (``Experiment.decided``).
    """
    (verdict, equiv, margin, x), _ = experiment.decided(_c2, "C2")
    rq_claim("C2 (Table 1, TOST) pairwise+hadamard ≡ hadamard",
             f"{equiv.ci_name} within ±{margin.value:.3f} PPL ({margin.basis}); robust part: |mean| < C1 gap/4",
             f"diff {_verdict_ci(equiv)}; C1 gap {x['c1_gap']:+.3f}; {_spread_text(equiv)}", verdict=verdict,
             margin=margin.value, margin_basis=margin.basis,
             pairwise_plus_hadamard=x["pph"], hadamard=x["had"], noise=equiv.noise, mean=x["mean"])
    assert x["robust"], f"pairwise+hadamard mean diff {x['mean']:+.3f} not small against C1's gap {x['c1_gap']:+.3f}"
    assert not verdict.failed, verdict.text()


def _c3(experiment) -> tuple[Verdict, list[float], list[float]]:
    rows = experiment.per_seed(r3="pairwise_only", estimator="rows")
    k_only = experiment.per_seed(r3="pairwise_only", estimator="k_only")
    verdict = experiment.paired_claim(Form.LESS, k_only, rows, tokens=experiment.tokens(),
                                      replicates=experiment.replicate_pairs({"estimator": "k_only"},
                                                                            {"estimator": "rows"}, r3="pairwise_only"))
    return verdict, k_only, rows


def test_c3_k_only_estimator_beats_rows(experiment, rq_claim) -> None:
    """C3 (App. L): the unadjusted paired 90% interval of ppl(k_only) − ppl(rows) lies below zero (the rule's
    LESS form, with the run's float-order replicates); the mean's sign is asserted."""
    (verdict, k_only, rows), _ = experiment.decided(_c3, "C3")
    mean = float(np.mean(k_only) - np.mean(rows))
    rq_claim("C3 (App. L) k_only vs rows estimator", f"{verdict.ci_name} of ppl(k_only) − ppl(rows) below 0",
             f"k_only {_fmt(k_only)} vs rows {_fmt(rows)}; diff {_verdict_ci(verdict)}; {_spread_text(verdict)}",
             verdict=verdict, k_only=k_only, rows=rows, noise=verdict.noise)
    assert mean < 0, f"k_only does not improve on rows on average: {mean:+.3f}"
    assert not verdict.failed, verdict.text()


BLOCKS = (2, 4, 8, 16, 32, 64)


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


def _support_ppl(rows: dict[str, dict]) -> list[float]:
    return [rows[f"b={b}"]["ppl"] for b in BLOCKS]


def _c4_ppl(experiment) -> tuple[Verdict, list[Verdict], list[float], Any]:
    """C4's perplexity steps at the experiment's seeds: (combined verdict, the steps, the mean gaps, the margin)."""
    gaps = _seed_mean(_support_series(experiment, lambda *_, **__: None)["gap"])
    seeds = experiment.budget.seeds
    ppl = [_support_ppl(_support_rows(experiment, seed)) for seed in seeds]
    w = dict(eval_windows=experiment.budget.support_windows)
    margin = equivalence_margin(float(np.mean([experiment.cell(seed, r3="hadamard", **w)["ppl"] for seed in seeds])))
    parts = [experiment.paired_claim(Form.NON_SUPERIOR, [p[i + 1] for p in ppl], [p[i] for p in ppl],
                                     margin=margin.value, tokens=experiment.tokens(experiment.budget.support_windows),
                                     replicates=experiment.replicate_pairs({"r3_block": BLOCKS[i + 1]},
                                                                           {"r3_block": BLOCKS[i]},
                                                                           r3="block_hadamard", **w),
                                     parts=len(BLOCKS) - 1)
             for i in range(len(BLOCKS) - 1)]
    robust = gaps[0] > gaps[-1]
    verdict = combine_all([deterministic(robust, "robust part: gap(b=2) <= gap(b=d_h)"), *parts])
    return verdict, parts, gaps, margin


def test_c4_perplexity_gap_non_increasing_in_block_size(experiment, rq_claim, rq_record) -> None:
    """C4 (Table M): the perplexity gap to hadamard is non-increasing in block size b.

    Each step b → 2b is a paired comparison ppl(2b) − ppl(b) over the seeds, read in the rule's NON_SUPERIOR
    form: no rise larger than C2's equivalence margin (a rise that small is "no rise" by the paper's own
    tolerance). The steps combine (holds if every step holds); each step has its own float-order replicates.
    The robust part is asserted: the gap at b = 2 exceeds the gap at b = d_h.
    """
    (verdict, parts, gaps, margin), at = experiment.decided(_c4_ppl, "C4 ppl")
    _support_series(at, rq_record)  # the table at the seeds the claim used (memoised cells)
    robust = gaps[0] > gaps[-1]
    worst_rise = max(gaps[i + 1] - gaps[i] for i in range(len(gaps) - 1))
    rq_claim("C4 (Table M) ppl gap vs b=2…64, W4A4KV4",
             f"no step b → 2b raises ppl by more than ±{margin.value:.3f} ({margin.basis}); robust: gap(2) > gap(64)",
             f"gap {_fmt(gaps)}; largest rise {worst_rise:+.3f}; steps "
             + ", ".join(f"{_verdict_ci(v)} [{_spread_text(v)}]" for v in parts),
             verdict=verdict, parts={f"b={BLOCKS[i]}→{BLOCKS[i + 1]}": v for i, v in enumerate(parts)}, gaps=gaps,
             noise=[v.noise for v in parts], margin=margin.value)
    assert robust, gaps
    assert not verdict.failed, verdict.text()


#: b = d_h against the full Hadamard, relative perplexity, on 4-bit keys alone (W16A16K4V16), where the cause is
#: measured (2026-11-23, 2bbd27c): b = d_h is P·H with P the swap inside each rotate_half pair; its 4-bit K codes equal
#: the Hadamard's, and with 16-bit keys the perplexities agree to 8e-8. With 4-bit keys any ulp-level difference
#: (the kernel, the q·k summation order that P changes, even a 6e-8 relative jitter) flips a first K code a few
#: layers down and the flips spread to ~5% of the codes: eight variants that are all exactly H in exact
#: arithmetic scored 13.215–13.280 (sd 0.155%; a difference of two has sd 0.22%; largest spread 0.49%). 1% is
#: ~4.5 sd. Under W4A4KV4 the activation quantisers add more rounding decisions for the same noise to flip, so
#: there the endpoint is asserted on the K metrics and its perplexity difference is recorded.
C4_ENDPOINT_PPL_TOL = 1e-2
K_ONLY = dict(w_bits=16, a_bits=16, k_bits=4, v_bits=16, weights="none", r1="identity", r2="identity", r4=False)


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
    k_only_64 = experiment.cell(0, r3="block_hadamard", r3_block=64, **K_ONLY)["ppl"]
    k_only_had = experiment.cell(0, r3="hadamard", **K_ONLY)["ppl"]
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


#: C6 and C7 run in the ``slow`` subset: both are decided under the sequential rule (C6 not resolvable within 40
#: seeds, C7 holds at 9; docs/runs/decided-epyc-2threads.json), and their 24 cells (≈ 6 min of the 2-core
#: machine's 24-min e2e layer) kept the default run over CI's 40-minute budget (docs/measurements.md).
@pytest.mark.slow
def test_c6_objective_mismatch(experiment, rq_claim) -> None:
    """C6 (§5, App. J): φ* has a lower surrogate objective than the branch-matched φ̂ control, but does not
    beat it in perplexity.

    The control is φ̂ on φ*'s branch [−π/4, π/4), as in the paper, so the comparison isolates the
    finite-phase correction from the branch shift. The surrogate part is robust (closed form, identical on
    every machine: holds or fails). "No perplexity gain" is the rule's NON_INFERIOR form with C2's
    equivalence margin: a gain, if any, smaller than the paper's tolerance for "equivalent".
    """
    ex = _excess_table(experiment)["excess"]
    lower_objective = float(ex["phi_star"].mean()) < float(ex["phi_hat_branch_matched"].mean())

    def evaluate(exp):
        control = exp.per_seed(**PHI_HAT_BM)
        phi_star = exp.per_seed(**PHI_STAR)
        margin = equivalence_margin(float(np.mean(control)))
        ppl_part = exp.paired_claim(Form.NON_INFERIOR, phi_star, control, margin=margin.value, tokens=exp.tokens(),
                                    replicates=exp.replicate_pairs(PHI_STAR, PHI_HAT_BM))
        return (combine_all([deterministic(lower_objective, "surrogate part"), ppl_part]), ppl_part, margin,
                control, phi_star)

    (verdict, ppl_part, margin, control, phi_star), _ = experiment.decided(evaluate, "C6")
    rq_claim("C6 (§5) objective mismatch: φ* vs branch-matched φ̂",
             f"lower surrogate excess (asserted); no ppl gain beyond −{margin.value:.3f} PPL ({margin.basis})",
             f"excess {float(ex['phi_star'].mean()):.1e} vs {float(ex['phi_hat_branch_matched'].mean()):.1e}; "
             f"ppl diff {_verdict_ci(ppl_part)}; {_spread_text(ppl_part)}", verdict=verdict, phi_star=phi_star,
             phi_hat_branch_matched=control, noise=ppl_part.noise, margin=margin.value)
    assert lower_objective
    assert not verdict.failed, verdict.text()


def _long_gaps(experiment, rq_record, lengths: tuple[int, ...], table: str) -> dict[int, Verdict]:
    """Per length: the rule's GREATER form on pairwise_only − hadamard, with the float-order replicates."""
    per_seed: dict[int, tuple[list[float], list[float]]] = {length: ([], []) for length in lengths}
    for seed in experiment.budget.seeds:
        had = experiment.long_context(seed, lengths, r3="hadamard")
        pw = experiment.long_context(seed, lengths, r3="pairwise_only")
        for length in lengths:
            h, p = had[length], pw[length]
            assert not isinstance(h, dict) and not isinstance(p, dict), f"L={length} failed: {h} / {p}"
            per_seed[length][0].append(p.ppl)
            per_seed[length][1].append(h.ppl)
            rq_record(table, seed=seed, L=length, hadamard=h.ppl, pairwise_only=p.ppl, gap=p.ppl - h.ppl,
                      n_windows=h.n_windows, n_tokens=h.n_tokens)
    rep_had = experiment.replicate_long_context(lengths, r3="hadamard")
    rep_pw = experiment.replicate_long_context(lengths, r3="pairwise_only")

    def replicates(length: int) -> dict[int, tuple[float, float]] | str:
        if isinstance(rep_had, str) or isinstance(rep_pw, str):
            return rep_had if isinstance(rep_had, str) else str(rep_pw)
        bad = [r[length] for r in (*rep_had.values(), *rep_pw.values()) if isinstance(r[length], dict)]
        if bad:
            return f"a replicate failed at L={length}: {bad[0]}"
        return {i: (rep_pw[i][length].ppl, rep_had[i][length].ppl) for i in rep_had}

    return {length: experiment.paired_claim(Form.GREATER, pw_ppl, had_ppl,
                                            tokens=experiment.budget.long_windows * length,
                                            replicates=replicates(length), parts=len(per_seed))
            for length, (pw_ppl, had_ppl) in per_seed.items()}


def _long_claim(experiment, rq_record, lengths: tuple[int, ...], table: str, name: str) -> dict[int, Verdict]:
    """:func:`_long_gaps` until decided (``--rq-until-decided``), then its table at the seeds used (a stop on the
    time budget carried to every part still open)."""
    def evaluate(exp):
        parts = _long_gaps(exp, lambda *_, **__: None, lengths, table)
        robust = all(v.mean is not None and v.mean > 0 for v in parts.values())
        return combine_all([deterministic(robust, "robust part: mean gap > 0 at every L"), *parts.values()]), parts

    (verdict, _), at = experiment.decided(evaluate, name)
    parts = _long_gaps(at, rq_record, lengths, table)
    if verdict.stop.startswith("time budget"):
        parts = {k: v if v.decided or v.stop else replace(v, stop=verdict.stop) for k, v in parts.items()}
    return parts


def _c7_claim(parts: dict[int, Verdict], rq_claim, what: str) -> None:
    robust = all(v.mean is not None and v.mean > 0 for v in parts.values())
    verdict = combine_all([deterministic(robust, "robust part: mean gap > 0 at every L"), *parts.values()])
    level = next(iter(parts.values())).ci_name
    rq_claim(what, f"paired {level} of pairwise_only − hadamard above 0 at every L",
             "; ".join(f"L={k}: {_verdict_ci(v)}, {_spread_text(v)}" for k, v in parts.items()), verdict=verdict,
             parts={f"L={k}": v for k, v in parts.items()}, **{str(k): v.mean for k, v in parts.items()},
             noise={str(k): v.noise for k, v in parts.items()})
    assert robust, {k: v.mean for k, v in parts.items()}
    assert not verdict.failed, verdict.text()


@pytest.mark.slow
def test_c7_long_context_gap_positive(experiment, rq_claim, rq_record, e2e_budget) -> None:
    """C7 (long context, App. A.4): the pairwise_only − hadamard gap is positive at every evaluated L, with a
    paired interval over the seeds at every length (the mean gap's sign is asserted; the interval decides)."""
    parts = _long_claim(experiment, rq_record, e2e_budget.long_lengths, "Long context (W4A4KV4, shakespeare)", "C7")
    _c7_claim(parts, rq_claim, "C7 (long context) gap pairwise_only − hadamard")


@pytest.mark.slow
def test_c7_long_context_gap_positive_at_8k(experiment, rq_claim, rq_record, e2e_budget) -> None:
    """C7 at the model's full context (``slow``): the same claim at ``slow_long_lengths``."""
    parts = _long_claim(experiment, rq_record, e2e_budget.slow_long_lengths, "Long context 8K (W4A4KV4, shakespeare)",
                        "C7 8K")
    _c7_claim(parts, rq_claim, "C7 (long context, 8K) gap pairwise_only − hadamard")


def test_c8_k_diagnostics_favour_hadamard(experiment, rq_claim) -> None:
    """C8 (Table E): K range and relative K error are lower under hadamard than pairwise_only, every seed."""
    rng_h, rng_p = experiment.per_seed("k_range_mean", r3="hadamard"), experiment.per_seed(
        "k_range_mean", r3="pairwise_only")
    err_h, err_p = experiment.per_seed("k_rel_err", r3="hadamard"), experiment.per_seed(
        "k_rel_err", r3="pairwise_only")
    holds = all(h < p for h, p in zip(rng_h, rng_p, strict=True)) and all(
        h < p for h, p in zip(err_h, err_p, strict=True))
    rq_claim("C8 (Table E) K range / K error", "hadamard < pairwise_only every seed",
             f"range {_fmt(rng_h)} vs {_fmt(rng_p)}; err {_fmt(err_h)} vs {_fmt(err_p)}", verdict=deterministic(holds))
    assert holds


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

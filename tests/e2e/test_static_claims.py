"""The static control (App. D, A.6): under the static joint control (scope ``both``) the dynamic ordering does
not hold at the shortest length: pairwise_only − hadamard ≤ 0 (the paper: −5.60 PPL at 2K).

The cells are the e2e session's (``tests/e2e/conftest.py``: GPTQ weights, whip R1, 16 × 512 calibration tokens,
3 seeds, shared cache): each seed's hadamard model is built, its static scales estimated transductively (A.6)
from the first :data:`STATIC_WINDOWS` non-overlapping 512-token windows of the evaluation split, frozen, and the
first :data:`STATIC_EVAL_WINDOWS` windows scored; then R3 is switched to pairwise_only on the same weights
(``reconfigure``) and the scales are re-estimated for it. The shortest length on CPU is the session's 512
(the paper's is 2048). Marked ``slow``: it adds 2 × 3 static evaluations (8 × 512 tokens each) to the session.

Measured 2026-11-24 (1 thread, ``--rq-seeds 0,1,2``, GPTQ weights cached): static both, L = 512, hadamard /
pairwise_only: seed 0 42.766 / 40.452 (gap −2.313), seed 1 41.699 / 41.745 (+0.046), seed 2 50.746 / 44.113
(−6.633); mean −2.967 (90% CI −8.677, +2.743; n = 3): the paper's sign in seeds 0 and 2, a tie in seed 1.

Verdict: the rule of :mod:`rope_quant.core.verdict` in its LESS form, with the session's float-order replicates
(the first ``--rq-replicates`` seeds with GPTQ in the other float mode, static scales re-estimated on them).
"""

from __future__ import annotations

from typing import Any

import pytest

from rope_quant.core.verdict import Form

#: Estimation windows per length (A.6: up to 64; CPU budget) and scored windows per cell (the session's short-
#: context cells score 12): the cell records name the deviation.
STATIC_WINDOWS = 4
STATIC_EVAL_WINDOWS = 4


def _static_cells(experiment, scope: str = "both", replicate: bool = False) -> dict[str, list[dict]]:
    """Per seed, the static-cell results of hadamard and pairwise_only at the session's seqlen (memoised per
    seed, so a claim given more seeds computes only the new ones); ``replicate``: the replicated seeds only, with
    GPTQ in the other float mode (the numerical replicates)."""
    from rope_quant.experiment.pipeline import build_quantized_model
    from rope_quant.sweep.static import StaticConfig, evaluate_static_cell

    b = experiment.budget
    seeds = tuple(experiment.replicate_seeds) if replicate else b.seeds
    extra = experiment._replicate_overrides({}) if replicate else {}
    out: dict[str, list[dict]] = {"hadamard": [], "pairwise_only": []}
    for seed in seeds:
        key = ("static", scope, STATIC_WINDOWS, STATIC_EVAL_WINDOWS, b.seqlen, seed, replicate)

        def compute(seed: int = seed) -> dict[str, dict]:
            qm = build_quantized_model(experiment.config(seed, r3="hadamard", eval_windows=STATIC_EVAL_WINDOWS,
                                                         **extra),
                                       cache_dir=experiment.cache_dir,
                                       base=experiment.base)
            done: dict[str, dict] = {}
            for r3 in out:
                qm.reconfigure(experiment.config(seed, r3=r3, eval_windows=STATIC_EVAL_WINDOWS, **extra))
                cell = StaticConfig(qm.cfg, (b.seqlen,), scope, max_windows=STATIC_WINDOWS)
                done[r3] = evaluate_static_cell(cell, qm)
                print(f"static {scope} seed {seed} {r3}: ppl {done[r3]['lengths'][str(b.seqlen)]['ppl']:.3f}",
                      flush=True)  # the measurement as it lands (the session's output with -s)
            del qm
            return done

        done = experiment.memo(key, compute)
        for r3 in out:
            out[r3].append(done[r3])
    return out


def _static_gap(experiment) -> tuple[Any, dict[str, list[dict]], list[float], list[float]]:
    """App. D's gap at the experiment's seeds: (the verdict, the cells, hadamard's and pairwise_only's ppl)."""
    b = experiment.budget
    cells = _static_cells(experiment, "both")
    length = str(b.seqlen)
    had = [c["lengths"][length]["ppl"] for c in cells["hadamard"]]
    pw = [c["lengths"][length]["ppl"] for c in cells["pairwise_only"]]
    reps: dict[int, tuple[float, float]] | str
    try:
        rep = _static_cells(experiment, "both", replicate=True)
        reps = {i: (p["lengths"][length]["ppl"], h["lengths"][length]["ppl"])
                for i, (p, h) in enumerate(zip(rep["pairwise_only"], rep["hadamard"], strict=True))}
    except Exception as exc:  # noqa: BLE001 (a replicate that fails to build is this claim's reason)
        reps = f"replicate failed to build: {type(exc).__name__}: {exc}"
    gap = experiment.paired_claim(Form.LESS, pw, had, tokens=STATIC_EVAL_WINDOWS * b.seqlen, replicates=reps)
    return gap, cells, had, pw


@pytest.mark.slow
def test_static_joint_control_reverses_the_ordering_at_the_shortest_length(experiment, rq_claim,
                                                                              rq_record) -> None:
    (gap, cells, had, pw), at = experiment.decided(_static_gap, "App. D")
    b = at.budget
    length = str(b.seqlen)
    for seed, h, p, c in zip(b.seeds, had, pw, cells["hadamard"], strict=True):
        rq_record("Static joint control (scope both, A.6 transductive)", seed=seed, L=b.seqlen, hadamard=h,
                  pairwise_only=p, gap=p - h, static_windows=c["lengths"][length]["static"]["windows"])
    # robust part: the protocol is A.6's (transductive, per length, scope both) with the recorded window counts
    for c in cells["hadamard"] + cells["pairwise_only"]:
        st = c["lengths"][length]["static"]
        assert c["static"]["transductive"] and st["scope"] == "both" and st["length"] == b.seqlen
        assert st["windows"] == min(STATIC_WINDOWS, st["available_windows"])
    verdict = gap
    ci = f"{gap.mean:+.3f}" + (f" ({gap.ci_name} {gap.low:+.3f}, {gap.high:+.3f}; n={gap.n})"
                               if gap.low is not None else "")
    rq_claim("Static (App. D) joint control: pairwise_only − hadamard ≤ 0 at the shortest length",
             f"{gap.ci_name} of the paired gap below 0 (paper: −5.60 PPL at 2K)",
             f"L={b.seqlen}: {ci}; hadamard {[round(v, 3) for v in had]}, pairwise_only {[round(v, 3) for v in pw]}; "
             + (gap.float_order.text() if gap.float_order else "float order: –"),
             verdict=verdict, stat=gap.mean, noise=gap.noise)
    assert not verdict.failed, f"static both, L={b.seqlen}: {verdict.text()}"

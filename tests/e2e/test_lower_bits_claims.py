"""App. F (lower bits) on the embedded model, ``slow``: W4A3KV4 and W3A3KV3 against W4A4KV4.

The same cells as ``rope-quant compare --configs lower-bits --weights gptq`` at the e2e budget (3 seeds,
12 x 512 scored tokens, 16 x 512 calibration tokens, the paper's rotations). W3A3KV3 needs its own GPTQ
weights per seed, which is why the claim runs in the ``slow`` subset (``tox -e slow``).

The paper's claim is descriptive: the pairwise_only gap to hadamard is positive at both lower settings and
larger at W3A3KV3 than at W4A4KV4. Each part is the GREATER form of the rule of :mod:`rope_quant.core.verdict`,
with the float-order replicates of the session (the first ``--rq-replicates`` seeds with GPTQ in the other
float mode, at each setting: W3A3KV3 adds one replicate GPTQ build per replicated seed); the parts combine.
"""

from __future__ import annotations

from typing import Any

import pytest

from rope_quant.core.verdict import Form, Verdict, combine_all
from rope_quant.sweep.presets import LOWER_BIT_SETTINGS

pytestmark = pytest.mark.slow

PARTS = 3  # App. F's sampled parts: the two gaps and the rise (the sequential rule spends refuted at α/3)


def _bits(setting: str) -> dict[str, int]:
    w, a, k, v = LOWER_BIT_SETTINGS[setting]
    return dict(w_bits=w, a_bits=a, k_bits=k, v_bits=v)


def _app_f(experiment) -> tuple[Verdict, dict[str, Verdict], dict[str, tuple[list[float], list[float], Any]]]:
    """App. F's parts at the experiment's seeds: (combined verdict, the parts, per setting (pw, had, replicates))."""
    per: dict[str, tuple[list[float], list[float], Any]] = {}
    for setting in LOWER_BIT_SETTINGS:
        had = experiment.per_seed(r3="hadamard", **_bits(setting))
        pw = experiment.per_seed(r3="pairwise_only", **_bits(setting))
        rep = experiment.replicate_pairs({"r3": "pairwise_only"}, {"r3": "hadamard"}, **_bits(setting))
        per[setting] = (pw, had, rep)
    tokens = experiment.tokens()

    def gap(setting: str) -> Verdict:
        pw, had, rep = per[setting]
        return experiment.paired_claim(Form.GREATER, pw, had, replicates=rep, tokens=tokens, parts=PARTS)

    def gap_of_gaps(hi: str, lo: str) -> Verdict:
        (pw_h, had_h, rep_h), (pw_l, had_l, rep_l) = per[hi], per[lo]
        g_hi = [p - h for p, h in zip(pw_h, had_h, strict=True)]
        g_lo = [p - h for p, h in zip(pw_l, had_l, strict=True)]
        if isinstance(rep_h, str) or isinstance(rep_l, str):
            reps: dict[int, tuple[float, float]] | str = rep_h if isinstance(rep_h, str) else str(rep_l)
        else:
            reps = {i: (rep_h[i][0] - rep_h[i][1], rep_l[i][0] - rep_l[i][1]) for i in rep_h}
        return experiment.paired_claim(Form.GREATER, g_hi, g_lo, tokens=tokens, replicates=reps, parts=PARTS)

    parts = {"gap W4A3KV4 > 0": gap("W4A3KV4"), "gap W3A3KV3 > 0": gap("W3A3KV3"),
             "gap W3A3KV3 > gap W4A4KV4": gap_of_gaps("W3A3KV3", "W4A4KV4")}
    return combine_all(parts.values()), parts, per


def test_lower_bits_pairwise_only_gap(experiment, rq_claim, rq_record) -> None:
    """App. F: ppl(pairwise_only) − ppl(hadamard) > 0 at W4A3KV4 and W3A3KV3, and larger at W3A3KV3 than at
    W4A4KV4 (seed means, paired within seed). With ``--rq-until-decided`` seeds are added while the claim is
    open (its pairwise_only and hadamard cells at each setting only; pairwise_plus_hadamard, recorded beside
    them, only at the seeds requested)."""
    (verdict, parts, per), at = experiment.decided(_app_f, "App. F")
    requested = set(experiment.budget.seeds)
    for setting, (pw, had, _) in per.items():
        for seed, h, p in zip(at.budget.seeds, had, pw, strict=True):
            q = (float(experiment.cell(seed, r3="pairwise_plus_hadamard", **_bits(setting))["ppl"])
                 if seed in requested else None)
            rq_record("App. F: lower bits (GPTQ, whip R1)", setting=setting, seed=seed, hadamard=h,
                      pairwise_plus_hadamard=q, pairwise_only=p, gap=p - h)
    measured = "; ".join(f"{k}: {v.mean:+.3f}" + (f" ({v.ci_name} {v.low:+.3f}, {v.high:+.3f})" if v.low is not None
                                                  else "") + f", σ_num {v.noise:.3f} → {v.text()}"
                         for k, v in parts.items())
    rq_claim("App. F lower bits: pairwise_only gap", "gap > 0 at W4A3KV4 and W3A3KV3; larger at W3A3KV3 than "
             "W4A4KV4", measured, verdict=verdict, gaps={k: v.mean for k, v in parts.items()},
             parts=parts)
    assert not verdict.failed, {k: v.text() for k, v in parts.items()}

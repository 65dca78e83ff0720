"""App. F (lower bits) on the embedded model, ``slow``: W4A3KV4 and W3A3KV3 against W4A4KV4.

The same cells as ``rope-quant compare --configs lower-bits --weights gptq`` at the e2e budget (3 seeds,
12 x 512 scored tokens, 16 x 512 calibration tokens, the paper's rotations). W3A3KV3 needs its own GPTQ
weights per seed, which is why the claim runs in the ``slow`` subset (``tox -e slow``).

The paper's claim is descriptive: the pairwise_only gap to hadamard is positive at both lower settings and
larger at W3A3KV3 than at W4A4KV4. Each part is decided only beyond :data:`REL_SPREAD` of the Hadamard
perplexity at that setting (float-order noise alone moved a W4A4KV4 cell by up to ~7% at this budget across
thread counts and float64 GPTQ, issue 11 §0), otherwise "inconclusive at this budget".
"""

from __future__ import annotations

import pytest

from rope_quant.core import stats
from rope_quant.sweep.presets import LOWER_BIT_SETTINGS

pytestmark = pytest.mark.slow

#: Relative perplexity spread inside which a lower-bits statement is inconclusive (see the module docstring).
REL_SPREAD = 0.07


def _bits(setting: str) -> dict[str, int]:
    w, a, k, v = LOWER_BIT_SETTINGS[setting]
    return dict(w_bits=w, a_bits=a, k_bits=k, v_bits=v)


def _decide(stat: float, scale: float) -> bool | None:
    return True if stat > REL_SPREAD * scale else False if stat < -REL_SPREAD * scale else None


def test_lower_bits_pairwise_only_gap(experiment, rq_claim, rq_record) -> None:
    """App. F: ppl(pairwise_only) − ppl(hadamard) > 0 at W4A3KV4 and W3A3KV3, and larger at W3A3KV3 than at
    W4A4KV4 (seed means, paired within seed)."""
    gaps: dict[str, stats.PairedCI] = {}
    had_mean: dict[str, float] = {}
    for setting in LOWER_BIT_SETTINGS:
        had = experiment.per_seed(r3="hadamard", **_bits(setting))
        pw = experiment.per_seed(r3="pairwise_only", **_bits(setting))
        pph = experiment.per_seed(r3="pairwise_plus_hadamard", **_bits(setting))
        gaps[setting] = stats.paired_ci(pw, had)
        had_mean[setting] = sum(had) / len(had)
        for seed, h, p, q in zip(experiment.budget.seeds, had, pw, pph, strict=True):
            rq_record("App. F: lower bits (GPTQ, whip R1)", setting=setting, seed=seed, hadamard=h,
                      pairwise_plus_hadamard=q, pairwise_only=p, gap=p - h)
    parts = {
        "gap W4A3KV4 > 0": _decide(gaps["W4A3KV4"].mean, had_mean["W4A3KV4"]),
        "gap W3A3KV3 > 0": _decide(gaps["W3A3KV3"].mean, had_mean["W3A3KV3"]),
        "gap W3A3KV3 > gap W4A4KV4": _decide(gaps["W3A3KV3"].mean - gaps["W4A4KV4"].mean, had_mean["W3A3KV3"]),
    }
    verdict = False if False in parts.values() else None if None in parts.values() else True
    measured = "; ".join(f"{s}: {g.mean:+.3f} (90% CI {g.low:+.3f}, {g.high:+.3f})" for s, g in gaps.items())
    rq_claim("App. F lower bits: pairwise_only gap", "gap > 0 at W4A3KV4 and W3A3KV3; larger at W3A3KV3 than "
             "W4A4KV4", f"{measured}; " + ", ".join(f"{k}: {v}" for k, v in parts.items()), verdict,
             gaps={s: g.mean for s, g in gaps.items()}, parts=parts)
    assert verdict is not False, parts

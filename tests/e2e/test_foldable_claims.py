"""Foldable R3 on the embedded model: how much of pairwise_only's gap to the Hadamard can a FOLDABLE R3 close?

KV-only (W16A16K4V16: only the keys and values are quantised, so R1/R2 are identities, which changes no key),
through the shared paired ``experiment`` (3 seeds, the e2e budget). The foldable family: the range-objective
pairwise, pairwise_scaled (range and variance angles) and the pair-tied pre-RoPE scales; learned_orthogonal
(not foldable) is the upper reference; its K error against the Hadamard's is the registry entry beyond-learned.
``rope-quant compare --configs beyond2`` runs the same family (docs/foldable_r3.md has the measured study). The
share of the gap is a bootstrap interval of a ratio of seed means (:func:`rope_quant.analysis.gap_share.gap_share`),
a statistic the engine does not read, so this row stays a test.
"""

from __future__ import annotations

import pytest

from rope_quant.analysis.gap_share import gap_share
from rope_quant.claims.paper import KV_ONLY

#: The foldable family and the references: the ``slow`` subset (two range fits and a learned fit per seed).
pytestmark = pytest.mark.slow

HADAMARD = dict(r3="hadamard", **KV_ONLY)
BASELINE = dict(r3="pairwise_only", **KV_ONLY)
FOLDABLE = {
    "pairwise_only-range_per_head": dict(r3="pairwise_only", estimator="per_head", objective="range", **KV_ONLY),
    "pairwise_scaled-range_per_head": dict(r3="pairwise_scaled", estimator="per_head", objective="range",
                                           **KV_ONLY),
    "pairwise_scaled-variance_per_head": dict(r3="pairwise_scaled", estimator="per_head", **KV_ONLY),
    "prerope_channel_scale": dict(r3="prerope_channel_scale", **KV_ONLY),
}
#: X of the claim: the share that the best foldable R3 closes, set from the measured studies (SmolLM2, pydoc, 3
#: seeds; docs/foldable_r3.md): KV-only 80% [71%, 90%] (4 x 512 tokens), W4A4KV4 87% [82%, 93%] (12 x 512),
#: rounded down to the 10% below the smaller lower bound.
CLAIMED_SHARE = 0.7


def _fmt(values) -> str:
    return "[" + ", ".join(f"{v:.4g}" for v in values) + "]"


def test_best_foldable_r3_closes_a_share_of_pairwise_onlys_gap(experiment, rq_claim) -> None:
    """Holds when the best foldable R3's bootstrap CI of the share lies at or above X; does not hold when it
    lies below; otherwise inconclusive at this budget (the suite's verdict semantics)."""
    had, base = experiment.per_seed(**HADAMARD), experiment.per_seed(**BASELINE)
    shares = {name: gap_share(experiment.per_seed(**ov), base, had) for name, ov in FOLDABLE.items()}
    best = max(shares, key=lambda n: -1e9 if shares[n]["share"] is None else shares[n]["share"])
    s = shares[best]
    if s["share"] is None or s["low"] is None:
        holds = None
    else:
        holds = True if s["low"] >= CLAIMED_SHARE else (False if s["high"] < CLAIMED_SHARE else None)
    measured = (f"best {best}: {100 * (s['share'] or 0):.0f}% (90% CI {100 * (s['low'] or 0):.0f}%, "
                f"{100 * (s['high'] or 0):.0f}%); hadamard {_fmt(had)}, pairwise_only {_fmt(base)}; "
                + "; ".join(f"{n} {100 * (v['share'] or 0):.0f}%" for n, v in shares.items()))
    rq_claim("Foldable R3: share of pairwise_only's gap closed, KV4", f"best foldable ≥ {100 * CLAIMED_SHARE:.0f}%",
             measured, holds, hadamard=had, pairwise_only=base, **{n: v["share"] for n, v in shares.items()})
    assert holds is not False, measured

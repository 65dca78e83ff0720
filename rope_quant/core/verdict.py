"""The one decision rule of the claims suite: holds, fails, inconclusive (with the budget to decide), refuted.

**The rule** (docs/verdicts.md). A claim about a paired effect ``θ`` (per seed: treatment − control) is read
from the two-sided 90% paired t interval ``[low, high]`` of the mean difference over the seeds (two one-sided
tests at α = 0.05) and the run's own *numerical spread* ``s >= 0``: how far the same seed's paired
difference moved when it was rebuilt under a different, equally valid floating-point order (the numerical
replicate; :func:`numerical_spread`). Every threshold is moved by ``s`` against the verdict being declared:

* lower bound ``θ > b`` (``GREATER``, b = 0; ``NON_INFERIOR``, b = −margin):
  **holds** iff ``low > b + s``; **refuted** iff ``high < b − s``;
* upper bound ``θ < b`` (``LESS``, b = 0; ``NON_SUPERIOR``, b = +margin): the mirror image;
* equivalence ``|θ| < margin`` (``EQUIVALENT``, TOST): **holds** iff ``−margin + s < low`` and
  ``high < margin − s``; **refuted** iff ``low > margin + s`` or ``high < −margin − s``;
* otherwise **inconclusive**, with the budget that would decide it at 80% power (:mod:`rope_quant.core.power`,
  at the measured mean and sd), towards the side the mean lies on; no budget when the mean lies within ``s``
  of the boundary (more seeds cannot beat the floating-point noise) or with fewer than 2 seeds
  ("needs ≥ 2 seeds": no interval, never a vacuous verdict);
* **fails**: a criterion without sampling error (a closed form, an every-seed sign, a claim's robust part) is
  false (:func:`deterministic`).

Several parts of one claim combine with :func:`combine_all`: fails or refuted if any part is, holds if every
part holds, else inconclusive with the largest budget of its undecided parts. A test fails on fails and
refuted, never on inconclusive. Standard library only at import time (the pytest plugin imports this module);
scipy is imported when a budget is computed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from typing import Any

LEVEL = 0.90
"""The interval's level: two one-sided tests at alpha = 0.05."""
PAPER_MARGIN = 0.05
"""The paper's equivalence margin for pairwise+Hadamard against Hadamard (Table 1), in PPL points."""
PAPER_PPL_RANGE = (6.0, 9.0)
"""The paper's WikiText-2 perplexities under W4A4KV4 (its Llama/Mistral checkpoints): its ppl scale."""
PAPER_PPL_REFERENCE = PAPER_MARGIN / 0.006
"""The ppl the margin is scaled from outside the paper's scale: ±0.05 is 0.6% of 8.33 PPL."""


class Outcome(StrEnum):
    """The four verdicts."""

    HOLDS = "holds"
    FAILS = "fails"
    INCONCLUSIVE = "inconclusive"
    REFUTED = "refuted"


class Form(StrEnum):
    """What the claim says about the paired effect θ."""

    GREATER = "greater"  # θ > 0
    LESS = "less"  # θ < 0
    NON_INFERIOR = "non_inferior"  # θ > −margin (e.g. "no gain": a gain smaller than the margin)
    NON_SUPERIOR = "non_superior"  # θ < +margin
    EQUIVALENT = "equivalent"  # |θ| < margin (TOST)


@dataclass(frozen=True)
class Budget:
    """What would decide an inconclusive claim at 80% power: ``seeds`` at today's tokens per cell, or
    ``tokens`` per cell at today's seeds (paired variance ∝ 1/tokens); ``towards`` the outcome it would
    reach; ``reason`` when no budget can decide."""

    seeds: int | None
    tokens: int | None
    towards: Outcome | None
    reason: str = ""

    def text(self) -> str:
        if self.seeds is None and self.tokens is None:
            return f"no budget decides: {self.reason}" if self.reason else "no budget decides"
        parts = []
        if self.seeds is not None:
            parts.append(f"{self.seeds} seeds at today's tokens")
        if self.tokens is not None:
            parts.append(f"{self.tokens} tokens/cell at today's seeds")
        towards = self.towards.value if self.towards else "decide"
        return f"80% power to {'hold' if towards == 'holds' else 'refute'}: " + " or ".join(parts)


@dataclass(frozen=True)
class Verdict:
    """One claim's (or one part's) decision and the numbers it was read from."""

    outcome: Outcome
    form: Form | None
    n: int
    mean: float | None = None
    sd: float | None = None
    low: float | None = None
    high: float | None = None
    margin: float = 0.0
    noise: float = 0.0
    budget: Budget | None = None
    note: str = ""

    @property
    def decided(self) -> bool:
        return self.outcome is not Outcome.INCONCLUSIVE

    @property
    def failed(self) -> bool:
        """The test should fail: the claim is false (fails) or shown false (refuted)."""
        return self.outcome in (Outcome.FAILS, Outcome.REFUTED)

    def text(self) -> str:
        """The verdict column: the outcome, then the note or the budget."""
        if self.outcome is not Outcome.INCONCLUSIVE:
            return self.outcome.value + (f" ({self.note})" if self.note else "")
        tail = self.note or (self.budget.text() if self.budget else "")
        return "inconclusive" + (f": {tail}" if tail else "")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["outcome"] = self.outcome.value
        out["form"] = self.form.value if self.form else None
        if self.budget is not None:
            out["budget"] = {**asdict(self.budget),
                             "towards": self.budget.towards.value if self.budget.towards else None,
                             "text": self.budget.text()}
        out["text"] = self.text()
        return out


def _bounds(form: Form, margin: float) -> tuple[str, float]:
    """('lower', b) for θ > b, ('upper', b) for θ < b, ('equivalent', margin)."""
    if form is Form.GREATER:
        return "lower", 0.0
    if form is Form.NON_INFERIOR:
        return "lower", -margin
    if form is Form.LESS:
        return "upper", 0.0
    if form is Form.NON_SUPERIOR:
        return "upper", margin
    return "equivalent", margin


def decide_interval(form: Form, n: int, mean: float, sd: float, low: float, high: float, *, margin: float = 0.0,
                    noise: float = 0.0, tokens: int | None = None) -> Verdict:
    """The rule (module docstring) on an interval already computed; ``tokens``: scored tokens per cell today."""
    if noise < 0 or not math.isfinite(noise):
        raise ValueError(f"numerical spread must be a finite number >= 0, got {noise!r}")
    if form in (Form.EQUIVALENT, Form.NON_INFERIOR, Form.NON_SUPERIOR) and not margin > 0:
        raise ValueError(f"{form.value} needs a positive margin, got {margin!r}")
    side, b = _bounds(form, margin)
    base = Verdict(Outcome.INCONCLUSIVE, form, n, mean, sd, low, high, margin, noise)
    if side == "lower":
        if low > b + noise:
            return replace(base, outcome=Outcome.HOLDS)
        if high < b - noise:
            return replace(base, outcome=Outcome.REFUTED)
    elif side == "upper":
        if high < b - noise:
            return replace(base, outcome=Outcome.HOLDS)
        if low > b + noise:
            return replace(base, outcome=Outcome.REFUTED)
    else:
        if -b + noise < low and high < b - noise:
            return replace(base, outcome=Outcome.HOLDS)
        if low > b + noise or high < -b - noise:
            return replace(base, outcome=Outcome.REFUTED)
    return replace(base, budget=budget_to_decide(form, n, mean, sd, margin=margin, noise=noise, tokens=tokens))


def budget_to_decide(form: Form, n: int, mean: float, sd: float, *, margin: float = 0.0, noise: float = 0.0,
                     tokens: int | None = None) -> Budget:
    """The budget that decides at 80% power, towards the side the measured mean lies on."""
    from rope_quant.core import power  # deferred: scipy

    side, b = _bounds(form, margin)
    shown_mean, shown_b = mean, b  # the reason names the claim's own orientation, not the mirror
    if side == "upper":  # mirror: θ < b  <=>  −θ > −b
        side, b, mean = "lower", -b, -mean
    if side == "lower":
        if mean > b + noise:
            seeds, toks = power.one_sided_budget(mean - b - noise, sd, n, tokens)
            return Budget(seeds, toks, Outcome.HOLDS, "" if seeds else "beyond the search range")
        if mean < b - noise:
            seeds, toks = power.one_sided_budget(b - noise - mean, sd, n, tokens)
            return Budget(seeds, toks, Outcome.REFUTED, "" if seeds else "beyond the search range")
        return Budget(None, None, None, f"the mean {shown_mean:+.4g} lies within the numerical spread {noise:.3g} "
                                        f"of the boundary {shown_b:+.4g}")
    if abs(mean) < b - noise:
        seeds, toks = power.tost_budget(mean, sd, b - noise, n, tokens)
        return Budget(seeds, toks, Outcome.HOLDS, "" if seeds else "beyond the search range")
    if abs(mean) > b + noise:
        seeds, toks = power.one_sided_budget(abs(mean) - b - noise, sd, n, tokens)
        return Budget(seeds, toks, Outcome.REFUTED, "" if seeds else "beyond the search range")
    reason = (f"the margin {b:.3g} is not wider than the numerical spread {noise:.3g}" if b <= noise else
              f"|mean| {abs(mean):.4g} lies within the numerical spread {noise:.3g} of the margin {b:.3g}")
    return Budget(None, None, None, reason)


def decide(form: Form, diffs: Sequence[float], *, margin: float = 0.0, noise: float = 0.0,
           tokens: int | None = None) -> Verdict:
    """The rule on per-seed paired differences (treatment − control): "needs ≥ 2 seeds" below two."""
    d = [float(x) for x in diffs]
    if any(not math.isfinite(x) for x in d):
        raise ValueError(f"paired differences must be finite, got {d}")
    if len(d) < 2:
        return Verdict(Outcome.INCONCLUSIVE, form, len(d), d[0] if d else None, margin=margin, noise=noise,
                       note="needs ≥ 2 seeds for an interval")
    from rope_quant.core import stats  # deferred: scipy

    n = len(d)
    mean = sum(d) / n
    sd = stats.sample_sd(d)
    half = stats.paired_ci(d, [0.0] * n, LEVEL)
    return decide_interval(form, n, mean, sd, half.low, half.high, margin=margin, noise=noise, tokens=tokens)


def deterministic(holds: bool, note: str = "") -> Verdict:
    """A criterion without sampling error: holds or fails."""
    return Verdict(Outcome.HOLDS if holds else Outcome.FAILS, None, 0, note=note)


def combine_all(parts: Iterable[Verdict], note: str = "") -> Verdict:
    """A claim made of parts: fails / refuted if any part is (fails first), holds if all hold, otherwise
    inconclusive with the largest budget among its undecided parts (none if any part has none)."""
    items = list(parts)
    if not items:
        raise ValueError("combine_all needs at least one part")
    for bad in (Outcome.FAILS, Outcome.REFUTED):
        hit = [v for v in items if v.outcome is bad]
        if hit:
            return replace(hit[0], note=note or hit[0].note)
    open_ = [v for v in items if v.outcome is Outcome.INCONCLUSIVE]
    if not open_:
        return replace(items[0], note=note)
    needs = [v for v in open_ if v.note.startswith("needs")]
    if needs:
        return needs[0]
    budgets = [v.budget for v in open_]
    if any(b is None or (b.seeds is None and b.tokens is None) for b in budgets):
        worst = next(v for v in open_ if v.budget is None or (v.budget.seeds is None and v.budget.tokens is None))
        return replace(worst, note=note or worst.note)
    seeds = [b.seeds for b in budgets if b is not None]
    toks = [b.tokens for b in budgets if b is not None]
    towards = {b.towards for b in budgets if b is not None}
    merged = Budget(None if None in seeds else max(s for s in seeds if s is not None),
                    None if None in toks else max(t for t in toks if t is not None),
                    towards.pop() if len(towards) == 1 else None)
    return replace(open_[0], budget=merged, note=note)


def numerical_spread(primary: float | Sequence[float], replicate: float | Sequence[float]) -> float:
    """How far a decision statistic moved between a seed and its numerical replicate (the same seed rebuilt
    under another valid floating-point order): the largest absolute difference, element-wise."""
    p = [primary] if isinstance(primary, (int, float)) else list(primary)
    r = [replicate] if isinstance(replicate, (int, float)) else list(replicate)
    if len(p) != len(r) or not p:
        raise ValueError(f"primary ({len(p)}) and replicate ({len(r)}) statistics must pair up")
    spread = max(abs(float(a) - float(b)) for a, b in zip(p, r, strict=True))
    if not math.isfinite(spread):
        raise ValueError(f"non-finite numerical spread from {p} and {r}")
    return spread


@dataclass(frozen=True)
class Margin:
    """An equivalence margin in PPL points and the basis it was taken on (named in the claims table)."""

    value: float
    basis: str


def equivalence_margin(ppl: float) -> Margin:
    """The paper's ±0.05 PPL where the comparator's perplexity is on the paper's scale
    (:data:`PAPER_PPL_RANGE`); otherwise scaled by the ppl ratio, ``0.05 · ppl / 8.33`` (0.6% of ppl)."""
    if not (math.isfinite(ppl) and ppl > 0):
        raise ValueError(f"perplexity must be a positive finite number, got {ppl!r}")
    low, high = PAPER_PPL_RANGE
    if low <= ppl <= high:
        return Margin(PAPER_MARGIN, f"the paper's ±{PAPER_MARGIN} PPL (ppl {ppl:.2f} on its scale {low:g}–{high:g})")
    value = PAPER_MARGIN * ppl / PAPER_PPL_REFERENCE
    return Margin(value, f"±{PAPER_MARGIN} PPL scaled by the ppl ratio {ppl:.2f}/{PAPER_PPL_REFERENCE:.2f} "
                         f"= ±{value:.3f}")


def paired_claim(form: Form, treatment: Sequence[float], control: Sequence[float], *,
                 replicate: tuple[float, float] | None, replicate_index: int = 0, margin: float = 0.0,
                 tokens: int | None = None) -> Verdict:
    """The rule on a seed-paired comparison with its numerical replicate.

    ``replicate``: (treatment, control) of seed ``treatment[replicate_index]`` rebuilt under another valid
    floating-point order; the spread is how far that seed's paired difference moved. ``None`` only where no
    replicate can exist (noise taken as 0, and the note says so).
    """
    if len(treatment) != len(control):
        raise ValueError(f"treatment has {len(treatment)} values but control has {len(control)}")
    diffs = [float(t) - float(c) for t, c in zip(treatment, control, strict=True)]
    noise = 0.0
    if replicate is not None and diffs:
        noise = numerical_spread(diffs[replicate_index], float(replicate[0]) - float(replicate[1]))
    v = decide(form, diffs, margin=margin, noise=noise, tokens=tokens)
    return v if replicate is not None or v.note else replace(v, note="no numerical replicate: spread taken as 0")

"""The one decision rule of the claims suite: holds, fails, inconclusive (with the budget to decide), refuted.

**The rule** (docs/verdicts.md). A claim is about a paired effect ``θ`` (per seed: treatment − control). GPTQ's
floating-point order (CPU, thread count, float mode) is a second source of variation: the same seed rebuilt
under another valid float order (its *numerical replicate*, GPTQ in the other float mode) moves ``θ_i`` by
``d_i = θ_i^rep − θ_i``. The run builds replicates for ``k`` of its ``n`` seeds. Then:

* the **primary interval** ``A`` is the two-sided 90% paired t interval of the mean of ``θ_i`` over the ``n``
  seeds. Each ``θ_i`` carries its own float-order perturbation, so ``A`` already contains the float-order
  *noise* as variance; nothing is added to it for noise;
* the shifts estimate the float-order noise ``σ_num = sd(d)`` and the float-order **bias** ``β = E d`` with its
  own 90% t interval on ``k − 1`` degrees of freedom (:class:`FloatOrder`);
* the **replicate interval** ``B`` is the 90% interval of the effect in the other float order, ``θ + β``. With
  every seed replicated (``k = n``, the default budget) it is that order's own paired t interval, over
  ``θ_i^rep = θ_i + d_i`` (exact, ``n − 1`` degrees of freedom). With ``k < n`` it is
  ``mean(θ) + mean(d) ± t_ν · sqrt(s_θ²/n + s_d²/k)`` with Welch–Satterthwaite ``ν``; the covariance of the two
  means (``−σ_e²/n`` where the seeds overlap) is left out, which only widens ``B``. The bias thus enters only
  as far as it is established: through its interval, never through a point magnitude;
* the claim is decided on the **union** ``U = [min(low_A, low_B), max(high_A, high_B)]``, in the forms below,
  with no offsets: lower bound ``θ > b`` (``GREATER``, b = 0; ``NON_INFERIOR``, b = −margin) **holds** iff
  ``U.low > b``, **refuted** iff ``U.high < b``; upper bound ``θ < b`` (``LESS``, ``NON_SUPERIOR``) the mirror;
  equivalence ``|θ| < margin`` (TOST) holds iff ``−margin < U.low`` and ``U.high < margin``, refuted iff
  ``U.low > margin`` or ``U.high < −margin``.

**Coverage.** ``A`` covers ``θ`` and ``B`` covers ``θ + β`` each with ≥ 95% per side (``B`` exactly with every
seed replicated, else to Welch's approximation, made conservative by the covariance left out), so a "holds" (or
"refuted") is wrong in *either* float order with probability ≤ 5% when the effect of that order lies on the
boundary, with or without a bias (``tests/theory/test_verdict_replicates.py`` measures it by simulation, with
the 0.1.x rule beside it). Otherwise the claim is **inconclusive**, with the budget that decides it at 80%
power (:func:`budget_replicated`; seeds with replicates in today's proportion, or tokens per cell) or, where
none can, the reason: an *established* bias (its interval excludes 0) that puts the two float orders on
opposite sides of the boundary, or a mean exactly on it. Fewer than 2 seeds ("needs ≥ 2 seeds"), fewer than 2
replicates (the noise and the bias cannot be estimated; the note says what the primary interval alone reads),
or a replicate that failed to build (the note gives the reason) are inconclusive too, never a vacuous verdict.

* **fails**: a criterion without sampling error (a closed form, an every-seed sign, a claim's robust part) is
  false (:func:`deterministic`).

:func:`decide` / :func:`decide_interval` apply the same thresholds to one interval with an explicit offset
``noise`` (0 for a ``rope-quant compare`` sign, which has no replicate). Several parts of one claim combine with
:func:`combine_all`: fails or refuted if any part is, holds if every part holds, else inconclusive with the
largest budget of its undecided parts. A test fails on fails and refuted, never on inconclusive. Standard
library only at import time (the pytest plugin imports this module); numpy/scipy when a number is computed.

Over 500 lines because the rule is one contract (docs/verdicts.md): its intervals, forms, replicated reading,
budgets and the combination of parts are read together; its power maths are power.py's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from typing import Any

from rope_quant.core.outlier import OutlierFlag

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
    reach; ``reason`` when no budget can decide; ``replicates``: how many of the ``seeds`` carry a numerical
    replicate (the replicated rule; None for the single-interval form)."""

    seeds: int | None
    tokens: int | None
    towards: Outcome | None
    reason: str = ""
    replicates: int | None = None

    def text(self) -> str:
        if self.seeds is None and self.tokens is None:
            return f"no budget decides: {self.reason}" if self.reason else "no budget decides"
        parts = []
        if self.seeds is not None:
            parts.append(f"{self.seeds} seeds at today's tokens"
                         + (f", {self.replicates} of them replicated" if self.replicates is not None else ""))
        if self.tokens is not None:
            parts.append(f"{self.tokens} tokens/cell at today's seeds")
        towards = self.towards.value if self.towards else "decide"
        return (f"80% power to {'hold' if towards == 'holds' else 'refute'}: " + " or ".join(parts)
                + (f" ({self.reason})" if self.reason else ""))


RULE_OFFSET = "interval, thresholds offset by a fixed noise"
"""The rule of :func:`decide`: one interval, every threshold moved by ``noise`` (0 for a compare sign)."""
RULE_REPLICATES = "union of the primary and the float-order replicate intervals"
"""The rule of :func:`decide_replicated` (module docstring); claims JSONs without a ``rule`` key predate it."""


@dataclass(frozen=True)
class FloatOrder:
    """What ``k`` numerical replicates say: the shifts ``d_i = θ_i^rep − θ_i``, their sd ``sigma`` (σ_num), the
    bias (their mean) with its 90% t interval, and the replicate-order interval ``[low_b, high_b]`` of
    ``θ + β``: ``paired`` when every seed is replicated (the replicate order's own paired t interval), else
    Welch's. ``reason``: why they could not be estimated (then the numbers are None)."""

    k: int
    shifts: tuple[float, ...] = ()
    sigma: float | None = None
    bias: float | None = None
    bias_low: float | None = None
    bias_high: float | None = None
    low_b: float | None = None
    high_b: float | None = None
    reason: str = ""
    paired: bool = False

    @property
    def established(self) -> bool:
        """The bias's interval excludes 0."""
        return (self.bias_low is not None and self.bias_low > 0) or (self.bias_high is not None and self.bias_high < 0)

    @property
    def bias_plug(self) -> float:
        """The established part of the bias: its interval's point nearest 0 (0 when the interval holds 0)."""
        if self.bias_low is not None and self.bias_low > 0:
            return self.bias_low
        if self.bias_high is not None and self.bias_high < 0:
            return self.bias_high
        return 0.0

    def text(self) -> str:
        if self.sigma is None or self.bias is None:
            return f"float order: {self.reason}"
        return (f"float order (k={self.k}): σ_num {self.sigma:.3g}, bias {self.bias:+.3g} "
                f"(90% CI {self.bias_low:+.3g}, {self.bias_high:+.3g}"
                + (", established)" if self.established else ")"))


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
    float_order: FloatOrder | None = None
    rule: str = RULE_OFFSET
    stop: str = ""
    """Why a claim still open at the sequential rule's last look stays open (:mod:`rope_quant.core.sequential`)."""
    level: float = 0.90
    """The two-sided level of ``low`` / ``high`` (the sequential rule's per-look level is higher)."""
    refutable: bool | None = None
    """An open part under the sequential rule: whether its predictive chance of being refuted by M is at least the
    futility level (None: not judged). A claim of parts that can no longer hold stops once no open part is."""
    shape: str = ""
    """The sequential rule's boundary shape (:class:`rope_quant.core.boundary.Shape`); "" under the fixed-n rule."""
    parts: int = 1
    """The parts the claim this verdict belongs to has, as the refuted side was spent (1: a claim of one part)."""
    skewness: float | None = None
    """The per-seed paired differences' sample skewness g1 (n ≥ 3): how far a decision leans on the tails."""
    kurtosis: float | None = None
    """Their sample excess kurtosis g2 (n ≥ 4)."""
    claim_error: str = ""
    """A claim of parts: the error the claim carries per side (:func:`combine_all`)."""
    diffs: tuple[float, ...] = ()
    """The per-seed paired differences the verdict was read from, in seed order (with ``float_order.shifts``, what
    a later rule needs to replay the decision look by look: :func:`rope_quant.core.sequential.replay`)."""
    outlier: OutlierFlag | None = None
    """Under the sequential rule: seeds farther from the others than normal seeds go (:mod:`rope_quant.core.outlier`);
    if they are blow-ups, the rule's 5% is not covered. None: none flagged, or the fixed-n rule."""

    @property
    def ci_name(self) -> str:
        """The interval's name as printed: "90% CI", or e.g. "98.8% CI" at the sequential rule's per-look level."""
        return f"{100 * self.level:.3g}% CI"

    @property
    def decided(self) -> bool:
        return self.outcome is not Outcome.INCONCLUSIVE

    @property
    def failed(self) -> bool:
        """The test should fail: the claim is false (fails) or shown false (refuted)."""
        return self.outcome in (Outcome.FAILS, Outcome.REFUTED)

    def text(self) -> str:
        """The verdict column: the outcome, then the note or the budget."""
        flagged = f"; {self.outlier.text()}" if self.outlier is not None else ""
        if self.outcome is not Outcome.INCONCLUSIVE:
            return self.outcome.value + (f" ({self.note})" if self.note else "") + flagged
        tail = self.stop or self.note or (self.budget.text() if self.budget else "")
        return "inconclusive" + (f": {tail}" if tail else "") + flagged

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["outcome"] = self.outcome.value
        out["form"] = self.form.value if self.form else None
        if self.budget is not None:
            out["budget"] = {**asdict(self.budget),
                             "towards": self.budget.towards.value if self.budget.towards else None,
                             "text": self.budget.text()}
        if self.outlier is not None:
            out["outlier"] = {**asdict(self.outlier), "text": self.outlier.text()}
        out["text"] = self.text()
        return out

    @property
    def bounds(self) -> tuple[float | None, float | None]:
        """The interval the outcome was read from: the union of the primary and replicate intervals under
        :data:`RULE_REPLICATES`, else the primary interval."""
        fo = self.float_order
        if fo is None or fo.low_b is None or fo.high_b is None or self.low is None or self.high is None:
            return self.low, self.high
        return min(self.low, fo.low_b), max(self.high, fo.high_b)


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


PAST_TODAY = "today's budget already has ≥ 80% power at the measured values; this run fell in the undecided rest"
"""Why a budget reads today's seeds + 1 (:func:`past_today`)."""


def past_today(budget: Budget, n: int, tokens: int | None, k: int | None = None) -> Budget:
    """A budget to decide is more than today's (this run did not decide): where the plug-in power at today's
    seeds (or tokens) already reaches 80%, the budget becomes today's seeds + 1 (replicates in today's proportion
    ``k/n``), the tokens are dropped, and the budget says why (:data:`PAST_TODAY`)."""
    short = (budget.seeds is not None and budget.seeds <= n) or (
        budget.tokens is not None and tokens is not None and budget.tokens <= tokens)
    if not short:
        return budget
    from rope_quant.core import power  # deferred: scipy

    reps = power.replicates_at(n + 1, n, k) if k is not None else None
    return replace(budget, seeds=n + 1, tokens=None, reason=PAST_TODAY, replicates=reps)


def budget_to_decide(form: Form, n: int, mean: float, sd: float, *, margin: float = 0.0, noise: float = 0.0,
                     tokens: int | None = None) -> Budget:
    """The budget that decides at 80% power, towards the side the measured mean lies on (more than today's:
    :func:`past_today`)."""
    return past_today(_budget_to_decide(form, n, mean, sd, margin=margin, noise=noise, tokens=tokens), n, tokens)


def _budget_to_decide(form: Form, n: int, mean: float, sd: float, *, margin: float, noise: float,
                      tokens: int | None) -> Budget:
    from rope_quant.core import power  # deferred: scipy

    side, b = _bounds(form, margin)
    shown_mean, shown_b = mean, b  # the reason names the claim's own orientation, not the mirror
    if side == "upper":  # mirror: θ < b  <=>  −θ > −b
        side, b, mean = "lower", -b, -mean
    if side == "lower":
        if mean > b + noise:
            seeds, toks = power.one_sided_budget(mean - b - noise, sd, n, tokens)
            return Budget(seeds, toks, Outcome.HOLDS, "" if seeds else "seeds beyond the search range")
        if mean < b - noise:
            seeds, toks = power.one_sided_budget(b - noise - mean, sd, n, tokens)
            return Budget(seeds, toks, Outcome.REFUTED, "" if seeds else "seeds beyond the search range")
        return Budget(None, None, None, f"the mean {shown_mean:+.4g} lies within the numerical spread {noise:.3g} "
                                        f"of the boundary {shown_b:+.4g}")
    if abs(mean) < b - noise:
        seeds, toks = power.tost_budget(mean, sd, b - noise, n, tokens)
        return Budget(seeds, toks, Outcome.HOLDS, "" if seeds else "seeds beyond the search range")
    if abs(mean) > b + noise:
        seeds, toks = power.one_sided_budget(abs(mean) - b - noise, sd, n, tokens)
        return Budget(seeds, toks, Outcome.REFUTED, "" if seeds else "seeds beyond the search range")
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
    inconclusive with the largest budget among its undecided parts (none if any part has none). Under the
    sequential rule it stops when every open part has stopped, or when one has (so the claim cannot hold) and no
    other is likely to be refuted (:attr:`Verdict.refutable`). A claim of two or more sampled parts carries its
    error in ``claim_error`` (:func:`claim_error`), and any part's outlier flag (:attr:`Verdict.outlier`)."""
    items = list(parts)
    if not items:
        raise ValueError("combine_all needs at least one part")
    error = claim_error(items)
    out = _combine(items, note)
    flagged = next((v.outlier for v in items if v.outlier is not None), None)
    if out.outlier is None and flagged is not None:  # a claim carries any part's flag (the first part's named)
        out = replace(out, outlier=flagged)
    return replace(out, claim_error=error) if error else out


ALPHA_SIDE = 0.05
"""The error per side the rule promises for one interval (the sequential rule spends it over its looks)."""


def claim_error(parts: Sequence[Verdict]) -> str:
    """The error a claim of parts carries per side. "Holds" needs every part to hold (an intersection-union test:
    no adjustment, ≤ 5%). "Refuted" needs one part refuted, so the parts' errors add: the sequential rule spends
    the refuted side at α / P per part when its plan names the P parts (Bonferroni, Holm's first step — the only
    step that decides the claim); otherwise the bound is P × 5%. "" for fewer than two sampled parts."""
    sampled = [v for v in parts if v.form is not None]
    p = len(sampled)
    if p < 2:
        return ""
    if all(v.shape and v.parts >= p for v in sampled):
        return (f"≤ {ALPHA_SIDE:.0%} per side for the claim: holds needs all {p} parts; refuted spent at "
                f"{ALPHA_SIDE:.0%}/{p} per part")
    return (f"holds ≤ {ALPHA_SIDE:.0%} (all {p} parts must hold); refuted ≤ {p} × {ALPHA_SIDE:.0%} = "
            f"{min(1.0, p * ALPHA_SIDE):.0%} (any one of the {p} parts refutes it)")


def _combine(items: list[Verdict], note: str) -> Verdict:
    """:func:`combine_all` without the claim's error."""
    for bad in (Outcome.FAILS, Outcome.REFUTED):
        hit = [v for v in items if v.outcome is bad]
        if hit:
            return replace(hit[0], note=note or hit[0].note)
    # a part still open comes before a part stopped (rope_quant.core.sequential): the claim stops with its last part
    open_ = sorted((v for v in items if v.outcome is Outcome.INCONCLUSIVE), key=lambda v: bool(v.stop))
    if not open_:
        return replace(items[0], note=note)
    running = [v for v in open_ if not v.stop]
    if running and len(running) < len(open_) and all(v.refutable is False for v in running):
        # a part stopped undecided means the claim cannot hold; only a refuted part could still decide it
        stopped = open_[len(running)]
        return replace(stopped, note=note or stopped.note, stop=f"{stopped.stop}; so the claim cannot hold within "
                       "the budget, and no part still open is likely to be refuted in it (each one's chance below the "
                       "futility level)")
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
    reps = [b.replicates for b in budgets if b is not None and b.replicates is not None]
    most = None if None in seeds else max(s for s in seeds if s is not None)
    merged = Budget(most, None if None in toks else max(t for t in toks if t is not None),
                    towards.pop() if len(towards) == 1 else None,
                    reason=next((b.reason for b in budgets if b is not None and b.seeds == most and b.reason), ""),
                    replicates=max(reps) if reps else None)
    return replace(open_[0], budget=merged, note=note)


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


def float_order(shifts: Sequence[float], n: int, mean: float, sd: float, sd_rep: float | None = None,
                alpha: float | None = None) -> FloatOrder:
    """The replicates' :class:`FloatOrder` beside the primary ``n``, ``mean``, ``sd`` of the paired effect;
    ``sd_rep``: with every seed replicated, the sd of the replicate order's differences ``θ_i + d_i`` (then B is
    that order's own paired t interval); ``alpha``: B's level per side (default the rule's 0.05; the sequential
    rule spends less per look). The bias's own interval stays at 90%."""
    d = [float(x) for x in shifts]
    k = len(d)
    if any(not math.isfinite(x) for x in d):
        raise ValueError(f"replicate shifts must be finite, got {d}")
    if k < 2:
        return FloatOrder(k, tuple(d), reason=f"{k} numerical replicate(s): the float-order noise and bias cannot "
                                              "be estimated (needs ≥ 2)")
    from rope_quant.core import power  # deferred: scipy

    bias = sum(d) / k
    sigma = math.sqrt(sum((x - bias) ** 2 for x in d) / (k - 1))
    half = float(power.t_quantile(k - 1)) * sigma / math.sqrt(k)
    low_a, high_a, low_b, high_b = power.union_bounds(mean, sd, n, bias, sigma, k, sd_rep=sd_rep,
                                                      alpha=power.ALPHA if alpha is None else alpha)
    return FloatOrder(k, tuple(d), sigma, bias, bias - half, bias + half, float(low_b), float(high_b),
                      paired=sd_rep is not None)


def decide_replicated(form: Form, diffs: Sequence[float], shifts: Sequence[float] | str | None, *,
                      margin: float = 0.0, tokens: int | None = None, alpha: float | None = None,
                      with_budget: bool = True) -> Verdict:
    """The rule (module docstring) on the per-seed paired differences and the replicates' shifts
    ``d_i = θ_i^rep − θ_i``. ``shifts``: a str is why a replicate failed to build; None, that none exists.
    ``alpha``: each interval's level per side (default 0.05: the 90% intervals; the sequential rule,
    :mod:`rope_quant.core.sequential`, passes its per-look level); ``with_budget``: compute the budget to decide
    an undecided claim (the sequential rule reads its own stop instead)."""
    level = LEVEL if alpha is None else 1.0 - 2.0 * alpha
    if form in (Form.EQUIVALENT, Form.NON_INFERIOR, Form.NON_SUPERIOR) and not margin > 0:
        raise ValueError(f"{form.value} needs a positive margin, got {margin!r}")
    d = [float(x) for x in diffs]
    if isinstance(shifts, str) or shifts is None:
        reason = shifts or "no numerical replicate exists for this setting"
        head = f"float-order replicate: {reason}" if isinstance(shifts, str) else f"float order: {reason}"
        return _primary_only(form, d, FloatOrder(0, reason=reason), head, margin, tokens)
    if len(d) < 2:  # no interval
        return replace(decide(form, d, margin=margin), rule=RULE_REPLICATES,
                       float_order=FloatOrder(len(shifts), tuple(float(x) for x in shifts)))
    if any(not math.isfinite(x) for x in d):
        raise ValueError(f"paired differences must be finite, got {d}")
    from rope_quant.core import stats  # deferred: scipy

    ci = stats.paired_ci(d, [0.0] * len(d), level)
    skew, kurt = tails(d)
    every = len(shifts) == len(d)  # every seed replicated: shifts[i] is seed i's
    sd_rep = stats.sample_sd([x + float(y) for x, y in zip(d, shifts, strict=True)]) if every else None
    fo = float_order(shifts, ci.n, ci.mean, ci.sd, sd_rep, alpha)
    if fo.sigma is None:
        return _primary_only(form, d, fo, fo.reason, margin, tokens)
    primary = Verdict(Outcome.INCONCLUSIVE, form, ci.n, ci.mean, ci.sd, ci.low, ci.high, margin, rule=RULE_REPLICATES,
                      skewness=skew, kurtosis=kurt, diffs=tuple(d))
    v = replace(primary, outcome=Outcome.INCONCLUSIVE, budget=None, noise=fo.sigma, float_order=fo)
    side, b = _bounds(form, margin)
    low, high = v.bounds
    from rope_quant.core.power import masks  # deferred: numpy

    holds, refuted = masks(side, b, low, high)
    if holds:
        return replace(v, outcome=Outcome.HOLDS)
    if refuted:
        return replace(v, outcome=Outcome.REFUTED)
    if not with_budget:
        return v
    return replace(v, budget=budget_replicated(form, ci.n, ci.mean, ci.sd, fo, margin=margin, tokens=tokens))


def tails(d: Sequence[float]) -> tuple[float | None, float | None]:
    """(g1, g2): the sample skewness (n ≥ 3) and excess kurtosis (n ≥ 4) of the per-seed differences; None where
    too few seeds or no spread."""
    n = len(d)
    if n < 3:
        return None, None
    mean = sum(d) / n
    m2 = sum((x - mean) ** 2 for x in d) / n
    if not m2 > 0:
        return None, None
    m3 = sum((x - mean) ** 3 for x in d) / n
    m4 = sum((x - mean) ** 4 for x in d) / n
    return m3 / m2 ** 1.5, (m4 / m2 ** 2 - 3.0 if n >= 4 else None)


def _primary_only(form: Form, d: list[float], fo: FloatOrder, why: str, margin: float,
                  tokens: int | None) -> Verdict:
    """Inconclusive: the float order cannot be estimated; the note says why and what the primary interval alone
    (the 0.1.x reading without a spread) would read."""
    alone = decide(form, d, margin=margin, tokens=tokens)
    return replace(alone, outcome=Outcome.INCONCLUSIVE, budget=None, float_order=fo, rule=RULE_REPLICATES,
                   note=f"{why}; the primary interval alone reads {alone.text()}")


def budget_replicated(form: Form, n: int, mean: float, sd: float, fo: FloatOrder, *, margin: float = 0.0,
                      tokens: int | None = None) -> Budget:
    """The budget that decides at 80% power under :data:`RULE_REPLICATES`, at the plug-in values (the measured
    mean, sd, σ_num, and the bias as far as it is established: :attr:`FloatOrder.bias_plug`), towards the
    side both float orders' means lie on; seeds with replicates in today's proportion ``k/n``, or tokens per
    cell at today's seeds (both variances ∝ 1/tokens)."""
    from rope_quant.core import power  # deferred: scipy

    assert fo.sigma is not None
    side, b = _bounds(form, margin)
    bias = fo.bias_plug
    means = (mean, mean + bias)

    def where(m: float) -> str:
        if side == "equivalent":
            return "holds" if abs(m) < b else "refuted+" if m > b else "refuted-" if m < -b else "edge"
        return "edge" if m == b else "holds" if (m > b) == (side == "lower") else "refuted"

    w_a, w_b = where(means[0]), where(means[1])
    bound = f"±{b:.4g}" if side == "equivalent" else f"{b:+.4g}"
    if "edge" in (w_a, w_b):
        edge = means[0] if w_a == "edge" else means[1]
        return Budget(None, None, None, f"the mean {edge:+.4g} lies on the boundary {bound}")
    if w_a != w_b:
        return Budget(None, None, None,
                      f"the established float-order bias {fo.bias:+.4g} (90% CI {fo.bias_low:+.4g}, "
                      f"{fo.bias_high:+.4g}) moves the mean {mean:+.4g} to {mean + bias:+.4g}, across the boundary "
                      f"{bound}: the claim differs between the float orders")
    towards = Outcome(w_a.rstrip("+-"))
    seeds, toks = power.replicated_budget(side, b, towards.value, mean, sd, bias, fo.sigma, n, fo.k, tokens)
    reps = power.replicates_at(seeds, n, fo.k) if seeds else None
    return past_today(Budget(seeds, toks, towards, "" if seeds else "seeds beyond the search range", replicates=reps),
                      n, tokens, fo.k)


def paired_claim(form: Form, treatment: Sequence[float], control: Sequence[float], *,
                 replicates: Mapping[int, tuple[float, float]] | str | None, margin: float = 0.0,
                 tokens: int | None = None) -> Verdict:
    """The rule on a seed-paired comparison with its numerical replicates.

    ``replicates``: seed index → (treatment, control) of that seed rebuilt under another valid floating-point
    order (GPTQ in the other float mode); a str is the reason a replicate failed to build (the claim is
    inconclusive with it); None where no replicate exists (inconclusive: the noise cannot be estimated).
    """
    if len(treatment) != len(control):
        raise ValueError(f"treatment has {len(treatment)} values but control has {len(control)}")
    diffs = [float(t) - float(c) for t, c in zip(treatment, control, strict=True)]
    if isinstance(replicates, str) or replicates is None:
        return decide_replicated(form, diffs, replicates, margin=margin, tokens=tokens)
    bad = [i for i in replicates if not 0 <= i < len(diffs)]
    if bad:
        raise ValueError(f"replicate seed indices {bad} are outside the {len(diffs)} seeds")
    shifts = [float(t) - float(c) - diffs[i] for i, (t, c) in sorted(replicates.items())]
    return decide_replicated(form, diffs, shifts, margin=margin, tokens=tokens)

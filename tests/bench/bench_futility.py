"""What the sequential rule's early stop for futility costs and saves (docs/verdicts.md, "Futility").

For each scenario of the expected-seeds table (tests/theory/test_sequential.py), ``--runs`` synthetic runs of the
plan (looks at 3 … 40 seeds, every seed replicated) are read look by look with ``sequential.decide``, once with the
early stop (the default, 10%) and once without; printed side by side: the fraction decided by M, the fraction
decided wrongly (towards the side the true values do not support), and the mean seeds spent. Standard output only;
nothing is asserted (``python tests/bench/bench_futility.py [--runs N]``)."""

from __future__ import annotations

import argparse
import time

import numpy as np

from rope_quant.core import sequential
from rope_quant.core.sequential import Plan, draw
from rope_quant.core.verdict import Form, Outcome

SCENARIOS = [  # form, margin, theta, beta, su, se (the expected-seeds table's rows, then C2's and a null)
    (Form.GREATER, 0.0, 1.0, 0.0, 1.0, 0.5),
    (Form.GREATER, 0.0, 1.5, -0.5, 1.0, 1.0),
    (Form.GREATER, 0.0, 3.0, 0.0, 1.0, 0.5),
    (Form.NON_SUPERIOR, 0.158, -1.0, 0.0, 0.85, 2.0),
    (Form.LESS, 0.0, -1.0, 0.29, 1.0, 1.5),
    (Form.EQUIVALENT, 0.6, 0.1, 0.0, 1.0, 0.7),
    (Form.EQUIVALENT, 0.141, -0.25, 0.54, 0.6, 0.87),
    (Form.GREATER, 0.0, 0.0, 0.0, 1.0, 0.5),
]


def run(form: Form, margin: float, p: np.ndarray, q: np.ndarray, plan: Plan) -> tuple[Outcome, int]:
    for n in range(plan.first, plan.max_seeds + 1):
        v = sequential.decide(form, p[:n], q[:n] - p[:n], plan, margin=margin)
        if v.decided or v.stop:
            return v.outcome, n
    return Outcome.INCONCLUSIVE, plan.max_seeds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=200)
    args = ap.parse_args()
    with_stop, without = Plan(3, 40), Plan(3, 40, futility=0.0)
    print("| form | margin | θ | β | σ_u | σ_e | decided by 40 (stop / none) | wrong (stop / none) | mean seeds "
          "(stop / none) | stopped for futility |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    t0 = time.perf_counter()
    for i, (form, margin, theta, beta, su, se) in enumerate(SCENARIOS):
        p, q = draw(theta, beta, su, se, args.runs, 40, 900 + i)
        res = {name: [run(form, margin, p[r], q[r], plan) for r in range(args.runs)]
               for name, plan in (("stop", with_stop), ("none", without))}
        side, b = sequential._bounds(form, margin)
        both = (theta, theta + beta)  # the true effect in each float order
        holds_all = {"lower": min(both) > b, "upper": max(both) < b,
                     "equivalent": max(map(abs, both)) < b}[side]
        refuted_all = {"lower": max(both) < b, "upper": min(both) > b,
                       "equivalent": min(map(abs, both)) > b}[side]

        def wrong(o: Outcome, holds_all: bool = holds_all, refuted_all: bool = refuted_all) -> bool:
            """A side the true values of some float order do not support."""
            return (o is Outcome.HOLDS and not holds_all) or (o is Outcome.REFUTED and not refuted_all)

        cols = []
        for f in (lambda r: np.mean([o is not Outcome.INCONCLUSIVE for o, _ in r]),
                  lambda r: np.mean([wrong(o) for o, _ in r]), lambda r: np.mean([n for _, n in r])):
            cols.append(f"{f(res['stop']):.3g} / {f(res['none']):.3g}")
        stopped = np.mean([o is Outcome.INCONCLUSIVE and n < 40 for o, n in res["stop"]])
        print(f"| {form.value} | {margin:g} | {theta:g} | {beta:g} | {su:g} | {se:g} | {' | '.join(cols)} | "
              f"{stopped:.3g} |", flush=True)
    print(f"{args.runs} runs per row, {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()

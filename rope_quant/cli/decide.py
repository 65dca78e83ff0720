"""``rope-quant decide DIR``: add seeds to a results directory until each claim is decided (the sequential rule).

One path decides both kinds of directory: the claims (a compare directory's configs against their controls,
:func:`rope_quant.sweep.decide.config_claims`; a ``rope-quant claims`` directory's registry claims) and the cells
one seed adds for a claim go to the one loop (:func:`rope_quant.sweep.claims_decide.until_decided_in`: the engine
and ``core.sequential.until_decided``); only the shape of ``DIR/decisions.json`` differs. This module parses and
checks the flags (bad input exits 2 before anything is built) and prints the claims table.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rope_quant.cli.args import CLIError
from rope_quant.cli.execute import Cells

HELP = "add seeds until each claim of a results directory is decided (sequential rule, docs/verdicts.md)"


def _seconds(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds (a number > 0), got {text!r}") from None


def add_parser(sub: Any) -> argparse.ArgumentParser:
    from rope_quant.core.boundary import DEFAULT_SHAPE, Shape
    from rope_quant.core.sequential import DEFAULT_FUTILITY, DEFAULT_MAX_SEEDS

    p = sub.add_parser("decide", help=HELP)
    p.add_argument("dir", metavar="DIR", help="results directory of a sweep (rope-quant compare ... --out DIR)")
    p.add_argument("--max-seeds", type=int, default=DEFAULT_MAX_SEEDS, metavar="M",
                   help=f"the most seeds a claim may use (default {DEFAULT_MAX_SEEDS}); a claim open at M stops "
                        "with its reason")
    p.add_argument("--time-budget", type=_seconds, default=None, metavar="SECONDS",
                   help="stop adding seeds when the next one would pass this wall time")
    p.add_argument("--futility", type=float, default=DEFAULT_FUTILITY, metavar="P",
                   help=f"stop a claim early when its chance of a decision by M is below P (default "
                        f"{DEFAULT_FUTILITY:g}; 0 turns it off)")
    p.add_argument("--shape", choices=[s.value for s in Shape], default=DEFAULT_SHAPE.value,
                   help=f"the sequential boundary (default {DEFAULT_SHAPE.value}: valid for skewed and heavy-tailed "
                        "per-seed effects; normal: the Pocock t boundary, fewer seeds, assumes normal effects; "
                        "contamination_robust: also a rare blow-up seed, more seeds)")
    p.add_argument("--cache-dir", default=None, metavar="DIR", help="weight cache (default DIR/cache)")
    p.add_argument("--progress", action="store_true", help="per-stage progress of each cell")
    return p


def run(args: argparse.Namespace, cells: Cells) -> int:
    from rope_quant.sweep import claims_decide as cd
    from rope_quant.sweep import decide
    from rope_quant.sweep.claim_store import DirectoryStore
    from rope_quant.sweep.claims_sweep import is_claims_study
    from rope_quant.sweep.manifest import load_manifest

    out = Path(args.dir)
    if args.time_budget is not None and not args.time_budget > 0:  # before the manifest is even read
        raise CLIError(f"--time-budget {args.time_budget:g}: must be a positive number of seconds")
    if args.max_seeds < 2:
        raise CLIError(f"--max-seeds {args.max_seeds}: the rule needs at least 2 seeds")
    if not 0.0 <= args.futility < 1.0:
        raise CLIError(f"--futility {args.futility:g}: must lie in [0, 1) (0 turns the early stop off)")
    manifest = load_manifest(out)
    claims_study = is_claims_study(manifest.study)
    try:
        if claims_study:  # a `rope-quant claims` directory: the registry's claims it planned
            store = DirectoryStore(out, manifest)
            cd.check_claims_inputs(store, args.max_seeds, args.time_budget)
            claims, dropped = _registry_claims(out, store)
            cells_for = cd.study_cells(store)
        else:  # a compare directory: each config against its control
            claims, dropped = decide.check_inputs(manifest, args.max_seeds, args.time_budget), {}
            cells_for, manifest = decide.compare_cells(manifest, claims), decide.with_family(manifest, claims)
    except decide.DecideError as exc:
        raise CLIError(str(exc)) from None
    got = cd.until_decided_in(out, manifest, claims, cells_for, max_seeds=args.max_seeds,
                              time_budget=args.time_budget, futility=args.futility, shape=args.shape,
                              cell_fn=cells.function(args, out), cache_dir=args.cache_dir)
    if claims_study:
        return _write_claims_decisions(out, got, dropped)
    result = decide.write_decisions(out, claims, got)
    print(decide.table(result, claims))
    print(f"decide: {result.stopped}; decisions in {out / decide.DECISIONS_FILE}")
    return 0


def _registry_claims(out: Path, store: Any) -> tuple[list[Any], dict[str, str]]:
    """The registry's claims a claims directory planned, and why the others are left out."""
    from rope_quant.cli.claims import directory_claims

    planned, dropped = directory_claims(store)
    if not planned:
        raise CLIError(f"{out}: no registered claim has its cells in this directory")
    return planned, dropped


def _write_claims_decisions(out: Path, got: Any, dropped: dict[str, str]) -> int:
    """DIR/decisions.json (and .md) of a claims directory in the claims JSON's shape, with the plan and why each
    claim stopped."""
    from rope_quant.analysis import claims_report as cr
    from rope_quant.core.sequential import RULE_SEQUENTIAL
    from rope_quant.sweep.claim_store import DirectoryStore
    from rope_quant.sweep.decide_plan import DECISIONS_FILE

    plan = got.plan
    plan_dict = {"first": plan.first, "max_seeds": plan.max_seeds, "alpha": plan.alpha,
                 "alpha_per_look": plan.alpha_look, "futility": plan.futility, "shape": plan.shape.value,
                 "rule": RULE_SEQUENTIAL}
    decided = got.decided
    data = cr.payload(out, DirectoryStore(out), [d.result for d in decided], dropped, "rope-quant decide",
                      row_extra={d.result.id: {"stopped": d.stopped} for d in decided}, plan=plan_dict)
    files = cr.write_claims(out, data, name=DECISIONS_FILE, markdown="decisions.md")
    print(cr.claims_markdown(data["claims"]))
    for line in cr.left_out_lines(dropped):
        print(line)
    print(f"decide: {len(decided)} claim(s) read under the sequential rule ({plan.describe()}); decisions in "
          f"{files[0]}")
    return 0

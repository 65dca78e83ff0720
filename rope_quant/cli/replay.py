"""``rope-quant replay CLAIMS.json``: a claims JSON's decisions re-read look by look under another sequential
plan (boundary shape, M, futility), with nothing rebuilt (:mod:`rope_quant.analysis.replay`)."""

from __future__ import annotations

import argparse
from typing import Any

from rope_quant.cli.args import CLIError

HELP = "re-read a claims JSON's decisions under another boundary, M or futility level (nothing is rebuilt)"


def add_parser(sub: Any) -> argparse.ArgumentParser:
    from rope_quant.core.boundary import DEFAULT_SHAPE, Shape
    from rope_quant.core.sequential import DEFAULT_FUTILITY, DEFAULT_MAX_SEEDS

    p = sub.add_parser("replay", help=HELP)
    p.add_argument("claims", metavar="CLAIMS.json",
                   help="a claims JSON (pytest --rq-claims-out=DIR: DIR/claims.json; rope-quant claims / decide)")
    p.add_argument("--shape", choices=[s.value for s in Shape], default=DEFAULT_SHAPE.value,
                   help=f"the boundary to re-read under (default {DEFAULT_SHAPE.value})")
    p.add_argument("--first", type=int, default=3, metavar="N",
                   help="the first look: the seeds the run started with (default 3)")
    p.add_argument("--max-seeds", type=int, default=DEFAULT_MAX_SEEDS, metavar="M",
                   help=f"the plan's M (default {DEFAULT_MAX_SEEDS})")
    p.add_argument("--futility", type=float, default=DEFAULT_FUTILITY, metavar="P",
                   help=f"the futility level (default {DEFAULT_FUTILITY:g}; 0 turns it off)")
    return p


def run(args: argparse.Namespace) -> int:
    from rope_quant.analysis.replay import replay_file, table
    from rope_quant.analysis.reproduce import ReproduceError
    from rope_quant.core.sequential import Plan, PlanError

    try:
        plan = Plan(args.first, args.max_seeds, futility=args.futility, shape=args.shape)
    except PlanError as exc:
        raise CLIError(str(exc)) from None
    try:
        rows = replay_file(args.claims, plan)
    except ReproduceError as exc:
        raise CLIError(str(exc)) from None
    if not rows:
        raise CLIError(f"{args.claims}: the claims list is empty")
    print(table(rows, plan))
    return 0

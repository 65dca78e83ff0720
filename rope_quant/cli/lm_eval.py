"""``rope-quant lm-eval``: lm-evaluation-harness tasks on the quantised model of each config and seed."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rope_quant.cli.args import CLIError, did_you_mean, flag
from rope_quant.cli.common import base_config, check_comparator, parse_configs
from rope_quant.cli.execute import Cells, sweep
from rope_quant.cli.options import add_sweep

HELP = "lm-evaluation-harness tasks on the quantised models (offline)"


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("lm-eval", help=HELP,
                       description="Score the quantised model of every config and seed with lm-evaluation-harness "
                                   "(pip install -e \".[eval]\"). Tasks and data come from the local Hugging Face "
                                   "datasets cache or local files (--include-path); nothing is downloaded.")
    p.add_argument("--configs", default="hadamard,pairwise_only", metavar="A,B,...",
                   help="R3 configs (default hadamard,pairwise_only)")
    p.add_argument("--tasks", required=True, metavar="T1,T2,...",
                   help="lm-eval task (or group) names, e.g. piqa,arc_easy,hellaswag,winogrande,lambada_openai")
    p.add_argument("--include-path", default=None, metavar="DIR", help="folder of local lm-eval task YAMLs")
    p.add_argument("--only-include-path", action="store_true",
                   help="index only the tasks under --include-path (skips lm-eval's built-in task index)")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="at most N documents per task")
    p.add_argument("--num-fewshot", type=int, default=None, metavar="K", help="few-shot examples (task default)")
    p.add_argument("--batch-size", type=int, default=1, metavar="B", help="lm-eval batch size (default 1)")
    p.add_argument("--max-length", type=int, default=None, metavar="N",
                   help="lm-eval's window length (default: the model's maximum)")
    return add_sweep(p)


def _check(args: argparse.Namespace, cells: Cells) -> tuple[str, ...]:
    tasks = tuple(dict.fromkeys(t.strip() for t in args.tasks.split(",") if t.strip()))
    if not tasks:
        raise CLIError("--tasks is empty")
    if args.include_path is not None and not Path(args.include_path).expanduser().is_dir():
        raise CLIError(f"--include-path {args.include_path}: not a directory")
    if args.only_include_path and args.include_path is None:
        raise CLIError("--only-include-path needs --include-path")
    for field in ("limit", "num_fewshot", "max_length"):
        value = getattr(args, field)
        if value is not None and value < (1 if field != "num_fewshot" else 0):
            raise CLIError(f"{flag(field)} must be a positive integer, got {value}")
    if args.batch_size < 1:
        raise CLIError(f"--batch-size must be a positive integer, got {args.batch_size}")
    if cells.cell_fn is None:  # the real pipeline needs lm-eval and the tasks: say so before any cell runs
        from rope_quant.experiment.lm_eval import LmEvalMissingError, require_lm_eval

        try:
            require_lm_eval()
        except LmEvalMissingError as exc:
            raise CLIError(str(exc)) from None
    return tasks


def _check_task_names(args: argparse.Namespace, tasks: tuple[str, ...]) -> None:
    """Every task is in lm-eval's index (built-in and/or --include-path): before any model loads, after the
    cheaper checks (indexing the built-in tasks takes seconds)."""
    from rope_quant.experiment.lm_eval import task_manager

    known = task_manager(args.include_path, include_defaults=not args.only_include_path).all_tasks
    unknown = [t for t in tasks if t not in known]
    if unknown:
        where = f"--include-path {args.include_path}" if args.only_include_path else (
            "lm-eval's task index" + (f" or --include-path {args.include_path}" if args.include_path else ""))
        raise CLIError(f"unknown --tasks {', '.join(map(repr, unknown))}"
                       f"{''.join(did_you_mean(t, known) for t in unknown)}; not in {where}")


def run(args: argparse.Namespace, cells: Cells) -> int:
    """Build the lm-eval manifest (config x seed) and run it like every other sweep."""
    from rope_quant.sweep.lm_eval import lm_eval_manifest

    configs = parse_configs(args.configs)
    tasks = _check(args, cells)
    check_comparator(args.comparator, configs)

    def build(args: argparse.Namespace, seeds: tuple[int, ...], used: list[str]) -> Any:
        if cells.cell_fn is None:  # after validate_common's cheaper checks, before any model loads
            _check_task_names(args, tasks)
        manifest = lm_eval_manifest(base_config(args), configs, seeds, tasks, include_path=args.include_path,
                                    include_defaults=not args.only_include_path, limit=args.limit,
                                    num_fewshot=args.num_fewshot, batch_size=args.batch_size,
                                    max_length=args.max_length, comparator=args.comparator)
        print(f"lm-eval tasks: {', '.join(tasks)}" + (f" (local YAMLs: {args.include_path})" if args.include_path
                                                      else ""), flush=True)
        return manifest

    return sweep(args, cells, build)

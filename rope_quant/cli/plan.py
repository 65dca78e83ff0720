"""``rope-quant plan MODEL``: predicted memory, disk and time per stage before any weight is read.

``add_parser(subparsers)`` / ``run(args)``; exit 0 when the run fits, 2 (one ``error: ...`` line with the
remedy on stderr) when it does not, or when MODEL or a setting cannot be read.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rope_quant.seeds import SeedSpecError, parse_seeds

__all__ = ["HELP", "add_parser", "run"]

HELP = "predict peak GPU memory, host RAM, disk and time per stage (no weights are read)"

GIB = 1 << 30


def _lengths(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"lengths must be positive, got {text!r}")
    return values


def _seed_count(text: str) -> int:
    try:
        return len(parse_seeds(text))
    except SeedSpecError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from rope_quant.model import shapes
    from rope_quant.planning import plan as planning  # deferred: `rope-quant --help` loads no torch
    from rope_quant.planning.plan_costs import DeviceName

    p = subparsers.add_parser(
        "plan", help=HELP,
        description="MODEL: a shape name (" + ", ".join(shapes.ShapeName) + "), a checkpoint directory or "
                    "its config.json. Defaults are the paper's protocol.")
    p.add_argument("model")
    p.add_argument("--device", default=DeviceName.H100.value, choices=[d.value for d in DeviceName])
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="storage dtype (default bfloat16 on a GPU, float32 on the CPU)")
    p.add_argument("--offload", default="none", choices=["none", "cpu"],
                   help="cpu: stream one decoder layer at a time to the GPU")
    d = planning.PAPER
    p.add_argument("--calib-windows", type=int, default=d.calib_windows)
    p.add_argument("--seqlen", type=int, default=d.seqlen)
    p.add_argument("--eval-windows", type=int, default=d.eval_windows)
    p.add_argument("--whip-epochs", type=int, default=d.whip_epochs)
    p.add_argument("--configs", type=int, default=d.configs, help="R3 configs in the sweep")
    p.add_argument("--seeds", type=_seed_count, default=d.seeds, metavar="0-2",
                   help="seeds in the sweep, as for compare (0,1,2 or 0-9); the plan counts them")
    p.add_argument("--weights", default="gptq", choices=["gptq", "rtn"])
    p.add_argument("--lengths", type=_lengths, default=(), help="long-context lengths, e.g. 4096,8192")
    p.add_argument("--gpu-memory-gib", type=float, default=None, help="GPU budget (default: the device's)")
    p.add_argument("--host-memory-gib", type=float, default=None, help="host RAM budget (default: unchecked)")
    return p


def _error(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


#: The protocol's counts, each set by the flag of the same name (errors name the flag, not the field).
COUNTS = ("calib_windows", "seqlen", "eval_windows", "whip_epochs", "configs")


def _check_flags(args: argparse.Namespace) -> None:
    """The counts and budgets the user typed, named by their flags (before any config is read)."""
    from rope_quant.cli.args import CLIError, flag

    for name in COUNTS:
        value = getattr(args, name)
        if value < 1:
            raise CLIError(f"{flag(name)} must be a positive integer, got {value}")
    for name in ("gpu_memory_gib", "host_memory_gib"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise CLIError(f"{flag(name)} must be a positive number of GiB, got {value}")


def run(args: argparse.Namespace) -> int:
    from rope_quant.cli.args import CLIError
    from rope_quant.model import arch
    from rope_quant.planning import plan as planning

    try:
        _check_flags(args)
    except CLIError as exc:
        return _error(str(exc))
    try:
        protocol = planning.Protocol(
            calib_windows=args.calib_windows, seqlen=args.seqlen, eval_windows=args.eval_windows,
            whip_epochs=args.whip_epochs, configs=args.configs, seeds=args.seeds, gptq=args.weights == "gptq",
            long_context=tuple(args.lengths))
        model = planning.read_model(args.model)
        plan = planning.make_plan(planning.model_cost(model, args.model), args.device, args.dtype, protocol,
                                  offload=args.offload == "cpu")
    except (planning.PlanError, arch.ArchitectureError) as exc:
        return _error(str(exc).splitlines()[0])
    print(planning.format_plan(plan))
    gpu = None if args.gpu_memory_gib is None else int(args.gpu_memory_gib * GIB)
    host = None if args.host_memory_gib is None else int(args.host_memory_gib * GIB)
    try:
        planning.check_fits(plan, gpu, host)
    except planning.PlanDoesNotFit as exc:
        return _error(str(exc))
    return 0

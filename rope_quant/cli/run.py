"""``rope-quant run``: one cell (one R3 config at one seed)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from rope_quant.cli.args import CLIError, check_name
from rope_quant.cli.execute import Cells, print_first_error, print_settings
from rope_quant.cli.options import add_common
from rope_quant.defaults import DEFAULT_COMPARATOR

HELP = "run one cell"


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("run", help=HELP)
    p.add_argument("--config", default="hadamard", help="R3 registry name (default hadamard)")
    p.add_argument("--seed", type=int, default=0, help="seed (default 0; 0 <= seed < 2**63)")
    p.add_argument("--block", type=int, default=None, help="block size for block_* transforms")
    p.add_argument("--phi-star", action="store_true", help="position-averaged angle φ* (same as --angle phi_star)")
    p.add_argument("--average-length", type=int, default=None, help="φ* averaging length (default seqlen)")
    p.add_argument("--name", default=None, help="cell name in the results directory (default: --config)")
    add_common(p, seeds=False)
    return p


def _check(args: argparse.Namespace) -> None:
    from rope_quant.cli.common import valid_configs
    from rope_quant.cli.validate import validate_common
    from rope_quant.core import transforms
    from rope_quant.seeds import SEED_LIMIT

    check_name(args.config, "config", valid_configs())
    if not 0 <= args.seed < SEED_LIMIT:
        raise CLIError(f"--seed must satisfy 0 <= seed < 2**63, got {args.seed}")
    if transforms.needs_block(args.config) and args.block is None:
        raise CLIError(f"--config {args.config} needs --block b (a power of two dividing head_dim)")
    if args.block is not None and not transforms.needs_block(args.config):
        raise CLIError(f"--block applies to block_* configs only, not {args.config!r}")
    validate_common(args)


def run(args: argparse.Namespace, cells: Cells) -> int:
    _check(args)
    from rope_quant.cli.validate import check_memory
    from rope_quant.model.offload import set_default_mode

    mode = check_memory(args)  # exit 2 with the plan's remedy before anything loads or is written
    with set_default_mode(mode):
        return _run(args, cells)


def _run(args: argparse.Namespace, cells: Cells) -> int:
    from rope_quant.cli.common import base_config, resolve_budget
    from rope_quant.experiment.config import AngleRule
    from rope_quant.experiment.envinfo import env_info, write_env
    from rope_quant.sweep import records
    from rope_quant.sweep.manifest import Manifest, ManifestMismatchError, cell_conflict, write_manifest
    from rope_quant.sweep.preflight import preflight
    from rope_quant.sweep.runner import run_cell_record

    used = resolve_budget(args)[1]
    angle = AngleRule.PHI_STAR.value if args.phi_star else args.angle
    cfg = base_config(args, seed=args.seed, r3=args.config, r3_block=args.block, angle=angle,
                      average_length=args.average_length)
    name = args.name or (args.config if args.block is None else f"{args.config}-b{args.block}")
    meta = {name: {"r3": args.config, **({"block": args.block} if args.block else {})}}
    manifest = Manifest(cells=[(name, cfg)], study="run", comparator=DEFAULT_COMPARATOR, meta=meta)
    out = Path(args.out)
    print_settings(args, cfg, used)
    path = records.cell_path(out, name, cfg)
    changed = cell_conflict(out, name, cfg)
    if changed and not args.force_new_manifest:
        raise ManifestMismatchError(
            f"{out} already holds cell {name!r} seed {args.seed} with other settings:\n  " + "\n  ".join(changed)
            + "\npass --name NEW for a separate cell, or --force-new-manifest to replace this one")
    if args.resume and records.is_complete(path, cfg.key()):
        print(f"already complete: {path}")
    else:
        for note in preflight(manifest, cells.cache(), load=cells.cell_fn is None):
            print(f"note: {note}", file=sys.stderr)
        out.mkdir(parents=True, exist_ok=True)
        write_manifest(out, manifest, merge=True)
        write_env(out, args.device, cfg.rotation.protocol())
        start = time.perf_counter()
        written, ok = run_cell_record(name, cfg, out, cells.function(args, out),
                                      env_info(args.device, cfg.rotation.protocol()))
        print(f"{'done' if ok else 'FAILED'} in {time.perf_counter() - start:.1f}s: {written}")
        if not ok:
            print_first_error(out, manifest, [0])
            return 1
    result = (records.read_record(path) or {}).get("result", {})
    keys = ("ppl", "n_windows", "n_tokens", "k_range_mean", "k_range_max", "delta_mean", "k_rel_err")
    print(json.dumps({k: result.get(k) for k in keys}, indent=2))
    return 0

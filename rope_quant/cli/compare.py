"""``rope-quant compare``, ``support`` and ``estimators``: the main comparison and its two ablations."""

from __future__ import annotations

import argparse
from typing import Any

from rope_quant.cli.args import CLIError, parse_int_list, parse_names, values
from rope_quant.cli.common import DEFAULT_CONFIGS, base_config, check_comparator, head_dim, parse_configs_or_preset
from rope_quant.cli.execute import Cells, sweep
from rope_quant.cli.options import add_sweep

HELP = {"compare": "the main comparison over R3 configs and seeds",
        "support": "mixing support: block size b against K range, error and gap",
        "estimators": "angle estimators rows / k_only / balanced (+ φ*)"}
BLOCK_TRANSFORMS = ("block_hadamard", "block_hadamard_contiguous", "block_hadamard_raw")
ESTIMATOR_TRANSFORMS = ("pairwise_only", "pairwise_plus_hadamard")


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("compare", help=HELP["compare"])
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), metavar="A,B,...|beyond|beyond2|lower-bits",
                   help=f"R3 configs (default {','.join(DEFAULT_CONFIGS)}); 'beyond': the preset of "
                        "head-dependent, range-objective and K-only φ* angles against hadamard; 'beyond2': the "
                        "foldable R3s (pairwise_scaled, prerope_channel_scale) and learned_orthogonal against "
                        "hadamard, with the share of pairwise_only's gap each closes; 'lower-bits': "
                        "App. F, hadamard, pairwise_plus_hadamard and pairwise_only at W4A4KV4, W4A3KV4 and "
                        "W3A3KV3, each paired against hadamard at the same bits")
    return add_sweep(p)


def add_support_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("support", help=HELP["support"])
    p.add_argument("--blocks", default=None, metavar="2,4,...",
                   help="block sizes (default powers of two 2 ... head_dim)")
    p.add_argument("--transform", default="block_hadamard", choices=BLOCK_TRANSFORMS,
                   help="block transform (default block_hadamard)")
    return add_sweep(p)


def add_estimators_parser(sub: Any) -> argparse.ArgumentParser:
    from rope_quant.experiment.config import Estimator

    default = (Estimator.ROWS.value, Estimator.K_ONLY.value, Estimator.BALANCED.value)
    p = sub.add_parser("estimators", help=HELP["estimators"])
    p.add_argument("--estimators", default=",".join(default), metavar="A,B,...",
                   help=f"estimators (default {','.join(default)}; per_head also valid)")
    p.add_argument("--phi-star", action="store_true",
                   help="add the position-averaged φ* and its branch-matched φ̂ control (with --estimator)")
    p.add_argument("--average-length", type=int, default=None, help="φ* averaging length (default seqlen)")
    p.add_argument("--transform", default="pairwise_only", choices=ESTIMATOR_TRANSFORMS,
                   help="R3 using the angles (default pairwise_only)")
    return add_sweep(p)


def run(args: argparse.Namespace, cells: Cells) -> int:
    from rope_quant.defaults import LOWER_BIT_SETTINGS
    from rope_quant.sweep import presets

    configs, preset = parse_configs_or_preset(args.configs, "compare")
    check_comparator(args.comparator, configs)
    if preset == presets.LOWER_BITS:
        bits = [f"--{q}-bits {getattr(args, f'{q}_bits')}" for q in ("w", "a", "k", "v")
                if getattr(args, f"{q}_bits") != 4]
        if bits:
            raise CLIError(f"--configs lower-bits sets each cell's bits itself (App. F: "
                           f"{', '.join(LOWER_BIT_SETTINGS)}): drop {', '.join(bits)}")

    def build(args: argparse.Namespace, seeds: tuple[int, ...], used: list[str]) -> Any:
        if preset == presets.BEYOND:
            return presets.beyond_manifest(base_config(args), seeds, comparator=args.comparator)
        if preset == presets.BEYOND2:
            return presets.beyond2_manifest(base_config(args), seeds, comparator=args.comparator)
        if preset == presets.LOWER_BITS:
            return presets.lower_bits_manifest(base_config(args), seeds, comparator=args.comparator)
        return presets.compare_manifest(base_config(args), configs, seeds, comparator=args.comparator)

    if preset == presets.BEYOND2:
        from rope_quant.analysis.gap_share import write_gap_share_report

        return sweep(args, cells, build, lambda out: write_gap_share_report(out, comparator=args.comparator,
                                                                            figures=args.figures))
    return sweep(args, cells, build)


def _blocks(args: argparse.Namespace, used: list[str]) -> tuple[int, ...]:
    if args.blocks is not None:
        blocks = parse_int_list(args.blocks, "--blocks", minimum=2)
        odd = [b for b in blocks if b & (b - 1)]
        if odd:
            raise CLIError(f"--blocks must be powers of two (2, 4, 8, ...), got {', '.join(map(str, odd))}")
        return blocks
    dim = head_dim(args.model)
    blocks = tuple(2 ** i for i in range(1, dim.bit_length()) if dim % 2 ** i == 0)
    if not blocks:
        raise CLIError(f"model {args.model} has an odd head_dim={dim}: no block size b = 2, 4, ... "
                       "divides it (RoPE pairs need an even head_dim)")
    used.append("blocks=" + ",".join(map(str, blocks)))
    return blocks


def run_support(args: argparse.Namespace, cells: Cells) -> int:
    from rope_quant.sweep import presets

    if args.blocks is not None:
        _blocks(args, [])  # a malformed list is refused before anything loads
    check_comparator(args.comparator, ())

    def build(args: argparse.Namespace, seeds: tuple[int, ...], used: list[str]) -> Any:
        return presets.support_manifest(base_config(args), _blocks(args, used), seeds, transform=args.transform,
                                        comparator=args.comparator)

    return sweep(args, cells, build)


def run_estimators(args: argparse.Namespace, cells: Cells) -> int:
    from rope_quant.experiment.config import Estimator
    from rope_quant.sweep import presets

    estimators = parse_names(args.estimators, "estimator", values(Estimator))
    check_comparator(args.comparator, ())

    def build(args: argparse.Namespace, seeds: tuple[int, ...], used: list[str]) -> Any:
        return presets.estimators_manifest(base_config(args), estimators, seeds, transform=args.transform,
                                           phi_star=args.phi_star, phi_star_estimator=args.estimator,
                                           average_length=args.average_length, comparator=args.comparator)

    return sweep(args, cells, build)

"""``rope-quant niah``: needle-in-a-haystack retrieval in the RULER format (App. G)."""

from __future__ import annotations

import argparse
from typing import Any

from rope_quant.cli.args import CLIError, parse_int_list
from rope_quant.cli.common import base_config, check_comparator, flags_for_fields, parse_configs
from rope_quant.cli.execute import Cells, sweep
from rope_quant.cli.options import add_sweep
from rope_quant.cli.validate import check_corpus

HELP = "needle-in-a-haystack retrieval in the RULER format (App. G)"
#: NiahSpec fields set by the flag of the same name (its errors name the flag).
NIAH_FLAGGED = ("lengths", "depths", "probes", "digits", "template")


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """``rope-quant niah``: needle-in-a-haystack retrieval (RULER format) of FP and each quantised config."""
    from rope_quant.scoring.niah import Template
    from rope_quant.sweep.niah import DEFAULT_CONFIGS

    p = sub.add_parser("niah", help=HELP,
                       description="Greedy retrieval of a key-value needle from a corpus haystack at several "
                                   "lengths and depths, with the quantised KV cache in effect during generation; "
                                   "FP (the unquantised model) is the reference.")
    p.add_argument("--lengths", default="256,512,1024", metavar="L1,L2,...",
                   help="prompt lengths in tokens (default 256,512,1024)")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), metavar="A,B,...",
                   help=f"R3 configs (default {','.join(DEFAULT_CONFIGS)}); FP is added unless --no-fp")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", metavar="D1,D2,...",
                   help="needle depths as fractions of the haystack (default 0,0.25,0.5,0.75,1: App. G's 5)")
    p.add_argument("--probes", type=int, default=20, metavar="N",
                   help="probes per (length, depth) and seed (default 20, App. G)")
    p.add_argument("--digits", type=int, default=7, metavar="N", help="digits of the magic number (default 7)")
    p.add_argument("--template", default="plain", choices=tuple(t.value for t in Template),
                   help="plain text to complete (default) or the tokenizer's chat template")
    p.add_argument("--haystack", default=None, metavar="NAME|PATH",
                   help="haystack corpus (default: --corpus); its evaluation split is used")
    p.add_argument("--no-fp", dest="fp", action="store_false", help="skip the unquantised reference cells")
    return add_sweep(p)


def run(args: argparse.Namespace, cells: Cells) -> int:
    """Build the NIAH manifest (seed x [fp, configs]) and run it like every other sweep, with the NIAH report."""
    from rope_quant.analysis.niah_report import niah_report
    from rope_quant.scoring.niah import NiahError, NiahSpec
    from rope_quant.sweep.niah import niah_manifest

    configs = parse_configs(args.configs)
    check_comparator(args.comparator, configs)
    lengths = parse_int_list(args.lengths, "--lengths", minimum=16)
    try:
        depths = tuple(float(d) for d in args.depths.split(",") if d.strip())
    except ValueError:
        raise CLIError(f"--depths expects comma-separated fractions in [0, 1], got {args.depths!r}") from None
    haystack = check_corpus(args.haystack or args.corpus)
    try:
        spec = NiahSpec(lengths=lengths, depths=depths, probes=args.probes, corpus=haystack, digits=args.digits,
                        template=args.template)
    except NiahError as exc:
        raise CLIError(flags_for_fields(str(exc), NIAH_FLAGGED)) from None

    def build(args: argparse.Namespace, seeds: tuple[int, ...], used: list[str]) -> Any:
        manifest = niah_manifest(base_config(args), configs, seeds, spec, fp=args.fp, comparator=args.comparator)
        print(f"niah: lengths={','.join(map(str, lengths))} depths={','.join(f'{d:g}' for d in depths)} "
              f"probes={args.probes} digits={args.digits} template={args.template} haystack={haystack} "
              "(exact match of the first number in the greedy continuation)", flush=True)
        return manifest

    return sweep(args, cells, build,
                 report_fn=lambda out: niah_report(out, comparator=args.comparator, figures=args.figures))

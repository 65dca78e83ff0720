"""``rope-quant static``: the static per-channel control of App. A.6 (scopes both/act/kv against dynamic)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rope_quant.cli.args import CLIError, parse_names, values
from rope_quant.cli.common import base_config, check_comparator, parse_configs
from rope_quant.cli.execute import Cells, sweep
from rope_quant.cli.long_context import lengths as context_lengths
from rope_quant.cli.options import add_sweep
from rope_quant.cli.validate import check_corpus

HELP = "static per-channel control (App. A.6/D/H): scopes both/act/kv vs dynamic"


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """``rope-quant static``: the static per-channel control of A.6 (scales per corpus and length)."""
    from rope_quant.experiment.static_control import PAPER_MAX_WINDOWS, StaticProtocol

    p = sub.add_parser("static", help=HELP)
    p.add_argument("--lengths", default=None, metavar="L1,L2,...",
                   help="context lengths (CPU 256,512,1024; CUDA 2048,4096,8192,16384)")
    p.add_argument("--configs", default="hadamard,pairwise_only,pairwise_plus_hadamard", metavar="A,B,...",
                   help="R3 configs (default hadamard,pairwise_only,pairwise_plus_hadamard)")
    p.add_argument("--scopes", default="dynamic,act,kv,both", metavar="S1,S2,...",
                   help="static scopes: both (activations and KV), act, kv; dynamic = no static control "
                        "(default all four: the A.8 non-additivity check needs them)")
    p.add_argument("--protocol", default=StaticProtocol.TRANSDUCTIVE.value, choices=values(StaticProtocol),
                   help="where the scales come from: transductive = windows of the evaluation corpus (A.6, "
                        "the paper's protocol); calibration-split = the calibration split (out of sample, not "
                        "in the paper)")
    p.add_argument("--static-windows", type=int, default=PAPER_MAX_WINDOWS, metavar="N",
                   help=f"at most N non-overlapping estimation windows per length (A.6: {PAPER_MAX_WINDOWS}; "
                        "fewer is a printed deviation)")
    p.add_argument("--eval-corpus", default=None, metavar="NAME|PATH",
                   help="corpus scored (default: --corpus's evaluation split); calibration stays on --corpus")
    p.add_argument("--quant-diagnostic", action="store_true",
                   help="record the selected step Δ and the relative error of every quantiser call (App. E)")
    return add_sweep(p)


def run(args: argparse.Namespace, cells: Cells) -> int:
    from rope_quant.analysis import static_report
    from rope_quant.sweep import static

    configs = parse_configs(args.configs)
    check_comparator(args.comparator, configs)
    scopes = tuple(static.parse_scope(n) for n in parse_names(
        args.scopes, "static scope", (static.DYNAMIC, "act", "kv", "both")))
    if args.static_windows < 1:
        raise CLIError(f"--static-windows must be an integer >= 1, got {args.static_windows}")
    if args.lengths is not None:
        context_lengths(args, [])
    if args.eval_corpus:
        check_corpus(args.eval_corpus)

    def build(args: argparse.Namespace, seeds: tuple[int, ...], used: list[str]) -> Any:
        manifest = static.static_manifest(base_config(args), configs, seeds, context_lengths(args, used), scopes,
                                          protocol=args.protocol, max_windows=args.static_windows,
                                          eval_corpus=args.eval_corpus, quant_diagnostic=args.quant_diagnostic,
                                          comparator=args.comparator)
        scoped = [cfg for _, cfg in manifest.cells if cfg.scope is not None]
        if scoped:
            first = scoped[0]
            print("static protocol: " + ("transductive (A.6: scales from the evaluation corpus)"
                                         if first.protocol.value == "transductive" else
                                         "calibration-split (out of sample; the paper ran the transductive "
                                         "protocol)"), flush=True)
            for line in static.deviations(first):
                print(f"deviation from A.6: {line}", flush=True)
        return manifest

    rc = sweep(args, cells, build)
    out = Path(args.out)
    text = static_report.write_static_report(out, comparator=args.comparator)
    print()
    print(text)
    print(f"wrote {out / 'static.md'}")
    return rc

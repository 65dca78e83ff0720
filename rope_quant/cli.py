"""The ``rope-quant`` command line: run cells and sweeps, verify φ*, and report (argparse).

Subcommands::

    rope-quant run           one cell (one R3 config at one seed)
    rope-quant compare       the paper's main comparison (hadamard vs pairwise vs identity ...);
                             ``--configs beyond``: per-head / range-objective / K-only φ* angles;
                             ``--configs lower-bits``: App. F (W4A3KV4, W3A3KV3 against W4A4KV4)
    rope-quant support       mixing support: block size b = 2 ... d_h (K range, relative error, gap)
    rope-quant estimators    rows / k_only / balanced (+ φ* with --phi-star)
    rope-quant long-context  perplexity gap against context length L (crossover)
    rope-quant lm-eval       lm-evaluation-harness tasks on the quantised models (extra ``[eval]``)
    rope-quant niah          needle-in-a-haystack retrieval, RULER format (App. G)
    rope-quant static        the static per-channel control (App. A.6): scopes both/act/kv against dynamic
    rope-quant verify        φ* artefacts of a results directory (App. A.5)
    rope-quant report        tables and figures from a results directory (--check: completion only)
    rope-quant models        embedded models and the model cache (--clear-cache empties it)

Defaults run on CPU in minutes on the embedded SmolLM2-135M and the ``pydoc`` corpus; with
``--device cuda`` the paper's budgets (seqlen 2048, 128 calibration windows, all evaluation windows)
are the defaults. ``--model PATH`` takes a local Hugging Face checkpoint or a .gguf file.

Tests and embedding code inject what computes the cells: ``main(argv, cell_fn=fn)`` runs every cell
through ``fn(cfg) -> dict`` instead of the pipeline, ``main(argv, models=cache)`` gives the real
pipeline a pre-filled :class:`~rope_quant.sweep.models.ModelCache`.

Before any cell runs, the sweep commands check their input (:mod:`rope_quant.sweep.preflight`): numeric
bounds, the model (read once; the real pipeline loads it once and the cells reuse it), the Hadamard orders
and block sizes the cells need at the model's head_dim / hidden size, the corpus against the windows, and
the results directory's existing ``manifest.json`` (a changed study is refused with a diff of the changed
settings unless ``--force-new-manifest``; more or fewer seeds or configs of the same study extend it).

Exit codes: 0 success; 1 some cells failed (the first error is printed in full; or ``report --check``
found incomplete cells, or φ* was not verified); 2 bad input (usage, model, corpus, geometry, a changed
study in ``--out``), reported before any cell runs; 130 interrupted (rerun the same command to resume).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rope_quant.defaults import DEFAULT_CORPUS, DEFAULT_MODEL
from rope_quant.experiment.config import (
    PIPELINE_ROTATIONS,
    AngleRule,
    DType,
    Estimator,
    Objective,
    RotationKind,
    WeightMode,
)

if TYPE_CHECKING:
    from rope_quant.sweep.models import ModelCache

CellFn = Callable[[Any], Mapping[str, Any]]

DEFAULT_CONFIGS = ("hadamard", "pairwise_only", "pairwise_plus_hadamard", "identity")
DEFAULT_SEEDS = (0, 1, 2)
DEFAULT_ESTIMATORS = (Estimator.ROWS.value, Estimator.K_ONLY.value, Estimator.BALANCED.value)
#: ``--configs`` preset name for the beyond-the-paper study (``presets.beyond_manifest``).
BEYOND = "beyond"
#: Defaults per device: window length, calibration / evaluation windows (None = every window), the
#: weight quantiser and its MSE clipping search. The CPU budget keeps the default ``compare`` (4 configs
#: x 3 seeds) within about 15 minutes on 2 cores: GPTQ with the MSE search took about 27 minutes for ONE
#: seed at 8 x 512 calibration tokens on the shared 2-core machine, so CPU defaults to RTN without the
#: search (``--weights gptq --w-mse`` restores the paper's setting, as on CUDA).
BUDGETS: dict[str, dict[str, Any]] = {
    "cpu": {"seqlen": 512, "calib_windows": 4, "eval_windows": 4, "weights": WeightMode.RTN.value, "w_mse": True},
    "cuda": {"seqlen": 2048, "calib_windows": 128, "eval_windows": None, "weights": WeightMode.GPTQ.value,
             "w_mse": True},
}
BUDGET_FIELDS = ("seqlen", "calib_windows", "eval_windows", "weights", "w_mse")
#: The offline rotations the CLI offers: the pipeline's ``RotationKind`` values (``given`` needs a matrix
#: from Python).
ROTATION_CHOICES = tuple(k.value for k in PIPELINE_ROTATIONS)
#: Smallest value of the numeric budget flags (a window needs two tokens: one predicts the next).
BUDGET_MINIMUM = {"seqlen": 2, "calib_windows": 1, "eval_windows": 1}
LONG_CONTEXT_LENGTHS = {"cpu": (256, 512, 1024), "cuda": (2048, 4096, 8192, 16384)}


class CLIError(ValueError):
    """Bad command-line input (exit code 2)."""


# ----------------------------------------------------------------------------- parsing helpers


def parse_int_list(text: str, what: str, *, minimum: int | None = None) -> tuple[int, ...]:
    """``"0,1,2"`` -> ``(0, 1, 2)``; distinct integers, at least one."""
    items = [s.strip() for s in str(text).split(",")]
    if not text or not all(items):
        raise CLIError(f"{what} must be a comma-separated list of integers like 0,1,2, got {text!r}")
    try:
        values = tuple(int(s) for s in items)
    except ValueError:
        raise CLIError(
            f"{what} must be a comma-separated list of integers like 0,1,2, got {text!r}"
        ) from None
    if len(set(values)) != len(values):
        raise CLIError(f"{what} has repeated values: {text!r}")
    if minimum is not None and any(v < minimum for v in values):
        raise CLIError(f"{what} values must be >= {minimum}, got {text!r}")
    return values


def values(enum_cls: type) -> tuple[str, ...]:
    """The values of a ``StrEnum``: the argparse choices and valid names of a flag."""
    return tuple(member.value for member in enum_cls)


def parse_names(text: str, what: str, valid: Sequence[str]) -> tuple[str, ...]:
    """Comma-separated names, each in ``valid`` (the error lists the valid names)."""
    names = tuple(s.strip() for s in str(text).split(",") if s.strip())
    if not names:
        raise CLIError(f"{what} is empty")
    if len(set(names)) != len(names):
        raise CLIError(f"{what} has repeated names: {text!r}")
    unknown = [n for n in names if n not in valid]
    if unknown:
        raise CLIError(f"unknown {what} {', '.join(map(repr, unknown))}; valid: {', '.join(valid)}")
    return names


def valid_configs() -> list[str]:
    """R3 registry names (``transforms.names()``)."""
    from rope_quant.core import transforms

    return list(transforms.names())


def parse_configs(text: str) -> tuple[str, ...]:
    """R3 names for compare / long-context; block transforms need ``support`` (they take a block size)."""
    from rope_quant.core import transforms

    configs = parse_names(text, "config", valid_configs())
    blocky = [c for c in configs if transforms.needs_block(c)]
    if blocky:
        raise CLIError(f"{', '.join(blocky)} need a block size: use `rope-quant support --transform NAME` "
                       "or `rope-quant run --config NAME --block b`")
    return configs


def check_corpus(name: str) -> str:
    """An embedded corpus name, ``wikitext2``, or an existing local path."""
    from rope_quant.experiment import data

    known = data.list_corpora(include_unavailable=True)
    if name in known and name not in data.list_corpora():
        raise CLIError(f"corpus {name!r} is not installed here; available: {', '.join(data.list_corpora())}")
    if name in known or name.lower() in data.HF_WIKITEXT_NAMES or Path(name).expanduser().exists():
        return name
    raise CLIError(f"unknown corpus {name!r}: use one of {', '.join(known)}, wikitext2, or a local path")


def check_model(name: str) -> str:
    """An embedded model name or an existing local checkpoint / .gguf file."""
    from rope_quant.model.loading import ModelNotFoundError, resolve_model

    try:
        resolve_model(name)
    except ModelNotFoundError as exc:
        raise CLIError(str(exc)) from None
    return name


def check_device(device: str) -> str:
    if device == "cpu":
        return device
    if device == "cuda" or device.startswith("cuda:"):
        import torch

        if not torch.cuda.is_available():
            raise CLIError(f"--device {device}: CUDA is not available on this machine")
        return device
    raise CLIError(f"--device must be cpu, cuda or cuda:N, got {device!r}")


# ----------------------------------------------------------------------------- parser


def _common(parser: argparse.ArgumentParser, *, seeds: bool = True) -> None:
    g = parser.add_argument_group("cell configuration")
    g.add_argument("--model", default=DEFAULT_MODEL, metavar="NAME|PATH",
                   help=f"embedded model name, local HF checkpoint or .gguf file (default {DEFAULT_MODEL})")
    g.add_argument("--corpus", default=DEFAULT_CORPUS, metavar="NAME|PATH",
                   help="pydoc, shakespeare, debian-reference, kjv, wikitext2 or a path "
                   f"(default {DEFAULT_CORPUS})")
    if seeds:
        g.add_argument("--seeds", default=None, metavar="0,1,2",
                       help="comma-separated seeds (default 0,1,2)")
    g.add_argument("--estimator", default=Estimator.ROWS.value, choices=values(Estimator),
                   help="covariance pooling for the pairwise angles (default rows)")
    g.add_argument("--angle", default=AngleRule.PHI_HAT.value, choices=values(AngleRule),
                   help="angle rule of the variance objective: φ̂ (the paper's pairwise_only), φ̂ wrapped to "
                        "φ*'s branch (App. J's control) or the position-averaged φ* (default phi_hat)")
    g.add_argument("--r1", default=None, choices=ROTATION_CHOICES,
                   help="R1: whip (the paper, A.1; default), random_hadamard (QuaRot's diag(s)·H), the plain "
                        "hadamard, or identity. On a model whose architecture refuses R1 (Gemma 3's sandwich "
                        "norms) the default is identity when activations stay 16-bit (--a-bits 16) and an "
                        "error otherwise")
    g.add_argument("--r2", default=RotationKind.RANDOM_HADAMARD.value, choices=ROTATION_CHOICES,
                   help="R2: random_hadamard (the paper keeps whip's initialisation, A.8; default), hadamard, "
                        "identity, or whip (trains R2: a deviation from A.8)")
    g.add_argument("--whip-epochs", type=int, default=None, metavar="N",
                   help="epochs of R1's whip fit (default 10 on every device: the fit takes seconds on CPU)")
    g.add_argument("--objective", default=Objective.VARIANCE.value, choices=values(Objective),
                   help="angle objective: variance (φ̂/φ*, the paper), a top-k grid, or range (coordinate "
                        "descent on the K quantiser's mean tokenwise range; default variance)")
    for q in ("w", "a", "k", "v"):
        g.add_argument(f"--{q}-bits", type=int, default=4, metavar="B",
                       help=f"{q.upper()} bits (16 = off; default 4)")
    g.add_argument("--weights", default=None, choices=values(WeightMode),
                   help="weight quantiser, cached per seed (CPU rtn, CUDA gptq)")
    g.add_argument("--w-mse", action=argparse.BooleanOptionalAction, default=None,
                   help="per-channel MSE clipping search for the weight scales (default on for CPU and CUDA; "
                        "--no-w-mse is faster)")
    g.add_argument("--seqlen", type=int, default=None, metavar="N",
                   help="window length, >= 2 (CPU 512, CUDA 2048)")
    g.add_argument("--calib-windows", type=int, default=None, metavar="N",
                   help="calibration windows (CPU 4, CUDA 128)")
    g.add_argument("--eval-windows", type=int, default=None, metavar="N",
                   help="evaluation windows (CPU 4, CUDA all; 0 = all)")
    g.add_argument("--device", default="cpu", metavar="cpu|cuda", help="compute device (default cpu)")
    g.add_argument("--dtype", default=DType.FLOAT32.value, choices=values(DType),
                   help="model dtype (default float32)")
    r = parser.add_argument_group("results")
    r.add_argument("--out", required=True, metavar="DIR", help="results directory")
    r.add_argument("--no-resume", dest="resume", action="store_false",
                   help="recompute cells that are already complete (default: skip them)")
    r.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="weight/statistics cache (default DIR/cache)")
    r.add_argument("--progress", action="store_true", help="progress bars inside each cell")
    r.add_argument("--force-new-manifest", action="store_true",
                   help="replace the manifest of --out even when it describes a different study "
                        "(default: refuse with the changed settings)")


def _sweep_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("execution (parallelism through existing engines)")
    g.add_argument("--shard", default=None, metavar="i/n",
                   help="run only shard i of n (0-based, deterministic contiguous split); 'auto' reads "
                        "SLURM_ARRAY_TASK_ID/COUNT or PYTEST_XDIST_WORKER/COUNT")
    g.add_argument("--slurm", type=int, default=None, metavar="N",
                   help="submit N Slurm array tasks through submitit (if installed) and return")
    g.add_argument("--slurm-param", action="append", default=[], metavar="KEY=VALUE",
                   help="submitit executor parameter (repeatable), e.g. timeout_min=120, slurm_partition=gpu, "
                        "gpus_per_node=1; cluster=local runs the array tasks as local subprocesses")
    g.add_argument("--comparator", default="hadamard", help="config every other one is paired against")
    g.add_argument("--no-figures", dest="figures", action="store_false", help="skip the PNG figures")
    g.add_argument("--quiet", action="store_true", help="do not print per-cell progress")
    g.add_argument("--keep-cache", action="store_true",
                   help="keep every seed's weights and statistics in the default cache DIR/cache (default: "
                        "delete them once all cells using them are complete; an explicit --cache-dir is "
                        "never pruned)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rope-quant",
        description="RoPE-commuting vs Hadamard R3 rotations in W4A4KV4 rotation-based PTQ.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="run one cell")
    p.add_argument("--config", default="hadamard", help="R3 registry name (default hadamard)")
    p.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    p.add_argument("--block", type=int, default=None, help="block size for block_* transforms")
    p.add_argument("--phi-star", action="store_true", help="position-averaged angle φ* (same as --angle phi_star)")
    p.add_argument("--average-length", type=int, default=None, help="φ* averaging length (default seqlen)")
    p.add_argument("--name", default=None, help="cell name in the results directory (default: --config)")
    _common(p, seeds=False)

    p = sub.add_parser("compare", help="the main comparison over R3 configs and seeds")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), metavar="A,B,...|beyond|lower-bits",
                   help=f"R3 configs (default {','.join(DEFAULT_CONFIGS)}); 'beyond': the preset of "
                        "head-dependent, range-objective and K-only φ* angles against hadamard; 'lower-bits': "
                        "App. F, hadamard, pairwise_plus_hadamard and pairwise_only at W4A4KV4, W4A3KV4 and "
                        "W3A3KV3, each paired against hadamard at the same bits")
    _common(p)
    _sweep_options(p)

    p = sub.add_parser("support", help="mixing support: block size b against K range, error and gap")
    p.add_argument("--blocks", default=None, metavar="2,4,...",
                   help="block sizes (default powers of two 2 ... head_dim)")
    p.add_argument("--transform", default="block_hadamard",
                   choices=("block_hadamard", "block_hadamard_contiguous", "block_hadamard_raw"),
                   help="block transform (default block_hadamard)")
    _common(p)
    _sweep_options(p)

    p = sub.add_parser("estimators", help="angle estimators rows / k_only / balanced (+ φ*)")
    p.add_argument("--estimators", default=",".join(DEFAULT_ESTIMATORS), metavar="A,B,...",
                   help=f"estimators (default {','.join(DEFAULT_ESTIMATORS)}; per_head also valid)")
    p.add_argument("--phi-star", action="store_true",
                   help="add the position-averaged φ* and its branch-matched φ̂ control (with --estimator)")
    p.add_argument("--average-length", type=int, default=None, help="φ* averaging length (default seqlen)")
    p.add_argument("--transform", default="pairwise_only",
                   choices=("pairwise_only", "pairwise_plus_hadamard"),
                   help="R3 using the angles (default pairwise_only)")
    _common(p)
    _sweep_options(p)

    p = sub.add_parser("long-context", help="perplexity gap against context length")
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
    _common(p)
    _sweep_options(p)

    add_lm_eval_parser(sub)
    add_niah_parser(sub)
    add_static_parser(sub)

    p = sub.add_parser("verify", help="verify φ* from the artefacts of a results directory")
    p.add_argument("dir", metavar="DIR", help="results directory")
    p.add_argument("--all", action="store_true",
                   help="also check φ̂ cells (averaging length = seqlen); default: φ* cells only")
    p.add_argument("--tol", type=float, default=None, help="relative excess tolerance (default 5e-5)")

    p = sub.add_parser("models", help="embedded models and the per-machine model cache (location, clearing)")
    p.add_argument("--clear-cache", action="store_true",
                   help="delete the model cache (assembled GGUFs, converted states); the next load rebuilds it")

    p = sub.add_parser("report", help="tables and figures from a results directory")
    p.add_argument("dir", metavar="DIR", help="results directory")
    p.add_argument("--check", action="store_true", help="only check completion (exit 1 if incomplete)")
    p.add_argument("--comparator", default=None, help="comparator config (default: the manifest's)")
    p.add_argument("--family", default=None, metavar="A,B,...", help="Holm family (default: manifest's)")
    p.add_argument("--level", type=float, default=0.90, help="paired CI level (default 0.90)")
    p.add_argument("--no-figures", dest="figures", action="store_false", help="skip the PNG figures")
    return parser


# ----------------------------------------------------------------------------- configuration


def resolve_budget(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """seqlen, windows, weights and w_mse from the flags or the device defaults; lists the defaults used."""
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    budget, used = {}, []
    for field in BUDGET_FIELDS:
        value = getattr(args, field)
        if value is None:
            value = BUDGETS[kind][field]
            used.append(f"{field}={'all' if value is None else value}")
        elif field == "eval_windows" and value == 0:
            value = None
        elif field in BUDGET_MINIMUM and value < BUDGET_MINIMUM[field]:
            raise CLIError(f"--{field.replace('_', '-')} must be an integer >= {BUDGET_MINIMUM[field]}"
                           f"{' (0 = all)' if field == 'eval_windows' else ''}, got {value}")
        budget[field] = value
    return budget, used


def base_config(args: argparse.Namespace, **overrides: Any) -> Any:
    """The ``RunConfig`` shared by every cell of the command (seed and R3 set per cell; flat names)."""
    from rope_quant.experiment import config
    from rope_quant.quant.gptq import GPTQConfig

    budget, _ = resolve_budget(args)
    w_mse = budget.pop("w_mse")
    fields = dict(model=args.model, corpus=args.corpus, w_bits=args.w_bits, a_bits=args.a_bits,
                  k_bits=args.k_bits, v_bits=args.v_bits, estimator=args.estimator, objective=args.objective,
                  angle=args.angle, r1=args.r1 or RotationKind.WHIP.value, r2=args.r2,
                  **({} if args.whip_epochs is None else {"whip_epochs": args.whip_epochs}),
                  device=args.device, dtype=args.dtype, gptq=dataclasses.replace(GPTQConfig(), mse=bool(w_mse)),
                  **budget)
    fields.update(overrides)
    try:
        cfg = config.RunConfig.from_flat(**fields)
    except config.PipelineError as exc:
        raise CLIError(str(exc)) from None
    from rope_quant.experiment.identity import resolve_identity

    return resolve_identity(cfg)  # keys follow the model's and the corpus's content, not their names


def _seeds(args: argparse.Namespace, used: list[str]) -> tuple[int, ...]:
    if args.seeds is None:
        used.append("seeds=" + ",".join(map(str, DEFAULT_SEEDS)))
        return DEFAULT_SEEDS
    return parse_int_list(args.seeds, "--seeds", minimum=0)


def _validate_common(args: argparse.Namespace) -> None:
    check_device(args.device)
    check_model(args.model)
    check_corpus(args.corpus)
    from rope_quant.quant.quantizers import OFF_BITS, check_bits

    for q in ("w", "a", "k", "v"):
        check_bits(getattr(args, f"{q}_bits"), f"--{q}-bits", low=2, high=OFF_BITS, error=CLIError)
    if hasattr(args, "r1"):
        args.r1 = resolve_r1(args.model, args.r1, args.a_bits)


def _r1_refusal(model: str) -> str | None:
    """Why the model's architecture refuses R1 (from its config alone), or None."""
    from types import SimpleNamespace

    from rope_quant.model import arch
    from rope_quant.model.loading import ModelLoadError, load_config

    try:
        return arch.rotation_refusal(SimpleNamespace(config=load_config(model)), "r1")
    except (ModelLoadError, arch.ArchitectureError):
        return None  # reported by the pipeline's own checks


def resolve_r1(model: str, requested: str | None, a_bits: int) -> str:
    """The R1 to use: ``requested``, or the default (whip). Where the architecture refuses R1 (sandwich norms),
    an unrequested R1 becomes ``identity`` when activations stay 16-bit (KV-only W16A16KV4, or W4A16KV4: R1
    then only conditions the weights), with a note on stderr; otherwise :class:`CLIError` naming the norms
    and the alternatives."""
    from rope_quant.quant.quantizers import OFF_BITS

    if requested == RotationKind.IDENTITY.value:
        return requested
    reason = _r1_refusal(model)
    if reason is None:
        return requested or RotationKind.WHIP.value
    alternatives = ("--r1 identity (R2, R4 and the online R3 remain available), or a setting with 16-bit "
                    "activations, where R1 defaults to identity: KV-only (--w-bits 16 --a-bits 16) or W4A16KV4 "
                    "(--w-bits 4 --a-bits 16: GPTQ weights, no R1)")
    if requested is None and a_bits >= OFF_BITS:
        print(f"note: R1 set to identity for {model}: {reason}", file=sys.stderr)
        return RotationKind.IDENTITY.value
    what = f"--r1 {requested}" if requested else f"the default R1 (whip) with --a-bits {a_bits}"
    raise CLIError(f"{what} is refused for {model}: R1 would change the model's function, since {reason}. "
                   f"Alternatives: {alternatives}")


def _head_dim(model: str) -> int:
    """head_dim of a model from its config alone (no weights loaded)."""
    from types import SimpleNamespace

    from rope_quant.model import arch
    from rope_quant.model.loading import ModelLoadError, load_config

    try:
        return arch.dims(SimpleNamespace(config=load_config(model))).head_dim
    except (ModelLoadError, arch.UnsupportedModelTypeError, arch.ModelStructureError) as exc:
        raise CLIError(f"model {model}: {exc}") from exc


# ----------------------------------------------------------------------------- commands


@dataclass(frozen=True)
class Cells:
    """What computes the cells of a command: ``cell_fn`` when given, else the real pipeline over ``models``."""

    cell_fn: CellFn | None = None
    models: ModelCache | None = None

    def cache(self) -> ModelCache:
        """The base-model cache the real pipeline uses (``models``, else the process-wide one)."""
        from rope_quant.sweep.models import process_models

        return self.models if self.models is not None else process_models()

    def function(self, args: argparse.Namespace, out: Path) -> CellFn:
        """The cell function for results directory ``out`` (weight cache ``--cache-dir``, default DIR/cache)."""
        if self.cell_fn is not None:
            return self.cell_fn
        from rope_quant.sweep.cells import pipeline_cell_fn
        from rope_quant.sweep.runner import CACHE_DIR

        cache = Path(args.cache_dir) if args.cache_dir else out / CACHE_DIR
        return pipeline_cell_fn(cache, artifacts=out, progress=args.progress, models=self.cache())


def describe(cfg: Any) -> str:
    """One line with the settings shared by a sweep's cells (the rotations and their deviations included)."""
    run = getattr(cfg, "run", cfg)
    evals = "all" if run.eval_windows is None else run.eval_windows
    rot = run.rotation
    r1 = rot.r1.value + (f" (epochs {rot.whip.epochs}, batch {rot.whip.batch_size}, subset {rot.whip.subset}, "
                         f"lr {rot.whip.lr}{', cosine' if rot.whip.cosine else ''})"
                         if rot.r1 == RotationKind.WHIP else "")
    line = (f"model={run.model} corpus={run.corpus} W{run.w_bits}A{run.a_bits}K{run.k_bits}V{run.v_bits} "
            f"weights={run.weights}{'' if run.gptq.mse else ' (no MSE clip search)'} "
            f"R1={r1} R2={rot.r2.value} R4={'hadamard' if rot.r4 else 'off'} "
            f"estimator={run.estimator} angle={run.angle} seqlen={run.seqlen} calib_windows={run.calib_windows} "
            f"eval_windows={evals} device={run.device} dtype={run.dtype}")
    if rot.deviations:
        line += "\ndeviations from the paper's rotations: " + "; ".join(rot.deviations)
    return line


def _slurm_params(items: Sequence[str]) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise CLIError(f"--slurm-param expects KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError:
            params[key] = value
    return params


def _print_first_error(out: Path, manifest: Any, failed: Sequence[int]) -> None:
    """The first failed cell's error in full (type, message, traceback) on stderr."""
    from rope_quant.sweep import records

    name, cfg = manifest.cells[failed[0]]
    sidecar = records.failure_path(out, name, cfg)  # a failed rerun of a complete cell keeps the good record
    path = sidecar if sidecar.exists() else records.cell_path(out, name, cfg)
    error = (records.read_record(path) or {}).get("error") or {}
    print(f"\nfirst error ({name} seed {cfg.seed}, {len(failed)} failed cell(s); records under {out}):",
          file=sys.stderr)
    print(error.get("traceback") or f"{error.get('type')}: {error.get('message')}", file=sys.stderr)


def _pending(out: Path, manifest: Any, indices: Sequence[int], resume: bool) -> list[tuple[str, Any]]:
    """The cells among ``indices`` that will run (with ``resume``, those not complete yet)."""
    from rope_quant.sweep import records

    cells = [manifest.cells[i] for i in indices]
    if not resume:
        return cells
    return [(name, cfg) for name, cfg in cells if not records.is_complete(records.cell_path(out, name, cfg),
                                                                           cfg.key())]


def _cache_pruner(args: argparse.Namespace, out: Path, manifest: Any) -> Any:
    """The default cache's pruner (:mod:`rope_quant.sweep.cache_policy`), or None: --keep-cache or --cache-dir."""
    from rope_quant.sweep import records, runner
    from rope_quant.sweep.cache_policy import CachePruner

    if getattr(args, "keep_cache", False) or args.cache_dir:
        return None

    def complete(i: int) -> bool:
        name, cfg = manifest.cells[i]
        return records.is_complete(records.cell_path(out, name, cfg), cfg.key())

    return CachePruner(out / runner.CACHE_DIR, list(manifest.cells), complete)


def _execute(args: argparse.Namespace, cells: Cells, manifest: Any, used: list[str],
             report_fn: Callable[[Path], dict] | None = None) -> int:
    """Check the input, then run (or submit) a sweep's cells, then write and print the report (``report_fn(out)``
    for kinds with their own report, returning ``{"markdown", "files"}``; default the paired perplexity report)."""
    from rope_quant.sweep import report, runner, slurm
    from rope_quant.sweep.manifest import Manifest, reconcile, write_manifest
    from rope_quant.sweep.preflight import preflight

    out = Path(args.out)
    print(f"rope-quant {args.command}: {len(manifest)} cells -> {out}", flush=True)
    print("settings: " + describe(manifest.cells[0][1]), flush=True)
    if used:
        print("defaults used: " + ", ".join(used), flush=True)
    if args.slurm is not None and args.slurm < 1:
        raise CLIError("--slurm needs a positive number of array tasks")
    params = _slurm_params(args.slurm_param)  # executor parameters; cluster=local picks submitit's local executor
    for key in ("cell_fn", "cache_dir", "resume"):
        if key in params:
            raise CLIError(f"--slurm-param {key}=...: not an executor parameter (see --cache-dir, --no-resume)")
    selection = None
    if args.shard is not None:
        selection = runner.shard_from_env() if args.shard == "auto" else runner.parse_shard(args.shard)
        if selection is None:
            raise CLIError("--shard auto: no SLURM_ARRAY_TASK_ID/COUNT or PYTEST_XDIST_WORKER/COUNT set")
    merged = reconcile(out, manifest, force=args.force_new_manifest)
    if merged.kept or (merged.added and merged.added < len(merged.manifest)):
        print(f"manifest of {out}: same study, {merged.added} cells added, {merged.kept} existing cells kept "
              f"({len(merged.manifest)} in all)", flush=True)
    if merged.content_changed:
        print(f"note: content changed since the last run into {out} (cells get new keys and are recomputed): "
              + "; ".join(merged.content_changed), flush=True)
    chosen = range(len(manifest)) if selection is None else runner.shard_indices(len(manifest), *selection)
    selected = [merged.indices[i] for i in chosen]
    pending = _pending(out, merged.manifest, selected, args.resume and args.slurm is None)
    if pending:
        for note in preflight(Manifest(cells=pending, kind=manifest.kind), cells.cache(),
                              load=cells.cell_fn is None and args.slurm is None):
            print(f"note: {note}", file=sys.stderr)
    if args.slurm is not None:
        write_manifest(out, merged.manifest)
        jobs = slurm.submit_slurm(out, args.slurm, cell_fn=cells.cell_fn, cache_dir=args.cache_dir,
                                  resume=args.resume, **params)
        print(f"submitted {len(jobs)} Slurm array tasks; when done run `rope-quant report {out}`")
        return 0
    start = time.perf_counter()
    pruner = _cache_pruner(args, out, merged.manifest)
    result = runner.run_cells(merged.manifest, out, selected,
                              cell_fn=cells.function(args, out), resume=args.resume,
                              cache_dir=args.cache_dir, device=args.device,
                              log=None if args.quiet else (lambda s: print(s, flush=True)),
                              after_cell=None if pruner is None else pruner.after_cell)
    print(f"cells: {result.summary()}", flush=True)
    if report_fn is None:
        rep = report.write_report(out, comparator=args.comparator, figures=args.figures)
        written = f"{out / 'summary.json'} and {out / 'summary.md'}"
    else:
        rep = report_fn(out)
        written = ", ".join(str(f) for f in rep["files"] if not str(f).endswith(".png"))
    print()
    print(rep["markdown"])
    print(f"wrote {written} (wall {time.perf_counter() - start:.1f}s)")
    for path in rep["files"]:
        if str(path).endswith(".png"):
            print(f"figure: {path}")
    if cells.cell_fn is None:
        from rope_quant.sweep.cache_policy import policy_lines

        for line in policy_lines(Path(args.cache_dir) if args.cache_dir else out / runner.CACHE_DIR, pruner):
            print(line)
    if result.failed:
        _print_first_error(out, merged.manifest, result.failed)
    return 1 if result.failed else 0


def cmd_run(args: argparse.Namespace, cells: Cells) -> int:
    from rope_quant.experiment.envinfo import env_info, write_env
    from rope_quant.sweep import records
    from rope_quant.sweep.manifest import Manifest, ManifestMismatchError, cell_conflict, write_manifest
    from rope_quant.sweep.preflight import preflight
    from rope_quant.sweep.runner import run_cell_record

    _validate_common(args)
    if args.config not in valid_configs():
        raise CLIError(f"unknown config {args.config!r}; valid: {', '.join(valid_configs())}")
    if args.seed < 0:
        raise CLIError(f"--seed must be >= 0, got {args.seed}")
    from rope_quant.core import transforms

    if transforms.needs_block(args.config) and args.block is None:
        raise CLIError(f"--config {args.config} needs --block b (a power of two dividing head_dim)")
    if args.block is not None and not transforms.needs_block(args.config):
        raise CLIError(f"--block applies to block_* configs only, not {args.config!r}")
    used = resolve_budget(args)[1]
    angle = AngleRule.PHI_STAR.value if args.phi_star else args.angle
    cfg = base_config(args, seed=args.seed, r3=args.config, r3_block=args.block, angle=angle,
                      average_length=args.average_length)
    name = args.name or (args.config if args.block is None else f"{args.config}-b{args.block}")
    meta = {name: {"r3": args.config, **({"block": args.block} if args.block else {})}}
    manifest = Manifest(cells=[(name, cfg)], kind="run", comparator="hadamard", meta=meta)
    out = Path(args.out)
    print("settings: " + describe(cfg), flush=True)
    if used:
        print("defaults used: " + ", ".join(used), flush=True)
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
            _print_first_error(out, manifest, [0])
            return 1
    result = (records.read_record(path) or {}).get("result", {})
    keys = ("ppl", "n_windows", "n_tokens", "k_range_mean", "k_range_max", "delta_mean", "k_rel_err")
    print(json.dumps({k: result.get(k) for k in keys}, indent=2))
    return 0


def cmd_compare(args: argparse.Namespace, cells: Cells) -> int:
    from rope_quant.sweep import presets

    _validate_common(args)
    used: list[str] = []
    seeds = _seeds(args, used)
    used += resolve_budget(args)[1]
    if args.configs.strip() == BEYOND:
        manifest = presets.beyond_manifest(base_config(args), seeds, comparator=args.comparator)
        return _execute(args, cells, manifest, used)
    if args.configs.strip() == presets.LOWER_BITS:
        bits = [f"--{q}-bits {getattr(args, f'{q}_bits')}" for q in ("w", "a", "k", "v")
                if getattr(args, f"{q}_bits") != 4]
        if bits:
            raise CLIError(f"--configs lower-bits sets each cell's bits itself (App. F: "
                           f"{', '.join(presets.LOWER_BIT_SETTINGS)}): drop {', '.join(bits)}")
        manifest = presets.lower_bits_manifest(base_config(args), seeds, comparator=args.comparator)
        return _execute(args, cells, manifest, used)
    configs = parse_configs(args.configs)
    if args.comparator not in configs:
        print(f"note: comparator {args.comparator!r} is not among --configs: no paired statistics",
              file=sys.stderr)
    manifest = presets.compare_manifest(base_config(args), configs, seeds, comparator=args.comparator)
    return _execute(args, cells, manifest, used)


def cmd_support(args: argparse.Namespace, cells: Cells) -> int:
    from rope_quant.sweep import presets

    _validate_common(args)
    used: list[str] = []
    seeds = _seeds(args, used)
    used += resolve_budget(args)[1]
    if args.blocks is None:
        head_dim = _head_dim(args.model)
        blocks = tuple(2 ** i for i in range(1, head_dim.bit_length()) if head_dim % 2 ** i == 0)
        if not blocks:
            raise CLIError(f"model {args.model} has an odd head_dim={head_dim}: no block size b = 2, 4, ... "
                           "divides it (RoPE pairs need an even head_dim)")
        used.append("blocks=" + ",".join(map(str, blocks)))
    else:
        blocks = parse_int_list(args.blocks, "--blocks", minimum=2)
        odd = [b for b in blocks if b & (b - 1)]
        if odd:
            raise CLIError(f"--blocks must be powers of two (2, 4, 8, ...), got {', '.join(map(str, odd))}")
    manifest = presets.support_manifest(base_config(args), blocks, seeds, transform=args.transform,
                                        comparator=args.comparator)
    return _execute(args, cells, manifest, used)


def cmd_estimators(args: argparse.Namespace, cells: Cells) -> int:
    from rope_quant.sweep import presets

    _validate_common(args)
    estimators = parse_names(args.estimators, "estimator", values(Estimator))
    used: list[str] = []
    seeds = _seeds(args, used)
    used += resolve_budget(args)[1]
    manifest = presets.estimators_manifest(base_config(args), estimators, seeds, transform=args.transform,
                                           phi_star=args.phi_star, phi_star_estimator=args.estimator,
                                           average_length=args.average_length, comparator=args.comparator)
    return _execute(args, cells, manifest, used)


def cmd_long_context(args: argparse.Namespace, cells: Cells) -> int:
    from rope_quant.sweep import presets

    _validate_common(args)
    beyond = args.configs.strip() == BEYOND
    configs = () if beyond or args.configs.strip() == presets.APPJ else parse_configs(args.configs)
    used: list[str] = []
    seeds = _seeds(args, used)
    used += resolve_budget(args)[1]
    if args.lengths is None:
        lengths = LONG_CONTEXT_LENGTHS["cuda" if args.device.startswith("cuda") else "cpu"]
        used.append("lengths=" + ",".join(map(str, lengths)))
    else:
        lengths = parse_int_list(args.lengths, "--lengths", minimum=2)
    appj = args.configs.strip() == presets.APPJ
    corpora = (tuple(c.strip() for c in args.eval_corpora.split(",") if c.strip()) if args.eval_corpora
               else (("shakespeare", "pydoc") if appj else ()))
    for corpus in corpora:
        check_corpus(corpus)
    explicit = bool(args.eval_corpora)
    if not corpora and not appj:
        corpora = _default_eval_corpora(args, used)
    if appj:
        used.append("eval_corpora=" + ",".join(corpora))
        manifest = presets.appj_long_context_manifest(base_config(args), seeds, lengths, corpora,
                                                      estimator=args.estimator)
    elif beyond:
        manifest = presets.beyond_long_context_manifest(base_config(args), seeds, lengths,
                                                        comparator=args.comparator)
    elif len(corpora) == 1 and explicit:  # one named corpus: the cells keep the config names
        manifest = presets.long_context_manifest(base_config(args), configs, seeds, lengths,
                                                 comparator=args.comparator, eval_corpus=corpora[0])
    else:
        manifest = presets.long_context_manifest(base_config(args), configs, seeds, lengths,
                                                 comparator=args.comparator)
    return _execute(args, cells, _long_context_protocol(args, manifest, seeds, lengths, corpora, explicit,
                                                        appj, used), used)


def _default_eval_corpora(args: argparse.Namespace, used: list[str]) -> tuple[str, ...]:
    """A.4's default: evaluate on installed long corpora other than the calibration corpus (else on it)."""
    from rope_quant.experiment import longctx

    corpora = longctx.default_eval_corpora(args.corpus)
    if not corpora:
        print(f"note: none of {', '.join(longctx.PREFERRED_EVAL_CORPORA)} is installed: long context is scored "
              f"on the calibration corpus {args.corpus} (a deviation from A.4)", file=sys.stderr)
        corpora = (args.corpus,)
    used.append("eval_corpora=" + ",".join(corpora))
    return corpora


def _long_context_protocol(args: argparse.Namespace, manifest: Any, seeds: Sequence[int], lengths: Sequence[int],
                           corpora: Sequence[str], explicit: bool, appj: bool, used: list[str]) -> Any:
    """The A.4 protocol on a long-context manifest: the first ``--eval-docs`` documents, the evaluation corpora
    (cells ``CONFIG+CORPUS`` for several), the φ* cells of ``--phi-star-estimators``; prints the deviations."""
    from rope_quant.experiment import longctx
    from rope_quant.sweep import presets

    if args.phi_star_estimators:
        text = args.phi_star_estimators.strip()
        ests = values(Estimator) if text == "all" else parse_names(text, "estimator", values(Estimator))
        if appj:
            raise CLIError("--phi-star-estimators adds cells to the default or beyond preset, not to appj")
        manifest = presets.add_cells(manifest, *presets.phi_star_matched_cells(base_config(args), seeds, lengths,
                                                                               ests))
    if not appj and corpora and not (len(corpora) == 1 and explicit):
        manifest = presets.per_corpus(manifest, corpora)
    if args.eval_docs is None:
        eval_docs: int | None = longctx.EVAL_DOCUMENTS
        used.append(f"eval_docs={eval_docs}")
    elif args.eval_docs < 0:
        raise CLIError(f"--eval-docs must be >= 0 (0 = the whole evaluation split), got {args.eval_docs}")
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


# ----------------------------------------------------------------------------- lm-eval


def add_lm_eval_parser(sub: Any) -> argparse.ArgumentParser:
    """``rope-quant lm-eval``: lm-evaluation-harness tasks on the quantised model of each config and seed."""
    p = sub.add_parser("lm-eval", help="lm-evaluation-harness tasks on the quantised models (offline)",
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
    _common(p)
    _sweep_options(p)
    return p


def cmd_lm_eval(args: argparse.Namespace, cells: Cells) -> int:
    """Build the lm-eval manifest (config x seed) and run it like every other sweep."""
    from rope_quant.sweep.lm_eval import lm_eval_manifest

    _validate_common(args)
    configs = parse_configs(args.configs)
    tasks = tuple(dict.fromkeys(t.strip() for t in args.tasks.split(",") if t.strip()))
    if not tasks:
        raise CLIError("--tasks is empty")
    if args.include_path is not None and not Path(args.include_path).expanduser().is_dir():
        raise CLIError(f"--include-path {args.include_path}: not a directory")
    if args.only_include_path and args.include_path is None:
        raise CLIError("--only-include-path needs --include-path")
    for flag in ("limit", "num_fewshot", "max_length"):
        value = getattr(args, flag)
        if value is not None and value < (1 if flag != "num_fewshot" else 0):
            raise CLIError(f"--{flag.replace('_', '-')} must be a positive integer, got {value}")
    if args.batch_size < 1:
        raise CLIError(f"--batch-size must be a positive integer, got {args.batch_size}")
    if cells.cell_fn is None:  # the real pipeline needs lm-eval: say so before any cell runs
        from rope_quant.experiment.lm_eval import LmEvalMissingError, require_lm_eval

        try:
            require_lm_eval()
        except LmEvalMissingError as exc:
            raise CLIError(str(exc)) from None
    if args.comparator not in configs:
        print(f"note: comparator {args.comparator!r} is not among --configs: no paired statistics",
              file=sys.stderr)
    used: list[str] = []
    seeds = _seeds(args, used)
    used += resolve_budget(args)[1]
    manifest = lm_eval_manifest(base_config(args), configs, seeds, tasks, include_path=args.include_path,
                                include_defaults=not args.only_include_path, limit=args.limit,
                                num_fewshot=args.num_fewshot, batch_size=args.batch_size,
                                max_length=args.max_length, comparator=args.comparator)
    print(f"lm-eval tasks: {', '.join(tasks)}" + (f" (local YAMLs: {args.include_path})" if args.include_path
                                                  else ""), flush=True)
    return _execute(args, cells, manifest, used)


# ----------------------------------------------------------------------------- NIAH (App. G)


def add_niah_parser(sub: Any) -> argparse.ArgumentParser:
    """``rope-quant niah``: needle-in-a-haystack retrieval (RULER format) of FP and each quantised config."""
    from rope_quant.experiment.niah import Template
    from rope_quant.sweep.niah import DEFAULT_CONFIGS

    p = sub.add_parser("niah", help="needle-in-a-haystack retrieval in the RULER format (App. G)",
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
    _common(p)
    _sweep_options(p)
    return p


# ----------------------------------------------------------------------------- static control (App. A.6)


def add_static_parser(sub: Any) -> argparse.ArgumentParser:
    """``rope-quant static``: the static per-channel control of A.6 (scales per corpus and length)."""
    from rope_quant.experiment.static_control import PAPER_MAX_WINDOWS, StaticProtocol

    p = sub.add_parser("static", help="static per-channel control (App. A.6/D/H): scopes both/act/kv vs dynamic")
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
    _common(p)
    _sweep_options(p)
    return p


def cmd_niah(args: argparse.Namespace, cells: Cells) -> int:
    """Build the NIAH manifest (seed x [fp, configs]) and run it like every other sweep, with the NIAH report."""
    from rope_quant.experiment.niah import NiahError, NiahSpec
    from rope_quant.sweep.niah import niah_manifest, niah_report

    _validate_common(args)
    configs = parse_configs(args.configs)
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
        raise CLIError(str(exc)) from None
    used: list[str] = []
    seeds = _seeds(args, used)
    used += resolve_budget(args)[1]
    manifest = niah_manifest(base_config(args), configs, seeds, spec, fp=args.fp, comparator=args.comparator)
    print(f"niah: lengths={','.join(map(str, lengths))} depths={','.join(f'{d:g}' for d in depths)} "
          f"probes={args.probes} digits={args.digits} template={args.template} haystack={haystack} "
          "(exact match of the first number in the greedy continuation)", flush=True)
    return _execute(args, cells, manifest, used,
                    report_fn=lambda out: niah_report(out, comparator=args.comparator, figures=args.figures))


def cmd_static(args: argparse.Namespace, cells: Cells) -> int:
    from rope_quant.sweep import static

    _validate_common(args)
    configs = parse_configs(args.configs)
    scopes = tuple(static.parse_scope(n) for n in parse_names(
        args.scopes, "static scope", (static.DYNAMIC, "act", "kv", "both")))
    if args.static_windows < 1:
        raise CLIError(f"--static-windows must be an integer >= 1, got {args.static_windows}")
    used: list[str] = []
    seeds = _seeds(args, used)
    used += resolve_budget(args)[1]
    if args.lengths is None:
        lengths = LONG_CONTEXT_LENGTHS["cuda" if args.device.startswith("cuda") else "cpu"]
        used.append("lengths=" + ",".join(map(str, lengths)))
    else:
        lengths = parse_int_list(args.lengths, "--lengths", minimum=2)
    if args.eval_corpus:
        check_corpus(args.eval_corpus)
    manifest = static.static_manifest(base_config(args), configs, seeds, lengths, scopes, protocol=args.protocol,
                                      max_windows=args.static_windows, eval_corpus=args.eval_corpus,
                                      quant_diagnostic=args.quant_diagnostic, comparator=args.comparator)
    first = next(cfg for _, cfg in manifest.cells if cfg.scope is not None) if any(
        cfg.scope is not None for _, cfg in manifest.cells) else None
    if first is not None:
        print("static protocol: " + ("transductive (A.6: scales from the evaluation corpus)"
                                     if first.protocol.value == "transductive" else
                                     "calibration-split (out of sample; the paper ran the transductive protocol)"),
              flush=True)
        for line in static.deviations(first):
            print(f"deviation from A.6: {line}", flush=True)
    rc = _execute(args, cells, manifest, used)
    out = Path(args.out)
    text = static.write_static_report(out, comparator=args.comparator)
    print()
    print(text)
    print(f"wrote {out / 'static.md'}")
    return rc


def cmd_verify(args: argparse.Namespace, cells: Cells) -> int:
    from rope_quant.calib import verify
    from rope_quant.io import atomic_write_json, markdown_table
    from rope_quant.sweep.manifest import ARTIFACTS_DIR, config_from_dict, read_manifest, run_of
    from rope_quant.sweep.records import is_complete

    out = Path(args.dir)
    data = read_manifest(out)
    rows, checked = [], 0
    for entry in data["cells"]:
        cfg = config_from_dict(entry["config"])  # nested, or the flat form of older directories
        cfg = run_of(cfg)
        if not (cfg.position_average or args.all):
            continue
        art = out / ARTIFACTS_DIR / entry["key"]
        if not is_complete(out / entry["path"], entry["key"]):  # the runner's and report's predicate
            rows.append({"config": entry["name"], "seed": entry["seed"], "verified": None,
                         "worst_excess": None, "note": "cell not complete"})
            continue
        if not (art / "angles.npy").is_file():
            rows.append({"config": entry["name"], "seed": entry["seed"], "verified": None,
                         "worst_excess": None, "note": "no artefacts (cell not run?)"})
            continue
        length = cfg.average_length or cfg.seqlen
        dest = out / "verify" / entry["name"] / f"seed{entry['seed']}"
        kwargs = {"tol": args.tol} if args.tol is not None else {}
        result = verify.verify_files(art / "angles.npy", art / "stats.npz", art / "frequencies.json", length,
                                     dest, rule=cfg.estimator.value, **kwargs)
        checked += 1
        rows.append({"config": entry["name"], "seed": entry["seed"], "verified": result.verified,
                     "worst_excess": result.summary["worst_excess"], "average_length": length,
                     "artefacts": str(dest)})
    if not rows:
        raise CLIError(f"{out} has no φ* cells (use `rope-quant estimators --phi-star` or `run --phi-star`, "
                       "or --all for φ̂ cells)")
    atomic_write_json(out / "verify" / "verify_summary.json", {"cells": rows})
    shown = [{"config": r["config"], "seed": r["seed"],
              "verdict": r.get("note") or ("yes" if r["verified"] else "no"),
              "excess": "–" if r["worst_excess"] is None else f"{r['worst_excess']:.3g}"} for r in rows]
    print(markdown_table(shown, ("config", "seed", "verdict", "excess"),
                         ("config", "seed", "φ* verified", "worst relative excess")))
    print(f"{checked} cells checked; artefacts under {out / 'verify'}")
    return 0 if checked and all(r["verified"] for r in rows) else 1


def cmd_report(args: argparse.Namespace, cells: Cells) -> int:
    from rope_quant.sweep import report
    from rope_quant.sweep.records import status

    out = Path(args.dir)
    st = status(out)
    print(st.summary())
    if args.check:
        return 0 if st.done else 1
    family = None
    if args.family is not None:
        family = [s.strip() for s in args.family.split(",") if s.strip()]
    if not 0 < args.level < 1:
        raise CLIError(f"--level must lie in (0, 1), got {args.level}")
    rep = report.write_report(out, comparator=args.comparator, family=family, level=args.level,
                              figures=args.figures)
    print(rep["markdown"])
    print("wrote " + ", ".join(str(Path(f).relative_to(out)) for f in rep["files"]))
    if rep["summary"].get("kind") == "static":  # App. A.6 contrasts, A.8 non-additivity, App. E diagnostic
        from rope_quant.sweep.static import write_static_report

        print(write_static_report(out, level=args.level))
    return 0


def cmd_models(args: argparse.Namespace, cells: Cells) -> int:
    """List the embedded models and the model cache (``$ROPE_QUANT_MODEL_CACHE``); ``--clear-cache`` empties it."""
    from rope_quant.model import model_cache
    from rope_quant.model.loading import EMBEDDED_MODELS, INSTALL_HINT

    root = model_cache.cache_root()
    if args.clear_cache:
        removed = model_cache.clear_model_cache()
        print(f"removed {len(removed)} entr{'y' if len(removed) == 1 else 'ies'} from {root}")
        return 0
    for name in EMBEDDED_MODELS:
        print(f"{name}: install with `{INSTALL_HINT[name]}`")
    entries = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else []
    size = sum(p.stat().st_size for p in entries)
    print(f"model cache {root} ({model_cache.CACHE_ENV}): {len(entries)} files, {size / 2 ** 20:.0f} MiB; "
          "clear it with `rope-quant models --clear-cache`")
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace, Cells], int]] = {
    "run": cmd_run, "compare": cmd_compare, "support": cmd_support, "estimators": cmd_estimators,
    "long-context": cmd_long_context, "verify": cmd_verify, "report": cmd_report, "lm-eval": cmd_lm_eval,
    "niah": cmd_niah,
    "models": cmd_models,
    "static": cmd_static,
}


def main(argv: Sequence[str] | None = None, *, cell_fn: CellFn | None = None,
         models: ModelCache | None = None) -> int:
    """Entry point of the ``rope-quant`` console script; returns the exit code.

    ``cell_fn(cfg) -> dict`` replaces the pipeline for every cell (tests); ``models`` is the base-model
    cache of the real pipeline (default: the process-wide one).
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0)
    from rope_quant.experiment.config import PipelineError
    from rope_quant.sweep.manifest import SweepError

    try:
        return COMMANDS[args.command](args, Cells(cell_fn=cell_fn, models=models))
    except (CLIError, SweepError, PipelineError) as exc:  # PipelineError: a setting RunConfig refuses
        print(f"rope-quant {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        print(f"rope-quant {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"rope-quant {args.command}: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


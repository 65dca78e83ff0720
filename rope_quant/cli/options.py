"""Option groups shared by the commands: the cell configuration, the results directory, sweep execution.

Choices come from the config enums (imported when a command's parser is built, never by ``--help`` alone).
"""

from __future__ import annotations

import argparse

from rope_quant.cli.args import values
from rope_quant.defaults import DEFAULT_COMPARATOR, DEFAULT_CORPUS, DEFAULT_MODEL

#: ``--dtype auto``: resolved by :func:`rope_quant.cli.validate.resolve_dtype` from the device.
AUTO_DTYPE = "auto"


def add_common(parser: argparse.ArgumentParser, *, seeds: bool = True) -> None:
    """The cell configuration (model, corpus, seeds, rotations, bits, budget) and the results options."""
    from rope_quant.experiment.specs import PIPELINE_ROTATIONS, AngleRule, DType, Estimator, Objective, WeightMode

    rotations = tuple(k.value for k in PIPELINE_ROTATIONS)
    g = parser.add_argument_group("cell configuration")
    g.add_argument("--model", default=DEFAULT_MODEL, metavar="NAME|PATH",
                   help=f"embedded model name, local HF checkpoint or .gguf file (default {DEFAULT_MODEL})")
    g.add_argument("--corpus", default=DEFAULT_CORPUS, metavar="NAME|PATH",
                   help="pydoc, shakespeare, debian-reference, kjv, wikitext2 or a path "
                   f"(default {DEFAULT_CORPUS})")
    if seeds:
        g.add_argument("--seeds", default=None, metavar="0,1,2|0-9",
                       help="seeds: comma-separated integers and inclusive ranges, e.g. 0,1,2 or 0-9 or 0-4,7 "
                            "(0 <= seed < 2**63; default 0,1,2)")
    g.add_argument("--estimator", default=Estimator.ROWS.value, choices=values(Estimator),
                   help="covariance pooling for the pairwise angles (default rows)")
    g.add_argument("--angle", default=AngleRule.PHI_HAT.value, choices=values(AngleRule),
                   help="angle rule of the variance objective: φ̂ (the paper's pairwise_only), φ̂ wrapped to "
                        "φ*'s branch (App. J's control) or the position-averaged φ* (default phi_hat)")
    g.add_argument("--r1", default=None, choices=rotations,
                   help="R1: whip (the paper, A.1; default), random_hadamard (QuaRot's diag(s)·H), the plain "
                        "hadamard, or identity. On a model whose architecture refuses R1 (Gemma 3's sandwich "
                        "norms) the default is identity when activations stay 16-bit (--a-bits 16) and an "
                        "error otherwise")
    g.add_argument("--r2", default=rotations[1], choices=rotations,
                   help="R2: random_hadamard (the paper keeps whip's initialisation, A.8; default), hadamard, "
                        "identity, or whip (trains R2: a deviation from A.8)")
    g.add_argument("--r4", action=argparse.BooleanOptionalAction, default=True,
                   help="R4: the online Hadamard on down_proj's input (the paper, A.1; default on). --no-r4 "
                        "gives cells that `rope-quant export --format hf` can write (R4 has no place in a "
                        "plain checkpoint); a deviation from the paper, printed with the settings")
    g.add_argument("--whip-epochs", type=int, default=None, metavar="N",
                   help="epochs of R1's whip fit (default 10 on every device: the fit takes seconds on CPU)")
    g.add_argument("--objective", default=Objective.VARIANCE.value, choices=values(Objective),
                   help="angle objective: variance (φ̂/φ*, the paper), a top-k grid, or range (coordinate "
                        "descent on the K quantiser's mean tokenwise range; default variance)")
    for q in ("w", "a", "k", "v"):
        g.add_argument(f"--{q}-bits", type=int, default=4, metavar="B",
                       help=f"{q.upper()} bits (16 = off; default 4)")
    add_key_quant(g)
    g.add_argument("--weights", default=None, choices=values(WeightMode),
                   help="weight quantiser, cached per seed (default: CPU rtn, CUDA gptq as in the paper)")
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
    g.add_argument("--dtype", default=AUTO_DTYPE, choices=(AUTO_DTYPE, *values(DType)),
                   help="model storage dtype; auto (default) = bfloat16 on CUDA, float32 on the CPU (the "
                        "resolved dtype is what the records and cache keys hold)")
    g.add_argument("--offload", default="auto", choices=("none", "cpu", "auto"),
                   help="cpu: weights in host RAM, one decoder layer at a time on the GPU; auto (default): cpu "
                        "exactly when the plan (`rope-quant plan`) says the model does not fit the GPU without "
                        "it, announced in the output. A run that does not fit even so exits 2 with the plan's "
                        "remedy before anything loads (budgets: the GPU's memory and the physical RAM, or "
                        "ROPE_QUANT_GPU_MEMORY_GIB / ROPE_QUANT_HOST_MEMORY_GIB). A no-op on the CPU")
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


#: The key-quantiser flags: each sets the flat config field of its name (``--k-token-group`` -> ``k_token_group``).
KEY_QUANT_FLAGS = ("k_quant", "k_token_group", "k_residual", "k_sinks", "k_min_bits", "k_max_bits", "k_avg_bits")


def add_key_quant(g: argparse._ArgumentGroup) -> None:
    """``--k-quant`` and its parameters (docs/key_quantizers.md); unset ones take the quantiser's defaults."""
    from rope_quant.quant.keys import DEFAULT_KEY_QUANT, KeyQuantName

    g.add_argument("--k-quant", default=None, metavar="NAME",
                   help=f"key quantiser, fed --k-bits: {', '.join(values(KeyQuantName))} (default "
                        f"{DEFAULT_KEY_QUANT.value}: the paper's dynamic per-token rule; docs/key_quantizers.md)")
    g.add_argument("--k-token-group", type=int, default=None, metavar="G",
                   help="kivi / kvquant_prerope: tokens per per-channel group (default 32 / 128)")
    g.add_argument("--k-residual", type=int, default=None, metavar="R",
                   help="kivi: the most recent R tokens stay in full precision, R >= G (default 128)")
    g.add_argument("--k-sinks", type=int, default=None, metavar="S",
                   help="sink: the first S tokens stay in 16 bits (default 4)")
    g.add_argument("--k-min-bits", type=int, default=None, metavar="B",
                   help="rope_pair_bits: the smallest width of a pair (default 2)")
    g.add_argument("--k-max-bits", type=int, default=None, metavar="B",
                   help="rope_pair_bits: the largest width of a pair (default 8)")
    g.add_argument("--k-avg-bits", type=float, default=None, metavar="B",
                   help="rope_pair_bits: the mean width (default --k-bits; head_dim/2 times it must be an integer)")


def add_sweep_options(parser: argparse.ArgumentParser) -> None:
    """Execution options of the sweep commands: shards, Slurm, the comparator, figures, the cache policy."""
    g = parser.add_argument_group("execution (parallelism through existing engines)")
    g.add_argument("--shard", default=None, metavar="i/n",
                   help="run only shard i of n (0-based, deterministic contiguous split); 'auto' reads "
                        "SLURM_ARRAY_TASK_ID/COUNT or PYTEST_XDIST_WORKER/COUNT")
    g.add_argument("--slurm", type=int, default=None, metavar="N",
                   help="submit N Slurm array tasks through submitit (if installed) and return")
    g.add_argument("--slurm-param", action="append", default=[], metavar="KEY=VALUE",
                   help="submitit executor parameter (repeatable), e.g. timeout_min=120, slurm_partition=gpu, "
                        "gpus_per_node=1; cluster=local runs the array tasks as local subprocesses")
    g.add_argument("--comparator", default=DEFAULT_COMPARATOR,
                   help="config every other one is paired against (one of the sweep's configs)")
    g.add_argument("--no-figures", dest="figures", action="store_false", help="skip the PNG figures")
    g.add_argument("--quiet", action="store_true", help="do not print per-cell progress")
    g.add_argument("--keep-cache", action="store_true",
                   help="keep every seed's weights and statistics in the default cache DIR/cache (default: "
                        "delete them once all cells using them are complete; an explicit --cache-dir is "
                        "never pruned)")


def add_sweep(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Both groups of a sweep command (``add_common`` then ``add_sweep_options``); returns ``parser``."""
    add_common(parser)
    add_sweep_options(parser)
    return parser

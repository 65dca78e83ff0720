"""Checks of a command's input that need no model: device, model and corpus names, bits, paths, corpus text.

Each raises :class:`~rope_quant.cli.args.CLIError` (exit 2, one line) before any model loads.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from rope_quant.cli.args import CLIError, unknown_name


def check_corpus(name: str) -> str:
    """An embedded corpus name, ``wikitext2``, or an existing local path (else the closest names)."""
    from rope_quant.corpora import sources

    known = sources.list_corpora(include_unavailable=True)
    if name in known and name not in sources.list_corpora():
        raise CLIError(f"corpus {name!r} is not installed here; available: {', '.join(sources.list_corpora())}")
    if name in known or name.lower() in sources.HF_WIKITEXT_NAMES or Path(name).expanduser().exists():
        return name
    if "/" in name or "\\" in name or "." in name:  # looks like a path: call it missing
        raise CLIError(f"corpus {name}: missing (no such file or directory)")
    raise unknown_name("corpus", name, [*known, "wikitext2"])


def check_model(name: str, facts: Any = None) -> str:
    """An embedded model name or an existing local checkpoint / .gguf file of a supported architecture (else
    the closest names, or the registered types). ``facts``: the model's config already read
    (:func:`rope_quant.cli.common.checkpoint`), else it is read here."""
    from rope_quant.claims.premises import read_checkpoint
    from rope_quant.model import arch
    from rope_quant.model.loading import EMBEDDED_MODELS, ModelLoadError, ModelNotFoundError, check_checkpoint

    looks_like_path = "/" in name or "\\" in name or name.endswith(".gguf")
    if name.lower() not in EMBEDDED_MODELS and not looks_like_path and not Path(name).expanduser().exists():
        raise unknown_name("model", name, list(EMBEDDED_MODELS))
    try:
        check_checkpoint(name)  # resolves it; a cut file or an odd head_dim is named here, before any weight loads
        if name.lower() not in EMBEDDED_MODELS:  # the architecture from the config alone (a GGUF's header)
            arch.spec_for((facts or read_checkpoint(name)).as_model())
    except (ModelNotFoundError, ModelLoadError) as exc:
        raise CLIError(str(exc)) from None
    except arch.ArchitectureError as exc:
        raise CLIError(f"model {name}: {exc}") from None
    return name


def check_device(device: str, runs_here: bool = True) -> str:
    """``cpu``, ``cuda`` or ``cuda:N`` (CUDA only where it is available, unless the run is submitted to Slurm
    from a machine without a GPU: ``runs_here=False``)."""
    if device == "cpu":
        return device
    if device == "cuda" or device.startswith("cuda:"):
        import torch

        if runs_here and not torch.cuda.is_available():
            raise CLIError(f"--device {device}: CUDA is not available on this machine")
        return device
    raise CLIError(f"--device must be cpu, cuda or cuda:N, got {device!r}")


def resolve_dtype(device: str, dtype: str) -> str:
    """``--dtype auto`` -> bfloat16 on CUDA (float16 on a GPU without native bfloat16, with a note saying so),
    float32 on the CPU (CPU numbers and keys do not move); an explicit dtype is kept
    (:func:`rope_quant.model.dtypes.auto_dtype`)."""
    from rope_quant.cli.options import AUTO_DTYPE
    from rope_quant.experiment.config import DType
    from rope_quant.model.dtypes import auto_dtype

    if dtype != AUTO_DTYPE:
        return dtype
    name, note = auto_dtype(device)
    if note:
        print(note, file=sys.stderr)
    return DType(name).value


def check_memory(args: argparse.Namespace, configs: int = 1, seeds: int = 1) -> str:
    """The plan for this run's settings against this machine (:func:`rope_quant.planning.memory_check.decide`),
    before any model loads: the offload mode to run with (announced when streamed), else a :class:`CLIError`
    (exit 2) naming the stage and the plan's remedy. A model whose config cannot be read is left to the
    pipeline's own checks."""
    from rope_quant.cli.common import checkpoint, resolve_budget
    from rope_quant.model import arch
    from rope_quant.model.loading import ModelLoadError, ModelNotFoundError
    from rope_quant.planning import memory_check, plan

    budget, _ = resolve_budget(args)
    fallback = "cpu" if args.offload == "cpu" else "none"
    if str(args.device).startswith("cuda") and os.environ.get(memory_check.ENV_GPU) is None:
        import torch

        if not torch.cuda.is_available():  # submitting to Slurm from a login node (check_device let it through)
            print(f"note: no GPU on this machine, so the plan is not checked before submitting; set "
                  f"{memory_check.ENV_GPU} (and {memory_check.ENV_HOST}) to the GPU node's memory in GiB to "
                  f"check it here", file=sys.stderr)
            return fallback
    try:
        protocol = memory_check.protocol_for(budget["calib_windows"], budget["seqlen"], budget.get("eval_windows"),
                                             args.whip_epochs, configs, seeds, str(budget.get("weights")) == "gptq")
        decision = memory_check.decide(args.model, args.device, args.dtype, protocol, args.offload,
                                       config=checkpoint(args).config)
    except plan.PlanDoesNotFit as exc:
        raise CLIError(f"the plan for this run does not fit: {exc}") from None
    except plan.PlanError as exc:
        raise CLIError(str(exc)) from None
    except (ModelLoadError, ModelNotFoundError, arch.ArchitectureError):
        return "none"  # the pipeline's own checks name the problem
    except Exception as exc:  # noqa: BLE001 - a config the plan cannot model must not stop a run that may fit
        print(f"note: memory check skipped ({type(exc).__name__}: {exc}); --offload {args.offload} taken as "
              f"{fallback}", file=sys.stderr)
        return fallback
    if decision.note:
        print(decision.note, flush=True)
    return decision.offload.value


def check_paths(args: argparse.Namespace) -> None:
    """``--out`` and ``--cache-dir`` are writable directories (or can be created): before the model loads."""
    from rope_quant.sweep.preflight import PreflightError, check_output_dir

    try:
        check_output_dir(args.out, "--out")
        if getattr(args, "cache_dir", None):
            check_output_dir(args.cache_dir, "--cache-dir")
    except PreflightError as exc:
        raise CLIError(str(exc)) from None


def check_corpus_text(name: str, seqlen: int) -> None:
    """A local corpus is non-empty UTF-8 text of at least one window (:func:`preflight.check_corpus_text`)."""
    from rope_quant.sweep.preflight import PreflightError
    from rope_quant.sweep.preflight import check_corpus_text as check

    try:
        check(name, seqlen)
    except PreflightError as exc:
        raise CLIError(str(exc)) from None


def check_key_quant(args: argparse.Namespace) -> None:
    """``--k-quant`` names a registered key quantiser (else the closest names) and its parameters are valid with
    the other K flags (the config's own checks, named by flag): before any model loads."""
    name = getattr(args, "k_quant", None)
    if name is None:
        given = [f for f in ("k_token_group", "k_residual", "k_sinks", "k_min_bits", "k_max_bits", "k_avg_bits")
                 if getattr(args, f, None) is not None]
        if not given:
            return
    from rope_quant.cli.common import flags_for_fields
    from rope_quant.experiment.specs import KEY_QUANT_PARAMS, KeyQuantSpec, PipelineError
    from rope_quant.quant import keys as keyq
    from rope_quant.quant.quantizers import QuantConfig

    if name is not None and name not in keyq.names():
        raise unknown_name("--k-quant", name, keyq.names())
    try:
        spec = KeyQuantSpec(name or keyq.DEFAULT_KEY_QUANT.value,
                            **{p: getattr(args, f"k_{p}", None) for p in KEY_QUANT_PARAMS})
        spec.option(QuantConfig(bits=args.k_bits))
    except PipelineError as exc:
        raise CLIError(flags_for_fields(str(exc))) from None


def validate_common(args: argparse.Namespace) -> None:
    """Device, model, corpus, bits, whip epochs, R1, output paths and the corpus text: all before any load."""
    from rope_quant.cli.common import checkpoint, resolve_budget, resolve_r1
    from rope_quant.quant.quantizers import OFF_BITS, check_bits

    check_device(args.device, runs_here=getattr(args, "slurm", None) is None)
    args.dtype = resolve_dtype(args.device, args.dtype)
    check_model(args.model, checkpoint(args))
    check_corpus(args.corpus)
    for q in ("w", "a", "k", "v"):
        check_bits(getattr(args, f"{q}_bits"), f"--{q}-bits", low=2, high=OFF_BITS, error=CLIError)
    check_key_quant(args)
    if args.whip_epochs is not None and args.whip_epochs < 1:
        raise CLIError(f"--whip-epochs must be an integer >= 1, got {args.whip_epochs}")
    budget, _ = resolve_budget(args)
    check_paths(args)
    check_corpus_text(args.corpus, budget["seqlen"])
    if hasattr(args, "r1"):
        args.r1 = resolve_r1(checkpoint(args), args.r1, args.a_bits)

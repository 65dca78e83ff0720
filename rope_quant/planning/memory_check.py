"""The memory check before a run loads anything (fail early): the plan for the run's actual settings, the offload
decision, or a refusal with the plan's remedy.

:func:`decide` reads the model's config only (no weights), builds the plan
(:func:`rope_quant.planning.plan.make_plan`) and checks it (:func:`~rope_quant.planning.plan.check_fits`)
against the budgets of this machine: the CUDA device's memory and the physical host RAM, each overridable
with an environment variable (:data:`ENV_GPU`, :data:`ENV_HOST`, in GiB; tests use them to make a tiny model
"not fit"). ``--offload auto`` streams (``cpu``) exactly when the plan does not fit without offload and fits
with it; on the CPU offload is a no-op (the weights already live in host RAM) and only the host is checked.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from rope_quant.model.offload import OffloadMode
from rope_quant.planning import plan as planning
from rope_quant.planning.plan_costs import GIB, DeviceName

__all__ = ["ENV_GPU", "ENV_HOST", "Decision", "gpu_budget", "host_budget", "plan_for", "decide", "protocol_for"]

#: GPU / host memory budgets in GiB (default: the CUDA device's total memory / the physical RAM).
ENV_GPU = "ROPE_QUANT_GPU_MEMORY_GIB"
ENV_HOST = "ROPE_QUANT_HOST_MEMORY_GIB"


@dataclass(frozen=True)
class Decision:
    """The offload mode to run with (never auto) and the line that announces a streamed run ('' otherwise)."""

    offload: OffloadMode
    note: str = ""


def _gib_env(name: str) -> int | None:
    text = os.environ.get(name)
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise planning.PlanError(f"{name} must be a number of GiB, got {text!r}") from None
    if value <= 0:
        raise planning.PlanError(f"{name} must be positive, got {text!r}")
    return int(value * GIB)


def gpu_budget(device: str) -> int | None:
    """GPU bytes for ``device`` (None on the CPU): :data:`ENV_GPU`, else the CUDA device's total memory."""
    if not str(device).startswith("cuda"):
        return None
    gpu = _gib_env(ENV_GPU)
    if gpu is None:
        import torch

        if not torch.cuda.is_available():  # a Slurm login node: the job's GPU is not this machine's
            raise planning.PlanError(f"--device {device} on a machine without CUDA: set {ENV_GPU} (and "
                                     f"{ENV_HOST}) to the GPU node's memory in GiB to plan the run here")
        gpu = int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    return gpu


def host_budget() -> int | None:
    """Host bytes: :data:`ENV_HOST`, else the physical RAM (None when unknown)."""
    host = _gib_env(ENV_HOST)
    if host is None:
        try:
            host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            host = None
    return host


def _plan_device(device: str) -> str:
    """The plan's device for a torch device (memory comes from :func:`budgets`; the name picks time rates)."""
    if not str(device).startswith("cuda"):
        return DeviceName.CPU.value
    import torch

    if not torch.cuda.is_available():  # planned from a login node (the budget from ROPE_QUANT_GPU_MEMORY_GIB)
        return DeviceName.H100.value
    name = torch.cuda.get_device_name(torch.device(device)).upper()
    if "H200" in name:
        return DeviceName.H200.value
    if "A100" in name:
        big = torch.cuda.get_device_properties(torch.device(device)).total_memory > 50 * GIB
        return (DeviceName.A100_80G if big else DeviceName.A100_40G).value
    return DeviceName.H100.value


def protocol_for(calib_windows: int, seqlen: int, eval_windows: int | None, whip_epochs: int | None,
                 configs: int, seeds: int, gptq: bool) -> planning.Protocol:
    """The plan's protocol for a run's settings (``eval_windows`` None or 0: the paper's 140)."""
    return planning.Protocol(calib_windows=calib_windows, seqlen=seqlen,
                             eval_windows=eval_windows or planning.PAPER.eval_windows,
                             whip_epochs=whip_epochs or planning.PAPER.whip_epochs, configs=max(1, configs),
                             seeds=max(1, seeds), gptq=gptq)


def plan_for(model: str, device: str, dtype: str, protocol: planning.Protocol, offload: bool,
             config: Any = None) -> planning.Plan:
    """The plan of ``model`` (an embedded name, checkpoint or .gguf: its config only) for these settings;
    ``config``: the model's config where the caller has read it already."""
    import torch
    from transformers import AutoModelForCausalLM

    from rope_quant.model.loading import load_config

    config = load_config(model) if config is None else config
    with torch.device("meta"):
        meta: Any = AutoModelForCausalLM.from_config(config)
    return planning.make_plan(planning.model_cost(meta, model), _plan_device(device), dtype, protocol,
                              offload=offload)


def decide(model: str, device: str, dtype: str, protocol: planning.Protocol, requested: OffloadMode | str,
           gpu_bytes: int | None = None, host_bytes: int | None = None, config: Any = None) -> Decision:
    """The offload to run with, or :class:`~rope_quant.planning.plan.PlanDoesNotFit` (stage, need, budget,
    remedy). ``gpu_bytes`` / ``host_bytes`` default to :func:`gpu_budget` / :func:`host_budget`; ``config``: the
    model's config where the caller has read it already (:func:`plan_for`)."""
    from rope_quant.model.loading import load_config

    requested = OffloadMode(requested)
    config = load_config(model) if config is None else config
    gpu = gpu_budget(device) if gpu_bytes is None else gpu_bytes
    host = host_budget() if host_bytes is None else host_bytes
    if not str(device).startswith("cuda"):  # offload is a no-op on the CPU: the host check only
        planning.check_fits(plan_for(model, device, dtype, protocol, offload=False, config=config), None, host)
        return Decision(OffloadMode.NONE)
    if requested == OffloadMode.CPU:
        planning.check_fits(plan_for(model, device, dtype, protocol, offload=True, config=config), gpu, host)
        return Decision(OffloadMode.CPU, "offload: cpu (--offload cpu: one decoder layer at a time on the GPU)")
    try:
        planning.check_fits(plan_for(model, device, dtype, protocol, offload=False, config=config), gpu, host)
        return Decision(OffloadMode.NONE)
    except planning.PlanDoesNotFit as exc:
        if requested == OffloadMode.NONE:
            raise
        planning.check_fits(plan_for(model, device, dtype, protocol, offload=True, config=config), gpu, host)
        need = str(exc).split(": use ")[0]
        return Decision(OffloadMode.CPU, f"offload: cpu (the plan: {need} without offload; it fits streaming one "
                                         "decoder layer at a time)")

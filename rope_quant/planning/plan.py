"""The cost plan of a run (before committing): predicted peak GPU memory, host RAM, disk and wall time per stage.

The model is read on the meta device (no weights). Memory is counted from the shapes: the stored model, the
largest float64 block of the rotation algebra (:mod:`rope_quant.rotations.folding` folds one block at a time),
the whip samples and fit matrices, GPTQ's layer inputs and Hessians, the activations of one window (of a batch
of windows in a GPU's calibration). On the CPU, time is FLOP count over the measured rates times fitted
overheads; on a GPU it is per unit of the work (:class:`rope_quant.planning.plan_costs.GpuCosts`, measured on
an H100): decoder forwards per layer-window at the measured bf16 rate (quantised: times the measured
overhead), calibration statistics per layer-window, GPTQ's Hessians at the float32 rate plus its column loop
per column, whip's steps and checks on the device. :func:`check_fits` raises :class:`PlanDoesNotFit` with the
remedy before any expensive step.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from rope_quant.core import hadamard
from rope_quant.model import arch, shapes
from rope_quant.planning import plan_costs as pc
from rope_quant.planning.stages import StageName
from rope_quant.rotations.folding import fold_block_rows
from rope_quant.rotations.whip import AUTO_ANALYTIC_ABOVE

__all__ = ["PlanError", "PlanDoesNotFit", "Protocol", "PAPER", "ModelCost", "Stage", "Plan", "read_model",
           "model_cost", "make_plan", "check_fits", "format_plan"]

GIB = pc.GIB
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class PlanError(ValueError):
    """A model or setting the plan cannot read."""


class PlanDoesNotFit(PlanError):
    """The run does not fit the device; the message names the stage and the remedy."""


@dataclass(frozen=True)
class Protocol:
    """What a run does: calibration / evaluation budgets, whip schedule, sweep size, long-context lengths."""

    calib_windows: int = 128
    seqlen: int = 2048
    eval_windows: int = 140
    whip_epochs: int = 10
    whip_batch: int = 64
    whip_subset: float = 0.1
    tokens_per_sample: int = 64
    configs: int = 4
    seeds: int = 3
    gptq: bool = True
    long_context: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("calib_windows", "seqlen", "whip_epochs", "whip_batch", "tokens_per_sample", "configs",
                     "seeds", "eval_windows"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise PlanError(f"{name} must be a positive integer, got {v!r}")


#: The paper's protocol (App. A.1): 128 × 2048 calibration, whip 10 epochs, GPTQ, 4 R3 configs × 3 seeds,
#: evaluation over 140 windows of 2048.
PAPER = Protocol()


@dataclass(frozen=True)
class ModelCost:
    """The shape facts the plan needs, read from a config on the meta device."""

    name: str
    params: int
    layer_params: int  # one decoder layer's linear weights
    hidden: int
    intermediate: int
    n_layers: int
    vocab: int
    kv_dim: int
    largest_rows: int  # rows of the largest matrix the rotation algebra folds (embedding / lm_head)
    q_dim: int = 0  # n_heads * head_dim (0: the hidden size)
    head_dim: int = 128
    n_heads: int = 32
    n_kv_heads: int = 8


@dataclass(frozen=True)
class Stage:
    """Predicted peaks and time of one stage (bytes, seconds)."""

    name: str
    gpu_bytes: int
    host_bytes: int
    disk_bytes: int
    seconds: float
    repeats: int = 1  # how often the sweep runs it


@dataclass
class Plan:
    model: ModelCost
    device: pc.Device
    dtype: str
    protocol: Protocol
    offload: bool
    stages: list[Stage] = field(default_factory=list)

    @property
    def total_seconds(self) -> float:
        return sum(s.seconds * s.repeats for s in self.stages)

    @property
    def peak_gpu(self) -> int:
        return max(s.gpu_bytes for s in self.stages)

    @property
    def peak_host(self) -> int:
        return max(s.host_bytes for s in self.stages)


def _meta_model(config: Any) -> Any:
    from transformers import AutoModelForCausalLM

    arch.spec_for(config.model_type)  # an unknown architecture: the adapter's error, before anything else
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def read_model(model: str) -> Any:
    """The meta-device model of a shape name, a checkpoint directory or a ``config.json`` (no weights read)."""
    from transformers import AutoConfig

    try:
        return shapes.build_meta(model)
    except shapes.ShapeError:
        pass
    path = Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise PlanError(f"{model!r} is neither a shape ({', '.join(shapes.ShapeName)}), a checkpoint directory "
                        "with config.json, nor a config.json file")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PlanError(f"cannot read the config {path}: {exc}") from exc
    arch.check_config_dict(data, str(path))  # the geometry from the file, not transformers' defaults
    try:
        config = AutoConfig.for_model(**data)
    except (ValueError, KeyError, TypeError) as exc:
        raise PlanError(f"cannot read the config {path}: {exc}") from exc
    return _meta_model(config)


def model_cost(model: Any, name: str = "") -> ModelCost:
    """Parameter and shape counts of a (meta) model."""
    d = arch.dims(model)
    a, m = arch.attention(model, 0), arch.mlp_parts(model, 0)
    linears: tuple[Any, ...] = (a.q, a.k, a.v, a.o, m.gate, m.up, m.down)
    layer = int(sum(lin.weight.numel() for lin in linears))
    params = sum({id(p): p.numel() for p in model.parameters()}.values())
    embed: Any = arch.embeddings(model)
    vocab = int(embed.weight.shape[0])
    return ModelCost(name or getattr(model.config, "model_type", "model"), params, layer, d.hidden, d.intermediate,
                     d.n_layers, vocab, d.n_kv_heads * d.head_dim, max(vocab, d.intermediate),
                     d.n_heads * d.head_dim, d.head_dim, d.n_heads, d.n_kv_heads)


def _stage_gpu(on_gpu: bool, model_bytes: int, layer_bytes: int, work: int, offload: bool) -> int:
    if not on_gpu:
        return 0
    return (layer_bytes if offload else model_bytes) + work


def make_plan(mc: ModelCost, device: str = "cpu", dtype: str | None = None, protocol: Protocol = PAPER,
              offload: bool = False) -> Plan:
    """Per-stage predictions for ``protocol`` on ``device`` (``dtype`` default: float32 on CPU, bfloat16 else)."""
    try:
        dev = pc.device(device)
    except ValueError:
        raise PlanError(f"unknown device {device!r}; known: {', '.join(pc.DeviceName)}") from None
    gpu = dev.name != pc.DeviceName.CPU
    dtype = dtype or ("bfloat16" if gpu else "float32")
    if dtype not in _BYTES:
        raise PlanError(f"dtype must be one of {', '.join(_BYTES)}, got {dtype!r}")
    p = protocol
    b = _BYTES[dtype]
    rate, rate64 = dev.flops[dtype], dev.fp64_flops
    model_b = mc.params * b
    layer_b = mc.layer_params * b
    emb_b = mc.vocab * mc.hidden * b
    host0 = pc.HOST_BASELINE_BYTES
    host_model = host0 + model_b  # on the CPU the model lives in host RAM; on a GPU the loader maps it once
    host_run = host_model if (not gpu or offload) else host0 + layer_b
    calib_tok = p.calib_windows * p.seqlen
    act_window = p.seqlen * (4 * mc.hidden + 2 * mc.intermediate) * 4  # one window's live activations, fp32
    fwd_tok = 2 * (mc.layer_params * mc.n_layers)  # decoder FLOP per token
    k_paley = hadamard.hadamard_order(mc.intermediate)[0]  # R4's non-power-of-two factor: a k × k product
    r4_tok = 2 * mc.n_layers * mc.intermediate * k_paley  # the online R4 per token (K = 172 at Llama-2-7B's 11008)
    r4_s = r4_tok / dev.flops["float32"]  # its seconds per token
    attn_tok = 2 * mc.n_layers * p.seqlen * mc.hidden  # causal attention FLOP per token (QKᵀ and AV, averaged)
    head_tok = 2 * mc.vocab * mc.hidden
    stages: list[Stage] = []

    def add(name: str, work_gpu: int, work_host: int, disk: int, seconds: float, repeats: int = 1) -> None:
        stages.append(Stage(name, _stage_gpu(gpu, model_b, layer_b + emb_b * 2, work_gpu, offload),
                            host_run + work_host, disk, seconds, repeats))

    add(StageName.LOAD, 0, 0, model_b, model_b / 1.0e9)  # ~1 GB/s from a local disk
    n_samples = p.calib_windows * 2 * mc.n_layers
    steps = p.whip_epochs * math.ceil(max(1, int(n_samples * p.whip_subset)) / p.whip_batch)
    samples_b = n_samples * p.tokens_per_sample * mc.hidden * 4
    fit_b = 12 * mc.hidden ** 2 * 4  # A, grad, momentum, two CholeskyQR passes and their autograd buffers
    n3 = 2 * mc.hidden ** 3  # one n × n product
    step = pc.WHIP_STEP_MATMULS_ANALYTIC if mc.hidden > AUTO_ANALYTIC_ABOVE else pc.WHIP_STEP_MATMULS
    whip_s = (calib_tok * (fwd_tok + attn_tok) / rate + steps * step * n3 / dev.flops["float32"]
              + pc.WHIP_FIXED_MATMULS * n3 / rate64)
    # the need: samples on the host, scored in 256 MiB pieces on the GPU; the fit moves them onto the GPU only
    # where they fit in whip.SAMPLES_GPU_SHARE of its free memory (elastic, like the calibration batch)
    add(StageName.WHIP_R1, act_window + fit_b + min(samples_b, 1 << 28), samples_b + (0 if gpu else fit_b), 0, whip_s,
        p.seeds)
    block = min(mc.largest_rows, fold_block_rows(mc.hidden)) * mc.hidden * (8 + 8 + 4)  # float64 in, out, cast
    k_r4 = k_paley if mc.intermediate > 4096 else mc.intermediate  # the dense R4 matrix at or below 4096
    block += 3 * k_r4 ** 2 * 8  # the R4 Hadamard factor (built as integers, then float64)
    retained = pc.HOST_RETAINED_BYTES  # CPU: resident after the rotation stage (plan_costs)
    rot_flops = 2 * mc.hidden * (2 * mc.vocab * mc.hidden + mc.n_layers * mc.layer_params) + mc.hidden * r4_tok
    fold_rate = rate64 if dtype == "float32" else dev.flops["float32"]  # folding.fold_dtype
    add(StageName.ROTATION, block + mc.hidden ** 2 * 8, 0 if gpu else block + mc.hidden ** 2 * 8, 0,
        rot_flops * pc.ROTATION_OVERHEAD / fold_rate, p.seeds)
    if p.gptq:
        inputs_b = 2 * calib_tok * mc.hidden * b + act_window  # a layer's inputs and outputs, storage dtype
        hess_b = (pc.GPTQ_HESSIAN_COPIES * mc.intermediate ** 2
                  + pc.GPTQ_WEIGHT_COPIES * mc.hidden * mc.intermediate) * 4  # the widest linear (down_proj)
        # the layer forwards at the storage dtype's rate; Hessians, Cholesky and the column loop in float32
        hess_flops = 2 * calib_tok * (mc.hidden ** 2 * 3 + mc.intermediate ** 2)  # per layer, shared Hessians
        if gpu:  # two quantised forwards per window, the Hessians at float32, the column loop per column
            gc = pc.gpu_costs(dev.name)
            columns = 4 * mc.hidden + 2 * mc.hidden + mc.intermediate  # q, k, v, o, gate, up, down inputs
            gptq_s = (calib_tok * (fwd_tok + attn_tok) * 2 / rate * gc.quant_layer_overhead
                      + mc.n_layers * (hess_flops / dev.flops["float32"] + columns * gc.gptq_column_s))
        else:
            gptq_s = (calib_tok * (fwd_tok + attn_tok) * 2 / rate + mc.n_layers * (
                hess_flops + 2 * mc.layer_params * mc.hidden) / dev.flops["float32"]) * pc.GPTQ_OVERHEAD
        add(StageName.GPTQ, inputs_b + hess_b, inputs_b + hess_b + retained if not gpu else inputs_b, model_b,
            gptq_s, p.seeds)
    qf = pc.FAKEQUANT_OVERHEAD if gpu else pc.CPU_QUANT_FORWARD_OVERHEAD[dtype]  # the quantised forward
    logits_b = p.seqlen * mc.vocab * 4
    eval_tok = p.eval_windows * p.seqlen
    if gpu:
        # per layer-window: the quantised forward (the measured overhead includes R4 and the R3 attention)
        # and the device statistics of q and k (scaled by their size). Memory: the need is one window; the
        # pipeline batches more into a share of what it finds free (calibrate.calibration_batch), so the
        # allocated peak on a large GPU is higher by design, never a reason not to fit.
        costs = pc.gpu_costs(dev.name)
        q_dim = mc.q_dim or mc.hidden
        win_b = pc.calib_window_bytes(mc.hidden, mc.intermediate, mc.n_heads, mc.n_kv_heads, mc.head_dim, b,
                                      p.seqlen)
        stats_s = costs.stats_s * (q_dim + mc.kv_dim) * p.seqlen / costs.stats_ref_elems
        calib_s = (calib_tok * (fwd_tok + attn_tok) / rate * costs.quant_layer_overhead
                   + p.calib_windows * mc.n_layers * stats_s)
        add(StageName.CALIBRATION, win_b, 0, 0, calib_s, p.seeds)
        eval_s = eval_tok * ((fwd_tok + attn_tok) / rate * costs.quant_layer_overhead + head_tok / rate)
    else:  # the decoder only, no lm_head; a GPTQ build gathers the statistics in GPTQ's pass (no time of its own)
        add(StageName.CALIBRATION, act_window, act_window + retained, 0,
            0.0 if p.gptq else calib_tok * ((fwd_tok + attn_tok) / rate + r4_s) * qf, p.seeds)
        eval_s = eval_tok * ((fwd_tok + attn_tok + head_tok) / rate + r4_s) * qf
    add(StageName.EVALUATION, act_window + logits_b, 0 if gpu else act_window + logits_b + retained, 0, eval_s,
        p.seeds * p.configs)
    for length in p.long_context:
        n_win = max(1, eval_tok // length)
        attn_l = 2 * mc.n_layers * length * mc.hidden
        add(f"long context L={length}", length * (4 * mc.hidden + 2 * mc.intermediate) * 4 + length * 4 * 1024,
            0, 0, n_win * length * ((fwd_tok + attn_l + head_tok) / rate + r4_s) * pc.FAKEQUANT_OVERHEAD,
            p.seeds * p.configs)
    return Plan(mc, dev, dtype, p, offload, stages)


def long_context_cells(plan: Plan, cells: Mapping[int, int], windows: int) -> Plan:
    """``plan`` with each long-context stage at ``windows`` windows per cell (the plan scores
    ``eval_windows × seqlen // L`` windows at L), run once per cell scored at that length (``cells``: L → count);
    a sweep of single-length cells (the claims' C7) is counted this way."""
    eval_tokens = plan.protocol.eval_windows * plan.protocol.seqlen
    for i, stage in enumerate(plan.stages):
        for length, count in cells.items():
            if stage.name == f"long context L={length}":
                per = stage.seconds * windows / max(1, eval_tokens // length)
                plan.stages[i] = replace(stage, seconds=per, repeats=count)
    return plan


def check_fits(plan: Plan, gpu_bytes: int | None = None, host_bytes: int | None = None) -> None:
    """Raise :class:`PlanDoesNotFit` (stage, need, budget, remedy) when a stage exceeds a memory budget.

    ``gpu_bytes`` defaults to the device's memory; ``host_bytes`` to no limit. Call before any expensive step.
    """
    gpu_budget = plan.device.memory_bytes if gpu_bytes is None else gpu_bytes
    for s in plan.stages:
        if plan.device.name != pc.DeviceName.CPU and s.gpu_bytes > gpu_budget:
            remedy = ("more GPU memory (a larger device)" if plan.offload else "--offload cpu (stream one "
                      "decoder layer at a time)") + ", or a smaller --calib-windows"
            remedy += ", or --dtype bfloat16" if plan.dtype == "float32" else ""
            raise PlanDoesNotFit(f"stage '{s.name}' needs {s.gpu_bytes / GIB:.1f} GiB of GPU memory, "
                                 f"{gpu_budget / GIB:.1f} GiB available: use {remedy}")
        if host_bytes is not None and s.host_bytes > host_bytes:
            raise PlanDoesNotFit(f"stage '{s.name}' needs {s.host_bytes / GIB:.1f} GiB of host RAM, "
                                 f"{host_bytes / GIB:.1f} GiB available: use a smaller --calib-windows"
                                 + (", --dtype bfloat16" if plan.dtype == "float32" else "") + ", or more memory")


def format_plan(plan: Plan) -> str:
    """The plan as a Markdown table plus the totals and the time basis."""
    mc, p = plan.model, plan.protocol
    lines = [f"plan: {mc.name} ({mc.params / 1e9:.2f}B parameters, {mc.n_layers} layers, hidden {mc.hidden}, "
             f"vocab {mc.vocab}) on {plan.device.name}, storage {plan.dtype}"
             + (", offload cpu" if plan.offload else ""),
             f"protocol: {p.calib_windows}x{p.seqlen} calibration, whip {p.whip_epochs} epochs, "
             f"{'GPTQ' if p.gptq else 'RTN'}, {p.configs} configs x {p.seeds} seeds, {p.eval_windows} eval windows",
             "",
             "| stage | GPU peak GiB | host RAM GiB | disk GiB | time per run | runs |", "|---|---|---|---|---|---|"]
    for s in plan.stages:
        lines.append(f"| {s.name} | {s.gpu_bytes / GIB:.1f} | {s.host_bytes / GIB:.1f} | {s.disk_bytes / GIB:.1f} | "
                     f"{_duration(s.seconds)} | {s.repeats} |")
    hours = plan.total_seconds / 3600
    unit = "GPU-hours" if plan.device.name != pc.DeviceName.CPU else "CPU-thread-hours"
    lines += ["", f"total: {hours:.2f} {unit}; peak GPU {plan.peak_gpu / GIB:.1f} GiB, "
              f"peak host {plan.peak_host / GIB:.1f} GiB", f"time basis: {plan.device.basis}",
              f"plan error against measurement: {pc.MEASURED_ERROR}"]
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"

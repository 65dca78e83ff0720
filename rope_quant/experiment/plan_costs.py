"""Cost constants of the plan's cost model (:mod:`rope_quant.experiment.plan`), and device specs.

CPU constants were measured on this project's 2-core CPU machine at 1 thread (torch 2.13 CPU, 2026-11-25):
a 2048³ matmul's best-of-3 rate, and one whip step at width 4096 (CholeskyQR2 forward + backward + the
rotated loss on 8 × 64 tokens: 26.3 s, i.e. 26 dense n³ matmuls at the float32 rate). No GPU was available in
this session: every CUDA rate below is **extrapolated** from the vendor's dense datasheet figure times an
assumed efficiency (:attr:`Device.basis` says so, and ``rope-quant plan`` prints it).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = ["DeviceName", "Device", "DEVICES", "CPU_FP32_FLOPS", "CPU_FP64_FLOPS", "WHIP_STEP_MATMULS",
           "GPTQ_OVERHEAD", "FAKEQUANT_OVERHEAD", "CPU_QUANT_FORWARD_OVERHEAD", "HOST_BASELINE_BYTES",
           "HOST_RETAINED_BYTES", "GPTQ_HESSIAN_COPIES", "GPTQ_WEIGHT_COPIES", "MEASURED_ERROR"]

GIB = 1 << 30

#: float32 / float64 dense matmul rate on one CPU thread (FLOP/s), measured (see the module docstring).
CPU_FP32_FLOPS = 79e9
CPU_FP64_FLOPS = 43e9
#: One whip step at width n costs this many dense n³ float32 matmuls (2 n³ FLOP each), measured at n = 4096.
WHIP_STEP_MATMULS = 26.0
#: GPTQ's time over its FLOP count (Python column loop, Cholesky, act_order permutations), measured in process
#: CPU seconds by the whole-pipeline probe (tests/numerics/scale_pipeline_probe.py, 1-layer Llama-2-7B at full
#: width, 1 thread, 2 × 2048 calibration tokens: 363 s against 247 s at the former assumed 3.0; docs/paper_scale.md).
GPTQ_OVERHEAD = 4.4
#: W4A4KV4 fake-quant forward over the plain forward, at 2 threads (README: 1.229×); the GPU rates use it.
FAKEQUANT_OVERHEAD = 1.23
#: On the CPU, the quantised forward of the calibration and evaluation stages (activation quantisers, online
#: R4, quantise-mode attention, calibration hooks, lm_head included) over its plain matmul FLOP time at the
#: float32 rate: measured in CPU seconds by the whole-pipeline probe at width 4096, 1 thread (calibration 3.2×,
#: evaluation 3.3× on the 1-layer Llama-2-7B shape, 2026-11-25). It does not transfer: the 1-layer Llama-3-8B
#: shape ran its quantised forward at 0.3–0.5× the plain FLOP time (see MEASURED_ERROR): the online R4 at
#: intermediate 11008 = 5504·2 takes 38 CPU s per 2048 tokens (a dense 5504² factor over a trailing axis of 2),
#: at 14336 = 28·512 0.2 s. Re-measure this constant when that transform is fixed.
CPU_QUANT_FORWARD_OVERHEAD = 3.2
#: GPTQ's host work on the widest linear (down_proj, in-features = intermediate): float32 Hessian copies at the
#: peak (the accumulator, its act_order permutation, the damped copy, its Cholesky factor, the inverse and the
#: inverse's upper factor: counted in ``rope_quant/quant/gptq.py``) and float32 copies of the weight (Wf, Q,
#: codes, the error terms); the copy count of the weight was fitted to the probe's peak RSS.
GPTQ_HESSIAN_COPIES = 6
GPTQ_WEIGHT_COPIES = 5
#: Host memory of the process besides the model and the stage's work (torch + transformers, allocator slack): an
#: estimate; with it the 1-layer Llama-2-7B probe came out at 4.31 GiB peak RSS against the plan's 4.33 GiB.
HOST_BASELINE_BYTES = int(0.55 * GIB)
#: Host memory that stays resident after the offline rotation on the CPU (allocator retention; the cause is not
#: isolated): the 1-layer Llama-2-7B probe held 0.67 GiB more than the model and the baseline in its calibration
#: stage (3.02 GiB against 2.35 GiB), RTN weights, 2026-11-25. Added to the host RAM of every later CPU stage.
HOST_RETAINED_BYTES = int(0.65 * GIB)

#: The plan's own error against measurement (measured / predicted), from the whole-pipeline CPU probe
#: (tests/numerics/scale_pipeline_probe.py, 1-layer Llama-2-7B at full width, 2 × 2048 calibration, GPTQ, 1 thread,
#: process CPU seconds on a loaded 2-core machine, 2026-11-25; table in docs/paper_scale.md). The GPTQ, quantised
#: forward and retention constants above were fitted on this shape (GPTQ time and memory in-sample; calibration and
#: evaluation fitted at 512 tokens, checked at 2048); GPU rows are extrapolated, never measured.
MEASURED_ERROR = ("CPU 1 thread, measured/plan: Llama-2-7B (fitted): peak RSS x0.93, whip R1 x0.72, rotation x0.71, "
                  "GPTQ x1.00, calibration x0.92, evaluation x1.04; Llama-3-8B / Mistral-7B / Qwen2.5-7B (RTN, out of "
                  "sample): peak RSS x1.12 / x1.11 / x1.24; Llama-3-8B: "
                  "whip x0.72, rotation x0.61, calibration x0.10, evaluation x0.15 (the slow online R4 at 11008 is "
                  "in the fitted overhead, docs/paper_scale.md); GPU: unmeasured")


class DeviceName(StrEnum):
    """Devices the plan knows (``--device``)."""

    CPU = "cpu"
    H100 = "h100"
    H200 = "h200"
    A100_80G = "a100-80g"
    A100_40G = "a100-40g"


@dataclass(frozen=True)
class Device:
    """Memory and effective matmul rates of one device; ``basis`` says where the rates come from."""

    name: DeviceName
    memory_bytes: int  # GPU memory (0 for the CPU)
    flops: dict  # storage dtype name -> effective FLOP/s of the pipeline's matmuls
    fp64_flops: float
    basis: str
    measured: bool


def _gpu(name: DeviceName, gib: float, bf16_tflops: float, fp32_tflops: float, fp64_tflops: float) -> Device:
    eff = 0.35  # assumed share of the datasheet rate reached by the pipeline's unfused matmuls
    return Device(name, int(gib * GIB),
                  {"bfloat16": bf16_tflops * 1e12 * eff, "float16": bf16_tflops * 1e12 * eff,
                   "float32": fp32_tflops * 1e12 * eff}, fp64_tflops * 1e12 * eff,
                  f"extrapolated: datasheet dense {bf16_tflops:g} TFLOP/s bf16, {fp32_tflops:g} TF32, "
                  f"{fp64_tflops:g} fp64, x{eff} assumed efficiency (not measured: no GPU this session)", False)


DEVICES: dict[DeviceName, Device] = {
    DeviceName.CPU: Device(DeviceName.CPU, 0, {"float32": CPU_FP32_FLOPS, "bfloat16": CPU_FP32_FLOPS / 4,
                                               "float16": CPU_FP32_FLOPS / 4}, CPU_FP64_FLOPS,
                           "measured: 1 CPU thread, 2-core machine, 2026-11-25", True),
    DeviceName.H100: _gpu(DeviceName.H100, 80, 989, 495, 67),
    DeviceName.H200: _gpu(DeviceName.H200, 141, 989, 495, 67),
    DeviceName.A100_80G: _gpu(DeviceName.A100_80G, 80, 312, 156, 19.5),
    DeviceName.A100_40G: _gpu(DeviceName.A100_40G, 40, 312, 156, 19.5),
}

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
           "GPTQ_OVERHEAD", "FAKEQUANT_OVERHEAD", "HOST_BASELINE_BYTES"]

GIB = 1 << 30

#: float32 / float64 dense matmul rate on one CPU thread (FLOP/s), measured (see the module docstring).
CPU_FP32_FLOPS = 79e9
CPU_FP64_FLOPS = 43e9
#: One whip step at width n costs this many dense n³ float32 matmuls (2 n³ FLOP each), measured at n = 4096.
WHIP_STEP_MATMULS = 26.0
#: GPTQ's wall time over its FLOP count (Python column loop, Cholesky): ASSUMED, not measured yet (the GPTQ
#: stage was not run at paper width in this session); the scale bench is where it gets checked.
GPTQ_OVERHEAD = 3.0
#: W4A4KV4 fake-quant forward over the plain forward, at 2 threads (README: 1.229×).
FAKEQUANT_OVERHEAD = 1.23
#: Host memory of the process besides the model and the stage's work (torch + transformers, allocator slack): an
#: estimate; with it the 1-layer Llama-2-7B probe came out at 4.31 GiB peak RSS against the plan's 4.33 GiB.
HOST_BASELINE_BYTES = int(0.55 * GIB)


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

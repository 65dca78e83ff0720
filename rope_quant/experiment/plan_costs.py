"""Cost constants of the plan's cost model (:mod:`rope_quant.experiment.plan`), and device specs.

The CPU's matmul rates are measured when a plan is made (:func:`measure_cpu_flops`: machines differ by 2×
and more); the constants below are ratios to those rates, fitted on the 1-layer full-width probes
(``tests/numerics/scale_pipeline_probe.py``, 1 thread, process CPU seconds; docs/paper_scale.md). No GPU has
been available to this project: every CUDA rate is **extrapolated** from the vendor's dense datasheet figure
times an assumed efficiency (:attr:`Device.basis` says so, and ``rope-quant plan`` prints it).
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["DeviceName", "Device", "DEVICES", "measure_cpu_flops", "cpu_device", "device", "WHIP_STEP_MATMULS",
           "WHIP_STEP_MATMULS_ANALYTIC", "WHIP_FIXED_MATMULS", "ROTATION_OVERHEAD", "GPTQ_OVERHEAD",
           "FAKEQUANT_OVERHEAD", "CPU_QUANT_FORWARD_OVERHEAD", "HOST_BASELINE_BYTES", "HOST_RETAINED_BYTES",
           "GPTQ_HESSIAN_COPIES", "GPTQ_WEIGHT_COPIES", "MEASURED_ERROR"]

GIB = 1 << 30

#: One whip step at width n costs this many dense n³ float32 matmuls (2 n³ FLOP each), measured at n = 4096:
#: with autograd through CholeskyQR2 (widths up to whip.AUTO_ANALYTIC_ABOVE) and with the closed-form gradient.
WHIP_STEP_MATMULS = 20.0
WHIP_STEP_MATMULS_ANALYTIC = 9.3
#: Once per fit: the float64 CholeskyQR2 of the start and of the fitted matrix, and their losses (n³ products at
#: the float64 rate).
WHIP_FIXED_MATMULS = 15.5
#: The offline rotation's time over its fold FLOPs (R1 on every weight, R2, R4; casts, blocks, Python).
ROTATION_OVERHEAD = 1.24
#: GPTQ's time over its FLOP count (Python column loop, Cholesky, act_order permutations), in process CPU
#: seconds over the float32 rate (1-layer Llama-2-7B at full width, 2 × 2048 calibration tokens).
GPTQ_OVERHEAD = 5.0
#: W4A4KV4 fake-quant forward over the plain forward, at 2 threads (README: 1.229×); the GPU rates use it.
FAKEQUANT_OVERHEAD = 1.23
#: On the CPU, the quantised forward of the calibration (decoder only) and evaluation (with the lm_head) stages
#: (activation quantisers, online R4, quantise-mode attention, hooks) over its matmul FLOP time at the storage
#: dtype's measured rate, per storage dtype: bfloat16's matmuls run on AMX at ~8x the float32 rate on the probe
#: machine, so its elementwise work weighs more (float16 is not measured: float32's value).
CPU_QUANT_FORWARD_OVERHEAD = {"float32": 1.15, "bfloat16": 2.2, "float16": 1.15}
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

#: The plan's own error against measurement (measured / predicted), from the whole-pipeline CPU probes
#: (tests/numerics/scale_pipeline_probe.py, 1 layer at full width, 1 thread, process CPU seconds, 2-core Xeon with
#: AMX, torch 2.13 CPU, 2026-11-26; tables in docs/paper_scale.md; `python tests/bench/bench_scale.py fit` refits,
#: `rows` recomputes). The time constants above are fitted on the four 7B shapes and the bf16 Llama-3-8B probe (a
#: refit on the final records moves none by more than 3%); Llama-3-70B is out of sample. GPU rows are extrapolated.
MEASURED_ERROR = ("CPU 1 thread, measured/plan: Llama-2-7B (GPTQ), Llama-3-8B, Mistral-7B, Qwen2.5-7B (fp32, RTN) and "
                  "Llama-3-8B (bf16, vocab 128256), fitted: peak RSS x0.87-0.98, whip R1 x0.95-1.06, rotation "
                  "x0.95-1.06, GPTQ x0.96, calibration x0.93-1.03, evaluation x0.91-1.00; Llama-3-70B (bf16, out of "
                  "sample): peak RSS x1.13, whip x0.71, rotation x1.11, calibration x0.93, evaluation x0.96; "
                  "GPU: unmeasured")


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
                  f"extrapolated: datasheet dense {bf16_tflops:g} TFLOP/s bf16, {fp32_tflops:g} fp32 (not TF32: "
                  f"torch's default, which rope_quant keeps), {fp64_tflops:g} fp64, x{eff} assumed efficiency, the "
                  "CPU-fitted overheads (not measured: no GPU has been lent to this project)", False)


def measure_cpu_flops() -> dict[str, float]:
    """Dense matmul FLOP/s of this machine on one thread, per dtype (best of 5 products of 1024² matrices after
    a warm-up, in thread CPU time; about 0.3 s in all, once per process). CPU machines differ by 2× and more,
    and 16-bit rates by ~8× (with or without AMX), so the CPU plan measures its rates instead of shipping them;
    the overheads above are ratios to these rates."""
    return dict(_measure_cpu_flops())


@functools.cache
def _measure_cpu_flops() -> tuple[tuple[str, float], ...]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rates = []
        for name in ("float32", "float64", "bfloat16", "float16"):
            dt = getattr(torch, name)
            a, b = torch.randn(1024, 1024).to(dt), torch.randn(1024, 1024).to(dt)
            a @ b
            best = math.inf
            for _ in range(5):  # the thread's CPU time: a busy machine does not slow the measured rate
                t = time.thread_time()
                a @ b
                best = min(best, time.thread_time() - t)
            rates.append((name, 2 * 1024 ** 3 / max(best, 1e-9)))
        return tuple(rates)
    finally:
        torch.set_num_threads(threads)


def cpu_device() -> Device:
    """The CPU at one thread, its matmul rates measured now (:func:`measure_cpu_flops`)."""
    r = measure_cpu_flops()
    return Device(DeviceName.CPU, 0, {k: r[k] for k in ("float32", "bfloat16", "float16")}, r["float64"],
                  f"measured on this machine now, 1 CPU thread: {r['float32'] / 1e9:.0f} GFLOP/s float32, "
                  f"{r['float64'] / 1e9:.0f} float64, {r['bfloat16'] / 1e9:.0f} bfloat16, {r['float16'] / 1e9:.0f} "
                  "float16 (1024² matmuls); overheads fitted on the 1-layer probes", True)


def device(name: DeviceName | str) -> Device:
    """The plan's device: the CPU's rates measured now, a GPU's extrapolated (:data:`DEVICES`)."""
    name = DeviceName(name)
    return cpu_device() if name == DeviceName.CPU else DEVICES[name]


#: The GPUs the plan knows (the CPU: :func:`cpu_device`).
DEVICES: dict[DeviceName, Device] = {
    DeviceName.H100: _gpu(DeviceName.H100, 80, 989, 67, 67),  # SXM datasheet; fp64 on tensor cores
    DeviceName.H200: _gpu(DeviceName.H200, 141, 989, 67, 67),
    DeviceName.A100_80G: _gpu(DeviceName.A100_80G, 80, 312, 19.5, 19.5),
    DeviceName.A100_40G: _gpu(DeviceName.A100_40G, 40, 312, 19.5, 19.5),
}

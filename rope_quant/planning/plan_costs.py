"""Cost constants of the plan's cost model (:mod:`rope_quant.planning.plan`), and device specs.

The CPU's matmul rates are measured when a plan is made (:func:`measure_cpu_flops`: machines differ by 2×
and more); the constants below are ratios to those rates, fitted on the 1-layer full-width probes
(``tests/numerics/scale_pipeline_probe.py``, 1 thread, process CPU seconds; docs/paper_scale.md).

On a GPU the costs are not FLOP ratios: calibration and evaluation cost per layer-window, GPTQ per column.
:data:`H100_MEASURED` holds per-unit costs **measured on one NVIDIA H100 80GB (torch 2.11.0+cu130,
transformers 5.17, 2026-11-27)** at the Llama-3-8B shape, of the code before 0.2.0's GPU-path work
(2 layers); each constant says which measurement it comes from. The H200
uses them as they are, the A100s scaled by datasheet ratios; the float64 rate is still extrapolated from the
datasheet (:attr:`Device.basis` says which is which, and ``rope-quant plan`` prints it).
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
           "GPTQ_HESSIAN_COPIES", "GPTQ_WEIGHT_COPIES", "MEASURED_ERROR", "GpuCosts", "H100_MEASURED", "gpu_costs",
           "CALIB_MEMORY_FRACTION", "CALIB_MAX_BATCH", "calib_window_bytes", "calibration_batch_for"]

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
#: inverse's upper factor: counted in ``rope_quant/quant/gptq_solve.py``) and float32 copies of the weight (Wf, Q,
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
                  "GPU: per-unit costs measured on an H100 (2026-11-27), the whole-run plan not yet checked "
                  "against tests/bench/bench_cuda_scale.py")


@dataclass(frozen=True)
class GpuCosts:
    """Per-unit costs of the pipeline's GPU stages (seconds and FLOP/s), and where they come from."""

    bf16_flops: float  # effective rate of the decoder forward's bf16 matmuls
    fp32_flops: float  # effective float32 rate (no TF32): Hessian accumulation, whip steps, the fold algebra
    quant_layer_overhead: float  # a quantised decoder layer's forward (W4A4KV4, R3, R4) over the plain one
    stats_s: float  # the device calibration statistics of one layer-window (q and k), at stats_ref_elems
    stats_ref_elems: int  # (n_q + n_kv heads) * head_dim * seqlen of the measured layer-window
    gptq_column_s: float  # GPTQ's column loop, seconds per column of one linear
    basis: str


# Llama-3-8B arithmetic behind the numbers below: one decoder layer is 218.1M weights, 0.9278 TFLOP per
# 2048-token window with attention; the 128256-row lm_head is 2.152 TFLOP per window.
#: Measured on one NVIDIA H100 80GB, torch 2.11.0+cu130, transformers 5.17, 2026-11-27, 2 full-width layers of
#: the Llama-3-8B shape in bf16 with the full vocabulary:
#: - ``bf16_flops``: the plain bf16 HF forward of 8 windows of 2048 took 0.054 s: 32.06 TFLOP / 0.054 s;
#: - ``fp32_flops``: one window's float32 Hessian update of down_proj (14336² x 2048 x 2 FLOP) took 16.7 ms;
#: - ``quant_layer_overhead``: W4A4KV4 evaluation of those 8 windows took 0.235 s: 12.87 ms per quantised
#:   layer-window (the lm_head at the plain rate) against 1.562 ms plain;
#: - ``stats_s``: the moments and top-k of q and k for one window, torch float64 on the device (the path of
#:   :mod:`rope_quant.calib.device_acc`), 0.84 ms (the host numpy path it replaced: 88.6 ms);
#: - ``gptq_column_s``: GPTQ measured 17.1 s per layer in the pipeline; less its two quantised forwards per
#:   window (3.30 s) and its float32 Hessians (2.68 s), 11.1 s over the layer's 38912 columns (the 4096 x 4096
#:   micro-benchmark: 129 µs per column, 75 µs without the per-column host sync).
H100_MEASURED = GpuCosts(
    bf16_flops=5.94e14, fp32_flops=5.04e13, quant_layer_overhead=8.24, stats_s=0.84e-3,
    stats_ref_elems=(32 + 8) * 128 * 2048, gptq_column_s=2.86e-4,
    basis="measured on one NVIDIA H100 80GB (torch 2.11.0+cu130, 2026-11-27; Llama-3-8B shape, 2 layers): forward "
          "5.94e14 bf16 FLOP/s, float32 5.04e13, quantised layer x8.24 the plain one, statistics 0.84 ms per "
          "layer-window, GPTQ 286 µs per column; float64 extrapolated from the datasheet")

#: Fraction of the free GPU memory one calibration forward may fill with its batch of windows.
CALIB_MEMORY_FRACTION = 0.25
#: Most windows per calibration forward (a 2048-token window already fills a GPU's matmuls).
CALIB_MAX_BATCH = 16


def calib_window_bytes(hidden: int, intermediate: int, n_heads: int, n_kv_heads: int, head_dim: int,
                       itemsize: int, seqlen: int) -> int:
    """Estimated GPU memory of one calibration window: the residual stream and attention outputs (six
    hidden-size rows per token at the storage dtype), the MLP's three intermediate-size rows, and the float64
    q/k pair channels the statistics widen (about six copies of the q and k outputs)."""
    per_token = itemsize * (6 * hidden + 3 * intermediate) + 8 * 6 * (n_heads + n_kv_heads) * head_dim
    return per_token * seqlen


def calibration_batch_for(free_bytes: int, window_bytes: int, n_windows: int) -> int:
    """Windows per calibration forward on a GPU with ``free_bytes`` free (at least 1)."""
    fit = int(CALIB_MEMORY_FRACTION * free_bytes // max(1, window_bytes))
    return max(1, min(CALIB_MAX_BATCH, n_windows, fit))


def gpu_costs(name: DeviceName | str) -> GpuCosts:
    """The per-unit costs of a GPU: the H100's measured ones (H200: the same chip's compute), the A100s' scaled
    by datasheet rate ratios (bf16 312/989, float32 19.5/67; the latency-bound terms kept)."""
    name = DeviceName(name)
    if name in (DeviceName.H100, DeviceName.H200):
        return H100_MEASURED
    m = H100_MEASURED
    return GpuCosts(m.bf16_flops * 312 / 989, m.fp32_flops * 19.5 / 67, m.quant_layer_overhead, m.stats_s,
                    m.stats_ref_elems, m.gptq_column_s,
                    "the H100's measured costs (2026-11-27) scaled by datasheet rate ratios (not measured on an "
                    "A100); float64 extrapolated from the datasheet")


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


def _gpu(name: DeviceName, gib: float, fp64_tflops: float) -> Device:
    """A GPU: matmul rates from :func:`gpu_costs`, the float64 rate from the datasheet."""
    eff = 0.35  # assumed share of the datasheet float64 rate (not measured)
    costs = gpu_costs(name)
    return Device(name, int(gib * GIB),
                  {"bfloat16": costs.bf16_flops, "float16": costs.bf16_flops, "float32": costs.fp32_flops},
                  fp64_tflops * 1e12 * eff,
                  f"per-unit GPU costs, {gpu_costs(name).basis}; float64 extrapolated: datasheet dense "
                  f"{fp64_tflops:g} TFLOP/s x{eff} assumed efficiency",
                  name in (DeviceName.H100, DeviceName.H200))


def measure_cpu_flops() -> dict[str, float]:
    """Dense matmul FLOP/s of this machine on one thread, per dtype (best of 5 products after a warm-up, in thread
    CPU time; under a second in all, once per process). A dtype whose 256² product takes more than 2 ms (a 16-bit
    type without a fast kernel: ~1 GFLOP/s) is timed at 256², the others at 1024². CPU machines differ by 2× and
    more, and 16-bit rates by ~8× (with or without AMX), so the CPU plan measures its rates instead of shipping
    them; the overheads above are ratios to these rates."""
    return dict(_measure_cpu_flops())


def _best_product_seconds(a, b, repeats: int = 5) -> float:
    best = math.inf
    for _ in range(repeats):  # the thread's CPU time: a busy machine does not slow the measured rate
        t = time.thread_time()
        a @ b
        best = min(best, time.thread_time() - t)
    return max(best, 1e-9)


@functools.cache
def _measure_cpu_flops() -> tuple[tuple[str, float], ...]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rates = []
        for name in ("float32", "float64", "bfloat16", "float16"):
            dt = getattr(torch, name)
            n = 256
            a, b = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)
            a @ b
            if _best_product_seconds(a, b, repeats=1) < 2e-3:  # a fast kernel: time it at the larger size
                n = 1024
                a, b = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)
                a @ b
            rates.append((name, 2 * n ** 3 / _best_product_seconds(a, b)))
        return tuple(rates)
    finally:
        torch.set_num_threads(threads)


def cpu_device() -> Device:
    """The CPU at one thread, its matmul rates measured now (:func:`measure_cpu_flops`)."""
    r = measure_cpu_flops()
    return Device(DeviceName.CPU, 0, {k: r[k] for k in ("float32", "bfloat16", "float16")}, r["float64"],
                  f"measured on this machine now, 1 CPU thread: {r['float32'] / 1e9:.0f} GFLOP/s float32, "
                  f"{r['float64'] / 1e9:.0f} float64, {r['bfloat16'] / 1e9:.0f} bfloat16, {r['float16'] / 1e9:.0f} "
                  "float16 (256² or 1024² matmuls); overheads fitted on the 1-layer probes", True)


def device(name: DeviceName | str) -> Device:
    """The plan's device: the CPU's rates measured now, a GPU's extrapolated (:data:`DEVICES`)."""
    name = DeviceName(name)
    return cpu_device() if name == DeviceName.CPU else DEVICES[name]


#: The GPUs the plan knows (the CPU: :func:`cpu_device`).
DEVICES: dict[DeviceName, Device] = {
    DeviceName.H100: _gpu(DeviceName.H100, 80, 67),  # SXM datasheet fp64 (tensor cores)
    DeviceName.H200: _gpu(DeviceName.H200, 141, 67),
    DeviceName.A100_80G: _gpu(DeviceName.A100_80G, 80, 19.5),
    DeviceName.A100_40G: _gpu(DeviceName.A100_40G, 40, 19.5),
}

"""The storage dtype ``--dtype auto`` picks for a device.

bfloat16 on a CUDA GPU that has it natively (compute capability 8.0 and later: A100, H100, ...), float16 on an
older one (V100, T4: bfloat16 there is emulated or refused, at a fraction of the speed), float32 on the CPU (the
CPU's numbers and cache keys do not move). float16 keeps bfloat16's memory but has 5 exponent bits: a value
above 65504 overflows to inf, which the calibration statistics refuse by name (NaN/Inf in the calibration
input) rather than averaging it in.
"""

from __future__ import annotations


def auto_dtype(device: str) -> tuple[str, str]:
    """(dtype name, note): the dtype ``--dtype auto`` resolves to on ``device`` ("cpu", "cuda", "cuda:N"), and
    a note saying why when it is not the usual one (empty otherwise)."""
    if not str(device).startswith("cuda"):
        return "float32", ""
    import torch

    if not torch.cuda.is_available():  # e.g. submitting from a login node: the GPU node decides nothing here
        return "bfloat16", ""
    index = torch.device(device).index
    if torch.cuda.is_bf16_supported(including_emulation=False):
        return "bfloat16", ""
    name = torch.cuda.get_device_name(index)
    major, minor = torch.cuda.get_device_capability(index)
    return "float16", (f"note: {name} (compute capability {major}.{minor}) has no native bfloat16 (needs 8.0+); "
                       "--dtype auto uses float16 (same memory; values above 65504 overflow and are refused by "
                       "name), or pass --dtype float32 for full range at twice the memory")

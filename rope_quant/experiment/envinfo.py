"""Per-run records: ``env.json`` (versions, device, source revision, time).

``env.json`` is written atomically through :mod:`rope_quant.io`, like every result file of a sweep
(docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from rope_quant.io import atomic_write_json

PACKAGES: tuple[tuple[str, str], ...] = (
    ("torch", "torch"),
    ("transformers", "transformers"),
    ("numpy", "numpy"),
    ("scipy", "scipy"),
    ("gguf", "gguf"),
    ("rope_quant", "rope-quant"),
)


def package_versions() -> dict[str, str]:
    """Installed versions of the packages a result depends on (``"not installed"`` when absent)."""
    versions: dict[str, str] = {}
    for key, dist in PACKAGES:
        try:
            versions[key] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[key] = "not installed"
    return versions


def source_revision(path: str | os.PathLike[str] | None = None) -> str:
    """``git rev-parse HEAD`` of the repository holding ``path`` (default: this package), else ``"unknown"``.

    A ``+dirty`` suffix marks uncommitted changes to tracked files, since the revision alone would then
    not reproduce the result.
    """
    where = Path(path) if path is not None else Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10, check=False
        )
        if head.returncode != 0 or not head.stdout.strip():
            return "unknown"
        rev = head.stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=where, capture_output=True, text=True, timeout=10, check=False,
        )
        if dirty.returncode == 0 and dirty.stdout.strip():
            rev += "+dirty"
        return rev
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_description(device: str | None = None) -> dict[str, Any]:
    """The compute device: requested name, CUDA availability and the CUDA device name if any."""
    info: dict[str, Any] = {"requested": device or "cpu", "cuda_available": False, "cuda_name": None}
    try:
        import torch  # deferred: heavy
    except ImportError:
        return info
    info["cuda_available"] = bool(torch.cuda.is_available())
    if info["cuda_available"]:
        index = 0
        if device and device.startswith("cuda:"):
            index = int(device.split(":", 1)[1])
        info["cuda_name"] = torch.cuda.get_device_name(index)
    info["torch_threads"] = torch.get_num_threads()
    return info


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else :func:`platform.processor`)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")) and ":" in line:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def blas_info() -> str:
    """The BLAS torch was built with (``BLAS_INFO`` of ``torch.__config__.show()``), else numpy's."""
    try:
        import torch  # deferred: heavy

        for part in torch.__config__.show().replace("\n", ",").split(","):
            if "BLAS_INFO=" in part:
                return "torch: " + part.split("=", 1)[1].strip()
    except (ImportError, AttributeError):
        pass
    try:
        import numpy as np

        blas = np.show_config(mode="dicts").get("Build Dependencies", {}).get("blas", {})
        return f"numpy: {blas.get('name', 'unknown')} {blas.get('version', '')}".strip()
    except (ImportError, TypeError, AttributeError):
        return "unknown"


def machine_info(float_mode: str | None = None) -> dict[str, Any]:
    """What moves the digits of a result between machines: CPU model, threads, BLAS, torch and
    transformers versions, and the float mode (``float_mode``: the run's own, e.g. ``"gptq float32"``, plus
    torch's matmul precision and default dtype)."""
    info: dict[str, Any] = {"cpu_model": cpu_model(), "cpu_count": os.cpu_count(), "machine": platform.machine(),
                            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "blas": blas_info()}
    versions = package_versions()
    info.update(torch=versions["torch"], transformers=versions["transformers"], numpy=versions["numpy"])
    mode: dict[str, Any] = {"run": float_mode}
    try:
        import torch  # deferred: heavy

        info["threads"] = torch.get_num_threads()
        mode.update(matmul_precision=torch.get_float32_matmul_precision(), default_dtype=str(torch.get_default_dtype()),
                    deterministic=torch.are_deterministic_algorithms_enabled())
    except ImportError:
        info["threads"] = None
    info["float_mode"] = mode
    return info


def env_info(device: str | None = None, protocol: dict[str, Any] | None = None) -> dict[str, Any]:
    """The content of ``env.json``: what produced a result, on what, and when (UTC, ISO 8601); ``protocol``:
    the offline rotations of the run (R1/R2/R4, the whip settings, the deviations from the paper's)."""
    return {
        **({"protocol": protocol} if protocol is not None else {}),
        "packages": package_versions(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "device": device_description(device),
        "source_revision": source_revision(),
        "timestamp": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }


def write_env(directory: str | os.PathLike[str], device: str | None = None,
              protocol: dict[str, Any] | None = None) -> Path:
    """Write ``directory/env.json`` atomically and return its path."""
    path = Path(directory) / "env.json"
    atomic_write_json(path, env_info(device, protocol))
    return path

"""Per-run records: ``env.json`` (versions, device, source revision, time) and atomic file writes.

Every result file of a sweep (DESIGN.md, "One cell, end to end", step 8) is written through
:func:`atomic_write_text` / :func:`atomic_write_json`: the content goes to a temporary file in the
same directory, is flushed to disk, and is moved into place with ``os.replace``. A reader therefore
sees either the old file or the complete new one, never a partial write, even when several
processes or hosts share the directory.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

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


def env_info(device: str | None = None) -> dict[str, Any]:
    """The content of ``env.json``: what produced a result, on what, and when (UTC, ISO 8601)."""
    return {
        "packages": package_versions(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "device": device_description(device),
        "source_revision": source_revision(),
        "timestamp": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }


def write_env(directory: str | os.PathLike[str], device: str | None = None) -> Path:
    """Write ``directory/env.json`` atomically and return its path."""
    path = Path(directory) / "env.json"
    atomic_write_json(path, env_info(device))
    return path


# ----------------------------------------------------------------------------- atomic writes


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` through a same-directory temporary file and ``os.replace``."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; give the file ordinary permissions
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return target


def _read_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _read_umask()  # read once at import: os.umask is process-wide and not thread-safe


def _umask() -> int:
    return _UMASK


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Atomic UTF-8 text write (see :func:`atomic_write_bytes`)."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def to_jsonable(obj: Any) -> Any:
    """Convert numpy/torch scalars and arrays, tuples, paths and dataclasses to plain JSON values.

    Non-finite floats become ``None`` so the file stays strict JSON (``NaN`` is not JSON).
    """
    import dataclasses

    if obj is None or isinstance(obj, (bool, str, int)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return to_jsonable(dataclasses.asdict(obj))
    if hasattr(obj, "tolist"):  # numpy arrays/scalars, torch tensors
        return to_jsonable(obj.tolist())
    if hasattr(obj, "__float__"):
        return to_jsonable(float(obj))
    return str(obj)


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> Path:
    """Atomic JSON write of ``obj`` (converted with :func:`to_jsonable`, strict: no NaN)."""
    text = json.dumps(to_jsonable(obj), indent=2, sort_keys=False, allow_nan=False)
    return atomic_write_text(path, text + "\n")

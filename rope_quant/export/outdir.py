"""The output directory of an export: checked before any expensive step, written whole or not at all.

:func:`check_out` refuses an existing non-empty directory unless ``overwrite``. :func:`staged` yields a fresh
temporary directory next to ``out`` (same file system); on success it is renamed into place (an old ``out``
is moved aside first and removed after the rename), on failure it is removed: ``out`` is either the old
content or the complete new export, never a half-written one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from rope_quant.export.fold import ExportError

__all__ = ["check_out", "staged"]


def check_out(out: str | os.PathLike[str], overwrite: bool) -> Path:
    """``out`` as a Path; :class:`ExportError` if it is a file, or a non-empty directory without ``overwrite``."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ExportError(f"--out {path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise ExportError(f"--out {path} exists and is not empty; pass --overwrite to replace it")
    if not path.parent.exists():
        raise ExportError(f"--out {path}: the parent directory {path.parent} does not exist")
    return path


@contextlib.contextmanager
def staged(out: str | os.PathLike[str], overwrite: bool) -> Iterator[Path]:
    """Yield a temporary directory that replaces ``out`` when the block exits without an exception."""
    path = check_out(out, overwrite)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        yield tmp
        check_out(path, overwrite)  # nothing appeared meanwhile
        old = None
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
            os.replace(path, old / "out")
        try:
            os.replace(tmp, path)
        except OSError:
            if old is not None:
                os.replace(old / "out", path)  # put the old export back
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

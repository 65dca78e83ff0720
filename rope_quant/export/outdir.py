"""The output directory of an export: checked before any expensive step, written whole or not at all.

:func:`check_out` refuses an existing non-empty directory unless ``overwrite``. :func:`staged` yields a fresh
temporary directory next to ``out`` (same file system); on success it is renamed into place (an old ``out``
is moved aside first and removed after the rename), on failure it is removed: ``out`` is either the old
content or the complete new export, never a half-written one.

A writer holds an OS advisory lock on ``.OUT.tmp-XXXX.lock`` (``filelock``: ``flock`` on POSIX) for as long as
its staging directory ``.OUT.tmp-XXXX`` exists. A killed writer (``kill -9`` included) releases the lock, so
:func:`remove_stale` (run by the next export to the same ``out``) can tell its leftovers from a live writer's:
it removes staging directories whose lock it can take, and puts an ``out`` that was moved aside for
``--overwrite`` back where it was. A write that fails on the disk (a full disk, a read-only filesystem) is an
:class:`OSError` with its errno, whichever library wrote the file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock, Timeout

from rope_quant.export.fold import ExportError

__all__ = ["check_out", "staged", "remove_stale"]

_LOCK = ".lock"
_OLD = ".old"
#: How a Rust library (safetensors) prints the OS error under its own exception type.
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


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


def _prefix(path: Path) -> str:
    return f".{path.name}.tmp-"


def remove_stale(out: str | os.PathLike[str]) -> list[str]:
    """Remove what killed exports to ``out`` left beside it (their staging directories, an old ``out`` moved
    aside is put back if ``out`` is missing); a live writer's are kept. Returns one note per removal."""
    path = Path(out)
    if not path.parent.is_dir():
        return []
    notes: list[str] = []
    for entry in sorted(path.parent.glob(_prefix(path) + "*")):
        if entry.name.endswith(_LOCK) and entry.with_name(entry.name[: -len(_LOCK)]).exists():
            continue  # handled with its staging directory
        staging = entry.with_name(entry.name[: -len(_LOCK)]) if entry.name.endswith(_LOCK) else entry
        if staging.name.endswith(_OLD):
            continue  # handled with its staging directory
        lock = FileLock(str(staging.with_name(staging.name + _LOCK)), timeout=0)
        try:
            lock.acquire()
        except Timeout:
            continue  # a live writer
        try:
            old = staging.with_name(staging.name + _OLD)
            if (old / "out").is_dir() and not path.exists():
                os.replace(old / "out", path)
                notes.append(f"note: {path} was moved aside by a killed export: put back")
            for leftover in (staging, old):
                if leftover.exists():
                    shutil.rmtree(leftover, ignore_errors=True)
                    notes.append(f"note: removed {leftover.name}, left beside {path} by a killed export")
        finally:
            lock.release()
            with contextlib.suppress(OSError):
                Path(lock.lock_file).unlink()
    return notes


def _os_error(exc: BaseException, where: Path) -> OSError | None:
    """The OSError inside another library's exception (``SafetensorError: … (os error 28)``), else None."""
    if isinstance(exc, OSError):
        return None
    found = _RUST_OS_ERROR.search(str(exc))
    if found is None:
        return None
    code = int(found.group(1))
    return OSError(code, os.strerror(code) if code in errno.errorcode else str(exc), str(where))


@contextlib.contextmanager
def staged(out: str | os.PathLike[str], overwrite: bool) -> Iterator[Path]:
    """Yield a temporary directory that replaces ``out`` when the block exits without an exception."""
    path = check_out(out, overwrite)
    remove_stale(path)
    fd, name = tempfile.mkstemp(prefix=_prefix(path), suffix=_LOCK, dir=path.parent)
    os.close(fd)
    lock = FileLock(name)
    lock.acquire()  # before the directory exists: a directory without a held lock is a dead writer's
    tmp = Path(name[: -len(_LOCK)])
    try:
        tmp.mkdir()
        try:
            yield tmp
        except Exception as exc:
            found = _os_error(exc, path)
            if found is not None:
                raise found from exc
            raise
        check_out(path, overwrite)  # nothing appeared meanwhile
        old = None
        if path.exists():
            old = tmp.with_name(tmp.name + _OLD)
            old.mkdir()
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
    finally:
        lock.release()
        with contextlib.suppress(OSError):
            Path(name).unlink()

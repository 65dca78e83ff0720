"""File output shared by every layer: atomic writes, strict JSON, Markdown tables, the cache (standard library
only; torch is imported by the cache's tensor reader and writer when they run).

Every result, cache and artefact file is written through :func:`atomic_writer` (or its bytes / text /
JSON shorthands): the content goes to a temporary file with a unique name (``tempfile.mkstemp``) in the
target's directory, is flushed and fsync'ed, and is moved into place with ``os.replace``; the directory
is then fsync'ed where the platform allows. A reader therefore sees either the old file or the complete
new one, never a partial write, even when several processes or hosts share the directory; a writer
that fails leaves the old file and no temporary file behind. See docs/ARCHITECTURE.md.

The cache: one root (:func:`cache_root`: ``$ROPE_QUANT_CACHE_DIR``, else ``$XDG_CACHE_HOME/rope_quant``, else
``~/.cache/rope_quant``), one reader (:func:`read_cache`: the content or None, a damaged file warned about by
name on one channel, the ``rope_quant.cache`` logger, then rebuilt by the caller) and one writer
(:func:`save_tensors`, atomic).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar

__all__ = [
    "atomic_writer",
    "atomic_write_bytes",
    "atomic_write_text",
    "atomic_write_json",
    "json_text",
    "to_jsonable",
    "markdown_table",
    "CACHE_ENV",
    "cache_log",
    "cache_root",
    "read_cache",
    "load_tensors",
    "save_tensors",
]

#: The environment variable that moves the cache root.
CACHE_ENV = "ROPE_QUANT_CACHE_DIR"
#: The one channel of every cache warning (an unreadable file, a failed write).
cache_log = logging.getLogger("rope_quant.cache")
_T = TypeVar("_T")


def _read_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _read_umask()  # read once at import: os.umask is process-wide and not thread-safe


def _fsync_directory(directory: Path) -> None:
    """Best effort: make the rename durable (not possible on every platform or file system)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike[str]) -> Iterator[IO[bytes]]:
    """Yield a binary file object whose content replaces ``path`` atomically when the block exits.

    For writers that need a file object (``torch.save``, ``np.savez``, ``fig.savefig``). The parent
    directory is created if needed; the file gets ordinary permissions (``0o666`` less the umask), not
    ``mkstemp``'s private ``0o600``. If the block raises, the temporary file is removed, ``path`` is
    left as it was and the exception propagates.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        os.chmod(tmp, 0o666 & ~_UMASK)
        with os.fdopen(fd, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_directory(target.parent)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_writer`); returns the path."""
    with atomic_writer(path) as handle:
        handle.write(data)
    return Path(path)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Atomic UTF-8 text write (see :func:`atomic_writer`)."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def to_jsonable(obj: Any) -> Any:
    """Convert numpy/torch scalars and arrays, tuples, sets, paths and dataclasses to plain JSON values.

    Non-finite floats become ``None`` so the file stays strict JSON (``NaN`` is not JSON); anything
    else unknown becomes its ``str``.
    """
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


def json_text(obj: Any) -> str:
    """The file content for ``obj``: :func:`to_jsonable`, strict JSON (no NaN), indent 2, final newline."""
    return json.dumps(to_jsonable(obj), indent=2, sort_keys=False, allow_nan=False) + "\n"


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> Path:
    """Atomic JSON write of ``obj`` as :func:`json_text`."""
    return atomic_write_text(path, json_text(obj))


def markdown_table(
    rows: Iterable[Mapping[str, Any]], columns: Sequence[str], headers: Sequence[str] | None = None
) -> str:
    """A GitHub Markdown table: one line per row, cells ``str(row.get(column, ""))``, no final newline.

    ``headers`` (default: ``columns``) label the columns; the separator line is ``|---|---|...``.
    """
    labels = list(columns if headers is None else headers)
    if len(labels) != len(columns):
        raise ValueError(f"{len(labels)} headers for {len(columns)} columns")
    lines = ["| " + " | ".join(labels) + " |", "|" + "---|" * len(labels)]
    lines += ["| " + " | ".join(str(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the cache


def cache_root(env: str = CACHE_ENV, *parts: str) -> Path:
    """``$<env>``, else ``$XDG_CACHE_HOME/rope_quant/<parts>``, else ``~/.cache/rope_quant/<parts>``."""
    given = os.environ.get(env)
    if given:
        return Path(given).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache").joinpath("rope_quant", *parts)


def read_cache(path: str | os.PathLike[str] | None, reader: Callable[[Path], _T], what: str,
               then: str = "rebuilding it") -> _T | None:
    """``reader(path)``, or None: a missing file silently, a damaged one (any exception of ``reader``: truncated,
    garbage, another format) with a warning on :data:`cache_log` naming ``what`` and the file; the caller
    rebuilds it."""
    if path is None or not Path(path).is_file():
        return None
    try:
        return reader(Path(path))
    except FileNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001 - a damaged cache is rebuilt, whatever broke it
        cache_log.warning("ignoring unreadable %s %s (%s: %s); %s", what, path, type(exc).__name__, exc, then)
        return None


def load_tensors(path: Path, mmap: bool = False) -> Any:
    """A cache file written by :func:`save_tensors` (tensors and plain containers only: ``weights_only``)."""
    import torch  # deferred: this module stays importable without torch

    return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


def save_tensors(path: str | os.PathLike[str], obj: Any, what: str = "cache") -> bool:
    """``torch.save(obj)`` atomically (:func:`atomic_writer`); False (warned on :data:`cache_log`) when the file
    cannot be written: a cache that is not written is recomputed next time."""
    import torch  # deferred: this module stays importable without torch

    try:
        with atomic_writer(path) as handle:
            torch.save(obj, handle)
        return True
    except OSError as exc:
        cache_log.warning("could not write %s %s: %s", what, path, exc)
        return False

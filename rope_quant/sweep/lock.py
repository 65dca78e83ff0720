"""Advisory locks on a results directory (two runs may share one): one study per directory, one computation per cell.

Two locks, both OS advisory locks on small files under ``DIR/.locks/`` (``filelock``: ``flock`` on POSIX), so a
process that dies (kill -9 included) releases them at once and a stale lock is simply taken over:

* the **study lock** (``DIR/.locks/study.lock``) is held while a run checks ``manifest.json`` against its own
  study and writes it (:func:`rope_quant.sweep.manifest.commit_manifest`): two runs started together cannot
  both pass the check, so the second one gets the same diff error as a run started after the first;
* a **cell claim** (``DIR/.locks/cells/<name>/seed<k>-<key>.json.lock``, the record's relative path) is held
  while one process computes a cell (:mod:`rope_quant.sweep.runner`): identical runs and shards skip a claimed
  cell, come back to it at the end, and take it over only if its holder left no complete record (or died).

The lock files are left in place (empty; removing a lock file another process may be about to lock would
break mutual exclusion).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout

LOCK_DIR = ".locks"
STUDY_LOCK = "study.lock"
STUDY_TIMEOUT_S = 600.0


class StudyLockTimeout(TimeoutError):
    """Another process held a results directory's study lock for too long (``manifest.py`` turns it into a
    ``SweepError``: this module stays below the manifest)."""


def lock_dir(out: str | os.PathLike[str]) -> Path:
    """``DIR/.locks``, created on demand."""
    path = Path(out) / LOCK_DIR
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def study_lock(out: str | os.PathLike[str], timeout: float = STUDY_TIMEOUT_S) -> Iterator[Path]:
    """Hold ``DIR/.locks/study.lock`` (blocking up to ``timeout`` seconds) around a manifest check and write."""
    path = lock_dir(out) / STUDY_LOCK
    lock = FileLock(str(path), timeout=timeout)
    try:
        lock.acquire()
    except Timeout as exc:
        raise StudyLockTimeout(f"{out}: another run has held {path} for over {timeout:.0f}s; is it stuck? "
                               "(the lock is released when that process exits)") from exc
    try:
        yield path
    finally:
        lock.release()


class CellClaim:
    """The claim on one cell's computation: ``try_claim()`` without waiting, ``wait_claim()`` blocking.

    ``relpath`` is the cell record's path relative to ``DIR`` (one claim per (name, seed, key)).
    """

    def __init__(self, out: str | os.PathLike[str], relpath: str | os.PathLike[str]) -> None:
        path = lock_dir(out) / f"{relpath}.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = FileLock(str(path), timeout=-1)

    def try_claim(self) -> bool:
        """Claim the cell if no live process holds it; False when another one does."""
        try:
            self._lock.acquire(timeout=0)
        except Timeout:
            return False
        return True

    def wait_claim(self) -> None:
        """Block until the holder releases the claim (finished, failed or died), then claim it."""
        self._lock.acquire()

    def release(self) -> None:
        if self._lock.is_locked:
            self._lock.release()

    def __enter__(self) -> CellClaim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

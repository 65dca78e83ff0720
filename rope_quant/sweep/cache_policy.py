"""What a sweep keeps in its default cache directory, and the line that says so at the end of a run.

The default cache (``DIR/cache``, no ``--cache-dir``) keeps only what resuming needs. A seed's quantised
weights (``weights-*.pt``, ~300 MB each on the embedded model) and its calibration statistics
(``stats-*.npz``, ~50 MB, mostly the K sample) are deleted as soon as every cell of the manifest that reads
them has a complete record: no cell can need them again, and a rerun with ``--no-resume`` or new configs
recomputes them bit for bit. The whip R1 fits (``r1-whip-*.pt``, ~1 MB per seed) are kept: they are
small and the slowest thing to refit. ``--keep-cache`` keeps everything; an explicit ``--cache-dir`` (a
cache shared between runs or Slurm tasks) is never pruned.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: File kinds of the pipeline's cache directory, by file-name prefix (pipeline.py names them).
KINDS = {"weights-": "quantised weights", "stats-": "calibration statistics", "r1-whip-": "whip R1 fits"}


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:  # removed meanwhile (another shard)
        return 0


def _kind(name: str) -> str:
    return next((label for prefix, label in KINDS.items() if name.startswith(prefix)), "other")


def usage(cache_dir: str | os.PathLike[str]) -> dict[str, tuple[int, int]]:
    """{kind: (files, bytes)} of the files directly under ``cache_dir`` (empty if it does not exist)."""
    out: dict[str, tuple[int, int]] = {}
    root = Path(cache_dir)
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        if path.is_file():
            n, b = out.get(_kind(path.name), (0, 0))
            out[_kind(path.name)] = (n + 1, b + _size(path))
    return out


@dataclass
class CachePruner:
    """Deletes the weights and statistics of a manifest's cells once all cells reading them are complete.

    ``complete(i)`` says whether cell ``i`` has a complete record. Call :meth:`after_cell` after each cell
    (the runner does); :attr:`freed` counts the bytes removed.
    """

    cache_dir: Path
    cells: list[tuple[str, Any]]
    complete: Any
    freed: int = 0
    removed: list[Path] = field(default_factory=list)

    @staticmethod
    def _key(cfg: Any, key_of: str) -> str:
        """``cfg``'s weight or statistics key (a long-context cell's are its run config's)."""
        return getattr(cfg if hasattr(cfg, key_of) else cfg.run, key_of)()

    def _groups(self, key_of: str) -> dict[str, list[int]]:
        groups: dict[str, list[int]] = {}
        for i, (_, cfg) in enumerate(self.cells):
            groups.setdefault(self._key(cfg, key_of), []).append(i)
        return groups

    def after_cell(self, index: int) -> list[Path]:
        """Prune the files of cell ``index``'s weight and statistics keys if every cell sharing them is done."""
        cfg = self.cells[index][1]
        removed: list[Path] = []
        for key_of, prefix, suffix in (("weight_key", "weights-", ".pt"), ("stats_key", "stats-", ".npz")):
            key = self._key(cfg, key_of)
            if all(self.complete(i) for i in self._groups(key_of)[key]):
                removed += self._remove(self.cache_dir.glob(f"{prefix}{key}-*{suffix}"))
        return removed

    def _remove(self, paths: Iterable[Path]) -> list[Path]:
        done = []
        for path in paths:
            size = _size(path)
            try:
                path.unlink()
            except FileNotFoundError:  # another process pruned it first
                continue
            self.freed += size
            done.append(path)
        self.removed += done
        return done


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def policy_lines(cache_dir: str | os.PathLike[str], pruner: CachePruner | None) -> list[str]:
    """The cache policy printed at the end of a run: what is kept, where, how big, how to clear it."""
    cache_dir = Path(cache_dir)
    use = usage(cache_dir)
    total = sum(b for _, b in use.values())
    kept = ", ".join(f"{label} {n} file(s) {_mb(b)}" for label, (n, b) in sorted(use.items())) or "nothing"
    lines = [f"cache: {cache_dir} holds {_mb(total)} ({kept})"]
    if pruner is None:
        lines.append("cache policy: everything is kept (--keep-cache or an explicit --cache-dir); "
                     "weights and statistics make later runs of the same seeds skip quantisation")
    else:
        lines.append(f"cache policy: weights and calibration statistics are deleted once every cell using them "
                     f"is complete ({len(pruner.removed)} file(s), {_mb(pruner.freed)} freed this run); "
                     + ("the whip R1 fits are kept; " if KINDS["r1-whip-"] in use else "")
                     + "--keep-cache keeps everything")
    lines.append(f"cache: deleting {cache_dir} is always safe (it only costs recomputation): rm -r {cache_dir}")
    return lines


def default_pruner(out: str | os.PathLike[str], manifest: Any, *, keep: bool, cache_dir: Any = None
                   ) -> CachePruner | None:
    """The pruner of a sweep's default cache ``DIR/cache``; None when everything is kept: ``keep``
    (``--keep-cache``) or an explicit ``cache_dir`` (never pruned)."""
    from rope_quant.sweep import records, runner

    if keep or cache_dir:
        return None
    out = Path(out)

    def complete(i: int) -> bool:
        name, cfg = manifest.cells[i]
        return records.is_complete(records.cell_path(out, name, cfg), cfg.key())

    return CachePruner(out / runner.CACHE_DIR, list(manifest.cells), complete)

"""Slurm submission: one array task per shard of a results directory, through submitit when installed.

The executor is submitit's ``AutoExecutor``: on a Slurm login node it submits a Slurm job array;
``cluster="local"`` runs the same pickled tasks as subprocesses of this machine (submitit's
``LocalExecutor``, no cluster: tests/numerics/test_submitit_local.py, or a dry run before a long queue).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from rope_quant.sweep.cells import CellFn
from rope_quant.sweep.manifest import SweepError, read_manifest
from rope_quant.sweep.runner import run_shard


def submit_slurm(
    out: str | os.PathLike[str], n_shards: int, *, folder: str | os.PathLike[str] | None = None,
    cluster: str | None = None, cell_fn: CellFn | None = None,
    cache_dir: str | os.PathLike[str] | None = None, resume: bool = True, **parameters: Any,
) -> list[Any]:
    """Submit ``n_shards`` array tasks (submitit.AutoExecutor), task ``i`` running :func:`run_shard` ``(out, i, n)``.

    submitit is imported lazily and is not a core dependency (extras ``[slurm]`` and ``[eval]``);
    ``parameters`` go to ``executor.update_parameters`` (e.g. ``timeout_min``, ``slurm_partition``,
    ``gpus_per_node``). ``cluster`` picks the executor (``None``: submitit's choice, Slurm where
    ``sbatch`` exists, else local; or ``"slurm"``, ``"local"``). ``cache_dir`` is the weight
    cache of every task (default ``out/cache``; put it on storage every node sees); ``resume=False``
    recomputes complete cells; ``cell_fn`` replaces the real pipeline in every task and must pickle
    (a module-level function, or a ``functools.partial`` of one, importable in the tasks).
    Returns submitit's jobs, one per shard.
    """
    if n_shards < 1:
        raise SweepError("--slurm needs a positive number of array tasks")
    if cell_fn is not None and not callable(cell_fn):
        raise SweepError(f"cell_fn must be callable, got {cell_fn!r}")
    try:
        import submitit
    except ImportError as exc:
        raise SweepError("--slurm needs submitit: pip install submitit") from exc
    read_manifest(out)  # fail early without a manifest
    kind = {} if cluster is None else {"cluster": cluster}
    executor = submitit.AutoExecutor(folder=str(folder or Path(out) / "slurm"), **kind)
    executor.update_parameters(**parameters)
    options: dict[str, Any] = {}
    if cell_fn is not None:
        options["cell_fn"] = cell_fn
    if cache_dir is not None:
        options["cache_dir"] = str(cache_dir)
    if not resume:
        options["resume"] = False
    task = functools.partial(run_shard, **options) if options else run_shard
    outs = [str(out)] * n_shards
    return executor.map_array(task, outs, list(range(n_shards)), [n_shards] * n_shards)

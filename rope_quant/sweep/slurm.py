"""Slurm submission: one array task per shard of a results directory, through submitit when installed."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rope_quant.sweep.manifest import SweepError, read_manifest
from rope_quant.sweep.runner import run_shard


def submit_slurm(
    out: str | os.PathLike[str], n_shards: int, *, folder: str | os.PathLike[str] | None = None,
    **parameters: Any,
) -> list[Any]:
    """Submit ``n_shards`` Slurm array tasks (submitit.AutoExecutor), each running :func:`run_shard`.

    submitit is imported lazily and is not a dependency; ``parameters`` go to
    ``executor.update_parameters`` (e.g. ``timeout_min``, ``slurm_partition``, ``gpus_per_node``).
    """
    try:
        import submitit
    except ImportError as exc:
        raise SweepError("--slurm needs submitit: pip install submitit") from exc
    read_manifest(out)  # fail early without a manifest
    executor = submitit.AutoExecutor(folder=str(folder or Path(out) / "slurm"))
    executor.update_parameters(**parameters)
    outs = [str(out)] * n_shards
    return executor.map_array(run_shard, outs, list(range(n_shards)), [n_shards] * n_shards)

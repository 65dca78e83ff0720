"""A cheap cell function for sweeps that run in other processes (submitit's local executor).

Module-level, so cloudpickle pickles it by reference and the array tasks import it from this directory
(the test puts it on PYTHONPATH). Every computation appends one line to ``LOG/computations``; a cell
named in ``LOG/kill_at`` SIGKILLs its own process mid-cell, once (the file is removed first), after its
computation has started and before its record can be written.
"""

from __future__ import annotations

import hashlib
import os
import signal
from pathlib import Path
from typing import Any

COMPUTATIONS = "computations"
KILL_AT = "kill_at"


def cell_label(cfg: Any) -> str:
    return f"{cfg.r3}@{cfg.seed}"


def counting_cell(log_dir: str, cfg: Any) -> dict[str, Any]:
    """A deterministic result of ``cfg`` (a function of its key), logging the computation."""
    log = Path(log_dir)
    label = cell_label(cfg)
    with open(log / COMPUTATIONS, "a") as handle:  # O_APPEND: one short line per write, shards interleave safely
        handle.write(f"{label}\n")
    kill_at = log / KILL_AT
    if kill_at.is_file() and kill_at.read_text().strip() == label:
        kill_at.unlink()
        os.kill(os.getpid(), signal.SIGKILL)
    jitter = int(hashlib.sha256(cfg.key().encode()).hexdigest()[:8], 16) / 16**8  # in [0, 1)
    ppl = 12.0 + 0.1 * cfg.seed + (cfg.r3 != "hadamard") * (0.5 + 0.2 * jitter)
    return {"ppl": ppl, "n_windows": 1, "n_tokens": 10, "k_range_mean": 1.0 + jitter, "k_rel_err": 0.01 * jitter}

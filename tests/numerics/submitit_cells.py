"""Cheap cell functions for sweeps that run in other processes (submitit's local executor).

Module-level, so cloudpickle pickles them by reference and the array tasks import them from this directory
(the test puts it on PYTHONPATH): :func:`counting_cell` for a compare study, :func:`claims_cell` for a claims
study. Every computation appends one line to ``LOG/computations``; a cell
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


def _computing(log_dir: str, label: str) -> None:
    """Log the computation of ``label``; SIGKILL this process here when ``LOG/kill_at`` names it (once)."""
    log = Path(log_dir)
    with open(log / COMPUTATIONS, "a") as handle:  # O_APPEND: one short line per write, shards interleave safely
        handle.write(f"{label}\n")
    kill_at = log / KILL_AT
    if kill_at.is_file() and kill_at.read_text().strip() == label:
        kill_at.unlink()
        os.kill(os.getpid(), signal.SIGKILL)


def counting_cell(log_dir: str, cfg: Any) -> dict[str, Any]:
    """A deterministic result of ``cfg`` (a function of its key), logging the computation."""
    _computing(log_dir, cell_label(cfg))
    jitter = int(hashlib.sha256(cfg.key().encode()).hexdigest()[:8], 16) / 16**8  # in [0, 1)
    ppl = 12.0 + 0.1 * cfg.seed + (cfg.r3 != "hadamard") * (0.5 + 0.2 * jitter)
    return {"ppl": ppl, "n_windows": 1, "n_tokens": 10, "k_range_mean": 1.0 + jitter, "k_rel_err": 0.01 * jitter}


def claims_label(cfg: Any) -> str:
    """A claims-study cell: its R3, estimator, seed and GPTQ float mode (unique within the study)."""
    f = cfg.flat()
    return f"{f['r3']}+{f['estimator']}@{f['seed']}" + (".float64" if f["gptq"].float64 else "")


def claims_cell(log_dir: str, cfg: Any) -> dict[str, Any]:
    """The claims stand-in of tests/numerics/test_claims_cli.py, logged and killable: a seed-shared draw, pairwise_only
    2 PPL above hadamard, k_only 0.5 PPL below rows, a small float-order move."""
    import numpy as np

    _computing(log_dir, claims_label(cfg))
    f = cfg.flat()
    shared = np.random.default_rng(f["seed"]).normal(0, 0.4)
    own = np.random.default_rng([f["seed"], len(f["r3"]), len(f["estimator"]), int(f["gptq"].float64)]).normal(0, 0.05)
    ppl = float(14.0 + shared + own + 2.0 * (f["r3"] == "pairwise_only") - 0.5 * (f["estimator"] == "k_only"))
    return {"ppl": ppl, "n_tokens": 64, "k_range_mean": ppl / 4, "k_rel_err": ppl / 100}

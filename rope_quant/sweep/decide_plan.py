"""What a ``rope-quant decide`` run keeps and refuses, shared by its loop (:mod:`rope_quant.sweep.claims_decide`),
the claims study and the directory store: a cell's float-order replicate (the same cell with GPTQ in the other
float mode, named ``NAME`` + :data:`REPLICATE_SUFFIX`), the plan kept in ``DIR/decide.json`` and the
:class:`DecideError` of bad input.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from rope_quant.sweep.cellkind import SweepError, run_of, with_overrides

STATE_FILE = "decide.json"
DECISIONS_FILE = "decisions.json"
REPLICATE_SUFFIX = ".float-order"
"""The name of a config's float-order replicate cells (GPTQ in the other float mode)."""


class DecideError(SweepError):
    """Input the decide loop refuses before it builds anything (the CLI's exit 2)."""


def replicate_config(cfg: Any) -> Any | None:
    """The cell with GPTQ in the other float mode (float64 ↔ float32), or None where no float-order replicate
    exists (weights not GPTQ-quantised)."""
    from rope_quant.quant.quantizers import OFF_BITS

    run = run_of(cfg)
    if run.w_bits >= OFF_BITS or str(run.weights) != "gptq":
        return None
    gptq = run.quant.w.gptq
    return with_overrides(cfg, gptq=dataclasses.replace(gptq, float64=not gptq.float64))


def plan_state(out: Path, first: int, max_seeds: int, shape: str) -> dict[str, Any]:
    """The plan kept in ``DIR/decide.json`` (a new one at ``first`` seeds); a changed M or shape is refused."""
    path = out / STATE_FILE
    if path.is_file():
        state = json.loads(path.read_text())
        if int(state["max_seeds"]) != max_seeds:
            raise DecideError(f"{path}: this directory's plan was fixed at --max-seeds {state['max_seeds']} (looks "
                              f"{state['first']}…{state['max_seeds']}); rerun with --max-seeds {state['max_seeds']}, "
                              "or decide in a fresh directory (changing M after looking breaks the error bound)")
        fixed = state.get("shape", "normal")  # a plan written before the boundary had a shape used the t boundary
        if fixed != shape:
            raise DecideError(f"{path}: this directory's plan was fixed with --shape {fixed}; rerun with --shape "
                              f"{fixed}, or decide in a fresh directory (changing the boundary after looking "
                              "breaks the error bound)")
        return state
    return {"first": first, "max_seeds": max_seeds, "shape": shape}

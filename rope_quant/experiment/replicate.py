"""A cell's float-order replicate: the one rule every front reads (docs/verdicts.md).

The decision rule pairs each cell with its float-order replicate, the same cell computed in another float order;
the replicate interval bounds the numerical noise of the paired difference. Which replicate a cell has follows
from its weights alone (:func:`replicate_kind`):

* GPTQ weights (``w_bits`` < 16): the cell rebuilt with GPTQ's Hessians and column loop in the other float mode
  (float64 ↔ float32; :func:`replicate_overrides`);
* unquantised weights (``w_bits`` 16 or ``weights="none"``: the key claims' 4-bit keys alone): no step depends on
  the float order, so the cell is its own replicate (a shift of 0);
* weights quantised otherwise (round-to-nearest): no replicate is built, and the rule cannot decide a paired part
  (inconclusive, the missing replicate named).

``rope-quant decide`` and the claims sweep (sweep/decide.py, sweep/claims_sweep.py), a results directory read as a
claims store (sweep/claim_store.py) and pytest's registry fronts (tests/_support/registry_front.py) all ask here.
"""

from __future__ import annotations

import dataclasses
from enum import StrEnum
from typing import Any

from rope_quant.experiment.config import RunConfig
from rope_quant.experiment.specs import WeightMode
from rope_quant.quant.quantizers import OFF_BITS


class Replicate(StrEnum):
    """What a cell's float-order replicate is."""

    REBUILD = "rebuild"  # GPTQ weights: the cell rebuilt with GPTQ in the other float mode
    ITSELF = "itself"  # unquantised weights: no step depends on the float order (a shift of 0)
    NONE = "none"  # weights quantised without GPTQ: no replicate, a paired part cannot be decided


def replicate_kind(run: RunConfig) -> Replicate:
    """The float-order replicate of ``run`` (module docstring)."""
    mode = WeightMode(str(run.weights))
    if run.w_bits >= OFF_BITS or mode is WeightMode.NONE:
        return Replicate.ITSELF
    return Replicate.REBUILD if mode is WeightMode.GPTQ else Replicate.NONE


def replicate_overrides(run: RunConfig) -> dict[str, Any]:
    """The flat overrides that make ``run`` its own float-order replicate: GPTQ in the other float mode for a
    :attr:`Replicate.REBUILD` cell, none for a cell that is its own replicate; ValueError where none exists."""
    kind = replicate_kind(run)
    if kind is Replicate.NONE:
        raise ValueError(f"a cell with {run.weights} weights at W{run.w_bits} has no float-order replicate")
    if kind is Replicate.ITSELF:
        return {}
    gptq = run.quant.w.gptq
    return {"gptq": dataclasses.replace(gptq, float64=not gptq.float64)}

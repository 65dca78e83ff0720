"""NIAH sweeps (App. G): the manifest of ``rope-quant niah`` and what computes one of its cells.

A cell is a :class:`~rope_quant.sweep.kinds.niah.NiahConfig` (its cell kind): one configuration at one seed
answering every probe of a :class:`~rope_quant.scoring.niah.NiahSpec` (lengths × depths × probes). ``fp`` cells
answer with the unquantised model (plain SDPA, no rotation); the other cells with the seed's quantised model (the
pipeline's, reconfigured per R3 in the paired design, see :mod:`rope_quant.sweep.cells`), whose online R3 and K/V
quantisers act during generation. Cells are written, resumed and sharded by the ordinary runner; each record keeps
every probe (key, number, needle position, output, score).

Its report is :mod:`rope_quant.analysis.niah_report` (accuracy per length and depth, paired differences,
discriminative lengths, the accuracy figure).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from rope_quant.defaults import DEFAULT_COMPARATOR, NIAH_SATURATION, NIAH_SEPARATION
from rope_quant.scoring.niah import NiahSpec
from rope_quant.sweep.kinds.niah import NiahConfig, haystack_stream, niah_result, scored
from rope_quant.sweep.manifest import Manifest, with_overrides

__all__ = ["KIND", "FP", "DEFAULT_CONFIGS", "NiahConfig", "niah_manifest", "niah_result", "haystack_stream", "scored",
           "spec_hash", "SATURATION", "SEPARATION"]

KIND = "niah"
FP = "fp"
#: The configs of the App. G table.
DEFAULT_CONFIGS = ("hadamard", "pairwise_only", "pairwise_plus_hadamard")
SATURATION = NIAH_SATURATION
SEPARATION = NIAH_SEPARATION


def niah_manifest(base: Any, configs: Sequence[str], seeds: Sequence[int], spec: NiahSpec, *,
                  fp: bool = True, comparator: str = DEFAULT_COMPARATOR) -> Manifest:
    """Cells (seed-major): ``fp`` (unless ``fp=False``) then each R3 config of ``configs``."""
    cells = []
    for seed in seeds:
        run = with_overrides(base, seed=int(seed))
        if fp:
            cells.append((FP, NiahConfig(with_overrides(run, r3="identity"), spec, fp=True)))
        cells += [(name, NiahConfig(with_overrides(run, r3=name), spec)) for name in configs]
    meta = {name: {"r3": name} for name in configs}
    if fp:
        meta[FP] = {"r3": None, "unquantised": True}
    return Manifest(cells=cells, study=KIND, comparator=comparator, meta=meta)


def spec_hash(spec: NiahSpec) -> str:
    """A short content hash of the NIAH settings (for file names)."""
    return hashlib.sha256(json.dumps(spec.to_dict(), sort_keys=True).encode()).hexdigest()[:12]

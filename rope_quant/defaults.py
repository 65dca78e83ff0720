"""The default model, corpus and comparator names, the sequential rule's seed cap and boundary shape, and the
paper's named bit settings (App. F's lower bits, 4-bit keys alone): the one place they are spelled (imports
nothing of the project).

The embedded SmolLM2-135M (:mod:`rope_quant.model.loading`) and the embedded ``pydoc`` corpus
(:mod:`rope_quant.corpora.sources`) run everywhere offline; the run configuration, the CLI and the pytest
plugin default to them. Every paired statistic compares a configuration against the comparator, the online
Hadamard R3 of the paper, unless a run names another (``--comparator``) or a config names its own control.
"""

from collections.abc import Mapping
from enum import StrEnum
from types import MappingProxyType

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_CORPUS = "pydoc"
DEFAULT_COMPARATOR = "hadamard"
#: The most seeds a claim may use under the sequential rule when ``--max-seeds`` / ``--rq-max-seeds`` is not given
#: (:mod:`rope_quant.core.sequential`).
DEFAULT_MAX_SEEDS = 40
#: The sequential rule's early stop: an open claim whose chance of a decision by M is below this stops
#: (``rope_quant.core.sequential.predictive_power``; ``--futility`` / ``--rq-futility`` 0 turns it off).
DEFAULT_FUTILITY = 0.10


class Shape(StrEnum):
    """What the sequential rule's boundary assumes of the per-seed effects (:mod:`rope_quant.core.boundary`; the
    claims JSON's ``shape``; ``--shape`` / ``--rq-shape``)."""

    NORMAL = "normal"
    SKEW_ROBUST = "skew_robust"
    CONTAMINATION_ROBUST = "contamination_robust"


#: The sequential rule's default boundary: valid for skewed and heavy-tailed per-seed effects.
DEFAULT_SHAPE = Shape.SKEW_ROBUST


#: App. F's bit settings as (W, A, K, V): the lower bits and the W4A4KV4 reference (``compare --configs lower-bits``,
#: :mod:`rope_quant.sweep.presets`; the App. F claim, :mod:`rope_quant.claims.paper`).
LOWER_BIT_SETTINGS: dict[str, tuple[int, int, int, int]] = {
    "W4A4KV4": (4, 4, 4, 4), "W4A3KV4": (4, 3, 4, 4), "W3A3KV3": (3, 3, 3, 3)}

#: 4-bit keys alone (W16A16K4V16): unquantised weights, no R1, R2 or R4, as flat config overrides (the key
#: claims' ``KV4`` setting, :mod:`rope_quant.claims.keys`; App. I's KV-only rows).
KEYS_ALONE: Mapping[str, int | str | bool] = MappingProxyType({
    "w_bits": 16, "a_bits": 16, "k_bits": 4, "v_bits": 16, "weights": "none", "r1": "identity", "r2": "identity",
    "r4": False})

#: App. G: FP accuracy at or above this counts as near saturation (the length is within the model's reach).
NIAH_SATURATION = 0.9
#: App. G: the quantised configs "separate" at a length when their mean accuracies spread by at least this much.
NIAH_SEPARATION = 0.05

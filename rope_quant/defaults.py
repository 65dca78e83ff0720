"""The default model, corpus and comparator names, the sequential rule's seed cap and boundary shape: the one
place they are spelled (imports nothing of the project).

The embedded SmolLM2-135M (:mod:`rope_quant.model.loading`) and the embedded ``pydoc`` corpus
(:mod:`rope_quant.experiment.data`) run everywhere offline; the run configuration, the CLI and the pytest
plugin default to them. Every paired statistic compares a configuration against the comparator, the online
Hadamard R3 of the paper, unless a run names another (``--comparator``) or a config names its own control.
"""

from enum import StrEnum

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

"""rope_quant: R3 (the online q/k rotation after RoPE) in rotation-based W4A4KV4 quantisation.

The public API is the names in ``__all__``, loaded on first use (``import rope_quant`` imports no torch)::

    import rope_quant as rq
    cfg = rq.RunConfig(...)                       # the config: small frozen specs (docs/ARCHITECTURE.md, step 1)
    qm = rq.build_quantized_model(cfg)            # one cell's model: rotations, weights, calibration, R3
    record = rq.run_cell(cfg)                     # ... and its evaluation
    rq.transforms.names(); rq.transforms.build("hadamard", 64)   # the R3 registry
    rq.paired_ci(a, b); rq.holm(pvalues)          # the paired statistics of the claims
    rq.hadamard_matrix(64)                        # constructed Hadamard matrices and transforms

Everything else is importable from its layer, bottom up (imports point downwards; docs/ARCHITECTURE.md):
``io`` → ``core`` (pure math, the R3 registry) → ``model`` (architecture adapter, loading) → ``quant``
(quantisers, GPTQ) → ``calib`` (statistics, angle objectives, diagnostics) → ``rotations`` (R1/R2/R4, whip,
the attention hook) → ``corpora`` (text, documents, token streams) → ``planning`` (the cost plan) → ``scoring``
(perplexity, long context, NIAH) → ``experiment`` (config, pipeline) → ``sweep`` (manifests, records, runner,
presets) → ``analysis`` (report) → ``cli``. ``pytest_plugin`` imports nothing heavy. The 0.1.0 flat module paths
(``rope_quant.hadamard``, ...) still import, with a DeprecationWarning, until 0.3.0: one import hook and one
table in ``_deprecation.py``, no files.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from rope_quant import _deprecation

_deprecation.install()

__version__ = "0.2.0"

# public name -> the module that defines it (a module itself where the name is the module's last part).
_PUBLIC: dict[str, str] = {
    # the config of one cell (experiment/config.py) and the quantiser config it composes
    "RunConfig": "rope_quant.experiment.config",
    "WeightSpec": "rope_quant.experiment.config",
    "QuantSpecs": "rope_quant.experiment.config",
    "WhipSpec": "rope_quant.experiment.config",
    "RotationSpec": "rope_quant.experiment.config",
    "R3Spec": "rope_quant.experiment.config",
    "Budget": "rope_quant.experiment.config",
    "Runtime": "rope_quant.experiment.config",
    "WeightMode": "rope_quant.experiment.config",
    "PipelineError": "rope_quant.experiment.config",
    "QuantConfig": "rope_quant.quant.quantizers",
    # build and run one cell
    "build_quantized_model": "rope_quant.experiment.pipeline",
    "run_cell": "rope_quant.experiment.pipeline",
    "QuantizedModel": "rope_quant.experiment.pipeline",
    "load_model": "rope_quant.model.loading",
    "load_corpus": "rope_quant.corpora.token_streams",
    "perplexity": "rope_quant.scoring.evaluate",
    # the R3 registry (names, build, register, ...) and its base class
    "transforms": "rope_quant.core",
    "R3Transform": "rope_quant.core.transforms",
    # the paired statistics behind every claim
    "PairedCI": "rope_quant.core.stats",
    "paired_ci": "rope_quant.core.stats",
    "paired_t_pvalue": "rope_quant.core.stats",
    "equivalent": "rope_quant.core.stats",
    "holm": "rope_quant.core.stats",
    # constructed Hadamard matrices and fast transforms
    "hadamard_matrix": "rope_quant.core.hadamard",
    "hadamard_transform": "rope_quant.core.hadamard",
    "random_hadamard": "rope_quant.core.hadamard",
}

__all__ = [
    "__version__",
    "RunConfig", "WeightSpec", "QuantSpecs", "WhipSpec", "RotationSpec", "R3Spec", "Budget", "Runtime",
    "WeightMode", "PipelineError", "QuantConfig",
    "build_quantized_model", "run_cell", "QuantizedModel", "load_model", "load_corpus", "perplexity",
    "transforms", "R3Transform",
    "PairedCI", "paired_ci", "paired_t_pvalue", "equivalent", "holm",
    "hadamard_matrix", "hadamard_transform", "random_hadamard",
]


def __getattr__(name: str) -> Any:
    """Load a public name on first use, so that ``import rope_quant`` (and the pytest plugin) stays light."""
    where = _PUBLIC.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(where)
    value = importlib.import_module(f"{where}.{name}") if where == "rope_quant.core" else getattr(module, name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:  # what static checkers and IDEs see; never executed
    from rope_quant.core import transforms
    from rope_quant.core.hadamard import hadamard_matrix, hadamard_transform, random_hadamard
    from rope_quant.core.stats import PairedCI, equivalent, holm, paired_ci, paired_t_pvalue
    from rope_quant.core.transforms import R3Transform
    from rope_quant.corpora.token_streams import load_corpus
    from rope_quant.experiment.config import (
        Budget,
        PipelineError,
        QuantSpecs,
        R3Spec,
        RotationSpec,
        RunConfig,
        Runtime,
        WeightMode,
        WeightSpec,
        WhipSpec,
    )
    from rope_quant.experiment.pipeline import QuantizedModel, build_quantized_model, run_cell
    from rope_quant.model.loading import load_model
    from rope_quant.quant.quantizers import QuantConfig
    from rope_quant.scoring.evaluate import perplexity

"""The real cell function: one sweep cell through :mod:`rope_quant.experiment.pipeline`, plus its φ artefacts.

A *cell function* maps a cell config to its result dict; the runner takes one as a parameter
(:data:`CellFn`). :func:`pipeline_cell_fn` builds the real one over a :class:`ModelCache`; tests pass
fakes instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rope_quant.io import atomic_writer
from rope_quant.sweep.cellkind import CellContext, kind_of, run_of
from rope_quant.sweep.loaded_models import ModelCache, process_models
from rope_quant.sweep.manifest import ARTIFACTS_DIR

CellFn = Callable[[Any], Mapping[str, Any]]


def artifact_dir(out: str | os.PathLike[str], cfg: Any) -> Path:
    """Where a cell's φ artefacts live: ``DIR/artifacts/<key>/`` (angles, statistics, frequencies)."""
    return Path(out) / ARTIFACTS_DIR / cfg.key()


def save_artifacts(directory: str | os.PathLike[str], qm: Any) -> None:
    """Save a built cell's angles (``angles.npy``), calibration statistics (without the K sample: the
    statistics cache has it) and deployed frequencies."""
    import numpy as np

    from rope_quant.calib.verify import save_frequencies

    directory = Path(directory)
    with atomic_writer(directory / "angles.npy") as handle:
        np.save(handle, np.asarray(qm.angles, dtype=np.float64))
    qm.stats.save(directory / "stats.npz", k_sample=False)  # φ verification reads moments only (≈6 of 53 MB)
    per_layer = None
    if np.ndim(qm.inv_freq) == 2:  # one row per layer (Gemma 3): name each layer's buffer
        from rope_quant.model import arch

        per_layer = arch.inv_freq_by_layer(qm.model)[1]
    save_frequencies(directory / "frequencies.json", qm.inv_freq, qm.inv_freq_source, per_layer)


def _uses_angles(run_cfg: Any) -> bool:
    from rope_quant.core import transforms

    try:
        return transforms.needs_angles(run_cfg.r3)
    except transforms.TransformError:
        return False


def pipeline_cell_fn(
    cache_dir: str | os.PathLike[str] | None = None, artifacts: str | os.PathLike[str] | None = None,
    progress: bool = False, *, models: ModelCache | None = None,
) -> CellFn:
    """A cell function over :mod:`rope_quant.experiment.pipeline`, reusing one base model and corpus.

    The base model and its corpora come from ``models`` (default: :func:`process_models`, shared by the
    sweeps of this process). Consecutive cells that share weights and calibration statistics (the R3
    variants of one seed; the runner orders cells by ``weight_key``) reuse one built model through
    ``QuantizedModel.reconfigure``, which redoes only the angles, the R3 and the K/V quantisers
    (docs/ARCHITECTURE.md).

    Each cell is computed by its kind's ``evaluate`` (:func:`rope_quant.sweep.cellkind.kind_of`; the built-in
    kinds are in :mod:`rope_quant.sweep.kinds`): short-context cells give ``pipeline.run_cell``'s dict,
    long-context cells ``{"lengths": {L: {ppl, ...} | {error...}}, k_range_mean, ...}``, lm-eval cells
    ``{"tasks": {task: {metric: value}}, "samples": ...}``, NIAH cells their probes, static cells their scales.
    With ``artifacts`` (a results directory) each cell's angles, statistics and frequencies are saved
    under :func:`artifact_dir` for ``rope-quant verify``.
    """
    import gc

    from rope_quant.experiment import pipeline  # deferred: heavy

    cache = models if models is not None else process_models()
    current: list[Any] = []  # the last built QuantizedModel, reused for R3 variants of the same seed

    def model_for(run_cfg: Any) -> tuple[Any, bool]:
        """Reconfigure the last model when only R3/KV settings differ (paired design), else build.

        Returns (model, whether it was reused)."""
        if current:
            qm = current[0]
            same_source = (qm.cfg.model, qm.cfg.model_id, qm.cfg.device) == \
                (run_cfg.model, run_cfg.model_id, run_cfg.device)
            if same_source and qm.cfg.weight_key() == run_cfg.weight_key() and \
                    qm.cfg.stats_key() == run_cfg.stats_key():
                try:
                    return qm.reconfigure(run_cfg, progress=progress), True
                except pipeline.PipelineError:
                    pass
            current.clear()
            del qm
            gc.collect()
        base, corpora = cache.get(run_cfg.model, run_cfg.device, identity=run_cfg.model_id)
        # a resolved corpus is held under its content identity: new text under the same path is reloaded
        corpus_key = run_cfg.corpus if run_cfg.corpus_id is None else f"{run_cfg.corpus}@{run_cfg.corpus_id}"
        if corpus_key not in corpora:
            from rope_quant.corpora import token_streams

            corpora[corpus_key] = token_streams.load_corpus(run_cfg.corpus, base[1])
        qm = pipeline.build_quantized_model(run_cfg, cache_dir=cache_dir, base=base,
                                            corpus=corpora[corpus_key], progress=progress)
        current.append(qm)
        return qm, False

    def quantized(cfg: Any) -> tuple[Any, bool]:
        run_cfg = run_of(cfg)
        try:
            qm, reused = model_for(run_cfg)
        except BaseException:
            current.clear()
            raise
        if artifacts is not None and _uses_angles(run_cfg):
            save_artifacts(artifact_dir(artifacts, cfg), qm)
        return qm, reused

    def base(run_cfg: Any) -> tuple[tuple[Any, Any], dict]:
        return cache.get(run_cfg.model, run_cfg.device, identity=run_cfg.model_id)

    ctx = CellContext(quantized=quantized, base=base, progress=progress)

    def run(cfg: Any) -> Mapping[str, Any]:
        return kind_of(cfg).evaluate(cfg, ctx)

    return run

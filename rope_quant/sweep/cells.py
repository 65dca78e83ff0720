"""The real cell function: one sweep cell through :mod:`rope_quant.experiment.pipeline`, plus its φ artefacts.

A *cell function* maps a cell config to its result dict; the runner takes one as a parameter
(:data:`CellFn`). :func:`pipeline_cell_fn` builds the real one over a :class:`ModelCache`; tests pass
fakes instead.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rope_quant.io import atomic_writer
from rope_quant.sweep.manifest import ARTIFACTS_DIR, LmEvalConfig, LongContextConfig, run_of
from rope_quant.sweep.models import ModelCache, process_models

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


def _ppl_entry(value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        return dict(value)
    entry = dataclasses.asdict(value)
    entry.pop("window_nll", None)
    return entry


def _long_context_stream(cfg: LongContextConfig, run_cfg: Any, qm: Any) -> tuple[Any, Any]:
    """The token stream a long-context cell scores and its :class:`~rope_quant.experiment.longctx.EvalStream`:
    the first ``cfg.eval_docs`` evaluation documents of ``cfg.eval_corpus`` (else the calibration corpus), or
    the whole evaluation split when ``eval_docs`` is None (older cells)."""
    from rope_quant.experiment import longctx

    corpus = cfg.eval_corpus or run_cfg.corpus
    if cfg.eval_docs is not None:
        stream = longctx.eval_stream(corpus, qm.tokenizer, cfg.eval_docs)
        return stream.ids, stream
    if corpus == run_cfg.corpus:
        ids, docs = qm.corpus.eval_ids, qm.corpus.eval_docs
    else:
        from rope_quant.experiment.data import load_corpus

        loaded = load_corpus(corpus, qm.tokenizer)
        ids, docs = loaded.eval_ids, loaded.eval_docs
    return ids, longctx.EvalStream(corpus, ids, tuple(docs), len(docs), None)


def _niah_cell(cfg: Any) -> Any:
    """The NIAH sweep module when ``cfg`` is a NIAH cell (App. G), else None."""
    from rope_quant.sweep import niah

    return niah if isinstance(cfg, niah.NiahConfig) else None


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

    Short-context cells give ``pipeline.run_cell``'s dict; :class:`LongContextConfig` cells give
    ``{"lengths": {L: {ppl, nll, n_windows, n_tokens, seqlen} | {error...}}, k_range_mean, ...}``;
    :class:`LmEvalConfig` cells give lm-eval's ``{"tasks": {task: {metric: value}}, "samples": ...}``
    (:class:`rope_quant.sweep.lm_eval.LmEvalCells`).
    With ``artifacts`` (a results directory) each cell's angles, statistics and frequencies are saved
    under :func:`artifact_dir` for ``rope-quant verify``.
    """
    import gc

    from rope_quant.experiment import pipeline  # deferred: heavy

    cache = models if models is not None else process_models()
    current: list[Any] = []  # the last built QuantizedModel, reused for R3 variants of the same seed
    lm_eval_cells: list[Any] = []  # created on the first lm-eval cell (lm-eval is an optional extra)

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
            from rope_quant.experiment import data

            corpora[corpus_key] = data.load_corpus(run_cfg.corpus, base[1])
        qm = pipeline.build_quantized_model(run_cfg, cache_dir=cache_dir, base=base,
                                            corpus=corpora[corpus_key], progress=progress)
        current.append(qm)
        return qm, False

    def run(cfg: Any) -> Mapping[str, Any]:
        run_cfg = run_of(cfg)
        niah = _niah_cell(cfg)
        if niah is not None and cfg.fp:  # NIAH's unquantised reference: the base model, plain attention
            (model, tokenizer), corpora = cache.get(run_cfg.model, run_cfg.device, identity=run_cfg.model_id)
            return niah.niah_result(cfg, model, tokenizer, niah.haystack_stream(cfg, tokenizer, corpora), progress)
        try:
            qm, reused = model_for(run_cfg)
        except BaseException:
            current.clear()
            raise
        if artifacts is not None and _uses_angles(run_cfg):
            save_artifacts(artifact_dir(artifacts, cfg), qm)
        if niah is not None:
            corpora = cache.get(run_cfg.model, run_cfg.device, identity=run_cfg.model_id)[1]
            stream = niah.haystack_stream(cfg, qm.tokenizer, corpora)
            return {**niah.niah_result(cfg, qm.model, qm.tokenizer, stream, progress), "model_reused": reused}
        if isinstance(cfg, LmEvalConfig):
            if not lm_eval_cells:
                from rope_quant.sweep.lm_eval import LmEvalCells

                lm_eval_cells.append(LmEvalCells())
            return {**lm_eval_cells[0](cfg, qm), "model_reused": reused}
        if hasattr(cfg, "static_fields"):  # rope-quant static (App. A.6): scales per length, then scored
            from rope_quant.sweep.static import evaluate_static_cell

            return {**evaluate_static_cell(cfg, qm, progress=progress), "model_reused": reused}
        if not isinstance(cfg, LongContextConfig):
            return {**pipeline.run_cell(run_cfg, qm=qm, progress=progress), "model_reused": reused}
        from rope_quant.experiment import evaluate

        eval_ids, protocol = _long_context_stream(cfg, run_cfg, qm)
        diag = qm.attach_diagnostics()
        start = time.perf_counter()
        max_windows = run_cfg.eval_windows or evaluate.LONG_CONTEXT_MAX_WINDOWS
        try:
            if cfg.matched_average:  # φ* re-estimated with averaging length L for every length L
                res = {}
                for length in cfg.lengths:
                    qm.reconfigure(run_cfg.override(average_length=int(length)), progress=progress)
                    for st in qm.states:  # reconfigure installs fresh attention states
                        st.diagnostics = diag
                    res.update(evaluate.long_context(qm.model, eval_ids, (length,),
                                                     max_windows=max_windows, device=run_cfg.device,
                                                     progress=progress))
                qm.reconfigure(run_cfg, progress=progress)
            else:
                res = evaluate.long_context(qm.model, eval_ids, cfg.lengths, max_windows=max_windows,
                                            device=run_cfg.device, progress=progress)
        finally:
            qm.detach_diagnostics()
        from rope_quant.experiment.longctx import deviations, protocol_record

        lengths = {str(k): _ppl_entry(v) for k, v in res.items()}
        if cfg.matched_average:
            for entry in lengths.values():
                entry.setdefault("average_length", int(entry.get("seqlen") or entry.get("length")))
        unmatched = [] if cfg.matched_average or not run_cfg.position_average else ["this cell"]
        devs = deviations(calib_corpus=run_cfg.corpus, eval_corpora=(protocol.corpus,),
                          max_documents=cfg.eval_docs, cap=max_windows, lengths=cfg.lengths,
                          unmatched_phi_star=unmatched, count_corpora=False)
        return {"lengths": lengths, **diag.summary(),
                "protocol": {**protocol_record(protocol, cfg.lengths, max_windows, run_cfg.corpus),
                             "matched_average": cfg.matched_average, "estimator": run_cfg.estimator.value,
                             "angle": run_cfg.angle.value, "deviations": devs},
                "timing": {**qm.timing, "eval_s": time.perf_counter() - start}, "model_reused": reused}

    return run

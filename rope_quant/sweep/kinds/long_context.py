"""The long-context cell kind (App. A.4): a RunConfig evaluated at several context lengths."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rope_quant.sweep.cellkind import CellContext, CellKind, CellKindName, SweepError, WrapsRun, config_dict, register
from rope_quant.sweep.scoring import scored_lengths


@dataclass(frozen=True)
class LongContextConfig(WrapsRun):
    """A long-context cell: a RunConfig evaluated at several context lengths (App. A.4).

    ``key()`` adds the lengths to the run's key; ``weight_key()`` is the run's, so long-context cells
    share weights and calibration with the short-context cells of the same seed. ``matched_average``
    (φ* cells, ``run.angle == phi_star``) re-estimates φ* for every evaluated L with averaging length L.
    ``eval_corpus``: the corpus scored at long context when it differs from the calibration corpus
    ``run.corpus`` (App. A.4: calibrate on one corpus, evaluate on others); None scores ``run.corpus``.
    ``eval_docs``: the stream is the first ``eval_docs`` documents of the evaluation split, concatenated
    (A.4: 64; :mod:`rope_quant.scoring.longctx`); None scores the whole evaluation split (older cells).
    """

    run: Any
    lengths: tuple[int, ...]
    matched_average: bool = False
    eval_corpus: str | None = None
    eval_docs: int | None = None

    def __post_init__(self) -> None:
        lengths = tuple(int(v) for v in self.lengths)
        if not lengths or any(v < 2 for v in lengths) or len(set(lengths)) != len(lengths):
            raise SweepError(f"lengths must be distinct integers >= 2, got {self.lengths!r}")
        object.__setattr__(self, "lengths", lengths)
        if self.matched_average and not getattr(self.run, "position_average", False):
            raise SweepError("matched_average re-estimates φ* per length: the run needs angle='phi_star'")
        if self.eval_docs is not None and (isinstance(self.eval_docs, bool) or not isinstance(self.eval_docs, int)
                                           or self.eval_docs < 1):
            raise SweepError(f"eval_docs must be None or a positive integer, got {self.eval_docs!r}")

    def key(self) -> str:
        extra: dict[str, Any] = {"lengths": list(self.lengths)}
        if self.matched_average:
            extra["matched_average"] = True
        if self.eval_corpus is not None:
            extra["eval_corpus"] = self.eval_corpus
        if self.eval_docs is not None:
            extra["eval_docs"] = self.eval_docs
        return self._hash(extra)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"run": config_dict(self.run), "lengths": list(self.lengths)}
        if self.matched_average:
            out["matched_average"] = True
        if self.eval_corpus is not None:
            out["eval_corpus"] = self.eval_corpus
        if self.eval_docs is not None:
            out["eval_docs"] = self.eval_docs
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LongContextConfig:
        from rope_quant.experiment.config import RunConfig  # deferred: heavy

        return cls(RunConfig.from_dict(dict(data["run"])), tuple(data["lengths"]),
                   matched_average=bool(data.get("matched_average", False)),
                   eval_corpus=data.get("eval_corpus"), eval_docs=data.get("eval_docs"))


def _ppl_entry(value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        return dict(value)
    entry = dataclasses.asdict(value)
    entry.pop("window_nll", None)
    return entry


def long_context_stream(cfg: LongContextConfig, run_cfg: Any, qm: Any) -> tuple[Any, Any]:
    """The token stream a long-context cell scores and its :class:`~rope_quant.scoring.longctx.EvalStream`:
    the first ``cfg.eval_docs`` evaluation documents of ``cfg.eval_corpus`` (else the calibration corpus), or
    the whole evaluation split when ``eval_docs`` is None (older cells)."""
    from rope_quant.scoring import longctx

    corpus = cfg.eval_corpus or run_cfg.corpus
    if cfg.eval_docs is not None:
        stream = longctx.eval_stream(corpus, qm.tokenizer, cfg.eval_docs)
        return stream.ids, stream
    if corpus == run_cfg.corpus:
        ids, docs = qm.corpus.eval_ids, qm.corpus.eval_docs
    else:
        from rope_quant.corpora.token_streams import load_corpus

        loaded = load_corpus(corpus, qm.tokenizer)
        ids, docs = loaded.eval_ids, loaded.eval_docs
    return ids, longctx.EvalStream(corpus, ids, tuple(docs), len(docs), None)


def evaluate(cfg: LongContextConfig, ctx: CellContext) -> dict[str, Any]:
    """``{"lengths": {L: {ppl, nll, n_windows, n_tokens, seqlen} | {error...}}, k_range_mean, ..., "protocol"}``."""
    from rope_quant.scoring import evaluate as ev
    from rope_quant.scoring.longctx import deviations, protocol_record

    run_cfg, progress = cfg.run, ctx.progress
    qm, reused = ctx.quantized(cfg)
    eval_ids, protocol = long_context_stream(cfg, run_cfg, qm)
    diag = qm.attach_diagnostics()
    start = time.perf_counter()
    max_windows = run_cfg.eval_windows or ev.LONG_CONTEXT_MAX_WINDOWS
    try:
        if cfg.matched_average:  # φ* re-estimated with averaging length L for every length L
            res = {}
            for length in cfg.lengths:
                qm.reconfigure(run_cfg.override(average_length=int(length)), progress=progress)
                for st in qm.states:  # reconfigure installs fresh attention states
                    st.diagnostics = diag
                res.update(ev.long_context(qm.model, eval_ids, (length,), max_windows=max_windows,
                                           device=run_cfg.device, progress=progress))
            qm.reconfigure(run_cfg, progress=progress)
        else:
            res = ev.long_context(qm.model, eval_ids, cfg.lengths, max_windows=max_windows, device=run_cfg.device,
                                  progress=progress)
    finally:
        qm.detach_diagnostics()
    lengths = {str(k): _ppl_entry(v) for k, v in res.items()}
    if cfg.matched_average:
        for entry in lengths.values():
            entry.setdefault("average_length", int(entry.get("seqlen") or entry["length"]))
    unmatched = [] if cfg.matched_average or not run_cfg.position_average else ["this cell"]
    devs = deviations(calib_corpus=run_cfg.corpus, eval_corpora=(protocol.corpus,), max_documents=cfg.eval_docs,
                      cap=max_windows, lengths=cfg.lengths, unmatched_phi_star=unmatched, count_corpora=False)
    return {"lengths": lengths, **diag.summary(),
            "protocol": {**protocol_record(protocol, cfg.lengths, max_windows, run_cfg.corpus),
                         "matched_average": cfg.matched_average, "estimator": run_cfg.estimator.value,
                         "angle": run_cfg.angle.value, "deviations": devs},
            "timing": {**qm.timing, "eval_s": time.perf_counter() - start}, "model_reused": reused}


def _settings(cfg: LongContextConfig) -> dict[str, Any]:
    return {"lengths": list(cfg.lengths), "matched_average": cfg.matched_average}


KIND = register(CellKind(CellKindName.LONG_CONTEXT.value, LongContextConfig, tag="lengths",
                         from_dict=LongContextConfig.from_dict, extra_settings=_settings, evaluate=evaluate,
                         scored=lambda result: bool(scored_lengths(result)), lengths=lambda cfg: cfg.lengths,
                         description="one RunConfig at several context lengths (App. A.4)"))

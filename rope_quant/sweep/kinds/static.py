"""The static-control cell kind (App. A.6, D, H): a RunConfig scored at several lengths with frozen per-channel
scales re-estimated at each length (or the ``dynamic`` reference). The manifest and the report of ``rope-quant
static`` are in :mod:`rope_quant.sweep.static`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rope_quant.experiment.config import StaticScope
from rope_quant.experiment.static_control import PAPER_MAX_WINDOWS, StaticProtocol
from rope_quant.sweep.cellkind import (
    CellContext,
    CellKind,
    CellKindName,
    SweepError,
    WrapsRun,
    config_dict,
    register,
)
from rope_quant.sweep.scoring import scored_lengths

#: The scope name of the reference cells without the static control.
DYNAMIC = "dynamic"


def scope_name(scope: StaticScope | None) -> str:
    return DYNAMIC if scope is None else StaticScope(scope).value


def parse_scope(name: str) -> StaticScope | None:
    """``dynamic`` → None, else a :class:`StaticScope` (SweepError naming the valid scopes)."""
    if name == DYNAMIC:
        return None
    try:
        return StaticScope(name)
    except ValueError:
        raise SweepError(f"unknown static scope {name!r}; valid: {DYNAMIC}, "
                         + ", ".join(s.value for s in StaticScope)) from None


@dataclass(frozen=True)
class StaticConfig(WrapsRun):
    """A static-control cell: ``run`` evaluated at ``lengths`` under ``scope`` (None: dynamic reference).

    ``protocol``: where the scales come from; ``max_windows``: the cap on estimation windows per length (A.6:
    64; lower it on CPU, and the report names the deviation); ``eval_corpus``: the scored corpus (None: the
    calibration corpus's evaluation split); ``quant_diagnostic``: record App. E's statistics in the cell.
    The number of scored windows per length is ``run.eval_windows`` (None: 24, App. A.4's cap).
    """

    run: Any
    lengths: tuple[int, ...]
    scope: StaticScope | None = StaticScope.BOTH
    protocol: StaticProtocol = StaticProtocol.TRANSDUCTIVE
    max_windows: int = PAPER_MAX_WINDOWS
    eval_corpus: str | None = None
    quant_diagnostic: bool = False

    def __post_init__(self) -> None:
        lengths = tuple(int(v) for v in self.lengths)
        if not lengths or any(v < 2 for v in lengths) or len(set(lengths)) != len(lengths):
            raise SweepError(f"lengths must be distinct integers >= 2, got {self.lengths!r}")
        object.__setattr__(self, "lengths", lengths)
        object.__setattr__(self, "scope", None if self.scope in (None, DYNAMIC) else parse_scope(str(self.scope)))
        try:
            object.__setattr__(self, "protocol", StaticProtocol(self.protocol))
        except ValueError:
            raise SweepError(f"unknown static protocol {self.protocol!r}; valid: "
                             + ", ".join(p.value for p in StaticProtocol)) from None
        if isinstance(self.max_windows, bool) or not isinstance(self.max_windows, int) or self.max_windows < 1:
            raise SweepError(f"static max_windows must be a positive integer, got {self.max_windows!r}")
        if self.run.quant.static_scope is not None:
            raise SweepError("a static cell's run must use the dynamic quantisers (the A.6 control is applied "
                             "at evaluation time)")

    def static_fields(self) -> dict[str, Any]:
        return {"lengths": list(self.lengths), "scope": scope_name(self.scope), "protocol": self.protocol.value,
                "max_windows": self.max_windows, "eval_corpus": self.eval_corpus,
                "quant_diagnostic": self.quant_diagnostic}

    def key(self) -> str:
        return self._hash({"static": self.static_fields()})

    def to_dict(self) -> dict[str, Any]:
        return {"run": config_dict(self.run), "static": self.static_fields()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StaticConfig:
        from rope_quant.experiment.config import RunConfig

        fields = dict(data["static"])
        fields["lengths"] = tuple(fields["lengths"])
        return cls(RunConfig.from_dict(dict(data["run"])), **fields)


def deviations(cfg: StaticConfig, windows_used: Mapping[int, int] | None = None,
               available: Mapping[int, int] | None = None) -> list[str]:
    """Departures from A.6 of a static cell (and of its measured window counts, when given)."""
    out: list[str] = []
    if cfg.scope is None:
        return out
    if cfg.protocol != StaticProtocol.TRANSDUCTIVE:
        out.append("scales from the calibration split (out of sample), not from the evaluation corpus as in A.6")
    if cfg.max_windows < PAPER_MAX_WINDOWS:
        out.append(f"at most {cfg.max_windows} estimation windows per length (A.6: up to {PAPER_MAX_WINDOWS})")
    for length, used in sorted((windows_used or {}).items()):
        avail = (available or {}).get(length)
        if avail is not None and used < min(PAPER_MAX_WINDOWS, avail):
            out.append(f"L={length}: {used} estimation windows of the {min(PAPER_MAX_WINDOWS, avail)} A.6 would use")
    return out


def evaluate_static_cell(cfg: StaticConfig, qm: Any, progress: bool = False) -> dict[str, Any]:
    """Score ``qm`` (built for ``cfg.run``) at every length under the cell's scope; the JSON-able result."""
    from rope_quant.experiment import static_control
    from rope_quant.quant import diagnostic
    from rope_quant.scoring import evaluate

    run = cfg.run
    eval_ids = qm.corpus.eval_ids
    eval_name = run.corpus
    if cfg.eval_corpus is not None and cfg.eval_corpus != run.corpus:
        from rope_quant.corpora.token_streams import load_corpus

        eval_ids = load_corpus(cfg.eval_corpus, qm.tokenizer).eval_ids
        eval_name = cfg.eval_corpus
    source = static_control.source_ids(cfg.protocol, eval_ids, qm.corpus)
    cap = run.eval_windows or evaluate.LONG_CONTEXT_MAX_WINDOWS
    lengths: dict[str, Any] = {}
    used, available = {}, {}
    start = time.perf_counter()
    for length in cfg.lengths:
        scales = None
        if cfg.scope is not None:
            windows = static_control.static_windows(source, length, cfg.max_windows)
            scales = static_control.estimate_scales(qm, windows, cfg.scope, progress=progress)
            used[length], available[length] = int(windows.shape[0]), int(source.numel() // length)
        recorder = diagnostic.recording() if cfg.quant_diagnostic else contextlib.nullcontext()
        with static_control.applied(qm, scales), recorder as rec:
            res = evaluate.perplexity(qm.model, eval_ids, length, cap, run.device, progress=progress)
        entry: dict[str, Any] = {"ppl": res.ppl, "nll": res.nll, "n_windows": res.n_windows, "n_tokens": res.n_tokens,
                 "seqlen": res.seqlen}
        if scales is not None:
            transductive = cfg.protocol == StaticProtocol.TRANSDUCTIVE
            source_name = f"{eval_name} (evaluation split)" if transductive else f"{run.corpus} (calibration split)"
            entry["static"] = {**scales.record(), "available_windows": available[length], "source": source_name,
                               "protocol": cfg.protocol.value}
        if cfg.quant_diagnostic and rec is not None:
            entry["quant_diagnostic"] = rec.summary()
        lengths[str(length)] = entry
    return {"lengths": lengths,
            "static": {"scope": scope_name(cfg.scope), "protocol": cfg.protocol.value,
                       "transductive": cfg.scope is not None and cfg.protocol == StaticProtocol.TRANSDUCTIVE,
                       "max_windows": cfg.max_windows, "eval_corpus": eval_name, "calib_corpus": run.corpus,
                       "eval_windows_cap": cap, "deviations": deviations(cfg, used, available)},
            "timing": {**qm.timing, "eval_s": time.perf_counter() - start}}



def evaluate(cfg: StaticConfig, ctx: CellContext) -> dict[str, Any]:
    """Scales per length, then scored (:func:`evaluate_static_cell`) on the seed's quantised model."""
    qm, reused = ctx.quantized(cfg)
    return {**evaluate_static_cell(cfg, qm, progress=ctx.progress), "model_reused": reused}


KIND = register(CellKind(CellKindName.STATIC.value, StaticConfig, tag="static", from_dict=StaticConfig.from_dict,
                         extra_settings=lambda cfg: cfg.static_fields(), evaluate=evaluate,
                         scored=lambda result: bool(scored_lengths(result)), lengths=lambda cfg: cfg.lengths,
                         description="the static per-channel control at several lengths (App. A.6)",
                         report="rope_quant.analysis.static_report:kind_report"))

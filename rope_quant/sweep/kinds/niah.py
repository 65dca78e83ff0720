"""The NIAH cell kind (App. G): one configuration at one seed answering every probe of a NIAH spec.

``fp`` cells answer with the unquantised model (plain SDPA, no rotation); the others with the seed's quantised
model, whose online R3 and K/V quantisers act during generation. The manifest and the report of
``rope-quant niah`` are in :mod:`rope_quant.sweep.niah`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rope_quant.scoring.niah import NiahSpec, accuracy_table, run_probes
from rope_quant.sweep.cellkind import CellContext, CellKind, CellKindName, WrapsRun, config_dict, register
from rope_quant.sweep.scoring import scored_niah


@dataclass(frozen=True)
class NiahConfig(WrapsRun):
    """A NIAH cell: the model of ``run`` (or the unquantised model when ``fp``) on every probe of ``spec``.

    ``weight_key()`` is the run's, so the R3 variants of a seed share its quantised weights; ``key()`` adds
    the NIAH settings (and ``fp``).
    """

    run: Any
    spec: NiahSpec
    fp: bool = False

    def key(self) -> str:
        return self._hash({"niah": self.spec.to_dict(), "fp": self.fp})

    def to_dict(self) -> dict[str, Any]:
        return {"run": config_dict(self.run), "niah": self.spec.to_dict(), "fp": self.fp}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NiahConfig:
        from rope_quant.experiment.config import RunConfig

        spec = dict(data["niah"])
        spec["lengths"], spec["depths"] = tuple(spec["lengths"]), tuple(spec["depths"])
        return cls(RunConfig.from_dict(dict(data["run"])), NiahSpec(**spec), fp=bool(data.get("fp", False)))


def niah_result(cfg: NiahConfig, model: Any, tokenizer: Any, stream: Any, progress: bool = False) -> dict[str, Any]:
    """Answer every probe of ``cfg`` with ``model``: accuracy tables and every probe record."""
    import time

    start = time.perf_counter()
    probes = run_probes(model, tokenizer, stream, cfg.spec, cfg.seed, progress=progress)
    return {"niah": {"accuracy": accuracy_table(probes), "contains": accuracy_table(probes, "contains"),
                     "probes": probes, "spec": cfg.spec.to_dict(), "fp": cfg.fp,
                     "seconds": time.perf_counter() - start}}


def haystack_stream(cfg: NiahConfig, tokenizer: Any, corpora: dict) -> Any:
    """The evaluation token stream of the haystack corpus (cached in ``corpora`` by name)."""
    from rope_quant.corpora import token_streams

    if cfg.spec.corpus not in corpora:
        corpora[cfg.spec.corpus] = token_streams.load_corpus(cfg.spec.corpus, tokenizer)
    return corpora[cfg.spec.corpus].eval_ids


def evaluate(cfg: NiahConfig, ctx: CellContext) -> dict[str, Any]:
    """The probes answered by the unquantised model (``fp``) or by the seed's quantised model."""
    if cfg.fp:  # NIAH's unquantised reference: the base model, plain attention
        (model, tokenizer), corpora = ctx.base(cfg.run)
        return niah_result(cfg, model, tokenizer, haystack_stream(cfg, tokenizer, corpora), ctx.progress)
    qm, reused = ctx.quantized(cfg)
    corpora = ctx.base(cfg.run)[1]
    stream = haystack_stream(cfg, qm.tokenizer, corpora)
    return {**niah_result(cfg, qm.model, qm.tokenizer, stream, ctx.progress), "model_reused": reused}


def scored(result: Any) -> bool:
    """A NIAH result counts when it has an accuracy for at least one length (the records' predicate)."""
    return isinstance(result, Mapping) and scored_niah(result)


KIND = register(CellKind(CellKindName.NIAH.value, NiahConfig, tag="niah", from_dict=NiahConfig.from_dict,
                         extra_settings=lambda cfg: {"niah": cfg.spec.to_dict(), "fp": cfg.fp}, evaluate=evaluate,
                         scored=scored, description="needle-in-a-haystack probes (App. G)",
                         report="rope_quant.analysis.niah_report:kind_report"))

"""A results directory as a claims store (:class:`rope_quant.claims.stores.Store`): its complete cell records.

A claim's cell (flat config overrides, ``rope_quant/claims/registry.py``) at a seed is the directory's
**comparator** config at that seed with the overrides applied (``with_overrides``), found among the manifest's
cells by its key (a ``compare`` directory's configs are its base config with each config's overrides, so the
claim's ``{"r3": "pairwise_only", "estimator": "k_only"}`` is the directory's k_only cell whatever it is named).
Its float-order replicate follows the one rule of :mod:`rope_quant.experiment.replicate`: a GPTQ cell's is the same
config with GPTQ in the other float mode (:func:`rope_quant.sweep.decide_plan.replicate_config`: the cells ``rope-quant
decide`` adds), a cell with unquantised weights is its own, an RTN cell has none. A value is read only
from a complete record (:func:`rope_quant.sweep.records.is_complete`). A claim cell scored otherwise than at the
directory's evaluation windows (C4's support windows, C7's long-context protocol) is the config the claims sweep
planned for it (:func:`rope_quant.sweep.claim_scoring.scored_config`, at the scoring budget of the manifest's
``meta``); a long-context cell's value is its length's entry. At a seed where the directory has no comparator cell
(``rope-quant decide`` adds a seed's cells for the open claims only), the base is the comparator's config at its
first seed with that seed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rope_quant.claims.registry import Metric, Override
from rope_quant.claims.stores import MissingCellError, ReplicateValues
from rope_quant.sweep.cellkind import SweepError, config_seed, run_of, with_overrides
from rope_quant.sweep.claim_scoring import ScoringBudget, scored_config, scored_tokens, scored_value
from rope_quant.sweep.decide_plan import replicate_config
from rope_quant.sweep.manifest import Manifest, cell_relpath, load_manifest
from rope_quant.sweep.records import is_complete, read_record


class DirectoryStore:
    """The :class:`~rope_quant.claims.stores.Store` of results directory ``out`` (its manifest read once);
    ``replicate(cfg)``: a cell's float-order replicate config (None: it has none)."""

    def __init__(self, out: str | os.PathLike[str], manifest: Manifest | None = None,
                 replicate: Callable[[Any], Any | None] = replicate_config) -> None:
        self.out = Path(out)
        self.manifest = manifest if manifest is not None else load_manifest(out)
        self.replicate = replicate
        self._by_key = {cfg.key(): (name, cfg) for name, cfg in self.manifest.cells}
        self._base = {config_seed(cfg): cfg for name, cfg in self.manifest.cells if name == self.manifest.comparator}
        self.scoring = ScoringBudget.from_meta(self.manifest.meta)

    def config(self, cell: Mapping[str, Override], seed: int) -> Any:
        """The config of ``cell`` at ``seed``: the comparator's with the cell's overrides, scored as the claims
        sweep planned it (:func:`~rope_quant.sweep.claim_scoring.scored_config`)."""
        base = self._base.get(int(seed))
        if base is None:
            if not self._base:
                raise MissingCellError(cell, seed, f"comparator {self.manifest.comparator!r} (the base config)")
            base = with_overrides(next(iter(self._base.values())), seed=int(seed))
        return scored_config(cell, base, self.scoring)

    def seeds(self) -> list[int]:
        """The seeds at which the directory holds its comparator (the base of every claim cell), in manifest order."""
        return list(self._base)

    def comparator(self, seed: int | None = None) -> Any:
        """The comparator's config at ``seed`` (default: the first seed), the base of every claim cell."""
        if not self._base:
            raise SweepError(f"{self.out}: the manifest has no cell of its comparator {self.manifest.comparator!r}")
        return self._base[next(iter(self._base)) if seed is None else int(seed)]

    def planned(self, cell: Mapping[str, Override], seed: int) -> bool:
        """Whether the manifest names ``cell``'s config at ``seed`` (computed or not)."""
        if int(seed) not in self._base:
            return False
        return self.config(cell, seed).key() in self._by_key

    def planned_replicate(self, cell: Mapping[str, Override], seed: int) -> bool:
        """Whether the manifest names ``cell``'s float-order replicate at ``seed`` (True where none is built)."""
        rep = self.replicate(self.config(cell, seed)) if int(seed) in self._base else None
        return rep is None or rep.key() in self._by_key

    def _result(self, cfg: Any) -> dict[str, Any] | None:
        """The result of ``cfg``'s complete record (None: not planned, or not computed yet)."""
        hit = self._by_key.get(cfg.key())
        if hit is None:
            return None
        path = self.out / cell_relpath(hit[0], cfg)
        if not is_complete(path, cfg.key()):
            return None
        return dict((read_record(path) or {}).get("result") or {})

    def _read(self, cfg: Any, metric: str) -> float | None:
        result = self._result(cfg)
        return None if result is None else scored_value(cfg, result, metric)

    def values(self, cell: Mapping[str, Override], seeds: Sequence[int], metric: str = Metric.PPL) -> list[float]:
        out = []
        for seed in seeds:
            value = self._read(self.config(cell, seed), metric)
            if value is None:
                raise MissingCellError(cell, seed, metric)
            out.append(value)
        return out

    def replicates(self, cell: Mapping[str, Override], seeds: Sequence[int],
                   metric: str = Metric.PPL) -> ReplicateValues:
        from rope_quant.experiment.replicate import Replicate, replicate_kind

        found: dict[int, float] = {}
        for seed in seeds:
            cfg = self.config(cell, seed)
            kind = replicate_kind(run_of(cfg))
            if kind is Replicate.NONE:
                return None  # RTN weights: a float-order replicate is not built
            rep = self.replicate(cfg) if kind is Replicate.REBUILD else None
            value = self._read(cfg if rep is None else rep, metric)
            if value is not None:
                found[int(seed)] = value
        return found or None

    def tokens(self, cell: Mapping[str, Override]) -> int | None:
        """The scored tokens of the cell's first complete record (None when no record says)."""
        for seed in self._base:
            cfg = self.config(cell, seed)
            result = self._result(cfg)
            if result is not None:
                return scored_tokens(cfg, result)
        return None


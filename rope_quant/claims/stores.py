"""Where a claim's per-seed cell values come from: the :class:`Store` protocol and the in-memory store.

A store answers three questions about a cell (registry.py: flat config overrides plus how it is scored): its
value of a metric at each seed, the same seed's value rebuilt in the other floating-point order (GPTQ in the
other float mode: the numerical replicate of docs/verdicts.md), and the scored tokens per cell (the budget to
decide reads it). :class:`MemoryStore` keeps them in a dict keyed by the canonical cell key
(:func:`rope_quant.claims.registry.cell_key`), metric and seed: for tests and for the e2e suite's memo of
computed cells. A sweep directory's records are read by ``rope_quant.sweep.claim_store`` (the sweep layer).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

from rope_quant.claims.registry import Metric, Override, cell_key, describe

Cell = Mapping[str, Override]
ReplicateValues = Mapping[int, float] | str | None
"""Seed → value in the other float order; a str: why the replicate failed to build; None: none exists."""


class MissingCellError(KeyError):
    """A store has no value for a cell at a seed (the message names the cell, metric, seed and float order)."""

    def __init__(self, cell: Cell, seed: int, metric: str, *, replicate: bool = False) -> None:
        self.cell, self.seed, self.metric, self.replicate = dict(cell), seed, str(metric), replicate
        order = " in the other float order (its replicate)" if replicate else ""
        super().__init__(f"no {self.metric} for cell {{{describe(cell)}}} at seed {seed}{order}")

    def __str__(self) -> str:  # KeyError would print the message's repr
        return str(self.args[0])


class Store(Protocol):
    """Per-seed values of cells (every method reads; none computes)."""

    def values(self, cell: Cell, seeds: Sequence[int], metric: str = Metric.PPL) -> list[float]:
        """``metric`` of ``cell`` at each seed, in order; :class:`MissingCellError` for the first one missing."""
        ...

    def replicates(self, cell: Cell, seeds: Sequence[int], metric: str = Metric.PPL) -> ReplicateValues:
        """Seed → ``metric`` of the seed rebuilt in the other float order, for the replicated ones among
        ``seeds``; a str: why a replicate failed to build; None: no replicate exists for this cell."""
        ...

    def tokens(self, cell: Cell) -> int | None:
        """Scored tokens per cell (None when unknown: the budget is then in seeds only)."""
        ...


class MemoryStore:
    """A :class:`Store` in a dict: ``(cell key, metric, seed, replicate) → value``. ``tokens``: scored tokens per
    cell, one number for every cell or a function of the cell (None: unknown)."""

    def __init__(self, tokens: int | Callable[[Cell], int | None] | None = None) -> None:
        self._values: dict[tuple[str, str, int, bool], float] = {}
        self._failed: dict[str, str] = {}
        self._tokens = tokens

    def put(self, cell: Cell, seed: int, value: float, *, metric: str = Metric.PPL, replicate: bool = False) -> None:
        """Store one value (``replicate``: the seed's value in the other float order)."""
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"cell {{{describe(cell)}}} seed {seed}: {metric} must be finite, got {value}")
        self._values[(cell_key(cell), str(metric), int(seed), replicate)] = value

    def put_seeds(self, cell: Cell, seeds: Iterable[int], values: Iterable[float], *, metric: str = Metric.PPL,
                  replicates: Mapping[int, float] | None = None) -> None:
        """Store a cell's values over ``seeds`` (in order) and its replicates (seed → value)."""
        seeds, values = list(seeds), list(values)
        if len(seeds) != len(values):
            raise ValueError(f"{len(seeds)} seeds but {len(values)} values for cell {{{describe(cell)}}}")
        for seed, value in zip(seeds, values, strict=True):
            self.put(cell, seed, value, metric=metric)
        for seed, value in (replicates or {}).items():
            self.put(cell, seed, value, metric=metric, replicate=True)

    def replicate_failed(self, cell: Cell, reason: str) -> None:
        """The cell's replicate failed to build: :meth:`replicates` answers ``reason``."""
        self._failed[cell_key(cell)] = reason

    def values(self, cell: Cell, seeds: Sequence[int], metric: str = Metric.PPL) -> list[float]:
        key, out = cell_key(cell), []
        for seed in seeds:
            try:
                out.append(self._values[(key, str(metric), int(seed), False)])
            except KeyError:
                raise MissingCellError(cell, seed, metric) from None
        return out

    def replicates(self, cell: Cell, seeds: Sequence[int], metric: str = Metric.PPL) -> ReplicateValues:
        key = cell_key(cell)
        if key in self._failed:
            return self._failed[key]
        found = {int(s): self._values[(key, str(metric), int(s), True)] for s in seeds
                 if (key, str(metric), int(s), True) in self._values}
        return found or None

    def tokens(self, cell: Cell) -> int | None:
        return self._tokens(cell) if callable(self._tokens) else self._tokens

    def __len__(self) -> int:
        return len(self._values)

"""The base models of a process, in memory: one loaded checkpoint (and its corpora) shared by consecutive cells.

Every cell deep-copies the base model, so the paired cells of a sweep load the checkpoint once. A
:class:`ModelCache` holds at most one base model; loading another one evicts it. The real cell function
(:func:`rope_quant.sweep.cells.pipeline_cell_fn`) takes a cache as a parameter; :func:`process_models`
is the one it uses by default, so successive sweeps of one process (several ``cli.main`` calls) share it.
Tests pass their own cache, pre-filled with :meth:`ModelCache.put`.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

#: ``(model, tokenizer)`` as returned by :func:`rope_quant.model.loading.load_model`.
Base = tuple[Any, Any]


def _load(model: str, device: str) -> Base:
    from rope_quant.model.loading import load_model  # deferred: heavy

    return load_model(model, device=device)


class ModelCache:
    """At most one base ``(model, tokenizer)`` keyed by ``(model name, device)``, plus its loaded corpora.

    ``loader(model, device)`` loads a base model on a miss (default: ``load_model``).
    """

    def __init__(self, loader: Callable[[str, str], Base] = _load) -> None:
        self._loader = loader
        self._ident: tuple[str, str] | None = None
        self._identity: str | None = None
        self._entry: tuple[Base, dict[str, Any]] | None = None

    def get(self, model: str, device: str = "cpu", identity: str | None = None) -> tuple[Base, dict[str, Any]]:
        """The base ``(model, tokenizer)`` and its ``{corpus name: Corpus}`` (loaded on first use).

        ``identity`` (a config's ``model_id``): a held model known to have other content is reloaded, so
        files rewritten under the same path are not served from memory.
        """
        ident = (str(model), str(device))
        stale = identity is not None and self._identity is not None and identity != self._identity
        if self._entry is None or self._ident != ident or stale:
            self.clear()  # one base model in memory at a time
            self.put(*ident, self._loader(*ident))
        if identity is not None:
            self._identity = identity
        assert self._entry is not None
        return self._entry

    def put(self, model: str, device: str, base: Base, corpora: dict[str, Any] | None = None) -> None:
        """Hold ``base`` (and already-loaded ``corpora``) as the base model of ``(model, device)``."""
        self._ident = (str(model), str(device))
        self._identity = None
        self._entry = (base, corpora if corpora is not None else {})

    def clear(self) -> None:
        """Drop the held model and collect it."""
        self._ident = self._entry = self._identity = None
        gc.collect()

    def __contains__(self, ident: object) -> bool:
        return self._entry is not None and ident == self._ident


_PROCESS_MODELS = ModelCache()


def process_models() -> ModelCache:
    """The cache shared by the sweeps of this process when none is passed."""
    return _PROCESS_MODELS

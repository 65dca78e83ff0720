"""The e2e claims suite's shared experiment: paired cells on the embedded model, run once per session.

Every test asks the session-scoped :class:`Experiment` for cells; a cell is computed once, keyed by
``RunConfig.key()``, and every R3 variant of a seed shares that seed's offline rotations, GPTQ weights and
calibration sample (the pipeline caches them per ``weight_key``/``stats_key`` in one cache directory).
That is what makes the comparisons paired, and what keeps the whole marker within its CPU budget.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from rope_quant.defaults import DEFAULT_MODEL
from rope_quant.sweep.claim_scoring import ScoringBudget

_SCORING = ScoringBudget()  # the claims sweep's sizes of App. D's and App. G's cells, pytest's too


@dataclass(frozen=True)
class E2EBudget:
    """Token budgets of the CPU claims (the measured wall time is in the README, "Test layers").

    Short context: ``eval_windows`` x ``seqlen`` scored tokens per cell, ``calib_windows`` x ``seqlen``
    calibration tokens per seed (shared by the whip fit of R1, GPTQ and the R3 statistics). The block-size
    interpolation (C4) scores ``support_windows`` windows per cell: its claims are about K range and error,
    means over every key of every window. ``long_lengths`` are scored with ``long_windows`` windows each on
    the long-form corpus (Gutenberg plays); the ``slow`` subset adds ``slow_long_lengths``. App. D's static cells
    estimate their scales on ``static_windows`` windows (A.6: up to 64) and score ``static_eval_windows``; App. G's
    NIAH cells answer ``niah_probes`` probes per depth (App. G: 20) at ``niah_length`` tokens.
    ``gptq_float64``: GPTQ's Hessians and column loop in float64 (``ROPE_QUANT_E2E_GPTQ_FLOAT64=1``).

    The numerical replicates: the first ``replicates`` seeds rebuilt with GPTQ in the other float mode (float64
    when the run is float32, and back; ``--rq-replicates K``), one GPTQ build per replicated seed and model,
    shared by every claim family. How far each replicated seed's paired difference moves gives the float-order
    noise and bias that the decision rule (:mod:`rope_quant.core.verdict`) reads; fewer than 2 leave every
    replicated claim inconclusive ("cannot be estimated").
    """

    seeds: tuple[int, ...] = (0, 1, 2)
    seqlen: int = 512
    calib_windows: int = 16
    eval_windows: int | None = 12
    support_windows: int = 3
    long_corpus: str = "shakespeare"
    long_lengths: tuple[int, ...] = (1024, 4096)
    slow_long_lengths: tuple[int, ...] = (8192,)
    long_windows: int = 1
    static_windows: int = _SCORING.static_windows
    static_eval_windows: int | None = _SCORING.static_eval_windows
    niah_length: int = _SCORING.niah_length
    niah_probes: int = _SCORING.niah_probes
    gptq_float64: bool = False
    replicates: int = 3

    @staticmethod
    def replicates_for(given: int | None, seeds: tuple[int, ...]) -> int:
        """``--rq-replicates K`` as given (checked against the seeds), else the default 3, at most the number of
        seeds (``--rq-seeds 0`` alone: 1 replicate, and the claims say the noise cannot be estimated)."""
        return int(given) if given is not None else min(E2EBudget.replicates, len(seeds))

    def __post_init__(self) -> None:
        if not 0 <= self.replicates <= len(self.seeds):
            raise ValueError(f"--rq-replicates {self.replicates}: must lie in 0 … {len(self.seeds)} (the seeds "
                             f"{list(self.seeds)}); a replicate is a seed rebuilt in the other float mode")


class Experiment:
    """Memoised paired cells through the public API (``pipeline.run_cell`` / ``build_quantized_model``).

    ``plan`` (``--rq-until-decided``): the sequential rule's looks (:class:`rope_quant.core.sequential.Plan`); the
    registry front (tests/_support/registry_front.py) then adds seeds to an inconclusive claim through
    :meth:`with_seeds`, every one replicated (only its own cells are computed, through the same memo and cache).
    """

    def __init__(self, base: tuple[Any, Any], cache_dir: str, budget: E2EBudget, corpus: str,
                 model: str = DEFAULT_MODEL, device: str = "cpu", plan: Any = None,
                 time_budget: float | None = None, started: float | None = None) -> None:
        self.base, self.cache_dir, self.budget, self.corpus = base, cache_dir, budget, corpus
        self.model, self.device = model, device
        self.plan, self.time_budget = plan, time_budget
        self.started = time.perf_counter() if started is None else started
        self._cells: dict[str, dict[str, Any]] = {}
        self._models: dict[tuple[str, str, bool], Any] = {}

    def with_seeds(self, seeds: Sequence[int]) -> Experiment:
        """The same experiment (cells, memo, cache) at ``seeds``, every one replicated."""
        other = Experiment(self.base, self.cache_dir, replace(self.budget, seeds=tuple(seeds), replicates=len(seeds)),
                           self.corpus, self.model, self.device, self.plan, self.time_budget, self.started)
        other._cells, other._models = self._cells, self._models
        return other

    def memo(self, key: Any, compute: Callable[[], Any]) -> Any:
        """``compute()`` once per ``key``: in memory (this pytest run), then on disk in the cache directory
        (:func:`cell_memo_path`: keyed by ``key`` and the code that computes cells, :func:`source_digest`,
        written atomically), so a warm rerun or a killed ``--rq-until-decided`` run recomputes no finished cell."""
        import pickle

        from rope_quant.io import atomic_write_bytes

        if key in self._cells:
            return self._cells[key]
        # the key within this experiment: its model, corpus, device and budget (bar its seed list) are on disk too,
        # and what moves the float order: the torch build, the thread count, the CPU
        full = repr((self.model, self.corpus, self.device, replace(self.budget, seeds=(), replicates=0), key,
                     float_order_identity()))
        path = cell_memo_path(self.cache_dir, full)
        value = None
        if path.is_file():
            try:
                stored_key, value = pickle.loads(path.read_bytes())
                value = value if stored_key == full else None
            except Exception:  # noqa: BLE001 (an unreadable memo is recomputed, never trusted)
                value = None
        if value is None:
            value = compute()
            atomic_write_bytes(path, pickle.dumps((full, value)))
        self._cells[key] = value
        return value

    def config(self, seed: int = 0, **overrides: Any):
        from rope_quant.experiment.pipeline import RunConfig
        from rope_quant.quant.rtn import GPTQConfig

        b = self.budget
        fields = dict(model=self.model, corpus=self.corpus, seed=seed, seqlen=b.seqlen, device=self.device,
                      calib_windows=b.calib_windows, eval_windows=b.eval_windows)
        if b.gptq_float64:
            fields["gptq"] = GPTQConfig(float64=True)
        fields.update(overrides)
        return RunConfig.from_flat(**fields)

    @property
    def replicate_seed(self) -> int:
        """The first seed (the replicated one when any is)."""
        return self.budget.seeds[0]

    @property
    def replicate_seeds(self) -> tuple[int, ...]:
        return tuple(self.budget.seeds[: self.budget.replicates])

    def over_replicates(self, fn: Callable[[int, dict[str, Any]], Any]) -> dict[int, Any] | str:
        """``fn(seed, overrides)`` for each replicated seed (keyed by its index among the seeds), the overrides
        flipping GPTQ's float mode; a replicate that fails to build returns the reason instead (its claim reads
        inconclusive with it; the other claims go on)."""
        out: dict[int, Any] = {}
        for index, seed in enumerate(self.replicate_seeds):
            try:
                out[index] = fn(seed, self._replicate_overrides({}))
            except Exception as exc:  # noqa: BLE001 (any build error is the claim's reason, not the session's)
                return f"replicate of seed {seed} failed to build: {type(exc).__name__}: {exc}"
        return out

    def tokens(self, windows: int | None = None, **overrides: Any) -> int | None:
        """Scored tokens per cell (short context) at ``windows`` (default the budget's evaluation windows); with
        every window scored, the first seed's cell (``overrides``) says how many tokens that was."""
        w = self.budget.eval_windows if windows is None else windows
        if w is None:
            return int(self.cell(self.budget.seeds[0], **overrides).get("n_tokens") or 0) or None
        return w * self.budget.seqlen

    def _replicate_overrides(self, overrides: dict[str, Any]) -> dict[str, Any]:
        from rope_quant.quant.rtn import GPTQConfig

        return {**overrides, "gptq": GPTQConfig(float64=not self.budget.gptq_float64)}

    def quantized(self, cfg: Any) -> Any:
        """The built model of ``cfg``: one of the last :data:`MODELS_KEPT` built, switched in place with
        ``reconfigure`` when only its R3 / K-V fields differ (the same weights and calibration statistics; the
        cell's numbers are bit-identical to a fresh build's, ``test_replicate.py``), else a fresh build."""
        from rope_quant.experiment.pipeline import build_quantized_model

        key = (cfg.weight_key(), cfg.stats_key(), bool(cfg.quant.static_act))
        qm = self._models.pop(key, None)
        if qm is None:
            qm = build_quantized_model(cfg, cache_dir=self.cache_dir, base=self.base)
        elif qm.cfg.key() != cfg.key():
            qm.reconfigure(cfg)
        self._models[key] = qm  # the most recent last
        while len(self._models) > (MODELS_KEPT if self.device == "cpu" else 1):
            self._models.pop(next(iter(self._models)))
        return qm

    def cell(self, seed: int = 0, **overrides: Any) -> dict[str, Any]:
        from rope_quant.experiment.pipeline import run_cell

        cfg = self.config(seed, **overrides)
        return self.memo(cfg.key(), lambda: run_cell(cfg, qm=self.quantized(cfg)))

    def runtime_cell(self, seed: int = 0, **overrides: Any) -> dict[str, Any]:
        """The cell scored by llama.cpp (:func:`rope_quant.runtime.cells.score_cell`: exported to GGUF, scored on
        the evaluator's windows), memoised like :meth:`cell`; skips, naming the install line, without llama.cpp."""
        from rope_quant.runtime import cells, llamacpp

        try:
            llamacpp.require()
        except llamacpp.LlamaCppMissingError as exc:
            pytest.skip(str(exc))
        cfg = self.config(seed, **overrides)
        return self.memo(("runtime", cfg.key()),
                         lambda: cells.score_cell(cfg, base=self.base, cache_dir=self.cache_dir))

    def kind_cell(self, cfg: Any) -> dict[str, Any]:
        """A claims-sweep cell of any kind (static, NIAH: ``rope_quant.sweep.claim_scoring.scored_config``)
        evaluated by its kind as ``rope-quant claims`` evaluates it, on this experiment's models; memoised like
        :meth:`cell`."""
        from rope_quant.sweep.cellkind import CellContext, kind_of, run_of

        corpora: dict[str, Any] = {}
        ctx = CellContext(quantized=lambda c: (self.quantized(run_of(c)), False),
                          base=lambda run: (self.base, corpora))
        return self.memo(("kind", cfg.key()), lambda: dict(kind_of(cfg).evaluate(cfg, ctx)))

    def per_seed(self, metric: str = "ppl", **overrides: Any) -> list[float]:
        return [float(self.cell(seed, **overrides)[metric]) for seed in self.budget.seeds]

    def long_context(self, seed: int = 0, lengths: tuple[int, ...] | None = None,
                     **overrides: Any) -> dict[int, Any]:
        """Perplexity per length on the long-form corpus (App. A.4 protocol), one entry per length."""
        from rope_quant.scoring import evaluate

        b = self.budget
        lengths = tuple(lengths or b.long_lengths)
        key = ("long", lengths, self.config(seed, **overrides).key())

        def compute() -> Any:
            from rope_quant.scoring.longctx import eval_stream

            qm = self.quantized(self.config(seed, **overrides))
            stream = eval_stream(b.long_corpus, qm.tokenizer)  # A.4: the first 64 evaluation documents
            return evaluate.long_context(qm.model, stream.ids, list(lengths), max_windows=b.long_windows)

        return self.memo(key, compute)


MODELS_KEPT = 6
"""Built models an e2e experiment keeps on the CPU (3 seeds and their replicates: about 0.6 GB each for
SmolLM2-135M), so that every R3 variant of a seed reuses one build."""
CELL_MEMO_DIR = "cells-memo-v1"


# The test modules that hand ``Experiment.memo`` the function computing a cell; the others select cells by
# overrides, which the memo key holds, and assert on them. A change to an assertion leaves the memo valid; a
# change here, or anywhere in ``rope_quant``, recomputes every cell.
CELL_SOURCES = ("tests/e2e/conftest.py",)


def digest_sources() -> dict[str, Path]:
    """The files :func:`source_digest` reads, by name: every ``.py`` file of ``rope_quant``, then
    :data:`CELL_SOURCES`."""
    import rope_quant

    package, repo = Path(rope_quant.__file__).parent, Path(__file__).resolve().parents[2]
    files = {str(f.relative_to(package)): f for f in sorted(package.rglob("*.py"))}
    return files | {name: repo / name for name in CELL_SOURCES}


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """A digest of the code that computes a cell (:func:`digest_sources`): a memoised cell is read back only by
    the code that computed it."""
    import hashlib

    h = hashlib.sha256()
    for name, f in digest_sources().items():
        h.update(name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def float_order_identity() -> tuple[str, int, str]:
    """What changes a cell's numbers at the same code (the claims columns differ between 1 and 2 threads): the
    torch version, its intra-op thread count (read at each call) and the CPU model."""
    import torch

    return torch.__version__, torch.get_num_threads(), _cpu_model()


@functools.lru_cache(maxsize=1)
def _cpu_model() -> str:
    """:func:`rope_quant.experiment.envinfo.cpu_model`, read once per session (the memo asks for it per cell)."""
    from rope_quant.experiment.envinfo import cpu_model

    return cpu_model()


def cell_memo_path(cache_dir: str, key: str):
    """Where :meth:`Experiment.memo` keeps the result of ``key`` (its full text) in ``cache_dir``."""
    import hashlib

    name = hashlib.sha256(f"{source_digest()}|{key}".encode()).hexdigest()[:32]
    return Path(cache_dir) / CELL_MEMO_DIR / f"{name}.pkl"


_MACHINE: dict[str, Any] = {}


@pytest.fixture(autouse=True)
def _record_machine(rq_machine) -> None:
    """Every e2e report carries the machine; the claims JSON records it (since 0.2.0)."""
    if not _MACHINE:
        from rope_quant.experiment.envinfo import machine_info

        float64 = os.environ.get("ROPE_QUANT_E2E_GPTQ_FLOAT64", "") not in ("", "0")
        _MACHINE.update(machine_info("GPTQ float64" if float64 else "GPTQ float32"))
    rq_machine(dict(_MACHINE))


@pytest.fixture(scope="session")
def experiment_factory():
    """The ``Experiment`` and ``E2EBudget`` classes, for test modules that size their own protocol."""
    return Experiment, E2EBudget


@pytest.fixture(scope="session")
def e2e_budget(rq_options) -> E2EBudget:
    seeds = rq_options.seeds if rq_options.seeds is not None else E2EBudget.seeds
    given = rq_options.replicates if rq_options.replicates is not None or not rq_options.until_decided else len(seeds)
    return E2EBudget(seeds=seeds, replicates=E2EBudget.replicates_for(given, seeds),
                     gptq_float64=os.environ.get("ROPE_QUANT_E2E_GPTQ_FLOAT64", "") not in ("", "0"))


def explicit_models(config: pytest.Config) -> tuple[str, ...]:
    """The models named with ``--rq-model`` (empty when none was given)."""
    return tuple(config.getoption("--rq-model") or ())


#: The fixtures of an e2e test that runs on the default model: the session's ``experiment`` or the model itself.
DEFAULT_MODEL_FIXTURES = frozenset({"experiment", "embedded_model"})
_DESELECTED = pytest.StashKey[int]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With ``--rq-model`` naming other models only, nothing runs on the default model: this directory's tests
    that use :data:`DEFAULT_MODEL_FIXTURES` are deselected (the registry's claims, App. I's among them, run on the named
    models)."""
    named = explicit_models(config)
    if not named or DEFAULT_MODEL in {m.lower() for m in named}:
        return
    here = Path(__file__).resolve().parent
    bound = {id(it) for it in items if DEFAULT_MODEL_FIXTURES.intersection(getattr(it, "fixturenames", ()))
             and Path(str(it.path)).resolve().is_relative_to(here)}
    if bound:
        config.hook.pytest_deselected(items=[it for it in items if id(it) in bound])
        items[:] = [it for it in items if id(it) not in bound]
        config.stash[_DESELECTED] = len(bound)


def pytest_report_collectionfinish(config: pytest.Config) -> list[str]:
    count = config.stash.get(_DESELECTED, 0)
    if not count:
        return []
    return [f"rope_quant: --rq-model names other models only: {count} e2e tests that run on {DEFAULT_MODEL} "
            f"deselected (add --rq-model={DEFAULT_MODEL} to run them)"]


@pytest.fixture(scope="session")
def experiment(request, build_cache, e2e_budget, rq_options) -> Experiment:
    """The embedded SmolLM2-135M under the paper's W4A4KV4 pipeline: the default model's registry front
    (test_registry_claims.py) and the statements of test_claims.py and its siblings share it. With ``--rq-model``
    naming other models only, the tests that use it are deselected (:func:`pytest_collection_modifyitems`); the
    registry claims run on the named models."""
    base = request.getfixturevalue("embedded_model")
    return Experiment(base, build_cache, e2e_budget, rq_options.corpus, plan=sequential_plan(rq_options, e2e_budget),
                      time_budget=rq_options.time_budget)


def sequential_plan(rq_options, budget: E2EBudget) -> Any:
    """With ``--rq-until-decided``: the looks ``len(seeds) … --rq-max-seeds`` (None otherwise)."""
    if not rq_options.until_decided:
        return None
    from rope_quant.core.sequential import Plan

    return Plan(len(budget.seeds), rq_options.max_seeds, futility=rq_options.futility, shape=rq_options.shape)

"""The registry's claims (rope_quant/claims) through the e2e suite's paired experiment.

``pytest -m e2e --rq-model PATH`` (a local Hugging Face directory, a GGUF file, or an embedded name other than
the default) runs every registry claim whose premises the model meets (rope_quant/claims/premises.py), through
the same :class:`Experiment` as the default suite (paired cells, float-order replicates, ``--rq-until-decided``)
and decided by the one engine (``rope_quant.claims.engine.evaluate``). A claim whose only missing premise is a
foldable R1 runs with ``r1=identity`` and names that deviation in its row; any other missing premise skips it with
its reason; its model-dependent values (head_dim, the best foldable R3) are resolved from the model's config and a
claim at equal bits per key element is checked before any cell runs (``premises.adapt``, as ``rope-quant claims``).

On the default model the paper's claims (group ``paper``) are the default suite's (tests/e2e/test_claims.py and
its siblings state each one): this module runs there only the registry claims that no test module states (the key
quantisers of claims/keys.py), all in ``slow``, so the default run's time and table do not change. The claims the
default suite runs in ``slow`` (:data:`SLOW`) and the key claims are ``slow`` on every model. Select one with
``-k`` and its id (``-k K-kvquant-id-KV4``; the test ids are ``<model>-<claim id>``).

Each test attaches its row (``rq_claim``) and fails on a claim refuted or failed, never on inconclusive.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from rope_quant.claims import registry
from rope_quant.claims.premises import adapt, facts_of
from rope_quant.claims.registry import PAPER, Metric, Override, Scoring, length_of, overrides_of, scoring_of
from rope_quant.claims.stores import ReplicateValues
from rope_quant.defaults import DEFAULT_MODEL

SLOW = {"C6", "C7", "C7-8K", "App-F", "beyond-commuting", "beyond-range", "beyond-range-pph"}
"""Registry claims the default suite runs in ``slow`` (their cells would push the e2e layer past its budget)."""


def _user_models(config: pytest.Config) -> tuple[str, ...]:
    return tuple(m for m in (config.getoption("--rq-model") or ()) if m.lower() != DEFAULT_MODEL)


def _default_model_runs(config: pytest.Config) -> bool:
    """The default model is in the session: no ``--rq-model``, or the default named among them."""
    named = config.getoption("--rq-model") or ()
    return not named or any(m.lower() == DEFAULT_MODEL for m in named)


def _slow(claim: registry.Claim) -> bool:
    return claim.id in SLOW or claim.group != PAPER


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "claim_id" not in metafunc.fixturenames:
        return
    params = [pytest.param(m, c.id, id=f"{m.rstrip('/').split('/')[-1]}-{c.id}",
                           marks=[pytest.mark.slow] if _slow(c) else [])
              for m in _user_models(metafunc.config) for c in registry.claims()]
    if _default_model_runs(metafunc.config):  # the claims no test module states (the paper's are the suite's)
        params += [pytest.param(DEFAULT_MODEL, c.id, id=f"{DEFAULT_MODEL}-{c.id}", marks=pytest.mark.slow)
                   for c in registry.claims() if c.group != PAPER]
    if not params:  # the default model and no claim beyond the paper's: the default suite decides them
        params = [pytest.param(DEFAULT_MODEL, "", id="no-checkpoint-named", marks=pytest.mark.skip(
            reason=f"no checkpoint named: {DEFAULT_MODEL}'s claims are the default suite's (test_claims.py); "
                   "--rq-model PATH decides the registry's claims on a checkpoint"))]
    metafunc.parametrize(("umodel", "claim_id"), params, scope="module")


class ExperimentStore:
    """The :class:`rope_quant.claims.stores.Store` of an :class:`Experiment`: each cell computed (and memoised)
    on first read."""

    def __init__(self, exp: Any) -> None:
        self.exp = exp

    def _overrides(self, cell: Mapping[str, Override]) -> dict[str, Any]:
        out: dict[str, Any] = dict(overrides_of(cell))
        if scoring_of(cell) is Scoring.SUPPORT:
            out["eval_windows"] = self.exp.budget.support_windows
        return out

    def _value(self, cell: Mapping[str, Override], seed: int, metric: str, **rep: Any) -> float:
        ov = {**self._overrides(cell), **rep}
        if scoring_of(cell) is Scoring.LONG:
            length = int(length_of(cell) or 0)
            return float(self.exp.long_context(seed, (length,), **ov)[length].ppl)
        return float(self.exp.cell(seed, **ov)[str(metric)])

    def values(self, cell: Mapping[str, Override], seeds: Sequence[int], metric: str = Metric.PPL) -> list[float]:
        return [self._value(cell, int(s), metric) for s in seeds]

    def replicates(self, cell: Mapping[str, Override], seeds: Sequence[int],
                   metric: str = Metric.PPL) -> ReplicateValues:
        got = self.exp.over_replicates(lambda seed, rep: self._value(cell, seed, metric, **rep))
        if isinstance(got, str):
            return got
        chosen = {int(s) for s in seeds}
        out = {self.exp.replicate_seeds[i]: v for i, v in got.items() if self.exp.replicate_seeds[i] in chosen}
        return out or None

    def tokens(self, cell: Mapping[str, Override]) -> int | None:
        scoring = scoring_of(cell)
        if scoring is Scoring.LONG:
            return self.exp.budget.long_windows * int(length_of(cell) or 0)
        return self.exp.tokens(self.exp.budget.support_windows if scoring is Scoring.SUPPORT else None,
                               **self._overrides(cell))


@pytest.fixture(scope="module")
def uexp(request, umodel, e2e_cache, e2e_budget, rq_options, experiment_factory):
    """The paired experiment on the model (the default suite's own on the default model, sharing its cells), with
    the facts its config gives (premises, head_dim, q/k norms)."""
    from rope_quant.core.sequential import Plan
    from rope_quant.model.loading import ModelNotFoundError, load_model

    if umodel == DEFAULT_MODEL:
        exp = request.getfixturevalue("experiment")
        return exp, facts_of(exp.base[0])
    Experiment, _ = experiment_factory  # noqa: N806 (a class)
    try:
        base = load_model(umodel, device="cpu")
    except ModelNotFoundError as exc:
        pytest.fail(f"--rq-model {umodel!r}: {exc}")
    plan = (Plan(len(e2e_budget.seeds), rq_options.max_seeds, futility=rq_options.futility, shape=rq_options.shape)
            if rq_options.until_decided else None)
    exp = Experiment(base, e2e_cache, e2e_budget, rq_options.corpus, model=umodel, plan=plan,
                     time_budget=rq_options.time_budget)
    return exp, facts_of(base[0])


def test_registry_claim(uexp, claim_id: str, rq_claim) -> None:
    """One registry claim on the model: adapted to it (premises, model-dependent values, equal bits at the
    budget's T), decided by the engine (fixed-n, or the sequential rule with ``--rq-until-decided``), its row
    recorded with the model and any deviation; fails on refuted or fails."""
    from rope_quant.claims.engine import evaluate

    exp, facts = uexp
    claim = adapt(registry.get(claim_id), facts, seq_len=exp.budget.seqlen)
    if isinstance(claim, str):
        pytest.skip(f"{claim_id} on {exp.model}: the architecture lacks a premise ({claim})")
    adapted = claim

    def run(e: Any) -> Any:
        result = evaluate(adapted, ExperimentStore(e), e.budget.seeds, plan=e.plan)
        return result.verdict, result

    (verdict, result), _ = exp.decided(run, claim.id)
    row = result.to_dict(model=exp.model)
    rq_claim(claim.title, row["expected"], row["measured"], model=exp.model, verdict=verdict,
             parts=result.part_verdicts if len(result.parts) > 1 else None, **row["numbers"])
    assert not verdict.failed, verdict.text()

"""The paper's claims from the registry (rope_quant/claims), on the checkpoints named with ``--rq-model``.

``pytest -m e2e --rq-model PATH`` (a local Hugging Face directory, a GGUF file, or an embedded name other than
the default) runs every registry claim whose premises the model meets (rope_quant/claims/premises.py), through
the same :class:`Experiment` as the default suite (paired cells, float-order replicates, ``--rq-until-decided``)
and decided by the one engine (``rope_quant.claims.engine.evaluate``), on the path ``gpu_e2e`` shares
(tests/_support/registry_front.py): the plan of the model's whole claims table is printed before it loads, and
a table that does not fit this machine is refused with the plan's remedy. A claim whose only missing premise is a
foldable R1 runs with ``r1=identity`` and names that deviation in its row; any other missing premise skips it with
its reason. The default model's claims are the default suite's (tests/e2e/test_claims.py and its siblings): on
it this module runs nothing, so the default run's time and table do not change. The claims the default suite
runs in ``slow`` (:data:`SLOW`) are ``slow`` here too.

Each test attaches its row (``rq_claim``) and fails on a claim refuted or failed, never on inconclusive.
"""

from __future__ import annotations

import pytest

from rope_quant.claims import registry
from rope_quant.defaults import DEFAULT_MODEL

SLOW = {"C6", "C7", "C7-8K", "App-F", "beyond-commuting", "beyond-range", "beyond-range-pph"}
"""Registry claims the default suite runs in ``slow`` (their cells would push the e2e layer past its budget)."""


def _user_models(config: pytest.Config) -> tuple[str, ...]:
    return tuple(m for m in (config.getoption("--rq-model") or ()) if m.lower() != DEFAULT_MODEL)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "claim_id" not in metafunc.fixturenames:
        return
    models = _user_models(metafunc.config)
    if not models:  # the default model: the default suite decides these claims
        metafunc.parametrize(("umodel", "claim_id"), [pytest.param(
            DEFAULT_MODEL, "", id="no-checkpoint-named", marks=pytest.mark.skip(
                reason=f"no checkpoint named: {DEFAULT_MODEL}'s claims are the default suite's (test_claims.py); "
                       "--rq-model PATH decides the registry's claims on a checkpoint"))])
        return
    # the model module-scoped alone (the claims function-scoped): one front per model, its claims in a row
    metafunc.parametrize("umodel", models, ids=[m.rstrip("/").split("/")[-1] for m in models], scope="module")
    metafunc.parametrize("claim_id", [pytest.param(c.id, marks=[pytest.mark.slow] if c.id in SLOW else [])
                                      for c in registry.claims()])


@pytest.fixture(scope="module")
def ufront(umodel, e2e_cache, e2e_budget, rq_options, experiment_factory):
    """The registry front of a user's checkpoint at the e2e CPU budget (tests/_support/registry_front.py): the
    plan of its claims table printed before the model loads, then the paired experiment."""
    from tests._support.registry_front import open_front

    Experiment, _ = experiment_factory  # noqa: N806 (a class)
    return open_front(umodel, "cpu", e2e_budget, corpus=rq_options.corpus, experiment_cls=Experiment,
                      cache=e2e_cache, rq_options=rq_options, protocol="e2e CPU budget", missing=pytest.fail)


def test_registry_claim(ufront, claim_id: str, rq_claim, rq_run) -> None:
    """One registry claim on the user's checkpoint: decided by the engine (fixed-n, or the sequential rule with
    ``--rq-until-decided``), its row recorded with the model and any deviation; fails on refuted or fails."""
    from tests._support.registry_front import decide_claim

    verdict, _ = decide_claim(ufront, claim_id, rq_claim, rq_run)
    assert not verdict.failed, verdict.text()

"""``gpu_e2e``: the claims registry on real checkpoints, under the paper's protocol, on CUDA.

Run on a CUDA node with local checkpoints (nothing is downloaded)::

    pytest -m gpu_e2e --rq-model=/ckpt/Llama-3.2-1B --rq-model=/ckpt/Mistral-7B-v0.3 \
           --rq-corpus=/data/wikitext-2-raw --rq-seeds 0-2 [--rq-until-decided] [--rq-claims-out=DIR]

One test per (model, registry claim) (the paper's, rope_quant/claims/paper.py, and the key quantisers',
rope_quant/claims/keys.py), through the registry fronts' one path
(tests/_support/registry_front.py, shared with ``-m e2e --rq-model``): the same paired :class:`Experiment`, the
same :class:`~tests._support.registry_front.ExperimentStore` and the one engine
(:func:`rope_quant.claims.engine.evaluate`). Without ``--rq-model`` the embedded SmolLM2-135M runs at these
full sizes. The plugin skips these tests, with its reason, where CUDA is unavailable; they are collected
everywhere (``pytest -m gpu_e2e --collect-only`` lists the registry). The same path runs on the CPU at a tiny
budget in tests/e2e/test_paper_protocol_cpu.py.

Protocol (:data:`~tests._support.registry_front.PAPER`): 128 x 2048 calibration tokens, seqlen 2048, every
evaluation window, W4A4KV4 with GPTQ weights, the paper's rotations (R1 fitted with whip, R2 random Hadamard, R4
online Hadamard); C4's cells on 3 support windows, C7's one window per context length. Before the model loads
the plan of its whole claims table (time and memory on this GPU) is printed, and a table that does not fit
fails with the plan's remedy (a model that fits only streamed runs with ``--offload cpu``'s layer streaming).

Premises: a claim whose only missing premise is a foldable R1 runs with ``r1=identity`` and its row names the
deviation; any other missing premise skips it with its reason (:func:`rope_quant.claims.premises.adapt`, from
the checkpoint's config before the model loads). A key claim's model-dependent values (G = head_dim, the mean
width, the best foldable R3) are resolved there too, and its cells are checked to store equal bits per key element
at T = 2048: unequal bits fail the model's claims before it loads, naming the cells and their bits.

Verdicts: the rule of the CPU claims (docs/verdicts.md). The numerical replicates are the first K seeds
(``--rq-replicates K``, default every seed up to 3) rebuilt with GPTQ in the other float mode (float64 when the
run is float32); under ``--rq-until-decided`` every seed is replicated, the added ones included, and an open claim
gets seeds until decided, ``--rq-max-seeds`` or ``--rq-time-budget``. A claim that cannot decide is
inconclusive with the budget that would decide it, never a failure for lack of power; a test fails on refuted or
fails only (a question beyond the paper, the key claims: on fails only; refuted is one of its answers).
"""

from __future__ import annotations

import pytest

from rope_quant.claims import registry
from rope_quant.pytest_plugin import options


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "gpu_claim" in metafunc.fixturenames:  # the model module-scoped alone: one front per model
        models = options(metafunc.config).models
        metafunc.parametrize("gpu_model", models, ids=[m.rstrip("/").split("/")[-1] for m in models], scope="module")
        metafunc.parametrize("gpu_claim", [c.id for c in registry.claims()])


@pytest.fixture(scope="module")
def gpu_front(gpu_model, rq_options, build_cache, experiment_factory):
    """The registry front of ``gpu_model`` under the paper's protocol on the session's CUDA device."""
    from rope_quant.model import offload
    from tests._support.registry_front import PAPER, open_front

    Experiment, E2EBudget = experiment_factory  # noqa: N806 (classes)
    front = open_front(gpu_model, rq_options.resolved_device(), PAPER.budget(E2EBudget, rq_options),
                       corpus=rq_options.corpus, experiment_cls=Experiment, cache=build_cache, rq_options=rq_options,
                       protocol=PAPER.name)
    with offload.set_default_mode(offload.OffloadMode(front.offload)):
        yield front


@pytest.mark.gpu_e2e
def test_gpu_registry_claim(gpu_front, gpu_claim: str, rq_claim, rq_run) -> None:
    """One registry claim on the checkpoint under the paper's protocol: decided by the engine, its row recorded
    with the model and any deviation; fails on refuted or fails (a question beyond the paper, the key claims:
    on fails only, refuted being one of its answers)."""
    from tests._support.registry_front import decide_claim

    verdict, _ = decide_claim(gpu_front, gpu_claim, rq_claim, rq_run)
    assert not registry.get(gpu_claim).fails_test(verdict), verdict.text()

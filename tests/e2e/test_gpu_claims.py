"""``gpu_e2e``: the paper's Table 1 expectations on real checkpoints, under the paper's protocol.

Run on a CUDA node with local checkpoints (nothing is downloaded)::

    pytest -m gpu_e2e --rq-model /ckpt/Llama-3.2-1B --rq-model /ckpt/Mistral-7B-v0.3 \
           --rq-corpus /data/wikitext-2-raw --rq-seeds 0,1,2

Protocol: 128 x 2048 calibration tokens, seqlen 2048, every evaluation window, W4A4KV4 with GPTQ weights, the
paper's rotations (R1 fitted with whip, R2 random Hadamard, R4 online Hadamard). Without ``--rq-model`` the
embedded SmolLM2-135M runs at these full sizes. The plugin skips every test here, with
its reason, where CUDA is unavailable.
"""

from __future__ import annotations

import pytest

from rope_quant.core import stats
from rope_quant.pytest_plugin import options

pytestmark = pytest.mark.gpu_e2e

#: The paper's equivalence margin for pairwise_plus_hadamard against hadamard (Table 1), in PPL points.
PAPER_MARGIN = 0.05


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "gpu_model" in metafunc.fixturenames:
        models = options(metafunc.config).models
        metafunc.parametrize("gpu_model", models, ids=[m.rstrip("/").split("/")[-1] for m in models],
                             scope="module")


@pytest.fixture(scope="module")
def gpu_experiment(gpu_model, rq_options, tmp_path_factory, experiment_factory):
    from rope_quant.model.loading import ModelNotFoundError, load_model

    Experiment, E2EBudget = experiment_factory  # noqa: N806 (classes)

    device = rq_options.resolved_device()
    try:
        base = load_model(gpu_model, device=device)
    except ModelNotFoundError as exc:
        pytest.skip(f"gpu_e2e: model {gpu_model!r} is not available locally: {exc}")
    budget = E2EBudget(seeds=rq_options.seeds or (0, 1, 2), seqlen=2048, calib_windows=128, eval_windows=None)
    cache = tmp_path_factory.mktemp("gpu-e2e-cache")
    return Experiment(base, str(cache), budget, rq_options.corpus, model=gpu_model, device=device)


def test_table1_pairwise_only_worse_than_hadamard(gpu_experiment, rq_claim) -> None:
    """Table 1 sign: ppl(pairwise_only) > ppl(hadamard) in every seed."""
    had = gpu_experiment.per_seed(r3="hadamard")
    pw = gpu_experiment.per_seed(r3="pairwise_only")
    ci = stats.paired_ci(pw, had) if len(had) > 1 else None
    holds = all(p > h for p, h in zip(pw, had, strict=True))
    rq_claim(f"Table 1 sign ({gpu_experiment.model})", "ppl(pairwise_only) > ppl(hadamard) every seed",
             f"pw {pw} vs had {had}" + (f"; CI ({ci.low:+.3f}, {ci.high:+.3f})" if ci else ""), holds,
             model=gpu_experiment.model)
    assert holds


def test_table1_pairwise_plus_hadamard_equivalent(gpu_experiment, rq_claim) -> None:
    """Table 1 TOST: the paired 90% CI of pairwise_plus_hadamard − hadamard lies inside ±0.05 PPL."""
    had = gpu_experiment.per_seed(r3="hadamard")
    pph = gpu_experiment.per_seed(r3="pairwise_plus_hadamard")
    if len(had) < 2:
        pytest.skip("gpu_e2e: the equivalence test needs at least two seeds (--rq-seeds)")
    ci = stats.paired_ci(pph, had)
    holds = stats.equivalent(ci, PAPER_MARGIN)
    rq_claim(f"Table 1 TOST ({gpu_experiment.model})", f"90% CI within ±{PAPER_MARGIN}",
             f"diff {ci.mean:+.4f} (CI {ci.low:+.4f}, {ci.high:+.4f}; n={ci.n})", holds, model=gpu_experiment.model)
    assert holds

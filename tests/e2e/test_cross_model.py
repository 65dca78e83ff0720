"""Cross-model claims (App. I on CPU): the model-generic claims on both embedded models, with a model column.

The paper's finding rests on Llama and Mistral checkpoints. Here the claims that are valid on any RoPE
architecture run on the embedded SmolLM2-135M (Llama: MHA, head_dim 64, one RoPE base) and Gemma 3 270M
(GQA 4:1, head_dim 256, RoPE base 1e4 on sliding layers and 1e6 on full layers, q/k norms, sandwich norms).

Settings (App. I):

- **KV-only, W16A16KV4** (:data:`rope_quant.defaults.KEYS_ALONE`): 4-bit keys and nothing else quantised, no
  offline rotation. It isolates R3's effect on the keys and is valid on both architectures (Gemma 3's sandwich
  norms refuse R1).
- **W4A16KV4** (:data:`W4A16KV4`, ``slow``): GPTQ weights, no R1, R2 random Hadamard, R4 online, 4-bit KV.
  Measured 2026-11-24 (2 threads, 3 seeds, 12 x 512 pydoc tokens, ``-k w4a16 --rq-model=M``): smollm2-135m
  hadamard 15.407, 15.437, 15.433 vs pairwise_only 17.599, 17.600, 17.740 (smallest gap +14.0%), 7 min 46 s;
  gemma3-270m 55.269, 49.295, 50.596 vs 182.464, 177.727, 147.928 (+192%), 11 min 40 s: C1 and C8 hold on both.

The module is in the ``slow`` subset (``tox -e slow``; ``pytest -m e2e --run-slow``): on 2 cores the KV-only
claims take about 10 minutes per model at 1 thread and would not fit the default run's CI budget. Both
embedded models run by default; ``pytest -m e2e --run-slow --rq-model=gemma3-270m`` runs these claims on the
named models only (the W4A4KV4 pipeline claims of test_claims.py skip there).

**Verdicts** (the one rule of :mod:`rope_quant.core.verdict`). C1, C4 and C8 are every-seed criteria (holds
or fails). C3 is the LESS form. On 4-bit keys alone there is no GPTQ, so no float-mode replicate of the
k_only − rows difference exists and the claims' replicated rule cannot apply: this claim is read, explicitly (its
verdict's note and ``rule`` say so), with the single-interval offset rule (:func:`rope_quant.core.verdict.decide`),
the offset being how far the hadamard cell moves when rebuilt as the block Hadamard at b = d_h (exactly H·P in
exact arithmetic: another float order, which 4-bit K rounding amplifies).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from rope_quant.core import stats
from rope_quant.core.verdict import Form, combine_all, decide, deterministic
from rope_quant.defaults import DEFAULT_MODEL, KEYS_ALONE

pytestmark = pytest.mark.slow

#: The embedded models (the default run covers both).
MODELS = (DEFAULT_MODEL, "gemma3-270m")
#: W4A16KV4: GPTQ weights without R1 (App. I), R2 random Hadamard and R4 online (valid on both families).
W4A16KV4 = dict(w_bits=4, a_bits=16, k_bits=4, v_bits=16, r1="identity")

def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "xmodel" in metafunc.fixturenames:
        models = tuple(metafunc.config.getoption("--rq-model") or ()) or MODELS
        metafunc.parametrize("xmodel", models, ids=[m.rstrip("/").split("/")[-1] for m in models],
                             scope="module")


@pytest.fixture(scope="module")
def xexp(xmodel, request, build_cache, e2e_budget, rq_options, experiment_factory):
    """The paired experiment on one model; the default model shares the session ``experiment`` (its cells)."""
    if xmodel.lower() == DEFAULT_MODEL:
        return request.getfixturevalue("experiment")
    from rope_quant.model.loading import ModelNotFoundError, load_model

    Experiment, _ = experiment_factory  # noqa: N806 (a class)
    try:
        base = load_model(xmodel, device="cpu")
    except ModelNotFoundError as exc:  # the README install provides the embedded ones: a missing one fails
        if xmodel in MODELS:
            pytest.fail(f"embedded model unavailable: {exc}")
        pytest.skip(f"model {xmodel!r} is not available locally: {exc}")
    return Experiment(base, build_cache, e2e_budget, rq_options.corpus, model=xmodel)


#: Claims measured NOT to hold on a model (a disagreement between the models, reported in the README): strict
#: xfails with the measured numbers. 2026-11-27, commit d84b643, 1 thread, 3 seeds, 12 x 512 pydoc tokens,
#: W16A16KV4, no BOS (2026-11-24: diff +115.97 (+71.76, +160.18), before the device-side K sample).
DISAGREEMENTS = {
    ("C3", "gemma3-270m"): "C3 does not hold on Gemma 3 (MQA, 1 KV head): k_only 299.34, 266.58, 262.86 vs rows "
                           "149.75, 148.42, 162.19; diff +122.81 (90% CI +81.01, +164.60), refuted: far past the "
                           "0.87 PPL spread",
}


def _expect(request, claim: str, exp) -> None:
    """Mark the running test as a strict xfail where :data:`DISAGREEMENTS` records that the claim fails."""
    reason = DISAGREEMENTS.get((claim, _name(exp)))
    if reason:
        request.applymarker(pytest.mark.xfail(strict=True, reason=reason))


def _name(exp) -> str:
    return exp.model.rstrip("/").split("/")[-1]


def _fmt(values) -> str:
    return "[" + ", ".join(f"{v:.3f}" for v in values) + "]"


def test_c1_kv_only_pairwise_only_worse(xexp, rq_claim, rq_record) -> None:
    """C1 on 4-bit keys alone: ppl(pairwise_only) > ppl(hadamard) in every seed (holds or fails); the
    pairwise+Hadamard row is recorded for the table."""
    had = xexp.per_seed(r3="hadamard", **KEYS_ALONE)
    pw = xexp.per_seed(r3="pairwise_only", **KEYS_ALONE)
    pph = xexp.per_seed(r3="pairwise_plus_hadamard", **KEYS_ALONE)
    for seed, h, p, q in zip(xexp.budget.seeds, had, pw, pph, strict=True):
        rq_record("Cross-model, W16A16KV4", model=_name(xexp), seed=seed, hadamard=h, pairwise_only=p,
                  pairwise_plus_hadamard=q)
    rel = min((p - h) / h for p, h in zip(pw, had, strict=True))
    verdict = deterministic(rel > 0)
    ci = f"; diff {_ci(pw, had)}" if len(had) > 1 else ""
    rq_claim("C1 (App. I) pairwise_only vs hadamard, W16A16KV4", "ppl(pairwise_only) > ppl(hadamard) every seed",
             f"pw {_fmt(pw)} vs had {_fmt(had)}{ci}; smallest relative gap {rel:+.2%}; pw+H {_fmt(pph)}",
             verdict=verdict, model=_name(xexp), pairwise_only=pw, hadamard=had, pairwise_plus_hadamard=pph, stat=rel)
    assert not verdict.failed, f"pairwise_only not above hadamard in every seed: {pw} vs {had}"


def test_c8_kv_only_k_diagnostics_favour_hadamard(xexp, rq_claim) -> None:
    """C8 on 4-bit keys alone: K range and relative K error lower under hadamard than pairwise_only, every
    seed (means over every key of every window: robust to float order)."""
    metrics = {m: (xexp.per_seed(m, r3="hadamard", **KEYS_ALONE), xexp.per_seed(m, r3="pairwise_only", **KEYS_ALONE))
               for m in ("k_range_mean", "k_rel_err")}
    holds = all(h < p for had, pw in metrics.values() for h, p in zip(had, pw, strict=True))
    rq_claim("C8 (Table E) K range / K error, W16A16KV4", "hadamard < pairwise_only every seed",
             "; ".join(f"{m} {_fmt(h)} vs {_fmt(p)}" for m, (h, p) in metrics.items()), verdict=deterministic(holds),
             model=_name(xexp), **{m: {"hadamard": h, "pairwise_only": p} for m, (h, p) in metrics.items()})
    assert holds, metrics


def test_c3_kv_only_k_only_beats_rows(xexp, rq_claim, request) -> None:
    """C3 on 4-bit keys alone: the paired 90% interval of ppl(k_only) − ppl(rows) lies below zero (the rule's
    LESS form, spread from the b = d_h rebuild). A strict xfail on Gemma 3 (:data:`DISAGREEMENTS`)."""
    _expect(request, "C3", xexp)
    rows = xexp.per_seed(r3="pairwise_only", estimator="rows", **KEYS_ALONE)
    k_only = xexp.per_seed(r3="pairwise_only", estimator="k_only", **KEYS_ALONE)
    seed = xexp.replicate_seed
    d_h = _blocks(xexp)[-1]
    noise = abs(xexp.cell(seed, r3="hadamard", **KEYS_ALONE)["ppl"]
                - xexp.cell(seed, r3="block_hadamard", r3_block=d_h, **KEYS_ALONE)["ppl"])
    verdict = decide(Form.LESS, [k - r for k, r in zip(k_only, rows, strict=True)], noise=noise, tokens=xexp.tokens())
    if not verdict.note:
        verdict = replace(verdict, note="offset rule: no float-mode replicate exists without GPTQ")
    ci = f"{verdict.mean:+.3f}" + (f" (90% CI {verdict.low:+.3f}, {verdict.high:+.3f})" if verdict.low is not None
                                   else "")
    rq_claim("C3 (App. L) k_only vs rows, W16A16KV4", "90% CI of ppl(k_only) − ppl(rows) below 0",
             f"k_only {_fmt(k_only)} vs rows {_fmt(rows)}; diff {ci}; numerical spread {noise:.3f} "
             f"(hadamard vs b={d_h})", verdict=verdict, model=_name(xexp), k_only=k_only, rows=rows, noise=noise)
    assert not verdict.failed, f"k_only vs rows: {verdict.text()}"


def _blocks(exp) -> tuple[int, ...]:
    from rope_quant.model import arch

    d = arch.dims(exp.base[0]).head_dim
    return tuple(2 ** i for i in range(1, int(np.log2(d)) + 1))


def test_c4_kv_only_k_metrics_non_increasing_in_block_size(xexp, rq_claim, rq_record) -> None:
    """C4 (Table M) on 4-bit keys alone: K range and relative K error non-increasing in b = 2 … d_h, every
    seed (d_h = 64 on SmolLM2, 256 on Gemma 3)."""
    blocks = _blocks(xexp)
    w = dict(eval_windows=xexp.budget.support_windows, **KEYS_ALONE)
    series: dict[str, list[list[float]]] = {"k_range_mean": [], "k_rel_err": []}
    for seed in xexp.budget.seeds:
        cells: dict[int, Any] = {b: xexp.cell(seed, r3="block_hadamard", r3_block=b, **w) for b in blocks}
        for b, c in cells.items():
            rq_record("Cross-model mixing support, W16A16KV4", model=_name(xexp), seed=seed, b=b,
                      k_range_mean=c["k_range_mean"], k_rel_err=c["k_rel_err"], ppl=c["ppl"])
        for m in series:
            series[m].append([float(cells[b][m]) for b in blocks])
    holds = all(all(s[i + 1] <= s[i] for i in range(len(s) - 1)) for per in series.values() for s in per)
    mean = {m: np.mean(np.asarray(v), axis=0) for m, v in series.items()}
    rq_claim(f"C4 (Table M) K range / K error vs b=2…{blocks[-1]}, W16A16KV4", "non-increasing in b, every seed",
             f"seed-mean range {_fmt(mean['k_range_mean'])}; err {_fmt(100 * mean['k_rel_err'])}%",
             verdict=deterministic(holds),
             model=_name(xexp), blocks=list(blocks), **series)
    assert holds, series


def test_c1_c8_w4a16kv4(xexp, rq_claim, rq_record) -> None:
    """App. I's W4A16KV4 (GPTQ per seed): C1 and C8 every seed (holds or fails)."""
    had = xexp.per_seed(r3="hadamard", **W4A16KV4)
    pw = xexp.per_seed(r3="pairwise_only", **W4A16KV4)
    pph = xexp.per_seed(r3="pairwise_plus_hadamard", **W4A16KV4)
    rng = [xexp.per_seed("k_range_mean", r3=r3, **W4A16KV4) for r3 in ("hadamard", "pairwise_only")]
    for seed, h, p, q in zip(xexp.budget.seeds, had, pw, pph, strict=True):
        rq_record("Cross-model, W4A16KV4", model=_name(xexp), seed=seed, hadamard=h, pairwise_only=p,
                  pairwise_plus_hadamard=q)
    rel = min((p - h) / h for p, h in zip(pw, had, strict=True))
    c8 = all(h < p for h, p in zip(*rng, strict=True))
    verdict = combine_all([deterministic(rel > 0, "C1 every seed"), deterministic(c8, "C8 every seed")])
    rq_claim("C1 + C8 (App. I) W4A16KV4", "pw > had every seed; K range lower under hadamard",
             f"pw {_fmt(pw)} vs had {_fmt(had)} (smallest relative gap {rel:+.2%}); "
             f"pw+H {_fmt(pph)}; K range {_fmt(rng[0])} vs {_fmt(rng[1])}", verdict=verdict,
             model=_name(xexp), hadamard=had, pairwise_only=pw, pairwise_plus_hadamard=pph, stat=rel)
    assert c8, rng
    assert not verdict.failed, (pw, had)


def _ci(treatment: list[float], control: list[float]) -> str:
    ci = stats.paired_ci(treatment, control)
    return f"{ci.mean:+.3f} (90% CI {ci.low:+.3f}, {ci.high:+.3f})"

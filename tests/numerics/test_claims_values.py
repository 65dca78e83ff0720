"""``rope_quant.claims.values``: a paired comparison over measured values, decided by the engine, gives the rule's
verdict itself (the e2e suite's ``Experiment.paired_claim`` for App. D and App. G goes through it)."""

from __future__ import annotations

import numpy as np
import pytest

from rope_quant.claims import values
from rope_quant.core import sequential, verdict
from rope_quant.core.verdict import Form

CASES = [
    (Form.GREATER, 0.0, "all"), (Form.LESS, 0.0, "some"), (Form.GREATER, 0.0, "failed"), (Form.LESS, 0.0, "none"),
    (Form.EQUIVALENT, 0.3, "all"), (Form.NON_INFERIOR, 0.2, "all"),
]


def _data(effect: float, n: int, seed: int) -> tuple[list[float], list[float], dict[int, tuple[float, float]]]:
    rng = np.random.default_rng(seed)
    shared = rng.normal(0, 1.0, n)
    t = list(20.0 + shared + effect + rng.normal(0, 0.2, n))
    c = list(20.0 + shared + rng.normal(0, 0.2, n))
    reps = {i: (t[i] + float(rng.normal(0, 0.1)), c[i] + float(rng.normal(0, 0.1))) for i in range(n)}
    return t, c, reps


def _replicates(kind: str, reps: dict[int, tuple[float, float]]) -> values.PairReplicates:
    return {"all": reps, "some": {i: reps[i] for i in (0, 2)}, "failed": "replicate failed to build: OOM",
            "none": None}[kind]


@pytest.mark.parametrize(("form", "margin", "kind"), CASES)
@pytest.mark.parametrize("effect", [0.0, 0.8, -0.8])
def test_the_fixed_n_reading_is_the_rules(form: Form, margin: float, kind: str, effect: float) -> None:
    t, c, reps = _data(effect, 5, 7)
    got = values.decide(values.paired(form, margin=margin), t, c, replicates=_replicates(kind, reps), tokens=4096)
    direct = verdict.paired_claim(form, t, c, replicates=_replicates(kind, reps), margin=margin, tokens=4096)
    assert got.parts[0].verdict == direct, (got.parts[0].verdict.text(), direct.text())
    assert got.rule == "fixed-n"


@pytest.mark.parametrize(("form", "margin", "kind"), CASES)
@pytest.mark.parametrize("parts", [1, 3])
def test_the_sequential_reading_is_the_rules(form: Form, margin: float, kind: str, parts: int) -> None:
    t, c, reps = _data(0.6, 6, 11)
    plan = sequential.Plan(3, 8).with_parts(parts)
    for n in (3, 6):
        r = _replicates(kind, {i: p for i, p in reps.items() if i < n})
        got = values.decide(values.paired(form, margin=margin), t[:n], c[:n], replicates=r, plan=plan)
        direct = sequential.paired_claim(form, t[:n], c[:n], plan, replicates=r, margin=margin)
        assert got.parts[0].verdict == direct, (n, got.parts[0].verdict.text(), direct.text())


def test_bad_values_are_refused() -> None:
    claim = values.paired(Form.GREATER)
    with pytest.raises(ValueError, match="treatment has 3 values but control has 2"):
        values.decide(claim, [1.0, 2.0, 3.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="replicate of seed index 5"):
        values.decide(claim, [1.0, 2.0, 3.0], [1.0, 2.0, 3.0], replicates={5: (1.0, 1.0)})
    with pytest.raises(ValueError, match="must be finite"):
        values.decide(claim, [1.0, float("inf"), 3.0], [1.0, 2.0, 3.0])

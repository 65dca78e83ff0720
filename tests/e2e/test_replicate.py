"""The numerical replicate of the e2e session (tests/e2e/conftest.py): the first seed, GPTQ in the other
float mode, every other field unchanged; no model needed."""

from __future__ import annotations

from typing import Any


def _flat(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        return {k: v for key, val in obj.items() for k, v in _flat(val, f"{prefix}{key}.").items()}
    return {prefix[:-1]: obj}


def _diff(a: dict, b: dict) -> list[str]:
    fa, fb = _flat(a), _flat(b)
    return sorted(k for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k))


def test_replicate_flips_only_the_gptq_float_mode(experiment_factory) -> None:
    Experiment, E2EBudget = experiment_factory  # noqa: N806 (classes)
    for float64 in (False, True):
        exp = Experiment(None, "/nonexistent", E2EBudget(seeds=(4, 5), gptq_float64=float64), "pydoc")
        primary = exp.config(exp.replicate_seed, r3="hadamard")
        replicate = exp.config(exp.replicate_seed, **exp._replicate_overrides({"r3": "hadamard"}))
        assert exp.replicate_seed == 4
        assert primary.gptq.float64 is float64 and replicate.gptq.float64 is (not float64)
        assert _diff(primary.to_dict(), replicate.to_dict()) == ["quant.w.gptq.float64"]
        assert replicate.weight_key() != primary.weight_key() and replicate.key() != primary.key()
        assert exp.tokens() == 12 * 512 and exp.tokens(3) == 3 * 512

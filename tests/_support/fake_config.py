"""A stand-in for ``RunConfig`` in the sweep, report and reproduce tests: frozen, with ``key()`` and
``weight_key()``, and no torch (a fake cell function computes its result from the fields)."""

from __future__ import annotations

import dataclasses
import hashlib
import json


@dataclasses.dataclass(frozen=True)
class FakeConfig:
    model: str = "fake-model"
    seed: int = 0
    r3: str = "hadamard"
    seqlen: int = 64
    block: int = 0

    def key(self) -> str:
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:16]

    def weight_key(self) -> str:
        return f"{self.model}-s{self.seed}"

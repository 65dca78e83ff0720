"""No full-model copy per cell (0.2.0): the time of a cell's model copy, the old ``deepcopy(base).to(...)``
against :mod:`rope_quant.model.working_copy` (every parameter: a weight-cache miss; the few a hit reads), on
the embedded SmolLM2-135M at 1 thread. Prints times and ratios, never asserts on time.

    PYTHONPATH=$PWD python tests/bench/bench_working_copy.py
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import torch


def _best(f: Callable[[], Any], n: int = 3) -> float:
    best = float("inf")
    for _ in range(n):
        start = time.perf_counter()
        out = f()
        best = min(best, time.perf_counter() - start)
        del out
    return best


def main() -> None:
    from rope_quant.experiment import base_model
    from rope_quant.model import working_copy
    from rope_quant.model.loading import load_model

    torch.set_num_threads(1)
    base, _ = load_model("smollm2-135m")
    total = sum(p.numel() * p.element_size() for p in base.parameters())

    def full() -> Any:
        model = working_copy.skeleton(base, "cpu", torch.float32)
        working_copy.fill(model, base)
        return model

    def hit() -> tuple[Any, list[str]]:
        model = working_copy.skeleton(base, "cpu", torch.float32)
        names = base_model.eager_names(model)
        working_copy.fill(model, base, names)
        return model, names

    old = _best(lambda: copy.deepcopy(base).to("cpu", torch.float32))
    t_full, t_hit = _best(full), _best(hit)
    model, names = hit()
    params = dict(model.named_parameters(remove_duplicate=False))
    copied = sum({id(params[n]): params[n].numel() * params[n].element_size() for n in names}.values())
    print(f"model {total / 2**20:.1f} MiB fp32; deepcopy+to {old:.3f} s; working copy, every parameter (miss) "
          f"{t_full:.3f} s ({t_full / old:.2f}x); cache hit {t_hit:.3f} s ({t_hit / old:.2f}x), copying "
          f"{copied / 2**20:.1f} MiB in {len(names)} tensors")


if __name__ == "__main__":
    main()

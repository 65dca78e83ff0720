"""Count host synchronisations on the CPU, as a proxy for what a GPU pays.

Each wrapped call (``Tensor.item``, ``.tolist``, ``.cpu``, ``.numpy``, ``__bool__``, ``__float__``,
``__int__``) forces a device to finish its queue and copy to the host. On the CPU they cost nothing, but
they are the same calls, so counting them here bounds what a GPU run will wait for. The count that matters is
the marginal one: syncs per added layer-window (calibration, evaluation) and per added layer (GPTQ), which must
be a small constant, not per head, per column or per window-and-layer.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch

#: The Tensor methods that copy to the host or block on the device.
SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")


@contextlib.contextmanager
def count_host_syncs() -> Iterator[Counter[str]]:
    """Within the block, count every call of :data:`SYNC_METHODS` (the yielded Counter, by method name)."""
    counts: Counter[str] = Counter()
    originals = {n: getattr(torch.Tensor, n) for n in SYNC_METHODS}

    def wrap(name: str, fn):  # type: ignore[no-untyped-def]
        def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            counts[name] += 1
            return fn(self, *args, **kwargs)
        return counted

    for n, fn in originals.items():
        setattr(torch.Tensor, n, wrap(n, fn))
    try:
        yield counts
    finally:
        for n, fn in originals.items():
            setattr(torch.Tensor, n, fn)


def marginal(grid: dict[tuple[int, int], int]) -> tuple[float, float]:
    """(per added layer-window, per added layer at the smaller window count) from counts on a 2 × 2 grid
    ``{(layers, windows): count}`` of two layer counts and two window counts (second and first differences)."""
    (l0, l1), (w0, w1) = sorted({k[0] for k in grid}), sorted({k[1] for k in grid})
    per_lw = (grid[(l1, w1)] - grid[(l1, w0)] - grid[(l0, w1)] + grid[(l0, w0)]) / ((l1 - l0) * (w1 - w0))
    per_layer = (grid[(l1, w0)] - grid[(l0, w0)]) / (l1 - l0)
    return per_lw, per_layer

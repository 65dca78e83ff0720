"""Per-(layer, frequency pair) top-k candidate rows for the grid objectives (App. A.2.1).

For every layer and RoPE pair k the ``topk`` rows (a, b) with the largest |a|+|b| are kept (K stream by
default); :mod:`rope_quant.calib.objectives` scores its grid of angles on them. Merging re-ranks the union.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rope_quant.calib.errors import (
    CalibrationError,
    CalibrationShapeError,
    IncompatibleStatsError,
    UnknownStreamError,
    check_layer,
)
from rope_quant.calib.rules import STREAMS


class TopKCandidates:
    """The ``topk`` rows with the largest |a|+|b| per (layer, pair), fed from the ``streams`` named."""

    def __init__(self, n_layers: int, n_pairs: int, topk: int = 256, streams: Sequence[str] = ("k",)) -> None:
        if int(topk) != topk or topk < 0:
            raise CalibrationShapeError(f"topk must be a non-negative integer, got {topk!r}")
        streams = tuple(streams)
        for st in streams:
            if st not in STREAMS:
                raise UnknownStreamError(f"topk_streams: unknown stream {st!r}; expected one of {STREAMS}")
        self.n_layers, self.n_pairs = int(n_layers), int(n_pairs)
        self.topk = int(topk)
        self.streams = streams
        self._cand = np.zeros((self.n_layers, self.topk, self.n_pairs, 2))
        self._cand_count = np.zeros(self.n_layers, dtype=np.int64)

    def config(self) -> dict[str, Any]:
        return {"n_layers": self.n_layers, "n_pairs": self.n_pairs, "topk": self.topk, "streams": self.streams}

    def update(self, layer: int, stream: str, a: np.ndarray, b: np.ndarray) -> None:
        """Offer one batch of pair channels a, b of shape (N, H, K); a no-op unless ``stream`` is kept."""
        if self.topk and stream in self.streams:
            # rows = (token, head), as np.stack([a, b], -1).reshape(-1, K, 2) orders them, without the copy
            self._push_ab(layer, a.reshape(-1, self.n_pairs), b.reshape(-1, self.n_pairs))

    def push(self, layer: int, new: np.ndarray) -> None:
        """Re-rank the union of kept and new rows (M, K, 2) by |a|+|b| per pair; keep the top k."""
        self._push_ab(layer, new[..., 0], new[..., 1])

    def _push_ab(self, layer: int, new_a: np.ndarray, new_b: np.ndarray) -> None:
        """:meth:`push` with the new rows given as their a and b channels (M, K) each."""
        if new_a.shape[0] == 0:
            return
        count = int(self._cand_count[layer])
        old = self._cand[layer, :count].copy()  # the kept rows are overwritten below
        # |a|+|b| (what np.abs(row).sum(axis=-1) adds), kept rows first, then the new ones
        score = np.concatenate([np.abs(old[..., 0]) + np.abs(old[..., 1]), np.abs(new_a) + np.abs(new_b)])
        keep = min(self.topk, score.shape[0])
        if score.shape[0] > keep:
            # partition each pair's column as a contiguous row (the same selection, without strided access)
            idx = np.ascontiguousarray(np.argpartition(-score.T, keep - 1, axis=1)[:, :keep].T)
        else:
            idx = np.broadcast_to(np.arange(keep)[:, None], score.shape).copy()
        kept_score = np.take_along_axis(score, idx, axis=0)
        order = np.argsort(-kept_score, axis=0, kind="stable")
        idx = np.take_along_axis(idx, order, axis=0)
        from_old = idx < count
        i_old, i_new = np.where(from_old, idx, 0), np.where(from_old, 0, idx - count)
        for c, src in enumerate((new_a, new_b)):
            picked = np.take_along_axis(src, i_new, axis=0)
            if count:
                picked = np.where(from_old, np.take_along_axis(old[..., c], i_old, axis=0), picked)
            self._cand[layer, :keep, :, c] = picked
        self._cand_count[layer] = keep

    def candidates(self, layer: int) -> np.ndarray:
        """Top-k candidate rows of a layer, shape (n_kept, K, 2) as (a, b), sorted by |a|+|b| descending."""
        layer = check_layer(layer, self.n_layers)
        if not self.topk:
            raise CalibrationError("no candidate sets were kept (topk=0)")
        return self._cand[layer, : int(self._cand_count[layer])].copy()

    def merge(self, other: TopKCandidates) -> TopKCandidates:
        """Re-rank the union of ``other``'s candidates and the kept ones, in place. Returns self."""
        if not isinstance(other, TopKCandidates) or other.config() != self.config():
            raise IncompatibleStatsError(f"cannot merge candidate sets {_describe(other)} into {self.config()}")
        if self.topk:
            for layer in range(self.n_layers):
                count = int(other._cand_count[layer])
                if count:
                    self.push(layer, other._cand[layer, :count])
        return self

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The file section: ``cand`` (L, topk, K, 2) and ``cand_count`` (L,)."""
        return {"cand": self._cand, "cand_count": self._cand_count}

    def load_arrays(self, data: Mapping[str, Any]) -> None:
        """Fill from a file section written by :meth:`to_arrays` (KeyError/ValueError if malformed)."""
        self._cand = np.asarray(data["cand"], dtype=np.float64).reshape(self._cand.shape)
        self._cand_count = np.asarray(data["cand_count"], dtype=np.int64)


def _describe(obj: Any) -> Any:
    return obj.config() if isinstance(obj, TopKCandidates) else type(obj).__name__

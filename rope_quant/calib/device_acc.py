"""Calibration statistics accumulated on the device of the activations (App. A.2.1), copied to the host once.

:class:`DeviceAccumulator` is the torch twin of the host (numpy) update of
:class:`rope_quant.calib.stats.CalibrationStats`: for each (layer, stream) it keeps float64 raw sums, the
means and centred co-moments (the same per-batch moments and Chan et al. merge as the host), the top-k candidate
rows by |a|+|b| and the bottom-k K sample, all on the device the q/k outputs live on. Nothing in
:meth:`DeviceAccumulator.update` reads a device value on the host (row counts come from shapes, the non-finite
check is a device counter), so a GPU never waits for the host inside the window loop.
:meth:`DeviceAccumulator.drain` moves every accumulator to the host in one copy and returns host arrays that the
host components fold in exactly as they fold their own batches.

Equal to the host update to float64 rounding: the sums are the same terms added in another order
(``torch.sum`` instead of ``np.einsum``); candidate values, K-sample rows, keys and positions are exact copies.
Ties in |a|+|b| are ordered by row index like the host's stable sort.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

_STABLE = ("mean_a", "mean_b", "m2_aa", "m2_bb", "m2_ab")
_RAW = ("sum_a", "sum_b", "sum_aa", "sum_bb", "sum_ab")
MOMENT_KEYS = _STABLE + _RAW


def _dot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Σ_n x[n] y[n] per column, (N, H, K) -> (H, K): the host's ``einsum("nhk,nhk->hk")`` (fused, no product
    tensor)."""
    return torch.linalg.vecdot(x, y, dim=0)


@dataclass
class _Cell:
    """The device state of one (layer, stream): row count (host int), moments, non-finite count."""

    n: int = 0
    acc: dict[str, torch.Tensor] = field(default_factory=dict)
    bad: torch.Tensor | None = None


@dataclass
class _Cand:
    """Top-k rows (count, K, 2) float64 of one layer, sorted by |a|+|b| descending."""

    rows: torch.Tensor
    count: int


@dataclass
class _Sample:
    """Bottom-k K sample of one layer: keys (n,) float64, positions (n,) int64, rows (n, H_kv, d) float32."""

    keys: torch.Tensor
    pos: torch.Tensor
    rows: torch.Tensor


@dataclass
class Drained:
    """Host copies of a drained accumulator, keyed like the host components want them."""

    moments: dict[tuple[int, str], tuple[int, dict[str, np.ndarray]]]
    bad: dict[tuple[int, str], int]
    candidates: dict[int, np.ndarray]
    sample: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]


class DeviceAccumulator:
    """Per-(layer, stream) moments, top-k candidates and K sample on the activations' device."""

    def __init__(self, n_pairs: int, topk: int, topk_streams: tuple[str, ...], sample_rows: int) -> None:
        self.n_pairs, self.topk, self.topk_streams, self.sample_rows = n_pairs, topk, topk_streams, sample_rows
        self._cells: dict[tuple[int, str], _Cell] = {}
        self._cand: dict[int, _Cand] = {}
        self._sample: dict[int, _Sample] = {}
        self._index: dict[tuple[Any, torch.device], Any] = {}

    def empty(self) -> bool:
        """True when no rows were accumulated since the last drain."""
        return not self._cells

    def _select(self, sel: Any, device: torch.device) -> Any:
        """A numpy pair index as what torch indexing wants on ``device`` (a slice stays a slice)."""
        if isinstance(sel, slice):
            return sel
        key = (sel.tobytes(), device)
        if key not in self._index:
            self._index[key] = torch.as_tensor(sel, dtype=torch.long, device=device)
        return self._index[key]

    def update(self, layer: int, stream: str, x: torch.Tensor, rows: torch.Tensor, sel_a: Any, sel_b: Any,
               keys: np.ndarray | None) -> None:
        """Fold the rows (N, H, d) of one q/k output ``x`` (..., H*d) into (layer, stream).

        ``keys``: the K sample's uniform keys for these N rows (drawn on the host), or None to sample nothing.
        """
        dev = rows.device
        n_new = rows.shape[0]
        a = rows[:, :, self._select(sel_a, dev)].to(torch.float64)
        b = rows[:, :, self._select(sel_b, dev)].to(torch.float64)
        cell = self._cells.setdefault((layer, stream), _Cell())
        sum_a, sum_b = a.sum(dim=0), b.sum(dim=0)
        # A NaN/Inf input makes its (head, pair) column sum non-finite; float64 sums of float32/16-bit inputs
        # cannot overflow (|x| < 3.4e38), so the column sums are the whole check (no pass over the input).
        bad = (~torch.isfinite(sum_a + sum_b)).sum()
        cell.bad = bad if cell.bad is None else cell.bad + bad
        raw = {"sum_a": sum_a, "sum_b": sum_b, "sum_aa": _dot(a, a), "sum_bb": _dot(b, b), "sum_ab": _dot(a, b)}
        # batch means; a constant column gets its value exactly (as the host's _mean_exact_constant)
        mean_a = torch.where(a.amax(dim=0) == a.amin(dim=0), a[0], sum_a / n_new)
        mean_b = torch.where(b.amax(dim=0) == b.amin(dim=0), b[0], sum_b / n_new)
        if stream in self.topk_streams and self.topk:
            self._push_candidates(layer, a.reshape(-1, self.n_pairs), b.reshape(-1, self.n_pairs))
        if keys is not None:
            self._push_sample(layer, x.shape, rows, keys)
        da, db = a - mean_a, b - mean_b
        batch = {"mean_a": mean_a, "mean_b": mean_b, "m2_aa": _dot(da, da), "m2_bb": _dot(db, db),
                 "m2_ab": _dot(da, db)}
        if cell.n == 0:
            cell.acc = {**batch, **raw}
        else:  # Chan, Golub & LeVeque pairwise update; the weights are host floats (no device read)
            n1, n2 = cell.n, n_new
            w2, cross = n2 / (n1 + n2), (float(n1) * n2) / (n1 + n2)
            acc = cell.acc
            d_a, d_b = batch["mean_a"] - acc["mean_a"], batch["mean_b"] - acc["mean_b"]
            acc["mean_a"] = acc["mean_a"] + d_a * w2
            acc["mean_b"] = acc["mean_b"] + d_b * w2
            acc["m2_aa"] = acc["m2_aa"] + batch["m2_aa"] + d_a * d_a * cross
            acc["m2_bb"] = acc["m2_bb"] + batch["m2_bb"] + d_b * d_b * cross
            acc["m2_ab"] = acc["m2_ab"] + batch["m2_ab"] + d_a * d_b * cross
            for key in _RAW:
                acc[key] = acc[key] + raw[key]
        cell.n += n_new

    def _push_candidates(self, layer: int, new_a: torch.Tensor, new_b: torch.Tensor) -> None:
        """Keep the ``topk`` rows of the union with the largest |a|+|b| per pair, ties by row index."""
        old = self._cand.get(layer)
        union = torch.stack([new_a, new_b], dim=-1)  # (M, K, 2)
        if old is not None:
            union = torch.cat([old.rows, union])
        score = union.abs().sum(dim=-1)  # |a|+|b|, the host's np.abs(a) + np.abs(b)
        keep = min(self.topk, union.shape[0])
        if union.shape[0] > keep:
            idx = torch.topk(score, keep, dim=0, largest=True, sorted=False).indices
            idx = idx.sort(dim=0).values  # by row index, so the stable sort below breaks ties by index
        else:
            idx = torch.arange(keep, device=union.device).unsqueeze(1).expand(keep, self.n_pairs)
        order = torch.sort(-score.gather(0, idx), dim=0, stable=True).indices
        idx = idx.gather(0, order)
        rows = union.gather(0, idx.unsqueeze(-1).expand(keep, self.n_pairs, 2))
        self._cand[layer] = _Cand(rows, keep)

    def _push_sample(self, layer: int, shape: torch.Size, rows: torch.Tensor, keys: np.ndarray) -> None:
        """Keep the ``sample_rows`` rows with the smallest keys of the kept and new rows, in row order."""
        dev = rows.device
        new_keys = torch.from_numpy(keys)
        new_keys = (new_keys.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda"
                    else new_keys.to(dev))
        positions = torch.arange(shape[-2], device=dev).expand(*shape[:-1]).reshape(-1)
        new_rows = rows.to(torch.float32)
        old = self._sample.get(layer)
        if old is not None:
            new_keys = torch.cat([old.keys, new_keys])
            positions = torch.cat([old.pos, positions])
            new_rows = torch.cat([old.rows, new_rows])
        if new_keys.shape[0] > self.sample_rows:
            sel = torch.topk(new_keys, self.sample_rows, largest=False, sorted=False).indices.sort().values
            new_keys, positions, new_rows = new_keys[sel], positions[sel], new_rows[sel]
        self._sample[layer] = _Sample(new_keys, positions, new_rows)

    def drain(self) -> Drained:
        """Copy every accumulator to the host in one transfer, return the host arrays and reset.

        Every piece is flattened to float64 (int64 positions below 2**53 and float32 rows convert exactly),
        concatenated on its device, copied once per device (one device in practice) and split on the host.
        """
        pieces: list[tuple[str, Any, str, tuple[int, ...], torch.Tensor]] = []
        for (layer, stream), cell in self._cells.items():
            for key in MOMENT_KEYS:
                pieces.append(("m", (layer, stream), key, tuple(cell.acc[key].shape), cell.acc[key]))
            assert cell.bad is not None
            pieces.append(("bad", (layer, stream), "", (), cell.bad))
        for layer, cand in self._cand.items():
            pieces.append(("cand", layer, "", tuple(cand.rows.shape), cand.rows))
        for layer, smp in self._sample.items():
            for key, t in (("keys", smp.keys), ("pos", smp.pos), ("rows", smp.rows)):
                pieces.append(("sample", layer, key, tuple(t.shape), t))
        host: list[np.ndarray] = []
        by_device: dict[torch.device, list[int]] = {}
        for i, p in enumerate(pieces):
            by_device.setdefault(p[4].device, []).append(i)
        flat: dict[int, np.ndarray] = {}
        for dev_items in by_device.values():
            cat = torch.cat([pieces[i][4].reshape(-1).to(torch.float64) for i in dev_items])
            arr = cat.cpu().numpy()  # the one copy to the host
            offset = 0
            for i in dev_items:
                size = int(np.prod(pieces[i][3], dtype=np.int64))
                flat[i] = arr[offset:offset + size].reshape(pieces[i][3])
                offset += size
        host = [flat[i] for i in range(len(pieces))]
        out = Drained({}, {}, {}, {})
        sample_parts: dict[int, dict[str, np.ndarray]] = {}
        for (kind, where, key, _, _), arr in zip(pieces, host, strict=True):
            if kind == "m":
                out.moments.setdefault(where, (self._cells[where].n, {}))[1][key] = arr.copy()
            elif kind == "bad":
                out.bad[where] = int(arr)
            elif kind == "cand":
                out.candidates[where] = arr.copy()
            else:
                sample_parts.setdefault(where, {})[key] = arr
        for layer, parts in sample_parts.items():
            out.sample[layer] = (parts["keys"].copy(), parts["pos"].astype(np.int64),
                                 parts["rows"].astype(np.float32))
        self._cells, self._cand, self._sample = {}, {}, {}
        return out

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
(a product and ``torch.sum`` instead of ``np.einsum``); candidate values, K-sample rows, keys and positions are
exact copies.
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


def _pairs_view(x: torch.Tensor, sel_a: Any, sel_b: Any, n_pairs: int) -> torch.Tensor | None:
    """The rows (N, H, d) as their (a, b) pairs (N·H, K, 2), a view, where the layout allows one (rotate_half:
    a, b the two halves; interleaved: the even and odd channels), else None."""
    if not (isinstance(sel_a, slice) and isinstance(sel_b, slice)):
        return None
    n, k = x.shape[0] * x.shape[1], n_pairs
    if (sel_a.start, sel_a.stop, sel_a.step) == (0, k, 1) and (sel_b.start, sel_b.stop, sel_b.step) == (k, 2 * k, 1):
        return x.reshape(n, 2, k).transpose(1, 2)
    if (sel_a.start, sel_a.step, sel_b.start, sel_b.step) == (0, 2, 1, 2):
        return x.reshape(n, k, 2)
    return None


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
    score: torch.Tensor  # (count, K): |a|+|b| of the rows


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
        self._buffers: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def empty(self) -> bool:
        """True when no rows were accumulated since the last drain."""
        return not self._cells

    def _scratch(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """float64 buffers for one update of ``rows`` (N, H, d): the rows, their products (N, H, d) and the pair
        products (N, H, d/2). Kept per shape on the CPU, where a fresh multi-MB buffer costs its page faults on
        every update; elsewhere the device's caching allocator already reuses memory."""
        n, h, d = rows.shape
        make = lambda *shape: torch.empty(shape, dtype=torch.float64, device=rows.device)  # noqa: E731
        if rows.device.type != "cpu":
            return make(n, h, d), make(n, h, d), make(n, h, d // 2)
        key = (n, h, d)
        if key not in self._buffers:
            self._buffers[key] = (make(n, h, d), make(n, h, d), make(n, h, d // 2))
        return self._buffers[key]

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
        ia, ib = self._select(sel_a, dev), self._select(sel_b, dev)
        # One float64 copy of every channel (copy=True: the rows are centred in place below); the sums of
        # squares and products are a product and a column sum each (``linalg.vecdot`` over the row axis is
        # ~10x slower on the CPU), the squares of a and b in one product over all d channels.
        x64, square, cross = self._scratch(rows)
        x64.copy_(rows)
        sums = x64.sum(dim=0)
        sum_a, sum_b = sums[:, ia], sums[:, ib]
        cell = self._cells.setdefault((layer, stream), _Cell())
        # A NaN/Inf input makes its (head, pair) column sum non-finite; float64 sums of float32/16-bit inputs
        # cannot overflow (|x| < 3.4e38), so the column sums are the whole check (no pass over the input).
        bad = (~torch.isfinite(sum_a + sum_b)).sum()
        cell.bad = bad if cell.bad is None else cell.bad + bad
        torch.mul(x64, x64, out=square)
        squares = square.sum(dim=0)
        torch.mul(x64[:, :, ia], x64[:, :, ib], out=cross)
        raw = {"sum_a": sum_a, "sum_b": sum_b, "sum_aa": squares[:, ia], "sum_bb": squares[:, ib],
               "sum_ab": cross.sum(dim=0)}
        # batch means; a constant column gets its value exactly (as the host's _mean_exact_constant)
        mean = torch.where(x64.amax(dim=0) == x64.amin(dim=0), x64[0], sums / n_new)
        if stream in self.topk_streams and self.topk:
            pairs = _pairs_view(x64, sel_a, sel_b, self.n_pairs)
            if pairs is None:
                pairs = torch.stack([x64[:, :, ia].reshape(-1, self.n_pairs),
                                     x64[:, :, ib].reshape(-1, self.n_pairs)], dim=-1)
            # |a|+|b|, the host's np.abs(a) + np.abs(b), into the cross buffer (free until the centred pass)
            score = torch.abs(x64[:, :, ia], out=cross).add_(x64[:, :, ib].abs())
            self._push_candidates(layer, pairs, score.reshape(-1, self.n_pairs))
        if keys is not None:
            self._push_sample(layer, x.shape, rows, keys)
        x64.sub_(mean)  # centred in place, the two-pass co-moments below
        torch.mul(x64, x64, out=square)
        centred = square.sum(dim=0)
        torch.mul(x64[:, :, ia], x64[:, :, ib], out=cross)
        batch = {"mean_a": mean[:, ia], "mean_b": mean[:, ib], "m2_aa": centred[:, ia], "m2_bb": centred[:, ib],
                 "m2_ab": cross.sum(dim=0)}
        if cell.n == 0:
            cell.acc = {**batch, **raw}
        else:  # Chan, Golub & LeVeque pairwise update; the weights are host floats (no device read)
            n1, n2 = cell.n, n_new
            w2, weight = n2 / (n1 + n2), (float(n1) * n2) / (n1 + n2)
            acc = cell.acc
            d_a, d_b = batch["mean_a"] - acc["mean_a"], batch["mean_b"] - acc["mean_b"]
            acc["mean_a"] = acc["mean_a"] + d_a * w2
            acc["mean_b"] = acc["mean_b"] + d_b * w2
            acc["m2_aa"] = acc["m2_aa"] + batch["m2_aa"] + d_a * d_a * weight
            acc["m2_bb"] = acc["m2_bb"] + batch["m2_bb"] + d_b * d_b * weight
            acc["m2_ab"] = acc["m2_ab"] + batch["m2_ab"] + d_a * d_b * weight
            for key in _RAW:
                acc[key] = acc[key] + raw[key]
        cell.n += n_new

    def _push_candidates(self, layer: int, new: torch.Tensor, new_score: torch.Tensor) -> None:
        """Keep the ``topk`` rows of the union of the kept and the ``new`` (M, K, 2) rows with the largest |a|+|b|
        per pair (``new_score``, (M, K)), ties by row index. The union is never materialised: the kept and new
        rows are gathered apart and merged (as the host does)."""
        old = self._cand.get(layer)
        count = 0 if old is None else old.count
        score = new_score if old is None else torch.cat([old.score, new_score])
        keep = min(self.topk, score.shape[0])
        if score.shape[0] > keep:
            idx = torch.topk(score, keep, dim=0, largest=True, sorted=False).indices
            idx = idx.sort(dim=0).values  # by row index, so the stable sort below breaks ties by index
        else:
            idx = torch.arange(keep, device=score.device).unsqueeze(1).expand(keep, self.n_pairs)
        kept_score = score.gather(0, idx)
        order = torch.sort(-kept_score, dim=0, stable=True).indices
        idx, kept_score = idx.gather(0, order), kept_score.gather(0, order)
        pick = (idx - count).clamp_(min=0).unsqueeze(-1).expand(keep, self.n_pairs, 2)
        rows = new.gather(0, pick)
        if old is not None:
            from_old = (idx < count).unsqueeze(-1)
            old_pick = idx.clamp(max=count - 1).unsqueeze(-1).expand(keep, self.n_pairs, 2)
            rows = torch.where(from_old, old.rows.gather(0, old_pick), rows)
        self._cand[layer] = _Cand(rows, keep, kept_score)

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

"""The calibration statistics of one model: :class:`CalibrationStats`, its file, and the hooks that feed it.

:class:`CalibrationStats` composes the pair moments (:class:`rope_quant.calib.moments.PairMoments`, App. A.2.1)
with the two optional components fed from the same forward passes: the top-k candidate rows of the grid
objectives (:mod:`rope_quant.calib.candidates`) and the uniform K-token sample of the ``range`` objective
(:mod:`rope_quant.calib.ksample`). It owns the statistics file (format v2; v1 files, which have no K sample,
still load): each component writes and reads its own section of the arrays.

:func:`merge_all` merges the statistics of several processes; :func:`register_projection_hooks` feeds a
:class:`CalibrationStats` from forward hooks on every layer's pre-RoPE query/key module.
"""

from __future__ import annotations

import io
import json
import os
import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rope_quant.calib.candidates import TopKCandidates
from rope_quant.calib.device_acc import DeviceAccumulator
from rope_quant.calib.errors import (
    CalibrationError,
    CalibrationShapeError,
    IncompatibleStatsError,
    MissingStatsFileError,
    NonFiniteCalibrationError,
    StatsFileError,
    check_layer,
)
from rope_quant.calib.ksample import KSample
from rope_quant.calib.moments import PairMoments, _check_geometry
from rope_quant.calib.rules import check_stream
from rope_quant.core.angles import PairCov
from rope_quant.core.rope import check_head_dim, check_layout, pair_indices
from rope_quant.core.threads import one_cpu_thread
from rope_quant.io import atomic_write_bytes
from rope_quant.model import arch

__all__ = [
    "CalibrationStats",
    "merge_all",
    "register_projection_hooks",
]

_FORMAT_VERSION = 2
_READABLE_VERSIONS = (1, 2)  # version 1 files have no K sample


def _to_numpy_float(x: Any) -> np.ndarray:
    """A float32 or float64 CPU numpy view (a copy only where it must be) of a tensor or array-like.

    Every value converts exactly: float32/float64 as they are, bf16/fp16 widened to float32, anything
    else to float64. Callers widen to float64 where they compute, in numpy (on CPU many times faster
    than ``Tensor.to(float64)``).
    """
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        import torch

        t = x.detach().cpu()
        if t.dtype not in (torch.float32, torch.float64):
            t = t.to(torch.float32 if t.dtype.is_floating_point and t.dtype.itemsize < 4 else torch.float64)
        return t.numpy()
    arr = np.asarray(x)
    return arr if arr.dtype in (np.float32, np.float64) else arr.astype(np.float64)


def _as_slice(idx: np.ndarray) -> slice | np.ndarray:
    """An arithmetic index sequence as the equivalent slice (a strided copy is much cheaper than a gather)."""
    if idx.size > 1 and np.all(np.diff(idx) == idx[1] - idx[0]) and idx[1] > idx[0]:
        return slice(int(idx[0]), int(idx[-1]) + 1, int(idx[1] - idx[0]))
    return idx


class CalibrationStats:
    """The calibration statistics of one model: pair moments, top-k candidates and K sample (App. A.2.1).

    ``update(layer, stream, x)`` takes a q_proj ("q", ``n_q_heads``) or k_proj ("k", ``n_kv_heads``)
    output before RoPE, shape (..., H*head_dim) in the model's native ``layout``; every leading axis
    (samples, positions) is folded into rows and fed to :attr:`moments`, to :attr:`topk_candidates`
    (``topk`` rows per (layer, pair) from ``topk_streams``; ``topk`` = 0 keeps none) and, for K, to
    :attr:`ksample` (``sample_rows`` tokens per layer; 0 keeps none).
    """

    def __init__(
        self,
        n_layers: int,
        n_q_heads: int,
        n_kv_heads: int,
        head_dim: int,
        layout: str = "rotate_half",
        topk: int = 256,
        topk_streams: Sequence[str] = ("k",),
        sample_rows: int = 0,
        sample_seed: int = 0,
    ) -> None:
        _check_geometry(n_layers, n_q_heads, n_kv_heads)
        self.n_pairs = check_head_dim(int(head_dim))
        self.layout = check_layout(layout)
        self.n_layers, self.n_q_heads, self.n_kv_heads = int(n_layers), int(n_q_heads), int(n_kv_heads)
        self.head_dim = int(head_dim)
        self._moments = PairMoments(self.n_layers, self.n_q_heads, self.n_kv_heads, self.n_pairs)
        self._topk_candidates = TopKCandidates(self.n_layers, self.n_pairs, topk, topk_streams)
        self._ksample = KSample(self.n_layers, self.n_kv_heads, self.head_dim, sample_rows, sample_seed)
        self.topk, self.topk_streams = self._topk_candidates.topk, self._topk_candidates.streams
        self.sample_rows, self.sample_seed = self._ksample.size, self._ksample.seed
        self._idx_a, self._idx_b = pair_indices(self.head_dim, self.layout)
        self._sel_a, self._sel_b = _as_slice(self._idx_a), _as_slice(self._idx_b)
        self._device = DeviceAccumulator(self.n_pairs, self.topk, self.topk_streams, self.sample_rows)

    # ------------------------------------------------------------------ the host components (device rows folded in)

    @property
    def moments(self) -> PairMoments:
        """The pair moments (rows accumulated on a device are copied in first)."""
        self.finalize()
        return self._moments

    @property
    def topk_candidates(self) -> TopKCandidates:
        """The top-k candidate rows (rows accumulated on a device are copied in first)."""
        self.finalize()
        return self._topk_candidates

    @property
    def ksample(self) -> KSample:
        """The K sample (rows accumulated on a device are copied in first)."""
        self.finalize()
        return self._ksample

    def finalize(self) -> None:
        """Copy what torch batches accumulated on their device to the host (one transfer) and fold it in.

        Every reader calls this first; a calibration pass calls it once at its end. Raises
        :class:`NonFiniteCalibrationError` naming the (layer, stream) if a device batch held NaN/Inf (the
        device rows are then dropped: the host statistics keep only what was folded in before).
        """
        if self._device.empty():
            return
        drained = self._device.drain()
        bad = {where: count for where, count in drained.bad.items() if count}
        if bad:
            where = ", ".join(f"layer {layer}, stream {st!r}: non-finite values (NaN/Inf) in {count} "
                              "(head, pair) column(s)" for (layer, st), count in sorted(bad.items()))
            raise NonFiniteCalibrationError(f"{where} in the calibration input")
        for (layer, stream), (n, arrays) in sorted(drained.moments.items()):
            self._moments.fold(layer, stream, n, arrays)
        for layer, rows in sorted(drained.candidates.items()):
            self._topk_candidates.push(layer, rows)
        for layer, (keys, positions, rows) in sorted(drained.sample.items()):
            self._ksample.push(layer, keys, positions, rows)

    # ------------------------------------------------------------------ configuration helpers

    def heads(self, stream: str) -> int:
        """Number of heads of a stream (Q: n_q_heads, K: n_kv_heads)."""
        return self._moments.heads(stream)

    @property
    def group_size(self) -> int:
        """Q heads per KV head (GQA group size)."""
        return self._moments.group_size

    def config(self) -> dict[str, Any]:
        return {
            "n_layers": self.n_layers,
            "n_q_heads": self.n_q_heads,
            "n_kv_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "layout": self.layout,
            "topk": self.topk,
            "topk_streams": list(self.topk_streams),
            "sample_rows": self.sample_rows,
            "sample_seed": self.sample_seed,
        }

    def n_rows(self, stream: str) -> np.ndarray:
        """Rows seen per layer for ``stream`` (each row holds every head of that stream)."""
        return self.moments.n_rows(stream)

    # ------------------------------------------------------------------ accumulation

    def update(self, layer: int, stream: str, x: Any) -> None:
        """Accumulate one batch of q_proj/k_proj outputs (pre-RoPE), shape (..., H*head_dim).

        A torch tensor is accumulated on its own device (:mod:`rope_quant.calib.device_acc`, no host
        synchronisation; a NaN/Inf is reported by :meth:`finalize`); anything else on the host in numpy (a
        NaN/Inf raises at once).
        """
        stream = check_stream(stream)
        layer = check_layer(layer, self.n_layers)
        H, d = self.heads(stream), self.head_dim
        if isinstance(x, torch.Tensor):
            self._update_device(layer, stream, x.detach())
            return
        arr = _to_numpy_float(x)  # float32 or float64; widened to float64 below while selecting the pairs
        self._check_shape(layer, stream, arr.shape)
        rows = arr.reshape(-1, H, d)
        if rows.shape[0] == 0:
            return
        # (N, H, K) C-contiguous float64 copies, the layout the fancy-index gather gave (the einsums see it)
        a = np.array(rows[:, :, self._sel_a], dtype=np.float64, order="C")
        b = np.array(rows[:, :, self._sel_b], dtype=np.float64, order="C")
        sums = a.sum(axis=0), b.sum(axis=0)
        # A non-finite input makes its column's sum non-finite (float64 sums of the rows cannot overflow
        # otherwise short of ~1e308 inputs), so the full elementwise check runs only when a sum is.
        if not (np.isfinite(sums[0]).all() and np.isfinite(sums[1]).all()):
            finite = np.isfinite(arr)
            if not finite.all():
                bad = int(arr.size - np.count_nonzero(finite))
                raise NonFiniteCalibrationError(
                    f"layer {layer}, stream {stream!r}: {bad} non-finite value(s) (NaN/Inf) "
                    "in the calibration input"
                )
        self.finalize()  # device rows first, so the host sees every batch in order
        self._topk_candidates.update(layer, stream, a, b)
        if stream == "k":
            self._ksample.update(layer, arr.shape, rows)  # float32 rows cast exactly as before
        self._moments.update(layer, stream, a, b, sums=sums, overwrite=True)  # centres a, b in place

    def _check_shape(self, layer: int, stream: str, shape: tuple[int, ...]) -> None:
        H, d = self.heads(stream), self.head_dim
        if len(shape) < 1 or shape[-1] != H * d:
            raise CalibrationShapeError(
                f"layer {layer}, stream {stream!r}: expected input of shape (..., {H}*{d}={H * d}) "
                f"({H} heads of dim {d}), got {tuple(shape)}"
            )

    def _update_device(self, layer: int, stream: str, x: torch.Tensor) -> None:
        """:meth:`update` for a torch tensor: shape checks on the host, arithmetic on ``x.device``."""
        H, d = self.heads(stream), self.head_dim
        self._check_shape(layer, stream, x.shape)
        rows = x.reshape(-1, H, d)
        if rows.shape[0] == 0:
            return
        keys = None
        if stream == "k" and self.sample_rows:
            keys = self._ksample.draw_keys(layer, tuple(x.shape))
        with one_cpu_thread(x.device):  # 1 thread: faster at this size, and thread-count free
            self._device.update(layer, stream, x, rows, self._sel_a, self._sel_b, keys)

    def candidates(self, layer: int) -> np.ndarray:
        """Top-k candidate rows of a layer, shape (n_kept, K, 2) as (a, b), sorted by |a|+|b| descending."""
        return self.topk_candidates.candidates(layer)

    def k_sample(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The K sample of a layer: pre-RoPE rows (n, H_kv, head_dim) float64 and positions (n,) int64."""
        return self.ksample.sample(layer)

    # ------------------------------------------------------------------ merging and persistence

    def merge(self, other: CalibrationStats) -> CalibrationStats:
        """Fold ``other`` (disjoint rows) into ``self`` in place, component by component.

        Returns self.
        """
        if not isinstance(other, CalibrationStats):
            raise IncompatibleStatsError(f"cannot merge {type(other).__name__} into CalibrationStats")
        mine, theirs = self.config(), other.config()
        mine.pop("sample_seed")
        theirs.pop("sample_seed")  # processes sample with their own seeds
        if mine != theirs:
            raise IncompatibleStatsError(f"configurations differ: {mine} vs {theirs}")
        self.moments.merge(other.moments)
        self.topk_candidates.merge(other.topk_candidates)
        self.ksample.merge(other.ksample)
        return self

    def copy(self) -> CalibrationStats:
        """Deep copy."""
        out = CalibrationStats(**{**self.config(), "topk_streams": tuple(self.topk_streams)})
        out.merge(self)
        out.ksample.copy_rng_state(self.ksample)
        return out

    def save(self, path: str | os.PathLike, k_sample: bool = True) -> Path:
        """Write the accumulators to a .npz file atomically (:func:`rope_quant.io.atomic_write_bytes`).

        ``k_sample=False`` leaves the K sample out (it is most of the file; the file then loads as
        statistics with ``sample_rows=0``, the moments and candidates unchanged).
        """
        path = Path(path)
        config = self.config() if k_sample else {**self.config(), "sample_rows": 0}
        arrays: dict[str, np.ndarray] = {
            "meta": np.array(json.dumps({"version": _FORMAT_VERSION, **config})),
            **self.topk_candidates.to_arrays(),
            **(self.ksample.to_arrays() if k_sample else {}),
            **self.moments.to_arrays(),
        }
        buf = io.BytesIO()
        np.savez(buf, **arrays)  # type: ignore[arg-type]  # mypy: a key could be savez's allow_pickle (none is)
        atomic_write_bytes(path, buf.getvalue())
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> CalibrationStats:
        """Read accumulators written by :meth:`save`; a truncated or malformed file raises
        :class:`StatsFileError` naming it."""
        path = Path(path)
        if not path.is_file():
            raise MissingStatsFileError(f"calibration statistics file {str(path)!r} does not exist")
        try:
            with np.load(path, allow_pickle=False) as data:
                meta = json.loads(str(data["meta"]))
                if meta.pop("version", None) not in _READABLE_VERSIONS:
                    raise StatsFileError(f"{path}: unknown statistics format version")
                meta["topk_streams"] = tuple(meta["topk_streams"])
                out = cls(**meta)
                try:
                    for part in (out.moments, out.topk_candidates, out.ksample):
                        part.load_arrays(data)
                except StatsFileError as exc:
                    raise StatsFileError(f"{path}: {exc}") from exc
        except (KeyError, ValueError, OSError, EOFError, TypeError, zipfile.BadZipFile) as exc:
            if isinstance(exc, CalibrationError):
                raise
            raise StatsFileError(f"{path} is not a valid calibration statistics file "
                                 f"({type(exc).__name__}: {exc})") from exc
        return out

    # ------------------------------------------------------------------ pooled covariances

    def raw_moments(self, stream: str) -> dict[str, np.ndarray]:
        """The raw-moment sums of a stream: n (L,), sum_a, sum_b, sum_aa, sum_bb, sum_ab (L, H, K)."""
        return self.moments.raw_moments(stream)

    def per_head(self, stream: str) -> PairCov:
        """Unpooled per-head covariance of one stream (see :meth:`PairMoments.per_head`)."""
        return self.moments.per_head(stream)

    def pooled(self, rule: str = "rows") -> PairCov:
        """Pooled per-pair covariance under ``rule`` (see :meth:`PairMoments.pooled`)."""
        return self.moments.pooled(rule)

    def pooled_raw(self, rule: str = "rows") -> PairCov:
        """The pooled covariance from the raw-moment sums (see :meth:`PairMoments.pooled_raw`)."""
        return self.moments.pooled_raw(rule)

    def pair_energies(self, stream: str = "k") -> np.ndarray:
        """Mean E[a² + b²] of every (layer, head, RoPE pair) of a stream's pre-RoPE rows, (L, H, K). RoPE turns a
        pair without changing it, so it is the post-RoPE pair energy too: the input of
        :func:`rope_quant.quant.keys.allocate_pair_bits` where no R3 mixes the pairs."""
        from rope_quant.quant.keys import pair_energies

        m = self.raw_moments(stream)
        return pair_energies(m["sum_aa"], m["sum_bb"], m["n"])

    def pooled_mean(self, rule: str = "rows") -> tuple[np.ndarray, np.ndarray]:
        """Pooled pair means (ā, b̄) under ``rule`` (see :meth:`PairMoments.pooled_mean`)."""
        return self.moments.pooled_mean(rule)


def merge_all(stats: Iterable[CalibrationStats]) -> CalibrationStats:
    """Merge several accumulators (e.g. from different processes) into a new one."""
    items = list(stats)
    if not items:
        raise CalibrationError("merge_all needs at least one CalibrationStats")
    out = items[0].copy()
    for other in items[1:]:
        out.merge(other)
    return out


def register_projection_hooks(model: Any, stats: CalibrationStats) -> list[Any]:
    """Feed ``stats`` from forward hooks on every layer's pre-RoPE query/key module.

    The modules come from :func:`rope_quant.model.arch.attention_modules`: q_proj/k_proj, or the per-head
    q/k norms where the family has them (what RoPE actually rotates; their (..., L, H, d) outputs, or
    (b, H, L, d) ones transposed first where the family norms after the head transpose, are flattened to
    (..., L, H*d)). Returns the hook handles; call ``handle.remove()`` on each when done.
    """
    try:
        parts = arch.attention_modules(model)
    except arch.ArchitectureError as exc:
        raise CalibrationShapeError(f"cannot find the attention modules: {exc}") from exc
    handles = []
    for position, attn in enumerate(parts):
        layer = position if attn.layer_idx is None else attn.layer_idx
        for stream in ("q", "k"):
            mod, per_head = attn.pre_rope(stream)
            heads_first = per_head and attn.norm_heads_first  # Gemma 3: (b, H, L, d) -> (b, L, H, d) first

            def hook(_mod: Any, _inp: Any, out: Any, layer: int = layer, stream: str = stream,
                     per_head: bool = per_head, heads_first: bool = heads_first) -> None:
                if heads_first:
                    out = out.transpose(-3, -2)
                stats.update(layer, stream, out.flatten(-2) if per_head else out)

            handles.append(mod.register_forward_hook(hook))
    return handles

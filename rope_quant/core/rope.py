"""RoPE geometry (paper §3, App. A.5): pair layouts, the RoPE matrix R_m, phase averages, inv_freq lookup.

Conventions (see the contracts): head_dim ``d`` is even and ``K = d/2``. RoPE at position ``m``
rotates pair ``k`` by ``m * theta_k`` acting on the column ``[a; b]`` with ``[[cos, -sin], [sin, cos]]``
(HF: ``q*cos + rotate_half(q)*sin``). Layouts:

- ``rotate_half`` (native HF): pair ``k`` = channels ``(k, k + d/2)``;
- ``interleaved``: pair ``k`` = channels ``(2k, 2k + 1)``.

Pure numpy (float64); torch is touched only by :func:`find_inv_freq`, through the module it is given.
"""

from __future__ import annotations

from typing import Any

import numpy as np

LAYOUTS = ("rotate_half", "interleaved")

# Above this many (position, frequency) products the chunked direct sum works in slices.
_CHUNK_ELEMENTS = 1 << 20


class RopeError(ValueError):
    """Base class for bad RoPE inputs."""


class OddHeadDimError(RopeError):
    """head_dim is not a positive even integer."""


class UnsupportedLayoutError(RopeError):
    """The pair layout is not one of :data:`LAYOUTS`."""


class MissingInvFreqError(RopeError):
    """No materialised ``inv_freq`` buffer was found in a module tree (App. A.5)."""


class AmbiguousInvFreqError(RopeError):
    """Several distinct ``inv_freq`` buffers were found in a module tree (App. A.5)."""


class NonDistinctFrequencyError(RopeError):
    """Two RoPE frequencies coincide, so the Lemma's precondition (distinct theta_k) fails."""


class InvalidFrequencyError(RopeError):
    """Frequencies are not a finite, positive 1-D array."""


# ----------------------------------------------------------------------------- validation


def check_head_dim(head_dim: int) -> int:
    """Validate ``head_dim`` (positive, even) and return the number of pairs ``K = d/2``."""
    if isinstance(head_dim, bool) or not isinstance(head_dim, (int, np.integer)):
        raise OddHeadDimError(f"head_dim must be an integer, got {head_dim!r}")
    if head_dim <= 0 or head_dim % 2:
        raise OddHeadDimError(f"head_dim must be a positive even integer, got {head_dim}")
    return int(head_dim) // 2


def check_layout(layout: str) -> str:
    """Validate a pair layout name."""
    if layout not in LAYOUTS:
        raise UnsupportedLayoutError(f"unsupported pair layout {layout!r}; expected one of {LAYOUTS}")
    return layout


def _as_freq_vector(inv_freq: Any, *, positive: bool) -> np.ndarray:
    arr = _to_numpy(inv_freq)
    if arr.ndim != 1 or arr.size == 0:
        raise InvalidFrequencyError(f"inv_freq must be a non-empty 1-D array, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise InvalidFrequencyError("inv_freq contains NaN or infinite values")
    if positive and not np.all(arr > 0):
        raise InvalidFrequencyError("inv_freq must be strictly positive")
    return arr


FREQ_RTOL = 1e-6


def check_frequencies(inv_freq: Any) -> np.ndarray:
    """Return ``inv_freq`` as float64 after checking it is finite, positive and pairwise distinct.

    Distinct frequencies are the precondition of the Lemma's converse (App. proofs): with a
    repeated frequency the commutant of RoPE is larger than SO(2)^K.
    Two frequencies count as equal when they differ by at most :data:`FREQ_RTOL` relative to the larger
    one (1e-6: about 8 float32 ulps, so a buffer that repeats a value up to rounding is caught, while real
    RoPE schedules, whose neighbouring frequencies differ by several percent, pass).
    """
    arr = _as_freq_vector(inv_freq, positive=True)
    sorted_vals = np.sort(arr)
    gaps = np.diff(sorted_vals)
    repeats = np.flatnonzero(gaps <= FREQ_RTOL * sorted_vals[1:])
    if repeats.size:
        i = int(repeats[0])
        raise NonDistinctFrequencyError(
            f"RoPE frequencies must be pairwise distinct (relative tolerance {FREQ_RTOL:g}); "
            f"{sorted_vals[i]!r} and {sorted_vals[i + 1]!r} coincide"
        )
    return arr


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch tensor, without importing torch
        x = x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


# ----------------------------------------------------------------------------- layouts


def pair_indices(head_dim: int, layout: str = "rotate_half") -> tuple[np.ndarray, np.ndarray]:
    """Channel indices ``(idx_a, idx_b)`` of the K pairs: pair k is channels ``(idx_a[k], idx_b[k])``."""
    k = check_head_dim(head_dim)
    check_layout(layout)
    if layout == "rotate_half":
        idx_a = np.arange(k)
        return idx_a, idx_a + k
    return np.arange(0, 2 * k, 2), np.arange(1, 2 * k, 2)


def layout_permutation(head_dim: int, src: str, dst: str) -> np.ndarray:
    """Permutation ``perm`` with ``x_dst = x_src[..., perm]`` (pair k of src lands on pair k of dst)."""
    a_src, b_src = pair_indices(head_dim, src)
    a_dst, b_dst = pair_indices(head_dim, dst)
    perm = np.empty(head_dim, dtype=np.int64)
    perm[a_dst] = a_src
    perm[b_dst] = b_src
    return perm


# ----------------------------------------------------------------------------- R_m


def rope_matrix(inv_freq: Any, position: Any, layout: str = "rotate_half") -> np.ndarray:
    """The RoPE matrix R_m (d x d, float64) acting on column vectors, ``d = 2 * len(inv_freq)``.

    ``position`` may be a scalar (returns ``(d, d)``) or an array (returns ``position.shape + (d, d)``).
    """
    theta = _as_freq_vector(inv_freq, positive=False)
    d = 2 * theta.size
    idx_a, idx_b = pair_indices(d, layout)
    pos = np.asarray(position, dtype=np.float64)
    ang = pos[..., None] * theta  # (..., K)
    cos, sin = np.cos(ang), np.sin(ang)
    out = np.zeros(pos.shape + (d, d), dtype=np.float64)
    out[..., idx_a, idx_a] = cos
    out[..., idx_a, idx_b] = -sin
    out[..., idx_b, idx_a] = sin
    out[..., idx_b, idx_b] = cos
    return out


# ----------------------------------------------------------------------------- phase averages


def _check_length(length: Any) -> int:
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 1:
        raise RopeError(f"average length L must be a positive integer, got {length!r}")
    return int(length)


def phase_averages(inv_freq: Any, length: int, method: str = "closed") -> tuple[np.ndarray, np.ndarray]:
    """Phase averages (Eq. CkSk): ``C_k = mean_{m<L} cos(2 m theta_k)``, ``S_k = mean sin(2 m theta_k)``.

    ``method="closed"`` uses the Dirichlet-kernel closed form
    ``sum_{m<L} e^{2 i m theta} = e^{i (L-1) theta} sin(L theta) / sin(theta)`` (O(K) memory);
    ``method="sum"`` sums the terms directly in chunks (O(chunk) memory), as an independent check.
    """
    theta = _as_freq_vector(inv_freq, positive=False)
    n = _check_length(length)
    if method == "closed":
        return _phase_closed(theta, n)
    if method == "sum":
        return _phase_sum(theta, n)
    raise RopeError(f"unknown phase-average method {method!r}; expected 'closed' or 'sum'")


def _phase_closed(theta: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    sin_t = np.sin(theta)
    degenerate = sin_t == 0.0  # theta = 0 exactly (multiples of pi are not exact in float64)
    safe = np.where(degenerate, 1.0, sin_t)
    ratio = np.sin(n * theta) / (n * safe)
    phase = (n - 1) * theta
    c = np.where(degenerate, 1.0, np.cos(phase) * ratio)
    s = np.where(degenerate, 0.0, np.sin(phase) * ratio)
    return c.astype(np.float64), s.astype(np.float64)


def _phase_sum(theta: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    k = theta.size
    step = max(1, _CHUNK_ELEMENTS // max(k, 1))
    c_acc = np.zeros(k)
    s_acc = np.zeros(k)
    for start in range(0, n, step):
        m = np.arange(start, min(start + step, n), dtype=np.float64)
        ang = 2.0 * m[:, None] * theta[None, :]
        c_acc += np.cos(ang).sum(axis=0)
        s_acc += np.sin(ang).sum(axis=0)
    return c_acc / n, s_acc / n


# ----------------------------------------------------------------------------- inv_freq lookup


def find_inv_freq(module: Any, head_dim: int | None = None) -> tuple[np.ndarray, str]:
    """Find the materialised RoPE ``inv_freq`` buffer in a torch module tree (App. A.5).

    Searches ``module.named_buffers()`` for names ending in ``inv_freq`` (``original_inv_freq`` is
    ignored), skipping meta tensors. With ``head_dim`` only buffers of length ``head_dim/2`` count.
    Buffers with identical values (e.g. one rotary module per layer) are one candidate.

    Returns ``(inv_freq as float64 array, source buffer name)``. Raises
    :class:`MissingInvFreqError` when there is none and :class:`AmbiguousInvFreqError` when
    there are several distinct ones.
    """
    if not hasattr(module, "named_buffers"):
        raise MissingInvFreqError(f"{type(module).__name__} is not a torch module (no named_buffers)")
    want = None if head_dim is None else check_head_dim(head_dim)
    found: list[tuple[str, np.ndarray]] = []
    skipped: list[str] = []
    for name, buf in module.named_buffers():
        leaf = name.rsplit(".", 1)[-1]
        if not leaf.endswith("inv_freq") or leaf == "original_inv_freq":
            continue
        if getattr(buf, "is_meta", False):
            skipped.append(f"{name} (meta tensor, not materialised)")
            continue
        values = _to_numpy(buf).reshape(-1)
        if want is not None and values.size != want:
            skipped.append(f"{name} (length {values.size}, expected {want})")
            continue
        found.append((name, values))
    if not found:
        detail = f"; skipped: {', '.join(skipped)}" if skipped else ""
        raise MissingInvFreqError(
            f"no materialised inv_freq buffer in {type(module).__name__}"
            + (f" of length head_dim/2 = {want}" if want is not None else "")
            + detail
        )
    distinct: list[tuple[str, np.ndarray]] = []
    for name, values in found:
        if not any(v.shape == values.shape and np.array_equal(v, values) for _, v in distinct):
            distinct.append((name, values))
    if len(distinct) > 1:
        names = ", ".join(f"{n} (len {v.size})" for n, v in distinct)
        hint = ("pass the rotary module of one layer itself (rope_quant.model.arch.layer_inv_freq does this "
                "per layer)" if head_dim is not None else "pass head_dim= or the rotary module itself")
        raise AmbiguousInvFreqError(
            f"{len(distinct)} distinct inv_freq buffers in {type(module).__name__}"
            + (f" of length head_dim/2 = {want}" if want is not None else "") + f": {names}; {hint}"
        )
    name, values = distinct[0]
    return values.astype(np.float64, copy=True), name

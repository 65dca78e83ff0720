"""φ* verification (App. A.5 and J): does the stored angle attain the analytic minimum λ̄?

Inputs are the stored angles, the per-pair covariances reconstructed after raw-moment aggregation
(:meth:`CalibrationStats.pooled_raw`) and the deployed frequencies with the averaging length L.
The check is independent of the closed forms used to estimate φ*: the surrogate
Σ̃ = (1/L) Σ_{m<L} R_m Σ R_mᵀ is rebuilt from direct position sums of cos², sin², cos·sin (not the
Dirichlet closed form, not the double-angle algebra), the rotated 2x2 matrix G(φ) Σ̃ G(φ)ᵀ is formed
explicitly, and

    minimax = max(diag(G Σ̃ Gᵀ)),   λ̄ = (s11 + s22)/2,   excess = minimax - λ̄.

``phi_star_verified`` holds when the worst relative excess, max over (layer[, head], pair) of
excess/λ̄ (pairs with λ̄ = 0 count as 0 when their excess is 0), is at most the tolerance
(default 5e-5). For comparison the excess of the identity, the per-pair H2 and the Jacobi φ̂
(which is ½|S|·r with r = sqrt((s11 - s22)² + 4 s12²)) are reported too.

:func:`brute_force_phi_star` is a third, closed-form-free route to φ* (Theorem (ii), (iv)): it averages
the explicitly rotated matrices R_m Σ R_mᵀ over the positions and minimises the worst-case output variance
over a fine angle grid with a golden-section refinement.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from rope_quant.calib.stats import CalibrationStats
from rope_quant.core.angles import PairCov, as_pair_cov, jacobi_angle
from rope_quant.core.rope import check_frequencies, find_inv_freq
from rope_quant.io import atomic_write_text
from rope_quant.model import arch

DEFAULT_TOLERANCE = 5e-5
CSV_COLUMNS = (
    "layer",
    "pair",
    "theta",
    "C",
    "S",
    "s11",
    "s22",
    "s12",
    "phi",
    "minimax",
    "lambda_bar",
    "excess",
    "excess_identity",
    "excess_h2",
    "excess_phi_hat",
)
EXCESS_MEASURE = "relative: max over pairs of (minimax - lambda_bar) / lambda_bar"
_CHUNK = 1 << 20
BRUTE_FORCE_GRID = 4096
BRUTE_FORCE_REFINE = 80
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


class VerificationError(ValueError):
    """Bad input to the φ* verifier."""


class VerificationShapeError(VerificationError):
    """Angles, covariances and frequencies do not fit together."""


class MissingArtifactError(FileNotFoundError, VerificationError):
    """An input artifact (angles, statistics or frequencies file) does not exist."""


@dataclass
class VerificationResult:
    """Per-pair arrays (shape of the angles) and the summary of one verification."""

    arrays: dict[str, np.ndarray]
    summary: dict[str, Any]
    per_head: bool = False
    columns: tuple[str, ...] = field(default=CSV_COLUMNS)

    @property
    def verified(self) -> bool:
        return bool(self.summary["phi_star_verified"])


def position_moments(inv_freq: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Direct sums over m < L of cos²(mθ), sin²(mθ), cos(mθ)sin(mθ), divided by L (chunked)."""
    if isinstance(length, bool) or int(length) != length or length < 1:
        raise VerificationError(f"average length must be a positive integer, got {length!r}")
    theta = np.asarray(inv_freq, dtype=np.float64)
    k = theta.size
    step = max(1, _CHUNK // max(k, 1))
    cc, ss, cs = np.zeros(k), np.zeros(k), np.zeros(k)
    for start in range(0, int(length), step):
        m = np.arange(start, min(start + step, int(length)), dtype=np.float64)
        ang = m[:, None] * theta[None, :]
        c, s = np.cos(ang), np.sin(ang)
        cc += (c * c).sum(axis=0)
        ss += (s * s).sum(axis=0)
        cs += (c * s).sum(axis=0)
    return cc / length, ss / length, cs / length


class BruteForcePhiStar(NamedTuple):
    """Result of :func:`brute_force_phi_star`: the minimising angle in [-π/4, π/4) and the objective there."""

    phi: np.ndarray
    objective: np.ndarray


def _brute_inputs(s11: Any, s22: Any, s12: Any, inv_freq: Any, length: Any) -> tuple[np.ndarray, ...]:
    """Broadcast covariances (..., K), frequencies (K,) and a checked length for the brute-force route."""
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 1:
        raise VerificationError(f"average length must be a positive integer, got {length!r}")
    theta = np.asarray(inv_freq, dtype=np.float64)
    if theta.ndim != 1 or theta.size == 0 or not np.isfinite(theta).all():
        raise VerificationShapeError(f"inv_freq must be a finite non-empty 1-D array, got shape {theta.shape}")
    arrays = [np.asarray(v, dtype=np.float64) for v in (s11, s22, s12)]
    try:  # the last axis is the pair axis: one frequency per pair
        s11, s22, s12, _ = np.broadcast_arrays(*arrays, theta)
    except ValueError as exc:
        raise VerificationShapeError(
            f"covariances of shapes {[a.shape for a in arrays]} do not broadcast to (..., {theta.size}) "
            f"pairs (one per frequency)"
        ) from exc
    if not (np.isfinite(s11).all() and np.isfinite(s22).all() and np.isfinite(s12).all()):
        raise VerificationError("covariances contain NaN/Inf")
    return s11, s22, s12, theta


def position_averaged_covariance(
    s11: Any, s22: Any, s12: Any, inv_freq: Any, length: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(1/L) Σ_{m<L} R_m Σ R_mᵀ (Eq. Sigmatilde) by explicit 2x2 products at every position m = 0..L-1.

    R_m = [[cos mθ_k, -sin mθ_k], [sin mθ_k, cos mθ_k]] is built per position; the average of the
    Kronecker products R_m ⊗ R_m is accumulated over position chunks and applied to each Σ. No phase
    average (C_k, S_k) and no double-angle algebra is used. Returns (Σ̃11, Σ̃22, Σ̃12), shape (..., K).
    """
    s11, s22, s12, theta = _brute_inputs(s11, s22, s12, inv_freq, length)
    k = theta.size
    step = max(1, _CHUNK // (16 * k))
    kron = np.zeros((k, 2, 2, 2, 2))  # kron[k, i, j, p, l] = mean_m R_m[i, j] R_m[p, l]
    for start in range(0, int(length), step):
        m = np.arange(start, min(start + step, int(length)), dtype=np.float64)
        ang = m[:, None] * theta[None, :]
        c, s = np.cos(ang), np.sin(ang)
        rot = np.stack([np.stack([c, -s], -1), np.stack([s, c], -1)], -2)  # (m, K, 2, 2)
        kron += np.einsum("mkij,mkpl->kijpl", rot, rot)
    kron /= int(length)
    sigma = np.stack([np.stack([s11, s12], -1), np.stack([s12, s22], -1)], -2)  # (..., K, 2, 2)
    avg = np.einsum("kijpl,...kjl->...kip", kron, sigma)
    return avg[..., 0, 0], avg[..., 1, 1], (avg[..., 0, 1] + avg[..., 1, 0]) / 2


def _worst_variance(t11: np.ndarray, t22: np.ndarray, t12: np.ndarray, phi: Any) -> np.ndarray:
    """max diag(G(φ) Σ̃ G(φ)ᵀ) with G(φ) = [[cos, -sin], [sin, cos]] (Theorem (iii)'s objective)."""
    v1, v2 = _rotated_diag(t11, t22, t12, phi)
    return np.maximum(v1, v2)


def position_averaged_minimax(s11: Any, s22: Any, s12: Any, inv_freq: Any, length: int, phi: Any) -> np.ndarray:
    """The objective φ* minimises (Theorem (ii)-(iv)): the larger of the two output variances of G(φ)
    averaged over the positions m < L, i.e. max_i (1/L) Σ_m [G(φ) R_m Σ R_mᵀ G(φ)ᵀ]_ii, evaluated through
    :func:`position_averaged_covariance` (G's conjugation is linear, so it commutes with the mean)."""
    t11, t22, t12 = position_averaged_covariance(s11, s22, s12, inv_freq, length)
    return _worst_variance(t11, t22, t12, np.asarray(phi, dtype=np.float64))


def brute_force_phi_star(
    s11: Any,
    s22: Any,
    s12: Any,
    inv_freq: Any,
    length: int,
    *,
    grid: int = BRUTE_FORCE_GRID,
    refine: int = BRUTE_FORCE_REFINE,
) -> BruteForcePhiStar:
    """Minimise :func:`position_averaged_minimax` over φ by brute force, independently of the closed forms.

    ``s11, s22, s12``: per-pair covariance entries broadcasting to (..., K); ``inv_freq``: (K,) RoPE
    frequencies θ_k; ``length``: the averaging length L (positions 0..L-1). The objective is scored on
    ``grid`` equally spaced angles -π/4 + j·(π/2)/grid, j = 0..grid-1 (it has period π/2, so this covers
    every rotation), then ``refine`` golden-section steps shrink the bracket [best - step, best + step]
    around the best grid angle (the objective t + r̃|sin(β - 2φ)| is unimodal there). Returns
    :class:`BruteForcePhiStar` ``(phi, objective)``, arrays of shape (...,  K), ``phi`` wrapped into
    [-π/4, π/4). Where the averaged covariance is isotropic every angle is optimal and ``phi`` is arbitrary.
    """
    if isinstance(grid, bool) or int(grid) != grid or grid < 4:
        raise VerificationError(f"grid must be an integer >= 4, got {grid!r}")
    if isinstance(refine, bool) or int(refine) != refine or refine < 0:
        raise VerificationError(f"refine must be a non-negative integer, got {refine!r}")
    t11, t22, t12 = position_averaged_covariance(s11, s22, s12, inv_freq, length)
    width = math.pi / 2 / int(grid)
    angles = -math.pi / 4 + width * np.arange(int(grid), dtype=np.float64)
    best_val = np.full(t11.shape, np.inf)
    best_phi = np.zeros(t11.shape)
    chunk = max(1, _CHUNK // max(1, t11.size))
    for start in range(0, angles.size, chunk):
        block = angles[start:start + chunk].reshape((-1,) + (1,) * t11.ndim)
        vals = _worst_variance(t11, t22, t12, block)  # (block, ..., K)
        idx = np.argmin(vals, axis=0)
        val = np.take_along_axis(vals, idx[None], axis=0)[0]
        better = val < best_val
        best_val = np.where(better, val, best_val)
        best_phi = np.where(better, angles[start:start + chunk][idx], best_phi)
    lo, hi = best_phi - width, best_phi + width
    for _ in range(int(refine)):
        c, d = hi - _GOLDEN * (hi - lo), lo + _GOLDEN * (hi - lo)
        left = _worst_variance(t11, t22, t12, c) <= _worst_variance(t11, t22, t12, d)
        hi, lo = np.where(left, d, hi), np.where(left, lo, c)
    mid = (lo + hi) / 2
    mid_val = _worst_variance(t11, t22, t12, mid)
    use_mid = mid_val <= best_val
    phi = np.where(use_mid, mid, best_phi)
    phi = phi - (math.pi / 2) * np.floor((phi + math.pi / 4) / (math.pi / 2))  # period π/2
    phi = np.where(phi >= math.pi / 4, phi - math.pi / 2, np.where(phi < -math.pi / 4, phi + math.pi / 2, phi))
    return BruteForcePhiStar(phi, np.where(use_mid, mid_val, best_val))


def _rotated_diag(s11, s22, s12, phi) -> tuple[np.ndarray, np.ndarray]:
    """diag(G(φ) Σ Gᵀ) formed explicitly, G = [[c, -s], [s, c]]."""
    c, s = np.cos(phi), np.sin(phi)
    v1 = c * c * s11 - 2 * c * s * s12 + s * s * s22
    v2 = s * s * s11 + 2 * c * s * s12 + c * c * s22
    return v1, v2


def _relative(excess: np.ndarray, lam: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(lam > 0, excess / np.where(lam > 0, lam, 1.0), np.where(excess == 0, 0.0, np.inf))
    return rel


def verify_phi_star(
    angles: Any,
    cov: PairCov | CalibrationStats,
    inv_freq: Any,
    average_length: int,
    *,
    rule: str = "rows",
    tol: float = DEFAULT_TOLERANCE,
    frequency_source: str | None = None,
    frequency_sources: Any = None,
) -> VerificationResult:
    """Recompute the surrogate, the achieved minimax variance and λ̄ for stored angles (App. A.5).

    ``cov`` is a PairCov of shape (L, K) / (L, H_kv, K) (or the (..., 2, 2) stack of the same matrices,
    see :func:`rope_quant.core.angles.as_pair_cov`), or a CalibrationStats whose raw-moment
    covariance under ``rule`` is used. ``inv_freq`` is an array, a model of a registered family (its
    layers' shared buffer, from :mod:`rope_quant.model.arch`) or a torch module holding the live buffer
    (found with :func:`rope.find_inv_freq`). A model whose layers differ (Gemma 3) or a (n_layers, K) array
    gives each layer its own frequencies; the record names each layer's source (``frequency_source_by_layer``,
    from the model's buffers or ``frequency_sources``).
    """
    if isinstance(cov, CalibrationStats):
        cov = cov.pooled_raw(rule)
    s11, s22, s12 = (np.asarray(v, dtype=np.float64) for v in as_pair_cov(cov))
    phi = np.asarray(angles, dtype=np.float64)
    head_dim = 2 * phi.shape[-1] if phi.ndim else None
    layer_sources: tuple[str, ...] | None = None
    if arch.is_registered(inv_freq):  # each layer's own buffer (Gemma 3: sliding and full layers differ)
        values, names = arch.inv_freq_by_layer(inv_freq, head_dim=head_dim)
        freqs = np.stack([check_frequencies(v) for v in values])
        layer_sources = tuple(f"live buffer {n}" for n in names)
        source = frequency_source or arch.describe_sources(layer_sources)
    elif not hasattr(inv_freq, "named_buffers") and np.ndim(inv_freq) == 2:  # (n_layers, K) given per layer
        freqs = np.stack([check_frequencies(v) for v in np.asarray(inv_freq, dtype=np.float64)])
        source = frequency_source or "given array (per layer)"
        layer_sources = tuple(frequency_sources) if frequency_sources is not None else (source,) * freqs.shape[0]
    elif hasattr(inv_freq, "named_buffers"):
        values, name = find_inv_freq(inv_freq, head_dim=head_dim)
        freqs, source = check_frequencies(values), frequency_source or f"live buffer {name}"
    else:
        freqs, source = check_frequencies(inv_freq), frequency_source or "given array"
    if not s11.shape == s22.shape == s12.shape:
        raise VerificationShapeError(
            f"covariance arrays differ in shape: {s11.shape}, {s22.shape}, {s12.shape}"
        )
    if phi.shape != s11.shape:
        raise VerificationShapeError(f"angles have shape {phi.shape} but the covariances {s11.shape}")
    if phi.ndim not in (2, 3):
        raise VerificationShapeError(f"angles must be (n_layers, K) or (n_layers, H_kv, K), got {phi.shape}")
    if freqs.shape[-1] != phi.shape[-1]:
        raise VerificationShapeError(f"{freqs.shape[-1]} frequencies for {phi.shape[-1]} pairs")
    if freqs.ndim == 2 and freqs.shape[0] != phi.shape[0]:
        raise VerificationShapeError(f"frequencies for {freqs.shape[0]} layers, angles for {phi.shape[0]}")
    if not (
        np.isfinite(phi).all()
        and np.isfinite(s11).all()
        and np.isfinite(s22).all()
        and np.isfinite(s12).all()
    ):
        raise VerificationError("angles or covariances contain NaN/Inf")
    if not 0 < tol:
        raise VerificationError(f"tolerance must be positive, got {tol!r}")

    if freqs.ndim == 2:  # per layer: (L, K), broadcast over the heads of per-head angles
        cc, ss, cs = (np.stack(m) for m in zip(*(position_moments(f, average_length) for f in freqs),
                                                strict=True))
        if phi.ndim == 3:
            freqs, cc, ss, cs = (a[:, None, :] for a in (freqs, cc, ss, cs))
    else:
        cc, ss, cs = position_moments(freqs, average_length)
    t11 = cc * s11 - 2 * cs * s12 + ss * s22
    t22 = ss * s11 + 2 * cs * s12 + cc * s22
    t12 = cs * (s11 - s22) + (cc - ss) * s12
    lam = (s11 + s22) / 2

    def excess_at(angle: Any) -> np.ndarray:
        v1, v2 = _rotated_diag(t11, t22, t12, angle)
        return np.maximum(v1, v2) - lam

    v1, v2 = _rotated_diag(t11, t22, t12, phi)
    minimax = np.maximum(v1, v2)
    excess = minimax - lam
    phi_hat = np.asarray(jacobi_angle(s11, s22, s12), dtype=np.float64)
    shape = phi.shape
    arrays = {
        "theta": np.broadcast_to(freqs, shape),
        "C": np.broadcast_to(cc - ss, shape),
        "S": np.broadcast_to(2 * cs, shape),
        "s11": s11,
        "s22": s22,
        "s12": s12,
        "phi": phi,
        "minimax": minimax,
        "lambda_bar": lam,
        "excess": excess,
        "excess_identity": excess_at(0.0),
        "excess_h2": np.abs(t12),  # H2 output variances on the surrogate: t ± Σ̃12
        "excess_phi_hat": excess_at(phi_hat),
    }
    r = np.sqrt((s11 - s22) ** 2 + (2 * s12) ** 2)
    predicted_phi_hat = 0.5 * np.abs(arrays["S"]) * r

    rel = _relative(excess, lam)
    worst = np.unravel_index(int(np.argmax(rel)), shape)
    location = {"layer": int(worst[0]), "pair": int(worst[-1])}
    if len(shape) == 3:
        location["head"] = int(worst[1])

    def stats_of(key: str) -> dict[str, float]:
        rel_k = _relative(arrays[key], lam)
        return {
            "mean_rel_excess": float(rel_k.mean()),
            "max_rel_excess": float(rel_k.max()),
            "mean_abs_excess": float(arrays[key].mean()),
            "max_abs_excess": float(arrays[key].max()),
        }

    worst_rel = float(rel.max())
    summary = {
        "phi_star_verified": bool(worst_rel <= tol),
        "worst_excess": worst_rel,
        "excess_measure": EXCESS_MEASURE,
        "worst_location": location,
        "worst_abs_excess": float(excess.max()),
        "tolerance": float(tol),
        "frequency_source": source,
        "frequency_source_by_layer": list(layer_sources) if layer_sources else [source] * int(shape[0]),
        "average_length": int(average_length),
        "n_layers": int(shape[0]),
        "n_pairs": int(shape[-1]),
        "n_kv_heads": int(shape[1]) if len(shape) == 3 else None,
        "trace_check_max_abs": float(np.max(np.abs((t11 + t22) / 2 - lam))),
        "phi_hat_formula_max_abs_dev": float(np.max(np.abs(arrays["excess_phi_hat"] - predicted_phi_hat))),
        "comparison": {
            "stored": stats_of("excess"),
            "identity": stats_of("excess_identity"),
            "h2": stats_of("excess_h2"),
            "phi_hat": stats_of("excess_phi_hat"),
        },
    }
    return VerificationResult(arrays=arrays, summary=summary, per_head=len(shape) == 3)


def write_artifacts(
    result: VerificationResult, out_dir: str | os.PathLike, prefix: str = "phi_star"
) -> tuple[Path, Path]:
    """Write ``{prefix}_pairs.csv`` (one row per layer[, head], pair) and ``{prefix}_summary.json``.

    Both are written atomically (:mod:`rope_quant.io`). Returns (csv path, json path).
    """
    out = Path(out_dir)
    columns = list(CSV_COLUMNS)
    if result.per_head:
        columns.insert(1, "head")
    shape = result.arrays["phi"].shape
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(columns)
    for idx in np.ndindex(*shape):
        row: list[Any] = [idx[0]] + ([idx[1]] if result.per_head else []) + [idx[-1]]
        row += [repr(float(result.arrays[c][idx])) for c in CSV_COLUMNS[2:]]
        writer.writerow(row)
    csv_path, json_path = out / f"{prefix}_pairs.csv", out / f"{prefix}_summary.json"
    atomic_write_text(csv_path, buf.getvalue())
    atomic_write_text(json_path, json.dumps(_finite_json(result.summary), indent=2) + "\n")
    return csv_path, json_path


def _finite_json(obj: Any) -> Any:
    """JSON has no Inf/NaN: write them as strings."""
    if isinstance(obj, dict):
        return {k: _finite_json(v) for k, v in obj.items()}
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    return obj


def _require(path: str | os.PathLike, what: str) -> Path:
    p = Path(path)
    if not p.is_file():
        raise MissingArtifactError(f"{what} file {str(p)!r} does not exist")
    return p


def load_angles(path: str | os.PathLike) -> np.ndarray:
    """Angles from a .npy file or a .npz holding an ``angles`` array."""
    p = _require(path, "angles")
    data = np.load(p, allow_pickle=False)
    if isinstance(data, np.lib.npyio.NpzFile):
        with data:
            if "angles" not in data:
                raise VerificationError(f"{p}: no 'angles' array")
            return np.asarray(data["angles"], dtype=np.float64)
    return np.asarray(data, dtype=np.float64)


def load_frequency_sources(path: str | os.PathLike) -> list[str] | None:
    """The per-layer source buffers saved with the frequencies (``sources_by_layer``), or None."""
    p = Path(path)
    if p.suffix != ".json" or not p.is_file():
        return None
    found = json.loads(p.read_text()).get("sources_by_layer")
    return None if found is None else [str(s) for s in found]


def load_frequencies(path: str | os.PathLike) -> tuple[np.ndarray, str]:
    """Frequencies from .npy, or .json ``{"inv_freq": [...], "source": "..."}``; returns (values, source)."""
    p = _require(path, "frequencies")
    if p.suffix == ".json":
        payload = json.loads(p.read_text())
        if "inv_freq" not in payload:
            raise VerificationError(f"{p}: no 'inv_freq' key")
        return np.asarray(payload["inv_freq"], dtype=np.float64), str(payload.get("source", p))
    return np.asarray(np.load(p, allow_pickle=False), dtype=np.float64), str(p)


def save_frequencies(path: str | os.PathLike, inv_freq: Any, source: str,
                     sources_by_layer: Any = None) -> Path:
    """Write deployed frequencies and their source as JSON (atomically); a (n_layers, K) array (one row per
    layer, e.g. Gemma 3's two RoPE bases) is kept as nested lists."""
    p = Path(path)
    arr = np.asarray(inv_freq, dtype=np.float64)
    values = arr.tolist() if arr.ndim == 2 else [float(v) for v in arr.reshape(-1)]
    payload: dict[str, Any] = {"inv_freq": values, "source": source}
    if sources_by_layer is not None:
        payload["sources_by_layer"] = list(sources_by_layer)
    atomic_write_text(p, json.dumps(payload, indent=2) + "\n")
    return p


def verify_files(
    angles_path: str | os.PathLike,
    stats_path: str | os.PathLike,
    frequencies_path: str | os.PathLike,
    average_length: int,
    out_dir: str | os.PathLike,
    *,
    rule: str = "rows",
    tol: float = DEFAULT_TOLERANCE,
    prefix: str = "phi_star",
) -> VerificationResult:
    """File-based verification: every artifact must exist (MissingArtifactError otherwise)."""
    angles_p = _require(angles_path, "angles")
    stats_p = _require(stats_path, "calibration statistics")
    freq_p = _require(frequencies_path, "frequencies")
    angles = load_angles(angles_p)
    stats = CalibrationStats.load(stats_p)
    freqs, source = load_frequencies(freq_p)
    result = verify_phi_star(
        angles, stats, freqs, average_length, rule=rule, tol=tol, frequency_source=source,
        frequency_sources=load_frequency_sources(freq_p) if freqs.ndim == 2 else None,
    )
    write_artifacts(result, out_dir, prefix)
    return result

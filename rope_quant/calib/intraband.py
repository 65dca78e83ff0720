"""Intra-band statistics of the pre-RoPE frequency pairs (App. A, Table A): σ1, σ2 and ρ per layer and pair.

For each frequency pair k the two channels (a, b) that RoPE rotates together have standard deviations
σ1 = √Σ11, σ2 = √Σ22 and correlation ρ = Σ12 / (σ1 σ2), from the calibration accumulators
(:class:`rope_quant.calib.stats.CalibrationStats`, centred float64 moments). They are reported

- separately for the Q stream (every Q head) and the K stream (every KV head): ``scope`` ``q`` / ``k``;
- pooled the way the pairwise angles pool them: ``pooled`` (the ``rows`` rule, one per layer) and
  ``pooled_kv_group`` (the ``per_head`` rule: a KV head with the Q heads of its GQA group).

:func:`intraband_rows` gives one row per (scope, layer, head, pair); :func:`rho_quantiles` the head-resolved
summary (quantiles of ρ and |ρ| over every layer, head and pair of a scope). A pair with a zero variance
has no correlation: its ρ is NaN and is left out of the quantiles (counted in ``n_undefined``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rope_quant.core.angles import PairCov

#: Scopes in report order: the two streams separately, then the two poolings.
SCOPES = ("q", "k", "pooled", "pooled_kv_group")
#: Quantiles of the head-resolved summary.
QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)
#: |ρ| thresholds whose exceedance fractions the summary reports.
THRESHOLDS = (0.1, 0.3)
ROW_COLUMNS = ("scope", "layer", "head", "pair", "sigma1", "sigma2", "rho")


def sigma_rho(cov: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """σ1, σ2 and ρ of covariances (s11, s22, s12) of any shape; ρ is NaN where σ1 σ2 = 0."""
    s11, s22, s12 = (np.asarray(v, dtype=np.float64) for v in cov)
    sigma1, sigma2 = np.sqrt(np.clip(s11, 0.0, None)), np.sqrt(np.clip(s22, 0.0, None))
    den = sigma1 * sigma2
    with np.errstate(divide="ignore", invalid="ignore"):
        rho = np.where(den > 0, s12 / np.where(den > 0, den, 1.0), np.nan)
    return sigma1, sigma2, np.clip(rho, -1.0, 1.0)


def scope_covariances(stats: Any) -> dict[str, PairCov]:
    """Covariances per scope, each (n_layers, heads, K): per Q head, per KV head, the ``rows`` pooling (one
    head axis of size 1) and the ``per_head`` pooling (one per KV head)."""
    rows = stats.pooled("rows")
    return {
        "q": stats.per_head("q"),
        "k": stats.per_head("k"),
        "pooled": PairCov(*(np.asarray(v)[:, None, :] for v in rows)),
        "pooled_kv_group": stats.pooled("per_head"),
    }


def intraband_rows(stats: Any, scopes: Sequence[str] = SCOPES) -> list[dict[str, Any]]:
    """One row per (scope, layer, head, pair): σ1, σ2, ρ (``head`` is -1 for the per-layer ``pooled``)."""
    covs = scope_covariances(stats)
    out: list[dict[str, Any]] = []
    for scope in scopes:
        s1, s2, rho = sigma_rho(covs[scope])
        n_layers, n_heads, n_pairs = rho.shape
        for layer in range(n_layers):
            for head in range(n_heads):
                for k in range(n_pairs):
                    out.append({"scope": scope, "layer": layer, "head": -1 if scope == "pooled" else head,
                                "pair": k, "sigma1": float(s1[layer, head, k]), "sigma2": float(s2[layer, head, k]),
                                "rho": float(rho[layer, head, k])})
    return out


def rho_quantiles(stats: Any, scopes: Sequence[str] = SCOPES,
                  quantiles: Sequence[float] = QUANTILES) -> list[dict[str, Any]]:
    """The head-resolved summary (Table A): per scope, quantiles of ρ and of |ρ| over every (layer, head,
    pair), the fraction of |ρ| above each of :data:`THRESHOLDS`, and the median of max(σ1,σ2)/min(σ1,σ2)."""
    covs = scope_covariances(stats)
    out = []
    for scope in scopes:
        s1, s2, rho = sigma_rho(covs[scope])
        ok = np.isfinite(rho)
        r = rho[ok]
        row: dict[str, Any] = {"scope": scope, "n": int(r.size), "n_undefined": int((~ok).sum())}
        for q in quantiles:
            row[f"rho_q{round(q * 100):02d}"] = float(np.quantile(r, q)) if r.size else None
        for q in quantiles:
            row[f"abs_rho_q{round(q * 100):02d}"] = float(np.quantile(np.abs(r), q)) if r.size else None
        for t in THRESHOLDS:
            row[f"frac_abs_rho_gt_{t:g}"] = float((np.abs(r) > t).mean()) if r.size else None
        lo, hi = np.minimum(s1, s2)[ok], np.maximum(s1, s2)[ok]
        row["sigma_ratio_median"] = float(np.median(hi / lo)) if r.size else None
        out.append(row)
    return out


def abs_rho_by_pair(stats: Any, scope: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per pair index k: the median, 10% and 90% quantiles of |ρ| over layers and heads of ``scope``."""
    _, _, rho = sigma_rho(scope_covariances(stats)[scope])
    flat = np.abs(rho).reshape(-1, rho.shape[-1])
    with np.errstate(all="ignore"):
        return (np.nanmedian(flat, axis=0), np.nanquantile(flat, 0.1, axis=0), np.nanquantile(flat, 0.9, axis=0))

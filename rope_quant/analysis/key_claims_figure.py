"""The key-quantiser claims' figure: Δppl against the online Hadamard, per scheme and R3, one panel per model and
setting (rope_quant/claims/keys.py; docs/key_quantizers.md).

Reads one or more claims JSONs (the pytest plugin's ``--rq-claims-out=DIR`` (DIR/claims.json), or ``rope-quant report
DIR``'s): every row whose claim id is a key claim's, ``K-<scheme>-<id|fold>-<KV4|W4A4KV4>`` (the row's ``id``, else
found in its test id). Each point is the mean paired Δppl = ppl(scheme + R3) − ppl(reference + online Hadamard)
over the seeds; its bar is the interval the verdict was read from (docs/verdicts.md: the primary paired interval,
joined with the float-order replicate interval where one exists); the dotted tick beside it is the claim's +margin
(its reference cell's ±0.05 PPL scaled by that cell's ppl: the claim holds when the bar lies below it, is refuted
when the bar lies above it). Filled: holds; a cross:
refuted; open: inconclusive or fails. Every legend sits outside the axes.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rope_quant.analysis.figures import legend_outside, pyplot, save_png
from rope_quant.analysis.reproduce import short_deviation
from rope_quant.claims import keys

ID_PATTERN = re.compile(r"K-(?P<scheme>[a-z]+)-(?P<r3>[a-z]+)-(?P<setting>W4A4KV4|KV4)(?![A-Za-z0-9])")
"""A key claim's id (claims/keys.py: claim_id), found in a row's ``id`` or ``test``."""
R3_LABELS = {"id": "no R3", "fold": "best foldable R3"}
MARKERS = {"id": "o", "fold": "s"}
OFFSETS = {"id": -0.15, "fold": 0.15}


@dataclass(frozen=True)
class KeyPoint:
    """One key claim's row as the figure draws it."""

    model: str
    setting: str
    scheme: str
    r3: str
    mean: float
    low: float
    high: float
    margin: float | None
    outcome: str
    deviation: str = ""  # the protocol's deviation on this model (claims/premises.py), short: "R1 refused by …"


def claim_parts(text: str) -> tuple[str, str, str] | None:
    """(scheme, R3 tag, setting) of the key claim id in ``text``, or None."""
    m = ID_PATTERN.search(text or "")
    return (m["scheme"], m["r3"], m["setting"]) if m else None


def read_rows(paths: Iterable[str | os.PathLike[str]]) -> list[dict[str, Any]]:
    """The claim rows of every claims JSON in ``paths`` (a file, or a directory holding ``claims.json``)."""
    rows: list[dict[str, Any]] = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            path = path / "claims.json"
        rows += list(json.loads(path.read_text()).get("claims") or [])
    return rows


def key_points(rows: Sequence[Mapping[str, Any]]) -> list[KeyPoint]:
    """The rows of key claims with a decided interval (a row without a mean and interval is left out); a claim read
    twice on one model (two JSONs) keeps the last."""
    out: dict[tuple[str, str, str, str], KeyPoint] = {}
    for row in rows:
        parts = claim_parts(str(row.get("id") or "")) or claim_parts(str(row.get("test") or ""))
        decision = row.get("decision") or {}
        if parts is None or decision.get("mean") is None or decision.get("low") is None:
            continue
        low, high = float(decision["low"]), float(decision["high"])
        fo = decision.get("float_order") or {}
        if fo.get("low_b") is not None and fo.get("high_b") is not None:  # the union the verdict reads
            low, high = min(low, float(fo["low_b"])), max(high, float(fo["high_b"]))
        scheme, r3, setting = parts
        model = str(row.get("model") or "")
        margin = decision.get("margin")
        out[(model, setting, scheme, r3)] = KeyPoint(model, setting, scheme, r3, float(decision["mean"]), low, high,
                                                     None if margin is None else float(margin),
                                                     str(decision.get("outcome") or ""),
                                                     short_deviation(str(row.get("claim") or "")))
    return list(out.values())


def key_claims_figure(points: Sequence[KeyPoint]) -> Any:
    """The open figure: one panel per (model, setting), schemes on x, one point per R3 (:data:`R3_LABELS`)."""
    plt = pyplot()
    if not points:
        raise ValueError("no key claim with a decided interval among the rows")
    panels = sorted({(p.model, p.setting) for p in points},
                    key=lambda ms: (ms[0], list(keys.SETTINGS).index(ms[1]) if ms[1] in keys.SETTINGS else 9))
    order = [s.tag for s in keys.SCHEMES]
    fig, axes = plt.subplots(len(panels), 1, figsize=(7.5, 2.8 * len(panels)), squeeze=False)
    for ax, (model, setting) in zip(axes[:, 0], panels, strict=True):
        here = [p for p in points if (p.model, p.setting) == (model, setting)]
        schemes = [s for s in order if any(p.scheme == s for p in here)]
        schemes += sorted({p.scheme for p in here} - set(schemes))
        ax.axhline(0.0, color="0.3", ls="--", lw=1, label="per-token + online Hadamard (Δ = 0)")
        marked = False
        for p in here:  # each claim's own +margin (its reference cell's ±0.05 PPL, scaled by that cell's ppl)
            if p.margin is not None:
                x = schemes.index(p.scheme) + OFFSETS.get(p.r3, 0.0)
                ax.hlines(p.margin, x - 0.12, x + 0.12, color="0.4", ls=":", lw=1.5,
                          label=None if marked else "+margin of the claim")
                marked = True
        for r3, label in R3_LABELS.items():
            pts = [p for p in here if p.r3 == r3]
            for p in pts:
                x = schemes.index(p.scheme) + OFFSETS.get(r3, 0.0)
                face = "C0" if r3 == "id" else "C1"
                marker = "X" if p.outcome == "refuted" else MARKERS[r3]
                filled = p.outcome in ("holds", "refuted")
                ax.errorbar([x], [p.mean], yerr=[[p.mean - p.low], [p.high - p.mean]], fmt=marker, color=face,
                            mfc=face if filled else "white", capsize=3, lw=1.2,
                            label=label if p is pts[0] else None)
        ax.set_xticks(range(len(schemes)), schemes)
        ax.set_xlim(-0.6, len(schemes) - 0.4)
        ax.set_ylabel("Δppl vs online Hadamard")
        words = keys.SETTINGS[setting][2] if setting in keys.SETTINGS else setting
        deviations = sorted({p.deviation for p in here if p.deviation})
        ax.set_title(f"{model} · {words}" + "".join(f"\ndeviation: {d}, R1 = identity" if d.startswith("R1 ")
                                                   else f"\ndeviation: {d}" for d in deviations), fontsize=9)
        legend_outside(ax)
    fig.suptitle("Key quantisers against the online Hadamard at equal bits per key element\n"
                 "mean paired Δppl and the verdict's interval (filled: holds, X: refuted, open: undecided)",
                 fontsize=10)
    fig.tight_layout()
    return fig


def plot_key_claims(paths: Iterable[str | os.PathLike[str]], out: str | os.PathLike[str]) -> Path:
    """Read the claims JSONs ``paths`` and write the figure to ``out`` (a PNG); returns its path."""
    fig = key_claims_figure(key_points(read_rows(paths)))
    try:
        return save_png(fig, Path(out))
    finally:
        pyplot().close(fig)

"""The llama.cpp claims' figure: each cell's perplexity in llama.cpp and in the simulator (claims L1–L3,
rope_quant/claims/runtime.py; docs/llamacpp.md).

Reads claims JSONs (the pytest plugin's ``--rq-claims-out=DIR``): the L3 row of each model holds, per cell of L1 and
L2 (no R3 or the best foldable R3 folded, llama.cpp's rotation off or on, q4_0 keys), the per-seed perplexity
llama.cpp gives and the simulator's. One panel per model: a cell per x position, llama.cpp's seeds as dots, the
simulator's as crosses beside them, and the grey band L3's ±tolerance around llama.cpp's mean (the simulator agrees
where its crosses lie inside the band). The panel's title carries L1's, L2's and L3's verdicts from the same rows.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rope_quant.analysis.figures import legend_outside, pyplot, save_png
from rope_quant.analysis.key_claims_figure import read_rows
from rope_quant.claims.runtime import CELLS, L3_TOLERANCE

__all__ = ["CELL_LABELS", "RuntimePanel", "runtime_panels", "llamacpp_figure", "plot_llamacpp"]

CELL_LABELS = {"off": "no R3\nrotation off", "on": "no R3\nrotation on", "fold_off": "foldable R3\nrotation off",
               "fold_on": "foldable R3\nrotation on"}
"""x labels of the cells of :data:`rope_quant.claims.runtime.CELLS`."""


@dataclass(frozen=True)
class RuntimePanel:
    """One model's L3 numbers: cell → (llama.cpp's per-seed ppl, the simulator's), the claims' verdicts and the
    best foldable R3 the claims resolved to on it."""

    model: str
    runtime: Mapping[str, Sequence[float]]
    simulated: Mapping[str, Sequence[float]]
    verdicts: Mapping[str, str]
    fold: str = ""


def _cell_of(part_name: str) -> str | None:
    """The cell a part of L3 compares (its name reads ``ppl_sim(<cell>) ≡ …``)."""
    for cell in CELLS:
        if part_name.startswith(f"ppl_sim({cell})"):
            return cell
    return None


def runtime_panels(rows: Sequence[Mapping[str, Any]]) -> list[RuntimePanel]:
    """One panel per model with an L3 row holding numbers; L1's, L2's and L3's outcomes from the rows of that
    model (a claim read twice keeps the last)."""
    by_model: dict[str, dict[str, Mapping[str, Any]]] = {}
    for row in rows:
        by_model.setdefault(str(row.get("model") or ""), {})[str(row.get("id") or "")] = row
    panels = []
    for model, claims in sorted(by_model.items()):
        l3 = claims.get("L3")
        if l3 is None or not l3.get("numbers"):
            continue
        runtime: dict[str, list[float]] = {}
        simulated: dict[str, list[float]] = {}
        for part, numbers in l3["numbers"].items():
            cell = _cell_of(part)
            if cell is not None:
                simulated[cell] = [float(v) for v in numbers["treatment"]]
                runtime[cell] = [float(v) for v in numbers["control"]]
        verdicts: dict[str, str] = {cid: str((claims[cid].get("decision") or {}).get("outcome") or "")
                                     for cid in ("L1", "L2", "L3", "L1-sim", "L2-sim") if cid in claims}
        fold = re.search(r"best foldable R3: r3=([A-Za-z0-9_]+)", str(l3.get("claim") or ""))
        panels.append(RuntimePanel(model, runtime, simulated, verdicts, fold[1] if fold else ""))
    return panels


def llamacpp_figure(panels: Sequence[RuntimePanel]) -> Any:
    """The open figure, one panel per model (:func:`runtime_panels`)."""
    plt = pyplot()
    if not panels:
        raise ValueError("no L3 row with numbers among the rows: run the llamacpp claims with --rq-claims-out")
    fig, axes = plt.subplots(len(panels), 1, figsize=(7.5, 3.2 * len(panels)), squeeze=False)
    for ax, panel in zip(axes[:, 0], panels, strict=True):
        cells = [c for c in CELLS if c in panel.runtime]
        for x, cell in enumerate(cells):
            rt, sim = panel.runtime[cell], panel.simulated[cell]
            mean = sum(rt) / len(rt)
            ax.fill_between([x - 0.3, x + 0.3], mean * (1 - L3_TOLERANCE), mean * (1 + L3_TOLERANCE), color="0.85",
                            label=f"llama.cpp's mean ± {L3_TOLERANCE:.0%} (L3's margin)" if x == 0 else None)
            ax.plot([x - 0.1] * len(rt), rt, "o", color="C0", label="llama.cpp" if x == 0 else None)
            ax.plot([x + 0.1] * len(sim), sim, "x", color="C1", ms=8, label="simulator" if x == 0 else None)
        ax.set_xticks(range(len(cells)), [CELL_LABELS[c] for c in cells], fontsize=8)
        ax.set_xlim(-0.6, len(cells) - 0.4)
        ax.set_ylabel("perplexity (q4_0 keys)")
        verdicts = ", ".join(f"{cid} {out}" for cid, out in panel.verdicts.items())
        fold = f" (foldable R3: {panel.fold})" if panel.fold else ""
        ax.set_title(f"{panel.model}{fold}\n{verdicts}", fontsize=9)
        legend_outside(ax)
    fig.suptitle("llama.cpp against the simulator, KV-only with q4_0 keys, one marker per seed", fontsize=10)
    fig.tight_layout()
    return fig


def plot_llamacpp(paths: Iterable[str | os.PathLike[str]], out: str | os.PathLike[str]) -> Path:
    """Read the claims JSONs ``paths`` (files, or directories holding ``claims.json``) and write the figure to
    ``out`` (a PNG); returns its path."""
    fig = llamacpp_figure(runtime_panels(read_rows(paths)))
    try:
        return save_png(fig, Path(out))
    finally:
        pyplot().close(fig)

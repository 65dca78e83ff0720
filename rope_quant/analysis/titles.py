"""What every figure's title says about the run behind it: model, bits, weight mode, budget (a figure read
alone must say what it shows).

:func:`describe` reads ``DIR/manifest.json`` and the complete cell records (JSON only: no torch) and gives a
:class:`Setup`, e.g. ``smollm2-135m · W4A4KV4 · GPTQ weights · 3 seeds × 8 windows × L=512``. A manifest dict
may hold the nested ``RunConfig`` form or the flat form of older results directories; a cell kind that wraps a
run keeps it under ``"run"``. Settings that differ between cells are joined with ``/``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: Bit widths at or above this are unquantised (the CLI's "off").
OFF_BITS = 16


@dataclass(frozen=True)
class Setup:
    """The settings a figure title names (each a display string; ``""`` when the manifest does not say)."""

    model: str = ""
    bits: str = ""
    weights: str = ""
    seeds: int = 0
    windows: str = ""
    lengths: str = ""
    unit: str = "windows"

    def budget(self) -> str:
        """``seeds × windows × L``, e.g. ``3 seeds × 8 windows × L=512`` (NIAH: probes per length and depth)."""
        parts = [f"{self.seeds} seed{'s' if self.seeds != 1 else ''}" if self.seeds else "",
                 f"{self.windows} {self.unit}" if self.windows else "", f"L={self.lengths}" if self.lengths else ""]
        return " × ".join(p for p in parts if p)

    def title(self) -> str:
        """One line: model · bits · weight mode · budget."""
        return " · ".join(p for p in (self.model, self.bits, self.weights, self.budget()) if p)


def _run_dict(config: Mapping[str, Any]) -> Mapping[str, Any]:
    run = config.get("run", config)
    return run if isinstance(run, Mapping) else {}


def _get(run: Mapping[str, Any], nested: Sequence[str], flat: str) -> Any:
    """A setting from the nested RunConfig dict (path ``nested``) or the flat form (``flat``)."""
    node: Any = run
    for part in nested:
        if not isinstance(node, Mapping) or part not in node:
            return run.get(flat)
        node = node[part]
    return node


def _joined(values: Iterable[Any]) -> str:
    return "/".join(str(v) for v in dict.fromkeys(v for v in values if v is not None and v != ""))


def _bits(run: Mapping[str, Any]) -> str:
    w, a, k, v = (_get(run, ("quant", q, "bits"), f"{q}_bits") for q in ("w", "a", "k", "v"))
    if None in (w, a, k, v):
        return ""
    kv = f"KV{k}" if k == v else f"K{k}V{v}"
    return f"W{w}A{a}{kv}"


def _weights(run: Mapping[str, Any]) -> str:
    w = _get(run, ("quant", "w", "bits"), "w_bits")
    mode = _get(run, ("quant", "w", "mode"), "weights")
    if w is not None and int(w) >= OFF_BITS:
        return "unquantised weights"
    return f"{str(mode).upper()} weights" if mode else ""


def setup_from(cells: Sequence[Mapping[str, Any]], records: Sequence[Mapping[str, Any]] = ()) -> Setup:
    """The :class:`Setup` of manifest cell entries (``{"seed", "config", ...}``) and their complete records.

    ``windows``: the scored windows the records report (``n_windows``, per length for long-context cells),
    else the runs' ``eval_windows``, else ``all``; ``lengths``: a long-context cell's lengths, else the runs'
    ``seqlen``.
    """
    runs = [_run_dict(c.get("config") or {}) for c in cells]
    lengths = [tuple(c["config"]["lengths"]) for c in cells if isinstance((c.get("config") or {}).get("lengths"), list)]
    # a wrapping kind's own settings sit beside "run" under its tag (static, NIAH, a plug-in's): whatever lengths
    # or probes a kind declares there, the title shows, without naming the kind
    own = [v for c in cells for k, v in (c.get("config") or {}).items() if k != "run" and isinstance(v, Mapping)]
    lengths += [tuple(v["lengths"]) for v in own if isinstance(v.get("lengths"), list)]
    probes = [v.get("probes") for v in own if v.get("probes") is not None]
    length_text = ",".join(str(v) for v in sorted({v for ls in lengths for v in ls}))
    if length_text and "," in length_text:
        length_text = "{" + length_text + "}"
    windows = []
    for rec in records:
        result = rec.get("result") or {}
        if isinstance(result.get("n_windows"), int):
            windows.append(result["n_windows"])
        for entry in (result.get("lengths") or {}).values():
            if isinstance(entry, Mapping) and isinstance(entry.get("n_windows"), int):
                windows.append(entry["n_windows"])
    if probes:
        window_text = _joined(probes)
    elif windows:
        lo, hi = min(windows), max(windows)
        window_text = str(lo) if lo == hi else f"{lo}–{hi}"
    else:
        wanted = [_get(r, ("budget", "eval_windows"), "eval_windows") for r in runs]
        window_text = _joined(wanted) if wanted and None not in wanted else ("all" if runs else "")
    return Setup(model=_joined(_get(r, ("model",), "model") for r in runs),
                 bits=_joined(_bits(r) for r in runs), weights=_joined(_weights(r) for r in runs),
                 seeds=len({r.get("seed") for r in records} if records else {c.get("seed") for c in cells}),
                 windows=window_text, unit="probes per depth" if probes else "windows",
                 lengths=length_text or _joined(_get(r, ("budget", "seqlen"), "seqlen") for r in runs))


def describe(results_dir: str | os.PathLike[str], names: Sequence[str] | None = None) -> Setup:
    """The :class:`Setup` of a results directory (of the cells called ``names``, default: every cell)."""
    from rope_quant.sweep.manifest import read_manifest
    from rope_quant.sweep.records import complete_records

    cells = [c for c in read_manifest(results_dir)["cells"] if names is None or c["name"] in names]
    keys = {c["key"] for c in cells}
    records = [r for r in complete_records(results_dir) if r.get("key") in keys]
    return setup_from(cells, records)


def calibration_setup(results_dir: str | os.PathLike[str], name: str, seed: int) -> Setup:
    """The :class:`Setup` of one cell's calibration statistics: its model, bits and weights, and the calibration
    budget (1 seed × ``calib_windows`` windows × L = ``seqlen``)."""
    from rope_quant.sweep.manifest import read_manifest

    cells = [c for c in read_manifest(results_dir)["cells"] if c["name"] == name and c["seed"] == seed]
    runs = [_run_dict(c.get("config") or {}) for c in cells]
    base = setup_from(cells)
    return dataclasses.replace(base, seeds=1, unit="calibration windows",
                               windows=_joined(_get(r, ("budget", "calib_windows"), "calib_windows") for r in runs),
                               lengths=_joined(_get(r, ("budget", "seqlen"), "seqlen") for r in runs))

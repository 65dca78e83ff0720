"""Scale benchmark, CPU: the whole pipeline on paper shapes cut to 1 layer at full width
(:mod:`tests.numerics.scale_pipeline_probe`, a subprocess at 1 thread). Prints measured against target, never
asserted on time:

* ``targets``: the 0.2.0 targets' 1-layer Llama-3-8B probe at their settings (vocab 128256, 4 × 512 calibration,
  whip 10 epochs, RTN, pairwise_only, one eval window; bf16 storage: fp32 would pass this machine's 8 GiB per
  process): peak RSS over the model at its storage dtype (target ≤ 1.5×; 3.7× at fp32 when it was set), the
  rotate step (whip fit + offline rotation) against the targets' 642 s (target ≥ 5× faster), and the plan's error
  per stage.
* ``fit LOG ...``: the plan_costs time constants refitted from logged probe records at this machine's rates.
* ``rows LOG ...``: the tables of logged probe records against the plan of the code now.
* ``table [SHAPE ...]``: the ``slow`` cases of ``tests/numerics/test_scale_pipeline.py`` as the Markdown rows of
  docs/paper_scale.md (memory, then time per stage: wall / CPU (plan) seconds and CPU/plan).

    PYTHONPATH=$PWD python tests/bench/bench_scale.py targets
    PYTHONPATH=$PWD python tests/bench/bench_scale.py table llama-2-7b mistral-7b
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rope_quant.planning import plan_costs  # noqa: E402
from tests.numerics.scale_pipeline_probe import (  # noqa: E402
    GIB,
    SLOW_CASES,
    memory_row,
    plan_for,
    run_probe,
    stage_report,
    time_row,
)

BASELINE_ROTATE_S = 642.0  # the targets' rotate step (whip fit 332 s + float64 algebra), 1 thread, fp32


def targets() -> str:
    r = run_probe("llama-3-8b", 1, 128256, 4, 512, "bfloat16", "rtn", configs="pairwise_only", whip_epochs=10)
    rotate = r["stage_s"]["whip R1"] + r["stage_s"]["offline rotation"]
    rotate_cpu = r["stage_cpu_s"]["whip R1"] + r["stage_cpu_s"]["offline rotation"]
    return "\n".join([
        stage_report(r),
        f"target peak RSS <= 1.5x the model: {r['peak_rss'] / GIB:.2f} GiB / {r['model_bytes'] / GIB:.2f} GiB "
        f"= {r['peak_rss'] / r['model_bytes']:.2f}x (before: 3.7x at fp32)",
        f"target rotate step >= 5x faster than {BASELINE_ROTATE_S:.0f} s: {rotate:.0f} s wall ({rotate_cpu:.0f} s CPU, "
        f"{r['whip_steps']} whip steps) = {BASELINE_ROTATE_S / rotate:.2f}x faster "
        f"({BASELINE_ROTATE_S / rotate_cpu:.2f}x on CPU time)",
        f"rotated vs original: max relative logit error {r['rel_logit_err']:.1e}",
        json.dumps(r),
    ])


def table(names: list[str]) -> str:
    cases = [c for c in SLOW_CASES if not names or c[0] in names]
    return _tables([run_probe(*c) for c in cases])


def _records(paths: list[str]) -> list[dict]:
    """The probe records (JSON lines) of ``targets`` / ``table`` logs."""
    return [json.loads(line) for p in paths for line in Path(p).read_text().splitlines() if line.startswith("{")]


def _plan(r: dict) -> Any:
    """The plan of the code now for the settings of probe record ``r``."""
    return plan_for(r["shape"], r["layers"], r["vocab"], r["calib_windows"], r["seqlen"], len(r["configs"]),
                    r["dtype"], r["weights"], r["whip_epochs"])


def rows(paths: list[str]) -> str:
    """The tables of logged probe records, against the plan of the code now (after a refit of plan_costs: the
    measurements stand, the predictions are recomputed)."""
    runs = _records(paths)
    for r in runs:
        pl = _plan(r)
        r["plan"] = {s.name: {"host": s.host_bytes, "s": s.seconds} for s in pl.stages}
        r["plan_peak_host"] = pl.peak_host
    return "\n\n".join([_tables(runs, records=False)] + [stage_report(r) for r in runs])


def _tables(runs: list[dict], records: bool = True) -> str:
    head = ["| shape | params | storage, weights | peak RSS GiB | model GiB | RSS/model | plan GiB | RSS/plan | "
            "rel. logit err (rotated fp) |", "|---|---|---|---|---|---|---|---|---|"]
    head += [memory_row(r) for r in runs]
    head += ["", "| shape | load | whip R1 | offline rotation | GPTQ | calibration | eval (per config) |",
             "|---|---|---|---|---|---|---|"]
    head += [time_row(r) for r in runs]
    return "\n".join(head + ([json.dumps(r) for r in runs] if records else []))


def _unit_plan(r: dict, **constants: float) -> dict[str, float]:
    """The plan's seconds per stage for probe record ``r`` with the plan_costs constants set to ``constants``."""
    with mock.patch.multiple(plan_costs, **constants):
        return {s.name: s.seconds for s in _plan(r).stages}


def fit(paths: list[str]) -> str:
    """Refit the plan's CPU time constants (plan_costs) from probe records (the JSON lines of ``targets`` /
    ``table`` logs), at this machine's measured rates: each overhead is the median of measured CPU seconds over
    the plan's seconds at overhead 1; the whip's per-step and fixed costs by least squares."""
    import numpy as np

    recs = _records(paths)
    unit = dict(WHIP_STEP_MATMULS=0.0, WHIP_STEP_MATMULS_ANALYTIC=0.0, WHIP_FIXED_MATMULS=0.0, ROTATION_OVERHEAD=1.0,
                GPTQ_OVERHEAD=1.0, CPU_QUANT_FORWARD_OVERHEAD=dict.fromkeys(("float32", "bfloat16", "float16"), 1.0))
    design: list[list[float]] = []
    rhs: list[float] = []
    ratios: dict[str, list[float]] = {}
    for r in recs:
        base = _unit_plan(r, **unit)
        step = _unit_plan(r, **{**unit, "WHIP_STEP_MATMULS": 1.0, "WHIP_STEP_MATMULS_ANALYTIC": 1.0})["whip R1"]
        fixed = _unit_plan(r, **{**unit, "WHIP_FIXED_MATMULS": 1.0})["whip R1"]
        design.append([step - base["whip R1"], fixed - base["whip R1"]])
        rhs.append(r["stage_cpu_s"]["whip R1"] - base["whip R1"])
        for name in ("offline rotation", "GPTQ", "calibration", "evaluation (per config)"):
            if name in base and name in r["stage_cpu_s"]:
                key = f"{name}, {r['dtype']}" if name in ("calibration", "evaluation (per config)") else name
                ratios.setdefault(key, []).append(r["stage_cpu_s"][name] / base[name])
    (s_step, s_fixed), *_ = np.linalg.lstsq(np.array(design), np.array(rhs), rcond=None)
    out = [f"{len(recs)} probe records; rates: {plan_costs.cpu_device().basis}",
           f"whip: {s_step:.1f} n³ products per step (analytic above 1024 here), {s_fixed:.1f} fixed float64 products"]
    out += [f"{name}: measured / plan at overhead 1 = {', '.join(f'{v:.2f}' for v in vals)} -> median "
            f"{float(np.median(vals)):.2f}" for name, vals in ratios.items() if vals]
    return "\n".join(out)


if __name__ == "__main__":
    args = sys.argv[1:] or ["targets"]
    commands = {"targets": lambda: targets(), "table": lambda: table(args[1:]), "fit": lambda: fit(args[1:]),
                "rows": lambda: rows(args[1:])}
    print(commands[args[0]]())

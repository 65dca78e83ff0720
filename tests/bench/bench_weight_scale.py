"""Weight-scale search benchmark: perplexity of each scale-search candidate against today's default, paired.

Every cell is weights-only GPTQ (A16, KV16: no activation or K/V quantiser, no R3), act_order, damping 0.01,
``--calib`` × 512 ``pydoc`` calibration windows drawn with the seed, ``--eval`` × 512 evaluation windows, fp32,
the project's loader. A *setting* is (model, rotation, bits, group size); within a setting and a seed every
candidate sees the same calibration windows and the same rotated model (paired design), so the paired
difference ``ppl(candidate) - ppl(default)`` (``default``: the search of 0.1.0, :data:`REFERENCE`) over the
seeds gets a Student-t 90% interval.

Rotations: ``none`` (R1 = R2 = identity, no R4) and ``rh`` (seeded random Hadamards: R1, R2 and the online R4
where the architecture allows them; Gemma 3 refuses R1, so its ``rh`` is R2 + R4).

Reuse: the base model is loaded once per model, each (rotation, seed)'s rotated model once, and every
candidate quantises a copy of it. GPTQ itself cannot share Hessians between candidates: from layer 1 on each
layer's inputs pass through the candidate's own quantised layers (true-sequential protocol).

Results go to ``--out`` (JSON, rewritten atomically after every cell) and a rerun skips the cells it holds,
so a cut-off run loses at most the cell in progress::

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python tests/bench/bench_weight_scale.py run --out ws.json \\
        --settings smollm2:none:4:-1 smollm2:rh:4:-1 --seeds 0 1 2 --candidates default llmc proxy
    PYTHONPATH=$PWD python tests/bench/bench_weight_scale.py report --out ws.json
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from rope_quant.io import atomic_write_json  # noqa: E402
from rope_quant.quant.rtn import GPTQConfig, ScaleObjective  # noqa: E402

#: The reference every candidate is paired with: the scale search of 0.1.0 (the weights' own L2 error, ratios
#: 1 .. 0.2, max|w|/7), spelled out so that a change of GPTQConfig's defaults never changes what it measures.
REFERENCE: dict[str, Any] = {"mse": True, "grid": 100, "max_shrink": 0.8, "p_norm": 2.0,
                             "objective": ScaleObjective.WEIGHT, "full_range": False}
#: The candidates: changes to the reference (act_order, percdamp 0.01, per channel or g128 in every cell).
CANDIDATES: dict[str, dict[str, Any]] = {
    "default": {},                                                     # the reference itself
    "off": {"mse": False},                                             # no search: max|w|/7
    "p2.4": {"p_norm": 2.4},
    "shrink0.8": {"max_shrink": 0.2},                                  # ratios 1 .. 0.8
    "half": {"full_range": True},                                      # base max|w|/7.5, search as today
    "half_off": {"mse": False, "full_range": True},                    # max|w|/7.5, no search
    "llmc": {"p_norm": 2.4, "max_shrink": 0.2, "full_range": True},      # llm-compressor's observer settings
    "proxy": {"objective": ScaleObjective.HESSIAN_DIAG},               # GPTQ's proxy loss, H's diagonal
    "proxy0.8": {"objective": ScaleObjective.HESSIAN_DIAG, "max_shrink": 0.2, "full_range": True},
}
MODELS = {"smollm2": "smollm2-135m", "gemma": "gemma3-270m"}
SEQLEN = 512


def gptq_config(candidate: str, group_size: int) -> GPTQConfig:
    """The candidate's GPTQConfig at the protocol's settings."""
    return GPTQConfig(percdamp=0.01, act_order=True, group_size=group_size, **{**REFERENCE, **CANDIDATES[candidate]})


def _rotate(base: torch.nn.Module, model_key: str, rotation: str, seed: int) -> torch.nn.Module:
    from rope_quant.rotations.offline import RotationConfig, rotate_model

    model = copy.deepcopy(base)
    if rotation == "none":
        return model
    r1 = "identity" if model_key == "gemma" else "random_hadamard"  # Gemma 3's sandwich norms refuse R1
    rotate_model(model, RotationConfig(r1=r1, r2="random_hadamard", r4=True, seed=seed))
    return model


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _cell_id(setting: str, seed: int, candidate: str) -> str:
    return f"{setting}|{seed}|{candidate}"


def run(args: argparse.Namespace) -> None:
    """Measure the cells not yet in ``args.out`` (setting-major, then seed, then candidate)."""
    from rope_quant.corpora import token_streams
    from rope_quant.model.loading import load_model
    from rope_quant.quant import gptq
    from rope_quant.scoring import evaluate

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    doc: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {"cells": {}}
    doc["meta"] = {"machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
                   "threads": args.threads, "torch": torch.__version__, "commit": _commit(),
                   "calib_windows": args.calib, "eval_windows": args.eval, "seqlen": SEQLEN}
    bases: dict[str, tuple[Any, Any, Any]] = {}
    for setting in args.settings:
        model_key, rotation, bits_s, group_s = setting.split(":")
        bits, group = int(bits_s), int(group_s)
        for seed in args.seeds:
            todo = [c for c in args.candidates if _cell_id(setting, seed, c) not in doc["cells"]]
            if not todo:
                continue
            if model_key not in bases:
                bases.clear()  # one base model in memory at a time
                t = time.perf_counter()
                model, tok = load_model(MODELS[model_key], dtype=torch.float32)
                bases[model_key] = (model, tok, token_streams.load_corpus("pydoc", tok))
                print(f"loaded {model_key} in {time.perf_counter() - t:.1f} s", flush=True)
            base, _tok, corpus = bases[model_key]
            calib = token_streams.calibration_windows(corpus, args.calib, SEQLEN, seed)
            t = time.perf_counter()
            rotated = _rotate(base, model_key, rotation, seed)
            rot_s = time.perf_counter() - t
            for cand in todo:
                t0 = time.perf_counter()
                model = copy.deepcopy(rotated)
                errors = gptq.quantize_model_gptq(model, calib, bits, gptq_config(cand, group), progress=False)
                t1 = time.perf_counter()
                res = evaluate.perplexity(model, corpus.eval_ids, SEQLEN, max_windows=args.eval, progress=False)
                t2 = time.perf_counter()
                del model
                doc["cells"][_cell_id(setting, seed, cand)] = {
                    "setting": setting, "seed": seed, "candidate": cand, "ppl": res.ppl, "nll": res.nll,
                    "n_windows": res.n_windows, "gptq_s": t1 - t0, "eval_s": t2 - t1, "rotate_s": rot_s,
                    "proxy_error_mean": sum(errors.values()) / max(len(errors), 1),
                    "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
                atomic_write_json(out, doc)
                print(f"{setting} seed {seed} {cand}: ppl {res.ppl:.4f} (gptq {t1 - t0:.0f} s, eval {t2 - t1:.0f} s)",
                      flush=True)
            del rotated


def _t_interval(diffs: list[float], level: float = 0.90) -> tuple[float, float, float]:
    """Mean of the paired differences and its two-sided Student-t interval (nan width for one pair)."""
    from scipy import stats

    n = len(diffs)
    mean = sum(diffs) / n
    if n < 2:
        return mean, math.nan, math.nan
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    half = stats.t.ppf(0.5 + level / 2, n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def report(args: argparse.Namespace) -> None:
    """Markdown table: per setting and candidate, the mean perplexity and the paired difference to ``default``
    (cells of several result files merged, e.g. from runs in parallel processes, each with its own file)."""
    docs = [json.loads(Path(o).read_text()) for o in args.out]
    doc = {"meta": docs[-1].get("meta", {}), "cells": {k: v for d in docs for k, v in d["cells"].items()}}
    cells = list(doc["cells"].values())
    settings = list(dict.fromkeys(c["setting"] for c in cells))
    print(f"meta: {json.dumps(doc.get('meta', {}))}")
    print("| setting | candidate | seeds | mean ppl | Δ vs default (90% t interval) |")
    print("|---|---|---|---|---|")
    for s in settings:
        here = [c for c in cells if c["setting"] == s]
        ref = {c["seed"]: c["ppl"] for c in here if c["candidate"] == "default"}
        for cand in list(dict.fromkeys(c["candidate"] for c in here)):
            mine = {c["seed"]: c["ppl"] for c in here if c["candidate"] == cand}
            mean_ppl = sum(mine.values()) / len(mine)
            seeds = sorted(set(mine) & set(ref))
            if cand == "default" or not seeds:
                delta = "–"
            else:
                m, lo, hi = _t_interval([mine[k] - ref[k] for k in seeds])
                delta = f"{m:+.3f} ({lo:+.3f}, {hi:+.3f})" if len(seeds) > 1 else f"{m:+.3f} (one seed)"
            per = ", ".join(f"{mine[k]:.2f}" for k in sorted(mine))
            print(f"| {s} | {cand} | {len(mine)} | {mean_ppl:.3f} ({per}) | {delta} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--settings", nargs="+", default=["smollm2:none:4:-1"],
                   help=f"model:rotation:bits:group, model in {sorted(MODELS)}, rotation none|rh")
    r.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    r.add_argument("--candidates", nargs="+", default=["default", "llmc", "proxy"], choices=sorted(CANDIDATES))
    r.add_argument("--calib", type=int, default=16)
    r.add_argument("--eval", type=int, default=12)
    r.add_argument("--threads", type=int, default=1)
    p = sub.add_parser("report")
    p.add_argument("--out", required=True, nargs="+", help="one or more result files (cells merged)")
    args = parser.parse_args(argv)
    for s in getattr(args, "settings", []):
        parts = s.split(":")
        if len(parts) != 4 or parts[0] not in MODELS or parts[1] not in ("none", "rh"):
            parser.error(f"bad setting {s!r}: want model:rotation:bits:group")
    if args.cmd == "run" and "default" not in args.candidates:
        parser.error("the candidates must include 'default' (the paired reference)")
    (run if args.cmd == "run" else report)(args)


if __name__ == "__main__":
    main()

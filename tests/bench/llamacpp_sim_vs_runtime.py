"""The simulator against llama.cpp per K type (docs/llamacpp.md, "The simulator against llama.cpp per K type").

For each K type (``f16``, ``q8_0``, ``q4_0``, ``q4_1``, ``iq4_nl``) and llama.cpp's rotation off and on (f16: off
only, the runtime rotates a quantised cache only): the KV-only cell without R3 (the e2e budget, one seed) scored by
the simulator (:func:`rope_quant.experiment.pipeline.run_cell`, the ggml K format and ``runtime_rotation``) and by
llama.cpp (:func:`rope_quant.runtime.cells.score_cell`), with their relative difference. A measurement, not a
claim (claims L1–L3 decide q4_0 over seeds)::

    PYTHONPATH=. python tests/bench/llamacpp_sim_vs_runtime.py --model smollm2-135m --k-types f16,q8_0,q4_1 \
        --out sim-vs-runtime.json
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from rope_quant.defaults import KEYS_ALONE
from rope_quant.io import atomic_write_json

K_TYPES = ("f16", "q8_0", "q4_0", "q4_1", "iq4_nl")


def cell_config(model: str, k_type: str, rotation: bool, seed: int) -> Any:
    """The KV-only cell at ``k_type`` (f16: keys unquantised) with the runtime rotation on or off, no R3."""
    from rope_quant.experiment.pipeline import RunConfig

    keys: dict[str, Any] = ({"k_bits": 16} if k_type == "f16" else
                            {"k_bits": 8 if k_type == "q8_0" else 4, "k_quant": f"ggml_{k_type}"})
    return RunConfig.from_flat(model=model, corpus="pydoc", seed=seed, seqlen=512, device="cpu", calib_windows=16,
                               eval_windows=12, **{**KEYS_ALONE, **keys}, r3="identity", runtime_rotation=rotation)


def measure(model: str, k_types: list[str], seed: int = 0) -> dict[str, dict[str, float]]:
    """``"<k type> rotation <on|off>"`` → simulated and llama.cpp perplexity, printed as they come."""
    from rope_quant.experiment.pipeline import run_cell
    from rope_quant.runtime.cells import score_cell

    out: dict[str, dict[str, float]] = {}
    for k_type in k_types:
        for rotation in (False, True) if k_type != "f16" else (False,):
            cfg = cell_config(model, k_type, rotation, seed)
            t = time.perf_counter()
            sim, rt = float(run_cell(cfg)["ppl"]), float(score_cell(cfg)["ppl"])
            name = f"{k_type} rotation {'on' if rotation else 'off'}"
            out[name] = {"simulated": sim, "llama.cpp": rt}
            print(f"{name}: simulated {sim:.3f}, llama.cpp {rt:.3f}, relative {(sim - rt) / rt:+.4f} "
                  f"({time.perf_counter() - t:.0f} s)", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--k-types", default=",".join(K_TYPES), help=f"comma-separated, of {', '.join(K_TYPES)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the numbers as JSON (atomically)")
    args = parser.parse_args()
    k_types = [k for k in args.k_types.split(",") if k]
    unknown = sorted(set(k_types) - set(K_TYPES))
    if unknown:
        parser.error(f"unknown K types {unknown}: choose from {', '.join(K_TYPES)}")
    numbers = measure(args.model, k_types, args.seed)
    if args.out:
        atomic_write_json(args.out, {"model": args.model, "seed": args.seed, "cells": numbers})


if __name__ == "__main__":
    main()

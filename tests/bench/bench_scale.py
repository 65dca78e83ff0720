"""Scale benchmark (issue 21), CPU: the 1-layer Llama-3-8B probe (hidden 4096, GQA 32/8, vocab 128256) with a
whip-fitted R1, R2 and R4, in a subprocess at 1 thread. Prints peak RSS over the model at its storage dtype
(target ≤ 1.5×; the issue measured 3.7× before), the whip and rotate times, and the plan's error on each —
measured against the targets, never asserted on time.

    PYTHONPATH=$PWD python tests/bench/bench_scale.py [DTYPE] [WINDOWS]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = ROOT / "tests" / "numerics" / "scale_probe.py"


def probe(shape: str = "llama-3-8b", layers: int = 1, vocab: int = 128256, windows: int = 4, seqlen: int = 512,
          r1: str = "whip", dtype: str = "bfloat16") -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(PROBE), shape, str(layers), str(vocab), str(windows), str(seqlen),
                          r1, dtype], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(r: dict) -> str:
    gib = 2 ** 30
    return "\n".join([
        f"{r['shape']} x{r['layers']} layer(s), vocab {r['vocab']}, {r['params'] / 1e9:.2f}B params, {r['dtype']}, "
        f"{r['threads']} thread(s), R1={r['r1']} ({r['whip_steps']} whip steps)",
        f"peak RSS {r['peak_rss'] / gib:.2f} GiB = {r['peak_rss'] / r['model_bytes']:.2f}x the model "
        f"({r['model_bytes'] / gib:.2f} GiB; target <= 1.5x, issue before: 3.7x at fp32)",
        f"plan peak host {r['plan_peak_host'] / gib:.2f} GiB: measured/plan {r['peak_rss'] / r['plan_peak_host']:.2f}",
        f"whip {r['whip_s']:.1f} s (plan {r['plan_whip_s']:.1f} s, measured/plan {r['whip_s'] / r['plan_whip_s']:.2f})",
        f"rotate {r['rotate_s']:.1f} s (plan {r['plan_rotate_s']:.1f} s, "
        f"measured/plan {r['rotate_s'] / r['plan_rotate_s']:.2f}); issue before: 642 s incl. a 10-step whip fit",
        f"rotated-vs-original max relative logit error {r['rel_logit_err']:.2e}",
    ])


if __name__ == "__main__":
    args = sys.argv[1:]
    print(report(probe(dtype=args[0] if args else "bfloat16", windows=int(args[1]) if len(args) > 1 else 4)))

"""Scale probe, run as a subprocess so its peak RSS is its own: a paper-scale shape cut to a few layers
at full width, whip R1 + R2 + R4 applied with :func:`rope_quant.rotations.offline.rotate_model`.

``python scale_probe.py SHAPE LAYERS VOCAB WINDOWS SEQLEN R1`` [DTYPE] (R1: ``whip`` or ``random_hadamard``)
prints one JSON line: the parameter count, the
stage times, the peak RSS, the max relative logit error of the rotated model against the original, and the
plan's predictions for the same settings.
"""

from __future__ import annotations

import json
import resource
import sys
import time

import torch


def main(shape: str, layers: int, vocab: int, windows: int, seqlen: int, r1: str = "whip",
         dtype: str = "float32") -> dict:
    from rope_quant.model import shapes
    from rope_quant.planning import plan as planning
    from rope_quant.rotations import offline

    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    model = shapes.build(shape, layers=layers, vocab=vocab, seed=0, dtype=getattr(torch, dtype))
    t_build = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (windows, seqlen), generator=gen)
    probe = ids[:1, :32]
    with torch.no_grad():
        ref = model(input_ids=probe).logits
    t0 = time.perf_counter()
    cfg = offline.RotationConfig(r1=r1, r2="random_hadamard", r4=True, seed=0)
    tokens = min(64, seqlen)
    r1_matrix, steps = None, 0
    if r1 == "whip":
        from rope_quant.rotations import whip, whip_model

        fitted = whip_model.calibrate_model_rotations(model, ids, fit_r1=True, fit_r2=False, seed=0,
                                                      r1=whip.WhipConfig(epochs=1, batch_size=64, lr=1e-3),
                                                      tokens_per_sample=tokens)
        r1_matrix, steps = fitted.r1, fitted.r1_result.n_steps
    t_whip = time.perf_counter() - t0
    t0 = time.perf_counter()
    offline.rotate_model(model, cfg, r1_matrix=r1_matrix)
    t_rot = time.perf_counter() - t0
    with torch.no_grad():
        out = model(input_ids=probe).logits
    rel = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    mc = planning.model_cost(model, shape)
    pl = planning.make_plan(mc, "cpu", dtype, planning.Protocol(
        calib_windows=windows, seqlen=seqlen, whip_epochs=1, whip_subset=1.0, configs=1, seeds=1,
        tokens_per_sample=tokens))
    pred = {s.name: {"host": s.host_bytes, "s": s.seconds} for s in pl.stages}
    return {"shape": shape, "layers": layers, "vocab": vocab, "params": mc.params, "build_s": t_build,
            "whip_s": t_whip, "rotate_s": t_rot, "peak_rss": peak, "start_rss": base_rss, "rel_logit_err": rel,
            "model_bytes": mc.params * model.dtype.itemsize, "dtype": dtype, "whip_steps": steps, "r1": r1,
            "plan_peak_host": max(pred[n]["host"] for n in ("load", "whip R1", "offline rotation")),
            "plan_whip_s": pred["whip R1"]["s"], "plan_rotate_s": pred["offline rotation"]["s"],
            "threads": torch.get_num_threads()}


if __name__ == "__main__":
    a = sys.argv[1:]
    print(json.dumps(main(a[0], int(a[1]), int(a[2]), int(a[3]), int(a[4]), *a[5:])))

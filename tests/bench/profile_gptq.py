"""Profile one seed of the GPTQ pipeline on the embedded model (not a test: run as a script).

    OMP_NUM_THREADS=1 PYTHONPATH=. python tests/bench/profile_gptq.py [--threads N] [--eval-windows 12]

Builds the W4A4KV4 GPTQ model of RunConfig defaults with seqlen=512, calib_windows=16 (as tests/e2e do),
then evaluates two R3 cells (identity, pairwise φ̂) on the built model, under cProfile. Prints the wall time
per pipeline stage (``qm.timing``) and the cumulative time of the functions that make up each stage.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
import time

import torch

STAGE_FUNCS = [
    ("rotation (rotate_model)", "offline.py", "rotate_model"),
    ("GPTQ driver (quantize_model_gptq)", "gptq.py", "quantize_model_gptq"),
    ("  capture layer-0 inputs", "gptq.py", "capture_layer_inputs"),
    ("  Hessian accumulation (pre-hooks)", "gptq.py", "add"),
    ("  per-linear GPTQ solve (gptq_quantize)", "gptq.py", "gptq_quantize"),
    ("    scales / MSE clip search", "rtn.py", "_group_scales"),
    ("    inverse-Hessian Cholesky", "gptq.py", "_inverse_hessian_factor"),
    ("    quantise (quantize_with_scales)", "rtn.py", "quantize_with_scales"),
    ("  activation fake-quant in hooks", "quantizers.py", "fake_quant"),
    ("  online R4 Hadamard (fwht)", "hadamard.py", "fwht"),
    ("weight cache save", "weight_cache.py", "save_weights"),
    ("calibration pass (_calibrate)", "pipeline.py", "_calibrate"),
    ("  CalibrationStats.update", "calib/stats.py", "update"),
    ("angles (_estimate_angles)", "pipeline.py", "_estimate_angles"),
    ("evaluation (evaluate.perplexity)", "evaluate.py", "perplexity"),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--eval-windows", type=int, default=12)
    ap.add_argument("--calib-windows", type=int, default=16, help="GPTQ/calibration windows of 512 tokens")
    ap.add_argument("--out", default=None, help="write the raw pstats here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from rope_quant.corpora import token_streams
    from rope_quant.experiment.pipeline import RunConfig, build_quantized_model, run_cell
    from rope_quant.model.loading import load_model

    t = time.perf_counter()
    base = load_model("smollm2-135m", device="cpu")
    cfg = RunConfig.from_flat(seed=0, seqlen=512, calib_windows=args.calib_windows, eval_windows=args.eval_windows)
    corpus = token_streams.load_corpus(cfg.corpus, base[1])
    print(f"load {time.perf_counter() - t:.1f} s; weight key {cfg.weight_key()}; threads {torch.get_num_threads()}")
    prof = cProfile.Profile()
    with tempfile.TemporaryDirectory() as cache:
        prof.enable()
        t0 = time.perf_counter()
        qm = build_quantized_model(cfg, cache_dir=cache, base=base, corpus=corpus)
        build_s = time.perf_counter() - t0
        cells = {}
        for name, over in (("identity", dict(r3="identity")), ("pairwise_only", dict(r3="pairwise_only"))):
            c = cfg.override(**over)
            t1 = time.perf_counter()
            qm.reconfigure(c)
            res = run_cell(c, qm=qm)
            cells[name] = (time.perf_counter() - t1, res["ppl"])
        prof.disable()
    print(f"build {build_s:.1f} s: " + ", ".join(f"{k} {v:.1f}" for k, v in qm.timing.items()))
    for name, (s, ppl) in cells.items():
        print(f"cell {name}: {s:.1f} s (ppl {ppl:.3f}, {args.eval_windows} windows x {cfg.budget.seqlen})")
    st = pstats.Stats(prof)
    table = st.stats  # type: ignore[attr-defined]
    print("\nstage                                        cumulative s   calls")
    for label, file, func in STAGE_FUNCS:
        hits = [(v[3], v[1]) for (f, _, fn), v in table.items() if fn == func and f.endswith(file)]
        if hits:
            print(f"{label:44s} {sum(h[0] for h in hits):10.1f} {sum(h[1] for h in hits):8d}")
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    print(s.getvalue())
    if args.out:
        st.dump_stats(args.out)


if __name__ == "__main__":
    main()

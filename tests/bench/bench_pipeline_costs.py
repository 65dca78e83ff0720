"""Pipeline cost ratios on the embedded SmolLM2-135M, each measured side by side in one run (a script, not a test):

    PYTHONPATH=. python tests/bench/bench_pipeline_costs.py [--threads 2] [--only calib,fq,range,cache] [--rounds 3]
        [--angles-out range_angles.npy]

calib: calibration-statistics pass / plain forward (2048 tokens); fq: W4A4KV4 fake-quant forward / plain
(2048 tokens); range: the range-objective fit of every layer (real K samples, 2048 tokens per layer);
cache: weight-cache bytes of one seed (RTN W4 weights: the same coded layout as GPTQ's, without its cost)
against the fp32 state. Timings alternate the two variants round by round and keep each one's best.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from _timing import paired_best

L_FWD = 2048


def forward(model):
    def run(x):
        with torch.inference_mode():
            model.model(input_ids=x, use_cache=False)
    return run


def bench_calib(base, ids, rounds: int = 3) -> dict:
    from rope_quant.calib.stats import CalibrationStats
    from rope_quant.rotations import attention

    model = base[0]
    geom = attention.check_model(model)
    run = forward(model)
    stats = CalibrationStats(geom.n_layers, geom.n_q_heads, geom.n_kv_heads, geom.head_dim, sample_rows=2048)

    def calib():
        with attention.calibration_hooks(model, stats):
            run(ids)
    t_plain, t_cal = paired_best([lambda: run(ids), calib], rounds)
    return {"plain_s": t_plain, "calib_s": t_cal, "ratio": t_cal / t_plain}


def bench_fq(base, corpus, ids, rounds: int = 3) -> dict:
    from rope_quant.experiment.pipeline import RunConfig, build_quantized_model

    cfg = RunConfig.from_flat(w_bits=16, weights="none", a_bits=4, k_bits=4, v_bits=4, seqlen=256, calib_windows=1,
                              r3="identity")
    qm = build_quantized_model(cfg, base=base, corpus=corpus)
    plain, fq = forward(base[0]), forward(qm.model)
    t_plain, t_fq = paired_best([lambda: plain(ids), lambda: fq(ids)], rounds)
    return {"plain_s": t_plain, "fq_s": t_fq, "ratio": t_fq / t_plain}


def bench_range(base, corpus) -> dict:
    from rope_quant.calib.objectives import estimate_angles
    from rope_quant.calib.stats import CalibrationStats
    from rope_quant.experiment import data
    from rope_quant.rotations import attention

    model = base[0]
    geom = attention.check_model(model)
    stats = CalibrationStats(geom.n_layers, geom.n_q_heads, geom.n_kv_heads, geom.head_dim, sample_rows=2048)
    windows = data.calibration_windows(corpus, 4, 512, 0)
    with attention.calibration_hooks(model, stats), torch.no_grad():
        for row in windows:
            model.model(input_ids=row[None], use_cache=False)
    out = {}
    for name, kw in (("pairwise_only", {}), ("pairwise_plus_hadamard", {"then_hadamard": True})):
        t0 = time.perf_counter()
        angles = estimate_angles(stats, "rows", "range", inv_freq=model, **kw)
        out[f"{name}_s"] = time.perf_counter() - t0
        out[f"{name}_angles"] = angles
    return out


def bench_cache(base, corpus) -> dict:
    from rope_quant.experiment.pipeline import RunConfig, build_quantized_model

    cfg = RunConfig.from_flat(weights="rtn", seqlen=256, calib_windows=1, r3="identity")
    with tempfile.TemporaryDirectory() as d:
        qm = build_quantized_model(cfg, cache_dir=d, base=base, corpus=corpus)
        (path,) = Path(d).glob("weights-*.pt")
        size = path.stat().st_size
        fp32 = sum(v.numel() * v.element_size() for v in qm.model.state_dict().values())
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        fp_part = sum(v.numel() * v.element_size() for v in payload["state"].values())
        again = build_quantized_model(cfg, cache_dir=d, base=base, corpus=corpus)
        ids = corpus.eval_ids[:256][None]
        with torch.no_grad():
            same = torch.equal(qm.model(ids).logits, again.model(ids).logits)
    return {"file_mb": size / 1e6, "fp32_state_mb": fp32 / 1e6, "ratio": size / fp32,
            "uncoded_fp_mb": fp_part / 1e6, "coded_mb": (size - fp_part) / 1e6, "logits_equal": same,
            "hit": again.weight_cache_hit}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default="calib,fq,range,cache")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per paired timing (best of)")
    ap.add_argument("--angles-out", default=None, help="with range: save both angle arrays here (.npy)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from rope_quant.experiment import data
    from rope_quant.model.loading import load_model

    base = load_model("smollm2-135m", device="cpu")
    corpus = data.load_corpus("pydoc", base[1])
    ids = corpus.eval_ids[:L_FWD].unsqueeze(0)
    print(f"threads {torch.get_num_threads()}")
    for what in args.only.split(","):
        if what == "calib":
            print("calib", bench_calib(base, ids, args.rounds), flush=True)
        elif what == "fq":
            print("fq", bench_fq(base, corpus, ids, args.rounds), flush=True)
        elif what == "range":
            r = bench_range(base, corpus)
            if args.angles_out:  # compare two code versions' angles with np.array_equal
                np.save(args.angles_out, np.stack([r["pairwise_only_angles"], r["pairwise_plus_hadamard_angles"]]))
            print("range", {k: v for k, v in r.items() if k.endswith("_s")}, flush=True)
        elif what == "cache":
            print("cache", bench_cache(base, corpus), flush=True)


if __name__ == "__main__":
    main()

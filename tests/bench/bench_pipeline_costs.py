"""Pipeline cost ratios on the embedded SmolLM2-135M, each measured side by side in one run (a script, not a test):

    PYTHONPATH=. python tests/bench/bench_pipeline_costs.py [--threads 2] [--only calib,fq,calibstats,range,cache]
        [--rounds 3] [--repeats 3] [--fq-lengths 512,2048] [--r3 hadamard] [--angles-out range_angles.npy]

calib: calibration-statistics pass / plain forward (2048 tokens); fq: W4A4KV4 fake-quant forward / plain, R1-R4
(R3 ``--r3``), decoder stack, inside one deferred-check window under inference mode as the evaluation runs it,
per length of ``--fq-lengths`` (512: the evaluation's windows), ``--repeats`` paired measurements and their
median, then where one fake-quant forward's extra time goes (quantisers, online R4, R3); calibstats: the
calibration statistics of one layer-window at SmolLM2's q/k shape (the real pre-RoPE q/k of 512-token windows),
torch CPU tensors (the path the pipeline takes) / numpy arrays (the host path), per layer-window; range: the
range-objective fit of every layer (real K samples, 2048 tokens per layer); cache: weight-cache bytes of one
seed (RTN W4 weights: the same coded layout as GPTQ's, without its cost) against the fp32 state. Timings
alternate the variants round by round and keep each one's best; ``--repeats`` repeats that and reports the median.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
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


def _deferred_forward(model) -> Callable[[torch.Tensor], None]:
    """The decoder forward as the evaluation runs it: inference mode, one deferred-check window."""
    from rope_quant.quant import deferred

    base = model.model

    def run(x: torch.Tensor) -> None:
        with torch.inference_mode():
            deferred.run_checked(lambda: base(input_ids=x, use_cache=False))
    return run


@contextlib.contextmanager
def _component_timer(model) -> Iterator[Counter]:
    """Seconds spent in the fake quantisers, the online R4 and the R3 transforms while the block runs (wrappers on
    the module functions and the layers' transforms, removed on exit)."""
    from rope_quant.quant import quantizers
    from rope_quant.rotations import attention, online_r4

    spent: Counter = Counter()

    def timed(name: str, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t0
        return wrapper

    saved = [(quantizers, "fake_quant_per_token"), (online_r4, "online_r4")]
    originals = [getattr(mod, name) for mod, name in saved]
    quantizers.fake_quant_per_token = timed("quantisers", originals[0])
    online_r4.online_r4 = timed("R4", originals[1])
    patched = []  # instance attributes shadowing the transforms' methods, deleted on exit
    for st in attention.attention_states(model):
        tr = st.transform
        for name in ("apply", "apply_query", "apply_key"):
            if tr is not None and hasattr(tr, name) and name not in vars(tr):
                setattr(tr, name, timed("R3", getattr(tr, name)))
                patched.append((tr, name))
    try:
        yield spent
    finally:
        for (mod, name), fn in zip(saved, originals, strict=True):
            setattr(mod, name, fn)
        for tr, name in patched:
            delattr(tr, name)


def bench_fq(base, corpus, lengths: tuple[int, ...] = (512, 2048), rounds: int = 3, repeats: int = 3,
             r3: str = "hadamard") -> dict:
    """W4A4KV4 (R1-R4, R3 = ``r3``) decoder forward ÷ the plain one per length: ``repeats`` paired best-of-
    ``rounds`` measurements, their ratios and median, and one fake-quant forward's component seconds."""
    from rope_quant.experiment.pipeline import RunConfig, build_quantized_model

    cfg = RunConfig.from_flat(w_bits=16, weights="none", a_bits=4, k_bits=4, v_bits=4, seqlen=256, calib_windows=1,
                              r3=r3)
    qm = build_quantized_model(cfg, base=base, corpus=corpus)
    plain, fq = _deferred_forward(base[0]), _deferred_forward(qm.model)
    out: dict = {"r3": r3}
    for length in lengths:
        ids = corpus.eval_ids[:length].unsqueeze(0)
        pairs = [paired_best([lambda x=ids: plain(x), lambda x=ids: fq(x)], rounds) for _ in range(repeats)]
        ratios = [f / p for p, f in pairs]
        with _component_timer(qm.model) as spent:
            t0 = time.perf_counter()
            fq(ids)
            total = time.perf_counter() - t0
        out[length] = {"plain_s": [round(p, 4) for p, _ in pairs], "fq_s": [round(f, 4) for _, f in pairs],
                       "ratios": [round(r, 4) for r in ratios], "median_ratio": round(statistics.median(ratios), 4),
                       "one_fq_forward_s": round(total, 4),
                       "components_s": {k: round(v, 4) for k, v in sorted(spent.items())}}
    return out


def _capture_qk(model, windows: torch.Tensor) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """The pre-RoPE (q, k) outputs of every layer for each window, as the calibration hooks receive them."""
    from rope_quant.calib.stats import register_projection_hooks

    seen: list[dict[tuple[int, str], torch.Tensor]] = []

    class Capture:
        def update(self, layer: int, stream: str, x: torch.Tensor) -> None:
            seen[-1][(layer, stream)] = x.detach().clone()

    handles = register_projection_hooks(model, Capture())
    try:
        with torch.no_grad():
            for row in windows:
                seen.append({})
                model.model(input_ids=row[None], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    n_layers = len(seen[0]) // 2
    return [[(w[(layer, "q")], w[(layer, "k")]) for layer in range(n_layers)] for w in seen]


def bench_calibstats(base, corpus, windows: int = 4, seqlen: int = 512, rounds: int = 3, repeats: int = 3) -> dict:
    """The calibration statistics (moments, top-k candidates, the 2048-row K sample) of real pre-RoPE q/k, ms
    per layer-window: torch CPU tensors (the pipeline's path) against numpy arrays (the host path), side by side."""
    from rope_quant.calib.stats import CalibrationStats
    from rope_quant.corpora import token_streams
    from rope_quant.experiment.config import K_SAMPLE_ROWS
    from rope_quant.rotations import attention

    model = base[0]
    geom = attention.check_model(model)
    qk = _capture_qk(model, token_streams.calibration_windows(corpus, windows, seqlen, 0))
    as_numpy = [[(q.numpy(), k.numpy()) for q, k in layers] for layers in qk]

    def run(batches) -> Callable[[], None]:
        def go() -> None:
            stats = CalibrationStats(geom.n_layers, geom.n_q_heads, geom.n_kv_heads, geom.head_dim,
                                     sample_rows=K_SAMPLE_ROWS)
            for layers in batches:
                for layer, (q, k) in enumerate(layers):
                    stats.update(layer, "q", q)
                    stats.update(layer, "k", k)
            stats.finalize()
        return go

    per = len(qk) * geom.n_layers / 1e3  # seconds -> ms per layer-window
    pairs = [paired_best([run(as_numpy), run(qk)], rounds) for _ in range(repeats)]
    ratios = [t / n for n, t in pairs]
    return {"numpy_ms": [round(n / per, 3) for n, _ in pairs], "torch_ms": [round(t / per, 3) for _, t in pairs],
            "ratios": [round(r, 4) for r in ratios], "median_ratio": round(statistics.median(ratios), 4),
            "shape": f"{seqlen} tokens, {geom.n_q_heads} q / {geom.n_kv_heads} kv heads, head_dim {geom.head_dim}"}


def bench_range(base, corpus) -> dict:
    from rope_quant.calib.objectives import estimate_angles
    from rope_quant.calib.stats import CalibrationStats
    from rope_quant.corpora import token_streams
    from rope_quant.rotations import attention

    model = base[0]
    geom = attention.check_model(model)
    stats = CalibrationStats(geom.n_layers, geom.n_q_heads, geom.n_kv_heads, geom.head_dim, sample_rows=2048)
    windows = token_streams.calibration_windows(corpus, 4, 512, 0)
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


def main(argv: list[str] | None = None, base=None, corpus=None) -> None:
    """``base``/``corpus``: a model and corpus to measure instead of SmolLM2 on pydoc (the smoke test's tiny ones)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default="calib,fq,calibstats,range,cache")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per paired timing (best of)")
    ap.add_argument("--repeats", type=int, default=3, help="fq, calibstats: paired timings repeated (median)")
    ap.add_argument("--fq-lengths", default="512,2048", help="fq: comma-separated forward lengths (tokens)")
    ap.add_argument("--r3", default="hadamard", help="fq: the R3 of the fake-quant model")
    ap.add_argument("--calib-windows", type=int, default=4, help="calibstats: 512-token windows")
    ap.add_argument("--angles-out", default=None, help="with range: save both angle arrays here (.npy)")
    args = ap.parse_args(argv)
    parts = args.only.split(",")
    unknown = sorted(set(parts) - {"calib", "fq", "calibstats", "range", "cache"})
    if unknown:
        ap.error(f"--only: unknown part(s) {', '.join(unknown)}; expected calib, fq, calibstats, range or cache")
    torch.set_num_threads(args.threads)
    from rope_quant.corpora import token_streams
    from rope_quant.model.loading import load_model

    if base is None:
        base = load_model("smollm2-135m", device="cpu")
    if corpus is None:
        corpus = token_streams.load_corpus("pydoc", base[1])
    lengths = tuple(int(n) for n in args.fq_lengths.split(","))
    ids = corpus.eval_ids[:L_FWD].unsqueeze(0)
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()}", flush=True)
    for what in parts:
        if what == "calib":
            print("calib", bench_calib(base, ids, args.rounds), flush=True)
        elif what == "fq":
            print("fq", bench_fq(base, corpus, lengths, args.rounds, args.repeats, args.r3), flush=True)
        elif what == "calibstats":
            print("calibstats", bench_calibstats(base, corpus, args.calib_windows, rounds=args.rounds,
                                                 repeats=args.repeats), flush=True)
        elif what == "range":
            r = bench_range(base, corpus)
            if args.angles_out:  # compare two code versions' angles with np.array_equal
                np.save(args.angles_out, np.stack([r["pairwise_only_angles"], r["pairwise_plus_hadamard_angles"]]))
            print("range", {k: v for k, v in r.items() if k.endswith("_s")}, flush=True)
        elif what == "cache":
            print("cache", bench_cache(base, corpus), flush=True)
    print(f"load average {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()

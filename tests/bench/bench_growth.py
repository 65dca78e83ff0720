"""How cost grows with the work: a script, not a test. Writes a CSV and one log-log figure.

    OMP_NUM_THREADS=2 PYTHONPATH=. python tests/bench/bench_growth.py [--threads 2] [--out docs]
        [--only eval,calib,gptq,fwht] [--calib-seqlen 128]

eval:  long-context evaluation of the embedded model (fp, one window of L tokens, lm_head in 1024-row
       blocks) at L = 1K, 2K, 4K, 8K: wall time and peak RSS (the kernel's high-water mark VmHWM, reset
       before each L through /proc/self/clear_refs, so each peak is that evaluation's own).
calib: the calibration-statistics pass (pre-RoPE q/k moments, top-k, K sample) over 4, 16, 64 windows.
gptq:  GPTQ of one decoder layer of tiny random Llama configs, hidden 64 ... 1024 (intermediate 3×hidden,
       head_dim 32, 4 windows × 128 tokens), time per layer.
fwht:  the torch FWHT (core.hadamard.fwht) of 256 rows, d = 64 ... 16384.

Each series is fitted with a power law t ∝ n^p (least squares in log-log); the expected orders are printed
beside the fitted exponent. Timings are best of a few repeats; memory is exact (kernel counters).
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import numpy as np
import torch
from _timing import best_of

EXPECTED = {
    "eval_time": "~1 to 2 (linear layers ∝ L, attention ∝ L²)",
    "eval_peak_rss": "≤ 1 (activations ∝ L with blockwise lm_head, plus a constant lm_head block)",
    "calib_time": "1 (linear in windows)",
    "gptq_time": "2 to 3 (Hessians ∝ N·h², solve ∝ h³)",
    "fwht_time": "~1 (d·log d) for a radix-2 FWHT; 1.5 for this two-factor Kronecker form (d·Σr, r ≈ √d)",
}


def _status(field: str) -> int:
    """A VmXXX field of /proc/self/status in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux ≥ 4.0); False where not permitted."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False



def bench_eval(base, rows: list) -> None:
    from rope_quant.corpora import token_streams
    from rope_quant.scoring.evaluate import perplexity

    model = base[0]
    corpus = token_streams.load_corpus("shakespeare", base[1])
    ids = corpus.eval_ids
    perplexity(model, ids[:256], seqlen=256, max_windows=1)  # warm-up
    for L in (1024, 2048, 4096, 8192):
        reset = _reset_peak()
        before = _status("VmRSS")
        t0 = time.perf_counter()
        res = perplexity(model, ids, seqlen=L, max_windows=1)
        wall = time.perf_counter() - t0
        peak = _status("VmHWM")
        rows.append(("eval_time", L, wall, f"ppl {res.ppl:.3f}"))
        rows.append(("eval_peak_rss", L, (peak - before) / 1e6,
                     f"peak {peak / 1e6:.0f} MB, before {before / 1e6:.0f} MB" + ("" if reset else " (no reset)")))
        print(rows[-2], rows[-1], flush=True)


def bench_calib(base, rows: list, seqlen: int) -> None:
    from rope_quant.calib.stats import CalibrationStats
    from rope_quant.corpora import token_streams
    from rope_quant.experiment.pipeline import K_SAMPLE_ROWS
    from rope_quant.rotations import attention

    model = base[0]
    geom = attention.check_model(model)
    corpus = token_streams.load_corpus("pydoc", base[1])
    for n in (4, 16, 64):
        windows = token_streams.calibration_windows(corpus, n, seqlen, 0)
        stats = CalibrationStats(geom.n_layers, geom.n_q_heads, geom.n_kv_heads, geom.head_dim,
                                 sample_rows=K_SAMPLE_ROWS)
        t0 = time.perf_counter()
        with attention.calibration_hooks(model, stats), torch.no_grad():
            for row in windows:
                model.model(input_ids=row[None], use_cache=False)
        rows.append(("calib_time", n, time.perf_counter() - t0, f"{n} x {seqlen} tokens"))
        print(rows[-1], flush=True)


def _tiny_llama(hidden: int, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=1,
                      num_attention_heads=hidden // 32, num_key_value_heads=hidden // 32, head_dim=32,
                      max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


def bench_gptq(rows: list) -> None:
    from rope_quant.quant.gptq import quantize_model_gptq
    from rope_quant.quant.rtn import GPTQConfig

    windows = torch.randint(0, 512, (4, 128), generator=torch.Generator().manual_seed(0))
    quantize_model_gptq(_tiny_llama(64), windows, 4, GPTQConfig(), progress=False)  # warm-up
    for hidden in (64, 128, 256, 512, 1024):
        model = _tiny_llama(hidden)
        state = {k: v.clone() for k, v in model.state_dict().items()}

        def run(model=model, state=state) -> None:
            model.load_state_dict(state)
            quantize_model_gptq(model, windows, 4, GPTQConfig(), progress=False)
        t = best_of(run, 2)
        rows.append(("gptq_time", hidden, t, "1 layer, 4 x 128 tokens"))
        print(rows[-1], flush=True)


def bench_fwht(rows: list) -> None:
    from rope_quant.core.hadamard import fwht

    for e in range(6, 15):
        d = 2 ** e
        x = torch.randn(256, d)
        fwht(x)
        rows.append(("fwht_time", d, best_of(lambda x=x: fwht(x), 5), "256 rows"))
        print(rows[-1], flush=True)


def fit_exponent(ns, ts) -> float:
    """Least-squares slope of log t against log n."""
    return float(np.polyfit(np.log(np.asarray(ns, float)), np.log(np.asarray(ts, float)), 1)[0])


def figure(rows: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {}
    for name, n, v, _ in rows:
        series.setdefault(name, []).append((n, v))
    labels = {"eval_time": ("long-context eval wall (s)", "L tokens"),
              "eval_peak_rss": ("long-context eval peak RSS above baseline (MB)", "L tokens"),
              "calib_time": ("calibration pass (s)", "windows"),
              "gptq_time": ("GPTQ, one layer (s)", "hidden size"),
              "fwht_time": ("FWHT, 256 rows (s)", "d")}
    fig, axes = plt.subplots(2, 3, figsize=(12, 7))
    axes = axes.ravel()
    for ax, (name, pts) in zip(axes, series.items(), strict=False):
        n, v = map(np.asarray, zip(*pts, strict=True))
        slopes = f"slope {fit_exponent(n, v):.2f}; last 3: {fit_exponent(n[-3:], v[-3:]):.2f}"
        ax.plot(n, v, "o-", label=f"measured ({slopes})")
        ax.plot(n, v[-1] * (n / n[-1]), "k--", lw=0.8, label="slope 1 (through the last point)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(labels[name][0], fontsize=9)
        ax.set_xlabel(labels[name][1])
        ax.legend(fontsize=7)
        ax.grid(True, which="both", lw=0.3)
    for ax in axes[len(series):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="docs")
    ap.add_argument("--only", default="eval,calib,gptq,fwht")
    ap.add_argument("--calib-seqlen", type=int, default=128)
    ap.add_argument("--from-csv", default=None, help="redraw the figure and tables from a CSV of this script")
    args = ap.parse_args()
    if args.from_csv:
        with open(args.from_csv) as f:
            rows = [(r["series"], int(r["n"]), float(r["value"]), r["note"]) for r in csv.DictReader(f)]
        figure(rows, Path(args.out) / "growth.png")
        _tables(rows)
        return
    torch.set_num_threads(args.threads)
    parts = args.only.split(",")
    rows: list = []
    base = None
    if "eval" in parts or "calib" in parts:
        from rope_quant.model.loading import load_model

        base = load_model("smollm2-135m", device="cpu")
    t0 = time.perf_counter()
    if "fwht" in parts:
        bench_fwht(rows)
    if "gptq" in parts:
        bench_gptq(rows)
    if "calib" in parts:
        bench_calib(base, rows, args.calib_seqlen)
    if "eval" in parts:
        bench_eval(base, rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "growth.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["series", "n", "value", "note"])
        w.writerows(rows)
    figure(rows, out / "growth.png")
    print(f"threads {torch.get_num_threads()}, total {time.perf_counter() - t0:.0f} s")
    _tables(rows)


def _tables(rows: list) -> None:
    print("| series | n | value | note |\n|---|---|---|---|")
    for name, n, v, note in rows:
        print(f"| {name} | {n} | {v:.4g} | {note} |")
    print("\n| series | fitted exponent (all points) | last 3 points | expected |\n|---|---|---|---|")
    names = dict.fromkeys(r[0] for r in rows)
    for name in names:
        n, v = zip(*[(n, v) for s, n, v, _ in rows if s == name], strict=True)
        print(f"| {name} | {fit_exponent(n, v):.2f} | {fit_exponent(n[-3:], v[-3:]):.2f} | {EXPECTED[name]} |")


if __name__ == "__main__":
    main()

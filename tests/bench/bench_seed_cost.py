"""The price of one seed on the embedded model (not a test: run as a script; its smoke test is
tests/bench/test_bench_seed_cost.py).

    PYTHONPATH=. python tests/bench/bench_seed_cost.py --threads 2 [--calib-windows 16] [--seqlen 512] [--json out.json]

Builds one fresh seed with the paper's pipeline (whip R1, R2, R4, GPTQ with act_order, MSE clip search and
true-sequential groups, calibration) exactly as the e2e layer does (``RunConfig`` defaults at the e2e budget),
evaluates ``--cells`` R3 cells on it, then builds its float-order replicate (``GPTQConfig(float64=True)``, the
e2e layer's ``_replicate_overrides``) in the same cache directory and evaluates the same cells. Prints, side by
side in one run:

* per stage: seconds and the ratio to one plain fp32 forward of the same calibration tokens through the whole
  model (``model(ids)``, one window at a time as GPTQ runs them; the best of one run before and one after the
  builds, so a load spike on the shared machine does not inflate every ratio);
* the forwards GPTQ runs per decoder layer, COUNTED with hooks during the GPTQ stage: ``linear passes`` = the
  completed decoder-linear forwards ÷ (linears × layers × windows), i.e. layer forwards measured by the
  matmuls they run; ``layer entries`` = calls of a decoder layer's own ``forward`` ÷ (layers × windows) (a staged
  forward runs the layer's blocks without entering the layer);
* seconds per fresh seed (build + cells) with and without its float-order replicate.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

#: R3 cells evaluated per seed (as tests/bench/profile_gptq.py: the identity control and the paper's pairwise).
CELLS = (("identity", {"r3": "identity"}), ("pairwise_only", {"r3": "pairwise_only"}))


def plain_forward_s(model: nn.Module, windows: torch.Tensor) -> float:
    """Seconds of one plain fp32 forward of ``windows`` (n, seqlen) through the whole model, one window a call."""
    with torch.inference_mode():
        t = time.perf_counter()
        for row in windows:
            model(row.unsqueeze(0), use_cache=False)
        return time.perf_counter() - t


@contextlib.contextmanager
def counted_gptq(record: dict[str, Any]) -> Iterator[None]:
    """Wrap ``gptq.quantize_model_gptq`` for the duration: time it and count the forwards it runs per layer."""
    from rope_quant.model import arch
    from rope_quant.quant import gptq

    real = gptq.quantize_model_gptq

    def wrapped(model: nn.Module, windows: torch.Tensor, *args: Any, **kwargs: Any) -> dict[str, float]:
        layers = arch.decoder_layers(model)
        linears = [m for layer in layers for m in layer.modules() if isinstance(m, nn.Linear)]
        calls = {"linear": 0, "layer": 0}

        def bump(key: str) -> Callable[..., None]:
            def hook(*_: Any) -> None:
                calls[key] += 1
            return hook

        def entered(forward: Callable[..., Any]) -> Callable[..., Any]:
            def counted(*a: Any, **k: Any) -> Any:
                calls["layer"] += 1
                return forward(*a, **k)
            return counted

        # a wrapped forward, not a hook on the layer: a hook of the layer's own would refuse the staged forward
        for layer in layers:
            layer.forward = entered(layer.forward)  # type: ignore[method-assign]
        handles = [m.register_forward_hook(bump("linear")) for m in linears]
        t = time.perf_counter()
        try:
            return real(model, windows, *args, **kwargs)
        finally:
            record["gptq_s"] = record.get("gptq_s", 0.0) + time.perf_counter() - t
            for h in handles:
                h.remove()
            for layer in layers:
                del layer.forward
            n = len(windows)
            record["linear_passes_per_layer"] = calls["linear"] / (len(linears) * n)
            record["layer_entries_per_layer"] = calls["layer"] / (len(layers) * n)

    gptq.quantize_model_gptq = wrapped  # type: ignore[assignment]
    try:
        yield
    finally:
        gptq.quantize_model_gptq = real  # type: ignore[assignment]


def _build_and_cells(cfg: Any, cache: str, base: tuple[Any, Any], corpus: Any,
                     cells: tuple[tuple[str, dict], ...]) -> dict[str, Any]:
    from rope_quant.experiment.pipeline import build_quantized_model, run_cell

    rec: dict[str, Any] = {}
    with counted_gptq(rec):
        t = time.perf_counter()
        qm = build_quantized_model(cfg, cache_dir=cache, base=base, corpus=corpus)
        rec["build_s"] = time.perf_counter() - t
    rec["timing"] = dict(qm.timing)
    rec["cells"] = {}
    for name, over in cells:
        c = cfg.override(**over)
        t = time.perf_counter()
        qm.reconfigure(c)
        res = run_cell(c, qm=qm)
        rec["cells"][name] = {"s": time.perf_counter() - t, "ppl": float(res["ppl"])}
    rec["cells_s"] = sum(v["s"] for v in rec["cells"].values())
    return rec


def measure(base: tuple[Any, Any], cfg: Any, corpus: Any, cells: tuple[tuple[str, dict], ...] = CELLS,
            replicate: bool = True) -> dict[str, Any]:
    """Every figure of the bench for one seed of ``cfg`` on ``base`` (model, tokenizer): a JSON-able dict."""
    from rope_quant.corpora import token_streams
    from rope_quant.quant.rtn import GPTQConfig

    calib = token_streams.calibration_windows(corpus, cfg.budget.calib_windows, cfg.budget.seqlen, cfg.seed)
    plain = [plain_forward_s(base[0], calib)]
    out: dict[str, Any] = {"calib_windows": int(calib.shape[0]), "seqlen": int(calib.shape[1]),
                           "threads": torch.get_num_threads(), "loadavg_before": os.getloadavg()}
    with tempfile.TemporaryDirectory() as cache:
        out["seed"] = _build_and_cells(cfg, cache, base, corpus, cells)
        if replicate:  # the e2e layer's replicate: the same seed with GPTQ in the other float mode
            rep_cfg = cfg.override(gptq=GPTQConfig(float64=not cfg.quant.w.gptq.float64))
            out["replicate"] = _build_and_cells(rep_cfg, cache, base, corpus, cells)
    plain.append(plain_forward_s(base[0], calib))
    out["loadavg_after"] = os.getloadavg()
    out["plain_forward_s"] = min(plain)
    out["plain_forward_runs_s"] = plain
    out["rows"] = rows(out)
    return out


def rows(out: dict[str, Any]) -> list[tuple[str, float, float]]:
    """(stage, seconds, ratio to the plain forward) rows of :func:`measure`'s result."""
    p = out["plain_forward_s"]
    seed = out["seed"]
    tm = seed["timing"]
    items = [("plain fp32 forward of the calibration tokens", p),
             ("load + calibration windows", tm.get("load_s", 0.0)),
             ("whip R1 + offline rotations", tm.get("rotate_s", 0.0)),
             ("activation quantisers", tm.get("act_calib_s", 0.0)),
             ("GPTQ (quantize_model_gptq)", seed["gptq_s"]),
             ("weights stage (GPTQ + cache save)", tm.get("weights_s", 0.0)),
             ("calibration statistics", tm.get("calibration_s", 0.0)),
             ("angles + attention (reconfigure)", tm.get("angles_s", 0.0) + tm.get("attention_s", 0.0)),
             ("build (fresh seed)", seed["build_s"])]
    items += [(f"cell {name}", c["s"]) for name, c in seed["cells"].items()]
    fresh = seed["build_s"] + seed["cells_s"]
    items.append(("fresh seed: build + cells", fresh))
    if "replicate" in out:
        rep = out["replicate"]
        items += [("replicate GPTQ (float64)", rep["gptq_s"]),
                  ("replicate build (R1 cache hit)", rep["build_s"]),
                  ("replicate cells", rep["cells_s"]),
                  ("fresh seed + replicate", fresh + rep["build_s"] + rep["cells_s"])]
    return [(name, float(s), float(s) / p) for name, s in items]


def report(out: dict[str, Any]) -> str:
    lines = [f"{out['calib_windows']} x {out['seqlen']} calibration tokens, {out['threads']} threads, "
             f"load average before {out['loadavg_before'][0]:.2f}, after {out['loadavg_after'][0]:.2f}; "
             f"plain forward runs {', '.join(f'{s:.2f}' for s in out['plain_forward_runs_s'])} s",
             f"{'stage':48s} {'seconds':>9s} {'x plain':>8s}"]
    lines += [f"{name:48s} {s:9.2f} {r:8.2f}" for name, s, r in out["rows"]]
    seed = out["seed"]
    lines.append(f"GPTQ forwards per decoder layer (counted): linear passes {seed['linear_passes_per_layer']:.2f}, "
                 f"layer entries {seed['layer_entries_per_layer']:.2f}")
    if "replicate" in out:
        rep = out["replicate"]
        lines.append(f"replicate GPTQ / primary GPTQ: {rep['gptq_s'] / seed['gptq_s']:.2f}; replicate forwards: "
                     f"linear passes {rep['linear_passes_per_layer']:.2f}, layer entries "
                     f"{rep['layer_entries_per_layer']:.2f}")
    lines.append("perplexity: " + ", ".join(
        f"{name} {c['ppl']:.3f}" for name, c in seed["cells"].items())
        + ("; replicate: " + ", ".join(f"{name} {c['ppl']:.3f}" for name, c in out["replicate"]["cells"].items())
           if "replicate" in out else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calib-windows", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--eval-windows", type=int, default=12, help="evaluation windows per cell (the e2e budget)")
    ap.add_argument("--cells", type=int, default=len(CELLS), choices=range(0, len(CELLS) + 1))
    ap.add_argument("--no-replicate", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write every figure here (atomically)")
    args = ap.parse_args(argv)
    for flag in ("threads", "calib_windows", "seqlen", "eval_windows"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    torch.set_num_threads(args.threads)
    from rope_quant.corpora import token_streams
    from rope_quant.experiment.pipeline import RunConfig
    from rope_quant.io import atomic_write_json
    from rope_quant.model.loading import load_model

    base = load_model("smollm2-135m", device="cpu")
    cfg = RunConfig.from_flat(seed=args.seed, seqlen=args.seqlen, calib_windows=args.calib_windows,
                              eval_windows=args.eval_windows)
    corpus = token_streams.load_corpus(cfg.corpus, base[1])
    out = measure(base, cfg, corpus, CELLS[:args.cells], replicate=not args.no_replicate)
    import subprocess

    out["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                   cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    out["torch"] = torch.__version__
    print(report(out))
    if args.json:
        atomic_write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

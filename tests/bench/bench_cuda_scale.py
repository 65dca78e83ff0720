"""CUDA scale benchmark: one seed of the paper's protocol on the full-depth Llama-3-8B shape, in one GPU call.

Builds the random-weight shape (:mod:`rope_quant.model.shapes`) directly on the device in its storage dtype (no
CPU initialisation), hands it to the pipeline as the loaded model (no working copy: the model is in GPU memory
once), and runs the paper's protocol for one seed: 128 × 2048 calibration, whip R1 10 epochs, the offline
rotations, the calibration statistics, then each R3 configuration over the evaluation windows, and GPTQ. Per
stage it prints the wall time, the GPU peak (allocated), the plan's prediction
(:func:`rope_quant.planning.plan.make_plan`) and the 0.2.0 GPU target (per 8B layer on an
H100: calibration ≤ 0.5 s, GPTQ ≤ 3 s, whip R1 ≤ 2 s per seed, evaluation ≤ 1.3× the plain bf16 forward; Table 1
≤ 15 GPU-minutes). Never asserts on time.

Fitting one device call (≤ 8 minutes on one H100): the whole run is bounded by ``--budget-s`` (default 450 s;
a timer interrupts the stage then running, which is reported as stopped, with what it had done). GPTQ runs
last (``--gptq last``, the default), on the built model, layer by layer until the budget: the row gives the
layers done, the time per layer and the full-depth projection; the model is built with RTN weights first, so
calibration and evaluation are measured whatever GPTQ costs (their cost does not depend on the weights' values).
``--gptq pipeline`` runs the pipeline's own order (GPTQ before calibration) instead.

An out-of-memory error in a stage is reported with the stage's name and the pipeline's remedy, not raised.
``--dtype auto`` takes bfloat16, or float16 with a note on a GPU without native bfloat16
(:func:`rope_quant.model.dtypes.auto_dtype`).

    PYTHONPATH=$PWD python3 tests/bench/bench_cuda_scale.py                      # the H100 run (one call)
    PYTHONPATH=$PWD python3 tests/bench/bench_cuda_scale.py --device cpu --tiny --layers 2 --calib-windows 2 \\
        --seqlen 64 --eval-windows 2 --whip-epochs 1                             # the CPU smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

#: The paper's four R3 configurations of Table 1 (no R3, Hadamard, the pairwise rotation, both).
R3_CONFIGS = ("identity", "hadamard", "pairwise_only", "pairwise_plus_hadamard")
#: The 0.2.0 GPU targets, per 8B layer on one H100 (seconds), and Table 1's.
TARGET_CALIB_PER_LAYER_S = 0.5
TARGET_GPTQ_PER_LAYER_S = 3.0
TARGET_WHIP_S = 2.0
TARGET_EVAL_OVER_PLAIN = 1.3
TARGET_TABLE1_MIN = 15.0
TABLE1_WINDOWS, TABLE1_SEEDS, TABLE1_CONFIGS = 140, 3, 4


class BudgetExceeded(Exception):
    """The run's time budget ran out inside a stage."""


class ByteTokenizer:
    """Bytes as token ids (256 ids): random weights need no real tokenizer, only the corpus's windows."""

    def __call__(self, text: str, **_: Any) -> dict[str, list[int]]:
        return {"input_ids": list(text.encode("utf-8"))}

    def get_vocab(self) -> dict[str, int]:
        return {chr(i): i for i in range(256)}


@dataclass
class Row:
    stage: str
    wall_s: float | None = None
    peak_gib: float | None = None
    plan_s: float | None = None
    target: str = "–"
    note: str = ""


@dataclass
class Recorder:
    """Wall time and GPU peak of every pipeline stage (the pipeline's ``stage`` context, wrapped)."""

    cuda: bool
    rows: list[Row] = field(default_factory=list)

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    @contextlib.contextmanager
    def record(self, name: str, note: str = "") -> Iterator[Row]:
        row = Row(str(name), note=note)
        self.rows.append(row)
        self._sync()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        try:
            yield row
        finally:
            with contextlib.suppress(Exception):
                self._sync()
            row.wall_s = time.perf_counter() - t
            if self.cuda:
                row.peak_gib = torch.cuda.max_memory_allocated() / 2**30


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-3-8b")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's full depth)")
    p.add_argument("--tiny", action="store_true", help="a tiny width (hidden 64) instead of the shape's: CPU smoke")
    p.add_argument("--calib-windows", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--eval-windows", type=int, default=32, help="evaluation windows per R3 configuration")
    p.add_argument("--whip-epochs", type=int, default=10)
    p.add_argument("--configs", default=",".join(R3_CONFIGS), help="R3 configurations, comma-separated")
    p.add_argument("--gptq", choices=("last", "pipeline", "off"), default="last")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"))
    p.add_argument("--device", default=None, help="cuda (default where available) or cpu")
    p.add_argument("--budget-s", type=float, default=450.0, help="stop the stage running at this wall time")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = p.parse_args(argv)
    for name in ("calib_windows", "seqlen", "eval_windows", "whip_epochs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.layers is not None and args.layers < 1:
        p.error("--layers must be positive")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: CUDA is not available here")
    return args


def resolve_dtype(args: argparse.Namespace) -> str:
    from rope_quant.model.dtypes import auto_dtype

    if args.dtype != "auto":
        return args.dtype
    name, note = auto_dtype(args.device)
    if note:
        print(note)
    return name


def plan_device(device: str) -> str:
    """The plan's device for this machine: the GPU by name (an unknown GPU is priced as an H100)."""
    if not device.startswith("cuda"):
        return "cpu"
    name = torch.cuda.get_device_name(torch.device(device).index).upper()
    if "H200" in name:
        return "h200"
    if "A100" in name:
        total = torch.cuda.get_device_properties(torch.device(device).index).total_memory
        return "a100-80g" if total > 50 * 2**30 else "a100-40g"
    return "h100"


def build_model(args: argparse.Namespace, dtype: torch.dtype) -> Any:
    """The random-weight model, initialised on ``args.device`` in ``dtype`` (no CPU copy)."""
    from rope_quant.model import shapes

    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(args.device):
            if args.tiny:
                from transformers import LlamaConfig, LlamaForCausalLM

                cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=args.layers or 2, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=16, max_position_embeddings=max(512, args.seqlen))
                model = LlamaForCausalLM(cfg)
            else:
                model = shapes.build(args.shape, layers=args.layers, dtype=dtype)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def make_plan(model: Any, args: argparse.Namespace, dtype: str, configs: int) -> dict[str, float]:
    from rope_quant.planning import plan

    mc = plan.model_cost(_meta_twin(model), args.shape)
    protocol = plan.Protocol(calib_windows=args.calib_windows, seqlen=args.seqlen, eval_windows=args.eval_windows,
                             whip_epochs=args.whip_epochs, configs=configs, seeds=1, gptq=args.gptq != "off")
    p = plan.make_plan(mc, plan_device(args.device), dtype, protocol)
    return {s.name: s.seconds for s in p.stages}


def _meta_twin(model: Any) -> Any:
    """The same architecture on the meta device (the plan reads shapes only)."""
    with torch.device("meta"):
        return type(model)(model.config)


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise :class:`BudgetExceeded` in the main thread after ``seconds`` of wall time."""
    def fire(_sig: int, _frame: Any) -> None:
        raise BudgetExceeded(f"time budget of {seconds:.0f} s exhausted")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def plain_forward_s(model: Any, windows: torch.Tensor, device: str, cuda: bool) -> float:
    """Wall time of the plain HF forward (with logits) over ``windows``: the evaluation target's baseline."""
    with torch.no_grad():
        model(input_ids=windows[:1].to(device), use_cache=False)  # warm-up
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        for row in windows:
            model(input_ids=row[None].to(device), use_cache=False)
        if cuda:
            torch.cuda.synchronize()
    return time.perf_counter() - t


def run(args: argparse.Namespace) -> list[Row]:
    from rope_quant.corpora import token_streams
    from rope_quant.experiment import pipeline
    from rope_quant.experiment.config import RunConfig
    from rope_quant.planning.stages import StageName, StageOutOfMemoryError
    from rope_quant.quant import gptq

    cuda = args.device.startswith("cuda")
    rec = Recorder(cuda)
    dtype_name = resolve_dtype(args)
    configs = [c for c in args.configs.split(",") if c]
    t_start = time.perf_counter()
    layers_note = ""
    with deadline(args.budget_s):
        try:
            with rec.record(StageName.LOAD, "random init on the device") as row:
                model = build_model(args, getattr(torch, dtype_name))
            n_layers = model.config.num_hidden_layers
            plans = make_plan(model, args, dtype_name, len(configs))
            layers_note = f"{n_layers} layers"
            tok = ByteTokenizer()
            corpus = token_streams.load_corpus("pydoc", tok, use_cache=False)
            n_eval = min(args.eval_windows, corpus.eval_ids.numel() // args.seqlen)
            eval_ids = corpus.eval_ids[: n_eval * args.seqlen].reshape(n_eval, args.seqlen)
            plain_s = plain_forward_s(model, eval_ids, args.device, cuda)
            weights = "gptq" if args.gptq == "pipeline" else "rtn"
            flat = dict(model="bench", corpus="pydoc", seed=0, weights=weights, a_bits=4, k_bits=4, v_bits=4,
                        seqlen=args.seqlen, calib_windows=args.calib_windows, eval_windows=args.eval_windows,
                        whip_epochs=args.whip_epochs, device=args.device, dtype=dtype_name, r3=configs[0])
            cfg = RunConfig.from_flat(**flat)
            real_stage, real_load = pipeline.stage, pipeline.load_base

            @contextlib.contextmanager
            def timed_stage(name: StageName) -> Iterator[None]:
                if name == StageName.LOAD:  # the model is already built (the row above): nothing to time
                    with real_stage(name):
                        yield
                    return
                with rec.record(name), real_stage(name):
                    yield

            pipeline.stage = timed_stage  # type: ignore[assignment]
            pipeline.load_base = lambda *_a, **_k: (model, tok)  # type: ignore[assignment]
            try:
                qm = pipeline.build_quantized_model(cfg, base=(model, tok), corpus=corpus, offload="none")
                eval_rows = []
                for name in configs:
                    cell = cfg.override(r3=name)
                    with rec.record("R3 angles", f"{name}"):
                        qm.reconfigure(cell)
                    pipeline.run_cell(cell, qm=qm)
                    eval_rows.append(rec.rows[-1])
                    eval_rows[-1].note = f"{name}; plain forward {plain_s:.3f} s"
                if args.gptq == "last":
                    done = [0]
                    real_layer = gptq._quantize_layer

                    def counted(*a: Any, **k: Any) -> Any:
                        out = real_layer(*a, **k)
                        done[0] += 1
                        return out

                    gptq._quantize_layer = counted  # type: ignore[assignment]
                    try:
                        with rec.record(StageName.GPTQ, "after the cell, on the built model") as row:
                            try:
                                w = cfg.quant.w
                                gptq.quantize_model_gptq(qm.model, qm.calib, w.bits, w.gptq, clip_ratio=w.clip)
                            finally:
                                row.note = f"{done[0]}/{n_layers} layers"
                    finally:
                        gptq._quantize_layer = real_layer  # type: ignore[assignment]
            finally:
                pipeline.stage, pipeline.load_base = real_stage, real_load  # type: ignore[assignment]
        except BudgetExceeded as exc:
            rec.rows[-1].note = (rec.rows[-1].note + f"; STOPPED: {exc}").lstrip("; ")
        except StageOutOfMemoryError as exc:
            rec.rows[-1].note = (rec.rows[-1].note + f"; OUT OF MEMORY: {exc}").lstrip("; ")
        except torch.OutOfMemoryError as exc:  # in the bench's own steps (the build, the plain forward)
            rec.rows[-1].note = (rec.rows[-1].note + f"; OUT OF MEMORY in stage '{rec.rows[-1].stage}': "
                                 f"{str(exc)[:300]}").lstrip("; ")
    _annotate(rec.rows, locals().get("plans", {}), args, locals().get("n_layers", args.layers or 0),
              locals().get("plain_s"))
    print(f"total wall {time.perf_counter() - t_start:.1f} s ({layers_note})")
    return rec.rows


def _annotate(rows: list[Row], plans: dict[str, float], args: argparse.Namespace, n_layers: int,
              plain_s: float | None) -> None:
    """The plan's prediction and the target on every row; GPTQ's full-depth projection."""
    eight_b = args.shape == "llama-3-8b" and not args.tiny
    for row in rows:
        row.plan_s = plans.get(row.stage)
        if row.stage == "GPTQ" and "/" in row.note and row.wall_s:
            done = int(row.note.split("/")[0].split()[-1])
            if 0 < done < n_layers:
                per = row.wall_s / done
                row.note += f"; {per:.2f} s per layer, {n_layers} layers ≈ {per * n_layers:.0f} s"
        if not eight_b:
            continue
        if row.stage == "calibration":
            row.target = f"≤ {TARGET_CALIB_PER_LAYER_S * n_layers:.0f} s"
        elif row.stage == "GPTQ":
            row.target = f"≤ {TARGET_GPTQ_PER_LAYER_S * n_layers:.0f} s"
        elif row.stage == "whip R1":
            row.target = f"≤ {TARGET_WHIP_S:.0f} s"
        elif row.stage.startswith("evaluation") and plain_s:
            row.target = f"≤ {TARGET_EVAL_OVER_PLAIN * plain_s:.2f} s"


def table1_projection(rows: list[Row], args: argparse.Namespace, n_layers: int) -> str:
    """Table 1 (4 configs × 3 seeds × 140 windows) projected from the rows (load once, GPTQ at full depth)."""
    get = {r.stage: r.wall_s or 0.0 for r in rows}
    gptq = next((r for r in rows if r.stage == "GPTQ"), None)
    gptq_s = 0.0
    if gptq is not None and gptq.wall_s:
        done = int(gptq.note.split("/")[0].split()[-1]) if "/" in gptq.note else n_layers
        gptq_s = gptq.wall_s / max(done, 1) * n_layers
    evals = [r.wall_s for r in rows if r.stage.startswith("evaluation") and r.wall_s]
    per_window = (sum(evals) / len(evals) / args.eval_windows) if evals else 0.0
    seed = get.get("whip R1", 0) + get.get("offline rotation", 0) + gptq_s + get.get("calibration", 0)
    total = TABLE1_SEEDS * seed + TABLE1_SEEDS * TABLE1_CONFIGS * TABLE1_WINDOWS * per_window
    return (f"Table 1 projection (3 seeds x 4 configs x {TABLE1_WINDOWS} windows): {total / 60:.1f} GPU-minutes "
            f"(target ≤ {TARGET_TABLE1_MIN:.0f}); per seed {seed:.1f} s, evaluation {per_window:.3f} s per window")


def report(rows: list[Row], args: argparse.Namespace) -> str:
    fmt = lambda v, d=2: "–" if v is None else f"{v:.{d}f}" if v >= 0.01 else f"{v:.2g}"  # noqa: E731
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    lines = [f"device: {dev}; torch {torch.__version__}; shape {args.shape}{' (tiny width)' if args.tiny else ''}; "
             f"{args.calib_windows}x{args.seqlen} calibration, whip {args.whip_epochs} epochs, "
             f"{args.eval_windows} evaluation windows per config",
             "", "| stage | wall s | GPU peak GiB | plan s | target | note |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.stage} | {fmt(r.wall_s)} | {fmt(r.peak_gib, 1)} | {fmt(r.plan_s)} | {r.target} | "
                     f"{r.note} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    rows = run(args)
    print(report(rows, args))
    n_layers = args.layers or (2 if args.tiny else 0)
    if not args.tiny:
        from rope_quant.model import shapes

        n_layers = args.layers or shapes.shape(args.shape).depth
    print(table1_projection(rows, args, n_layers))
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

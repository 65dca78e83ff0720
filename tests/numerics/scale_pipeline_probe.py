"""Whole-pipeline scale probe, run as a subprocess so its peak RSS is its own.

A paper-scale shape (:mod:`rope_quant.model.shapes`) cut to a few layers at full width is saved as a random-weight
checkpoint (with a byte-level BPE tokenizer trained on the pydoc corpus, at most ``TOKENIZER_VOCAB`` ids) by a
child process, then run through the public API: :func:`~rope_quant.experiment.pipeline.build_quantized_model`
(load, whip R1, offline R1/R2/R4, GPTQ, calibration) and :func:`~rope_quant.experiment.pipeline.run_cell` with one
evaluation window per R3 config (the paired design: :meth:`QuantizedModel.reconfigure`). The only instrument is a
wrapper around :func:`rope_quant.rotations.offline.rotate_model` that scores the rotated fp model against the
original on a 32-token probe (max relative logit error), inside the real run.

``python scale_pipeline_probe.py SHAPE LAYERS VOCAB CALIB SEQLEN CONFIGS [DTYPE] [WEIGHTS] [WHIP_EPOCHS]``
(CONFIGS comma-separated R3 names) prints one JSON line: the stage times, the peak RSS (overall and per stage,
sampled), the logit error, the model bytes and the plan's prediction (:func:`rope_quant.planning.plan.make_plan`
on device ``cpu`` for the same settings).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from tests._support.models import TOKENIZER_VOCAB, save_shape_checkpoint

PROBE_TOKENS = 32
ROOT = Path(__file__).resolve().parents[2]
GIB = 2 ** 30

#: (shape, layers, vocab, calibration windows, seqlen, dtype, weights): the ``slow`` table (docs/paper_scale.md).
#: Vocabularies above 32000 and GPTQ above intermediate 11008 are cut to keep one process under ~8 GiB here:
#: GPTQ's host work grows with intermediate² (5 float32 copies of the down_proj Hessian: 3.8 GiB at 14336).
SLOW_CASES = [
    ("llama-2-7b", 1, 32000, 2, 2048, "float32", "gptq"),
    ("llama-3-8b", 1, 32000, 2, 2048, "float32", "rtn"),
    ("mistral-7b", 1, 32000, 2, 2048, "float32", "rtn"),
    ("qwen2.5-7b", 1, 32000, 2, 2048, "float32", "rtn"),
    ("llama-3-70b", 1, 8192, 2, 2048, "bfloat16", "rtn"),
]
CONFIGS = "hadamard,pairwise_only"


def run_probe(shape: str, layers: int, vocab: int, calib: int, seqlen: int, dtype: str, weights: str,
              threads: int = 1, configs: str = CONFIGS, whip_epochs: int = 1) -> dict:
    """One probe subprocess (its own peak RSS); the last stdout line is its JSON record."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
    args = [shape, str(layers), str(vocab), str(calib), str(seqlen), configs, dtype, weights, str(whip_epochs)]
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), *args], capture_output=True, text=True,
                         env=env, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"probe {shape} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def stage_report(r: dict) -> str:
    """Per stage: measured wall and CPU seconds, the plan's seconds, CPU/plan; peak RSS against the plan."""
    lines = [f"{r['shape']} x{r['layers']} layer, vocab {r['vocab']}, {r['dtype']}, {r['weights']}, "
             f"{r['threads']} thread(s): peak RSS {r['peak_rss'] / GIB:.2f} GiB, plan {r['plan_peak_host'] / GIB:.2f}"
             f" GiB (x{r['peak_rss'] / r['plan_peak_host']:.2f}), model {r['model_bytes'] / GIB:.2f} GiB"]
    for name, wall in r["stage_s"].items():
        plan = r["plan"].get(name, {}).get("s")
        cpu = r["stage_cpu_s"].get(name, float("nan"))
        ratio = f"{cpu / plan:.2f}" if plan else "-"
        plan_s = f"{plan:.1f}" if plan else "-"
        lines.append(f"  {name}: wall {wall:.1f} s, cpu {cpu:.1f} s, plan {plan_s} s, cpu/plan {ratio}")
    return "\n".join(lines)


STAGES = ("load", "whip R1", "offline rotation", "GPTQ", "calibration", "evaluation (per config)")


def memory_row(r: dict) -> str:
    """``| shape | params | dtype, weights | peak RSS | model | RSS/model | plan | measured/plan |`` (GiB)."""
    return (f"| {r['shape']} x{r['layers']}, vocab {r['vocab']} | {r['params'] / 1e9:.3f}B | {r['dtype']}, "
            f"{r['weights']} | {r['peak_rss'] / GIB:.2f} | {r['model_bytes'] / GIB:.2f} | "
            f"{r['peak_rss'] / r['model_bytes']:.2f} | {r['plan_peak_host'] / GIB:.2f} | "
            f"{r['peak_rss'] / r['plan_peak_host']:.2f} | {r['rel_logit_err']:.1e} |")


def time_row(r: dict) -> str:
    """Per stage ``wall / cpu (plan) s`` and the CPU/plan ratio (stages the run skipped: ``-``)."""
    cells = []
    for name in STAGES:
        plan = r["plan"].get(name, {}).get("s")
        if plan is None:
            cells.append("-")
            continue
        cpu = r["stage_cpu_s"][name]
        cells.append(f"{r['stage_s'][name]:.0f} / {cpu:.0f} ({plan:.0f}) x{cpu / plan:.2f}")
    return f"| {r['shape']} | " + " | ".join(cells) + " |"


def save_checkpoint(directory: Path, shape: str, layers: int, vocab: int, dtype: str) -> None:
    """The random-weight shape and a pydoc-trained BPE tokenizer, saved for ``RunConfig.model``."""
    save_shape_checkpoint(directory, shape, layers, vocab, dtype)


class RssSampler:
    """Resident set size of this process every ``period`` seconds (``/proc/self/statm``), with timestamps."""

    def __init__(self, period: float = 0.05) -> None:
        self.period, self.samples = period, []  # type: ignore[var-annotated]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._page = os.sysconf("SC_PAGE_SIZE")

    def _run(self) -> None:
        while not self._stop.is_set():
            with open("/proc/self/statm") as f:
                rss = int(f.read().split()[1]) * self._page
            self.samples.append((time.perf_counter(), rss, time.process_time()))
            self._stop.wait(self.period)

    @staticmethod
    def file_backed() -> int:
        """Resident file-backed bytes (``RssFile``: e.g. mmapped checkpoint pages)."""
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssFile:"):
                    return int(line.split()[1]) * 1024
        return 0

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def peak(self, start: float, end: float) -> int:
        return max((r for t, r, _ in self.samples if start <= t <= end), default=0)

    def cpu(self, start: float, end: float) -> float:
        """Process CPU seconds between two ``perf_counter`` times (nearest samples): robust to a loaded machine."""
        inside = [c for t, _, c in self.samples if start <= t <= end]
        return inside[-1] - inside[0] if len(inside) > 1 else 0.0


def _rss_peak() -> int:
    """This process's peak RSS: VmHWM (Linux), not ``ru_maxrss``, which a child keeps from its parent across
    fork + exec (a probe started by a 9.7 GiB pytest process reported 9.69 GiB)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _instrument_rotation(record: dict) -> Any:
    """Wrap ``offline.rotate_model``: logits of the original and of the rotated fp model on the same probe."""
    from rope_quant.rotations import offline

    original = offline.rotate_model

    def rotate_model(model, *args, **kwargs):
        vocab = model.get_input_embeddings().weight.shape[0]
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, min(vocab, TOKENIZER_VOCAB), (1, PROBE_TOKENS), generator=gen)
        with torch.no_grad():
            ref = model(input_ids=ids).logits.double()
        record["rotate_start"] = time.perf_counter()
        record["rss_file_before_rotation"] = RssSampler.file_backed()
        out = original(model, *args, **kwargs)
        record["rotate_end"] = time.perf_counter()
        record["rss_file_after_rotation"] = RssSampler.file_backed()
        with torch.no_grad():
            got = model(input_ids=ids).logits.double()
        record["rel_logit_err"] = ((got - ref).abs().max() / ref.abs().max()).item()
        return out

    offline.rotate_model = rotate_model
    return original


def plan_for(shape: str, layers: int, vocab: int, calib: int, seqlen: int, configs: int, dtype: str,
             weights: str, whip_epochs: int) -> Any:
    """The plan of the same settings on device ``cpu`` (whip schedule and sample size as in the run)."""
    from rope_quant.experiment.config import WhipSpec
    from rope_quant.model import shapes
    from rope_quant.planning import plan as planning

    spec = WhipSpec()
    mc = planning.model_cost(shapes.build_meta(shape, layers=layers, vocab=vocab), shape)
    return planning.make_plan(mc, "cpu", dtype, planning.Protocol(
        calib_windows=calib, seqlen=seqlen, eval_windows=1, whip_epochs=whip_epochs, whip_batch=spec.batch_size,
        whip_subset=spec.subset, tokens_per_sample=spec.tokens_per_sample, configs=configs, seeds=1,
        gptq=weights == "gptq"))


def main(shape: str, layers: int, vocab: int, calib: int, seqlen: int, configs: str, dtype: str = "float32",
         weights: str = "gptq", whip_epochs: int = 1) -> dict:
    from rope_quant.experiment import pipeline
    from rope_quant.experiment.config import RunConfig

    r3s = configs.split(",")
    record: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="scale-probe-") as tmp:
        ckpt = Path(tmp) / "model"
        t0 = time.perf_counter()
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        subprocess.run([sys.executable, __file__, "--save", str(ckpt), shape, str(layers), str(vocab), dtype],
                       check=True, env=env)
        save_s = time.perf_counter() - t0
        start_rss = _rss_peak()
        _instrument_rotation(record)
        cfg = RunConfig.from_flat(model=str(ckpt), corpus="pydoc", seed=0, seqlen=seqlen, calib_windows=calib,
                                  eval_windows=1, weights=weights, whip_epochs=whip_epochs, dtype=dtype,
                                  r3=r3s[0])
        evals: dict[str, dict] = {}
        with RssSampler() as rss:
            t_build = time.perf_counter()
            qm = pipeline.build_quantized_model(cfg, cache_dir=None)
            t_built = time.perf_counter()
            for name in r3s:
                t = time.perf_counter()
                cell_cfg = cfg.override(r3=name)
                res = pipeline.run_cell(cell_cfg, qm=qm.reconfigure(cell_cfg))
                evals[name] = {"ppl": res["ppl"], "eval_s": res["timing"]["eval_s"],
                               "cell_s": time.perf_counter() - t, "n_tokens": res["n_tokens"],
                               "peak_rss": rss.peak(t, time.perf_counter()), "cpu_s": rss.cpu(t, time.perf_counter())}
        params = sum({id(p): p.numel() for p in qm.model.parameters()}.values())
    timing, fit = qm.timing, qm.rotation_fit
    whip_s = float(fit.get("fit_s", 0.0))
    # stage windows from the pipeline's own timings (sequential steps of build_quantized_model)
    bounds, t = {}, t_build
    for key, name in (("load_s", "load"), ("rotate_s", "rotate"), ("act_calib_s", "act"),
                      ("weights_s", "GPTQ"), ("calibration_s", "calibration")):
        bounds[name] = (t, t + timing[key])
        t += timing[key]
    bounds["whip R1"] = (bounds["rotate"][0], record.get("rotate_start", bounds["rotate"][0]))
    bounds["offline rotation"] = (record.get("rotate_start", bounds["rotate"][0]), bounds["rotate"][1])
    stage_rss = {name: rss.peak(a, b) for name, (a, b) in bounds.items()}
    stage_cpu = {name: rss.cpu(a, b) for name, (a, b) in bounds.items()}
    stage_cpu["evaluation (per config)"] = sum(e["cpu_s"] for e in evals.values()) / len(evals)
    measured = {"load": timing["load_s"], "whip R1": whip_s, "offline rotation": timing["rotate_s"] - whip_s,
                "GPTQ": timing["weights_s"], "calibration": timing["calibration_s"],
                "evaluation (per config)": sum(e["eval_s"] for e in evals.values()) / len(evals)}
    pl = plan_for(shape, layers, vocab, calib, seqlen, len(r3s), dtype, weights, whip_epochs)
    pred = {s.name: {"host": s.host_bytes, "s": s.seconds} for s in pl.stages}
    return {"shape": shape, "layers": layers, "vocab": vocab, "params": params, "dtype": dtype, "weights": weights,
            "calib_windows": calib, "seqlen": seqlen, "configs": r3s, "whip_epochs": whip_epochs,
            "whip_steps": fit.get("steps"), "save_s": save_s, "build_s": t_built - t_build,
            "stage_s": measured, "stage_rss": stage_rss, "stage_cpu_s": stage_cpu, "evals": evals,
            "peak_rss": _rss_peak(), "start_rss": start_rss, "sampled_peak_rss": rss.peak(0, float("inf")),
            "rel_logit_err": record.get("rel_logit_err"), "rss_file_end": RssSampler.file_backed(),
            "rss_file_before_rotation": record.get("rss_file_before_rotation"),
            "rss_file_after_rotation": record.get("rss_file_after_rotation"),
            "model_bytes": params * getattr(torch, dtype).itemsize,
            "plan": pred, "plan_peak_host": pl.peak_host,
            "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


if __name__ == "__main__":
    a = sys.argv[1:]
    if a and a[0] == "--save":
        save_checkpoint(Path(a[1]), a[2], int(a[3]), int(a[4]), a[5])
    else:
        print(json.dumps(main(a[0], int(a[1]), int(a[2]), int(a[3]), int(a[4]), a[5], *a[6:8],
                              *(int(x) for x in a[8:9]))))

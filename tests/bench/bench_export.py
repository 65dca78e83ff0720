"""File size and load time of the exports against the plain fp16 model (numbers in docs/export.md).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python tests/bench/bench_export.py [--model smollm2-135m] [--repeats 3]

Builds one cell (whip R1, random-Hadamard R2, no R4, pairwise_only φ̂, RTN W4, A4, K/V 16-bit; seqlen 128 and
2 calibration windows to keep it short), writes the original model in fp16 (``save_pretrained``), the hf export
in fp16 and the compressed-tensors export (W4 packed, the rest fp16), then loads each with
``AutoModelForCausalLM.from_pretrained(dir, dtype="auto")`` in an interpreter without rope_quant (best of
``--repeats``).
Prints sizes and load times with their ratios to the fp16 model: ratios, never asserts.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from pathlib import Path

import torch

from rope_quant.experiment.config import RunConfig
from rope_quant.export import build, compressed, hf, outdir
from rope_quant.model.loading import load_model
from tests.numerics.export_isolated import hf_logits


def size_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.iterdir() if p.suffix == ".safetensors") / 2 ** 20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cfg = RunConfig.from_flat(model=args.model, corpus="pydoc", seed=0, r1="whip", r2="random_hadamard", r4=False,
                              r3="pairwise_only", weights="rtn", a_bits=4, k_bits=16, v_bits=16, seqlen=128,
                              calib_windows=2, eval_windows=1)
    model, tok = load_model(args.model)
    ids = torch.tensor([tok("The capital of France is", add_special_tokens=False)["input_ids"]])
    root = Path(tempfile.mkdtemp(prefix="bench-export-"))
    plain = root / "fp16"
    m16 = copy.deepcopy(model).to(torch.float16)
    build.drop_loader_quantization(m16)  # the GGUF source: its weights are already dequantised
    m16.config.dtype = torch.float16
    m16.save_pretrained(plain)
    tok.save_pretrained(plain)
    dirs = {"fp16 (original)": plain}
    em = build.build_export_model(cfg, None, base=(copy.deepcopy(model), tok), weights=build.WeightSource.UNQUANTISED)
    with outdir.staged(root / "hf16", overwrite=False) as tmp:
        hf.write_hf(em, tmp, torch.float16, weights="unquantised", source={"bench": True})
    dirs["hf fp16 (R1/R2/R3 folded)"] = root / "hf16"
    em = build.build_export_model(cfg, None, base=(copy.deepcopy(model), tok), weights=build.WeightSource.DEQUANTISED,
                                  fold=False)
    with outdir.staged(root / "ct", overwrite=False) as tmp:
        compressed.write_compressed(em, tmp, torch.float16, source={"bench": True})
    dirs["compressed-tensors W4 (rest fp16)"] = root / "ct"
    base_size = size_mb(plain)
    base_load = None
    print(f"{'export':36s} {'MB':>8s} {'x fp16':>7s} {'load s':>7s} {'x fp16':>7s}")
    for name, path in dirs.items():
        best = min(hf_logits(path, ids, root, dtype="'auto'")[1]["load_s"] for _ in range(args.repeats))
        base_load = best if base_load is None else base_load
        print(f"{name:36s} {size_mb(path):8.1f} {size_mb(path) / base_size:7.2f} {best:7.2f} {best / base_load:7.2f}")
    print(f"(directories under {root})")


if __name__ == "__main__":
    main()

"""The price of llama.cpp's online K Hadamard: prompt and decode tokens/s with the rotation on and off, at q4_0 keys,
measured side by side in one run (a script, not a test; timings are printed, never asserted):

    PYTHONPATH=. python tests/bench/bench_llamacpp_rotation.py [--models smollm2-135m,gemma3-270m] [--threads 2]
        [--prompt 512] [--decode 64] [--rounds 3] [--k-type q4_0]

For each model (the embedded GGUF files, as shipped) it opens two contexts, rotation on and off
(``rope_quant.runtime.llamacpp.open_model``), and alternates them round by round: one prompt of ``prompt`` tokens
(pydoc text, tokenised by llama.cpp) in one batch, then the next ``decode`` tokens of the text one step each.
Each context keeps its best round. The table gives tokens/s and the on/off ratios (below 1: the rotation costs time).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

from rope_quant.runtime import llamacpp as lc

COLUMNS = ("model", "head_dim", "k", "threads", "prompt", "decode", "prompt_tok/s on", "prompt_tok/s off",
           "prompt on/off", "decode_tok/s on", "decode_tok/s off", "decode on/off")


def prompt_tokens(llm: Any, n: int) -> list[int]:
    """``n`` tokens of the pydoc topics text (sorted by key), tokenised by the model's own tokenizer."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = llm.tokenize(text.encode(), add_bos=False, special=False)
    if len(ids) < n:
        raise SystemExit(f"the pydoc text has {len(ids)} tokens, fewer than --prompt {n}")
    return list(ids[:n])


def one_round(llm: Any, tokens: list[int], n_prompt: int) -> tuple[float, float]:
    """(prompt seconds, decode seconds) of one fresh sequence: ``tokens[:n_prompt]`` in one batch, then each later
    token as its own step (teacher-forced decode: the same work per step as sampling, the same tokens in both
    contexts)."""
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(tokens[:n_prompt])
    t1 = time.perf_counter()
    for tok in tokens[n_prompt:]:
        llm.eval([tok])
    return t1 - t0, time.perf_counter() - t1


def bench_model(name: str, k_type: lc.KCacheType, threads: int, n_prompt: int, n_decode: int,
                rounds: int) -> dict[str, Any]:
    from rope_quant.model.loading import model_path, resolve_model

    path = model_path(resolve_model(name))
    geo = lc.gguf_geometry(path)
    ctx = n_prompt + n_decode
    llms = {rot: lc.open_model(path, ctx, k_type, rot, threads, logits_all=False, geometry=geo)
            for rot in (True, False)}
    tokens = prompt_tokens(llms[True], ctx)
    best = {rot: [math.inf, math.inf] for rot in llms}
    for llm in llms.values():  # warm-up
        one_round(llm, tokens[:34], 32)
    for _ in range(rounds):
        for rot, llm in llms.items():
            p, d = one_round(llm, tokens, n_prompt)
            best[rot] = [min(best[rot][0], p), min(best[rot][1], d)]
    for llm in llms.values():
        llm.close()
    pt = {rot: n_prompt / best[rot][0] for rot in best}
    dt = {rot: n_decode / best[rot][1] for rot in best}
    return {"model": name, "head_dim": geo.head_dim_k, "k": k_type.value, "threads": threads, "prompt": n_prompt,
            "decode": n_decode, "prompt_tok/s on": pt[True], "prompt_tok/s off": pt[False],
            "prompt on/off": pt[True] / pt[False], "decode_tok/s on": dt[True], "decode_tok/s off": dt[False],
            "decode on/off": dt[True] / dt[False]}


def table(rows: list[dict[str, Any]]) -> str:
    def cell(v: Any) -> str:
        return f"{v:.3f}" if isinstance(v, float) and v < 10 else f"{v:.1f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(r[c]) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="smollm2-135m,gemma3-270m")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--k-type", default="q4_0", choices=[t.value for t in lc.KCacheType if t.quantised])
    a = p.parse_args(argv)
    import llama_cpp

    rows = [bench_model(m, lc.KCacheType(a.k_type), a.threads, a.prompt, a.decode, a.rounds)
            for m in a.models.split(",")]
    print(f"llama-cpp-python {llama_cpp.__version__}; best of {a.rounds} alternating rounds")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

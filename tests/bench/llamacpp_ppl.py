"""llama.cpp perplexity of GGUF files on the evaluator's windows, per K cache type and runtime rotation (a script):

    PYTHONPATH=. python tests/bench/llamacpp_ppl.py --model smollm2-135m [--gguf NAME=PATH ...]
        [--k-types q4_0] [--corpus pydoc] [--seqlen 512] [--windows 8] [--threads 2]

The windows are ``rope_quant.scoring.evaluate.eval_windows`` of the corpus' evaluation stream, tokenised by
``--model``'s tokenizer (what ``rope-quant run`` scores); every file is scored on them by
``rope_quant.runtime.llamacpp.score_windows``. Without ``--gguf`` the model's own GGUF file is scored. A quantised
K type is scored with the rotation on and off; f16 once (llama.cpp rotates only a quantised cache).
"""

from __future__ import annotations

import argparse
import sys

from rope_quant.runtime import llamacpp as lc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="the model whose tokenizer makes the windows")
    p.add_argument("--gguf", action="append", default=[], metavar="NAME=PATH", help="a GGUF to score (repeatable)")
    p.add_argument("--k-types", default="q4_0", help="comma-separated K cache types")
    p.add_argument("--corpus", default="pydoc")
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    from transformers import AutoTokenizer

    from rope_quant.corpora import token_streams
    from rope_quant.model.loading import model_path, resolve_model
    from rope_quant.scoring import evaluate

    src = resolve_model(a.model)
    tok = AutoTokenizer.from_pretrained(src.directory, gguf_file=src.gguf_file) if src.gguf_file else \
        AutoTokenizer.from_pretrained(src.directory)
    windows = evaluate.eval_windows(token_streams.load_corpus(a.corpus, tok).eval_ids, a.seqlen, a.windows)
    files = [tuple(g.split("=", 1)) for g in a.gguf] or [(f"{a.model} (as shipped)", str(model_path(src)))]
    print(f"{a.corpus}: {windows.shape[0]} windows of {a.seqlen} tokens ({a.model}'s tokenizer), "
          f"{a.threads} threads, V f16")
    print("| GGUF | K cache | rotation on | rotation off | off - on |\n|---|---|---|---|---|")
    for name, path in files:
        for k in (lc.KCacheType(t) for t in a.k_types.split(",")):
            on = lc.score_windows(path, windows, k, True, a.threads).ppl
            if not k.quantised:
                print(f"| {name} | {k.value} | {on:.3f} | – | – |", flush=True)
                continue
            off = lc.score_windows(path, windows, k, False, a.threads).ppl
            print(f"| {name} | {k.value} | {on:.3f} | {off:.3f} | {off - on:+.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A cell scored by llama.cpp instead of the simulator (the claims' ``Scoring.RUNTIME``).

The cell's model is built by the pipeline as for the simulator (its R3 fitted on the cell's calibration windows),
exported to a GGUF with R1, R2 and its RoPE-commuting R3 folded (:mod:`rope_quant.export.gguf_export`, f32
weights: the cells of the runtime claims leave the weights unquantised), and scored by llama.cpp
(:func:`rope_quant.runtime.llamacpp.score_windows`) on the evaluator's windows
(:func:`rope_quant.scoring.evaluate.eval_windows`), so a runtime cell and its simulated twin score the same
tokens. The cell's key quantiser names llama.cpp's K cache type (``ggml_q4_0`` → ``q4_0``; unquantised keys →
``f16``) and its ``runtime_rotation`` the runtime's online K Hadamard. The GGUF lives in a temporary directory for
the scoring only.
"""

from __future__ import annotations

import tempfile
from typing import Any

from rope_quant.runtime.llamacpp import KCacheType, LlamaCppError, score_windows

__all__ = ["RUNTIME_WEIGHTS", "k_cache_type", "score_cell"]

RUNTIME_WEIGHTS = "f32"
"""The GGUF weight type of a runtime cell (the simulator's cells compute in float32)."""


def k_cache_type(cfg: Any) -> KCacheType:
    """llama.cpp's K cache type for the cell ``cfg``: its ggml key quantiser's format, or f16 for unquantised
    keys; :class:`LlamaCppError` for a key quantiser the runtime does not have (per_token at 4 bits, KIVI, …)."""
    from rope_quant.quant.quantizers import OFF_BITS

    kind = str(cfg.quant.kq.kind)
    if kind.startswith("ggml_"):
        return KCacheType(kind.removeprefix("ggml_"))
    if cfg.quant.k.bits >= OFF_BITS:
        return KCacheType.F16
    raise LlamaCppError(f"k_quant={kind} at {cfg.quant.k.bits} bits is not a K cache type of llama.cpp: a runtime "
                        f"cell's keys are ggml_q4_0, ggml_q4_1, ggml_iq4_nl, ggml_q8_0 or unquantised")


def score_cell(cfg: Any, *, base: tuple[Any, Any] | None = None, cache_dir: str | None = None,
               n_threads: int = 2) -> dict[str, Any]:
    """Perplexity of the cell ``cfg`` in llama.cpp on the evaluator's windows: ``ppl``, ``n_tokens``, ``k_type``,
    ``runtime_rotation``. Bad input (a key quantiser llama.cpp lacks, an architecture it cannot load, a
    non-commuting R3) is refused before the model is built."""
    from rope_quant.corpora import token_streams
    from rope_quant.export import build, gguf_export
    from rope_quant.scoring import evaluate

    k_type = k_cache_type(cfg)
    rotation = bool(cfg.online.runtime_rotation)
    em = build.build_export_model(cfg, cache_dir, base=base)
    corpus = token_streams.load_corpus(cfg.corpus, em.tokenizer)
    windows = evaluate.eval_windows(corpus.eval_ids, cfg.budget.seqlen, cfg.budget.eval_windows)
    with tempfile.TemporaryDirectory(prefix="rq-runtime-cell-") as tmp:
        out = gguf_export.write_gguf(em, tmp, gguf_export.GGUFWeightType(RUNTIME_WEIGHTS),
                                     source={"runtime_cell": cfg.key()})
        scores = score_windows(out / gguf_export.GGUF_FILE, windows.tolist(), k_type, rotation, n_threads)
    return {"ppl": scores.ppl, "n_tokens": int(sum(scores.n_tokens)), "k_type": k_type.value,
            "runtime_rotation": rotation}

"""The tiny random Llama every numerics test builds: one builder, seeded, so a test's expectations are fixed."""

from __future__ import annotations

from typing import Any

import torch

# The smallest pipeline budget the numerics use with :func:`tiny_base` (RunConfig.from_flat(**TINY)).
TINY = dict(seqlen=64, calib_windows=4, eval_windows=2)


def tiny_llama(vocab: int = 96, *, seed: int = 0, layers: int = 2, hidden: int = 64, heads: int = 4,
               kv_heads: int = 2, intermediate: int = 128, max_positions: int = 512, tied: bool = False,
               **config: Any) -> Any:
    """A random ``LlamaForCausalLM`` in eval mode, initialised under ``torch.manual_seed(seed)``.

    head_dim is hidden // heads (16 by default). ``config`` passes any other ``LlamaConfig`` field (e.g.
    ``initializer_range``, ``attention_bias``).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                      max_position_embeddings=max_positions, tie_word_embeddings=tied, **config)
    return LlamaForCausalLM(cfg).eval()


def tiny_base(embedded_model: tuple[Any, Any], seed: int = 0, max_positions: int = 512) -> tuple[Any, Any]:
    """(tiny Llama, tokenizer) with the embedded model's vocabulary and tokenizer, tied embeddings like SmolLM2:
    the ``base`` a pipeline test builds a quantised model from in seconds."""
    model = tiny_llama(embedded_model[0].config.vocab_size, seed=seed, max_positions=max_positions, tied=True)
    return model, embedded_model[1]


class ByteTokenizer:
    """Bytes as token ids (vocabulary 256): enough for the pipeline's corpus windows on a random model."""

    def __call__(self, text: str, **_: Any) -> dict[str, list[int]]:
        return {"input_ids": list(text.encode("utf-8"))}

    def get_vocab(self) -> dict[str, int]:
        return {chr(i): i for i in range(256)}

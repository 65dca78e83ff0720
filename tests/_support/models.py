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


def tiny_gemma3(vocab: int = 256, *, seed: int = 0, layers: int = 2, kv_heads: int = 1, intermediate: int = 96,
                window: int = 32, layer_types: list[str] | None = None, max_positions: int = 256,
                **config: Any) -> Any:
    """A random ``Gemma3ForCausalLM`` (hidden 64, 4 heads, head_dim 16) in eval mode under ``torch.manual_seed``.

    ``layer_types`` defaults to sliding layers then one full layer (the two RoPE bases of Gemma 3); ``config``
    passes any other ``Gemma3TextConfig`` field (e.g. ``query_pre_attn_scalar``, ``tie_word_embeddings``).
    """
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    types = layer_types or ["sliding_attention"] * (layers - 1) + ["full_attention"]
    cfg = Gemma3TextConfig(vocab_size=vocab, hidden_size=64, intermediate_size=intermediate,
                           num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=kv_heads,
                           head_dim=16, sliding_window=window,
                           layer_types=types, max_position_embeddings=max_positions, **config)
    return Gemma3ForCausalLM(cfg).eval()


def tiny_qwen3(vocab: int = 256, *, seed: int = 0, layers: int = 2, kv_heads: int = 2, intermediate: int = 96,
               max_positions: int = 256, **config: Any) -> Any:
    """A random ``Qwen3ForCausalLM`` (hidden 64, 4 heads, head_dim 16, per-head q/k norms) in eval mode under
    ``torch.manual_seed(seed)``; ``config`` passes any other ``Qwen3Config`` field."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=16,
                      max_position_embeddings=max_positions, **config)
    return Qwen3ForCausalLM(cfg).eval()


def randomise_norms(model: Any, low: float, high: float) -> Any:
    """Every norm weight drawn uniformly from [low, high) (so fusing or folding into a norm is not a no-op)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(low, high)
    return model


class ByteTokenizer:
    """Bytes as token ids (vocabulary 256): enough for the pipeline's corpus windows on a random model."""

    def __call__(self, text: str, **_: Any) -> dict[str, list[int]]:
        return {"input_ids": list(text.encode("utf-8"))}

    def get_vocab(self) -> dict[str, int]:
        return {chr(i): i for i in range(256)}

    def decode(self, ids: Any, **_: Any) -> str:
        """The bytes back to text (NIAH reads its answers and haystack boundaries this way)."""
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


#: The most ids of the BPE tokenizer a random-weight shape checkpoint is saved with (trained on the pydoc corpus).
TOKENIZER_VOCAB = 4096


def save_shape_checkpoint(directory: Any, shape: str, layers: int, vocab: int, dtype: str = "float32",
                          heads: int | None = None) -> Any:
    """A random-weight paper shape (:mod:`rope_quant.model.shapes`: ``layers`` decoder layers, a ``vocab``-row
    embedding, ``heads`` query heads through :func:`~rope_quant.model.shapes.narrow` when given) and a byte-level
    BPE tokenizer trained on the pydoc corpus (at most :data:`TOKENIZER_VOCAB` ids), saved with
    ``save_pretrained`` into ``directory`` (returned), loadable as ``RunConfig.model``."""
    from pathlib import Path
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from rope_quant.model import shapes

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab, TOKENIZER_VOCAB), special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(topics.values()), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    kind = shapes.narrow(shape, heads) if heads is not None else shape
    model = shapes.build(kind, layers=layers, vocab=vocab, seed=0, dtype=getattr(torch, dtype))
    model.config.bos_token_id, model.config.eos_token_id = 1, 2
    model.save_pretrained(directory)
    fast.save_pretrained(directory)
    return Path(directory)

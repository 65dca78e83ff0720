"""Paper-scale model shapes: random-weight models built from the published configs, no download (for plans).

Each :class:`Shape` holds the values of a model card's ``config.json`` (source URL in ``card``), written out
here so the scale tests and ``rope-quant plan`` need no network. :func:`build` instantiates the model with
transformers' own class (random weights, optionally truncated to ``layers`` decoder layers at full width);
:func:`build_meta` does the same on the meta device (no memory), for planning and parameter counts.
:func:`narrow` keeps a shape's architecture, head_dim, GQA ratio and RoPE base at fewer heads (a CPU test of
the paper's protocol on the shape's kind of model).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

import torch

__all__ = ["ShapeName", "Shape", "SHAPES", "ShapeError", "shape", "narrow", "hf_config", "build", "build_meta",
           "param_count"]


class ShapeError(ValueError):
    """An unknown shape name or a bad truncation."""


class ShapeName(StrEnum):
    """The paper-scale shapes (five published 7B-70B models)."""

    LLAMA2_7B = "llama-2-7b"
    LLAMA3_8B = "llama-3-8b"
    MISTRAL_7B = "mistral-7b"
    QWEN25_7B = "qwen2.5-7b"
    LLAMA3_70B = "llama-3-70b"


@dataclass(frozen=True)
class Shape:
    """The architecture values of one published config (``card``: where they were read)."""

    name: ShapeName
    model_type: str
    hidden: int
    intermediate: int
    depth: int
    heads: int
    kv_heads: int
    vocab: int
    rope_theta: float
    max_positions: int
    rms_eps: float
    card: str
    qkv_bias: bool = False
    tied: bool = False
    sliding_window: int | None = None
    published_params: float = 0.0  # the model card's parameter count, in billions

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES: dict[ShapeName, Shape] = {s.name: s for s in (
    Shape(ShapeName.LLAMA2_7B, "llama", hidden=4096, intermediate=11008, depth=32, heads=32, kv_heads=32,
          vocab=32000, rope_theta=10000.0, max_positions=4096, rms_eps=1e-5, published_params=6.74,
          card="https://huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json"),
    Shape(ShapeName.LLAMA3_8B, "llama", hidden=4096, intermediate=14336, depth=32, heads=32, kv_heads=8,
          vocab=128256, rope_theta=500000.0, max_positions=8192, rms_eps=1e-5, published_params=8.03,
          card="https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json"),
    Shape(ShapeName.MISTRAL_7B, "mistral", hidden=4096, intermediate=14336, depth=32, heads=32, kv_heads=8,
          vocab=32000, rope_theta=10000.0, max_positions=32768, rms_eps=1e-5, sliding_window=4096,
          published_params=7.24, card="https://huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json"),
    Shape(ShapeName.QWEN25_7B, "qwen2", hidden=3584, intermediate=18944, depth=28, heads=28, kv_heads=4,
          vocab=152064, rope_theta=1000000.0, max_positions=131072, rms_eps=1e-6, qkv_bias=True,
          published_params=7.62, card="https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json"),
    Shape(ShapeName.LLAMA3_70B, "llama", hidden=8192, intermediate=28672, depth=80, heads=64, kv_heads=8,
          vocab=128256, rope_theta=500000.0, max_positions=8192, rms_eps=1e-5, published_params=70.6,
          card="https://huggingface.co/meta-llama/Meta-Llama-3-70B/blob/main/config.json"),
)}


def shape(name: str | ShapeName | Shape) -> Shape:
    """The :class:`Shape` of a name (case-insensitive), or the shape itself."""
    if isinstance(name, Shape):
        return name
    try:
        return SHAPES[ShapeName(str(name).lower())]
    except ValueError:
        raise ShapeError(f"unknown shape {name!r}; known: {', '.join(s.value for s in ShapeName)}") from None


def narrow(name: str | ShapeName | Shape, heads: int) -> Shape:
    """The shape at ``heads`` query heads: head_dim, the query/KV head ratio, the RoPE base and the architecture
    kept; hidden = heads × head_dim, the MLP width scaled by the same factor. ``heads`` must be a positive multiple
    of the shape's query heads per KV head and at most its heads."""
    s = shape(name)
    group = s.heads // s.kv_heads
    if isinstance(heads, bool) or not isinstance(heads, int) or not 0 < heads <= s.heads or heads % group:
        raise ShapeError(f"{s.name.value}: heads must be a multiple of {group} (query heads per KV head) in "
                         f"{group} … {s.heads}, got {heads!r}")
    return replace(s, hidden=heads * s.head_dim, intermediate=s.intermediate * heads // s.heads, heads=heads,
                   kv_heads=heads // group, published_params=0.0)


def _truncated(s: Shape, layers: int | None, vocab: int | None) -> Shape:
    for what, v in (("layers", layers), ("vocab", vocab)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ShapeError(f"{what} must be a positive integer, got {v!r}")
    return replace(s, depth=layers or s.depth, vocab=vocab or s.vocab)


def hf_config(name: str | ShapeName | Shape, layers: int | None = None, vocab: int | None = None) -> Any:
    """The transformers config of a shape (``layers`` / ``vocab`` truncate; the width is never changed)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    s = _truncated(shape(name), layers, vocab)
    common: dict[str, Any] = dict(hidden_size=s.hidden, intermediate_size=s.intermediate, num_hidden_layers=s.depth,
                  num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, vocab_size=s.vocab,
                  max_position_embeddings=s.max_positions, rms_norm_eps=s.rms_eps, rope_theta=s.rope_theta,
                  tie_word_embeddings=s.tied, hidden_act="silu")
    if s.model_type == "qwen2":  # q/k/v biases are built in for qwen2
        return Qwen2Config(**common, use_sliding_window=False)
    if s.model_type == "mistral":
        return MistralConfig(**common, sliding_window=s.sliding_window, head_dim=s.head_dim)
    return LlamaConfig(**common, attention_bias=s.qkv_bias)


def _model_class(cfg: Any) -> Any:
    from transformers import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM

    return {"llama": LlamaForCausalLM, "mistral": MistralForCausalLM, "qwen2": Qwen2ForCausalLM}[cfg.model_type]


def build_meta(name: str | ShapeName | Shape, layers: int | None = None, vocab: int | None = None) -> Any:
    """The model on the meta device: parameter shapes and counts, no storage."""
    cfg = hf_config(name, layers, vocab)
    with torch.device("meta"):
        return _model_class(cfg)(cfg)


def build(name: str | ShapeName | Shape, layers: int | None = None, dtype: torch.dtype = torch.float32,
          seed: int = 0, vocab: int | None = None, std: float | None = None) -> Any:
    """A random-weight model of the shape in eval mode (transformers' own class and initialiser).

    ``layers``: keep the first ``layers`` decoder layers at full width; ``vocab``: a smaller vocabulary;
    ``std``: the initialiser's std (default the config's ``initializer_range``, 0.02). Norm weights are 1.
    """
    cfg = hf_config(name, layers, vocab)
    if std is not None:
        cfg.initializer_range = std
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialise in the storage dtype: no float32 copy of a bf16 model
    try:
        model = _model_class(cfg)(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def param_count(model_or_shape: Any, layers: int | None = None) -> int:
    """Parameters of a model (shared tensors once), or of a shape (built on the meta device)."""
    model = model_or_shape
    if isinstance(model_or_shape, (str, Shape)):
        model = build_meta(model_or_shape, layers)
    seen = {id(p): p.numel() for p in model.parameters()}
    return sum(seen.values())

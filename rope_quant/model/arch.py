"""Architecture adapter: the one module that knows the attribute names of supported model families.

Every other module asks this one for the decoder layers, the attention and MLP linears, the norms, the
embeddings / lm_head, the rotary module and each layer's ``inv_freq``, the head geometry, and which
offline rotations are function-preserving. A family is described by an :class:`ArchSpec` (attribute
names and structural facts) in :data:`ARCHITECTURES`, keyed by ``config.model_type``; to add a family,
add an entry there (or call :func:`register`).

Registered: ``llama``, ``mistral``, ``qwen2``, ``qwen3`` (pre-norm RMSNorm decoders, one RoPE base) and
``gemma3_text`` (sandwich norms, ``(1 + w)`` RMSNorm, one RoPE base per layer type). Gemma 3 is registered
so that R1 is refused with a reason (:func:`rotation_refusal`): its post-attention / post-feedforward
norms scale the o_proj / down_proj outputs per channel before they reach the residual stream.

Over 500 lines because it is the only module that knows the families' attribute names: adding a family
touches this one place.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from rope_quant.core import rope

if TYPE_CHECKING:  # torch is imported lazily, so that importing the numpy-only calib modules stays light
    from torch import nn

__all__ = [
    "ArchitectureError",
    "UnsupportedModelTypeError",
    "ModelStructureError",
    "ArchSpec",
    "ARCHITECTURES",
    "ROTATIONS",
    "register",
    "registered_types",
    "is_registered",
    "spec_for",
    "text_config",
    "ModelDims",
    "AttentionParts",
    "MLPParts",
    "LayerNorms",
    "dims",
    "GEOMETRY_FIELDS",
    "OPTIONAL_GEOMETRY_FIELDS",
    "check_config_dict",
    "base_model",
    "decoder_layers",
    "attention",
    "attention_modules",
    "mlp_parts",
    "layer_norms",
    "final_norm",
    "embeddings",
    "lm_head",
    "embeddings_tied",
    "fusable_norms",
    "norm_weight_offset",
    "rotary_modules",
    "layer_inv_freq",
    "shared_inv_freq",
    "inv_freq_by_layer",
    "describe_sources",
    "layer_linear_groups",
    "decoder_linears",
    "rotation_refusal",
]

#: Offline rotations an adapter can declare non-function-preserving.
ROTATIONS = ("r1", "r2", "r4")


class ArchitectureError(ValueError):
    """Base class: the model cannot be handled by the architecture adapter."""


class UnsupportedModelTypeError(ArchitectureError):
    """``config.model_type`` has no entry in :data:`ARCHITECTURES`."""


class ModelStructureError(ArchitectureError):
    """The model's modules do not have the layout its registered family declares."""


@dataclass(frozen=True)
class ArchSpec:
    """Attribute names and structural facts of one model family (relative to the causal LM).

    Norm roles: ``pre_attn_norm`` feeds q/k/v, ``pre_mlp_norm`` feeds gate/up; ``post_attn_norm`` /
    ``post_mlp_norm`` (sandwich norms, optional) scale the o_proj / down_proj outputs before the residual
    add. ``norm_offset``: the RMSNorm scale is ``offset + weight`` (Gemma: 1). ``inv_freq_by_layer_type``:
    the rotary module holds one buffer per ``config.layer_types`` entry, named ``f"{layer_type}_inv_freq"``.
    ``qk_norm_heads_first``: the q/k norms run after the (b, L, H, d) -> (b, H, L, d) transpose (Gemma 3),
    not before it (Qwen3).
    ``refused``: extra (rotation, reason) declarations beyond those derived from the structure.
    ``gguf_arch``: llama.cpp's name for the family (None: llama.cpp does not load it); ``gguf_pairs_interleaved``:
    llama.cpp rotates interleaved pairs (2i, 2i + 1) of a head (its NORM rope), so the GGUF's W_Q/W_K rows and
    the runtime's K rows hold a head in that order, not in the rotate_half order (i, i + d/2) of transformers.
    ``staged``: the decoder layer is the residual block :mod:`rope_quant.model.layer_stages` reproduces
    (pre-attention norm, attention, optional post-attention norm, residual add; pre-MLP norm, MLP, optional
    post-MLP norm, residual add), so GPTQ may run it in two stages; False keeps GPTQ on whole-layer forwards.
    """

    model_type: str
    base: str = "model"
    layers: str = "layers"
    embed: str = "embed_tokens"
    final_norm: str = "norm"
    lm_head: str = "lm_head"
    rotary: str = "rotary_emb"
    attn: str = "self_attn"
    q: str = "q_proj"
    k: str = "k_proj"
    v: str = "v_proj"
    o: str = "o_proj"
    q_norm: str | None = None
    k_norm: str | None = None
    mlp: str = "mlp"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    pre_attn_norm: str = "input_layernorm"
    pre_mlp_norm: str = "post_attention_layernorm"
    post_attn_norm: str | None = None
    post_mlp_norm: str | None = None
    norm_offset: float = 0.0
    inv_freq_by_layer_type: bool = False
    qk_norm_heads_first: bool = False
    refused: tuple[tuple[str, str], ...] = field(default=())
    staged: bool = True
    gguf_arch: str | None = None
    gguf_pairs_interleaved: bool = False

    @property
    def has_qk_norm(self) -> bool:
        """Whether queries and keys are RMS-normed per head before RoPE (Qwen3, Gemma 3)."""
        return bool(self.q_norm and self.k_norm)

    def linear_groups(self) -> tuple[tuple[str, ...], ...]:
        """Decoder-layer linears in execution order (true-sequential GPTQ groups), names relative to a layer."""
        a, m = self.attn, self.mlp
        return ((f"{a}.{self.q}", f"{a}.{self.k}", f"{a}.{self.v}"), (f"{a}.{self.o}",),
                (f"{m}.{self.gate}", f"{m}.{self.up}"), (f"{m}.{self.down}",))


#: The registry: one entry per supported ``config.model_type``. Add new families here.
ARCHITECTURES: dict[str, ArchSpec] = {}


def register(spec: ArchSpec) -> ArchSpec:
    """Add (or replace) a family in :data:`ARCHITECTURES`."""
    ARCHITECTURES[spec.model_type] = spec
    return spec


for _t in ("llama", "mistral"):  # Mistral checkpoints are llama in llama.cpp
    register(ArchSpec(_t, gguf_arch="llama", gguf_pairs_interleaved=True))
register(ArchSpec("qwen2", gguf_arch="qwen2"))
register(ArchSpec("qwen3", q_norm="q_norm", k_norm="k_norm", gguf_arch="qwen3"))
register(ArchSpec(
    "gemma3_text", q_norm="q_norm", k_norm="k_norm", pre_mlp_norm="pre_feedforward_layernorm",
    post_attn_norm="post_attention_layernorm", post_mlp_norm="post_feedforward_layernorm",
    norm_offset=1.0, inv_freq_by_layer_type=True, qk_norm_heads_first=True, gguf_arch="gemma3",
))


def registered_types() -> tuple[str, ...]:
    """The registered ``model_type`` keys, sorted."""
    return tuple(sorted(ARCHITECTURES))


# ----------------------------------------------------------------------------- lookup


def text_config(model: Any) -> Any:
    """The (text) config of a Hugging Face model."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        raise UnsupportedModelTypeError(
            f"{type(model).__name__} has no .config: expected a Hugging Face causal LM of a registered "
            f"type ({', '.join(registered_types())})"
        )
    get_text = getattr(cfg, "get_text_config", None)
    return get_text() if callable(get_text) else cfg


def is_registered(model: Any) -> bool:
    """True when ``model`` is a causal LM of a registered family (not, e.g., its rotary module)."""
    if getattr(model, "config", None) is None:
        return False
    spec = ARCHITECTURES.get(getattr(text_config(model), "model_type", None))
    return spec is not None and getattr(model, spec.base, None) is not None


def spec_for(model_or_type: Any) -> ArchSpec:
    """The :class:`ArchSpec` of a model (by ``config.model_type``) or of a model-type string."""
    mtype = model_or_type if isinstance(model_or_type, str) else getattr(text_config(model_or_type),
                                                                         "model_type", None)
    spec = ARCHITECTURES.get(mtype)
    if spec is None:
        raise UnsupportedModelTypeError(
            f"model type {mtype!r} is not supported: registered types are {', '.join(registered_types())}. "
            "A new family is added in rope_quant/model/arch.py (ARCHITECTURES / register(ArchSpec(...)))"
        )
    return spec


def _get(obj: Any, name: str, where: str) -> Any:
    value = getattr(obj, name, None)
    if value is None:
        raise ModelStructureError(f"{where}.{name} is missing")
    return value


# ----------------------------------------------------------------------------- geometry


@dataclass(frozen=True)
class ModelDims:
    """Sizes read from the config: layers, hidden, heads, KV heads, head_dim, MLP width."""

    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int

    @property
    def group(self) -> int:
        """Q heads per KV head (GQA group size)."""
        return self.n_heads // self.n_kv_heads


#: The config fields every reader of a model's geometry needs (:func:`dims`, the plan's cost model): a
#: config.json must hold them itself; transformers would otherwise fill in its class defaults (a 7B model).
GEOMETRY_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
#: Geometry fields with a defined fallback when absent (KV heads = heads; head_dim = hidden // heads).
OPTIONAL_GEOMETRY_FIELDS = ("num_key_value_heads", "head_dim")


def check_config_dict(data: Any, where: str) -> None:
    """A raw config (the parsed config.json) of a registered type that holds every :data:`GEOMETRY_FIELDS` as
    a positive integer; else the error names the field(s). A multimodal config's ``text_config`` is checked for
    its type and values only: ``save_pretrained`` leaves out a nested config's fields that equal its class's
    defaults, so there the defaults are the model's own."""
    if not isinstance(data, dict):
        raise ModelStructureError(f"{where}: not a JSON object")
    text = data.get("text_config")
    nested = isinstance(text, dict) and "model_type" in text
    cfg = text if nested else data
    spec_for(cfg.get("model_type"))  # an unknown family first: its fields are named otherwise
    missing = [name for name in GEOMETRY_FIELDS if cfg.get(name) is None]
    if missing and not nested:
        raise ModelStructureError(
            f"{where} lacks {', '.join(missing)}: the model's geometry must come from the file (transformers "
            "would fill in the defaults of another model); use the checkpoint's complete config.json")
    for name in (*GEOMETRY_FIELDS, *OPTIONAL_GEOMETRY_FIELDS):
        value = cfg.get(name)
        if value is None and (nested or name in OPTIONAL_GEOMETRY_FIELDS):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelStructureError(f"{where}: {name} must be a positive integer, got {value!r}")


def dims(model: Any) -> ModelDims:
    """Head geometry and widths of a registered model, from its config (GQA aware)."""
    spec_for(model)
    cfg = text_config(model)
    try:
        hidden = int(cfg.hidden_size)
        n_heads = int(cfg.num_attention_heads)
        n_kv = int(getattr(cfg, "num_key_value_heads", None) or n_heads)
        n_layers = int(cfg.num_hidden_layers)
        intermediate = int(cfg.intermediate_size)
    except (AttributeError, TypeError) as exc:
        raise ModelStructureError(f"config lacks a geometry field: {exc}") from exc
    head_dim = getattr(cfg, "head_dim", None) or hidden // n_heads
    if n_heads % n_kv:
        raise ModelStructureError(f"num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_kv}")
    return ModelDims(n_layers, hidden, n_heads, n_kv, int(head_dim), intermediate)


# ----------------------------------------------------------------------------- modules


@dataclass(frozen=True)
class AttentionParts:
    """A layer's attention module, its q/k/v/o linears and optional per-head q/k norms (pre-RoPE)."""

    module: nn.Module
    q: nn.Module
    k: nn.Module
    v: nn.Module
    o: nn.Module
    q_norm: nn.Module | None
    k_norm: nn.Module | None
    norm_heads_first: bool = False

    @property
    def qk_norms(self) -> tuple[nn.Module | None, nn.Module | None]:
        """(q norm, k norm): the per-head norms before RoPE, None where the architecture has none."""
        return self.q_norm, self.k_norm

    @property
    def head_dim(self) -> int | None:
        """head_dim as the module itself uses it (None when it does not say)."""
        value = getattr(self.module, "head_dim", None)
        return None if value is None else int(value)

    @property
    def layer_idx(self) -> int | None:
        value = getattr(self.module, "layer_idx", None)
        return None if value is None else int(value)

    def pre_rope(self, stream: str) -> tuple[nn.Module, bool]:
        """The module whose output is the pre-RoPE query ("q") or key ("k"), and whether that output is
        per head, (..., L, H, head_dim) (a q/k norm; (b, H, L, head_dim) when :attr:`norm_heads_first`),
        rather than (..., H*head_dim) (the projection)."""
        if stream not in ("q", "k"):
            raise ValueError(f"stream must be 'q' or 'k', got {stream!r}")
        norm = self.q_norm if stream == "q" else self.k_norm
        if norm is not None:
            return norm, True
        return (self.q if stream == "q" else self.k), False


@dataclass(frozen=True)
class MLPParts:
    """A layer's gated MLP: gate/up read the residual stream, down writes it."""

    module: nn.Module
    gate: nn.Module
    up: nn.Module
    down: nn.Module


@dataclass(frozen=True)
class LayerNorms:
    """A layer's norms by role; ``post_*`` are sandwich norms (None for pre-norm-only families)."""

    pre_attn: nn.Module
    pre_mlp: nn.Module
    post_attn: nn.Module | None = None
    post_mlp: nn.Module | None = None


def base_model(model: Any) -> nn.Module:
    """The decoder stack (embeddings, layers, final norm, rotary module) of a causal LM."""
    spec = spec_for(model)
    return _get(model, spec.base, type(model).__name__)


def decoder_layers(model: Any) -> nn.ModuleList:
    """The decoder layers, in order (a non-empty ModuleList)."""
    from torch import nn

    spec = spec_for(model)
    layers = getattr(base_model(model), spec.layers, None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ModelStructureError(
            f"model type {spec.model_type!r}: no decoder layer list at {spec.base}.{spec.layers}")
    return layers


def _layer(model: Any, i: int) -> nn.Module:
    return decoder_layers(model)[i]


def attention(model: Any, i: int) -> AttentionParts:
    """Layer ``i``'s attention parts (q/k/v/o checked to be present)."""
    spec = spec_for(model)
    where = f"layers.{i}.{spec.attn}"
    attn = _get(_layer(model, i), spec.attn, f"layers.{i}")
    q, k, v, o = (_get(attn, n, where) for n in (spec.q, spec.k, spec.v, spec.o))
    qn = getattr(attn, spec.q_norm, None) if spec.q_norm else None
    kn = getattr(attn, spec.k_norm, None) if spec.k_norm else None
    return AttentionParts(attn, q, k, v, o, qn, kn, spec.qk_norm_heads_first)


def attention_modules(model: Any) -> list[AttentionParts]:
    """Every layer's attention parts, in layer order."""
    return [attention(model, i) for i in range(len(decoder_layers(model)))]


def mlp_parts(model: Any, i: int) -> MLPParts:
    """Layer ``i``'s MLP parts."""
    spec = spec_for(model)
    m = _get(_layer(model, i), spec.mlp, f"layers.{i}")
    where = f"layers.{i}.{spec.mlp}"
    return MLPParts(m, *(_get(m, n, where) for n in (spec.gate, spec.up, spec.down)))


def layer_norms(model: Any, i: int) -> LayerNorms:
    """Layer ``i``'s norms by role."""
    spec = spec_for(model)
    layer, where = _layer(model, i), f"layers.{i}"
    post = [None if n is None else _get(layer, n, where) for n in (spec.post_attn_norm, spec.post_mlp_norm)]
    return LayerNorms(_get(layer, spec.pre_attn_norm, where), _get(layer, spec.pre_mlp_norm, where), *post)


def final_norm(model: Any) -> nn.Module:
    """The norm applied after the last layer (feeds lm_head)."""
    spec = spec_for(model)
    return _get(base_model(model), spec.final_norm, spec.base)


def embeddings(model: Any) -> nn.Module:
    """The token embedding module."""
    spec = spec_for(model)
    return _get(base_model(model), spec.embed, spec.base)


def lm_head(model: Any) -> nn.Module:
    """The output projection (hidden → vocab)."""
    spec = spec_for(model)
    return _get(model, spec.lm_head, type(model).__name__)


def embeddings_tied(model: Any) -> bool:
    """True when lm_head and the embeddings share storage."""
    emb, head = embeddings(model).weight, lm_head(model).weight
    return head is emb or head.data_ptr() == emb.data_ptr()


def norm_weight_offset(model: Any) -> float:
    """The RMSNorm scale is ``offset + weight`` (0 for Llama-style norms, 1 for Gemma's)."""
    return spec_for(model).norm_offset


def fusable_norms(model: Any) -> list[tuple[str, nn.Module, list[nn.Module]]]:
    """(qualified name, norm, linears it feeds) for every norm whose scale can move into the next linears.

    Pre-attention norm → q, k, v; pre-MLP norm → gate, up; final norm → lm_head. Sandwich norms are not
    listed: their output goes to the residual add, not into a linear.
    """
    spec = spec_for(model)
    out: list[tuple[str, nn.Module, list[nn.Module]]] = []
    for i in range(len(decoder_layers(model))):
        a, m, n = attention(model, i), mlp_parts(model, i), layer_norms(model, i)
        out.append((f"layers.{i}.{spec.pre_attn_norm}", n.pre_attn, [a.q, a.k, a.v]))
        out.append((f"layers.{i}.{spec.pre_mlp_norm}", n.pre_mlp, [m.gate, m.up]))
    out.append((spec.final_norm, final_norm(model), [lm_head(model)]))
    return out


# ----------------------------------------------------------------------------- RoPE


def rotary_modules(model: Any) -> list[nn.Module]:
    """The rotary-embedding module(s) the layers use (one shared module for every registered family)."""
    spec = spec_for(model)
    return [_get(base_model(model), spec.rotary, spec.base)]


def _layer_type(model: Any, i: int) -> str:
    types = getattr(text_config(model), "layer_types", None)
    if not types or i >= len(types):
        raise ModelStructureError(f"model type {spec_for(model).model_type!r}: config.layer_types has no entry {i}")
    return str(types[i])


def layer_inv_freq(model: Any, i: int, head_dim: int | None = None) -> tuple[np.ndarray, str]:
    """Layer ``i``'s RoPE ``inv_freq`` (float64) and the buffer it came from.

    Raises :class:`rope_quant.core.rope.MissingInvFreqError` / ``AmbiguousInvFreqError`` as
    :func:`rope_quant.core.rope.find_inv_freq` does.
    """
    spec = spec_for(model)
    n_layers = len(decoder_layers(model))
    if not 0 <= i < n_layers:
        raise ModelStructureError(f"layer {i} is outside 0..{n_layers - 1}")
    rotary = rotary_modules(model)[0]
    prefix = f"{spec.base}.{spec.rotary}"
    if spec.inv_freq_by_layer_type:
        name = f"{_layer_type(model, i)}_inv_freq"
        buf = getattr(rotary, name, None)
        if not hasattr(buf, "detach") or buf.is_meta:
            raise rope.MissingInvFreqError(f"no materialised buffer {prefix}.{name} for layer {i}")
        values = buf.detach().cpu().double().numpy().reshape(-1)
        if head_dim is not None and values.size != rope.check_head_dim(head_dim):
            raise rope.MissingInvFreqError(f"{prefix}.{name} has length {values.size}, expected {head_dim // 2}")
        return values.copy(), f"{prefix}.{name}"
    values, name = rope.find_inv_freq(rotary, head_dim=head_dim)
    return values, f"{prefix}.{name}"


def shared_inv_freq(model: Any, head_dim: int | None = None) -> tuple[np.ndarray, str]:
    """The one ``inv_freq`` every layer uses; AmbiguousInvFreqError when layers differ (per-type bases)."""
    per_layer = [layer_inv_freq(model, i, head_dim) for i in range(len(decoder_layers(model)))]
    values, source = per_layer[0]
    distinct = {s for v, s in per_layer if not np.array_equal(v, values)}
    if distinct:
        raise rope.AmbiguousInvFreqError(
            f"layers use different RoPE frequencies ({source} and {', '.join(sorted(distinct))}); "
            "use layer_inv_freq(model, i) per layer"
        )
    return values, source


def inv_freq_by_layer(model: Any, head_dim: int | None = None) -> tuple[np.ndarray, tuple[str, ...]]:
    """Every layer's RoPE ``inv_freq`` as one (n_layers, K) float64 array, and each row's source buffer.

    For a one-base family every row is the shared buffer; for Gemma 3 the sliding-window layers read
    ``sliding_attention_inv_freq`` (θ = 1e4) and the full-attention layers ``full_attention_inv_freq`` (1e6).
    """
    rows = [layer_inv_freq(model, i, head_dim) for i in range(len(decoder_layers(model)))]
    return np.stack([v for v, _ in rows]), tuple(s for _, s in rows)


def describe_sources(sources: tuple[str, ...] | list[str]) -> str:
    """One line naming each distinct source buffer and the layers that read it (records, logs)."""
    by: dict[str, list[int]] = {}
    for i, s in enumerate(sources):
        by.setdefault(s, []).append(i)
    if len(by) == 1:
        return next(iter(by))
    return "; ".join(f"{s} (layers {','.join(map(str, layers))})" for s, layers in by.items())


# ----------------------------------------------------------------------------- linears


def layer_linear_groups(model: Any) -> tuple[tuple[str, ...], ...]:
    """The decoder-layer linears in execution order, as names relative to a layer."""
    return spec_for(model).linear_groups()


def decoder_linears(model: Any) -> Iterator[tuple[str, nn.Linear]]:
    """``(f"layers.{i}.{name}", linear)`` for every nn.Linear inside the decoder layers."""
    from torch import nn

    for li, layer in enumerate(decoder_layers(model)):
        for n, m in layer.named_modules():
            if isinstance(m, nn.Linear):
                yield f"layers.{li}.{n}", m


# ----------------------------------------------------------------------------- function preservation


def rotation_refusal(model: Any, rotation: str) -> str | None:
    """Why ``rotation`` ("r1" | "r2" | "r4") would not be function-preserving here; None when it is.

    Derived from the structure: sandwich norms (a per-channel weight on the o_proj / down_proj output
    before the residual add) break R1, since a weighted RMSNorm does not commute with a rotation and
    its weight cannot be folded into a linear. Explicit ``ArchSpec.refused`` entries are added.
    """
    if rotation not in ROTATIONS:
        raise ValueError(f"unknown rotation {rotation!r}; expected one of {ROTATIONS}")
    spec = spec_for(model)
    reasons = [reason for rot, reason in spec.refused if rot == rotation]
    sandwich = [n for n in (spec.post_attn_norm, spec.post_mlp_norm) if n is not None]
    if rotation == "r1" and sandwich:
        reasons.append(
            f"{spec.model_type} has sandwich norms ({', '.join(sandwich)}) that scale the "
            f"{spec.o} / {spec.down} outputs per channel before the residual add; R1 rotates those outputs, "
            "and a weighted RMSNorm neither commutes with a rotation nor folds into a linear"
        )
    return "; ".join(reasons) or None

"""Online R3 and the KV quantiser inside attention (paper §3, Fig. 1; DartQuant-style W4A4KV4 pipeline).

The only place that touches transformers' attention. A custom attention function is registered through
the library's attention interface (``transformers.AttentionInterface`` on 4.51+, the
``ALL_ATTENTION_FUNCTIONS`` mapping on 4.48–4.50) and selected per model with
``model.set_attn_implementation`` (4.57+) or ``config._attn_implementation``. No modeling file is copied
and no module global is replaced.

The function receives the post-RoPE ``query`` (b, H_q, L, d) and ``key`` (b, H_kv, L_kv, d) before the GQA
repeat, once per layer. It reads the layer's :class:`AttentionState` from ``module.rq_attention`` (state
lives on the model, never in globals), then

1. applies the layer's R3 transform to q and k (``apply_query`` / ``apply_key`` when the transform has them,
   else ``apply`` to both; ``x -> M_h x`` per head; q heads of a GQA group use their KV head's matrix, which
   the transform derives from the tensor's head count): since ``(M_q q)^T (M_k k) = q^T k`` for
   ``M_q = M_k^{-T}`` (orthogonal ``M``: the same matrix), the logits are unchanged in exact arithmetic; then,
   in a cell that simulates llama.cpp (``runtime_rotation``, or a ggml K format), q and k in the runtime's
   element order and, with ``runtime_rotation`` on, llama.cpp's own online Hadamard on them
   (:mod:`.runtime_rotation`);
2. streams K diagnostics on the post-R3 keys of the new tokens (before quantisation);
3. fake-quantises K and V per token per head (asymmetric dynamic INT-b, group = head_dim by default),
   or with the static per-channel control (App. A.6, D) when one is installed, or K with the layer's key
   quantiser from :mod:`rope_quant.quant.keys` when the cell names another (``kivi``,
   ``kvquant_prerope``, ``rope_pair_bits``, ``sink``, ``per_token_window``): on the post-R3 key. A ``pre_rope``
   quantiser (``kvquant_prerope``) undoes RoPE itself at the keys' positions (``position_ids`` of the new
   tokens, else 0..T-1), quantises, and re-applies RoPE: with an R3 that commutes with RoPE (a foldable one) it
   gets the post-R3 key, whose pre-RoPE form is the key of W_K with R3 folded in; with an online R3 (Hadamard)
   it gets the post-RoPE key before R3, and R3 then acts on the result;
4. calls the library's SDPA function.

With a KV cache the function sees the whole cache (stored un-rotated, un-quantised) at every step and
re-applies R3 and the per-token quantiser to it: both are token-local, so this equals quantising each
token once when it enters the cache. A streaming key quantiser (KIVI's and KVQuant's groups of G tokens,
quantised once complete and, for KIVI, outside the full-precision window) depends on the cache length: at
one new token the cache's state is exact as well; over many new tokens (a window's forward) every query is
given the state of the cache at its own length, by attending over [K̂; K] (the quantised and the full-precision
copy) with a mask that lets query i see key j's quantised copy exactly when j lies in the quantised prefix
at length i + 1 (twice the keys and a dense mask for that forward; the softmax equals the per-query one).

Calibration mode (:func:`calibration_hooks`) streams the pre-RoPE q/k (projection or q/k-norm outputs) into
:class:`rope_quant.calib.stats.CalibrationStats` through forward hooks that are removed afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from rope_quant.core import rope
from rope_quant.model import arch
from rope_quant.quant import diagnostic as qdiag
from rope_quant.quant.quantizers import QuantConfig, fake_quant, selected_step
from rope_quant.rotations.runtime_rotation import (
    RuntimeRotationError,
    apply_runtime_rotation,
    runtime_block,
    runtime_row_order,
)

__all__ = [
    "ATTN_NAME",
    "STATE_ATTR",
    "KV_OFF",
    "AttentionWrapError",
    "UnsupportedAttentionError",
    "AttentionGeometry",
    "AttentionState",
    "register_attention",
    "check_model",
    "attention_modules",
    "attention_states",
    "install_attention",
    "uninstall_attention",
    "set_attn_implementation",
    "calibration_hooks",
    "rq_attention_forward",
]

#: Name under which the attention function is registered in transformers' attention interface.
ATTN_NAME = "rq_sdpa"
#: Attribute of each attention module that holds its :class:`AttentionState`.
STATE_ATTR = "rq_attention"
#: A quantiser that is off (bits 16): the default K and V setting.
KV_OFF = QuantConfig()


class AttentionWrapError(ValueError):
    """The model's attention cannot be wrapped by rope_quant."""


class UnsupportedAttentionError(AttentionWrapError):
    """The model type's attention lacks what the wrapper needs (a family registered in
    :mod:`rope_quant.model.arch` with q/k/v projections and ``layer_idx``, a config with
    ``_attn_implementation`` plumbing, a transformers version with an attention registry)."""


# ----------------------------------------------------------------------------- state


@dataclass
class AttentionState:
    """Per-layer configuration read by the attention function (stored on the attention module).

    ``transform``: an :class:`rope_quant.core.transforms.R3Transform` (or any object with ``apply``), None = off.
    ``k``/``v``: the dynamic per-token K and V quantisers (bits >= 16, the default, means no
    quantisation; groups of -1 are whole heads). ``k_static``/``v_static``: optional static
    per-channel quantisers (App. A.6, D) used instead of the dynamic per-token ones.
    ``diagnostics``: a :class:`rope_quant.calib.diagnostics.KDiagnostics`-like object with ``update(k)``.
    ``observers``: callables ``fn(layer_idx, key, value)`` seeing post-R3, pre-quantisation K and V of the
    new tokens (used to calibrate the static control).
    ``key_quant``: a :class:`rope_quant.quant.keys.KeyQuantizer` used for K instead of ``k``
    (None, the default: ``k``, the paper's per-token rule, exactly as before).
    ``runtime_block``: the order of llama.cpp's online Hadamard on q and k after R3 (None, the default: off).
    ``runtime_order``: the model family's permutation into llama.cpp's K row
    (:func:`~rope_quant.rotations.runtime_rotation.runtime_row_order`; None: the same order), used when the cell
    simulates the runtime (:attr:`simulates_runtime`).
    """

    layer_idx: int
    transform: Any = None
    k: QuantConfig = field(default_factory=QuantConfig)
    v: QuantConfig = field(default_factory=QuantConfig)
    k_static: Any = None
    v_static: Any = None
    diagnostics: Any = None
    observers: list[Callable[[int, torch.Tensor, torch.Tensor], None]] = field(default_factory=list)
    enabled: bool = True
    key_quant: Any = None
    runtime_block: int | None = None
    runtime_order: torch.Tensor | None = None

    @property
    def simulates_runtime(self) -> bool:
        """The cell stands for llama.cpp's K cache: its online rotation on, or a ggml K format."""
        return self.runtime_block is not None or bool(getattr(self.key_quant, "runtime_row", False))

    @property
    def k_bits(self) -> int:
        return self.k.bits

    @property
    def v_bits(self) -> int:
        return self.v.bits


@dataclass(frozen=True)
class AttentionGeometry:
    """Shapes of a wrappable model's attention."""

    n_layers: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int


# ----------------------------------------------------------------------------- the attention function


def _sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def _apply_quant(x: torch.Tensor, spec: QuantConfig, static: Any, stream: str = "k") -> torch.Tensor:
    if static is not None:
        y = static(x)
        if qdiag.active() is not None and hasattr(static, "step"):
            qdiag.observe(stream, qdiag.Rule.STATIC, x, y, static.step)
        return y
    if not spec.enabled:
        return x
    y = fake_quant(x, spec)
    if qdiag.active() is not None:  # App. E diagnostic (read-only)
        qdiag.observe(stream, qdiag.Rule.DYNAMIC, x, y, lambda: selected_step(x, spec))
    return y


def rq_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, **kwargs: Any):
    """Attention function: R3 on post-RoPE q/k, K diagnostics, K/V fake-quant, then the library's SDPA."""
    state: AttentionState | None = getattr(module, STATE_ATTR, None)
    if state is not None and state.enabled:
        post_rope = key
        if state.transform is not None:  # q and k may get different maps (M_q = M_k^{-T}); default: both apply()
            tr = state.transform
            query = getattr(tr, "apply_query", tr.apply)(query)
            key = getattr(tr, "apply_key", tr.apply)(key)
        if state.runtime_order is not None and state.simulates_runtime:  # llama.cpp's K row order
            query, key = query[..., state.runtime_order], key[..., state.runtime_order]
        if state.runtime_block is not None:  # llama.cpp's online Hadamard of a quantised K cache, after R3
            query = apply_runtime_rotation(query, state.runtime_block)
            key = apply_runtime_rotation(key, state.runtime_block)
        n_new = query.shape[-2]
        if state.diagnostics is not None or state.observers:
            k_new, v_new = key[..., -n_new:, :], value[..., -n_new:, :]
            if state.diagnostics is not None:
                state.diagnostics.update(k_new, layer=state.layer_idx)
            for fn in state.observers:
                fn(state.layer_idx, k_new, v_new)
        if state.key_quant is not None:
            value = _apply_quant(value, state.v, state.v_static, "v")
            return _key_quant_attention(module, state, query, post_rope, key, value, attention_mask, kwargs)
        key = _apply_quant(key, state.k, state.k_static, "k")
        value = _apply_quant(value, state.v, state.v_static, "v")
    return _sdpa()(module, query, key, value, attention_mask, **kwargs)


def _key_positions(kwargs: dict[str, Any], n_new: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """Positions of the cache's keys, (b or 1, kv_len): the new tokens' ``position_ids`` continued backwards
    over the cache (left padding included), else 0..kv_len-1."""
    base = torch.arange(kv_len, device=device).unsqueeze(0)
    pid = kwargs.get("position_ids")
    if not torch.is_tensor(pid) or pid.dim() != 2 or pid.shape[-1] != n_new:
        return base
    return base + (pid[:, :1].to(device) - (kv_len - n_new))


def _key_quant_attention(module: nn.Module, state: AttentionState, query: torch.Tensor, post_rope: torch.Tensor,
                         key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                         kwargs: dict[str, Any]):
    """SDPA with the layer's key quantiser (``key``: the post-R3 key; ``post_rope``: the key before R3)."""
    kq = state.key_quant
    if kq.pre_rope and state.runtime_block is not None:
        raise AttentionWrapError(f"{kq.name} quantises the key before RoPE; llama.cpp's runtime rotation acts on "
                                 "the post-RoPE key it stores: the two do not combine")
    positions = _key_positions(kwargs, query.shape[-2], key.shape[-2], key.device) if kq.needs_positions else None
    tr = state.transform
    if kq.pre_rope and tr is not None and not getattr(tr, "commutes_with_rope", False):
        # an online R3 acts after RoPE: quantised before RoPE (inside the quantiser), then R3 on the re-rotated key
        k_hat = getattr(tr, "apply_key", tr.apply)(kq(post_rope, positions))
    elif kq.pre_rope:
        # no R3, or one that commutes with RoPE: R3·RoPE(k) = RoPE(R3·k), the key of W_K with R3 folded in, so the
        # quantiser undoes RoPE on the post-R3 key and quantises the folded pre-RoPE key (as a deployment would)
        k_hat = kq(key, positions)
    else:
        k_hat = kq(key, positions)
    if not kq.streaming:
        return _sdpa()(module, query, k_hat, value, attention_mask, **kwargs)
    return _streaming_sdpa(module, query, k_hat, key, value, attention_mask, kq, kwargs)


def _streaming_sdpa(module: nn.Module, query: torch.Tensor, k_hat: torch.Tensor, k_fp: torch.Tensor,
                    value: torch.Tensor, attention_mask: torch.Tensor | None, kq: Any, kwargs: dict[str, Any]):
    """Each query sees the cache as it stood at its own length: keys of the quantised prefix at that length from
    ``k_hat``, the others from ``k_fp`` (module docstring)."""
    n_new, kv_len = query.shape[-2], k_fp.shape[-2]
    prefix = kq.quantized_prefix(torch.arange(kv_len - n_new + 1, kv_len + 1))  # per query, on the host
    first, last = int(prefix[0]), int(prefix[-1])
    if first == last:  # one state for every query (a decode step, or no group completed in this forward)
        key = k_fp if last == 0 else torch.cat([k_hat[..., :last, :], k_fp[..., last:, :]], dim=-2)
        return _sdpa()(module, query, key, value, attention_mask, **kwargs)
    device = query.device
    use_q = (torch.arange(kv_len)[None, :] < prefix[:, None]).to(device)  # (n_new, kv_len)
    if attention_mask is None:
        causal = kwargs.get("is_causal")
        if causal is None:
            causal = getattr(module, "is_causal", True)
        rows = torch.arange(kv_len - n_new, kv_len, device=device)[:, None]
        base = torch.arange(kv_len, device=device)[None, :] <= rows if causal else torch.ones_like(use_q)
        base = base[None, None]
    else:
        base = attention_mask[..., :kv_len]
        base = base.expand(*base.shape[:-2], n_new, kv_len)
    if base.dtype == torch.bool:
        mask = torch.cat([base & use_q, base & ~use_q], dim=-1)
    else:  # an additive float mask
        neg = torch.finfo(base.dtype).min
        mask = torch.cat([base.masked_fill(~use_q, neg), base.masked_fill(use_q, neg)], dim=-1)
    rest = {k: v for k, v in kwargs.items() if k != "is_causal"}
    return _sdpa()(module, query, torch.cat([k_hat, k_fp], dim=-2), torch.cat([value, value], dim=-2), mask, **rest)


def register_attention(name: str = ATTN_NAME) -> str:
    """Register :func:`rq_attention_forward` (and the SDPA mask builder) under ``name``; idempotent."""
    import transformers

    if hasattr(transformers, "AttentionInterface"):  # 4.51+
        transformers.AttentionInterface.register(name, rq_attention_forward)
    else:  # 4.48-4.50
        try:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        except ImportError as exc:
            raise UnsupportedAttentionError(
                f"transformers {transformers.__version__} has no attention registry; rope_quant needs >= 4.48"
            ) from exc
        ALL_ATTENTION_FUNCTIONS[name] = rq_attention_forward
    # Masks: build the same (padding-aware) masks as SDPA; without this, newer versions pass mask=None.
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError:  # older versions build masks from the implementation name's family
        return name
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return name


# ----------------------------------------------------------------------------- model checks


def _config(model: nn.Module):
    cfg = getattr(model, "config", None)
    if cfg is None:
        raise UnsupportedAttentionError(f"{type(model).__name__} has no config")
    return cfg


def _parts(model: nn.Module) -> list[arch.AttentionParts]:
    """Every layer's attention parts from the architecture adapter, as UnsupportedAttentionError on failure."""
    mtype = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    try:
        parts = arch.attention_modules(model)
    except arch.ArchitectureError as exc:
        detail = str(exc) if isinstance(exc, arch.UnsupportedModelTypeError) else f"model type {mtype!r}: {exc}"
        raise UnsupportedAttentionError(detail) from exc
    for i, p in enumerate(parts):
        if p.layer_idx is None:
            raise UnsupportedAttentionError(f"model type {mtype!r}: the attention of layer {i} has no layer_idx")
        if p.layer_idx != i:
            raise UnsupportedAttentionError(
                f"model type {mtype!r}: the attention of layer {i} has layer_idx {p.layer_idx}")
    return parts


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The decoder layers' attention modules, in layer order; raise if the model cannot be wrapped."""
    return [p.module for p in _parts(model)]


def check_model(model: nn.Module) -> AttentionGeometry:
    """Check that ``model`` can be wrapped and return its geometry.

    Raises :class:`UnsupportedAttentionError` (unregistered model type, missing projections, no
    ``_attn_implementation``), :class:`rope_quant.core.rope.OddHeadDimError` (odd head_dim) or
    :class:`rope_quant.core.rope.MissingInvFreqError` (no RoPE / no materialised ``inv_freq``).
    """
    cfg = _config(model)
    parts = _parts(model)
    if not hasattr(cfg, "_attn_implementation"):
        raise UnsupportedAttentionError(
            f"{type(cfg).__name__} has no _attn_implementation: this transformers model does not dispatch "
            "attention through the attention interface"
        )
    first = parts[0]
    head_dim = first.head_dim or arch.dims(model).head_dim
    rope.check_head_dim(int(head_dim))
    q_out, k_out = first.q.out_features, first.k.out_features
    n_q, n_kv = q_out // head_dim, k_out // head_dim
    if n_q * head_dim != q_out or n_kv * head_dim != k_out:
        raise UnsupportedAttentionError(
            f"q/k projection widths {q_out}/{k_out} are not multiples of head_dim {head_dim}")
    if n_kv == 0 or n_q % n_kv:
        raise UnsupportedAttentionError(f"{n_q} query heads are not a multiple of {n_kv} KV heads")
    for i in range(len(parts)):  # raises MissingInvFreqError / AmbiguousInvFreqError
        arch.layer_inv_freq(model, i, head_dim=int(head_dim))
    return AttentionGeometry(len(parts), n_q, n_kv, int(head_dim))


def set_attn_implementation(model: nn.Module, name: str) -> None:
    """Select an attention implementation: ``set_attn_implementation`` (4.57+) or the config field."""
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        setter(name)
    else:
        model.config._attn_implementation = name
    if getattr(model.config, "_attn_implementation", None) != name:
        raise UnsupportedAttentionError(
            f"could not select attention implementation {name!r} on {type(model).__name__} "
            f"(it is {getattr(model.config, '_attn_implementation', None)!r})"
        )


# ----------------------------------------------------------------------------- install / uninstall


def install_attention(model: nn.Module, transforms: Sequence[Any] | None = None, *,
                      k: QuantConfig = KV_OFF, v: QuantConfig = KV_OFF,
                      k_static: Sequence[Any] | None = None, v_static: Sequence[Any] | None = None,
                      diagnostics: Any = None, key_quant: Sequence[Any] | None = None,
                      runtime_rotation: bool = False, name: str = ATTN_NAME) -> list[AttentionState]:
    """Attach an :class:`AttentionState` to every layer's attention and select the custom function.

    ``k``/``v``: the dynamic K and V quantisers (default off). ``transforms``/``k_static``/``v_static``/
    ``key_quant`` (a :class:`~rope_quant.quant.keys.KeyQuantizer` used for K instead of ``k``):
    one entry per layer (or None). ``runtime_rotation``: llama.cpp's online Hadamard on q and k after R3 (an
    :class:`AttentionWrapError` where the runtime skips the head dimension). Returns the states, which
    callers may edit in place (e.g. swap ``diagnostics``). The previous implementation is remembered on
    the model for :func:`uninstall_attention`.
    """
    geom = check_model(model)
    mods = attention_modules(model)
    for what, seq in (("transforms", transforms), ("k_static", k_static), ("v_static", v_static),
                      ("key_quant", key_quant)):
        if seq is not None and len(seq) != geom.n_layers:
            raise AttentionWrapError(
                f"{what}: expected {geom.n_layers} entries (one per layer), got {len(seq)}")
    for spec, what in ((k, "k"), (v, "v")):
        if not isinstance(spec, QuantConfig):
            raise AttentionWrapError(f"{what} must be a QuantConfig, got {type(spec).__name__}")
    if key_quant is not None and k_static is not None:
        raise AttentionWrapError("key_quant and k_static both replace the K quantiser: give one")
    try:
        block = runtime_block(geom.head_dim) if runtime_rotation else None
    except RuntimeRotationError as exc:
        raise AttentionWrapError(str(exc)) from None
    order = runtime_row_order(geom.head_dim, arch.spec_for(model).gguf_pairs_interleaved)
    if order is not None:  # on the model's device once, not per forward
        order = order.to(next(model.parameters()).device)
    register_attention(name)
    states = []
    for i, mod in enumerate(mods):
        st = AttentionState(
            layer_idx=i, transform=None if transforms is None else transforms[i],
            k=k, v=v,
            k_static=None if k_static is None else k_static[i],
            v_static=None if v_static is None else v_static[i],
            diagnostics=diagnostics, key_quant=None if key_quant is None else key_quant[i], runtime_block=block,
            runtime_order=order,
        )
        setattr(mod, STATE_ATTR, st)
        states.append(st)
    current = model.config._attn_implementation
    if current != name and not hasattr(model, "rq_previous_attn"):
        model.rq_previous_attn = current
    set_attn_implementation(model, name)
    return states


def attention_states(model: nn.Module) -> list[AttentionState]:
    """The installed per-layer states (empty list when none is installed)."""
    return [s for s in (getattr(m, STATE_ATTR, None) for m in attention_modules(model)) if s is not None]


def uninstall_attention(model: nn.Module) -> None:
    """Remove the states and restore the previous attention implementation (default ``sdpa``)."""
    for mod in attention_modules(model):
        if hasattr(mod, STATE_ATTR):
            delattr(mod, STATE_ATTR)
    previous = getattr(model, "rq_previous_attn", None) or "sdpa"
    set_attn_implementation(model, previous)
    if hasattr(model, "rq_previous_attn"):
        del model.rq_previous_attn


@contextlib.contextmanager
def calibration_hooks(model: nn.Module, stats: Any) -> Iterator[Any]:
    """Collect mode: stream pre-RoPE queries/keys into ``stats`` (a CalibrationStats).

    Forward hooks (public API) are registered on every layer's pre-RoPE q/k module and removed on exit.
    """
    from rope_quant.calib.stats import register_projection_hooks

    check_model(model)
    handles = register_projection_hooks(model, stats)
    try:
        yield stats
    finally:
        for h in handles:
            h.remove()

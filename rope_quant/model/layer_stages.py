"""A decoder layer run in two stages: the attention block, then the MLP block.

Part of the architecture adapter: the parts come from :mod:`rope_quant.model.arch` (which alone knows the
attribute names); this module knows the residual layout every registered family shares (``ArchSpec.staged``)::

    r = x + post_attn(attention(pre_attn(x)))      # post_attn: Gemma 3's sandwich norm, identity elsewhere
    y = r + post_mlp(mlp(pre_mlp(r)))              # post_mlp: likewise

Each piece is the layer's own module called as the layer calls it (``self_attn(hidden_states=..., **kwargs)``,
``mlp(h)``, ``o_proj(a)``, ``down_proj(d)``), so hooks installed on the attention, the MLP or their linears
(the online R4 Hadamard, the activation quantisers, GPTQ's Hessian hooks) run exactly as in the layer's forward;
q/k norms (Qwen3, Gemma 3) and RoPE run inside the attention module. What the stages cannot reproduce, and
:func:`staging_refusal` therefore refuses: hooks on the decoder layer itself, positional inputs besides the
hidden states, and a family registered with ``staged=False``. GPTQ (:mod:`rope_quant.quant.gptq`) also checks
once per model that :meth:`LayerStages.forward` equals the layer's own forward before it relies on the stages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rope_quant.model import arch

__all__ = ["LayerStages", "layer_stages", "staging_refusal", "same_output"]


@dataclass(frozen=True)
class LayerStages:
    """The attention and MLP blocks of one decoder layer, with the norms that wrap them."""

    attention_parts: arch.AttentionParts
    mlp_parts: arch.MLPParts
    norms: arch.LayerNorms

    @property
    def o(self) -> nn.Module:
        return self.attention_parts.o

    @property
    def down(self) -> nn.Module:
        return self.mlp_parts.down

    def attention_input(self, x: torch.Tensor) -> torch.Tensor:
        """What q/k/v read: the pre-attention norm of the residual stream."""
        return self.norms.pre_attn(x)

    def attention(self, h: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
        """The attention module on ``h`` with the layer's keyword inputs (mask, RoPE, ...): o_proj's output."""
        out = self.attention_parts.module(hidden_states=h, **kwargs)
        return out[0] if isinstance(out, (tuple, list)) else out

    def attention_residual(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """The residual stream after the attention block (Gemma 3 normalises ``attn_out`` first)."""
        post = self.norms.post_attn
        return x + (attn_out if post is None else post(attn_out))

    def mlp_input(self, r: torch.Tensor) -> torch.Tensor:
        """What gate/up read: the pre-MLP norm of the residual stream."""
        return self.norms.pre_mlp(r)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.mlp_parts.module(h)

    def mlp_residual(self, r: torch.Tensor, mlp_out: torch.Tensor) -> torch.Tensor:
        """The layer's output (Gemma 3 normalises ``mlp_out`` first)."""
        post = self.norms.post_mlp
        return r + (mlp_out if post is None else post(mlp_out))

    def forward(self, x: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
        """The whole layer, block by block (equals the layer's forward: :func:`same_output`)."""
        r = self.attention_residual(x, self.attention(self.attention_input(x), kwargs))
        return self.mlp_residual(r, self.mlp(self.mlp_input(r)))


def staging_refusal(model: Any, i: int, args: tuple = ()) -> str | None:
    """Why layer ``i`` cannot be run in stages (with positional inputs ``args``), or None when it can."""
    spec = arch.spec_for(model)
    if not spec.staged:
        return f"model type {spec.model_type!r} is registered with staged=False"
    layer = arch.decoder_layers(model)[i]
    if layer._forward_pre_hooks or layer._forward_hooks:
        return f"layers.{i} carries hooks of its own (a staged forward would skip them)"
    if len(args) != 1:
        return f"layers.{i} receives {len(args)} positional inputs (the stages pass the hidden states only)"
    return None


def layer_stages(model: Any, i: int) -> LayerStages:
    """Layer ``i``'s stages (check :func:`staging_refusal` first)."""
    return LayerStages(arch.attention(model, i), arch.mlp_parts(model, i), arch.layer_norms(model, i))


def same_output(staged: torch.Tensor, whole: torch.Tensor, rtol: float = 1e-5) -> bool:
    """Whether a staged forward's output equals the layer's own (same modules in the same order: equal up to
    float rounding; a layout the stages do not reproduce differs by O(1))."""
    if staged.shape != whole.shape:
        return False
    scale = whole.detach().abs().max().clamp_min(1e-30)
    return bool(((staged - whole).abs().max() <= rtol * scale).item())

"""RoPE undone and redone at each key's position (KVQuant's pre-RoPE keys, Hooper et al. 2024, Sec. 3.2): the
rotation R_p and its inverse on (b, H, T, d) keys, angles in float64."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rope_quant.core.rope import check_head_dim, check_layout
from rope_quant.quant.keys.base import KeyQuantError, _work


def _rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position·θ_k, (b, 1, T, K), angles in float64."""
    ang = positions.to(torch.float64).unsqueeze(-1) * inv_freq.to(device=positions.device, dtype=torch.float64)
    return torch.cos(ang).to(dtype).unsqueeze(1), torch.sin(ang).to(dtype).unsqueeze(1)


def apply_rope(x: torch.Tensor, inv_freq: Any, positions: torch.Tensor, layout: str = "rotate_half",
               inverse: bool = False) -> torch.Tensor:
    """RoPE R_p on x (b, H, T, d) at ``positions`` (b or 1, T), or its inverse R_p^T (``inverse``).

    Pair k (channels a, b of ``layout``) turns by p·θ_k: a' = a cos − b sin, b' = b cos + a sin. Computed in x's
    working dtype (float32 for half inputs) with the angles in float64.
    """
    layout = check_layout(layout)
    freq = torch.as_tensor(np.asarray(inv_freq, dtype=np.float64)) if not torch.is_tensor(inv_freq) else inv_freq
    w = _work(x)
    k = check_head_dim(w.shape[-1])
    if freq.numel() != k:
        raise KeyQuantError(f"inv_freq has {freq.numel()} frequencies, the head has {k} pairs")
    cos, sin = _rope_cos_sin(freq.reshape(-1), positions.to(w.device), w.dtype)
    if inverse:
        sin = -sin
    if layout == "rotate_half":
        a, b = w[..., :k], w[..., k:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    a, b = w[..., 0::2], w[..., 1::2]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)

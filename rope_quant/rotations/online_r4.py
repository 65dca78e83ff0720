"""The online half of R4 (QuaRot §4): a normalised Hadamard on down_proj's input, as a forward pre-hook.

The offline half (``W_down ← W_down A``) is :func:`rope_quant.rotations.offline.apply_r4`, which installs this
hook. The hook is registered with ``prepend=True``: it must run before down_proj's input quantiser, which has
to see the rotated activation the fused weight expects. Hooks are not part of a state_dict, so a model rebuilt
from cached rotated weights gets the hook again with :func:`install_online_r4`. Each down_proj carries
``rq_online_r4`` (:data:`R4_FLAG`): ``"hook"`` (this hook) or ``"external"`` (the caller applies
:func:`online_r4` itself).
"""

from __future__ import annotations

import torch
from torch import nn

from rope_quant.core import hadamard
from rope_quant.model import arch
from rope_quant.rotations.errors import AlreadyRotatedError, UnsupportedArchitectureError

__all__ = ["R4_FLAG", "r4_matrix", "online_r4", "r4_rows", "down_projs", "install_online_r4"]

#: The attribute on each down_proj that says how its input gets R4.
R4_FLAG = "rq_online_r4"


def r4_matrix(n: int) -> torch.Tensor:
    """Matrix ``A`` (float64, n × n) with ``online_r4(x) == x @ A`` (``A = Hᵀ/√n`` of hadamard.py)."""
    return hadamard.hadamard_transform(torch.eye(n, dtype=torch.float64))


def online_r4(x: torch.Tensor) -> torch.Tensor:
    """The online half of R4: normalised Hadamard on the last dim (down_proj input), same dtype."""
    return hadamard.hadamard_transform(x)


def r4_rows(x: torch.Tensor) -> torch.Tensor:
    """:func:`online_r4` of a (rows, n) block as the Kronecker form ``(H_K/√K) · fwht(X)`` with the K-axis
    product as ONE matrix multiply (``hadamard_transform`` broadcasts a K × K factor over every row: slow when
    K is in the thousands, e.g. n = 2104 = 1052 · 2)."""
    rows, n = x.shape
    k, m = hadamard.hadamard_order(n)
    p = 1 << m
    y = x.reshape(rows, k, p)
    if p > 1:
        y = hadamard.fwht(y)
    if k == 1:
        return y.reshape(rows, n)
    hk = hadamard.hadamard_matrix(k, dtype=x.dtype, device=x.device) / k ** 0.5
    y = hk @ y.transpose(0, 1).reshape(k, rows * p)  # (k, rows·p)
    return y.reshape(k, rows, p).transpose(0, 1).reshape(rows, n)


def _r4_pre_hook(module: nn.Module, args: tuple) -> tuple:
    return (online_r4(args[0]),) + tuple(args[1:])


def down_projs(model: nn.Module) -> list[nn.Linear]:
    """Every decoder layer's down_proj, checked to be an ``nn.Linear``."""
    downs: list[nn.Linear] = []
    for i in range(len(arch.decoder_layers(model))):
        down = arch.mlp_parts(model, i).down
        if not isinstance(down, nn.Linear):
            raise UnsupportedArchitectureError(f"layer {i}: down_proj is not an nn.Linear")
        downs.append(down)
    return downs


def install_online_r4(model: nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
    """Register only the online half of R4 (pre-hook on every down_proj, ``prepend=True``).

    For a model whose down_proj weights already hold ``W A`` (e.g. rotated weights reloaded from a cache:
    hooks are not part of a state_dict). Raises AlreadyRotatedError where the hook is already installed.
    """
    downs = down_projs(model)
    if any(getattr(down, R4_FLAG, False) == "hook" for down in downs):
        raise AlreadyRotatedError("the online R4 hook is already installed on this model's down_proj")
    handles = []
    for down in downs:
        handles.append(down.register_forward_pre_hook(_r4_pre_hook, prepend=True))
        setattr(down, R4_FLAG, "hook")
    return handles

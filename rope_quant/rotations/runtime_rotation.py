"""llama.cpp's online rotation of a quantised K cache, as a switch of the simulator (``runtime_rotation``).

llama.cpp (the version llama-cpp-python 0.3.36 vendors: ``attn_rot_k`` in ``src/llama-kv-cache.cpp``,
``llama_mul_mat_hadamard`` in ``src/llama-graph.cpp``) multiplies Q and K after RoPE by a normalised Sylvester
Hadamard matrix whenever the K cache type is quantised and the head dimension is a multiple of 64; the order is the
largest power of two dividing the head dimension (64 for SmolLM2's 64, 256 for Gemma 3's 256, 64 for a head of
192), applied to each consecutive block of that many channels of every head. Q and K get the same orthogonal
symmetric matrix, so q·k is unchanged in exact arithmetic; only the quantised cache sees rotated keys. In the
attention (:mod:`rope_quant.rotations.attention`) it acts after RoPE and after the cell's R3, as in llama.cpp with
an R3 folded into the weights. ``LLAMA_ATTN_ROT_DISABLE=1`` is the runtime's switch off. llama.cpp also rotates a
quantised V cache (blocks of 64, the output rotated back): not simulated here (the runtime measurements keep V
at f16).

**The runtime's element order.** For a family whose llama.cpp rope rotates interleaved pairs (``llama``, Mistral:
``gguf_pairs_interleaved`` in :mod:`rope_quant.model.arch`), the GGUF's W_Q/W_K rows, and so the K rows llama.cpp
stores, hold a head as (x_0, x_{d/2}, x_1, x_{d/2+1}, …): pair i at elements 2i, 2i + 1. Its Hadamard and its
blocks of 32 act on that row. A cell that simulates the runtime (``runtime_rotation``, or a ggml K format) puts q and
k in that order first (:func:`runtime_row_order`); the same permutation of both leaves q·k unchanged. On SmolLM2
(e2e budget, seed 0, q4_0 keys, rotation off) this moves the simulated perplexity from 14.18 to 15.30 against
llama.cpp's 15.23: the blocks of the rotate_half order each hold one half of every pair.
"""

from __future__ import annotations

import torch

from rope_quant.core.hadamard import fwht

__all__ = ["RUNTIME_MULTIPLE", "RuntimeRotationError", "runtime_block", "runtime_row_order", "apply_runtime_rotation"]

#: llama.cpp rotates only when the head dimension is a multiple of this (``n_embd_head_k % 64 == 0``).
RUNTIME_MULTIPLE = 64


class RuntimeRotationError(ValueError):
    """A head dimension llama.cpp's rotation skips (not a multiple of 64)."""


def runtime_block(head_dim: int) -> int:
    """The order of llama.cpp's K rotation at ``head_dim``: the largest power of two dividing it (at least 64).

    :class:`RuntimeRotationError` when ``head_dim`` is not a positive multiple of 64: llama.cpp leaves such a cache
    unrotated, so a cell asking for the rotation there would simulate something the runtime never does."""
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % RUNTIME_MULTIPLE:
        raise RuntimeRotationError(
            f"runtime_rotation: llama.cpp rotates Q and K only when head_dim is a multiple of {RUNTIME_MULTIPLE}; "
            f"this model's head_dim is {head_dim!r}, so the runtime never rotates it (drop runtime_rotation)")
    n = RUNTIME_MULTIPLE
    while head_dim % (2 * n) == 0:
        n *= 2
    return n


def apply_runtime_rotation(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` (..., d) with each block of ``block`` channels multiplied by the normalised Sylvester Hadamard H_block
    (symmetric and orthogonal: applying it twice gives ``x`` back)."""
    d = x.shape[-1]
    if d % block:
        raise RuntimeRotationError(f"runtime_rotation: block {block} does not divide the head dimension {d}")
    return fwht(x.reshape(*x.shape[:-1], d // block, block)).reshape(x.shape)


def runtime_row_order(head_dim: int, pairs_interleaved: bool) -> torch.Tensor | None:
    """The permutation taking a head from transformers' rotate_half order to llama.cpp's K row: element j of the
    runtime's row is element ``order[j]`` of ours (interleaved pairs: 0, d/2, 1, d/2 + 1, …); None where the two
    orders agree (NEOX-rope families: Gemma 3, Qwen2/3)."""
    if not pairs_interleaved:
        return None
    half = torch.arange(head_dim // 2)
    return torch.stack([half, half + head_dim // 2], dim=1).reshape(-1)

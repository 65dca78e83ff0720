"""The cell's key quantisers, one per layer, from its ``k_quant`` option (:mod:`rope_quant.quant.keys`).

The default (``per_token``) builds nothing: the attention keeps the paper's path, bit for bit. Another option
is built per layer with the layer's RoPE frequencies (``kvquant_prerope``) and, for ``rope_pair_bits``, the
pair energies E[a² + b²] per (KV head, pair) of the keys it will quantise: measured on the post-R3 keys over
the calibration windows (:func:`key_pair_energies`, one extra forward pass), since an R3 that mixes pairs
(Hadamard) changes them; with no R3, or one that turns pairs only, they equal the pre-RoPE pair energies of the
calibration statistics.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from rope_quant.core.rope import pair_indices
from rope_quant.experiment.act_quant import forward_windows
from rope_quant.experiment.config import PipelineError, RunConfig
from rope_quant.model import arch
from rope_quant.quant import keys as keyq
from rope_quant.quant.quantizers import QuantConfig
from rope_quant.rotations import attention

__all__ = ["key_bits_per_element", "key_pair_energies", "key_quantizers"]

#: The RoPE layout of the keys the attention function sees (transformers' rotate_half; as the calibration).
LAYOUT = "rotate_half"


def key_pair_energies(model: nn.Module, geom: attention.AttentionGeometry, calib: torch.Tensor,
                      progress: bool = False) -> np.ndarray:
    """Mean E[a² + b²] of every (layer, KV head, RoPE pair) of the post-R3, unquantised keys over the
    calibration windows, (n_layers, H_kv, K) float64. The installed attention states are used as they are
    (their R3), with K quantisation off during the pass."""
    sums = [torch.zeros(geom.n_kv_heads, geom.head_dim, dtype=torch.float64) for _ in range(geom.n_layers)]
    rows = [0] * geom.n_layers

    def observe(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        sums[layer] += k.detach().double().pow(2).sum(dim=(0, 2)).cpu()
        rows[layer] += k.shape[0] * k.shape[2]

    states = attention.attention_states(model)
    saved = [(s.k, s.key_quant) for s in states]
    for s in states:
        s.k, s.key_quant = QuantConfig(), None  # off: observe unquantised keys
        s.observers.append(observe)
    try:
        forward_windows(model, calib, "key pair energies", progress)
    finally:
        for s, (k, kq) in zip(states, saved, strict=True):
            s.observers.remove(observe)
            s.k, s.key_quant = k, kq
    if min(rows) == 0:
        raise PipelineError("key pair energies: the calibration windows reached no attention layer")
    idx_a, idx_b = pair_indices(geom.head_dim, LAYOUT)
    out = np.stack([(s[:, idx_a] + s[:, idx_b]).numpy() / n for s, n in zip(sums, rows, strict=True)])
    if not np.all(np.isfinite(out)):
        bad = sorted({int(i) for i in np.argwhere(~np.isfinite(out))[:, 0]})
        raise PipelineError(f"key pair energies are non-finite in layer(s) {bad}")
    return out


def key_quantizers(model: nn.Module, cfg: RunConfig, geom: attention.AttentionGeometry,
                   calib: torch.Tensor | None, progress: bool = False) -> list[keyq.KeyQuantizer] | None:
    """One key quantiser per layer for ``cfg``'s ``k_quant`` option, or None for the default per-token rule.

    Each layer gets its own RoPE frequencies from the model (:func:`rope_quant.model.arch.inv_freq_by_layer`);
    ``calib``: the calibration windows (energies of ``rope_pair_bits``). Call with the cell's attention
    installed (its R3 in place)."""
    if cfg.quant.kq.is_default:
        return None
    option = cfg.quant.key_option()
    freq, _ = arch.inv_freq_by_layer(model, head_dim=geom.head_dim)
    energies: Any = [None] * geom.n_layers
    if option.needs_energies:
        if calib is None:
            raise PipelineError(f"k_quant={option.name} needs the calibration windows (pair energies)")
        check = getattr(option, "check_head_dim", None)
        try:
            if check is not None:
                check(geom.head_dim)
        except keyq.KeyQuantError as exc:
            raise PipelineError(str(exc)) from None
        energies = key_pair_energies(model, geom, calib, progress)
    try:
        return [option.build(keyq.KeyQuantContext(geom.head_dim, geom.n_kv_heads, freq[i], LAYOUT, energies[i]))
                for i in range(geom.n_layers)]
    except keyq.KeyQuantError as exc:
        raise PipelineError(str(exc)) from None


def key_bits_per_element(model: nn.Module, cfg: RunConfig, head_dim: int, seq_len: int) -> float | None:
    """The bits per key element the cell's key cache stores at T = ``seq_len`` (scales, zero points and
    full-precision tokens included: :meth:`~rope_quant.quant.keys.KeyQuantOption.bits_per_element`);
    for ``rope_pair_bits`` the calibrated widths of every layer and KV head installed in ``model``. None under the
    static per-channel control (its scales are per channel, not the option's)."""
    if cfg.quant.static_kv:
        return None
    option = cfg.quant.key_option()
    if not option.needs_energies:
        return float(option.bits_per_element(head_dim, seq_len))
    widths = [np.asarray(st.key_quant.widths) for st in attention.attention_states(model)
              if getattr(st.key_quant, "widths", None) is not None]
    if not widths:
        raise PipelineError(f"k_quant={option.name}: no calibrated widths are installed in the model")
    return float(option.bits_per_element(head_dim, seq_len, widths=np.stack(widths)))

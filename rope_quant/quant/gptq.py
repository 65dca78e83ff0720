"""GPTQ weight quantisation of a decoder, layer by layer (Frantar et al. 2022; the solve for one matrix is
:mod:`rope_quant.quant.gptq_solve`).

:func:`quantize_model_gptq` runs GPTQ layer by layer through a decoder: the inputs of layer 0 are captured
by a pre-hook that stops the forward, and every quantised layer is run to produce the next layer's inputs.
Inside a layer, linears are quantised in execution groups (``q/k/v``, ``o``, ``gate/up``, ``down``:
"true sequential"), so each group's Hessian comes from inputs that already pass through the quantised
earlier groups. The Hessian of each linear is accumulated by a forward pre-hook registered *after* any
hooks already on that linear: it therefore sees exactly what the linear sees, including the online R4
Hadamard on ``down_proj`` and the activation fake-quantiser when the pipeline has installed them (our
choice, recorded in the weight cache key). The attention's K/V quantisers and R3 are not active during
GPTQ: they depend on the R3 choice, which must not influence the weights (paired design).

Where the architecture adapter splits a layer (:mod:`rope_quant.model.layer_stages`), each window runs the
attention block once its q/k/v are quantised and the MLP once ``o_proj`` is (a staged forward); elsewhere it
falls back to whole-layer forwards per group, with a note. A layer's group forwards, factorisations and
error estimates read the device from the host a fixed number of times per layer
(tests/numerics/test_host_syncs.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from rope_quant.model import arch, layer_stages, offload
from rope_quant.quant import deferred, gptq_layer
from rope_quant.quant.gptq_solve import (  # noqa: F401 (the public ones re-exported: the solve's names as gptq's)
    GPTQ_CALLS,
    HessianAccumulator,
    _error_terms,
    _gptq_stacked,
    gptq_quantize,
    gptq_quantize_shared,
    loop_dtype,
)
from rope_quant.quant.packing import negzero_flag
from rope_quant.quant.rtn import (
    GPTQConfig,
    GPTQError,
    ScaleObjective,
    _check_bits,
    _decoder_layers,
    _record_codes,
)

log = logging.getLogger(__name__)

__all__ = [
    "resolve_objective",
    "HessianAccumulator",
    "LayerGroups",
    "gptq_quantize",
    "gptq_quantize_shared",
    "quantize_model_gptq",
    "GPTQ_CALLS",
]

#: Stop a decoder layer's forward once every linear of the group being quantised has seen its input (the
#: Hessians need nothing later; the weights are bit-identical either way, tests/numerics/test_gptq_speed.py).
EARLY_STOP = True
#: Linears of a group that read the very same input tensor in every window (q/k/v, gate/up: one tensor, also
#: through the activation quantiser's shared-input memo) share one Hessian instead of accumulating copies of
#: it (the same additions in the same order: bit-identical, tests/numerics/test_gptq_speed.py).
SHARE_HESSIANS = True

#: Linears that share a Hessian run ONE GPTQ solve over their stacked rows (one factorisation, one column loop;
#: rows are independent given H, so each equals its own solve up to float rounding, test_gptq_fast.py).
STACK_SHARED = True

# ----------------------------------------------------------------------------- layer-by-layer driver


#: Execution groups of a decoder layer (true-sequential order), names relative to the layer.
LayerGroups = tuple[tuple[str, ...], ...]


_StopForward = gptq_layer.StopForward  # raised by the capture hook on decoder layer 0 once its inputs are recorded


def _linear_groups(layer: nn.Module, true_sequential: bool,
                   order: LayerGroups = ()) -> list[list[tuple[str, nn.Linear]]]:
    linears = {n: m for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
    if not true_sequential:
        return [list(linears.items())]
    groups, seen = [], set()
    for names in order:
        g = [(n, linears[n]) for n in names if n in linears]
        if g:
            groups.append(g)
            seen.update(n for n, _ in g)
    rest = [(n, m) for n, m in linears.items() if n not in seen]
    if rest:
        groups.append(rest)
    return groups


def capture_layer_inputs(model: nn.Module, windows: torch.Tensor,
                         device: torch.device | str | None = None) -> list[tuple[tuple, dict]]:
    """Run the model on each window until decoder layer 0 and return that layer's (args, kwargs)."""
    layers = _decoder_layers(model)
    captured: list[tuple[tuple, dict]] = []

    def hook(_mod, args, kwargs):
        captured.append((tuple(a.detach() if torch.is_tensor(a) else a for a in args), dict(kwargs)))
        raise _StopForward

    handle = layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    dev = device or next(model.parameters()).device
    try:
        with torch.no_grad():
            for row in windows:
                try:
                    model(row.unsqueeze(0).to(dev), use_cache=False)
                except _StopForward:
                    pass
    finally:
        handle.remove()
    if len(captured) != len(windows):
        raise GPTQError("could not capture the inputs of decoder layer 0")
    return captured


def capture_per_layer_kwargs(model: nn.Module, windows: torch.Tensor,
                             device: torch.device | str | None = None) -> list[list[dict]] | None:
    """Each decoder layer's keyword inputs per window, ``[layer][window]``, for models whose layers receive
    different ones (Gemma 3: sliding layers get the θ = 1e4 RoPE and the banded mask, full-attention layers the
    θ = 1e6 RoPE and the causal mask); None when ``config.layer_types`` has one kind (layer 0's are reused)."""
    if len(set(getattr(arch.text_config(model), "layer_types", None) or ())) <= 1:
        return None
    layers = _decoder_layers(model)
    per_layer: list[list[dict]] = [[] for _ in layers]
    handles = [layer.register_forward_pre_hook(
        lambda _m, _a, kwargs, _i=i: per_layer[_i].append(dict(kwargs)), with_kwargs=True)
        for i, layer in enumerate(layers)]
    dev = device or next(model.parameters()).device
    try:
        with torch.no_grad():
            for row in windows:
                arch.base_model(model)(input_ids=row.unsqueeze(0).to(dev), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return per_layer


def _layer_output(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _group_hessians(layer: nn.Module, group: list[tuple[str, nn.Module]], inputs: list, dtype: torch.dtype,
                    share: bool, bf16: bool = False) -> dict[str, HessianAccumulator]:
    """The Hessian of each linear of ``group`` over the layer's ``inputs`` (one whole-layer forward per window,
    stopped early where :data:`EARLY_STOP`; sharing as in :func:`rope_quant.quant.gptq_layer.hessians_over`)."""
    runs = [lambda a=args, k=kwargs: layer(*a, **k) for args, kwargs in inputs]
    return gptq_layer.hessians_over(group, runs, _new_acc(dtype, bf16), share, EARLY_STOP)[0]


def _new_acc(dtype: torch.dtype, bf16: bool) -> Callable[[nn.Module], HessianAccumulator]:
    return lambda m: HessianAccumulator(m.in_features, m.weight.device, dtype, bf16)


def resolve_objective(cfg: GPTQConfig, model: nn.Module) -> GPTQConfig:
    """``cfg`` with :attr:`ScaleObjective.AUTO` resolved for ``model``: the weights' own error when R1 rotated
    its residual stream (``model.rq_rotation``, set by the offline rotations), GPTQ's diagonal proxy otherwise."""
    if cfg.objective != ScaleObjective.AUTO:
        return cfg
    r1 = getattr(getattr(model, "rq_rotation", None), "r1", "identity")
    return dataclasses.replace(
        cfg, objective=ScaleObjective.WEIGHT if r1 != "identity" else ScaleObjective.HESSIAN_DIAG)


def quantize_model_gptq(model: nn.Module, windows: torch.Tensor, bits: int, cfg: GPTQConfig = GPTQConfig(),
                        clip_ratio: float = 1.0, progress: bool = True,
                        skip: Callable[[str], bool] | None = None,
                        observe: Callable[[int], contextlib.AbstractContextManager[Any]] | None = None
                        ) -> dict[str, float]:
    """Quantise every linear of every decoder layer with GPTQ, sequentially over layers (in place).

    ``windows``: (n, seqlen) token ids. The embedding, final norm and lm_head stay in full precision
    (QuaRot/DartQuant keep lm_head at 16 bit). Returns per-linear relative output errors
    ``||W X - Q X||_F^2 / ||W X||_F^2`` estimated from the Hessian (``tr(D H D^T) / tr(W H W^T)``).
    True-sequential GPTQ runs each layer in stages (:func:`rope_quant.quant.gptq_layer.staged_layer`) where the
    architecture adapter splits it (:func:`staging_plan`), and whole-layer group forwards otherwise.
    ``observe(li)``: a context entered around the one pass over the windows that runs layer ``li``'s attention
    with its q/k/v quantised (the staged attention step, or the forward for the next layer's inputs), where the
    caller may read what the quantised layer computes (:func:`rope_quant.experiment.calibrate.during_gptq`).
    """
    from tqdm.auto import tqdm

    _check_bits(bits)
    GPTQ_CALLS["model"] += 1
    cfg = resolve_objective(cfg, model)
    layers = _decoder_layers(model)
    order = arch.layer_linear_groups(model)
    inputs = capture_layer_inputs(model, windows)
    per_layer_kwargs = capture_per_layer_kwargs(model, windows)
    staged = STAGED and cfg.true_sequential and staging_plan(model, inputs, per_layer_kwargs)
    errors: dict[str, float] = {}
    for li, layer in enumerate(tqdm(layers, desc="GPTQ layers", disable=not progress)):
        with offload.resident(model, layer):  # a streamed model (--offload cpu): this layer on the device
            inputs = _quantize_layer(layer, li, inputs, per_layer_kwargs, order, bits, cfg, clip_ratio, skip, errors,
                                     stages=layer_stages.layer_stages(model, li) if staged else None,
                                     observe=None if observe is None else lambda li=li: observe(li))
    return errors


#: Run true-sequential GPTQ through the staged layer forward where the adapter allows it (False: always the
#: whole-layer group forwards; the agreement test compares both, tests/numerics/test_gptq_staged.py).
STAGED = True


def staging_plan(model: nn.Module, inputs: list, per_layer_kwargs: list | None) -> bool:
    """Whether every decoder layer can run in stages: the adapter splits each (no refusal, the four execution
    groups and no other linear), and layer 0's staged forward equals its own forward on the first window (one
    extra layer forward per model). Otherwise a warning names the reason and GPTQ takes the whole-layer path
    (the weights are GPTQ's either way)."""
    layers = _decoder_layers(model)
    order = arch.layer_linear_groups(model)
    reason = None
    for li, layer in enumerate(layers):
        reason = layer_stages.staging_refusal(model, li, inputs[0][0])
        names = {n for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
        if reason is None and (len(order) != len(STAGE_ROLES) or names != {n for g in order for n in g}):
            reason = f"layers.{li} has linears {sorted(names)}, not the execution groups {order}"
        if reason is not None:
            break
    if reason is None:
        args, kwargs = inputs[0]
        kwargs = kwargs if per_layer_kwargs is None else per_layer_kwargs[0][0]
        with offload.resident(model, layers[0]), torch.no_grad():
            whole = _layer_output(layers[0](*args, **kwargs))
            parts = layer_stages.layer_stages(model, 0).forward(args[0], kwargs)
        if not layer_stages.same_output(parts, whole):
            reason = "layers.0's staged forward differs from its own forward"
    if reason is not None:
        log.warning("GPTQ: staged layer forward not used (%s); running whole-layer forwards per group", reason)
    return reason is None


#: The staged layer keeps down_proj's inputs of every window (intermediate-sized) up to this many bytes; above,
#: it runs the quantised MLP once more instead, so a layer's peak memory stays near the whole-layer path's.
STAGED_KEEP_BYTES = 1 << 30


def _down_input_bytes(stages: layer_stages.LayerStages, inputs: list) -> int:
    x = inputs[0][0][0]
    return len(inputs) * x[..., :1].numel() * stages.down.in_features * x.element_size()


#: The execution groups' roles in the staged forward, in the adapter's order (q/k/v, o, gate/up, down).
STAGE_ROLES = ("qkv", "o", "gate_up", "down")


def _quantize_layer(layer: nn.Module, li: int, inputs: list, per_layer_kwargs: list | None, order: Any, bits: int,
                    cfg: GPTQConfig, clip_ratio: float, skip: Callable[[str], bool] | None,
                    errors: dict[str, float], stages: layer_stages.LayerStages | None = None,
                    observe: gptq_layer.Observe | None = None) -> list:
    """GPTQ of one decoder layer (in place); returns the next layer's inputs.

    With ``stages``, the layer runs block by block (:func:`rope_quant.quant.gptq_layer.staged_layer`); without,
    one whole-layer forward per group and one for the next layer's inputs. The group forwards run with the
    quantisers' checks deferred (one host read per group, :mod:`rope_quant.quant.deferred`); the error
    estimates and finiteness flags of every linear are read in one transfer at the end of the layer.
    """
    if per_layer_kwargs is not None:  # this layer's own RoPE / mask, not layer 0's
        inputs = [(args, per_layer_kwargs[li][w]) for w, (args, _) in enumerate(inputs)]
    pending: list[tuple[str, nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    records: list[tuple[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def solve(group: list[tuple[str, nn.Module]], accs: dict[str, HessianAccumulator]) -> None:
        shared: dict[int, list[tuple[str, nn.Module]]] = {}
        for n, m in group:  # linears with one accumulator: one stacked solve
            shared.setdefault(id(accs[n]) if STACK_SHARED else id(m), []).append((n, m))
        for members in shared.values():
            H = accs[members[0][0]].H
            Ws = [m.weight.data for _, m in members]
            H32 = H.to(loop_dtype(Ws[0]))
            for (n, m), W, (Q, codes, scales, finite) in zip(
                    members, Ws, _gptq_stacked(Ws, H, bits, cfg, clip_ratio), strict=True):
                num, den = _error_terms(W, Q, H32)
                neg = negzero_flag(codes, Q) if bits <= 8 else torch.zeros((), dtype=torch.bool, device=Q.device)
                pending.append((n, m, num, den, finite, neg))
                records.append((m, codes, scales, Q))
                m.weight.data.copy_(Q)

    groups = [[(n, m) for n, m in group if not (skip and skip(f"layers.{li}.{n}"))]
              for group in _linear_groups(layer, cfg.true_sequential, order)]
    if stages is not None:
        new_acc = _new_acc(cfg.dtype, cfg.hessian_bf16)
        out = gptq_layer.staged_layer(
            stages, dict(zip(STAGE_ROLES, groups, strict=True)), inputs,
            lambda g, runs, capture: gptq_layer.hessians_over(g, runs, new_acc, SHARE_HESSIANS, EARLY_STOP, capture),
            solve, keep_down_inputs=_down_input_bytes(stages, inputs) <= STAGED_KEEP_BYTES, observe=observe)
    else:
        for group in groups:
            if group:
                solve(group, deferred.run_checked(
                    lambda g=group: _group_hessians(layer, g, inputs, cfg.dtype, SHARE_HESSIANS, cfg.hessian_bf16))[0])
    if pending:
        host = torch.stack([torch.stack([num.double(), den.double(), fin.double(), neg.double()])
                            for _, _, num, den, fin, neg in pending]).tolist()
        for (n, _, _, _, _, _), (num, den, fin, _) in zip(pending, host, strict=True):
            if not fin:
                raise GPTQError(f"GPTQ produced non-finite weights (layers.{li}.{n})")
            errors[f"layers.{li}.{n}"] = num / max(den, 1e-30)
        for (m, codes, scales, Q), row in zip(records, host, strict=True):
            _record_codes(m, codes, scales, bits, cfg.group_size, Q, has_negzero=bool(row[3]))
    if stages is not None:
        return out

    # Inputs of the next layer: this layer, now quantised (with whatever hooks are installed).
    def forward() -> list:
        with torch.no_grad():
            return [((_layer_output(layer(*args, **kwargs)),) + tuple(args[1:]), kwargs) for args, kwargs in inputs]
    with observe() if observe is not None else contextlib.nullcontext():
        return deferred.run_checked(forward)[0]


def linear_names(model: nn.Module) -> Sequence[str]:
    """Qualified names of the decoder-layer linears GPTQ/RTN quantise."""
    return [f"layers.{li}.{n}" for li, layer in enumerate(_decoder_layers(model))
            for n, m in layer.named_modules() if isinstance(m, nn.Linear)]

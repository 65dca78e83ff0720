"""The forwards GPTQ runs inside one decoder layer: Hessian collection over any forward, and the staged layer.

True-sequential GPTQ (Frantar et al. 2022, Sec. 4; QuaRot's ``true_sequential``) quantises a layer's linears in
execution groups (q/k/v, o, gate/up, down), each group's Hessian taken on inputs that already pass through the
quantised earlier groups. Run as whole-layer forwards, that costs one (early-stopped) layer forward per group plus
one for the next layer's inputs. :func:`staged_layer` runs the layer block by block instead
(:mod:`rope_quant.model.layer_stages`), keeping every intermediate it will need again:

1. q/k/v Hessians: the attention module on ``pre_attn(x)``, stopped once q/k/v have read their input;
2. o_proj: the attention (quantised q/k/v) run once, stopped at o_proj, whose raw input is kept;
3. the residual after attention, from the quantised o_proj applied to the kept input;
4. gate/up Hessians: the MLP on ``pre_mlp(r)``, stopped once gate/up have read it;
5. down_proj: the MLP (quantised gate/up) run once, stopped at down_proj, whose raw input is kept;
6. the next layer's input, from the quantised down_proj applied to the kept input.

Every linear is called as the layer calls it, so the hooks on it (online R4 on down_proj, the activation
quantisers) run before the Hessian hook, which is registered last: each Hessian sees what its linear sees. The
raw input is recorded by a hook registered first (``prepend=True``), before any transform. Each linear's matmul
runs once per window (q/k and gate run once more in the first window, where the q/k/v and gate/up capture
forwards check that each group reads one tensor): 7 linear passes per window, plus 3 in the first. Where
down_proj's kept inputs would exceed a memory budget (:data:`rope_quant.quant.gptq.STAGED_KEEP_BYTES`), step 6
runs the quantised MLP again instead: gate/up twice per window, 9 linear passes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from rope_quant.model.layer_stages import LayerStages
from rope_quant.quant import deferred

__all__ = ["StopForward", "hessians_over", "staged_layer", "Group", "Observe"]

#: One execution group: (name relative to the layer, linear) pairs.
Group = list[tuple[str, nn.Module]]
#: A context entered around a pass that the caller observes (:func:`staged_layer`'s ``observe``).
Observe = Callable[[], contextlib.AbstractContextManager[Any]]


class StopForward(Exception):
    """Raised by a capture hook once a forward has given everything that is needed from it."""


def hessians_over(group: Group, runs: Sequence[Callable[[], Any]], new_acc: Callable[[nn.Module], Any],
                  share: bool, early_stop: bool, capture: nn.Module | None = None) -> tuple[dict, list]:
    """The Hessian accumulator of each linear of ``group`` over the forwards ``runs`` (one per window), and
    the raw input ``capture`` received in each window (``[]`` without ``capture``).

    ``new_acc(linear)`` makes an empty accumulator (``.add(x)``). A forward stops (:class:`StopForward`) once
    every linear of the group has its input (``early_stop``) and, with ``capture``, once ``capture``'s hooks
    have run. With ``share``, a linear whose input is, in every window, the tensor the previous linear of the
    group just read (same object, unchanged) takes that linear's accumulator instead of a copy; if a linear
    shares in some windows but not in others, the forwards run again without sharing. A group whose linears
    all read the first one's input tensor in the first window is taken to do so in every window (the same
    module code reads the same tensor): later windows stop at the first linear's hook, before any matmul.
    """
    accs = {n: new_acc(m) for n, m in group}
    last: dict[str, Any] = {"x": None, "version": None, "name": None}
    source: dict[str, set] = {n: set() for n, _ in group}  # who accumulated n's input, per window
    seen: set[str] = set()
    raw: list = [None] * len(runs) if capture is not None else []
    window = [0]
    handles = []
    names = [n for n, _ in group]
    one_input = [False]  # set after the first window when the whole group read one tensor there
    for n, m in group:
        def pre(_mod: nn.Module, args: tuple, _n: str = n) -> None:
            x = args[0]
            version = None if x.is_inference() else x._version
            if share and last["x"] is x and last["version"] == version:
                source[_n].add(last["name"])
            else:
                accs[_n].add(x)
                source[_n].add(_n)
                last.update(x=x, version=version, name=_n)
            seen.add(_n)
            if early_stop and capture is None and (len(seen) == len(accs) or one_input[0]):
                # every Hessian of the group has its input: the rest is unused (after the first window of a
                # group that reads one tensor, its first linear's input is everyone's: stop before its matmul)
                raise StopForward
        handles.append(m.register_forward_pre_hook(pre))
    if capture is not None:
        def keep(_mod: nn.Module, args: tuple) -> None:
            raw[window[0]] = args[0]

        def stop(_mod: nn.Module, args: tuple) -> None:
            raise StopForward
        handles.append(capture.register_forward_pre_hook(keep, prepend=True))  # before R4 and the quantiser
        handles.append(capture.register_forward_pre_hook(stop))  # after every hook, the Hessian's included
    try:
        with torch.no_grad():
            for w, run in enumerate(runs):
                window[0] = w
                seen.clear()
                try:
                    run()
                except StopForward:
                    pass
                if w == 0 and share and len(names) > 1 and all(source[n] == {names[0]} for n in names[1:]):
                    one_input[0] = True
    finally:
        for h in handles:
            h.remove()
        last.clear()
    if not share:
        return accs, raw
    for n, src in source.items():
        (leader,) = src if len(src) == 1 else (None,)
        if leader is None or source[leader] != {leader}:
            return hessians_over(group, runs, new_acc, False, early_stop, capture)
        accs[n] = accs[leader]
    return accs, raw


def staged_layer(stages: LayerStages, groups: dict[str, Group], inputs: list[tuple[tuple, dict]],
                 collect: Callable[[Group, Sequence[Callable[[], Any]], nn.Module | None], tuple[dict, list]],
                 solve: Callable[[Group, dict], None], keep_down_inputs: bool = True,
                 observe: Observe | None = None) -> list[tuple[tuple, dict]]:
    """True-sequential GPTQ of one layer through its stages (module docstring); returns the next layer's inputs.

    ``groups``: the linears to quantise by role, ``"qkv"``, ``"o"``, ``"gate_up"``, ``"down"`` (a role may be
    empty: those linears stay as they are, and still run). ``collect(group, runs, capture)`` returns
    :func:`hessians_over`'s result (with the caller's accumulator, sharing and stop settings); ``solve(group,
    accs)`` quantises the group in place. Forwards run with the quantisers' checks deferred, one host read per
    step (:func:`rope_quant.quant.deferred.run_checked`, which recomputes a step that asks for exact checks).
    The norms are recomputed per forward rather than kept. ``keep_down_inputs``: keep down_proj's inputs
    (intermediate-sized, every window) for the output step; False runs the quantised MLP once more instead
    (gate/up twice per window), so the layer holds no more than its inputs, o_proj's inputs (hidden-sized) and the
    residual stream. ``observe()``: a context entered around step 2, the one pass over the windows of the
    attention with its q/k/v quantised (the calibration statistics are collected there).
    """
    xs = [args[0] for args, _ in inputs]
    kws = [kwargs for _, kwargs in inputs]
    attn_runs = [lambda w=w: stages.attention(stages.attention_input(xs[w]), kws[w]) for w in range(len(xs))]
    if groups["qkv"]:
        solve(groups["qkv"], deferred.run_checked(lambda: collect(groups["qkv"], attn_runs, None))[0][0])
    with observe() if observe is not None else contextlib.nullcontext():
        accs, o_in = deferred.run_checked(lambda: collect(groups["o"], attn_runs, stages.o))[0]
    if groups["o"]:
        solve(groups["o"], accs)

    def residual() -> list:
        with torch.no_grad():
            return [stages.attention_residual(x, stages.o(a)) for x, a in zip(xs, o_in, strict=True)]
    r = deferred.run_checked(residual)[0]
    o_in.clear()  # no longer needed: free the memory before the MLP
    mlp_runs = [lambda w=w: stages.mlp(stages.mlp_input(r[w])) for w in range(len(xs))]
    if groups["gate_up"]:
        solve(groups["gate_up"], deferred.run_checked(lambda: collect(groups["gate_up"], mlp_runs, None))[0][0])
    capture = stages.down if keep_down_inputs or not groups["down"] else None
    accs, d_in = deferred.run_checked(lambda: collect(groups["down"], mlp_runs, capture))[0]
    if groups["down"]:
        solve(groups["down"], accs)
    if capture is None:  # down_proj's inputs were not kept: the quantised MLP once more
        d_in = [None] * len(xs)

    def output() -> list:
        with torch.no_grad():
            return [stages.mlp_residual(t, stages.mlp(stages.mlp_input(t)) if d is None else stages.down(d))
                    for t, d in zip(r, d_in, strict=True)]
    out = deferred.run_checked(output)[0]
    return [((y,) + tuple(args[1:]), kwargs) for y, (args, kwargs) in zip(out, inputs, strict=True)]

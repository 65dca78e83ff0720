"""GPTQ weight quantisation (Frantar et al. 2022), written from the algorithm.

For one linear layer ``y = W x`` with calibration inputs ``X`` (columns = tokens), GPTQ quantises the
columns of ``W`` one at a time and spreads each column's rounding error over the not-yet-quantised
columns, using the inverse of the layer Hessian ``H = 2 X X^T / n`` (the Hessian of ``||W X - Q X||^2``):

1. damp ``H += percdamp * mean(diag H) * I`` (dead inputs, ``H_jj = 0``, get ``H_jj = 1`` and ``W_:j = 0``);
2. optionally permute columns by decreasing ``diag H`` (``act_order``);
3. ``U = chol(H^{-1})^T`` (upper Cholesky factor of the inverse Hessian);
4. for each block of ``blocksize`` columns, for each column ``j``: ``q_j = quant(w_j)``,
   ``e_j = (w_j - q_j) / U_jj``, ``w_{j+1:} -= e_j U_{j, j+1:}`` inside the block; after the block, the
   block's errors update all later columns in one matmul (lazy batch update).

The quantiser is symmetric INT-b per output channel (or per group of ``group_size`` input columns); its scales,
their clip search and the settings (:class:`~rope_quant.quant.rtn.GPTQConfig`) are :mod:`rope_quant.quant.rtn`'s,
shared with the round-to-nearest baseline.

:func:`quantize_model_gptq` runs GPTQ layer by layer through a decoder: the inputs of layer 0 are captured
by a pre-hook that stops the forward, and every quantised layer is run to produce the next layer's inputs.
Inside a layer, linears are quantised in execution groups (``q/k/v``, ``o``, ``gate/up``, ``down``:
"true sequential"), so each group's Hessian comes from inputs that already pass through the quantised
earlier groups. The Hessian of each linear is accumulated by a forward pre-hook registered *after* any
hooks already on that linear: it therefore sees exactly what the linear sees, including the online R4
Hadamard on ``down_proj`` and the activation fake-quantiser when the pipeline has installed them (our
choice, recorded in the weight cache key). The attention's K/V quantisers and R3 are not active during
GPTQ: they depend on the R3 choice, which must not influence the weights (paired design).

Linears that share one Hessian (q/k/v, gate/up) are solved together: their rows are stacked under one
factorisation and one column loop (rows are independent given H). Nothing inside the column loop reads the
device from the host; a layer's group forwards, factorisations and error estimates read it a fixed number of
times per layer (tests/numerics/test_host_syncs.py).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from rope_quant.model import arch, layer_stages, offload
from rope_quant.quant import deferred, gptq_layer
from rope_quant.quant.packing import negzero_flag
from rope_quant.quant.rtn import (
    GPTQConfig,
    GPTQError,
    ScaleObjective,
    _check_bits,
    _decoder_layers,
    _group_scales,
    _qmax,
    _record_codes,
    weight_scales,
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

def loop_dtype(W: torch.Tensor) -> torch.dtype:
    """The precision of GPTQ's column loop and error estimates: the weights' own, at least float32.
    ``GPTQConfig(float64=True)`` (the float-order replicate) changes the Hessian sums and the factorisation only:
    on a float32 model the loop's float32 arithmetic is the primary's, fed with a differently rounded
    inverse-Hessian factor."""
    return torch.promote_types(W.dtype, torch.float32)


#: Number of per-linear GPTQ solves run in this process (the weight-cache test checks it does not grow).
GPTQ_CALLS = {"linear": 0, "model": 0}


# ----------------------------------------------------------------------------- Hessian


@dataclass
class HessianAccumulator:
    """Running ``H = 2/n sum_t x_t x_t^T`` over the rows ``x_t`` of a linear's inputs (float32).

    A float64 accumulator (``GPTQConfig(float64=True)``) sums the float32 products of float32 inputs in float64:
    the running sum is exact to float64, each window's product is the forward's precision.
    ``bf16_inputs``: the product takes the inputs rounded to bfloat16 and accumulates in float32 (tensor
    cores on a GPU, ``torch.mm(..., out_dtype=torch.float32)``; an exact float32 product of the rounded
    inputs elsewhere). Off by default: use it only where
    :func:`rope_quant.quant.hessian_check.validate_fast_hessian` passes on the real shapes.
    """

    n_features: int
    device: torch.device | str = "cpu"
    dtype: torch.dtype = torch.float32
    bf16_inputs: bool = False
    H: torch.Tensor = field(init=False)
    n_samples: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.H = torch.zeros(self.n_features, self.n_features, dtype=self.dtype, device=self.device)

    def add(self, x: torch.Tensor) -> None:
        """Accumulate a batch of inputs of shape (..., n_features)."""
        if x.shape[-1] != self.n_features:
            raise GPTQError(f"input has {x.shape[-1]} features, Hessian expects {self.n_features}")
        x = x.detach().reshape(-1, x.shape[-1])
        m = x.shape[0]
        if m == 0:
            return
        total = self.n_samples + m
        self.H.mul_(self.n_samples / total)
        product = torch.promote_types(x.dtype, torch.float32)
        if self.bf16_inputs:
            self.H.add_(_bf16_gram(x.to(device=self.H.device)), alpha=2.0 / total)
        elif product != self.dtype:  # float64 sums of float32 products (the float-order replicate)
            x = x.to(device=self.H.device, dtype=product)
            self.H.add_(x.T @ x, alpha=2.0 / total)
        else:
            x = x.to(device=self.H.device, dtype=self.dtype) * math.sqrt(2.0 / total)
            self.H.addmm_(x.T, x)
        self.n_samples = total


def _bf16_gram(x: torch.Tensor) -> torch.Tensor:
    """``x^T x`` of the bfloat16-rounded rows, accumulated in float32."""
    xb = x.to(torch.bfloat16)
    if xb.is_cuda:
        try:
            return torch.mm(xb.T, xb, out_dtype=torch.float32)
        except (TypeError, RuntimeError):  # a torch without out_dtype: the float32 product below
            pass
    xf = xb.float()
    return xf.T @ xf


# ----------------------------------------------------------------------------- GPTQ for one matrix


def _upper_inverse_factor(Hd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``U`` upper triangular with ``U^T U = Hd^{-1}`` (the upper Cholesky factor of the inverse), and the 0-d
    LAPACK status (0: ``Hd`` positive definite), from ONE Cholesky factorisation and one triangular inverse.

    With ``P`` the reversal permutation and ``P Hd P = L L^T``: ``Hd^{-1} = (P L^{-1} P)^T (P L^{-1} P)``, and
    ``P L^{-1} P`` is upper triangular with a positive diagonal, so it is the factor (the Cholesky factor is
    unique). The same matrix as ``chol(cholesky_inverse(chol(Hd)), upper=True)`` in exact arithmetic, at about
    half the cost: the inverse is never formed.
    """
    L, info = torch.linalg.cholesky_ex(Hd.flip(0, 1))
    eye = torch.eye(Hd.shape[0], dtype=Hd.dtype, device=Hd.device)
    return torch.linalg.solve_triangular(L, eye, upper=False).flip(0, 1), info


def _inverse_hessian_factor(H: torch.Tensor, percdamp: float, max_tries: int = 6) -> torch.Tensor:
    """Upper Cholesky factor of ``(H + damp I)^{-1}`` (:func:`_upper_inverse_factor`), raising the damping
    tenfold if H is not PD.

    The first attempt reads its outcome in one host transfer (the diagonal mean and the factorisation's
    status together): one synchronisation per Hessian on an accelerator.
    """
    diag_mean_t = torch.mean(torch.diagonal(H))
    # float64 product, then H's dtype: the value the host float gave before (percdamp * mean, rounded once)
    damp_t = (diag_mean_t.double() * percdamp).to(H.dtype) if percdamp > 0 else torch.zeros_like(diag_mean_t)
    Hd = H.clone()
    Hd.diagonal().add_(damp_t)
    U, info = _upper_inverse_factor(Hd)
    diag_mean, first = torch.stack([diag_mean_t.double(), info.double()]).tolist()
    if not math.isfinite(diag_mean):
        raise GPTQError("Hessian contains NaN or infinite values (did the calibration inputs overflow?)")
    if first == 0:
        return U
    damp = percdamp * diag_mean if percdamp > 0 else 0.0
    idx = torch.arange(H.shape[0], device=H.device)
    for attempt in range(1, max_tries):
        damp = max(damp, 1e-8 * max(diag_mean, 1e-8)) * 10.0
        Hd = H.clone()
        Hd[idx, idx] += damp
        U, info = _upper_inverse_factor(Hd)
        if int(info) == 0:
            log.warning("GPTQ: Hessian needed damping %.3g (percdamp x %d)", damp, 10**attempt)
            return U
    raise GPTQError(
        f"Hessian is not positive definite even with damping {damp:.3g}; "
        "increase percdamp or use more calibration data"
    )


def gptq_quantize(W: torch.Tensor, H: torch.Tensor, bits: int, cfg: GPTQConfig = GPTQConfig(),
                  clip_ratio: float = 1.0) -> torch.Tensor:
    """GPTQ (Frantar et al. 2022, Alg. 1) of ``W`` (out, in) given the input Hessian ``H`` (in, in).

    Returns the dequantised weight (same dtype/device as ``W``).
    """
    return _gptq(W, H, bits, cfg, clip_ratio)[0]


def gptq_quantize_shared(Ws: Sequence[torch.Tensor], H: torch.Tensor, bits: int, cfg: GPTQConfig = GPTQConfig(),
                         clip_ratio: float = 1.0) -> list[torch.Tensor]:
    """GPTQ of several weights that share one input Hessian (q/k/v, gate/up): one factorisation and one
    column loop over their stacked rows. GPTQ treats rows independently given ``H``, so each result equals
    :func:`gptq_quantize` of that weight alone up to floating-point rounding (tests/numerics/test_gptq_fast.py)."""
    res = _gptq_stacked(list(Ws), H, bits, cfg, clip_ratio)
    if not bool(torch.stack([r[3] for r in res]).all()):
        raise GPTQError("GPTQ produced non-finite weights")
    return [r[0] for r in res]


def _gptq_stacked(Ws: list[torch.Tensor], H: torch.Tensor, bits: int, cfg: GPTQConfig, clip_ratio: float
                  ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """:func:`_gptq` of the row-stacked ``Ws`` split back per weight (one solve for all)."""
    if len(Ws) == 1:
        return [_gptq_flagged(Ws[0], H, bits, cfg, clip_ratio)]
    if len({(W.ndim, W.shape[1:], W.dtype, W.device) for W in Ws}) != 1:
        raise GPTQError(f"stacked GPTQ needs weights of one width, dtype and device, got "
                        f"{[(tuple(W.shape), W.dtype) for W in Ws]}")
    rows = [W.shape[0] for W in Ws]
    Q, C, S, _ = _gptq_flagged(torch.cat([W.detach() for W in Ws]), H, bits, cfg, clip_ratio)
    return [(q, c, s, torch.isfinite(q).all())
            for q, c, s in zip(Q.split(rows), C.split(rows), S.split(rows), strict=True)]


def _gptq(W: torch.Tensor, H: torch.Tensor, bits: int, cfg: GPTQConfig,
          clip_ratio: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`gptq_quantize` with its integer codes (out, in) and scales (out, n_groups), in column order."""
    Q, C, S, finite = _gptq_flagged(W, H, bits, cfg, clip_ratio)
    if not bool(finite):
        raise GPTQError("GPTQ produced non-finite weights")
    return Q, C, S


def _gptq_flagged(W: torch.Tensor, H: torch.Tensor, bits: int, cfg: GPTQConfig,
                  clip_ratio: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_gptq` with a 0-d device flag
    "every weight is finite" (read by the caller: no host synchronisation here besides the factorisation's).

    The column loop runs on the transposed weight (a column of W is a contiguous row), with the per-column
    scales gathered before the loop and each block's rows taken as views in one call: ~7 kernels per column
    and no host read inside the loop. The factorisation runs in ``cfg.dtype`` (float64 for the float-order
    replicate); the column loop in the weights' precision (:func:`loop_dtype`: float32 in the pipeline).
    """
    _check_bits(bits)
    if W.ndim != 2 or H.shape != (W.shape[1], W.shape[1]):
        raise GPTQError(f"shape mismatch: W {tuple(W.shape)}, H {tuple(H.shape)}")
    GPTQ_CALLS["linear"] += 1
    out_f, in_f = W.shape
    Wf = W.detach().clone().to(loop_dtype(W))
    H = H.detach().clone().to(device=Wf.device, dtype=cfg.dtype)

    dead = torch.diagonal(H) == 0  # masked ops, not boolean indexing: no host read of the dead count
    H.diagonal().masked_fill_(dead, 1.0)
    Wf.masked_fill_(dead[None, :], 0.0)

    gs = in_f if cfg.group_size == -1 else cfg.group_size
    n_groups = math.ceil(in_f / gs)
    # The search's per-column weights: GPTQ's proxy loss with H's diagonal (ScaleObjective), or none.
    hdiag = torch.diag(H).float() if cfg.objective != ScaleObjective.WEIGHT else None
    grp = lambda W_: _group_scales(W_, bits, cfg.group_size, cfg.mse, clip_ratio,  # noqa: E731
                                   cfg.grid, cfg.max_shrink, norm=cfg.p_norm, full_range=cfg.full_range,
                                   col_weight=hdiag)
    # Static scales (computed once, on the original contiguous groups) unless groups are formed on the fly.
    lazy_groups = cfg.group_size != -1 and not cfg.act_order
    scales = torch.empty(out_f, n_groups, dtype=Wf.dtype, device=Wf.device) if lazy_groups else grp(Wf)
    group_of_col = torch.arange(in_f, device=Wf.device) // gs

    perm = None
    if cfg.act_order:
        perm = torch.argsort(torch.diagonal(H), descending=True)
        Wf = Wf[:, perm]
        H = H[perm][:, perm]
        group_of_col = group_of_col[perm]

    U = _inverse_hessian_factor(H, cfg.percdamp).to(Wf.dtype)
    # Row j of col_scales: the scales of (permuted) column j, gathered on the device before the loop.
    col_scales = None if lazy_groups else (scales.T.expand(in_f, out_f) if n_groups == 1
                                           else scales.T[group_of_col])
    qmax = _qmax(bits)
    Wt = Wf.T.contiguous()  # (in, out): the column loop reads and writes contiguous rows
    Qt = torch.empty_like(Wt)
    Ct = torch.empty_like(Wt)

    for i1 in range(0, in_f, cfg.blocksize):
        i2 = min(i1 + cfg.blocksize, in_f)
        W1 = Wt[i1:i2]  # updated in place: these rows are not read after their block
        Err1 = torch.empty_like(W1)
        U1 = U[i1:i2, i1:i2]
        # every per-column view of the block in one call each (indexing per column costs more than the math)
        ws, cs, qs, es = W1.unbind(0), Ct[i1:i2].unbind(0), Qt[i1:i2].unbind(0), Err1.unbind(0)
        us, ds = U1.unbind(0), U1.diagonal().unbind(0)
        ss = None if col_scales is None else col_scales[i1:i2].unbind(0)
        for i in range(i2 - i1):
            col = i1 + i
            if lazy_groups and col % gs == 0:
                # Scales of the group starting here, from the error-updated weights (Frantar et al.).
                block = torch.cat([W1[i:], Wt[i2:]], dim=0)[:gs].T
                scales[:, col // gs] = weight_scales(
                    block, bits, cfg.mse, clip_ratio, cfg.grid, cfg.max_shrink, norm=cfg.p_norm,
                    full_range=cfg.full_range, col_weight=None if hdiag is None else hdiag[col:col + gs])[:, 0]
            s = scales[:, col // gs] if ss is None else ss[i]
            w, c, q, e = ws[i], cs[i], qs[i], es[i]
            torch.div(w, s, out=c)  # = _int_codes(w, s, bits), written in place
            c.round_().clamp_(-qmax - 1, qmax)
            torch.mul(c, s, out=q)  # = quantize_with_scales(w, s, bits)
            torch.sub(w, q, out=e).div_(ds[i])
            if i + 1 < i2 - i1:
                W1[i + 1:].addr_(us[i][i + 1:], e, alpha=-1.0)
        if i2 < in_f:
            Wt[i2:].addmm_(U[i1:i2, i2:].T, Err1, alpha=-1.0)

    Q, C = Qt.T, Ct.T
    if perm is not None:
        inv = torch.argsort(perm)
        Q, C = Q[:, inv], C[:, inv]
    Q, C = Q.contiguous(), C.contiguous()
    return Q.to(dtype=W.dtype), C, scales, torch.isfinite(Q).all()


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
                        skip: Callable[[str], bool] | None = None) -> dict[str, float]:
    """Quantise every linear of every decoder layer with GPTQ, sequentially over layers (in place).

    ``windows``: (n, seqlen) token ids. The embedding, final norm and lm_head stay in full precision
    (QuaRot/DartQuant keep lm_head at 16 bit). Returns per-linear relative output errors
    ``||W X - Q X||_F^2 / ||W X||_F^2`` estimated from the Hessian (``tr(D H D^T) / tr(W H W^T)``).
    True-sequential GPTQ runs each layer in stages (:func:`rope_quant.quant.gptq_layer.staged_layer`) where the
    architecture adapter splits it (:func:`staging_plan`), and whole-layer group forwards otherwise.
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
                                     stages=layer_stages.layer_stages(model, li) if staged else None)
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


def _error_terms(W: torch.Tensor, Q: torch.Tensor, H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``tr(D H D^T)`` and ``tr(W H W^T)`` with ``D = W - Q`` (0-d, on the device): one matmul of the stacked
    ``[D; W]`` with the symmetric ``H`` in the loop's precision (a diagnostic; the float64 replicate's too)."""
    Wh = W.to(H.dtype)
    stacked = torch.cat([Wh - Q.to(H.dtype), Wh])
    prod = (stacked @ H).mul_(stacked)
    rows = W.shape[0]
    return prod[:rows].sum(), prod[rows:].sum()


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
                    errors: dict[str, float], stages: layer_stages.LayerStages | None = None) -> list:
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
            solve, keep_down_inputs=_down_input_bytes(stages, inputs) <= STAGED_KEEP_BYTES)
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
    return deferred.run_checked(forward)[0]


def linear_names(model: nn.Module) -> Sequence[str]:
    """Qualified names of the decoder-layer linears GPTQ/RTN quantise."""
    return [f"layers.{li}.{n}" for li, layer in enumerate(_decoder_layers(model))
            for n, m in layer.named_modules() if isinstance(m, nn.Linear)]

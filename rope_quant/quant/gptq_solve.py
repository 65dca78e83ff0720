"""GPTQ's solve for one weight matrix (Frantar et al. 2022, Alg. 1), written from the algorithm.

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
shared with the round-to-nearest baseline. Linears that share one Hessian (q/k/v, gate/up) are solved together:
their rows are stacked under one factorisation and one column loop (rows are independent given H). Nothing
inside the column loop reads the device from the host (tests/numerics/test_host_syncs.py).

The layer-by-layer driver that feeds these solves is :mod:`rope_quant.quant.gptq`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from rope_quant.core.threads import one_cpu_thread
from rope_quant.quant.rtn import (
    GPTQConfig,
    GPTQError,
    ScaleObjective,
    _check_bits,
    _group_scales,
    _qmax,
    weight_scales,
)

log = logging.getLogger("rope_quant.quant.gptq")  # GPTQ's one logger (the driver's name)

__all__ = ["HessianAccumulator", "gptq_quantize", "gptq_quantize_shared", "loop_dtype", "GPTQ_CALLS"]


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
    with one_cpu_thread(Hd.device):  # LAPACK's rounding follows the thread count (rope_quant.core.threads)
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


def _error_terms(W: torch.Tensor, Q: torch.Tensor, H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``tr(D H D^T)`` and ``tr(W H W^T)`` with ``D = W - Q`` (0-d, on the device): one matmul of the stacked
    ``[D; W]`` with the symmetric ``H`` in the loop's precision (a diagnostic; the float64 replicate's too)."""
    Wh = W.to(H.dtype)
    stacked = torch.cat([Wh - Q.to(H.dtype), Wh])
    prod = (stacked @ H).mul_(stacked)
    rows = W.shape[0]
    return prod[:rows].sum(), prod[rows:].sum()

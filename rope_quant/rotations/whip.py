"""DartQuant rotation calibration: the whip loss with a QR-orthogonal parameterisation.

DartQuant (Shao et al., 2025) fits the offline rotations R1 and R2 by making the rotated activations
close to uniformly distributed rather than by end-to-end training:

* Whip loss (Sec. 3.2, Eq. 6): ``L(R) = mean_t Σ_j exp(−|(x_t R)_j|)``. A rotation preserves ‖x_t‖, so
  the loss is lowered by moving mass away from zero, which flattens the distribution and shrinks the
  largest entries (outliers) at a fixed norm.
* QR-Orth (Sec. 3.3): a free matrix ``A`` is optimised with plain SGD (momentum 0.9) and the rotation is
  the Q factor of ``A = QR``, sign-fixed so that diag(R) > 0 (this makes the map A ↦ Q unique and gives
  Q = A when A is already orthogonal). It replaces Cayley / Riemannian optimisers.
* R1 is fitted once on activations pooled across layers (the unit-RMS-normalised residual entering every
  layer's attention and MLP norm: what q/k/v and gate/up read once norms are fused); R2 per layer on the
  per-head values (v_proj outputs, or, as in the released code, o_proj inputs).

The training loop mirrors the released scripts: epochs over shuffled samples, micro-batches of
``batch_size`` samples, the loss divided by ``accumulation`` and one optimiser step every
``accumulation`` micro-batches.

This module is the fit on given samples; the samples are collected from a model through hooks, and both fits run
on them, by :mod:`rope_quant.rotations.whip_model`.

**The released R2 schedule never steps.** The released R2 script (defaults nsamples=128, bsz=128,
accumulation_steps=2) tests ``(batch_idx + 1) % accumulation_steps == 0`` with ``batch_idx`` the index
*within the epoch*. With 128 samples and batch 128 each epoch has one batch (``batch_idx`` = 0), so the
test is never true and R2 stays at its Hadamard initialisation, whatever the number of epochs (the
gradient keeps accumulating and is never used). ``released_schedule=True`` reproduces that counting (the
zero-step outcome emerges from the loop, it is not special-cased). The default (``False``) counts
micro-batches across epochs and flushes a pending partial accumulation at the end, so every sample
contributes to at least one step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from rope_quant.core import hadamard
from rope_quant.core.threads import one_cpu_thread

__all__ = [
    "WhipError",
    "WhipConfig",
    "WhipResult",
    "CalibratedRotations",
    "RELEASED_R2",
    "whip_loss",
    "qr_orthogonal",
    "QR_METHODS",
    "QR_GRADS",
    "AUTO_ANALYTIC_ABOVE",
    "qr_grad_for",
    "fit_rotation",
]


#: How the whip step differentiates the QR factor (:attr:`WhipConfig.qr_grad`).
QR_GRADS = ("auto", "autograd", "analytic")
#: ``qr_grad="auto"`` uses the closed-form gradient above this width (paper scale: 4096, 8192) and autograd at or
#: below it, so the embedded models' fits (widths 576 and 640) and every number measured on them stay bit for bit.
AUTO_ANALYTIC_ABOVE = 1024


class WhipError(ValueError):
    """Bad input to the whip calibration (shapes, schedule settings, sources)."""


@dataclass(frozen=True)
class WhipConfig:
    """Optimiser and schedule of one whip fit (DartQuant Sec. 3.3 / released scripts).

    ``nsamples``: use the first ``nsamples`` samples (None: all); ``subset``: fraction of them drawn per
    epoch (released R1: 0.1); ``max_steps``: stop after this many optimiser steps (None: run all epochs);
    ``cosine``: anneal the learning rate to 0 over the planned steps (``CosineAnnealingLR``).
    ``qr_grad``: ``"autograd"`` differentiates through CholeskyQR2; ``"analytic"`` uses the closed-form QR
    gradient (:class:`_QRAnalytic`): the same gradient up to rounding, ~2–3.5× cheaper per step at width 4096 on
    a CPU (7.0 s against 15.6–26 s at 1 thread), not bit-identical; ``"auto"`` (default, :func:`qr_grad_for`):
    analytic above width :data:`AUTO_ANALYTIC_ABOVE`, autograd below.
    Defaults are small so a fit runs in seconds on CPU; raise ``epochs`` for real calibrations.
    """

    lr: float = 1e-3
    momentum: float = 0.9
    epochs: int = 10
    batch_size: int = 8
    accumulation: int = 1
    nsamples: int | None = None
    subset: float = 1.0
    max_steps: int | None = None
    released_schedule: bool = False
    init: str = "hadamard"
    cosine: bool = False
    qr_grad: str = "auto"

    def __post_init__(self) -> None:
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise WhipError(f"lr must be positive and finite, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise WhipError(f"momentum must be in [0, 1), got {self.momentum}")
        for name in ("epochs", "batch_size", "accumulation"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise WhipError(f"{name} must be a positive integer, got {v!r}")
        if self.nsamples is not None and (not isinstance(self.nsamples, int) or self.nsamples < 1):
            raise WhipError(f"nsamples must be a positive integer or None, got {self.nsamples!r}")
        if not 0 < self.subset <= 1:
            raise WhipError(f"subset must be in (0, 1], got {self.subset}")
        if self.max_steps is not None and (not isinstance(self.max_steps, int) or self.max_steps < 0):
            raise WhipError(f"max_steps must be a non-negative integer or None, got {self.max_steps!r}")
        if self.init not in ("hadamard", "identity"):
            raise WhipError(f"init must be 'hadamard' or 'identity', got {self.init!r}")
        if self.qr_grad not in QR_GRADS:
            raise WhipError(f"qr_grad must be one of {QR_GRADS}, got {self.qr_grad!r}")


def qr_grad_for(cfg: WhipConfig, width: int) -> str:
    """The QR gradient a fit of this width uses: ``cfg.qr_grad``, with ``"auto"`` resolved by the width."""
    if cfg.qr_grad != "auto":
        return cfg.qr_grad
    return "analytic" if width > AUTO_ANALYTIC_ABOVE else "autograd"


#: The released r2_base_qr.py defaults: nsamples 128, bsz 128, accumulation 2, 5 epochs, lr 1e-3, SGD 0.9.
RELEASED_R2 = WhipConfig(lr=1e-3, momentum=0.9, epochs=5, batch_size=128, accumulation=2, nsamples=128,
                         released_schedule=True)


@dataclass
class WhipResult:
    """Outcome of :func:`fit_rotation`.

    ``rotation`` / ``init``: float64 (G, d, d) (or (d, d) for a single matrix), the sign-fixed QR factor of
    the final / initial free matrix. ``n_steps``: optimiser steps taken; ``n_batches``: micro-batches seen;
    ``epoch_losses``: mean whip loss per epoch (undivided by accumulation); ``initial_loss`` /
    ``final_loss``: whip loss of ``init`` / ``rotation`` on all used samples.
    """

    rotation: torch.Tensor
    init: torch.Tensor
    n_steps: int
    n_batches: int
    epoch_losses: list[float] = field(default_factory=list)
    initial_loss: float = float("nan")
    final_loss: float = float("nan")


@dataclass
class CalibratedRotations:
    """R1 (hidden × hidden, float64) and R2 ((L, n_kv, d, d), float64) fitted on a model, with fit logs."""

    r1: torch.Tensor | None
    r2: torch.Tensor | None
    r1_result: WhipResult | None = None
    r2_results: list[WhipResult] = field(default_factory=list)


# ------------------------------------------------------------------------------------------ loss / QR


def whip_loss(x: torch.Tensor, r: torch.Tensor | None = None) -> torch.Tensor:
    """DartQuant whip loss (Eq. 6): token mean of ``Σ_j exp(−|(x R)_j|)`` over the last dim.

    ``x``: (..., n); ``r``: (n, n) or None (identity). Every leading index is a token.
    """
    if x.ndim < 1 or x.shape[-1] == 0:
        raise WhipError(f"whip_loss needs x of shape (..., n) with n > 0, got {tuple(x.shape)}")
    if r is not None:
        if r.shape != (x.shape[-1], x.shape[-1]):
            raise WhipError(f"rotation of shape {tuple(r.shape)} does not match x's last dim {x.shape[-1]}")
        x = x @ r.to(x.dtype)
    return torch.exp(-x.abs()).sum(dim=-1).mean()


QR_METHODS = ("householder", "cholesky")


def _qr_householder(a: torch.Tensor) -> torch.Tensor:
    with one_cpu_thread(a.device):  # LAPACK's rounding follows the thread count (rope_quant.core.threads)
        q, r = torch.linalg.qr(a)
    d = torch.diagonal(r, dim1=-2, dim2=-1)
    s = torch.where(d < 0, -torch.ones_like(d), torch.ones_like(d))
    return q * s.unsqueeze(-2)


def _cholesky_pass(a: torch.Tensor, checked: bool = True) -> torch.Tensor:
    """One CholeskyQR pass: R = chol(AᵀA)ᵀ (upper, positive diagonal), Q = A R⁻¹.

    ``checked=False``: no host read of the factorisation's status (a failure leaves non-finite values,
    which the caller's device-side check catches)."""
    gram = a.transpose(-1, -2) @ a
    with one_cpu_thread(a.device):  # LAPACK's rounding follows the thread count (rope_quant.core.threads)
        lower = torch.linalg.cholesky(gram) if checked else torch.linalg.cholesky_ex(gram).L  # AᵀA = L Lᵀ, R = Lᵀ
        # Q = A L⁻ᵀ  <=>  Qᵀ = L⁻¹ Aᵀ
        return torch.linalg.solve_triangular(lower, a.transpose(-1, -2), upper=False).transpose(-1, -2)


def qr_orthogonal(a: torch.Tensor, method: str = "cholesky",
                  failures: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Q of ``A = QR`` with diag(R) > 0 (unique; Q = A for orthogonal A). Batched over leading dims.

    ``"householder"``: LAPACK QR plus the sign fix. ``"cholesky"`` (default): CholeskyQR2, two passes of
    ``R = chol(AᵀA)ᵀ, Q = A R⁻¹``; the product of the two upper factors has a positive diagonal, so it is the
    same unique factor, and it is an order of magnitude faster on CPU than Householder QR for the
    hidden-size matrices here (matmul + Cholesky + triangular solve, all with cheap autograd). It needs a
    full-rank A, which holds along the fit (A starts orthogonal and moves by small steps); if the Cholesky
    factorisation fails it falls back to Householder.

    ``failures``: a list that receives a 0-d device bool per call (True: CholeskyQR2 failed here) instead
    of the fallback, so nothing is read on the host (the fit loop reads them once at its end and refits with
    Householder if any is True).
    """
    if method not in QR_METHODS:
        raise WhipError(f"QR method must be one of {QR_METHODS}, got {method!r}")
    if method == "householder":
        return _qr_householder(a)
    if failures is not None:
        q = _cholesky_pass(_cholesky_pass(a, checked=False), checked=False)
        with torch.no_grad():
            eye = torch.eye(q.shape[-1], dtype=q.dtype, device=q.device)
            err = (q.transpose(-1, -2) @ q - eye).abs().max()
            tol = 1e-4 if q.dtype in (torch.float32, torch.float16, torch.bfloat16) else 1e-10
            failures.append(~(err <= tol))  # NaN (a failed factorisation) counts as a failure
        return q
    try:
        q = _cholesky_pass(_cholesky_pass(a))
    except torch.linalg.LinAlgError:
        return _qr_householder(a)
    with torch.no_grad():  # ill-conditioned A: CholeskyQR2 loses orthogonality; use Householder then
        eye = torch.eye(q.shape[-1], dtype=q.dtype, device=q.device)
        err = (q.transpose(-1, -2) @ q - eye).abs().max()
    tol = 1e-4 if q.dtype in (torch.float32, torch.float16, torch.bfloat16) else 1e-10
    if not torch.isfinite(err) or err > tol:
        return _qr_householder(a)
    return q


class _QRAnalytic(torch.autograd.Function):
    """Q of ``A = QR`` (diag R > 0) with the closed-form backward for a loss of Q alone:
    ``Ā = (Q̄ + Q copyltu(M)) R⁻ᵀ``, ``M = −Q̄ᵀQ``, ``copyltu(M) = tril(M) + tril(M, −1)ᵀ`` (the QR
    adjoint of Walter & Lehmann / Seeger et al. with R̄ = 0): three n³ products instead of CholeskyQR2's graph."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, method: str = "cholesky",  # type: ignore[override]
                failures: list[torch.Tensor] | None = None) -> torch.Tensor:
        q = qr_orthogonal(a, method, failures)
        ctx.save_for_backward(q, torch.triu(q.transpose(-1, -2) @ a))
        return q

    @staticmethod
    def backward(ctx, gq: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        q, r = ctx.saved_tensors
        m = -(gq.transpose(-1, -2) @ q)
        b = gq + q @ (torch.tril(m) + torch.tril(m, -1).transpose(-1, -2))
        with one_cpu_thread(b.device):
            return torch.linalg.solve_triangular(r.transpose(-1, -2), b, upper=False, left=False), None, None


# ------------------------------------------------------------------------------------------ fitting


def _as_heads(samples: torch.Tensor, n: int | None, groups: int) -> torch.Tensor:
    """Reshape samples to (N, T, H, d): (N, T, n) → H = 1, (N, T, H, d) kept, (N, n) → T = 1."""
    if not isinstance(samples, torch.Tensor) or not torch.is_floating_point(samples):
        raise WhipError("samples must be a floating-point tensor")
    if samples.ndim == 2:
        samples = samples[:, None, :]
    if samples.ndim == 3:
        samples = samples[:, :, None, :]
    if samples.ndim != 4:
        raise WhipError(f"samples must be (N, n), (N, T, n) or (N, T, H, d); got {tuple(samples.shape)}")
    if n is not None and samples.shape[-1] != n:
        raise WhipError(f"samples have last dim {samples.shape[-1]}, expected n={n}")
    if samples.shape[0] == 0 or samples.shape[1] == 0:
        raise WhipError("samples are empty")
    if samples.shape[2] % groups:
        raise WhipError(f"{samples.shape[2]} heads cannot be split into {groups} rotation groups")
    if not torch.isfinite(samples).all():
        raise WhipError("samples contain NaN or inf")
    return samples


def _rotate_heads(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """x (B, T, H, d), r (G, d, d), head h uses r[h // (H/G)]: returns x_h @ r_g."""
    b, t, h, d = x.shape
    g = r.shape[0]
    xg = x.reshape(b, t, g, h // g, d)
    return torch.einsum("btgkd,gde->btgke", xg, r).reshape(b, t, h, d)


def _loss_heads(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Whip loss with the head-grouped rotation: token mean of the sum over all heads and channels."""
    y = _rotate_heads(x, r)
    return torch.exp(-y.abs()).sum(dim=(-2, -1)).mean()


#: Samples up to this many float64 bytes are scored in one piece on the CPU (today's arithmetic, bit for bit);
#: larger ones in chunks of this size on the fit device (an 8B model's 128 windows are ~9 GB in float64).
LOSS_CHUNK_BYTES = 1 << 28


def _loss_float64(x: torch.Tensor, r: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The whip loss of rotation ``r`` on all samples ``x`` (N, T, H, d), in float64 on ``device``,
    memory-bounded; a 0-d tensor on ``device`` (read by the caller, once for both losses)."""
    rd = r.to(device)
    if x.numel() * 8 <= LOSS_CHUNK_BYTES:
        return _loss_heads(x.to(device, torch.float64), rd)
    per = max(1, LOSS_CHUNK_BYTES // (8 * x[0].numel()))
    total = torch.zeros((), dtype=torch.float64, device=device)
    for start in range(0, x.shape[0], per):
        chunk = x[start:start + per].to(device=device, dtype=torch.float64)
        total = total + _loss_heads(chunk, rd) * chunk.shape[0]
    return total / x.shape[0]


#: Samples are kept on a GPU when they take at most this share of its free memory (else on the host, and each
#: batch is copied to the GPU).
SAMPLES_GPU_SHARE = 0.5


def _fits_on(device: torch.device, nbytes: int) -> bool:
    """Whether ``nbytes`` of samples may live on ``device`` (always on the CPU; on a GPU within
    :data:`SAMPLES_GPU_SHARE` of its free memory)."""
    if device.type != "cuda":
        return device.type == "cpu"
    free, _ = torch.cuda.mem_get_info(device)
    return nbytes <= SAMPLES_GPU_SHARE * free


def _init_matrix(d: int, groups: int, seed: int, init: str, dtype: torch.dtype) -> torch.Tensor:
    if init == "identity":
        base = torch.eye(d, dtype=torch.float64)
    else:
        base = hadamard.random_hadamard(d, seed, dtype=torch.float64)
    return base.expand(groups, d, d).clone().to(dtype)


def fit_rotation(
    samples: torch.Tensor,
    n: int | None = None,
    seed: int = 0,
    steps: int | None = None,
    lr: float | None = None,
    cfg: WhipConfig | None = None,
    groups: int = 1,
    init: torch.Tensor | None = None,
    device: torch.device | str | None = None,
    progress: bool = False,
    qr_method: str = "cholesky",
    **overrides,
) -> WhipResult:
    """Fit a whip-optimal rotation by QR-Orth SGD (DartQuant Sec. 3.3).

    ``samples``: (N, T, n) (N samples of T tokens), (N, n), or (N, T, H, d) per-head values with ``groups``
    rotations shared by consecutive head blocks (head h uses group h // (H/groups), the GQA mapping).
    ``steps`` / ``lr`` override ``cfg.max_steps`` / ``cfg.lr``; other ``WhipConfig`` fields can be given as
    keyword overrides. ``init``: a (d, d) or (groups, d, d) starting matrix instead of ``cfg.init``.
    ``device``: where the optimisation runs (default: the samples' device); batches are moved there.
    ``progress``: a tqdm bar over the optimiser steps (a step at width 4096 takes seconds on a CPU).
    ``qr_method``: the QR of every step (:func:`qr_orthogonal`); with ``"cholesky"`` a step where CholeskyQR2
    fails is noticed on the device and the whole fit is rerun with ``"householder"`` (no host read per step).
    Returns float64 rotations on the CPU, acting on rows (``x @ R``).
    """
    from tqdm.auto import tqdm

    args = dict(samples=samples, n=n, seed=seed, steps=steps, lr=lr, cfg=cfg, groups=groups, init=init,
                device=device, progress=progress, **overrides)

    cfg = cfg or WhipConfig()
    if steps is not None:
        overrides["max_steps"] = steps
    if lr is not None:
        overrides["lr"] = lr
    if overrides:
        try:
            cfg = replace(cfg, **overrides)
        except TypeError as exc:
            raise WhipError(f"unknown whip option: {exc}") from exc
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise WhipError(f"groups must be a positive integer, got {groups!r}")
    x_all = _as_heads(samples, n, groups)
    if cfg.nsamples is not None:
        x_all = x_all[: cfg.nsamples]
    x_all = x_all.detach().to(torch.float32)
    n_total, d = x_all.shape[0], x_all.shape[-1]

    if init is None:
        a0 = _init_matrix(d, groups, seed, cfg.init, torch.float32)
    else:
        a0 = torch.as_tensor(init, dtype=torch.float32)
        a0 = (a0.expand(groups, d, d) if a0.ndim == 2 else a0).clone()
        if a0.shape != (groups, d, d):
            raise WhipError(f"init of shape {tuple(a0.shape)}: expected ({d}, {d}) or ({groups}, {d}, {d})")
    dev = torch.device(device) if device is not None else x_all.device
    a = nn.Parameter(a0.clone().to(dev))
    opt = torch.optim.SGD([a], lr=cfg.lr, momentum=cfg.momentum)
    gen = torch.Generator().manual_seed(int(seed))
    n_draw = max(1, int(n_total * cfg.subset))
    planned = max(1, cfg.epochs * math.ceil(n_draw / cfg.batch_size) // cfg.accumulation)
    if cfg.max_steps is not None:
        planned = max(1, min(planned, cfg.max_steps))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=planned) if cfg.cosine else None

    failures: list[torch.Tensor] = []

    def qr(m: torch.Tensor) -> torch.Tensor:
        if qr_grad_for(cfg, d) == "autograd":
            return qr_orthogonal(m, qr_method, failures)
        return _QRAnalytic.apply(m, qr_method, failures)

    bar = tqdm(total=planned, desc=f"whip fit (n={d})", disable=not progress, leave=False)
    n_steps = 0
    micro = 0  # micro-batches across epochs (working schedule)
    pending = False
    epoch_losses: list[float] = []
    done = cfg.max_steps is not None and cfg.max_steps == 0
    # batch losses stay on the device (one read at the end: no host sync per step)
    epoch_batch_losses: list[list[torch.Tensor]] = []
    if x_all.device != dev and _fits_on(dev, x_all.numel() * x_all.element_size()):
        x_all = x_all.to(dev)  # the samples live where the fit runs (a GPU: no host gather per batch)
    for _epoch in range(cfg.epochs):
        if done:
            break
        order = torch.randperm(n_total, generator=gen)[:n_draw].to(x_all.device)
        losses: list[torch.Tensor] = []
        epoch_batch_losses.append(losses)
        for batch_idx, start in enumerate(range(0, n_draw, cfg.batch_size)):
            idx = order[start : start + cfg.batch_size]
            xb = x_all[idx].to(dev, non_blocking=True)
            loss = _loss_heads(xb, qr(a)) / cfg.accumulation
            loss.backward()
            pending = True
            losses.append(loss.detach())
            counter = batch_idx if cfg.released_schedule else micro
            micro += 1
            if (counter + 1) % cfg.accumulation == 0:
                opt.step()
                opt.zero_grad()
                if sched is not None:
                    sched.step()
                pending = False
                n_steps += 1
                bar.update(1)
                if progress:  # reading the loss waits for the device: only when someone watches
                    bar.set_postfix(loss=f"{losses[-1].item() * cfg.accumulation:.4g}", refresh=False)
                if cfg.max_steps is not None and n_steps >= cfg.max_steps:
                    done = True
                    break
    if pending and not cfg.released_schedule and not done:
        opt.step()  # flush the last partial accumulation (working schedule only)
        opt.zero_grad()
        n_steps += 1
        bar.update(1)
    bar.close()

    with torch.no_grad():
        r_init = qr_orthogonal(a0.to(dev, torch.float64))
        r_fit = qr_orthogonal(a.detach().to(torch.float64))
        # one read of every loss: the batch losses (float32, summed on the host in float64 per epoch as
        # before) and the two float64 losses over all samples
        flat = [t.to(torch.float64) for batch in epoch_batch_losses for t in batch]
        ends = torch.stack([_loss_float64(x_all, r_init, dev), _loss_float64(x_all, r_fit, dev)])
        failed = (torch.stack(failures).any() if failures else torch.zeros((), dtype=torch.bool, device=dev))
        values = torch.cat([torch.stack(flat) if flat else ends[:0], ends, failed.to(ends).reshape(1)]).tolist()
        if values[-1]:  # CholeskyQR2 failed at some step: the fit is redone with Householder QR throughout
            with torch.enable_grad():
                return fit_rotation(**{**args, "qr_method": "householder"})
        init_loss, final_loss = values[-3], values[-2]
        offset = 0
        for batch in epoch_batch_losses:
            epoch_losses.append(sum(v * cfg.accumulation for v in values[offset:offset + len(batch)]) / len(batch))
            offset += len(batch)
        r_init, r_fit = r_init.cpu(), r_fit.cpu()
    if samples.ndim < 4 and groups == 1:
        r_init, r_fit = r_init[0], r_fit[0]
    return WhipResult(r_fit, r_init, n_steps, micro, epoch_losses, init_loss, final_loss)

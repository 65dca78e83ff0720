"""Is the bf16-input Hessian good enough for GPTQ? (the tensor-core Hessian's validation)

On a GPU the Hessian ``H = 2 X X^T / n`` is several times faster with bfloat16 inputs and float32
accumulation (``GPTQConfig.hessian_bf16``). It changes H by the inputs' rounding, so it is used only where
GPTQ's own objective (Frantar et al. 2022, Eq. 1: the proxy loss ``tr((W − Q) H (W − Q)^T)``, scored under
the float32 Hessian) rises by at most 0.5% on the real shapes: :func:`validate_fast_hessian`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rope_quant.quant.gptq import HessianAccumulator, gptq_quantize
from rope_quant.quant.rtn import GPTQConfig

__all__ = ["FAST_HESSIAN_TOLERANCE", "FastHessianCheck", "proxy_loss", "validate_fast_hessian"]


def proxy_loss(W: torch.Tensor, Q: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """GPTQ's objective ``tr((W − Q) H (W − Q)^T)`` (Frantar et al. 2022, Eq. 1 with ``H = 2 X X^T / n``),
    a 0-d float64 tensor on H's device."""
    D = (W.to(torch.float64) - Q.to(torch.float64)).to(H.device)
    return torch.einsum("oi,ij,oj->", D, H.to(torch.float64), D)


@dataclass(frozen=True)
class FastHessianCheck:
    """The outcome of :func:`validate_fast_hessian`: both proxy losses (under the float32 Hessian) and
    their relative difference; ``ok`` when it is within ``tolerance``."""

    loss_fp32: float
    loss_fast: float
    rel_diff: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return math.isfinite(self.rel_diff) and abs(self.rel_diff) <= self.tolerance


#: The largest relative change of GPTQ's proxy loss the bf16-input Hessian may cause.
FAST_HESSIAN_TOLERANCE = 0.005


def validate_fast_hessian(W: torch.Tensor, X: torch.Tensor, bits: int, cfg: GPTQConfig | None = None,
                          clip_ratio: float = 1.0, tolerance: float = FAST_HESSIAN_TOLERANCE,
                          fast: Callable[[torch.Tensor], torch.Tensor] | None = None) -> FastHessianCheck:
    """Is the fast Hessian good enough for GPTQ on this layer? ``X`` (n, in): the layer's calibration inputs.

    GPTQ runs twice, with the float32 Hessian and with ``fast(X)`` (default: bf16 inputs, float32
    accumulation, :meth:`HessianAccumulator.add` with ``bf16_inputs``); both results are scored by the
    proxy loss ``tr((W − Q) H (W − Q)^T)`` under the float32 Hessian. ``ok`` when the two losses are within
    ``tolerance`` of each other (relative to the float32 one's).
    """
    cfg = GPTQConfig() if cfg is None else cfg

    def hessian(bf16: bool) -> torch.Tensor:
        acc = HessianAccumulator(X.shape[-1], X.device, torch.float32, bf16_inputs=bf16)
        acc.add(X)
        return acc.H
    H32 = hessian(False)
    Hf = fast(X) if fast is not None else hessian(True)
    l32 = float(proxy_loss(W, gptq_quantize(W, H32, bits, cfg, clip_ratio), H32))
    lf = float(proxy_loss(W, gptq_quantize(W, Hf, bits, cfg, clip_ratio), H32))
    rel = (lf - l32) / l32 if l32 > 0 else (0.0 if lf <= 0 else math.inf)
    return FastHessianCheck(l32, lf, rel, tolerance)

"""Per-pair angles of the R3 rotation (paper §3: Theorem, Eq. Sigmatilde, the H2 proposition).

A pair's 2x2 covariance is three same-shaped arrays ``PairCov(s11, s22, s12)``; every function
is elementwise over them, so shapes ``(n_layers, K)`` or ``(n_layers, n_kv_heads, K)`` just work.
Wherever a function takes ``cov`` it also accepts a stack of symmetric 2x2 matrices, shape ``(..., 2, 2)``
(converted once, by :func:`as_pair_cov`).
Inputs may be numpy (computed in float64) or torch tensors (kept in their dtype/device).

Notation: ``p = (s11 - s22)/2``, ``q = s12``, ``t = (s11 + s22)/2``.

- G(phi) = [[cos, -sin], [sin, cos]], applied ``y = G @ [a; b]``; its output variances are
  ``v1 = t + p cos 2phi - q sin 2phi`` and ``v2 = t - p cos 2phi + q sin 2phi``.
- Jacobi angle: ``phi_hat = 0.5 atan2(s11 - s22, 2 s12)`` equalises them.
- Surrogate (Eq. Sigmatilde): ``p~ = p C - q S``, ``q~ = p S + q C``, ``t~ = t``.
- phi* = wrap(0.5 atan2(p~, q~)) into [-pi/4, pi/4); minimax variance ``t + |p~ cos 2phi - q~ sin 2phi|``,
  analytic minimum ``lambda_bar = t``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

_HALF_PI = math.pi / 2
_QUARTER_PI = math.pi / 4


class PairCov(NamedTuple):
    """A pair's covariance: (var a, var b, cov ab), elementwise arrays of one shape."""

    s11: Any
    s22: Any
    s12: Any


class PairCovShapeError(ValueError):
    """A covariance argument is neither a (s11, s22, s12) triple nor a symmetric (..., 2, 2) stack."""


_EXPECTED_COV = ("a PairCov / 3-sequence (s11, s22, s12) of same-shaped arrays, "
                 "or an array of symmetric 2x2 matrices of shape (..., 2, 2)")
# Relative asymmetry |S01 - S10| / (|S00| + |S11|) above which a (..., 2, 2) stack is refused.
SYMMETRY_RTOL = 1e-10


# ----------------------------------------------------------------------------- backend


def _is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def _backend(*xs: Any):
    """Return (xp, conv): the array module and a converter to it, torch if any input is a tensor."""
    ref = next((x for x in xs if _is_torch(x)), None)
    if ref is None:
        return np, lambda v: np.asarray(v, dtype=np.float64)
    import torch  # only when a tensor was passed in

    dtype = ref.dtype if ref.is_floating_point() else torch.float64

    def conv(v: Any):
        if isinstance(v, torch.Tensor):
            return v.to(device=ref.device, dtype=dtype)
        return torch.as_tensor(np.asarray(v, dtype=np.float64), dtype=dtype, device=ref.device)

    return torch, conv


def _atan2(xp, y, x):
    return xp.arctan2(y, x) if xp is np else xp.atan2(y, x)


def as_pair_cov(cov: Any) -> PairCov:
    """The one conversion of a covariance argument to :class:`PairCov` (Eq. Sigmatilde's Sigma per pair).

    Accepts a :class:`PairCov`, any 3-sequence ``(s11, s22, s12)``, or a numpy array / torch tensor / nested
    list of shape ``(..., 2, 2)`` holding symmetric matrices (``s11 = S[..., 0, 0]``, ``s22 = S[..., 1, 1]``,
    ``s12`` the mean of the two off-diagonal entries). A numpy array or tensor of another shape whose
    leading axis has length 3 is read as the stacked triple. Anything else, or a (..., 2, 2) stack whose
    off-diagonal entries differ by more than :data:`SYMMETRY_RTOL` relative to ``|S00| + |S11|``, raises
    :class:`PairCovShapeError`.
    """
    if isinstance(cov, PairCov):
        return cov
    is_array = isinstance(cov, np.ndarray) or _is_torch(cov)
    if not is_array:
        if isinstance(cov, (tuple, list)) and len(cov) == 3:
            return PairCov(*cov)
        try:
            cov = np.asarray(cov, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise PairCovShapeError(f"cannot read a covariance from {type(cov).__name__}; expected "
                                    f"{_EXPECTED_COV}") from exc
    shape = tuple(cov.shape)
    if len(shape) >= 2 and shape[-2:] == (2, 2):
        return _from_matrices(cov)
    if is_array and len(shape) >= 1 and shape[0] == 3:
        return PairCov(cov[0], cov[1], cov[2])
    raise PairCovShapeError(f"covariance of shape {shape}: expected {_EXPECTED_COV}")


def _from_matrices(mats: Any) -> PairCov:
    """Split a (..., 2, 2) stack into the triple after checking it is symmetric (see :func:`as_pair_cov`)."""
    xp, conv = _backend(mats)
    mats = conv(mats)
    s11, s22 = mats[..., 0, 0], mats[..., 1, 1]
    up, low = mats[..., 0, 1], mats[..., 1, 0]
    gap = xp.abs(up - low)
    bound = SYMMETRY_RTOL * (xp.abs(s11) + xp.abs(s22))
    bad = (gap > bound) | (gap != gap)  # also NaN off-diagonals
    if bool(bad.any()):
        worst = float(gap.max())
        raise PairCovShapeError(
            f"the (..., 2, 2) covariance stack is not symmetric (largest |S01 - S10| = {worst:.3g}, "
            f"relative tolerance {SYMMETRY_RTOL:g}); expected {_EXPECTED_COV}"
        )
    return PairCov(_scalarise(s11), _scalarise(s22), _scalarise((up + low) / 2))


def _pqt(cov: PairCov, conv):
    s11, s22, s12 = (conv(v) for v in cov)
    return (s11 - s22) / 2, s12, (s11 + s22) / 2


def _scalarise(x):
    """0-d numpy results become Python floats' numpy scalars (kept as ndarray otherwise)."""
    return x[()] if isinstance(x, np.ndarray) and x.ndim == 0 else x


# ----------------------------------------------------------------------------- basic pieces


def givens(phi: Any):
    """G(phi) = [[cos phi, -sin phi], [sin phi, cos phi]] with shape ``phi.shape + (2, 2)``."""
    xp, conv = _backend(phi)
    phi = conv(phi)
    c, s = xp.cos(phi), xp.sin(phi)
    row1 = xp.stack([c, -s], -1)
    row2 = xp.stack([s, c], -1)
    return xp.stack([row1, row2], -2)


def wrap_angle(phi: Any):
    """Wrap angles into [-pi/4, pi/4) modulo pi/2 (the minimax variance has period pi/2)."""
    xp, conv = _backend(phi)
    phi = conv(phi)
    out = phi - _HALF_PI * xp.floor((phi + _QUARTER_PI) / _HALF_PI)
    # Guard the two ends against rounding in the floor's argument.
    out = xp.where(out >= _QUARTER_PI, out - _HALF_PI, out)
    out = xp.where(out < -_QUARTER_PI, out + _HALF_PI, out)
    return _scalarise(out)


def jacobi_angle(s11: Any, s22: Any, s12: Any):
    """Jacobi (variance-equalising) angle ``phi_hat = 0.5 atan2(s11 - s22, 2 s12)``, unwrapped.

    ``atan2(0, 0) = 0`` gives the identity for an isotropic pair. Range (-pi/2, pi/2].
    """
    xp, conv = _backend(s11, s22, s12)
    s11, s22, s12 = conv(s11), conv(s22), conv(s12)
    return _scalarise(0.5 * _atan2(xp, s11 - s22, 2 * s12))


def surrogate_covariance(cov: PairCov, C: Any, S: Any) -> PairCov:
    """Phase-averaged covariance Sigma~ = mean_m R_m Sigma R_m^T (Eq. Sigmatilde).

    With (C, S) from :func:`rope_quant.core.rope.phase_averages`: ``p~ = pC - qS``, ``q~ = pS + qC``,
    trace kept.
    """
    cov = as_pair_cov(cov)
    _, conv = _backend(*cov, C, S)
    p, q, t = _pqt(cov, conv)
    C, S = conv(C), conv(S)
    p_t = p * C - q * S
    q_t = p * S + q * C
    return PairCov(_scalarise(t + p_t), _scalarise(t - p_t), _scalarise(q_t + 0 * t))


def equalising_angle(cov: PairCov, C: Any = 1.0, S: Any = 0.0):
    """phi* = wrap(0.5 atan2(Sig~11 - Sig~22, 2 Sig~12)) in [-pi/4, pi/4) (Theorem (ii)).

    With the defaults ``C=1, S=0`` the surrogate is Sigma itself and this is the wrapped phi_hat.
    """
    sur = surrogate_covariance(cov, C, S)
    return wrap_angle(jacobi_angle(*sur))


def rotated_variances(cov: PairCov, phi: Any):
    """Diagonal of G(phi) Sigma G(phi)^T: the variances of the two outputs of the pair."""
    cov = as_pair_cov(cov)
    xp, conv = _backend(*cov, phi)
    p, q, t = _pqt(cov, conv)
    phi = conv(phi)
    f = p * xp.cos(2 * phi) - q * xp.sin(2 * phi)
    return _scalarise(t + f), _scalarise(t - f)


def minimax_variance(cov: PairCov, phi: Any):
    """max of the two rotated variances of ``cov`` at angle ``phi`` (Theorem (iii))."""
    cov = as_pair_cov(cov)
    xp, conv = _backend(*cov, phi)
    p, q, t = _pqt(cov, conv)
    phi = conv(phi)
    f = p * xp.cos(2 * phi) - q * xp.sin(2 * phi)
    return _scalarise(t + xp.abs(f))


def analytic_minimum(cov: PairCov):
    """lambda_bar = (s11 + s22) / 2, the minimum over phi of the minimax variance (Theorem (iv))."""
    cov = as_pair_cov(cov)
    _, conv = _backend(*cov)
    return _scalarise(_pqt(cov, conv)[2])


def minimax_excess(cov: PairCov, phi: Any, C: Any = 1.0, S: Any = 0.0):
    """Excess of angle ``phi`` over lambda_bar on the surrogate: ``|p~ cos 2phi - q~ sin 2phi|``.

    Equal to ``minimax_variance(surrogate, phi) - analytic_minimum(cov)`` but free of cancellation.
    """
    cov = as_pair_cov(cov)
    xp, conv = _backend(*cov, phi, C, S)
    p, q, _ = _pqt(cov, conv)
    C, S, phi = conv(C), conv(S), conv(phi)
    p_t = p * C - q * S
    q_t = p * S + q * C
    return _scalarise(xp.abs(p_t * xp.cos(2 * phi) - q_t * xp.sin(2 * phi)))


def h2_variances(cov: PairCov, C: Any = 1.0, S: Any = 0.0):
    """Output variances of the per-pair H2 = G(pi/4): ``(t - s12, t + s12)`` (on the surrogate
    when C, S are given). The fixed 2x2 Hadamard reflection gives the same pair, swapped."""
    sur = surrogate_covariance(cov, C, S)
    _, conv = _backend(*sur)
    p, q, t = _pqt(sur, conv)
    return _scalarise(t - q), _scalarise(t + q)

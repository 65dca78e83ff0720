"""The errors of the offline rotations and the online R4 hook: bad input, refused before any weight changes."""

from __future__ import annotations

from rope_quant.model import arch

__all__ = [
    "RotationError", "UnsupportedArchitectureError", "NotFunctionPreservingError", "TiedEmbeddingsError",
    "NormsNotFusedError", "RotationShapeError", "NotOrthogonalError", "AlreadyRotatedError", "MissingRotationError",
]


class RotationError(ValueError):
    """Base class for bad input to the offline rotations."""


class UnsupportedArchitectureError(RotationError, arch.ArchitectureError):
    """The model's modules are not what the rotations rely on (e.g. a norm that is not an RMSNorm)."""


class NotFunctionPreservingError(RotationError):
    """The architecture declares the requested rotation not function-preserving (see
    :func:`rope_quant.model.arch.rotation_refusal`); the message names the modules responsible."""


class TiedEmbeddingsError(RotationError):
    """lm_head shares its weight with embed_tokens; call :func:`untie_embeddings` first."""


class NormsNotFusedError(RotationError):
    """R1 needs unit-weight RMSNorms; call :func:`fuse_norms` first."""


class RotationShapeError(RotationError):
    """A rotation matrix (or stack of them) has the wrong shape for this model."""


class NotOrthogonalError(RotationError):
    """A matrix given as a rotation is not orthogonal."""


class AlreadyRotatedError(RotationError):
    """The online R4 Hadamard is already installed on this model."""


class MissingRotationError(RotationError):
    """A rotation choice needs a matrix (or calibration ids) that was not given."""

"""Errors of the calibration-statistics components (App. A.2.1) and the layer check they share."""

from __future__ import annotations


class CalibrationError(ValueError):
    """Base class for bad calibration input or state."""


class NonFiniteCalibrationError(CalibrationError):
    """The calibration input of a (layer, stream) holds NaN or Inf values."""


class CalibrationShapeError(CalibrationError):
    """The calibration input or configuration has the wrong shape."""


class UnknownStreamError(CalibrationError):
    """A stream other than 'q' or 'k' was named."""


class UnknownPoolingRuleError(CalibrationError):
    """A pooling rule outside :data:`rope_quant.calib.rules.POOLING_RULES` was named."""


class EmptyStatisticsError(CalibrationError):
    """A covariance was asked for a layer/stream that has seen no rows."""


class IncompatibleStatsError(CalibrationError):
    """Two accumulators with different configurations were merged."""


class StatsFileError(CalibrationError):
    """A saved statistics file is malformed or of an unknown version."""


class MissingStatsFileError(FileNotFoundError, CalibrationError):
    """A statistics file does not exist."""


def check_layer(layer: int, n_layers: int) -> int:
    """``layer`` as an int in 0..n_layers-1, else CalibrationShapeError."""
    if isinstance(layer, bool) or int(layer) != layer or not 0 <= layer < n_layers:
        raise CalibrationShapeError(f"layer {layer!r} is outside 0..{n_layers - 1}")
    return int(layer)

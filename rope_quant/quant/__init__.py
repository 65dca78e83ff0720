"""Fake quantisers (dynamic, static, RTN) and GPTQ.

Until 0.2.0 ``rope_quant.quant`` was one module; its names (``QuantConfig``, ``fake_quant``, ...) now live in
:mod:`rope_quant.quant.quantizers` (``StaticChannelQuantizer``: :mod:`rope_quant.quant.static`) and still resolve
here, with a :class:`DeprecationWarning`, until 0.3.0.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    from rope_quant._deprecation import OLD_QUANT_NAMES, moved_attribute

    if name in OLD_QUANT_NAMES:
        return moved_attribute(__name__, name, ["rope_quant.quant.quantizers", "rope_quant.quant.static"])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Key quantisers: the public path of :mod:`rope_quant.quant.keys` (the package holds the registry, the options,
the per-layer quantisers, RoPE undone and redone, and the pair-width allocation; docs/key_quantizers.md). Every
public name of the package is importable here."""

from __future__ import annotations

from rope_quant.quant.keys import *  # noqa: F403 - the package's public names, this module's since 0.2.0
from rope_quant.quant.keys import __all__ as __all__

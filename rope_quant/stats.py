"""Deprecated since 0.2.0, removed in 0.3.0: this module is now ``rope_quant.core.stats``."""

from rope_quant._deprecation import alias_module

alias_module(__name__)

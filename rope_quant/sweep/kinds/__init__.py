"""The built-in cell kinds, one module each (:mod:`rope_quant.sweep.cellkind` holds the registry).

Importing a kind module registers its kind; :mod:`rope_quant.sweep.kinds.builtin` imports them all. This
package's ``__init__`` imports nothing, so the light kinds (long-context, lm-eval) load without the heavy
ones (NIAH and static import torch).
"""

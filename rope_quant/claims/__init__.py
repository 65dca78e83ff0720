"""The claims layer: the paper's claims as data (registry.py, paper.py; App. I's on every model: cross_model.py), the
key quantisers against R3 (keys.py),
the paper's question inside llama.cpp (runtime.py),
where their cells' values come from (stores.py), the equal-bits checks (bits.py) and the one engine that decides
them (engine.py). Above ``experiment/`` and ``core/``, below ``sweep/`` and ``cli/``; imports only ``core/`` at
import (docs/ARCHITECTURE.md). Importing the package registers the paper's entries (paper.py, then cross_model.py,
which imports it), then the key quantisers' (keys.py), then llama.cpp's (runtime.py); nothing heavy is imported.
"""

from __future__ import annotations

from rope_quant.claims import cross_model as cross_model
from rope_quant.claims import keys as keys
from rope_quant.claims import paper as paper
from rope_quant.claims import runtime as runtime

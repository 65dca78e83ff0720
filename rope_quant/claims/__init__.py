"""The claims layer: the paper's claims as data (registry.py, paper.py), where their cells' values come from
(stores.py) and the one engine that decides them (engine.py). Above ``experiment/`` and ``core/``, below
``sweep/`` and ``cli/``; imports only ``core/`` (docs/ARCHITECTURE.md). Importing the package registers the
paper's entries (paper.py); nothing heavy is imported.
"""

from __future__ import annotations

from rope_quant.claims import paper as paper

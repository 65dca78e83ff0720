"""The claims layer: the paper's claims as data (registry.py) and where their cells' values come from
(stores.py). Above ``experiment/`` and ``core/``, below ``sweep/`` and ``cli/``; imports only ``core/``
(docs/ARCHITECTURE.md). Nothing heavy is imported.
"""

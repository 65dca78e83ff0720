"""rope_quant: R3 (the online q/k rotation after RoPE) in rotation-based W4A4KV4 quantisation.

Layers, bottom up (imports point downwards; the map and the path of one cell are in docs/ARCHITECTURE.md):
``io`` → ``core`` (pure math, the R3 registry) → ``model`` (architecture adapter, loading) → ``quant``
(quantisers, GPTQ) → ``calib`` (statistics, angle objectives, diagnostics) → ``rotations`` (R1/R2/R4, whip,
the attention hook) → ``experiment`` (config, pipeline, data, evaluation) → ``sweep`` (manifests, records,
runner, presets, report) → ``cli``. ``pytest_plugin`` imports nothing heavy.
"""

__version__ = "0.1.0"

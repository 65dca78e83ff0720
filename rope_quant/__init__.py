"""rope_quant: R3 (the online q/k rotation after RoPE) in rotation-based W4A4KV4 quantisation.

Layers, bottom up (imports point downwards): ``rope``/``angles``/``stats`` (pure math) →
``hadamard``/``transforms`` (R3 registry) → ``calibration``/``objectives``/``diagnostics``/``verify`` →
``quant``/``gptq``/``rotation``/``whip``/``attention`` → ``models``/``data``/``evaluate``/``pipeline`` →
``sweep``/``report``/``cli``. ``pytest_plugin`` imports nothing heavy.
"""

__version__ = "0.1.0"

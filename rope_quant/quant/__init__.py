"""Fake quantisers (dynamic, static, RTN) and GPTQ."""

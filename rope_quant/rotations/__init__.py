"""Offline rotations R1/R2/R4, DartQuant whip, and the attention hook (R3 + KV quantisers)."""

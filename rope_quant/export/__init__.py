"""Deployable checkpoints from a cell (docs/export.md): hf (everything folded) and compressed-tensors (W4 packed)."""

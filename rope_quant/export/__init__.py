"""Deployable checkpoints from a cell (issue 25): hf (everything folded) and compressed-tensors (W4 packed)."""

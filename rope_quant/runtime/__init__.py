"""Runtimes that score our models outside our own simulator (llama.cpp: :mod:`rope_quant.runtime.llamacpp`)."""

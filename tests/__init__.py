"""The rope_quant test suite. A package only so that ``tests._support`` (shared helpers) has one import path."""

"""Corpora: text by name or path (sources.py), documents and their split (documents.py), token streams and
calibration windows (token_streams.py)."""

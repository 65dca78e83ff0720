"""Calibration statistics, R3 angle objectives, K diagnostics and phi* verification."""

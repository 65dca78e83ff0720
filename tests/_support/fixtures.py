"""Fixtures shared by every layer (registered by the root conftest.py through ``pytest_plugins``)."""

from __future__ import annotations

from typing import Any

import pytest

from tests._support.models import tiny_base


@pytest.fixture
def tiny_base_model(embedded_model) -> tuple[Any, Any]:
    """A fresh (tiny random Llama, embedded tokenizer) per test: :func:`tests._support.tiny_base` at seed 0."""
    return tiny_base(embedded_model)

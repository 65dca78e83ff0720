"""Session-wide fixtures shared by every test layer.

Markers, ``--rq-*`` options and the claims table come from the installed plugin
(``rope_quant.pytest_plugin``). Heavy objects are built lazily, once per session.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def embedded_model():
    """(model, tokenizer) of the embedded SmolLM2-135M in fp32 on CPU, loaded once per session.

    Tests must not mutate it: build rotated or quantised copies with ``copy.deepcopy``.
    """
    from rope_quant.model.loading import ModelNotFoundError, load_model

    try:
        return load_model("smollm2-135m", device="cpu")
    except ModelNotFoundError as exc:  # the README install step provides it; say so if it is missing
        pytest.fail(f"embedded model unavailable: {exc}")


pytest_plugins = ["pytester"]

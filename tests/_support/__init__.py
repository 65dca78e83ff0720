"""Helpers shared by the test modules, so that no test module imports from another.

Import them as ``from tests._support import tiny_llama`` (the repository root is on ``sys.path`` through
``pythonpath = .`` in pytest.ini, so this works from the repo root, from tox and under ``-p xdist``). The
fixtures (``tiny_base_model``) are registered by the root conftest.py from :mod:`tests._support.fixtures`.

* :func:`tiny_llama` — the one tiny random Llama builder (2 layers, hidden 64, GQA 4/2, head_dim 16 unless told);
* :class:`ByteTokenizer` — bytes as token ids, for a random model driven through the pipeline;
* :func:`tiny_base` — that model with the embedded tokenizer's vocabulary, as the pipeline's ``base``;
* :data:`TINY` — the smallest pipeline budget the numerics use (64-token windows, 4 calibration, 2 scored);
* :func:`tiny_gemma3`, :func:`tiny_qwen3` — tiny random Gemma 3 (sliding + full layers) and Qwen3 (q/k norms);
  :func:`randomise_norms` draws their norm weights;
* :class:`FakeConfig` — a torch-free stand-in for ``RunConfig`` in the sweep / report tests;
* :func:`range_keys` — synthetic heavy-tailed K rows with outlier channels for the range objective;
* :mod:`tests._support.range_reference` — the range fit frozen at commit 0a3b657.
"""

from tests._support.fake_config import FakeConfig
from tests._support.keys import range_keys
from tests._support.models import (
    TINY,
    ByteTokenizer,
    randomise_norms,
    tiny_base,
    tiny_gemma3,
    tiny_llama,
    tiny_qwen3,
)

__all__ = ["TINY", "ByteTokenizer", "FakeConfig", "randomise_norms", "range_keys", "tiny_base", "tiny_gemma3",
           "tiny_llama", "tiny_qwen3"]

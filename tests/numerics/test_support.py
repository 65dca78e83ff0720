"""tests/_support: test modules share helpers through it, never by importing one another, and
its tiny-Llama builder gives exactly the model the explicit construction gives (so migrating a test to it
changes none of the test's numbers)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests._support import TINY, range_keys, tiny_base, tiny_llama

TESTS = Path(__file__).resolve().parents[1]
# Helper modules that must keep their own top-level name (submitit pickles cells by module path).
HELPERS = {"submitit_cells", "_timing"}


def _sibling_imports(path: Path) -> list[str]:
    local = {p.stem for p in path.parent.glob("*.py")} - HELPERS - {"conftest"}
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found += [n for n in names if n.split(".")[0] in local]
    return found


def test_no_test_module_imports_another():
    offenders = {}
    for path in sorted(TESTS.rglob("*.py")):
        rel = path.relative_to(TESTS).as_posix()
        if rel.startswith("_support/"):
            continue
        if imports := _sibling_imports(path):
            offenders[rel] = imports
    assert not offenders, f"import shared helpers from tests._support instead: {offenders}"


def test_the_sibling_import_finder_can_fail(tmp_path):
    (tmp_path / "test_a.py").write_text("def helper(): ...\n")
    (tmp_path / "test_b.py").write_text("from test_a import helper\nimport os\n")
    assert _sibling_imports(tmp_path / "test_b.py") == ["test_a"]


@pytest.mark.parametrize("kw, explicit", [
    (dict(vocab=96, max_positions=256), dict(vocab_size=96, intermediate_size=128, max_position_embeddings=256)),
    (dict(vocab=128, intermediate=96, max_positions=64, tied=True, seed=3),
     dict(vocab_size=128, intermediate_size=96, max_position_embeddings=64, tie_word_embeddings=True)),
    (dict(vocab=101, hidden=32, intermediate=64, initializer_range=0.5),
     dict(vocab_size=101, hidden_size=32, intermediate_size=64, max_position_embeddings=512, initializer_range=0.5)),
])
def test_tiny_llama_is_the_explicit_construction(kw, explicit):
    kw = dict(kw)
    vocab, seed = kw.pop("vocab"), kw.get("seed", 0)
    built = tiny_llama(vocab, **kw)
    torch.manual_seed(seed)
    cfg = LlamaConfig(**{"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                         "num_key_value_heads": 2, **explicit})
    reference = LlamaForCausalLM(cfg).eval()
    ours, theirs = built.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert not built.training and built.config.head_dim == cfg.hidden_size // cfg.num_attention_heads


def test_tiny_base_uses_the_tokenizers_vocabulary():
    class Fake:
        class config:
            vocab_size = 77

    model, tok = tiny_base((Fake, "tokenizer"))
    assert model.config.vocab_size == 77 and tok == "tokenizer" and model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert TINY == dict(seqlen=64, calib_windows=4, eval_windows=2)


def test_range_keys_are_deterministic_and_shaped():
    rows, pos, inv = range_keys(5, n=40, heads=3, d=8)
    again = range_keys(5, n=40, heads=3, d=8)
    assert rows.shape == (40, 3, 8) and pos.shape == (40,) and inv.shape == (4,)
    assert (rows == again[0]).all() and (pos == again[1]).all()

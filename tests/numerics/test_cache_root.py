"""The one cache: one root (XDG everywhere), one reader (content or None, one warning channel), one atomic writer."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from rope_quant import io
from rope_quant.corpora import token_streams
from rope_quant.model import model_cache


def test_every_cache_root_honours_xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for env in (io.CACHE_ENV, model_cache.CACHE_ENV):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert token_streams.default_cache_dir() == tmp_path / "xdg" / "rope_quant"
    assert model_cache.cache_root() == tmp_path / "xdg" / "rope_quant" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert model_cache.cache_root() == Path.home() / ".cache" / "rope_quant" / "models"
    monkeypatch.setenv(model_cache.CACHE_ENV, str(tmp_path / "m"))
    monkeypatch.setenv(io.CACHE_ENV, str(tmp_path / "c"))
    assert model_cache.cache_root() == tmp_path / "m" and token_streams.default_cache_dir() == tmp_path / "c"


def test_read_cache_is_content_or_none_with_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "x.pt"
    assert io.read_cache(path, io.load_tensors, "test cache") is None and not caplog.records  # missing: silent
    assert io.save_tensors(path, {"ids": torch.arange(3)}, "test cache")
    assert torch.equal(io.read_cache(path, io.load_tensors, "test cache")["ids"], torch.arange(3))
    assert [p.name for p in tmp_path.iterdir()] == ["x.pt"]  # no temporary file left
    path.write_bytes(b"garbage")
    with caplog.at_level(logging.WARNING, logger="rope_quant.cache"):
        assert io.read_cache(path, io.load_tensors, "test cache", "recomputing it") is None
    (record,) = caplog.records
    assert record.name == "rope_quant.cache" and "ignoring unreadable test cache" in record.getMessage()
    assert str(path) in record.getMessage() and record.getMessage().endswith("recomputing it")


def test_a_cache_that_cannot_be_written_is_warned_not_raised(tmp_path: Path, caplog) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="rope_quant.cache"):
        assert not io.save_tensors(blocker / "x.pt", {"a": 1}, "test cache")
    assert any("could not write test cache" in r.getMessage() for r in caplog.records)

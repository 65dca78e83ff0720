"""rope_quant.io: atomic writes (unique temporary names, failure leaves the old file and no litter),
strict JSON conversion, the Markdown table renderer."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from rope_quant import io as rio


def test_bytes_text_json_round_trip_and_permissions(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "x.bin"
    assert rio.atomic_write_bytes(target, b"\x00\x01") == target  # parent created
    assert target.read_bytes() == b"\x00\x01"
    assert target.stat().st_mode & 0o777 != 0o600  # not mkstemp's private mode
    rio.atomic_write_text(tmp_path / "t.txt", "φ* ok\n")
    assert (tmp_path / "t.txt").read_bytes() == "φ* ok\n".encode()
    rio.atomic_write_json(tmp_path / "x.json", {"a": float("nan"), "b": (1, 2)})
    assert (tmp_path / "x.json").read_text() == '{\n  "a": null,\n  "b": [\n    1,\n    2\n  ]\n}\n'


def test_writer_form_for_file_object_writers(tmp_path: Path) -> None:
    arr = np.arange(6.0).reshape(2, 3)
    with rio.atomic_writer(tmp_path / "a.npz") as handle:
        np.savez(handle, arr=arr)
    with np.load(tmp_path / "a.npz") as data:
        np.testing.assert_array_equal(data["arr"], arr)


def test_concurrent_writers_never_share_a_temporary_file(tmp_path: Path, monkeypatch) -> None:
    target = tmp_path / "shared.txt"
    names: list[str] = []
    real_mkstemp = rio.tempfile.mkstemp

    def spy(*args, **kwargs):
        fd, name = real_mkstemp(*args, **kwargs)
        names.append(name)
        return fd, name

    monkeypatch.setattr(rio.tempfile, "mkstemp", spy)
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def write(i: int) -> None:
        try:
            with rio.atomic_writer(target) as handle:
                barrier.wait(timeout=10)  # every writer holds its temporary file open at once
                handle.write(f"writer {i}\n".encode() * 100)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(names)) == 8 and all(Path(n).parent == tmp_path for n in names)
    lines = target.read_text().splitlines()
    assert len(lines) == 100 and len(set(lines)) == 1  # one writer's complete content, not a mixture
    assert [p.name for p in tmp_path.iterdir()] == ["shared.txt"]


def test_failure_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path, monkeypatch) -> None:
    target = tmp_path / "x.json"
    rio.atomic_write_json(target, {"a": 1})
    before = target.read_bytes()

    with pytest.raises(RuntimeError, match="writer failed"), rio.atomic_writer(target) as handle:
        handle.write(b"partial")
        raise RuntimeError("writer failed")
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError, match="disk full"):
        rio.atomic_write_text(target, "new content")
    assert target.read_bytes() == before  # old content intact
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]  # temporary file removed


def test_to_jsonable() -> None:
    @dataclasses.dataclass
    class Point:
        x: float
        tags: tuple[str, ...]

    value = {1: np.float32(0.5), "arr": np.arange(3), "nan": float("inf"), "path": Path("a/b"),
             "point": Point(np.float64(2.0), ("u",)), "set": frozenset({3}), "np_nan": np.float64("nan"),
             "other": object}
    out = rio.to_jsonable(value)
    assert out == {"1": 0.5, "arr": [0, 1, 2], "nan": None, "path": "a/b", "point": {"x": 2.0, "tags": ["u"]},
                   "set": [3], "np_nan": None, "other": str(object)}
    json.dumps(out, allow_nan=False)


def test_markdown_table() -> None:
    rows = [{"config": "hadamard", "ppl": "12.000"}, {"config": "pairwise_only"}]
    assert rio.markdown_table(rows, ["config", "ppl"]) == (
        "| config | ppl |\n|---|---|\n| hadamard | 12.000 |\n| pairwise_only |  |")
    assert rio.markdown_table([], ["a"], headers=["A (unit)"]) == "| A (unit) |\n|---|"
    assert rio.markdown_table([{"n": 3}], ["n"]).endswith("| 3 |")
    with pytest.raises(ValueError):
        rio.markdown_table([], ["a", "b"], headers=["a"])

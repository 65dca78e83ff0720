"""``--format hf``: a standard transformers checkpoint with R1, R2 and a RoPE-commuting R3 folded in.

The directory holds what ``save_pretrained`` writes (``model.safetensors``, ``config.json``,
``generation_config.json``), the tokenizer files where the tokenizer can save itself, and
``rope_quant_export.json`` (the cell's configuration and what was folded). It loads with a plain
``AutoModelForCausalLM.from_pretrained(dir)``; nothing of rope_quant is needed.

The config describes what is saved: R1 unties the embeddings (``tie_word_embeddings=False``) and fuses every
RMSNorm scale into the linears that read it (the saved norm weights are 1, or 0 for Gemma's ``1 + w`` norms).
A configuration with an online part (R4, a non-commuting R3) is refused (:class:`OnlinePartError`), naming
the part and the format that can carry it; so are activation and KV quantisation, which this format has no
fields for, with a note (the weights are written, the runtime quantisers are not).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from rope_quant.export.build import ExportModel
from rope_quant.export.fold import refuse_online_parts
from rope_quant.io import atomic_write_json, to_jsonable
from rope_quant.model import arch

__all__ = ["EXPORT_INFO", "check_hf", "write_hf", "runtime_quant_notes"]

#: Provenance file written next to the weights.
EXPORT_INFO = "rope_quant_export.json"


def check_hf(cfg: Any, head_dim: int) -> None:
    """Refuse (before any expensive step) a configuration with an online part: hf has no runtime transforms."""
    refuse_online_parts(cfg, head_dim, "hf", "Export it with --format compressed-tensors (online transforms in its "
                        "transform_config)")


def runtime_quant_notes(cfg: Any) -> list[str]:
    """Notes for the runtime quantisers (activations, K, V) that an hf checkpoint cannot describe."""
    q = cfg.quant
    off = [f"{n}={getattr(q, n).bits}-bit" for n in ("a", "k", "v") if getattr(q, n).enabled]
    if not off:
        return []
    return [f"note: --format hf has no fields for runtime quantisation: {', '.join(off)} not written "
            "(the checkpoint runs them in 16/32-bit)"]


def _set_dtype(em: ExportModel, dtype: torch.dtype) -> None:
    em.model.to(dtype)
    for cfg in {id(c): c for c in (em.model.config, arch.text_config(em.model))}.values():
        cfg.dtype = dtype
        if hasattr(cfg, "torch_dtype"):
            try:
                cfg.torch_dtype = dtype
            except AttributeError:  # a read-only alias of dtype on 5.x
                pass


def write_hf(em: ExportModel, out_dir: str | os.PathLike[str], dtype: torch.dtype, *,
             weights: str, source: dict[str, Any]) -> Path:
    """Save ``em`` into ``out_dir`` (an empty staging directory) as an hf checkpoint in ``dtype``."""
    out = Path(out_dir)
    check_hf(em.cfg, arch.dims(em.model).head_dim)
    _set_dtype(em, dtype)
    model: Any = em.model
    tied = arch.embeddings_tied(model)
    for cfg in {id(c): c for c in (model.config, arch.text_config(model))}.values():
        if hasattr(cfg, "tie_word_embeddings"):
            cfg.tie_word_embeddings = tied
    model.save_pretrained(out, safe_serialization=True)
    tokenizer = em.tokenizer
    saved_tok = callable(getattr(tokenizer, "save_pretrained", None))
    if saved_tok:
        tokenizer.save_pretrained(out)
    else:
        em.notes.append(f"note: the tokenizer ({type(tokenizer).__name__}) cannot save itself: not written")
    em.notes.extend(runtime_quant_notes(em.cfg))
    info = {
        "format": "hf", "dtype": str(dtype).removeprefix("torch."), "weights": weights,
        "folded": {"r1": em.cfg.rotation.r1.value, "r2": em.cfg.rotation.r2.value,
                   "r3": em.cfg.online.transform, "untied_embeddings": not tied},
        "online": [], "config": em.cfg.to_dict(), "source": source, "notes": list(em.notes),
    }
    atomic_write_json(out / EXPORT_INFO, to_jsonable(info))
    return out

"""The model an export writes: one cell's rotated model, plain (no rope_quant hook), R3 folded where it commutes.

:func:`build_export_model` rebuilds the cell with :func:`rope_quant.experiment.pipeline.build_quantized_model`
(a weight and statistics cache hit when the results directory still holds them; otherwise they are
recomputed with a note, or refused with ``recompute=False`` before any expensive step). From it come the
R1/R2 matrices, the per-layer R3 (its angles) and the integer weight codes. The returned model then is:

* ``unquantised``: a fresh copy of the base model with the same R1/R2 (and R4) folded, weights fp;
* ``dequantised``: the cell's own GPTQ/RTN weights (codes · scales).

Either way the activation quantisers, the custom attention function and (unless ``keep_r4_hook``) the online
R4 hooks are removed, and the commuting part of R3 is folded (:func:`rope_quant.export.fold.fold_commuting_part`,
through the cells' own :func:`rope_quant.rotations.fold_r3.fold_r3`).
"""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rope_quant.experiment.config import RunConfig, WeightMode
from rope_quant.export.fold import ExportError, check_fold_layout, fold_commuting_part, r3_split
from rope_quant.model import arch

__all__ = ["WeightSource", "ExportModel", "build_export_model", "weight_cache_present"]


class WeightSource(StrEnum):
    """Which weights an export writes: the rotated fp weights, or the cell's quantised weights dequantised."""

    UNQUANTISED = "unquantised"
    DEQUANTISED = "dequantised"


@dataclass
class ExportModel:
    """A plain transformers model ready to save, with what went into it."""

    model: nn.Module
    tokenizer: Any
    cfg: RunConfig
    transforms: list[Any]
    codes: dict[str, Any] = field(default_factory=dict)  # module name -> packing.WeightCodes (quantised weights)
    notes: list[str] = field(default_factory=list)
    r4_online: bool = False


def weight_cache_present(cfg: RunConfig, cache_dir: str | os.PathLike | None, model: nn.Module,
                         calib: torch.Tensor) -> tuple[bool, Path | None]:
    """(the cell's weight cache file exists, its path) for ``cache_dir`` (no cache dir: (False, None))."""
    from rope_quant.experiment import weight_cache

    if cache_dir is None:
        return False, None
    path = weight_cache.weight_cache_path(Path(cache_dir), cfg, weight_cache.model_fingerprint(model),
                                          weight_cache.data_fingerprint(calib))
    return path is not None and path.is_file(), path


def _codes(model: nn.Module, cfg: RunConfig, cache_path: Path | None) -> dict[str, Any]:
    """module name -> WeightCodes of every quantised linear, from the modules or from the weight cache file."""
    from rope_quant.quant import packing

    out: dict[str, Any] = {}
    from rope_quant.experiment.weight_cache import read_codes

    saved = read_codes(cache_path)
    for name, mod in model.named_modules():
        c = getattr(mod, packing.CODES_ATTR, None)
        key = f"{name}.weight"
        if c is None and key in saved:
            c = packing.from_dict(saved[key])
        if c is not None and packing.encode(mod.weight, c) is not None:
            out[name] = c
    return out


def drop_loader_quantization(model: Any) -> None:
    """Forget how the source checkpoint was stored (e.g. GGUF): its weights were dequantised at load, and what
    an export saves is described by the export's own config (a GGUF quantizer also blocks ``save_pretrained``)."""
    model.hf_quantizer = None
    if "is_quantized" in vars(model):
        model.is_quantized = False
    for cfg in {id(c): c for c in (model.config, arch.text_config(model))}.values():
        if "quantization_config" in vars(cfg):
            del cfg.quantization_config


def build_export_model(cfg: RunConfig, cache_dir: str | os.PathLike | None = None,
                       base: tuple[nn.Module, Any] | None = None, *,
                       weights: WeightSource = WeightSource.UNQUANTISED, recompute: bool = True,
                       keep_r4_hook: bool = False, corpus: Any = None, fold: bool = True) -> ExportModel:
    """The cell ``cfg`` as a plain model with its commuting R3 folded (see the module docstring).

    ``recompute=False`` raises :class:`ExportError` (naming the missing cache file) when the weight cache was
    pruned, before the weights are rebuilt; otherwise the rebuild adds a note to ``notes``. ``fold=False`` keeps
    W_Q/W_K as the cell has them (compressed-tensors: a fold would move quantised rows off their grid).
    """
    from rope_quant.corpora import token_streams
    from rope_quant.experiment import pipeline
    from rope_quant.rotations.offline import RotationKind, rotate_model

    weights = WeightSource(weights)
    if weights == WeightSource.DEQUANTISED and cfg.quant.w.mode == WeightMode.NONE:
        raise ExportError("--weights dequantised needs a cell with quantised weights (this one has weights=none)")
    if base is None:
        base = pipeline.load_base(cfg, None)
    model0, tokenizer = base
    notes: list[str] = []
    if corpus is None:
        corpus = token_streams.load_corpus(cfg.corpus, tokenizer)
    calib = token_streams.calibration_windows(corpus, cfg.budget.calib_windows, cfg.budget.seqlen, cfg.seed)
    r3 = cfg.online
    if fold and r3_split(r3.transform, arch.dims(model0).head_dim, r3.block)[0]:  # before the expensive build
        check_fold_layout(model0, r3.transform, r3.block)
    present, wpath = weight_cache_present(cfg, cache_dir, model0, calib)
    if cache_dir is not None and not present:
        if not recompute:
            raise ExportError(f"the weights of this cell are not in the cache (missing {wpath}; the cache policy "
                              "may have pruned them): rerun without --no-recompute to rebuild them")
        notes.append(f"note: the cell's weights were not cached ({wpath.name if wpath else '?'}): recomputed")
    qm = pipeline.build_quantized_model(cfg, cache_dir=cache_dir, base=(model0, tokenizer), corpus=corpus)
    transforms_ = list(qm.transforms)
    r4_online = bool(cfg.rotation.r4) and keep_r4_hook
    if weights == WeightSource.DEQUANTISED:
        codes = _codes(qm.model, cfg, wpath)
        model = qm.strip_hooks(keep_r4_hook)
    else:
        codes = {}
        qm.strip_hooks(keep_r4_hook=False)
        model = copy.deepcopy(model0).to(cfg.runtime.device, cfg.runtime.dtype.torch).eval()
        kwargs: dict[str, Any] = {}
        rot = qm.rotation
        if cfg.rotation.r1 == RotationKind.WHIP:
            kwargs["r1_matrix"] = rot.r1
        if cfg.rotation.r2 == RotationKind.WHIP:
            kwargs["r2_matrices"] = rot.r2
        result = rotate_model(model, cfg.rotation.config(cfg.seed), register_r4_hooks=keep_r4_hook, **kwargs)
        for got, want, what in ((result.r1, rot.r1, "R1"), (result.r2, rot.r2, "R2")):
            if (got is None) != (want is None) or (got is not None and not torch.equal(got.cpu(), want.cpu())):
                raise ExportError(f"rebuilding {what} for the unquantised export gave another matrix than the cell's")
        del qm
    dims = arch.dims(model)
    if fold and r3_split(cfg.online.transform, dims.head_dim, cfg.online.block)[0]:
        fold_commuting_part(model, transforms_)  # the rest stays online (compressed-tensors)
    drop_loader_quantization(model)
    model.eval()
    return ExportModel(model=model, tokenizer=tokenizer, cfg=dataclasses.replace(cfg), transforms=transforms_,
                       codes=codes, notes=notes, r4_online=r4_online)

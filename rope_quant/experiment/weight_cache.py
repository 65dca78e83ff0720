"""The on-disk caches of one seed's build (the paired design's shared state): the fitted whip R1, and the rotated,
quantised weights, stored as packed 4-bit codes with the embeddings left out and rebuilt from R1 on a hit
(sha256-checked). Keys and fingerprints name the model, the calibration windows and the weight fields, so a
cache never serves another configuration. Every file is written atomically (:mod:`rope_quant.io`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from rope_quant.experiment.config import (
    WEIGHT_CACHE_FORMAT,
    WHIP_FIT_REVISION,
    PipelineError,
    RunConfig,
    versioned_hash,
)
from rope_quant.io import atomic_writer, cache_log, load_tensors, read_cache
from rope_quant.model import arch

log = logging.getLogger(__name__)

__all__ = ["WeightCacheMismatch", "r1_cache_path", "read_r1_cache", "hit_fit_log", "restore_rotated",
           "model_fingerprint", "data_fingerprint", "weight_cache_path", "save_weights", "embedding_keys", "digest",
           "compact_state", "dequantized_state", "read_weight_cache"]


def r1_cache_path(cache: Path | None, cfg: RunConfig, fingerprint: str, data_fp: str) -> Path | None:
    """The fitted whip R1 of (model, seed, whip settings, calibration windows), shared by every weight
    setting that uses it."""
    if cache is None:
        return None
    key = versioned_hash({"seed": cfg.seed, "whip": dataclasses.asdict(cfg.rotation.whip),
                          "revision": WHIP_FIT_REVISION})
    return cache / f"r1-whip-{key}-{fingerprint}-{data_fp}.pt"


def read_r1_cache(path: Path | None) -> tuple[torch.Tensor, dict] | None:
    """The cached whip R1 and its fit log, or None (missing, or unreadable: warned)."""
    def read(p: Path) -> tuple[torch.Tensor, dict]:
        saved = load_tensors(p)
        return saved["r1"], {**saved["log"], "cache_hit": True}

    # a damaged file is rebuilt from the weight cache's copy, or refitted
    return read_cache(path, read, "R1 cache", "rebuilding it")


def hit_fit_log(path: Path | None, payload: dict) -> dict | None:
    """A weight-cache hit's R1 fit log (a damaged R1 file must not cost the record its fit log).

    The R1 file's log when it is readable; else the weight cache's copy of R1 and its log, written back to the
    R1 file; None when the weight cache predates that copy (the caller then refits R1 and recomputes)."""
    saved = read_r1_cache(path)
    if saved is not None:
        return saved[1]
    fit, r1 = payload.get("rotation_fit"), payload.get("r1")
    if not fit or r1 is None or path is None:
        return None
    with atomic_writer(path) as handle:
        torch.save({"r1": r1, "log": fit}, handle)
    log.warning("rebuilt R1 cache %s from the weight cache's R1 and fit log", path)
    return {**fit, "cache_hit": True}


class WeightCacheMismatch(PipelineError):
    """A cache hit could not rebuild the left-out embeddings bit for bit (the cell recomputes the weights)."""


def restore_rotated(model: nn.Module, cfg: RunConfig, payload: dict):
    """Cache hit: rebuild the rotated model's structure and load its cached (quantised) parameters.

    The decoder's weight algebra (:func:`rotation.rotate_model`) is skipped: the cached state holds its
    result. The embeddings and lm_head, which the cache leaves out (``derived``), are rebuilt from the loaded
    model and the cached R1 (:func:`rotation.rotate_embeddings`; without R1 they are the model's own) and
    must match their cached sha256, else :class:`WeightCacheMismatch`. An older file that holds them is
    loaded as it is (embeddings untied). Only the online half of R4 is registered
    (:func:`rotation.install_online_r4`, ``prepend=True`` as in ``apply_r4``).
    """
    from rope_quant.rotations import offline as rotation

    derived = payload.get("derived") or {}
    if derived and payload.get("r1") is not None:
        rotation.rotate_embeddings(model, payload["r1"])
    elif not derived:  # an older file holds the (untied) embeddings; without R1 they are the model's own
        rotation.untie_embeddings(model)
    missing, unexpected = model.load_state_dict(payload["state"], strict=False)
    missing = [k for k in missing if k not in derived]
    if missing or unexpected:
        raise PipelineError(f"weight cache does not match the model: missing {missing[:3]}, "
                            f"unexpected {unexpected[:3]}")
    state = model.state_dict()
    for key, expected in derived.items():
        if key not in state or digest(state[key]) != expected:
            raise WeightCacheMismatch(f"{key} rebuilt from the cached R1 differs from the cached digest")
    result = rotation.RotationResult(config=cfg.rotation.config(cfg.seed), r1=payload.get("r1"), r2=payload.get("r2"),
                                     untied=bool(payload.get("untied")))
    if cfg.rotation.r4:
        result.r4_handles.extend(rotation.install_online_r4(model))
    setattr(model, "rq_rotation", result.config)  # noqa: B010 - an attribute the torch Module type does not declare
    return result


def model_fingerprint(model: nn.Module) -> str:
    """Short hash of a loaded model's shape and weights (taken before any rotation).

    Cache files carry it in their names, so a test model built from ``base=`` never collides with the
    checkpoint named in ``cfg.model``.
    """
    c = model.config
    names = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "intermediate_size")
    parts: list[Any] = [getattr(c, n, None) for n in names]
    last = len(arch.decoder_layers(model)) - 1
    with torch.no_grad():
        for t in (arch.embeddings(model).weight, arch.attention(model, 0).q.weight,
                  arch.mlp_parts(model, last).down.weight):
            t64 = cast(torch.Tensor, t).detach().double()
            parts += [float(t64.sum()), float(t64.abs().sum()), float((t64 * t64).sum())]
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def data_fingerprint(windows: torch.Tensor) -> str:
    """Short hash of the calibration windows' token ids (shape and values).

    Cache files that depend on the calibration sample carry it in their names, so a corpus that changed
    under the same name (or a caller that never resolved ``corpus_id``) cannot reuse statistics or
    weights computed on other text.
    """
    ids = windows.detach().to("cpu", torch.long).contiguous()
    h = hashlib.sha256(json.dumps(list(ids.shape)).encode())
    h.update(ids.numpy().tobytes())
    return h.hexdigest()[:8]


def weight_cache_path(cache_dir: Path | None, cfg: RunConfig, fingerprint: str, data_fp: str) -> Path | None:
    if cache_dir is None:
        return None
    suffix = f"-{data_fp}" if cfg.uses_calibration_for_weights else ""
    return Path(cache_dir) / f"weights-{cfg.weight_key()}-{fingerprint}{suffix}.pt"


def save_weights(path: Path, cfg: RunConfig, model: nn.Module, rotation: Any, errors: dict,
                  static_act: dict | None, rotation_fit: dict | None = None) -> None:
    """Write the rotated, quantised state (every parameter and buffer) atomically (:mod:`rope_quant.io`).

    A quantised linear's weight is stored as its integer codes and scales (:mod:`rope_quant.quant.packing`)
    when they dequantise to it bit for bit, else as the tensor; :func:`read_weight_cache` dequantises.
    """
    state, codes = compact_state(model)
    derived = {key: digest(state.pop(key)) for key in embedding_keys(model)}  # rebuilt on a hit
    payload = {
        "format": WEIGHT_CACHE_FORMAT, "weight_fields": cfg.weight_fields(),
        "state": state, "codes": codes, "derived": derived,
        "r1": None if rotation is None or rotation.r1 is None else rotation.r1.cpu(),
        "r2": None if rotation is None or rotation.r2 is None else rotation.r2.cpu(),
        "untied": bool(getattr(rotation, "untied", False)), "errors": errors,
        "static_act": None if static_act is None else {
            n: (q.lo.cpu(), q.hi.cpu()) for n, q in static_act.items()},
        "rotation_fit": {**rotation_fit, "cache_hit": False} if rotation_fit else None,  # heals the R1 file
    }
    with atomic_writer(path) as handle:
        torch.save(payload, handle)


def embedding_keys(model: nn.Module) -> list[str]:
    """State-dict keys of the embedding and lm_head weights (the matrices :func:`rotation.rotate_embeddings`
    rebuilds)."""
    targets = (arch.embeddings(model).weight, arch.lm_head(model).weight)
    return [k for k, v in model.state_dict(keep_vars=True).items() if any(v is t for t in targets)]


def digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes (a rebuilt matrix must match its cached digest bit for bit)."""
    t = t.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def compact_state(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """(state without the coded weights, {state key: WeightCodes.to_dict()}) of ``model``."""
    from rope_quant.quant import packing

    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    codes: dict[str, dict] = {}
    for name, mod in model.named_modules():
        key = f"{name}.weight" if name else "weight"
        enc = packing.encode(state[key], getattr(mod, packing.CODES_ATTR, None)) if key in state else None
        if enc is not None:
            codes[key] = enc.to_dict()
            del state[key]
    return state, codes


def dequantized_state(payload: dict) -> dict[str, torch.Tensor]:
    """The full state of a cache payload: its tensors plus its coded weights, dequantised (ValueError if bad)."""
    from rope_quant.quant import packing

    coded = payload.get("codes") or {}
    if not isinstance(coded, dict):
        raise ValueError("the weight codes section is not a mapping")
    state = dict(payload["state"])
    for key, entry in coded.items():
        if key in state:
            raise ValueError(f"{key} is stored both as a tensor and as codes")
        try:
            state[key] = packing.from_dict(entry).dequantize()
        except (KeyError, TypeError, RuntimeError, AttributeError) as exc:
            raise ValueError(f"malformed codes for {key}: {exc}") from exc
    return state


def read_codes(path: Path | None) -> dict[str, Any]:
    """The integer codes a weight-cache file holds (``{"<module>.weight": packed codes}``), or {} when there is
    no readable file (what the export reads instead of the dequantised state)."""
    payload = read_cache(path, lambda p: load_tensors(p, mmap=True), "weight cache", "exporting without its codes")
    return dict(payload.get("codes") or {}) if isinstance(payload, dict) else {}


def read_weight_cache(path: Path | None, cfg: RunConfig) -> dict | None:
    """The cached weights of ``cfg`` (dequantised state, R1 and its fit log), or None (missing; unreadable or of
    other fields: warned)."""
    payload = read_cache(path, lambda p: load_tensors(p, mmap=True), "weight cache", "recomputing it")
    if payload is None:
        return None
    fields = json.loads(json.dumps(cfg.weight_fields(), default=str))
    if not isinstance(payload, dict) or not isinstance(payload.get("state"), dict) \
            or payload.get("format") != WEIGHT_CACHE_FORMAT or payload.get("weight_fields") != fields:
        cache_log.warning("ignoring weight cache %s: its fields do not match this configuration", path)
        return None
    try:
        payload["state"] = dequantized_state(payload)
    except ValueError as exc:
        cache_log.warning("ignoring unreadable weight cache %s (%s); recomputing it", path, exc)
        return None
    return payload

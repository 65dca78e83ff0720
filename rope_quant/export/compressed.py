"""``--format compressed-tensors``: the cell's GPTQ/RTN integer weights packed as ``pack-quantized``.

Weights (every decoder linear; embeddings and lm_head stay dense): the cell's integer codes
(:mod:`rope_quant.quant.packing`, symmetric, one float32 scale per output channel or group of
``group_size`` contiguous input columns) are written as ``weight_packed`` (int32, the format's dense
packing, codes offset by 2^(b-1)), ``weight_scale`` ((out, n_groups)) and ``weight_shape``; symmetric, so no
zero point. Dequantised by the loader, they equal the cell's weights bit for bit in float32.

``quantization_config`` (``config.json``): ``format: pack-quantized``; ``weights`` {num_bits, int,
symmetric, strategy channel|group, group_size}; ``input_activations`` {dynamic per token (or group),
symmetric as the cell} where the cell quantises activations; ``kv_cache_scheme`` from the cell's K settings
(one scheme for K and V: the format has no separate V fields). Clip ratios and different K/V settings have
no field: they are listed in ``rope_quant_export.json`` notes.

The key quantisers (docs/key_quantizers.md): ``kv_cache_scheme`` is one ``QuantizationArgs`` for the whole cache
as attention stores it (post-RoPE), one ``num_bits``, dynamic only per token / tensor / group of channels. It
carries the paper's per-token rule (``per_token``); every other option is refused with the reason
(:data:`KEY_QUANT_FORMS`).

``transform_config`` (inside ``quantization_config``, compressed-tensors 0.20): the online parts.
* R4: on every ``down_proj`` input (location ``input``). Power-of-two sizes: type ``hadamard`` (the format's
  deterministic Sylvester matrix, checked equal to ours). Other sizes (SmolLM2: 1536): type
  ``random-hadamard`` with our ±1 matrix stored per layer as ``…down_proj.R4_input.weight`` (the format's
  convention: applied as ``x · W / √n``).
* A non-commuting R3 that is the full-head Hadamard (``hadamard``; ``pairwise_plus_hadamard`` after its
  pairwise half is folded): type ``hadamard`` with ``head_dim``, locations ``q_attn`` and ``k_cache``.
  Other non-commuting R3s (block controls) have no transform type: refused.
* A RoPE-commuting R3 is not folded here (it would move the quantised W_Q/W_K rows off their grid) and has no
  per-layer transform type: with K and V unquantised it changes no q·k and is left out (a note); with a
  quantised KV cache the export is refused.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from rope_quant.core import transforms
from rope_quant.export.build import ExportModel
from rope_quant.export.fold import ExportError, LayoutError
from rope_quant.io import atomic_write_json, to_jsonable
from rope_quant.model import arch

__all__ = ["PINNED", "R4_SCHEME", "R3_SCHEME", "KEY_QUANT_FORMS", "key_quant_refusal", "require", "check_compressed",
           "quantization_config", "transform_config", "codes_int8", "write_compressed"]

#: The compressed-tensors version this module is written against (the ``[export]`` extra pins it).
PINNED = "0.20.0"
R4_SCHEME = "R4"
R3_SCHEME = "R3"


_PER_CHANNEL_STATIC = ("kv_cache_scheme's per-channel strategy is static (one calibrated range per channel for "
                       "the whole cache: QuantizationArgs refuses dynamic=True with strategy channel) and its groups "
                       "run over channels within a token, not over tokens")
#: Key quantiser → None where ``kv_cache_scheme`` (compressed-tensors 0.20) can carry it, else why not.
KEY_QUANT_FORMS: dict[str, str | None] = {
    "per_token": None,  # dynamic per token (strategy token), or per group of channels (strategy group)
    "kivi": ("per-channel ranges over groups of G tokens, computed as the cache grows, with the R most recent "
             f"tokens in 16 bits: {_PER_CHANNEL_STATIC}, and it has no field for a full-precision window"),
    "kvquant_prerope": ("keys quantised before RoPE and RoPE re-applied after dequantisation: kv_cache_scheme "
                        "quantises the cache as attention stores it (post-RoPE) and has no field for the place; "
                        f"{_PER_CHANNEL_STATIC}"),
    "rope_pair_bits": ("a bit width per RoPE pair (channels of different widths in one head): kv_cache_scheme has "
                       "one num_bits for every element"),
    "sink": ("the first S tokens in 16 bits: kv_cache_scheme quantises every token alike (no field for an "
             "unquantised subset of tokens)"),
    "per_token_window": ("the R most recent tokens and the group being filled in 16 bits: kv_cache_scheme quantises "
                         "every token alike (no field for a full-precision window)"),
}


def key_quant_refusal(name: str) -> str | None:
    """Why ``kv_cache_scheme`` cannot carry key quantiser ``name`` (None: it can)."""
    if name in KEY_QUANT_FORMS:
        return KEY_QUANT_FORMS[name]
    return f"{name} is not a built-in key quantiser and declares no compressed-tensors form"


def require() -> Any:
    """The compressed_tensors module, or :class:`ExportError` saying how to install it."""
    try:
        import compressed_tensors
    except ImportError:
        raise ExportError("--format compressed-tensors needs the compressed-tensors package: "
                          "pip install 'rope-quant[export]'") from None
    return compressed_tensors


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_compressed(cfg: Any, head_dim: int) -> None:
    """Refuse (before any expensive step) a cell the format cannot express."""
    from rope_quant.experiment.config import WeightMode

    w = cfg.quant.w
    if w.mode == WeightMode.NONE:
        raise ExportError("--format compressed-tensors writes quantised weights; this cell has weights=none "
                          "(export it with --format hf)")
    if w.bits > 8:
        raise ExportError(f"--format compressed-tensors packs 1..8-bit integer weights, the cell has w_bits={w.bits}")
    kq = getattr(cfg.quant, "kq", None)
    kind = str(getattr(kq, "kind", "per_token"))
    why = key_quant_refusal(kind) if cfg.quant.k.enabled else None
    if why is not None:
        raise ExportError(f"--format compressed-tensors cannot carry this cell's keys, k_quant={kind}: {why} "
                          "(docs/export.md; --format hf writes the weights without any KV quantisation)")
    split = transforms.foldability(cfg.online.transform, head_dim, cfg.online.block)
    kv = cfg.quant.k.enabled or cfg.quant.v.enabled
    if split.online is not None and not split.online_is_hadamard:
        raise LayoutError(f"R3 {cfg.online.transform!r} does not commute with RoPE and is not the full-head "
                          "Hadamard: compressed-tensors has no transform type for it")
    if split.folds and kv:
        raise LayoutError(
            f"R3 {cfg.online.transform!r} with a quantised KV cache: its RoPE-pair rotation would have to fold into "
            "the quantised W_Q/W_K rows (moving them off their 4-bit grid) or run online per layer at q_attn/k_cache, "
            "which compressed-tensors' transform types (hadamard, random-hadamard, random-matrix: one matrix per "
            "size) cannot carry; export --format hf --weights dequantised (R3 folded, KV quantisation not carried)")


def r3_notes(cfg: Any, head_dim: int) -> list[str]:
    """Why a RoPE-commuting R3 is absent from a compressed-tensors export with K/V unquantised."""
    if not transforms.foldability(cfg.online.transform, head_dim, cfg.online.block).folds:
        return []
    return [f"note: R3 {cfg.online.transform!r}'s pair rotation is not written: with K and V unquantised it leaves "
            "every q·k unchanged (an orthogonal map on q and k alike), so the function is the same without it"]


def _act_args(spec: Any) -> dict[str, Any]:
    group = spec.group_size
    return {"num_bits": spec.bits, "type": "int", "symmetric": bool(spec.symmetric), "dynamic": True,
            "strategy": "token" if group == -1 else "group", "group_size": None if group == -1 else group}


def quantization_config(cfg: Any) -> tuple[dict[str, Any], list[str]]:
    """(the ``quantization_config`` without its transform part, notes on what has no field)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    q, notes = cfg.quant, []
    gs = q.w.gptq.group_size
    weights = QuantizationArgs(num_bits=q.w.bits, type="int", symmetric=True, dynamic=False,
                               strategy="channel" if gs == -1 else "group", group_size=None if gs == -1 else gs)
    acts = QuantizationArgs(**_act_args(q.a)) if q.a.enabled else None
    kv = QuantizationArgs(**_act_args(q.k)) if q.k.enabled else None
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts,
                                format="pack-quantized")
    config = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized",
                                quantization_status="compressed", kv_cache_scheme=kv, ignore=["lm_head"])
    if q.w.clip != 1.0:
        notes.append(f"note: w_clip={q.w.clip} is baked into the scales (no field)")
    for name in ("a", "k", "v"):
        spec = getattr(q, name)
        if spec.enabled and spec.clip_ratio != 1.0:
            notes.append(f"note: {name}_clip={spec.clip_ratio} has no compressed-tensors field: not written")
    if q.k.enabled != q.v.enabled or (q.k.enabled and _act_args(q.k) != _act_args(q.v)):
        notes.append(f"note: kv_cache_scheme holds the K settings; V ({q.v.bits}-bit) has no separate field")
    if q.k.enabled:
        notes.append("note: kv_cache_scheme 'token' strategy: the cell quantises per token and per "
                     + ("head" if q.k.group_size == -1 else f"group of {q.k.group_size}") + " (dynamic)")
    if cfg.quant.static_scope is not None:
        notes.append(f"note: the static control ({cfg.quant.static_scope}) is not written: its calibrated "
                     "scales have no field here; the config says dynamic")
    return config.model_dump(exclude={"quant_method"}, mode="json"), notes


def _ct_targets() -> dict[str, str]:
    """compressed-tensors target patterns of the modules an online transform attaches to (R4's down-projection
    input, R3's attention), from the adapter's names for the Llama-style layouts it registers."""
    groups = arch.spec_for("llama").linear_groups()
    down = groups[-1][0]  # <mlp>.<down>, the last linear of a layer
    attention = groups[0][0].rsplit(".", 1)[0]  # the parent of the q/k/v linears
    return {"down_proj": f"re:.*{re.escape(down)}$", "attention": f"re:.*{re.escape(attention)}$"}


CT_TARGETS = _ct_targets()


def transform_config(cfg: Any, dims: Any) -> dict[str, Any] | None:
    """The ``transform_config`` of the cell's online parts (None when everything folds)."""
    from compressed_tensors.transform import TransformArgs, TransformConfig, TransformScheme

    groups: dict[str, Any] = {}
    if cfg.rotation.r4:
        kind = "hadamard" if _pow2(dims.intermediate) else "random-hadamard"
        groups[R4_SCHEME] = TransformScheme(type=kind, apply=[TransformArgs(targets=[CT_TARGETS["down_proj"]],
                                                                            location="input")])
    if transforms.foldability(cfg.online.transform, dims.head_dim, cfg.online.block).online_is_hadamard:
        targets = [CT_TARGETS["attention"]]
        groups[R3_SCHEME] = TransformScheme(type="hadamard", head_dim=dims.head_dim, apply=[
            TransformArgs(targets=targets, location="q_attn"), TransformArgs(targets=targets, location="k_cache")])
    if not groups:
        return None
    return TransformConfig(config_groups=groups).model_dump(mode="json")


def codes_int8(codes: Any) -> torch.Tensor:
    """(out, in) int8 codes of a :class:`rope_quant.quant.packing.WeightCodes`."""
    from rope_quant.quant import packing

    out_f, in_f = codes.shape
    n = out_f * in_f
    flat = packing.unpack_nibbles(codes.codes, n, codes.bits) if codes.bits <= 4 else codes.codes[:n]
    return flat.reshape(out_f, in_f).to(torch.int8)


def _r4_weights(model: Any, dims: Any, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``…down_proj.R4_input.weight`` = √n · A (±1 entries) per layer, for the non-power-of-two R4."""
    from rope_quant.rotations.online_r4 import r4_matrix

    n = dims.intermediate
    w = (r4_matrix(n) * n ** 0.5).round()
    if not torch.allclose(w, r4_matrix(n) * n ** 0.5, atol=1e-9):
        raise LayoutError(f"R4 of size {n} is not a ±1 Hadamard up to scale")
    names = {id(m): name for name, m in model.named_modules()}
    return {f"{names[id(arch.mlp_parts(model, i).down)]}.{R4_SCHEME}_input.weight": w.to(dtype).contiguous()
            for i in range(dims.n_layers)}


def _packed_state(em: ExportModel, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    model = em.model
    names = {id(m): name for name, m in model.named_modules()}
    full = {names[id(m)] for _, m in arch.decoder_linears(model)}
    missing = sorted(full - set(em.codes))
    if missing:
        raise ExportError(f"no integer codes for {len(missing)} decoder linears (e.g. {missing[0]}): "
                          "their weights are not the cell's quantised weights")
    state: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        mod = key.rsplit(".", 1)[0]
        if mod in em.codes and key.endswith(".weight"):
            c = em.codes[mod]
            state[f"{mod}.weight_packed"] = pack_to_int32(codes_int8(c), c.bits).contiguous()
            state[f"{mod}.weight_scale"] = c.scales.to(dtype).contiguous()
            state[f"{mod}.weight_shape"] = torch.tensor(list(c.shape), dtype=torch.int64)
        else:
            state[key] = value.detach().to("cpu", dtype if value.is_floating_point() else value.dtype).contiguous()
    if arch.embeddings_tied(model):
        head = [k for k in state if k.endswith("lm_head.weight")]
        for k in head:
            del state[k]
    return state


def write_compressed(em: ExportModel, out_dir: str | os.PathLike[str], dtype: torch.dtype, *,
                     source: dict[str, Any]) -> Path:
    """Write ``em`` (dequantised weights with codes, R4 hook removed) into ``out_dir`` as compressed-tensors."""
    from safetensors.torch import save_file

    require()
    out = Path(out_dir)
    dims = arch.dims(em.model)
    check_compressed(em.cfg, dims.head_dim)
    qconfig, notes = quantization_config(em.cfg)
    notes += r3_notes(em.cfg, dims.head_dim)
    tconfig = transform_config(em.cfg, dims)
    state = _packed_state(em, dtype)
    if tconfig is not None and tconfig["config_groups"].get(R4_SCHEME, {}).get("type") == "random-hadamard":
        state.update(_r4_weights(em.model, dims, dtype))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    model: Any = em.model
    tied = arch.embeddings_tied(model)
    for cfg in {id(c): c for c in (model.config, arch.text_config(model))}.values():
        if hasattr(cfg, "tie_word_embeddings"):
            cfg.tie_word_embeddings = tied
        cfg.dtype = dtype
    model.config.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
    data = json.loads((out / "config.json").read_text())
    import compressed_tensors

    data["quantization_config"] = {"version": compressed_tensors.__version__, "quant_method": "compressed-tensors",
                                   "sparsity_config": {}, "transform_config": tconfig or {}, **qconfig}
    atomic_write_json(out / "config.json", data)
    if callable(getattr(em.tokenizer, "save_pretrained", None)):
        em.tokenizer.save_pretrained(out)
    else:
        notes.append(f"note: the tokenizer ({type(em.tokenizer).__name__}) cannot save itself: not written")
    em.notes.extend(notes)
    info = {"format": "compressed-tensors", "dtype": str(dtype).removeprefix("torch."), "weights": "packed",
            "folded": {"r1": em.cfg.rotation.r1.value, "r2": em.cfg.rotation.r2.value, "r3": None},
            "online": sorted((tconfig or {}).get("config_groups", {})), "config": em.cfg.to_dict(),
            "source": source, "notes": list(em.notes)}
    atomic_write_json(out / "rope_quant_export.json", to_jsonable(info))
    return out

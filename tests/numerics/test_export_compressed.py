"""Export ``--format compressed-tensors``: packed W4 codes reload through transformers' compressed-tensors
loader, without rope_quant, and compute the cell's weights-only function; the codes match ours code for code."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from rope_quant.experiment.pipeline import build_quantized_model
from rope_quant.export import build as ebuild
from rope_quant.export import compressed, fold, outdir
from tests._support import ByteTokenizer
from tests.numerics.export_isolated import run_isolated
from tests.numerics.test_export_hf import cell, rel, tiny_llama, weights_only

pytest.importorskip("compressed_tensors")  # the [export] extra; installed in the project venv

#: Stated tolerance: the loader dequantises codes · scale in float32 exactly as the cell did, so only the
#: forward's float32 rounding differs (measured 1.9e-7 relative on the tiny model); 1e-4 leaves margin.
REL = 1e-4

LOAD_CT = """
from transformers import AutoModelForCausalLM
from safetensors.torch import load_file
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
ids = torch.load({ids!r})
path = {path!r}
t = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
load_s = time.perf_counter() - t
cfg = json.load(open(path + "/config.json"))
tcfg = cfg["quantization_config"].get("transform_config") or {{}}
groups = {{k: v for k, v in (tcfg.get("config_groups") or {{}}).items() if k in {apply_transforms!r}}}
if groups:
    from compressed_tensors.transform import TransformConfig, apply_transform_config
    apply_transform_config(model, TransformConfig.model_validate({{"config_groups": groups}}))
with torch.no_grad():
    logits = model(input_ids=ids).logits
state = load_file(path + "/model.safetensors")
codes = {{k[:-len(".weight_packed")]: unpack_from_int32(v, 4, state[k[:-6] + "shape"])
         for k, v in state.items() if k.endswith(".weight_packed")}}
torch.save({{"logits": logits, "codes": codes,
            "scales": {{k[:-len(".weight_scale")]: v for k, v in state.items() if k.endswith(".weight_scale")}}}},
           {result!r})
print(json.dumps({{"load_s": load_s, "class": type(model).__name__, "has_rope_quant": "rope_quant" in sys.modules}}))
"""


@pytest.fixture(scope="module")
def base():
    return tiny_llama(), ByteTokenizer()


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))


def export_ct(cfg, base, out: Path, keep_r4_hook: bool = False) -> Path:
    with outdir.staged(out, overwrite=False) as tmp:
        em = ebuild.build_export_model(cfg, None, base=(copy.deepcopy(base[0]), base[1]),
                                       weights=ebuild.WeightSource.DEQUANTISED, keep_r4_hook=keep_r4_hook,
                                       fold=False)
        compressed.write_compressed(em, tmp, torch.float32, source={"test": True})
    return out


def reload(out: Path, ids: torch.Tensor, tmp: Path, apply_transforms: tuple[str, ...] = ()) -> dict:
    torch.save(ids, tmp / "ids.pt")
    info = run_isolated(LOAD_CT.format(ids=str(tmp / "ids.pt"), path=str(out), result=str(tmp / "ct.pt"),
                                       apply_transforms=list(apply_transforms)), tmp)
    assert info["has_rope_quant"] is False
    return torch.load(tmp / "ct.pt")


def test_ct_w4_reload_matches_cell_and_codes(base, ids, tmp_path: Path) -> None:
    cfg = cell(weights="rtn", a_bits=16, k_bits=16, v_bits=16)
    qm = build_quantized_model(cfg, base=(copy.deepcopy(base[0]), base[1]))
    ours = {name: compressed.codes_int8(mod.rq_weight_codes) for name, mod in qm.model.named_modules()
            if getattr(mod, "rq_weight_codes", None) is not None}
    scales = {name: mod.rq_weight_codes.scales for name, mod in qm.model.named_modules()
              if getattr(mod, "rq_weight_codes", None) is not None}
    with torch.no_grad():
        ref = weights_only(qm)(input_ids=ids).logits
    out = export_ct(cfg, base, tmp_path / "ct")
    got = reload(out, ids, tmp_path)
    assert rel(got["logits"], ref) < REL, rel(got["logits"], ref)
    assert len(ours) == 2 * 7 and set(got["codes"]) == set(ours)  # every decoder linear, code for code
    for name in ours:
        assert torch.equal(got["codes"][name].to(torch.int8), ours[name]), name
        assert torch.equal(got["scales"][name], scales[name]), name
    cfgj = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfgj["format"] == "pack-quantized" and cfgj["quant_method"] == "compressed-tensors"
    w = cfgj["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["symmetric"], w["strategy"]) == (4, True, "channel")
    assert cfgj["config_groups"]["group_0"]["input_activations"] is None and cfgj["kv_cache_scheme"] is None



@pytest.fixture(scope="module")
def online_export(base, ids, tmp_path_factory):
    """A cell with R4 and the full-head Hadamard R3 (both online), its weights-only reference and its export."""
    cfg = cell(weights="rtn", a_bits=16, k_bits=16, v_bits=16, r4=True, r3="hadamard")
    qm = build_quantized_model(cfg, base=(copy.deepcopy(base[0]), base[1]))
    with torch.no_grad():
        ref = weights_only(qm)(input_ids=ids).logits
    tmp = tmp_path_factory.mktemp("ct4")
    return export_ct(cfg, base, tmp / "ct4"), ref, tmp


def test_ct_online_r4_through_compressed_tensors_transform(online_export, ids) -> None:
    """R4 stays online: written as the format's transform on down_proj's input and applied by compressed-tensors'
    own ``apply_transform_config`` after the transformers load (transformers 5.24 does not apply it itself)."""
    out, ref, tmp = online_export
    tcfg = json.loads((out / "config.json").read_text())["quantization_config"]["transform_config"]
    assert tcfg["config_groups"]["R4"]["type"] == "hadamard"  # intermediate 128: the format's Sylvester matrix
    assert [a["location"] for a in tcfg["config_groups"]["R3"]["apply"]] == ["q_attn", "k_cache"]
    got = reload(out, ids, tmp, apply_transforms=("R4",))
    assert rel(got["logits"], ref) < REL, rel(got["logits"], ref)
    plain = reload(out, ids, tmp)  # control: without the transform R4 is missing and the function changes
    assert rel(plain["logits"], ref) > 1e-2


@pytest.mark.xfail(strict=True, reason="compressed-tensors 0.20's q_attn/k_cache hooks on transformers 5.24 (CPU, "
                   "sdpa) change the fp logits of the tiny model by 1.04e-2 relative (max abs 1.3e-2; measured "
                   "2026-11-25), where an orthogonal R3 on both q and k must leave them unchanged: its "
                   "attention transforms are not usable as a check here")
def test_ct_online_r3_hadamard_through_compressed_tensors_attention_hooks(online_export, ids) -> None:
    out, ref, tmp = online_export
    got = reload(out, ids, tmp, apply_transforms=("R4", "R3"))
    assert rel(got["logits"], ref) < REL, rel(got["logits"], ref)


@pytest.mark.parametrize(("over", "error", "words"), [
    ({"weights": "none"}, fold.ExportError, ["weights=none", "--format hf"]),
    ({"r3": "pairwise_only", "k_bits": 4}, fold.LayoutError, ["quantised KV cache", "q_attn/k_cache", "--format hf"]),
    ({"r3": "block_hadamard", "r3_block": 4}, fold.LayoutError, ["block_hadamard", "no transform type"]),
])
def test_ct_refuses_what_the_format_cannot_express(over, error, words) -> None:
    flat = dict(weights="rtn", a_bits=16, k_bits=16, v_bits=16)
    flat.update(over)
    with pytest.raises(error) as info:
        compressed.check_compressed(cell(**flat), 16)
    assert all(w in str(info.value) for w in words), str(info.value)


@pytest.mark.parametrize(("flat", "words"), [
    ({"k_quant": "kivi"}, ["k_quant=kivi", "QuantizationArgs refuses dynamic=True with strategy channel",
                           "full-precision window"]),
    ({"k_quant": "kvquant_prerope"}, ["before RoPE", "post-RoPE", "strategy channel"]),
    ({"k_quant": "rope_pair_bits", "k_max_bits": 6}, ["a bit width per RoPE pair", "one num_bits"]),
    ({"k_quant": "sink"}, ["first S tokens in 16 bits", "every token alike"]),
    ({"k_quant": "per_token_window"}, ["R most recent tokens", "every token alike"]),
])
def test_ct_refuses_each_key_quantiser_it_cannot_carry_with_the_reason(flat, words) -> None:
    with pytest.raises(fold.ExportError) as info:
        compressed.check_compressed(cell(weights="rtn", r3="hadamard", k_bits=4, **flat), 16)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_ct_key_quantiser_forms_are_the_formats_own_limits() -> None:
    """Every built-in key quantiser has an answer; per_token's is the scheme the export writes; the reasons stand on
    compressed-tensors' own model: no dynamic per-channel strategy, one integer width, and no field that names a
    place (pre-RoPE), a token subset or a window (a new field fails this test: re-examine the table)."""
    from compressed_tensors.quantization import QuantizationArgs
    from pydantic import ValidationError

    from rope_quant.quant import keys as keyq

    assert set(compressed.KEY_QUANT_FORMS) == {m.value for m in keyq.KeyQuantName}
    assert [n for n, why in compressed.KEY_QUANT_FORMS.items() if why is None] == ["per_token"]
    with pytest.raises(ValidationError, match="dynamic"):
        QuantizationArgs(num_bits=4, type="int", strategy="channel", dynamic=True)
    with pytest.raises(ValidationError):
        QuantizationArgs(num_bits=[3, 4], type="int", strategy="token", dynamic=True)
    assert set(QuantizationArgs.model_fields) == {
        "num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic", "actorder",
        "scale_dtype", "zp_dtype", "observer", "observer_kwargs"}
    assert compressed.key_quant_refusal("someone_elses") is not None
    compressed.check_compressed(cell(weights="rtn", r3="hadamard", k_bits=4, k_quant="per_token"), 16)


def test_ct_quantization_config_fields_for_a4kv4() -> None:
    """The activation and KV settings go where the format has fields (validated by its own pydantic models)."""
    from compressed_tensors.quantization import QuantizationConfig

    cfg = cell(weights="rtn", r3="hadamard", a_bits=4, k_bits=4, v_bits=4, k_clip=0.9)
    qcfg, notes = compressed.quantization_config(cfg)
    parsed = QuantizationConfig.model_validate(qcfg)
    acts = parsed.config_groups["group_0"].input_activations
    assert (acts.num_bits, acts.dynamic, acts.strategy, acts.symmetric) == (4, True, "token", False)
    assert parsed.kv_cache_scheme.num_bits == 4 and parsed.kv_cache_scheme.dynamic is True
    assert any("k_clip=0.9" in n for n in notes)


LOAD_R4_WEIGHTS = """
from safetensors.torch import load_file
stored = {{k: v for k, v in load_file(path + "/model.safetensors").items() if ".R4_input." in k}}
missing, unexpected = model.load_state_dict(stored, strict=False)
assert not unexpected, unexpected
assert len(stored) == {n_layers}, sorted(stored)
"""


def test_ct_online_r4_not_power_of_two_stores_its_matrix(ids, tmp_path: Path) -> None:
    """An R4 of size 96 (= 12·8, like SmolLM2's 1536 = 12·128): ``random-hadamard`` with our ±1 matrix stored per
    layer; compressed-tensors applies it after loading those weights into its transform modules."""
    base = (tiny_llama(intermediate=96), ByteTokenizer())
    cfg = cell(weights="rtn", a_bits=16, k_bits=16, v_bits=16, r4=True, r3="hadamard")
    qm = build_quantized_model(cfg, base=(copy.deepcopy(base[0]), base[1]))
    with torch.no_grad():
        ref = weights_only(qm)(input_ids=ids).logits
    out = export_ct(cfg, base, tmp_path / "ct96")
    tcfg = json.loads((out / "config.json").read_text())["quantization_config"]["transform_config"]
    assert tcfg["config_groups"]["R4"]["type"] == "random-hadamard"
    anchor = "with torch.no_grad():\n    logits"
    body = LOAD_CT.replace(anchor, LOAD_R4_WEIGHTS + anchor, 1)
    torch.save(ids, tmp_path / "ids.pt")
    run_isolated(body.format(ids=str(tmp_path / "ids.pt"), path=str(out), result=str(tmp_path / "ct.pt"),
                             apply_transforms=["R4"], n_layers=2), tmp_path)
    got = torch.load(tmp_path / "ct.pt")
    assert rel(got["logits"], ref) < REL, rel(got["logits"], ref)
    # control: the format's own random-hadamard of size 96 (not our matrix) gives other logits
    run_isolated(LOAD_CT.format(ids=str(tmp_path / "ids.pt"), path=str(out), result=str(tmp_path / "ct0.pt"),
                                apply_transforms=["R4"]), tmp_path)
    assert rel(torch.load(tmp_path / "ct0.pt")["logits"], ref) > 1e-3

"""llama.cpp's K-cache formats as key quantisers (ggml_q4_0, ggml_q4_1, ggml_iq4_nl, ggml_q8_0) and llama.cpp's
online rotation as a cell switch: every format bit for bit against the ``gguf`` package's reference quantisers
(``gguf.quants``; iq4_nl, which gguf cannot quantise, against its dequantiser and a scalar transcription of ggml's
``quantize_row_iq4_nl_ref`` written here), the bits per element, the rotation preserving q·k, the SmolLM2 attention
seeing the rotated, block-quantised keys, and the bad input refused before any model loads."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")  # a dependency of transformers' GGUF loading, installed with rope_quant

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402
from gguf import quants as gq  # noqa: E402

from rope_quant.experiment.config import PipelineError, RunConfig  # noqa: E402
from rope_quant.quant import keys as keyq  # noqa: E402
from rope_quant.quant.keys import ggml  # noqa: E402
from rope_quant.quant.quantizers import QuantConfig  # noqa: E402
from rope_quant.rotations import attention  # noqa: E402
from rope_quant.rotations.runtime_rotation import (  # noqa: E402
    RuntimeRotationError,
    apply_runtime_rotation,
    runtime_block,
    runtime_row_order,
)

pytestmark = pytest.mark.numerics

GGUF_TYPE = {"q4_0": GGMLQuantizationType.Q4_0, "q4_1": GGMLQuantizationType.Q4_1,
             "q8_0": GGMLQuantizationType.Q8_0, "iq4_nl": GGMLQuantizationType.IQ4_NL}
CODE_STEP = {"q4_0": 8.0, "q4_1": 15.0, "q8_0": 127.0}


def _inputs(fmt: str) -> dict[str, np.ndarray]:
    """Random and adversarial rows (8 rows of 128 = 4 blocks each), float32."""
    rng = np.random.default_rng(7)
    normal = rng.standard_normal((8, 128)).astype(np.float32)
    step = CODE_STEP.get(fmt, 127.0)
    ties = (rng.integers(-int(step), int(step) + 1, (8, 128)) + 0.5).astype(np.float32)  # exact .5 codes
    ties[:, ::32] = step  # the block's extreme fixes d to 1 (q4_0: max = 8 -> d = -1)
    both_signs = normal.copy()
    both_signs[:, 3], both_signs[:, 9] = 5.0, -5.0  # |max| tie: the first one sets q4_0's sign
    zeros = np.zeros((8, 128), np.float32)
    mixed = normal.copy()
    mixed[:, :32] = 0.0  # a zero block beside normal ones
    mixed[:, 32:64] = 0.75  # a constant block
    wide = (normal * 10.0 ** rng.uniform(-3, 3, (8, 1))).astype(np.float32)
    f16_sub = (normal * 1e-6).astype(np.float32)  # scales in float16's subnormal range
    f16_zero = (normal * 1e-9).astype(np.float32)  # scales below float16's smallest subnormal: stored as zero
    f16_top = (normal / np.abs(normal).max() * 5.2e5).astype(np.float32)  # q4_0 scale near 65504
    f16_over = (normal * 1e6).astype(np.float32)  # scales beyond float16: inf / NaN, as ggml gives
    halfway = np.full((8, 128), 1.0, np.float32)
    halfway[:, ::2] = np.float32(1.0 + 2.0 ** -11) * step  # d exactly halfway between two float16 values
    return {"normal": normal, "ties": ties, "both_signs": both_signs, "zeros": zeros, "mixed": mixed,
            "wide": wide, "f16_subnormal": f16_sub, "f16_zero": f16_zero, "f16_top": f16_top,
            "f16_overflow": f16_over, "halfway": halfway}


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
def test_blocks_and_values_are_gguf_bit_for_bit(fmt):
    """Our packed blocks are gguf.quants.quantize's bytes, and our dequantised keys gguf's dequantised values, on
    every random and adversarial input."""
    qtype = GGUF_TYPE[fmt]
    for case, x in _inputs(fmt).items():
        with np.errstate(all="ignore"):
            ref = gq.quantize(x, qtype)
            ref_values = gq.dequantize(ref, qtype)
        blocks = ggml.quantize(torch.from_numpy(x), fmt)
        assert np.array_equal(ggml.pack(blocks), ref), (fmt, case)
        ours = ggml.fake_quant_ggml(torch.from_numpy(x), fmt).numpy()
        assert np.array_equal(ours, ref_values, equal_nan=True), (fmt, case)
        if case == "normal":
            assert not np.array_equal(ours, x)  # the keys were quantised


def _best_index(x: np.float32) -> int:
    """ggml's best_index_int8 (binary search, a tie to the upper value)."""
    v = ggml.IQ4_NL_VALUES
    if x <= v[0]:
        return 0
    if x >= v[-1]:
        return len(v) - 1
    lo, hi = 0, len(v) - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if x < v[mid]:
            hi = mid
        else:
            lo = mid
    return hi - 1 if np.float32(x - np.float32(v[hi - 1])) < np.float32(np.float32(v[hi]) - x) else hi


def _iq4_nl_ref_block(xb: np.ndarray) -> tuple[np.float16, list[int] | None]:
    """quantize_row_iq4_nl_ref on one block (ntry = -1), float32 scalar arithmetic in ggml's order."""
    f = np.float32
    amax, top = f(0), f(0)
    for v in xb:
        if abs(v) > amax:
            amax, top = abs(v), v
    if amax < f(1e-15):
        return np.float16(0), None
    d = f(top / f(-127))
    inv = f(f(1) / d)
    idx, sumqx, sumq2 = [], f(0), f(0)
    for v in xb:
        al = f(inv * v)
        lvl = _best_index(al)
        idx.append(lvl)
        q = f(ggml.IQ4_NL_VALUES[lvl])
        w = f(v * v)
        sumqx = f(sumqx + f(f(w * q) * v))
        sumq2 = f(sumq2 + f(f(w * q) * q))
    return np.float16(f(sumqx / sumq2) if sumq2 > 0 else f(0)), idx


def test_iq4_nl_is_ggmls_reference_choice_and_gguf_reads_it():
    """Scales and grid indices equal the scalar transcription of ggml's K-cache reference, and gguf's IQ4_NL
    dequantiser of our packed blocks gives our dequantised keys."""
    qtype = GGUF_TYPE["iq4_nl"]
    for case, x in _inputs("iq4_nl").items():
        blocks = ggml.quantize(torch.from_numpy(x), "iq4_nl")
        d = blocks.d.numpy().reshape(-1)
        codes = blocks.codes.numpy().reshape(-1, ggml.BLOCK)
        for i, xb in enumerate(x.reshape(-1, ggml.BLOCK)):
            ref_d, ref_idx = _iq4_nl_ref_block(xb)
            assert d[i].tobytes() == ref_d.tobytes() or (np.isnan(d[i]) and np.isnan(ref_d)), (case, i)
            if ref_idx is not None:
                assert codes[i].tolist() == ref_idx, (case, i)
        with np.errstate(all="ignore"):
            read = gq.dequantize(ggml.pack(blocks), qtype)
        assert np.array_equal(ggml.dequantize(blocks).numpy(), read, equal_nan=True), case
    x = _inputs("iq4_nl")["normal"]
    err = np.abs(ggml.fake_quant_ggml(torch.from_numpy(x), "iq4_nl").numpy() - x)
    assert 0 < err.max() < 0.25 * np.abs(x).max()  # quantised, and on the grid's scale


def test_non_finite_keys_pass_through_and_count_as_zero():
    x = torch.randn(2, 64)
    y = x.clone()
    y[0, 5], y[1, 40] = float("nan"), float("inf")
    out = ggml.fake_quant_ggml(y, "q4_0")
    assert torch.isnan(out[0, 5]) and torch.isinf(out[1, 40])
    z = y.clone()
    z[0, 5], z[1, 40] = 0.0, 0.0
    ref = ggml.fake_quant_ggml(z, "q4_0")
    keep = torch.isfinite(y)
    assert torch.equal(out[keep], ref[keep])


@pytest.mark.parametrize("name, bits, expected", [("ggml_q4_0", 4, 4.5), ("ggml_q4_1", 4, 5.0),
                                                  ("ggml_iq4_nl", 4, 4.5), ("ggml_q8_0", 8, 8.5)])
def test_bits_per_element_are_the_ggml_block_sizes(name, bits, expected):
    option = keyq.option_from(name, QuantConfig(bits=bits))
    block, type_size = GGML_QUANT_SIZES[GGUF_TYPE[name.removeprefix("ggml_")]]
    for head_dim, seq_len in ((64, 512), (256, 1), (96, 2048)):
        assert option.bits_per_element(head_dim, seq_len) == expected == 8 * type_size / block
    cfg = RunConfig.from_flat(k_quant=name, k_bits=bits)
    assert cfg.quant.key_option().bits_per_element(64, 512) == expected


def test_bad_ggml_settings_are_refused_when_the_config_is_built():
    with pytest.raises(PipelineError, match=r"ggml_q8_0 stores 8-bit codes: it needs k_bits 8, got 4"):
        RunConfig.from_flat(k_quant="ggml_q8_0")  # k_bits defaults to 4
    with pytest.raises(PipelineError, match=r"ggml_q4_0 stores 4-bit codes"):
        RunConfig.from_flat(k_quant="ggml_q4_0", k_bits=3)
    with pytest.raises(PipelineError, match=r"k_token_group does not apply to the key quantiser ggml_q4_1"):
        RunConfig.from_flat(k_quant="ggml_q4_1", k_token_group=32)
    with pytest.raises(PipelineError, match=r"k_group.*not to ggml_iq4_nl"):
        RunConfig.from_flat(k_quant="ggml_iq4_nl", k_group=32)
    option = keyq.option_from("ggml_q4_0", QuantConfig(bits=4))
    with pytest.raises(keyq.KeyQuantError, match=r"blocks of 32.*multiple of 32, got 48"):
        option.check_head_dim(48)
    with pytest.raises(keyq.KeyQuantError, match=r"multiple of 32"):
        option.build(keyq.KeyQuantContext(48))


# ----------------------------------------------------------------------------- the runtime rotation


@pytest.mark.parametrize("head_dim, block", [(64, 64), (128, 128), (192, 64), (256, 256), (320, 64), (512, 512)])
def test_runtime_block_is_the_largest_power_of_two_dividing_head_dim(head_dim, block):
    assert runtime_block(head_dim) == block


@pytest.mark.parametrize("head_dim", [32, 48, 96, 100, 0])
def test_a_head_dim_the_runtime_skips_is_refused(head_dim):
    with pytest.raises(RuntimeRotationError, match=r"multiple of 64.*never rotates it"):
        runtime_block(head_dim)


def _sylvester(n: int) -> torch.Tensor:
    """ggml_gen_hadamard: H_1 = 1/√n, then [[H, H], [H, -H]] doubling up to n."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


@pytest.mark.parametrize("head_dim", [64, 192, 256])
def test_the_runtime_rotation_is_gmmls_hadamard_per_block_and_preserves_q_dot_k(head_dim):
    g = torch.Generator().manual_seed(head_dim)
    q, k = torch.randn(2, 3, 7, head_dim, generator=g), torch.randn(2, 3, 7, head_dim, generator=g)
    block = runtime_block(head_dim)
    rq, rk = apply_runtime_rotation(q, block), apply_runtime_rotation(k, block)
    h = _sylvester(block)
    dense = (k.double().reshape(2, 3, 7, -1, block) @ h.T).reshape(k.shape)
    assert torch.allclose(rk.double(), dense, atol=1e-5)
    assert not torch.allclose(rk, k, atol=1e-2)  # the keys do change
    assert torch.allclose(rq @ rk.transpose(-1, -2), q @ k.transpose(-1, -2), atol=1e-4)
    assert torch.allclose(apply_runtime_rotation(rk, block), k, atol=1e-5)  # H·H = I


def test_the_runtime_rotation_field_keeps_every_existing_key():
    cfg = RunConfig.from_flat(k_quant="ggml_q4_0", w_bits=16, a_bits=16, v_bits=16)
    assert RunConfig().key() == RunConfig.from_flat(runtime_rotation=False).key()
    assert RunConfig().to_dict()["online"]["runtime_rotation"] is False
    on = cfg.override(runtime_rotation=True)
    assert on.key() != cfg.key()
    assert (on.weight_key(), on.stats_key()) == (cfg.weight_key(), cfg.stats_key())  # paired: weights shared
    assert RunConfig.from_dict(on.to_dict()) == on
    assert RunConfig.from_dict({k: v for k, v in cfg.to_dict().items()}) == cfg


def test_runtime_rotation_without_a_quantised_k_cache_or_with_a_pre_rope_quantiser_is_refused():
    with pytest.raises(PipelineError, match=r"only when the K cache is quantised.*k_bits 16"):
        RunConfig.from_flat(runtime_rotation=True, k_bits=16)
    with pytest.raises(PipelineError, match=r"kvquant_prerope quantises the key before RoPE"):
        RunConfig.from_flat(runtime_rotation=True, k_quant="kvquant_prerope")
    with pytest.raises(PipelineError, match=r"runtime_rotation must be a bool"):
        RunConfig.from_flat(runtime_rotation="yes")


def test_a_head_dim_the_runtime_skips_is_refused_from_the_config_alone():
    from rope_quant.cli import common
    from rope_quant.sweep.preflight import key_problem

    cfg = RunConfig.from_flat(k_quant="ggml_q4_0", runtime_rotation=True)
    assert key_problem("c", cfg, 64) is None
    assert "never rotates it" in key_problem("c", cfg, 96)
    assert "multiple of 32" in key_problem("c", cfg.override(runtime_rotation=False), 48)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(common, "head_dim", lambda model: 96)
        with pytest.raises(PipelineError, match=r"head_dim is 96"):
            common.check_key_quant(cfg, "any")


# ----------------------------------------------------------------------------- SmolLM2's attention


def _recorded(model, ids, states_kwargs):
    """(query, key) that SDPA receives in layer 0 with the given install_attention settings, and the logits."""
    seen = []
    sdpa = attention._sdpa()

    def recording(module, query, key, value, mask, **kw):
        if module.layer_idx == 0:
            seen.append((query.detach(), key.detach()))
        return sdpa(module, query, key, value, mask, **kw)

    attention.install_attention(model, None, **states_kwargs)
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention, "_sdpa", lambda: recording)
        logits = model(ids).logits
    return seen[-1], logits


def test_smollm2_attention_sees_the_rotated_block_quantised_keys_in_llama_cpps_row_order(embedded_model):
    """SmolLM2 (head_dim 64, llama: interleaved pairs in llama.cpp): a cell that simulates the runtime hands SDPA
    q and k in llama.cpp's row order P (pair i at 2i, 2i + 1); with the switch on, H·P·q and ggml_q4_0(H·P·k), H the
    64-point Sylvester Hadamard; with q4_0 keys alone, P·q and ggml_q4_0(P·k). Without key quantisation the
    rotation leaves the logits unchanged; with q4_0 keys it changes them."""
    model = copy.deepcopy(embedded_model[0])
    geom = attention.check_model(model)
    assert geom.head_dim == 64 and runtime_block(geom.head_dim) == 64
    ids = torch.randint(0, 5000, (1, 48), generator=torch.Generator().manual_seed(3))
    q4 = keyq.option_from("ggml_q4_0", QuantConfig(bits=4))
    quant = [q4.build(keyq.KeyQuantContext(64, geom.n_kv_heads)) for _ in range(geom.n_layers)]
    (q_plain, k_plain), plain = _recorded(model, ids, {})
    (q_rot, k_rot), rotated = _recorded(model, ids, {"runtime_rotation": True})
    (q_q4, k_q4), q4_off = _recorded(model, ids, {"key_quant": quant})
    (q_q4r, k_q4r), q4_on = _recorded(model, ids, {"key_quant": quant, "runtime_rotation": True})
    order = runtime_row_order(64, pairs_interleaved=True)
    assert order is not None and order[:4].tolist() == [0, 32, 1, 33]
    h = _sylvester(64).float()
    q_row, k_row = q_plain[..., order], k_plain[..., order]
    assert torch.allclose(q_rot, q_row @ h, atol=1e-5) and torch.allclose(k_rot, k_row @ h, atol=1e-5)
    assert torch.equal(k_q4, ggml.fake_quant_ggml(k_row, "q4_0")) and torch.equal(q_q4, q_row)
    assert torch.equal(k_q4r, ggml.fake_quant_ggml(k_rot, "q4_0")) and torch.equal(q_q4r, q_rot)
    # the runtime's blocks of 32 hold 16 whole pairs; the rotate_half order's hold one half of 32 pairs
    assert not torch.equal(k_q4, ggml.fake_quant_ggml(k_plain, "q4_0")[..., order])
    assert (rotated - plain).abs().max().item() < 1e-3  # an orthogonal rotation of q and k: float error only
    assert (q4_on - q4_off).abs().max().item() > 1e-2  # the quantised cache sees other keys
    assert (q4_off - plain).abs().max().item() > 1e-2
    attention.uninstall_attention(model)


def test_the_simulators_row_order_is_the_gguf_exports_row_order():
    """The permutation the simulator applies to a head is the one the GGUF export applies to W_K's rows (so
    llama.cpp's K row, W_K's rows times the input, is our key in that order), for every llama.cpp family."""
    from rope_quant.export import gguf_export

    w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(3 * 8, 5)  # 3 heads of head_dim 8
    for model_type, (_, interleaved) in gguf_export.GGUF_ARCHITECTURES.items():
        order = runtime_row_order(8, interleaved)
        in_file = gguf_export.interleave_pairs(w, 3) if interleaved else w
        ours = w.reshape(3, 8, 5)[:, order.numpy()] if order is not None else w.reshape(3, 8, 5)
        assert np.array_equal(in_file, ours.reshape(w.shape)), model_type
    assert gguf_export.GGUF_ARCHITECTURES["llama"] == ("llama", True)
    assert gguf_export.GGUF_ARCHITECTURES["gemma3_text"] == ("gemma3", False)


def test_a_neox_family_keeps_its_order_and_other_key_quantisers_are_not_permuted():
    """Gemma 3 (NEOX rope in llama.cpp) has no runtime order; on a llama model a key quantiser that does not stand
    for llama.cpp's cache (the paper's per-token rule) sees the key in transformers' order."""
    from tests._support import tiny_gemma3, tiny_llama

    gemma = tiny_gemma3(layers=1)
    assert all(st.runtime_order is None for st in attention.install_attention(gemma, None))
    llama = tiny_llama(layers=1, hidden=128, heads=2, kv_heads=1)  # head_dim 64
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(1))
    pt = keyq.option_from("per_token", QuantConfig(bits=4))
    quant = [pt.build(keyq.KeyQuantContext(64, 1))]
    (q_plain, k_plain), _ = _recorded(llama, ids, {})
    (q_pt, _), _ = _recorded(llama, ids, {"key_quant": quant})
    assert torch.equal(q_pt, q_plain)


def test_install_refuses_the_rotation_where_the_runtime_skips_it():
    from tests._support import tiny_llama

    model = tiny_llama(layers=1)  # head_dim 16
    with pytest.raises(attention.AttentionWrapError, match=r"head_dim is 16"):
        attention.install_attention(model, None, runtime_rotation=True)


@pytest.mark.parametrize("flags, message", [
    (["--runtime-rotation"], "head_dim is 16, so the runtime never rotates it"),
    (["--k-quant", "ggml_q4_0"], "multiple of 32, got 16"),
    (["--k-quant", "ggml_q8_0"], "ggml_q8_0 stores 8-bit codes: it needs --k-bits 8, got 4"),
])
def test_the_cli_refuses_before_any_model_loads(tmp_path, capsys, monkeypatch, flags, message):
    """A config.json alone (head_dim 16): the refusal comes from the config, and no model is loaded."""
    from transformers import LlamaConfig

    from rope_quant import cli
    from rope_quant.model import loading

    model = tmp_path / "tiny-llama"
    LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=4, max_position_embeddings=4096).save_pretrained(model)
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    assert cli.main(["run", "--model", str(model), "--r1", "identity", "--out", str(tmp_path / "o"), *flags]) == 2
    assert message in capsys.readouterr().err


def test_compressed_tensors_export_refuses_the_ggml_formats_and_the_runtime_rotation():
    from rope_quant.export.compressed import check_compressed
    from rope_quant.export.fold import ExportError

    with pytest.raises(ExportError, match=r"k_quant=ggml_q4_0: a llama.cpp cache type"):
        check_compressed(RunConfig.from_flat(k_quant="ggml_q4_0"), 64)
    with pytest.raises(ExportError, match=r"cannot carry runtime_rotation"):
        check_compressed(RunConfig.from_flat(runtime_rotation=True), 64)

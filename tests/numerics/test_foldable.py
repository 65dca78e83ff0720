"""Foldable R3: the fitted R3 transforms (pairwise_scaled, prerope_channel_scale, learned_orthogonal), their fits on
the K sample, and folding a commuting R3 into W_Q / W_K (bit-close to the online R3)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rope_quant.calib import foldable as F
from rope_quant.calib.stats import CalibrationStats
from rope_quant.core import transforms as T
from rope_quant.core.rope import OddHeadDimError, rope_matrix
from rope_quant.rotations import attention
from rope_quant.rotations.fold_r3 import FoldError, fold_r3, fold_refusal

D, K, H_Q, H_KV = 16, 8, 6, 2
LAYOUTS = ("rotate_half", "interleaved")


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def tiny_llama(seed: int = 0, layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=H_Q * D, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=H_Q, num_key_value_heads=H_KV, head_dim=D, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


def _ids(length: int = 40) -> torch.Tensor:
    return torch.randint(0, 128, (2, length), generator=torch.Generator().manual_seed(1))


def _scaled(layout: str = "rotate_half", seed: int = 0) -> T.PairwiseScaled:
    rng = _rng(seed)
    return T.build("pairwise_scaled", D, angles=rng.uniform(-np.pi, np.pi, (H_KV, K)),
                   scales=np.exp(rng.normal(0, 0.7, (H_KV, K))), layout=layout)


def _examples(layout: str) -> list[T.R3Transform]:
    rng = _rng(3)
    q, _ = np.linalg.qr(rng.normal(size=(H_KV, D, D)))
    return [_scaled(layout), T.build("prerope_channel_scale", D, scales=rng.uniform(0.2, 3.0, K), layout=layout),
            T.build("learned_orthogonal", D, matrices=q, layout=layout)]


# ----------------------------------------------------------------------------- the maps


@pytest.mark.parametrize("layout", LAYOUTS)
def test_apply_matches_matrices_and_keeps_every_score(layout: str) -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, H_Q, 5, D, generator=gen, dtype=torch.float64)
    k = torch.randn(2, H_KV, 5, D, generator=gen, dtype=torch.float64)
    for t in _examples(layout):
        qq, kk = t.apply_query(q), t.apply_key(k)
        for h in range(H_Q):
            g = h // (H_Q // H_KV)
            torch.testing.assert_close(qq[:, h], q[:, h] @ torch.from_numpy(t.query_matrix(h, H_Q)).T)
            torch.testing.assert_close(kk[:, g], k[:, g] @ torch.from_numpy(t.matrix(g, H_KV)).T)
            mq, mk = t.query_matrix(h, H_Q), t.matrix(g, H_KV)
            np.testing.assert_allclose(mq, np.linalg.inv(mk).T, atol=1e-12)  # M_q = M_k^{-T}
            torch.testing.assert_close(qq[:, h] @ kk[:, g].transpose(-1, -2), q[:, h] @ k[:, g].transpose(-1, -2))


def test_scales_really_differ_between_queries_and_keys() -> None:
    """The check above can fail: a transform that scaled q and k alike would change the scores."""
    t = _scaled()
    assert not np.allclose(t.matrix(0), t.query_matrix(0))
    x = torch.randn(1, H_KV, 3, D, dtype=torch.float64)
    assert not torch.allclose(t.apply_key(x), t.apply_query(x))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_declared_commutation_holds_and_an_untied_scale_breaks_it(layout: str) -> None:
    freqs = 1e4 ** (-np.arange(0, D, 2) / D)
    for t in _examples(layout):
        for h in range(H_KV):
            for m in (1, 7, 300):
                r = rope_matrix(freqs, m, layout)
                gap = max(np.abs(M @ r - r @ M).max() for M in (t.matrix(h, H_KV), t.query_matrix(h * 3, H_Q)))
                assert (gap < 1e-10) == t.commutes_with_rope, (t.name, gap)
    # why prerope_channel_scale ties its scale within each pair: an untied diag(s) is not in the commutant
    s = np.ones(D)
    s[0] = 2.0
    r = rope_matrix(freqs, 5, layout)
    assert np.abs(np.diag(s) @ r - r @ np.diag(s)).max() > 0.1


def test_bad_parameters_are_refused_clearly() -> None:
    with pytest.raises(OddHeadDimError):
        T.build("pairwise_scaled", 15, angles=np.zeros(7))
    with pytest.raises(OddHeadDimError):
        T.build("prerope_channel_scale", 15)
    with pytest.raises(T.ScaleError, match="> 0"):
        T.build("pairwise_scaled", D, angles=np.zeros(K), scales=np.r_[np.ones(K - 1), 0.0])
    with pytest.raises(T.ScaleError, match="> 0"):
        T.build("prerope_channel_scale", D, scales=-np.ones(K))
    with pytest.raises(T.ScaleError, match="NaN"):
        T.build("prerope_channel_scale", D, scales=np.r_[np.ones(K - 1), np.nan])
    with pytest.raises(T.ScaleError, match="do not match"):
        T.build("pairwise_scaled", D, angles=np.zeros((3, K)), scales=np.ones((2, K)))
    with pytest.raises(T.NotOrthogonalError, match="not orthogonal"):
        T.build("learned_orthogonal", D, matrices=2 * np.eye(D))
    with pytest.raises(T.NotOrthogonalError, match="NaN"):
        T.build("learned_orthogonal", D, matrices=np.full((D, D), np.nan))
    with pytest.raises(T.FitError, match="layer 1 head 1"):
        bad = np.ones((H_KV, K))
        bad[1, 3] = np.inf
        T.check_fit("pairwise_scaled", [{"scales": np.ones((H_KV, K))}, {"scales": bad}], 2, H_KV)


# ----------------------------------------------------------------------------- attention: logits unchanged


@pytest.mark.parametrize("index", [0, 1, 2])
def test_gqa_logits_unchanged_by_the_online_map(index: int) -> None:
    model = tiny_llama()
    ids = _ids()
    with torch.no_grad():
        ref = model(ids).logits
    attention.install_attention(model, [_examples("rotate_half")[index]] * 2)
    with torch.no_grad():
        out = model(ids).logits
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)


# ----------------------------------------------------------------------------- folding into W_Q / W_K


def _fold_matches_online(model: torch.nn.Module, trs: list, ids: torch.Tensor) -> float:
    online = copy.deepcopy(model)
    attention.install_attention(online, trs)
    folded = copy.deepcopy(model)
    fold_r3(folded, trs)
    with torch.no_grad():
        a, b = online(ids).logits, folded(ids).logits
    return float((a - b).abs().max() / a.abs().max())


@pytest.mark.parametrize("index", [0, 1])
def test_fold_equals_online_on_the_tiny_llama(index: int) -> None:
    model, ids = tiny_llama(), _ids()
    tr = _examples("rotate_half")[index]
    assert _fold_matches_online(model, [tr, tr], ids) < 1e-6
    # the check can fail: folding the query map into W_K (and the key map into W_Q) is not the same
    wrong = copy.deepcopy(model)
    p = wrong.model.layers[0].self_attn
    p.k_proj.weight.data.mul_(2.0)
    with torch.no_grad():
        assert (wrong(ids).logits - model(ids).logits).abs().max() > 1e-3


def test_fold_refuses_a_non_commuting_map() -> None:
    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(FoldError, match="layer 1: R3 'learned_orthogonal' does not commute"):
        fold_r3(model, [_examples("rotate_half")[0], _examples("rotate_half")[2]])
    # refused before any layer changed (layer 0's map commutes; layer 1's does not)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert fold_refusal(model, [_examples("rotate_half")[0]] * 2) is None
    assert "does not commute" in (fold_refusal(model, [_examples("rotate_half")[2]] * 2) or "")


# ----------------------------------------------------------------------------- fits on a K sample


def _stats(model: torch.nn.Module, ids: torch.Tensor) -> CalibrationStats:
    stats = CalibrationStats(len(model.model.layers), H_Q, H_KV, D, sample_rows=256, sample_seed=0)
    with attention.calibration_hooks(model, stats), torch.no_grad():
        model(ids)
    return stats


def _ctx(model, stats, angles=None, **options) -> T.FitContext:
    from rope_quant.calib.objectives import resolve_layer_inv_freq

    n = len(model.model.layers)
    inv, _ = resolve_layer_inv_freq(model, n, head_dim=D)
    return T.FitContext(stats=stats, inv_freq=inv, n_layers=n, n_kv_heads=H_KV, head_dim=D, angles=angles,
                        k_bits=4, seed=0, options=options)


@pytest.fixture(scope="module")
def fitted_model():
    model = tiny_llama(seed=2)
    with torch.no_grad():  # an outlier pair, as in real keys
        model.model.layers[0].self_attn.k_proj.weight[3] *= 8.0
        model.model.layers[1].self_attn.k_proj.weight[D + 1] *= 6.0
    return model, _stats(model, _ids(96))


def test_pair_scale_fit_never_loses_to_pairwise_only(fitted_model) -> None:
    model, stats = fitted_model
    angles = np.zeros((2, H_KV, K))
    params = F.fit_for("pairwise_scaled", _ctx(model, stats, angles))
    assert len(params) == 2 and params[0]["scales"].shape == (H_KV, K)
    y = F.post_rope(*stats.k_sample(0), _ctx(model, stats).inv_freq[0], "rotate_half")
    scales, alpha, errs = F.fit_pair_scales(y, F.query_weights(stats, 0, H_KV), 4, "rotate_half")
    assert np.all(errs[list(F.ALPHAS).index(alpha[0]), 0] <= errs[0, 0])  # α = 0 is pairwise_only
    assert alpha.max() > 0  # the outlier pair makes a non-trivial scale worth it
    np.testing.assert_allclose(params[0]["scales"], scales)


def test_prerope_scales_shrink_the_outlier_pair(fitted_model) -> None:
    model, stats = fitted_model
    (p0, _) = F.fit_for("prerope_channel_scale", _ctx(model, stats))
    s = p0["scales"]  # (H_kv, K); channel 3 is pair 3 in rotate_half
    assert s[0, 3] == s[0].min() and np.exp(np.log(s).mean(-1)) == pytest.approx(1.0)


def test_learned_orthogonal_is_never_worse_than_hadamard_on_its_sample(fitted_model) -> None:
    model, stats = fitted_model
    params = F.fit_for("learned_orthogonal", _ctx(model, stats, steps=60, check_every=10, rows=256))
    had = T.build("hadamard", D)
    for layer, p in enumerate(params):
        tr = T.build("learned_orthogonal", D, matrices=p["matrices"])
        y = F.post_rope(*stats.k_sample(layer), _ctx(model, stats).inv_freq[layer], "rotate_half")
        e_l, e_h = F._rel_error(tr.apply(y), 4), F._rel_error(had.apply(y), 4)
        assert torch.all(e_l <= e_h + 1e-15)
        assert not np.allclose(p["matrices"][0], had.matrix())  # it moved


def test_a_diverging_fit_is_rejected_naming_layer_and_head(fitted_model) -> None:
    model, stats = fitted_model
    bad = copy.deepcopy(stats)
    rows, _ = bad.k_sample(1)
    bad.ksample._sample[1][2][:, 1, 0] = np.nan  # one head of layer 1 turns to NaN
    with pytest.raises(T.FitError, match="layer 1 head 1"):
        F.fit_for("learned_orthogonal", _ctx(model, bad, steps=2))
    with pytest.raises(T.FitError, match="layer 1 head 1"):
        F.fit_for("prerope_channel_scale", _ctx(model, bad))
    with pytest.raises(T.FitError, match="layer 0 head 0 diverged"):
        F.fit_for("learned_orthogonal", _ctx(model, stats, steps=5, lr=1e308))

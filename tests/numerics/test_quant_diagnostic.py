"""App. E's quantiser-step diagnostic (rope_quant.quant.diagnostic): exact steps and errors, evaluation counts
(the shared-input memo counts once), and bit-identical logits with the diagnostic on and off."""

from __future__ import annotations

import pytest
import torch

from rope_quant.experiment import static_control
from rope_quant.experiment.pipeline import RunConfig, build_quantized_model
from rope_quant.quant import diagnostic
from rope_quant.quant.quantizers import (
    QuantConfig,
    fake_quant,
    quant_step,
    selected_step,
)
from rope_quant.quant.static import StaticChannelQuantizer
from tests._support import tiny_base

TINY = dict(seqlen=32, calib_windows=2, eval_windows=2, weights="rtn", r1="random_hadamard")


@pytest.fixture(scope="module")
def qm(embedded_model):
    return build_quantized_model(RunConfig.from_flat(**TINY), base=tiny_base(embedded_model))


def _logits(qm, ids):
    with torch.no_grad():
        return qm.model(input_ids=ids).logits


@pytest.mark.parametrize("cfg", [QuantConfig(bits=4), QuantConfig(bits=3, group_size=8, clip_ratio=0.9),
                                 QuantConfig(bits=4, symmetric=True)])
def test_selected_step_is_the_step_the_quantiser_uses(cfg: QuantConfig) -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 7, 32) * torch.linspace(0.1, 4, 32)
    x[0, 0] = 0.0  # a zero group: guarded step 1
    y = fake_quant(x, cfg)
    delta = selected_step(x, cfg)
    g = 32 if cfg.group_size == -1 else cfg.group_size
    assert delta.shape == (5, 7, 32 // g)
    per = delta.unsqueeze(-1).expand(5, 7, 32 // g, g).reshape(5, 7, 32)
    k = y / per
    torch.testing.assert_close(k, k.round(), rtol=0, atol=1e-4)  # ŷ lies on the grid of that step
    assert float(delta[0, 0, 0]) == 1.0
    if not cfg.symmetric:
        torch.testing.assert_close(delta[1:], quant_step(x, cfg.bits, cfg.group_size, cfg.clip_ratio)[0][1:])


def test_static_step_is_per_channel() -> None:
    q = StaticChannelQuantizer(6, bits=4)
    q.observe(torch.tensor([[-1.0, 0.0, 2.0, 3.0, -4.0, 0.0], [1.0, 1.0, -2.0, 3.0, 0.0, 0.0]]))
    # ranges contain 0: [-1, 1], [0, 1], [-2, 2], [0, 3], [-4, 0]; an all-zero channel gets the guard step 1
    torch.testing.assert_close(q.step(), torch.tensor([2 / 15, 1 / 15, 4 / 15, 3 / 15, 4 / 15, 1.0]))


def test_recorder_statistics_are_exact() -> None:
    torch.manual_seed(1)
    cfg = QuantConfig(bits=4)
    xs = [torch.randn(3, 16), torch.randn(2, 16) * 3]
    with diagnostic.recording() as rec:
        for x in xs:
            diagnostic.observe("act", "dynamic", x, fake_quant(x, cfg), lambda _x=x: selected_step(_x, cfg))
    s = rec.summary()["act/dynamic"]
    deltas = torch.cat([selected_step(x, cfg).flatten() for x in xs]).double()
    rel = torch.tensor([float(((fake_quant(x, cfg) - x) ** 2).sum() / (x ** 2).sum()) for x in xs]).double()
    assert s["evaluations"] == 2 and s["n_steps"] == 5
    assert s["delta_mean"] == pytest.approx(float(deltas.mean()))
    assert s["delta_max"] == pytest.approx(float(deltas.max()))
    assert s["delta_sd"] == pytest.approx(float(deltas.std()))
    assert s["rel_mse_mean"] == pytest.approx(float(rel.mean()))
    assert s["rel_mse_max"] == pytest.approx(float(rel.max()))
    assert diagnostic.active() is None  # recording ends with the block
    diagnostic.observe("act", "dynamic", xs[0], xs[0], lambda: 1 / 0)  # inactive: the step is never computed


def test_counts_follow_the_memo(qm) -> None:
    """q/k/v (and gate/up) read one tensor: one evaluation each; 4 activation evaluations per layer."""
    ids = qm.corpus.eval_ids[:32].unsqueeze(0)
    with diagnostic.recording() as rec:
        _logits(qm, ids)
    s = rec.summary()
    n = qm.geometry.n_layers
    assert s["act/dynamic"]["evaluations"] == 4 * n
    assert s["k/dynamic"]["evaluations"] == n and s["v/dynamic"]["evaluations"] == n
    assert s["k/dynamic"]["n_steps"] == n * qm.geometry.n_kv_heads * 32  # one step per token and head
    assert 0 < s["k/dynamic"]["rel_mse_mean"] < 0.1 and s["act/dynamic"]["delta_max"] > 0


def test_logits_bit_identical_with_the_diagnostic_on_and_off(qm) -> None:
    """W4A4KV4 dynamic, and the static control (scope both): the diagnostic never changes a number."""
    ids = qm.corpus.eval_ids[:64].reshape(2, 32)
    off = _logits(qm, ids)
    with diagnostic.recording() as rec:
        on = _logits(qm, ids)
    assert rec.summary()["act/dynamic"]["evaluations"] > 0
    assert torch.equal(on, off)
    scales = static_control.estimate_scales(qm, static_control.static_windows(qm.corpus.eval_ids, 32, 2), "both")
    with static_control.applied(qm, scales):
        s_off = _logits(qm, ids)
        with diagnostic.recording() as rec:
            s_on = _logits(qm, ids)
    assert set(rec.summary()) == {"act/static", "k/static", "v/static"}
    assert torch.equal(s_on, s_off) and not torch.equal(s_on, off)

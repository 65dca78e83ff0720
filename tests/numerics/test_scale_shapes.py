"""Paper-scale shapes: the configs match the published model cards, built with transformers' classes."""

from __future__ import annotations

import pytest
import torch

from rope_quant.model import arch, shapes

#: Parameter counts published on the model cards, in billions (Llama-2-7B 6.74B ... Llama-3-70B 70.6B).
PUBLISHED = {"llama-2-7b": 6.74, "llama-3-8b": 8.03, "mistral-7b": 7.24, "qwen2.5-7b": 7.62, "llama-3-70b": 70.6}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_count_matches_the_model_card(name):
    n = shapes.param_count(name) / 1e9
    assert abs(n - PUBLISHED[name]) / PUBLISHED[name] < 0.01, (name, n)


def test_published_values():
    l3 = shapes.shape("llama-3-8b")
    assert (l3.heads, l3.kv_heads, l3.vocab, l3.rope_theta, l3.head_dim) == (32, 8, 128256, 5e5, 128)
    l70 = shapes.shape("Llama-3-70B")
    assert (l70.depth, l70.heads, l70.kv_heads, l70.hidden) == (80, 64, 8, 8192)
    assert shapes.shape("qwen2.5-7b").qkv_bias and shapes.shape("llama-2-7b").kv_heads == 32


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_meta_model_is_understood_by_the_adapter(name):
    s = shapes.shape(name)
    m = shapes.build_meta(name, layers=2)
    d = arch.dims(m)
    assert (d.hidden, d.n_heads, d.n_kv_heads, d.head_dim, d.intermediate, d.n_layers) == (
        s.hidden, s.heads, s.kv_heads, s.head_dim, s.intermediate, 2)
    assert m.model.embed_tokens.weight.device.type == "meta"
    q = arch.attention(m, 0).q
    assert (q.bias is not None) == s.qkv_bias
    assert m.config.rope_parameters["rope_theta"] == s.rope_theta


def test_build_truncates_depth_keeps_width_and_dtype():
    m = shapes.build("mistral-7b", layers=1, dtype=torch.bfloat16, vocab=256)
    assert len(m.model.layers) == 1 and m.config.hidden_size == 4096
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32
    out = m(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert out.shape == (1, 3, 256) and torch.isfinite(out).all()


@pytest.mark.parametrize(("name", "heads"), [("llama-3-8b", 4), ("qwen2.5-7b", 7), ("mistral-7b", 8)])
def test_narrow_keeps_head_dim_gqa_ratio_and_rope_base(name, heads):
    s, n = shapes.shape(name), shapes.narrow(name, heads)
    m = shapes.build_meta(n, layers=1)
    d = arch.dims(m)
    assert (d.head_dim, d.n_heads, d.n_heads // d.n_kv_heads) == (s.head_dim, heads, s.heads // s.kv_heads)
    assert d.hidden == heads * s.head_dim and d.intermediate == s.intermediate * heads // s.heads
    assert m.config.rope_parameters["rope_theta"] == s.rope_theta and type(m) is type(shapes.build_meta(name, 1))
    with pytest.raises(shapes.ShapeError, match=f"multiple of {s.heads // s.kv_heads}"):
        shapes.narrow(name, heads + 1)


def test_bad_names_and_truncations():
    with pytest.raises(shapes.ShapeError, match="unknown shape 'llama-9b'.*llama-2-7b"):
        shapes.shape("llama-9b")
    with pytest.raises(shapes.ShapeError, match="layers must be a positive integer"):
        shapes.hf_config("llama-2-7b", layers=0)


def test_whip_loss_in_chunks_equals_the_one_piece_loss(monkeypatch):
    """Above LOSS_CHUNK_BYTES the float64 whip loss is scored chunk by chunk; the value is the same."""
    from rope_quant.rotations import whip

    torch.manual_seed(0)
    x = torch.randn(37, 5, 1, 16)
    r = whip.qr_orthogonal(torch.randn(1, 16, 16, dtype=torch.float64))
    whole = whip._loss_float64(x, r, torch.device("cpu")).item()  # a device tensor: read once by the fit
    monkeypatch.setattr(whip, "LOSS_CHUNK_BYTES", 8 * 5 * 16 * 4)  # 4 samples per chunk, 10 chunks
    chunked = whip._loss_float64(x, r, torch.device("cpu")).item()
    assert chunked == pytest.approx(whole, rel=1e-12) and whole == whip._loss_heads(x.double(), r).item()


def test_whip_fit_shows_progress(capsys):
    from rope_quant.rotations import whip

    torch.manual_seed(0)
    whip.fit_rotation(torch.randn(8, 4, 16), steps=3, batch_size=2, progress=True)
    err = capsys.readouterr().err
    assert "whip fit (n=16)" in err and "/3 [" in err  # a bar over the 3 planned steps
    whip.fit_rotation(torch.randn(8, 4, 16), steps=3, batch_size=2)
    assert "whip fit" not in capsys.readouterr().err


def test_analytic_qr_gradient_equals_autograd_and_the_fit_follows():
    """qr_grad="analytic" (the cheaper whip step at width 4096) gives autograd's gradient to rounding."""
    from rope_quant.rotations import whip

    torch.manual_seed(0)
    n = 24
    a0 = torch.linalg.qr(torch.randn(2, n, n, dtype=torch.float64))[0] + 0.01 * torch.randn(2, n, n,
                                                                                            dtype=torch.float64)
    x = torch.randn(4, 8, 2, n, dtype=torch.float64)
    grads = []
    for qr in (whip.qr_orthogonal, whip._QRAnalytic.apply):
        a = a0.clone().requires_grad_()
        whip._loss_heads(x, qr(a)).backward()
        grads.append(a.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=1e-12)
    samples = torch.randn(16, 8, n)
    fits = [whip.fit_rotation(samples, steps=5, batch_size=4, lr=0.05, qr_grad=g) for g in ("autograd", "analytic")]
    torch.testing.assert_close(fits[1].rotation, fits[0].rotation, rtol=0, atol=1e-5)
    assert fits[0].final_loss < fits[0].initial_loss
    with pytest.raises(whip.WhipError, match="qr_grad must be one of"):
        whip.WhipConfig(qr_grad="fast")


def test_auto_qr_gradient_is_analytic_only_above_the_embedded_widths(monkeypatch):
    """``qr_grad="auto"`` (default): autograd at the embedded widths (576, 640: their numbers stay bit for bit),
    the closed form at paper scale; an explicit choice wins."""
    from rope_quant.rotations import whip

    auto = whip.WhipConfig()
    assert auto.qr_grad == "auto"
    assert [whip.qr_grad_for(auto, n) for n in (64, 576, 640, 1024, 1025, 4096, 8192)] == [
        "autograd"] * 4 + ["analytic"] * 3
    assert whip.qr_grad_for(whip.WhipConfig(qr_grad="autograd"), 4096) == "autograd"
    assert whip.qr_grad_for(whip.WhipConfig(qr_grad="analytic"), 64) == "analytic"
    used = []  # the fit really takes the resolved path
    real = whip._QRAnalytic.apply
    monkeypatch.setattr(whip._QRAnalytic, "apply", lambda a, *rest: used.append(a.shape[-1]) or real(a, *rest))
    samples = torch.randn(8, 4, 16)
    default = whip.fit_rotation(samples, steps=2, batch_size=4)
    assert used == []
    monkeypatch.setattr(whip, "AUTO_ANALYTIC_ABOVE", 8)
    whip.fit_rotation(samples, steps=2, batch_size=4)
    assert used == [16, 16]
    explicit = whip.fit_rotation(samples, steps=2, batch_size=4, qr_grad="autograd")
    assert torch.equal(explicit.rotation, default.rotation)

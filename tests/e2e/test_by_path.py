"""A user's checkpoint given by path builds what the embedded model builds: SmolLM2 written with
``save_pretrained`` under another name gives seed 0's W4A4KV4 GPTQ weights (the e2e budget, whip R1, hadamard R3)
bit for bit, and the same perplexity, as ``smollm2-135m``. So a table run with ``--rq-model=PATH`` on a copy of
the embedded model reads the embedded table's numbers (docs/models.md, "A checkpoint given by path").

``slow`` (two GPTQ builds, about 7 minutes on 2 cores). Measured 2026-11-29 (Intel Xeon, 2 threads): both
builds 23.522.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _build(model: str, base, cache: Path) -> tuple[str, float]:
    """Seed 0's build of ``model`` at the e2e budget: the SHA-256 of its state dict, and its perplexity."""
    from rope_quant.experiment.pipeline import RunConfig, build_quantized_model, run_cell

    cfg = RunConfig.from_flat(model=model, corpus="pydoc", seed=0, seqlen=512, device="cpu", calib_windows=16,
                              eval_windows=12, r3="hadamard")
    qm = build_quantized_model(cfg, cache_dir=cache, base=base)
    digest = hashlib.sha256()
    for name, tensor in sorted(qm.model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest(), float(run_cell(cfg, qm=qm)["ppl"])


def test_a_checkpoint_by_path_builds_the_embedded_models_gptq_weights_bit_for_bit(embedded_model, tmp_path) -> None:
    from rope_quant.model.loading import load_model

    model, tokenizer = embedded_model
    path = tmp_path / "my-smol-checkpoint"
    plain = type(model)(model.config)  # a GGUF-loaded model refuses save_pretrained: the same weights, plain
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(path)
    tokenizer.save_pretrained(path)
    embedded = _build("smollm2-135m", embedded_model, tmp_path / "cache-embedded")
    by_path = _build(str(path), load_model(str(path), device="cpu"), tmp_path / "cache-path")
    assert by_path == embedded, (by_path, embedded)

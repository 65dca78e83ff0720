"""``rope-quant export --format gguf`` without llama.cpp: the layout conventions against transformers' GGUF loader,
the refusals before any model loads, and (``slow``) SmolLM2's exports read back by ``gguf.GGUFReader`` and by
transformers, matching the cell. llama.cpp's own logits of these files: tests/numerics/test_llamacpp.py."""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from rope_quant.cli import export as cli_export
from rope_quant.experiment.config import RunConfig
from rope_quant.export import build as ebuild
from rope_quant.export import fold, gguf_export, outdir
from tests.numerics import test_export_cli


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rope-quant")
    cli_export.add_parser(p.add_subparsers(dest="command", required=True))
    return cli_export.run(p.parse_args(["export", *argv]))


@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (4, 4)])
def test_interleave_is_inverted_by_transformers_gguf_loader(heads: int, kv_heads: int) -> None:
    """What the export writes for a llama file, transformers' GGUF loader (LlamaTensorProcessor) undoes exactly."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    proc = LlamaTensorProcessor(config={"num_attention_heads": heads, "num_key_value_heads": kv_heads})
    rng = np.random.default_rng(0)
    for name, n in (("blk.0.attn_q.weight", heads), ("blk.0.attn_k.weight", kv_heads)):
        w = rng.standard_normal((n * 8, 24)).astype(np.float32)
        stored = gguf_export.interleave_pairs(w, n)
        assert not np.array_equal(stored, w)
        assert np.array_equal(proc.process(stored, name).weights, w)
        # pair i of each head (rows i and i + d/2) sits at rows 2i, 2i + 1
        assert np.array_equal(stored[2], w[1]) and np.array_equal(stored[3], w[1 + 4])


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "qwen3"])
def test_file_layout_is_what_transformers_gguf_loader_undoes(model_type: str) -> None:
    """Every tensor of a layer, as written for llama.cpp, comes back as the model's own tensor through transformers'
    GGUF tensor processor of that architecture (llama: q/k rows un-interleaved; gemma3: norms minus 1; qwen3:
    as is)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    from rope_quant.model import arch

    gguf_arch, interleave = gguf_export.GGUF_ARCHITECTURES[model_type]
    heads, kv_heads, d = 4, 2, 8
    proc = TENSOR_PROCESSORS.get(gguf_arch, TensorProcessor)(
        config={"num_attention_heads": heads, "num_key_value_heads": kv_heads})
    rng = np.random.default_rng(1)
    shapes = {"blk.0.attn_q.weight": (heads * d, 32), "blk.0.attn_k.weight": (kv_heads * d, 32),
              "blk.0.attn_v.weight": (kv_heads * d, 32), "blk.0.attn_norm.weight": (32,),
              "blk.0.attn_q_norm.weight": (d,), "output_norm.weight": (32,)}
    offset = arch.spec_for(model_type).norm_offset
    for name, shape in shapes.items():
        w = rng.standard_normal(shape).astype(np.float32)
        stored = gguf_export.file_layout(name, w, norm_offset=offset, interleave=interleave, n_heads=heads,
                                         n_kv_heads=kv_heads)
        np.testing.assert_allclose(proc.process(stored, name).weights, w, rtol=0, atol=1e-6, err_msg=name)
    assert offset == (1.0 if model_type == "gemma3_text" else 0.0)


def test_cli_gguf_types_are_the_enum() -> None:
    assert cli_export.GGUF_TYPES == tuple(t.value for t in gguf_export.GGUFWeightType)


def test_unsupported_architecture_named() -> None:
    with pytest.raises(fold.ExportError, match="'phi3' has no llama.cpp architecture.*gemma3_text, llama"):
        gguf_export._gguf_arch("phi3")


model_dir = test_export_cli.model_dir  # the tiny Llama checkpoint directory (fixture)


@pytest.mark.parametrize(("r3", "extra"), [("hadamard", []), ("pairwise_plus_hadamard", []),
                                           ("block_hadamard", ["--set", "r3_block=4"])])
def test_non_commuting_r3_refused_before_any_load(tmp_path: Path, model_dir: Path, capsys, monkeypatch,
                                                  r3: str, extra: list[str]) -> None:
    monkeypatch.setattr(ebuild, "build_export_model", lambda *a, **k: pytest.fail("the model was built"))
    code = main(["--model", str(model_dir), "--config", r3, "--no-r4", *extra, "--format", "gguf",
                 "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and "--format gguf cannot carry online parts" in err and "does not commute with RoPE" in err, err
    assert not (tmp_path / "o").exists()


def test_r4_and_hf_directory_refused_before_any_load(tmp_path: Path, model_dir: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(ebuild, "build_export_model", lambda *a, **k: pytest.fail("the model was built"))
    base = ["--model", str(model_dir), "--config", "pairwise_only", "--format", "gguf", "--out", str(tmp_path / "o")]
    assert main(base) == 2
    assert "R4" in capsys.readouterr().err
    assert main([*base, "--no-r4"]) == 2
    err = capsys.readouterr().err
    assert "Hugging Face directory" in err and "convert_hf_to_gguf" in err, err
    assert main([*base, "--no-r4", "--format", "hf", "--gguf-type", "q8_0"]) == 2
    assert "--gguf-type applies to --format gguf only" in capsys.readouterr().err


def test_source_gguf_of_another_architecture_refused(tmp_path: Path) -> None:
    """A GGUF whose llama.cpp architecture is not one this export writes is named, from its header alone."""
    import gguf

    path = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(path, "phi3")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cfg = RunConfig.from_flat(model=str(path), r3="pairwise_only", r4=False)
    with pytest.raises(fold.ExportError, match="architecture 'phi3'; supported: gemma3, llama, qwen2, qwen3"):
        gguf_export.check_gguf(cfg, 64)


# ----------------------------------------------------------------------------- SmolLM2 (slow: model builds)

SMALL = dict(corpus="pydoc", seed=0, r4=False, weights="none", a_bits=16, k_bits=16, v_bits=16, seqlen=128,
             calib_windows=2, eval_windows=1)
#: The unrotated cell and the folded one (random-Hadamard R1 and R2, pairwise_only with fitted φ̂ angles).
UNROTATED = dict(model="smollm2-135m", r1="identity", r2="identity", r3="identity", **SMALL)
FOLDED = dict(model="smollm2-135m", r1="random_hadamard", r2="random_hadamard", r3="pairwise_only", **SMALL)
TEXT = ("The quick brown fox jumps over the lazy dog. Rotations fold into the weights, and the runtime "
        "rotates its keys online.")


def export_gguf(cfg: RunConfig, base, out: Path, wtype=gguf_export.GGUFWeightType.F32):
    """(export dir, the cell's model with R3 online) for ``cfg`` on a copy of ``base``."""
    from rope_quant.experiment.pipeline import build_quantized_model

    qm = build_quantized_model(cfg, base=(copy.deepcopy(base[0]), base[1]))
    with outdir.staged(out, overwrite=False) as tmp:
        em = ebuild.build_export_model(cfg, None, base=(copy.deepcopy(base[0]), base[1]))
        gguf_export.write_gguf(em, tmp, wtype, source={"test": True})
    return out, qm


def ids_of(tokenizer) -> torch.Tensor:
    return torch.tensor([tokenizer(TEXT, add_special_tokens=False)["input_ids"]])


def transformers_logits(directory: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_export.GGUF_FILE, dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids=ids).logits[0]


@pytest.mark.slow
def test_smollm2_unrotated_gguf_reads_back_exactly(embedded_model, tmp_path: Path) -> None:
    """The f32 export of the unrotated cell: GGUFReader reads it (names, types, metadata copied from the source,
    provenance); transformers loads it back and its logits equal the original model's (the weights round-trip
    bit for bit through the q/k interleave and its inverse)."""
    import gguf

    out, _ = export_gguf(RunConfig.from_flat(**UNROTATED), embedded_model, tmp_path / "smol")
    reader = gguf.GGUFReader(out / gguf_export.GGUF_FILE)
    names = {t.name: t for t in reader.tensors}
    assert len(names) == 2 + 30 * 9 and "output.weight" not in names  # tied: no output tensor
    assert names["blk.0.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert reader.fields["general.architecture"].contents() == "llama"
    assert reader.fields["general.file_type"].contents() == int(gguf.LlamaFileType.ALL_F32)
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == 49152
    info = json.loads(reader.fields["rope_quant.export"].contents())
    assert info["folded"]["r3"] == "identity" and info["qk_rows"].startswith("interleaved")
    ids = ids_of(embedded_model[1])
    with torch.no_grad():
        original = embedded_model[0](input_ids=ids).logits[0]
    got = transformers_logits(out, ids)
    assert torch.equal(got, original), float((got - original).abs().max())


@pytest.mark.slow
def test_smollm2_folded_gguf_matches_the_cell(embedded_model, tmp_path: Path) -> None:
    """R1, R2 and pairwise_only (φ̂) folded, written with the llama interleave: transformers' reload equals the
    cell's model (R3 online) and the original model within 1e-4 relative (transformers un-interleaves the q/k rows
    on load, so a wrong row order or a fold that does not commute with RoPE would show here)."""
    from tests.numerics.test_export_hf import REL, rel

    out, qm = export_gguf(RunConfig.from_flat(**FOLDED), embedded_model, tmp_path / "smol")
    assert float(abs(qm.angles).max()) > 0.05
    ids = ids_of(embedded_model[1])
    with torch.no_grad():
        rotated = qm.model(input_ids=ids).logits[0]
        original = embedded_model[0](input_ids=ids).logits[0]
    got = transformers_logits(out, ids)
    print(f"smollm2 gguf folded: rel vs cell {rel(got, rotated):.2e}, vs original {rel(got, original):.2e}")
    assert rel(got, rotated) < REL and rel(got, original) < REL

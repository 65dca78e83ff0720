"""``rope-quant export`` (rope_quant.cli.export): cells from a results directory, and bad input."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from rope_quant.cli import export as cli_export
from rope_quant.sweep import records
from rope_quant.sweep.manifest import Manifest, write_manifest
from tests.numerics.export_isolated import byte_tokenizer, hf_logits
from tests.numerics.test_export_hf import REL, cell, rel, tiny_llama


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rope-quant")
    cli_export.add_parser(p.add_subparsers(dest="command", required=True))
    return p


def main(argv: list[str]) -> int:
    return cli_export.run(parser().parse_args(["export", *argv]))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny Llama checkpoint directory with a real (byte-level) tokenizer."""
    path = tmp_path_factory.mktemp("tiny") / "llama"
    tiny_llama().save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def results_dir(root: Path, model_dir: Path, name: str = "pairwise_only", complete: bool = True, **over) -> Path:
    """A results directory holding one cell (manifest + record), as ``rope-quant run`` leaves it."""
    cfg = cell(model=str(model_dir), weights="rtn", a_bits=4, k_bits=16, v_bits=16, **over)
    out = root / "results"
    write_manifest(out, Manifest(cells=[(name, cfg)], study="run"))
    if complete:
        rec = records.result_record(name, cfg, {"ppl": 12.5, "n_windows": 1}, 1.0, {})
    else:
        rec = records.error_record(name, cfg, RuntimeError("out of memory in GPTQ"), 1.0, {})
    records.write_record(out, name, cfg, rec)
    return out


@pytest.mark.parametrize(("flag", "value", "choices"), [("--format", "onnx", "'hf', 'compressed-tensors', 'gguf'"),
                                                          ("--dtype", "int8", "'float32', 'bfloat16', 'float16'")])
def test_unknown_format_or_dtype_exit_2_with_choices(tmp_path: Path, capsys, flag, value, choices) -> None:
    args = ["--format", "hf", "--dtype", "float32", "--out", str(tmp_path / "o"), "--model", "x", "--config", "y"]
    args[args.index(flag) + 1] = value
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"invalid choice: '{value}'" in err and choices in err
    assert not (tmp_path / "o").exists()


def test_incomplete_and_failed_cells_named(tmp_path: Path, model_dir: Path, capsys) -> None:
    out = results_dir(tmp_path, model_dir, complete=False)
    code = main(["--from", str(out), "--cell", "pairwise_only", "--format", "hf", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("error:") == 1
    assert "cell 'pairwise_only' seed 0" in err and "failed" in err and "out of memory in GPTQ" in err
    code = main(["--from", str(out), "--cell", "hadamard", "--format", "hf", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert code == 2 and "no cell 'hadamard' seed 0" in err and "cells: pairwise_only" in err
    assert not (tmp_path / "x").exists()


def test_non_empty_out_refused_unless_overwrite(tmp_path: Path, model_dir: Path, capsys) -> None:
    out = results_dir(tmp_path, model_dir)
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    code = main(["--from", str(out), "--cell", "pairwise_only", "--format", "hf", "--out", str(dest)])
    err = capsys.readouterr().err
    assert code == 2 and "not empty" in err and "--overwrite" in err
    assert (dest / "keep.txt").read_text() == "mine"


def test_online_part_refused_before_any_build(tmp_path: Path, model_dir: Path, capsys) -> None:
    out = results_dir(tmp_path, model_dir, r4=True)
    code = main(["--from", str(out), "--cell", "pairwise_only", "--format", "hf", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and "R4" in err and "compressed-tensors" in err
    assert not (out / "cache").exists()  # refused before the cell was built
    assert not (tmp_path / "o").exists()


def test_export_from_results_pruned_cache_recompute_and_no_recompute(tmp_path: Path, model_dir: Path,
                                                                     capsys) -> None:
    out = results_dir(tmp_path, model_dir)
    base = ["--from", str(out), "--cell", "pairwise_only", "--out", str(tmp_path / "hf")]
    # the cache policy pruned the weights: --no-recompute refuses, naming the missing file, and writes nothing
    code = main([*base, "--format", "hf", "--no-recompute"])
    err = capsys.readouterr().err
    assert code == 2 and "not in the cache" in err and "weights-" in err and "--no-recompute" in err
    assert not (tmp_path / "hf").exists()
    # without it: recomputed, with a note
    code = main([*base, "--format", "hf", "--weights", "dequantised"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "recomputed" in captured.err and "exported hf" in captured.out
    assert {"model.safetensors", "config.json", "tokenizer.json", "rope_quant_export.json"} <= {
        p.name for p in (tmp_path / "hf").iterdir()}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf.")]  # no staging directory left
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(3))
    logits, _ = hf_logits(tmp_path / "hf", ids, tmp_path)
    # now cached: --no-recompute goes through, and --overwrite replaces the export with the same content
    code = main([*base, "--format", "hf", "--weights", "dequantised", "--no-recompute", "--overwrite"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "recomputed" not in captured.err
    again, _ = hf_logits(tmp_path / "hf", ids, tmp_path)
    assert rel(again, logits) < REL
    info = json.loads((tmp_path / "hf" / "rope_quant_export.json").read_text())
    assert info["source"]["cell"] == "cell 'pairwise_only' seed 0" and info["weights"] == "dequantised"
    # and the compressed-tensors export of the same cell (K/V unquantised: R3 is not needed)
    code = main([*base[:-1], str(tmp_path / "ct"), "--format", "compressed-tensors", "--no-recompute"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "pair rotation is not written" in captured.err
    qcfg = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert qcfg["config_groups"]["group_0"]["input_activations"]["num_bits"] == 4


def test_compressed_tensors_rejects_unquantised_weights_flag(tmp_path: Path, model_dir: Path, capsys) -> None:
    out = results_dir(tmp_path, model_dir)
    code = main(["--from", str(out), "--cell", "pairwise_only", "--format", "compressed-tensors",
                 "--weights", "unquantised", "--out", str(tmp_path / "ct")])
    err = capsys.readouterr().err
    assert code == 2 and "packs the quantised codes" in err


def test_direct_flags_build_and_export(tmp_path: Path, model_dir: Path, capsys) -> None:
    sets = ["r1=random_hadamard", "r4=false", "weights=none", "a_bits=16", "k_bits=16", "v_bits=16", "seqlen=32",
            "calib_windows=2"]
    argv = ["--model", str(model_dir), "--config", "pairwise_only", "--corpus", "pydoc", "--format", "hf",
            "--out", str(tmp_path / "direct")]
    for s in sets:
        argv += ["--set", s]
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    info = json.loads((tmp_path / "direct" / "rope_quant_export.json").read_text())
    assert info["folded"]["r3"] == "pairwise_only" and info["config"]["rotation"]["r4"] is False


@pytest.mark.parametrize(("argv", "words"), [
    (["--cell", "x", "--model", "m", "--config", "pairwise_only"], ["--cell needs --from"]),
    (["--model", "m"], ["--model and --config"]),
    (["--model", "m", "--config", "pairwise_only", "--set", "w_bits"], ["FIELD=VALUE"]),
    (["--model", "m", "--config", "pairwise_only", "--set", "nonsense=1"], ["nonsense"]),
])
def test_direct_flag_errors(tmp_path: Path, capsys, argv, words) -> None:
    code = main([*argv, "--format", "hf", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error:") and all(w in err for w in words), err

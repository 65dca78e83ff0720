"""Bad input fails early and clearly (exit 2, one error, no cell run); a changed study in ``--out`` is refused.

Models here are tiny random Llama checkpoints (a config.json, or built in memory by a counting
:class:`ModelCache` loader) and truncated / empty GGUF files; cells are fakes or never reached.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rope_quant import cli
from rope_quant.model.loading import ModelLoadError, load_config, load_model
from rope_quant.sweep.loaded_models import ModelCache
from rope_quant.sweep.manifest import read_manifest
from rope_quant.sweep.records import status

QUIET = ["--no-figures", "--quiet"]


def fake_cell(calls: list):
    def run(cfg) -> dict:
        calls.append(cfg)
        if hasattr(cfg, "lengths"):
            return {"lengths": {str(L): {"ppl": 10.0 + cfg.seed + (cfg.run.r3 != "hadamard"), "n_windows": 1}
                                for L in cfg.lengths}, "k_range_mean": 1.0}
        return {"ppl": 12.0 + 0.1 * cfg.seed + (cfg.r3 != "hadamard"), "n_windows": 1, "n_tokens": 10,
                "k_range_mean": 1.0, "k_rel_err": 0.01}
    return run


def llama_config(head_dim: int = 16, heads: int = 4, intermediate: int = 128):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=256, hidden_size=head_dim * heads, intermediate_size=intermediate,
                       num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=heads,
                       max_position_embeddings=4096)


def checkpoint_dir(path: Path, **kwargs) -> Path:
    """A local HF checkpoint directory holding only config.json (enough for the config-level checks)."""
    llama_config(**kwargs).save_pretrained(path)
    return path


class CharTokenizer:
    """Byte-level stand-in for a HF tokenizer (what ``data.load_corpus`` calls)."""

    def __call__(self, text: str, **_: object) -> dict:
        return {"input_ids": list(text.encode("utf-8"))}

    def get_vocab(self) -> dict:
        return {chr(i): i for i in range(256)}


class CountingLoader:
    """A ``ModelCache`` loader building a random Llama of the configured geometry; counts loads."""

    def __init__(self, **geometry) -> None:
        self.geometry = geometry
        self.loads = 0

    def __call__(self, model: str, device: str):
        from transformers import LlamaForCausalLM

        self.loads += 1
        return LlamaForCausalLM(llama_config(**self.geometry)).eval(), CharTokenizer()


# ----------------------------------------------------------------------------- model files


@pytest.mark.compat  # transformers' GGUF reader
@pytest.mark.parametrize(("content", "words"), [(b"", ["empty", "0 bytes"]),
                                                 (b"GGUF\x03\x00\x00\x00\x01", ["truncated", "struct"]),
                                                 (b"PK\x03\x04", ["not a GGUF file"])])
def test_bad_gguf_clear_error_naming_path(tmp_path: Path, capsys, content: bytes, words: list[str]) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    for read in (load_config, load_model):
        with pytest.raises(ModelLoadError) as info:
            read(str(path))
        assert str(path) in str(info.value) and any(w in str(info.value) for w in words)
    calls: list = []
    code = cli.main(["compare", "--out", str(tmp_path / "o"), "--model", str(path), "--seeds", "0", *QUIET],
                    cell_fn=fake_cell(calls))
    err = capsys.readouterr().err
    assert code == 2, err
    assert str(path) in err and calls == []
    assert not (tmp_path / "o" / "cells").exists()


def test_support_head_dim_10_one_error_one_load(tmp_path: Path, capsys) -> None:
    model = checkpoint_dir(tmp_path / "hd10", head_dim=10, heads=2, intermediate=64)
    loader = CountingLoader(head_dim=10, heads=2, intermediate=64)
    code = cli.main(["support", "--out", str(tmp_path / "o"), "--model", str(model), "--seeds", "0,1",
                     "--seqlen", "16", *QUIET], models=ModelCache(loader))
    err = capsys.readouterr().err
    assert code == 2, err
    assert loader.loads == 1  # loaded once, not once per cell
    assert err.count("error:") == 1
    assert "head_dim=10" in err and "R2 (r2=random_hadamard)" in err and "R3 'hadamard'" in err
    assert not (tmp_path / "o" / "cells").exists()
    # an explicit block that does not divide head_dim names the block (config only: a fake cell)
    calls: list = []
    code = cli.main(["support", "--out", str(tmp_path / "o2"), "--model", str(model), "--blocks", "4",
                     "--seeds", "0", *QUIET], cell_fn=fake_cell(calls))
    err = capsys.readouterr().err
    assert code == 2 and calls == [] and "block 4" in err and "dividing head_dim = 10" in err


def test_seqlen_1_exits_2_before_any_load(tmp_path: Path, capsys) -> None:
    loader = CountingLoader()
    for command in ("compare", "long-context", "run"):
        code = cli.main([command, "--out", str(tmp_path / command), "--seqlen", "1"], models=ModelCache(loader))
        err = capsys.readouterr().err
        assert code == 2 and "--seqlen must be an integer >= 2, got 1" in err
    assert loader.loads == 0


def test_corpus_too_small_names_the_numbers(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("ROPE_QUANT_CACHE_DIR", str(tmp_path / "corpus-cache"))
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("The quick brown fox jumps over the lazy dog. " * 8)  # 360 bytes = tokens
    model = checkpoint_dir(tmp_path / "m")
    loader = CountingLoader()
    # fewer bytes than one calibration window: refused from the text alone, before the model loads
    code = cli.main(["compare", "--out", str(tmp_path / "o"), "--model", str(model), "--corpus", str(corpus),
                     "--seeds", "0,1", "--configs", "hadamard,identity", "--seqlen", "512", *QUIET],
                    models=ModelCache(loader))
    err = capsys.readouterr().err
    assert code == 2, err
    assert loader.loads == 0
    assert f"corpus {corpus}: shorter than one window" in err and "512 tokens" in err
    assert not (tmp_path / "o").exists()
    # the calibration split fits, the evaluation split does not: found once the tokenizer has loaded
    code = cli.main(["compare", "--out", str(tmp_path / "o"), "--model", str(model), "--corpus", str(corpus),
                     "--seeds", "0,1", "--configs", "hadamard,identity", "--seqlen", "200", *QUIET],
                    models=ModelCache(loader))
    err = capsys.readouterr().err
    assert code == 2, err
    assert loader.loads == 1
    assert "too small" in err and "tokens, fewer than one window of 200" in err
    assert not (tmp_path / "o" / "cells").exists()
    # long-context: a length beyond the evaluation stream
    code = cli.main(["long-context", "--out", str(tmp_path / "lc"), "--model", str(model), "--corpus",
                     str(corpus), "--eval-corpora", str(corpus), "--seeds", "0", "--seqlen", "16", "--lengths",
                     "16,4096", *QUIET],
                    models=ModelCache(loader))
    err = capsys.readouterr().err
    assert code == 2 and "fewer than one window of 4096 tokens" in err


# ----------------------------------------------------------------------------- changed studies


def _k_bits(out: Path) -> set[int]:
    return {c["config"]["quant"]["k"]["bits"] for c in read_manifest(out)["cells"]}


def test_changed_flag_refused_with_diff_then_forced(tmp_path: Path, capsys) -> None:
    out, calls = tmp_path / "o", []
    base = ["compare", "--out", str(out), "--seeds", "0,1", "--configs", "hadamard,identity", *QUIET]
    assert cli.main(base, cell_fn=fake_cell(calls)) == 0
    summary = (out / "summary.json").read_text()
    calls.clear()
    assert cli.main([*base, "--k-bits", "3"], cell_fn=fake_cell(calls)) == 2
    err = capsys.readouterr().err
    assert "different study" in err and "k_bits: 4 -> 3 (hadamard, identity)" in err
    assert "--force-new-manifest" in err
    assert calls == [] and _k_bits(out) == {4} and (out / "summary.json").read_text() == summary
    assert cli.main([*base, "--k-bits", "3", "--force-new-manifest"], cell_fn=fake_cell(calls)) == 0
    assert len(calls) == 4 and _k_bits(out) == {3}
    # another kind of study into the same directory
    assert cli.main(["support", "--out", str(out), "--seeds", "0", *QUIET], cell_fn=fake_cell(calls)) == 2
    assert "study: \"compare\" -> \"support\"" in capsys.readouterr().err


def test_same_study_extends_the_manifest(tmp_path: Path, capsys) -> None:
    out, calls = tmp_path / "o", []
    cmd = ["compare", "--out", str(out), *QUIET]
    assert cli.main([*cmd, "--seeds", "0,1", "--configs", "hadamard,identity"], cell_fn=fake_cell(calls)) == 0
    assert len(calls) == 4
    assert cli.main([*cmd, "--seeds", "0,1,2", "--configs", "hadamard,identity"], cell_fn=fake_cell(calls)) == 0
    assert len(calls) == 6  # only the new seed ran
    assert cli.main([*cmd, "--seeds", "0,1,2", "--configs", "hadamard,identity,pairwise_only"],
                    cell_fn=fake_cell(calls)) == 0
    assert len(calls) == 9 and len(read_manifest(out)["cells"]) == 9
    # a subset of the study keeps every existing cell in the manifest and the report
    assert cli.main([*cmd, "--seeds", "0", "--configs", "hadamard"], cell_fn=fake_cell(calls)) == 0
    assert len(calls) == 9 and len(read_manifest(out)["cells"]) == 9
    assert "8 existing cells kept" in capsys.readouterr().out
    assert status(out).done
    summary = json.loads((out / "summary.json").read_text())
    assert summary["seeds"] == [0, 1, 2] and set(summary["configs"]) == {"hadamard", "identity", "pairwise_only"}


def test_run_refuses_a_changed_cell_of_the_same_name(tmp_path: Path, capsys) -> None:
    out, calls = tmp_path / "o", []
    cmd = ["run", "--config", "hadamard", "--seed", "0", "--out", str(out)]
    assert cli.main(cmd, cell_fn=fake_cell(calls)) == 0
    assert cli.main([*cmd, "--k-bits", "3"], cell_fn=fake_cell(calls)) == 2
    assert "k_bits: 4 -> 3" in capsys.readouterr().err and len(calls) == 1
    assert cli.main([*cmd, "--k-bits", "3", "--name", "hadamard-k3"], cell_fn=fake_cell(calls)) == 0
    assert cli.main([*cmd, "--k-bits", "3", "--force-new-manifest"], cell_fn=fake_cell(calls)) == 0
    assert len(calls) == 3 and _k_bits(out) == {3}


# ----------------------------------------------------------------------------- small ones


def test_first_cell_error_printed_in_full(tmp_path: Path, capsys) -> None:
    def failing(cfg):
        raise RuntimeError(f"simulated failure in {cfg.r3}")

    code = cli.main(["compare", "--out", str(tmp_path / "o"), "--seeds", "0", "--configs", "hadamard,identity",
                     *QUIET], cell_fn=failing)
    err = capsys.readouterr().err
    assert code == 1
    assert "first error (hadamard seed 0, 2 failed cell(s)" in err
    assert "Traceback" in err and "RuntimeError: simulated failure in hadamard" in err


def test_long_context_header_lists_seeds(tmp_path: Path, capsys) -> None:
    out = tmp_path / "lc"
    assert cli.main(["long-context", "--out", str(out), "--seeds", "0,1", "--lengths", "256,512", "--eval-corpora",
                     "pydoc", *QUIET],
                    cell_fn=fake_cell([])) == 0
    header = (out / "summary.md").read_text().splitlines()[0]
    assert "4/4 cells, seeds 0, 1," in header and "–" not in header


def test_w_mse_help_says_what_the_default_is() -> None:
    sub = cli.build_parser()._subparsers._group_actions[0].choices["compare"]
    action = next(a for a in sub._actions if "--w-mse" in a.option_strings)
    assert "CPU off" not in action.help and "default on for CPU and CUDA" in action.help
    assert cli.BUDGETS["cpu"]["w_mse"] is True


def test_complete_sweep_rerun_loads_nothing(tmp_path: Path) -> None:
    out = tmp_path / "o"
    cmd = ["compare", "--out", str(out), "--seeds", "0", "--configs", "hadamard,identity", *QUIET]
    assert cli.main(cmd, cell_fn=fake_cell([])) == 0
    loader = CountingLoader()
    assert cli.main(cmd, models=ModelCache(loader)) == 0  # the real pipeline: every cell already complete
    assert loader.loads == 0


@pytest.mark.parametrize(("argv", "message"), [
    (["estimators", "--phi-star", "--average-length", "0"], "--average-length must be None or a positive integer"),
    (["support", "--blocks", "3"], "--blocks must be powers of two"),
    (["compare", "--eval-windows", "-1"], "--eval-windows must be an integer >= 1 (0 = all)"),
])
def test_more_bad_numbers_exit_2_before_any_load(argv, message, tmp_path: Path, capsys) -> None:
    loader = CountingLoader()
    assert cli.main([*argv, "--out", str(tmp_path / "o"), "--seeds", "0"], models=ModelCache(loader)) == 2
    assert message in capsys.readouterr().err and loader.loads == 0

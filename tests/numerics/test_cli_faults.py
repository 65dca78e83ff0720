"""Faults and bad input at the CLI: each gets exit 2 and one specific line on stderr,
before any model loads, and writes nothing; an environment fault during a sweep is one line, not a traceback.

Models are a config-only tiny Llama checkpoint; the model loader of the real pipeline raises if reached, so a
check that came too late fails the test. Read-only and full disks are injected (``os.access``, ``OSError``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from pathlib import Path

import pytest

from rope_quant import cli, io
from rope_quant.sweep.loaded_models import ModelCache

QUIET = ["--no-figures", "--quiet", "--seeds", "0"]


def _no_load(model: str, device: str):
    raise AssertionError(f"the model {model} was loaded before the input was checked")


@pytest.fixture
def model(tmp_path: Path) -> str:
    """A local checkpoint directory holding only a tiny Llama's config.json."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=4, max_position_embeddings=4096).save_pretrained(tmp_path / "tiny")
    return str(tmp_path / "tiny")


def refused(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    """Run the real pipeline (its loader raises), expect exit 2 with ONE error line; returns that line."""
    code = cli.main(argv, models=ModelCache(_no_load))
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("note:")]
    assert len(lines) == 1 and "error: " in lines[0] and "Traceback" not in err, err
    return lines[0]


# ----------------------------------------------------------------------------- output and cache paths


def test_out_an_existing_file(tmp_path: Path, model: str, capsys) -> None:
    target = tmp_path / "results.txt"
    target.write_text("keep me")
    line = refused(["compare", "--out", str(target), "--model", model, *QUIET], capsys)
    assert f"--out {target}: an existing file, not a directory" in line
    assert target.read_text() == "keep me"


def test_out_under_a_file(tmp_path: Path, model: str, capsys) -> None:
    (tmp_path / "f").write_text("x")
    line = refused(["compare", "--out", str(tmp_path / "f" / "sub" / "dir"), "--model", model, *QUIET], capsys)
    assert f"{tmp_path / 'f'} is a file, so no directory can be created under it" in line


def test_out_not_writable(tmp_path: Path, model: str, capsys, monkeypatch) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == ro else real(p, mode, **kw))
    line = refused(["compare", "--out", str(ro / "new"), "--model", model, *QUIET], capsys)
    assert f"--out {ro / 'new'}: {ro} is not writable" in line
    assert not (ro / "new").exists()


def test_out_on_a_read_only_filesystem(tmp_path: Path, model: str, capsys, monkeypatch) -> None:
    """As root, os.access says yes on a read-only mount: the probe write sees EROFS."""
    import tempfile

    def erofs(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", kwargs.get("dir"))

    monkeypatch.setattr(tempfile, "mkstemp", erofs)
    line = refused(["run", "--out", str(tmp_path / "o"), "--model", model, "--seed", "0"], capsys)
    assert "--out" in line and "read-only (errno EROFS)" in line
    assert not (tmp_path / "o").exists()


def test_cache_dir_not_writable(tmp_path: Path, model: str, capsys, monkeypatch) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == cache else real(p, mode, **kw))
    line = refused(["compare", "--out", str(tmp_path / "o"), "--cache-dir", str(cache), "--model", model,
                    *QUIET], capsys)
    assert f"--cache-dir {cache}: {cache} is not writable" in line
    assert not (tmp_path / "o").exists()


def test_disk_full_at_the_probe(tmp_path: Path, model: str, capsys, monkeypatch) -> None:
    import tempfile

    def enospc(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tempfile, "mkstemp", enospc)
    line = refused(["compare", "--out", str(tmp_path / "o"), "--model", model, *QUIET], capsys)
    assert "the disk is full (errno ENOSPC)" in line


# ----------------------------------------------------------------------------- corpora


def _latin1(p: Path) -> None:
    p.write_bytes("caf\xe9 ".encode("latin-1") * 400)


@pytest.mark.parametrize(("make", "words"), [
    (lambda p: None, "missing (no such file or directory)"),
    (lambda p: p.write_text(""), "empty"),
    (lambda p: p.write_text("  \n\n "), "empty"),
    (_latin1, "not UTF-8"),
    (lambda p: p.write_bytes(b"\x00\x01\x02binary" * 100), "binary (NUL bytes), not UTF-8 text"),
    (lambda p: p.write_text("too short for a window.\n\nstill short.\n"), "shorter than one window"),
    (lambda p: (p.mkdir(), (p / "image.png").write_bytes(b"\x89PNG")), "a folder with no text"),
])
def test_corpus_errors_name_the_corpus(tmp_path: Path, model: str, capsys, make, words: str) -> None:
    corpus = tmp_path / "corpus.txt"
    make(corpus)
    line = refused(["compare", "--out", str(tmp_path / "o"), "--model", model, "--corpus", str(corpus),
                    "--seqlen", "64", *QUIET], capsys)
    assert f"corpus {corpus}: {words}" in line, line
    assert not (tmp_path / "o").exists()


def test_a_long_enough_local_corpus_passes_the_text_check(tmp_path: Path) -> None:
    from rope_quant.sweep.preflight import check_corpus_text

    corpus = tmp_path / "ok.txt"
    corpus.write_text("A line of text.\n\n" * 100)
    check_corpus_text(str(corpus), 64)  # raises on failure
    check_corpus_text("pydoc", 10**9)  # embedded corpora are checked by name (windows after tokenising)


# ----------------------------------------------------------------------------- names, bits, flags, seeds


@pytest.mark.parametrize(("argv", "needles"), [
    (["compare", "--configs", "hadamrd,identity"], ["unknown config 'hadamrd'", "did you mean 'hadamard'"]),
    (["compare", "--configs", "beyon"],
     ["did you mean 'beyond'", "presets: commuting-r3, foldable-r3, lower-bits; earlier names: beyond, beyond2"]),
    (["compare", "--configs", "lowerbits"], ["did you mean 'lower-bits'"]),
    (["long-context", "--configs", "apj"], ["did you mean 'appj'",
                                              "presets: commuting-r3, matched-phi-star; earlier names: beyond, appj"]),
    (["compare", "--comparator", "hadamrd"], ["unknown --comparator 'hadamrd'", "did you mean 'hadamard'"]),
    (["compare", "--corpus", "pydco"], ["unknown corpus 'pydco'", "did you mean 'pydoc'"]),
    (["compare", "--model", "smollm2-135"], ["unknown model 'smollm2-135'", "did you mean 'smollm2-135m'"]),
    (["run", "--config", "pairwise"], ["unknown config 'pairwise'", "did you mean"]),
    (["compare", "--k-bits", "1"], ["--k-bits"]),
    (["compare", "--whip-epochs", "-1"], ["--whip-epochs must be an integer >= 1, got -1"]),
    (["compare", "--seeds", "99999999999999999999"], ["--seeds", "out of range", "0-9"]),
    (["compare", "--seeds", "5-3"], ["--seeds", "empty", "0-4,7"]),
    (["compare", "--seeds", "0,x"], ["--seeds", "malformed"]),
    (["run", "--seed", str(2**63)], ["--seed must satisfy 0 <= seed < 2**63"]),
])
def test_bad_names_and_numbers(tmp_path: Path, model: str, capsys, argv: list[str], needles: list[str]) -> None:
    uses_model = "--model" not in argv
    base = ["--out", str(tmp_path / "o")] + (["--model", model] if uses_model else [])
    line = refused([*argv, *base, *(["--no-figures", "--quiet"] if argv[0] != "run" else [])], capsys)
    for needle in needles:
        assert needle in line, (needle, line)
    assert not (tmp_path / "o").exists()  # nothing written: no manifest, no failed record


def test_the_preset_list_comes_from_the_registry() -> None:
    from rope_quant.sweep.presets import APPJ, BEYOND, BEYOND2, COMMAND_PRESETS, LOWER_BITS

    assert COMMAND_PRESETS["compare"] == (BEYOND, BEYOND2, LOWER_BITS)
    assert COMMAND_PRESETS["long-context"] == (BEYOND, APPJ)


def test_the_earlier_preset_names_are_aliases() -> None:
    from rope_quant.cli.common import parse_configs_or_preset
    from rope_quant.sweep.presets import PRESET_ALIASES, preset_named

    assert PRESET_ALIASES == {"beyond": "commuting-r3", "beyond2": "foldable-r3", "appj": "matched-phi-star"}
    assert parse_configs_or_preset("beyond2", "compare") == ((), "foldable-r3")
    assert parse_configs_or_preset("appj", "long-context") == ((), "matched-phi-star")
    assert parse_configs_or_preset("commuting-r3", "long-context") == ((), "commuting-r3")
    assert preset_named("appj", "compare") is None  # an alias is a preset only where its preset is


def test_seed_ranges_run(tmp_path: Path) -> None:
    seen: list = []

    def cell(cfg) -> dict:
        seen.append(cfg.seed)
        return {"ppl": 10.0 + cfg.seed + (cfg.r3 != "hadamard"), "n_windows": 1, "n_tokens": 10}

    assert cli.main(["compare", "--out", str(tmp_path / "o"), "--configs", "hadamard,identity", "--seeds", "0-3,7",
                     "--no-figures", "--quiet"], cell_fn=cell) == 0
    assert sorted(set(seen)) == [0, 1, 2, 3, 7]


# ----------------------------------------------------------------------------- disk full, corrupt manifests


def _full_after(monkeypatch, match: str) -> None:
    """``io.atomic_writer`` raises ENOSPC for every path containing ``match``."""
    real = io.atomic_writer

    @contextlib.contextmanager
    def writer(path):
        if match in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        with real(path) as fh:
            yield fh

    monkeypatch.setattr(io, "atomic_writer", writer)


def _cell(cfg) -> dict:
    return {"ppl": 12.0 + 0.1 * cfg.seed + (cfg.r3 != "hadamard"), "n_windows": 1, "n_tokens": 10}


def test_disk_full_before_the_first_cell(tmp_path: Path, capsys, monkeypatch) -> None:
    _full_after(monkeypatch, "manifest.json")
    code = cli.main(["compare", "--out", str(tmp_path / "o"), "--configs", "hadamard,identity", *QUIET],
                    cell_fn=_cell)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "error: the disk is full (errno ENOSPC)" in err and "manifest.json" in err


def test_disk_full_mid_sweep_then_a_bit_identical_rerun(tmp_path: Path, capsys, monkeypatch) -> None:
    out, clean = tmp_path / "o", tmp_path / "clean"
    argv = ["compare", "--configs", "hadamard,identity", "--no-figures", "--quiet", "--seeds", "0,1"]
    assert cli.main([*argv, "--out", str(clean)], cell_fn=_cell) == 0
    _full_after(monkeypatch, "seed1")
    code = cli.main([*argv, "--out", str(out)], cell_fn=_cell)
    err = capsys.readouterr().err
    assert code in (1, 2) and "Traceback" not in err, err
    assert "disk full" in err or "the disk is full" in err
    monkeypatch.undo()
    assert cli.main([*argv, "--out", str(out)], cell_fn=_cell) == 0
    strip = lambda p: {k: v for k, v in json.loads(p.read_text()).items() if k not in ("paired", "files")}  # noqa: E731
    assert json.loads((out / "summary.json").read_text())["configs"] == \
        json.loads((clean / "summary.json").read_text())["configs"]
    assert strip(out / "summary.json").keys() == strip(clean / "summary.json").keys()


def test_cell_failing_on_a_full_disk_is_one_line(tmp_path: Path, capsys) -> None:
    def cell(cfg) -> dict:
        if cfg.r3 == "identity":
            raise OSError(errno.ENOSPC, "No space left on device", "/somewhere/cache/weights-x.pt")
        return _cell(cfg)

    code = cli.main(["compare", "--out", str(tmp_path / "o"), "--configs", "hadamard,identity", *QUIET],
                    cell_fn=cell)
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err, err
    assert "disk full: OSError: [Errno 28] No space left on device" in err and "rerun the same command" in err


@pytest.mark.parametrize("content", ["{not json", "", "[1, 2]", "\xff\xfe"])
def test_report_and_verify_on_a_corrupt_manifest(tmp_path: Path, capsys, content: str) -> None:
    out = tmp_path / "o"
    out.mkdir()
    (out / "manifest.json").write_text(content, encoding="latin-1")
    for command in ("report", "verify"):
        assert cli.main([command, str(out)]) == 2
        err = capsys.readouterr().err
        assert f"{out / 'manifest.json'}" in err and "--force-new-manifest to replace it" in err, err
        assert "Traceback" not in err


# ----------------------------------------------------------------------------- messages


def test_main_job_says_which_weight_mode(tmp_path: Path, capsys) -> None:
    assert cli.main(["compare", "--out", str(tmp_path / "a"), "--configs", "hadamard,identity", *QUIET],
                    cell_fn=_cell) == 0
    out = capsys.readouterr().out
    assert "weights: RTN (the CPU budget's default), not the paper's GPTQ" in out
    assert cli.main(["compare", "--out", str(tmp_path / "b"), "--configs", "hadamard,identity", "--w-bits", "16",
                     "--a-bits", "16", *QUIET], cell_fn=_cell) == 0
    out = capsys.readouterr().out
    assert "weights=rtn" not in out and "weights: RTN" not in out
    assert "weights=16-bit (W16: not quantised)" in out


def test_r1_refusal_note_on_stdout_names_the_norms(tmp_path: Path, capsys, monkeypatch) -> None:
    from rope_quant.cli import common

    reason = ("gemma3_text has sandwich norms (post_attention_layernorm, post_feedforward_layernorm) that scale "
              "the o_proj / down_proj outputs per channel")
    monkeypatch.setattr(common, "r1_refusal", lambda model: reason)
    assert cli.main(["compare", "--out", str(tmp_path / "o"), "--configs", "hadamard,identity", "--w-bits", "16",
                     "--a-bits", "16", *QUIET], cell_fn=_cell) == 0
    captured = capsys.readouterr()
    assert "note: R1 set to identity" in captured.out and "post_feedforward_layernorm" in captured.out
    assert "R1=identity" in captured.out and "R1 set to identity" not in captured.err  # once, next to the settings
    line = refused(["compare", "--out", str(tmp_path / "p"), *QUIET], capsys)
    assert "post_attention_layernorm" in line and "--r1 identity" in line


def test_r1_rule() -> None:
    from rope_quant.rotations.r1_choice import choose_r1

    assert choose_r1("m", None, None, 4).r1 == "whip"
    assert choose_r1("m", "norms", "identity", 4).r1 == "identity"
    choice = choose_r1("m", "norms", None, 16)
    assert choice.r1 == "identity" and "norms" in (choice.note or "")
    with pytest.raises(ValueError, match="the default R1 \\(whip\\) with --a-bits 4 is refused"):
        choose_r1("m", "norms", None, 4)


def test_whip_fits_are_mentioned_only_when_kept(tmp_path: Path) -> None:
    from rope_quant.sweep.cache_policy import CachePruner, policy_lines

    cache = tmp_path / "cache"
    cache.mkdir()
    pruner = CachePruner(cache, [], lambda i: True)
    assert not any("whip R1 fits are kept" in line for line in policy_lines(cache, pruner))
    (cache / "r1-whip-abc.pt").write_bytes(b"x" * 10)
    assert any("whip R1 fits are kept" in line for line in policy_lines(cache, pruner))

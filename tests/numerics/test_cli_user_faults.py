"""Bad input and faults at the command line, as a user meets them: ``rope-quant`` runs in a subprocess, and each
case is checked for its exit code and its one ``error:`` line (no traceback), given before the model is loaded
or built, with nothing left behind. The export flow of docs/export.md runs as printed.

Where a case must not reach the model, the subprocess runs the CLI behind a guard that exits 97 if a model is
loaded or an export model is built; faults (a full disk, a read-only directory, a killed writer) are injected
into that subprocess the same way.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests._support.reliability import corpus_text, save_tiny_model

REPO = Path(__file__).resolve().parents[2]

#: Exits 97 when a model is loaded or an export model is built (the check came too late).
GUARD = """
import os, sys
def _too_late(*args, **kwargs):
    sys.stderr.write("GUARD: the model was loaded or built before the input was checked\\n")
    sys.stderr.flush()
    os._exit(97)
import rope_quant.model.loading, rope_quant.export.build
rope_quant.model.loading.load_model = _too_late
rope_quant.export.build.build_export_model = _too_late
"""

#: safetensors' own error on a full disk (measured on a 64 KiB tmpfs: the file is removed, this is raised).
FULL_DISK = """
import safetensors.torch, transformers.modeling_utils
from safetensors import SafetensorError
def _full(tensors, filename, metadata=None):
    with open(filename, "wb") as fh:
        fh.write(b"\\0" * 4096)  # a partial file, as a real disk fills
    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
safetensors.torch.save_file = _full
transformers.modeling_utils.safe_save_file = _full
"""

#: Kills its own process (SIGKILL) once the hf files are in the staging directory, before the rename.
KILL_AFTER_WRITE = """
import os, signal
import rope_quant.export.hf as _hf
_write = _hf.write_hf
def _write_then_die(*args, **kwargs):
    _write(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)
_hf.write_hf = _write_then_die
"""


def rope_quant(argv: list[str], cwd: Path, *, inject: str = "") -> subprocess.CompletedProcess:
    """``rope-quant ARGV`` in a subprocess (``python -m rope_quant.cli``, or the same ``main`` after ``inject``)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "ROPE_QUANT_CACHE_DIR": str(cwd / "token-cache"), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TQDM_DISABLE": "1"}
    if inject:
        script = textwrap.dedent(inject) + "\nfrom rope_quant.cli import main\nsys.exit(main(sys.argv[1:]))\n"
        cmd = [sys.executable, "-c", "import sys\n" + script, *argv]
    else:
        cmd = [sys.executable, "-m", "rope_quant.cli", *argv]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def help_flags(command: str) -> set[str]:
    """The flags ``rope-quant COMMAND --help`` lists."""
    from rope_quant.cli import build_parser

    parser = build_parser(only=command)
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]  # noqa: SLF001
    return {s for action in sub._actions for s in action.option_strings}  # noqa: SLF001


#: A progress bar's line (tqdm), not a message.
PROGRESS = re.compile(r"\d+%\|.*\|")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def refused(proc: subprocess.CompletedProcess, command: str) -> str:
    """Exit 2 with one ``error:`` line on stderr (notes aside) and no traceback; every flag the line names
    exists in ``rope-quant COMMAND --help``. Returns the line."""
    err = proc.stderr
    assert proc.returncode == 2, (proc.returncode, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    lines = [s for s in err.splitlines() if s.strip() and not s.startswith(("note:", "[transformers]"))
             and not PROGRESS.search(s)]
    assert len(lines) == 1 and "error: " in lines[0], err
    named = set(FLAG.findall(lines[0].split("`rope-quant ")[0]))
    assert named <= help_flags(command), (named - help_flags(command), lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A saved 2-layer random Llama with a byte-level tokenizer, and a random-word corpus beside it."""
    root = tmp_path_factory.mktemp("models")
    (root / "corpus.txt").write_text(corpus_text(1))
    return save_tiny_model(root / "tiny")


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> Path:
    """A GPT-2 checkpoint (config only: a load would fail on its missing weights, not name the type)."""
    from transformers import GPT2Config

    path = tmp_path_factory.mktemp("models") / "gpt2"
    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=300).save_pretrained(path)
    return path


def _config(path: Path, data: dict) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(data))
    return path


def _leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


# ----------------------------------------------------------------------------- export


TINY_CELL = ["--no-r4", "--set", "weights=none", "--set", "a_bits=16", "--set", "k_bits=16", "--set", "v_bits=16",
             "--set", "seqlen=32", "--set", "calib_windows=2", "--set", "r1=random_hadamard"]


@pytest.mark.parametrize(("case", "words"), [
    ("unknown config", ["unknown config 'pairwise_onyl'", "did you mean 'pairwise_only'"]),
    ("gpt2", ["model type 'gpt2' is not supported", "registered types are", "llama"]),
    ("partial config", ["lacks hidden_size, intermediate_size, num_hidden_layers, num_attention_heads"]),
    ("unknown corpus", ["unknown corpus 'pydco'", "did you mean 'pydoc'"]),
    ("read-only parent", ["is not writable"]),
    ("r4 to hf", ["R4", "--format compressed-tensors", "For this cell: pass --no-r4"]),
])
def test_export_bad_input_refused_before_the_build(tmp_path: Path, tiny: Path, gpt2: Path, case: str,
                                                   words: list[str]) -> None:
    model, config, inject, cell = str(tiny), "pairwise_only", GUARD, TINY_CELL
    out = tmp_path / "parent" / "out"
    out.parent.mkdir()
    if case == "unknown config":
        config = "pairwise_onyl"
    elif case == "gpt2":
        model = str(gpt2)
    elif case == "partial config":
        model = str(_config(tmp_path / "partial", {"model_type": "llama", "vocab_size": 100}))
    elif case == "unknown corpus":
        cell = [*cell, "--corpus", "pydco"]
    elif case == "read-only parent":  # os.access: root passes chmod, so the check is what sees read-only
        inject += textwrap.dedent(f"""
            _access = os.access
            os.access = lambda p, m, **k: False if os.path.abspath(p) == {str(out.parent)!r} else _access(p, m, **k)
        """)
    elif case == "r4 to hf":
        cell = [c for c in cell if c != "--no-r4"]
    line = refused(rope_quant(["export", "--model", model, "--config", config, *cell, "--format", "hf",
                               "--out", str(out)], tmp_path, inject=inject), "export")
    assert all(w in line for w in words), line
    assert not out.exists() and _leftovers(out.parent, "out") == []


def test_export_on_a_full_disk_is_one_line_and_leaves_nothing(tmp_path: Path, tiny: Path) -> None:
    out = tmp_path / "out"
    proc = rope_quant(["export", "--model", str(tiny), "--config", "pairwise_only", *TINY_CELL, "--corpus",
                       str(tiny.parent / "corpus.txt"), "--format", "hf", "--out", str(out)], tmp_path,
                      inject=FULL_DISK)
    line = refused(proc, "export")
    assert f"--out {out}: the disk is full (errno ENOSPC)" in line and "nothing was written" in line, line
    assert not out.exists() and _leftovers(tmp_path, "out") == []


def test_a_killed_exports_staging_dir_is_removed_by_the_rerun_and_a_live_one_kept(tmp_path: Path,
                                                                                  tiny: Path) -> None:
    from filelock import FileLock

    out = tmp_path / "out"
    argv = ["export", "--model", str(tiny), "--config", "pairwise_only", *TINY_CELL, "--corpus",
            str(tiny.parent / "corpus.txt"), "--format", "hf", "--out", str(out)]
    killed = rope_quant(argv, tmp_path, inject=KILL_AFTER_WRITE)
    assert killed.returncode == -9, killed.stderr[-2000:]
    (stale,) = [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-") and p.is_dir()]
    assert (stale / "model.safetensors").is_file() and not out.exists()
    live = tmp_path / ".out.tmp-live"  # another export still writing: its lock is held
    live.mkdir()
    with FileLock(str(tmp_path / ".out.tmp-live.lock")):
        rerun = rope_quant(argv, tmp_path)
        assert rerun.returncode == 0, rerun.stderr[-3000:]
        assert f"note: removed {stale.name}, left beside {out} by a killed export" in rerun.stderr
        assert live.is_dir()
    assert not stale.exists() and (out / "model.safetensors").is_file()
    assert _leftovers(tmp_path, "out") == [".out.tmp-live", ".out.tmp-live.lock"]


def test_the_documented_flow_runs_as_printed(tmp_path: Path, tiny: Path) -> None:
    """docs/export.md: `rope-quant run --out results --config pairwise_only … --no-r4` then `rope-quant export
    --from results --cell pairwise_only --seed 0 --format hf …` (tiny model and budget in place of the …)."""
    doc = (REPO / "docs" / "export.md").read_text()
    run_line = next(s for s in doc.splitlines() if s.startswith("rope-quant run --out results"))
    export_line = next(s for s in doc.splitlines() if "--format hf" in s and s.startswith("rope-quant export"))
    run_argv = run_line.split("#")[0].replace("...", "").split()[1:]
    run_argv[run_argv.index("--model") + 1] = str(tiny)  # the tiny model in place of the embedded one
    budget = ["--corpus", str(tiny.parent / "corpus.txt"), "--seqlen", "32", "--calib-windows", "2",
              "--eval-windows", "1", "--weights", "rtn", "--no-w-mse", "--whip-epochs", "1"]
    proc = rope_quant([*run_argv, *budget], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "R4=off" in proc.stdout
    proc = rope_quant(export_line.split("#")[0].split()[1:], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / export_line.split("--out")[1].split()[0]
    info = json.loads((out / "rope_quant_export.json").read_text())
    assert info["config"]["rotation"]["r4"] is False and info["folded"]["r3"] == "pairwise_only"
    assert "--no-r4" in help_flags("run") and "--no-r4" in help_flags("compare")


def test_a_cell_with_r4_is_refused_for_hf_with_a_remedy_that_exists(tmp_path: Path, tiny: Path) -> None:
    """A complete cell of the paper's default (R4 on), as `run` leaves it (manifest and record written here)."""
    from rope_quant.experiment.config import RunConfig
    from rope_quant.sweep import records
    from rope_quant.sweep.manifest import Manifest, write_manifest

    cfg = RunConfig.from_flat(model=str(tiny), r3="pairwise_only", weights="rtn", seqlen=32, calib_windows=2)
    assert cfg.rotation.r4
    write_manifest(tmp_path / "results", Manifest(cells=[("pairwise_only", cfg)], study="run"))
    records.write_record(tmp_path / "results", "pairwise_only", cfg, records.result_record(
        "pairwise_only", cfg, {"ppl": 12.5, "n_windows": 1}, 1.0, {}))
    line = refused(rope_quant(["export", "--from", "results", "--cell", "pairwise_only", "--format", "hf",
                               "--out", "x"], tmp_path, inject=GUARD), "export")
    assert "R4 (the online Hadamard on down_proj's input)" in line
    assert "For this cell: run the cell with --no-r4 (`rope-quant run --no-r4" in line, line
    assert not (tmp_path / "x").exists() and not (tmp_path / "results" / "cache").exists()


def test_r4_default_keeps_the_keys_of_existing_results() -> None:
    """--r4 (the default) hashes nothing new, so a results directory written before the flag keeps its cells;
    --no-r4 is another cell (and other weights)."""
    import argparse

    from rope_quant.cli.common import base_config
    from rope_quant.cli.options import add_common

    parser = argparse.ArgumentParser()
    add_common(parser)
    on = parser.parse_args(["--out", "x", "--dtype", "float32", "--weights", "rtn"])
    before = argparse.Namespace(**{k: v for k, v in vars(on).items() if k != "r4"})  # the flag did not exist
    off = parser.parse_args(["--out", "x", "--dtype", "float32", "--weights", "rtn", "--no-r4"])
    assert on.r4 is True and off.r4 is False
    assert base_config(on).key() == base_config(before).key()
    assert base_config(on).weight_key() == base_config(before).weight_key()
    assert base_config(off).key() != base_config(on).key()
    assert base_config(off).weight_key() != base_config(on).weight_key()


# ----------------------------------------------------------------------------- plan


@pytest.mark.parametrize(("config", "flags", "words"), [
    ({"model_type": "llama", "vocab_size": 100}, [],
     ["config.json lacks hidden_size, intermediate_size, num_hidden_layers, num_attention_heads"]),
    ({"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
      "num_hidden_layers": -3, "num_attention_heads": 4}, [], ["num_hidden_layers must be a positive integer, got -3"]),
    ({"model_type": "gpt2", "n_layer": 1}, [], ["model type 'gpt2' is not supported"]),
    (None, ["--calib-windows", "0"], ["--calib-windows must be a positive integer, got 0"]),
    (None, ["--seqlen", "-1"], ["--seqlen must be a positive integer, got -1"]),
    (None, ["--whip-epochs", "0"], ["--whip-epochs must be a positive integer, got 0"]),
    (None, ["--configs", "0"], ["--configs must be a positive integer, got 0"]),
])
def test_plan_refuses_partial_configs_and_names_its_flags(tmp_path: Path, config: dict | None, flags: list[str],
                                                          words: list[str]) -> None:
    model = "llama-3-8b" if config is None else str(_config(tmp_path / "m", config))
    line = refused(rope_quant(["plan", model, *flags], tmp_path), "plan")
    assert all(w in line for w in words), line
    assert not re.search(r"(?<!-)\b(calib_windows|whip_epochs)\b", line), line


# ----------------------------------------------------------------------------- every command


SWEEPS = ("run", "compare", "support", "estimators", "long-context", "lm-eval", "niah", "static")


def _sweep_argv(command: str, model: str, out: Path) -> list[str]:
    extra = {"lm-eval": ["--tasks", "piqa"], "long-context": ["--lengths", "64"], "static": ["--lengths", "64"],
             "niah": ["--lengths", "64"]}.get(command, [])
    seeds = ["--seed", "0"] if command == "run" else ["--seeds", "0", "--no-figures"]
    return [command, "--model", model, "--out", str(out), *seeds, *extra]


@pytest.mark.parametrize("command", SWEEPS)
def test_every_sweep_command_refuses_an_unsupported_architecture_before_loading(tmp_path: Path, gpt2: Path,
                                                                                command: str) -> None:
    out = tmp_path / "out"
    line = refused(rope_quant(_sweep_argv(command, str(gpt2), out), tmp_path, inject=GUARD), command)
    assert "model type 'gpt2' is not supported" in line and str(gpt2) in line, line
    assert not out.exists()


@pytest.mark.parametrize("fault", ["read-only", "disk full"])
@pytest.mark.parametrize("command", SWEEPS)
def test_every_sweep_command_refuses_an_unwritable_out_before_loading(tmp_path: Path, tiny: Path, command: str,
                                                                      fault: str, capsys, monkeypatch) -> None:
    """In process (the CLI's ``main``; a subprocess per case would cost seconds each): the same check for all."""
    import errno
    import tempfile

    from rope_quant import cli
    from rope_quant.sweep.loaded_models import ModelCache

    def no_load(model: str, device: str):
        raise AssertionError("the model was loaded before --out was checked")

    parent = tmp_path / "parent"
    parent.mkdir()
    if fault == "read-only":
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, m, **k: False if Path(p) == parent else real(p, m, **k))
    else:
        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(tempfile, "mkstemp", full)
    out = parent / "out"
    quiet = [] if command == "run" else ["--quiet"]
    code = cli.main([*_sweep_argv(command, str(tiny), out), *quiet], models=ModelCache(no_load))
    err = capsys.readouterr().err
    lines = [s for s in err.splitlines() if s.strip() and not s.startswith("note:")]
    assert code == 2 and len(lines) == 1, err
    assert f"rope-quant {command}: error: --out {out}: " in lines[0], lines[0]
    assert ("is not writable" if fault == "read-only" else "the disk is full (errno ENOSPC)") in lines[0]
    assert not out.exists()


def test_lm_eval_refuses_an_unknown_task_before_loading(tmp_path: Path, tiny: Path) -> None:
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "mine.yaml").write_text(textwrap.dedent(f"""\
        task: my_local_task
        dataset_path: json
        dataset_kwargs:
          data_files: {tasks / 'data.jsonl'}
        output_type: loglikelihood_rolling
        test_split: train
        doc_to_text: ""
        doc_to_target: "{{{{text}}}}"
        metric_list:
          - metric: word_perplexity
        """))
    out = tmp_path / "out"
    argv = [*_sweep_argv("lm-eval", str(tiny), out)[:-2], "--tasks", "my_local_tsk", "--include-path", str(tasks),
            "--only-include-path"]
    line = refused(rope_quant(argv, tmp_path, inject=GUARD), "lm-eval")
    assert "unknown --tasks 'my_local_tsk' (did you mean 'my_local_task'?)" in line, line
    assert not out.exists()


def test_niah_errors_name_the_flags(tmp_path: Path, tiny: Path) -> None:
    out = tmp_path / "out"
    line = refused(rope_quant([*_sweep_argv("niah", str(tiny), out), "--depths", "0,2"], tmp_path, inject=GUARD),
                   "niah")
    assert "--depths must be distinct fractions in [0, 1]" in line, line


@pytest.mark.parametrize("fault", ["read-only", "disk full"])
@pytest.mark.parametrize("command", ["report", "verify", "models"])
def test_the_other_writers_on_a_read_only_or_full_disk(tmp_path: Path, command: str, fault: str, capsys,
                                                       monkeypatch) -> None:
    """report and verify write into the results directory, models --clear-cache deletes the model cache: a
    read-only or full disk there is one line naming the file, exit 2 (in process, faults injected)."""
    import errno
    import shutil

    from rope_quant import cli, io

    code_ = errno.EROFS if fault == "read-only" else errno.ENOSPC
    out = tmp_path / "results"
    assert cli.main(["compare", "--out", str(out), "--configs", "hadamard,identity", "--seeds", "0",
                     "--no-figures", "--quiet"],
                    cell_fn=lambda cfg: {"ppl": 12.0 + (cfg.r3 != "hadamard"), "n_windows": 1, "n_tokens": 10}) == 0
    capsys.readouterr()
    cache = tmp_path / "model-cache"
    (cache / "some-model").mkdir(parents=True)
    monkeypatch.setenv("ROPE_QUANT_MODEL_CACHE", str(cache))
    real = io.atomic_writer

    def failing(path):
        if str(path).startswith(str(out)):
            raise OSError(code_, os.strerror(code_), str(path))
        return real(path)

    def rmtree(path, *args, **kwargs):
        raise OSError(code_, os.strerror(code_), str(path))

    monkeypatch.setattr(io, "atomic_writer", failing)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    argv = {"report": ["report", str(out), "--no-figures"], "verify": ["verify", str(out), "--all"],
            "models": ["models", "--clear-cache"]}[command]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    lines = [s for s in err.splitlines() if s.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"rope-quant {command}: error: ")
    assert ("read-only (errno EROFS)" if fault == "read-only" else "the disk is full (errno ENOSPC)") in lines[0]
    assert str(out if command != "models" else cache) in lines[0], lines[0]


def test_an_export_killed_while_overwriting_puts_the_old_one_back(tmp_path: Path) -> None:
    """Killed between moving the old --out aside and renaming the new one in: the next export's sweep puts the
    old export back (nothing lost) and removes the half-written one; a live writer's directories are kept."""
    from filelock import FileLock

    from rope_quant.export import outdir

    out = tmp_path / "out"
    dead = tmp_path / ".out.tmp-dead"
    (dead / "half").mkdir(parents=True)
    (dead.with_name(dead.name + ".old") / "out").mkdir(parents=True)
    (dead.with_name(dead.name + ".old") / "out" / "model.safetensors").write_text("the old export")
    (tmp_path / ".out.tmp-dead.lock").touch()  # its writer died: nobody holds it
    live = tmp_path / ".out.tmp-live"
    live.mkdir()
    with FileLock(str(tmp_path / ".out.tmp-live.lock")):
        notes = outdir.remove_stale(out)
        assert live.is_dir()
    assert (out / "model.safetensors").read_text() == "the old export"
    assert any("put back" in n for n in notes) and any(".out.tmp-dead" in n for n in notes)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.tmp-live", ".out.tmp-live.lock", "out"]

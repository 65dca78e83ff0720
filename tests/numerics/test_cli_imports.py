"""The CLI package's shape: ``import rope_quant.cli`` and ``rope-quant --help`` load no torch or transformers,
``python -m rope_quant.cli`` works, a command is one registry line, and no CLI module reaches 300 lines."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import rope_quant
from rope_quant import cli

HEAVY = ("torch", "transformers")
PROBE = """
import json, sys
{body}
print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {heavy!r})))
"""


def _heavy_modules(body: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(rope_quant.__file__).parents[1])}
    proc = subprocess.run([sys.executable, "-c", PROBE.format(body=body, heavy=HEAVY)], capture_output=True,
                          text=True, env=env, timeout=120, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_loads_no_torch_or_transformers() -> None:
    assert _heavy_modules("import rope_quant.cli") == []


def test_top_level_help_loads_no_torch_or_transformers() -> None:
    body = ("import contextlib, io\nfrom rope_quant.cli import main\nbuf = io.StringIO()\n"
            "with contextlib.redirect_stdout(buf):\n    assert main(['--help']) == 0\n"
            "assert 'compare' in buf.getvalue() and 'long-context' in buf.getvalue()")
    assert _heavy_modules(body) == []


def test_a_command_parser_does_load_torch_control() -> None:
    """Control for the two tests above: the probe does see torch when a full command parser is built."""
    assert "torch" in _heavy_modules("from rope_quant.cli import build_parser\nbuild_parser()")


def test_python_dash_m_runs_the_cli() -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(rope_quant.__file__).parents[1])}
    proc = subprocess.run([sys.executable, "-m", "rope_quant.cli", "--help"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert all(c.name in proc.stdout for c in cli.COMMANDS)
    proc = subprocess.run([sys.executable, "-m", "rope_quant.cli", "nonsense"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_every_registered_command_has_help_and_a_full_parser() -> None:
    parser = cli.build_parser()
    choices = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert list(choices) == [c.name for c in cli.COMMANDS]
    for cmd in cli.COMMANDS:
        assert cmd.help(), cmd.name
        assert callable(cmd.target(cmd.run)), cmd.name
    # the lazy parser of one command equals the full parser for that command
    for name in ("compare", "report", "run"):
        lazy = cli.build_parser(only=name)._subparsers._group_actions[0].choices[name]  # type: ignore[union-attr]
        full = choices[name]
        assert [a.dest for a in lazy._actions] == [a.dest for a in full._actions]


def test_adding_a_command_is_one_registry_line(tmp_path: Path, monkeypatch, capsys) -> None:
    (tmp_path / "hello_cmd.py").write_text(
        "HELP = 'say hello'\n"
        "def add_parser(sub):\n"
        "    p = sub.add_parser('hello', help=HELP)\n"
        "    p.add_argument('--name', required=True)\n"
        "    return p\n"
        "def run(args):\n"
        "    if args.name == 'bad':\n"
        "        from rope_quant.cli import CLIError\n"
        "        raise CLIError('--name bad is refused')\n"
        "    print(f'hello {args.name}')\n"
        "    return 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "COMMANDS", (*cli.COMMANDS, cli.Command("hello", "hello_cmd")))
    assert cli.main(["hello", "--name", "world"]) == 0
    assert capsys.readouterr().out == "hello world\n"
    assert cli.main(["hello", "--name", "bad"]) == 2
    assert capsys.readouterr().err == "rope-quant hello: error: --name bad is refused\n"
    assert cli.main(["--help"]) == 0
    assert "say hello" in capsys.readouterr().out


def test_no_cli_module_reaches_300_lines() -> None:
    sizes = {p.name: len(p.read_text().splitlines()) for p in Path(cli.__file__).parent.glob("*.py")}
    assert len(sizes) >= 8 and max(sizes.values()) < 300, sizes


def test_legacy_names_stay_importable() -> None:
    from rope_quant.cli import CLIError, build_parser, main, parse_int_list, parse_names, resolve_r1  # noqa: F401
    from rope_quant.sweep import presets

    assert cli.BUDGETS is presets.BUDGETS and cli.LONG_CONTEXT_LENGTHS is presets.LONG_CONTEXT_LENGTHS
    assert cli.DEFAULT_CONFIGS == ("hadamard", "pairwise_only", "pairwise_plus_hadamard", "identity")
    with pytest.raises(AttributeError):
        cli.no_such_name  # noqa: B018
    assert isinstance(build_parser(only="models"), argparse.ArgumentParser)


def test_budget_weight_modes_are_weight_mode_values() -> None:
    from rope_quant.experiment.config import WeightMode
    from rope_quant.sweep.presets import BUDGETS

    assert {b["weights"] for b in BUDGETS.values()} <= {m.value for m in WeightMode}
    assert BUDGETS["cpu"]["weights"] == WeightMode.RTN.value and BUDGETS["cuda"]["weights"] == WeightMode.GPTQ.value


@pytest.mark.parametrize("name", [c.name for c in cli.COMMANDS])
def test_each_command_help_exits_0(name: str, capsys) -> None:
    assert cli.main([name, "--help"]) == 0
    assert f"usage: rope-quant {name}" in capsys.readouterr().out

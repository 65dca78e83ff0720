"""Every flag an error message names exists: the messages of ``rope_quant`` are collected from the source (the
strings of every ``raise``, of every ``…Error(…)`` call, and, in the command modules, every string that is not
a flag definition or a help text), and each ``--flag`` they name is looked up in the ``--help`` of the commands
that can print it: a command module's own commands, the command a message quotes (`` `rope-quant CMD …` ``),
and for the shared modules at least one command.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from rope_quant.cli import COMMANDS, build_parser

PACKAGE = Path(__file__).resolve().parents[2] / "rope_quant"
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
QUOTED = re.compile(r"rope-quant ([a-z-]+)([^`'\"]*)")
#: ``pytest … --rq-flag``: a flag of this project's pytest plugin.
QUOTED_PYTEST = re.compile(r"pytest ([^`'\"]*)")
#: Flags of other programs that messages quote (``pip install --no-deps …``).
FOREIGN = {"--no-deps"}
#: "rerun the sweep command that wrote it with --flag": a flag of the commands that write a results directory.
SWEEPS = ("run", "compare", "support", "estimators", "long-context", "lm-eval", "niah", "static")
#: Modules whose strings are not messages of the command line (the pytest plugin has its own ``--rq-*`` options).
NOT_CLI = {"pytest_plugin.py"}


def help_flags(command: str) -> set[str]:
    parser = build_parser(only=command)
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]  # noqa: SLF001
    return {s for action in sub._actions for s in action.option_strings}  # noqa: SLF001


def plugin_flags() -> set[str]:
    """The options pytest has here: the plugin's (rope_quant/pytest_plugin.py) and the root conftest.py's."""
    trees = [ast.parse(p.read_text()) for p in (PACKAGE / "pytest_plugin.py", PACKAGE.parent / "conftest.py")]
    return {a.value for t in trees for n in ast.walk(t)
            if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "addoption"
            for a in n.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}


FLAGS = {c.name: help_flags(c.name) for c in COMMANDS}
FLAGS["pytest"] = plugin_flags()
ANY = set().union(*FLAGS.values())
MODULE_COMMANDS = {}
for _c in COMMANDS:
    MODULE_COMMANDS.setdefault(_c.module, []).append(_c.name)


def _strings(node: ast.AST) -> Iterator[str]:
    """The literal text inside ``node``: constants and the literal parts of f-strings."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            yield sub.value


def _docstrings(tree: ast.Module) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def _is_definition(node: ast.Call) -> bool:
    """``add_argument(…)`` / ``add_parser(…)`` / ``add_argument_group(…)``: flags defined, not named in a message."""
    name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
    return name.startswith("add_")


def messages(path: Path, command_module: bool) -> Iterator[tuple[int, str]]:
    """(line, text) of every message string in ``path``."""
    tree = ast.parse(path.read_text())
    skip = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _is_definition(node):
            skip.update(id(s) for s in ast.walk(node))
    for node in ast.walk(tree):
        is_error = isinstance(node, ast.Call) and (getattr(node.func, "id", "") or getattr(node.func, "attr", "")
                                                   ).endswith(("Error", "Exception", "Timeout"))
        if isinstance(node, ast.Raise) or is_error or (command_module and isinstance(node, ast.Constant)):
            for sub in ast.walk(node):
                if isinstance(sub, ast.Constant) and isinstance(sub.value, str) and id(sub) not in skip:
                    skip.add(id(sub))  # once, however many enclosing nodes hold it
                    yield sub.lineno, sub.value


def named_flags() -> list[tuple[str, int, str, str, tuple[str, ...]]]:
    """(module, line, flag, text, commands it must exist in (any of them)) for every flag a message names."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name in NOT_CLI:
            continue
        rel = path.relative_to(PACKAGE.parent)
        module = ".".join(rel.with_suffix("").parts)
        own = tuple(MODULE_COMMANDS.get(module, ()))
        for line, text in messages(path, bool(own)):
            rest = text
            for quoted in QUOTED.finditer(text):  # `rope-quant CMD --flag …`: CMD's flags
                cmd, args = quoted.groups()
                if cmd in FLAGS:
                    for flag in FLAG.findall(args):
                        found.append((module, line, flag, text, (cmd,)))
                    rest = rest.replace(quoted.group(0), "")
            for quoted in QUOTED_PYTEST.finditer(rest):  # `pytest … --rq-flag`: the plugin's options
                found.extend((module, line, flag, text, ("pytest",)) for flag in FLAG.findall(quoted.group(1)))
                rest = rest.replace(quoted.group(0), "")
            scope = SWEEPS if "the sweep command" in rest else (own or tuple(FLAGS))
            for flag in FLAG.findall(rest):
                if flag not in FOREIGN:
                    found.append((module, line, flag, text, scope))
    return found


FOUND = named_flags()


def test_the_scan_sees_the_messages() -> None:
    """The collection is not vacuous: known messages are found, with the right scope."""
    by_flag = {(m, f) for m, _, f, _, _ in FOUND}
    assert ("rope_quant.cli.run", "--block") in by_flag
    assert ("rope_quant.export.outdir", "--overwrite") in by_flag
    assert ("rope_quant.cli.export", "--no-r4") in by_flag
    assert any(f == "--no-r4" and cmds == ("run",) for _, _, f, _, cmds in FOUND)  # quoted `rope-quant run --no-r4`
    assert len(FOUND) > 60
    assert "--rq-until-decided" in FLAGS["pytest"] and "--rq-max-seeds" in FLAGS["pytest"]


@pytest.mark.parametrize("module", sorted({m for m, *_ in FOUND}))
def test_every_flag_a_message_names_exists(module: str) -> None:
    missing = [f"{module}:{line}: {flag} (in {'/'.join(cmds) if len(cmds) < 4 else 'any command'}): {text!r}"
               for m, line, flag, text, cmds in FOUND
               if m == module and not any(flag in FLAGS[c] for c in cmds)]
    assert not missing, "\n".join(missing)


def test_a_message_naming_a_flag_that_does_not_exist_is_caught() -> None:
    """The check itself: the refusal that named --no-r4 before any command had it would have failed."""
    without = {c: flags - {"--no-r4", "--r4"} for c, flags in FLAGS.items()}
    stale = [(m, f) for m, _, f, _, cmds in FOUND if f == "--no-r4" and not any(f in without[c] for c in cmds)]
    assert stale

"""The pytest commands the documentation prints, and a driver that collects each of them as printed.

:func:`documented` reads README.md and docs/*.md: every shell line of a fenced block (``bash``, ``sh``, ``shell``
or ``console``) or of an indented code block that runs pytest (``\\`` continuations joined, ``#`` comments
dropped), and every inline code span that runs ``pytest`` (alone, after ``&&``/``;``, or as ``python -m pytest``).
:func:`substituted` replaces what only names a place on the reader's machine: a ``--rq-model`` that is not an
embedded name becomes a tiny checkpoint directory of the same base name, a ``--rq-claims-out`` a scratch directory,
``<files>`` the e2e directory, ``MODULE::TEST`` the module, an upper-case placeholder of a number
(``--rq-time-budget S``) a number; an optional part of a synopsis (``[--rq-model NAME]``) is run included.
Everything else is kept, the spacing of every option included: ``--rq-model /ckpt/X`` with a space still gives
pytest an existing directory as an argument.

``python -m tests._support.docs_commands JSON`` runs each argv of the JSON list (``[[argv...], ...]``) with
``--collect-only -q`` through ``pytest.main`` in this one process, in the current directory (the repository
root), and prints one ``@@rq-docs-command`` line of JSON per command (its index and exit code). One process: the
test modules are imported once, and each later command costs its collection alone.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

#: The marker of a result line of :func:`main`.
RESULT = "@@rq-docs-command "
_SHELL = {"bash", "sh", "shell", "console"}
_FENCE = re.compile(r"^\s*```(\S*)\s*$")
_INLINE = re.compile(r"`(?:python -m )?(pytest(?:\s[^`]*)?)`")
_INDENTED = re.compile(r"^ {4,}(\S+=\S*\s+)*(python -m )?pytest(\s|$)")
_SEPARATORS = {"&&", "||", ";", "|"}
_NUMBER_OPTIONS = {"--rq-time-budget": "60", "--rq-max-seeds": "6", "--rq-replicates": "3"}


@dataclass(frozen=True)
class Command:
    """One documented pytest command: where it is printed (``file:line``), its text, and its argv after ``pytest``."""

    where: str
    text: str
    argv: tuple[str, ...]


def _pytest_argv(text: str) -> list[tuple[str, ...]]:
    """The argv after ``pytest`` of each pytest command in one shell line (environment assignments, ``python -m``
    and wrappers before it dropped)."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    out: list[tuple[str, ...]] = []
    segment: list[str] = []
    for token in [*lexer, ";"]:
        if token not in _SEPARATORS:
            segment.append(token)
            continue
        if "pytest" in segment:
            out.append(tuple(segment[segment.index("pytest") + 1:]))
        segment = []
    return out


def _shell_lines(lines: list[str]) -> list[tuple[int, str]]:
    """(line number, shell line) of every line of a fenced shell block and every indented code line that runs
    pytest, continuations joined."""
    out: list[tuple[int, str]] = []
    language: str | None = None
    pending: tuple[int, str] | None = None
    for number, line in enumerate(lines, 1):
        fence = _FENCE.match(line)
        if fence:
            language = None if language is not None else fence.group(1).lower()
            continue
        shell = language in _SHELL if language is not None else (
            _INDENTED.match(line) is not None or (pending is not None and line.startswith("    ")))
        if not shell:
            continue
        text = line.strip().removeprefix("$ ")
        start, joined = pending if pending else (number, "")
        joined = f"{joined} {text}".strip()
        if joined.endswith("\\"):
            pending = (start, joined[:-1])
            continue
        pending = None
        out.append((start, joined))
    return out


def _inline(lines: list[str]) -> list[tuple[int, str]]:
    """(line number, text) of every inline code span that runs pytest, outside the fenced blocks (a span may
    run over a line break)."""
    kept: list[str] = []
    inside = False
    for line in lines:
        fence = _FENCE.match(line) is not None
        inside = inside != fence
        kept.append("" if inside or fence else line)
    text = "\n".join(kept)
    return [(text.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split())) for m in _INLINE.finditer(text)]


def documented(root: Path) -> list[Command]:
    """Every pytest command of README.md and docs/*.md (module docstring), in file and line order."""
    out: list[Command] = []
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        lines = path.read_text(encoding="utf-8").splitlines()
        found = sorted([*_shell_lines(lines), *_inline(lines)])
        for number, text in found:
            if not re.search(r"(^|[\s;&|])pytest(\s|$)", text):
                continue
            for argv in _pytest_argv(text):
                out.append(Command(f"{path.relative_to(root)}:{number}", text, argv))
    return out


def _placeholder_value(option: str, value: str, ckpt: Path, scratch: Path, embedded: set[str]) -> str:
    if option == "--rq-model":
        if value.lower() in embedded:
            return value
        return str(ckpt / (Path(value.rstrip("/")).name or "model"))
    if option == "--rq-claims-out":
        return str(scratch / (Path(value.rstrip("/")).name or "out"))
    if option in _NUMBER_OPTIONS and not re.fullmatch(r"[0-9.]+", value):
        return _NUMBER_OPTIONS[option]
    return value


def _optional_included(argv: tuple[str, ...]) -> tuple[str, ...]:
    """``argv`` with an optional part of a synopsis (``[--rq-model NAME]``) run included, its brackets dropped."""
    out: list[str] = []
    inside = False
    for token in argv:
        if not inside and token.startswith("[-"):
            token, inside = token[1:], True
        if inside and token.endswith("]"):
            token, inside = token[:-1], False
        out.append(token)
    return tuple(out)


def substituted(argv: tuple[str, ...], ckpt: Path, scratch: Path, embedded: set[str]) -> list[str]:
    """``argv`` with the reader's places replaced (module docstring), its options' spacing kept."""
    out: list[str] = []
    options = {"--rq-model", "--rq-claims-out", *_NUMBER_OPTIONS}
    argv = _optional_included(argv)
    i = 0
    while i < len(argv):
        token = argv[i]
        name, eq, value = token.partition("=")
        if name in options and eq:
            out.append(f"{name}={_placeholder_value(name, value, ckpt, scratch, embedded)}")
        elif token in options and i + 1 < len(argv):
            out += [token, _placeholder_value(token, argv[i + 1], ckpt, scratch, embedded)]
            i += 1
        elif re.fullmatch(r"<[^>]+>", token):
            out.append("tests/e2e")
        elif re.fullmatch(r"\S+\.py::[A-Z_]+", token):  # a test of the reader's choice: its module
            out.append(token.partition("::")[0])
        else:
            out.append(token)
        i += 1
    return out


def models_named(commands: list[list[str]]) -> set[str]:
    """The ``--rq-model`` values of ``commands`` (substituted), both spellings."""
    named: set[str] = set()
    for argv in commands:
        for i, token in enumerate(argv):
            if token.startswith("--rq-model="):
                named.add(token.partition("=")[2])
            elif token == "--rq-model" and i + 1 < len(argv):
                named.add(argv[i + 1])
    return named


def main(argv: list[str]) -> int:
    """Collect each command of the JSON list ``argv[0]`` (module docstring)."""
    import pytest

    for index, args in enumerate(json.loads(argv[0])):
        print(f"@@rq-docs-start {index}", flush=True)
        try:
            code = int(pytest.main([*args, "--collect-only", "-q"]))
        except SystemExit as exc:  # argparse's own exit on an option it cannot parse
            code = int(exc.code or 0)
        print(RESULT + json.dumps({"index": index, "code": code}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

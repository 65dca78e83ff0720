"""Every pytest command the documentation prints works as printed.

Each ``pytest ...`` of README.md and docs/*.md (fenced shell lines and inline code: ``tests/_support/docs_commands.py``)
is collected with ``--collect-only -q`` from the repository root, its reader's places replaced by existing ones (a
checkpoint path by a tiny Llama directory of the same name, an output directory by a scratch one), the spacing of
its options kept. Each must collect (exit 0): not exit 4, the usage error a path-valued ``--rq-*`` option written
with a space gives (pytest takes the existing directory for its rootdir and loses pytest.ini), nor any other. The
commands run in one process, one ``pytest.main`` each, so the test modules are imported once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._support.docs_commands import RESULT, documented, models_named, substituted

pytestmark = pytest.mark.numerics

ROOT = Path(__file__).resolve().parents[2]
#: Each distinct command (its argv after ``pytest``) → where the docs print it.
COMMANDS: dict[tuple[str, ...], list[str]] = {}
for _command in documented(ROOT):
    COMMANDS.setdefault(_command.argv, []).append(_command.where)


def test_the_documentation_prints_pytest_commands() -> None:
    """The extraction finds the commands a reader copies (a guard against a parser that finds none)."""
    assert len(COMMANDS) >= 10
    assert ("-m", "e2e") in COMMANDS and any("gpu_e2e" in argv for argv in COMMANDS)
    assert any(where.startswith("docs/gpu.md:") for wheres in COMMANDS.values() for where in wheres)


@pytest.fixture(scope="module")
def collected(tmp_path_factory) -> dict[tuple[str, ...], tuple[list[str], int, str]]:
    """Each documented command → (the argv run, its exit code, its output), from one process."""
    from rope_quant.model.loading import EMBEDDED_MODELS
    from tests._support.models import tiny_llama

    base = tmp_path_factory.mktemp("docs-commands")
    ckpt, scratch = base / "ckpt", base / "out"
    embedded = {m.lower() for m in EMBEDDED_MODELS}
    runs = {argv: substituted(argv, ckpt, scratch, embedded) for argv in COMMANDS}
    model = tiny_llama()
    for path in models_named(list(runs.values())):
        if path.lower() not in embedded:
            model.save_pretrained(path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    order = list(runs)
    proc = subprocess.run([sys.executable, "-m", "tests._support.docs_commands", json.dumps([runs[a] for a in order])],
                          cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=1800)
    out: dict[tuple[str, ...], tuple[list[str], int, str]] = {}
    chunks = proc.stdout.split("@@rq-docs-start ")[1:]
    for chunk in chunks:
        body, _, tail = chunk.partition(RESULT)
        result = json.loads(tail.splitlines()[0])
        argv = order[result["index"]]
        out[argv] = (runs[argv], result["code"], body.partition("\n")[2][-4000:])
    assert len(out) == len(order), proc.stdout[-4000:]
    return out


@pytest.mark.parametrize("argv", list(COMMANDS), ids=[COMMANDS[a][0] for a in COMMANDS])
def test_a_documented_pytest_command_collects_as_printed(collected, argv: tuple[str, ...]) -> None:
    run, code, output = collected[argv]
    printed = " ".join(["pytest", *argv])
    assert code == 0, (f"`{printed}` (printed at {', '.join(COMMANDS[argv])}; run as pytest {' '.join(run)} "
                       f"--collect-only -q) exits {code}:\n{output}")

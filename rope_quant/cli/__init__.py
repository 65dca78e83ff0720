"""The ``rope-quant`` command line: run cells and sweeps, verify φ*, and report (argparse).

Subcommands::

    rope-quant run           one cell (one R3 config at one seed)
    rope-quant compare       the paper's main comparison (hadamard vs pairwise vs identity ...);
                             ``--configs beyond``: per-head / range-objective / K-only φ* angles;
                             ``--configs lower-bits``: App. F (W4A3KV4, W3A3KV3 against W4A4KV4)
    rope-quant support       mixing support: block size b = 2 ... d_h (K range, relative error, gap)
    rope-quant estimators    rows / k_only / balanced (+ φ* with --phi-star)
    rope-quant long-context  perplexity gap against context length L (crossover)
    rope-quant lm-eval       lm-evaluation-harness tasks on the quantised models (extra ``[eval]``)
    rope-quant niah          needle-in-a-haystack retrieval, RULER format (App. G)
    rope-quant static        the static per-channel control (App. A.6): scopes both/act/kv against dynamic
    rope-quant verify        φ* artefacts of a results directory (App. A.5)
    rope-quant report        tables and figures from a results directory (--check: completion only)
    rope-quant decide        add seeds to a results directory until each claim is decided (sequential rule)
    rope-quant replay        a claims JSON's decisions re-read under another boundary, M or futility level
    rope-quant claims        the paper's claims: their cells and float-order replicates as one sweep, the claims table
    rope-quant models        embedded models and the model cache (--clear-cache empties it)
    rope-quant plan          predicted memory, disk and time per stage, before any weight is read
    rope-quant export        one cell as a deployable checkpoint (hf or compressed-tensors; docs/export.md)

Defaults run on CPU in minutes on the embedded SmolLM2-135M and the ``pydoc`` corpus, with RTN weights (the
CPU budget; ``--weights gptq`` for the paper's GPTQ); with ``--device cuda`` the paper's budgets (seqlen 2048,
128 calibration windows, all evaluation windows, GPTQ) are the defaults. ``--model PATH`` takes a local
Hugging Face checkpoint or a .gguf file.

Tests and embedding code inject what computes the cells: ``main(argv, cell_fn=fn)`` runs every cell
through ``fn(cfg) -> dict`` instead of the pipeline, ``main(argv, models=cache)`` gives the real
pipeline a pre-filled :class:`~rope_quant.sweep.loaded_models.ModelCache`.

Every input that needs no model (names with the closest matches, bits, seeds, output and cache paths, the
corpus text) is checked before the model loads (:mod:`rope_quant.cli.validate`); then
:mod:`rope_quant.sweep.preflight` checks the model's geometry and the corpus against the windows, and the
results directory's ``manifest.json`` (a changed study is refused with a diff unless ``--force-new-manifest``).

Exit codes: 0 success; 1 some cells failed (the first error is printed; or ``report --check`` found incomplete
cells, or φ* was not verified); 2 bad input or an environment fault (usage, names, paths, model, corpus,
geometry, a changed study in ``--out``, a full or read-only disk), one line on stderr; 130 interrupted (rerun
the same command to resume).

Adding a command is one :class:`Command` line in :data:`COMMANDS`: its module has ``add_parser(subparsers)``
and ``run(args)`` (or ``run(args, cells)``). ``import rope_quant.cli`` and ``rope-quant --help`` load no torch:
a command's full parser is built only when that command runs.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rope_quant.cli.args import CLIError, parse_int_list, parse_names, values
from rope_quant.cli.common import (
    DEFAULT_CONFIGS,
    DEFAULT_SEEDS,
    base_config,
    flags_for_fields,
    parse_configs,
    resolve_budget,
    resolve_r1,
    valid_configs,
)
from rope_quant.cli.execute import CellFn, Cells, describe
from rope_quant.cli.validate import check_corpus, check_device, check_model

if TYPE_CHECKING:
    from rope_quant.sweep.loaded_models import ModelCache

__all__ = ["COMMANDS", "CLIError", "Cells", "Command", "DEFAULT_CONFIGS", "DEFAULT_SEEDS", "base_config",
           "build_parser", "check_corpus", "check_device", "check_model", "describe", "main", "parse_configs",
           "parse_int_list", "parse_names", "resolve_budget", "resolve_r1", "valid_configs", "values"]


@dataclass(frozen=True)
class Command:
    """One subcommand: ``module.add(subparsers)`` builds its parser, ``module.run(args[, cells])`` runs it;
    the module imports no torch at import time (its ``HELP`` feeds ``rope-quant --help``)."""

    name: str
    module: str
    add: str = "add_parser"
    run: str = "run"

    def target(self, attr: str) -> Any:
        return getattr(importlib.import_module(self.module), attr)

    def help(self) -> str:
        """The module's ``HELP`` (a string, or a dict by command name for a module of several commands)."""
        text = getattr(importlib.import_module(self.module), "HELP", "")
        return str(text.get(self.name, "") if isinstance(text, dict) else text)


#: The registry of subcommands, in ``--help`` order: adding a command is one line here.
COMMANDS: tuple[Command, ...] = (
    Command("run", "rope_quant.cli.run"),
    Command("compare", "rope_quant.cli.compare"),
    Command("support", "rope_quant.cli.compare", add="add_support_parser", run="run_support"),
    Command("estimators", "rope_quant.cli.compare", add="add_estimators_parser", run="run_estimators"),
    Command("long-context", "rope_quant.cli.long_context"),
    Command("lm-eval", "rope_quant.cli.lm_eval"),
    Command("niah", "rope_quant.cli.niah"),
    Command("static", "rope_quant.cli.static"),
    Command("verify", "rope_quant.cli.report", add="add_verify_parser", run="run_verify"),
    Command("models", "rope_quant.cli.models"),
    Command("report", "rope_quant.cli.report"),
    Command("decide", "rope_quant.cli.decide"),
    Command("replay", "rope_quant.cli.replay"),
    Command("claims", "rope_quant.cli.claims"),
    Command("export", "rope_quant.cli.export"),
    Command("plan", "rope_quant.cli.plan"),
)


def _command(name: str) -> Command:
    return next(c for c in COMMANDS if c.name == name)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``rope-quant`` parser. ``only``: build that command's full parser and a help-only stub for the
    others (no torch for ``--help``); default every command in full."""
    parser = argparse.ArgumentParser(
        prog="rope-quant",
        description="RoPE-commuting vs Hadamard R3 rotations in W4A4KV4 rotation-based PTQ.",
        epilog="Defaults: CPU budget (RTN weights, seqlen 512, 4+4 windows) on SmolLM2-135M and pydoc; "
               "`rope-quant COMMAND --help` for a command's flags.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for cmd in COMMANDS:
        if only is None or cmd.name == only:
            cmd.target(cmd.add)(sub)
        else:
            sub.add_parser(cmd.name, help=cmd.help())
    return parser


def _chosen(argv: Sequence[str]) -> str:
    """The subcommand named in ``argv`` (the first word that is not an option), or "" for none."""
    names = {c.name for c in COMMANDS}
    word = next((a for a in argv if not a.startswith("-")), "")
    return word if word in names else ""


def main(argv: Sequence[str] | None = None, *, cell_fn: CellFn | None = None,
         models: ModelCache | None = None) -> int:
    """Entry point of the ``rope-quant`` console script; returns the exit code.

    ``cell_fn(cfg) -> dict`` replaces the pipeline for every cell (tests); ``models`` is the base-model
    cache of the real pipeline (default: the process-wide one).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(only=_chosen(argv))
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0)
    return _dispatch(_command(args.command), args, Cells(cell_fn=cell_fn, models=models))


def _dispatch(cmd: Command, args: argparse.Namespace, cells: Cells) -> int:
    """Run ``cmd``, mapping bad input and environment faults to exit 2 with one line on stderr."""
    from rope_quant.experiment.config import PipelineError
    from rope_quant.sweep.manifest import SweepError
    from rope_quant.sweep.preflight import ENVIRONMENT_ERRNOS, environment_fault

    run = cmd.target(cmd.run)
    try:
        return int(run(args, cells) if len(inspect.signature(run).parameters) > 1 else run(args))
    except PipelineError as exc:  # a setting RunConfig refuses: name the flag, not the field
        print(f"rope-quant {args.command}: error: {flags_for_fields(str(exc))}", file=sys.stderr)
        return 2
    except (CLIError, SweepError, FileNotFoundError) as exc:
        print(f"rope-quant {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        if exc.errno not in ENVIRONMENT_ERRNOS:
            raise
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"rope-quant {args.command}: error: {environment_fault(exc)}{where}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"rope-quant {args.command}: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130


_LEGACY = {"BUDGETS", "BUDGET_FIELDS", "BUDGET_MINIMUM", "LONG_CONTEXT_LENGTHS", "BEYOND"}


def __getattr__(name: str) -> Any:
    """Budget tables, re-exported from :mod:`rope_quant.sweep.presets` on first use (they import torch)."""
    if name in _LEGACY:
        from rope_quant.sweep import presets

        return getattr(presets, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

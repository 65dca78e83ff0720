"""Parsing helpers of the ``rope-quant`` CLI (standard library only: ``import rope_quant.cli`` loads no torch).

Names are checked against their registry with the closest matches suggested (``difflib``); seeds use the one
grammar of :mod:`rope_quant.seeds`.
"""

from __future__ import annotations

import difflib
import enum
from collections.abc import Sequence

from rope_quant.seeds import SeedSpecError, parse_seeds


class CLIError(ValueError):
    """Bad command-line input (exit code 2)."""


def flag(field: str) -> str:
    """``whip_epochs`` -> ``--whip-epochs``: errors name the flag a user typed, not the attribute."""
    return "--" + field.replace("_", "-")


def did_you_mean(name: str, valid: Sequence[str]) -> str:
    """``" (did you mean 'hadamard'?)"`` for the closest valid names (empty when none is close; a name equal but for
    its case first)."""
    same = [v for v in valid if v.lower() == name.lower()]
    close = list(dict.fromkeys(same + difflib.get_close_matches(name, list(valid), n=3, cutoff=0.6)))[:3]
    return f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""


def unknown_name(what: str, name: str, valid: Sequence[str]) -> CLIError:
    """The error for an unknown ``what`` (config, model, corpus, preset ...): closest matches, then every name."""
    return CLIError(f"unknown {what} {name!r}{did_you_mean(name, valid)}; valid: {', '.join(valid)}")


def parse_int_list(text: str, what: str, *, minimum: int | None = None) -> tuple[int, ...]:
    """``"0,1,2"`` -> ``(0, 1, 2)``; distinct integers, at least one."""
    items = [s.strip() for s in str(text).split(",")]
    if not text or not all(items):
        raise CLIError(f"{what} must be a comma-separated list of integers like 0,1,2, got {text!r}")
    try:
        values = tuple(int(s) for s in items)
    except ValueError:
        raise CLIError(
            f"{what} must be a comma-separated list of integers like 0,1,2, got {text!r}"
        ) from None
    if len(set(values)) != len(values):
        raise CLIError(f"{what} has repeated values: {text!r}")
    if minimum is not None and any(v < minimum for v in values):
        raise CLIError(f"{what} values must be >= {minimum}, got {text!r}")
    return values


def parse_seed_list(text: str, what: str = "--seeds") -> tuple[int, ...]:
    """``--seeds`` in :func:`rope_quant.seeds.parse_seeds`'s grammar (``0,1,2``, ``0-9``, ``0-4,7``)."""
    try:
        return parse_seeds(text)
    except SeedSpecError as exc:
        raise CLIError(f"{what}: {exc}") from None


def values(enum_cls: type[enum.Enum]) -> tuple[str, ...]:
    """The values of a ``StrEnum``: the argparse choices and valid names of a flag."""
    return tuple(str(member.value) for member in enum_cls)


def parse_names(text: str, what: str, valid: Sequence[str]) -> tuple[str, ...]:
    """Comma-separated names, each in ``valid`` (the error suggests the closest and lists the valid names)."""
    names = tuple(s.strip() for s in str(text).split(",") if s.strip())
    if not names:
        raise CLIError(f"{what} is empty")
    if len(set(names)) != len(names):
        raise CLIError(f"{what} has repeated names: {text!r}")
    unknown = [n for n in names if n not in valid]
    if unknown:
        hints = "".join(did_you_mean(n, valid) for n in unknown)
        raise CLIError(f"unknown {what} {', '.join(map(repr, unknown))}{hints}; valid: {', '.join(valid)}")
    return names


def check_name(name: str, what: str, valid: Sequence[str]) -> str:
    """One name in ``valid`` (``--comparator``, ``--transform`` ...), else exit 2 with the closest matches."""
    if name not in valid:
        raise unknown_name(what, name, valid)
    return name

"""Seed lists as users type them: ``0,1,2``, ``0-9`` or a mix such as ``0-4,7``.

Standard library only: the CLI (``--seeds``) and the pytest plugin (``--rq-seeds``) parse with the same
function, so both accept the same forms and refuse the same mistakes before anything expensive runs.
"""

from __future__ import annotations

import re

SEED_LIMIT = 2**63
"""Seeds must satisfy ``0 <= seed < 2**63`` (``torch.manual_seed`` and numpy's generators take that range)."""

FORMS = "comma-separated integers and inclusive ranges, e.g. 0,1,2 or 0-9 or 0-4,7 (each 0 <= seed < 2**63)"

_ITEM = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


class SeedSpecError(ValueError):
    """A seed list that is empty, malformed, out of range or repeats a seed; the message lists the forms."""


def parse_seeds(text: str | None) -> tuple[int, ...]:
    """``"0-2,5"`` -> ``(0, 1, 2, 5)``: distinct seeds in the order given, ranges inclusive and ascending.

    Raises :class:`SeedSpecError` for an empty list, a malformed item, a descending range, a seed outside
    ``[0, 2**63)`` or a repeated seed.
    """
    if text is None or not str(text).strip():
        raise SeedSpecError(f"the seed list is empty; expected {FORMS}")
    seeds: list[int] = []
    for raw in str(text).split(","):
        match = _ITEM.match(raw)
        if match is None:
            raise SeedSpecError(f"malformed seed item {raw.strip()!r} in {text!r}; expected {FORMS}")
        low = int(match.group(1))
        high = int(match.group(2)) if match.group(2) is not None else low
        if high < low:
            raise SeedSpecError(f"the range {raw.strip()!r} in {text!r} is empty (it descends); expected {FORMS}")
        if high >= SEED_LIMIT:
            raise SeedSpecError(f"seed {high} in {text!r} is out of range; expected {FORMS}")
        if high - low >= 100_000:
            raise SeedSpecError(f"the range {raw.strip()!r} holds {high - low + 1} seeds; at most 100000 at once")
        seeds.extend(range(low, high + 1))
    repeated = sorted({s for s in seeds if seeds.count(s) > 1})
    if repeated:
        raise SeedSpecError(f"repeated seeds {repeated} in {text!r}; expected {FORMS}")
    return tuple(seeds)

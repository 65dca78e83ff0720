"""Equal bits per key element: a claim that compares key quantisers compares cells that store the same bits.

A key cache of T tokens and head_dim d costs each cell's key quantiser ``bits_per_element(d, T)`` bits per element
(payload, every scale and zero point at 16 bits, full-precision tokens at 16 bits: docs/key_quantizers.md). A
perplexity window is read query by query: the query at position t reads the cache as it stood at length t + 1
(a streaming group quantiser, KIVI's or KVQuant's, still holds its open group in 16 bits there). So two cells are
at equal bits when they store the same bits at T **and** the same bits averaged over the window's query–key pairs
(:func:`attended`); KVQuant at T against the per-token rule is equal at T only, and is compared with the per-token
rule on its own complete groups instead (claims/keys.py).

A claim with ``equal_bits`` (registry.py) is checked twice: from the cells' configs alone, before any model loads
(:func:`check_equal_bits`, run by :func:`rope_quant.claims.premises.adapt`), and on the bits each cell measured
after its calibration (``k_bits_per_element`` of the cell result: rope_pair_bits' allocated widths) by the engine
(:func:`check_measured_bits`). Either raises :class:`~rope_quant.claims.registry.ClaimError` naming the cells and
their bits. A claim whose cells quantise under :data:`MIN_ATTENDED_SHARE` of the keys their queries read tests
almost no quantisation; :func:`too_few_quantised` says so, with the T that would test it.

The config is read through ``rope_quant.experiment.config`` (imported when a check runs, never at import).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rope_quant.claims.registry import Claim, ClaimError, Override, describe, overrides_of, side_cells

TOLERANCE = 1e-9
"""Two cells store equal bits when their bits per element differ by at most this (float rounding of the counts)."""
MIN_ATTENDED_SHARE = 0.25
"""A cell whose key quantiser quantises under this share of the query–key pairs of a window tests almost none of
it (KIVI with G = R = 256 at T = 512: 0.2%); such a claim is not run at that T."""


def _option(cell: Mapping[str, Override]) -> Any:
    from rope_quant.experiment.config import PipelineError, RunConfig

    try:
        return RunConfig.from_flat(**overrides_of(cell)).quant.key_option()
    except (PipelineError, ValueError) as exc:
        raise ClaimError(f"cell {{{describe(cell)}}}: its key quantiser cannot be read: {exc}") from None


def head_dim_refusal(cell: Mapping[str, Override], head_dim: int) -> str:
    """Why the key quantiser of ``cell`` (flat config overrides, resolved) cannot run at ``head_dim``, from its
    config alone (rope_pair_bits: integer widths in [min, max] that cannot average its target there); "" when it
    can."""
    try:
        check = getattr(_option(cell), "check_head_dim", None)
        if check is not None:
            check(int(head_dim))
    except ClaimError as exc:
        return str(exc)
    except ValueError as exc:
        return f"cell {{{describe(cell)}}}: {exc}"
    return ""


def key_bits(cell: Mapping[str, Override], head_dim: int, seq_len: int) -> float:
    """Bits per key element that ``cell`` (flat config overrides, resolved) stores at head_dim and T = ``seq_len``,
    from its config alone (rope_pair_bits before calibration: its bound, every width in [min, max] used)."""
    try:
        return float(_option(cell).bits_per_element(int(head_dim), int(seq_len)))
    except ValueError as exc:
        raise ClaimError(f"cell {{{describe(cell)}}}: {exc}") from None


def attended(cell: Mapping[str, Override], head_dim: int, seq_len: int) -> tuple[float, float]:
    """(bits, share) over the query–key pairs of a window of T = ``seq_len`` tokens, the query at position t
    reading the cache at length t + 1: the mean bits per key element it reads, and the share of those keys that are
    quantised."""
    option, t = _option(cell), int(seq_len)
    pairs = t * (t + 1) / 2
    try:
        bits = sum(float(option.bits_per_element(int(head_dim), n)) * n for n in range(1, t + 1)) / pairs
    except ValueError as exc:
        raise ClaimError(f"cell {{{describe(cell)}}}: {exc}") from None
    return bits, sum(option.quantized_tokens(n) for n in range(1, t + 1)) / pairs


def compared_cells(claim: Claim) -> list[tuple[str, tuple[str, ...]]]:
    """(part name, the cells it compares) for every part that compares cells (sampled or not)."""
    out = []
    for part in claim.parts:
        names = tuple(dict.fromkeys([*side_cells(part.treatment), *side_cells(part.control)]))
        if len(names) > 1:
            out.append((part.name, names))
    return out


def check_equal_bits(claim: Claim, head_dim: int, seq_len: int) -> dict[str, float]:
    """Cell name → bits per key element at (head_dim, T) for a claim with ``equal_bits``; :class:`ClaimError`
    naming the part, its cells and their bits where a part compares cells of unequal bits, stored at T or read by
    the window's queries (:func:`attended`)."""
    bits = {name: key_bits(claim.cells[name], head_dim, seq_len) for name in claim.cell_names()}
    _compare(claim, lambda name: [bits[name]], f"at head_dim {head_dim}, T = {seq_len} (from the configs)")
    read = {name: attended(claim.cells[name], head_dim, seq_len)[0] for name in claim.cell_names()}
    _compare(claim, lambda name: [read[name]], f"averaged over the query–key pairs of a window of T = {seq_len} "
                                                f"at head_dim {head_dim} (from the configs)")
    return bits


def too_few_quantised(claim: Claim, head_dim: int, seq_len: int, longest: int = 1 << 16) -> str:
    """Why ``claim`` tests almost no key quantisation at T = ``seq_len`` (a cell quantising under
    :data:`MIN_ATTENDED_SHARE` of its window's query–key pairs), with the shortest T up to ``longest`` (a power of
    two) at which it would not; "" when every cell quantises enough."""
    shares = {name: attended(claim.cells[name], head_dim, seq_len)[1] for name in claim.cell_names()}
    low = {n: v for n, v in shares.items() if v < MIN_ATTENDED_SHARE}
    if not low:
        return ""
    t = int(seq_len)

    def enough(length: int) -> bool:
        return all(attended(claim.cells[n], head_dim, length)[1] >= MIN_ATTENDED_SHARE for n in low)

    while t < longest and not enough(t):
        t *= 2
    need = f"T = {t}" if enough(t) else f"more than T = {longest}"
    shown = "; ".join(f"{n} {{{describe(claim.cells[n])}}}: {v:.1%}" for n, v in low.items())
    return (f"at T = {seq_len} and head_dim {head_dim} its key quantiser quantises under {MIN_ATTENDED_SHARE:.0%} "
            f"of the keys the window's queries read ({shown}): the claim would compare nearly unquantised caches; "
            f"it needs evaluation windows of {need}")


def check_measured_bits(claim: Claim, measured: Callable[[str], Sequence[float] | None]) -> None:
    """The engine's check after calibration: ``measured(cell name)`` gives the cell's ``k_bits_per_element`` per
    seed (None where the store has none); the cells of a part that all carry it must agree at every seed."""
    got = {name: measured(name) for name in claim.cell_names()}
    known = {name: list(v) for name, v in got.items() if v is not None}
    _compare(claim, lambda name: known.get(name), "as measured by the cells (after calibration)")


def _compare(claim: Claim, bits_of: Callable[[str], Sequence[float] | None], where: str) -> None:
    for part_name, names in compared_cells(claim):
        values = {n: bits_of(n) for n in names}
        present = {n: list(v) for n, v in values.items() if v is not None}
        if len(present) < 2:
            continue
        first = next(iter(present.values()))
        if any(len(v) != len(first) or any(not math.isclose(a, b, rel_tol=0.0, abs_tol=TOLERANCE)
                                           for a, b in zip(v, first, strict=False))
               for v in present.values()):
            shown = "; ".join(f"{n} {{{describe(claim.cells[n])}}}: {_fmt(v)}" for n, v in present.items())
            raise ClaimError(f"claim {claim.id}, part {part_name!r}: its cells do not store equal bits per key "
                             f"element {where}: {shown}")


def _fmt(values: Sequence[float]) -> str:
    distinct = sorted(set(round(float(v), 9) for v in values))
    return " / ".join(f"{v:.6g}" for v in distinct) + " bits"


__all__ = ["MIN_ATTENDED_SHARE", "TOLERANCE", "attended", "check_equal_bits", "check_measured_bits", "compared_cells",
           "head_dim_refusal", "key_bits", "too_few_quantised"]

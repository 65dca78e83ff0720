"""The seed-list grammar shared by ``--seeds`` and ``--rq-seeds`` (rope_quant.seeds)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rope_quant.seeds import SEED_LIMIT, SeedSpecError, parse_seeds


@pytest.mark.parametrize(("text", "expected"), [
    ("0", (0,)), ("0,1,2", (0, 1, 2)), ("0-9", tuple(range(10))), ("0-4,7", (0, 1, 2, 3, 4, 7)),
    (" 3 - 5 , 9 ", (3, 4, 5, 9)), ("7-7", (7,)), (str(SEED_LIMIT - 1), (SEED_LIMIT - 1,)),
])
def test_accepted_forms(text: str, expected: tuple[int, ...]) -> None:
    assert parse_seeds(text) == expected


@pytest.mark.parametrize(("text", "fragment"), [
    ("", "empty"), ("  ", "empty"), (None, "empty"), ("a", "malformed"), ("1,,2", "malformed"),
    ("-1", "malformed"), ("5-3", "descends"), ("99999999999999999999", "out of range"),
    ("1,1", "repeated"), ("0-3,2", "repeated"), ("0-999999", "at most"),
])
def test_refused_forms_name_the_problem_and_the_accepted_forms(text: str | None, fragment: str) -> None:
    with pytest.raises(SeedSpecError, match=fragment) as info:
        parse_seeds(text)
    assert "0-9" in str(info.value) or "at most" in str(info.value)


@given(st.lists(st.integers(0, SEED_LIMIT - 1), min_size=1, max_size=8, unique=True))
def test_a_plain_list_round_trips(seeds: list[int]) -> None:
    assert parse_seeds(",".join(map(str, seeds))) == tuple(seeds)


@given(st.integers(0, 10**6), st.integers(0, 50))
def test_a_range_is_inclusive(low: int, width: int) -> None:
    assert parse_seeds(f"{low}-{low + width}") == tuple(range(low, low + width + 1))

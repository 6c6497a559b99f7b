"""Reading a user's history list (stream/history.py): the whole-list parse of long clean lists gives exactly what the
entry-by-entry definition gives, and every list it cannot vouch for goes the entry-by-entry way."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stream.history import _WELL_FORMED, _parse, _parse_each, _parse_well_formed, _well_formed

INT64 = 2**63


def entry(ts: int, item: int) -> bytes:
    return f"{ts}:{item}".encode()


def clean_list(rng: random.Random, n: int) -> list[bytes]:
    # newest appended first; click times out of order and repeated (late clicks, several partitions)
    return [entry(978_300_760_000 + rng.randrange(50), rng.randrange(-INT64, INT64)) for _ in range(n)]


@pytest.mark.parametrize("seed", range(40))
def test_a_long_clean_list_parses_as_the_entry_by_entry_definition(seed: int) -> None:
    rng = random.Random(seed)
    entries = clean_list(rng, rng.randrange(16, 201))
    entries = list(dict.fromkeys(entries))  # distinct: a repeated click is the other path's job
    if len(entries) < 16:
        entries += [entry(1, k) for k in range(16)]
    assert _parse_well_formed(entries) is not None
    assert _parse(entries) == _parse_each(entries)


@pytest.mark.parametrize("odd", [
    b"not an entry", b"12", b"1:2:3", b":5", b"5:", b" 5:6", b"+5:6", b"5:6 ", b"1_0:5", b"5:-",
    b"9223372036854775808:1",  # a click time past int64
    b"1:9223372036854775808", b"1:-9223372036854775809",  # items past int64 either way
    b"1:9223372036854775807", b"1:-9223372036854775808",  # int64's own ends (where a saturating parse lands)
    b"1:2\n3:4",  # a newline inside one entry
])
def test_a_list_with_an_odd_entry_parses_entry_by_entry(odd: bytes) -> None:
    entries = clean_list(random.Random(7), 40)
    entries.insert(13, odd)
    assert _parse_well_formed(entries) is None
    assert _parse(entries) == _parse_each(entries)


def test_a_click_appended_twice_and_str_entries_go_entry_by_entry() -> None:
    entries = list(dict.fromkeys(clean_list(random.Random(3), 40)))
    twice = entries + [entries[5]]
    assert _parse_well_formed(twice) is None
    assert _parse(twice) == _parse_each(twice) and len(_parse(twice)[0]) == len(entries)
    as_text: list[bytes | str] = [e.decode() for e in entries]
    assert _parse_well_formed(as_text) is None and _parse(as_text) == _parse_each(entries)


# The batch read's check of a batch's joined entries (numpy passes) against the regex it stands for.
_piece = st.one_of(st.integers(0, 10**25).map(lambda n: str(n).encode()), st.sampled_from([b":", b"\n", b"-", b":-",
                                                                                           b"", b"a", b" ", b"+"]))


@given(st.lists(_piece, max_size=12).map(b"".join))
@settings(max_examples=2000, deadline=None)
def test_the_numpy_check_of_joined_entries_is_the_regex(joined: bytes) -> None:
    assert _well_formed(joined) == (_WELL_FORMED.fullmatch(joined) is not None)


@given(st.lists(st.tuples(st.integers(0, 10**20), st.integers(-(10**20), 10**20)), min_size=1, max_size=6))
@settings(max_examples=500, deadline=None)
def test_the_numpy_check_takes_what_the_regex_takes(pairs: list[tuple[int, int]]) -> None:
    joined = b"\n".join(f"{t}:{i}".encode() for t, i in pairs)
    assert _well_formed(joined) == (_WELL_FORMED.fullmatch(joined) is not None)

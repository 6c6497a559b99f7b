"""stream/history.py: the whole-batch as-of read gives each sample what the per-user definition gives it."""

from __future__ import annotations

from bisect import bisect_left

from hypothesis import given, settings
from hypothesis import strategies as st

from stream.history import _as_of_columns, _parse

entry = st.one_of(
    st.builds(lambda t, i: f"{t}:{i}".encode(), st.integers(0, 50), st.integers(-3, 3)),  # few values: duplicates
    st.builds(lambda t, i: f"{t}:{i}".encode(), st.integers(0, 2**42), st.integers(-(2**63) + 1, 2**63 - 2)),
    st.sampled_from([b"x:1", b"1:", b"!wrongtype", "5:6", b"99999999999999999999:1"]),  # odd ones
)


def per_user(users: list[int], times: list[int], distinct: list[int], lists: list[list], max_len: int) -> list:
    parsed = {u: _parse(e) for u, e in zip(distinct, lists, strict=True)}
    out = []
    for u, ts in zip(users, times, strict=True):
        click_times, items = parsed[u]
        n = bisect_left(click_times, ts)
        out.append(items[max(0, n - max_len):n])
    return out


@given(st.lists(st.lists(entry, max_size=8), min_size=1, max_size=6), st.data(), st.integers(1, 5))
@settings(max_examples=300, deadline=None)
def test_the_batch_read_agrees_with_the_per_user_definition_or_declines(lists: list, data: st.DataObject,
                                                                         max_len: int) -> None:
    distinct = list(range(100, 100 + len(lists)))
    n = data.draw(st.integers(0, 20))
    users = data.draw(st.lists(st.sampled_from(distinct), min_size=n, max_size=n))
    times = data.draw(st.lists(st.integers(0, 60), min_size=n, max_size=n))
    got = _as_of_columns(users, times, distinct, lists, max_len)
    if got is not None:
        assert got == per_user(users, times, distinct, lists, max_len)


def test_a_clean_batch_is_read_as_columns_and_limited_to_max_len() -> None:
    lists = [[b"30:7", b"10:5", b"20:6"], [], [b"5:1", b"5:2"]]  # newest appended first
    users, times = [100, 100, 101, 102, 100], [25, 31, 99, 6, 10]
    got = _as_of_columns(users, times, [100, 101, 102], lists, 2)
    assert got == [[5, 6], [6, 7], [], [2, 1], []]  # equal click times: append order (oldest appended first)
    assert got == per_user(users, times, [100, 101, 102], lists, 2)


def test_a_click_stored_twice_goes_the_per_user_way() -> None:
    assert _as_of_columns([1], [99], [1], [[b"3:4", b"2:9", b"3:4"]], 5) is None

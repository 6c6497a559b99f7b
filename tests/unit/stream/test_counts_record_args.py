"""``stream.counts.DailyCounts.record`` counts and names by columns (np.unique per day, set lookups for the names
already sent): its script calls count and name what a ``Counter`` of (day, member) pairs gives, the rule as it was
written before, for any mix of days, repeats, names, ids too large for a uint64 and string ids. The order of the
pairs within a call is not compared (each member once in a call: its place changes nothing in Redis)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from stream.counts import DailyCounts
from stream.counts_keys import DAY_MS, day_str

NOW_MS = 1_700_000_000_000


def _pairs(calls: list[tuple[str, list[Any]]]) -> dict[str, tuple[int, set[tuple[Any, Any]], set[tuple[Any, Any]]]]:
    """Each script call (by its names key: one per day) as n, its (count, member) pairs and its (member, name) pairs."""
    out = {}
    for key, args in calls:
        n, rest = args[0], args[1:]
        out[key] = (n, set(zip(rest[0:2 * n:2], rest[1:2 * n:2], strict=True)),
                    set(zip(rest[2 * n::2], rest[2 * n + 1::2], strict=True)))
    assert len(out) == len(calls)
    return out


def _expected(counts: DailyCounts, kind: str, ids: list[Any], ts: list[int], names: dict[Any, Any],
              named: dict[str, set[str]]) -> list[tuple[str, list[Any]]]:
    """Per day's script call, its names key and its arguments after the marker: n, (count, member) pairs, then
    (member, name) pairs of members not named before (``named``, updated)."""
    days = Counter(zip([t // DAY_MS for t in ts], [str(i) for i in ids], strict=True))
    by_text = {str(k): str(v) for k, v in names.items()}
    out: dict[int, tuple[list[Any], list[str]]] = {}
    for (d, member), n in days.items():
        pairs, sent = out.setdefault(d, ([], []))
        pairs.extend((n, member))
        done = named.setdefault(counts.names_key(kind, day_str(d)), set())
        if member not in done and member in by_text:
            sent.extend((member, by_text[member]))
            done.add(member)
    return [(counts.names_key(kind, day_str(d)), [len(pairs) // 2, *pairs, *sent]) for d, (pairs, sent) in out.items()]


def _calls(counts: DailyCounts) -> list[tuple[str, list[Any]]]:
    """The script calls of :meth:`DailyCounts.record` from here on, recorded instead of sent (each names key there)."""
    seen: list[tuple[str, list[Any]]] = []

    def write(kind: str, calls: list[tuple[list[str], list[Any]]]) -> list[int]:
        seen.extend((keys[1], args[2:]) for keys, args in calls)
        return [1] * len(calls)

    counts._write = write  # type: ignore[method-assign]
    return seen


ids_of = st.one_of(
    st.lists(st.integers(0, 40), min_size=1, max_size=60),
    st.lists(st.sampled_from([0, 7, 2**63, 2**64 - 1, 2**64, 2**70]), min_size=1, max_size=30),
    st.lists(st.one_of(st.integers(0, 9), st.sampled_from(["a", "b", "7", "zz"])), min_size=1, max_size=40),
)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_record_sends_the_counts_and_names_a_counter_of_day_member_pairs_gives(data: st.DataObject) -> None:
    counts = DailyCounts(object(), future_s=1e12)  # type: ignore[arg-type]
    calls = _calls(counts)
    named: dict[str, set[str]] = {}
    for _ in range(data.draw(st.integers(1, 3))):  # later writes skip the names the earlier ones sent
        ids = data.draw(ids_of)
        ts = data.draw(st.lists(st.integers(NOW_MS - 3 * DAY_MS, NOW_MS), min_size=len(ids), max_size=len(ids)))
        names = {i: i for i in data.draw(st.lists(st.sampled_from(ids))) if not isinstance(i, int) or i < 2**64}
        del calls[:]
        counts.record("item", "impression", ids, ts, names=names, write_id="w")
        assert _pairs(calls) == _pairs(_expected(counts, "item", ids, ts, names, named))


def test_record_names_a_uint64_column_as_the_hashes_were_given() -> None:
    counts = DailyCounts(object())  # type: ignore[arg-type]
    calls = _calls(counts)
    hashes = np.array([2**64 - 1, 5, 2**64 - 1], dtype=np.uint64)
    counts.record("user", "click", hashes, [NOW_MS] * 3, names={2**64 - 1: "max", 5: 5})
    assert _pairs(calls) == {counts.names_key("user", day_str(NOW_MS // DAY_MS)):
                             (2, {(2, str(2**64 - 1)), (1, "5")}, {(str(2**64 - 1), "max"), ("5", "5")})}

"""The hot set's members come from Redis sorted sets any client with write access can add to: a member that is not a
stable hash's text (``stream/ids.py``: ASCII digits, below 2**63) is left out of the hot set and counted, never a
failed nightly refresh. ``"99999999999999999999"`` (an int64 overflow) and ``"²"`` (``isdigit`` but not ``int``) failed
stage hot_set every night while they were among the top ids; the refresh published nothing."""

from __future__ import annotations

import numpy as np
import pytest

from cache_refresh.hot_set import NAME_MAX_CHARS, hot_rows, member_hashes, named_rows, ranked_ids, top_ids
from learner.features import default_config

HOSTILE = ["99999999999999999999", "9223372036854775808", "\u00b2", "\u0661\u0662", "-3", "+4", " 5", "u1", "", "1e3"]


def test_members_that_are_no_stable_hash_are_counted_and_left_out() -> None:
    hashed, skipped = member_hashes(["5", *HOSTILE, "9223372036854775807", "0"])
    assert hashed.tolist() == [5, 9223372036854775807, 0]
    assert skipped == len(HOSTILE)


def test_hostile_members_among_the_top_ids_leave_the_hot_rows_of_the_others() -> None:
    cfg = default_config({}, buckets=1000)
    assert np.array_equal(hot_rows(cfg, "item", ["5", *HOSTILE, "7"]), hot_rows(cfg, "item", ["5", "7"]))


class RankedCounts:
    """A ``DailyCounts`` stand-in for the hot set's reads: one day, ``rows`` (member, count) highest first; records
    each ``top`` call's k."""

    def __init__(self, rows: list[tuple[str, float]]) -> None:
        self.rows = rows
        self.asked: list[int] = []

    def days_available(self, kind: str, event: str) -> list[str]:
        return ["20000101"]

    def top(self, kind: str, event: str = "impression", day: str | None = None, days: int = 1, k: int = 10,
            ) -> list[tuple[str, float]]:
        self.asked.append(k)
        return self.rows[:k]

    def day_counts(self, kind: str, event: str, members: list[str], day: str, days: int = 1,
                   at_most: float | None = None) -> dict[str, list[float]]:
        return {}  # one key: its counts are top's


def test_rejected_members_give_their_top_k_places_to_valid_ids_below_the_cut(caplog: pytest.LogCaptureFixture) -> None:
    counts = RankedCounts([("u1", 100.0), ("5", 90.0), ("\u00b2", 80.0), ("7", 70.0), ("9", 60.0), ("11", 50.0)])
    top, day, filled = ranked_ids(counts, "item", "impression", "impression", 1, 3)  # type: ignore[arg-type]
    assert [m for m, _ in top] == ["5", "7", "9"] and day == "20000101" and filled == 0
    assert "2 of the top item ids" in caplog.text  # the warning and its count stay


def test_fewer_valid_ids_than_k_are_all_taken_and_the_ranking_stops_at_the_members_end() -> None:
    counts = RankedCounts([("u1", 9.0), ("5", 8.0), ("-3", 7.0), ("7", 6.0)])
    top, _ = top_ids(counts, "item", "impression", 1, 5)  # type: ignore[arg-type]
    assert [m for m, _ in top] == ["5", "7"] and counts.asked == [5]


def test_a_head_of_rejected_members_is_read_past_in_logarithmically_many_reads() -> None:
    counts = RankedCounts([(f"u{i}", 1e6 - i) for i in range(10_000)] + [("5", 1.0), ("7", 0.5)])
    top, _ = top_ids(counts, "item", "impression", 1, 2)  # type: ignore[arg-type]
    assert [m for m, _ in top] == ["5", "7"]
    assert len(counts.asked) <= 15 and counts.asked[-1] <= 2 * len(counts.rows)


def test_a_hash_text_with_leading_zeros_is_no_stable_hash_and_takes_no_place_of_another_id() -> None:
    # the joiner and serving write str(int): "007" is another client's; taken as 7, it and "7" were one row counted
    # as two ids, and the hot set held k - 1 distinct rows
    hashed, skipped = member_hashes(["7", "007", "00", "0"])
    assert hashed.tolist() == [7, 0] and skipped == 2
    counts = RankedCounts([("7", 100.0), ("007", 90.0), ("9", 80.0), ("11", 70.0)])
    top, _ = top_ids(counts, "item", "impression", 1, 3)  # type: ignore[arg-type]
    assert [m for m, _ in top] == ["7", "9", "11"]


class NamedCounts:
    """A ``DailyCounts`` stand-in for ``named_rows``: ``names`` as Redis holds them."""

    def __init__(self, names: dict[str, str]) -> None:
        self._names = names

    def names(self, kind: str, members: list[str], day: str, days: int = 1) -> dict[str, str]:
        return {m: self._names[m] for m in members if m in self._names}


def test_a_name_too_long_for_a_raw_id_is_shown_by_hash_and_keeps_the_manifest_loadable(
        caplog: pytest.LogCaptureFixture) -> None:
    # a 1 MB name (HSET by another client) of each top id went into the manifest's hot_set: 20 of them were more than
    # a manifest's 16 MB, the staged artifact "is corrupt" and every nightly run failed at stage validate
    huge = "x" * (1 << 20)
    counts = NamedCounts({"5": huge, "7": "item-7"})
    rows = named_rows(counts, "item", [("5", 9.0), ("7", 8.0)], "20000101", 1)  # type: ignore[arg-type]
    assert rows == [{"name": None, "hash": "5", "count": 9}, {"name": "item-7", "count": 8}]
    assert "longer than" in caplog.text
    ok = "y" * NAME_MAX_CHARS  # the longest name shown as it is
    assert named_rows(NamedCounts({"5": ok}), "item", [("5", 1.0)], "20000101", 1)[0]["name"] == ok  # type: ignore[arg-type]

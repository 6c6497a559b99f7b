"""stream.alignment: event-time alignment of inputs read together (Flink's watermark alignment)."""

from __future__ import annotations

from stream.alignment import UNREAD, align, lead


def all_behind(key: str) -> bool:
    return True


def test_the_lead_is_over_the_slowest_other_input_with_more_to_read() -> None:
    times = {"a": 100, "b": 300, "c": 50}
    assert lead("b", times, all_behind) == 250
    assert lead("b", times, lambda k: k != "c") == 200  # c is read to the end: it holds nobody back
    assert lead("c", times, all_behind) == -50


def test_an_unread_input_with_more_to_read_is_an_unbounded_lead_for_the_others() -> None:
    assert lead("a", {"a": 100, "b": None}, all_behind) == UNREAD
    assert lead("b", {"a": 100, "b": None}, all_behind) is None  # the unread one itself is never paused


def test_align_pauses_the_leaders_and_never_the_slowest_input_with_more_to_read() -> None:
    pause, resume = align({"a": 0, "b": 100_000, "c": 200_000}, set(), all_behind, 60_000)
    assert (pause, resume) == ({"b", "c"}, set())


def test_align_resumes_under_half_the_drift_or_when_no_other_has_more_to_read() -> None:
    assert align({"a": 75_000, "b": 100_000}, {"b"}, all_behind, 60_000) == (set(), {"b"})
    assert align({"a": 60_000, "b": 100_000}, {"b"}, all_behind, 60_000) == (set(), set())  # 40 s > 30 s
    assert align({"a": 0, "b": 100_000}, {"b"}, lambda k: k == "b", 60_000) == (set(), {"b"})
    assert align({"a": 0}, {"b"}, all_behind, 60_000) == (set(), {"b"})  # b no longer read

"""Reading a dead letter's headers back (stream/dlq.py, ``DeadLetter.from_headers``): a dead-letter topic takes
records from any producer, so any header list reads to a dead letter or to a ValueError that says why; never a
KeyError or IndexError, and never a dead letter whose source headers were cut at a count it does not hold."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from stream.dlq import DeadLetter
from stream.errors import BadMessage
from tests.unit.stream.test_dlq_sizing import _dead_letters

OURS = ["dlq.reason", "dlq.kind", "dlq.source.topic", "dlq.source.partition", "dlq.source.offset",
        "dlq.headers_dropped", "dlq.value_truncated_from", "dlq.key_truncated_from", "dlq.original_headers"]


def _written(original: list[tuple[str, bytes | None]]) -> list[tuple[str, bytes | None]]:
    dl, producer, kafka = _dead_letters()
    dl.send(kafka.impressions_topic, b"k", b"v", BadMessage("not JSON", kind="bad_json"), 3, 7, original)
    return producer.sent[0][3]


def _mutated(draw: st.DrawFn) -> list[tuple[str, bytes | None]]:
    """Headers DeadLetters wrote, then one header dropped, duplicated, renamed or given another value."""
    original = draw(st.lists(st.tuples(st.sampled_from(["trace", *OURS]), st.none() | st.binary(max_size=4)),
                             max_size=3))
    hs = list(_written(original))
    i = draw(st.integers(0, len(hs) - 1))
    op = draw(st.sampled_from(["drop", "dup", "name", "value"]))
    if op == "drop":
        del hs[i]
    elif op == "dup":
        hs.insert(draw(st.integers(0, len(hs))), hs[i])
    elif op == "name":
        hs[i] = (draw(st.sampled_from(OURS) | st.text(max_size=6)), hs[i][1])
    else:
        hs[i] = (hs[i][0], draw(st.none() | st.binary(max_size=6) | st.sampled_from(
            [b"-1", b"-3", b"99", b" 1", b"1_0", "\u0663".encode(), b"9" * 5000, b"1e3", b"\xff"])))
    return hs


headers_st = st.one_of(st.composite(_mutated)(), st.lists(st.tuples(st.sampled_from(OURS) | st.text(max_size=6),
                                                                    st.none() | st.binary(max_size=6)), max_size=8))


@example([("dlq.original_headers", b"5")])  # a count past the headers there: KeyError
@example([("dlq.original_headers", b"-1")])  # a negative count read the source headers from the end
@example([])
@given(headers_st)
@settings(max_examples=200, deadline=None, database=None)
def test_any_headers_read_to_a_dead_letter_or_a_value_error_saying_why(headers: list[tuple[str, bytes | None]]
                                                                        ) -> None:
    try:
        letter = DeadLetter.from_headers(headers)
    except ValueError as exc:
        assert str(exc).strip()
        return
    n = len(letter.original_headers)
    assert list(letter.original_headers) == headers[:n]  # the source headers are a prefix, ours follow
    if headers and headers[-1][0] == "dlq.original_headers":  # else written before the count: ours only
        assert headers[-1][1] == str(n).encode()
    else:
        assert n == 0


@pytest.mark.parametrize("original", [[], [("trace", b"1"), ("dlq.reason", b"theirs")]])
def test_headers_a_dead_letter_was_written_with_read_back_to_it(original: list[tuple[str, bytes | None]]) -> None:
    letter = DeadLetter.from_headers(_written(original))
    assert (letter.reason, letter.kind, letter.source_partition, letter.source_offset) == ("not JSON", "bad_json", 3, 7)
    assert list(letter.original_headers) == original


def test_dead_letters_that_never_reached_their_topic_are_not_duplicates_by_coordinates() -> None:
    """The README's rule, a DLQ reader de-duplicates on ``dlq.source.topic``/``partition``/``offset``, took every
    dead letter with offset -1 for one record: a replay's rows (partition -1) and the joiner's too-large samples of
    one partition (partition p) share their coordinates, and all but one were dropped as repeats. Only a consumed
    record's coordinates (offset >= 0) name it; a dead letter with offset -1 has none to match."""
    dl, producer, kafka = _dead_letters()
    replay_rows = [(b"{bad", -1, -1), (b"{worse", -1, -1)]  # stream/replay/publisher.py: never reached the topic
    too_large = [(b"sample-a", 0, -1), (b"sample-b", 0, -1)]  # the joiner's _too_large: partition known, no offset
    consumed = [(b"{x", 2, 9), (b"{x", 2, 9)]  # one consumed record dead-lettered twice (a restart, a rebalance)
    for value, partition, offset in replay_rows + too_large + consumed:
        dl.send(kafka.impressions_topic, b"k", value, BadMessage("bad", kind="bad_json"), partition, offset)
    letters = [(value, DeadLetter.from_headers(headers)) for _, value, _, headers in producer.sent]
    seen: set[tuple[str, int, int]] = set()
    kept = []
    for value, letter in letters:
        key = letter.source_coordinates
        if key is None or key not in seen:
            kept.append(value)
        if key is not None:
            seen.add(key)
    assert kept == [b"{bad", b"{worse", b"sample-a", b"sample-b", b"{x"]

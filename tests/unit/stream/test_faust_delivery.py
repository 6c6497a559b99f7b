"""The faust driver's batch delivery (stream/joiner/faust_delivery.py): the offset bookkeeping it does for a whole
fetch at once is the bookkeeping faust's per-message loop does (the integration side: tests/integration/
test_faust_delivery.py)."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st

from stream.joiner.faust_delivery import _gaps


def faust_drain_gaps(read: int | None, offsets: list[int]) -> list[tuple[int, int]]:
    """faust's ``Consumer._drain_messages``, the gap part: what it passes to ``_add_gap`` message by message."""
    out = []
    for offset in offsets:
        if read is None or offset >= read:
            gap = offset - (read or 0)
            if gap > 1 and read:
                out.append((read + 1, offset))
            read = offset
    return out


@given(st.one_of(st.none(), st.integers(0, 50)), st.lists(st.integers(1, 5), min_size=1, max_size=30),
       st.integers(0, 60))
def test_a_fetch_records_the_gaps_faust_records_one_message_at_a_time(read: int | None, steps: list[int],
                                                                       start: int) -> None:
    # offsets ascending, at or past the read offset (what reaches _gaps after the read-offset filter)
    first = max(start, read or 0)
    offsets = [first + sum(steps[:i]) for i in range(len(steps))]
    recs = [SimpleNamespace(offset=o) for o in offsets]
    assert _gaps(read, offsets[0], offsets[-1], len(offsets), recs) == faust_drain_gaps(read, offsets)


def test_a_contiguous_fetch_after_its_read_offset_has_no_gap_and_one_after_a_hole_has_one() -> None:
    recs = [SimpleNamespace(offset=o) for o in range(10, 15)]
    assert _gaps(9, 10, 14, 5, recs) == []
    assert _gaps(6, 10, 14, 5, recs) == [(7, 10)]  # 7..9 are not in the log (markers, compaction)
    assert _gaps(None, 10, 14, 5, recs) == []  # nothing read yet: faust counts no gap either

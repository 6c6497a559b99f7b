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


def test_a_partition_starting_past_the_brokers_reported_high_watermark_moves_back_once_per_generation() -> None:
    """Tansu reports the start of a partition's last record batch + 1 as its high watermark, and a fetch from inside
    that batch returns nothing: a start at or past it moves back to it - 1 (once per generation and partition)."""
    import asyncio
    import logging

    from faust.types import TP

    from stream.joiner.faust_delivery import BatchConsumer

    stuck, fine, unknown, fed = (TP("impressions", p) for p in range(4))
    highs = {stuck: 10, fine: 10, fed: 3}
    seeks: list[tuple[TP, int]] = []

    def highwater(tp: TP) -> int:
        if tp not in highs:
            raise KeyError(tp)  # not fetched yet
        return highs[tp]

    async def seek(tp: TP, offset: int) -> None:
        seeks.append((tp, offset))

    starts = {stuck: 12, fine: 6, unknown: 50, fed: 7}  # faust's read offsets after its seek to the committed ones
    fake = SimpleNamespace(_resumed=set(), _resumed_generation=-1, _read_offset=starts,
                           _get_active_partitions=lambda: [stuck, fine, unknown, fed], highwater=highwater, seek=seek,
                           log=logging.getLogger("test"))
    resume = BatchConsumer._resume_safely
    asyncio.run(resume(fake, 1, {fed: [object()]}))  # type: ignore[arg-type]  # fed brought records: not checked
    assert seeks == [(stuck, 9)]
    highs[unknown] = 40  # fetched now: checked once its high watermark is known
    asyncio.run(resume(fake, 1, {}))  # type: ignore[arg-type]
    assert seeks == [(stuck, 9), (unknown, 39)]
    asyncio.run(resume(fake, 1, {}))  # type: ignore[arg-type]  # the same generation: once
    assert len(seeks) == 2
    asyncio.run(resume(fake, 2, {}))  # type: ignore[arg-type]  # a rebalance: every partition's start again
    assert seeks[2:] == [(stuck, 9), (unknown, 39), (fed, 2)]

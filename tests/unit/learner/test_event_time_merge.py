"""EventTimeMerge: the learner hands the samples partitions on in event-time order, whatever the fetch order."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from learner.kafka_dataset import EventTimeMerge
from stream.samples import SampleBatch


@dataclass
class Msg:  # the three calls the merge makes on a confluent_kafka.Message
    part: int
    payload: bytes | None
    err: object = None

    def partition(self) -> int:
        return self.part

    def error(self) -> object:
        return self.err

    def value(self) -> bytes | None:
        return self.payload


def msg(part: int, *ts: int) -> Msg:
    n = len(ts)
    sb = SampleBatch.from_columns(impression_id=[f"{part}-{t}" for t in ts], ts=np.array(ts), label=np.zeros(n),
                                  label_delay_ms=np.zeros(n), user_id=np.zeros(n), item_id=np.zeros(n),
                                  history=[[] for _ in range(n)])
    return Msg(part, sb.encode())


def first_ts(out: list) -> list[int]:
    return [int(sb.batch.column("ts")[0].as_py()) for _, sb in out]


def all_behind(p: int) -> bool:
    return True


def test_a_partitions_chunk_waits_for_the_others_and_goes_out_interleaved_oldest_first() -> None:
    merge = EventTimeMerge([0, 1])
    for t in (10, 20, 30, 40):  # partition 0's backlog arrives first, in one chunk
        merge.add(msg(0, t))
    assert merge.take(all_behind) == []  # partition 1 has more to read and nothing buffered: it may be older
    merge.add(msg(1, 5))
    merge.add(msg(1, 25))
    assert first_ts(merge.take(all_behind)) == [5, 10, 20, 25]  # then 1 is empty again: wait
    assert first_ts(merge.take(lambda p: p == 0)) == [30, 40]  # 1 is read to the end: holds nobody back


def test_a_full_buffer_pauses_its_partition_and_half_empty_resumes_it() -> None:
    merge = EventTimeMerge([0, 1], capacity=4)
    for t in range(4):
        merge.add(msg(0, t))
    assert merge.flow() == ({0}, set())
    merge.add(msg(1, 100))
    assert first_ts(merge.take(all_behind)) == [0, 1, 2, 3]
    assert merge.flow() == (set(), {0})


def test_an_idle_partition_holds_nobody_back_after_the_idle_timeout() -> None:
    merge = EventTimeMerge([0, 1], idle_s=0.0)
    merge.add(msg(0, 10))
    assert first_ts(merge.take(all_behind)) == [10]  # 1 sent nothing within idle_s: its lag is not believed


def test_an_undecodable_message_and_an_error_go_on_at_once() -> None:
    merge = EventTimeMerge([0, 1])
    bad, eof = Msg(0, b"not arrow"), Msg(1, None, err="partition eof")
    merge.add(bad)
    merge.add(eof)
    out = merge.take(all_behind)
    assert [m for m, _ in out] == [bad, eof] and all(sb is None for _, sb in out)
    assert merge.empty()


def test_a_message_that_starts_with_a_delayed_positive_goes_at_its_click_not_at_its_impression() -> None:
    # p0's message went out at 1_000 + 900 (a click 900 ms after its impression); p1's at 1_500. Keyed by the
    # impression time, p0's would go first and be trained before p1's impression at 1_500 is predicted.
    n = 1
    late = SampleBatch.from_columns(impression_id=["0-a"], ts=np.array([1_000]), label=np.ones(n),
                                    label_delay_ms=np.array([900]), user_id=np.zeros(n), item_id=np.zeros(n),
                                    history=[[]], kind=np.array([2]))
    merge = EventTimeMerge([0, 1])
    merge.add(Msg(0, late.encode()))
    merge.add(msg(1, 1_500))
    assert [m.partition() for m, _ in merge.take(lambda p: False)] == [1, 0]


def test_a_partition_paused_or_draining_longer_than_the_idle_timeout_is_not_idle_when_its_buffer_runs_out() -> None:
    # Partition 1 was held for a full buffer (or sat on buffered messages) for longer than idle_s; when its
    # buffer runs out it is refetching, not quiet: partition 0 must not run ahead of it meanwhile.
    merge = EventTimeMerge([0, 1], capacity=2, idle_s=0.2)
    merge.add(msg(1, 1))
    merge.add(msg(1, 2))
    merge.flow()  # 1 paused
    time.sleep(0.3)  # longer than idle_s, all of it paused with messages buffered
    merge.add(msg(0, 10))
    merge.add(msg(0, 20))
    assert first_ts(merge.take(all_behind)) == [1, 2]  # then 1's buffer is empty: 0 waits for it
    assert merge.flow() == ({0}, {1})  # the reader resumes 1 (it refetches) and pauses 0 (full)
    assert first_ts(merge.take(all_behind)) == []
    time.sleep(0.3)  # now 1 has really sent nothing for idle_s
    assert first_ts(merge.take(all_behind)) == [10, 20]


def test_the_idle_clock_starts_with_the_first_message_not_with_the_merge() -> None:
    merge = EventTimeMerge([0, 1], idle_s=0.2)
    time.sleep(0.3)  # the consumer's start: nobody has sent anything yet
    merge.add(msg(0, 10))
    assert merge.take(all_behind) == []  # 1 has not been quiet for idle_s since data began to flow


def test_a_message_without_a_time_waits_behind_its_partitions_buffered_messages() -> None:
    """A message to be dead-lettered (undecodable) used to go on at once, ahead of its partition's buffered
    messages: the daemon then counted the partition as read past them, and a restart skipped them."""
    merge = EventTimeMerge([0, 1])
    merge.add(msg(0, 10))
    merge.add(msg(0, 20))
    bad = Msg(0, b"not arrow")
    merge.add(bad)
    merge.add(msg(0, 30))
    assert merge.take(all_behind) == []  # partition 1 may be older: nothing of partition 0 goes, not even `bad`
    merge.add(msg(1, 25))
    out = merge.take(lambda p: p == 0)
    assert [m.partition() for m, _ in out] == [0, 0, 0, 1, 0]
    assert out[2][0] is bad and out[2][1] is None  # right behind 0's 10 and 20, with 20's time
    assert first_ts([o for o in out if o[1] is not None]) == [10, 20, 25, 30]


def test_a_message_without_a_time_goes_at_once_when_its_partition_has_nothing_buffered() -> None:
    merge = EventTimeMerge([0, 1])
    merge.add(msg(1, 5))
    bad = Msg(0, b"not arrow")
    merge.add(bad)
    out = merge.take(all_behind)
    assert [m for m, _ in out] == [bad]  # nothing of partition 0 is ahead of it; partition 1's 5 waits for 0


def test_a_stall_is_no_quiet_time_and_a_partition_with_more_to_read_still_holds_the_others_back(
        monkeypatch) -> None:
    """A learner stopped past idle_s (SIGSTOP, a long GC pause) woke with every partition quiet by the wall clock:
    partition 0, its messages fetched first, ran ahead of partition 1's older ones, still unfetched."""
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    merge = EventTimeMerge([0, 1], idle_s=2.0)
    merge.add(msg(1, 1))
    assert first_ts(merge.take(lambda p: False)) == [1]  # both read to the end for now
    clock[0] += 0.2
    merge.add(msg(0, 10))
    clock[0] += 12.0  # stopped for 12 s; 1's next, older messages arrived meanwhile, not fetched yet
    assert merge.take(all_behind) == []
    polls, out = 0, []
    while not out:  # then 2 s of polls without a message from 1: now it is quiet
        clock[0] += 0.2
        polls += 1
        out = merge.take(all_behind)
    # 1 was last seen 0.2 s before the stall, which counted as one poll of 0.2 s: 1.6 s of polls were left
    assert first_ts(out) == [10] and 7 <= polls <= 9


def test_a_partition_added_while_merging_is_merged_in_event_time_and_holds_the_others_back(monkeypatch) -> None:
    """A samples partition added while the learner reads (``add_partition``) is merged like the ones it started with.
    Unknown to the merge, its messages went on at once, unordered, and it held nobody back: the others ran ahead of
    its older samples. Its idle clock starts when it is added, not with the merge's first message long before (which
    would have made it quiet, holding nobody back, before its first fetch came)."""
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    merge = EventTimeMerge([0], idle_s=2.0)
    merge.add(msg(0, 10))
    assert first_ts(merge.take(all_behind)) == [10]
    clock[0] += 60.0  # a minute of polls later (each well under a stall)
    for _ in range(300):
        merge.take(lambda p: False)
        clock[0] += 0.2
    merge.add(msg(0, 20))
    merge.add(msg(0, 30))
    merge.add_partition(1)
    assert merge.take(all_behind) == []  # 1 has more to read and nothing buffered: its next message may be older
    merge.add(msg(1, 5))
    merge.add(msg(1, 25))
    assert first_ts(merge.take(all_behind)) == [5, 20, 25]  # then 1 is empty again: wait
    assert first_ts(merge.take(lambda p: p == 0)) == [30]
    merge.add_partition(1)  # added again (a second report of the same growth): nothing changes
    assert merge.empty() and set(merge.buffers) == {0, 1}

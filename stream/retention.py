"""Input lost to retention: a consumer's saved offset below its partition's log start offset, said and counted.

A consumer that was down longer than an input topic's retention (or whose records an operator removed with
DeleteRecords) resumes at a saved offset below the partition's low watermark (its first record still held).
librdkafka then resets it to the earliest offset (``auto.offset.reset``) without an error: the records between the
saved offset and the low watermark are gone for that consumer, and nothing in streamrec said so (aiokafka, under the
joiner's faust driver, does the same with ``auto_offset_reset``). Every consumer that resumes from saved offsets (the
joiner's kafka driver and ``EventReader`` through ``stream.kafka.resume_offsets``, the joiner's faust driver at the
committed offsets faust seeks to after each assignment, ``stream.joiner.faust_delivery.BatchConsumer``, the
learner's ``KafkaSampleDataset`` at its checkpoint's offsets) passes its start
offsets through :func:`account_for_retention` first: it starts such a partition at the low watermark, logs one
ERROR line per partition (the reader, the topic, the partition, the range lost, the likely cause and what to do)
and counts the records lost in ``streamrec_input_lost_to_retention_total{reader, topic}``. The low watermark is
reliable on every broker (unlike the local broker's high watermark, ``stream.kafka.resume_offsets``); a start
offset that is no saved offset (``OFFSET_BEGINNING`` and the other logical offsets, all negative) loses nothing.

A reader can also fall behind retention while it runs (a slow learner whose lag grows past the topic's
``retention.ms``): its fetch gets OFFSET_OUT_OF_RANGE and librdkafka resets it to the earliest offset, again without
a word. :class:`Gaps` finds that from what the reader reads: per partition, the next offset expected; a message past
it is a gap, and only on a gap is the broker asked for the partition's low watermark (gaps come without any loss too:
transaction control records, compaction). The records between the offset expected and the low watermark (or the
message, if it comes first) are lost: the same ERROR line and counter as at a start (:func:`_said`). The learner's
``KafkaSampleDataset`` checks each message as fetched (O(1) a message); the joiner's kafka driver each batch, in C
(``Gaps.batch``: each partition's last offset against the one expected and the batch's length); the joiner's faust
driver each fetch (aiokafka resets it the same way, with ``auto_offset_reset``: ``BatchConsumer._records`` notes a
partition's jump past the offset it expects, its read offset + 1 or the offset it sought, and only then asks the
broker, ``earliest_offsets``), all through :func:`lost_in_gap`. Not covered: a gap without loss found only after
retention moved past it (the low watermark is asked at the gap, not at the fetch, so control records just before it
would be counted lost: the readers ask right after the fetch to keep that short).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass

from confluent_kafka import Consumer, KafkaException, TopicPartition

from stream.errors import quoted
from stream.metrics import INPUT_LOST

log = logging.getLogger("streamrec.retention")


@dataclass(frozen=True, slots=True)
class Lost:
    """The records ``[saved, low)`` of ``topic``/``partition``, gone before ``reader`` read them."""

    reader: str
    topic: str
    partition: int
    saved: int
    low: int

    @property
    def records(self) -> int:
        return self.low - self.saved


def account_for_retention(reader: str, starts: Sequence[TopicPartition], lows: Mapping[tuple[str, int], int],
                          ) -> tuple[list[TopicPartition], list[Lost]]:
    """The offsets ``reader`` should start ``starts`` at, and what it lost: a start offset below its partition's low
    watermark (``lows``, keyed by (topic, partition); a partition not in it is not checked) becomes that low
    watermark, each such partition logged as one ERROR line and its records lost counted (module docstring)."""
    out: list[TopicPartition] = []
    lost: list[Lost] = []
    for tp in starts:
        low = lows.get((tp.topic, tp.partition))
        if low is None or tp.offset < 0 or tp.offset >= low:
            out.append(tp)
            continue
        gone = Lost(reader, tp.topic, tp.partition, tp.offset, low)
        out.append(TopicPartition(tp.topic, tp.partition, low))
        if _said(gone, f"its saved offset {gone.saved} is below the partition's first offset {low}",
                 "the topic's retention (retention.ms / retention.bytes) is shorter than this reader's downtime", low):
            lost.append(gone)
    return out, lost


# (reader, topic, partition) -> the offset ranges [start, end) of the losses this process said, merged, ascending: a
# loss found while the reader ran is below the group's committed offset until something past it is committed, and a
# rewind, a re-seek or a rebalance before that said and counted it again (the reviews). A range, not its end: records
# fetched before the jump but dropped unprocessed (a rebalance) and deleted since are a loss of their own.
_SAID: dict[tuple[str, str, int], list[tuple[int, int]]] = {}


def _unsaid(key: tuple[str, str, int], start: int, end: int) -> int:
    """How many of the offsets ``[start, end)`` no loss this process said covers."""
    covered = sum(max(0, min(end, hi) - max(start, lo)) for lo, hi in _SAID.get(key, ()))
    return max(0, end - start - covered)


def _remember(key: tuple[str, str, int], start: int, end: int) -> None:
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted([*_SAID.get(key, ()), (start, end)]):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    _SAID[key] = merged


def past_said(reader: str, topic: str, partition: int, offset: int) -> int:
    """``offset``, or the end of the loss this process said that holds it: where a reader re-seeking to a saved offset
    inside a loss it said goes on from, without asking the broker again."""
    for lo, hi in _SAID.get((reader, topic, partition), ()):
        if lo <= offset < hi:
            return hi
    return offset


def _said(gone: Lost, how: str, cause: str, goes_on: int) -> int:
    """The ERROR line and the count of ``gone``, the one definition of both for a reader's start and its run: ``how``
    it was found, its likely ``cause`` besides DeleteRecords, and the offset the reader ``goes_on`` from. Only what
    this process has not said before counts (:data:`_SAID`); nothing new: nothing said. Returns the records counted."""
    key = (gone.reader, gone.topic, gone.partition)
    new = _unsaid(key, gone.saved, gone.low)
    _remember(key, gone.saved, gone.low)
    if not new:
        return 0
    INPUT_LOST.labels(gone.reader, gone.topic).inc(new)
    before = "" if new == gone.records else f", {gone.records - new} of them said before"
    log.error("%s: %d record(s) of %s partition %d, offsets %d..%d%s, were deleted before it read them (%s): %s, or "
              "someone ran DeleteRecords. It goes on from offset %d. Raise the topic's retention above the longest "
              "downtime or lag you expect and alert on this reader's lag", gone.reader, new, gone.topic,
              gone.partition, gone.saved, gone.low - 1, before, how, cause, goes_on)
    return new


def starting_after_retention(consumer: Consumer, reader: str, starts: Sequence[TopicPartition],
                             timeout_s: float = 10.0) -> Generator[None, None, list[TopicPartition]]:
    """:func:`account_for_retention` of ``starts`` with the low watermarks ``consumer`` asks the broker for, for a
    reader that starts at offsets of its own (the learner's checkpoint) rather than through
    ``stream.kafka.resume_offsets``; returned when the generator ends. A broker that cannot say is logged as a WARNING
    naming what was not checked, and ``starts`` are used as they are: the reader's own fetches report a broker that
    stays away. It yields after each partition's answer: each broker call is bounded by ``timeout_s``, all of them are
    not (one per partition), and a reader on a slow broker shows its progress between them
    (``learner/kafka_dataset.py``: a DataLoader worker's heartbeat, so that ``learner/worker_stall.py`` does not take a
    start on a slow broker for a hung worker)."""
    lows: dict[tuple[str, int], int] = {}
    try:
        for tp in starts:
            if tp.offset >= 0:
                lows[(tp.topic, tp.partition)] = consumer.get_watermark_offsets(
                    TopicPartition(tp.topic, tp.partition), timeout=timeout_s)[0]
                yield
    except KafkaException as exc:
        not_checked(reader, [(tp.topic, tp.partition) for tp in starts], exc)
        return list(starts)
    return account_for_retention(reader, starts, lows)[0]


def not_checked(reader: str, partitions: Iterable[tuple[str, int]], exc: BaseException,
                before: str = "its start offsets") -> None:
    """The WARNING of a reader whose broker could not give the low watermarks of ``partitions``: it starts (or goes
    on) where it would have, unchecked (its own fetches report a broker that stays away)."""
    log.warning("%s: could not read the first offsets of %s (%s): whether records before %s were deleted unread "
                "(retention, DeleteRecords) is not checked this time", reader, sorted(partitions),
                quoted(str(exc) or type(exc).__name__), before)


class Gaps:
    """Records deleted under a running ``reader`` (one that fell behind retention while it ran): each partition's next
    offset expected (the last message's offset + 1, or its start), and a message past it is a gap. librdkafka's
    fetch got OFFSET_OUT_OF_RANGE and reset the partition to its earliest offset without a word; a gap also comes
    without any loss (transaction control records, a compacted topic), so only on a gap (never per message in the
    normal case) is the broker asked for the partition's low watermark: the records ``[expected, min(low, offset))``
    are lost, said and counted as a start's are (:func:`_said`). A broker that cannot answer: one WARNING that the gap
    was not checked (:func:`not_checked`). An offset below the one expected (a seek back, a rewind) is no gap: the
    expectation starts over from it."""

    def __init__(self, consumer: Consumer, reader: str, timeout_s: float = 5.0) -> None:
        self.consumer, self.reader, self.timeout_s = consumer, reader, timeout_s
        self.next: dict[tuple[str, int], int] = {}  # (topic, partition) -> the next offset expected

    def expect(self, starts: Iterable[TopicPartition]) -> None:
        """The reader (re)starts these partitions at their offsets; a logical offset (negative): whatever comes."""
        for tp in starts:
            if tp.offset >= 0:
                self.next[(tp.topic, tp.partition)] = tp.offset
            else:
                self.next.pop((tp.topic, tp.partition), None)

    def forget(self, partitions: Iterable[tuple[str, int]]) -> None:
        """No expectation for ``partitions`` (revoked, or at a position not known): their next message starts one."""
        for key in partitions:
            self.next.pop(key, None)

    def message(self, topic: str, partition: int, offset: int) -> Lost | None:
        """One message read (O(1) unless it is past the offset expected): what was lost before it, if anything."""
        key = (topic, partition)
        expected = self.next.get(key)
        self.next[key] = offset + 1
        if expected is None or offset <= expected:
            return None
        return self._check(topic, partition, expected, offset)

    def batch(self, topics: Sequence[str], partitions: Sequence[int], offsets: Sequence[int]) -> list[Lost]:
        """The messages of one batch, as columns in the order read: what was lost before or among them. One C-level
        pass over the columns (each partition's last offset, ~60 ns a message): when every partition has an offset
        expected and the spans from there to their last offsets add up to the batch's length, no partition has a gap
        (a partition's offsets only grow from the one expected: the reader says where it seeks, :meth:`expect`).
        Only otherwise are the offsets of the partitions that do not add up looked at one by one."""
        if not offsets:
            return []
        # the keys' tuples are not kept: zip hands its tuple back once the dict found the key in it (no garbage per
        # message for the collector; a list of them cost ~4 young collections a batch)
        last = dict(zip(zip(topics, partitions, strict=True), offsets, strict=True))
        nxt = self.next
        spans = [o - nxt[k] + 1 if k in nxt else -1 for k, o in last.items()]
        # each partition starting where expected too: a partition gone back (a reset to an earlier offset) has less
        # span than messages, which could cancel another's gap in the sum (the review's masked loss)
        first = dict(zip(zip(reversed(topics), reversed(partitions), strict=True), reversed(offsets), strict=True))
        if -1 not in spans and sum(spans) == len(offsets) and all(first[k] == nxt[k] for k in last):
            nxt.update({k: o + 1 for k, o in last.items()})
            return []
        lost: list[Lost] = []  # look closer (rare): every message of the partitions without an offset expected or
        # whose span is not their count
        keys = list(zip(topics, partitions, strict=True))
        counts = Counter(keys)
        closer = {k for k, span in zip(last, spans, strict=True) if span != counts[k] or first[k] != nxt.get(k)}
        for k, offset in zip(keys, offsets, strict=True):
            if k in closer:
                if (gone := self.message(k[0], k[1], offset)) is not None:
                    lost.append(gone)
            else:
                nxt[k] = offset + 1
        return lost

    def _check(self, topic: str, partition: int, expected: int, offset: int) -> Lost | None:
        try:
            low = self.consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=self.timeout_s)[0]
        except KafkaException as exc:
            not_checked(self.reader, [(topic, partition)], exc,
                        f"offset {offset}, where it expected offset {expected} (a gap)")
            return None
        return lost_in_gap(self.reader, topic, partition, expected, offset, low)


def lost_in_gap(reader: str, topic: str, partition: int, expected: int, offset: int, low: int) -> Lost | None:
    """What a running ``reader`` lost of ``topic``/``partition`` where it expected offset ``expected`` and the
    broker's next record was ``offset``, the partition's first offset now ``low``: the records ``[expected, min(low,
    offset))``, said and counted (:func:`_said`); None (a DEBUG line) where ``low`` is not past ``expected`` (control
    records, compaction). The one definition for every reader that finds such gaps (:class:`Gaps`, the joiner's faust
    driver)."""
    if low <= expected:
        log.debug("%s: %s partition %d skipped offsets %d..%d with nothing deleted (its first offset is %d): "
                  "control records or compaction", reader, topic, partition, expected, offset - 1, low)
        return None
    gone = Lost(reader, topic, partition, expected, min(low, offset))
    said = _said(gone, f"it expected offset {expected} next and the broker's next record was {offset}, the "
                       f"partition's first offset {low}", "this reader fell behind the topic's retention "
                       "(retention.ms / retention.bytes) while it ran: its lag grew past it", offset)
    return gone if said else None

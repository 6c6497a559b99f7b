"""Batch delivery for the faust join driver: faust's own consumer hands what it fetched to the join whole.

faust delivers one message at a time. Its Fetcher service runs ``Consumer._drain_messages``, which turns each
record into a ``ConsumerMessage`` and awaits the Conductor's callback for it (inside ``wait_first``: two tasks
per message); the callback decodes it into an ``Event`` and queues it on the topic's channel, where an agent's
stream takes it, tracks it and acknowledges it. On bench/joiner.py that took ~28 of the faust driver's 34 s for
220 k events, against 5.4 s for the join itself.

:class:`BatchConsumer` is faust's aiokafka ``Consumer`` with that one loop replaced; everything else is faust's:
the aiokafka consumer thread, group membership and rebalance callbacks, pause/resume, seeks and the commit.
Its ``_drain_messages`` fetches as faust does (``_wait_next_records``: the active partitions, up to
``broker_max_poll_records``), keeps faust's record of what its fetcher handed on (read offsets, the gaps of
offsets the log does not hold), gathers fetches into a batch of up to ``max_records`` records (``_gather``),
hands the batch to :attr:`BatchDelivery.process` as a list of :class:`~stream.joiner.records.Record`, and when
that returns, acknowledges the offsets it reports processed in the consumer's own ledger (what ``Consumer.ack``
writes: ``_acked``, ``_acked_index``), the one faust's commit reads. So faust still commits, on its timer, every
``broker_commit_every`` acknowledgements, at a revocation and at shutdown; it can only ever commit offsets of
batches ``process`` returned from.

* ``process`` is synchronous: from the last check of the flow (below) to the acknowledgement nothing awaits, so
  no rebalance callback, commit or timer runs in the middle of a batch.
* ``process`` raises: nothing of the batch is acknowledged (the worker exits before it raises, see
  ``worker.py``).
* A rebalance while records are in hand (faust stopped the flow, or the group generation moved on since the
  hand's first fetch was issued): the whole hand is dropped unprocessed and the partitions seek back to their
  committed offsets, as faust's ``getmany`` does with a fetch that returns while the flow is stopped (a partition
  without a committed offset, which aiokafka's ``seek_to_committed`` leaves where it is, to the first record
  dropped). A revoked partition's records are therefore never processed after its revocation (faust stops the
  flow before it sends ``on_partitions_revoked``), and an assigned one reads again from what was committed.
* Records the batch did not process (``process`` reports less than it was given): those ``process`` keeps
  (:attr:`BatchDelivery.held`: the join's hold, records past their partition's event-time frontier) stay
  unacknowledged, in memory, and are acknowledged once a later batch processes them; their offsets are never
  committed before that, so a crash or a rebalance reads them again. When nothing new comes while it keeps records,
  an empty batch is delivered after a short fetch, for it to join what the other input has caught up with. Records
  it did not keep: what was acknowledged is committed and the hand is dropped the same way, so they are read again.
  Whenever the hand is dropped and the partitions sought back, what it keeps is dropped too
  (:attr:`BatchDelivery.dropped`): the seek reads it again.
* A partition resuming at a committed offset below its first record still held (the joiner was down longer than
  the topic's retention, or DeleteRecords ran): aiokafka would reset it to the earliest offset
  (``consumer_auto_offset_reset``) without a word. Every seek to the committed offsets (``perform_seek``: faust's
  after each assignment, and the drops above) goes through :meth:`BatchConsumer.seek_to_committed`, which starts such
  a partition at its low watermark and says and counts the loss (``stream.retention``, as the kafka driver does),
  once: asked once per generation and partition, and a loss already said is not said again while the committed
  offset stays where it was (nothing processed of the partition yet).
* A partition that falls behind the topic's retention while it runs: aiokafka's fetch gets OFFSET_OUT_OF_RANGE and
  resets it to the earliest offset, again without a word (and faust's ledger records the jump as a gap its commit
  passes over). Each fetch's jumps past the offset expected next (the read offset + 1, or right after a seek the
  offset sought) are noted, and only then the broker is asked for the partitions' low watermarks: what they are past
  is said and counted (``stream.retention.lost_in_gap``, as the kafka driver's ``Gaps``), and not again at the next
  seek to the committed offsets. A rebalance while it was asked drops the hand, as at any fetch.
* A member dropped from the group for a batch past ``broker_max_poll_interval`` (``[kafka.extra]
  max.poll.interval.ms``, 300 s unless set): the batch's commit goes out as a member of no generation, which the
  broker refuses (UnknownMemberId); the revocation drops what it holds, and faust's answer to it counts as a poll
  (``_CommittedReads.on_partitions_revoked``) for aiokafka to rejoin.
* An input topic deleted and made again under the group's committed offset (of the old topic; a member committing
  its position after the deletion): the start moved back (above) dropped the new topic's records below it as
  processed, and no batch came for the restore that tells the topic changed. A fetch whose every record was left out
  is therefore delivered as an empty batch, and an input its restore found made again
  (:attr:`BatchDelivery.started_over`: nothing of the batch processed) is committed at its first offset at once, its
  floor forgotten, and the hand dropped: the seek back to the committed offsets reads it from its first record.
* A partition paused (backpressure) after its records were fetched: they are delivered; faust's ``getmany``
  drops such records without a seek, so they were not read again until the next rebalance.

No per-message objects exist any more: no ``ConsumerMessage``, ``Event``, stream buffer or unacked-message
set. faust's ``wait_empty`` (at a revocation and at shutdown) therefore has nothing to wait for, which is right
because no batch can be half-processed when it runs; faust's monitor gets each partition's end offset and
stream-inbound time once per fetch or batch instead of once per message (its per-message counters stay at zero).
"""

from __future__ import annotations

import asyncio
import time
from bisect import bisect_left
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import groupby, repeat
from operator import attrgetter
from typing import Any, cast

from aiokafka import __version__ as aiokafka_version
from aiokafka.consumer.subscription_state import Assignment, TopicPartitionState
from confluent_kafka import TopicPartition
from faust import __version__ as faust_version
from faust.transport.consumer import CONSUMER_FETCHING
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types import TP, AppT
from faust.types.tuples import ack_lock
from mode import ServiceT
from mode.utils.futures import notify

from stream.joiner.header_keys import checked, read_leniently
from stream.joiner.records import Record, records_of
from stream.kafka import BATCH_MESSAGES
from stream.retention import account_for_retention, lost_in_gap, not_checked, past_said

# Per (topic, partition), the offset after the last record a batch processed (JoinPipeline.processed).
Processed = Mapping[tuple[str, int], int]

_TOPIC_PARTITION = attrgetter("topic", "partition")  # of a Record
_OFFSET = attrgetter("offset")  # of a Record or a fetched aiokafka record
_KEY, _VALUE, _HEADERS = attrgetter("key"), attrgetter("value"), attrgetter("headers")  # of a fetched aiokafka record
_SHORT_POLL_S = 0.05  # one fetch in a backlog or while an input is paused: how long a batch in hand waits for more
_IDLE_POLL_S = 1.0  # one fetch with nothing in hand (faust's own getmany timeout)
_READER = "joiner"  # whose input lost to retention is logged and counted (stream.retention), as the kafka driver's
# What BatchConsumer uses of faust's Consumer beyond its public interface (faust-streaming 0.15.3, the version
# pyproject.toml allows): a faust that moved any of it fails at start, not in a batch.
_FAUST_INTERNALS = ("_drain_messages", "_wait_next_records", "_get_active_partitions", "_add_gap", "_committed_offset",
                    "_acked", "_acked_index", "_read_offset", "_n_acked", "_waiting_for_ack", "_thread",
                    "_commit_offsets")


@dataclass(frozen=True)
class BatchDelivery:
    """What :class:`BatchConsumer` hands its batches to, and how it cuts them."""

    # Makes the batch's outputs and state durable and returns what it processed; synchronous. Raising: nothing of
    # the batch is acknowledged.
    process: Callable[[list[Record]], Processed]
    max_records: int  # a batch closes at this many records ...
    within_s: float  # ... or this long after its first record came
    # Whether an input is paused (backpressure): then a batch in hand goes as soon as a short fetch brings nothing,
    # instead of waiting out within_s for records that cannot come.
    short_polls: Callable[[], bool]
    # Told how many records are in hand after each fetch, what is left in hand after a batch, 0 when it is dropped.
    in_hand: Callable[[int], None]
    # Per (topic, partition), how many records ``process`` keeps unprocessed (the last of those it was given, in
    # memory, to process with a later batch): acknowledged when processed, not read again. None: it keeps none.
    held: Callable[[], Mapping[tuple[str, int], int]] | None = None
    # Told that what ``process`` keeps of these (topic, partition)s (None: of all) must be dropped: the hand was dropped
    # and the partitions sought back to their committed offsets, or they were revoked; either way it is read again.
    dropped: Callable[[set[tuple[str, int]] | None], None] = lambda _partitions: None
    # Seconds to wait before the next fetch, asked after each batch (a failed batch's backoff: the infrastructure is
    # away); 0: none.
    wait_s: Callable[[], float] = lambda: 0.0
    # Asked after each batch: the (topic, partition)s of inputs its restore found deleted and made again (the group's
    # committed offset is the old topic's). ``process`` processed nothing then; they are committed at their first
    # offset before anything of them is joined, and read from there.
    started_over: Callable[[], set[tuple[str, int]]] = lambda: set()
    # Told, before the batch that follows, the (topic, partition)s a fetch brought records of below the consumer's read
    # offset (left out as read): the topic made again under the running consumer, its position reset to the new
    # topic's first offset? ``process`` asks the topics' ids (``JoinPipeline.regressed``) and starts such an input over.
    below: Callable[[set[tuple[str, int]]], None] = lambda _below: None
    # Whether ``process`` is owed a batch though nothing came (``JoinPipeline.topics_due``: the periodic check of the
    # input topics' ids, which an input made again under the consumer's position of the old topic needs, as nothing
    # of it is fetched): an empty one is delivered.
    due: Callable[[], bool] = lambda: False


class _Dropped(Exception):
    """The records in hand are stale: a rebalance started or happened while they were gathered."""

    def __init__(self, batch: list[Record], fetched: Mapping[Any, list[Any]] | None = None) -> None:
        self.first = _first_offsets(batch)  # per partition, the first offset in hand
        for tp, recs in (fetched or {}).items():  # then those of the fetch that just returned
            if recs:
                self.first.setdefault(TP(tp.topic, tp.partition), recs[0].offset)
        self.records = len(batch) + sum(map(len, (fetched or {}).values()))
        super().__init__(f"{self.records} record(s) in hand")


def _first_offsets(records: list[Record]) -> dict[TP, int]:
    first: dict[TP, int] = {}
    for (topic, partition), run in groupby(records, _TOPIC_PARTITION):
        first.setdefault(TP(topic, partition), next(run).offset)
    return first


class BatchConsumer(faust_aiokafka.Consumer):
    """faust's aiokafka consumer, delivering to :attr:`BatchTransport.delivery` in batches (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        missing = [name for name in _FAUST_INTERNALS if not hasattr(self, name)]
        if missing:
            raise RuntimeError(f"faust-streaming {faust_version} lacks {', '.join(missing)}, which the faust join "
                               "driver's batch delivery replaces or reads (stream/joiner/faust_delivery.py; tested "
                               "on 0.15.3): install faust-streaming 0.15.x or run `streamrec join --driver kafka`")
        self._carry: list[Record] = []  # fetched past the last batch's max_records: the start of the next one
        self._carried: set[tuple[str, int]] = set()  # the (topic, partition)s of the records in ``_carry``
        self._carry_generation = 0  # the group generation in which they were fetched
        self._resumed: set[TP] = set()  # partitions whose start this generation was checked (:meth:`_resume_safely`)
        self._resumed_generation = -1
        self._lows_asked: set[TP] = set()  # partitions whose low watermark was asked this generation (retention)
        self._lows_generation = -1
        # Per partition, the offsets delivered that ``process`` keeps unprocessed (BatchDelivery.held), ascending: not
        # acknowledged until a later batch processes them.
        self._kept: dict[TP, list[int]] = {}
        # Per partition sought (:meth:`seek`, :meth:`seek_to_committed`) and not read since, the offset sought: the next
        # one expected (faust's read offset is the last offset read, except right after a seek, when it is this).
        self._sought: dict[TP, int] = {}
        # Per partition moved back below its committed offset (:meth:`_resume_safely`), that offset: the records below
        # it are read again for faust's bookkeeping but not delivered (processed or dead-lettered already).
        self._redone: dict[TP, int] = {}
        # The jumps of the last fetch (:meth:`_records`): (partition, first offset missing, the next record's offset).
        self._jumps: list[tuple[TP, int, int]] = []
        # Whether a fetch since the last batch brought records and every one was left out (read or processed already):
        # delivered all the same, as an empty batch, for ``process`` to restore their partitions (module docstring).
        self._left_out = False

    @property
    def delivery(self) -> BatchDelivery:
        return cast(BatchTransport, self.transport).delivery

    def _new_consumer_thread(self) -> faust_aiokafka.AIOKafkaConsumerThread:
        return _CommittedReads(self, loop=self.loop, beacon=self.beacon)

    async def _drain_messages(self, fetcher: ServiceT) -> None:
        """The Fetcher's loop: batches instead of faust's per-message callback; faust's stop conditions and error
        handling (a cancel while stopping ends the loop quietly: the Fetcher treats a cancel during a rebalance as a
        crash otherwise)."""
        consumer_should_stop = self._stopped.is_set
        fetcher_should_stop = cast(Any, fetcher)._stopped.is_set
        try:
            while not (consumer_should_stop() or fetcher_should_stop()):
                self.diag.set_flag(CONSUMER_FETCHING)
                try:
                    batch = await self._gather()
                except _Dropped as dropped:
                    await self._drop(dropped.first, dropped.records)
                    continue
                finally:
                    self.diag.unset_flag(CONSUMER_FETCHING)
                # nothing new: what is kept is offered again (the other input may have come), and a restore is
                # owed to records left out (an input made again under the committed offset: module docstring)
                if batch or self._kept or self._left_out or self.delivery.due():
                    self._left_out = False
                    await self._deliver(batch)
                    if (wait := self.delivery.wait_s()) > 0:
                        await self.sleep(wait)  # (mode's: ends early when the consumer stops)
        except self.consumer_stopped_errors:
            if self.transport.app.should_stop:
                self.log.info("Broker stopped consumer, shutting down...")
                return
            raise
        except asyncio.CancelledError:
            if self.transport.app.should_stop:  # the Fetcher stopped (shutdown), perhaps in the middle of a rebalance
                self.log.info("Consumer shutting down for user cancel.")
                return
            raise
        except Exception as exc:
            self.log.exception("Drain messages raised: %r", exc)
            raise

    async def _gather(self) -> list[Record]:
        """One batch: fetches until ``max_records`` or ``within_s`` after the first record; [] when the consumer
        stops. Raises :class:`_Dropped` when the flow changed under the hand. A fetch that brings more than the batch
        has room for leaves the rest in hand for the next batch.

        A live stream (every active partition read up to its high watermark) makes one batch per window, however
        few records come in it. With a backlog, or an input paused, a batch in hand goes as soon as a short fetch
        brings nothing: aiokafka fetches a partition again only once its buffer ran dry, so the next records are on
        their way over the network, which they travel while ``process`` runs (waiting out the window for them cost
        ~10% on bench/joiner.py)."""
        d = self.delivery
        batch = self._carry
        self._set_carry([])
        generation = self._carry_generation if batch else self.app.consumer_generation_id
        if batch and (not self.flow_active or self.app.consumer_generation_id != generation):
            raise _Dropped(batch)  # the last batch's commit awaited: a rebalance may have come since the fetch
        deadline = time.monotonic() + d.within_s if batch else None
        while len(batch) < d.max_records:
            if deadline is None:
                short, timeout = False, min(_IDLE_POLL_S, d.within_s) if self._kept else _IDLE_POLL_S
            elif (timeout := deadline - time.monotonic()) <= 0:
                break
            elif short := d.short_polls() or self._has_backlog():
                timeout = min(timeout, _SHORT_POLL_S)
            records, _ = await self._wait_next_records(timeout)
            if self.should_stop:
                return []
            if not self.flow_active or self.app.consumer_generation_id != generation:
                raise _Dropped(batch, records)
            fresh = self._records(records or {})
            if self._jumps:  # rare: a fetch past offsets the log no longer holds, or never held
                await self._say_lost_while_running()
                if not self.flow_active or self.app.consumer_generation_id != generation:
                    raise _Dropped(batch, records)  # the broker was asked: a rebalance may have come meanwhile
            await self._resume_safely(generation, records or {})
            if fresh:
                batch.extend(fresh)
                d.in_hand(len(batch))
                if deadline is None:
                    deadline = time.monotonic() + d.within_s
            elif (batch and short) or (not batch and (self._kept or self._left_out or d.due())):
                break
        if len(batch) > d.max_records:
            self._set_carry(batch[d.max_records:])
            self._carry_generation = generation
            del batch[d.max_records:]
        return batch

    async def _resume_safely(self, generation: int, fetched: Mapping[Any, list[Any]]) -> None:
        """The local broker's high-watermark limit (Tansu reports the start of a partition's last record batch + 1;
        ``stream.kafka.resume_offsets``): a partition that starts this generation at a committed offset inside that
        batch gets nothing until more data arrives, so a worker given it in a rebalance read nothing and exited idle
        with the restored impressions never emitted. Once per generation and partition, at the first fetch that
        knows its high watermark and brought it nothing, a start offset (faust's read offset after its seek to the
        committed one) at or past that high watermark is moved back to it - 1, the batch's start: the records in
        between come again and the join engine skips them (``redelivered``). On Apache Kafka that only re-reads the
        last record of a partition read to its end; a partition that brought records is not checked."""
        if generation != self._resumed_generation:
            self._resumed_generation, self._resumed = generation, set()
        self._resumed.update(TP(tp.topic, tp.partition) for tp, recs in fetched.items() if recs)
        for tp in self._get_active_partitions():
            if tp in self._resumed:
                continue
            try:
                high = self.highwater(tp)
            except Exception:  # noqa: BLE001 - not fetched yet: checked at a later fetch
                continue
            if high is None or high <= 0:
                continue
            self._resumed.add(tp)
            start = self._read_offset.get(tp)
            if start is not None and start >= high:
                self.log.info("%r starts at %d, past the broker's reported high watermark %d: reading from %d "
                              "(records already applied are skipped)", tp, start, high, high - 1)
                try:
                    await self.seek(tp, high - 1)
                    # owed from ``start`` still: the record re-read below it is no jump, and on a partition retention
                    # emptied (its first offset the high watermark) the fetch's reset to it is no loss of high - 1
                    self._sought[TP(tp.topic, tp.partition)] = start
                    # the engine skips the good records below it as redelivered, but a bad one was dead-lettered
                    # again (the chaos test: a restart after an idle exit dead-lettered it twice). Not past one record
                    # batch: a topic deleted and made again (offsets started over), whose records the join takes
                    if start - (high - 1) <= BATCH_MESSAGES + 1:
                        self._redone[TP(tp.topic, tp.partition)] = start
                        self._left_out = True  # (delivered now: its restore may find the topic made again)
                except Exception as exc:  # noqa: BLE001 - revoked meanwhile: its next owner checks again
                    self.log.warning("could not seek %r back to %d: %r", tp, high - 1, exc)

    async def seek_to_committed(self) -> Mapping[TP, int]:
        """faust's seek to the committed offsets (``perform_seek``, which makes them the read and committed offsets
        it keeps), each partition started at its low watermark instead where records between its committed offset and
        that were deleted unread: the loss logged and counted once (module docstring)."""
        # aiokafka's offsets: None where a partition has none (faust's own type says int)
        out = await self._start_after_retention(await super().seek_to_committed())
        for tp, offset in out.items():
            if offset is not None and offset >= 0:
                self._sought[TP(tp.topic, tp.partition)] = offset
            else:  # aiokafka's auto_offset_reset: whatever comes first
                self._sought.pop(TP(tp.topic, tp.partition), None)
        return cast(Mapping[TP, int], out)

    async def seek(self, partition: TP, offset: int) -> None:
        """faust's seek, the offset sought remembered as the next one expected (:meth:`_records`)."""
        await super().seek(partition, offset)
        self._sought[TP(partition.topic, partition.partition)] = offset

    async def _say_lost_while_running(self) -> None:
        """The jumps the last fetch noted (:meth:`_records`), checked against the partitions' low watermarks: aiokafka
        got OFFSET_OUT_OF_RANGE (the joiner fell behind the topic's retention while it ran) and reset the partition to
        its earliest offset without a word; what the low watermark is past is lost, said and counted once
        (``stream.retention.lost_in_gap``, as the kafka driver's ``Gaps``). A jump the low watermark is not past
        (control records, compaction) loses nothing; a broker that cannot answer is one WARNING."""
        jumps, self._jumps = self._jumps, []
        try:
            lows = await self.earliest_offsets(*{tp for tp, _, _ in jumps})
        except Exception as exc:  # noqa: BLE001 - said; the fetch goes on (CancelledError is no Exception: it ends it)
            not_checked(_READER, {(tp.topic, tp.partition) for tp, _, _ in jumps}, exc, ", ".join(
                f"offset {offset} of {tp.topic} partition {tp.partition}, where it expected offset {expected} (a gap)"
                for tp, expected, offset in jumps))
            return
        for tp, expected, offset in jumps:
            low = lows.get(tp)
            if low is not None:
                lost_in_gap(_READER, tp.topic, tp.partition, expected, offset, low)

    async def _start_after_retention(self, committed: Mapping[Any, int | None]) -> dict[Any, int | None]:
        """``committed`` (aiokafka's partitions to their committed offsets, None: none), a partition whose committed
        offset is below its low watermark sought to that and its offset there (``stream.retention``, reader
        ``joiner``). The low watermarks are asked once per generation and partition; a partition whose committed
        offset lies in a loss said before starts past it (``stream.retention.past_said``), and only records deleted
        since count."""
        generation = self.app.consumer_generation_id
        if generation != self._lows_generation:
            self._lows_generation, self._lows_asked = generation, set()
        saved = {tp: offset for tp, offset in committed.items() if offset is not None and offset >= 0}
        ask = [tp for tp in saved if TP(tp.topic, tp.partition) not in self._lows_asked]
        lows: dict[tuple[str, int], int] = {}
        if ask:
            try:
                earliest = await self.earliest_offsets(*ask)
                lows = {(tp.topic, tp.partition): low for tp, low in earliest.items() if low is not None}
            except Exception as exc:  # noqa: BLE001 - said, and the partitions start at their committed offsets
                not_checked(_READER, [(tp.topic, tp.partition) for tp in ask], exc)
            # asked only once answered or said: a seek cancelled while it waits (faust's recovery timeout, a new
            # rebalance) is asked again at the next seek of the generation, not left unchecked
            self._lows_asked.update(TP(tp.topic, tp.partition) for tp in ask)
        starts = [TopicPartition(tp.topic, tp.partition, past_said(_READER, tp.topic, tp.partition, offset))
                  for tp, offset in saved.items()]
        out = dict(committed)
        moved = account_for_retention(_READER, starts, lows)[0]
        for tp, start in zip(saved, moved, strict=True):
            if start.offset != saved[tp]:
                try:
                    await self.seek(tp, start.offset)
                except Exception as exc:  # noqa: BLE001 - revoked meanwhile: its next owner checks again
                    self.log.warning("could not seek %r to its first offset held %d: %r", tp, start.offset, exc)
                    continue
                out[tp] = start.offset
        return out

    def _has_backlog(self) -> bool:
        """Whether an active partition has more to read than faust's fetcher handed on (its tracked high water)."""
        return any(map(self.has_more, self._get_active_partitions()))

    def has_more(self, tp: TP) -> bool:
        """:meth:`fetched_more`, unknown counted as no."""
        return bool(self.fetched_more(tp))

    def fetched_more(self, tp: TP) -> bool | None:
        """Whether ``tp`` has records ``process`` has not been given yet: fetched past the last batch's room (the carry,
        which faust's read offset counts as read), or past the read offset (right after a seek the offset sought, the
        next to read: ``_sought``) by the high water faust's fetcher last saw. None while that is unknown (not fetched
        yet, an error): backpressure counts it as more for a while (``worker._behind``, ``backpressure.Unfetched``; it
        once said a partition whose last records were in the carry, or that was sought to its last record, had
        nothing more). Nothing read or sought yet (a new group's first assignment, started at the beginning): aiokafka's
        fetch position stands in for the read offset once it is known, or a partition whose every record was deleted
        (retention, DeleteRecords: the log start, where it starts, is the high water) read as more for good and the
        hold kept the other input back (as the kafka driver's ``stream.kafka.fetched_more`` once did). Past the last
        record read, the log may hold offsets no record is handed on from (a transaction's commit marker, aborted or
        compacted records): the fetch position, which passes them, at the high water says nothing is left (the read
        offset below it read as more for good: no idle exit, ``backpressure.unread``, and the other input held back)."""
        if (tp[0], tp[1]) in self._carried:
            return True
        try:
            high = self.highwater(tp)
        except Exception:  # noqa: BLE001 - unknown (not fetched yet)
            return None
        if high is None or high < 0:
            return None
        if high == 0:
            return False
        read, sought = self._read_offset.get(tp), self._sought.get(tp)
        if sought is not None and sought >= high and not self._start_checked(tp):
            return None  # moved back at the next fetch (:meth:`_resume_safely`), perhaps to a topic made again
        if read is not None and (read + 1 if sought is None else sought) >= high:
            return False
        if read is not None and sought is not None:  # sought below the high water: more, whatever was fetched
            return True
        position = _fetch_position(self._thread._ensure_consumer(), tp)  # nothing read yet, or read below the high
        return position is None or position < high  # water: the fetch position decides (markers, compacted records)

    def _start_checked(self, tp: TP) -> bool:
        """Whether :meth:`_resume_safely` checked ``tp``'s start this generation. Until then a start at or past the high
        water is not known to be read to its end: an idle exit before that check (the high water comes with a fetch
        that returned nothing, and faust's wait for records goes on a while) ended the run before the restore found the
        topic made again under the committed offset."""
        return self._resumed_generation == self.app.consumer_generation_id and TP(tp[0], tp[1]) in self._resumed

    def _set_carry(self, records: list[Record]) -> None:
        self._carry = records
        self._carried = {key for key, _ in groupby(records, _TOPIC_PARTITION)}

    async def _drop(self, first: dict[TP, int], records: int) -> None:
        """Drop the ``records`` in hand, unprocessed, and seek back to the committed offsets (module docstring); a
        partition without a committed offset (aiokafka's ``seek_to_committed`` leaves those where they are) seeks
        back to ``first``, the first offset dropped of it, or that record would never be read again."""
        for tp, kept in self._kept.items():  # kept before the hand: the first of them is the first to read again
            first[tp] = min(first.get(tp, kept[0]), kept[0])
        if records or self._kept:
            self.log.info("dropping %d record(s) in hand and %d kept, unprocessed (the flow stopped or the generation "
                          "moved on); seeking back to the committed offsets", records,
                          sum(map(len, self._kept.values())))
        self._set_carry([])
        self._kept = {}
        self.delivery.dropped(None)
        self.delivery.in_hand(0)
        try:
            await self.perform_seek()
        except Exception as exc:  # noqa: BLE001 - faust's own handling in getmany: the next rebalance seeks again
            self.log.warning("exception performing seek when flow not active %r", exc)
            return  # a rebalance under way: it resets every position (committed, or auto_offset_reset)
        assignment = self.assignment()
        for tp, offset in first.items():
            if tp in assignment and not self._read_offset.get(tp):  # perform_seek found no committed offset
                try:
                    await self.seek(tp, offset)
                except Exception as exc:  # noqa: BLE001 - revoked meanwhile: its next owner starts from committed
                    self.log.warning("could not seek %r back to %d: %r", tp, offset, exc)

    def _records(self, records: Mapping[Any, list[Any]]) -> list[Record]:
        """aiokafka's records as pipeline records, and faust's bookkeeping of what its fetcher handed on, as
        ``getmany`` and ``_drain_messages`` keep it: records before a partition's read offset are skipped, the
        offsets the log does not hold between them are recorded as gaps (transaction markers, compaction: faust's
        commit passes over them), and the read offset advances (backpressure reads it: ``worker._behind``). Each jump
        past the offset expected next (the one sought, or the read offset + 1) is noted for :meth:`_gather` to check
        against retention (:meth:`_say_lost_while_running`)."""
        out: list[Record] = []
        monitor = self.app.monitor
        for tp, recs in records.items():
            if not recs:
                continue
            read = self._read_offset[tp]
            if read is not None and recs[0].offset < read:
                self.delivery.below({(tp.topic, tp.partition)})
                recs = [r for r in recs if r.offset >= read]
                if not recs:
                    self._left_out = True
                    continue
            key = TP(tp.topic, tp.partition)
            expected = self._sought.pop(key) if key in self._sought else None if read is None else read + 1
            if expected is not None:
                self._jumps.extend((key, start, end) for start, end in _jumps(expected, recs))
            topic, partition = tp
            given = _not_redone(self._redone, key, recs)
            self._left_out |= not given
            stamps = [-1 if r.timestamp is None else r.timestamp for r in given]  # -1: none, the clock bounds ts
            out.extend(records_of(repeat(topic, len(given)), repeat(partition, len(given)), map(_OFFSET, given),
                                  map(_KEY, given), map(_VALUE, given), stamps, _headers(given)))
            if self.app.topics.acks_enabled_for(topic):
                for start, end in _gaps(read, recs[0].offset, recs[-1].offset, len(recs), recs):
                    self._add_gap_now(tp, start, end)
            self._read_offset[tp] = recs[-1].offset
            if monitor is not None:
                monitor.track_tp_end_offset(tp, self.highwater(tp))
        return out

    async def _deliver(self, batch: list[Record]) -> None:
        """``process`` the batch, then acknowledge what it processed (nothing awaits in between)."""
        try:
            processed = self.delivery.process(batch)
        finally:
            self.delivery.in_hand(len(self._carry))
        again = self.delivery.started_over()  # (asked before anything awaits: no revocation in between)
        offsets, self._kept = self._kept, {}  # what process() kept from earlier batches comes first
        for (topic, partition), run in groupby(batch, _TOPIC_PARTITION):  # runs of one partition, offsets ascending
            offsets.setdefault(TP(topic, partition), []).extend(map(_OFFSET, run))
        left: dict[TP, int] = {}  # per partition, the first record process() did not process (nor keep)
        held = self.delivery.held() if self.delivery.held is not None else {}
        now = time.monotonic()
        monitor = self.app.monitor
        for tp, offs in offsets.items():
            upto = processed.get((tp.topic, tp.partition))
            done = 0 if upto is None else bisect_left(offs, upto)  # offsets ascending: what process() did is a prefix
            if done < len(offs):
                if held.get((tp.topic, tp.partition)) == len(offs) - done:
                    self._kept[tp] = offs[done:]  # kept by process(): acknowledged once a later batch processes them
                else:
                    left[tp] = offs[done]
            if done:
                self.ack_offsets(tp, offs if done == len(offs) else offs[:done])
                if monitor is not None:
                    monitor.stream_inbound_time[tp] = now
        commit_every = self._commit_every
        lows = await self.start_over(again) if again else {}
        if left or again:  # read again from what was processed (module docstring)
            await self.commit()
            unprocessed = sum(len(offs) - bisect_left(offs, left[tp]) for tp, offs in offsets.items() if tp in left)
            await self._drop({**_first_offsets(self._carry), **left, **lows}, unprocessed + len(self._carry))
        elif commit_every is not None and self._n_acked >= commit_every:
            self._n_acked = 0
            await self.commit()

    async def start_over(self, again: set[tuple[str, int]]) -> dict[TP, int]:
        """Inputs found deleted and made again (:attr:`BatchDelivery.started_over`) committed at their first offset and
        sought there, their floor (``_redone``) forgotten; the hand is dropped next. At once, before anything of them is
        joined: left at the old topic's offset until a later commit, a crash after the new topic's first state chunk
        restarted there, the state's topic id now the topic's (no start over), and the records in between were never
        joined. A broker that cannot answer fails the consumer, as faust's own commit does: the restart's restore
        finds the topic made again anew. A partition revoked while the broker was asked is not sought (aiokafka
        raised, out of the fetcher): faust's commit discarded its offset, and its next owner starts it over. Returns
        the first offsets, where the drop that follows seeks them (a committed 0 is no committed offset to faust)."""
        tps = [TP(topic, partition) for topic, partition in sorted(again)]
        for tp in tps:
            self._redone.pop(tp, None)
        with ack_lock:  # the old topic's acks and gaps not committed yet (the running check, within faust's commit
            for tp in tps:  # interval): its commit took them over the first offset (a committed 0 skips its gap check)
                self._acked.pop(tp, None)
                self._acked_index.pop(tp, None)
                self._gap.pop(tp, None)
        lows = {tp: low for tp, low in (await self.earliest_offsets(*tps)).items() if low is not None}
        await self._commit_offsets(lows)
        for tp, low in lows.items():  # (aiokafka's seek to the committed offsets passes over an offset of 0)
            try:
                await self.seek(tp, low)
            except Exception as exc:  # noqa: BLE001 - revoked meanwhile (its commit discarded): its next owner's
                self.log.warning("could not seek %r to %d: %r", tp, low, exc)  # restore starts it over
        return lows

    def forget_kept(self, partitions: set[TP]) -> None:
        """What ``process`` kept of ``partitions`` is dropped (revoked: their next owner reads it); it is told so."""
        self._kept = {tp: kept for tp, kept in self._kept.items() if tp not in partitions}
        for tp in partitions:  # no offset sought survives its partition's revocation (its next seek sets it again)
            self._sought.pop(TP(tp.topic, tp.partition), None)
            self._redone.pop(TP(tp.topic, tp.partition), None)
        self.delivery.dropped({(tp.topic, tp.partition) for tp in partitions})

    def ack_offsets(self, tp: TP, offsets: list[int]) -> None:
        """``Consumer.ack`` for a partition's processed offsets at once: what faust's commit reads."""
        with ack_lock:
            try:
                if self.app.topics.acks_enabled_for(tp.topic):
                    committed = self._committed_offset[tp]
                    index = self._acked_index[tp]
                    new = [o for o in offsets if (committed is None or o >= committed) and o not in index]
                    index.update(new)
                    self._acked[tp].extend(new)
                    self._n_acked += len(new)
            finally:
                notify(self._waiting_for_ack)

    def _add_gap_now(self, tp: TP, offset_from: int, offset_to: int) -> None:
        """``Consumer._add_gap`` without its ``sleep(0)`` (nothing awaits between a fetch's checks and its batch)."""
        committed = self._committed_offset[tp]
        if committed is not None:
            offset_from = max(offset_from, committed + 1)
        if offset_from <= offset_to:
            gap = self._gap[tp]
            gap.addi(offset_from, offset_to + 1)
            gap.merge_overlaps()


def _fetch_position(consumer: Any, tp: TP) -> int | None:
    """The offset aiokafka's ``consumer`` fetches next of ``tp``, as its ``position`` answers it but without waiting:
    None while it is not known (its committed offset or reset not looked up yet) or ``tp`` is not assigned. Where
    aiokafka keeps it is checked at start (``_CommittedReads``)."""
    assignment = getattr(consumer._subscription.subscription, "assignment", None)  # no subscription: None
    state = assignment.state_value(tp) if assignment is not None else None
    return state.position if state is not None and state.has_valid_position else None


def _not_redone(redone: dict[TP, int], key: TP, recs: list[Any]) -> list[Any]:
    """``recs`` (ascending) less those below the committed offset their partition was moved back from
    (``BatchConsumer._redone``, forgotten once a record at or past it comes)."""
    floor = redone.get(key)
    if floor is None:
        return recs
    if recs[-1].offset >= floor:
        del redone[key]
    return [r for r in recs if r.offset >= floor]


def _headers(recs: list[Any]) -> list[Any]:
    """The fetched records' headers (``()`` where none: one C-level pass), a record's ``bad_header`` BadMessage where a
    key is not UTF-8 (``header_keys``); only records with headers are checked one by one."""
    headers = list(map(_HEADERS, recs))
    return [h and checked(h) for h in headers] if any(headers) else headers


def _jumps(expected: int, recs: list[Any]) -> list[tuple[int, int]]:
    """The jumps in ``recs`` (offsets ascending) from ``expected``, the offset expected first: (the first offset
    missing, the next record's offset) each; O(1) where they are contiguous (the usual case)."""
    first, last = recs[0].offset, recs[-1].offset
    if last - first == len(recs) - 1:
        return [(expected, first)] if first > expected else []
    out = []
    for r in recs:
        if r.offset > expected:
            out.append((expected, r.offset))
        expected = r.offset + 1
    return out


def _gaps(read: int | None, first: int, last: int, n: int, recs: list[Any]) -> list[tuple[int, int]]:
    """The gaps ``Consumer._drain_messages`` records reading ``recs`` (offsets ``first`` .. ``last``, ``n`` of them)
    after ``read``: (read + 1, offset) before each offset more than one past the last (none after a read offset of
    None or 0, as there)."""
    if last - first == n - 1:  # contiguous: the usual case, checked in O(1)
        return [(read + 1, first)] if read and first - read > 1 else []
    out = []
    for r in recs:
        if read and r.offset - read > 1:
            out.append((read + 1, r.offset))
        read = r.offset
    return out


class _CommittedReads(faust_aiokafka.AIOKafkaConsumerThread):
    """faust's consumer thread, its aiokafka consumer reading committed records only. faust asks aiokafka for
    ``read_uncommitted`` unless it runs exactly-once itself: an application producing impressions or clicks in
    transactions had what it aborted joined into samples by this driver (the kafka driver, librdkafka, reads committed
    ones: ``stream.kafka.consumer_config``). Set before the consumer starts (aiokafka's fetcher reads it then).

    Its assignor is faust's co-partitioning one (``app.assignor``: partition p of both inputs to one member, as the
    kafka driver's range assignor does) whatever ``table_standby_replicas`` says: faust falls back to aiokafka's
    round robin for an app with no standby replicas and no tables, which with ``TABLE_STANDBY_REPLICAS=0`` in the
    environment (faust's env names win over the worker's settings) gave impressions p and clicks p to different
    members unless the member count divided the partition count: their clicks joined as orphans, impressions as 0s."""

    def _create_worker_consumer(self, transport: Any) -> Any:
        consumer = super()._create_worker_consumer(transport)
        if not hasattr(consumer, "_partition_assignment_strategy"):
            raise RuntimeError(f"aiokafka {aiokafka_version} keeps its assignors elsewhere: the faust join driver "
                               "cannot give partition p of both inputs to one member (stream/joiner/faust_delivery.py)")
        self._assignor = self.app.assignor
        consumer._partition_assignment_strategy = [self._assignor]  # aiokafka's coordinator reads it at start
        if getattr(consumer, "_isolation_level", None) not in ("read_uncommitted", "read_committed"):
            raise RuntimeError(f"aiokafka {aiokafka_version} keeps its isolation level elsewhere: the faust join "
                               "driver cannot make it read committed records only (stream/joiner/faust_delivery.py)")
        consumer._isolation_level = "read_committed"
        if not hasattr(getattr(consumer, "_subscription", None), "fetch_context"):
            raise RuntimeError(f"aiokafka {aiokafka_version} keeps its poll clock elsewhere: the faust join driver "
                               "cannot rejoin after a slow batch (stream/joiner/faust_delivery.py)")
        if not (hasattr(Assignment, "state_value") and hasattr(TopicPartitionState, "has_valid_position")
                and hasattr(TopicPartitionState, "position")):
            raise RuntimeError(f"aiokafka {aiokafka_version} keeps its fetch positions elsewhere: the faust join "
                               "driver cannot tell a partition whose records were all deleted has nothing to read "
                               "(stream/joiner/faust_delivery.py)")
        return consumer

    async def on_partitions_revoked(self, revoked: set[TP]) -> None:
        """faust's revocation, then a poll as far as aiokafka's ``max_poll_interval`` goes: the main loop answered it,
        so the slow batch that kept it (and the fetcher) away is over. A member dropped for a batch past
        ``broker_max_poll_interval`` is told its partitions are revoked, and aiokafka rejoins only once its fetcher
        polls again, while faust polls only once a rejoin resumed its flow: the worker sat with no partitions until it
        exited idle (status 0, its input unread, not one sample out) or for good."""
        await super().on_partitions_revoked(revoked)
        with self._ensure_consumer()._subscription.fetch_context():
            pass


class BatchTransport(faust_aiokafka.Transport):
    """faust's aiokafka transport with :class:`BatchConsumer` as its consumer."""

    Consumer = BatchConsumer

    def __init__(self, app: AppT, delivery: BatchDelivery) -> None:
        super().__init__(app.conf.broker_consumer, app)
        self.delivery = delivery


def install(app: AppT, delivery: BatchDelivery) -> None:
    """Make ``app`` consume through :class:`BatchConsumer`; before anything created its consumer."""
    if getattr(app, "_consumer", None) is not None:
        raise RuntimeError("install() must come before the app's consumer is created")
    app.transport = BatchTransport(app, delivery)
    read_leniently()  # a header key that is not UTF-8 raised out of every fetch of its record (header_keys.py)

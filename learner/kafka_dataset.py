"""A ``torch.utils.data.IterableDataset`` over the ``samples`` topic.

Each Kafka message is one Arrow sample batch (``stream/samples.py``); messages are decoded and
turned into tensors without per-row Python (``learner/batch.py``), then joined into training
batches of about ``batch_rows`` rows. A message is never split: every yielded batch lists the
``(partition, offset, rows)`` of the messages it holds, which is what checkpoints record, and the newest joiner
watermark each partition's messages in it carry (``TensorBatch.watermarks``, for ``learner/served.py``).

Partitions and start offsets are explicit (the checkpoint's), not a consumer group's: the learner seeks to exactly where
its model state stopped. With DataLoader workers, each worker reads its share of the rank's partitions
(``learner.distributed.partitions_of``: dealt out in turn, shares differing by at most one). Given the topic's
partitions as the daemon listed them (``listed``), a reader asks for them again every ``PARTITION_CHECK_S`` and reads a
partition added since that it owns by the same rule (its rank's, ``shard``, then its worker's) from its first record, as
a partition without a saved offset. A message that cannot be decoded or turned into tensors (whatever the exception)
goes to ``samples.dlq`` with the reason, and its offset still counts as consumed, so it is never retried in a loop.
``suspects`` are messages that were in a batch whose training failed (``stream/strikes.py``): each is yielded as a batch
of its own, and one with a poison reason is dead-lettered instead.

Partitions are merged in event time (:class:`EventTimeMerge`): decoded messages wait in a small buffer per
partition, and the one whose first sample went out the earliest in event time (``emitted_at``) goes next, as long
as every partition with more to read has one buffered (a partition whose buffer is full is paused; the consumer
refetches it from where the buffer ends).
Read from a backlog, librdkafka hands over each partition's messages in chunks of up to
``max.partition.fetch.bytes``, and test-then-train would otherwise train on one partition's next months before it
predicts another's past (on the demo's ML-1M topic the learner's event time jumped back by months, and the
served metrics' windows held one partition's burst at a time). In a live stream every partition has its next
message in hand or is caught up, so nothing waits; a partition that sent nothing for ``idle_s`` (2 s) holds
nobody back, whatever its lag says. With DataLoader workers each worker merges the partitions it reads.

The dead-letter producer is made on the first message an iteration dead-letters (most iterations make
none, so they leave no Kafka client behind) and dropped when the iteration ends. A producer left to the
cyclic garbage collector may be collected in a forked DataLoader worker, where destroying the parent's
librdkafka client hangs or crashes; an ``AckedProducer`` that is no reference cycle is destroyed at once,
in the process that made it, when this drops it.
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import logging
import multiprocessing
import os
import re
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Generator, Iterator
from functools import partial
from typing import TypeVar

import pyarrow.compute as pc
import torch
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from learner.batch import TensorBatch, concat, to_tensors
from learner.distributed import partitions_of
from learner.features import FeatureConfig
from learner.worker_counters import WorkerTally
from learner.worker_stall import loader_timeout
from stream.config import KafkaSettings
from stream.dlq import DeadLetters
from stream.errors import BadMessage, StreamError, quoted, shown
from stream.idle_clock import IdleClock
from stream.kafka import Headers, fetched_more, has_more, headers_of, new_consumer
from stream.limits import DEFAULT_LIMITS, EventLimits
from stream.retention import Gaps, starting_after_retention
from stream.samples import MAX_LIST_VALUES, SampleBatch, watermark_of
from stream.strikes import is_infrastructure
from stream.unfetched import Unfetched

log = logging.getLogger("streamrec.train")
_R = TypeVar("_R")

# How torch reports a DataLoader worker that died (checked on torch 2.13): its SIGCHLD handler, run wherever the
# training process is (inside a training step too), raises "DataLoader worker (pid 123) is killed by signal:
# Killed." or "... exited unexpectedly with exit code 1. ..."; the loader's own check, when it finds the worker gone
# while waiting for a batch, "DataLoader worker (pid(s) 123, 456) exited unexpectedly". Plain RuntimeErrors, told
# apart by their text (as learner/distributed.py tells a peer's failure).
_WORKER_DEATH = re.compile(r"DataLoader worker \(pid(?:\(s\))? [\d, ]+\) (?:is killed by signal|exited unexpectedly)")


class SamplesNeverFetched(StreamError):
    """A bounded run (``exit_when_idle_s``) idle with samples partitions never fetched since their assignment
    (``stream.unfetched.Unfetched.overdue``): their samples are unread, so the run fails rather than end as complete."""


def never_fetched(kafka: KafkaSettings, partitions: list[int], waited_s: float) -> SamplesNeverFetched:
    """The error of a bounded run idle with samples ``partitions`` never fetched in ``waited_s``."""
    return SamplesNeverFetched(
        f"learner: {kafka.samples_topic} partition(s) {partitions} were never fetched in {waited_s:.0f} s from "
        f"[kafka] bootstrap_servers={kafka.bootstrap_servers} (their fetches keep failing or never answer: see the "
        "consumer's errors above); their samples are unread, so this bounded run (exit_when_idle_s) fails instead of "
        "ending as if its input were trained: fix the broker or the topic's access and run it again")


def worker_died(exc: BaseException) -> bool:
    """True when ``exc`` is torch telling that a DataLoader worker process died (OOM-killed, a SIGKILL from outside,
    a segfault in a library): the process reading messages is gone, no message's training failed."""
    return isinstance(exc, RuntimeError) and _WORKER_DEATH.search(str(exc)) is not None


def not_the_batch(exc: BaseException) -> bool:
    """True when a failure while training a batch is not its messages' fault and gives them no strikes
    (``stream/strikes.py``): the infrastructure's (:func:`stream.strikes.is_infrastructure`), or a DataLoader worker
    that died on its own. torch raises the worker's death in the training process wherever that process is, in a
    training step as well, and every message of the batch in hand got a strike for it: a few OOM kills dead-lettered
    innocent messages as poison."""
    return is_infrastructure(exc) or worker_died(exc)


_orphan_watch: threading.Thread | None = None  # one per DataLoader worker process
_sigterm_watch: threading.Thread | None = None  # one per DataLoader worker process too

# The reader asks for the samples topic's partitions this often (one metadata request), to read those added while it
# runs; not at every poll
PARTITION_CHECK_S = 15.0
POLL_S = 0.2  # one poll of the consumer waits at most this long for samples
# A gap between two polls longer than this was a stall, not idleness: it counts as one poll (below)
STALL_S = POLL_S + 2.0


def _exit_with_parent(grace_s: float = 2.0) -> None:
    """In a DataLoader worker: end this process once the training process that forked it is gone (SIGKILLed).

    A worker outlives a killed parent in two places: waiting for new samples in :meth:`KafkaSampleDataset.__iter__`
    (which checks its parent, closes its consumer and leaves), and in torch's own worker loop, whose liveness check
    ends the loop but then exits normally: multiprocessing's exit handler joins the data queue's feeder thread,
    blocked for good on a pipe full of batches for the dead parent (only the workers still hold its read end). This
    watcher ends the process from either place, ``grace_s`` after noticing, so the reading loop can close its
    consumer first. Nobody is left to read what it would have delivered."""
    global _orphan_watch
    if _orphan_watch is not None:
        return
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        time.sleep(grace_s)
        os._exit(0)

    _orphan_watch = threading.Thread(target=watch, name="streamrec-orphan-watch", daemon=True)
    _orphan_watch.start()


def _outlive_one_sigterm() -> None:
    """In a DataLoader worker: the first SIGTERM from anyone but the training process is not the worker's to act on;
    a second one ends it, and one from the training process ends it at once.

    A SIGTERM sent to the learner's whole process group or cgroup (systemd's default ``KillMode=control-group``,
    ``kill -TERM -<pgid>``, a supervisor that stops process groups) reached the workers too, which died of it at once;
    the training process, stopping on the same signal, then failed with "DataLoader worker ... is killed by signal:
    Terminated" (raised by torch's SIGCHLD handler wherever it was, in a training step as well) and exited 1 without
    its final checkpoint. Now a worker goes on serving batches until the training process shuts it down as on any
    stop; an operator's second SIGTERM or the end of a stop timeout ends it as before.

    The training process's own SIGTERM (torch's ``terminate()`` of a worker that did not join, multiprocessing's exit
    handler, which then joins it) ends the worker at once, as torch's handler does: outlived, it hung the learner for
    good at its exit after an error raised from the DataLoader (a worker that died while the learner waited for its
    batch). A Python signal handler is not told the sender, so SIGTERM is blocked here, in the thread that goes on to
    make every other one of the worker, and taken by a thread of its own (``sigwaitinfo`` says who sent it)."""
    global _sigterm_watch
    if _sigterm_watch is not None:
        return
    parent = os.getppid()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # what the second one does, once the watcher unblocks it
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def take() -> None:
        first = True
        while True:
            sender = signal.sigwaitinfo({signal.SIGTERM}).si_pid
            if sender == parent:
                os._exit(0)  # as torch's own handler: the training process stops its worker
            if not first:  # unblocked in this thread only, the default action ends the process
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
                os.kill(os.getpid(), signal.SIGTERM)
            first = False
            log.info("DataLoader worker %d got SIGTERM: it goes on until the training process stops it (a second "
                     "SIGTERM ends it now)", os.getpid())

    _sigterm_watch = threading.Thread(target=take, name="streamrec-sigterm-watch", daemon=True)
    _sigterm_watch.start()


class KafkaSampleDataset(IterableDataset):
    def __init__(self, kafka: KafkaSettings, cfg: FeatureConfig, start: dict[int, int], batch_rows: int = 4096,
                 exit_when_idle_s: float | None = None, pin_memory: bool = False,
                 suspects: dict[tuple[int, int], str | None] | None = None, merge: bool = True,
                 future_ts_s: float | None = 3600.0, max_label_delay_s: float | None = None,
                 unsaved: Collection[int] = (), listed: Collection[int] | None = None,
                 shard: tuple[int, int] = (0, 1), limits: EventLimits = DEFAULT_LIMITS) -> None:
        super().__init__()
        self.limits = limits  # [limits], the joiner's: the strings a message may hold (read_samples)
        # The topic's partitions when ``start`` was chosen (the daemon's listing), and this reader's rank of the
        # learner's world size: a partition the topic gains later that this reader owns (rank, then DataLoader
        # worker, the rule ``start`` was split by) is read too, from its first record (None: ``start``'s only)
        self.listed = None if listed is None else frozenset(listed)
        self.shard = shard
        # partitions whose start is no saved offset (a fresh learner, a partition new to its checkpoint): starting
        # below what retention left of them loses nothing this learner was owed, so it is not said or counted
        self.unsaved = frozenset(unsaved)
        # A message with a row whose ts leads this machine's wall clock by more than future_ts_s (as the joiner does
        # for events, [limits] future_ts_s), or whose label_delay_ms is over max_label_delay_s (the joiner's
        # attribution window), is dead-lettered (read_samples); None: no such bound
        self.future_ts_s, self.max_label_delay_s = future_ts_s, max_label_delay_s
        self.merge = merge  # merge the partitions in event time (module docstring); False: as fetched
        self.kafka, self.cfg, self.start = kafka, cfg, dict(start)
        self.batch_rows, self.exit_when_idle_s, self.pin = batch_rows, exit_when_idle_s, pin_memory
        self.suspects = dict(suspects or {})  # (partition, offset) -> poison reason, or None: train it alone
        # A batch also closes at this many embedding values (ids and list values): rows alone do not bound its
        # memory, each message may hold up to MAX_LIST_VALUES list values (stream/samples.py) in one row
        self.max_values = 2 * MAX_LIST_VALUES
        self.reading: tuple[int, ...] = ()  # the partitions the iteration reads now (set by _read; added ones too)

    def _owns(self, p: int) -> bool:
        """Whether partition ``p`` is this reader's: its rank's, then, in a DataLoader worker, that worker's
        (``learner.distributed.partitions_of``, the one rule for both)."""
        info = get_worker_info()
        return bool(partitions_of([p], *self.shard, *((0, 1) if info is None else (info.id, info.num_workers))))

    def _my_partitions(self) -> list[int]:
        info = get_worker_info()
        mine = [p for p in sorted(self.start) if self._owns(p)]
        if info is not None:
            log.info("DataLoader worker %d of %d reads samples partitions %s", info.id, info.num_workers, mine)
        return mine

    def _added(self, consumer: Consumer, known: set[int]) -> list[int]:
        """The partitions of the samples topic, past ``known``, that this reader owns: one metadata request."""
        topic = self.kafka.samples_topic
        try:
            found = consumer.list_topics(topic, timeout=2).topics[topic].partitions
        except (KafkaException, KeyError) as exc:  # the broker away: asked again at the next check
            log.debug("learner: cannot list the partitions of %s (%s); asking again later", topic, exc)
            return []
        return sorted(p for p in found if p not in known and self._owns(p))

    def __iter__(self) -> Iterator[TensorBatch]:
        """The batches of :meth:`_read`; in a DataLoader worker each carries what the worker counted since the one
        before (``learner/worker_counters.py``: the worker's registry is not the one the learner's /metrics serves)
        and the worker's id and the partitions it reads now (added ones too: what a stall names), and a last heartbeat
        says that its reading ended (``learner/worker_stall.py``: a worker that stopped reading is no hung one)."""
        info = get_worker_info()
        if info is None:
            yield from self._read()
            return
        tally = WorkerTally()
        with contextlib.closing(self._read()) as batches:  # closed with this iterator: its consumer too, at once
            for tb in batches:
                tb.worker_counts, tb.worker, tb.worker_partitions = tally.take(), info.id, self.reading
                yield tb
        last = to_tensors_empty(self.cfg, None)
        last.worker, last.worker_done, last.worker_partitions = info.id, True, self.reading
        yield last

    def _read(self) -> Generator[TensorBatch, None, None]:
        if get_worker_info() is not None and multiprocessing.parent_process() is not None:  # a worker process
            _outlive_one_sigterm()  # first: every thread made after it leaves SIGTERM to its watcher
            _exit_with_parent()
        parts = self._my_partitions()
        self.reading = tuple(parts)
        if not parts and self.listed is None:
            return
        known = set(self.listed or ()) | set(self.start)  # partitions the topic had, and those added since
        topic = self.kafka.samples_topic
        consumer = new_consumer(self.kafka, f"{self.kafka.client_id}-samples-reader", **{
            "fetch.max.bytes": 64 * 1024 * 1024, "max.partition.fetch.bytes": 16 * 1024 * 1024})
        dlq: DeadLetters | None = None  # made on the first dead letter
        # a saved start offset below what retention left of a partition: said, counted, started at its first record;
        # a partition without a saved offset starts at its first record silently (nothing was owed to this learner)
        saved = [TopicPartition(topic, p, self.start[p]) for p in parts if p not in self.unsaved]
        fresh = [TopicPartition(topic, p, self.start[p]) for p in parts if p in self.unsaved]
        was = saved + fresh
        try:  # a heartbeat between the start's broker calls (_beating): the iteration may be closed at one
            held, unknown = yield from _beating(_first_held(consumer, fresh), self.cfg)
            starts = (yield from _beating(starting_after_retention(consumer, "learner", saved), self.cfg)) + held
        except BaseException:
            _close_reading(consumer, parts)
            raise
        consumer.assign(starts)
        # records deleted under the running learner (its lag grew past the topic's retention; librdkafka resets the
        # fetch to the earliest offset silently): a gap in a partition's offsets, checked against its first offset.
        # A fresh partition whose first offset the broker did not say expects nothing: librdkafka's start at its first
        # record is no gap (a false loss of every record before it, the review found)
        gaps = Gaps(consumer, "learner")
        gaps.expect(tp for tp in starts if tp.partition not in unknown)
        # Where each partition was assigned (or sought): its position while none of its records came since
        # (stream.kafka.fetched_more), for the idle exit's question whether it has more to read
        at = {tp.partition: tp.offset for tp in starts}
        unfetched = Unfetched(clock=time.monotonic)  # looked up now: tests patch time.monotonic
        beyond = {tp.partition: tp.offset for tp in starts if tp.partition not in self.unsaved and tp.offset > 0}
        passed: dict[tuple[int, int], int] = {}  # (partition, offset) of a message after a loss -> its last offset
        # Records a partition starts past (lost, or before a fresh partition's first record) count as passed: a
        # zero-row batch at the last of them, so the next checkpoint starts past them and a restart before new records
        # neither counts them again nor takes a fresh partition's 0 for a saved offset (the review's false loss).
        skipped = [to_tensors_empty(self.cfg, (now.partition, now.offset - 1, 0))
                   for before, now in zip(was, starts, strict=True) if now.offset > max(before.offset, 0)]
        pending: list[TensorBatch] = []
        rows = values = 0
        # The idle clock (``exit_when_idle_s``, stream.idle_clock): a stall between two polls is no idleness. A wall
        # clock ended the frozen-learner fault test's run at once, "input idle", the samples of the stall untrained.
        idle = IdleClock(STALL_S, POLL_S)
        last_yield = time.monotonic()
        read = partial(read_samples, future_ts_s=self.future_ts_s, max_label_delay_s=self.max_label_delay_s,
                       limits=self.limits)
        merge = EventTimeMerge(parts, read=read) if self.merge and len(parts) > 1 else None

        def behind(p: int) -> bool:
            # not fetched yet counts as more to read: it may hold the oldest rows, and the merge's idle clock
            # bounds the wait (at the start of a backlog the first partition fetched ran days ahead alone)
            return has_more(consumer, topic, p, unknown=True)

        def ordered(msgs: list) -> list:
            """``msgs`` through the merge, as (message, its SampleBatch if decoded already), and the pauses it asks."""
            if merge is None:
                return [(m, None) for m in msgs]
            for m in msgs:
                merge.add(m)
            out = merge.take(behind)
            pause, resume = merge.flow()
            if pause:
                consumer.pause([TopicPartition(topic, p) for p in sorted(pause)])
            if resume:
                consumer.resume([TopicPartition(topic, p) for p in sorted(resume)])
            return out

        # In a DataLoader worker: the training process that forked it. A worker whose parent was SIGKILLed would
        # otherwise wait for new samples for ever (torch's own liveness check runs only between batches), an orphan
        # holding its partitions' consumer.
        parent = os.getppid() if get_worker_info() is not None else None
        next_check = time.monotonic() + PARTITION_CHECK_S
        try:
            yield from skipped
            while True:
                if self.listed is not None and time.monotonic() >= next_check:
                    added = self._added(consumer, known)
                    next_check = time.monotonic() + PARTITION_CHECK_S
                    if added:  # started as a partition without a saved offset is (above), merged as the others
                        known.update(added)
                        parts = sorted(set(parts) | set(added))
                        self.reading = tuple(parts)
                        held, lost_unknown = yield from _beating(
                            _first_held(consumer, [TopicPartition(topic, p, 0) for p in added]), self.cfg)
                        consumer.incremental_assign(held)
                        at.update((tp.partition, tp.offset) for tp in held)
                        gaps.expect(tp for tp in held if tp.partition not in lost_unknown)
                        pending += [to_tensors_empty(self.cfg, (tp.partition, tp.offset - 1, 0)) for tp in held
                                    if tp.offset > 0]
                        if merge is None and self.merge and len(parts) > 1:
                            merge = EventTimeMerge(parts, read=read)
                        elif merge is not None:
                            for p in added:
                                merge.add_partition(p)
                        log.info("learner: samples partition(s) %s added to %s while it reads: reading them from "
                                 "their first record (now %s)", added, topic, parts)
                if parent is not None and os.getppid() != parent:
                    log.warning("the training process is gone: DataLoader worker for partitions %s stops", parts)
                    consumer.close()  # leave the group now, not after a session timeout
                    # Not a return: the worker's batches still queued for the dead parent sit in a pipe whose read
                    # end only the workers hold, so multiprocessing's exit handler (joining the queue's feeder
                    # thread, blocked on the full pipe) would hang the orphan for good. Nobody is left to read them.
                    os._exit(0)
                fetched = consumer.consume(256, POLL_S)
                for m in fetched:  # checked as fetched, not after the merge: the first offset is asked the sooner
                    got = (m.partition(), m.offset())  # set on every consumed message (the stubs say Optional)
                    if m.error() is not None:
                        continue
                    if (gone := gaps.message(topic, *got)) is not None:  # type: ignore[arg-type]
                        passed[got] = gone.low - 1  # type: ignore[index]
                    if beyond:  # (a saved partition's first message: it did not start over)
                        beyond.pop(got[0], None)  # type: ignore[arg-type]
                if beyond and _start_over_past_end(consumer, topic, beyond, at):
                    idle.reset()  # a start again: the idle clock too
                msgs = ordered(fetched)
                idle.tick()
                for m, decoded in msgs:
                    err = m.error()
                    if err is not None:
                        if err.code() != KafkaError._PARTITION_EOF and err.fatal():
                            raise KafkaException(err)
                        continue
                    idle.reset()
                    part, offset = m.partition(), m.offset()
                    assert part is not None and offset is not None  # set on every consumed message
                    pos = (part, offset)
                    if passed and (last_lost := passed.pop(pos, None)) is not None:
                        # the records lost pass as a zero-row batch at the last of them, ahead of this message (as
                        # at a start): a checkpoint that holds it and not this message starts past them
                        pending.append(to_tensors_empty(self.cfg, (part, last_lost, 0)))
                    suspect = pos in self.suspects
                    headers: Headers | None = None  # read once (stream.kafka.headers_of), kept in a dead letter
                    try:
                        headers = headers_of(m)
                        if suspect and self.suspects[pos] is not None:
                            raise BadMessage(str(self.suspects[pos]), kind="poison")
                        sb = decoded if decoded is not None else read(m.value())
                        tb = to_tensors(sb, self.cfg, [(*pos, len(sb))])
                        if (wm := read_watermark(headers, self.future_ts_s, self.max_label_delay_s)) is not None:
                            tb.watermarks = {part: wm}
                    except Exception as exc:  # noqa: BLE001 - whatever a message does, it must not stop the learner
                        bad = exc if isinstance(exc, BadMessage) else BadMessage(
                            f"cannot be turned into tensors: {type(exc).__name__}: {quoted(str(exc))}",
                            kind="undecodable")
                        if dlq is None:
                            dlq = DeadLetters(self.kafka)
                        dlq.send(topic, m.key(), m.value(), bad, *pos, headers)
                        dlq.flush()
                        tb = to_tensors_empty(self.cfg, (*pos, 0))
                        suspect = False
                        if time.monotonic() - last_yield >= 1.0:
                            # a run of dead letters on a slow broker (each flush up to its timeout) handed nothing
                            # over until the fetch's last one, and the worker was named hung (learner/worker_stall.py)
                            yield to_tensors_empty(self.cfg, None)
                            last_yield = time.monotonic()
                    if suspect:  # alone: if training it fails again, only it is blamed
                        if pending:
                            yield self._emit(pending)
                            pending, rows, values = [], 0, 0
                        yield self._emit([tb])
                        last_yield = time.monotonic()
                        continue
                    pending.append(tb)
                    rows += len(tb)
                    values += len(tb.values)
                    if rows >= self.batch_rows or values >= self.max_values:
                        yield self._emit(pending)
                        pending, rows, values = [], 0, 0
                        last_yield = time.monotonic()
                if not msgs and pending:  # nothing more right now: train what we have
                    yield self._emit(pending)
                    pending, rows, values = [], 0, 0
                    last_yield = time.monotonic()
                elif not msgs and time.monotonic() - last_yield >= 1.0:
                    # A heartbeat (no rows, no positions) while idle, so the consumer of this iterator can
                    # react to a stop signal and checkpoint on time even when no data arrives.
                    yield to_tensors_empty(self.cfg, None)
                    last_yield = time.monotonic()
                if (self.exit_when_idle_s is not None and not pending and (merge is None or merge.empty())
                        and idle.idle_s >= self.exit_when_idle_s):
                    # Not while a partition has more to read, by the high watermark its fetcher saw, or its end is
                    # unknown (no fetch answered since its assignment) for Unfetched's grace: a first fetch slower
                    # than the limit (a 105 MB response under load, a slow broker) ended the run "idle" with its whole
                    # input unread. Asked here only, at the limit: a cached-watermark call per partition.
                    if [p for p in parts if unfetched.behind((topic, p), fetched_more(consumer, topic, p, at.get(p)))]:
                        idle.reset()
                        continue
                    if overdue := unfetched.overdue():  # past the grace: unread, not idle (the joiner's rule too)
                        raise never_fetched(self.kafka, [p for _, p in overdue],
                                            unfetched.grace_s + self.exit_when_idle_s)
                    return
        finally:
            _close_reading(consumer, parts)
            dlq = None  # every dead letter was flushed when sent; the producer goes with this iteration

    def _emit(self, pending: list[TensorBatch]) -> TensorBatch:
        tb = concat(pending, self.cfg.num_fields)
        return tb.pin_memory() if self.pin else tb


def sample_loader(dataset: IterableDataset, num_workers: int, prefetch_factor: int, pin_memory: bool,
                  persistent_workers: bool = False, stall_s: float = 0.0) -> DataLoader:
    """The DataLoader both learners train from: ``dataset``'s batches as they are (``batch_size=None``), each handed
    on as soon as its worker has it (``in_order=False``). In order, the loader takes one batch of each worker in
    turn: a worker with nothing to read (caught up, or with fewer partitions than workers) held every other worker
    to its idle heartbeat, one batch a second, however large their backlog. A partition is one worker's and a
    worker's batches keep their order, so each partition's positions still come in offset order (what a
    checkpoint records). Cyclic garbage is collected first where workers will fork: a Kafka client in a reference
    cycle collected in a worker hangs or crashes it (module docstring). ``stall_s`` (> 0, with workers): a wait for a
    batch from any worker ends after at most that long with torch's timeout, waited again and counted by
    ``learner/worker_stall.py`` (every worker hung). Workers are forked, whatever the platform's default start method
    (forkserver from Python 3.14 on Linux, spawn on macOS): under those the dataset was pickled into each worker, and a
    :class:`~stream.secrets.Secret` pickles empty by design, so a SASL password arrived as "" and every worker's
    login was refused."""
    if num_workers:
        gc.collect()
    return DataLoader(dataset, batch_size=None, num_workers=num_workers,
                      multiprocessing_context=multiprocessing.get_context("fork") if num_workers else None,
                      timeout=loader_timeout(stall_s) if num_workers else 0.0,
                      prefetch_factor=prefetch_factor if num_workers else None,
                      persistent_workers=persistent_workers and num_workers > 0, pin_memory=pin_memory,
                      in_order=False)


class EventTimeMerge:
    """Consumed messages of several partitions, handed on oldest first (module docstring). A message whose
    samples cannot be read for their time (an error, a message that will be dead-lettered, an empty one) goes
    on at once, unless earlier messages of its partition are still buffered: then it waits behind them.

    A partition's messages always go on in offset order: the daemon counts a partition as read up to its
    newest message trained (``offset + 1``), so one handed on ahead of its partition's buffered messages
    would have the next checkpoint skip them (a dead-lettered message at offset 7 going on before offsets
    3-6 lost those four messages to a restart)."""

    def __init__(self, partitions: list[int], capacity: int = 8, idle_s: float = 2.0,
                 read: Callable[[bytes | None], SampleBatch] = SampleBatch.decode) -> None:
        self.read = read  # the dataset's decoder with its bounds: a message it refuses has no time here
        self.capacity = capacity  # messages buffered per partition before it is paused
        # A partition that sent nothing for this long (wall clock) holds nobody back, whatever its lag says
        # (Flink's idleness timeout): a quiet partition of a live stream, or one whose lag the broker misreports.
        # The idle clock of a partition runs only while it has nothing buffered and is not paused by the merge
        # itself (a partition held back for a full buffer, or whose buffer is draining, is not quiet), and not
        # before the first message of any partition (the consumer's start is nobody's silence).
        self.idle_s = idle_s
        # That wall clock leaves stalls out (stream.idle_clock: a gap between two calls over STALL_S counts as one
        # poll): a learner stopped past idle_s (SIGSTOP, a long GC pause) woke with every partition quiet, and the
        # one with its messages fetched first ran ahead of the others' older ones.
        self._clock = IdleClock(STALL_S, POLL_S)
        self.last_seen: dict[int, float | None] = {p: None for p in partitions}
        self._started: float | None = None
        self.buffers: dict[int, deque] = {p: deque() for p in partitions}
        self.paused: set[int] = set()
        self._ready: list = []  # messages that need no ordering

    def add(self, m: Message) -> None:
        part = m.partition()
        now = self._clock.tick()
        if self._started is None:
            self._started = now
        if part in self.last_seen:
            self.last_seen[part] = now
        sb = _decode(m, self.read) if m.error() is None else None
        buf = self.buffers.get(part) if part is not None else None
        if sb is not None and len(sb) and buf is not None:
            buf.append((emitted_at(sb), (m, sb)))
        elif buf:  # no time of its own: right behind its partition's buffered messages, with the last one's time
            buf.append((buf[-1][0], (m, sb)))
        else:
            self._ready.append((m, sb))

    def add_partition(self, part: int) -> None:
        """Merge ``part`` too from now on (a partition added to the topic while the learner reads; one the merge has
        already: nothing). Its idle clock starts now: since the merge's start, it would count as quiet at once."""
        if part not in self.buffers:
            self.buffers[part] = deque()
            self.last_seen[part] = None if self._started is None else self._clock.tick()

    def empty(self) -> bool:
        return not self._ready and not any(self.buffers.values())

    def take(self, behind: Callable[[int], bool]) -> list:
        """The messages that may go now, oldest first: while every partition with more to read (``behind``)
        that is not idle has one buffered."""
        out, self._ready = self._ready, []
        heads = [(buf[0][0], p) for p, buf in self.buffers.items() if buf]
        heapq.heapify(heads)
        now = self._clock.tick()
        for p, buf in self.buffers.items():
            if buf or p in self.paused:
                self.last_seen[p] = now

        def quiet(p: int) -> bool:
            seen = self.last_seen[p]
            since = seen if seen is not None else self._started
            return since is not None and now - since >= self.idle_s

        while heads:
            if any(not buf and not quiet(p) and behind(p) for p, buf in self.buffers.items()):
                break  # a partition with more to read has nothing buffered: its next message may be older
            _, p = heapq.heappop(heads)
            out.append(self.buffers[p].popleft()[1])
            if self.buffers[p]:
                heapq.heappush(heads, (self.buffers[p][0][0], p))
        return out

    def flow(self) -> tuple[set[int], set[int]]:
        """(partitions to pause: buffer full, partitions to resume: buffer at half or less)."""
        pause = {p for p, buf in self.buffers.items() if len(buf) >= self.capacity and p not in self.paused}
        resume = {p for p in self.paused if len(self.buffers[p]) <= self.capacity // 2}
        self.paused = (self.paused - resume) | pause
        return pause, resume


def emitted_at(sb: SampleBatch) -> int:
    """The event time the joiner put out ``sb``'s first row at: its impression time plus the label delay (a
    delayed positive goes out at its click; an observed 0 at its impression, es_dfm's after its elapsed time).
    Keying a message by its impression time alone would hand a message that starts with a delayed positive
    up to a window early, and train it before other partitions' impressions of the minutes in between."""
    return int(sb.batch.column("ts")[0].as_py()) + int(sb.batch.column("label_delay_ms")[0].as_py())


def read_samples(raw: bytes | None, future_ts_s: float | None = None, max_label_delay_s: float | None = None,
                 limits: EventLimits = DEFAULT_LIMITS) -> SampleBatch:
    """``SampleBatch.decode`` and the bounds that need the learner's settings or clock: how far a row's ``ts``
    may lead this machine's wall clock (``future_ts_s``) and how long its ``label_delay_ms`` may be
    (``max_label_delay_s``: the joiner's attribution window, which every delay it writes is within); None: no
    bound. One row's clock must not move the learner's event time (id ages, bucket decay, TTL sweeps) or the
    calibration clock (``ts + label_delay_ms``), nor merge its partition last. And the strings the learner keeps
    within ``limits`` (``[limits]``, the joiner's): :func:`check_strings`. Raises :class:`BadMessage`
    (``future_ts``, ``bad_value``, ``too_large``)."""
    sb = SampleBatch.decode(raw)
    check_strings(sb, limits)
    if max_label_delay_s is not None and len(sb):
        longest = int(sb.column("label_delay_ms").max())
        if longest > max_label_delay_s * 1000:
            raise BadMessage(f"column 'label_delay_ms': a delay of {longest / 1000:.0f} s, over [learner] "
                             f"attribution_window_s={max_label_delay_s:g} (the joiner's window)", kind="bad_value")
    if future_ts_s is not None and len(sb):
        newest = int(sb.column("ts").max())
        now = int(time.time() * 1000)
        if newest - now > future_ts_s * 1000:
            raise BadMessage(f"column 'ts': a row {(newest - now) / 1000:.0f} s ahead of the learner's clock, over "
                             f"[learner] future_ts_s={future_ts_s:g}", kind="future_ts")
    return sb


def check_strings(sb: SampleBatch, limits: EventLimits) -> None:
    """Raise :class:`BadMessage` (``too_large``) for an impression id over ``[limits] max_str_len`` characters, the
    bound the joiner's decoder puts on every id it joins. The learner keeps impression ids (the duplicate filter
    ``RecentIds`` and served quality's waiting impressions, both in every checkpoint, up to ``dedup_window`` of
    them): bounded only by the 16 MiB message, a producer writing 1 MiB ids grew its memory and checkpoints by
    gigabytes. And for a context or dense column whose name (past ``ctx.`` / ``dense.``) is over ``[limits]
    max_key_len``, the joiner's bound on the event keys it names them after: a fresh learner takes its fields' names
    from the first messages and keeps them in every checkpoint and artifact."""
    for name in (*sb.context_names, *sb.dense_names):
        if len(name) > limits.max_key_len:
            raise BadMessage(f"column {shown(name, 80)}: a feature name of {len(name)} chars, over [limits] "
                             f"max_key_len={limits.max_key_len} (the joiner's bound on context and dense keys)",
                             kind="too_large")
    imp = sb.batch.column("impression_id")
    longest = pc.max(pc.utf8_length(imp)).as_py() if len(imp) else 0
    if longest > limits.max_str_len:
        raise BadMessage(f"column 'impression_id': an id of {longest} chars, over [limits] max_str_len="
                         f"{limits.max_str_len} (the joiner's bound on ids)", kind="too_large")


def read_watermark(headers: Headers | None, future_ts_s: float | None = None,
                   window_s: float | None = None) -> int | None:
    """``watermark_of`` the message's headers, and the bound that needs the learner's clock: a watermark leading it by
    more than ``future_ts_s`` (None: no bound) + ``window_s`` (the attribution window, ``max_label_delay_s``; None: 0)
    is none the joiner wrote (its watermark is an event time it took, within its own ``future_ts_s`` of its clock, or
    at a drain that time + the window, ``stream/joiner/engine.py``); one would close every impression of its
    partition, for good (``learner/served.py``: a partition's watermark never goes back). Raises :class:`BadMessage`
    (``future_ts``)."""
    window_ms = int(window_s * 1000) if window_s is not None else 0
    wm = watermark_of(headers, window_ms)
    if wm is not None and future_ts_s is not None:
        now = int(time.time() * 1000)
        if wm - now > future_ts_s * 1000 + window_ms:
            raise BadMessage(f"a streamrec-watermark header {(wm - now) / 1000:.0f} s ahead of the learner's clock, "
                             f"over [learner] future_ts_s={future_ts_s:g} + attribution_window_s={window_ms / 1000:g}",
                             kind="future_ts")
    return wm


def _decode(m: Message, read: Callable[[bytes | None], SampleBatch]) -> SampleBatch | None:
    """The message's samples (None: undecodable; the reader decodes it again and dead-letters it)."""
    try:
        return read(m.value())
    except Exception:  # noqa: BLE001 - whatever is wrong with it, the reader says so in its dead letter
        return None


def _close_reading(consumer: Consumer, parts: list[int]) -> None:
    """Close a reading's ``consumer`` (of ``parts``), where the reading ends (its start too: closed at a heartbeat of
    :func:`_beating`). A close that fails is raised after a clean end; as an error ends the reading (a GeneratorExit
    too) it is logged, and that error goes on: a failing close must not hide it."""
    failing = sys.exc_info()[1]
    try:
        consumer.close()
    except Exception as exc:
        if failing is None:
            raise
        log.warning("closing the consumer of partitions %s failed too (%s: %s) as %s ended the reading", parts,
                    type(exc).__name__, exc, type(failing).__name__)


def _first_held(consumer: Consumer, starts: list[TopicPartition],
                ) -> Generator[None, None, tuple[list[TopicPartition], set[int]]]:
    """``starts`` moved up to their partitions' first record still held (the low watermark), without a word: for
    partitions with no saved offset, which retention cannot have taken anything from; and the partitions whose first
    record the broker could not say (unmoved: librdkafka starts them at the earliest offset all the same). Yields
    after each partition's broker call (10 s at most each, not all of them: :func:`_beating`)."""
    out, unknown = [], set()
    for tp in starts:
        try:
            low = consumer.get_watermark_offsets(TopicPartition(tp.topic, tp.partition), timeout=10)[0]
        except KafkaException:
            low = -1
            unknown.add(tp.partition)
        out.append(TopicPartition(tp.topic, tp.partition, max(tp.offset, low)))
        yield
    return out, unknown


def _beating(steps: Generator[None, None, _R], cfg: FeatureConfig, every_s: float = 1.0,
             ) -> Generator[TensorBatch, None, _R]:
    """``steps`` (a reader's broker calls, one per partition: :func:`_first_held`,
    ``stream.retention.starting_after_retention``) run to their result, an idle heartbeat handed over between two of
    them at most every ``every_s``, as while the reader waits for samples. Without it a worker starting on a slow broker
    (a watermark query per partition, each up to its 10 s timeout) handed nothing over for minutes and was named hung
    (``learner/worker_stall.py``) and the learner stopped; a worker hung inside one call still hands nothing over."""
    last = time.monotonic()
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
        if time.monotonic() - last >= every_s:
            yield to_tensors_empty(cfg, None)
            last = time.monotonic()


def _start_over_past_end(consumer: Consumer, topic: str, beyond: dict[int, int], at: dict[int, int]) -> bool:
    """Partitions (``beyond``: partition -> saved start, none of its messages read yet) whose end, as the first fetch
    response said it (the true end on Tansu too, ``stream.kafka.has_more``), is below their saved start: the topic was
    deleted and created again since the checkpoint (its offsets started over), and the learner goes on from the new
    partition's first record, as librdkafka's reset on Apache Kafka does. Tansu answered such a fetch with nothing and
    no error: the learner waited at the saved offset in silence, and the new records below it were never trained. A
    new topic already past the saved offset cannot be told by offsets: the daemons compare its topic id with the
    checkpoint's and read it from its first record (``learner.checkpoint_format.same_topic``). A log truncated under the
    learner (data lost on the broker) is taken the same way: its records before the end are trained again. Returns
    whether a partition started over; ``at`` (partition -> where it was assigned or sought) gets its new start."""
    again = False
    for p, start in list(beyond.items()):
        low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), cached=True)
        if high < 0:  # no fetch response yet
            continue
        if high < start:
            log.error("learner: %s partition %d ends at offset %d, before the checkpoint's offset %d: the topic was "
                      "deleted and created again (its offsets started over). Training its records from offset %d",
                      topic, p, high, start, max(low, 0))
            try:
                consumer.seek(TopicPartition(topic, p, max(low, 0)))
            except KafkaException as exc:
                log.warning("learner: cannot seek %s partition %d to its start yet (%s); trying again", topic, p, exc)
                continue
            at[p], again = max(low, 0), True
        del beyond[p]
    return again


def to_tensors_empty(cfg: FeatureConfig, pos: tuple[int, int, int] | None) -> TensorBatch:
    """A zero-row batch: the position of a skipped (dead-lettered) message, or an idle heartbeat (None)."""
    import numpy as np

    return TensorBatch(torch.zeros(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                       torch.zeros((0, len(cfg.dense))), torch.zeros(0), np.zeros(0, object),
                       np.zeros(0, np.int64), [pos] if pos is not None else [],
                       keys=np.zeros(0, np.int64) if cfg.keyed else None, label_delay_ms=np.zeros(0, np.int64))

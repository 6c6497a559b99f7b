"""``streamrec join --driver kafka``: :class:`~stream.joiner.pipeline.JoinPipeline` on a plain
confluent-kafka consumer, for throughput (faust's per-event asyncio machinery caps one worker at
~6-13 k events/s on two cores; this loop is bounded by the join itself, see bench/joiner.py).

Same semantics as the faust driver: a consumer group over ``impressions`` and ``clicks`` with the
range assignor (partition p of both topics goes to the same member, the topics being
co-partitioned), batches of ``batch_max`` messages, and offsets committed only after
:meth:`JoinPipeline.process` made the batch's outputs and state durable. Revoked partitions are
forgotten after a final commit of what was processed, lost ones (the member dropped) without it;
assigned ones are restored from the state log on first use. An exception in a batch stops the worker: its
offsets are never committed, not even by the revocation that ``close()`` triggers in ``finally`` (the batch's
messages got their strikes, see ``stream/strikes.py``; the process exits non-zero for its supervisor to restart it).

Event time is kept aligned by the hold: the records of a partition past its event-time frontier
(``backpressure.hold_limits``: one fetch can bring an input months ahead of the other) are held back, kept in
memory (by the pipeline: ``JoinPipeline.process_new``, a held record costs nothing per batch it waits) and joined
with a later batch, their offsets committed only then (a crash or a revocation reads them again). An input is paused
only for memory (``backpressure.hold_bounds``): once 16 batches of its records are held (fewer where a worker has
more than 4 partitions: 64 batches in all), until no more than a quarter of that are; clicks sooner, since held clicks
join into the waiting ones, within their cap. A pause purges the consumer's prefetched messages and a resume fetches
them again, so the two marks are set apart. The gate's event-time rule, which paused an input whose read time led
the other's by the drift, is not used here: the hold already bounds what is joined by the same drift, and that rule
paused and resumed inputs with nearly every batch of a replay (~25 of ~70 s of a replayed ML-1M went to re-fetching).
Clicks near ``max_waiting_per_partition`` are still paused by the gate (``backpressure.py``) until their impressions
catch up; the gate is asked after every batch, and a run never ends idle with an input paused or records held, nor
before every assigned input is read to its end (``backpressure.unread``; idleness counts from then), nor with status 0
while an input was never fetched (``backpressure.never_fetched``: every fetch of it failing). A member assigned no
partition ends its run idle too, once that empty assignment came (not during a rebalance: ``_settled``).

A failure of the infrastructure (the broker or Redis unreachable, a delivery not acknowledged) is
not the batch's fault: the worker recovers in-process instead. It forgets its in-memory state, seeks
every assigned partition back to its committed offset, waits (1 s, doubling up to 30 s) and goes
on; the state log restores what was durable, and what was not is done again. So a Redis or broker
restart needs no human. A rebalance during such a failure is ridden out too: the partition layout check and the start
positions of assigned partitions (the group's committed offsets) are asked again, with the same backoff, until the
broker answers or the worker is told to stop (``_start_positions``; counted in ``streamrec_join_assign_retries_total``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from operator import attrgetter
from typing import Any, cast

from confluent_kafka import (
    OFFSET_BEGINNING,
    TIMESTAMP_NOT_AVAILABLE,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
)

from stream.config import KafkaSettings
from stream.errors import BadMessage, close_after_error, quoted
from stream.idle_clock import IdleClock
from stream.joiner.backpressure import (
    CLICKS,
    InputGate,
    InputPauses,
    Key,
    never_fetched,
    topic_of,
    unread,
)
from stream.joiner.config import JoinerSettings
from stream.joiner.metrics import ASSIGN_RETRIES
from stream.joiner.pipeline import JoinPipeline
from stream.joiner.records import Record, records_of
from stream.kafka import (
    BATCH_MESSAGES,
    Headers,
    consumer_config,
    fetched_more,
    headers_of,
    headers_whole,
    heartbeat_interval_s,
    resume_offsets,
)
from stream.retention import Gaps
from stream.stop_signals import put_back_signals, take_stop_signals
from stream.strikes import RECOVERY_BACKOFF_S, is_infrastructure
from stream.unfetched import Unfetched

log = logging.getLogger("streamrec.join")

_TOPIC_PARTITION = attrgetter("topic", "partition")  # of a Record
_POLL_S = 0.05  # one poll of _fetch: how long a batch in hand waits for the consumer to bring more
# librdkafka postpones a partition's next fetch by this long once its local queue is over queued.min.messages (100 k):
# its default, 1 s, left a replay's worker waiting on empty polls once it had drained a click partition's queue while
# the impressions were paused for their held records (ML-1M: 82 empty polls, 1.9 s of a 34 s span; none at 20 ms).
_FETCH_QUEUE_BACKOFF_MS = 20
_STALL_S = 2.0  # a round (fetch, batch, gate) longer than batch_within_s by this much was a stall, not idleness (run())


def _records(msgs: list[Message], gaps: Gaps | None = None) -> list[Record]:
    """The fetched messages as records, column by column (each column one C-level pass); errors logged or raised.
    With ``gaps``: records lost to retention under the running worker said and counted (a few C-level passes more,
    ``stream.retention.Gaps.batch``)."""
    errors = list(map(Message.error, msgs))
    if any(e is not None for e in errors):
        for err in errors:
            if err is not None and err.fatal():
                raise KafkaException(err)
            if err is not None and err.code() != KafkaError._PARTITION_EOF:
                log.warning("consumer: %s", err)
        msgs = [m for m, e in zip(msgs, errors, strict=True) if e is None]
    # -1 where a message has no timestamp: the wall clock bounds its ts (stream.events.ts_bound_ms)
    stamps = [ts if kind != TIMESTAMP_NOT_AVAILABLE else -1 for kind, ts in map(Message.timestamp, msgs)]
    # a consumed record always has its topic, partition and offset (the stubs say Optional)
    topics, partitions, offsets = list(map(Message.topic, msgs)), list(map(Message.partition, msgs)), list(
        map(Message.offset, msgs))
    if gaps is not None:
        gaps.batch(topics, partitions, offsets)  # type: ignore[arg-type]
    return records_of(topics, partitions, offsets, map(Message.key, msgs), map(Message.value, msgs), stamps,
                      _headers(msgs))


def _headers(msgs: list[Message]) -> list[Headers | BadMessage | None]:
    """Each message's headers, or why they cannot be read (``stream.kafka.headers_of``: a header key that is not
    UTF-8, which another producer may write), for the pipeline to dead-letter it. One C-level pass where no message has
    headers (the usual case), and one more over all their pairs where some have (``headers_whole``); only where that
    finds a broken pair are those with headers checked one by one, and all of them after confluent-kafka raised for one
    (its ``headers()`` returns the list it built the first time, a broken one unread)."""
    try:
        headers = cast(list[Headers | BadMessage | None], list(map(Message.headers, msgs)))  # consumed: (str, bytes)
    except (SystemError, UnicodeDecodeError):
        return list(map(_headers_or_why, msgs))
    if any(headers) and not headers_whole(cast(list[Headers | None], headers)):
        return [h if h is None else _headers_or_why(m) for m, h in zip(msgs, headers, strict=True)]
    return headers


def _headers_or_why(msg: Message) -> Headers | BadMessage | None:
    try:
        return headers_of(msg)
    except BadMessage as exc:
        return exc


class KafkaJoinWorker:
    def __init__(self, pipeline: JoinPipeline, kafka: KafkaSettings, js: JoinerSettings) -> None:
        self.pipeline, self.kafka, self.js = pipeline, kafka, js
        self._stop = False
        self._offsets: dict[tuple[str, int], int] = {}  # next offset to commit: processed batches only
        # per topic-partition, the group's committed offset at its last start position (_start_positions, _recover):
        # every record below it was processed or dead-lettered (_unprocessed)
        self._done: dict[tuple[str, int], int] = {}
        self._backoff_s = RECOVERY_BACKOFF_S[0]
        self.recoveries = 0
        self.assign_retries = 0  # layout or start positions of assigned partitions asked again (_start_positions)
        self._held = 0  # records fetched past the event-time frontier, held by the pipeline, not processed yet
        self._hold = js.backpressure and js.max_input_drift_s is not None
        self._assigned: set[int] = set()  # the partitions assigned now (of both topics: co-partitioned)
        # an assignment came (perhaps empty: more members than partitions) and no revocation since: a member may end
        # its run idle only then, outside a rebalance (librdkafka calls on_assign and on_revoke with empty lists too)
        self._settled = False
        self._revoked: set[tuple[str, int]] = set()  # revoked by the poll in progress (_fetch)
        # ``exit_when_idle_s``'s clock, one tick a round (run()); a round longer than batch_within_s by _STALL_S was a
        # stall, which restarts idleness after a wait of two heartbeats (stream.idle_clock)
        self._idle = IdleClock(js.batch_within_s + _STALL_S, None, after_stall_s=2 * heartbeat_interval_s(kafka))
        # The gate's waiting-click rule only; event time is the hold's (module docstring). Without the hold (no drift
        # configured, or backpressure off) the gate has no event-time rule either.
        self.gate = InputGate(js.max_waiting_per_partition, enabled=js.backpressure, headroom=js.batch_max,
                              max_drift_ms=None)
        self.pauses = InputPauses(self.gate, js.batch_max)  # what the consumer has paused: the gate's and the hold's
        self.unfetched = Unfetched()  # an input not fetched yet since its assignment: behind, for a while
        self.consumer = Consumer(consumer_config(
            kafka, js.app_id, **{"partition.assignment.strategy": "range", "enable.partition.eof": False,
                                 "fetch.max.bytes": 16 * 1024 * 1024,
                                 "fetch.queue.backoff.ms": _FETCH_QUEUE_BACKOFF_MS}))
        # each partition's next offset expected: a fetch past it that skipped records retention deleted under the
        # running worker (librdkafka resets an out-of-range position to the earliest offset silently) is said
        self.gaps = Gaps(self.consumer, "joiner")

    def _commit(self) -> None:
        """Commit the processed offsets. A commit that fails (a rebalance under way, the coordinator away) keeps them
        for the next one: their batches' state is durable already, so until then a restart or the partitions' next
        owner reads them again and skips what the state log applied. It used to raise out of the run loop and stop
        the worker, a batch after its outputs were made durable."""
        if self._offsets:
            t0 = time.monotonic()
            try:
                self.consumer.commit(offsets=[TopicPartition(t, p, o) for (t, p), o in self._offsets.items()],
                                     asynchronous=False)
                self._offsets.clear()
            except KafkaException as exc:
                log.warning("offset commit failed (%s); kept for the next commit (the batches' state is durable: "
                            "what is read again is skipped)", quoted(str(exc)))
            self.pipeline.totals.stage_s["commit"] += time.monotonic() - t0

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._commit()
        self._on_lost(consumer, partitions)

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Partitions taken away without a revocation (the member dropped from the group: a batch past
        ``max.poll.interval.ms``, a session timed out): forgotten as revoked ones, but nothing is committed, they have
        another owner already. The revocation path's commit, made here as a member of no generation, was taken by the
        local broker over the new owner's assignment and moved the group's offsets to where the dropped member got."""
        revoked = {(tp.topic, tp.partition) for tp in partitions}
        self._revoked |= revoked
        self._settled = False
        for tp in revoked:  # not committed now: never later, by a member that no longer owns them
            self._offsets.pop(tp, None)
        self._assigned -= {tp.partition for tp in partitions}
        self.unfetched.forget(tp.partition for tp in partitions)
        self.gaps.forget(revoked)
        self.pipeline.drop_held(revoked)  # the next owner reads them
        self._held = sum(self.pipeline.held_counts.values())
        self.gate.release({tp.partition for tp in partitions if tp.topic == self.kafka.impressions_topic})
        try:  # a pause must not outlive the assignment it was made in
            self._sync_pauses()
        except KafkaException as exc:
            log.debug("resume of revoked partitions: %s", exc)
        self.pipeline.forget({tp.partition for tp in partitions if tp.topic == self.kafka.impressions_topic})

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        log.info("assigned %s", sorted((tp.topic, tp.partition) for tp in partitions))
        positions = self._start_positions(consumer, partitions)
        if positions is None:  # told to stop while the broker could not say: assigned, never read (run() ends)
            consumer.assign(partitions)
            consumer.pause(partitions)
            return
        consumer.assign(positions)
        self.gaps.expect(positions)
        self._assigned |= {tp.partition for tp in partitions}
        self.unfetched.forget(tp.partition for tp in partitions)
        self.pauses.resize(len(self._assigned))
        self._idle.reset()
        self._settled = True

    def _start_positions(self, consumer: Consumer, partitions: list[TopicPartition]) -> list[TopicPartition] | None:
        """``resume_offsets`` of the assigned ``partitions``, asked again (1 s, doubling up to 30 s) while the broker
        cannot answer (its committed offsets or watermarks timed out, the coordinator away); None when the worker is
        told to stop meanwhile. An exception out of this rebalance callback used to stop the process (exit 1, its
        supervisor restarting it) at every broker hiccup during a rebalance. The partition layout is checked first, in
        the same loop (``Layout.assigned``: partitions added to the inputs, an admin metadata request): topics that
        disagree stop the worker (its ConfigError, exit 2), a broker that cannot say is asked again the same way.

        Waiting here, inside librdkafka's callback, is safe: the callback runs on this thread, within ``consume()``,
        so nothing is fetched or processed meanwhile and nothing is committed for partitions not assigned yet;
        librdkafka's own threads keep the group's heartbeats going, and if the group moves on meanwhile (a member
        that waits past ``max.poll.interval.ms`` is dropped from it), the revocation that follows comes as usual
        once this returns. A failure that is no infrastructure's (a bug) is raised as before."""
        backoff = RECOVERY_BACKOFF_S[0]
        while True:
            try:
                self.pipeline.layout.assigned(tp.partition for tp in partitions)  # no request once it has passed
                starts = resume_offsets(consumer, partitions, "joiner")
                self._remember_done(consumer, starts)
                return starts
            except Exception as exc:
                if not is_infrastructure(exc):
                    raise
                self.assign_retries += 1
                ASSIGN_RETRIES.inc()
                log.warning("could not read the partition layout or start positions of assigned partitions %s (%s: "
                            "%s); asking again in %.1f s (they are not read until then)",
                            sorted((tp.topic, tp.partition) for tp in partitions), type(exc).__name__,
                            quoted(str(exc)), backoff)
            self._wait(backoff)
            if self._stop:
                log.warning("stopping before the start positions of %s could be read: they are left unread",
                            sorted((tp.topic, tp.partition) for tp in partitions))
                return None
            backoff = min(RECOVERY_BACKOFF_S[1], backoff * 2)

    def run(self) -> int:
        handlers: dict[int, Any] = {}  # the process's own SIGTERM/SIGINT dispositions, put back when the run ends
        take_stop_signals(handlers, self._on_signal)
        limit = self.js.exit_when_idle_s
        status = 0
        try:
            self.consumer.subscribe([self.kafka.impressions_topic, self.kafka.clicks_topic],
                                    on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_lost)
            self._idle.reset()
            while not self._stop:
                t0 = time.monotonic()
                msgs = self._fetch()
                self.pipeline.totals.stage_s["fetch"] += time.monotonic() - t0  # incl. waiting for data
                self.pipeline.awake.tick()  # a round ran: a quiet click input's time counts (a stall's does not)
                fetched = _records(msgs, self.gaps)
                idle = not fetched
                if fetched or self._held or self.pipeline.topics_due():
                    if not self._process(fetched, self._holds_back if self._hold else None):
                        continue
                resumed = self._apply_gate()
                # a stall (the process stopped, a long GC pause, a swapping host) is no idleness: woken past its
                # session, the member learns its partitions are gone a poll later, and taken for idle at once it
                # drained its stale joins as samples labelled 0 (as the faust driver did: worker.py). The whole
                # round is timed: a stall can come after the fetch too (the gate asks the broker every round)
                idle_s = self._idle.tick()  # below 0 for two heartbeats after a stall
                if resumed and idle:
                    self._idle.reset()  # clicks resumed: not idle while they are read
                elif idle and limit is not None and unread(self._assigned, self._behind, self.pauses.paused):
                    self._idle.reset()  # an input not read to its end yet (backpressure.unread): no idleness
                elif idle and limit is not None and idle_s >= limit:
                    if self._held:  # never end a run with records held back: join them first
                        if not self._process([], None):
                            continue
                        self._idle.reset()
                    elif self.gate.paused:  # nor with an input held back: read it first
                        self.gate.release()
                        self._sync_pauses()
                        self._idle.reset()
                    elif overdue := self.unfetched.overdue():  # nor as idle with an input never fetched
                        status = never_fetched(overdue, self.unfetched.grace_s + limit)
                        break
                    elif self._settled:  # (a member assigned nothing too: it waited for partitions for good)
                        break
            if self.js.drain_at_exit and not self._stop and not status:  # input complete, not a signal
                # every assigned partition, those that brought no record since their assignment too (not restored)
                self.pipeline.restore(self._assigned)
                # an input that restore found made again gets its first offset committed before the drain's chunks
                # record the new topic's id: left the old topic's, the next start read on from it, no start over
                self._started_over([])
                self.pipeline.drain()
            self._commit()
        except BaseException:  # a close that fails too (its revocation callback) must not replace the error
            close_after_error(self.consumer.close, "closing the joiner's consumer", log)
            raise
        else:
            self.consumer.close()
        finally:  # whatever the close raised: left installed, a later SIGTERM went to this finished worker
            put_back_signals(handlers)
        return status

    def _fetch(self) -> list[Any]:
        """The next batch: up to ``batch_max`` messages within ``batch_within_s``, but no longer than it takes the
        consumer to run dry once something is in hand. One ``consume(batch_max, batch_within_s)`` waits out the whole
        window whenever fewer than ``batch_max`` messages can come, which in a backlog means an input paused by the
        gate or a hold while the rest runs dry. So while an input is paused, short polls: the batch grows while
        messages keep arriving and goes as soon as a poll brings none. Otherwise (a live stream) the whole window, as
        one consume: a trickle of events still makes one batch per window, not one per poll.

        A poll that serves a rebalance leaves the messages of the earlier polls in hand: those of the partitions it
        revoked are dropped, unprocessed and not committed (their owner reads them again from the committed offset,
        this worker too where they are assigned back; joined here, they were restored and written to the state log
        beside the new owner's, committed, and the partition's engine kept, stale, for when it came back). Within one
        poll librdkafka drops them itself; the poll's own messages are of the new assignment."""
        got: list[Any] = []
        self._revoked = set()
        deadline = time.monotonic() + self.js.batch_within_s
        while len(got) < self.js.batch_max and (left := deadline - time.monotonic()) > 0:
            paused = self.pauses.paused
            msgs = self.consumer.consume(self.js.batch_max - len(got), min(left, _POLL_S) if paused else left)
            if self._revoked:  # this poll served a revocation: what the earlier ones brought of it goes
                revoked, self._revoked = self._revoked, set()
                got = [m for m in got if (m.topic(), m.partition()) not in revoked]
            if not msgs and got and paused:
                break
            got.extend(msgs)
        return got

    def _process(self, records: list[Record], behind: Callable[[str, int], bool] | None) -> bool:
        """Join ``records`` (all, or up to their event-time frontier with ``behind``; those read again below the
        committed offsets left out, ``_unprocessed``) and commit what was joined; False when an infrastructure failure
        rewound the worker instead (``_recover``). The restore comes first: an input it finds made again is read
        from its first record (``_started_over``) before any floor drops the new topic's records."""
        try:
            # Every assigned partition's state in one read of the state log (each read costs a consumer's start-up
            # and an end-of-partition wait), not one read per partition as each first appears in a batch.
            if missing := self._assigned - set(self.pipeline.engines):
                self.pipeline.restore(missing)
            # an input made again under the running consumer (its records below what its engine applied, or the
            # periodic check of the topics' ids) is read from its first record (_started_over)
            if below := self.pipeline.below_applied(records):
                self.pipeline.regressed(below)
            self.pipeline.check_topics()
            records = self._unprocessed(self._started_over(records))
            if not records and not self._held:
                return True
            self.pipeline.process_new(records, behind)  # raises: nothing of this batch is ever committed
        except Exception as exc:
            if not is_infrastructure(exc):
                raise
            self._recover(exc)
            return False
        done = self.pipeline.processed  # per topic-partition, the offset after the last record processed
        self._offsets.update(done)
        self._commit()
        held = sum(self.pipeline.held_counts.values())
        if done or held != self._held:
            self._idle.reset()
        self._held = held
        self._backoff_s = RECOVERY_BACKOFF_S[0]
        return True

    def _holds_back(self, kind: str, partition: int) -> bool:
        """``InputPauses.holds_back`` over this consumer: whether ``kind`` of ``partition`` bounds what is joined."""
        waiting = self.pipeline.waiting().get(partition, 0) if kind == CLICKS else 0
        return self.pauses.holds_back(kind, partition, waiting, self._behind)

    def _topic(self, kind: str) -> str:
        return topic_of(self.kafka, kind)

    def _behind(self, kind: str, partition: int) -> bool:
        """Whether ``kind`` of ``partition`` has more to read: past what the consumer handed out, by the high watermark
        its fetcher saw, from where it was assigned while nothing came since (``Gaps.next``); not fetched yet since the
        assignment: yes, for a while (``Unfetched``)."""
        topic = self._topic(kind)
        more = fetched_more(self.consumer, topic, partition, self.gaps.next.get((topic, partition)))
        return self.unfetched.behind((kind, partition), more)

    def _apply_gate(self) -> set[Key]:
        """Pause and resume inputs as the gate says; returns the ones resumed."""
        pause, resume = self.gate.update(self.pipeline.waiting(), self.pipeline.input_times(), self._behind)
        if pause:
            log.info("paused for backpressure: %s", sorted(pause))
        return self._sync_pauses() & resume

    def _sync_pauses(self) -> set[Key]:
        """Pause what the gate or a hold wants paused and resume the rest; returns the inputs resumed."""
        pause, resume = self.pauses.sync(self.pipeline.held_per_input())
        self.pipeline.clicks_held = {p for k, p in self.pauses.paused if k == CLICKS}
        if pause:
            self.consumer.pause([TopicPartition(self._topic(k), p) for k, p in sorted(pause)])
        if resume:
            self.consumer.resume([TopicPartition(self._topic(k), p) for k, p in sorted(resume)])
        return resume

    def _wait(self, seconds: float) -> None:
        """Sleep ``seconds``, or less when the worker is told to stop meanwhile (looked at every 0.1 s)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not self._stop:
            time.sleep(min(0.1, seconds))

    def _recover(self, exc: BaseException) -> None:
        """Back to the last durable point after an infrastructure failure (module docstring)."""
        log.warning("infrastructure failure (%s: %s); rewinding to the committed offsets and retrying in %.0f s",
                    type(exc).__name__, quoted(str(exc)), self._backoff_s)
        self.recoveries += 1
        self._offsets.clear()
        self.pipeline.drop_held(set(self.pipeline.held_counts))  # never committed: the rewind reads them again
        self._held = 0
        self.pipeline.forget(set(self.pipeline.engines))
        self.gate.release()  # the rewind starts both inputs afresh
        self._sync_pauses()
        self._wait(self._backoff_s)
        self._backoff_s = min(RECOVERY_BACKOFF_S[1], self._backoff_s * 2)
        try:
            assigned = self.consumer.assignment()
            self.gaps.forget((tp.topic, tp.partition) for tp in assigned)  # where a failed seek leaves them: unknown
            starts = resume_offsets(self.consumer, assigned, "joiner")
            self._remember_done(self.consumer, starts)
            for tp in starts:
                self.consumer.seek(tp)
                self.gaps.expect([tp])
        except KafkaException as err:  # the broker is still away: the next batch fails again and comes back here
            log.warning("could not rewind yet: %s", err)
        # A rewind is not idleness: what follows must be read again before an idle exit may drain (which needs
        # Redis, and would fail, or finish the join on a partial read).
        self._idle.reset()

    def _remember_done(self, consumer: Consumer, starts: list[TopicPartition]) -> None:
        """Where a start position (``resume_offsets``) lies below the group's committed offset by at most one record
        batch, that offset: every record below it was processed. ``resume_offsets`` starts there on a broker whose high
        watermark lags (the local Tansu reports its last record batch's start + 1), and those records come again. A
        committed offset further on is a topic deleted and made again (its offsets started over): its records are
        the new topic's, which the join takes (``pipeline``'s topic ids), so no floor; none either where the start is
        the committed offset (Apache Kafka, at every assignment). One within a batch of a new topic's end goes with its
        restore (``_started_over``)."""
        committed = {(tp.topic, tp.partition): tp.offset for tp in consumer.committed(starts, timeout=10)}
        for tp in starts:
            key = (tp.topic, tp.partition)
            self._done.pop(key, None)  # an earlier assignment's, not read up to
            if 0 <= tp.offset < committed.get(key, -1) <= tp.offset + BATCH_MESSAGES + 1:
                self._done[key] = committed[key]

    def _started_over(self, records: list[Record]) -> list[Record]:
        """``records`` less those of the inputs a restore found deleted and made again (``pipeline.started_over``: the
        state log's offsets are of another topic id than the topic's now), which are sought to their first record and
        lose their floor (``_remember_done``). The group's committed offset there is the old topic's too: a new topic
        with fewer records than it started at its high watermark - 1 (``resume_offsets``) and the floor dropped every
        new record below the old offset as processed, in silence (the broker keeps no commit metadata to tell). So the
        new topic's first offset is committed for the group at once, before anything of it is joined: left the old
        topic's until the first commit, a crash or a rewind after a batch's state was durable started at it again, the
        state's topic id now the topic's (no start over), and the records between the state and it were never joined."""
        again = self.pipeline.take_started_over()
        if not again:
            return records
        for topic, partition in sorted(again):
            self._done.pop((topic, partition), None)
            self._offsets.pop((topic, partition), None)  # a failed commit's, kept: the old topic's
            low = self.consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10)[0]
            self.consumer.commit(offsets=[TopicPartition(topic, partition, low)], asynchronous=False)
            start = TopicPartition(topic, partition, OFFSET_BEGINNING)
            self.consumer.seek(start)
            self.gaps.expect([start])
        return [r for r in records if (r.topic, r.partition) not in again]

    def _unprocessed(self, records: list[Record]) -> list[Record]:
        """``records`` less those below their partition's committed offset (``_remember_done``). The join engine skips
        the good ones among them as redelivered, but a bad one was dead-lettered again at every restart (the chaos
        test: a clean stop's restart on the local broker dead-lettered a partition's last record batch twice). A
        partition's floor is forgotten once a record at or past it comes: no per-record pass after the first batches."""
        done = self._done
        if not done:
            return records
        kept = [r for r in records if r.offset >= done.get((r.topic, r.partition), -1)]
        for tp in set(map(_TOPIC_PARTITION, kept)):
            done.pop(tp, None)
        return kept

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop the run (or, asked before it, end it at once): SIGTERM/SIGINT, or the caller's (``streamrec join``)."""
        self._stop = True

    @property
    def stop_reason(self) -> str:
        """Why :meth:`run` ended, for the summary: "signal" (SIGTERM/SIGINT: the input may not have been read to its
        end, nor drained) or "input idle". A caller that goes on to the next stage (the demo) tells them apart."""
        return "signal" if self._stop else "input idle"

"""Publish an :class:`EventTable` to the ``impressions`` and ``clicks`` topics in event-time order.

- One event per message, key = ``impression_id`` (co-partitions impressions and clicks), its partition chosen by the
  replay as the producer's partitioner would, and no headers: a rerun with ``resume`` tells what was delivered by
  the content of each partition's last messages (``stream/replay/resume.py``).
- Impressions before clicks at equal timestamps; source order breaks the remaining ties.
- The Kafka message timestamp is left to the producer (wall clock): event time travels in the
  payload. Replaying years-old event times as message timestamps would make a real Kafka broker
  delete the segments at once under time-based retention.
- Rows a source rejected go to ``<topic>.dlq`` with their reason; deliberately malformed messages
  (synthetic ``malformed_share``) go to the real topic for consumers to dead-letter.
- Pacing: ``rate`` (events per wall-clock second) or ``speed`` (event time / wall time), else as
  fast as the producer takes them. Every message is acknowledged before the summary is printed. A delivery reported
  failed (refused as too large, denied, a partition missing, timed out) stops the replay at the next poll (a paced
  sleep, at least every ``SERVE_S``; an unpaced chunk) with the error its last flush would raise; a replay an error or
  SIGTERM stops flushes what it sent (Ctrl-C: what is answered already), and logs (stderr) the events acknowledged per
  topic (after Ctrl-C a lower bound) and those not. A
  SIGTERM (a process manager's stop) during :func:`publish` in the main thread raises :class:`Terminated` where the
  replay is, so it stops as an error does (flushing for up to ``STOP_FLUSH_S``), and exits 143. A SIGTERM during
  that flush (a process manager's second stop) cuts it short: the events acknowledged so far are logged all the same.
  Event time is counted from the first event in the order with a usable time (a source's row rejected for its time
  has ts 0 and goes out at once); a paced replay that would take over a year of wall clock (``MAX_PACED_S``: a tiny
  rate or speed, or times decades apart) is a :class:`~stream.errors.ConfigError` before anything is sent.
- A broker that acknowledges nothing (killed, unreachable, frozen) is said in a log line at once when librdkafka
  reports it unreachable, else after :data:`WAIT_TELL_S` without an acknowledgement, and in the progress line; past
  ``broker_wait_s`` (each message's delivery timeout too) the replay stops with
  :class:`~stream.errors.BrokerUnreachable`, logging the acknowledged counts without a stop flush. A broker back
  within it is said, and the replay goes on: the idempotent producer's retries deliver each event once
  (:class:`_BrokerWatch`).
- The message values are built column-wise, a chunk of the order at a time (``stream/replay/encoding.py``:
  byte for byte what ``stream/events.py`` encodes); unpaced, a chunk goes out in a loop that calls only
  ``produce``, and counts, polls and progress are per chunk.
- Message size: at start the replay learns what each topic it writes takes (``stream.kafka_limits.message_limits``: the
  topic's ``max.message.bytes`` by DescribeConfigs, the producer's ``message.max.bytes``, the smaller), and checks
  each chunk's messages against it before sending the chunk (one Arrow pass per kind); an event over it is a
  :class:`~stream.errors.MessageLimitError` (a ConfigError, exit 2) naming the topic, the event's size, the limit
  and what to raise, and nothing of its chunk is sent (an event cannot be cut; the earlier chunks were). A message
  refused as too large all the same (by the producer, or by the broker at delivery: its limit lower than it reported,
  or lowered since) is a :class:`~stream.errors.MessageLimitError` too, in the joiner's and the dead letters' words
  (``stream.kafka_limits.refused_as_too_large``), not a generic failure (exit 1) that a rerun repeats. Dead letters are
  sized under their topic's limit by ``stream/dlq.py``.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow.compute as pc

from stream.config import KafkaSettings
from stream.dlq import DeadLetters
from stream.errors import BrokerUnreachable, ConfigError, MessageLimitError, MessageTooLarge, shown
from stream.joiner.partitions import ensure_inputs
from stream.kafka_limits import MessageLimit, message_limits, raise_limit, refused_as_too_large, usable_bytes
from stream.kafka_producer import AckedProducer, DeliveryReport
from stream.kafka_topics import ensure_topics
from stream.metrics import EVENTS
from stream.replay.config import BROKER_WAIT_S
from stream.replay.encoding import EventEncoder, to_bytes
from stream.replay.resume import delivered_events, key_partitions, run_fingerprint
from stream.replay.table import CLICK, IMPRESSION, EventTable, RawMessage

log = logging.getLogger("streamrec.replay")

_RAW = 2  # kind code of raw messages in the merged order


@dataclass
class ReplaySummary:
    dataset: str
    impressions: int = 0
    clicks: int = 0
    malformed_published: int = 0
    dead_lettered: int = 0
    acked: dict[str, int] = field(default_factory=dict)
    run: str = ""  # the fingerprint of what defines the events (stream/replay/resume.py; logged, never sent)
    skipped: dict[str, int] = field(default_factory=dict)  # --resume: events per topic its partitions held already
    # --resume: of dead_lettered, those an earlier run had sent already (each was before an event the topics hold, in
    # the replay order, which every run sends in): <topic>.dlq is not read, so they are sent again, and it holds them
    # twice where the earlier send was delivered. A lower bound: dead letters after the last event held are not counted
    dead_lettered_again: int = 0
    first_ts: int | None = None
    last_ts: int | None = None
    elapsed_s: float = 0.0
    events_per_s: float = 0.0
    source: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def replay_order(table: EventTable) -> tuple[np.ndarray, np.ndarray]:
    """The merged event-time order: ``(kind (E,), index (E,))``, E = impressions + clicks + raw."""
    ts = np.concatenate([table.ts, table.click_ts, raw_ts_of(table)])
    kind = np.concatenate([
        np.full(table.n_impressions, IMPRESSION, np.int8),
        np.full(table.n_clicks, CLICK, np.int8),
        np.full(len(table.raw), _RAW, np.int8),
    ])
    index = np.concatenate([
        np.arange(table.n_impressions), np.arange(table.n_clicks), np.arange(len(table.raw))
    ])
    order = np.lexsort((kind, ts))  # by ts, then kind; lexsort is stable so source order stays
    return kind[order], index[order]


SERVE_S = 1.0  # the longest a paced replay sleeps without serving the producer's callbacks


class Pacer:
    """Sleeps so that at most ``rate`` events/s go out, or event time advances ``speed`` x wall time.

    ``serve(n_sent)`` is called before each sleep, and at least every :data:`SERVE_S` of a long one: the replay serves
    the producer's callbacks there (``poll(0)``) and moves its progress (:class:`_Progress`). A poll every 5,000
    events alone served them every 500 s at ``--rate 10`` (and not at all across a long gap of event time):
    librdkafka's log lines (a broker gone) and a fatal error came minutes late. Per sleep, not per event: an unpaced
    replay never sleeps, and adds nothing."""

    def __init__(self, rate: float | None, speed: float | None, first_ts: int,
                 serve: Callable[[int], None] = lambda _n: None) -> None:
        if rate is not None and speed is not None:
            raise ValueError("give either rate (events/s) or speed (x event time), not both")
        if (rate is not None and rate <= 0) or (speed is not None and speed <= 0):
            raise ValueError("rate and speed must be > 0")
        self._rate, self._speed, self._t0_event, self._serve = rate, speed, first_ts, serve
        self._t0 = time.monotonic()

    @property
    def active(self) -> bool:
        return self._rate is not None or self._speed is not None

    def wait(self, n_sent: int, ts: int) -> None:
        if self._rate is not None:
            due = n_sent / self._rate
        elif self._speed is not None:
            due = (ts - self._t0_event) / 1000.0 / self._speed
        else:
            return
        ahead = due - (time.monotonic() - self._t0)
        while ahead > 0.002:
            self._serve(n_sent)
            time.sleep(min(ahead, SERVE_S))
            ahead = due - (time.monotonic() - self._t0)


MAX_PACED_S = 365 * 86_400  # the longest a paced replay may take (wall clock)


def raw_ts_of(table: EventTable) -> np.ndarray:
    """(R,) int64: the event times of ``table``'s raw messages."""
    return np.fromiter((m.ts for m in table.raw), dtype=np.int64, count=len(table.raw))


def pace_origin(table: EventTable) -> int:
    """The event time pacing counts from: the earliest of the impressions, clicks and raw messages, leaving out raw
    messages without a usable time (ts 0); 0 for a table with none."""
    ts = np.concatenate([table.ts, table.click_ts,
                         np.fromiter((m.ts for m in table.raw if m.ts > 0), dtype=np.int64)])
    return int(ts.min()) if len(ts) else 0


def check_pace(rate: float | None, speed: float | None, n_events: int, origin_ts: int, last_ts: int) -> None:
    """A :class:`ConfigError` where pacing ``n_events`` (their times from ``origin_ts`` to ``last_ts``, ms) at
    ``rate`` or ``speed`` would take over ``MAX_PACED_S`` of wall clock: a wait that long never ends in practice
    (and one past what ``time.sleep`` takes raises ``OverflowError`` mid-replay)."""
    if rate is not None:
        wall_s, what = n_events / rate, f"[replay] rate {rate:g} (events/s) paces its {n_events:,} events"
    elif speed is not None:
        span_s = max(0, last_ts - origin_ts) / 1000.0
        wall_s, what = span_s / speed, f"[replay] speed {speed:g} paces its {span_s:,.0f} s of event time"
    else:
        return
    if wall_s > MAX_PACED_S:
        raise ConfigError(f"{what} over {wall_s:.3g} s of wall clock; a paced replay may take at most a year "
                          f"({MAX_PACED_S} s): raise it, or replay unpaced")


WAIT_TELL_S = 5.0  # no acknowledgement this long (messages waiting) is told as a wait on the broker


class _BrokerWatch:
    """Watches a replay's producer for a broker that acknowledges nothing (killed, unreachable, frozen), from the
    replay's polls and a full queue's wait (``AckedProducer.waiting``).

    librdkafka retries a message until its delivery timeout (300 s by default), and the replay said nothing that
    long: it seemed to run, or hang. Now a wait is said at once when librdkafka reports the broker unreachable
    (``error_cb``: all brokers down; one broker of several refusing is not), else once nothing was acknowledged for
    :data:`WAIT_TELL_S` while messages wait (a frozen broker keeps its connections); the progress line says it
    waits. A broker answering again within ``limit_s`` is said too, and the replay goes on: the idempotent
    producer's retries deliver each waiting message once, in order. Past ``limit_s`` without an acknowledgement,
    :meth:`check` raises :class:`BrokerUnreachable` (the producer's ``message.timeout.ms`` is ``limit_s`` as well,
    so librdkafka gives up on each message on the same schedule and the last flush waits no longer)."""

    def __init__(self, producer: AckedProducer, bootstrap: str, setting: str,
                 status: Callable[[str | None], None]) -> None:
        """``setting``: what sets the limit, the producer's delivery timeout (``[replay] broker_wait_s`` unless
        ``[kafka.extra]`` gives ``message.timeout.ms``)."""
        self._producer, self._bootstrap, self._setting, self._status = producer, bootstrap, setting, status
        limit_s = self._limit_s = producer.delivery_timeout_s
        self._delivered, self._since, self._told = 0, time.monotonic(), False
        self._tell_s = min(WAIT_TELL_S, limit_s / 2)
        self.where = ""  # the replay's phase, in what is said: " at its final flush" once every event was sent

    def check(self) -> None:
        """After callbacks were served: say, clear or give up on a wait (class docstring). A message that ran out its
        delivery timeout (``limit_s``) while the broker was silent gives up too: it may come before ``limit_s`` of
        the watch's own count, which starts at the last acknowledgement seen, not at that message's send."""
        producer, now = self._producer, time.monotonic()
        delivered, outstanding = producer.delivered()
        if delivered > self._delivered:  # the broker answers
            if self._told:
                log.warning("[replay] Kafka at %s acknowledges again after %.0f s; the replay goes on",
                            self._bootstrap, now - self._since)
                self._status(None)
            self._delivered, self._since, self._told, producer.unreachable = delivered, now, False, None
            return
        why, timed_out = producer.unreachable, producer.timed_out
        if not outstanding and not timed_out:  # nothing waits: no wait to count (an idle gap of a paced replay)
            self._since = now
            if why is None:
                return
        waited = now - self._since
        if not self._told and (why is not None or timed_out or waited >= self._tell_s):
            self._told = True
            log.warning("[replay] Kafka at %s %s; %d message(s) wait for it%s: the replay waits up to %g s for an "
                        "acknowledgement (%s), then stops", self._bootstrap,
                        f"cannot be reached ({why})" if why else f"has acknowledged nothing for {waited:.0f} s",
                        outstanding, self.where, self._limit_s, self._setting)
        if self._told:
            self._status(f"waiting for the broker {waited:.0f}/{self._limit_s:g} s")
        if timed_out or (outstanding and waited >= self._limit_s):
            raise BrokerUnreachable(
                f"Kafka at {self._bootstrap} acknowledged nothing for {waited:.0f} s and messages waited the replay's "
                f"limit ({self._setting} = {self._limit_s:g} s){f': {why}' if why else ''}; "
                f"the replay stopped{self.where} with {outstanding + timed_out} message(s) unacknowledged. Is the "
                "broker up "
                "(`streamrec stack status`)? A rerun with --resume sends only what the topics do not hold yet")


CHUNK = 4096  # events encoded, sent and counted at a time
PROGRESS_S = 2.0  # the longest a paced replay's progress stands still while it paces


class _Progress:
    """``publish``'s ``progress(n)``, fed the events sent so far and called with the increase. Per chunk alone
    (every 5,000 events paced), a paced replay's bar moved every 500 s at ``--rate 10``: an operator saw nothing for
    minutes.
    The pacer's sleeps now move it too, at most every :data:`PROGRESS_S` (:meth:`due`); unpaced, only per chunk."""

    def __init__(self, progress: Callable[[int], None] | None, skipped: int = 0) -> None:
        """``skipped``: events a resumed replay does not send (the topics hold them): counted as done."""
        self._progress, self._reported, self._at, self._skipped = progress, 0, time.monotonic(), skipped

    def to(self, n_sent: int) -> None:
        """Report up to ``n_sent`` events sent, and the skipped (nothing when none are new)."""
        n_sent += self._skipped
        if self._progress is not None and n_sent > self._reported:
            self._progress(n_sent - self._reported)
            self._reported = n_sent
        self._at = time.monotonic()

    def due(self, n_sent: int) -> None:
        """From a paced sleep: report once :data:`PROGRESS_S` passed since the last report."""
        if time.monotonic() - self._at >= PROGRESS_S:
            self.to(n_sent)


def _objects(items: list[Any]) -> np.ndarray:
    """A 1-D object array of ``items`` (``np.array`` would make bytes of one length a 2-D or 'S' array)."""
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out


def publish(table: EventTable, kafka: KafkaSettings, dataset: str, *, rate: float | None = None,
            speed: float | None = None, linger_ms: int = 20, broker_wait_s: float = BROKER_WAIT_S,
            progress: Callable[[int], None] | None = None,
            status: Callable[[str | None], None] | None = None, run: Mapping[str, Any] | None = None,
            resume: bool = False) -> ReplaySummary:
    """Produce every event of ``table``; returns counts once all are acknowledged.

    ``progress(n)`` is called every few thousand events with the number sent since the last call, and in a paced
    replay at most every :data:`PROGRESS_S` while it paces (:class:`_Progress`). A broker that acknowledges nothing is
    said (a log line; ``status(text)``, None once it answers again) and waited for up to ``broker_wait_s``, then
    :class:`~stream.errors.BrokerUnreachable` (:class:`_BrokerWatch`).
    Raises ``DeliveryFailed`` if any message was not acknowledged (at the first poll that serves a failed delivery's
    report, not only at the end: :func:`_poll`), and :class:`~stream.errors.MessageLimitError` for
    a message over its topic's limit or refused as too large (module docstring, "Message size"), and :class:`Terminated`
    for a SIGTERM in the main thread (what was sent is flushed and counted first).

    Events are encoded column-wise (:class:`~stream.replay.encoding.EventEncoder`) a chunk of the replay
    order at a time; unpaced, a chunk goes out in a loop that only calls ``produce``, and the counts,
    the poll and the progress are per chunk. Paced, every event waits for its turn as before.

    Every message goes to the partition its key's hash picks, chosen here, and carries no headers
    (``stream/replay/resume.py``); ``run``: what defines the events (settings -> values; the fingerprint, logged and
    in the summary, adds the partition count), ``{"dataset": dataset}`` by default. ``resume``: skip the events each
    partition holds already, found by the content of its last messages; ConfigError where they are not this run's
    events for it, or match several positions. Dead letters (``<topic>.dlq``) are sent again on a resume: their
    topics are not read; the summary's ``dead_lettered_again`` counts those an earlier run had sent (a lower bound).
    """
    topics = {IMPRESSION: kafka.impressions_topic, CLICK: kafka.clicks_topic}
    written = [*topics.values(), *(kafka.dlq_topic(t) for t in topics.values())]
    # co-partitioned (stream/joiner/partitions.py): events sent into topics that disagree are joined wrong for good
    n_partitions = ensure_inputs(kafka)
    ensure_topics(kafka, written[2:])
    run_id = run_fingerprint({**(run if run is not None else {"dataset": dataset}), "partitions": n_partitions})
    producer = AckedProducer(kafka, **{"linger.ms": linger_ms, "message.timeout.ms": round(broker_wait_s * 1000)})
    setting = ("[replay] broker_wait_s (--broker-wait-s)" if "message.timeout.ms" not in kafka.extra
               else "[kafka.extra] message.timeout.ms")  # (applied last: it replaces the replay's)
    watch = _BrokerWatch(producer, kafka.bootstrap_servers, setting, status or (lambda _text: None))
    producer.waiting = watch.check
    dead_letters = DeadLetters(kafka, producer)
    # What each topic written takes (module docstring, "Message size"); the dead-letter topics' only to name them in
    # a refusal (DeadLetters learns its own at the first dead letter, the same way).
    limits = message_limits(kafka, written, producer.max_message_bytes, producer.max_message_setting)
    room = {kind: usable_bytes(limits[topic].bytes) for kind, topic in topics.items()}
    summary = ReplaySummary(dataset=dataset, source=dict(table.stats), run=run_id)

    kinds, indexes = replay_order(table)
    ts_all = np.concatenate([table.ts, table.click_ts])
    if len(ts_all):
        summary.first_ts, summary.last_ts = int(ts_all.min()), int(ts_all.max())
    Pacer(rate, speed, 0)  # bad settings fail before anything is sent
    origin = pace_origin(table)
    paced = rate is not None or speed is not None
    imp_topic, click_topic = topics[IMPRESSION], topics[CLICK]

    t0 = time.monotonic()
    encoder = EventEncoder(table)
    # Per event of the order: its topic (a raw message names its own), its key and partition, its seq, and for a raw
    # message the message itself (the encoder builds the others' values chunk by chunk).
    raw = table.raw
    raw_kind = np.fromiter((m.topic_kind for m in raw), dtype=np.int8, count=len(raw))
    is_raw = kinds == _RAW
    topic_kind = kinds.copy()
    topic_kind[is_raw] = raw_kind[indexes[is_raw]]
    raw_keys = _objects([m.key for m in raw])
    pool_at = indexes + np.array([0, table.n_impressions, table.n_impressions + table.n_clicks])[kinds]
    key_of = np.concatenate([table.impression_id.astype(object), table.click_impression_id.astype(object),
                             raw_keys])[pool_at]
    part_of = np.concatenate([key_partitions(table.impression_id, n_partitions),
                              key_partitions(table.click_impression_id, n_partitions),
                              key_partitions(raw_keys, n_partitions)])[pool_at]
    dead = np.zeros(len(kinds), bool)
    dead[is_raw] = np.array([m.error is not None for m in raw], dtype=bool)[indexes[is_raw]]
    summary.skipped = {imp_topic: 0, click_topic: 0}
    if resume:
        held = np.zeros(len(kinds), bool)
        for kind, topic in topics.items():  # dead letters go to <topic>.dlq, not read: sent again
            mine = np.flatnonzero(~dead & (topic_kind == kind))
            held[delivered_events(kafka, topic, {p: mine[part_of[mine] == p] for p in range(n_partitions)},
                                  lambda pos: [_key_bytes(key) for key in key_of[pos].tolist()],
                                  lambda pos: _chunk_values(encoder, raw, kinds[pos], indexes[pos], room)[0])] = True
        summary.skipped = {imp_topic: int(np.count_nonzero(held & (topic_kind == IMPRESSION))),
                           click_topic: int(np.count_nonzero(held & (topic_kind == CLICK)))}
        if held.any():  # an earlier run sent everything before the last event held, its dead letters included
            summary.dead_lettered_again = int(np.count_nonzero(dead[:int(np.flatnonzero(held)[-1])]))
        keep = ~held
        kinds, indexes, topic_kind, key_of, part_of, dead = (
            a[keep] for a in (kinds, indexes, topic_kind, key_of, part_of, dead))
        if held.any():  # pacing counts from the first event left to send
            rest = np.concatenate([table.ts, table.click_ts, raw_ts_of(table)])[pool_at[keep]]
            origin = int(rest[rest > 0].min()) if (rest > 0).any() else origin
        log.info("[replay] --resume (run %s): the topics hold %s events of it already (skipped); %d to send%s",
                 run_id, summary.skipped, len(kinds), "" if len(kinds) else ": the replay is complete, nothing sent")
        if summary.dead_lettered_again:
            log.warning("[replay] --resume: %d dead letters an earlier run sent already are sent again (the "
                        "dead-letter topics %s are not read): they may be there twice", summary.dead_lettered_again,
                        ", ".join(written[2:]))
    check_pace(rate, speed, len(kinds), origin, max(int(ts_all.max()) if len(ts_all) else 0,
                                                    max((m.ts for m in table.raw), default=0)))
    topic_of = np.array([imp_topic, click_topic], dtype=object)[topic_kind]

    tracker = _Progress(progress, sum(summary.skipped.values()))

    def serve(n_sent: int) -> None:  # at a paced sleep (Pacer)
        _poll(producer, limits, watch)
        tracker.due(n_sent)

    pacer = Pacer(rate, speed, origin, serve)  # its clock starts with the first event
    counters = {IMPRESSION: EVENTS.labels("replay", imp_topic), CLICK: EVENTS.labels("replay", click_topic)}
    restore_sigterm = _raise_on_sigterm()
    try:
        for start in range(0, len(kinds), CHUNK):
            stop = min(start + CHUNK, len(kinds))
            k, i = kinds[start:stop], indexes[start:stop]
            is_imp, is_click, is_raw_c = k == IMPRESSION, k == CLICK, k == _RAW
            dead_c = dead[start:stop]
            values_l, over = _chunk_values(encoder, raw, k, i, room)
            topics_l, keys_l = topic_of[start:stop].tolist(), key_of[start:stop].tolist()
            parts_l = part_of[start:stop].tolist()
            if over is not None:
                raise _over_limit(topics_l[over], keys_l[over], len(values_l[over] or b""), limits[topics_l[over]])
            if paced:
                ts_l = [table.ts[j] if kind == IMPRESSION else table.click_ts[j] if kind == CLICK else raw[j].ts
                        for kind, j in zip(k.tolist(), i.tolist(), strict=True)]
                dead_l, kinds_l = dead_c.tolist(), k.tolist()
                for j in range(stop - start):
                    n = start + j
                    if dead_l[j]:
                        dead_letters.send(topics_l[j], keys_l[j], values_l[j], raw[i[j]].error)  # type: ignore[arg-type]
                    else:
                        with _refused(limits):
                            producer.send(topics_l[j], values_l[j], keys_l[j], partition=parts_l[j])
                    _count(summary, kinds_l[j], dead_l[j])
                    if kinds_l[j] in counters:  # per event: a paced chunk can take minutes
                        counters[kinds_l[j]].inc()
                    if n % 5000 == 0:
                        _poll(producer, limits, watch)
                        tracker.to(n)
                    pacer.wait(n + 1, ts_l[j])
                continue
            # Unpaced: runs between dead-lettered raw messages go out in the produce-only loop.
            cut = 0
            for j in [*np.flatnonzero(dead_c).tolist(), stop - start]:
                if j > cut:
                    with _refused(limits):
                        producer.send_run(topics_l[cut:j], values_l[cut:j], keys_l[cut:j], parts_l[cut:j])
                if j < stop - start:
                    dead_letters.send(topics_l[j], keys_l[j], values_l[j], raw[i[j]].error)  # type: ignore[arg-type]
                cut = j + 1
            summary.impressions += int(np.count_nonzero(is_imp))
            summary.clicks += int(np.count_nonzero(is_click))
            _count_events(imp_topic, click_topic, is_imp, is_click)
            n_dead = int(np.count_nonzero(dead_c))
            summary.dead_lettered += n_dead
            summary.malformed_published += int(np.count_nonzero(is_raw_c)) - n_dead
            _poll(producer, limits, watch)
            tracker.to(stop)

        report = _final_flush(producer, limits, watch)
    except BaseException as exc:  # an error, Ctrl-C, SIGTERM: what went out is flushed and counted (module docstring)
        _stopped(exc, producer, len(kinds))
        raise
    finally:
        restore_sigterm()
        producer.waiting = lambda: None  # (the watch refers to the producer: no cycle keeps its client alive)
    summary.elapsed_s = time.monotonic() - t0
    total = summary.impressions + summary.clicks + summary.malformed_published + summary.dead_lettered
    tracker.to(total)
    summary.events_per_s = total / summary.elapsed_s if summary.elapsed_s > 0 else 0.0
    summary.acked = dict(sorted(report.acked.items()))
    return summary


STOP_FLUSH_S = 30.0  # how long a replay stopped by an error or SIGTERM waits for what it sent (none after Ctrl-C)


class Terminated(SystemExit):
    """A SIGTERM stopped :func:`publish` part way (module docstring): what was sent was flushed and counted. A
    ``SystemExit`` with the status a shell gives a process SIGTERM ended (143): ``except Exception`` does not take it
    for a failure to handle, and ``streamrec replay`` exits with it."""

    def __init__(self) -> None:
        super().__init__(128 + signal.SIGTERM)


def _raise_on_sigterm() -> Callable[[], None]:
    """Make a SIGTERM raise :class:`Terminated` where the replay is (by default it ended the process at once: what
    the producer held was lost and nothing said how much went out); returns the function that puts the previous
    handler back. Only the main thread may set a handler: elsewhere, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def stop(_signum: int, _frame: Any) -> None:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, stop)

    def restore() -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)  # None: one set in C

    return restore


def _stopped(exc: BaseException, producer: AckedProducer, total: int) -> None:
    """A replay that ``exc`` stopped part way: flush what it sent (it was lost with the producer, and the chunks
    before an error were said to be sent), and log the events acknowledged per topic and of
    those not sent or not acknowledged (a lower bound of the acknowledged after Ctrl-C, which waits for nothing).

    A SIGTERM while it waits (a second one, or a process manager's stop after an error) cuts the wait short: its
    :class:`Terminated` was raised out of the flush and ended the process with neither the counts nor ``exc``'s
    status (a traceback instead). Now the reports already in are counted (a lower bound, as after Ctrl-C), the line is
    logged, later SIGTERMs are ignored until :func:`publish` restores the handler, and ``exc`` goes on (exit 143). A
    Ctrl-C while it waits (an operator at the terminal) cuts it short the same way: its KeyboardInterrupt went past
    the count and replaced ``exc`` (exit 130, neither the line nor the first stop's error)."""
    # none after Ctrl-C, nor for a broker that answered nothing for the replay's whole limit: it was bounded
    timeout = 0.0 if isinstance(exc, (KeyboardInterrupt, BrokerUnreachable)) else STOP_FLUSH_S
    failed = ""
    try:  # the notice inside: a SIGTERM right after it is one during the flush
        if timeout:
            log.warning("[replay] stopping (%s): waiting up to %.0f s for what was sent to be acknowledged; a SIGTERM "
                        "or Ctrl-C stops waiting", type(exc).__name__, timeout)
        producer.flush(timeout)
    except (Terminated, KeyboardInterrupt) as cut:  # raised only in the main thread, where the handler may be set
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a third one must not lose the count either
        failed = f" (its flush cut short by a {'SIGTERM' if isinstance(cut, Terminated) else 'Ctrl-C'})"
        try:
            producer.flush(0)  # the reports already in: counted, the rest as unacknowledged
        except Exception:  # noqa: BLE001 - messages still unanswered: what acked_total then claims is a lower bound
            pass
    except Exception as flush_exc:  # noqa: BLE001 - the note says it; exc is what goes on
        failed = f" (its flush: {flush_exc})"
    acked = dict(sorted(producer.acked_total.items()))
    log.error("[replay] stopped (%s) after sending part of its %d events: acknowledged per topic %s; %d events not "
              "sent or not acknowledged%s; a rerun with --resume sends only those", type(exc).__name__, total, acked,
              total - sum(acked.values()), failed)


def _count_events(imp_topic: str, click_topic: str, is_imp: np.ndarray, is_click: np.ndarray) -> None:
    """``streamrec_events_total{stage="replay"}`` as each unpaced chunk goes out."""
    EVENTS.labels("replay", imp_topic).inc(int(np.count_nonzero(is_imp)))
    EVENTS.labels("replay", click_topic).inc(int(np.count_nonzero(is_click)))


FINAL_POLL_S = 0.5  # the final flush's wait for reports between two looks of the broker watch


def _final_flush(producer: AckedProducer, limits: Mapping[str, MessageLimit], watch: _BrokerWatch) -> DeliveryReport:
    """The replay's last flush, every event sent, under the broker watch. ``flush_answered`` alone waited up to the
    delivery timeout and a margin with nothing of the replay's said, and a broker gone meanwhile ended the replay as
    the timeouts' generic DeliveryFailed, whose stop then waited :data:`STOP_FLUSH_S` more. Polled until librdkafka
    holds nothing, the watch says the wait once (at its final flush) and gives up as BrokerUnreachable, naming the
    messages left unacknowledged; the flush after waits for nothing, and settles the report (a broker away for
    minutes at the end: every message answered, none left unsure)."""
    watch.where = " at its final flush"
    while producer.delivered()[1]:
        _poll(producer, limits, watch, FINAL_POLL_S)
    with _refused(limits):
        return producer.flush_answered()


def _poll(producer: AckedProducer, limits: Mapping[str, MessageLimit], watch: _BrokerWatch,
          wait_s: float = 0.0) -> None:
    """Serve the producer's callbacks, and stop the replay at a delivery already reported failed (refused as too
    large, denied by an ACL, a partition missing, timed out against a broker gone): with the error its last flush
    would raise (``AckedProducer.raise_failed``), now rather than after hours of a paced replay sending into a topic
    it cannot write. Called per paced sleep (at least every :data:`SERVE_S`) and per unpaced chunk, never per event.
    The broker watch first: a broker silent past the limit is said as such, not as the timeouts it caused. ``wait_s``:
    how long the poll may wait for a report (the final flush's)."""
    producer.poll(wait_s)
    watch.check()
    with _refused(limits):
        producer.raise_failed()


@contextmanager
def _refused(limits: Mapping[str, MessageLimit]) -> Iterator[None]:
    """Sends and the flush: a message refused as too large is a :class:`MessageLimitError` naming its topic and the
    limit learned for it (module docstring, "Message size"), as the joiner's and the dead letters' are."""
    try:
        yield
    except MessageTooLarge as exc:
        raise refused_as_too_large(exc, limits.get(exc.topic or "")) from None


def _over_limit(topic: str, key: Any, size: int, limit: MessageLimit) -> MessageLimitError:
    """The error for an event of ``size`` bytes over what a record of ``topic`` may be under ``limit``."""
    return MessageLimitError(
        f"an event for {topic} (key {shown(key)}) is {size} bytes, over the {usable_bytes(limit.bytes)} bytes a "
        f"record of {topic} may be (its limit {limit.bytes} bytes, {limit.source}); the replay stopped before sending "
        f"its chunk (it and up to {CHUNK - 1} events before it; the chunks before were sent): "
        f"{raise_limit(topic, limit)}")


def _chunk_values(encoder: EventEncoder, raw: list[RawMessage], kinds: np.ndarray, indexes: np.ndarray,
                  room: Mapping[int, int]) -> tuple[list[bytes | None], int | None]:
    """The message values of a chunk of the replay order (``kinds``, ``indexes``), in that order, and the position
    of the first one over the ``room`` (topic kind -> bytes) of the topic it goes to, None when all fit (a raw
    message with an error goes to its dead-letter topic instead, sized there)."""
    out = np.empty(len(kinds), dtype=object)
    over: list[int] = []
    for kind, encode in ((IMPRESSION, encoder.impressions), (CLICK, encoder.clicks)):
        mask = kinds == kind
        texts = encode(indexes[mask])
        if len(texts) and (pc.max(pc.binary_length(texts)).as_py() or 0) > room[kind]:
            sizes = pc.binary_length(texts).to_numpy(zero_copy_only=False)
            over.append(int(np.flatnonzero(mask)[np.argmax(sizes > room[kind])]))
        out[mask] = _objects(to_bytes(texts))
    is_raw = kinds == _RAW
    if is_raw.any():
        where, messages = np.flatnonzero(is_raw).tolist(), [raw[j] for j in indexes[is_raw].tolist()]
        out[is_raw] = _objects([m.value for m in messages])
        over += [n for n, m in zip(where, messages, strict=True)
                 if m.error is None and len(m.value or b"") > room[m.topic_kind]][:1]
    return out.tolist(), min(over, default=None)


def _key_bytes(key: Any) -> bytes | None:
    """A message key as the producer sends it (a str as UTF-8) and a consumer reads it back."""
    return key.encode() if isinstance(key, str) else key


def _count(summary: ReplaySummary, kind: int, dead: bool) -> None:
    if kind == IMPRESSION:
        summary.impressions += 1
    elif kind == CLICK:
        summary.clicks += 1
    elif dead:
        summary.dead_lettered += 1
    else:
        summary.malformed_published += 1


def progress_bar(total: int, enabled: bool) -> tuple[Callable[[int], None], Callable[[], None],
                                                    Callable[[str | None], None]]:
    """A tqdm bar on stderr: ``(update, close, status)``; ``status(text)`` shows what the replay waits on after the
    counts (None: nothing). Disabled -> no-ops."""
    if not enabled:
        return (lambda _n: None), (lambda: None), (lambda _text: None)
    from tqdm import tqdm

    bar = tqdm(total=total, unit="ev", unit_scale=True, file=sys.stderr, desc="replay", smoothing=0.1)
    return bar.update, bar.close, lambda text: bar.set_postfix_str(text or "")

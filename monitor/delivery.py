"""Delivery: each alert sink behind a bounded queue with a worker thread of its own, and the fan-out to them.

The monitor never calls a sink itself: :class:`QueuedSink` puts each sink behind a bounded queue drained by a worker
thread of its own, so a slow or dead sink never delays rule evaluation nor the other sinks; alerts an attempt did
not deliver stay queued (in order) and are retried with exponential backoff. An alert leaves a queue only when
delivered, or dropped for one of three reasons, each counted (``streamrec_monitor_sink_dropped_total``) and logged:
``overflow`` (more than ``queue_size`` waiting, or more than ``queue_max_bytes`` in them: first the alerts a later
one of the same fingerprint supersedes, then the oldest; :meth:`QueuedSink._trim`), ``rejected`` (the sink refused
the alert itself, e.g. HTTP 400, or Kafka's MSG_SIZE_TOO_LARGE or TOPIC_AUTHORIZATION_FAILED, at produce() or at
delivery: :data:`~monitor.alerts.REFUSED_FOR_GOOD`; retrying cannot help) and ``closed`` (still queued when
:meth:`QueuedSink.close` ran out of time). Delivery is at least once: an attempt cut off at its deadline may have
reached the receiver, and the alert is sent again. :class:`FanOut` hands every batch to several queued sinks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter as PCounter
from prometheus_client import Gauge

from monitor.alerts import Alert, AlertSink, KafkaSink, LogSink, SinkError, SinkSettings, WebhookSink
from stream.config import KafkaSettings

log = logging.getLogger("streamrec.alerts")

SINK_DELIVERED = PCounter("streamrec_monitor_sink_delivered_total", "Alerts a sink delivered, by sink.", ["sink"])
SINK_FAILURES = PCounter("streamrec_monitor_sink_failures_total",
                         "Delivery attempts that failed, by sink (undelivered alerts stay queued and are retried).",
                         ["sink"])
SINK_RETRIES = PCounter("streamrec_monitor_sink_retries_total",
                        "Delivery attempts that retried alerts an earlier attempt failed to deliver, by sink.",
                        ["sink"])
SINK_DROPPED = PCounter("streamrec_monitor_sink_dropped_total",
                        "Alerts given up on, by sink and reason: overflow (queue full: superseded, then the oldest "
                        "dropped), rejected (the sink refused the alert itself), closed (undelivered at shutdown).",
                        ["sink", "reason"])
SINK_QUEUE = Gauge("streamrec_monitor_sink_queue_depth",
                   "Alerts waiting for delivery (queued or being sent), by sink.", ["sink"])


class Backoff:
    """The wait before the next attempt after ``failures`` failed attempts in a row: ``first_s``,
    doubled per further failure, never more than ``max_s``."""

    def __init__(self, first_s: float, max_s: float) -> None:
        self.first_s, self.max_s = first_s, max(max_s, first_s)

    def delay(self, failures: int) -> float:
        if failures <= 0:
            return 0.0
        return min(self.max_s, self.first_s * 2.0 ** min(failures - 1, 60))


@dataclass
class DeliveryStats:
    """What one sink's queue has done (also in the streamrec_monitor_sink_* metrics)."""

    delivered: int = 0  # alerts
    failed: int = 0  # attempts that failed
    retried: int = 0  # attempts that retried alerts an earlier attempt failed to deliver
    dropped: Counter[str] = field(default_factory=Counter)  # alerts, by reason: overflow, rejected, closed
    queued: int = 0  # alerts waiting now (queued or being sent)

    def as_dict(self) -> dict[str, Any]:
        return {"delivered": self.delivered, "failed": self.failed, "retried": self.retried,
                "dropped": dict(self.dropped), "queued": self.queued}


def _which(alerts: Sequence[Alert], limit: int = 5) -> str:
    shown = ", ".join(f"{a.rule}({a.state.value}, ts={a.ts})" for a in alerts[:limit])
    return shown + (f" and {len(alerts) - limit} more" if len(alerts) > limit else "")


class QueuedSink:
    """Delivers alerts to ``sink`` from a bounded queue, on a worker thread of its own.

    Promises:

    * :meth:`send` only queues and returns at once: however slow or dead the sink, the caller (rule
      evaluation) is never delayed, and neither are other sinks (each has its own queue and thread).
    * Every attempt (``sink.send`` of up to ``sink.batch_max`` alerts) has a total deadline of
      ``sink.timeout_s``; one that starts while :meth:`close` drains ends by close's deadline.
    * Alerts an attempt did not deliver go back to the head of the queue, in order, and are retried
      after :class:`Backoff` (``retry_backoff_s`` doubling to ``retry_backoff_max_s``), until delivered; a
      receiver's ``Retry-After`` (429, 503) lengthens the wait to what it asks, up to ``retry_backoff_max_s`` (a
      receiver asking for a day does not park the alerts that long). It was ignored: a throttled receiver got
      the next request 0.5 s later, and more 429s.
      Alerts are delivered in the order they were queued, at least once.
    * At most ``queue_size`` alerts wait (plus the batch being sent), holding at most ``queue_max_bytes``
      (:meth:`Alert.weight`); beyond either the superseded, then the oldest are dropped (:meth:`_trim`), never the
      newest (one alone over ``queue_max_bytes`` is kept). An alert
      over :data:`WebhookSink.MAX_BODY` is queued :meth:`Alert.shortened` (every sink sends it shortened anyway):
      counted by alerts alone, 1000 alerts with a scraped label of 10 MB held 10 GB while a sink was down.
      Every alert dropped (overflow, rejected by the sink, closed) is counted and logged.
    * :meth:`close` keeps delivering until the queue is empty or its deadline (trying at once, whatever
      the backoff, then backing off as before), then reports (log and return value) how many alerts
      were left undelivered.
    """

    JOIN_GRACE_S = 0.5  # close() waits this much beyond its deadline for an attempt cut off at it to return

    def __init__(self, sink: AlertSink, settings: SinkSettings = SinkSettings(),
                 close_advice: str = "raise close_timeout_s in [sinks] to wait longer") -> None:
        """``close_advice``: what the close's log line tells the operator when alerts were left undelivered by a
        sink that never failed (the owner's setting, or why there is none)."""
        self.sink, self.name, self.close_advice = sink, sink.name, close_advice
        self.queue_size = max(1, settings.queue_size)
        self.queue_max_bytes = max(1, settings.queue_max_bytes)
        self.close_timeout_s = settings.close_timeout_s
        self.backoff = Backoff(settings.retry_backoff_s, settings.retry_backoff_max_s)
        self.stats = DeliveryStats()
        self._queue: deque[Alert] = deque()
        self._in_flight: list[Alert] = []
        self._cond = threading.Condition()
        self._failures_in_row = 0
        self._retry_at = 0.0
        self._close_deadline: float | None = None
        self._before_close = True  # the attempt in flight began before begin_close (_attempt, _settle)
        self._closed = False  # close() is done: the worker stops after its current attempt
        self._left_at_close: list[Alert] = []
        SINK_QUEUE.labels(self.name).set(0)
        self._thread = threading.Thread(target=self._run, name=f"alert-sink-{self.name}", daemon=True)
        self._thread.start()

    # -- the caller's side
    def send(self, alerts: Sequence[Alert], deadline: float | None = None) -> None:
        """Queue ``alerts`` for delivery; returns at once (``deadline`` is not needed: nothing waits)."""
        if not alerts:
            return
        with self._cond:
            if self._closed:
                late, overflow = list(alerts), []
            else:
                late = []
                self._queue.extend(a if a.weight() <= WebhookSink.MAX_BODY else a.shortened() for a in alerts)
                overflow = self._trim()
                self._cond.notify_all()
        if late:
            self._drop(late, "closed", "the sink is closed")
        if overflow:
            self._drop(overflow, "overflow", self._overflow_why())

    @property
    def depth(self) -> int:
        """Alerts waiting: queued or being sent."""
        with self._cond:
            return len(self._queue) + len(self._in_flight)

    def waiting(self) -> list[Alert]:
        """The alerts not delivered yet (being sent, then queued, in order); after :meth:`close`, the ones it
        left undelivered."""
        with self._cond:
            return list(self._left_at_close) if self._closed else [*self._in_flight, *self._queue]

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing waits for delivery; False if that takes longer than ``timeout_s``."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._in_flight, timeout_s)

    def close(self, timeout_s: float | None = None) -> int:
        """Deliver what is queued for at most ``timeout_s`` (default ``close_timeout_s``), stop the
        worker and close the sink; returns (and logs) how many alerts were left undelivered. An attempt
        still running at the deadline (it began before close, with a longer deadline of its own) is not
        waited for beyond :attr:`JOIN_GRACE_S`: its alerts count as undelivered and it finishes in the
        background. A second call returns 0."""
        self.begin_close(time.monotonic() + (self.close_timeout_s if timeout_s is None else timeout_s))
        return self.finish_close()

    def begin_close(self, deadline: float) -> None:
        """Start draining: the worker delivers what is queued until ``deadline`` (``time.monotonic()``).
        A sink backing off after failures is tried again at once: its next retry may be due only after
        the deadline (up to ``retry_backoff_max_s`` away), and the sink may well answer again by now.
        A later call with an earlier deadline brings the drain's end forward (a stop signal cutting it short)."""
        with self._cond:
            if self._close_deadline is None or deadline < self._close_deadline:
                self._close_deadline = deadline
                self._retry_at = min(self._retry_at, time.monotonic())
            self._cond.notify_all()

    def finish_close(self) -> int:
        """Wait for the drain that :meth:`begin_close` started; the count of alerts left undelivered."""
        with self._cond:
            if self._closed:
                return 0
            assert self._close_deadline is not None, "begin_close() first"
            deadline = self._close_deadline
        self._thread.join(max(0.0, deadline - time.monotonic()) + self.JOIN_GRACE_S)
        with self._cond:
            self._closed = True
            left = list(self._queue)
            if self._thread.is_alive():  # an attempt overran its deadline: count its alerts undelivered too
                left = self._in_flight + left
            self._left_at_close = left
            self._queue.clear()
            self._set_depth()
            self._cond.notify_all()
        if left:
            self._drop(left, "closed", "the close deadline passed before they were delivered")
            log.error("alert sink %s closed with %d alert(s) undelivered (%s)", self.name, len(left),
                      self.close_advice if self.stats.failed == 0 else
                      "the sink kept failing; see the errors above")
        return len(left)

    # -- the worker's side
    def _run(self) -> None:
        try:
            while (batch := self._take()) is not None:
                self._attempt(batch)
        finally:
            try:
                self.sink.close()
            except Exception as exc:  # noqa: BLE001 - closing one sink must not stop the others
                log.error("closing alert sink %s: %s", self.name, exc)

    def _take(self) -> list[Alert] | None:
        """The next batch to send, once the backoff allows; None when the worker should stop."""
        with self._cond:
            while True:
                if self._closed:
                    return None
                now = time.monotonic()
                closing = self._close_deadline
                if closing is not None and (not self._queue or now >= closing):
                    return None
                if not self._queue:
                    self._cond.wait()
                    continue
                wake = self._retry_at if closing is None else min(self._retry_at, closing)
                if now < wake:
                    self._cond.wait(wake - now)
                    continue
                n = min(max(1, self.sink.batch_max), len(self._queue))
                self._in_flight = [self._queue.popleft() for _ in range(n)]
                return list(self._in_flight)

    def _attempt(self, batch: list[Alert]) -> None:
        retry = self._failures_in_row > 0
        self._before_close = self._close_deadline is None  # (read by _settle: the drain's own try is still due)
        deadline = time.monotonic() + self.sink.timeout_s
        if self._close_deadline is not None:
            deadline = min(deadline, self._close_deadline)
        if retry:
            SINK_RETRIES.labels(self.name).inc()
        try:
            self.sink.send(batch, deadline)
        except Exception as exc:  # noqa: BLE001 - a sink's failure must never end its worker
            self._settle(batch, exc, retry)
        else:
            self._settle(batch, None, retry)

    def _settle(self, batch: list[Alert], exc: Exception | None, retry: bool) -> None:
        if exc is None:
            undelivered: list[Alert] = []
            rejected: list[Alert] = []
        elif isinstance(exc, SinkError):
            rejected = exc.rejected
            gone = {id(a) for a in rejected}
            undelivered = [a for a in batch if id(a) not in gone] if exc.undelivered is None else exc.undelivered
        else:  # a client error let through: nothing of the batch is known delivered
            undelivered, rejected = list(batch), []
        kept = {id(a) for a in undelivered} | {id(a) for a in rejected}
        delivered = [a for a in batch if id(a) not in kept]
        with self._cond:
            self._in_flight = []
            overflow: list[Alert] = []
            if not self._closed:
                self._queue.extendleft(reversed(undelivered))
                overflow = self._trim()
            recovered, wait = 0, 0.0
            if undelivered:
                self._failures_in_row += 1
                wait = self.backoff.delay(self._failures_in_row)
                if isinstance(exc, SinkError) and exc.retry_after_s is not None:  # the receiver's word, within ours
                    wait = max(wait, min(exc.retry_after_s, self.backoff.max_s))
                self._retry_at = time.monotonic() + wait
                if self._before_close and self._close_deadline is not None:
                    # the drain began while this attempt was out: its try at once (begin_close) is still due, not
                    # this attempt's backoff, which may end past the drain's deadline (the alerts dropped untried)
                    self._retry_at = time.monotonic()
            else:  # everything delivered (or refused for good): the sink answers again
                recovered, self._failures_in_row = self._failures_in_row, 0
            self.stats.delivered += len(delivered)
            self.stats.retried += int(retry)
            self.stats.failed += int(exc is not None)
            self._set_depth()
            self._cond.notify_all()
        if delivered:
            SINK_DELIVERED.labels(self.name).inc(len(delivered))
        if exc is not None:
            SINK_FAILURES.labels(self.name).inc()
            if undelivered:
                log.warning("alert sink %s: attempt failed, %d alert(s) stay queued, retry #%d in %.3gs: %s",
                            self.name, len(undelivered), self._failures_in_row, wait, exc)
        if rejected:
            self._drop(rejected, "rejected", str(exc))
        if overflow:
            self._drop(overflow, "overflow", self._overflow_why())
        if recovered:
            log.info("alert sink %s delivers again after %d failed attempt(s)", self.name, recovered)
        if delivered and self._closed:  # an attempt close() stopped waiting for, counted "closed" there
            log.warning("alert sink %s: an attempt cut off at close delivered %d alert(s) after all (counted "
                        "dropped at close): %s", self.name, len(delivered), _which(delivered))

    # -- both
    def _trim(self) -> list[Alert]:
        """Drop queued alerts beyond ``queue_size`` or ``queue_max_bytes`` (hold the lock); returns them. Superseded
        ones go first, oldest first: an alert with a later one of the same fingerprint queued behind it (a receiver's
        last word on that alert is the later one either way); then the oldest. Dropping the oldest alone dropped,
        under a sink down for hours and one flapping rule, a resolved whose firing was delivered before the outage:
        that alert stayed firing at the receiver for ever (and out of the state file, which keeps only the resolves
        still queued). The newest alert is kept, even alone over ``queue_max_bytes``."""
        excess = len(self._queue) - self.queue_size
        over = sum(a.weight() for a in self._queue) - self.queue_max_bytes
        if excess <= 0 and over <= 0:
            self._set_depth()
            return []
        seen: set[str] = set()
        superseded: set[int] = set()  # queue positions
        for i in range(len(self._queue) - 1, -1, -1):
            fp = self._queue[i].fingerprint
            if fp in seen:
                superseded.add(i)
            seen.add(fp)
        gone: set[int] = set()  # never the newest (queue_size >= 1): one alert over queue_max_bytes alone was dropped
        # as it was queued, into a queue holding nothing else, and never delivered however often it was sent
        for i in [*sorted(superseded), *(i for i in range(len(self._queue) - 1) if i not in superseded)]:
            if len(gone) >= excess and over <= 0:
                break
            gone.add(i)
            over -= self._queue[i].weight()
        dropped = [a for i, a in enumerate(self._queue) if i in gone]
        self._queue = deque(a for i, a in enumerate(self._queue) if i not in gone)
        self._set_depth()
        return dropped

    def _overflow_why(self) -> str:
        return (f"more than queue_size={self.queue_size} alerts, or queue_max_bytes={self.queue_max_bytes} bytes in "
                "them, wait for delivery")

    def _set_depth(self) -> None:
        self.stats.queued = len(self._queue) + len(self._in_flight)
        SINK_QUEUE.labels(self.name).set(self.stats.queued)

    def _drop(self, alerts: list[Alert], reason: str, why: str) -> None:
        with self._cond:
            self.stats.dropped[reason] += len(alerts)
        SINK_DROPPED.labels(self.name, reason).inc(len(alerts))
        log.error("alert sink %s dropped %d alert(s) (%s: %s): %s", self.name, len(alerts), reason, why,
                  _which(alerts))


class FanOut:
    """Hands every alert batch to each sink's own :class:`QueuedSink` (sinks given unqueued are queued
    with ``settings``) and returns at once; one sink failing or hanging never affects the others."""

    name = "fanout"

    def __init__(self, sinks: Sequence[AlertSink | QueuedSink], settings: SinkSettings = SinkSettings()) -> None:
        self.settings = settings
        self.sinks = [s if isinstance(s, QueuedSink) else QueuedSink(s, settings) for s in sinks]

    def send(self, alerts: Sequence[Alert], deadline: float | None = None) -> None:
        for sink in self.sinks:
            sink.send(alerts)

    @property
    def failures(self) -> Counter[str]:
        """Failed delivery attempts, by sink name."""
        out: Counter[str] = Counter()
        for s in self.sinks:
            out[s.name] += s.stats.failed
        return +out

    def stats(self) -> dict[str, dict[str, Any]]:
        """:class:`DeliveryStats` by sink name (a second sink of the same name as ``name#2``)."""
        out: dict[str, dict[str, Any]] = {}
        for s in self.sinks:
            key, n = s.name, 1
            while key in out:
                n += 1
                key = f"{s.name}#{n}"
            out[key] = s.stats.as_dict()
        return out

    def waiting(self) -> list[Alert]:
        """The alerts some sink has not delivered yet (:meth:`QueuedSink.waiting`), sink after sink."""
        return [a for s in self.sinks for a in s.waiting()]

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no sink has alerts waiting; False if that takes longer than ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        return all(s.wait_idle(max(0.0, deadline - time.monotonic())) for s in self.sinks)

    def close(self, timeout_s: float | None = None, abort: Callable[[], str | None] | None = None) -> int:
        """Drain every sink in parallel for at most ``timeout_s`` (default ``close_timeout_s``); the
        count of alerts left undelivered, over all sinks (each sink logs its own). ``abort``: as for
        :func:`drain` (a stop signal beyond the one that began the shutdown ends the drain)."""
        return drain(self.sinks, time.monotonic() + (self.settings.close_timeout_s if timeout_s is None else timeout_s),
                     abort)


def drain(queues: Sequence[QueuedSink], deadline: float, abort: Callable[[], str | None] | None = None) -> int:
    """Close ``queues`` together: each delivers what it holds until ``deadline`` (``time.monotonic()``); the count of
    alerts left undelivered. ``abort`` (polled every 0.2 s) naming a reason (a further stop signal) ends the drain at
    once, with a log line saying so; the alerts still queued are dropped and counted as at the deadline. Without it a
    second SIGTERM during ``streamrec monitor``'s drain killed the process: no summary, no last state-file save."""
    for queue in queues:
        queue.begin_close(deadline)
    while abort is not None and (left := deadline - time.monotonic()) > 0:
        if (why := abort()) is not None:
            log.warning("%s during the alert drain at shutdown: the drain ends now; the alerts still undelivered are "
                        "dropped", why)
            for queue in queues:
                queue.begin_close(time.monotonic())
            break
        idle_by = time.monotonic() + min(left, 0.2)
        if all(q.wait_idle(max(0.0, idle_by - time.monotonic())) for q in queues):
            break
    return sum(queue.finish_close() for queue in queues)


def build_sinks(settings: SinkSettings, kafka: KafkaSettings | None) -> FanOut:
    sinks: list[AlertSink] = []
    if settings.log:
        sinks.append(LogSink())
    if settings.kafka_topic:
        if kafka is None:
            raise ValueError("the kafka sink needs Kafka settings")
        sinks.append(KafkaSink(kafka, settings.kafka_topic, settings.kafka_timeout_s))
    if settings.webhook_url:
        sinks.append(WebhookSink(settings.webhook_url, settings.webhook_timeout_s))
    return FanOut(sinks, settings)

"""Contract: every alert sink of monitor/alerts.py keeps the promises of the ``AlertSink`` protocol and of the
module docstring.

Sinks: ``LogSink`` (a logger of its own), ``KafkaSink`` (the session's real broker), ``WebhookSink`` (an
``http.server`` started here), and ``QueuedSink`` wrapping each of the three.

* Protocol: ``name`` (non-empty), ``timeout_s`` (> 0) and ``batch_max`` (>= 1); ``send([])`` delivers nothing.
* An alert sent is delivered exactly once with every field intact (NaN/inf values, a missing threshold,
  labels, a multi-line unicode message), in the order sent: Kafka keyed by rule, the webhook one JSON body per
  alert, the log one line per alert at its documented level. A ``QueuedSink`` hands its sink at most
  ``batch_max`` alerts per attempt, from its one worker thread, one attempt at a time.
* Every alert carries its identity (``kind``, ``fingerprint``) to every sink: the absence alert of a rule and a
  series of the rule labelled ``absent="true"`` reach a sink as two alerts a receiver tells apart by
  ``fingerprint``, each resolved on its own.
* A failing destination (nothing listens: refused; or it accepts and never answers: silent) makes a direct
  sink raise :class:`SinkError` naming every alert as undelivered, by ``timeout_s`` or by the ``deadline``
  given, whichever comes first: never a hang. A ``QueuedSink`` never raises nor blocks its caller: the alerts
  stay queued, the failed attempts are counted, and ``close()`` ends by its timeout reporting them undelivered.
* ``close()`` flushes (a QueuedSink delivers what is queued before it returns), may be called twice, and a
  QueuedSink stops its worker, closes its sink once, and drops (counted) what is sent after it closed.
"""

from __future__ import annotations

import json
import logging
import math
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from monitor.alerts import (
    Alert,
    AlertKind,
    AlertSink,
    AlertState,
    KafkaSink,
    LogSink,
    Severity,
    SinkError,
    SinkSettings,
    WebhookSink,
)
from monitor.delivery import QueuedSink
from monitor.rule_engine import RuleEngine
from monitor.rules import loads_rules
from monitor.scrape import Snapshot
from stream.config import KafkaSettings
from tests.bounded_teardown import close_all
from tests.kafka_io import read_topic
from tests.unit.monitor.test_engine_identity import LAG_RULES

FAST = SinkSettings(retry_backoff_s=0.02, retry_backoff_max_s=0.1, close_timeout_s=10.0)
SLACK_S = 2.0  # on top of a deadline: a slow 2-core CI box, never a hang (the old inline sinks took 20 s+)
TS = 1_718_000_000_000


def alerts(n: int = 4) -> list[Alert]:
    """Alerts exercising every field: NaN and inf values, no threshold, labels, an awkward message, an absence
    alert (kind)."""
    kinds = [
        Alert("cold_start_share", "learner", Severity.WARNING, AlertState.FIRING, 0.83, 0.5,
              "share 83% > 50%", TS, {"field": "user_id"}),
        Alert("nan_losses", "learner,joiner", Severity.CRITICAL, AlertState.FIRING, math.inf, 0.0,
              'unicode \u2713 "quoted"\nsecond line', TS + 1, {}),
        Alert("window_auc", "learner", Severity.INFO, AlertState.FIRING, math.nan, None, "auc is NaN", TS + 2,
              {"a": "1", "b": "\u00e9"}),
        Alert("cold_start_share", "learner", Severity.WARNING, AlertState.RESOLVED, None, 0.5, "resolved",
              TS + 3, {"field": "user_id"}),
        Alert("learner_lag", "", Severity.WARNING, AlertState.FIRING, None, 500.0, "no data for 60s", TS + 4,
              {"absent": "true"}, AlertKind.ABSENT),
    ]
    return [kinds[i % len(kinds)] if i < len(kinds) else
            Alert(f"rule_{i}", "job", Severity.INFO, AlertState.FIRING, float(i), 1.0, f"alert {i}", TS + i)
            for i in range(n)]


# -- destinations -----------------------------------------------------------------------------------
class Webhook:
    """A local receiver: 200 and the body recorded, per POST."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        lock, bodies = threading.Lock(), self.bodies

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    bodies.append(body)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), name="contract-webhook")
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


class Silent:
    """A port that accepts connections (the kernel's backlog) and never answers a byte."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]

    def close(self) -> None:
        self.sock.close()


def refused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


# -- the implementations ----------------------------------------------------------------------------
@dataclass
class Target:
    """One sink implementation with a working destination, and how to read what it delivered."""

    name: str
    make: Callable[..., AlertSink]  # make(timeout_s=...) -> a sink to the working destination
    delivered: Callable[[], list[Any]]  # what the destination received, in order
    receipt: Callable[[Alert], Any]  # what the destination receives for one alert
    fail: Callable[[str, float], AlertSink] | None = None  # fail(kind, timeout_s) -> a sink to a failing one


@dataclass
class Spy:
    """Wraps a sink for a QueuedSink: records the batch sizes it is handed and how often it is closed."""

    inner: AlertSink
    batches: list[int] = field(default_factory=list)
    closed: int = 0
    threads: set[int] = field(default_factory=set)  # the threads that called send
    overlapping: int = 0  # calls that began while another was running

    def __post_init__(self) -> None:
        self.name, self.timeout_s, self.batch_max = self.inner.name, self.inner.timeout_s, self.inner.batch_max
        self._lock, self._active = threading.Lock(), 0

    def send(self, alerts: Sequence[Alert], deadline: float | None = None) -> None:
        with self._lock:
            self.batches.append(len(alerts))
            self.threads.add(threading.get_ident())
            self.overlapping += self._active > 0
            self._active += 1
        try:
            self.inner.send(alerts, deadline)
        finally:
            with self._lock:
                self._active -= 1

    def close(self) -> None:
        self.closed += 1
        self.inner.close()


def _log_target() -> Target:
    logger = logging.getLogger(f"contract.alerts.{uuid.uuid4().hex[:8]}")
    logger.propagate, logger.level = False, logging.DEBUG
    handler = ListHandler()
    logger.addHandler(handler)

    def level(a: Alert) -> int:
        if a.state is AlertState.RESOLVED:
            return logging.INFO
        return logging.ERROR if a.severity is Severity.CRITICAL else logging.WARNING

    return Target("log", lambda timeout_s=5.0: LogSink(logger),
                  lambda: [(r.levelno, r.getMessage()) for r in handler.records],
                  lambda a: (level(a), a.describe()))


def _kafka_target(kafka: KafkaSettings, closers: list[Callable[[], None]]) -> Target:
    topic = f"alerts-{uuid.uuid4().hex[:10]}"

    def fail(kind: str, timeout_s: float) -> AlertSink:
        if kind == "silent":
            silent = Silent()
            closers.append(silent.close)
            port = silent.port
        else:
            port = refused_port()
        return KafkaSink(KafkaSettings(bootstrap_servers=f"127.0.0.1:{port}"), topic, timeout_s=timeout_s)

    return Target("kafka", lambda timeout_s=10.0: KafkaSink(kafka, topic, timeout_s=timeout_s),
                  lambda: [(r.key, json.loads(r.value)) for r in read_topic(kafka, topic)],
                  lambda a: (a.key, a.as_dict()), fail)


def _webhook_target(closers: list[Callable[[], None]]) -> Target:
    hook = Webhook()
    closers.append(hook.close)

    def fail(kind: str, timeout_s: float) -> AlertSink:
        if kind == "silent":
            silent = Silent()
            closers.append(silent.close)
            return WebhookSink(f"http://127.0.0.1:{silent.port}/hook", timeout_s=timeout_s)
        return WebhookSink(f"http://127.0.0.1:{refused_port()}/hook", timeout_s=timeout_s)

    return Target("webhook", lambda timeout_s=5.0: WebhookSink(hook.url, timeout_s=timeout_s),
                  lambda: list(hook.bodies), lambda a: a.as_dict(), fail)


SINKS = ["log", "kafka", "webhook"]
FAILABLE = ["kafka", "webhook"]  # a log record cannot fail: LogSink has no failing destination


@pytest.fixture
def closers() -> Iterator[list[Callable[[], None]]]:
    out: list[Callable[[], None]] = []
    yield out
    close_all(reversed(out))


def build_target(name: str, request: pytest.FixtureRequest, closers: list[Callable[[], None]]) -> Target:
    if name == "log":
        return _log_target()
    if name == "kafka":
        return _kafka_target(request.getfixturevalue("kafka"), closers)  # only kafka targets start the broker
    return _webhook_target(closers)


@dataclass
class Queued:
    """The QueuedSink variant: each sink behind its own queue (what the monitor uses)."""

    queue: QueuedSink
    spy: Spy


def queued(sink: AlertSink, closers: list[Callable[[], None]], settings: SinkSettings = FAST) -> Queued:
    spy = Spy(sink)
    q = QueuedSink(spy, settings)
    closers.append(lambda: q.close(timeout_s=1.0))  # a no-op after the test's own close
    return Queued(q, spy)


# -- protocol ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", SINKS)
def test_every_sink_has_the_protocol_attributes_and_an_empty_send_delivers_nothing(
        name: str, request: pytest.FixtureRequest, closers: list[Callable[[], None]]) -> None:
    target = build_target(name, request, closers)
    sink = target.make()
    assert isinstance(sink.name, str) and sink.name
    assert isinstance(sink.timeout_s, int | float) and 0 < sink.timeout_s < math.inf
    assert isinstance(sink.batch_max, int) and sink.batch_max >= 1
    sink.send([])
    q = queued(target.make(), closers)
    q.queue.send([])
    assert q.queue.depth == 0 and q.queue.close(timeout_s=5.0) == 0
    sink.close()
    assert target.delivered() == [] and q.spy.batches == []


# -- delivery ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", SINKS)
def test_an_alert_sent_is_delivered_once_with_its_fields_intact(
        name: str, request: pytest.FixtureRequest, closers: list[Callable[[], None]]) -> None:
    target = build_target(name, request, closers)
    sink = target.make()
    batch = alerts(5)
    for i in range(0, len(batch), sink.batch_max):  # the caller's side of the protocol: <= batch_max per send
        sink.send(batch[i:i + sink.batch_max])
    sink.close()
    assert target.delivered() == [target.receipt(a) for a in batch]


@pytest.mark.parametrize("name", SINKS)
def test_a_queued_sink_delivers_every_alert_once_in_order_in_batches_of_at_most_batch_max(
        name: str, request: pytest.FixtureRequest, closers: list[Callable[[], None]]) -> None:
    target = build_target(name, request, closers)
    q = queued(target.make(), closers)
    batch = alerts(2 * q.spy.batch_max + 1 if q.spy.batch_max < 10 else 25)
    t0 = time.monotonic()
    for a in batch:
        q.queue.send([a])
    assert time.monotonic() - t0 < 1.0, "send() only queues"
    assert q.queue.wait_idle(20.0), q.queue.stats
    assert target.delivered() == [target.receipt(a) for a in batch]
    assert q.queue.stats.delivered == len(batch) and q.queue.stats.failed == 0 and not q.queue.stats.dropped
    assert sum(q.spy.batches) == len(batch) and max(q.spy.batches) <= q.spy.batch_max
    assert q.spy.overlapping == 0 and q.spy.threads == {q.queue._thread.ident}  # one thread: its worker
    assert q.queue.close(timeout_s=5.0) == 0


# -- identity ----------------------------------------------------------------------------------------


def _absent_and_series_alerts() -> list[Alert]:
    """What the engine sends when a rule's absence alert and its series labelled absent="true" both fire and then
    resolve one after the other (the series is held firing while its source fails: hold_s)."""
    engine = RuleEngine(loads_rules(LAG_RULES).rules, hold_s=600)

    def lag(v: float) -> Snapshot:
        return Snapshot.from_texts({"learner": f'lag{{absent="true"}} {v}\n'})

    failed = Snapshot(errors={"learner": "down"})
    steps = [(0, lag(900)), (30, failed), (90, failed), (120, lag(800)), (135, lag(3))]
    return [a for t, snap in steps for a in engine.evaluate(snap, t)]


def _identity(name: str, receipt: Any) -> str:
    """What a receiver groups alerts by: the fingerprint (the log line says it as ``id=``)."""
    if name == "log":
        return next(w[3:].rstrip(":") for w in receipt[1].split() if w.startswith("id="))
    body = receipt[1] if name == "kafka" else receipt
    return str(body["fingerprint"])


def _state(name: str, receipt: Any) -> str:
    return receipt[1].split()[0].lower() if name == "log" else (receipt[1] if name == "kafka" else receipt)["state"]


@pytest.mark.parametrize("name", SINKS)
def test_an_absence_alert_and_a_series_labelled_absent_true_reach_the_sink_as_two_alerts_that_resolve_apart(
        name: str, request: pytest.FixtureRequest, closers: list[Callable[[], None]]) -> None:
    batch = _absent_and_series_alerts()
    # the series fires, then the absence alert; data again resolves the absence alert, then the series resolves
    assert [(a.kind, a.state) for a in batch] == [(AlertKind.SERIES, AlertState.FIRING),
                                                  (AlertKind.ABSENT, AlertState.FIRING),
                                                  (AlertKind.ABSENT, AlertState.RESOLVED),
                                                  (AlertKind.SERIES, AlertState.RESOLVED)]
    assert {frozenset(a.labels.items()) for a in batch} == {frozenset({("absent", "true")})}  # same labels: both
    target = build_target(name, request, closers)
    sink = target.make()
    for i in range(0, len(batch), sink.batch_max):
        sink.send(batch[i:i + sink.batch_max])
    sink.close()
    got = target.delivered()
    assert got == [target.receipt(a) for a in batch]
    by_identity: dict[str, list[str]] = {}
    for receipt in got:
        by_identity.setdefault(_identity(name, receipt), []).append(_state(name, receipt))
    # two alerts, each fired once and resolved once: neither resolved (or deduplicated) the other
    assert sorted(by_identity.values()) == [["firing", "resolved"], ["firing", "resolved"]]
    assert len(by_identity) == 2


# -- failing destinations ----------------------------------------------------------------------------
def _failed_alerts(exc: SinkError, sent: Sequence[Alert]) -> tuple[list[Alert], list[Alert]]:
    rejected = list(exc.rejected)
    undelivered = ([a for a in sent if all(a is not r for r in rejected)] if exc.undelivered is None
                   else list(exc.undelivered))
    return undelivered, rejected


@pytest.mark.parametrize("kind", ["refused", "silent"])
@pytest.mark.parametrize("name", FAILABLE)
def test_a_failing_destination_is_a_sink_error_naming_every_alert_by_timeout_s(
        name: str, kind: str, request: pytest.FixtureRequest, closers: list[Callable[[], None]]) -> None:
    target = build_target(name, request, closers)
    assert target.fail is not None
    timeout_s = 1.0
    sink = target.fail(kind, timeout_s)
    batch = alerts(min(3, sink.batch_max))
    t0 = time.monotonic()
    with pytest.raises(SinkError) as caught:
        sink.send(batch)
    took = time.monotonic() - t0
    assert took < timeout_s + SLACK_S, f"{name} took {took:.1f}s against a {kind} destination"
    undelivered, rejected = _failed_alerts(caught.value, batch)
    assert rejected == [] and [id(a) for a in undelivered] == [id(a) for a in batch]  # nothing claimed delivered
    sink.close()
    sink.close()


@pytest.mark.parametrize("name", FAILABLE)
def test_a_failing_destination_is_a_sink_error_by_the_deadline_given(
        name: str, request: pytest.FixtureRequest, closers: list[Callable[[], None]]) -> None:
    target = build_target(name, request, closers)
    assert target.fail is not None
    sink = target.fail("silent", 60.0)  # the sink's own timeout is far away: the deadline must win
    t0 = time.monotonic()
    with pytest.raises(SinkError):
        sink.send(alerts(1), deadline=t0 + 1.0)
    assert time.monotonic() - t0 < 1.0 + SLACK_S
    sink.close()


@pytest.mark.parametrize("kind", ["refused", "silent"])
@pytest.mark.parametrize("name", FAILABLE)
def test_a_queued_sink_to_a_failing_destination_never_blocks_keeps_the_alerts_and_reports_them_at_close(
        name: str, kind: str, request: pytest.FixtureRequest, closers: list[Callable[[], None]]) -> None:
    target = build_target(name, request, closers)
    assert target.fail is not None
    q = queued(target.fail(kind, 0.5), closers)
    batch = alerts(3)
    t0 = time.monotonic()
    q.queue.send(batch)
    assert time.monotonic() - t0 < 0.5, "send() must not wait for the sink"
    deadline = time.monotonic() + 10
    while q.queue.stats.failed < 2 and time.monotonic() < deadline:  # a first attempt and a retry
        time.sleep(0.02)
    assert q.queue.stats.failed >= 2 and q.queue.stats.retried >= 1, q.queue.stats
    assert q.queue.depth == len(batch) and q.queue.stats.delivered == 0
    t0 = time.monotonic()
    assert q.queue.close(timeout_s=0.5) == len(batch)
    assert time.monotonic() - t0 < 0.5 + QueuedSink.JOIN_GRACE_S + 0.5 + SLACK_S
    assert q.queue.stats.dropped["closed"] == len(batch) and q.queue.depth == 0


# -- close --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", SINKS)
def test_close_is_idempotent_and_nothing_sent_before_it_is_lost(
        name: str, request: pytest.FixtureRequest, closers: list[Callable[[], None]]) -> None:
    target = build_target(name, request, closers)
    sink = target.make()
    batch = alerts(2)
    sink.send(batch[: sink.batch_max])
    sink.close()
    sink.close()
    assert target.delivered() == [target.receipt(a) for a in batch[: sink.batch_max]]


@pytest.mark.parametrize("name", SINKS)
def test_a_queued_sink_close_flushes_the_queue_stops_its_worker_and_drops_what_comes_after(
        name: str, request: pytest.FixtureRequest, closers: list[Callable[[], None]]) -> None:
    target = build_target(name, request, closers)
    q = queued(target.make(), closers)
    batch = alerts(5)
    q.queue.send(batch)
    assert q.queue.close() == 0  # no wait_idle first: close itself delivers what is queued
    assert target.delivered() == [target.receipt(a) for a in batch]
    assert q.queue.close() == 0 and q.spy.closed == 1  # idempotent; the sink closed once, by the worker
    worker = q.queue._thread  # the worker thread (private): it must have ended
    assert not worker.is_alive()
    late = alerts(6)[5:]
    q.queue.send(late)
    assert q.queue.stats.dropped["closed"] == 1 and q.queue.depth == 0
    assert target.delivered() == [target.receipt(a) for a in batch]

"""Alert delivery: every sink behind its own queue and worker thread (monitor.delivery.QueuedSink).

Against real local HTTP servers that are dead (a closed port), hang (hold the request until the test
releases an Event), trickle their answer one byte per 0.5 s, fail the first requests with 500, or
refuse with 400; and against a dead Kafka broker and the real one. What is promised: rule evaluation
never waits for a sink, one sink never waits for another, every attempt ends by its total deadline,
undelivered alerts stay queued and are retried until delivered (in order), an overflow drops the
oldest and counts them, and close() reports what it could not deliver.

Time bounds here are an order of magnitude above what the code needs (the old inline sinks took 3.5 s
against a refused port, 20 s or more against a silent or trickling server); where it matters, the test
proves "did not wait" with an Event the server holds instead of a clock.
"""

from __future__ import annotations

import dataclasses
import email.utils
import json
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import REGISTRY

from monitor.alerts import Alert, AlertState, KafkaSink, Severity, SinkError, SinkSettings, WebhookSink
from monitor.delivery import FanOut, QueuedSink, build_sinks
from monitor.engine import Monitor
from monitor.http_deadline import retry_after_s
from monitor.rules import RulesError, loads_rules
from monitor.scrape import Snapshot
from stream.config import KafkaSettings
from tests.bounded_teardown import close_all
from tests.kafka_io import read_topic

FAST = SinkSettings(retry_backoff_s=0.01, retry_backoff_max_s=0.05)

RULE = """
[[rule]]
name = "cold_start_share"
expr = 'streamrec_learner_bucket_share{field="user_id"}'
op = ">"
threshold = 0.5
for_s = 0
"""


# -- helpers --------------------------------------------------------------------------------------
class HookServer:
    """A local webhook receiver on a free port. ``mode``:

    * ``ok``: 200 and the JSON body recorded;
    * ``hang``: the first request waits until :attr:`release` is set (``entered`` says it arrived);
      later ones are answered at once;
    * ``trickle``: the answer goes out one byte per ``trickle_s``;
    * ``flaky``: 500 for the first ``fail_first`` requests, then 200;
    * ``reject``: 400 for every request;
    * ``throttle``: 429 with ``Retry-After: <retry_after>`` for the first ``fail_first`` requests, then 200;
    * ``limit``: 413 for a body over ``max_body`` bytes (read whole first), else 200.

    :attr:`arrived` holds each request's ``time.monotonic()``.
    """

    def __init__(self, mode: str = "ok", fail_first: int = 0, trickle_s: float = 0.5, retry_after: str = "1",
                 max_body: int = 1 << 16) -> None:
        self.mode, self.fail_first, self.trickle_s, self.retry_after = mode, fail_first, trickle_s, retry_after
        self.max_body = max_body
        self.arrived: list[float] = []
        self.posts: list[dict] = []
        self.requests = 0
        self.entered, self.release, self.stopped = threading.Event(), threading.Event(), threading.Event()
        self.lock = threading.Lock()
        srv = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802
                size = int(self.headers["Content-Length"])
                body = json.loads(self.rfile.read(size))
                with srv.lock:
                    srv.requests += 1
                    n = srv.requests
                    srv.arrived.append(time.monotonic())
                srv.entered.set()
                if srv.mode == "hang" and n == 1:
                    srv.release.wait(60)
                if srv.mode == "trickle":
                    self.trickle(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
                    self.close_connection = True  # cut short by close(): hang up, so neither side waits on
                    return  # a keep-alive connection (the client until its deadline, this thread for a request)
                if srv.mode == "limit" and size > srv.max_body:
                    self.answer(413)
                    return
                if srv.mode == "throttle" and n <= srv.fail_first:
                    self.answer(429, {"Retry-After": srv.retry_after})
                    return
                if (srv.mode == "flaky" and n <= srv.fail_first) or srv.mode == "reject":
                    self.answer(500 if srv.mode == "flaky" else 400)
                    return
                with srv.lock:
                    srv.posts.append(body)
                self.answer(200)

            def answer(self, status: int, headers: dict[str, str] | None = None) -> None:
                self.send_response(status)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Length", "0")
                self.send_header("Connection", "close")
                self.end_headers()

            def trickle(self, data: bytes) -> None:
                try:
                    for i in range(len(data)):
                        if srv.stopped.wait(srv.trickle_s):
                            return
                        self.wfile.write(data[i:i + 1])
                except OSError:  # the client gave up: what the test wants
                    pass

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stopped.set()
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture
def hook_server() -> Iterator[Callable[..., HookServer]]:
    servers: list[HookServer] = []

    def make(*args, **kw) -> HookServer:
        servers.append(HookServer(*args, **kw))
        return servers[-1]

    try:
        yield make
    finally:
        close_all(s.close for s in servers)


def closed_port() -> int:
    """A port nothing listens on: connections are refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alert(i: int = 0, state: AlertState = AlertState.FIRING) -> Alert:
    return Alert(rule="cold_start_share", source="learner", severity=Severity.WARNING, state=state, value=0.9,
                 threshold=0.5, message=f"alert {i}", ts=1_700_000_000_000 + i, labels={"field": "user_id"})


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


class ListSink:
    """An in-process sink that records what it gets; ``block`` makes each attempt wait for an Event."""

    timeout_s, batch_max = 5.0, 100

    def __init__(self, name: str | None = None, block: bool = False) -> None:
        self.name = name or f"list-{uuid.uuid4().hex[:8]}"
        self.got: list[Alert] = []
        self.block, self.entered, self.release = block, threading.Event(), threading.Event()

    def send(self, alerts, deadline=None) -> None:
        self.entered.set()
        if self.block:
            self.release.wait(30)
        self.got.extend(alerts)

    def close(self) -> None:
        pass


def wait_until(cond: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def alternating_scrape() -> Callable[[], Snapshot]:
    """Every scrape flips the user_id share across the threshold: one alert per evaluation."""
    n = [0]

    def scrape() -> Snapshot:
        n[0] += 1
        share = 0.9 if n[0] % 2 else 0.1
        return Snapshot.from_texts({"learner": f'streamrec_learner_bucket_share{{field="user_id"}} {share}\n'})

    return scrape


# -- rule evaluation never waits for a sink -------------------------------------------------------
def test_evaluation_runs_on_while_the_webhook_holds_a_request(hook_server) -> None:
    server = hook_server("hang")
    config = loads_rules(f'interval_s = 0.1\n[sinks]\nlog = false\nwebhook_url = "{server.url}"\n'
                         f"webhook_timeout_s = 60\n" + RULE)
    monitor = Monitor(config, build_sinks(config.sinks, None), scrape=alternating_scrape())
    stop = threading.Event()
    loop = threading.Thread(target=monitor.run, args=(stop,), daemon=True)
    loop.start()
    try:
        assert server.entered.wait(10), "the first alert never reached the webhook"
        at_entry = monitor.engine.evaluations
        # the server still holds the first request: the loop must go on evaluating regardless
        assert wait_until(lambda: monitor.engine.evaluations >= at_entry + 20), (
            f"only {monitor.engine.evaluations - at_entry} evaluation(s) while the webhook held a request")
        assert not server.release.is_set() and server.posts == []
        assert monitor.sink.sinks[0].depth >= 10  # queued behind the held request, none lost
        assert metric("streamrec_monitor_sink_queue_depth", sink="webhook") >= 10
    finally:
        server.release.set()
        stop.set()
        loop.join(5)
    assert not loop.is_alive()
    assert monitor.close(10) == 0
    sent = monitor.sent["firing"] + monitor.sent["resolved"]
    assert len(server.posts) == sent  # every alert, once, in the order evaluation raised them
    assert [p["state"] for p in server.posts] == ["firing", "resolved"] * (sent // 2) + ["firing"] * (sent % 2)
    assert [p["ts"] for p in server.posts] == sorted(p["ts"] for p in server.posts)


def test_a_dead_webhook_does_not_slow_evaluation_nor_the_other_sinks() -> None:
    config = loads_rules(f'[sinks]\nlog = false\nwebhook_url = "http://127.0.0.1:{closed_port()}/hook"\n' + RULE)
    listed = ListSink()
    fan = FanOut([*build_sinks(config.sinks, None).sinks, QueuedSink(listed, config.sinks)], config.sinks)
    monitor = Monitor(config, fan, scrape=alternating_scrape())
    started = time.monotonic()
    for _ in range(5):
        monitor.step()
    assert time.monotonic() - started < 1.0  # the old inline sink spent 3.5 s per alert on this port
    assert fan.sinks[1].wait_idle(5) and len(listed.got) == 5
    assert wait_until(lambda: fan.sinks[0].stats.failed >= 1)
    assert monitor.close(0.2) == 5  # the webhook's five stay undelivered; the list sink got all


# -- every attempt ends by its deadline -----------------------------------------------------------
def test_a_trickling_webhook_is_cut_off_at_the_attempts_deadline(hook_server) -> None:
    server = hook_server("trickle", trickle_s=0.5)  # the whole answer would take 30 s
    sink = WebhookSink(server.url, timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(SinkError, match="deadline") as info:
        sink.send([alert()])
    took = time.monotonic() - started
    assert 0.9 <= took < 2.5, took  # cut off at 1 s, although every byte came within 0.5 s of the last
    assert info.value.undelivered == [alert()] and server.requests == 1


def test_a_trickling_webhook_never_delays_the_other_sinks(hook_server) -> None:
    server = hook_server("trickle", trickle_s=0.5)
    listed = ListSink()
    fan = FanOut([WebhookSink(server.url, timeout_s=30), listed], FAST)
    fan.send([alert(1), alert(2)])
    assert server.entered.wait(10)
    assert fan.sinks[1].wait_idle(5) and len(listed.got) == 2
    assert fan.sinks[0].depth == 2 and fan.sinks[0].stats.failed == 0  # the webhook is still mid-answer
    started = time.monotonic()
    assert fan.close(0.5) == 2  # close does not wait for the attempt in progress (its deadline is 30 s)
    assert time.monotonic() - started < 2.0


# -- undelivered alerts stay queued until delivered -------------------------------------------------
def test_a_flaky_webhook_eventually_gets_every_alert_in_order(hook_server) -> None:
    server = hook_server("flaky", fail_first=5)
    before = {m: metric(f"streamrec_monitor_sink_{m}_total", sink="webhook")
              for m in ("delivered", "failures", "retries")}
    sink = QueuedSink(WebhookSink(server.url, timeout_s=2), FAST)
    sink.send([alert(i) for i in range(10)])
    sink.send([alert(i) for i in range(10, 20)])
    assert sink.wait_idle(20)
    assert [p["ts"] for p in server.posts] == [alert(i).ts for i in range(20)]  # none lost, in order
    assert (sink.stats.delivered, sink.stats.failed, sink.stats.retried) == (20, 5, 5)
    assert not sink.stats.dropped and sink.depth == 0
    after = {m: metric(f"streamrec_monitor_sink_{m}_total", sink="webhook") for m in before}
    assert {m: after[m] - before[m] for m in before} == {"delivered": 20, "failures": 5, "retries": 5}
    assert sink.close(1) == 0


def test_retries_back_off_exponentially(hook_server) -> None:
    server = hook_server("flaky", fail_first=4)
    sink = QueuedSink(WebhookSink(server.url, timeout_s=2), SinkSettings(retry_backoff_s=0.1,
                                                                          retry_backoff_max_s=0.2))
    started = time.monotonic()
    sink.send([alert()])
    assert sink.wait_idle(10)
    # waits 0.1 + 0.2 + 0.2 + 0.2 (capped) between the five attempts
    assert time.monotonic() - started >= 0.7 and server.requests == 5 and len(server.posts) == 1
    sink.close(1)


def test_a_throttling_webhooks_retry_after_is_waited_for_up_to_the_backoff_maximum(hook_server) -> None:
    """A 429 with ``Retry-After: 1`` got its retry 0.01 s later (the backoff alone): more requests to a receiver
    that asked for a pause. Now the wait is what it asks, within ``retry_backoff_max_s``."""
    server = hook_server("throttle", fail_first=1, retry_after="1")
    with pytest.raises(SinkError) as info:
        WebhookSink(server.url, timeout_s=2).send([alert()])
    assert info.value.retry_after_s == 1.0 and info.value.undelivered == [alert()]
    server.requests, server.arrived = 0, []
    sink = QueuedSink(WebhookSink(server.url, timeout_s=2), SinkSettings(retry_backoff_s=0.01, retry_backoff_max_s=5))
    sink.send([alert()])
    assert sink.wait_idle(10) and len(server.posts) == 1
    assert server.arrived[1] - server.arrived[0] >= 1.0  # waited as asked, not 0.01 s
    sink.close(1)
    capped = hook_server("throttle", fail_first=1, retry_after="86400")  # a day: not more than retry_backoff_max_s
    sink = QueuedSink(WebhookSink(capped.url, timeout_s=2), SinkSettings(retry_backoff_s=0.01, retry_backoff_max_s=0.2))
    sink.send([alert()])
    assert sink.wait_idle(10) and len(capped.posts) == 1
    sink.close(1)


def test_retry_after_reads_seconds_and_http_dates_and_nothing_else() -> None:
    assert (retry_after_s("120"), retry_after_s(" 0 "), retry_after_s(None)) == (120.0, 0.0, None)
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # a date past: at once
    assert 3500 < retry_after_s(email.utils.formatdate(time.time() + 3600, usegmt=True)) <= 3600
    assert [retry_after_s(v) for v in ("-5", "1.5", "soon", "\xb2", "")] == [None] * 5


def test_an_alert_too_large_for_the_webhook_goes_shortened_with_its_fingerprint(hook_server) -> None:
    """A scraped label value of 200 KB: the receiver's 413 dropped the alert ("rejected"), firing and resolved alike.
    It goes shortened instead (same fingerprint), as to Kafka; one over MAX_BODY goes shortened at once."""
    big = dataclasses.replace(alert(1), labels={"field": "user_id", "path": "x" * 200_000})
    server = hook_server("limit", max_body=1 << 16)
    sink = QueuedSink(WebhookSink(server.url, timeout_s=5), FAST)
    sink.send([big, dataclasses.replace(big, state=AlertState.RESOLVED)])
    assert sink.wait_idle(10) and not sink.stats.dropped
    assert [(p["state"], p["fingerprint"]) for p in server.posts] == [("firing", big.fingerprint),
                                                                      ("resolved", big.fingerprint)]
    assert server.posts[0]["labels"]["path"].endswith("... (200000 characters)") and server.requests == 4
    sink.close(1)
    huge = dataclasses.replace(big, labels={"path": "x" * (WebhookSink.MAX_BODY + 1)})
    plain = hook_server("ok")
    WebhookSink(plain.url, timeout_s=5).send([huge])
    assert plain.posts[0]["labels"]["path"].endswith("characters)") and plain.requests == 1


def test_an_alert_the_webhook_refuses_is_dropped_counted_and_logged(hook_server, caplog) -> None:
    server = hook_server("reject")
    before = metric("streamrec_monitor_sink_dropped_total", sink="webhook", reason="rejected")
    sink = QueuedSink(WebhookSink(server.url, timeout_s=2), FAST)
    with caplog.at_level("ERROR", logger="streamrec.alerts"):
        sink.send([alert(1), alert(2)])
        assert sink.wait_idle(10)
    assert server.requests == 2 and sink.stats.dropped == {"rejected": 2}  # not retried: it cannot help
    assert metric("streamrec_monitor_sink_dropped_total", sink="webhook", reason="rejected") - before == 2
    assert "HTTP 400" in caplog.text and "dropped 1 alert(s) (rejected" in caplog.text
    assert sink.close(1) == 0


# -- bounded queues -------------------------------------------------------------------------------------
def test_an_overflowing_queue_drops_the_oldest_counts_and_logs_them(caplog) -> None:
    blocked = ListSink(block=True)
    sink = QueuedSink(blocked, SinkSettings(queue_size=3))
    sink.send([alert(0)])
    assert blocked.entered.wait(5)  # alert 0 is being sent; the attempt waits for the test
    with caplog.at_level("ERROR", logger="streamrec.alerts"):
        for i in range(1, 10):
            sink.send([alert(i)])
    assert sink.stats.dropped == {"overflow": 6} and sink.depth == 4  # 7, 8, 9 queued + 0 in flight
    assert metric("streamrec_monitor_sink_dropped_total", sink=blocked.name, reason="overflow") == 6
    assert metric("streamrec_monitor_sink_queue_depth", sink=blocked.name) == 4
    assert caplog.text.count("(overflow: more than queue_size=3 alerts, or queue_max_bytes=67108864 bytes in them, "
                             "wait for delivery)") == 6
    assert "ts=1700000000001)" in caplog.text.splitlines()[0]  # the log names what was dropped: the oldest first
    blocked.release.set()
    assert sink.wait_idle(5)
    assert [a.message for a in blocked.got] == ["alert 0", "alert 7", "alert 8", "alert 9"]
    assert sink.close(1) == 0


def test_a_queue_holds_alerts_with_huge_labels_shortened_and_at_most_queue_max_bytes_of_them(caplog) -> None:
    """Bounded by alert count alone, 1000 queued alerts with a scraped label of 10 MB held 10 GB while a sink was
    down. An alert over the webhook's body limit is queued shortened (what every sink sends of it), its fingerprint
    kept, and the queue holds at most queue_max_bytes: the oldest beyond it are dropped, counted and logged."""
    blocked = ListSink(block=True)
    sink = QueuedSink(blocked, SinkSettings(queue_size=1000, queue_max_bytes=20_000))
    sink.send([alert(0)])
    assert blocked.entered.wait(5)  # alert 0 is being sent; the attempt waits for the test
    huge = [dataclasses.replace(alert(i), labels={"path": "x" * 10_000_000}) for i in range(1, 41)]
    with caplog.at_level("ERROR", logger="streamrec.alerts"):
        for a in huge:
            sink.send([a])
    queued = sink.waiting()[1:]
    assert sum(a.weight() for a in queued) <= 20_000  # before: 40 alerts of 10 MB each, 400 MB
    assert all(a.labels["path"].endswith("... (10000000 characters)") for a in queued)
    assert [a.fingerprint for a in queued] == [a.fingerprint for a in huge[-len(queued):]]  # the newest kept
    dropped = 40 - len(queued)
    assert dropped > 0 and sink.stats.dropped == {"overflow": dropped}
    assert metric("streamrec_monitor_sink_dropped_total", sink=blocked.name, reason="overflow") == dropped
    assert caplog.text.count("queue_max_bytes=20000 bytes in them, wait for delivery)") == dropped
    blocked.release.set()
    assert sink.wait_idle(5) and sink.close(1) == 0


def test_queue_max_bytes_counts_an_alerts_text_in_utf8_bytes_not_characters() -> None:
    """A scraped label of emoji is four bytes a character: counted in characters, three such alerts of ~8 kB each
    weighed ~2.3 kB each and a queue bound of 20 kB held all three (~25 kB), four times the bound for text of 4-byte
    characters. Counted in UTF-8 bytes (what a sink sends), the oldest goes."""
    wide = [dataclasses.replace(alert(i), labels={"path": "\U0001F600" * 2_000}) for i in range(1, 4)]
    assert wide[0].weight() >= 8_000 and len(wide[0].labels["path"]) == 2_000
    blocked = ListSink(block=True)
    sink = QueuedSink(blocked, SinkSettings(queue_size=1000, queue_max_bytes=20_000))
    sink.send([alert(0)])
    assert blocked.entered.wait(5)  # alert 0 is being sent; the queue fills behind it
    for a in wide:
        sink.send([a])
    queued = sink.waiting()[1:]
    assert [a.message for a in queued] == ["alert 2", "alert 3"] and sink.stats.dropped == {"overflow": 1}
    blocked.release.set()
    assert sink.wait_idle(5) and sink.close(1) == 0


def test_an_alert_heavier_than_queue_max_bytes_alone_is_queued_and_delivered_not_dropped() -> None:
    """One alert over queue_max_bytes (but under the webhook's body limit, so not shortened) into an empty queue was
    dropped as overflow at once: the queue held nothing else, and that alert, sent again at each evaluation while it
    fired, was never delivered. The newest alert stays; the bound drops the older ones."""
    blocked = ListSink(block=True)
    sink = QueuedSink(blocked, SinkSettings(queue_max_bytes=5_000))
    try:
        sink.send([alert(0)])
        assert blocked.entered.wait(5)  # alert 0 is being sent; the attempt waits for the test
        heavy = [dataclasses.replace(alert(i), labels={"path": "x" * 20_000}) for i in (1, 2)]
        sink.send([heavy[0]])
        assert [a.ts for a in sink.waiting()[1:]] == [heavy[0].ts] and sink.stats.dropped == {}
        sink.send([heavy[1]])  # the older one goes for the bound; the newest stays
        assert [a.ts for a in sink.waiting()[1:]] == [heavy[1].ts] and sink.stats.dropped == {"overflow": 1}
    finally:
        blocked.release.set()
    assert sink.wait_idle(5) and sink.close(1) == 0
    assert [a.ts for a in blocked.got] == [alert(0).ts, heavy[1].ts]


def test_an_overflow_drops_a_flapping_rules_superseded_alerts_not_a_resolved_whose_firing_was_delivered() -> None:
    """A sink down while one rule flaps: the queue fills with that rule's firing/resolved pairs. Dropping the oldest
    dropped the resolved of an alert whose firing went out before the outage, and the receiver showed it firing for
    ever; the flapping series' earlier records are superseded by its later ones and go first."""
    def of(rule: str, state: AlertState, i: int) -> Alert:
        return Alert(rule=rule, source="learner", severity=Severity.WARNING, state=state, value=0.9, threshold=0.5,
                     message=f"{rule} {i}", ts=1_700_000_000_000 + i, labels={})

    blocked = ListSink(block=True)
    sink = QueuedSink(blocked, SinkSettings(queue_size=3))
    sink.send([of("steady", AlertState.FIRING, 0)])
    assert blocked.entered.wait(5)  # its firing is being delivered; the sink then stays down a while
    sink.send([of("steady", AlertState.RESOLVED, 1)])
    for i in range(2, 12):
        sink.send([of("flapping", AlertState.FIRING if i % 2 == 0 else AlertState.RESOLVED, i)])
    assert sink.stats.dropped == {"overflow": 8}
    blocked.release.set()
    assert sink.wait_idle(5)
    got = [(a.rule, a.state.value) for a in blocked.got]
    assert got == [("steady", "firing"), ("steady", "resolved"), ("flapping", "firing"), ("flapping", "resolved")]
    assert sink.close(1) == 0


# -- close -------------------------------------------------------------------------------------------
def test_close_reports_the_alerts_it_could_not_deliver(caplog) -> None:
    sink = QueuedSink(WebhookSink(f"http://127.0.0.1:{closed_port()}/hook", timeout_s=1), FAST)
    before = metric("streamrec_monitor_sink_dropped_total", sink="webhook", reason="closed")
    sink.send([alert(i) for i in range(5)])
    assert wait_until(lambda: sink.stats.failed >= 2)
    started = time.monotonic()
    with caplog.at_level("ERROR", logger="streamrec.alerts"):
        assert sink.close(timeout_s=0.3) == 5
    assert time.monotonic() - started < 1.5
    assert "alert sink webhook closed with 5 alert(s) undelivered" in caplog.text
    assert sink.stats.dropped == {"closed": 5} and sink.depth == 0
    assert metric("streamrec_monitor_sink_dropped_total", sink="webhook", reason="closed") - before == 5
    assert sink.close(1) == 0  # closing twice reports nothing twice
    sink.send([alert(9)])  # after close nothing is queued, and nothing vanishes silently
    assert sink.stats.dropped == {"closed": 6}


def test_close_delivers_what_is_queued_before_its_deadline(hook_server) -> None:
    server = hook_server("ok")
    sink = QueuedSink(WebhookSink(server.url, timeout_s=2), FAST)
    sink.send([alert(i) for i in range(5)])
    assert sink.close(timeout_s=10) == 0 and len(server.posts) == 5


def test_close_does_not_wait_for_a_hanging_attempt(hook_server) -> None:
    server = hook_server("hang")
    sink = QueuedSink(WebhookSink(server.url, timeout_s=60), FAST)
    sink.send([alert(1), alert(2)])
    assert server.entered.wait(5)
    started = time.monotonic()
    assert sink.close(timeout_s=0.3) == 2  # the one in flight (its own deadline is 60 s) and the one behind it
    assert time.monotonic() - started < 1.5


# -- Kafka ---------------------------------------------------------------------------------------------
def test_a_dead_broker_never_blocks_evaluation_and_close_reports_it() -> None:
    kafka = KafkaSettings(bootstrap_servers=f"127.0.0.1:{closed_port()}")
    config = loads_rules('[sinks]\nlog = false\nkafka_topic = "alerts"\nkafka_timeout_s = 5\n' + RULE)
    listed = ListSink()
    fan = FanOut([*build_sinks(config.sinks, kafka).sinks, listed], config.sinks)
    monitor = Monitor(config, fan, scrape=alternating_scrape())
    started = time.monotonic()
    for _ in range(3):
        monitor.step()
    assert time.monotonic() - started < 1.0  # the old sink waited up to 10 s for topic metadata first
    assert fan.sinks[1].wait_idle(5) and len(listed.got) == 3
    started = time.monotonic()
    assert monitor.close(0.5) == 3
    assert time.monotonic() - started < 2.0
    # close() left the attempt in progress to end by its own deadline (kafka_timeout_s), in the background, as
    # documented; wait for that here so the worker does not outlive the test
    for sink in fan.sinks:
        sink._thread.join(10)
        assert not sink._thread.is_alive()


def test_alerts_reach_the_kafka_topic_through_the_queue(stack, kafka: KafkaSettings) -> None:
    topic = f"alerts-{uuid.uuid4().hex[:10]}"
    sink = QueuedSink(KafkaSink(kafka, topic, timeout_s=20), FAST)
    sink.send([alert(1), alert(2, AlertState.RESOLVED)])
    sink.send([alert(3)])
    assert sink.wait_idle(60) and sink.stats.delivered == 3
    assert sink.close(5) == 0
    records = read_topic(kafka, topic)
    assert [Alert.from_json(r.value) for r in records] == [alert(1), alert(2, AlertState.RESOLVED), alert(3)]
    assert {r.key for r in records} == {b"cold_start_share"}


def test_an_alert_too_large_for_a_kafka_message_goes_shortened_and_never_blocks_the_alerts_behind_it(
        stack, kafka: KafkaSettings) -> None:
    topic = f"alerts-{uuid.uuid4().hex[:10]}"
    huge = Alert(rule="cold_start_share", source="learner", severity=Severity.WARNING, state=AlertState.FIRING,
                 value=0.9, threshold=0.5, message="alert huge", ts=1_700_000_000_100,
                 labels={"field": "x" * 2_000_000})  # a scraped series' label value of 2 MB: over message.max.bytes
    sink = QueuedSink(KafkaSink(kafka, topic, timeout_s=20), FAST)
    try:
        sink.send([alert(1), huge, alert(2)])
        # produce() raised MSG_SIZE_TOO_LARGE, the whole batch stayed queued and was retried for ever: nothing
        # behind the large alert reached the topic
        assert sink.wait_idle(60) and sink.stats.delivered == 3 and sink.stats.failed == 0
    finally:
        sink.close(5)
    got = [Alert.from_json(r.value) for r in read_topic(kafka, topic)]
    assert [a.message for a in got] == ["alert 1", "alert huge", "alert 2"]
    assert got[1].fingerprint == huge.fingerprint  # the same alert (its resolved one will match it) ...
    assert 1000 < len(got[1].labels["field"]) < 2000  # ... its label value cut short, saying how long it was
    assert got[1].labels["field"].endswith("(2000000 characters)")


# -- settings ----------------------------------------------------------------------------------------
def test_delivery_settings_have_safe_defaults_and_are_validated() -> None:
    d = SinkSettings()
    assert (d.queue_size, d.retry_backoff_s, d.retry_backoff_max_s, d.close_timeout_s) == (1000, 0.5, 30.0, 10.0)
    assert (d.webhook_timeout_s, d.kafka_timeout_s) == (5.0, 10.0)
    s = loads_rules("[sinks]\nqueue_size = 50\nretry_backoff_s = 1\nretry_backoff_max_s = 8\nclose_timeout_s = 0\n"
                    "webhook_timeout_s = 2\n").sinks
    assert (s.queue_size, s.retry_backoff_s, s.retry_backoff_max_s, s.close_timeout_s) == (50, 1.0, 8.0, 0.0)
    for text, expected in [
        ("queue_size = 0", 'field "queue_size": expected an integer from 1 to 10000000'),
        ("queue_size = 1.5", 'field "queue_size": expected an integer'),
        ("retry_backoff_s = 0", 'field "retry_backoff_s": expected a number > 0, got 0'),
        ("retry_backoff_s = 5\nretry_backoff_max_s = 1", 'field "retry_backoff_max_s": 1 is below retry_backoff_s'),
        ("webhook_timeout_s = inf", 'field "webhook_timeout_s": expected a finite number, got inf'),
        ("close_timeout_s = -1", 'field "close_timeout_s": expected a number >= 0'),
        ("webhook_retries = 3", 'field "webhook_retries" is no longer used: undelivered alerts now stay queued'),
        ("webhook_backoff_s = 1", 'field "webhook_backoff_s" is no longer used'),
        ('webhook_url = "http://:80/x"', 'field "webhook_url": the URL names no host'),
        ('kafka_topic = "bad topic"', 'field "kafka_topic": "bad topic" holds \' \'; a Kafka topic name is 1 to 249'),
    ]:
        with pytest.raises(RulesError, match="^alert rules file r.toml: \\[sinks\\]: ") as info:
            loads_rules(f"[sinks]\n{text}\n", "r.toml")
        assert expected in str(info.value), (text, str(info.value))


def test_an_alerts_topic_deleted_while_the_monitor_runs_is_created_again_and_the_alerts_delivered(
        stack, kafka: KafkaSettings) -> None:
    from confluent_kafka.admin import AdminClient

    from stream.kafka import admin_config

    topic = f"alerts-{uuid.uuid4().hex[:10]}"
    sink = QueuedSink(KafkaSink(kafka, topic, timeout_s=5), FAST)
    try:
        sink.send([alert(1)])
        assert sink.wait_idle(60) and sink.stats.delivered == 1
        admin = AdminClient(admin_config(kafka))
        for fut in admin.delete_topics([topic], operation_timeout=10).values():
            fut.result(15)
        sink.send([alert(2)])
        # the sink checked the topic once, at its first attempt: with the topic gone, every attempt failed on it
        assert sink.wait_idle(60) and sink.stats.delivered == 2
    finally:
        sink.close(5)
    assert [Alert.from_json(r.value).message for r in read_topic(kafka, topic)] == ["alert 2"]

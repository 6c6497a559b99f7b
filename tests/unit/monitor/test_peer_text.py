"""What a scrape target or a webhook receiver writes in its answer (the status line's reason phrase, an error body)
reaches the monitor's log, run log and alert texts only bounded and escaped: a control character in it began a forged
log line or sent a terminal escape, and a reason phrase of 60 KB went into every failed scrape's message. Each test
failed before the fix."""

from __future__ import annotations

import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler

import pytest

from monitor.alerts import Alert, AlertState, Severity, SinkError, WebhookSink
from monitor.exposition import ExpositionError, parse
from monitor.scrape import Scraper, Snapshot
from tests.unit.monitor.test_engine_faults import Clocks, Target, monitor

FORGED = "Oops\x1b[2J\r2026-12-07 WARNING streamrec.monitor: FORGED\x85" + "y" * 60_000


def scrape_error(reason: str) -> tuple[str, str]:
    """The scrape error of a target that answers HTTP 500 with ``reason`` as its reason phrase, and the target's url."""
    def answer(h: BaseHTTPRequestHandler, stop: threading.Event) -> None:
        h.send_response(500, reason)
        h.send_header("Connection", "close")
        h.end_headers()

    t = Target(answer)
    try:
        return Scraper({"learner": t.url}, timeout_s=10).scrape().errors["learner"], t.url
    finally:
        t.close()


def test_a_scrape_targets_reason_phrase_is_quoted_short_and_escaped_in_the_scrape_error() -> None:
    said, url = scrape_error(FORGED)
    assert said.startswith(f"{url}: HTTP 500 Oops\\x1b[2J\\r") and len(said) < 200, said[:300]
    assert said.isprintable()


def test_a_webhook_receivers_reason_and_error_body_are_quoted_short_and_escaped_in_the_attempts_error() -> None:
    def answer(h: BaseHTTPRequestHandler, stop: threading.Event) -> None:
        h.rfile.read(int(h.headers["Content-Length"]))
        h.send_response(503, FORGED)
        h.send_header("Connection", "close")
        h.end_headers()
        h.wfile.write(b"down\n2026-12-07 ERROR streamrec.alerts: FORGED\x1b[2J")

    t = Target(answer)
    alert = Alert("r", "learner", Severity.WARNING, AlertState.FIRING, 1.0, 0.5, "m", 0)
    try:
        with pytest.raises(SinkError) as failed:
            WebhookSink(t.url, timeout_s=10).send([alert], time.monotonic() + 10)
    finally:
        t.close()
    said = str(failed.value)
    assert "HTTP 503 Oops" in said and "FORGED" in said and len(said) < 400, said[:300]
    assert said.isprintable()


def test_a_status_line_that_is_not_http_is_quoted_short_and_escaped_in_the_scrape_error_and_the_webhooks() -> None:
    def serve(srv: socket.socket) -> None:  # http.client's BadStatusLine quotes the line whole, up to 64 KiB
        for _ in range(2):  # the scrape, the webhook's POST
            try:
                conn, _ = srv.accept()
            except OSError:  # closed, or no request within its timeout: the test failed before it
                return
            with conn:
                conn.recv(65536)
                conn.sendall(FORGED.encode("latin-1") + b"\r\n\r\n")

    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(10)
    server = threading.Thread(target=serve, args=(srv,), daemon=True)
    server.start()
    url = f"http://127.0.0.1:{srv.getsockname()[1]}/metrics"
    alert = Alert("r", "learner", Severity.WARNING, AlertState.FIRING, 1.0, 0.5, "m", 0)
    try:
        scraped = Scraper({"learner": url}, timeout_s=10).scrape().errors["learner"]
        with pytest.raises(SinkError) as failed:
            WebhookSink(url, timeout_s=10).send([alert], time.monotonic() + 10)
    finally:
        server.join(10)
        srv.close()
    for said in (scraped, str(failed.value)):
        assert "Oops" in said and len(said) < 400 and said.isprintable(), said[:300]


def test_a_series_two_sources_export_is_named_short_and_escaped_in_the_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    text = f'share{{user="1\\n{FORGED}"}} 0.1\n'  # the exposition's \\n: a line break in the value
    mon, _ = monitor('[[rule]]\nname = "s"\nexpr = "share"\nop = ">"\nthreshold = 0.5\n',
                     lambda: Snapshot.from_texts({"a": text, "b": text}), Clocks())
    try:
        with caplog.at_level(logging.WARNING, logger="streamrec.monitor"):
            mon.step()
    finally:
        mon.close(5)
    [said] = [r.getMessage() for r in caplog.records if "all export" in r.getMessage()]
    assert said.startswith("sources a, b all export share{user=") and len(said) < 400, said[:300]
    assert said.isprintable()


def test_a_stale_series_is_named_short_and_escaped_in_the_stale_samples_warning() -> None:
    snap = Snapshot()
    snap.add_text("learner", f'share{{user="1\\n{FORGED}"}} 0.1 1000\n', now_s=1_800_000_000.0)  # stamped in 1970
    count, example = snap.stale["learner"]
    assert count == 1 and example.startswith("share{user=") and len(example) < 400, example[:300]
    assert example.isprintable()


def test_a_reason_phrase_under_its_limit_with_one_tab_is_quoted_whole_with_the_tab_escaped() -> None:
    reason = "Service\tUnavailable: the exporter is restarting, try again in a minute"  # 70 chars: under 80
    said, url = scrape_error(reason)
    escaped = reason.replace("\t", "\\t")
    assert said == f"{url}: HTTP 500 {escaped}"  # reprlib cut it at 60 chars


def test_a_series_given_twice_is_quoted_escaped_and_says_how_much_of_it_was_left_out() -> None:
    line = f'share{{user="1\\n{"y" * 60_000}"}} 0.1\n'
    with pytest.raises(ExpositionError) as twice:
        parse(line + line)
    said = str(twice.value)
    assert "series 'share{user=\"1\\ny" in said and said.isprintable(), said[:300]
    assert "more chars)" in said and len(said) < 300, said[:300]  # "...", not how much, before

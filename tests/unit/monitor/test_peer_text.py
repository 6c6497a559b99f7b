"""What a scrape target or a webhook receiver writes in its answer (the status line's reason phrase, an error body)
reaches the monitor's log, run log and alert texts only bounded and escaped: a control character in it began a forged
log line or sent a terminal escape, and a reason phrase of 60 KB went into every failed scrape's message. Each test
failed before the fix."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler

import pytest

from monitor.alerts import Alert, AlertState, Severity, SinkError, WebhookSink
from monitor.scrape import Scraper
from tests.unit.monitor.test_engine_faults import Target

FORGED = "Oops\x1b[2J\r2026-12-07 WARNING streamrec.monitor: FORGED\x85" + "y" * 60_000


def test_a_scrape_targets_reason_phrase_is_quoted_short_and_escaped_in_the_scrape_error() -> None:
    def answer(h: BaseHTTPRequestHandler, stop: threading.Event) -> None:
        h.send_response(500, FORGED)
        h.send_header("Connection", "close")
        h.end_headers()

    t = Target(answer)
    try:
        said = Scraper({"learner": t.url}, timeout_s=10).scrape().errors["learner"]
    finally:
        t.close()
    assert said.startswith(f"{t.url}: HTTP 500 'Oops\\x1b[2J\\r") and len(said) < 200, said[:300]
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
    assert "HTTP 503 'Oops" in said and "FORGED" in said and len(said) < 400, said[:300]
    assert said.isprintable()

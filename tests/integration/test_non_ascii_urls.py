"""A webhook or scrape source URL with non-ASCII text in its path or query (a rules file may hold any UTF-8) is
requested with that text percent-encoded as UTF-8, as browsers and ``requests`` send it. http.client refused it
(UnicodeEncodeError) at every attempt: the rules loaded, and every alert to such a webhook stayed queued for ever."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from monitor.alerts import Alert, AlertState, Severity, WebhookSink
from monitor.http_deadline import get_text


@pytest.fixture
def server() -> Iterator[tuple[str, list[str]]]:
    """A local HTTP server answering 200 to GET (one sample) and POST; the request targets it received."""
    targets: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def answer(self, body: bytes) -> None:
            targets.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802
            self.answer(b"up 1\n")

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            self.answer(b"")

        def log_message(self, *args: object) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", targets
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(5)


def test_a_webhook_url_with_non_ascii_text_delivers_it_percent_encoded(server: tuple[str, list[str]]) -> None:
    base, targets = server
    alert = Alert(rule="r", source="learner", severity=Severity.WARNING, state=AlertState.FIRING, value=1.0,
                  threshold=0.5, message="m", ts=0)
    WebhookSink(f"{base}/hooks/köln?team=données").send([alert])  # raises SinkError where it is not delivered
    assert targets == ["/hooks/k%C3%B6ln?team=donn%C3%A9es"]


def test_a_source_url_with_non_ascii_text_is_scraped_percent_encoded(server: tuple[str, list[str]]) -> None:
    base, targets = server
    assert get_text(f"{base}/métriques", time.monotonic() + 10, 1000) == "up 1\n"
    assert targets == ["/m%C3%A9triques"]


def test_an_existing_escape_is_sent_as_written(server: tuple[str, list[str]]) -> None:
    base, targets = server
    assert get_text(f"{base}/a%20b/é?x=%C3%A9", time.monotonic() + 10, 1000) == "up 1\n"
    assert targets == ["/a%20b/%C3%A9?x=%C3%A9"]

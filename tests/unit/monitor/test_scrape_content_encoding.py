"""A source that answers compressed (``Content-Encoding: gzip``: an exporter or a proxy before it that compresses
whatever the client asks) is a failed scrape saying so and what to do: the monitor asks for none (http.client
sends ``Accept-Encoding: identity``) and does not decode it; read as text, the answer was refused as cut off
"by a target that died while writing it", quoting binary bytes."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from monitor.scrape import Scraper

BODY = b"streamrec_lag 12\n"


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = gzip.compress(BODY)
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Encoding", "gzip")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_a_gzip_encoded_answer_is_a_failed_scrape_naming_its_encoding_and_the_fix(url: str) -> None:
    snap = Scraper({"learner": url}, timeout_s=5.0).scrape()
    assert not snap.metrics
    why = snap.errors["learner"]
    assert "Content-Encoding: gzip" in why and "uncompressed" in why, why
    assert "not a sample" not in why


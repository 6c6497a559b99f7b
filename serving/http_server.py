"""HTTP servers that carry :class:`serving.app.ScoringApp`: the stdlib's ThreadingHTTPServer (default) and aiohttp.

Measured with ``bench/serving.py`` (1 user x 100 candidates, 10 M-row TorchScript artifact, loopback,
2 cores shared with other work, load average ~5): at 1 client the two are within noise (p50 2.5 vs
2.2 ms); at 8 clients threading served 383 req/s (p99 48 ms) and aiohttp 355 req/s (p99 37 ms); a
1 M-row run gave threading 260 req/s vs aiohttp 165 req/s. Threading is the default: each keep-alive
connection runs on its own thread, so torch (which releases the GIL) scores several requests at once,
and there is no event-loop hop; aiohttp runs the scoring inline on its single event loop. Both speak
HTTP/1.1 keep-alive; ``[serve] server`` picks one.

Shutdown is graceful in both: stop accepting, let requests in flight finish (up to ``grace_s``), close.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Protocol

from serving.app import ScoringApp

log = logging.getLogger("streamrec.serve")


class Server(Protocol):
    port: int

    def start(self) -> None: ...

    def stop(self, grace_s: float = 10.0) -> None: ...


def _wait_idle(app: ScoringApp, grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    while app.in_flight > 0 and time.monotonic() < deadline:
        time.sleep(0.01)


# -- stdlib ---------------------------------------------------------------------------------------
class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    server_version = "streamrec-serve"
    timeout = 30  # an idle keep-alive connection is closed after this long
    app: ScoringApp

    def _answer(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length > self.app.s.max_body_bytes:
            status, ctype, body = 413, "application/json", b'{"error":"request body too large"}'
            self.close_connection = True
        else:
            status, ctype, body = self.app.handle(method, self.path, self.rfile.read(length) if length else b"")
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - BaseHTTPRequestHandler's naming
        self._answer("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._answer("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._answer("PUT")

    def do_DELETE(self) -> None:  # noqa: N802
        self._answer("DELETE")

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - access logs off (use /metrics)
        pass


class _TCPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def server_bind(self) -> None:
        self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().server_bind()


class ThreadedServer:
    def __init__(self, app: ScoringApp, host: str, port: int) -> None:
        handler = type("Handler", (_Handler,), {"app": app})
        self.app = app
        self.httpd = _TCPServer((host, port), handler)
        self.port = int(self.httpd.server_address[1])
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="serve-http", daemon=True)
        self._thread.start()

    def stop(self, grace_s: float = 10.0) -> None:
        self.httpd.shutdown()  # no new connections
        _wait_idle(self.app, grace_s)
        self.httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)


# -- aiohttp --------------------------------------------------------------------------------------
class AiohttpServer:
    """aiohttp on its own event-loop thread; scoring runs inline on the loop (no executor hop)."""

    def __init__(self, app: ScoringApp, host: str, port: int) -> None:
        self.app, self.host = app, host
        self.port = port
        self._loop = asyncio.new_event_loop()
        self._runner = None
        self._thread: threading.Thread | None = None
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        self.port = int(sock.getsockname()[1])
        self._sock = sock

    async def _handle(self, request):  # type: ignore[no-untyped-def]
        from aiohttp import web

        body = await request.read()
        status, ctype, out = self.app.handle(request.method, request.path_qs, body)
        return web.Response(status=status, body=out, content_type=ctype.split(";")[0],
                            charset="utf-8" if "charset" in ctype else None)

    async def _start(self) -> None:
        from aiohttp import web

        web_app = web.Application(client_max_size=self.app.s.max_body_bytes)
        web_app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(web_app, access_log=None)
        await self._runner.setup()
        await web.SockSite(self._runner, self._sock).start()

    def start(self) -> None:
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._start())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="serve-aiohttp", daemon=True)
        self._thread.start()
        ready.wait(10)

    def stop(self, grace_s: float = 10.0) -> None:
        if self._runner is not None:
            fut = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
            fut.result(timeout=grace_s + 5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._loop.close()


def make_server(kind: str, app: ScoringApp, host: str, port: int) -> Server:
    if kind == "threading":
        return ThreadedServer(app, host, port)
    if kind == "aiohttp":
        return AiohttpServer(app, host, port)
    raise ValueError(f"[serve] server must be threading or aiohttp, got {kind!r}")

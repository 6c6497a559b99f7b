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
import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Protocol

import orjson

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
class _BadFraming(Exception):
    """A request whose body cannot be delimited (bad Content-Length or chunk size): answered, then closed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class _Handler(BaseHTTPRequestHandler):
    """Every method and every framing error answers JSON (``{"error": ...}``), never the stdlib's HTML.

    Any request method reaches :meth:`ScoringApp.handle` (a method the path does not take is its 405 with
    ``Allow``; the stdlib alone would answer 501 HTML for TRACE, PATCH, ...). ``HEAD`` is ``GET`` without
    the body. A body is read by ``Content-Length`` or ``Transfer-Encoding: chunked``, bounded by
    ``max_body_bytes``; a length that is not a non-negative integer is a 400 and the connection is closed
    (the next request's start is unknown).
    """

    protocol_version = "HTTP/1.1"  # keep-alive
    server_version = "streamrec-serve"
    timeout = 30  # an idle keep-alive connection is closed after this long
    app: ScoringApp

    def handle_one_request(self) -> None:
        try:
            self.raw_requestline = self.rfile.readline(65537)
            if len(self.raw_requestline) > 65536:
                self.requestline = self.request_version = self.command = ""
                self.send_error(414, "request line longer than 65536 bytes")
                return
            if not self.raw_requestline:
                self.close_connection = True
                return
            if not self.parse_request():  # it answered (through send_error below)
                return
            self._answer(self.command)
            self.wfile.flush()
        except TimeoutError:
            self.close_connection = True

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The stdlib's own errors (malformed request line or headers, ...) as JSON."""
        if self.request_version == "HTTP/0.9":  # an unparsable request line: answer with a status line anyway
            self.request_version = "HTTP/1.0"
        short, long = self.responses.get(code, ("error", ""))
        text = message or short
        if explain and explain != long:
            text = f"{text}: {explain}"
        self._send(code, "application/json", json.dumps({"error": text}).encode(), close=True)

    def _send(self, status: int, ctype: str, body: bytes, close: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        if status == 405:
            self.send_header("Allow", ", ".join(self.app.allowed_methods(self.path)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _read_body(self) -> bytes:
        limit = self.app.s.max_body_bytes
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            return self._read_chunked(limit)
        raw = self.headers.get("Content-Length")
        if raw is None:
            return b""
        digits = raw.strip()
        if not (digits.isascii() and digits.isdigit()):  # int() alone takes "-1", "+5", "1_0"
            raise _BadFraming(400, f"Content-Length {raw[:40]!r} is not a non-negative integer")
        length = int(digits)
        if length > limit:
            raise _BadFraming(413, f"body of {length} bytes exceeds {limit}")
        return self.rfile.read(length) if length else b""

    def _read_chunked(self, limit: int) -> bytes:
        body = bytearray()
        while True:
            line = self.rfile.readline(1026)
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise _BadFraming(400, f"chunk size {line[:40]!r} is not a hexadecimal number") from None
            if size < 0:
                raise _BadFraming(400, f"chunk size {line[:40]!r} is negative")
            if size == 0:
                while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):  # trailers
                    pass
                return bytes(body)
            if len(body) + size > limit:
                raise _BadFraming(413, f"chunked body exceeds {limit} bytes")
            body += self.rfile.read(size)
            self.rfile.readline(3)  # the CRLF after the chunk

    def _answer(self, method: str) -> None:
        try:
            body = self._read_body()
        except _BadFraming as exc:
            self._send(exc.status, "application/json", json.dumps({"error": exc.message}).encode(), close=True)
            return
        status, ctype, out = self.app.handle("GET" if method == "HEAD" else method, self.path, body)
        self._send(status, ctype, out)

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

        limit = self.app.s.max_body_bytes
        too_large = orjson.dumps({"error": f"request body exceeds {limit} bytes"})
        if request.content_length is not None and request.content_length > limit:  # say so before reading it
            return web.Response(status=413, body=too_large, content_type="application/json",
                                headers={"Connection": "close"})
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:  # a chunked body past the limit
            return web.Response(status=413, body=too_large, content_type="application/json",
                                headers={"Connection": "close"})
        method = "GET" if request.method == "HEAD" else request.method  # aiohttp drops HEAD's body itself
        status, ctype, out = self.app.handle(method, request.path_qs, body)
        headers = {"Allow": ", ".join(self.app.allowed_methods(request.path))} if status == 405 else None
        return web.Response(status=status, body=out, content_type=ctype.split(";")[0],
                            charset="utf-8" if "charset" in ctype else None, headers=headers)

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

    async def _shutdown(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        # Handlers of connections the client left open would otherwise die with the loop ("Task was destroyed").
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in rest:
            t.cancel()
        await asyncio.gather(*rest, return_exceptions=True)

    def stop(self, grace_s: float = 10.0) -> None:
        if self._thread is not None and self._thread.is_alive():
            fut = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
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

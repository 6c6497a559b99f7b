"""The threading server (``[serve] server = threading``, the default): the stdlib's ThreadingHTTPServer, one thread per
keep-alive connection, with the limits ``serving/http_server.py`` lists read and enforced by its own request
handler (:class:`_Handler`) over the shared wire rules (``serving/http_wire.py``)."""

from __future__ import annotations

import http.client
import io
import logging
import math
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from serving.app import ScoringApp
from serving.http_wire import (
    CHUNK_LINE,
    HEAD_CUT_SHORT,
    MAX_HEAD,
    SCHEME,
    TARGET_BYTE,
    TOKEN,
    VERSION,
    VERSIONS,
    BadFraming,
    HeadTooLarge,
    check_content_coding,
    chunk_size,
    chunks_too_large,
    content_length,
    error_body,
    field_lines_error,
    http_date,
    list_members,
    max_chunks,
    origin_form,
    parse_header_lines,
    raw_response,
    read_header_lines,
    request_words,
    too_late,
    too_many_chunks,
    too_many_connections,
    unsupported_version,
)
from stream.errors import bind_error

log = logging.getLogger("streamrec.serve")


class _Deadline(Exception):
    """The client did not send in time: the request's ``request_timeout_s`` or the idle ``keepalive_timeout_s``."""


class _ConnReader(io.RawIOBase):
    """The reading side of one connection: every ``recv`` waits at most until ``deadline`` (``time.monotonic``),
    so a client trickling bytes cannot stretch a request past it the way a per-``recv`` socket timeout allows."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self.sock = sock
        self.deadline = math.inf

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise _Deadline
        self.sock.settimeout(left)
        try:
            return self.sock.recv_into(buf)
        except TimeoutError:
            raise _Deadline from None


class _Handler(BaseHTTPRequestHandler):
    """Every method and every framing error answers JSON (``{"error": ...}``), never the stdlib's HTML.

    Any request method that is a token reaches :meth:`ScoringApp.handle` (a known method the path does not take is
    its 405 with ``Allow``, an unknown one its 501; the stdlib alone would answer 501 HTML for TRACE, PATCH, ...).
    ``HEAD`` is ``GET`` without the body, ``OPTIONS`` a 204 with ``Allow``. A body is read by ``Content-Length`` or
    ``Transfer-Encoding: chunked``, bounded by ``max_body_bytes``; framing that is ambiguous or malformed is a
    400 and the connection is closed (the next request's start is unknown). The wait for a request's first
    byte is bounded by ``keepalive_timeout_s`` (``request_timeout_s`` for a new connection's first request), its
    headers and body together by ``request_timeout_s``.
    """

    protocol_version = "HTTP/1.1"  # keep-alive
    server_version = "streamrec-serve"
    disable_nagle_algorithm = True
    app: ScoringApp
    server: _TCPServer

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the stdlib's reader (a per-recv timeout at most): replaced by one with a deadline
        self._reader = _ConnReader(self.connection)
        self._buffered = io.BufferedReader(self._reader)
        self.rfile = self._buffered
        self._expect_100 = False
        self._served = False  # a request began on this connection: its idle wait is keepalive_timeout_s from now on
        self._unread = False  # the request being answered may have input left unread (its body): linger if closing

    def handle_one_request(self) -> None:
        s = self.app.s
        self.close_connection = True
        self.command, self.requestline, self.request_version, self._expect_100 = "", "", "HTTP/1.1", False
        self._unread = False
        if self.server.draining:
            return
        # idle: wait for the next request; a new connection's first within request_timeout_s (an idle socket must not
        # hold one of max_connections for keepalive_timeout_s), the next ones within keepalive_timeout_s
        idle_s = s.keepalive_timeout_s if self._served else min(s.keepalive_timeout_s, s.request_timeout_s)
        self._reader.deadline = time.monotonic() + idle_s
        try:
            if not self._await_request():
                return  # the client closed
        except (_Deadline, OSError):
            return  # idle too long, or stop() shut the connection
        # a request has begun to arrive: in flight from its first byte (stop() waits for it, closes idle ones only);
        # False: it began after stop() did (answered 503 "shutting down" once its head is in)
        self._before_stop = self.server.mark(self.connection, busy=True)
        self._served = True
        self._unread = True  # until its body is read
        self._reader.deadline = time.monotonic() + s.request_timeout_s  # its headers and body, from its first byte
        try:
            self._one_request()
        except _Deadline:
            self._unread = False  # a client too slow for its deadline gets no more time to send (no linger)
            self.app.refused(self.path if self.command else "", 408)
            try:
                self._send(408, "application/json", error_body(too_late(s.request_timeout_s)), close=True)
            except OSError:
                pass
        except OSError:  # the client left (or stop() cut the connection off after its grace)
            self.close_connection = True
        finally:
            if not self.server.mark(self.connection, busy=False):
                self.close_connection = True  # stop() began: no next request on this connection

    def _await_request(self) -> bool:
        """Wait (until the reader's idle deadline) for a request's first byte, skipping the empty lines before it
        (RFC 9112 2.2: a client may send a CRLF after a body) as aiohttp's parser does, any CR or LF bytes, a buffer
        at a time: they are idle time, not the start of a request. False: the client closed first."""
        while True:
            buffered = self._buffered.peek(1)  # what is buffered (a recv first if nothing is)
            if not buffered:
                return False
            blank = len(buffered) - len(buffered.lstrip(b"\r\n"))
            if not blank:
                return True
            self._buffered.read(blank)

    def _one_request(self) -> None:
        self.raw_requestline = self.rfile.readline(65537)
        if len(self.raw_requestline) > 65536:
            self.send_error(414, "request line longer than 65536 bytes")
            return
        if not self.raw_requestline:
            return
        if not self.parse_request():  # it answered (through send_error below)
            return
        if not self._before_stop:  # it arrived as stop() began
            self.app.refused(self.path, 503)
            self._send(503, "application/json", error_body("shutting down"), close=True)
            return
        try:
            length = self._framing()
        except BadFraming as exc:
            self._refuse(exc)
            return
        if self.app.admitted >= self.app.s.max_in_flight:  # every slot looks taken: ask before reading the body
            with self.app.admission(self.path) as refused:  # (a slot is not held across the body's read)
                if refused is not None:  # its body (if any) is not read, nor sent on Expect: the connection ends
                    self._send(*refused, close=length != 0)
                    return
        try:  # bounded by max_body_bytes and request_timeout_s; read bodies at once by max_connections
            body = self._read_body(length)
        except BadFraming as exc:
            self._refuse(exc)
            return
        self._unread = False
        # a slot of max_in_flight from the body's end until the answer is ready, released before it is written: a
        # client that has its answer and sends the next request at once found its own answered request's slot still
        # held (a 503 under load); what an answer being written holds is bounded by max_connections
        with self.app.admission(self.path) as refused:
            if refused is not None:
                resp = refused  # (its body was read: the connection goes on)
            else:
                active = self.server.active
                if active is None:
                    resp = self.app.handle(self.command, self.path, body)
                else:
                    with active:
                        resp = self.app.handle(self.command, self.path, body)
        self._send(*resp)

    def handle_expect_100(self) -> bool:
        """``Expect: 100-continue``: the ``100 Continue`` goes out when the body is about to be read, so a request
        refused from its headers (413, bad framing; 503 while every ``max_in_flight`` slot is taken) is answered
        without the client sending the body."""
        self._expect_100 = True
        return True

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The stdlib's own errors (malformed request line or headers, ...) as JSON."""
        if self.request_version == "HTTP/0.9":  # an unparsable request line: answer with a status line anyway
            self.request_version = "HTTP/1.0"
        short, long = self.responses.get(code, ("error", ""))
        text = message or short
        if explain and explain != long:
            text = f"{text}: {explain}"
        self.app.refused(self.path if self.command else "", code)  # (command: this request's path was read)
        self._send(code, "application/json", error_body(text), close=True)

    def parse_request(self) -> bool:
        """The stdlib's ``parse_request`` (same answers, same errors), with the header block parsed by
        :func:`~serving.http_wire.parse_headers`: the stdlib hands every request's headers to the ``email`` package's
        feed parser, ~40% of this server's own time per request (profiled, ``bench/README.md``)."""
        self.command = None  # type: ignore[assignment]  # (as the stdlib: set once the request line parses)
        self.request_version = version = self.default_request_version
        self.close_connection = True
        requestline = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")
        self.requestline = requestline
        words = request_words(requestline)
        if not words:
            return False
        if len(words) >= 3:  # enough to determine the protocol version
            version = words[-1]
            if version not in VERSIONS:  # HTTP/1.2 or 0.9 was served as 1.1 or 1.0, HTTP/01.1 as 1.1
                if VERSION.fullmatch(version):
                    self.send_error(505, unsupported_version(version))
                else:
                    self.send_error(400, f"Bad request version ({version!r})")
                return False
            self.close_connection = version == "HTTP/1.0"
            self.request_version = version
        if len(words) == 2:  # HTTP/0.9's request line (the stdlib answered it with the body alone, no status line)
            self.send_error(505, unsupported_version("HTTP/0.9"))
            return False
        if len(words) != 3:
            self.send_error(400, f"Bad request syntax ({requestline!r})")
            return False
        command, path = words[:2]
        if not TOKEN.fullmatch(command):  # (a token that is no method the app knows: its 501)
            self.send_error(400, f"malformed request: method {command[:40]!r} is not a token (RFC 9110 9.1)")
            return False
        if not (path.startswith("/") or SCHEME.match(path) or (path == "*" and command == "OPTIONS")):
            self.send_error(400, f"malformed request: request target {path[:200]!r} is none of /path, "
                                 "http://host/path and * (OPTIONS only): RFC 9112 3.2")
            return False
        if (bad := TARGET_BYTE.search(path)) is not None:  # (as llhttp: a 400 on aiohttp)
            self.send_error(400, f"malformed request: request target {ascii(path[:200])} holds byte "
                                 f"0x{ord(bad.group()):02x}, outside visible ASCII: percent-encode it (RFC 3986)")
            return False
        self.command, self.path = command, origin_form(path)  # (not the stdlib's "//" to "/": nothing redirects)
        try:
            lines = read_header_lines(self.rfile)
        except HeadTooLarge as err:
            self.send_error(431, str(err))
            return False
        except http.client.LineTooLong as err:
            self.send_error(431, "Line too long", str(err))
            return False
        except http.client.HTTPException as err:
            self.send_error(431, "Too many headers", str(err))
            return False
        if lines[-1] == b"":  # EOF before the blank line: a head cut short (was served as if whole), as on aiohttp
            self.send_error(400, HEAD_CUT_SHORT)
            return False
        self.headers = parse_header_lines(lines, self.MessageClass)
        self._field_error = field_lines_error(lines)  # refused by _framing
        connection = self.headers.get_all("Connection")
        if connection:  # a list of options (RFC 9110 7.6.1), any case: "close" wins
            options = set(list_members(connection))
            if "close" in options:
                self.close_connection = True
            elif "keep-alive" in options:
                self.close_connection = False
        if (self.headers.get("Expect", "").lower() == "100-continue" and self.request_version >= "HTTP/1.1"
                and not self.handle_expect_100()):
            return False
        return True

    def _refuse(self, exc: BadFraming) -> None:
        """Answer a request refused by its framing or its body (counted: :meth:`ScoringApp.refused`), and close."""
        self.app.refused(self.path, exc.status)
        self._send(exc.status, "application/json", error_body(exc.message), close=True)

    def _send(self, status: int, ctype: str, body: bytes, close: bool = False) -> None:
        """The whole answer, status line, headers and body, in one ``sendall``: the stdlib's ``send_response`` /
        ``end_headers`` then ``wfile.write(body)`` cost two sends, two loopback segments the client reads apart
        (~50 us each on loopback, profiled). The same headers as the stdlib's (``Server``, ``Date``) and ours."""
        self.connection.settimeout(self.app.s.request_timeout_s)  # bounds a client that does not read its answer
        close = close or self.server.draining or self.close_connection  # (the request's Connection: close, 1.0)
        phrase = self.responses[status][0] if status in self.responses else ""
        head = [f"{self.protocol_version} {status} {phrase}", f"Server: {self.version_string()}",
                f"Date: {http_date()}"]
        if status != 204:  # a 204 has no body, hence no Content-Length (RFC 9110 8.6)
            head += [f"Content-Type: {ctype}", f"Content-Length: {len(body)}"]
        head += [f"{name}: {value}" for name, value in
                 self.app.headers(self.command, getattr(self, "path", ""), status).items()]
        if close:
            head.append("Connection: close")
            self.close_connection = True
        elif self.request_version == "HTTP/1.0":  # kept open (its Connection: keep-alive): said, 1.0 closes by default
            head.append("Connection: keep-alive")
        out = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1")
        if self.command != "HEAD" and status != 204:
            out += body
        self.wfile.write(out)

    def _framing(self) -> int | None:
        """The body's length from the headers (0: none; None: chunked), or :class:`BadFraming` where they leave
        it ambiguous: any doubt about where this request ends is where a smuggled one would start."""
        if self._field_error is not None:  # obsolete line folding, a control character
            raise BadFraming(400, self._field_error)
        if self.headers.defects or any(not TOKEN.fullmatch(name) for name in self.headers.keys()):
            raise BadFraming(400, "malformed header line (a field name with whitespace, or a line without a colon)")
        te, cl = self.headers.get_all("Transfer-Encoding") or [], self.headers.get_all("Content-Length") or []
        length: int | None
        if te:
            if cl:
                raise BadFraming(400, "both Transfer-Encoding and Content-Length: the body's framing is ambiguous")
            if list_members(te) != ["chunked"]:
                raise BadFraming(501, f"Transfer-Encoding {', '.join(te)[:60]!r} is not supported: "
                                       "send chunked or a Content-Length")
            if self.request_version == "HTTP/1.0":
                self.close_connection = True  # RFC 9112 6.1
            length = None
        else:
            length = content_length(cl, self.app.s.max_body_bytes) if cl else 0
        if length != 0 and "Content-Encoding" in self.headers:
            check_content_coding(self.headers.get_all("Content-Encoding") or [])
        return length

    def _read_body(self, length: int | None) -> bytes:
        if length == 0:
            return b""
        if self._expect_100:
            self.send_response_only(100)
            self.end_headers()
        if length is None:
            return self._read_chunked(self.app.s.max_body_bytes)
        body = self.rfile.read(length)
        if len(body) < length:
            raise BadFraming(400, f"incomplete body: {len(body)} of {length} bytes before the connection closed")
        return body

    def _read_chunked(self, limit: int) -> bytes:
        body = bytearray()
        chunks, most = 0, max_chunks(limit)
        while True:
            line = self.rfile.readline(1026)
            m = CHUNK_LINE.fullmatch(line)
            if not line:  # (EOF: a malformed line b'' said nothing of the cut)
                raise BadFraming(400, "incomplete chunked body: no last chunk (0) before the connection closed")
            if m is None:  # (a bare LF, whitespace around the size, a CR or NUL in an extension were taken)
                raise BadFraming(400, f"malformed chunk-size line {line[:40]!r}: hexadecimal digits, optional "
                                       "extensions, then CRLF (RFC 9112 7.1)")
            size = chunk_size(m.group(1))
            if size == 0:  # the last chunk: its trailer (ignored, bounded as a header block) up to the blank line
                try:
                    trailer = read_header_lines(self.rfile)
                except HeadTooLarge:
                    raise BadFraming(431, f"chunked trailer over {MAX_HEAD} bytes") from None
                except http.client.HTTPException as exc:  # a line over 65536 bytes, over 100 lines
                    raise BadFraming(431, f"chunked trailer too large: {exc}") from None
                if any(not line.endswith(b"\r\n") for line in trailer):  # (EOF's b"", a bare LF)
                    raise BadFraming(400, "malformed or incomplete chunked trailer: each line ends in CRLF")
                if (error := field_lines_error(trailer)) is not None:
                    raise BadFraming(400, f"chunked trailer: {error}")
                return bytes(body)
            if len(body) + size > limit:
                raise BadFraming(413, chunks_too_large(limit))
            chunks += 1
            if chunks > most:
                raise BadFraming(400, too_many_chunks(limit))
            data = self.rfile.read(size)
            if len(data) < size:
                raise BadFraming(400, "incomplete chunk before the connection closed")
            body += data
            if self.rfile.read(2) != b"\r\n":  # (a bare LF was taken)
                raise BadFraming(400, "chunk data not followed by CRLF")

    def finish(self) -> None:
        """After the last answer: a connection closed with its request's rest maybe unread lingers (:func:`_linger`)
        on this thread, so a lingering client holds one of ``max_connections`` (and ``stop()`` shuts it as idle)."""
        super().finish()
        if self._unread and self.close_connection:
            s = self.app.s
            log.debug("lingering close ended: %s", _linger(self.connection, s.linger_s, s.linger_bytes))

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - access logs off (use /metrics)
        pass


def _linger(sock: socket.socket, seconds: float, budget: int) -> str:
    """Lingering close (RFC 9112 9.6) of a connection whose answer is sent but whose request may be partly unread (a
    413 from its headers, the body still arriving): closing a socket with unread input makes the kernel send a reset,
    and a client still sending its body (``http.client``, ``requests``) got ``BrokenPipe`` or "connection reset"
    instead of the answer that said why. So: half-close (the answer, then our FIN), read and drop what the client
    still sends until its EOF, ``budget`` bytes or ``seconds`` (nginx's ``lingering_time``, Apache's 2 s), whichever
    comes first; past the bound the close resets a client that is still sending. Why it ended: ``"eof"``,
    ``"bytes"``, ``"time"`` or ``"error"`` (``stop()`` shuts the socket: an EOF)."""
    if budget <= 0:
        return "bytes"
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        return "error"
    deadline = time.monotonic() + seconds
    buf = bytearray(65536)
    while budget > 0:
        left = deadline - time.monotonic()
        if left <= 0:
            return "time"
        try:
            sock.settimeout(left)
            n = sock.recv_into(buf, min(len(buf), budget))
        except TimeoutError:
            return "time"
        except OSError:
            return "error"
        if not n:
            return "eof"
        budget -= n
    return "bytes"


def _shut(sock: socket.socket) -> None:
    """Wake the thread blocked reading ``sock`` (it reads EOF) and stop the client sending more."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


JOIN_S = 2.0  # how long ThreadedServer.stop waits, all together, for the connection threads once it closed them


class _TCPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with a cap on connections (one thread each) and a registry of them for ``stop``."""

    daemon_threads = True
    block_on_close = False  # ThreadedServer.stop closes and joins the connection threads itself, bounded
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type[_Handler], app: ScoringApp) -> None:
        self.app = app
        self.lock = threading.Lock()
        self.conns: dict[socket.socket, bool] = {}  # open connection -> a request is in flight on it
        self.threads: set[threading.Thread] = set()
        self.draining = False
        # [serve] max_active: requests scored at once (the others wait, sleeping, for a turn); None: no bound
        self.active = threading.BoundedSemaphore(app.s.max_active) if app.s.max_active else None
        super().__init__(address, handler)

    def server_bind(self) -> None:
        if self.app.s.reuse_port:  # several processes on one port, the kernel spreading connections over them
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().server_bind()

    def process_request(self, request: Any, client_address: Any) -> None:
        limit = self.app.s.max_connections
        with self.lock:
            draining = self.draining
            admitted = not draining and len(self.conns) < limit
            if admitted:
                self.conns[request] = False
        if admitted:
            t = threading.Thread(target=self.process_request_thread, args=(request, client_address),
                                 name="serve-http-conn", daemon=True)
            with self.lock:
                self.threads.add(t)
            try:
                t.start()
                return
            except RuntimeError:  # no thread to be had: refused like one over the limit
                with self.lock:
                    self.conns.pop(request, None)
                    self.threads.discard(t)
        self.app.refused("", 503)
        try:  # over the limit: a quick 503 from the accepting thread (a small write, never blocking), closed
            request.setblocking(False)
            request.send(raw_response(503, "shutting down", {"Retry-After": "1"}) if draining
                         else too_many_connections(limit))
        except OSError:
            pass
        finally:
            request.close()

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.lock:
                self.conns.pop(request, None)
                self.threads.discard(threading.current_thread())

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):  # a client that left: not worth a traceback
            log.debug("connection from %s: %s", client_address, exc)
        else:
            log.exception("connection from %s failed", client_address)

    def mark(self, sock: socket.socket, busy: bool) -> bool:
        """Record whether a request is in flight on ``sock``; False once ``stop`` began (close after it)."""
        with self.lock:
            if sock in self.conns:
                self.conns[sock] = busy
            return not self.draining

    def close_connections(self, grace_s: float) -> None:
        """Close idle connections now, the others once their request is answered or ``grace_s`` is up; join."""
        shut: set[socket.socket] = set()
        deadline = time.monotonic() + max(0.0, grace_s)
        with self.lock:
            self.draining = True
        while True:
            with self.lock:
                left = bool(self.conns)
                idle = [c for c, busy in self.conns.items() if not busy and c not in shut]
            for c in idle:
                _shut(c)
                shut.add(c)
            if not left or time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        with self.lock:
            rest, threads = list(self.conns), list(self.threads)
        for c in rest:  # past the grace: cut off
            _shut(c)
        end = time.monotonic() + JOIN_S
        for t in threads:
            t.join(max(0.0, end - time.monotonic()))
        alive = [t.name for t in threads if t.is_alive()]
        if alive:  # (daemon threads: left to end on their own, a request stuck in the app past its socket's close)
            log.warning("stop: %d connection thread(s) still running %g s after their connections were closed, left "
                        "behind: %s", len(alive), JOIN_S, ", ".join(alive))


class ThreadedServer:
    def __init__(self, app: ScoringApp, host: str, port: int) -> None:
        handler = type("Handler", (_Handler,), {"app": app})
        self.app = app
        try:
            self.httpd = _TCPServer((host, port), handler, app)
        except (OSError, OverflowError) as exc:
            raise bind_error(exc, "[serve] host / port (--host / --port)", host, port) from None
        self.port = int(self.httpd.server_address[1])
        self._thread: threading.Thread | None = None
        self._stop_lock = threading.Lock()
        self._stopped = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="serve-http", daemon=True)
        self._thread.start()

    def stop(self, grace_s: float = 10.0) -> None:
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        with self.httpd.lock:
            self.httpd.draining = True  # from now on every answer says Connection: close
        if self._thread is not None:  # (shutdown() waits for serve_forever: it would hang on a server never started)
            self.httpd.shutdown()  # the accept loop ends (within its poll interval)
            self._thread.join(timeout=5)
            if self._thread.is_alive():
                log.warning("stop: the accept thread %s still runs 5 s after its shutdown, left behind",
                            self._thread.name)
        self.httpd.server_close()  # new connections are refused
        self.httpd.close_connections(grace_s)

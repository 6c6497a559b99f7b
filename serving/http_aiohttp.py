"""The aiohttp server (``[serve] server = aiohttp``): the scoring app on aiohttp's single event loop, with aiohttp's
connection handler given the request deadline, JSON answers to llhttp's errors and the limits
``serving/http_server.py`` lists (:func:`_aiohttp_protocol`); aiohttp is imported when the server is built."""

from __future__ import annotations

import ast
import asyncio
import functools
import logging
import socket
import threading
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from serving.app import Response, ScoringApp
from serving.http_wire import (
    FOLLOW_BUDGET,
    HEAD_CUT_SHORT,
    HEAD_TOO_LARGE,
    MAX_HEAD,
    TOKEN,
    VERSIONS,
    BadFraming,
    ChunkSizes,
    check_content_coding,
    chunks_too_large,
    content_length,
    error_body,
    head_ends,
    max_chunks,
    origin_form,
    raw_response,
    too_late,
    too_many_chunks,
    too_many_connections,
    unsupported_version,
)
from stream.errors import bind_error

if TYPE_CHECKING:
    from aiohttp import web

log = logging.getLogger("streamrec.serve")


# -- aiohttp --------------------------------------------------------------------------------------
class _TooLarge(Exception):
    pass


class _Refuse(asyncio.Protocol):
    """A connection over ``max_connections``: the 503 is written and the connection closed, nothing read."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(self.payload)
        transport.close()


def _refused_method(exc: Exception) -> str | None:
    """The method of a request line llhttp refused as no method of its list (a ``BadHttpMethod``: ``get``, ``BREW``),
    when it is a token (RFC 9110 9.1): the app answers it (a 501). None for anything else (a 400): a method with a
    byte that is no token character, TLS bytes. llhttp's message quotes the line it was reading (a bytes repr)."""
    try:
        line = ast.literal_eval(str(getattr(exc, "message", "")).split("\n")[2].strip())
    except (IndexError, ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    if type(line) is not bytes:
        return None
    method = line.split(b" ", 1)[0].decode("latin-1")
    return method if TOKEN.fullmatch(method) else None


# aiohttp's private RequestHandler attributes _Protocol (and AiohttpServer) use, looked for when the server is built
_AIOHTTP_INTERNALS = ("_loop", "_messages", "_waiter", "_request_in_progress", "_parser", "_force_close",
                      "_max_msg_queue_size")


@functools.cache
def _aiohttp_protocol() -> type:
    """aiohttp's connection handler (``RequestHandler``, one per connection) with the request deadline and JSON
    errors; built on first use (the server's construction) so the threading server never imports aiohttp. It reads a
    few of aiohttp's private attributes, :data:`_AIOHTTP_INTERNALS` (tested with 3.14): an aiohttp without one of them
    fails here, when the server is built, not on some request."""
    from aiohttp import web
    from aiohttp.http_exceptions import BadHttpMethod, BadStatusLine, HttpProcessingError
    from aiohttp.web_protocol import RequestHandler

    missing = [name for name in _AIOHTTP_INTERNALS if not hasattr(RequestHandler, name)]
    if missing:
        import aiohttp

        raise RuntimeError(f"aiohttp {aiohttp.__version__}'s RequestHandler lacks {', '.join(missing)}, which the "
                           "aiohttp server relies on (tested with 3.14): use [serve] server = \"threading\", or an "
                           "aiohttp 3.14")

    class _Protocol(RequestHandler):  # type: ignore[misc]
        request_timeout_s = 10.0
        app: ScoringApp | None = None

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.deadline: float | None = None  # of the request being received (loop time), from its first byte
            self.watchdog: asyncio.TimerHandle | None = None
            self.reading_body = False
            self.head_bytes = 0  # received while no request was parsed yet: its request line and headers
            self.head_open = True  # a request's head is being received (until its blank line)
            self.head_tail = b""  # the last bytes of it, for a blank line split across two reads
            self.first_request: asyncio.TimerHandle | None = None  # a new connection's wait for its first byte
            self.max_body_bytes = 4 << 20
            self.chunks: ChunkSizes | None = None  # the open chunked body's sizes, followed on the wire
            self.chunks_payload: Any = None  # (its request's body stream)
            self.body_refused = False  # a chunk declared past max_body_bytes: the rest of the connection is unread
            self.write_stall: asyncio.TimerHandle | None = None  # answers not read by the client: its deadline
            self.peer_eof = False  # the client shut its sending side: answer what it sent, then close
            self.feed_tail = b""  # the last 3 bytes received (a CRLFCRLF split across two reads)
            self.open_body: Any = None  # the body stream of the last request queued, while its body is arriving
            self.linger_left: int | None = None  # lingering (linger): the bytes it may still drop; None: not lingering
            self.linger_end: asyncio.TimerHandle | None = None  # its time bound
            self.linger_after = False  # handle_error's answer (llhttp refused the request): linger once it is written

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            # A new connection's first request must begin within request_timeout_s (aiohttp's keep-alive timer, also
            # started here, is keepalive_timeout_s's): an idle socket must not hold one of max_connections for longer.
            self.first_request = self._loop.call_later(self.request_timeout_s, self._on_no_request)

        def _on_no_request(self) -> None:
            self.first_request = None
            if self.transport is not None and self.deadline is None and not self._messages:
                log.debug("no request within %s s of connecting: closing", self.request_timeout_s)
                self.force_close()

        def data_received(self, data: bytes) -> None:
            if self.linger_left is not None:  # lingering: dropped, up to its byte bound
                self.linger_left -= len(data)
                if self.linger_left < 0:
                    log.debug("lingering close ended: bytes")
                    self.force_close()  # (the rest unread: the client, still sending, is reset)
                return
            if self.body_refused:
                return  # its handler answers 413 and closes
            if self.deadline is None and data.lstrip(b"\r\n"):  # (empty lines before a request: idle time)
                self.deadline = self._loop.time() + self.request_timeout_s
                self.watchdog = self._loop.call_at(self.deadline, self._on_deadline)
                if self.first_request is not None:
                    self.first_request.cancel()
                    self.first_request = None
            first = -2  # where the first CRLFCRLF in data starts (-1: none; -2: not looked for yet)
            # A request's head is counted until its blank line has come by (not by aiohttp's state: between the
            # parser's queueing of a request and its handler's start, body bytes looked like head bytes, and a body
            # of ~72 KiB sent in pieces was answered 431)
            if self.head_open:
                if self.head_tail or data[:1] in (b"\r", b"\n"):
                    seen = self.head_tail + data
                    end = seen.find(b"\r\n\r\n", 1 if seen.startswith(b"\r\n") else 0)
                else:  # (seen is data: its find is the pieces' first one too)
                    seen, end = data, data.find(b"\r\n\r\n")
                    first = end
                if end >= 0 or self._messages:
                    self.head_open, self.head_bytes, self.head_tail = False, 0, b""
                else:
                    self.head_bytes += len(data)
                    self.head_tail = seen[-3:]
            # Fed to llhttp in pieces, each ending just past a CRLFCRLF (the last: the rest), each piece's requests
            # queued before the next is fed: aiohttp queues a parse error in place of every request parsed from the
            # same feed, so a valid request pipelined in one write before a bad one got no answer (the threading server
            # answers both). llhttp is a streaming parser: the pieces parse exactly as the whole, and a request's head
            # ends nowhere but just past a CRLFCRLF (the feed that completes a head ends there: nothing after it in that
            # feed can erase it). Not past aiohttp's queue (the module docstring). One request per read: one find, one
            # feed (one with its body in the read: two of each, the head and the body).
            tail = self.feed_tail
            self.feed_tail = data[-3:] if len(data) >= 3 else (tail + data)[-3:]
            n, pos, end = len(data), 0, -1
            if tail and data[:1] in (b"\r", b"\n"):  # a CRLFCRLF begun in the previous read, ending in this one
                i = (tail + data[:3]).find(b"\r\n\r\n")
                end = i + 4 - len(tail) if 0 <= i < len(tail) else -1
            if end < 0:
                if first == -2:
                    first = data.find(b"\r\n\r\n")
                end = first + 4 if first >= 0 else -1
            while 0 <= end < n:
                if not self._feed(data[pos:end]):
                    return
                pos = end
                if len(self._messages) >= self._max_msg_queue_size:  # aiohttp's queue is full (llhttp holds the
                    break  # rest, parsed as it drains): the rest in one feed, not a request more per piece
                end = data.find(b"\r\n\r\n", pos)
                end = end + 4 if end >= 0 else -1
            if not self._feed(data[pos:] if pos else data):
                return
            if self.head_open and self.head_bytes > MAX_HEAD + 8192 and self.transport is not None:  # (+ a line)
                log.debug("request head past %s bytes and not complete: 431", MAX_HEAD)
                self._refused(431)
                self.transport.write(raw_response(431, HEAD_TOO_LARGE))
                self.force_close()

        def _feed(self, data: bytes) -> bool:
            """Give llhttp ``data`` (a piece of a read), the sizes of an open chunked body read
            before it takes them (and followed into a chunked body that opens in it); False: the connection reads no
            further (a chunk declared past ``max_body_bytes``)."""
            body_end = 0  # where in data a chunked body followed from an earlier piece ends
            if self.chunks is not None:  # its sizes are read before llhttp takes the bytes
                body_end = self.chunks.feed(data)
                if self.chunks.over:
                    self._refuse_chunks(self.chunks_payload)
                    return False
                if body_end >= 0 or self.chunks.lost:  # its end (however near the read's end), or lost: done
                    self.chunks = self.chunks_payload = None
                if body_end < 0:
                    body_end = len(data)
            messages = self._messages
            queued = len(messages)
            super().data_received(data)
            if len(messages) > queued:
                self._body_error(messages[-1])
                if (body_end < len(data) and self.chunks is None
                        and getattr(messages[-1][0], "chunked", False)):  # (an _ErrInfo has none)
                    self._follow_chunks(data, body_end)
            return True

        def _body_error(self, last: tuple[Any, Any]) -> None:
            """``last``, the request (or parse error) just queued: a parse error while the body of a request queued by
            an earlier read is still open (a malformed chunk-size line, ``zz``) is that body's error, raised to its
            handler's read (a 400 at once, as on the threading server). aiohttp queued it as a request of its own, and
            the handler, its body never ended, waited until ``request_timeout_s`` (a 408)."""
            msg, payload = last
            exc = getattr(msg, "exc", None)  # (aiohttp's _ErrInfo: llhttp's error; a request has none)
            if exc is None:
                self.open_body = None if payload.is_eof() else payload
                return
            if self.open_body is not None and not self.open_body.is_eof():
                lines = str(getattr(exc, "message", exc)).strip().splitlines() or ["unreadable"]
                self.open_body.set_exception(BadFraming(400, f"malformed request body: {lines[0].rstrip(': ')}"))
            self.open_body = None

        def _follow_chunks(self, data: bytes, start: int) -> None:
            """A request just parsed from ``data[start:]`` whose chunked body is still arriving: find where the body
            starts in ``data`` and follow its chunk sizes (:class:`ChunkSizes`) from there. llhttp does not say
            where a request's head ended, so each place a head can end is tried (after a CRLFCRLF at or after
            ``start``, or within the first 3 bytes when the head's last bytes came in the previous read), and the
            one from which the body reads to the end of ``data`` with exactly the data bytes llhttp gave the request
            is taken (a false match needs a client's own body crafted for it, and costs only that request). Where none
            matches, or llhttp parsed the request from bytes it held back (a pipeline past its queue of 32), the body
            is bounded as it arrives, as before. Runs once per chunked request whose body is still arriving, in at
            most ``FOLLOW_BUDGET`` steps over all the places tried: a read full of CRLFCRLFs each followed by chunk
            framing (``2\\r\\n\\r\\n\\r\\n`` repeated) made every try read the rest, ~250 s of the event loop
            for one 64 KB read; past the budget the body is bounded as it arrives."""
            payload = self._messages[-1][1]
            if payload.is_eof():
                return
            budget = FOLLOW_BUDGET
            for p in head_ends(data, start):
                sizes = ChunkSizes(self.max_body_bytes, budget)
                if sizes.feed(data, p) < 0 and not sizes.lost and sizes.decoded == payload.total_bytes:
                    if sizes.over:
                        self._refuse_chunks(payload)
                    else:
                        sizes.budget = None
                        self.chunks, self.chunks_payload = sizes, payload
                    return
                budget = (sizes.budget or 0) - 1
                if budget <= 0:
                    return

        def _refuse_chunks(self, payload: Any) -> None:
            """A chunked body declared past ``max_body_bytes``: its handler's read of it raises the 413 (answered in
            turn, after any request before it), and nothing more is read from the connection."""
            payload.set_exception(BadFraming(413, chunks_too_large(self.max_body_bytes)))
            self.chunks = self.chunks_payload = None
            self.body_refused = True

        def linger(self, seconds: float, budget: int) -> None:
            """Close after an answer with the request's rest maybe unread, lingering
            (:func:`~serving.http_threaded._linger`, the threading server's): half-close once the answer is flushed,
            drop what the client still sends until its EOF, ``budget`` bytes or ``seconds``. The connection stays one of
            ``max_connections`` meanwhile, and ``stop()`` closes it (not busy). aiohttp's own lingering
            (``lingering_time``) reads the body through the parser, without a half-close or a byte bound, and only when
            the connection is kept."""
            transport = self.transport
            if transport is None or budget <= 0 or self.peer_eof or not transport.can_write_eof():  # (EOF: no rest)
                self.force_close()
                return
            self._force_close = True  # aiohttp's loop ends, leaving the transport to the linger (force_close closes it)
            if self._waiter is not None:
                self._waiter.cancel()
            for timer in (self.watchdog, self.first_request):
                if timer is not None:
                    timer.cancel()
            self.watchdog = self.first_request = self.deadline = None
            self.linger_left = budget
            self.linger_end = self._loop.call_later(seconds, self._on_linger_end)
            transport.write_eof()  # (asyncio: the FIN once the answer is flushed)
            transport.resume_reading()  # (a body's flow control may have paused it)

        async def finish_response(self, request: Any, resp: Any, start_time: float | None) -> Any:
            """aiohttp's writing of an answer; after :meth:`handle_error`'s (llhttp refused the request, whose rest is
            unread) a lingering close, where aiohttp closed at once."""
            out = await super().finish_response(request, resp, start_time)
            if self.linger_after and self.app is not None:
                self.linger_after = False
                self.linger(self.app.s.linger_s, self.app.s.linger_bytes)
            return out

        def _on_linger_end(self) -> None:
            self.linger_end = None
            log.debug("lingering close ended: time")
            self.force_close()

        def _refused(self, status: int) -> None:
            """Count an answer written here, to a request whose path is unread (:meth:`ScoringApp.refused`)."""
            if self.app is not None:
                self.app.refused("", status)

        def body_read(self) -> None:
            """The request's body is in: its deadline no longer applies (the next request's starts with its bytes)."""
            if self.watchdog is not None:
                self.watchdog.cancel()
            self.watchdog = self.deadline = None
            self.head_open, self.head_bytes, self.head_tail = True, 0, b""  # the next request's head comes next

        def _on_deadline(self) -> None:
            self.watchdog = None
            if self.transport is None or self.reading_body:
                return  # closed; or its handler runs and bounds the body read itself
            waiter = getattr(self, "_waiter", None)  # pending while aiohttp waits for a request's headers
            if waiter is None or waiter.done() or self._messages:  # a request is handled (or queued): not this one
                self.watchdog = self._loop.call_later(0.05, self._on_deadline)  # look again once it is answered
                return
            log.debug("request headers not received within %s s: closing", self.request_timeout_s)
            self._refused(408)
            self.transport.write(raw_response(408, too_late(self.request_timeout_s)))
            self.force_close()

        def eof_received(self) -> bool | None:  # type: ignore[override]  # (asyncio.Protocol's: True keeps it open)
            """The client shut its sending side (``SHUT_WR``, ``nc -N``): the requests it sent in full are answered,
            then the connection is closed (the last answer says ``Connection: close``), as on the threading server.
            aiohttp closed the connection at once, answering none of them. A body cut short by the EOF is its
            handler's 400 (answered in turn, after the requests before it), as on the threading server: the
            connection was closed at once, the client left without an answer. So is a request whose head the EOF cut
            short (a 400 before the close) when nothing else is being answered; behind requests sent in full it ends
            the connection after their answers (the last says ``Connection: close``). An idle connection is closed at
            once."""
            if self.linger_left is not None:
                log.debug("lingering close ended: eof")
                return None  # (the transport closes)
            if self._parser is None or self._force_close:
                return None
            try:
                self._parser.feed_eof()
            except HttpProcessingError as exc:  # a body (or chunk) cut short; or a head (llhttp's error)
                body = self.open_body
                if body is not None and not body.is_eof():
                    reason = (str(getattr(exc, "message", exc)).strip().splitlines() or ["cut"])[0].rstrip(": .")
                    body.set_exception(BadFraming(400, f"incomplete body: {reason}, before the connection closed"))
                    self.open_body, self.peer_eof = None, True
                    return True  # (the transport stays open for its answer, which closes it)
            waiter = getattr(self, "_waiter", None)
            if not self._messages and waiter is not None and not waiter.done():  # no request queued nor handled:
                if self.deadline is not None and self.transport is not None:  # a request's first bytes came, its
                    self._refused(400)  # head cut short (else idle)
                    self.transport.write(raw_response(400, HEAD_CUT_SHORT))
                return None  # (the transport closes, the answer flushed)
            # (a head cut short behind requests sent in full: those are answered, the last saying Connection: close;
            # closing here dropped their answers, a request sent whole left unanswered)
            self.peer_eof = True  # the last queued request's answer closes the connection (AiohttpServer._reply)
            if not self._messages:
                self.close()  # no request queued: close once the one being handled (if any) is answered, or now
            return True  # (the transport stays open for the answers)

        def pause_writing(self) -> None:
            """The client is not reading its answers (asyncio's buffer for them is past its high-water mark): unless
            it reads them down within ``request_timeout_s``, the connection is aborted, its buffer dropped. Without
            this a client that pipelined requests and read nothing held its connection (one of ``max_connections``)
            for ever: aiohttp waits on the drain without a deadline, and a close waits for the buffer to flush. The
            threading server's answers are bounded alike (a send timeout of ``request_timeout_s``)."""
            super().pause_writing()
            if self.write_stall is None:
                self.write_stall = self._loop.call_later(self.request_timeout_s, self._on_write_stall)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self.write_stall is not None:
                self.write_stall.cancel()
                self.write_stall = None

        def _on_write_stall(self) -> None:
            self.write_stall = None
            if self.transport is not None:
                log.debug("answers not read within %s s: aborting the connection", self.request_timeout_s)
                self.transport.abort()  # (first: force_close's close would wait for the buffer to flush)
                self.force_close()

        def connection_lost(self, exc: BaseException | None) -> None:
            if self.linger_end is not None:
                self.linger_end.cancel()
                self.linger_end = None
            if self.write_stall is not None:
                self.write_stall.cancel()
                self.write_stall = None
            if self.watchdog is not None:
                self.watchdog.cancel()
                self.watchdog = None
            if self.first_request is not None:
                self.first_request.cancel()
                self.first_request = None
            super().connection_lost(exc)

        def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                         message: str | None = None) -> web.StreamResponse:
            """aiohttp's answer to a request it could not parse (or a handler that raised), as our JSON, and logged
            without a traceback for a bad request (a bug, a 500, keeps it). llhttp's "Invalid HTTP version" (a
            well-formed version it does not take, ``HTTP/1.2``) is a 505, as on the threading server, not a 400."""
            method = _refused_method(exc) if isinstance(exc, BadHttpMethod) else None
            if method is not None and self.app is not None:  # outside llhttp's list: the app's 501, as on threading
                log.debug("%s for %s: %s", method, getattr(request, "remote", "?"), exc)
                status, _, body = self.app.handle(method, "", b"")
                resp = web.Response(status=status, body=body, content_type="application/json")
                resp.force_close()  # (llhttp reads no further on this connection)
                self.linger_after = True
                return resp
            if isinstance(exc, BadStatusLine) and exc.message.startswith("Bad status line:\n  Invalid HTTP version:"):
                log.debug("505 for %s: %s", getattr(request, "remote", "?"), exc.message)
                text, status = unsupported_version(""), 505
            elif status >= 500:
                log.error("%s answering %s", status, getattr(request, "remote", "?"), exc_info=exc)
                text = "internal error; see the service log"
            else:
                first = (str(message or "").strip().splitlines() or [HTTPStatus(status).phrase])[0].rstrip(": ")
                text = f"malformed request: {first}"
                log.debug("bad request from %s: %s", getattr(request, "remote", "?"),
                          exc if isinstance(exc, HttpProcessingError) else text)
            if request.writer.output_size > 0:
                raise ConnectionError("answer already under way: cannot send the error one")
            self._refused(status)
            self.linger_after = status < 500 or status == 505  # llhttp refused it, its rest unread (a 500: closed)
            resp = web.Response(status=status, body=error_body(text), content_type="application/json")
            resp.force_close()
            return resp

    return _Protocol


class AiohttpServer:
    """aiohttp's low-level server (``web.Server``, no router: every path reaches the app) on its own event-loop
    thread; scoring runs inline on the loop (no executor hop)."""

    def __init__(self, app: ScoringApp, host: str, port: int) -> None:
        _aiohttp_protocol()  # (an aiohttp without the internals it reads fails here)
        self.app, self.host = app, host
        self.port = port
        self._loop = asyncio.new_event_loop()
        self._web: Any = None  # aiohttp.web.Server: the connections' manager
        self._aserver: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self._draining = False
        self._stop_lock = threading.Lock()
        self._stopped = False
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if app.s.reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((host, port))
        except (OSError, OverflowError) as exc:
            sock.close()
            self._loop.close()
            raise bind_error(exc, "[serve] host / port (--host / --port)", host, port) from None
        self.port = int(sock.getsockname()[1])
        self._sock = sock

    async def _reply(self, request: web.BaseRequest, resp: Response, close: bool = False) -> web.StreamResponse:
        from aiohttp import web

        status, ctype, out = resp
        headers = self.app.headers(request.method, origin_form(request.raw_path), status)
        if status == 204:
            r = web.Response(status=204, headers=headers)
        else:
            r = web.Response(status=status, body=out, headers={**headers, "Content-Type": ctype})  # (as the app says)
        proto: Any = request.protocol
        if close or self._draining or (proto.peer_eof and not proto._messages):  # (the client's last request)
            r.force_close()  # "Connection: close"
        if close:  # the body is not read: answer now, then a lingering close (its bounds, not the body's length)
            try:
                await r.prepare(request)
                await r.write_eof()
            except ConnectionError:
                pass
            if status == 408:  # a client too slow for its deadline gets no more time to send
                proto.force_close()
            else:
                proto.linger(self.app.s.linger_s, self.app.s.linger_bytes)
        return r

    async def _refuse(self, request: web.BaseRequest, target: str, status: int, message: str) -> web.StreamResponse:
        """The JSON ``status`` for a request refused by the server itself (counted: :meth:`ScoringApp.refused`),
        then a (lingering) close."""
        self.app.refused(target, status)
        return await self._reply(request, (status, "application/json", error_body(message)), close=True)

    async def _read_body(self, request: web.BaseRequest, limit: int) -> bytes:
        if request.headers.get("Expect", "").lower() == "100-continue" and request.version >= (1, 1):
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        body = bytearray()
        content = request.content
        if request.headers.get("Transfer-Encoding") is None:  # a Content-Length: read as it comes
            while chunk := await content.readany():
                body += chunk
                if len(body) > limit:
                    raise _TooLarge
            return bytes(body)
        chunks, most = 0, max_chunks(limit)
        while True:  # chunked: a chunk at a time, to count them
            data, end_of_chunk = await content.readchunk()
            if not data and not end_of_chunk:  # the body's end
                return bytes(body)
            body += data
            if len(body) > limit:
                raise _TooLarge
            chunks += end_of_chunk
            if chunks > most:
                raise BadFraming(400, too_many_chunks(limit))

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        from aiohttp import web
        from aiohttp.web_protocol import RequestPayloadError

        s = self.app.s
        proto: Any = request.protocol  # a _Protocol (_aiohttp_protocol)
        target = origin_form(request.raw_path)  # (not request.path: yarl's reading of "//healthz" is "////healthz")
        version = f"HTTP/{request.version[0]}.{request.version[1]}"
        if version not in VERSIONS:  # llhttp takes HTTP/2.0 and 0.9 (a request line without one) too
            self.app.refused(target, 505)
            if proto.transport is not None:  # written raw: aiohttp's status line would say the request's version
                proto.transport.write(raw_response(505, unsupported_version(version)))
            proto.force_close()
            return web.Response(status=505)  # (not sent: the connection is closed, its writes refused)
        limit = s.max_body_bytes
        if sum(len(k) + len(v) + 4 for k, v in request.raw_headers) + 2 > MAX_HEAD:  # (the threading server's count)
            return await self._refuse(request, target, 431, HEAD_TOO_LARGE)
        try:  # (not request.content_length: its int() raises past 4300 digits, a 500)
            content_length(request.headers.getall("Content-Length", []) or ["0"], limit)
            if request.body_exists and "Content-Encoding" in request.headers:  # (auto_decompress is off)
                check_content_coding(request.headers.getall("Content-Encoding"))
        except BadFraming as exc:  # over the limit, a coding: said before the body is read
            return await self._refuse(request, target, exc.status, exc.message)
        if self.app.admitted >= s.max_in_flight:  # every slot looks taken: ask before reading the body
            with self.app.admission(target) as refused:  # (a slot is not held across the body's read)
                if refused is not None:  # its body (if any) is not read, nor sent on Expect: the connection ends
                    return await self._reply(request, refused, close=request.body_exists)
        body = b""
        if request.body_exists:  # bounded by max_body_bytes and request_timeout_s; read at once by max_connections
            deadline = proto.deadline or self._loop.time() + s.request_timeout_s
            proto.reading_body = True
            try:
                body = await asyncio.wait_for(self._read_body(request, limit), deadline - self._loop.time())
            except asyncio.TimeoutError:
                return await self._refuse(request, target, 408, too_late(s.request_timeout_s))
            except _TooLarge:  # a chunked body past the limit
                return await self._refuse(request, target, 413, f"request body exceeds {limit} bytes")
            except BadFraming as exc:  # too many chunks; one declared past the limit (ChunkSizes); cut by an EOF
                return await self._refuse(request, target, exc.status, exc.message)
            except (RequestPayloadError, ConnectionError) as exc:  # malformed chunks; or the client left
                return await self._refuse(request, target, 400, f"malformed request body: {exc}")
            finally:
                proto.reading_body = False
        proto.body_read()
        with self.app.admission(target) as refused:  # a slot of max_in_flight from the body's end to the answer
            if refused is not None:
                return await self._reply(request, refused)  # (its body was read: the connection goes on)
            return await self._reply(request, self.app.handle(request.method, target, body))  # (HEAD: no body sent)

    async def _start(self) -> None:
        from aiohttp import web

        loop = asyncio.get_running_loop()
        s = self.app.s
        kwargs: dict[str, Any] = {"keepalive_timeout": s.keepalive_timeout_s, "access_log": None,
                                  "auto_decompress": False}  # (a coded body is a 415: check_content_coding)
        self._web = manager = web.Server(self._handle, loop=loop, **kwargs)
        protocol = _aiohttp_protocol()

        def connection() -> asyncio.Protocol:
            if self._draining or len(manager.connections) >= s.max_connections:
                self.app.refused("", 503)
                return _Refuse(too_many_connections(s.max_connections))
            p = protocol(manager, loop=loop, **kwargs)
            p.request_timeout_s, p.max_body_bytes, p.app = s.request_timeout_s, s.max_body_bytes, self.app
            return p  # type: ignore[no-any-return]

        self._aserver = await loop.create_server(connection, sock=self._sock, backlog=128)

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

    async def _shutdown(self, grace_s: float) -> None:
        loop = asyncio.get_running_loop()
        self._draining = True
        if self._aserver is not None:
            self._aserver.close()  # new connections are refused
        conns = list(self._web.connections) if self._web is not None else []

        def busy(c: Any) -> bool:  # a request being handled, or one whose bytes began to arrive (its deadline runs)
            return bool(getattr(c, "_request_in_progress", False) or getattr(c, "deadline", None) is not None)

        for c in conns:
            if not busy(c):
                c.close()  # an idle one ends now; a busy one after its answer (_reply: Connection: close)
        deadline = loop.time() + max(0.0, grace_s)
        while loop.time() < deadline and any(busy(c) for c in conns):
            await asyncio.sleep(0.01)
        for c in conns:
            c.force_close()  # past the grace (or done): closed
        # Handlers of connections the client left open would otherwise die with the loop ("Task was destroyed").
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in rest:
            t.cancel()
        await asyncio.gather(*rest, return_exceptions=True)
        if self._aserver is not None:
            try:
                await asyncio.wait_for(self._aserver.wait_closed(), 1.0)
            except asyncio.TimeoutError:
                pass

    def stop(self, grace_s: float = 10.0) -> None:
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        self._draining = True  # now, not when the loop gets to _shutdown: an answer being scored says close
        if self._thread is not None and self._thread.is_alive():
            fut = asyncio.run_coroutine_threadsafe(self._shutdown(grace_s), self._loop)
            try:
                fut.result(timeout=grace_s + 5)
            except Exception:  # noqa: BLE001 - stop must go on to stop the loop
                log.exception("aiohttp shutdown failed")
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        self._sock.close()
        if not self._loop.is_running():
            self._loop.close()

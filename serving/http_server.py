"""HTTP servers that carry :class:`serving.app.ScoringApp`: the stdlib's ThreadingHTTPServer (default) and aiohttp.

Measured with ``bench/serving.py`` (1 user x 100 candidates, 10 M-row TorchScript artifact, loopback,
2 cores shared with other work, load average ~5): at 1 client the two are within noise (p50 2.5 vs
2.2 ms); at 8 clients threading served 383 req/s (p99 48 ms) and aiohttp 355 req/s (p99 37 ms); a
1 M-row run gave threading 260 req/s vs aiohttp 165 req/s. Threading is the default: each keep-alive
connection runs on its own thread, so torch (which releases the GIL) scores several requests at once,
and there is no event-loop hop; aiohttp runs the scoring inline on its single event loop. Both speak
HTTP/1.1 keep-alive; ``[serve] server`` picks one.

Both enforce the same limits (``ServeSettings``, read from ``app.s``):

* ``max_connections``: open connections at once; one more is answered ``503`` (``Retry-After: 1``) and closed
  at once. The threading server runs one thread per connection, so this also caps its threads.
* ``max_in_flight``: requests between their body's end and their answer (:meth:`ScoringApp.admission`, entered
  once the body is read); one more is a ``503`` with ``Retry-After: 1`` (the probes ``/healthz``, ``/readyz``,
  ``/metrics`` are never refused). A body being read holds no slot, so clients trickling bodies cannot get every
  ``/v1/score`` refused while ``/healthz`` says 200: the reads are bounded by ``max_connections``,
  ``max_body_bytes`` and ``request_timeout_s`` instead (up to ``max_connections`` x ``max_body_bytes`` of bodies
  in memory at once). While every slot is taken a request is refused from its headers already, its body unread
  (and, on ``Expect: 100-continue``, unsent) and its connection closed; one refused after its body keeps it.
* ``max_active`` (threading server; 0: no bound): requests inside :meth:`ScoringApp.handle` at once; the others
  wait for a turn, asleep. Measured (bench/README.md, 2 cores, 8 clients): with 8 connection threads contending for
  the GIL a request cost the server ~1.5 ms of CPU with the ONNX INT8 artifact, ~1.1 ms at ``max_active = 1``, and
  throughput rose ~10%; TorchScript, whose ops run outside the GIL in parallel, lost ~8% with it. The aiohttp
  server scores on its one event loop: one at a time already.
* ``reuse_port``: bind with ``SO_REUSEPORT``, so several ``streamrec serve`` processes (same settings) share one
  port and the kernel spreads connections over them: past one process's GIL. Each process loads its own copy of the
  model (its own copy of the cold rows: N processes hold N tables in memory), applies deltas itself and
  answers ``/metrics`` for itself alone: scrape each process (its own metrics port is not built), and expect
  ``/readyz`` from whichever process the connection lands on.
* ``request_timeout_s``: a request's headers and body must arrive within it from its first byte, however the
  bytes trickle in (a per-``recv`` timeout would let one byte a second keep it alive); past it: ``408`` and
  close. A new connection must send its first request's first byte within it too (or ``keepalive_timeout_s``
  if shorter), else it is closed without an answer: idle sockets cannot hold ``max_connections``.
  An answer the client does not read is bounded by it too: the threading server's send times out; on aiohttp a
  connection whose unread answers stay past asyncio's high-water mark for it is aborted.
  ``keepalive_timeout_s``: a connection that has served a request and is idle (no request started) is closed
  after it. Empty lines before a request line (RFC 9112 2.2) are skipped as idle time.
* ``linger_s``, ``linger_bytes`` (lingering close, RFC 9112 9.6): an answer that closes the connection with its
  request's rest maybe unread (a ``413``, ``415``, ``400``, ``431``, ``501`` or ``505`` from the headers, a ``503``
  refused from them, a bad chunk) is followed by a half-close (``SHUT_WR``), then what the client still sends is read
  and dropped until its EOF, ``linger_bytes`` (8 MiB) or ``linger_s`` (2 s), then the socket closed
  (:func:`_linger`, ``_Protocol.linger``). Closed at once, a socket with input unread makes the kernel send a reset,
  and a client still sending its body (``http.client``, ``requests``) got ``BrokenPipe`` or "connection reset", never
  the answer that said why. A lingering connection holds one of ``max_connections`` (and, threading, its thread);
  ``stop()`` closes it as idle. No linger where the request was read whole (``Connection: close``), after a ``408``
  (a client too slow for its deadline gets no more time), for a connection over ``max_connections`` (its ``503`` is
  written and closed at once: lingering would take the slot it was refused), and on aiohttp after the ``505`` for an
  ``HTTP/2.0`` or ``0.9`` request line (written raw, closed at once). aiohttp's answers to llhttp's errors
  (``_Protocol.handle_error``) linger too, where aiohttp closed at once.
* framing: ``Content-Length`` must be one non-negative decimal integer (several headers, a sign, a list:
  ``400``; over ``max_body_bytes``: ``413`` before the body is read; leading zeros, however many, are allowed),
  chunked sizes hexadecimal (leading zeros allowed too), every line of a chunked body ending in CRLF (its size
  lines, the end of each chunk's data, its trailer: a bare LF or CR is a ``400``, RFC 9112 7.1), chunk extensions
  free of control characters but HTAB, at most 64 + 1 per KiB of ``max_body_bytes`` chunks (4160 at 4 MiB: chunks
  of 1 KiB or more never meet it; past it a ``400``), not both ``Content-Length`` and ``Transfer-Encoding``, no
  whitespace before a header's colon (HTTP's whitespace is SP and HTAB: a request line is split, and the members of
  ``Transfer-Encoding``, ``Content-Encoding`` and ``Connection`` trimmed, on those alone, not on all that Python's
  ``str.split()`` takes, NBSP and NEL included: ``chunked\xa0`` is no ``chunked``), no obsolete line folding (a
  header line starting with whitespace, RFC 9112 5.2), no control character in a header (or trailer) line but HTAB
  (a NUL, DEL, a CR not before LF: RFC 9110 5.5; bytes past ASCII are taken); any such error is answered JSON and
  the connection closed (the next request's start is unknown).
  A body with a ``Content-Encoding`` other than ``identity`` is a ``415`` before it is read (aiohttp's
  ``auto_decompress`` is off: the body is JSON as sent, on both servers).
  A chunk whose declared size takes the body past ``max_body_bytes`` is a ``413`` from its size line, before its
  data is waited for, on both servers (on aiohttp, :class:`_ChunkSizes` reads the sizes that llhttp keeps to itself).
  aiohttp's own parser (llhttp) refuses these before our code runs; its answer is turned into the same JSON
  ``{"error": "malformed request: ..."}``, logged at debug level without a traceback. A method outside llhttp's list
  (``BREW``, ``get``: methods are case-sensitive) is answered by the app, a ``501`` as on the threading server
  (:func:`_refused_method`; the connection is closed after it on aiohttp only), a method that is no token a ``400`` on
  both. Where the two differ: a
  ``Transfer-Encoding`` other than ``chunked`` is a ``501`` on the threading server (RFC 9112 6.1), a ``400``
  on aiohttp, which takes ``gzip, chunked`` as chunked; an HTTP/1.1 request without ``Host`` is a ``400`` on
  aiohttp only; aiohttp answers its parser's errors with an ``HTTP/1.0`` status line. llhttp also refuses (a ``400``,
  aiohttp only) header lines ending in a bare LF (RFC 9112 2.2 lets a recipient take them, as the threading server
  does), chunk extensions outside their grammar (``2;a=b c``, whitespace around ``;``: ignored on the threading
  server), a request line split by a tab or holding a control character or a byte past ASCII in its target (taken
  by the threading server: a 404 for an unknown path), and a request pipelined behind an ``HTTP/2.0`` or ``0.9`` one
  (a ``400`` for both, not the ``505``); it takes ``RTSP/1.0`` and ``ICE/1.0`` as versions (a ``400`` on the
  threading server). Requests pipelined in one read before a malformed one are answered first, then the error, on
  both; on aiohttp not those behind 32 others (40 ``GET`` and a ``BREW`` in one write: 33 200s, then the 501): while
  aiohttp's queue of 32 is full llhttp holds the read's rest back and parses it in one feed as the queue drains, and
  aiohttp answers the error in place of every request that one feed parsed. A method outside llhttp's list right
  behind a body in the same read is a ``400`` on aiohttp, not the ``501`` (llhttp's message quotes the body's end
  with it).
* versions: ``HTTP/1.1`` and ``HTTP/1.0`` are served; another well-formed one (``HTTP/1.2``, ``HTTP/2.0``, ``HTTP/0.9``)
  or none (HTTP/0.9's request line, ``GET /``) is a ``505``, a malformed one (``HTTP/01.1``, ``http/1.1``) a ``400``,
  and the connection closed (on aiohttp llhttp's "Invalid HTTP version" is made the ``505``, and ``HTTP/2.0`` and
  ``0.9``, which llhttp takes, are refused before the body is read, with an ``HTTP/1.1`` status line).
* request targets: an absolute-form one (``http://host/healthz``, RFC 9112 3.2.2) names its path; any other is
  routed as sent, never normalised (``//healthz`` is a 404 naming ``//healthz``, on both servers); one of no RFC 9112
  3.2 form (``healthz``, ``?a``, ``*`` but on OPTIONS, ``*?a``) is a ``400`` and the connection closed, on both.
* a request's header lines are at most 64 KiB together (and a chunked body's trailer, on the threading server;
  aiohttp's parser bounds a trailer by its own limits): past it a ``431``, at once, not at the deadline. Each line
  is at most 65536 bytes and a block 100 lines on the threading server, 8190 bytes and 128 lines on aiohttp.

A client that shuts its sending side (``SHUT_WR``) after its requests gets their answers, then the connection closes,
on both servers.

``stop(grace_s)``: stop accepting (new connections are refused), close idle keep-alive connections at once,
let requests in flight finish (up to ``grace_s``; their answer says ``Connection: close``; a request is in flight
from its first byte read, so one whose head is still arriving is waited for and answered, not cut off as idle), then
close every connection left and join the server's threads. A server never started stops at once; a second stop is a
no-op.
"""

from __future__ import annotations

import ast
import asyncio
import email.utils
import functools
import http.client
import io
import logging
import math
import re
import socket
import sys
import threading
import time
from collections.abc import Iterator
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from serving.app import Response, ScoringApp
from stream.errors import bind_error

if TYPE_CHECKING:
    from aiohttp import web

log = logging.getLogger("streamrec.serve")


class Server(Protocol):
    port: int

    def start(self) -> None: ...

    def stop(self, grace_s: float = 10.0) -> None: ...


def _error_body(message: str) -> bytes:
    return orjson.dumps({"error": message})


def _raw_response(status: int, message: str, headers: dict[str, str] | None = None) -> bytes:
    """A whole JSON error answer that closes the connection, written where no HTTP handler runs (a connection
    over ``max_connections``, a request whose headers did not arrive in time)."""
    body = _error_body(message)
    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", "Content-Type: application/json",
             f"Content-Length: {len(body)}", "Connection: close", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def _too_many_connections(limit: int) -> bytes:
    return _raw_response(503, f"too many connections ({limit}, max_connections); retry shortly", {"Retry-After": "1"})


def _late(timeout_s: float) -> str:
    return f"request not received within request_timeout_s ({timeout_s:g} s)"


_ABSOLUTE_FORM = re.compile(r"https?://[^/?#]*", re.IGNORECASE)
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")  # an absolute-form target's start (a target but /, * and these: 400)


def _origin_form(target: str) -> str:
    """The path (and query) a request target names, on both servers: an absolute-form target (``http://host/p?q``,
    which a server MUST accept, RFC 9112 3.2.2) is its path and query (``/`` if it has none); any other target is
    taken as sent, without normalisation: ``//healthz`` is not ``/healthz`` (a front proxy that routes or refuses by
    path sees it as sent too), and an error names the path the client sent."""
    m = _ABSOLUTE_FORM.match(target)
    if m is None:
        return target
    rest = target[m.end():]
    return rest if rest.startswith("/") else "/" + rest


# -- stdlib ---------------------------------------------------------------------------------------
_HEX = re.compile(rb"[0-9A-Fa-f]+")
_ZEROS = re.compile(rb"0*")
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # a header name (RFC 9110 5.6.2): no whitespace, no colon
# A chunk-size line (RFC 9112 7.1): hex digits, then CRLF, or extensions (``;`` after optional whitespace) that hold
# no control character but HTAB, then CRLF; a bare LF or CR ends no line. The extensions are ignored (RFC 9112 7.1.1),
# their grammar (token, "=", token or quoted string) unchecked: llhttp checks it (a 400 on aiohttp), but in Python's
# re that costs ~75 us per 1 KiB line (~0.3 s of the GIL for a body of 4160 such chunks), this ~4 us.
_CHUNK_LINE = re.compile(rb"([0-9A-Fa-f]+)(?:[ \t]*;[\t\x20-\x7e\x80-\xff]*)?\r\n")
# Field lines (RFC 9110 5.5: a value holds no CR, LF or NUL, nor any other control character but HTAB; a name is a
# token): the control characters looked for (CR: one not before LF), and obsolete line folding (RFC 9112 5.2)
_FIELD_CTL = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]|\r(?!\n)")
_CTL_OR_CR = bytes([*range(0x00, 0x09), *range(0x0b, 0x20), 0x7f])  # (deleted by translate: a C-speed count)
_OBS_FOLD = re.compile(rb"\n[ \t]")
_VERSIONS = ("HTTP/1.1", "HTTP/1.0")  # the versions served (a request line's last word)
_VERSION = re.compile(r"HTTP/[0-9]\.[0-9]")  # a well-formed HTTP-version (RFC 9112 2.3): any other is a 505
_MAX_LINE, _MAX_HEADERS = 65536, 100  # the stdlib's limits on a header line (bytes) and on a block's lines
_MAX_HEAD = 65536  # bytes of a request's header lines, line ends included (and of a chunked body's trailer): 431
_HEAD_TOO_LARGE = f"request header fields too large: the header block is over {_MAX_HEAD} bytes"
_OWS = " \t"  # HTTP's whitespace (RFC 9110 5.6.3); str.split() and str.strip() also take \x1c-\x1f, \x85, \xa0


def _words(requestline: str) -> list[str]:
    """A request line's words, split on SP and HTAB (RFC 9112 3): not ``str.split()``, whose whitespace (the line is
    read as ISO-8859-1) includes NBSP, NEL and FS to US, so ``GET /metrics\xa0 HTTP/1.1``, whose path a front proxy
    reads as ``/metrics\xa0`` (and lets through where it refuses ``/metrics``), was served as ``/metrics``."""
    return [w for w in requestline.replace("\t", " ").split(" ") if w]


def _members(values: list[str]) -> list[str]:
    """The members of a list-valued header (``Transfer-Encoding``, ``Content-Encoding``, ``Connection``; RFC 9110
    5.6.1), lower-cased and trimmed of SP and HTAB only: ``str.strip()`` also trimmed NBSP and NEL, so
    ``Transfer-Encoding: chunked\xa0``, no ``chunked`` to a front proxy (which frames the body otherwise), was read
    as a chunked body on the threading server (llhttp refuses it)."""
    return [m.strip(_OWS).lower() for v in values for m in v.split(",")]


class _BadFraming(Exception):
    """A request whose body cannot be delimited (bad Content-Length or chunk size): answered, then closed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def _max_chunks(limit: int) -> int:
    """The most chunks a chunked body of at most ``limit`` bytes may come in (both servers): 64, plus one per KiB of
    the limit (4160 at 4 MiB). A client whose chunks are 1 KiB or more never meets it; without it a body in 1-byte
    chunks cost ~1.7 us of Python per byte (~7 s of CPU, holding the GIL, for 4 MiB), now ~10 ms at most."""
    return 64 + limit // 1024


def _too_many_chunks(limit: int) -> str:
    return (f"chunked body in more than {_max_chunks(limit)} chunks (64 + 1 per KiB of max_body_bytes): send chunks "
            "of 1 KiB or more, or a Content-Length")


def _chunk_size(digits: bytes) -> int:
    """The size a chunk-size line's hex digits declare (both servers): leading zeros allowed, however many; past 15
    significant digits 2**60, more than any body limit, without ``int()`` of them."""
    digits = digits.lstrip(b"0")
    return int(digits or b"0", 16) if len(digits) <= 15 else 1 << 60


def _chunks_too_large(limit: int) -> str:
    return f"chunked body exceeds {limit} bytes"


_FOLLOW_BUDGET = 256  # steps of _ChunkSizes that finding an open chunked body's start in one read may take


def _head_ends(data: bytes, start: int) -> Iterator[int]:
    """Where a request head may end in ``data`` (at or after ``start``): just past each CRLFCRLF (llhttp ends a
    head nowhere else), and, when ``start`` is 0, at 0 to 3 where the CRLFCRLF began in the previous read."""
    if start == 0:
        yield from (p for p in (0, 1, 2, 3) if b"\r\n\r\n".endswith(data[:p]))
    i = data.find(b"\r\n\r\n", start)
    while i >= 0:
        yield i + 4
        i = data.find(b"\r\n\r\n", i + 1)


class _ChunkSizes:
    """Follows a chunked body on the wire only to read each chunk's declared size, for the aiohttp server.

    aiohttp's parser (llhttp) keeps a chunk's size to itself and hands its data on as it arrives, so a chunk declared
    larger than ``max_body_bytes`` was found out only once that many bytes had come: a client that declared one
    (``fffffffffffffff``) and sent no more held its connection until ``request_timeout_s`` and got a 408, where the
    threading server answers 413 from the size line. This reads the size lines of the bytes llhttp is given (the
    exact grammar: hex digits, then ``;`` extensions or CRLF; RFC 9112 7.1) and sets :attr:`over` once the sizes
    declared exceed the limit (a size line still arriving waits for its end, as on the threading server, bounded by
    ``request_timeout_s``). It checks nothing else:
    llhttp refuses what is malformed; a size line it cannot read makes it :attr:`lost` (follows no further).
    A body in 1 KiB chunks costs ~1 us of Python per chunk."""

    _SIZE, _DATA, _DATA_END, _TRAILER = range(4)

    def __init__(self, limit: int, budget: int | None = None) -> None:
        self.left = limit  # bytes the chunks to come may still declare
        self.chunks_left = _max_chunks(limit)  # past it the handler refuses the body (400): nothing to follow
        self.budget = budget  # steps (a size line, a chunk's data, its CRLF) it may take; None: no bound
        self.state = self._SIZE
        self.line = b""  # the size line so far, from its first digit but 0 (64 bytes: the digits, an extension's start)
        self.zero = False  # the size line began with a 0
        self.trailer_line = 0  # bytes of the trailer line so far
        self.data_left = 0  # of the chunk being received (2 for the CRLF after it, in _DATA_END)
        self.decoded = 0  # chunk data bytes seen
        self.over = False
        self.lost = False

    def feed(self, data: bytes, pos: int = 0) -> int:
        """Follow ``data[pos:]``: the offset just past the body's end in it (its trailer's blank line), or -1 where
        the body goes on past it (or :attr:`lost` is set). Once :attr:`over`, it still follows, for
        :meth:`_Protocol._follow_chunks` to count the data bytes."""
        n = len(data)
        while pos < n and not self.lost:
            if self.budget is not None:
                self.budget -= 1
                if self.budget < 0:
                    self.lost = True
                    break
            if self.state == self._DATA:
                take = min(self.data_left, n - pos)
                pos += take
                self.decoded += take
                self.data_left -= take
                if not self.data_left:
                    self.state, self.data_left = self._DATA_END, 2
            elif self.state == self._DATA_END:  # the CRLF after a chunk's data (llhttp checks it)
                take = min(self.data_left, n - pos)
                pos += take
                self.data_left -= take
                if not self.data_left:
                    self.state = self._SIZE
            elif self.state == self._SIZE:
                nl = data.find(b"\n", pos)
                end = n if nl < 0 else nl + 1
                if not self.line:  # leading zeros, however many, are skipped (their count does not matter)
                    zeros = _ZEROS.match(data, pos, end).end()  # type: ignore[union-attr]  # (matches "")
                    self.zero, pos = self.zero or zeros > pos, zeros
                if len(self.line) < 64:
                    self.line += data[pos:min(end, pos + 64 - len(self.line))]
                pos = end
                self._size_line(done=nl >= 0)
            else:  # the trailer's lines, up to the blank one that ends the body
                nl = data.find(b"\n", pos)
                if nl < 0:
                    self.trailer_line += n - pos
                    return -1
                blank = self.trailer_line + nl - pos <= 1  # (its CR alone)
                self.trailer_line, pos = 0, nl + 1
                if blank:
                    return pos
        return -1

    def _size_line(self, done: bool) -> None:
        """Read :attr:`line`, the size line so far (``done``: all of it): its size, or :attr:`over`, or :attr:`lost`."""
        m = _HEX.match(self.line)
        digits = m.group() if m else b""
        after = self.line[len(digits):len(digits) + 1]
        if (after and after not in b";\r") or (done and not (digits or self.zero)):
            self.lost = True  # not a size line: llhttp refuses it
            return
        if done:
            size = _chunk_size(digits)
            self.over = self.over or size > self.left
            self.line, self.zero = b"", False
            self.left = max(0, self.left - size)
            self.chunks_left -= 1
            if self.chunks_left < 0:
                self.lost = True  # (the handler's 400 for too many chunks)
            elif size:
                self.state, self.data_left = self._DATA, size
            else:
                self.state, self.trailer_line = self._TRAILER, 0


def _content_length(values: list[str], limit: int) -> int:
    """The body's length from a request's ``Content-Length`` values (both servers), or :class:`_BadFraming`: 400
    for several values or one that is not a plain non-negative decimal number, 413 past ``limit``. Leading zeros
    are allowed (``0005`` is 5); the number is compared by its digit count before ``int()`` sees it, so a value of
    thousands of digits (past Python's ``int_max_str_digits``, a ``ValueError``) is a 413 like any other."""
    if len(values) > 1:
        shown = ", ".join(v[:20] for v in values)[:80]
        raise _BadFraming(400, f"{len(values)} Content-Length headers ({shown}): the body's framing is ambiguous")
    raw = values[0]
    digits = raw.strip(_OWS)
    if not (digits.isascii() and digits.isdigit()):  # int() alone takes "-1", "+5", "1_0"
        raise _BadFraming(400, f"Content-Length {raw[:40]!r} is not a non-negative integer")
    digits = digits.lstrip("0") or "0"
    if len(digits) > len(str(limit)) or int(digits) > limit:  # (a longer number is larger: no int() of it)
        shown = digits if len(digits) <= 40 else f"a {len(digits)}-digit number of"
        raise _BadFraming(413, f"body of {shown} bytes exceeds {limit}")
    return int(digits)


def _unsupported_version(version: str) -> str:
    """The 505's message (both servers) for a request in an HTTP version other than 1.0 and 1.1 (``""``: unknown)."""
    said = f" {version!r}" if version else ""
    return f"HTTP version{said} not supported: send HTTP/1.1 (or HTTP/1.0)"


def _field_lines_error(lines: list[bytes]) -> str | None:
    """What makes a block of field lines (a request's headers, a chunked body's trailer: the lines, line ends
    included) unacceptable on both servers (llhttp refuses these before our code runs), or None: obsolete line
    folding (a line starting with whitespace, RFC 9112 5.2: the stdlib joins it to the line above, so
    ``Host: x\r\n Transfer-Encoding: chunked`` is a Host), or a control character other than HTAB (a NUL, DEL, a
    bare CR, ...: RFC 9110 5.5; a proxy that cuts a value or a line there reads another request)."""
    block = b"".join(lines)
    if block[:1] in (b" ", b"\t") or _OBS_FOLD.search(block):
        return "obsolete line folding (a header line starting with whitespace) is not accepted"
    # every control character but HTAB and LF, less the CRs of CRLFs: none left (~0.4 us for 7 headers, the regex ~1.5)
    if len(block) - len(block.translate(None, _CTL_OR_CR)) != block.count(b"\r\n"):
        m = _FIELD_CTL.search(block)
        shown = "CR not followed by LF" if m is None or m.group() == b"\r" else f"control character {m.group()!r}"
        return f"{shown} in a header line (only HTAB is allowed, RFC 9110 5.5)"
    return None


def _check_content_coding(values: list[str]) -> None:
    """A body's ``Content-Encoding`` values (both servers): none, or ``identity``; any other coding is a 415
    (RFC 9110 15.5.16) as :class:`_BadFraming`. The body is JSON as sent: aiohttp alone would inflate gzip, deflate
    (and br, zstd where installed) before our limit saw the bytes, so the same request was scored there and refused
    as "not valid UTF-8" JSON on the threading server; a coding aiohttp lacks was its 400 telling the client to
    install a package."""
    if any(c != "identity" for c in _members(values)):
        shown = ", ".join(values)[:60]
        raise _BadFraming(415, f"Content-Encoding {shown!r} is not supported: send the JSON body uncompressed")


class _HeadTooLarge(http.client.HTTPException):
    """A header (or trailer) block of more than ``_MAX_HEAD`` bytes: a 431."""


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


def _http_date(_cache: list[Any] = [-1, ""]) -> str:  # noqa: B006 - one cache for the process
    """The ``Date`` header's value (the stdlib's ``date_time_string``), formatted once per second."""
    now = int(time.time())
    if _cache[0] != now:
        _cache[1] = email.utils.formatdate(now, usegmt=True)
        _cache[0] = now
    return str(_cache[1])


def _read_header_lines(rfile: Any) -> list[bytes]:
    """A header block's lines up to and including the blank one (or EOF's ``b""``): ``http.client._read_headers``
    (lines of at most 65536 bytes, at most 100 of them, the same errors) with a cap on the whole block, past which
    it is :class:`_HeadTooLarge`: the stdlib's two limits alone let one request hold 100 x 64 KiB (~6 MB)."""
    lines: list[bytes] = []
    total = 0
    while True:
        line = rfile.readline(_MAX_LINE + 1)
        if len(line) > _MAX_LINE:
            raise http.client.LineTooLong("header line")
        total += len(line)
        if total > _MAX_HEAD:
            raise _HeadTooLarge(_HEAD_TOO_LARGE)
        lines.append(line)
        if len(lines) > _MAX_HEADERS:
            raise http.client.HTTPException(f"got more than {_MAX_HEADERS} headers")
        if line in (b"\r\n", b"\n", b""):
            return lines


def _parse_headers(rfile: Any, message_class: type[http.client.HTTPMessage]) -> http.client.HTTPMessage:
    """``http.client.parse_headers`` (the same limits, errors and result) without the ``email`` feed parser for
    the headers every client sends: lines ``Name: value`` whose name is a token and that hold no CR but their
    line end. A block with any other line (a continuation, a name with whitespace, a line without a colon, a bare
    CR, an unterminated line) goes to the stdlib's parser as a whole, so its defects and its reading of odd
    lines (which :meth:`_Handler._framing` refuses) are exactly the stdlib's. The value is what the feed parser
    makes of such a line: leading blanks and the line end stripped (``email.policy.compat32``). The lines are
    read by :func:`_read_header_lines`: the stdlib's limits and errors, and a cap on the block."""
    return _parse_header_lines(_read_header_lines(rfile), message_class)


def _parse_header_lines(lines: list[bytes], message_class: type[http.client.HTTPMessage]) -> http.client.HTTPMessage:
    """:func:`_parse_headers` of the lines :func:`_read_header_lines` read."""
    msg = message_class()
    for raw in lines[:-1]:  # the last is the blank line (or EOF)
        line = raw.decode("iso-8859-1")
        end = 2 if line.endswith("\r\n") else 1 if line.endswith("\n") else 0
        name, sep, value = line[:len(line) - end].partition(":")
        if not end or not sep or "\r" in value or not _TOKEN.fullmatch(name):
            return http.client.parse_headers(io.BytesIO(b"".join(lines)), _class=message_class)
        msg[name] = value.lstrip(_OWS)
    return msg


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
            try:
                self._send(408, "application/json", _error_body(_late(s.request_timeout_s)), close=True)
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
            self._send(503, "application/json", _error_body("shutting down"), close=True)
            return
        try:
            length = self._framing()
        except _BadFraming as exc:
            self._send(exc.status, "application/json", _error_body(exc.message), close=True)
            return
        if self.app.admitted >= self.app.s.max_in_flight:  # every slot looks taken: ask before reading the body
            with self.app.admission(self.path) as refused:  # (a slot is not held across the body's read)
                if refused is not None:  # its body (if any) is not read, nor sent on Expect: the connection ends
                    self._send(*refused, close=length != 0)
                    return
        try:  # bounded by max_body_bytes and request_timeout_s; read bodies at once by max_connections
            body = self._read_body(length)
        except _BadFraming as exc:
            self._send(exc.status, "application/json", _error_body(exc.message), close=True)
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
        self._send(code, "application/json", _error_body(text), close=True)

    def parse_request(self) -> bool:
        """The stdlib's ``parse_request`` (same answers, same errors), with the header block parsed by
        :func:`_parse_headers`: the stdlib hands every request's headers to the ``email`` package's feed parser,
        ~40% of this server's own time per request (profiled, ``bench/README.md``)."""
        self.command = None  # type: ignore[assignment]  # (as the stdlib: set once the request line parses)
        self.request_version = version = self.default_request_version
        self.close_connection = True
        requestline = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")
        self.requestline = requestline
        words = _words(requestline)
        if not words:
            return False
        if len(words) >= 3:  # enough to determine the protocol version
            version = words[-1]
            if version not in _VERSIONS:  # HTTP/1.2 or 0.9 was served as 1.1 or 1.0, HTTP/01.1 as 1.1
                if _VERSION.fullmatch(version):
                    self.send_error(505, _unsupported_version(version))
                else:
                    self.send_error(400, f"Bad request version ({version!r})")
                return False
            self.close_connection = version == "HTTP/1.0"
            self.request_version = version
        if len(words) == 2:  # HTTP/0.9's request line (the stdlib answered it with the body alone, no status line)
            self.send_error(505, _unsupported_version("HTTP/0.9"))
            return False
        if len(words) != 3:
            self.send_error(400, f"Bad request syntax ({requestline!r})")
            return False
        command, path = words[:2]
        if not _TOKEN.fullmatch(command):  # (a token that is no method the app knows: its 501)
            self.send_error(400, f"malformed request: method {command[:40]!r} is not a token (RFC 9110 9.1)")
            return False
        if not (path.startswith("/") or _SCHEME.match(path) or (path == "*" and command == "OPTIONS")):
            self.send_error(400, f"malformed request: request target {path[:200]!r} is none of /path, "
                                 "http://host/path and * (OPTIONS only): RFC 9112 3.2")
            return False
        self.command, self.path = command, _origin_form(path)  # (not the stdlib's "//" to "/": nothing redirects)
        try:
            lines = _read_header_lines(self.rfile)
        except _HeadTooLarge as err:
            self.send_error(431, str(err))
            return False
        except http.client.LineTooLong as err:
            self.send_error(431, "Line too long", str(err))
            return False
        except http.client.HTTPException as err:
            self.send_error(431, "Too many headers", str(err))
            return False
        self.headers = _parse_header_lines(lines, self.MessageClass)
        self._field_error = _field_lines_error(lines)  # refused by _framing
        connection = self.headers.get_all("Connection")
        if connection:  # a list of options (RFC 9110 7.6.1), any case: "close" wins
            options = set(_members(connection))
            if "close" in options:
                self.close_connection = True
            elif "keep-alive" in options:
                self.close_connection = False
        if (self.headers.get("Expect", "").lower() == "100-continue" and self.request_version >= "HTTP/1.1"
                and not self.handle_expect_100()):
            return False
        return True

    def _send(self, status: int, ctype: str, body: bytes, close: bool = False) -> None:
        """The whole answer, status line, headers and body, in one ``sendall``: the stdlib's ``send_response`` /
        ``end_headers`` then ``wfile.write(body)`` cost two sends, two loopback segments the client reads apart
        (~50 us each on loopback, profiled). The same headers as the stdlib's (``Server``, ``Date``) and ours."""
        self.connection.settimeout(self.app.s.request_timeout_s)  # bounds a client that does not read its answer
        close = close or self.server.draining or self.close_connection  # (the request's Connection: close, 1.0)
        phrase = self.responses[status][0] if status in self.responses else ""
        head = [f"{self.protocol_version} {status} {phrase}", f"Server: {self.version_string()}",
                f"Date: {_http_date()}"]
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
        """The body's length from the headers (0: none; None: chunked), or :class:`_BadFraming` where they leave
        it ambiguous: any doubt about where this request ends is where a smuggled one would start."""
        if self._field_error is not None:  # obsolete line folding, a control character
            raise _BadFraming(400, self._field_error)
        if self.headers.defects or any(not _TOKEN.fullmatch(name) for name in self.headers.keys()):
            raise _BadFraming(400, "malformed header line (a field name with whitespace, or a line without a colon)")
        te, cl = self.headers.get_all("Transfer-Encoding") or [], self.headers.get_all("Content-Length") or []
        length: int | None
        if te:
            if cl:
                raise _BadFraming(400, "both Transfer-Encoding and Content-Length: the body's framing is ambiguous")
            if _members(te) != ["chunked"]:
                raise _BadFraming(501, f"Transfer-Encoding {', '.join(te)[:60]!r} is not supported: "
                                       "send chunked or a Content-Length")
            if self.request_version == "HTTP/1.0":
                self.close_connection = True  # RFC 9112 6.1
            length = None
        else:
            length = _content_length(cl, self.app.s.max_body_bytes) if cl else 0
        if length != 0 and "Content-Encoding" in self.headers:
            _check_content_coding(self.headers.get_all("Content-Encoding") or [])
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
            raise _BadFraming(400, f"incomplete body: {len(body)} of {length} bytes before the connection closed")
        return body

    def _read_chunked(self, limit: int) -> bytes:
        body = bytearray()
        chunks, most = 0, _max_chunks(limit)
        while True:
            line = self.rfile.readline(1026)
            m = _CHUNK_LINE.fullmatch(line)
            if m is None:  # (a bare LF, whitespace around the size, a CR or NUL in an extension were taken)
                raise _BadFraming(400, f"malformed chunk-size line {line[:40]!r}: hexadecimal digits, optional "
                                       "extensions, then CRLF (RFC 9112 7.1)")
            size = _chunk_size(m.group(1))
            if size == 0:  # the last chunk: its trailer (ignored, bounded as a header block) up to the blank line
                try:
                    trailer = _read_header_lines(self.rfile)
                except _HeadTooLarge:
                    raise _BadFraming(431, f"chunked trailer over {_MAX_HEAD} bytes") from None
                except http.client.HTTPException as exc:  # a line over 65536 bytes, over 100 lines
                    raise _BadFraming(431, f"chunked trailer too large: {exc}") from None
                if any(not line.endswith(b"\r\n") for line in trailer):  # (EOF's b"", a bare LF)
                    raise _BadFraming(400, "malformed or incomplete chunked trailer: each line ends in CRLF")
                if (error := _field_lines_error(trailer)) is not None:
                    raise _BadFraming(400, f"chunked trailer: {error}")
                return bytes(body)
            if len(body) + size > limit:
                raise _BadFraming(413, _chunks_too_large(limit))
            chunks += 1
            if chunks > most:
                raise _BadFraming(400, _too_many_chunks(limit))
            data = self.rfile.read(size)
            if len(data) < size:
                raise _BadFraming(400, "incomplete chunk before the connection closed")
            body += data
            if self.rfile.read(2) != b"\r\n":  # (a bare LF was taken)
                raise _BadFraming(400, "chunk data not followed by CRLF")

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
        try:  # over the limit: a quick 503 from the accepting thread (a small write, never blocking), closed
            request.setblocking(False)
            request.send(_raw_response(503, "shutting down", {"Retry-After": "1"}) if draining
                         else _too_many_connections(limit))
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
    return method if _TOKEN.fullmatch(method) else None


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
            self.chunks: _ChunkSizes | None = None  # the open chunked body's sizes, followed on the wire
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
            if self.head_open and self.head_bytes > _MAX_HEAD + 8192 and self.transport is not None:  # (+ a line)
                log.debug("request head past %s bytes and not complete: 431", _MAX_HEAD)
                self.transport.write(_raw_response(431, _HEAD_TOO_LARGE))
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
                self.open_body.set_exception(_BadFraming(400, f"malformed request body: {lines[0].rstrip(': ')}"))
            self.open_body = None

        def _follow_chunks(self, data: bytes, start: int) -> None:
            """A request just parsed from ``data[start:]`` whose chunked body is still arriving: find where the body
            starts in ``data`` and follow its chunk sizes (:class:`_ChunkSizes`) from there. llhttp does not say
            where a request's head ended, so each place a head can end is tried (after a CRLFCRLF at or after
            ``start``, or within the first 3 bytes when the head's last bytes came in the previous read), and the
            one from which the body reads to the end of ``data`` with exactly the data bytes llhttp gave the request
            is taken (a false match needs a client's own body crafted for it, and costs only that request). Where none
            matches, or llhttp parsed the request from bytes it held back (a pipeline past its queue of 32), the body
            is bounded as it arrives, as before. Runs once per chunked request whose body is still arriving, in at
            most ``_FOLLOW_BUDGET`` steps over all the places tried: a read full of CRLFCRLFs each followed by chunk
            framing (``2\\r\\n\\r\\n\\r\\n`` repeated) made every try read the rest, ~250 s of the event loop
            for one 64 KB read; past the budget the body is bounded as it arrives."""
            payload = self._messages[-1][1]
            if payload.is_eof():
                return
            budget = _FOLLOW_BUDGET
            for p in _head_ends(data, start):
                sizes = _ChunkSizes(self.max_body_bytes, budget)
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
            payload.set_exception(_BadFraming(413, _chunks_too_large(self.max_body_bytes)))
            self.chunks = self.chunks_payload = None
            self.body_refused = True

        def linger(self, seconds: float, budget: int) -> None:
            """Close after an answer with the request's rest maybe unread, lingering (:func:`_linger`, the threading
            server's): half-close once the answer is flushed, drop what the client still sends until its EOF,
            ``budget`` bytes or ``seconds``. The connection stays one of ``max_connections`` meanwhile, and
            ``stop()`` closes it (not busy). aiohttp's own lingering (``lingering_time``) reads the body through the
            parser, without a half-close or a byte bound, and only when the connection is kept."""
            transport = self.transport
            if transport is None or budget <= 0 or not transport.can_write_eof():
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
            self.transport.write(_raw_response(408, _late(self.request_timeout_s)))
            self.force_close()

        def eof_received(self) -> bool | None:  # type: ignore[override]  # (asyncio.Protocol's: True keeps it open)
            """The client shut its sending side (``SHUT_WR``, ``nc -N``): the requests it sent in full are answered,
            then the connection is closed (the last answer says ``Connection: close``), as on the threading server.
            aiohttp closed the connection at once, answering none of them. A request cut short by the EOF, or an
            idle connection, is closed at once, as before."""
            if self.linger_left is not None:
                log.debug("lingering close ended: eof")
                return None  # (the transport closes)
            if self._parser is None or self._force_close:
                return None
            try:
                self._parser.feed_eof()
            except HttpProcessingError:  # a body (or chunk) cut short
                return None
            waiter = getattr(self, "_waiter", None)
            if not self._messages and waiter is not None and not waiter.done():
                return None  # idle, waiting for a request that cannot come
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
                text, status = _unsupported_version(""), 505
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
            self.linger_after = status < 500 or status == 505  # llhttp refused it, its rest unread (a 500: closed)
            resp = web.Response(status=status, body=_error_body(text), content_type="application/json")
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
        headers = self.app.headers(request.method, _origin_form(request.raw_path), status)
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
        chunks, most = 0, _max_chunks(limit)
        while True:  # chunked: a chunk at a time, to count them
            data, end_of_chunk = await content.readchunk()
            if not data and not end_of_chunk:  # the body's end
                return bytes(body)
            body += data
            if len(body) > limit:
                raise _TooLarge
            chunks += end_of_chunk
            if chunks > most:
                raise _BadFraming(400, _too_many_chunks(limit))

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        from aiohttp import web
        from aiohttp.web_protocol import RequestPayloadError

        s = self.app.s
        proto: Any = request.protocol  # a _Protocol (_aiohttp_protocol)
        version = f"HTTP/{request.version[0]}.{request.version[1]}"
        if version not in _VERSIONS:  # llhttp takes HTTP/2.0 and 0.9 (a request line without one) too
            if proto.transport is not None:  # written raw: aiohttp's status line would say the request's version
                proto.transport.write(_raw_response(505, _unsupported_version(version)))
            proto.force_close()
            return web.Response(status=505)  # (not sent: the connection is closed, its writes refused)
        limit = s.max_body_bytes
        if sum(len(k) + len(v) + 4 for k, v in request.raw_headers) + 2 > _MAX_HEAD:  # (the threading server's count)
            return await self._reply(request, (431, "application/json", _error_body(_HEAD_TOO_LARGE)), close=True)
        target = _origin_form(request.raw_path)  # (not request.path: yarl's reading of "//healthz" is "////healthz")
        try:  # (not request.content_length: its int() raises past 4300 digits, a 500)
            _content_length(request.headers.getall("Content-Length", []) or ["0"], limit)
            if request.body_exists and "Content-Encoding" in request.headers:  # (auto_decompress is off)
                _check_content_coding(request.headers.getall("Content-Encoding"))
        except _BadFraming as exc:  # over the limit, a coding: said before the body is read
            return await self._reply(request, (exc.status, "application/json", _error_body(exc.message)), close=True)
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
                return await self._reply(request, (408, "application/json", _error_body(
                    _late(s.request_timeout_s))), close=True)
            except _TooLarge:  # a chunked body past the limit
                return await self._reply(request, (413, "application/json", _error_body(
                    f"request body exceeds {limit} bytes")), close=True)
            except _BadFraming as exc:  # too many chunks; or one declared past the limit (_ChunkSizes)
                return await self._reply(request, (exc.status, "application/json", _error_body(exc.message)),
                                         close=True)
            except (RequestPayloadError, ConnectionError) as exc:  # malformed chunks; or the client left
                return await self._reply(request, (400, "application/json", _error_body(
                    f"malformed request body: {exc}")), close=True)
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
                                  "auto_decompress": False}  # (a coded body is a 415: _check_content_coding)
        self._web = manager = web.Server(self._handle, loop=loop, **kwargs)
        protocol = _aiohttp_protocol()

        def connection() -> asyncio.Protocol:
            if self._draining or len(manager.connections) >= s.max_connections:
                return _Refuse(_too_many_connections(s.max_connections))
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


def make_server(kind: str, app: ScoringApp, host: str, port: int) -> Server:
    if kind == "threading":
        return ThreadedServer(app, host, port)
    if kind == "aiohttp":
        return AiohttpServer(app, host, port)
    raise ValueError(f"[serve] server must be threading or aiohttp, got {kind!r}")

"""The HTTP/1.1 wire rules both servers share (``serving/http_server.py`` says what they enforce): the request
line's and headers' grammar, the framing of a body (``Content-Length``, chunked sizes), the limits on a header block,
and the JSON answers written raw (a 503 over ``max_connections``, a framing error)."""

from __future__ import annotations

import email.utils
import http.client
import io
import re
import time
from collections.abc import Iterator
from http import HTTPStatus
from typing import Any

import orjson


def error_body(message: str) -> bytes:
    return orjson.dumps({"error": message})


def raw_response(status: int, message: str, headers: dict[str, str] | None = None) -> bytes:
    """A whole JSON error answer that closes the connection, written where no HTTP handler runs (a connection
    over ``max_connections``, a request whose headers did not arrive in time)."""
    body = error_body(message)
    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", "Content-Type: application/json",
             f"Content-Length: {len(body)}", "Connection: close", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def too_many_connections(limit: int) -> bytes:
    return raw_response(503, f"too many connections ({limit}, max_connections); retry shortly", {"Retry-After": "1"})


def too_late(timeout_s: float) -> str:
    return f"request not received within request_timeout_s ({timeout_s:g} s)"


_ABSOLUTE_FORM = re.compile(r"https?://[^/?#]*", re.IGNORECASE)
# a byte no request target holds (RFC 9112 3.2, RFC 3986: visible ASCII only; others are percent-encoded): llhttp
# refuses them (a 400 on aiohttp), the threading server served them (GET /healthz?x=\xff: 200)
TARGET_BYTE = re.compile(r"[^\x21-\x7e]")
SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")  # an absolute-form target's start (a target but /, * and these: 400)


def origin_form(target: str) -> str:
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
TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # a header name (RFC 9110 5.6.2): no whitespace, no colon
# A chunk-size line (RFC 9112 7.1): hex digits, then CRLF, or extensions (``;`` after optional whitespace) that hold
# no control character but HTAB, then CRLF; a bare LF or CR ends no line. The extensions are ignored (RFC 9112 7.1.1),
# their grammar (token, "=", token or quoted string) unchecked: llhttp checks it (a 400 on aiohttp), but in Python's
# re that costs ~75 us per 1 KiB line (~0.3 s of the GIL for a body of 4160 such chunks), this ~4 us.
CHUNK_LINE = re.compile(rb"([0-9A-Fa-f]+)(?:[ \t]*;[\t\x20-\x7e\x80-\xff]*)?\r\n")
# Field lines (RFC 9110 5.5: a value holds no CR, LF or NUL, nor any other control character but HTAB; a name is a
# token): the control characters looked for (CR: one not before LF), and obsolete line folding (RFC 9112 5.2)
_FIELD_CTL = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]|\r(?!\n)")
_CTL_OR_CR = bytes([*range(0x00, 0x09), *range(0x0b, 0x20), 0x7f])  # (deleted by translate: a C-speed count)
_OBS_FOLD = re.compile(rb"\n[ \t]")
VERSIONS = ("HTTP/1.1", "HTTP/1.0")  # the versions served (a request line's last word)
VERSION = re.compile(r"HTTP/[0-9]\.[0-9]")  # a well-formed HTTP-version (RFC 9112 2.3): any other is a 505
_MAX_LINE, _MAX_HEADERS = 65536, 100  # the stdlib's limits on a header line (bytes) and on a block's lines
MAX_HEAD = 65536  # bytes of a request's header lines, line ends included (and of a chunked body's trailer): 431
HEAD_TOO_LARGE = f"request header fields too large: the header block is over {MAX_HEAD} bytes"
HEAD_CUT_SHORT = ("incomplete request: the connection closed before the blank line that ends its headers; send the "
                  "whole request (its head ends in an empty line) before shutting the sending side")
_OWS = " \t"  # HTTP's whitespace (RFC 9110 5.6.3); str.split() and str.strip() also take \x1c-\x1f, \x85, \xa0


def request_words(requestline: str) -> list[str]:
    """A request line's words, split on SP and HTAB (RFC 9112 3): not ``str.split()``, whose whitespace (the line is
    read as ISO-8859-1) includes NBSP, NEL and FS to US, so ``GET /metrics\xa0 HTTP/1.1``, whose path a front proxy
    reads as ``/metrics\xa0`` (and lets through where it refuses ``/metrics``), was served as ``/metrics``."""
    return [w for w in requestline.replace("\t", " ").split(" ") if w]


def list_members(values: list[str]) -> list[str]:
    """The members of a list-valued header (``Transfer-Encoding``, ``Content-Encoding``, ``Connection``; RFC 9110
    5.6.1), lower-cased and trimmed of SP and HTAB only: ``str.strip()`` also trimmed NBSP and NEL, so
    ``Transfer-Encoding: chunked\xa0``, no ``chunked`` to a front proxy (which frames the body otherwise), was read
    as a chunked body on the threading server (llhttp refuses it)."""
    return [m.strip(_OWS).lower() for v in values for m in v.split(",")]


class BadFraming(Exception):
    """A request whose body cannot be delimited (bad Content-Length or chunk size): answered, then closed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def max_chunks(limit: int) -> int:
    """The most chunks a chunked body of at most ``limit`` bytes may come in (both servers): 64, plus one per KiB of
    the limit (4160 at 4 MiB). A client whose chunks are 1 KiB or more never meets it; without it a body in 1-byte
    chunks cost ~1.7 us of Python per byte (~7 s of CPU, holding the GIL, for 4 MiB), now ~10 ms at most."""
    return 64 + limit // 1024


def too_many_chunks(limit: int) -> str:
    return (f"chunked body in more than {max_chunks(limit)} chunks (64 + 1 per KiB of max_body_bytes): send chunks "
            "of 1 KiB or more, or a Content-Length")


def chunk_size(digits: bytes) -> int:
    """The size a chunk-size line's hex digits declare (both servers): leading zeros allowed, however many; past 15
    significant digits 2**60, more than any body limit, without ``int()`` of them."""
    digits = digits.lstrip(b"0")
    return int(digits or b"0", 16) if len(digits) <= 15 else 1 << 60


def chunks_too_large(limit: int) -> str:
    return f"chunked body exceeds {limit} bytes"


FOLLOW_BUDGET = 256  # steps of ChunkSizes that finding an open chunked body's start in one read may take


def head_ends(data: bytes, start: int) -> Iterator[int]:
    """Where a request head may end in ``data`` (at or after ``start``): just past each CRLFCRLF (llhttp ends a
    head nowhere else), and, when ``start`` is 0, at 0 to 3 where the CRLFCRLF began in the previous read."""
    if start == 0:
        yield from (p for p in (0, 1, 2, 3) if b"\r\n\r\n".endswith(data[:p]))
    i = data.find(b"\r\n\r\n", start)
    while i >= 0:
        yield i + 4
        i = data.find(b"\r\n\r\n", i + 1)


class ChunkSizes:
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
        self.chunks_left = max_chunks(limit)  # past it the handler refuses the body (400): nothing to follow
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
            size = chunk_size(digits)
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


def content_length(values: list[str], limit: int) -> int:
    """The body's length from a request's ``Content-Length`` values (both servers), or :class:`BadFraming`: 400
    for several values or one that is not a plain non-negative decimal number, 413 past ``limit``. Leading zeros
    are allowed (``0005`` is 5); the number is compared by its digit count before ``int()`` sees it, so a value of
    thousands of digits (past Python's ``int_max_str_digits``, a ``ValueError``) is a 413 like any other."""
    if len(values) > 1:
        shown = ", ".join(v[:20] for v in values)[:80]
        raise BadFraming(400, f"{len(values)} Content-Length headers ({shown}): the body's framing is ambiguous")
    raw = values[0]
    digits = raw.strip(_OWS)
    if not (digits.isascii() and digits.isdigit()):  # int() alone takes "-1", "+5", "1_0"
        raise BadFraming(400, f"Content-Length {raw[:40]!r} is not a non-negative integer")
    digits = digits.lstrip("0") or "0"
    if len(digits) > len(str(limit)) or int(digits) > limit:  # (a longer number is larger: no int() of it)
        shown = digits if len(digits) <= 40 else f"a {len(digits)}-digit number of"
        raise BadFraming(413, f"body of {shown} bytes exceeds {limit}")
    return int(digits)


def unsupported_version(version: str) -> str:
    """The 505's message (both servers) for a request in an HTTP version other than 1.0 and 1.1 (``""``: unknown)."""
    said = f" {version!r}" if version else ""
    return f"HTTP version{said} not supported: send HTTP/1.1 (or HTTP/1.0)"


def field_lines_error(lines: list[bytes]) -> str | None:
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


def check_content_coding(values: list[str]) -> None:
    """A body's ``Content-Encoding`` values (both servers): none, or ``identity``; any other coding is a 415
    (RFC 9110 15.5.16) as :class:`BadFraming`. The body is JSON as sent: aiohttp alone would inflate gzip, deflate
    (and br, zstd where installed) before our limit saw the bytes, so the same request was scored there and refused
    as "not valid UTF-8" JSON on the threading server; a coding aiohttp lacks was its 400 telling the client to
    install a package."""
    if any(c != "identity" for c in list_members(values)):
        shown = ", ".join(values)[:60]
        raise BadFraming(415, f"Content-Encoding {shown!r} is not supported: send the JSON body uncompressed")


class HeadTooLarge(http.client.HTTPException):
    """A header (or trailer) block of more than ``MAX_HEAD`` bytes: a 431."""


def http_date(_cache: list[Any] = [-1, ""]) -> str:  # noqa: B006 - one cache for the process
    """The ``Date`` header's value (the stdlib's ``date_time_string``), formatted once per second."""
    now = int(time.time())
    if _cache[0] != now:
        _cache[1] = email.utils.formatdate(now, usegmt=True)
        _cache[0] = now
    return str(_cache[1])


def read_header_lines(rfile: Any) -> list[bytes]:
    """A header block's lines up to and including the blank one (or EOF's ``b""``): ``http.client._read_headers``
    (lines of at most 65536 bytes, at most 100 of them, the same errors) with a cap on the whole block, past which
    it is :class:`HeadTooLarge`: the stdlib's two limits alone let one request hold 100 x 64 KiB (~6 MB)."""
    lines: list[bytes] = []
    total = 0
    while True:
        line = rfile.readline(_MAX_LINE + 1)
        if len(line) > _MAX_LINE:
            raise http.client.LineTooLong("header line")
        total += len(line)
        if total > MAX_HEAD:
            raise HeadTooLarge(HEAD_TOO_LARGE)
        lines.append(line)
        if len(lines) > _MAX_HEADERS:
            raise http.client.HTTPException(f"got more than {_MAX_HEADERS} headers")
        if line in (b"\r\n", b"\n", b""):
            return lines


def parse_headers(rfile: Any, message_class: type[http.client.HTTPMessage]) -> http.client.HTTPMessage:
    """``http.client.parse_headers`` (the same limits, errors and result) without the ``email`` feed parser for
    the headers every client sends: lines ``Name: value`` whose name is a token and that hold no CR but their
    line end. A block with any other line (a continuation, a name with whitespace, a line without a colon, a bare
    CR, an unterminated line) goes to the stdlib's parser as a whole, so its defects and its reading of odd
    lines (which :meth:`~serving.http_threaded._Handler._framing` refuses) are exactly the stdlib's. The value is what
    the feed parser makes of such a line: leading blanks and the line end stripped (``email.policy.compat32``). The
    lines are read by :func:`read_header_lines`: the stdlib's limits and errors, and a cap on the block."""
    return parse_header_lines(read_header_lines(rfile), message_class)


def parse_header_lines(lines: list[bytes], message_class: type[http.client.HTTPMessage]) -> http.client.HTTPMessage:
    """:func:`parse_headers` of the lines :func:`read_header_lines` read."""
    msg = message_class()
    for raw in lines[:-1]:  # the last is the blank line (or EOF)
        line = raw.decode("iso-8859-1")
        end = 2 if line.endswith("\r\n") else 1 if line.endswith("\n") else 0
        name, sep, value = line[:len(line) - end].partition(":")
        if not end or not sep or "\r" in value or not TOKEN.fullmatch(name):
            return http.client.parse_headers(io.BytesIO(b"".join(lines)), _class=message_class)
        msg[name] = value.lstrip(_OWS)
    return msg

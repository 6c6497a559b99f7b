"""HTTP with a total deadline: one request whose connect, send and every read end by one deadline (a receiver
that trickles its answer is cut off too), as the webhook sink posts and the scraper reads.
"""

from __future__ import annotations

import base64
import email.utils
import http.client
import io
import json
import re
import socket
import time
import unicodedata
import urllib.parse
from functools import partial
from typing import Any

from stream.errors import quoted


def time_left(deadline: float, what: str) -> float:
    """Seconds until ``deadline``; :class:`TimeoutError` once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"deadline passed {what}")
    return left


class _DeadlineReader(io.RawIOBase):
    """Reads a socket, each read given only the time left until ``deadline``: a peer that trickles
    bytes is cut off at the deadline, not once per read. Reads through the socket's own file object
    (``makefile``), which keeps the socket open while the answer is read, as http.client expects: it
    closes its connection right after the headers of an answer that ends when the peer hangs up."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self._sock, self._deadline = sock, deadline
        self._raw = sock.makefile("rb", buffering=0)

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int | None:
        self._sock.settimeout(time_left(self._deadline, "reading the answer"))
        return self._raw.readinto(buf)

    def close(self) -> None:
        self._raw.close()
        super().close()


class _DeadlineSocket:
    """What :class:`http.client.HTTPResponse` needs of a socket (``makefile``), reading by a deadline."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock, self._deadline = sock, deadline

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(_DeadlineReader(self._sock, self._deadline))


def _deadline_response(sock: socket.socket, *args: Any, deadline: float, **kw: Any) -> http.client.HTTPResponse:
    return http.client.HTTPResponse(_DeadlineSocket(sock, deadline), *args, **kw)  # type: ignore[arg-type]


def _connect(address: tuple[str, int], deadline: float) -> socket.socket:
    """Like :func:`socket.create_connection`, but every address tried gets only the time left."""
    host, port = address
    error: OSError | None = None
    for family, kind, proto, _, addr in socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(time_left(deadline, "connecting"))
            sock.connect(addr)
            sock.settimeout(time_left(deadline, "connecting"))  # the TLS handshake, if any, gets what is left
            return sock
        except OSError as exc:
            sock.close()
            error = exc
            if isinstance(exc, TimeoutError):
                break
    raise error or OSError(f"{host} resolves to no address")


def _deadline_connection(url: str, deadline: float) -> tuple[http.client.HTTPConnection, str]:
    """A connected HTTP(S) connection to ``url`` whose connect, send and every read of the answer get only the time
    left until ``deadline``, and the request path; closed again if connecting fails."""
    parts = urllib.parse.urlsplit(url)
    conn_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    port = parts.port or (443 if parts.scheme == "https" else 80)
    conn = conn_class(parts.hostname or "", port, timeout=time_left(deadline, "connecting"))
    conn._create_connection = lambda address, *_: _connect(address, deadline)  # type: ignore[attr-defined]
    conn.response_class = partial(_deadline_response, deadline=deadline)  # type: ignore[assignment]
    try:
        conn.connect()
        assert conn.sock is not None
        conn.sock.settimeout(time_left(deadline, "sending"))  # sendall: a total limit since Python 3.5
    except BaseException:
        conn.close()
        raise
    return conn, _request_target(parts)


_NON_ASCII = re.compile(r"[^\x00-\x7f]+")


def _request_target(parts: urllib.parse.SplitResult) -> str:
    """The path and query of ``parts`` as an HTTP request sends them: each non-ASCII character percent-encoded as
    UTF-8 (as browsers and ``requests`` send it), the rest as written. http.client raised UnicodeEncodeError for a
    raw one at every request: a rules file with ``webhook_url = ".../köln"`` loaded, and each alert stayed queued."""
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return _NON_ASCII.sub(lambda m: urllib.parse.quote(m.group(), safe=""), target)


def _auth_headers(url: str) -> dict[str, str]:
    """``Authorization: Basic`` for the user and password ``url`` names (``https://user:password@host/...``,
    percent-escapes decoded, UTF-8), as curl sends them; none when it names no user. http.client itself drops
    them: a receiver that wants them answered 401 to every request."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None:
        return {}
    user = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
    return {"Authorization": "Basic " + base64.b64encode(user.encode()).decode("ascii")}


def retry_after_s(value: str | None) -> float | None:
    """Seconds an HTTP ``Retry-After`` header asks for: delay-seconds or an HTTP-date (RFC 9110 10.2.3), never
    negative; None when absent or unreadable."""
    if value is None:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():  # ("²".isdigit(), and a Latin-1 header may carry it)
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    return max(0.0, when.timestamp() - time.time()) if when.tzinfo is not None else None


def reason_of(resp: http.client.HTTPResponse) -> str:
    """The answer's reason phrase (``Not Found``) as a message may quote it: as sent where it is short and printable,
    else escaped and cut (:func:`stream.errors.quoted`). It is the peer's text, up to 64 KiB that http.client reads: a
    scrape target's ``500 \\x1b[2J...`` reached the log raw with every failed scrape (a terminal escape, a carriage
    return over the line), and kilobytes of it went into each alert's text."""
    return quoted(resp.reason, 80)


def post_json(url: str, body: bytes, deadline: float) -> tuple[int, str, bytes, float | None]:
    """``POST`` ``body`` to ``url``; returns (status, reason, the first bytes of an error answer's body, the seconds
    its ``Retry-After`` asks for or None).

    Promise: returns or raises by ``deadline`` (``time.monotonic()`` seconds), whatever the peer does:
    connecting, sending and every read of the answer get only the time left, so a server that accepts
    and never answers, or trickles its answer, raises :class:`TimeoutError` at the deadline. (Name
    resolution is the one step the operating system's resolver bounds instead.) A 2xx answer's body
    is not read: the status says the alert arrived. Redirects are not followed. A user and password in ``url``
    are sent as HTTP Basic authentication.
    """
    conn, path = _deadline_connection(url, deadline)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json",
                                                       "User-Agent": "streamrec-monitor", **_auth_headers(url)})
        resp = conn.getresponse()
        detail = b""
        if not 200 <= resp.status < 300:
            try:
                detail = resp.read(300)
            except (OSError, http.client.HTTPException):
                pass
        return resp.status, reason_of(resp), detail, retry_after_s(resp.getheader("Retry-After"))
    finally:
        conn.close()


def get_text(url: str, deadline: float, max_bytes: int) -> str:
    """``GET`` ``url`` and return its body as text: UTF-8, each undecodable byte kept as a lone surrogate
    (``surrogateescape``, U+DC80..U+DCFF), so :func:`monitor.exposition.parse` refuses it where Prometheus does (a
    label value, HELP text) and reads past it where Prometheus does (a comment); ``errors="replace"`` read a
    Latin-1 ``K\\xf6ln`` as ``K\\ufffdln``.

    Promise, as :func:`post_json`: returns or raises by ``deadline`` (``time.monotonic()`` seconds),
    whatever the peer does (a server that accepts and never answers, or trickles its answer, raises
    :class:`TimeoutError` at the deadline), and never holds more than ``max_bytes`` of the answer: a
    longer one raises :class:`ValueError` saying so. A status other than 2xx raises
    :class:`OSError` naming it, as does a compressed answer (a ``Content-Encoding`` other than identity: read as
    text it was refused as cut off); redirects are not followed (give the final URL). A user and password in ``url``
    are sent as HTTP Basic authentication.
    """
    conn, path = _deadline_connection(url, deadline)
    try:
        conn.request("GET", path, headers={"Accept": "text/plain", "User-Agent": "streamrec-monitor",
                                           **_auth_headers(url)})
        resp = conn.getresponse()
        if not 200 <= resp.status < 300:
            raise OSError(f"HTTP {resp.status} {reason_of(resp)}" + (" (redirects are not followed: give the final "
                                                                  "URL)" if 300 <= resp.status < 400 else ""))
        encoding = resp.getheader("Content-Encoding", "").strip(" \t")
        if encoding and encoding.lower() != "identity":  # (http.client asks for identity, and decodes nothing)
            raise OSError(f"the answer is compressed (Content-Encoding: {quoted(encoding, 40)}), which the monitor "
                          "does not decode; have the source (or the proxy before it) answer uncompressed when "
                          "asked for Accept-Encoding: identity")
        body = resp.read(max_bytes + 1)
        if len(body) > max_bytes:
            raise ValueError(f"the answer is larger than {max_bytes} bytes; not read further")
        return body.decode("utf-8", "surrogateescape")
    finally:
        conn.close()


def check_http_url(url: str) -> str | None:
    """None when ``url`` is a usable http(s) URL (a webhook, a scrape source), else what is wrong with it."""
    odd = dict.fromkeys(c for c in url if c.isspace() or unicodedata.category(c) == "Cc")  # urlsplit drops some
    if odd:  # (each escaped: the message must not carry a NUL or a line break to the terminal or the log)
        return (f"holds a control character or space ({', '.join(json.dumps(c) for c in odd)}; a space is %20 in a "
                "URL)")
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in 0-65535
    except ValueError as exc:  # its detail quotes the netloc's parts: not where a user-info (a password) is among them
        return (str(exc) if "@" not in url else "its host or port cannot be read (in a user:password@, a '/', '?', "
                "'#' or '@' must be percent-encoded)")
    if parts.scheme not in ("http", "https"):
        return "expected an http:// or https:// URL"
    if not parts.hostname:
        return "the URL names no host"
    return None

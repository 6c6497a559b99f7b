"""HTTP servers that carry :class:`serving.app.ScoringApp`: the stdlib's ThreadingHTTPServer (default) and aiohttp.

Measured with ``bench/serving.py`` (1 user x 100 candidates, 10 M-row TorchScript artifact, loopback,
2 cores shared with other work, load average ~5): at 1 client the two are within noise (p50 2.5 vs
2.2 ms); at 8 clients threading served 383 req/s (p99 48 ms) and aiohttp 355 req/s (p99 37 ms); a
1 M-row run gave threading 260 req/s vs aiohttp 165 req/s. Threading is the default: each keep-alive
connection runs on its own thread, so torch (which releases the GIL) scores several requests at once,
and there is no event-loop hop; aiohttp runs the scoring inline on its single event loop. Both speak
HTTP/1.1 keep-alive; ``[serve] server`` picks one (:func:`make_server`). The servers are ``http_threaded.py`` and
``http_aiohttp.py``, the HTTP/1.1 wire rules they share ``http_wire.py``; this module says what they enforce.

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
  (``http_threaded._linger``, ``http_aiohttp._Protocol.linger``). Closed at once, a socket with input unread makes the
  kernel send a reset, and a client still sending its body (``http.client``, ``requests``) got ``BrokenPipe`` or
  "connection reset", never the answer that said why. A lingering connection holds one of ``max_connections`` (and,
  threading, its thread); ``stop()`` closes it as idle. No linger where the request was read whole (``Connection:
  close``), after a ``408`` (a client too slow for its deadline gets no more time), for a connection over
  ``max_connections`` (its ``503`` is written and closed at once: lingering would take the slot it was refused), and on
  aiohttp after the ``505`` for an ``HTTP/2.0`` or ``0.9`` request line (written raw, closed at once). aiohttp's answers
  to llhttp's errors (``http_aiohttp._Protocol.handle_error``) linger too, where aiohttp closed at once.
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
  data is waited for, on both servers (on aiohttp, ``http_wire.ChunkSizes`` reads the sizes that llhttp keeps to
  itself).
  aiohttp's own parser (llhttp) refuses these before our code runs; its answer is turned into the same JSON
  ``{"error": "malformed request: ..."}``, logged at debug level without a traceback. A method outside llhttp's list
  (``BREW``, ``get``: methods are case-sensitive) is answered by the app, a ``501`` as on the threading server
  (``http_aiohttp._refused_method``; the connection is closed after it on aiohttp only), a method that is no token a
  ``400`` on both. Where the two differ: a
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

from typing import Protocol

from serving.app import ScoringApp
from serving.http_aiohttp import AiohttpServer
from serving.http_threaded import ThreadedServer


class Server(Protocol):
    port: int

    def start(self) -> None: ...

    def stop(self, grace_s: float = 10.0) -> None: ...


def make_server(kind: str, app: ScoringApp, host: str, port: int) -> Server:
    if kind == "threading":
        return ThreadedServer(app, host, port)
    if kind == "aiohttp":
        return AiohttpServer(app, host, port)
    raise ValueError(f"[serve] server must be threading or aiohttp, got {kind!r}")

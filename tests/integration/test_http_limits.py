"""HTTP limits of ``serving/http_server.py``, on both servers: ``max_connections``, ``max_in_flight``,
``request_timeout_s`` (a whole-request deadline, slowloris) and ``keepalive_timeout_s``.

Each test builds its server with small limits and short timeouts, so the whole module runs in seconds; every
wait is bounded (socket timeouts, ``join`` timeouts) and every server is stopped (the conftest's thread-leak
guard fails a test that leaves a server or client thread running). The app has no model: ``/v1/score`` with a
well-formed body answers 422 (``EMPTY_ITEMS``) or 503, ``/healthz`` 200.
"""

from __future__ import annotations

import http.client
import json
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

from learner.config import Device
from serving.app import ScoringApp
from serving.http_server import Server, make_server
from serving.metrics import ServingMetrics
from serving.settings import ServeSettings
from serving.swap import ModelHolder
from stream.errors import BindError
from tests.integration.test_http_server import EMPTY_ITEMS, EMPTY_ITEMS_ERROR, KINDS, read_response, request

Make = Callable[..., tuple[Server, ScoringApp]]


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def make(kind: str, tmp_path: Path) -> Iterator[Make]:
    """``make(**settings)``: a started server of this kind on a loopback port; every one is stopped after the test."""
    servers: list[Server] = []

    def build(**settings: Any) -> tuple[Server, ScoringApp]:
        settings = {"max_body_bytes": 1000, **settings}
        ss = ServeSettings(port=0, publish_root=tmp_path / "nothing-published", device=Device.CPU, **settings)
        holder = ModelHolder()
        app = ScoringApp(ss, holder, ServingMetrics(holder.model), None)
        srv = make_server(kind, app, "127.0.0.1", 0)
        srv.start()
        servers.append(srv)
        return srv, app

    try:
        yield build
    finally:
        for srv in servers:
            srv.stop(0.5)


class Client:
    """A raw connection with a buffered reader; closed by the test's ``clients`` fixture."""

    def __init__(self, srv: Server, timeout_s: float = 5.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", srv.port), timeout=timeout_s)
        self.f = self.sock.makefile("rb")

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def response(self, timeout_s: float = 5.0) -> tuple[int, dict[str, str], bytes]:
        self.sock.settimeout(timeout_s)
        return read_response(self.f)

    def closed(self, within_s: float) -> bool:
        """The server closed (or reset) the connection within ``within_s``, reading whatever it answered first."""
        self.sock.settimeout(within_s)
        try:
            while self.f.read(1):
                pass
            return True
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False

    def close(self) -> None:
        self.f.close()
        self.sock.close()


@pytest.fixture
def clients() -> Iterator[Callable[..., Client]]:
    opened: list[Client] = []

    def connect(srv: Server, timeout_s: float = 5.0) -> Client:
        c = Client(srv, timeout_s)
        opened.append(c)
        return c

    try:
        yield connect
    finally:
        for c in opened:
            c.close()


def healthz(srv: Server, connect: Callable[..., Client], timeout_s: float = 2.0) -> tuple[int, float]:
    """A normal request on a fresh connection: its status and how long it took."""
    t0 = time.monotonic()
    c = connect(srv)
    c.send(request("GET", "/healthz", headers={"Connection": "close"}))
    status = c.response(timeout_s)[0]
    return status, time.monotonic() - t0


# -- max_connections ------------------------------------------------------------------------------------------------
def test_connections_over_max_connections_get_a_quick_503_and_the_open_ones_are_still_served(
        make: Make, clients: Callable[..., Client]) -> None:
    srv, _ = make(max_connections=4, request_timeout_s=5, keepalive_timeout_s=10)
    keep = clients(srv)  # a client that was connected before the flood
    keep.send(request("GET", "/healthz"))
    assert keep.response()[0] == 200
    slow = [clients(srv) for _ in range(2)]  # a slow client: a request started, never finished
    for c in slow:
        c.send(b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Le")
    idle = clients(srv)  # and one that sends nothing
    time.sleep(0.2)  # all four accepted
    t0 = time.monotonic()
    for _ in range(6):  # the flood beyond the limit
        c = clients(srv)
        status, headers, body = c.response(timeout_s=2.0)
        assert (status, headers["retry-after"], headers["connection"]) == (503, "1", "close")
        assert "max_connections" in json.loads(body)["error"]
        assert c.closed(within_s=2.0)
    assert time.monotonic() - t0 < 3.0  # quick: refused at accept, nothing waited for
    keep.send(request("GET", "/healthz"))  # the server is not stuck: an open connection is served at once
    t0 = time.monotonic()
    assert keep.response(timeout_s=2.0)[0] == 200 and time.monotonic() - t0 < 1.0
    idle.close()  # a slot frees up: a new client gets in
    deadline = time.monotonic() + 3.0
    while (status := healthz(srv, clients)[0]) != 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert status == 200


def test_slow_clients_hold_their_connections_only_until_request_timeout(
        make: Make, clients: Callable[..., Client]) -> None:
    srv, _ = make(max_connections=3, request_timeout_s=1.0)
    stop = threading.Event()
    slow = [clients(srv) for _ in range(3)]

    def trickle() -> None:  # slowloris: a byte of a never-ending header every 0.1 s on each connection
        data = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
        for i in range(len(data)):
            if stop.wait(0.1):
                return
            for c in slow:
                try:
                    c.send(data[i:i + 1])
                except OSError:
                    pass

    t = threading.Thread(target=trickle, name="slowloris")
    t.start()
    try:
        time.sleep(0.3)
        assert healthz(srv, clients)[0] == 503  # the three slow ones hold every connection
        t0 = time.monotonic()
        assert all(c.closed(within_s=3.0) for c in slow)  # cut off at their deadline, not kept alive by bytes
        assert time.monotonic() - t0 < 2.0
        status, took = healthz(srv, clients)
        assert status == 200 and took < 1.0
    finally:
        stop.set()
        t.join(5)


# -- max_in_flight --------------------------------------------------------------------------------------------------
@contextmanager
def every_slot_taken(app: ScoringApp) -> Iterator[None]:
    """Hold every ``max_in_flight`` slot (as requests being scored would) until the block ends."""
    with ExitStack() as held:
        for _ in range(app.s.max_in_flight):
            assert held.enter_context(app.admission("/v1/score")) is None
        yield


def test_requests_over_max_in_flight_get_503_with_retry_after_and_probes_still_answer(
        make: Make, clients: Callable[..., Client]) -> None:
    srv, app = make(max_in_flight=2, request_timeout_s=5)
    with every_slot_taken(app):
        over = clients(srv)
        over.send(request("POST", "/v1/score", EMPTY_ITEMS) + request("GET", "/openapi.json"))
        status, headers, body = over.response(timeout_s=2.0)
        assert (status, headers["retry-after"]) == (503, "1")
        assert "max_in_flight" in json.loads(body)["error"]
        assert over.closed(within_s=2.0)  # refused from its headers, its body not read: the connection cannot go on
        assert b'streamrec_serving_requests_total{endpoint="/v1/score",status="503"} 1.0' in app.metrics.render()
        expect = clients(srv)  # refused from its headers: no 100 Continue, the body is never sent
        expect.send(request("POST", "/v1/score", headers={"Content-Length": str(len(EMPTY_ITEMS)),
                                                            "Expect": "100-continue"}))
        assert expect.response(timeout_s=2.0)[0] == 503
        probe = clients(srv)  # the probes are never refused
        probe.send(request("GET", "/healthz") + request("GET", "/metrics") + request("GET", "/readyz"))
        assert [probe.response(timeout_s=2.0)[0] for _ in range(3)] == [200, 200, 503]  # (readyz: no model)
        nobody = clients(srv)  # a refused request without a body keeps its connection
        nobody.send(request("GET", "/openapi.json"))
        assert nobody.response(timeout_s=2.0)[0] == 503
    assert app.admitted == 0
    nobody.send(request("GET", "/openapi.json"))  # and within the limit again, the same connection is served
    assert nobody.response(timeout_s=2.0)[0] == 200


def test_slow_uploads_hold_no_in_flight_slot_while_their_body_arrives(make: Make,
                                                                     clients: Callable[..., Client]) -> None:
    """The slot is taken once the body is in: max_in_flight clients trickling bodies do not get every other
    /v1/score a 503 (while /healthz says 200); their reads are bounded by max_connections and the deadline."""
    srv, app = make(max_in_flight=2, request_timeout_s=5)
    half = len(EMPTY_ITEMS) // 2
    slow = [clients(srv) for _ in range(4)]  # twice max_in_flight: headers in, half a body each
    for c in slow:
        c.send(request("POST", "/v1/score", EMPTY_ITEMS)[:-half])
    time.sleep(0.3)
    assert app.admitted == 0
    for _ in range(3):
        other = clients(srv)
        other.send(request("POST", "/v1/score", EMPTY_ITEMS))
        status, _, body = other.response(timeout_s=2.0)
        assert status == 422 and json.loads(body)["error"] == EMPTY_ITEMS_ERROR
    for c in slow:  # the slow ones are served too once their bodies are in
        c.send(EMPTY_ITEMS[-half:])
        status, _, body = c.response(timeout_s=2.0)
        assert status == 422 and json.loads(body)["error"] == EMPTY_ITEMS_ERROR


def test_a_request_refused_after_its_body_is_read_keeps_its_connection(make: Make,
                                                                      clients: Callable[..., Client]) -> None:
    srv, app = make(max_in_flight=2, request_timeout_s=5)
    half = len(EMPTY_ITEMS) // 2
    c = clients(srv)
    c.send(request("POST", "/v1/score", EMPTY_ITEMS)[:-half])  # headers in while a slot is free
    time.sleep(0.2)
    with every_slot_taken(app):  # taken while its body arrives
        c.send(EMPTY_ITEMS[-half:])
        status, headers, body = c.response(timeout_s=2.0)
        assert (status, headers["retry-after"]) == (503, "1") and "max_in_flight" in json.loads(body)["error"]
        assert "connection" not in headers
    c.send(request("POST", "/v1/score", EMPTY_ITEMS))  # the body was read: the same connection goes on
    status, _, body = c.response(timeout_s=2.0)
    assert status == 422 and json.loads(body)["error"] == EMPTY_ITEMS_ERROR


def test_slow_scoring_over_max_in_flight_is_refused_while_probes_answer(tmp_path: Path,
                                                                        clients: Callable[..., Client]) -> None:
    """The threading server scores requests in parallel (a thread each): the limit bounds them. (aiohttp scores
    inline on its one event loop, one at a time: the test above covers its limit.)"""
    ss = ServeSettings(port=0, publish_root=tmp_path, device=Device.CPU, max_in_flight=2)
    holder = ModelHolder()
    app = ScoringApp(ss, holder, ServingMetrics(holder.model), None)
    release, entered = threading.Event(), threading.Semaphore(0)

    def slow(_body: bytes) -> tuple[int, str, bytes]:
        entered.release()
        release.wait(5)
        return 200, "application/json", b'{"slow": true}'

    app._routes[("GET", "/slow")] = slow
    srv = make_server("threading", app, "127.0.0.1", 0)
    srv.start()
    try:
        busy = [clients(srv) for _ in range(2)]
        for c in busy:
            c.send(request("GET", "/slow"))
        assert entered.acquire(timeout=3) and entered.acquire(timeout=3)
        over = clients(srv)
        over.send(request("GET", "/slow"))
        status, headers, _ = over.response(timeout_s=2.0)
        assert (status, headers["retry-after"]) == (503, "1")
        assert healthz(srv, clients)[0] == 200
        release.set()
        assert [c.response(timeout_s=3.0)[0] for c in busy] == [200, 200]
        deadline = time.monotonic() + 2.0  # (a slot is given back just after its answer is written)
        while app.admitted and time.monotonic() < deadline:
            time.sleep(0.01)
        over.send(request("GET", "/slow"))
        assert over.response(timeout_s=3.0)[0] == 200
    finally:
        release.set()
        srv.stop(1.0)


# -- request_timeout_s, keepalive_timeout_s -------------------------------------------------------------------------
def test_a_request_trickled_byte_by_byte_is_answered_408_at_its_deadline(make: Make,
                                                                         clients: Callable[..., Client]) -> None:
    srv, _ = make(request_timeout_s=1.0)
    c = clients(srv)
    data = request("POST", "/v1/score", EMPTY_ITEMS)
    t0 = time.monotonic()
    answered: list[tuple[int, dict[str, str], bytes]] = []
    for i in range(len(data)):  # one byte every 0.1 s: each recv is quick, the request is not
        try:
            c.send(data[i:i + 1])
        except OSError:
            break
        if select.select([c.sock], [], [], 0.1)[0]:  # the server spoke (or closed)
            try:
                answered.append(c.response())
            except (AssertionError, ConnectionResetError):  # closed without an answer: allowed too
                pass
            break
    took = time.monotonic() - t0
    assert 0.8 < took < 2.5, took  # cut off at the deadline, long before the request was complete
    if answered:
        status, headers, body = answered[0]
        assert (status, headers["connection"]) == (408, "close") and "request_timeout_s" in json.loads(body)["error"]
    assert c.closed(within_s=2.0)


def test_a_body_trickled_after_its_headers_is_cut_off_at_the_same_deadline(make: Make,
                                                                          clients: Callable[..., Client]) -> None:
    srv, _ = make(request_timeout_s=1.0)
    c = clients(srv)
    t0 = time.monotonic()
    c.send(request("POST", "/v1/score", headers={"Content-Length": "100"}))
    for _ in range(5):
        time.sleep(0.1)
        c.send(b"x")
    status, headers, body = c.response(timeout_s=3.0)
    assert (status, headers["connection"]) == (408, "close") and 0.8 < time.monotonic() - t0 < 2.5
    assert "request_timeout_s" in json.loads(body)["error"]
    assert c.closed(within_s=2.0)
    assert healthz(srv, clients)[0] == 200


def test_the_deadline_starts_at_the_requests_first_byte_not_at_connect(make: Make,
                                                                      clients: Callable[..., Client]) -> None:
    srv, _ = make(request_timeout_s=0.6, keepalive_timeout_s=3.0)
    c = clients(srv)
    time.sleep(0.4)  # idle, within request_timeout_s (a new connection's wait for its first byte)
    data = request("GET", "/healthz")
    c.send(data[:10])
    time.sleep(0.4)  # 0.8 s from connect, 0.4 s from the request's first byte
    c.send(data[10:])
    assert c.response(timeout_s=2.0)[0] == 200
    time.sleep(0.8)  # between requests on a keep-alive connection the idle wait is keepalive_timeout_s's
    c.send(request("POST", "/v1/score", EMPTY_ITEMS))
    assert c.response(timeout_s=2.0)[0] == 422


def test_a_new_connection_that_sends_nothing_is_closed_after_request_timeout(make: Make,
                                                                            clients: Callable[..., Client]) -> None:
    """Not after keepalive_timeout_s: idle sockets (256 of them, at no bandwidth) would hold every one of
    max_connections for that long. Closed without an answer, as an idle keep-alive connection is."""
    srv, _ = make(request_timeout_s=0.5, keepalive_timeout_s=30.0)
    silent = [clients(srv) for _ in range(3)]
    assert all(c.closed(within_s=3.0) for c in silent)
    assert healthz(srv, clients)[0] == 200


def test_an_empty_line_after_a_request_is_idle_time_not_the_start_of_a_request(
        make: Make, clients: Callable[..., Client]) -> None:
    """A CRLF after a body (RFC 9112 2.2) is skipped: it starts no request, so no request_timeout_s (no 408)."""
    srv, _ = make(request_timeout_s=0.5, keepalive_timeout_s=5.0)
    c = clients(srv)
    c.send(request("POST", "/v1/score", EMPTY_ITEMS) + b"\r\n")
    status, _, body = c.response()
    assert status == 422 and json.loads(body)["error"] == EMPTY_ITEMS_ERROR
    c.send(b"\r\n")  # and one on its own, after the answer
    time.sleep(1.0)  # past request_timeout_s: a request begun by the CRLF would have been answered 408 and closed
    c.send(request("GET", "/healthz"))
    assert c.response(timeout_s=2.0)[0] == 200


def test_an_idle_keep_alive_connection_is_closed_after_keepalive_timeout(make: Make,
                                                                        clients: Callable[..., Client]) -> None:
    srv, _ = make(keepalive_timeout_s=0.5)
    c = clients(srv)
    c.send(request("GET", "/healthz"))
    assert c.response()[0] == 200
    t0 = time.monotonic()
    assert c.closed(within_s=3.0)
    assert 0.3 < time.monotonic() - t0 < 2.5
    silent = clients(srv)  # one that never sends a byte is closed as well
    assert silent.closed(within_s=3.0)


def test_a_client_that_reads_none_of_its_answers_loses_its_connection_after_request_timeout(
        make: Make, clients: Callable[..., Client]) -> None:
    """Pipelined requests whose answers the client never reads: the threading server's send times out; aiohttp
    waited on the drain for ever (a close waits for the flush too), so such a client held one of
    ``max_connections`` for good. With ``max_connections = 1`` the next client is served once it is cut off."""
    srv, _ = make(request_timeout_s=1.0, max_connections=1)
    c = clients(srv)
    c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    c.sock.setblocking(False)
    burst = request("GET", "/metrics") * 50
    cut_off, end = False, time.monotonic() + 30.0  # generous: the deadline is 1 s
    while not cut_off and time.monotonic() < end:
        try:
            c.sock.send(burst)
        except BlockingIOError:
            time.sleep(0.05)
        except OSError:  # reset, broken pipe: the server dropped the connection
            cut_off = True
    assert cut_off, "the connection was still open 30 s after its answers stopped being read"
    served = False
    while not served and time.monotonic() < end + 10.0:
        served = healthz(srv, clients)[0] == 200  # (a 503 while the server has yet to see it gone)
    assert served


# -- chunked bodies -------------------------------------------------------------------------------------------------
def chunked(body: bytes, size: int) -> bytes:
    return b"".join(f"{len(body[i:i + size]):x}\r\n".encode() + body[i:i + size] + b"\r\n"
                    for i in range(0, len(body), size)) + b"0\r\n\r\n"


def test_a_chunked_body_in_too_many_small_chunks_is_refused_and_kib_chunks_are_not(
        make: Make, clients: Callable[..., Client]) -> None:
    """At most 64 + 1 per KiB of max_body_bytes chunks (128 here): a body of the largest size in 1 KiB chunks is
    read; one in 100-byte chunks (~1.7 us of Python CPU per chunk) is a 400 once past the count."""
    srv, _ = make(max_body_bytes=64 << 10)
    body = EMPTY_ITEMS + b" " * ((64 << 10) - len(EMPTY_ITEMS))  # 64 KiB of JSON
    c = clients(srv)
    for size in (1024, 4096, 600):  # 64, 16 and 110 chunks
        c.send(request("POST", "/v1/score", headers={"Transfer-Encoding": "chunked"}) + chunked(body, size))
        status, _, answer = c.response()
        assert status == 422 and json.loads(answer)["error"] == EMPTY_ITEMS_ERROR, (size, answer)
    c.send(request("POST", "/v1/score", headers={"Transfer-Encoding": "chunked"}) + chunked(body, 100))  # 656
    status, headers, answer = c.response()
    assert (status, headers["connection"]) == (400, "close"), answer
    assert json.loads(answer)["error"].startswith("chunked body in more than 128 chunks")
    assert c.closed(within_s=2.0)
    tiny = clients(srv)  # 1-byte chunks: refused past the count however small the body (227 bytes here)
    tiny.send(request("POST", "/v1/score", headers={"Transfer-Encoding": "chunked"}) + chunked(body[:227], 1))
    status, _, answer = tiny.response()
    assert status == 400 and json.loads(answer)["error"].startswith("chunked body in more than 128 chunks")
    healthy = clients(srv)
    healthy.send(request("GET", "/healthz"))
    assert healthy.response()[0] == 200


CHUNKED_HEAD = request("POST", "/v1/score", headers={"Transfer-Encoding": "chunked"})
OVER = {  # name -> the pieces a client sends (a pause between them), declaring a chunked body past 1000 bytes
    "15 hex digits, some data": [CHUNKED_HEAD + b"fffffffffffffff\r\n" + b"x" * 10],
    "16 hex digits": [CHUNKED_HEAD + b"f" * 16 + b"\r\n" + b"x" * 10],
    "8 hex digits, no data": [CHUNKED_HEAD + b"ffffffff\r\n"],
    "leading zeros": [CHUNKED_HEAD + b"0" * 30 + b"3e9;ext=1\r\n" + b"x" * 10],
    "its size line in two reads": [CHUNKED_HEAD + b"fff", b"ffff\r\n"],
    "head and size in two reads": [CHUNKED_HEAD, b"fffffffffffffff\r\nxx"],
    "head split in its blank line": [CHUNKED_HEAD[:-1], b"\nfffffffffffffff\r\n"],
    "second chunk past the rest": [CHUNKED_HEAD + b"3e0\r\n" + b" " * 992 + b"\r\n", b"9\r\nxx"],
    "behind a pipelined request": [request("GET", "/healthz") + CHUNKED_HEAD + b"fffffffffffffff\r\nxx"],
    "behind a chunked request": [CHUNKED_HEAD + chunked(EMPTY_ITEMS, 5) + CHUNKED_HEAD + b"7fffffff\r\n"],
    # (the first body ends exactly at a read's end: its sizes' follower, done, was kept, and the next body unfollowed)
    "behind a chunked request that ended a read": [CHUNKED_HEAD, chunked(EMPTY_ITEMS, 5),
                                                   CHUNKED_HEAD + b"7fffffff\r\n"],
}


@pytest.mark.parametrize("name", list(OVER))
def test_a_chunk_declared_past_max_body_bytes_is_a_413_at_once_not_at_the_deadline(
        make: Make, clients: Callable[..., Client], name: str) -> None:
    """The threading server reads each chunk's size line; aiohttp's parser keeps it to itself and passed the data on
    as it came, so a chunk declared past the limit (``fffffffffffffff``) with little or no data behind it waited out
    ``request_timeout_s`` for a 408. A deadline of 60 s and a client that waits 20: at once means before that."""
    srv, _ = make(request_timeout_s=60.0)
    c = clients(srv, timeout_s=20.0)
    for i, piece in enumerate(OVER[name]):
        if i:
            time.sleep(0.2)
        c.send(piece)
    if name.startswith("behind"):
        assert c.response(timeout_s=20.0)[0] in (200, 422)  # the request before it is answered first
    status, headers, body = c.response(timeout_s=20.0)
    assert (status, headers["connection"]) == (413, "close"), body
    assert json.loads(body)["error"] == "chunked body exceeds 1000 bytes"
    assert c.closed(within_s=20.0)
    good = clients(srv)  # the server goes on: a chunked body in pieces, on a new connection, is read whole
    good.send(CHUNKED_HEAD + b"5\r\n" + EMPTY_ITEMS[:5])
    time.sleep(0.1)
    good.send(b"\r\n" + chunked(EMPTY_ITEMS[5:], 7))
    status, _, body = good.response(timeout_s=20.0)
    assert status == 422 and json.loads(body)["error"] == EMPTY_ITEMS_ERROR


def test_a_read_full_of_head_ends_and_chunk_framing_does_not_stall_the_server(
        make: Make, clients: Callable[..., Client]) -> None:
    """aiohttp finds where an open chunked body starts in a read by trying each place a head can end: a 63 KB body
    of ``2\\r\\n\\r\\n\\r\\n`` repeated, pipelined before a chunked request, made each try read the rest of it
    (~250 s of the event loop; every client waited). Bounded now: another client is answered (generous: 30 s)."""
    srv, _ = make(max_body_bytes=1 << 20, request_timeout_s=2.0)
    framing = b"2\r\n\r\n\r\n" * 9000
    c = clients(srv, timeout_s=30.0)
    c.send(request("POST", "/v1/score", framing) + CHUNKED_HEAD + b"1fffff\r\n" + framing)
    assert healthz(srv, clients, timeout_s=30.0)[0] == 200
    assert c.response(timeout_s=30.0)[0] == 400  # (its body is no JSON)
    assert c.response(timeout_s=30.0)[0] in (408, 413)  # (past the search's budget: bounded by the deadline)


@pytest.mark.parametrize("piece", [1, 5, 4096])
def test_chunked_bodies_of_exactly_max_body_bytes_pipelined_in_any_pieces_are_all_read(
        make: Make, clients: Callable[..., Client], piece: int) -> None:
    """The other side of the 413 above: bodies that declare exactly the limit, in chunks with leading zeros and
    extensions and a trailer, back to back, cut anywhere, are never refused (aiohttp reads their sizes on the wire)."""
    srv, _ = make(max_body_bytes=len(EMPTY_ITEMS), request_timeout_s=60.0)
    body = (b"1\r\n" + EMPTY_ITEMS[:1] + b"\r\n" + b"000a;x=y\r\n" + EMPTY_ITEMS[1:11] + b"\r\n"
            + f"{len(EMPTY_ITEMS) - 11:X}\r\n".encode() + EMPTY_ITEMS[11:] + b"\r\n0\r\nX-Trailer: 1\r\n\r\n")
    wire = ((CHUNKED_HEAD + body) * 3 + request("POST", "/v1/score", EMPTY_ITEMS)
            + CHUNKED_HEAD + chunked(EMPTY_ITEMS, 4))
    c = clients(srv, timeout_s=20.0)
    for i in range(0, len(wire), piece):
        c.send(wire[i:i + piece])
    for _ in range(5):
        status, _, answer = c.response(timeout_s=20.0)
        assert status == 422 and json.loads(answer)["error"] == EMPTY_ITEMS_ERROR, answer
    c.send(CHUNKED_HEAD + chunked(EMPTY_ITEMS + b" ", 4))  # one byte more
    assert c.response(timeout_s=20.0)[0] == 413


# -- lingering close ------------------------------------------------------------------------------------------------
BIG = 5_000_000  # a body far past a socket's buffers: the client is still sending it when the answer comes


def post_big(srv: Server, **headers: str) -> tuple[int, bytes]:
    """A 5 MB ``POST`` sent as ``http.client`` sends it: the whole body before the answer is read."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=20)
    try:
        conn.request("POST", "/v1/score", body=b" " * BIG, headers={"Content-Type": "application/json", **headers})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_a_client_still_sending_a_refused_body_reads_the_413_not_a_reset(make: Make) -> None:
    """Closing with the body unread used to reset the connection: http.client got BrokenPipe (threading) or
    ConnectionReset (aiohttp) instead of the 413. The lingering close drops the rest, so the answer is read."""
    srv, _ = make(max_body_bytes=1000)
    status, body = post_big(srv)
    assert status == 413 and "exceeds 1000" in json.loads(body)["error"]


def test_a_client_still_sending_a_body_refused_over_max_in_flight_reads_the_503(make: Make) -> None:
    srv, app = make(max_body_bytes=8 << 20, max_in_flight=1)
    with every_slot_taken(app):
        status, body = post_big(srv)
    assert status == 503 and "max_in_flight" in json.loads(body)["error"]


def test_a_client_still_sending_a_body_with_bad_framing_reads_the_400(make: Make) -> None:
    """Both Content-Length and Transfer-Encoding: refused by the threading server's framing check, by llhttp on
    aiohttp (aiohttp's error answer, which closed at once, lingers too)."""
    srv, _ = make(max_body_bytes=8 << 20)
    status, body = post_big(srv, **{"Content-Length": str(BIG), "Transfer-Encoding": "chunked"})
    assert status == 400 and "error" in json.loads(body)


def send_until_cut(c: Client, piece: bytes, most: int, pace_s: float = 0.0) -> bool:
    """Send ``piece`` up to ``most`` times; True: the server cut the connection (reset) before that."""
    try:
        for _ in range(most):
            c.send(piece)
            if pace_s:
                time.sleep(pace_s)  # (a trickle's pace, not a wait for an outcome)
    except (ConnectionResetError, BrokenPipeError):
        return True
    return False


def test_a_client_that_keeps_sending_is_cut_at_linger_bytes(make: Make, clients: Callable[..., Client]) -> None:
    """linger_s of an hour: only the byte bound can end the linger; 256 MiB sent without a reset fails the test."""
    srv, _ = make(max_body_bytes=1000, linger_bytes=64 << 10, linger_s=3600)
    c = clients(srv, timeout_s=20.0)
    c.send(request("POST", "/v1/score", headers={"Content-Length": str(10**12)}))
    assert send_until_cut(c, b" " * (64 << 10), most=4096)


def test_a_client_that_trickles_for_ever_is_cut_at_linger_s(make: Make, clients: Callable[..., Client]) -> None:
    """64 bytes every 50 ms, ~38 KB at most: far under linger_bytes (8 MiB), so only the time bound can end it."""
    srv, _ = make(max_body_bytes=1000, linger_s=0.2)
    c = clients(srv, timeout_s=20.0)
    c.send(request("POST", "/v1/score", headers={"Content-Length": str(10**12)}))
    assert send_until_cut(c, b" " * 64, most=600, pace_s=0.05)


def test_a_connection_closed_with_its_request_read_does_not_linger(make: Make, clients: Callable[..., Client]) -> None:
    """Nothing left unread (Connection: close, its body read): closed, not lingered over. A linger half-closes too (the
    client reads EOF either way), but drops what comes next for linger_s (an hour here): a closed socket resets it."""
    srv, _ = make(linger_s=3600)
    c = clients(srv)
    c.send(request("POST", "/v1/score", EMPTY_ITEMS, headers={"Connection": "close"}))
    assert c.response()[0] == 422
    assert c.closed(within_s=10.0)
    assert send_until_cut(c, b" ", most=1000, pace_s=0.01)


# -- stop under load ------------------------------------------------------------------------------------------------
def test_stop_during_a_flood_closes_every_connection_within_its_grace(kind: str, tmp_path: Path,
                                                                    clients: Callable[..., Client]) -> None:
    ss = ServeSettings(port=0, publish_root=tmp_path, device=Device.CPU, max_connections=8, max_body_bytes=1000)
    holder = ModelHolder()
    app = ScoringApp(ss, holder, ServingMetrics(holder.model), None)
    srv = make_server(kind, app, "127.0.0.1", 0)
    srv.start()
    try:
        flood = [clients(srv) for _ in range(12)]  # 8 held (idle, mid-headers, mid-body), 4 refused
        for i, c in enumerate(flood[:8]):
            c.send([b"", b"GET /healthz HTTP/1.1\r\nHo", request("POST", "/v1/score", headers={"Content-Length": "50"})
                    + b"{"][i % 3])
        time.sleep(0.3)
        t0 = time.monotonic()
        srv.stop(grace_s=0.5)
        assert time.monotonic() - t0 < 3.0
        assert all(c.closed(within_s=2.0) for c in flood)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", srv.port), timeout=2).close()
    finally:
        srv.stop(0)


# -- max_active and reuse_port ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("bound", "most"), [(1, 1), (2, 2), (0, None)])
def test_max_active_lets_that_many_requests_into_the_app_at_once(tmp_path: Path, bound: int, most: int | None) -> None:
    """The threading server's ``max_active``: 6 concurrent requests, each held 50 ms inside ``handle``, never more
    than ``max_active`` of them inside at once (and several at once without the bound); every one answered."""
    ss = ServeSettings(port=0, publish_root=tmp_path / "nothing-published", device=Device.CPU, max_active=bound)
    holder = ModelHolder()
    app = ScoringApp(ss, holder, ServingMetrics(holder.model), None)
    inside, peak, lock = [0], [0], threading.Lock()
    real = app.handle

    def held(method: str, path: str, body: bytes) -> Any:
        with lock:
            inside[0] += 1
            peak[0] = max(peak[0], inside[0])
        time.sleep(0.05)
        with lock:
            inside[0] -= 1
        return real(method, path, body)

    app.handle = held  # type: ignore[method-assign]
    srv = make_server("threading", app, "127.0.0.1", 0)
    srv.start()
    statuses: list[int] = []

    def one() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
        conn.request("GET", "/healthz")
        statuses.append(conn.getresponse().status)
        conn.close()

    try:
        threads = [threading.Thread(target=one) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        srv.stop(0.5)
    assert statuses == [200] * 6
    assert peak[0] == most if most is not None else peak[0] > 1, peak[0]


def test_a_negative_max_active_is_refused() -> None:
    from stream.errors import ConfigError

    with pytest.raises(ConfigError, match="max_active must be an integer >= 0"):
        ServeSettings(max_active=-1)


def test_reuse_port_lets_a_second_server_share_the_port_and_both_answer(kind: str, tmp_path: Path) -> None:
    """``reuse_port``: two servers (two serve processes, in production) bind one port; without it the second
    cannot. Each answers the connections the kernel gives it."""
    def app(**settings: Any) -> ScoringApp:
        ss = ServeSettings(port=0, publish_root=tmp_path / "nothing-published", device=Device.CPU, **settings)
        holder = ModelHolder()
        return ScoringApp(ss, holder, ServingMetrics(holder.model), None)

    first = make_server(kind, app(reuse_port=True), "127.0.0.1", 0)
    first.start()
    try:
        with pytest.raises(BindError, match="the port is in use"):
            make_server(kind, app(), "127.0.0.1", first.port)
        second = make_server(kind, app(reuse_port=True), "127.0.0.1", first.port)
        second.start()
        try:
            assert second.port == first.port
            first.stop(0.5)  # the second one alone now answers on the shared port
            conn = http.client.HTTPConnection("127.0.0.1", second.port, timeout=5)
            conn.request("GET", "/healthz")
            assert conn.getresponse().status == 200
            conn.close()
        finally:
            second.stop(0.5)
    finally:
        first.stop(0.5)


def test_an_answered_requests_slot_is_free_when_its_client_sends_the_next(make: Make,
                                                                        clients: Callable[..., Client],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """With max_in_flight = 1, a client that has its answer and sends its next request at once (on another
    connection) is not refused as overloaded by its own answered request: the threading server wrote the answer
    while it still held the slot, so the next request could find it taken (a 503 under load; made certain here by a
    slot released 0.3 s late)."""
    srv, app = make(max_in_flight=1, request_timeout_s=5)
    admission = app.admission

    @contextmanager
    def late_release(path: str) -> Iterator[Any]:
        with admission(path) as refused:
            yield refused
            if refused is None:
                time.sleep(0.3)  # (the slot is still held here)

    monkeypatch.setattr(app, "admission", late_release)
    for _ in range(3):  # each on a connection of its own (a connection's next request waits for its thread anyway)
        c = clients(srv)
        c.send(request("POST", "/v1/score", EMPTY_ITEMS))
        status, _, body = c.response(timeout_s=5.0)
        assert status == 422 and json.loads(body)["error"] == EMPTY_ITEMS_ERROR


# -- refusals in /metrics -------------------------------------------------------------------------------------------
def requests_by_status(app: ScoringApp) -> dict[str, float]:
    """``streamrec_serving_requests_total`` as ``/metrics`` renders it, summed by status over endpoints."""
    out: dict[str, float] = {}
    for line in app.metrics.render().decode().splitlines():
        if line.startswith("streamrec_serving_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            code = labels.split('status="', 1)[1].split('"', 1)[0]
            out[code] = out.get(code, 0.0) + float(value)
    return out


def test_requests_the_server_refuses_itself_are_counted_by_status_in_metrics(
        make: Make, clients: Callable[..., Client]) -> None:
    """A body over ``max_body_bytes`` (413), bad framing (400), a coded body (415), a header block over 64 KiB (431),
    an HTTP version not served (505), a request past its deadline (408), a connection over ``max_connections`` (503):
    answered by the server, never by the app, they were in no metric (``/metrics`` showed no 413 however many
    clients sent too much); now ``streamrec_serving_requests_total`` counts each by its status, as the app's own."""
    srv, app = make(request_timeout_s=1.0)
    pad = {f"X-Pad-{i}": "a" * 7000 for i in range(10)}  # 70 KiB of head, each line within aiohttp's 8190
    refused = [
        (request("POST", "/v1/score", headers={"Content-Length": "5000"}), 413),
        (request("POST", "/v1/score", headers={"Content-Length": "abc"}), 400),
        (request("POST", "/v1/score", EMPTY_ITEMS, {"Content-Encoding": "gzip"}), 415),
        (request("GET", "/healthz", headers=pad), 431),
        (b"GET /healthz HTTP/1.2\r\nHost: x\r\n\r\n", 505),
    ]
    before = requests_by_status(app)
    for data, status in refused:
        c = clients(srv)
        c.send(data)
        assert c.response()[0] == status
        c.close()
    late = clients(srv)
    late.send(request("POST", "/v1/score", headers={"Content-Length": "50"}) + b'{"user_id"')
    assert late.response(timeout_s=5.0)[0] == 408
    late.close()
    after = requests_by_status(app)
    counted = {code: after.get(code, 0.0) - before.get(code, 0.0) for code in ("400", "408", "413", "415", "431",
                                                                              "505")}
    assert counted == {"400": 1.0, "408": 1.0, "413": 1.0, "415": 1.0, "431": 1.0, "505": 1.0}
    full, full_app = make(max_connections=1)  # (a server of its own: no connection above lingers on it)
    held = clients(full)
    held.send(request("GET", "/healthz"))
    assert held.response()[0] == 200  # (its connection is counted in: it was answered)
    assert clients(full).response()[0] == 503
    assert requests_by_status(full_app).get("503") == 1.0

"""``serving/http_server.py``: both servers (``make_server("threading" | "aiohttp", ...)``) on a loopback port,
spoken to over raw sockets and ``http.client``.

HTTP/1.1 keep-alive, ``Content-Length`` framing (a pipelined request right behind a body is the next
request), chunked bodies, a body over ``max_body_bytes`` refused with 413 before it is sent (and the connection
closed at once), malformed or ambiguous framing (a bad or a second ``Content-Length``, ``Content-Length`` with
``Transfer-Encoding``, a bad chunk, a chunked body's line not ending in CRLF, a control character in a header)
answered with a JSON 4xx and the connection closed, with no traceback logged, an HTTP version other than 1.0 and 1.1
a 505 (a malformed one a 400), the ``Allow`` header of a 405, HEAD, OPTIONS, ``Expect: 100-continue``, and a graceful
``stop(grace_s)``: the request in flight finishes, idle keep-alive connections are closed, then new connections
are refused; a server never started stops at once. The app has no model (scores are 503, ``/healthz`` 200):
what is tested is the server, not the scoring. Limits (connections, requests in flight, deadlines) are in
test_http_limits.py.
"""

from __future__ import annotations

import gzip
import http.client
import io
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, cast

import pytest

from learner.config import Device
from serving.app import PROMETHEUS, ScoringApp
from serving.http_server import AiohttpServer, Server, ThreadedServer, make_server
from serving.metrics import ServingMetrics
from serving.settings import ServeSettings
from serving.swap import ModelHolder
from stream.errors import quoted

MAX_BODY = 1000
KINDS = ["threading", "aiohttp"]
EMPTY_ITEMS = b'{"user_id": 1, "items": []}'  # a 422 whose message proves the whole body arrived
EMPTY_ITEMS_ERROR = "field 'items': empty; send at least one candidate"


def new_app(tmp_path: Path, **settings: float) -> ScoringApp:
    ss = ServeSettings(port=0, publish_root=tmp_path / "nothing-published", device=Device.CPU, max_body_bytes=MAX_BODY,
                       **settings)
    holder = ModelHolder()
    return ScoringApp(ss, holder, ServingMetrics(holder.model), None)


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def app(tmp_path: Path) -> ScoringApp:
    return new_app(tmp_path)


@pytest.fixture
def server(kind: str, app: ScoringApp) -> Iterator[Server]:
    srv = make_server(kind, app, "127.0.0.1", 0)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop(2.0)


def request(method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> bytes:
    h = {"Host": "x", **({"Content-Length": str(len(body))} if body else {}), **(headers or {})}
    return (f"{method} {path} HTTP/1.1\r\n".encode() + b"".join(f"{k}: {v}\r\n".encode() for k, v in h.items())
            + b"\r\n" + body)


def read_response(f: BinaryIO, head: bool = False) -> tuple[int, dict[str, str], bytes]:
    """One response from a buffered socket file (several responses can follow each other on it)."""
    status_line = f.readline()
    assert status_line, "the server closed the connection without answering"
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while (line := f.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    body = b"" if head else f.read(int(headers.get("content-length", "0")))
    return status, headers, body


def closed_by_server(sock: socket.socket, f: BinaryIO, within_s: float = 5.0) -> bool:
    sock.settimeout(within_s)
    try:
        return f.read(1) == b""
    except ConnectionResetError:
        return True  # closed with the client's bytes unread: a reset, as good as a close here
    except TimeoutError:
        return False


def connect(srv: Server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.port), timeout=10)


# -- tests --------------------------------------------------------------------------------------------------
def test_make_server_builds_each_kind_on_a_free_port_and_refuses_others(app: ScoringApp) -> None:
    for kind, cls in (("threading", ThreadedServer), ("aiohttp", AiohttpServer)):
        srv = make_server(kind, app, "127.0.0.1", 0)
        srv.start()
        try:
            assert isinstance(srv, cls) and srv.port > 0
            with connect(srv) as s, s.makefile("rb") as f:
                s.sendall(request("GET", "/healthz"))
                assert read_response(f)[0] == 200
        finally:
            srv.stop(0.5)
    with pytest.raises(ValueError, match="server must be threading or aiohttp, got 'tornado'"):
        make_server("tornado", app, "127.0.0.1", 0)


def test_two_requests_share_one_keep_alive_connection(server: Server) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request("GET", "/healthz")
        r = conn.getresponse()
        assert (r.status, json.loads(r.read()), r.version) == (200, {"status": "ok"}, 11)
        sock = conn.sock
        conn.request("POST", "/v1/score", EMPTY_ITEMS, {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 422 and json.loads(r.read())["error"] == EMPTY_ITEMS_ERROR
        assert conn.sock is sock and sock is not None  # the same connection: not closed in between
        conn.request("HEAD", "/healthz")
        r = conn.getresponse()
        assert r.status == 200 and r.getheader("Content-Length") == "15" and r.read() == b""  # no body to HEAD
    finally:
        conn.close()


def test_content_length_frames_the_body_so_the_next_pipelined_request_is_read_after_it(server: Server) -> None:
    with connect(server) as s, s.makefile("rb") as f:
        s.sendall(request("POST", "/v1/score", EMPTY_ITEMS) + request("GET", "/healthz")
                  + request("GET", "/readyz"))
        status, headers, body = read_response(f)
        assert status == 422 and json.loads(body)["error"] == EMPTY_ITEMS_ERROR
        assert headers["content-type"].startswith("application/json") and int(headers["content-length"]) == len(body)
        assert read_response(f)[:1] == (200,)  # the bytes right after the body were the next request
        assert read_response(f)[0] == 503  # no model


def test_a_chunked_body_is_reassembled_and_bounded_by_max_body_bytes(server: Server) -> None:
    chunks = [EMPTY_ITEMS[:5], EMPTY_ITEMS[5:]]
    data = b"".join(f"{len(c):x}\r\n".encode() + c + b"\r\n" for c in chunks) + b"0\r\n\r\n"
    with connect(server) as s, s.makefile("rb") as f:
        s.sendall(request("POST", "/v1/score", headers={"Transfer-Encoding": "chunked"}) + data)
        status, _, body = read_response(f)
        assert status == 422 and json.loads(body)["error"] == EMPTY_ITEMS_ERROR
        s.sendall(request("GET", "/healthz"))
        assert read_response(f)[0] == 200  # the connection goes on after the last chunk
    big = f"{MAX_BODY + 1:x}\r\n".encode() + b"x" * (MAX_BODY + 1) + b"\r\n0\r\n\r\n"
    with connect(server) as s, s.makefile("rb") as f:
        s.sendall(request("POST", "/v1/score", headers={"Transfer-Encoding": "chunked"}) + big)
        status, headers, body = read_response(f)
        assert status == 413 and "exceeds" in json.loads(body)["error"] and headers["connection"] == "close"


def test_a_body_over_max_body_bytes_is_refused_with_413_before_it_is_sent(server: Server) -> None:
    with connect(server) as s, s.makefile("rb") as f:
        t0 = time.monotonic()
        s.sendall(request("POST", "/v1/score", headers={"Content-Length": "50000000"}) + b'{"user_id"')
        status, headers, body = read_response(f)  # answered with 50 MB still unsent: it is not waited for
        assert time.monotonic() - t0 < 5
        assert status == 413 and "exceeds" in json.loads(body)["error"] and str(MAX_BODY) in json.loads(body)["error"]
        assert headers["connection"] == "close"  # the rest of the body is not read as a next request
        assert closed_by_server(s, f, within_s=2.0)  # and closed at once, not after lingering over the rest
    with connect(server) as s, s.makefile("rb") as f:  # and the server goes on serving
        s.sendall(request("GET", "/healthz"))
        assert read_response(f)[0] == 200


@pytest.mark.parametrize("length", ["abc", "-1", "+5", "1_0", " 5x"])
def test_a_malformed_content_length_is_a_400_and_the_connection_is_closed(server: Server, kind: str,
                                                                           length: str) -> None:
    with connect(server) as s, s.makefile("rb") as f:
        s.sendall(request("POST", "/v1/score", headers={"Content-Length": length}) + b"{}{}{}{}{}")
        status, headers, body = read_response(f)
        assert status == 400, body
        assert headers["content-type"] == "application/json"
        if kind == "threading":
            assert json.loads(body)["error"] == f"Content-Length {length.strip()!r} is not a non-negative integer"
        else:  # aiohttp's own parser refuses it before our code runs: its reason, in our JSON
            assert json.loads(body)["error"].startswith("malformed request: ")
        assert closed_by_server(s, f)  # where the next request starts is unknown: nothing more is read
    with connect(server) as s, s.makefile("rb") as f:
        s.sendall(request("GET", "/healthz"))
        assert read_response(f)[0] == 200


def test_conflicting_content_length_headers_are_a_400(server: Server) -> None:
    with connect(server) as s, s.makefile("rb") as f:
        # the first length frames "{}" (a 422 from the app), the second "{}" and a smuggled request after it
        smuggled = request("GET", "/healthz")
        s.sendall(b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                  + f"Content-Length: {2 + len(smuggled)}\r\n\r\n".encode() + b"{}" + smuggled)
        status, headers, body = read_response(f)
        assert status == 400, (status, body)  # which framing was meant is unknown: refused, not guessed
        assert headers["content-type"] == "application/json" and json.loads(body)["error"]
        assert closed_by_server(s, f)  # and the smuggled request is never answered


def quiet(caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]) -> None:
    """Nothing was logged above DEBUG, no traceback: a bad request is not worth the service log's attention."""
    loud = [r for r in caplog.records if r.levelno > logging.DEBUG or r.exc_info]
    assert not loud, [r.getMessage() for r in loud]
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize("zeros", [1, 4300, 6000])
def test_a_content_length_with_leading_zeros_is_its_number_however_many(
        server: Server, zeros: int, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]) -> None:
    """``0...027`` is 27: past 4300 digits Python's int() raises (int_max_str_digits); the value is still valid."""
    with caplog.at_level(logging.DEBUG), connect(server) as s, s.makefile("rb") as f:
        length = "0" * zeros + str(len(EMPTY_ITEMS))
        s.sendall(request("POST", "/v1/score", headers={"Content-Length": length}) + EMPTY_ITEMS
                  + request("GET", "/healthz"))
        status, _, body = read_response(f)
        assert status == 422 and json.loads(body)["error"] == EMPTY_ITEMS_ERROR
        assert read_response(f)[0] == 200  # framed right: the next request starts after the 27 bytes
    quiet(caplog, capfd)


@pytest.mark.parametrize("length", ["9" * 5000, "0" * 3000 + "9" * 3000, "1" + "0" * 40])
def test_an_over_long_content_length_is_refused_as_json_and_closed_with_nothing_logged(
        server: Server, length: str, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]) -> None:
    with caplog.at_level(logging.DEBUG), connect(server) as s, s.makefile("rb") as f:
        s.sendall(request("POST", "/v1/score", headers={"Content-Length": length}) + EMPTY_ITEMS + SMUGGLED)
        status, headers, body = read_response(f)
        assert status in (400, 413), (status, body)  # 413 here; aiohttp's parser says "Content-Length overflow"
        assert headers["content-type"] == "application/json" and json.loads(body)["error"]
        assert closed_by_server(s, f)
    quiet(caplog, capfd)
    with connect(server) as s, s.makefile("rb") as f:
        s.sendall(request("GET", "/healthz"))
        assert read_response(f)[0] == 200


@pytest.mark.parametrize("zeros", [1, 20, 1000])
def test_a_chunk_size_with_leading_zeros_is_its_number(server: Server, zeros: int) -> None:
    chunk = "0" * zeros + f"{len(EMPTY_ITEMS):x}"
    data = f"{chunk}\r\n".encode() + EMPTY_ITEMS + b"\r\n" + b"0" * zeros + b"\r\n\r\n"
    with connect(server) as s, s.makefile("rb") as f:
        s.sendall(request("POST", "/v1/score", headers={"Transfer-Encoding": "chunked"}) + data
                  + request("GET", "/healthz"))
        status, _, body = read_response(f)
        assert status == 422 and json.loads(body)["error"] == EMPTY_ITEMS_ERROR
        assert read_response(f)[0] == 200


def test_an_over_long_chunk_size_is_refused_as_json_and_closed(server: Server) -> None:
    with connect(server) as s, s.makefile("rb") as f:
        s.sendall(request("POST", "/v1/score", headers={"Transfer-Encoding": "chunked"})
                  + b"1" + b"0" * 40 + b"\r\n" + EMPTY_ITEMS)
        status, headers, body = read_response(f)
        assert status in (400, 413), (status, body)
        assert headers["content-type"] == "application/json" and json.loads(body)["error"]
        assert closed_by_server(s, f)


@pytest.mark.parametrize("coding", ["gzip", "deflate", "br", "zstd", "identity, gzip", "x-unknown"])
def test_a_content_coded_body_is_a_415_on_both_servers_and_an_identity_one_is_read(server: Server,
                                                                                  coding: str) -> None:
    """The body is JSON as sent. aiohttp inflated gzip and deflate itself (a gzip body was scored there and a
    "not valid UTF-8" 400 on the threading server) and answered a coding it lacked with a 400 asking the client to
    install Brotli; now both refuse any coding but identity, before the body is read."""
    packed = gzip.compress(EMPTY_ITEMS) if coding == "gzip" else EMPTY_ITEMS
    with connect(server) as s, s.makefile("rb") as f:
        s.sendall(request("POST", "/v1/score", packed, {"Content-Encoding": coding}))
        status, headers, body = read_response(f)
        assert (status, headers["connection"]) == (415, "close"), body
        assert json.loads(body)["error"] == (f"Content-Encoding {coding!r} is not supported: send the JSON body "
                                             "uncompressed")
        assert closed_by_server(s, f)
    with connect(server) as s, s.makefile("rb") as f:  # identity is no coding; a GET has no body to code
        s.sendall(request("POST", "/v1/score", EMPTY_ITEMS, {"Content-Encoding": "identity"})
                  + request("GET", "/healthz", headers={"Content-Encoding": coding}))
        status, _, body = read_response(f)
        assert status == 422 and json.loads(body)["error"] == EMPTY_ITEMS_ERROR
        assert read_response(f)[0] == 200


@pytest.mark.parametrize("count", [1, 3])
def test_requests_sent_before_the_client_shuts_its_side_are_answered_then_the_connection_closes(
        server: Server, count: int) -> None:
    """``printf 'GET /healthz ...' | nc -N``: aiohttp closed the connection on the client's EOF without answering
    the requests that came before it; the threading server answered them."""
    sent = [request("GET", "/healthz"), request("POST", "/v1/score", EMPTY_ITEMS), request("GET", "/healthz")][:count]
    with connect(server) as s, s.makefile("rb") as f:
        s.sendall(b"".join(sent))
        s.shutdown(socket.SHUT_WR)
        answers = [read_response(f) for _ in sent]
        assert [status for status, _, _ in answers] == [200, 422, 200][:count]
        assert closed_by_server(s, f, within_s=20.0)


@pytest.mark.parametrize("cut", [
    request("POST", "/v1/score", EMPTY_ITEMS, {"Content-Length": "500"}),  # fewer bytes than its Content-Length
    b"POST /v1/score HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel",  # a chunk cut short
    b"POST /v1/score HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",  # no last chunk
], ids=["content-length", "chunk", "last-chunk"])
def test_a_body_cut_short_by_the_clients_eof_is_a_400_after_the_answers_before_it(server: Server, cut: bytes) -> None:
    """A client that shuts its side with a body unfinished reads a 400 saying so, after the answer to the request
    pipelined before it; aiohttp closed the connection without a word (the threading server answered 400)."""
    with connect(server) as s, s.makefile("rb") as f:
        s.sendall(request("GET", "/healthz") + cut)
        s.shutdown(socket.SHUT_WR)
        assert read_response(f)[0] == 200
        status, headers, body = read_response(f)
        assert status == 400 and headers["connection"] == "close"
        assert json.loads(body)["error"].startswith("incomplete ")
        assert "before the connection closed" in json.loads(body)["error"]
        assert closed_by_server(s, f)


@pytest.mark.parametrize("cut", [b"GET /healthz HTTP/1.1\r\n", b"GET /healthz HTTP/1.1\r\nHost: x\r\n",
                                 b"GET /healthz HTTP/1.1\r\nHost: exa"], ids=["request-line", "headers", "mid-line"])
def test_a_head_cut_short_by_the_clients_eof_is_a_400_not_served(server: Server, cut: bytes) -> None:
    """A request whose head never ended (no blank line before the client's EOF) is incomplete: a 400 naming it on
    both servers. The threading server served it as if whole (a 200 here), aiohttp closed without a word."""
    with connect(server) as s, s.makefile("rb") as f:
        s.sendall(cut)
        s.shutdown(socket.SHUT_WR)
        status, headers, body = read_response(f)
        assert status == 400 and headers["connection"] == "close"
        assert json.loads(body)["error"].startswith("incomplete request: the connection closed before the blank line")
        assert closed_by_server(s, f)


@pytest.mark.parametrize("cut", [b"GET /healthz HTTP/1.1\r\n", b"GET /healthz HTTP/1.1\r\nHost: exa"],
                         ids=["request-line", "mid-line"])
def test_a_request_sent_whole_before_a_head_cut_short_by_the_eof_is_answered(server: Server, cut: bytes) -> None:
    """A request pipelined in full before a head the client's EOF cut short is answered before the connection
    closes (the threading server then says 400 of the cut one); aiohttp closed at once, the whole request unanswered
    ("the server closed the connection without answering")."""
    with connect(server) as s, s.makefile("rb") as f:
        s.sendall(request("GET", "/healthz") + cut)
        s.shutdown(socket.SHUT_WR)
        assert read_response(f)[0] == 200
        rest = f.read()  # (until the server closes: nothing more than the cut head's 400, if any)
        assert rest == b"" or rest.startswith(b"HTTP/1.1 400 "), rest[:200]


PAD = b"X-Pad: " + b"a" * 7000 + b"\r\n"  # 7009 bytes: a header line within aiohttp's 8190


def test_a_header_block_over_64_kib_is_a_431_and_one_under_it_is_served(server: Server) -> None:
    with connect(server) as s, s.makefile("rb") as f:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + PAD * 9 + b"\r\n")  # 63 KB of header lines
        assert read_response(f)[0] == 200
    with connect(server) as s, s.makefile("rb") as f:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + PAD * 10 + b"\r\n" + SMUGGLED)  # 70 KB
        status, headers, body = read_response(f)
        assert (status, headers["connection"]) == (431, "close"), (status, body)
        assert "header block is over 65536 bytes" in json.loads(body)["error"]
        assert closed_by_server(s, f)


def test_an_unfinished_header_block_past_64_kib_is_a_431_at_once(server: Server) -> None:
    """Not held until request_timeout_s (10 s here; the read below gives up after 5): a client cannot make the
    server hold megabytes of headers per connection."""
    with connect(server) as s, s.makefile("rb") as f:
        try:
            s.sendall(b"POST /v1/score HTTP/1.1\r\nHost: x\r\n" + PAD * 30)  # 210 KB, never the blank line
        except OSError:
            pass  # (the server answered and closed while this was being sent)
        s.settimeout(5.0)
        status, _, body = read_response(f)
        assert status == 431 and "header block" in json.loads(body)["error"]


def test_a_large_body_is_read_as_body_not_counted_as_its_head(kind: str, tmp_path: Path) -> None:
    """The head's 64 KiB bound counts a request's head only: aiohttp's server counted body bytes arriving before
    its handler started as head bytes, and answered a body of more than ~72 KiB with a 431 (or reset the connection)."""
    ss = ServeSettings(port=0, publish_root=tmp_path / "nothing-published", device=Device.CPU, max_body_bytes=1 << 20)
    holder = ModelHolder()
    srv = make_server(kind, ScoringApp(ss, holder, ServingMetrics(holder.model), None), "127.0.0.1", 0)
    srv.start()
    body = b" " * 600_000 + EMPTY_ITEMS  # JSON may start with spaces
    try:
        with connect(srv) as s, s.makefile("rb") as f:
            s.sendall(request("POST", "/v1/score", body))  # the server reads it in pieces
            status, _, out = read_response(f)
            assert (status, json.loads(out)["error"]) == (422, EMPTY_ITEMS_ERROR), (status, out[:200])
            s.sendall(request("GET", "/healthz"))  # and the connection goes on
            assert read_response(f)[0] == 200
    finally:
        srv.stop(2.0)


def test_a_chunked_trailer_over_64_kib_is_a_431(app: ScoringApp) -> None:
    """The threading server reads a trailer as a header block, under the same cap (aiohttp's parser bounds it by
    its own limits: 128 fields of 8190 bytes)."""
    srv = make_server("threading", app, "127.0.0.1", 0)
    srv.start()
    try:
        with connect(srv) as s, s.makefile("rb") as f:
            s.sendall(request("POST", "/v1/score", headers={"Transfer-Encoding": "chunked"})
                      + f"{len(EMPTY_ITEMS):x}\r\n".encode() + EMPTY_ITEMS + b"\r\n0\r\n" + PAD * 10 + b"\r\n")
            status, headers, body = read_response(f)
            assert (status, headers["connection"]) == (431, "close"), (status, body)
            assert json.loads(body)["error"] == "chunked trailer over 65536 bytes"
        with connect(srv) as s, s.makefile("rb") as f:  # a small trailer is read and ignored
            s.sendall(request("POST", "/v1/score", headers={"Transfer-Encoding": "chunked"})
                      + f"{len(EMPTY_ITEMS):x}\r\n".encode() + EMPTY_ITEMS + b"\r\n0\r\n" + PAD * 2 + b"\r\n"
                      + request("GET", "/healthz"))
            assert read_response(f)[0] == 422 and read_response(f)[0] == 200
    finally:
        srv.stop(0.5)


def test_a_405_names_the_allowed_methods_in_the_allow_header(server: Server) -> None:
    with connect(server) as s, s.makefile("rb") as f:
        s.sendall(request("PUT", "/healthz", b"{}") + request("GET", "/v1/score:batch"))
        status, headers, body = read_response(f)
        assert (status, headers["allow"]) == (405, "GET, HEAD, OPTIONS") and "use GET" in json.loads(body)["error"]
        status, headers, _ = read_response(f)
        assert (status, headers["allow"]) == (405, "OPTIONS, POST")


@pytest.mark.parametrize(("method", "target", "status"), [
    ("get", "/healthz", 501), ("post", "/v1/score", 501), ("Get", "/healthz", 501), ("BREW", "/healthz", 501),
    ("BREW", "/nowhere", 501), ("GETX", "/healthz", 501), ("PROPFIND", "/healthz", 501),
    ("PUT", "/healthz", 405), ("DELETE", "/v1/score", 405), ("G@T", "/healthz", 400)])
def test_a_method_is_case_sensitive_an_unknown_one_a_501_and_a_known_one_the_path_lacks_a_405(
        server: Server, method: str, target: str, status: int, caplog: pytest.LogCaptureFixture,
        capfd: pytest.CaptureFixture[str]) -> None:
    """RFC 9110 9.1: methods are case-sensitive (``get`` is not ``GET``); a method the server does not recognise is a
    501 (15.6.2), one it knows that the path does not take a 405 with ``Allow`` (15.5.6), a method that is no token a
    400: the same on both servers. The threading server answered 405 to ``get`` and ``BREW``, aiohttp (llhttp) 400."""
    body = b"{}" if method.lower() in ("post", "put") else b""
    with caplog.at_level(logging.DEBUG, logger="streamrec.serve"), connect(server) as s, s.makefile("rb") as f:
        s.sendall(request(method, target, body))
        got, headers, out = read_response(f)
    assert (got, headers["content-type"]) == (status, "application/json"), out
    error = json.loads(out)["error"]
    if status == 501:
        assert f"{method!r} is not implemented" in error and "case-sensitive" in error and "allow" not in headers
    elif status == 405:
        assert "method not allowed" in error and headers["allow"] in ("GET, HEAD, OPTIONS", "OPTIONS, POST")
    quiet(caplog, capfd)


def test_stop_lets_the_request_in_flight_finish_then_refuses_new_connections(kind: str, app: ScoringApp) -> None:
    started, release_s = threading.Event(), 0.8

    def slow(_body: bytes) -> tuple[int, str, bytes]:
        started.set()
        time.sleep(release_s)
        return 200, "application/json", b'{"slow": true}'

    app._routes[("GET", "/slow")] = slow  # a route that takes a while, inside ScoringApp.handle (in_flight counts)
    srv = make_server(kind, app, "127.0.0.1", 0)
    srv.start()
    got: dict[str, object] = {}

    def client() -> None:
        try:
            with connect(srv) as s, s.makefile("rb") as f:
                s.sendall(request("GET", "/slow", headers={"Connection": "close"}))
                got["response"] = read_response(f)
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            got["error"] = exc

    t = threading.Thread(target=client, name="slow-client")
    t.start()
    try:
        assert started.wait(10), "the slow request never reached the app"
        t0 = time.monotonic()
        srv.stop(grace_s=5.0)
        took = time.monotonic() - t0
    finally:
        t.join(15)
    assert "error" not in got, got
    status, _, body = cast(tuple[int, dict[str, str], bytes], got["response"])
    assert (status, json.loads(body)) == (200, {"slow": True})  # finished, not cut off
    assert took < 5.0  # and stop did not wait out the whole grace once it was done
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", srv.port), timeout=2).close()
    assert app.in_flight == 0


def test_after_stop_an_open_keep_alive_connection_is_not_served(kind: str, app: ScoringApp) -> None:
    srv = make_server(kind, app, "127.0.0.1", 0)
    srv.start()
    s = connect(srv)
    f = s.makefile("rb")
    try:
        s.sendall(request("GET", "/healthz"))
        assert read_response(f)[0] == 200
        srv.stop(1.0)
        try:
            s.sendall(request("GET", "/healthz"))
        except OSError:
            return  # refused: as documented ("stop accepting, let requests in flight finish, close")
        assert closed_by_server(s, f, within_s=2.0), "a request was answered after stop()"
    finally:
        f.close()
        s.close()


SMUGGLED = request("GET", "/healthz")
CHUNKED = b"POST /v1/score HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
AMBIGUOUS = {  # name -> (the request, followed by a request that must not be answered; the status per kind)
    "two equal Content-Length": (b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                                 b"Content-Length: 2\r\n\r\n{}", (400, 400)),
    "a Content-Length list": (b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Length: 2, 2\r\n\r\n{}", (400, 400)),
    "Content-Length and chunked": (b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Length: 7\r\n"
                                   b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", (400, 400)),
    "Transfer-Encoding xchunked": (b"POST /v1/score HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: xchunked\r\n\r\n"
                                   b"2\r\n{}\r\n0\r\n\r\n", (501, 400)),
    "Transfer-Encoding gzip": (b"POST /v1/score HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n{}", (501, 400)),
    "chunk size 0x2": (b"POST /v1/score HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                       b"0x2\r\n{}\r\n0\r\n\r\n", (400, 400)),
    "chunk data without CRLF": (b"POST /v1/score HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                                b"2\r\n{}XX0\r\n\r\n", (400, 400)),
    "space before the colon": (b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Length : 2\r\n\r\n{}", (400, 400)),
    # obsolete line folding (a line starting with whitespace continues the one above, RFC 9112 5.2): refused
    "Transfer-Encoding by obs-fold": (b"POST /v1/score HTTP/1.1\r\nHost: x\r\nTransfer-Encoding:\r\n chunked\r\n\r\n"
                                      b"2\r\n{}\r\n0\r\n\r\n", (400, 400)),
    "Transfer-Encoding folded into Host": (b"POST /v1/score HTTP/1.1\r\nHost: x\r\n Transfer-Encoding: chunked\r\n"
                                           b"Content-Length: 2\r\n\r\n{}", (400, 400)),
    "obs-fold of any header": (b"POST /v1/score HTTP/1.1\r\nHost: x\r\nX-Note: a\r\n\tb\r\nContent-Length: 2\r\n\r\n{}",
                               (400, 400)),
    "a first header line folded": (b"POST /v1/score HTTP/1.1\r\n Transfer-Encoding: chunked\r\nHost: x\r\n"
                                   b"Content-Length: 2\r\n\r\n{}", (400, 400)),
    # every line of a chunked body ends in CRLF (RFC 9112 7.1): a bare LF, or a bare CR, is a 400 on both servers (the
    # threading server took a bare LF, and anything after the size, so a proxy reading it strictly split it elsewhere)
    "chunk-size line ending in a bare LF": (CHUNKED + b"2\n{}\r\n0\r\n\r\n", (400, 400)),
    "last-chunk line ending in a bare LF": (CHUNKED + b"2\r\n{}\r\n0\n\r\n", (400, 400)),
    "chunk extension ending in a bare LF": (CHUNKED + b"2;a=b\n{}\r\n0\r\n\r\n", (400, 400)),
    "chunk data followed by a bare LF": (CHUNKED + b"2\r\n{}\n0\r\n\r\n", (400, 400)),
    "a bare CR in a chunk-size line": (CHUNKED + b"2\r\r\n{}\r\n0\r\n\r\n", (400, 400)),
    "a bare CR in a chunk extension": (CHUNKED + b"2;a\rb\r\n{}\r\n0\r\n\r\n", (400, 400)),
    "a NUL in a chunk extension": (CHUNKED + b"2;\x00\r\n{}\r\n0\r\n\r\n", (400, 400)),
    "whitespace before a chunk size": (CHUNKED + b" 2\r\n{}\r\n0\r\n\r\n", (400, 400)),
    "whitespace after a chunk size": (CHUNKED + b"2 \r\n{}\r\n0\r\n\r\n", (400, 400)),
    "trailer line ending in a bare LF": (CHUNKED + b"2\r\n{}\r\n0\r\nX-A: b\n\r\n", (400, 400)),
    "trailer ending in a bare LF": (CHUNKED + b"2\r\n{}\r\n0\r\n\n", (400, 400)),
    "a NUL in a trailer": (CHUNKED + b"2\r\n{}\r\n0\r\nX-A: a\x00b\r\n\r\n", (400, 400)),
}


@pytest.mark.parametrize("name", list(AMBIGUOUS))
def test_ambiguous_framing_is_refused_as_json_the_connection_closed_and_nothing_logged_loudly(
        server: Server, kind: str, name: str, caplog: pytest.LogCaptureFixture,
        capfd: pytest.CaptureFixture[str]) -> None:
    data, statuses = AMBIGUOUS[name]
    with caplog.at_level(logging.DEBUG), connect(server) as s, s.makefile("rb") as f:
        s.sendall(data + SMUGGLED)
        status, headers, body = read_response(f)
        assert status == statuses[KINDS.index(kind)], (status, body)
        assert headers["content-type"] == "application/json" and json.loads(body)["error"]
        assert closed_by_server(s, f)  # the request behind it is not answered
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not loud, [r.getMessage() for r in loud]  # a bad request is no traceback in the service log
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize("line", [b"2;a=b", b'2;a="b c";d', b"2 ;a", b"2; a = b", b"2\t;a"])
def test_chunk_extensions_are_read_past_on_the_threading_server(app: ScoringApp, line: bytes) -> None:
    """The chunk-size line's grammar (RFC 9112 7.1.1): extensions are tokens, ``=`` a token or a quoted string, with
    optional whitespace around ``;`` and ``=`` (BWS, which a recipient must accept; llhttp refuses it, a 400 on
    aiohttp: a refusal, not a disagreement about where the body ends)."""
    srv = make_server("threading", app, "127.0.0.1", 0)
    srv.start()
    try:
        with connect(srv) as s, s.makefile("rb") as f:
            s.sendall(CHUNKED + line + b"\r\n{}\r\n0;x=1\r\n\r\n" + SMUGGLED)
            status, _, body = read_response(f)
            assert status == 422 and json.loads(body)["error"] == "field 'user_id' is required"
            assert read_response(f)[0] == 200  # the body ended where the chunks said: the next request is read
    finally:
        srv.stop(2.0)


def test_token_and_quoted_chunk_extensions_are_read_past_on_both_servers(server: Server) -> None:
    with connect(server) as s, s.makefile("rb") as f:
        s.sendall(CHUNKED + b'2;a=b;c="d e"\r\n{}\r\n0;x=1\r\n\r\n' + SMUGGLED)
        status, _, body = read_response(f)
        assert status == 422 and json.loads(body)["error"] == "field 'user_id' is required"
        assert read_response(f)[0] == 200


HEADER_CTLS = [b"\x00", b"\x01", b"\x08", b"\x0b", b"\x0c", b"\x1b", b"\x1f", b"\x7f", b"\r"]


@pytest.mark.parametrize("where", ["inside", "first", "last", "alone"])
@pytest.mark.parametrize("ctl", HEADER_CTLS, ids=[repr(c) for c in HEADER_CTLS])
def test_a_control_character_in_a_header_value_is_a_400_and_the_connection_closed(
        server: Server, ctl: bytes, where: str, caplog: pytest.LogCaptureFixture) -> None:
    """RFC 9110 5.5: a field value holds no CR, LF or NUL, and no other control character but HTAB. The threading
    server took them (a NUL in ``Content-Type`` was a 200); a proxy that refuses or cuts there reads another request."""
    value = {"inside": b"a" + ctl + b"b", "first": ctl + b"ab", "last": b"ab" + ctl, "alone": ctl}[where]
    with caplog.at_level(logging.DEBUG), connect(server) as s, s.makefile("rb") as f:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Note: " + value + b"\r\n\r\n" + SMUGGLED)
        status, headers, body = read_response(f)
        assert status == 400, body
        assert headers["content-type"] == "application/json" and json.loads(body)["error"]
        assert closed_by_server(s, f)  # the request behind it is not answered
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not loud, [r.getMessage() for r in loud]


@pytest.mark.parametrize("name", [b"X-\x00Note", b"X-Note\x01", b"\x7fX"])
def test_a_control_character_in_a_header_name_is_a_400_and_the_connection_closed(server: Server, name: bytes) -> None:
    with connect(server) as s, s.makefile("rb") as f:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + name + b": a\r\n\r\n" + SMUGGLED)
        status, headers, body = read_response(f)
        assert status == 400 and headers["content-type"] == "application/json", body
        assert closed_by_server(s, f)


def test_a_tab_and_bytes_past_ascii_in_a_header_value_are_accepted(server: Server) -> None:
    """HTAB and obs-text (0x80-0xff) are field-value characters (RFC 9110 5.5): served, the connection kept."""
    with connect(server) as s, s.makefile("rb") as f:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Note: a\tcaf\xe9\t\r\nX-Tab:\t\r\n\r\n" + SMUGGLED)
        assert [read_response(f)[0] for _ in range(2)] == [200, 200]


@pytest.mark.parametrize("version", ["HTTP/1.2", "HTTP/1.9", "HTTP/0.8", "HTTP/0.9", "HTTP/2.0", "HTTP/3.0", ""])
def test_an_http_version_other_than_1_0_and_1_1_is_a_505_and_the_connection_closed(server: Server,
                                                                                   version: str) -> None:
    """505 HTTP Version Not Supported (RFC 9110 15.6.6), for a well-formed version that is not 1.0 or 1.1, and for a
    request line without one (HTTP/0.9's, whose answer would have no status line). The threading server served 1.x
    and 0.x as 1.1 and 1.0, answered a line without a version by the body alone; llhttp (aiohttp) takes HTTP/2.0 and
    HTTP/0.9 and aiohttp answered them with an ``HTTP/2.0`` or ``HTTP/0.9`` status line."""
    line = f"GET /healthz {version}".rstrip().encode()
    with connect(server) as s, s.makefile("rb") as f:
        s.sendall(line + b"\r\nHost: x\r\n\r\n")  # (alone: llhttp takes a 0.9 or 2.0 request as a close)
        s.settimeout(5)
        raw = f.read()  # up to the server's close
    assert raw.split(b"\r\n", 1)[0].split()[:2] in ([b"HTTP/1.1", b"505"], [b"HTTP/1.0", b"505"]), raw
    _, headers, body = read_response(io.BytesIO(raw))
    assert headers["content-type"] == "application/json"
    assert json.loads(body)["error"].startswith("HTTP version"), body


@pytest.mark.parametrize("version", ["HTTP/01.1", "HTTP/1.01", "HTTP/11.1", "HTTP/1", "HTTP/1.", "http/1.1",
                                     "HTTP/1.1x", "HTTP/1,1", "HTTP/a.1"])
def test_a_malformed_http_version_is_a_400_and_the_connection_closed(server: Server, version: str) -> None:
    """HTTP-version is ``HTTP/`` DIGIT ``.`` DIGIT (RFC 9112 2.3), case-sensitive: anything else is a 400. The
    threading server read ``HTTP/01.1`` and ``HTTP/1.01`` as 1.1 (and answered ``HTTP/11.1`` with a 505)."""
    with connect(server) as s, s.makefile("rb") as f:
        s.sendall(f"GET /healthz {version}\r\nHost: x\r\n\r\n".encode() + SMUGGLED)
        status, headers, body = read_response(f)
        assert status == 400 and headers["content-type"] == "application/json", body
        assert closed_by_server(s, f)


def test_options_is_a_204_naming_the_methods_and_head_is_get_without_a_body(server: Server) -> None:
    with connect(server) as s, s.makefile("rb") as f:
        s.sendall(request("OPTIONS", "/v1/score") + request("OPTIONS", "*") + request("OPTIONS", "/nowhere")
                  + request("HEAD", "/readyz") + request("GET", "/healthz"))
        status, headers, body = read_response(f)
        assert (status, headers["allow"], body) == (204, "OPTIONS, POST", b"") and "content-length" not in headers
        status, headers, _ = read_response(f)
        assert (status, headers["allow"]) == (204, "GET, HEAD, OPTIONS, POST")
        status, _, body = read_response(f)
        assert status == 404 and "no endpoint" in json.loads(body)["error"]
        status, headers, body = read_response(f, head=True)  # no model: 503, a retry is worth it
        assert (status, headers["retry-after"]) == (503, "1") and int(headers["content-length"]) > 0
        assert read_response(f)[:1] == (200,)  # HEAD sent no body: the next answer starts right after its headers


def test_expect_100_continue_is_answered_only_when_the_body_is_wanted(server: Server) -> None:
    with connect(server) as s, s.makefile("rb") as f:
        s.sendall(request("POST", "/v1/score", headers={"Content-Length": str(len(EMPTY_ITEMS)),
                                                         "Expect": "100-continue"}))
        assert read_response(f)[0] == 100  # go on
        s.sendall(EMPTY_ITEMS)
        status, _, body = read_response(f)
        assert status == 422 and json.loads(body)["error"] == EMPTY_ITEMS_ERROR
    with connect(server) as s, s.makefile("rb") as f:
        s.sendall(request("POST", "/v1/score", headers={"Content-Length": str(MAX_BODY + 1),
                                                         "Expect": "100-continue"}))
        assert read_response(f)[0] == 413  # refused from the headers: no 100, the body is never sent


@pytest.mark.parametrize("kind", KINDS)
def test_stop_on_a_server_never_started_returns_at_once_and_frees_the_port(kind: str, app: ScoringApp) -> None:
    srv = make_server(kind, app, "127.0.0.1", 0)
    t0 = time.monotonic()
    srv.stop(5.0)
    srv.stop(5.0)  # a second stop is a no-op
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", srv.port), timeout=2).close()


def test_stop_closes_idle_keep_alive_connections_at_once_whatever_the_grace(kind: str, app: ScoringApp) -> None:
    srv = make_server(kind, app, "127.0.0.1", 0)
    srv.start()
    conns = [connect(srv) for _ in range(3)]
    files = [c.makefile("rb") for c in conns]
    try:
        for c, f in zip(conns, files, strict=True):
            c.sendall(request("GET", "/healthz"))
            assert read_response(f)[0] == 200
        t0 = time.monotonic()
        srv.stop(grace_s=30.0)  # nothing in flight: no reason to wait
        assert time.monotonic() - t0 < 2.0
        assert all(closed_by_server(c, f, within_s=1.0) for c, f in zip(conns, files, strict=True))
    finally:
        for c, f in zip(conns, files, strict=True):
            f.close()
            c.close()
        srv.stop(0)


def test_the_answer_to_a_request_in_flight_at_stop_says_connection_close(kind: str, app: ScoringApp) -> None:
    started = threading.Event()

    def slow(_body: bytes) -> tuple[int, str, bytes]:
        started.set()
        time.sleep(0.5)
        return 200, "application/json", b'{"slow": true}'

    app._routes[("GET", "/slow")] = slow
    srv = make_server(kind, app, "127.0.0.1", 0)
    srv.start()
    got: dict[str, object] = {}

    def client() -> None:
        with connect(srv) as s, s.makefile("rb") as f:
            s.sendall(request("GET", "/slow"))  # keep-alive
            got["response"] = read_response(f)
            got["closed"] = closed_by_server(s, f, within_s=2.0)

    t = threading.Thread(target=client, name="slow-client")
    t.start()
    try:
        assert started.wait(10)
        srv.stop(grace_s=5.0)
    finally:
        t.join(10)
    status, headers, _ = cast(tuple[int, dict[str, str], bytes], got["response"])
    assert (status, headers.get("connection")) == (200, "close") and got["closed"] is True


def _request_started(srv: Server) -> bool:
    """The server has read the first bytes of a request whose head is not complete yet (a partial request line)."""
    if isinstance(srv, ThreadedServer):
        with srv.httpd.lock:
            return any(srv.httpd.conns.values())
    assert isinstance(srv, AiohttpServer) and srv._web is not None
    return any(getattr(c, "deadline", None) is not None for c in list(srv._web.connections))


def test_a_request_whose_head_is_still_arriving_at_stop_is_answered_not_cut_off(kind: str, app: ScoringApp) -> None:
    """SIGTERM's drain: a keep-alive connection on which the next request has begun to arrive (its first bytes read
    by the server, the rest still on the wire) is a request in flight, not an idle connection: stop waits for it and
    answers it (Connection: close). It was shut at once as idle, and the client's request got no answer at all."""
    srv = make_server(kind, app, "127.0.0.1", 0)
    srv.start()
    stopper = threading.Thread(target=srv.stop, args=(10.0,), name="stopper")
    try:
        with connect(srv) as s, s.makefile("rb") as f:
            s.sendall(request("GET", "/healthz"))
            assert read_response(f)[0] == 200  # the connection has served a request: idle between two
            deadline = time.monotonic() + 10
            while _request_started(srv):  # (the server marks the answered request done after the client has it)
                assert time.monotonic() < deadline, "the answered request never ended on the server"
                time.sleep(0.01)
            s.sendall(b"POST /v1/score HTTP/1.1\r\nHost: x\r\n")  # the next one begins
            while not _request_started(srv):
                assert time.monotonic() < deadline, "the server never read the request's first bytes"
                time.sleep(0.01)
            stopper.start()
            while not (srv.httpd.draining if isinstance(srv, ThreadedServer) else cast(AiohttpServer, srv)._draining):
                time.sleep(0.01)  # (until stop has begun: the rest of the request arrives during the drain)
            s.sendall(f"Content-Length: {len(EMPTY_ITEMS)}\r\n\r\n".encode() + EMPTY_ITEMS)
            status, headers, body = read_response(f)
        assert (status, json.loads(body)["error"], headers.get("connection")) == (422, EMPTY_ITEMS_ERROR, "close")
    finally:
        if stopper.is_alive() or stopper.ident is not None:
            stopper.join(15)
        srv.stop(0)


def test_empty_lines_before_a_request_line_are_skipped(server: Server) -> None:
    """RFC 9112 2.2: a server SHOULD ignore at least one empty line before a request line (a client may send a CRLF
    after a body): at the start of a connection and between pipelined requests, CRLF or a bare LF."""
    with connect(server) as s, s.makefile("rb") as f:
        s.sendall(b"\r\n" + request("GET", "/healthz") + request("POST", "/v1/score", EMPTY_ITEMS) + b"\r\n"
                  + request("GET", "/readyz") + b"\n\r\n\r\n" + request("GET", "/healthz"))
        assert [read_response(f)[0] for _ in range(4)] == [200, 422, 503, 200]


def test_many_empty_lines_before_a_request_line_are_skipped_too(server: Server) -> None:
    with connect(server) as s, s.makefile("rb") as f:
        s.sendall(b"\r\n" * 20000 + b"\r" + request("GET", "/healthz"))  # (a bare CR too, as aiohttp's parser)
        assert read_response(f)[0] == 200


def test_the_answer_says_whether_the_connection_stays_open(server: Server) -> None:
    """HTTP/1.0 with Connection: keep-alive is kept open and told so (1.0's default is a close); a close asked for,
    in any case or in a list of options, is closed and said (RFC 9112 9.6)."""
    with connect(server) as s, s.makefile("rb") as f:
        s.sendall(b"GET /healthz HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        status, headers, _ = read_response(f)
        assert (status, headers.get("connection", "").lower()) == (200, "keep-alive")
        s.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")  # the same connection, a 1.0 request without keep-alive
        status, headers, _ = read_response(f)
        assert (status, headers.get("connection", "close")) == (200, "close")
        assert closed_by_server(s, f)
    for value in ("close", "Close", "TE, close"):
        with connect(server) as s, s.makefile("rb") as f:
            s.sendall(request("GET", "/healthz", headers={"Connection": value}))  # (aiohttp's parser answers 400
            status, headers, _ = read_response(f)  # to a request pipelined behind a close: none is sent here)
            assert (status, headers.get("connection")) == (200, "close"), value
            assert closed_by_server(s, f)


@pytest.mark.parametrize(("target", "status", "named"), [
    ("http://x/healthz", 200, None),  # absolute-form, which a server MUST accept (RFC 9112 3.2.2): its path
    ("HTTPS://example.com:8080/healthz?probe=1", 200, None),
    ("http://x", 404, "/"),
    ("//healthz", 404, "//healthz"),  # not normalised to /healthz, and the path named is the one sent
    ("//v1/score", 404, "//v1/score"),
    ("/%68ealthz", 404, "/%68ealthz"),
    ("ftp://x/healthz", 404, "ftp://x/healthz"),
])
def test_both_servers_read_a_request_target_alike(server: Server, target: str, status: int,
                                                  named: str | None) -> None:
    with connect(server) as s, s.makefile("rb") as f:
        s.sendall(request("GET", target))
        got, _, body = read_response(f)
        assert got == status, body
        if named is not None:
            assert json.loads(body)["error"].startswith(f"no endpoint {named}; ")


@pytest.mark.parametrize("target", [b"/h\xc3\xa9", b"/healthz?x=\xff", b"/healthz#\xff", b"/healthz\x7f", b"/h\x01",
                                    b"http://x\xff/healthz"], ids=["utf-8", "query", "fragment", "del", "ctl", "host"])
def test_a_request_target_with_a_byte_outside_visible_ascii_is_a_400_on_both_servers(server: Server,
                                                                                     target: bytes) -> None:
    """A target holds visible ASCII only (RFC 3986: the rest percent-encoded): llhttp refuses any other byte (a 400 on
    aiohttp); the threading server served them (``/healthz?x=\xff``: 200; ``/h\xc3\xa9``: a 404 quoting mojibake)."""
    with connect(server) as s, s.makefile("rb") as f:
        s.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, body = read_response(f)
        assert status == 400, body
        assert json.loads(body)["error"].startswith("malformed request")
        assert closed_by_server(s, f)


@pytest.mark.parametrize(("method", "target"), [
    ("GET", "*"), ("HEAD", "*"), ("POST", "*"), ("OPTIONS", "*?a"), ("OPTIONS", "*x"), ("GET", "*x"),
    ("GET", "healthz"), ("GET", "?a"),
])
def test_a_request_target_of_no_rfc_9112_form_is_a_400_and_the_connection_closed(server: Server, method: str,
                                                                                  target: str) -> None:
    """A target is origin-form (``/path``), absolute-form (``http://host/path``) or, for OPTIONS alone, exactly ``*``
    (RFC 9112 3.2): aiohttp's parser refused the others (400, closed) where the threading server routed them (a 404
    on a kept connection, and ``OPTIONS *?a`` a 204 as if it were ``*``)."""
    with connect(server) as s, s.makefile("rb") as f:
        s.sendall(request(method, target) + SMUGGLED)
        status, headers, _ = read_response(f)  # (a HEAD's too: the request is refused before its method is taken)
        assert (status, headers["content-type"]) == (400, "application/json")
        assert closed_by_server(s, f)


def test_metrics_says_the_prometheus_text_format_version_on_both_servers(server: Server) -> None:
    """``/metrics`` is ``text/plain; version=0.0.4; charset=utf-8`` (the exposition format's content type): aiohttp
    answered ``text/plain; charset=utf-8``, dropping the version, a HEAD and a GET alike."""
    with connect(server) as s, s.makefile("rb") as f:
        s.sendall(request("GET", "/metrics") + request("HEAD", "/metrics"))
        for head in (False, True):
            status, headers, _ = read_response(f, head=head)
            assert (status, headers["content-type"]) == (200, PROMETHEUS)


def test_an_absolute_form_target_reaches_its_endpoint_with_its_body_and_allow_header(server: Server) -> None:
    with connect(server) as s, s.makefile("rb") as f:
        s.sendall(request("POST", "http://x/v1/score", EMPTY_ITEMS) + request("PUT", "http://x/healthz", b"{}"))
        status, _, body = read_response(f)
        assert status == 422 and json.loads(body)["error"] == EMPTY_ITEMS_ERROR
        status, headers, _ = read_response(f)
        assert (status, headers["allow"]) == (405, "GET, HEAD, OPTIONS")


def test_stop_logs_the_connection_threads_still_running_after_its_bounded_join(
        app: ScoringApp, caplog: pytest.LogCaptureFixture) -> None:
    # A request stuck in the app past the grace: stop closes its connection, waits a bounded while for its thread and
    # returns; the thread left behind was not said anywhere.
    started, release = threading.Event(), threading.Event()

    def stuck(_body: bytes) -> tuple[int, str, bytes]:
        started.set()
        release.wait(30)
        return 200, "application/json", b"{}"

    app._routes[("GET", "/stuck")] = stuck
    srv = make_server("threading", app, "127.0.0.1", 0)
    srv.start()
    s = connect(srv)
    try:
        s.sendall(request("GET", "/stuck"))
        assert started.wait(10), "the request never reached the app"
        with caplog.at_level("WARNING", logger="streamrec.serve"):
            srv.stop(grace_s=0.0)
        assert "1 connection thread(s) still running" in caplog.text and "serve-http-conn" in caplog.text
    finally:
        release.set()
        s.close()
        srv.stop()


def test_a_malformed_chunk_size_line_after_a_head_read_earlier_is_a_400_at_once(kind: str, tmp_path: Path) -> None:
    """The chunked request's head in one write, a bad size line (``zz``) in a later one: a 400 at once and the
    connection closed. On aiohttp llhttp's error went to the queue of requests, the body's reader never heard of it and
    the handler waited for the rest of the body until request_timeout_s (a 408). request_timeout_s is 600 s here, the
    client's wait 5 s."""
    app = new_app(tmp_path, request_timeout_s=600.0)
    srv = make_server(kind, app, "127.0.0.1", 0)
    srv.start()
    try:
        with connect(srv) as s, s.makefile("rb") as f:
            s.sendall(CHUNKED)
            deadline = time.monotonic() + 10
            while not _request_started(srv):  # (the head is read: the bad line comes in a read of its own)
                assert time.monotonic() < deadline, "the server never read the request's head"
                time.sleep(0.01)
            s.sendall(b"zz\r\n{}\r\n0\r\n\r\n")
            s.settimeout(5)
            status, headers, body = read_response(f)
            assert status == 400 and headers["content-type"] == "application/json", body
            assert closed_by_server(s, f)
    finally:
        srv.stop(0.5)


BREW = request("BREW", "/healthz")  # a method outside llhttp's list: aiohttp's parser raises on it (the app's 501)


BAD_HEADER = request("GET", "/healthz", headers={"X-Note": "a\x01b"})  # a control character: a 400 on both servers


@pytest.mark.parametrize(("first", "bad"), [(request("GET", "/healthz"), BREW),
                                            (request("POST", "/v1/score", EMPTY_ITEMS), BAD_HEADER)],
                         ids=["get-then-unknown-method", "post-with-body-then-bad-header"])
def test_a_request_pipelined_in_one_write_before_a_refused_one_is_answered_first(server: Server, first: bytes,
                                                                                  bad: bytes) -> None:
    """Both in one ``sendall``: the first is answered (200, or the 422 naming its body), then the refused one (501 for
    the unknown method; 400 for the control character, and the connection closed). aiohttp's
    ``RequestHandler.data_received`` put the parse error of the second in place of every request parsed from the same
    read: the first got no answer, only the error."""
    with connect(server) as s, s.makefile("rb") as f:
        s.sendall(first + bad)
        status, _, body = read_response(f)
        assert status == (200 if first.startswith(b"GET") else 422), body
        status, _, body = read_response(f)
        assert status == (501 if bad is BREW else 400), body
        assert bad is BREW or closed_by_server(s, f)  # (a 501 keeps the connection on the threading server)


def test_a_request_whose_head_end_spans_two_reads_is_answered_before_the_refused_one_behind_it(
        server: Server) -> None:
    """The first request's blank line split across two writes (its last LF opens the second, with the refused request
    behind it): the first is still answered before the 501."""
    first = request("GET", "/healthz")
    with connect(server) as s, s.makefile("rb") as f:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(first[:-1])
        deadline = time.monotonic() + 10
        while not _request_started(server):  # (the server has read the first write)
            assert time.monotonic() < deadline, "the server never read the request's first bytes"
            time.sleep(0.01)
        s.sendall(first[-1:] + BREW)
        assert read_response(f)[0] == 200
        assert read_response(f)[0] == 501


def test_a_405_to_head_names_head_not_get(server: Server) -> None:
    """``HEAD /v1/score`` (a POST-only path): a 405 with the path's Allow whose message names the method sent. Both
    servers handed the app GET for a HEAD, so the message said ``GET /v1/score``, a request the client never sent. A
    HEAD answer has no body: its Content-Length is the message's length, GET's message with HEAD in its place."""
    with connect(server) as s, s.makefile("rb") as f:
        s.sendall(request("HEAD", "/v1/score") + request("GET", "/v1/score"))
        status, head_headers, _ = read_response(f, head=True)
        assert (status, head_headers["allow"]) == (405, "OPTIONS, POST")
        status, headers, body = read_response(f)
        assert (status, headers["allow"]) == (405, "OPTIONS, POST") and body.startswith(b'{"error":"GET /v1/score:')
        assert int(head_headers["content-length"]) == len(body.replace(b'"GET /v1/score', b'"HEAD /v1/score'))


# Bytes Python's str.split() and str.strip() take for whitespace (the wire is read as ISO-8859-1) that HTTP does not
# (RFC 9110 5.6.3: SP and HTAB): FS to US, NEL, NBSP
NOT_HTTP_WHITESPACE = [b"\x1c", b"\x1f", b"\x85", b"\xa0"]


@pytest.mark.parametrize("ws", NOT_HTTP_WHITESPACE)
def test_a_request_line_is_split_on_sp_and_htab_only_so_no_other_byte_ends_its_path(server: Server,
                                                                                     ws: bytes) -> None:
    """``GET /metrics\\xa0 HTTP/1.1`` names the path ``/metrics\\xa0``, which a front proxy that refuses ``/metrics``
    lets through: the threading server split the request line with ``str.split()`` and served it as ``/metrics`` (and
    ``GET /metrics\\x85HTTP/1.1`` too, and ``GET\\x1c/healthz``). It is refused (aiohttp: a 400) or a 404 naming the
    path as sent, never the endpoint."""
    lines = [b"GET /metrics" + ws + b" HTTP/1.1", b"GET /metrics" + ws + b"HTTP/1.1",
             b"GET" + ws + b"/metrics HTTP/1.1"]
    for line in lines:
        with connect(server) as s, s.makefile("rb") as f:
            s.sendall(line + b"\r\nHost: x\r\n\r\n")
            status, headers, body = read_response(f)
            assert status in (400, 404, 505), (line, status, body[:80])
            assert headers["content-type"] == "application/json", line
            if status == 404:
                # the path as sent, quoted (stream.errors.quoted: a character that is not printable as its escape)
                said = json.loads(body)["error"]
                assert said.startswith(f"no endpoint {quoted('/metrics' + ws.decode('latin-1'), 200)};"), line
                assert said.isprintable(), said


@pytest.mark.parametrize("ws", NOT_HTTP_WHITESPACE[2:])  # (FS to US: control characters, refused as such already)
def test_a_transfer_coding_padded_with_bytes_other_than_sp_and_htab_is_not_chunked(server: Server, kind: str,
                                                                                    ws: bytes) -> None:
    """``Transfer-Encoding: chunked\\xa0`` (or ``\\x85chunked``) is no ``chunked`` (RFC 9110 5.6.1: a list's members
    are trimmed of SP and HTAB only): a front proxy that reads it so frames the body otherwise, and the threading
    server, which trimmed it with ``str.strip()``, read a chunked body (a desync). Refused, the connection closed, on
    both servers; on the threading server SP and HTAB around it still make it ``chunked`` (llhttp refuses those)."""
    for value in (b"chunked" + ws, ws + b"chunked"):
        with connect(server) as s, s.makefile("rb") as f:
            s.sendall(CHUNKED.replace(b"chunked", value) + b"2\r\n{}\r\n0\r\n\r\n" + SMUGGLED)
            status, headers, body = read_response(f)
            assert status in (400, 501), (value, status, body[:80])
            assert headers["content-type"] == "application/json"
            assert closed_by_server(s, f), value  # the request behind it is not answered
    if kind != "threading":
        return
    with connect(server) as s, s.makefile("rb") as f:
        s.sendall(CHUNKED.replace(b"chunked", b" \tchunked\t ") + b"2\r\n{}\r\n0\r\n\r\n" + SMUGGLED)
        assert read_response(f)[0] == 422
        assert read_response(f)[0] == 200


@pytest.mark.parametrize("ws", NOT_HTTP_WHITESPACE[2:])
def test_a_content_coding_padded_with_bytes_other_than_sp_and_htab_is_a_415_on_both_servers(server: Server,
                                                                                           ws: bytes) -> None:
    """``Content-Encoding: identity\\xa0`` names no coding this service reads: aiohttp answered 415, the threading
    server (``str.strip()``) took it for ``identity`` and read the body."""
    body = b"{}"
    with connect(server) as s, s.makefile("rb") as f:
        s.sendall(request("POST", "/v1/score", body).replace(b"Host: x\r\n",
                                                             b"Host: x\r\nContent-Encoding: identity" + ws + b"\r\n"))
        assert read_response(f)[0] == 415

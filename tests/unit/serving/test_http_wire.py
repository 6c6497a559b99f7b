"""The threading server's own header parsing and answer writing (serving/http_threaded.py over serving/http_wire.py):
headers read as the stdlib reads them, each answer written in one send; the aiohttp server's reading of chunk sizes on
the wire."""

from __future__ import annotations

import http.client
import io
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import serving.http_aiohttp as http_aiohttp
from serving.http_threaded import _Handler
from serving.http_wire import ChunkSizes, HeadTooLarge, parse_headers

PLAIN = [
    b"Host: 127.0.0.1:8080\r\nContent-Type: application/json\r\nContent-Length: 42\r\n\r\n",
    b"host: x\r\naccept-encoding: identity\r\nX-Empty:\r\nX-Spaces:   padded  \r\nX-Tab:\tv\r\n\r\n",
    b"Content-Length: 1\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n",  # repeats kept, in order
    b"X-Latin: caf\xe9\r\nExpect: 100-continue\n\n",  # bare LF line ends; a latin-1 value
    b"\r\n",  # no headers at all
    b"Host: x\r\n",  # EOF before the blank line
]
ODD = [
    b"Host: x\r\n continued\r\n\r\n",  # obsolete line folding
    b"Content-Length : 5\r\n\r\n",  # whitespace before the colon
    b"no colon here\r\nHost: x\r\n\r\n",
    b"Host: a\rb\r\n\r\n",  # a bare CR inside a value
    b": empty name\r\n\r\n",
    b"Host: x\r\nH\xe9st: y\r\n\r\n",  # a name outside the token characters
    b"Host: x",  # an unterminated last line
]


def _stdlib(block: bytes) -> http.client.HTTPMessage:
    return http.client.parse_headers(io.BytesIO(block))


@pytest.mark.parametrize("block", PLAIN + ODD)
def test_headers_parse_as_the_stdlib_parses_them(block: bytes) -> None:
    ours, theirs = parse_headers(io.BytesIO(block), http.client.HTTPMessage), _stdlib(block)
    assert ours.items() == theirs.items()
    assert list(ours.keys()) == list(theirs.keys())
    assert [type(d) for d in ours.defects] == [type(d) for d in theirs.defects]
    for name in {k.lower() for k in theirs.keys()} | {"content-length", "connection"}:
        assert ours.get_all(name) == theirs.get_all(name)


@pytest.mark.parametrize("block", PLAIN)
def test_plain_header_lines_never_reach_the_email_parser(block: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_a: Any, **_k: Any) -> None:
        raise AssertionError("the email feed parser ran")

    expected = _stdlib(block).items()
    monkeypatch.setattr(http.client, "parse_headers", refuse)
    assert parse_headers(io.BytesIO(block), http.client.HTTPMessage).items() == expected


def test_the_stdlibs_limits_hold() -> None:
    with pytest.raises(http.client.LineTooLong):
        parse_headers(io.BytesIO(b"X: " + b"a" * 70000 + b"\r\n\r\n"), http.client.HTTPMessage)
    with pytest.raises(http.client.HTTPException):
        parse_headers(io.BytesIO(b"X: y\r\n" * 101 + b"\r\n"), http.client.HTTPMessage)


def test_the_whole_header_block_is_capped_at_64_kib() -> None:
    line = b"X: " + b"a" * 6000 + b"\r\n"  # 6005 bytes: each line and the count of lines within the stdlib's limits
    block = line * 10 + b"\r\n"  # 60,052 bytes
    assert len(parse_headers(io.BytesIO(block), http.client.HTTPMessage).get_all("X") or []) == 10
    with pytest.raises(HeadTooLarge, match="header block is over 65536 bytes"):
        parse_headers(io.BytesIO(line * 11 + b"\r\n"), http.client.HTTPMessage)


class _Wire:
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))


def _handler(command: str = "POST", version: str = "HTTP/1.1", draining: bool = False,
             close_connection: bool = False) -> _Handler:
    h = _Handler.__new__(_Handler)  # no socket: only what _send reads
    app = SimpleNamespace(s=SimpleNamespace(request_timeout_s=5.0),
                          headers=lambda m, p, status: {"Retry-After": "1"} if status == 503 else {})
    h.app = app  # type: ignore[assignment]
    h.server = SimpleNamespace(draining=draining)  # type: ignore[assignment]
    h.connection = SimpleNamespace(settimeout=lambda _t: None)  # type: ignore[assignment]
    h.wfile = _Wire()  # type: ignore[assignment]
    h.command, h.path, h.request_version, h.close_connection = command, "/v1/score", version, close_connection
    return h


def _read(raw: bytes, method: str = "POST") -> http.client.HTTPResponse:
    sock = SimpleNamespace(makefile=lambda *_a, **_k: io.BytesIO(raw))
    resp = http.client.HTTPResponse(sock, method=method)  # type: ignore[arg-type]
    resp.begin()
    return resp


def test_an_answer_is_one_write_with_the_stdlibs_headers_and_ours() -> None:
    h = _handler()
    h._send(200, "application/json", b'{"scores": [0.5]}')
    (raw,) = h.wfile.writes  # type: ignore[attr-defined]
    resp = _read(raw)
    assert (resp.status, resp.reason, resp.version) == (200, "OK", 11)
    assert resp.getheader("Content-Type") == "application/json"
    assert resp.getheader("Content-Length") == "17"
    assert resp.getheader("Server", "").startswith("streamrec-serve Python/")
    assert resp.getheader("Date", "").endswith(" GMT")
    assert resp.getheader("Connection") is None and not h.close_connection
    assert resp.read() == b'{"scores": [0.5]}'


def test_close_draining_head_204_and_503_answers_keep_their_framing() -> None:
    h = _handler(draining=True)
    h._send(503, "application/json", b'{"error": "x"}')
    resp = _read(h.wfile.writes[-1])  # type: ignore[attr-defined]
    assert resp.getheader("Connection") == "close" and h.close_connection
    assert resp.getheader("Retry-After") == "1" and resp.read() == b'{"error": "x"}'
    h = _handler(command="HEAD")
    h._send(200, "application/json", b"12345")
    (raw,) = h.wfile.writes  # type: ignore[attr-defined]
    assert raw.endswith(b"\r\n\r\n") and b"Content-Length: 5\r\n" in raw  # the GET's length, no body
    h = _handler(command="OPTIONS")
    h._send(204, "application/json", b"")
    (raw,) = h.wfile.writes  # type: ignore[attr-defined]
    assert raw.startswith(b"HTTP/1.1 204 No Content\r\n")
    assert b"Content-Length" not in raw and b"Content-Type" not in raw


def test_the_connection_header_says_what_happens_to_the_connection() -> None:
    h = _handler(close_connection=True)  # the request said Connection: close
    h._send(200, "application/json", b"{}")
    assert _read(h.wfile.writes[-1]).getheader("Connection") == "close" and h.close_connection  # type: ignore[attr-defined]
    h = _handler(version="HTTP/1.0")  # a 1.0 request with Connection: keep-alive (parse_request left it open)
    h._send(200, "application/json", b"{}")
    assert _read(h.wfile.writes[-1]).getheader("Connection") == "keep-alive" and not h.close_connection  # type: ignore[attr-defined]
    h = _handler(version="HTTP/1.0", close_connection=True)
    h._send(200, "application/json", b"{}")
    assert _read(h.wfile.writes[-1]).getheader("Connection") == "close"  # type: ignore[attr-defined]


@st.composite
def chunked_bodies(draw: st.DrawFn) -> tuple[bytes, int, list[int]]:
    """A chunked body (leading zeros, extensions, a trailer: what llhttp takes), its data's length and the offsets at
    which the wire cuts it into reads."""
    data = draw(st.binary(max_size=300))
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(data) - 1)), max_size=6)) | {len(data)}) if data else []
    zeros = draw(st.sampled_from([0, 1, 70, 1000]))
    ext = draw(st.sampled_from([b"", b";a=b", b";" + b"x" * 100]))
    raw, prev = b"", 0
    for c in cuts:
        raw += b"0" * zeros + f"{c - prev:X}".encode() + ext + b"\r\n" + data[prev:c] + b"\r\n"
        prev = c
    raw += b"0" * zeros + b"0" + ext + b"\r\n" + draw(st.sampled_from([b"", b"X-T: 1\r\n"])) + b"\r\n"
    reads = sorted(draw(st.sets(st.integers(1, len(raw) - 1), max_size=12)))
    return raw, len(data), reads


@settings(max_examples=300, deadline=None)
@given(chunked_bodies())
def test_chunk_sizes_follow_a_body_read_in_any_pieces_to_its_end_and_refuse_one_byte_less(
        body: tuple[bytes, int, list[int]]) -> None:
    raw, size, reads = body
    wire = raw + b"GET /next"  # the next request behind it
    sizes, prev, end = ChunkSizes(size), 0, -1
    for cut in [*reads, len(wire)]:
        at = sizes.feed(wire[prev:cut])
        if at >= 0:
            end = prev + at
            break
        prev = cut
    assert (end, sizes.decoded, sizes.over, sizes.lost) == (len(raw), size, False, False)
    if size:
        tight = ChunkSizes(size - 1)
        tight.feed(wire)
        assert tight.over


@pytest.mark.parametrize("line", [b"-2\r\n", b"2 \r\n", b"\r\n", b"0x2\r\n", b"Host: x\r\n", b"g\r\n"])
def test_a_line_that_is_no_chunk_size_leaves_the_chunk_sizes_lost_not_over(line: bytes) -> None:
    sizes = ChunkSizes(10)
    assert sizes.feed(line + b"ffffffffff\r\n") == -1 and sizes.lost and not sizes.over


def test_an_aiohttp_without_an_internal_the_server_reads_fails_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    """The aiohttp private attributes the server reads are looked for when it is built, not on some request."""
    monkeypatch.setattr(http_aiohttp, "_AIOHTTP_INTERNALS", (*http_aiohttp._AIOHTTP_INTERNALS, "_moved_away"))
    http_aiohttp._aiohttp_protocol.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="RequestHandler lacks _moved_away"):
            http_aiohttp.AiohttpServer(SimpleNamespace(), "127.0.0.1", 0)  # type: ignore[arg-type]
    finally:
        http_aiohttp._aiohttp_protocol.cache_clear()

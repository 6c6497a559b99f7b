"""schemathesis against the scoring service's own OpenAPI document (issue 11, item 9).

The real service (``ScoringService``: stdlib threading server, a real TorchScript artifact of a tiny trained
DeepFM) answers schemathesis's generated requests for every operation of ``/openapi.json``, schema-valid
(positive) and schema-violating (negative) ones. Properties, checked on every response by schemathesis's
checks (``not_a_server_error``, ``status_code_conformance``, ``content_type_conformance``,
``response_schema_conformance``, ``negative_data_rejection``, ``positive_data_acceptance``,
``unsupported_method``, ...) and by this module: no 5xx at all; every 4xx is JSON ``{"error": <non-empty
explanation>}``; every response conforms to the document; a request valid under the document is scored
(200), an invalid one refused (4xx). The document names the live model's features, so "valid" is exact.

The schema is built with ``schemathesis.openapi.from_dict`` from the same function and model features the
service uses, and :func:`test_the_fuzzed_document_is_the_served_one` checks that the service serves exactly
that document: ``schemathesis.pytest.from_fixture`` (loading it from the running service) does not work
with pytest 9.2 (it sets ``request.node._nodeid``, which pytest 9 no longer has).

HTTP framing that schemathesis does not generate (any method, a bad ``Content-Length``, chunked bodies,
a malformed request line, arbitrary body bytes) is fuzzed below too, on both servers.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import APIOperation, Case, GenerationMode

from serving.features import FeatureEncoder
from serving.request import openapi
from serving.service import ScoringService
from serving.settings import ServeSettings
from tests.integration.test_http_server import read_response
from tests.integration.test_serving import CFG, TinyLearner, publish_version

MAX_CANDIDATES, MAX_BATCH, MAX_BODY = 20, 4, 4 << 20  # the default body limit
# per operation (valid and invalid requests together; STREAMREC_FUZZ_EXAMPLES=2000 for a long run)
EXAMPLES = int(os.environ.get("STREAMREC_FUZZ_EXAMPLES", "250"))
_ENC = FeatureEncoder(SimpleNamespace(feature_config=CFG))  # the features the artifact below has
DOCUMENT = openapi(MAX_CANDIDATES, MAX_BATCH, "0", _ENC.context_names, _ENC.dense_names)

schema = schemathesis.openapi.from_dict(DOCUMENT)
# One test per operation, each with its own node id: `schema.parametrize()` (schemathesis 4.32) gave every operation
# the same node id, and pytest-xdist then ran one of the six (~150 fuzzed requests instead of ~1000).
OPERATIONS = [result.ok() for result in schema.get_all_operations()]
# Requests the generated tests below sent to `service` in this process: under pytest-xdist the module's tests may be
# spread over processes, each with its own module-scoped service, so the tally at the end checks this process's share.
SENT = {"fuzzed": 0}


def _settings(kind: str) -> ServeSettings:
    return ServeSettings(port=0, publish_root=Path(), poll_s=3600, max_candidates=MAX_CANDIDATES, max_batch=MAX_BATCH,
                         max_body_bytes=MAX_BODY, server=kind)


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fuzz") / "serving"
    publish_version(TinyLearner(seed=21), root, "v001")
    return root


@pytest.fixture(scope="module")
def service(published: Path) -> Iterator[ScoringService]:
    ss = _settings("threading")
    with ScoringService(ServeSettings(**{**ss.__dict__, "publish_root": published}), None) as svc:
        yield svc


@pytest.fixture(scope="module", params=["threading", "aiohttp"])
def any_server(request: pytest.FixtureRequest, published: Path) -> Iterator[ScoringService]:
    ss = _settings(request.param)
    with ScoringService(ServeSettings(**{**ss.__dict__, "publish_root": published}), None) as svc:
        yield svc


def test_the_fuzzed_document_is_the_served_one(service: ScoringService) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", service.port, timeout=10)
    conn.request("GET", "/openapi.json")
    r = conn.getresponse()
    assert r.status == 200 and json.loads(r.read()) == json.loads(json.dumps(DOCUMENT))
    props = DOCUMENT["components"]["schemas"]["ScoreRequest"]["properties"]
    assert set(props["context"]["properties"]) == {"device", "genres", "year"} and \
        props["context"]["additionalProperties"] is False and set(props["dense"]["properties"]) == {"price"}


def _check_error_body(status: int, body: bytes) -> None:
    if 400 <= status < 500:
        doc = json.loads(body)
        assert isinstance(doc, dict) and isinstance(doc.get("error"), str) and doc["error"].strip(), body[:300]


def _cases(operation: APIOperation) -> st.SearchStrategy[Case]:
    """Valid requests, and invalid ones where the operation takes input (a GET without parameters has none)."""
    valid = operation.as_strategy(generation_mode=GenerationMode.POSITIVE)
    return st.one_of(valid, operation.as_strategy(generation_mode=GenerationMode.NEGATIVE)) if list(operation.body) \
        else valid


@pytest.mark.parametrize("operation", OPERATIONS, ids=[op.label for op in OPERATIONS])
def test_generated_requests_get_no_5xx_and_conforming_answers(operation: APIOperation,
                                                               service: ScoringService) -> None:
    sent = SENT["fuzzed"]

    @given(case=_cases(operation))
    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def one(case: Case) -> None:
        SENT["fuzzed"] += 1
        response = case.call_and_validate(base_url=service.url)
        assert response.status_code < 500, (response.status_code, response.content[:300])
        _check_error_body(response.status_code, response.content)

    one()
    # An operation that takes a body is fuzzed with many requests (hypothesis ends early only on an exhausted
    # strategy: a GET without parameters has one request).
    assert SENT["fuzzed"] - sent >= (min(EXAMPLES, 100) if list(operation.body) else 1), SENT["fuzzed"] - sent


# -- framing that schemathesis does not generate -----------------------------------------------------------
def _raw(port: int, data: bytes, timeout_s: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """Send raw bytes, read one HTTP response (status, headers, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(data)
        resp = http.client.HTTPResponse(s, method="HEAD" if data.startswith(b"HEAD ") else "GET")
        resp.begin()
        body = resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, body


SCORE = json.dumps({"user_id": 1, "items": [1, 2]}).encode()


def _request(method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> bytes:
    h = {"Host": "x", **({"Content-Length": str(len(body))} if body else {}), **(headers or {})}
    return f"{method} {path} HTTP/1.1\r\n".encode() + b"".join(f"{k}: {v}\r\n".encode() for k, v in h.items()) + \
        b"\r\n" + body


def _chunked(body: bytes) -> bytes:
    half = len(body) // 2
    parts = [body[:half], body[half:]]
    return b"".join(f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in parts) + b"0\r\n\r\n"


FRAMING = [
    ("TRACE /v1/score", _request("TRACE", "/v1/score"), 405, "method not allowed"),
    ("PATCH /readyz", _request("PATCH", "/readyz", b"{}"), 405, "method not allowed"),
    ("PUT /openapi.json", _request("PUT", "/openapi.json", b"{}"), 405, "method not allowed"),
    ("BREW /v1/score", _request("BREW", "/v1/score", SCORE), 501, "is not implemented"),
    ("DELETE /nowhere", _request("DELETE", "/nowhere"), 404, "no endpoint"),
    ("Content-Length abc", _request("POST", "/v1/score", b"", {"Content-Length": "abc"}), 400, "Content-Length"),
    ("Content-Length -1", _request("POST", "/v1/score", b"", {"Content-Length": "-1"}), 400, "Content-Length"),
    ("Content-Length +5", _request("POST", "/v1/score", b"", {"Content-Length": "+5"}) + b"{}{}{", 400,
     "Content-Length"),
    ("Content-Length too large", _request("POST", "/v1/score", b"", {"Content-Length": str(MAX_BODY + 1)}), 413,
     "exceeds"),
    ("bad chunk size", _request("POST", "/v1/score", b"", {"Transfer-Encoding": "chunked"}) + b"zz\r\n", 400,
     "chunk"),
    ("chunked too large", _request("POST", "/v1/score", b"", {"Transfer-Encoding": "chunked"})
     + f"{MAX_BODY + 1:x}\r\n".encode(), 413, "exceeds"),
    ("empty body", _request("POST", "/v1/score"), 400, "empty body"),
]


@pytest.mark.parametrize("name", [n for n, *_ in FRAMING])
def test_http_framing_errors_are_json_4xx_and_the_server_keeps_serving(any_server: ScoringService,
                                                                        name: str) -> None:
    _, data, status, words = next(c for c in FRAMING if c[0] == name)
    aiohttp_parser = ("Content-Length abc", "Content-Length -1", "Content-Length +5", "bad chunk size")
    if any_server.s.server == "aiohttp" and name in aiohttp_parser:
        got, _, body = _raw(any_server.port, data)
        assert 400 <= got < 500, (got, body[:300])  # aiohttp's own parser refuses these (text, not our JSON)
    else:
        got, headers, body = _raw(any_server.port, data)
        assert got == status, (got, body[:300])
        assert headers["content-type"].startswith("application/json")
        doc = json.loads(body)
        assert words.lower() in doc["error"].lower(), doc
        if got == 405:
            assert "POST" in headers["allow"] or "GET" in headers["allow"]
    # and the next request on a fresh connection is served
    got, _, body = _raw(any_server.port, _request("POST", "/v1/score", SCORE))
    assert got == 200 and len(json.loads(body)["scores"]) == 2


def test_chunked_bodies_and_head_are_served(any_server: ScoringService) -> None:
    got, _, body = _raw(any_server.port, _request("POST", "/v1/score", b"", {"Transfer-Encoding": "chunked"})
                        + _chunked(SCORE))
    assert got == 200 and len(json.loads(body)["scores"]) == 2
    got, headers, body = _raw(any_server.port, _request("HEAD", "/readyz"))
    assert got == 200 and body == b""


@pytest.mark.parametrize("piece", [1, 7, 97, 1 << 20])
def test_pipelined_requests_sent_in_any_pieces_are_scored_as_each_alone(any_server: ScoringService,
                                                                         piece: int) -> None:
    """Content-Length and chunked requests back to back on one connection, the bytes cut into pieces of ``piece``
    (aiohttp follows each open chunked body's sizes on the wire: it must never misread one), then a bad one: each is
    answered in order with the scores it gets alone, and the server goes on."""
    bodies = [json.dumps({"user_id": u, "items": [u, u + 1, 7]}).encode() for u in range(12)]
    alone = [_raw(any_server.port, _request("POST", "/v1/score", b))[2] for b in bodies]
    chunked = _request("POST", "/v1/score", b"", {"Transfer-Encoding": "chunked"})
    wire = b"".join(chunked + _chunked(b) if i % 2 else _request("POST", "/v1/score", b) for i, b in enumerate(bodies))
    with socket.create_connection(("127.0.0.1", any_server.port), timeout=10) as s, s.makefile("rb") as f:
        for i in range(0, len(wire), piece):
            s.sendall(wire[i:i + piece])
        answers = [read_response(f) for _ in alone]
    assert [(status, json.loads(body)) for status, _, body in answers] == [(200, json.loads(a)) for a in alone]
    assert _raw(any_server.port, chunked + b"fffffffffffffff\r\n")[0] == 413  # past the limit: at once
    assert [json.loads(_raw(any_server.port, _request("POST", "/v1/score", b))[2]) for b in bodies[:2]] == \
        [json.loads(a) for a in alone[:2]]


def test_a_malformed_request_line_is_a_json_400(service: ScoringService) -> None:
    got, headers, body = _raw(service.port, b"GARBAGE\r\n\r\n")
    assert got == 400 and json.loads(body)["error"]


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(body=st.one_of(st.binary(max_size=300), st.text(max_size=200).map(str.encode),
                      st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                                   lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c,
                                                                                       max_size=4),
                                   max_leaves=20).map(lambda v: json.dumps(v).encode())),
       path=st.sampled_from(["/v1/score", "/v1/score:batch"]))
def test_any_body_bytes_are_scored_or_refused_with_a_reason(service: ScoringService, body: bytes, path: str) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", service.port, timeout=10)
    try:
        SENT["fuzzed"] += 1
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        out = r.read()
    finally:
        conn.close()
    assert r.status in (200, 400, 413, 422), (r.status, out[:300])
    _check_error_body(r.status, out)


def test_no_request_of_this_module_was_a_5xx(service: ScoringService) -> None:
    """The tally, from the service's own metrics (every request above went through it)."""
    by_status: dict[str, float] = {}
    for metric in service.metrics.registry.collect():
        for sample in metric.samples:
            if sample.name == "streamrec_serving_requests_total":
                by_status[sample.labels["status"]] = by_status.get(sample.labels["status"], 0) + sample.value
    print(f"\nfuzzed requests by status: {dict(sorted(by_status.items()))}; sent by the generated tests: {SENT}")
    assert sum(by_status.values()) >= SENT["fuzzed"], (SENT, by_status)  # every request sent here was counted
    assert not any(s.startswith("5") for s in by_status), by_status

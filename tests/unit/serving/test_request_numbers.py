"""Integers in a scoring request are read as written, as the event decoders read them (``stream.events``): an integer
literal outside int64 is a 422 wherever an integer is allowed (ids, context values), the 422 showing it as written;
``dense`` keeps it exact. orjson reads an integer literal past 2**64 - 1 as a float, so serving accepted a context
value of 2**64 or -(2**63)-1 (as a float) that the joiner rejects, and showed a rejected one as 1.8446744073709552e+19.

Routes are called without a model: a request that parses is a 503 (no model yet), one refused a 422."""

from __future__ import annotations

from pathlib import Path

import pytest

from serving.request import read_request
from stream.errors import ValidationError
from stream.events import decode_impression
from tests.unit.serving.test_app import call, make_app

PAST_INT64 = [2**63, -(2**63) - 1, 2**64, -(2**64), 10**30]
# (the field the 422 names, a request body with X where the literal goes)
PLACES = [("user_id", b'{"user_id":X,"items":[1]}'),
          ("items[1]", b'{"user_id":1,"items":[1,X]}'),
          ("items[1].item_id", b'{"user_id":1,"items":[1,{"item_id":X}]}'),
          ("context.a", b'{"user_id":1,"items":[1],"context":{"a":X}}'),
          ("context.a", b'{"user_id":1,"items":[1],"context":{"a":[1,X]}}'),
          ("items[0].context.a", b'{"user_id":1,"items":[{"item_id":1,"context":{"a":X}}]}')]


@pytest.mark.parametrize("literal", PAST_INT64)
@pytest.mark.parametrize(("field", "body"), PLACES)
def test_an_integer_literal_past_int64_is_a_422_shown_as_written_on_both_routes(tmp_path: Path, literal: int,
                                                                                 field: str, body: bytes) -> None:
    app = make_app(tmp_path)
    body = body.replace(b"X", str(literal).encode())
    for path, raw, where in (("/v1/score", body, ""), ("/v1/score:batch", b'{"requests":[' + body + b"]}",
                                                      "requests[0].")):
        got, _, out = call(app, "POST", path, raw)
        assert got == 422, (path, body, out)
        assert f"'{where}{field}'" in out["error"] and str(literal) in out["error"] and "e+" not in out["error"], out


@pytest.mark.parametrize("literal", ["9223372036854775807", "-9223372036854775808", "9223372036854775808",
                                     "-9223372036854775809", "18446744073709551615", "18446744073709551616",
                                     "-18446744073709551616", "1e19", "-1e19", "1.8446744073709552e+19", "2.5"])
@pytest.mark.parametrize("value", ["X", "[1,X]"])
def test_serving_accepts_a_context_value_exactly_when_the_joiner_does(tmp_path: Path, literal: str,
                                                                       value: str) -> None:
    context = b'"context":{"a":' + value.replace("X", literal).encode() + b"}"
    try:
        decode_impression(b'{"schema_version":1,"impression_id":"i","ts":5,"user_id":1,"item_id":2,' + context + b"}")
        joiner = 503  # accepted: no model to score it
    except ValidationError:
        joiner = 422
    for path, raw in (("/v1/score", b'{"user_id":1,"items":[2],' + context + b"}"),
                      ("/v1/score:batch", b'{"requests":[{"user_id":1,"items":[2],' + context + b"}]}")):
        got, _, out = call(make_app(tmp_path), "POST", path, raw)
        assert got == joiner, (path, raw, out)


def test_a_request_keeps_a_dense_integer_literal_past_int64_exact_and_a_float_literal_a_float() -> None:
    req = read_request(b'{"user_id":1,"items":[{"item_id":2,"dense":{"p":-9223372036854775809}}],'
                       b'"dense":{"q":18446742974197923840},"context":{"a":1e19,"b":-9223372036854775808}}', 100)
    assert req.item_dense == [{"p": -(2**63) - 1}] and type(req.item_dense[0]["p"]) is int
    assert req.dense == {"q": 2**64 - 2**40} and req.context == {"a": 1e19, "b": -(2**63)}
    assert type(req.context["a"]) is float

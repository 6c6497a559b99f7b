"""stream/event_batch.py: a block of messages decodes exactly as the per-event decoders decode each one."""

from __future__ import annotations

import dataclasses
import time

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

import stream.event_batch as event_batch
from stream.errors import BadMessage
from stream.event_batch import decode_events
from stream.events import Click, Impression, decode_click, decode_impression
from stream.limits import DEFAULT_LIMITS, EventLimits
from tests.integration.test_fuzz_inputs import broker_ts_st, fuzz, json_texts, limits_st


def one_by_one(values: list, brokers: list, clicks: bool, limits: EventLimits) -> list:
    decode = decode_click if clicks else decode_impression
    out = []
    for raw, broker in zip(values, brokers, strict=True):
        try:
            out.append(decode(raw, limits, broker))
        except BadMessage as exc:
            out.append(exc)
    return out


def same(got: list, want: list) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if isinstance(w, BadMessage):
            assert isinstance(g, BadMessage), (i, g, w)
            assert (type(g), g.kind, str(g)) == (type(w), w.kind, str(w)), i
        else:
            assert type(g) is type(w) and g == w, (i, g, w)


def imp(i: int, **extra: object) -> bytes:
    return orjson.dumps({"schema_version": 1, "impression_id": f"i{i}", "ts": 1_000 + i, "user_id": i % 7,
                         "item_id": f"item{i % 5}", "context": {"device": "ios", "hour": i % 24, "tags": [1, i % 3]},
                         **extra})


@given(st.lists(st.tuples(st.one_of(json_texts, st.none()), broker_ts_st), max_size=40), limits_st, st.booleans())
@fuzz(300)
def test_a_block_of_any_messages_decodes_like_each_message_alone(rows: list, limits: EventLimits, clicks: bool
                                                                 ) -> None:
    values, brokers = [r for r, _ in rows], [b for _, b in rows]
    same(decode_events(values, brokers, clicks, limits), one_by_one(values, brokers, clicks, limits))


@pytest.mark.parametrize("bad", [
    b"{not json", None, b"[1]", b'{"schema_version":1,"impression_id":"x","ts":5,"user_id":-1,"item_id":2}',
    b'{"schema_version":1,"impression_id":"x","ts":5,"user_id":1,"item_id":2,"item_id":3}',
    b'{"schema_version":1,"impression_id":"x","ts":5,"user_id":1,"item_id":2,"dense":{"p":1e39}}',
    b'{"schema_version":1,"impression_id":"x","ts":5,"user_id":1,"item_id":2,"context":{"a":{"b":1}}}',
    b'{"schema_version":1.0,"impression_id":"x","ts":5,"user_id":1,"item_id":2}',  # accepted by the rules
    b'{"schema_version":1,"impression_id":"x:y","ts":5,"user_id":"a:b","item_id":2}',  # colons, no duplicate
    b'{"schema_version":1,"impression_id":"x","ts":5,"user_id":1,"item_id":2,"context":{"":1}}',
    b'{"schema_version":1,"impression_id":"x","ts":5,"user_id":1,"item_id":2,"dense":{"' + b"k" * 65 + b'":1}}',
    # integer literals past int64 (orjson reads those beyond 64 bits unsigned as floats) and float literals as large
    *(b'{"schema_version":1,"impression_id":"x","ts":5,"user_id":1,"item_id":2,' + field + b"}" for field in (
        b'"context":{"a":-9223372036854775809}', b'"context":{"a":18446744073709551616}',
        b'"context":{"a":9223372036854775808}', b'"context":{"a":[1,18446744073709551616]}',
        b'"context":{"a":1e19}', b'"dense":{"p":-9223372036854775809}', b'"dense":{"p":18446744073709551616}',
        b'"dense":{"p":1e19}')),
    b'{"schema_version":1,"impression_id":"x","ts":5,"user_id":18446744073709551616,"item_id":2}',
    b'{"schema_version":1,"impression_id":"x","ts":5,"user_id":1,"item_id":-9223372036854775809}',
    b'{"schema_version":1,"impression_id":"x","ts":18446744073709551616,"user_id":1,"item_id":2}',
    b'{"schema_version":18446744073709551616,"impression_id":"x","ts":5,"user_id":1,"item_id":2}',
])
def test_one_bad_row_among_many_good_ones_gets_its_own_verdict_and_the_rest_decode(bad: bytes | None) -> None:
    values = [imp(i) for i in range(300)]
    values[137] = bad
    brokers = [None] * 300
    got = decode_events(values, brokers, False, DEFAULT_LIMITS)
    same(got, one_by_one(values, brokers, False, DEFAULT_LIMITS))
    assert sum(isinstance(g, Impression) for g in got) >= 299


@pytest.mark.parametrize("context", [
    {"device": "x" * 257, "hour": 1, "tags": [1]}, {"device": "ios", "hour": 2**63, "tags": [1]},
    {"device": "ios", "hour": None, "tags": [1]}, {"device": "ios", "hour": 1, "tags": list(range(1025))},
    {"device": "ios", "hour": 1, "tags": ["t" * 257]}, {"device": "ios", "hour": 1, "tags": [1.5]},
    {"device": "ios", "hour": 1, "tags": [[1]]}, {"device": ["x" * 257], "hour": 1, "tags": [1]},
    # accepted by the rules, of another type than the rest of their column
    {"device": 7, "hour": 1.5, "tags": "a"}, {"device": True, "hour": "h", "tags": [1, "b"]},
    {"device": "", "hour": -(2**63), "tags": []},
])
def test_a_context_value_of_the_same_keys_as_every_other_row_gets_its_own_verdict(context: dict) -> None:
    # every row's context has the same keys, so the block's contexts are checked column by column
    values = [imp(i) for i in range(300)]
    values[137] = imp(137, context=context)
    got = decode_events(values, [None] * 300, False, DEFAULT_LIMITS)
    same(got, one_by_one(values, [None] * 300, False, DEFAULT_LIMITS))
    assert sum(isinstance(g, Impression) for g in got) >= 299


@pytest.mark.parametrize("literal", [b"-9223372036854775809", b"18446744073709551616", b"1e19",
                                     b"[18446744073709551616]"])
def test_a_context_literal_past_int64_in_a_column_gets_the_per_event_verdict(literal: bytes) -> None:
    values = [imp(i) for i in range(300)]
    values[137] = imp(137, context={"device": "ios", "hour": "X", "tags": [1]}).replace(b'"X"', literal)
    got = decode_events(values, [None] * 300, False, DEFAULT_LIMITS)
    same(got, one_by_one(values, [None] * 300, False, DEFAULT_LIMITS))
    assert sum(isinstance(g, Impression) for g in got) >= 299


def test_a_clean_block_never_takes_the_per_event_decoder(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object) -> None:
        raise AssertionError("decoded row by row")

    values = [imp(i, dense={"price": 1.5}) for i in range(500)]
    clicks = [orjson.dumps({"schema_version": 1, "impression_id": f"i{i}", "ts": 2_000 + i}) for i in range(500)]
    want = one_by_one(values, [None] * 500, False, DEFAULT_LIMITS)
    monkeypatch.setattr(event_batch, "decode_impression", refuse)
    monkeypatch.setattr(event_batch, "decode_click", refuse)
    got = decode_events(values, [10**12] * 500, False, DEFAULT_LIMITS)
    same(got, want)
    assert decode_events(clicks, [None] * 500, True, DEFAULT_LIMITS) == [Click(f"i{i}", 2_000 + i) for i in range(500)]


def test_the_broker_timestamp_bounds_each_row_on_its_own() -> None:
    limits = dataclasses.replace(DEFAULT_LIMITS, future_ts_s=1.0)
    values = [imp(i) for i in range(50)]
    brokers = [1 if i == 20 else [None, 10**12][i % 2] for i in range(50)]  # row 20's ts: 1,019 ms past its broker's
    got = decode_events(values, brokers, False, limits)
    assert isinstance(got[20], BadMessage) and got[20].kind == "future_ts"
    same(got, one_by_one(values, brokers, False, limits))


@pytest.mark.parametrize("broker", ["same", -1, 0])
def test_a_ts_years_ahead_of_the_wall_clock_is_future_ts_whatever_the_broker_timestamp_says(broker: object) -> None:
    """A producer's CreateTime is the producer's clock: stamped as far ahead as its ``ts`` ("same") the bound was the
    message's own, and with no timestamp (-1: NOT_AVAILABLE as the drivers pass it; 0) there was none: either let a
    ten-years-ahead event through."""
    ahead = int(time.time() * 1000) + 10 * 365 * 86_400_000
    values = [imp(i) for i in range(20)] + [Impression("far", ahead, 1, 2).encode()]
    brokers = [10**12] * 20 + [ahead if broker == "same" else broker]
    got = decode_events(values, brokers, False, DEFAULT_LIMITS)
    assert isinstance(got[20], BadMessage) and got[20].kind == "future_ts"
    assert "ahead of this machine's clock" in str(got[20])
    same(got, one_by_one(values, brokers, False, DEFAULT_LIMITS))

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stream.errors import BadMessage, ValidationError
from stream.events import MAX_ID, Click, Impression, all_ids, check_id, decode_click, decode_impression
from stream.limits import DEFAULT_LIMITS, DENSE_BOUND

GOOD = {"schema_version": 1, "impression_id": "i1", "ts": 1_700_000_000_000, "user_id": "u1", "item_id": 7,
        "context": {"device": "ios", "genres": ["a", "b"], "pos": 3, "score": 0.5}, "dense": {"price": 1.5}}


def enc(obj: object) -> bytes:
    return json.dumps(obj).encode()  # stdlib: writes integers beyond 64 bits, as a bad producer might


def test_valid_impression_and_click_decode() -> None:
    imp = decode_impression(enc(GOOD))
    assert imp.user_id == "u1" and imp.item_id == 7 and imp.context["genres"] == ["a", "b"]
    assert decode_click(enc({"schema_version": 1, "impression_id": "i1", "ts": 5})) == Click("i1", 5)


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"ts": -1}, "ts"),
        ({"ts": "123"}, "ts"),
        ({"ts": 1_700_000_000_000_000}, "ts"),  # microseconds: a unit mistake
        ({"user_id": -5}, "user_id"),
        ({"user_id": 2**64}, "user_id"),
        ({"user_id": ""}, "user_id"),
        ({"user_id": True}, "user_id"),
        ({"item_id": None}, "item_id"),
        ({"impression_id": 12}, "impression_id"),
        ({"schema_version": 2}, "schema_version"),
        ({"context": {"x": {"nested": 1}}}, "context.x"),
        ({"context": {"x": [1, None]}}, "context.x"),
        ({"dense": {"p": "1.0"}}, "dense.p"),
        ({"extra": 1}, "extra"),
    ],
)
def test_invalid_impressions_name_field_value_and_expectation(patch: dict, field: str) -> None:
    with pytest.raises(ValidationError) as info:
        decode_impression(enc({**GOOD, **patch}))
    assert info.value.field == field
    assert "expected" in str(info.value) and field in str(info.value)


def test_missing_fields_and_garbage() -> None:
    for missing in ("impression_id", "ts", "user_id", "item_id"):
        obj = {k: v for k, v in GOOD.items() if k != missing}
        with pytest.raises(ValidationError, match="required") as info:
            decode_impression(enc(obj))
        assert info.value.field == missing
    for raw, kind in ((b"{not json", "bad_json"), (b"[1,2]", "bad_json"), (None, "empty"),
                      (b'{"schema_version":1,"impression_id":"i","ts":1,"user_id":1,"item_id":1,'
                       b'"dense":{"p":NaN}}', "bad_json")):
        with pytest.raises(BadMessage) as info:
            decode_impression(raw)
        assert info.value.kind == kind


ids = st.one_of(st.integers(0, MAX_ID), st.text(min_size=1, max_size=30))
scalars = st.one_of(st.text(max_size=20), st.integers(-(2**63), MAX_ID), st.booleans(),
                    st.floats(allow_nan=False, allow_infinity=False))
ctx_values = st.one_of(scalars, st.lists(st.one_of(st.text(max_size=8), st.integers(0, 2**40)), max_size=5))


@given(
    imp_id=st.text(min_size=1, max_size=40), ts=st.integers(0, 4_102_444_800_000), user=ids, item=ids,
    context=st.dictionaries(st.text(min_size=1, max_size=10), ctx_values, max_size=5),
    dense=st.dictionaries(st.text(min_size=1, max_size=10),  # |x| < 2**64: the bound of every stage
                          st.floats(-DENSE_BOUND, DENSE_BOUND, allow_nan=False, exclude_min=True,
                                    exclude_max=True), max_size=3),
)
def test_impression_json_round_trip(imp_id, ts, user, item, context, dense) -> None:
    imp = Impression(imp_id, ts, user, item, context, dense)
    back = decode_impression(imp.encode())
    assert back == imp
    assert all(math.isfinite(v) for v in back.dense.values())



def _taken_as_is(v: object) -> bool:
    try:
        return check_id("x", v) is v
    except BadMessage:
        return False


@pytest.mark.parametrize("values", [
    [], [0, 1, MAX_ID], ["a", "i7", "x" * 256], [1, "u", 2],
    [-1], [MAX_ID + 1], [True], [1, False], [""], ["x" * 257], [1.0], [None], [[1]], [{"item_id": 1}],
    [1, 2, "ok", 3.5],
])
def test_all_ids_is_true_exactly_when_check_id_takes_every_value_as_it_is(values: list) -> None:
    assert all_ids(values) is all(_taken_as_is(v) for v in values)


@given(st.lists(st.one_of(st.integers(min_value=-2, max_value=2**64), st.text(max_size=300), st.booleans(),
                          st.floats(allow_nan=False), st.none()), max_size=20))
def test_all_ids_agrees_with_check_id_on_any_list(values: list) -> None:
    assert all_ids(values) is all(_taken_as_is(v) for v in values)


def test_count_keys_counts_every_objects_keys_at_any_depth_and_scalars_as_none() -> None:
    import orjson

    from stream.events import count_keys

    assert count_keys(orjson.loads(b'{"a":{"b":[{"c":1,"d":[{"e":2}]},3]},"f":[[{"g":{}}]]}')) == 7
    assert [count_keys(orjson.loads(v)) for v in (b"[1,2,3]", b"5", b'"s"', b"null", b"{}")] == [0] * 5
    assert count_keys(orjson.loads(b"[" * 1000 + b'{"x":1}' + b"]" * 1000)) == 1  # deeper than Python recursion


def test_reject_duplicate_keys_finds_a_repeat_in_any_object_given_the_parsed_key_count() -> None:
    import orjson

    from stream.events import count_keys, reject_duplicate_keys

    for raw in (b'{"a":[{"b":1,"b":2}]}', b'[[{"x":{"y":1,"y":1}}]]', b'{"a":"k:v","a":1}'):
        with pytest.raises(BadMessage, match="duplicate key"):
            reject_duplicate_keys(raw, count_keys(orjson.loads(raw)))
    for raw in (b'{"a":[{"b":1},{"b":2}]}', b'{"a":"x:y:z","b":{"a":1}}', b'{ "a" : 1 , "b" : [ {"a": 2} ] }'):
        reject_duplicate_keys(raw, count_keys(orjson.loads(raw)))  # repeated across objects, colons in values: fine


@pytest.mark.parametrize("price", [1e20, -(2.0**64), 3e38, 2.0**64 - 2.0**39])
def test_a_dense_value_the_learner_refuses_is_refused_per_event_by_every_decoder(price: float) -> None:
    """One bound end to end (stream.limits.DENSE_BOUND): an event whose dense value the learner's samples decode
    refuses is dead-lettered alone at the joiner's decode, by the per-event and the column decoder alike. It used to
    pass (finite as float32), be joined, and cost the learner the whole 64-row samples message it shared."""
    from stream.event_batch import decode_events
    from stream.samples import SampleBatch

    good = Impression("i1", 1_000, "u", "v", dense={"price": 1.0}).encode()
    bad = Impression("i2", 1_000, "u", "v", dense={"price": price}).encode()
    with pytest.raises(BadMessage, match=r"dense\.price.*2\*\*64"):
        decode_impression(bad)
    out = decode_events([good] * 8 + [bad] + [good] * 8, [None] * 17, clicks=False)
    assert isinstance(out[8], BadMessage) and "2**64" in str(out[8])
    assert all(isinstance(e, Impression) for i, e in enumerate(out) if i != 8)
    edge = math.nextafter(DENSE_BOUND, 0)  # the largest both accept (the samples hold it as float32, below 2**64)
    assert decode_impression(Impression("i3", 1_000, "u", "v", dense={"price": edge}).encode()).dense["price"] == edge

    def samples(value: float) -> bytes:
        return SampleBatch.from_columns(impression_id=["i"], ts=[1_000], label=[0], label_delay_ms=[0],
                                        user_id=[1], item_id=[2], history=[[]], dense={"price": [value]}).encode()

    assert SampleBatch.decode(samples(edge)) is not None
    with pytest.raises(BadMessage, match="2\\*\\*64"):
        SampleBatch.decode(samples(price))


@pytest.mark.parametrize("literal", [2**63, -(2**63) - 1, 2**64, -(2**64), 10**30])
@pytest.mark.parametrize("where", ["scalar", "list"])
def test_a_context_integer_past_int64_is_rejected_whatever_its_size_or_sign(literal: int, where: str) -> None:
    """orjson reads an integer literal within 64 bits unsigned as an int and one beyond as a float: 2**63 was rejected
    (an int past int64) while -(2**63)-1 and 2**64 were accepted as floats (hashed as floats, and 2**64 and 2**64+1
    the same value). One rule: every integer literal outside int64 is rejected."""
    value = literal if where == "scalar" else [1, literal]
    with pytest.raises(ValidationError) as info:
        decode_impression(enc({**GOOD, "context": {"a": value}}))
    assert info.value.field == "context.a"


@pytest.mark.parametrize("literal", ["1e19", "-9223372036854775809.0", "1.8446744073709552e+19"])
def test_a_context_float_literal_past_int64_is_still_a_float(literal: str) -> None:
    raw = enc({**GOOD, "context": {"a": "X"}}).replace(b'"X"', literal.encode())
    assert decode_impression(raw).context["a"] == float(literal)


def test_a_dense_integer_literal_past_int64_keeps_its_exact_value() -> None:
    """Dense values are numbers (|x| < 2**64): an integer literal below -(2**63) is one, kept as written (an int, as
    one up to 2**64 - 1 is), not orjson's float of it."""
    imp = decode_impression(enc({**GOOD, "dense": {"p": -(2**63) - 1, "q": 2**64 - 2**40}}))
    assert imp.dense == {"p": -(2**63) - 1, "q": 2**64 - 2**40}
    assert type(imp.dense["p"]) is int


@pytest.mark.parametrize("field", ["user_id", "item_id", "ts", "schema_version", "context", "dense"])
@pytest.mark.parametrize("literal", [2**64, -(2**63) - 1, 10**30])
def test_a_rejected_integer_literal_past_int64_is_shown_as_written(field: str, literal: int) -> None:
    """orjson reads an integer literal beyond 64 bits unsigned as a float: a user_id of 2**64 was rejected, its reason
    showing 1.8446744073709552e+19."""
    if field == "dense":
        literal *= 2**64  # past the dense bound
    value = {"context": {"a": [literal]}, "dense": {"p": literal}}.get(field, literal)
    with pytest.raises(ValidationError) as info:
        decode_impression(enc({**GOOD, field: value}))
    assert str(literal)[:18] in str(info.value) and "e+" not in str(info.value)  # (a long one clipped as written)
    if field in ("ts", "schema_version"):
        with pytest.raises(ValidationError, match=str(literal)):
            decode_click(enc({"schema_version": 1, "impression_id": "i1", "ts": 5, field: literal}))


@pytest.mark.parametrize("literal", [2**64 - 2**39 - 1, -(2**64 - 2**39 - 2**10)])
def test_a_dense_integer_literal_that_becomes_2_64_as_float32_is_refused_by_events_and_requests(literal: int) -> None:
    """An integer literal below DENSE_BOUND that rounds to it as a float (every stage reads it through float64, then
    float32: 2**64 - 2**39 - 1 becomes 2**64) was accepted by the event decoder and the scoring request, so its
    samples message was refused whole by the learner's decode and serving fed the model 2**64. The largest integer
    that stays below is still accepted, and its samples decode."""
    from serving.request import RequestError, read_request
    from stream.event_batch import decode_events
    from stream.samples import SampleBatch

    raw = b'{"schema_version": 1, "impression_id": "i", "ts": 1000, "user_id": 1, "item_id": 2, "dense": {"price": %d}}'
    with pytest.raises(BadMessage, match=r"dense\.price.*2\*\*64"):
        decode_impression(raw % literal)
    assert isinstance(decode_events([raw % literal] * 8, [None] * 8, clicks=False)[0], BadMessage)
    with pytest.raises(RequestError, match=r"dense\.price"):
        read_request(b'{"user_id": 1, "items": [2], "dense": {"price": %d}}' % literal, 10)
    edge = (2**64 - 2**39 - 2**10 - 1) * (1 if literal > 0 else -1)
    price = decode_impression(raw % edge).dense["price"]
    assert read_request(b'{"user_id": 1, "items": [2], "dense": {"price": %d}}' % edge, 10).dense["price"] == price
    SampleBatch.decode(SampleBatch.from_columns(impression_id=["i"], ts=[1_000], label=[0], label_delay_ms=[0],
                                                user_id=[1], item_id=[2], history=[[]], dense={"price": [price]}
                                                ).encode())


def test_a_future_ts_reason_states_the_lead_exactly_not_rounded_to_the_limit() -> None:
    """1 ms over a 3600 s limit read "3600 s ahead ...; at most 3600 s is allowed": the reason stated no breach."""
    broker = 1_765_000_000_000
    raw = b'{"schema_version": 1, "impression_id": "a", "ts": %d}' % (broker + 3_600_001)
    with pytest.raises(BadMessage) as err:
        decode_click(raw, DEFAULT_LIMITS, broker)
    assert err.value.kind == "future_ts" and "3600001 ms ahead" in str(err.value) and "3600000 ms" in str(err.value)

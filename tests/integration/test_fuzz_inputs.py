"""Fuzzing every decoder of outside input with Hypothesis (issue 11, item 9).

The promise under test, decoder by decoder: whatever comes in gives either a value that satisfies the
documented schema, or the decoder's own error with a message; never another exception (RecursionError,
TypeError, KeyError, OverflowError, UnicodeError, ArrowInvalid...).

==================================================================  ========  ===================================
property                                                            examples  input
==================================================================  ========  ===================================
test_any_bytes_decode_to_an_impression_or_a_bad_message                  500  bytes, JSON-ish text, valid events
test_any_bytes_decode_to_a_click_or_a_bad_message                        500  bytes, JSON-ish text, valid events
test_any_json_value_decodes_to_an_event_or_a_bad_message                 400  st.recursive JSON values
test_event_shaped_json_decodes_to_a_valid_event_or_a_bad_message         400  objects with the schema's fields
test_valid_events_decode_to_what_was_encoded                             200  valid impressions and clicks
test_mutated_events_decode_to_a_valid_event_or_a_bad_message             500  valid events, mutated
test_hostile_events_are_rejected_quickly_with_a_short_reason         (plain)  deep, long, wide, huge values
test_any_bytes_decode_to_a_sample_batch_or_a_bad_message                 300  bytes, cut valid messages
test_sample_batch_regressions_are_bad_messages                       (plain)  the crashes fuzzing found
test_hostile_sample_batches_train_or_are_a_bad_message                   300  pyarrow-built, edited, patched
test_history_entries_parse_to_sorted_equal_length_lists                  600  lists of bytes/str/other
test_any_config_text_reads_to_a_dict_or_a_settings_error                 300  text / bytes in a tmp file
test_reading_a_directory_or_an_unreadable_path_is_a_settings_error   (plain)  a directory
test_config_files_build_settings_or_a_settings_error                     200  text -> read_config_file -> build
test_any_toml_tables_and_environment_build_settings_or_an_error          400  TOML-shaped dicts, env maps
test_redis_strikes_load_any_hash                                         200  hash fields/values (real Redis)
test_file_strikes_load_any_file                                          200  file bytes, JSON-ish text
==================================================================  ========  ===================================

5 000 examples in all, about 40 s on a 2-core machine (most of it Hypothesis drawing the inputs).
``STREAMREC_FUZZ_SCALE=10`` multiplies every count for a longer hunt (it passed at 10x: 50 000 examples).
``pytest --hypothesis-show-statistics`` shows each property's mix of outcomes (decoded / rejected by kind).

Each crash found has an explicit regression example (``@example`` or a plain test) next to its
property. ``database=None``: runs are reproducible from the seed, and leave nothing behind.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pytest
import redis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import event as _event
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from learner.batch import to_tensors
from learner.config import LearnerSettings
from learner.features import FeatureConfig, FieldSpec
from learner.kafka_dataset import read_samples
from stream.config import KafkaSettings
from stream.errors import BadMessage
from stream.events import MAX_ID, MAX_TS_MS, Click, Impression, decode_click, decode_impression, ts_bound_ms
from stream.history import _entry, _parse
from stream.joiner.config import JoinerSettings
from stream.limits import DEFAULT_LIMITS, DENSE_BOUND, FLOAT32_MAX, FLOAT32_OVERFLOW, EventLimits
from stream.samples import SampleBatch
from stream.strikes import FileStrikes, RedisStrikes
from streamrec.settings import SettingsError, build, read_config_file


def fuzz(n: int) -> settings:
    """``n`` examples (times ``STREAMREC_FUZZ_SCALE``, default 1: a longer hunt for a crash)."""
    return settings(max_examples=n * int(os.environ.get("STREAMREC_FUZZ_SCALE", "1")), deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much, HealthCheck.large_base_example,
                                           HealthCheck.function_scoped_fixture])


def event(label: str) -> None:
    """Count an outcome (``pytest --hypothesis-show-statistics``); a no-op outside a property."""
    if currently_in_test_context():
        _event(label)


INT64 = 2**63
RELAXED = dataclasses.replace(DEFAULT_LIMITS, max_message_bytes=10**9)
TIGHT = EventLimits(max_message_bytes=300, max_context_keys=2, max_dense_keys=1, max_key_len=3, max_str_len=5,
                    max_list_len=2, future_ts_s=0.0)
limits_st = st.sampled_from([DEFAULT_LIMITS, DEFAULT_LIMITS, DEFAULT_LIMITS, TIGHT])
broker_ts_st = st.one_of(st.none(), st.sampled_from([-1, 0, 1, MAX_TS_MS, INT64 - 1]),
                         st.integers(0, MAX_TS_MS + 10**7), st.integers(-INT64, INT64 - 1))


# -- JSON-ish values ------------------------------------------------------------------------------
class Obj(tuple):
    """A JSON object as its ``(key, value)`` pairs, in order: it may repeat a key."""


class Raw(str):
    """JSON text written out as is (numbers as no serializer writes them, broken tokens)."""


def dumps(v: Any, ascii_only: bool = True) -> str:
    """JSON text of ``v``; NaN and infinities come out as ``NaN`` / ``1e999`` (text that parses to them)."""
    if isinstance(v, Raw):
        return str(v)
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "NaN"
        if math.isinf(v):
            return "1e999" if v > 0 else "-1e999"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=ascii_only)
    if isinstance(v, Obj):
        return "{" + ",".join(f"{dumps(k, ascii_only)}:{dumps(x, ascii_only)}" for k, x in v) + "}"
    if isinstance(v, dict):
        return dumps(Obj(v.items()), ascii_only)
    return "[" + ",".join(dumps(x, ascii_only) for x in v) + "]"


def encode(v: Any, ascii_only: bool = True) -> bytes:
    # surrogatepass: a lone surrogate written unescaped becomes the invalid UTF-8 a hostile producer sends
    return dumps(v, ascii_only).encode("utf-8", "surrogatepass")


FIELDS = ["schema_version", "impression_id", "ts", "user_id", "item_id", "context", "dense"]
any_chars = st.one_of(st.characters(exclude_categories=()), st.characters(min_codepoint=0xD800,
                                                                          max_codepoint=0xDFFF))  # surrogates
raw_numbers = st.sampled_from([
    "1e999", "-1e999", "1E400", "NaN", "Infinity", "-Infinity", "-0", "0.0e0", "1" * 30, "-" + "9" * 25,
    "18446744073709551615", "18446744073709551616", "9223372036854775807", "9223372036854775808",
    "-9223372036854775808", "-9223372036854775809", "4102444800000", "4102444800001", "3.4028235e38",
    "3.4028236e38", "3.5e38", "1e39", "1e-400", "00", "01", "+1", ".5", "1.", "0x10", "nul", "tru", "1.0",
]).map(Raw)
ints = st.one_of(st.integers(), st.integers(-(2**70), 2**70), st.sampled_from(
    [0, -1, 1, MAX_ID, MAX_ID + 1, 2**64 - 1, 2**64, -INT64, -INT64 - 1, MAX_TS_MS, MAX_TS_MS + 1, 10**300]))
floats = st.one_of(st.floats(), st.sampled_from(
    [FLOAT32_MAX, FLOAT32_OVERFLOW, math.nextafter(FLOAT32_OVERFLOW, 0), -FLOAT32_OVERFLOW, 1e39, -0.0, 5e-324,
     DENSE_BOUND, math.nextafter(DENSE_BOUND, 0), -DENSE_BOUND, 1e20]))
LONG = [c * n for c in ("a", "é", "\\", '"', "\x00", "\ud800", "😀") for n in (64, 65, 256, 257, 1000, 70_000)]
texts = st.one_of(st.text(max_size=10), st.text(any_chars, max_size=10), st.sampled_from(LONG))
keys = st.one_of(st.sampled_from(FIELDS + ["", "genres", "price", "x"]), st.text(any_chars, max_size=70))
scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts, raw_numbers)
json_values = st.recursive(
    scalars, lambda kids: st.one_of(st.lists(kids, max_size=5), st.lists(st.tuples(keys, kids), max_size=5).map(Obj)),
    max_leaves=10)


small_json_values = st.recursive(  # for one field's value: cheaper to draw, as hostile
    scalars, lambda kids: st.one_of(st.lists(kids, max_size=3), st.lists(st.tuples(keys, kids), max_size=3).map(Obj)),
    max_leaves=4)


def to_obj(v: Any) -> Any:
    if isinstance(v, dict):
        return Obj((k, to_obj(x)) for k, x in v.items())
    if isinstance(v, list):
        return [to_obj(x) for x in v]
    return v


# -- valid events ---------------------------------------------------------------------------------
ids = st.one_of(st.integers(0, MAX_ID), st.text(min_size=1, max_size=8), st.sampled_from([0, MAX_ID, "x" * 256]))
ctx_values = st.one_of(
    st.text(max_size=8), st.sampled_from(["x" * 256, -INT64, INT64 - 1]), st.integers(-INT64, INT64 - 1),
    st.floats(allow_nan=False, allow_infinity=False), st.booleans(),
    st.lists(st.one_of(st.text(max_size=4), st.integers(-INT64, INT64 - 1)), max_size=4))
dense_values = st.one_of(st.floats(-DENSE_BOUND, DENSE_BOUND, exclude_min=True, exclude_max=True),
                         st.integers(-(2**63), 2**63),
                         st.sampled_from([math.nextafter(DENSE_BOUND, 0), -math.nextafter(DENSE_BOUND, 0)]))
feature_names = st.one_of(st.text(min_size=1, max_size=6), st.just("k" * 64))
valid_impressions = st.fixed_dictionaries(
    {"schema_version": st.just(1), "impression_id": st.text(min_size=1, max_size=8) | st.just("i" * 256),
     "ts": st.integers(0, MAX_TS_MS), "user_id": ids, "item_id": ids},
    optional={"context": st.dictionaries(feature_names, ctx_values, max_size=4),
              "dense": st.dictionaries(feature_names, dense_values, max_size=4)})
valid_clicks = st.fixed_dictionaries(
    {"schema_version": st.just(1), "impression_id": st.text(min_size=1, max_size=8) | st.just("i" * 256),
     "ts": st.integers(0, MAX_TS_MS)})


def check_reason(exc: BadMessage) -> None:
    event(f"rejected: {exc.kind}")  # the outcome mix: pytest --hypothesis-show-statistics
    assert isinstance(exc.reason, str) and exc.reason.strip(), exc
    assert len(exc.reason) < 1000, exc.reason[:200]
    assert isinstance(exc.kind, str) and exc.kind, exc


def _no_duplicate_keys(raw: bytes) -> None:
    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        names = [k for k, _ in items]
        assert len(names) == len(set(names)), f"duplicate keys accepted: {names}"
        return dict(items)

    json.loads(raw, object_pairs_hook=pairs)


def _check_id(v: Any, limits: EventLimits) -> None:
    if type(v) is int:
        assert 0 <= v <= MAX_ID
    else:
        assert type(v) is str and 0 < len(v) <= limits.max_str_len


def _check_keys(d: Any, max_keys: int, limits: EventLimits) -> None:
    assert type(d) is dict and len(d) <= max_keys
    for k in d:
        assert type(k) is str and 0 < len(k) <= limits.max_key_len


def _check_ts(ts: Any, broker: int | None, limits: EventLimits) -> None:
    assert type(ts) is int and 0 <= ts <= MAX_TS_MS
    assert ts <= ts_bound_ms(broker, int(time.time() * 1000)) + limits.future_ts_ms  # the clock read after the decode


def check_impression(imp: Impression, raw: bytes, limits: EventLimits, broker: int | None) -> None:
    """``imp`` satisfies the documented schema and survives a round trip."""
    assert type(imp) is Impression
    assert len(raw) <= limits.max_message_bytes
    assert type(imp.impression_id) is str and 0 < len(imp.impression_id) <= limits.max_str_len
    _check_ts(imp.ts, broker, limits)
    _check_id(imp.user_id, limits)
    _check_id(imp.item_id, limits)
    _check_keys(imp.context, limits.max_context_keys, limits)
    for v in imp.context.values():
        if type(v) is list:
            assert len(v) <= limits.max_list_len
            for x in v:
                assert (type(x) is str and len(x) <= limits.max_str_len) or (type(x) is int and -INT64 <= x < INT64)
        else:
            assert type(v) in (str, int, float, bool)
            if type(v) is str:
                assert len(v) <= limits.max_str_len
            elif type(v) is int:
                assert -INT64 <= v < INT64
            elif type(v) is float:
                assert math.isfinite(v)
    _check_keys(imp.dense, limits.max_dense_keys, limits)
    with np.errstate(over="ignore"):
        for v in imp.dense.values():
            assert type(v) in (int, float) and np.isfinite(np.float32(v)), v
    _no_duplicate_keys(raw)
    again = decode_impression(imp.encode(), dataclasses.replace(limits, max_message_bytes=10**9), broker)
    assert again == imp


def check_click(click: Click, raw: bytes, limits: EventLimits, broker: int | None) -> None:
    assert type(click) is Click
    assert len(raw) <= limits.max_message_bytes
    assert type(click.impression_id) is str and 0 < len(click.impression_id) <= limits.max_str_len
    _check_ts(click.ts, broker, limits)
    _no_duplicate_keys(raw)
    assert decode_click(click.encode(), dataclasses.replace(limits, max_message_bytes=10**9), broker) == click


def decode_or_reject(raw: bytes | None, limits: EventLimits = DEFAULT_LIMITS, broker: int | None = None,
                     ) -> tuple[Impression | None, Click | None]:
    """Both decoders on ``raw``: each gives a valid event or a BadMessage (the only exception allowed)."""
    out: list[Any] = []
    for decode, check in ((decode_impression, check_impression), (decode_click, check_click)):
        try:
            decoded = decode(raw, limits, broker_ts_ms=broker)
        except BadMessage as exc:
            check_reason(exc)
            out.append(None)
            continue
        check(decoded, raw, limits, broker)  # type: ignore[operator]
        event(f"decoded: {type(decoded).__name__}")
        out.append(decoded)
    return out[0], out[1]


json_texts = st.one_of(st.binary(max_size=300), json_values.map(encode),
                       st.builds(encode, json_values, st.just(False)), valid_impressions.map(orjson.dumps),
                       valid_clicks.map(orjson.dumps))


# Regression: an unhashable schema_version (a list or an object) raised TypeError from the version check.
@example(b'{"schema_version": []}', DEFAULT_LIMITS, None)
@example(b'{"schema_version": {"a": 1}, "impression_id": "x", "ts": 1}', DEFAULT_LIMITS, 5)
@given(json_texts, limits_st, broker_ts_st)
@fuzz(500)
def test_any_bytes_decode_to_an_impression_or_a_bad_message(raw: bytes, limits: EventLimits, broker: int | None,
                                                            ) -> None:
    try:
        imp = decode_impression(raw, limits, broker_ts_ms=broker)
    except BadMessage as exc:
        check_reason(exc)
        return
    check_impression(imp, raw, limits, broker)
    event("decoded: Impression")


@example(b'{"schema_version": [1], "impression_id": "x", "ts": 1}', DEFAULT_LIMITS, None)
@given(json_texts, limits_st, broker_ts_st)
@fuzz(500)
def test_any_bytes_decode_to_a_click_or_a_bad_message(raw: bytes, limits: EventLimits, broker: int | None) -> None:
    try:
        click = decode_click(raw, limits, broker_ts_ms=broker)
    except BadMessage as exc:
        check_reason(exc)
        return
    check_click(click, raw, limits, broker)
    event("decoded: Click")


@given(json_values, st.booleans(), limits_st, broker_ts_st)
@fuzz(400)
def test_any_json_value_decodes_to_an_event_or_a_bad_message(value: Any, ascii_only: bool, limits: EventLimits,
                                                             broker: int | None) -> None:
    decode_or_reject(encode(value, ascii_only), limits, broker)


@st.composite
def event_shaped(draw: st.DrawFn) -> Obj:
    """An object with (most of) the schema's fields, each with a valid value or any JSON value."""
    base = draw(st.one_of(valid_impressions, valid_clicks))
    pairs = []
    for name in FIELDS:
        present = name in base or draw(st.booleans())
        if not present or draw(st.integers(0, 9)) == 0:
            continue
        hostile = draw(st.integers(0, 7)) == 0
        pairs.append((name, draw(small_json_values) if hostile or name not in base else to_obj(base[name])))
    if draw(st.integers(0, 5)) == 0:
        pairs.append((draw(keys), draw(small_json_values)))
    return Obj(draw(st.permutations(pairs)))


@example(Obj([("schema_version", [1]), ("impression_id", "a"), ("ts", 1)]), DEFAULT_LIMITS, None)
@given(event_shaped(), limits_st, broker_ts_st)
@fuzz(400)
def test_event_shaped_json_decodes_to_a_valid_event_or_a_bad_message(obj: Obj, limits: EventLimits,
                                                                     broker: int | None) -> None:
    decode_or_reject(encode(obj), limits, broker)


def _expected_impression(d: dict[str, Any]) -> Impression:
    return Impression(d["impression_id"], d["ts"], d["user_id"], d["item_id"], d.get("context", {}),
                      d.get("dense", {}))


@given(valid_impressions, valid_clicks, st.booleans())
@fuzz(200)
def test_valid_events_decode_to_what_was_encoded(imp: dict[str, Any], click: dict[str, Any], ours: bool) -> None:
    # valid: not ahead of the clock (past it, ts is future_ts whatever the stamp: stream.events.ts_bound_ms; drawn
    # from [0, 2100] it was, now and then, and the test failed), and stamped at its event time
    imp = {**imp, "ts": min(imp["ts"], int(time.time() * 1000))}
    raw_imp = encode(imp, ascii_only=False) if ours else orjson.dumps(imp)
    got = decode_impression(raw_imp, RELAXED, broker_ts_ms=imp["ts"])
    assert got == _expected_impression(imp)
    check_impression(got, raw_imp, RELAXED, imp["ts"])
    raw_click = encode(click) if ours else orjson.dumps(click)
    assert decode_click(raw_click, RELAXED) == Click(click["impression_id"], click["ts"])


# -- mutations of valid events --------------------------------------------------------------------
def _set(obj: Obj, key: str, value: Any) -> Obj:
    pairs = [(k, v) for k, v in obj if k != key]
    return Obj([*pairs, (key, value)])


@st.composite
def mutated_event(draw: st.DrawFn) -> bytes:
    obj = to_obj(draw(st.one_of(valid_impressions, valid_clicks)))
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["swap", "drop", "duplicate", "nest", "wrap", "inner"]))
        names = [k for k, _ in obj] or ["ts"]
        name = draw(st.sampled_from(names))
        value = dict(obj).get(name)
        if op == "swap":  # a field's value of another JSON type
            obj = _set(obj, name, draw(small_json_values))
        elif op == "drop":
            obj = Obj([(k, v) for k, v in obj if k != name])
        elif op == "duplicate":  # the same key twice, with the same or another value
            dup = value if draw(st.booleans()) else draw(small_json_values)
            pairs = list(obj)
            pairs.insert(draw(st.integers(0, len(pairs))), (name, dup))
            obj = Obj(pairs)
        elif op == "nest":  # one level more around a field's value
            obj = _set(obj, name, draw(st.sampled_from([lambda v: [v], lambda v: Obj([("v", v)])]))(value))
        elif op == "wrap":  # one level more around the whole event
            obj = draw(st.sampled_from([lambda v: [v], lambda v: Obj([("event", v)])]))(obj)
            break
        elif op == "inner":  # duplicate or hostile keys and values inside context / dense
            inner_name = draw(st.sampled_from(["context", "dense"]))
            inner = dict(obj).get(inner_name)
            inner = inner if isinstance(inner, Obj) else Obj()
            pairs = list(inner)
            if pairs and draw(st.booleans()):
                k, v = draw(st.sampled_from(pairs))
                pairs.append((k, v if draw(st.booleans()) else draw(small_json_values)))
            else:
                pairs.append((draw(keys), draw(small_json_values)))
            obj = _set(obj, inner_name, Obj(pairs))
    raw = bytearray(encode(obj, draw(st.booleans())))
    for _ in range(draw(st.integers(0, 3))):
        if not raw:
            break
        op = draw(st.sampled_from(["flip", "truncate", "insert", "delete"]))
        i = draw(st.integers(0, len(raw) - 1))
        if op == "flip":
            raw[i] ^= draw(st.integers(1, 255))
        elif op == "truncate":
            del raw[i:]
        elif op == "insert":
            raw[i:i] = draw(st.one_of(st.binary(min_size=1, max_size=8),
                                      st.sampled_from([b'"', b"\\", b":", b",", b"{", b"}", b"[", b"]", b"\x00",
                                                       b"\xff", b"\xed\xa0\x80", b'"ts":1,', b'"a":'])))
        else:
            del raw[i:i + draw(st.integers(1, 8))]
    return bytes(raw)


@example(b'{"schema_version":1,"impression_id":"a","ts":1,"ts":2}', DEFAULT_LIMITS, None)
@example(b'{"schema_version":1,"impression_id":"a","ts":1,"user_id":1,"item_id":2,"dense":{"p":1,"p":2}}',
         DEFAULT_LIMITS, None)
@example(b'{"schema_version":1,"impression_id":"a\\":","ts":1,"user_id":1,"item_id":2}', DEFAULT_LIMITS, None)
@given(mutated_event(), limits_st, broker_ts_st)
@fuzz(500)
def test_mutated_events_decode_to_a_valid_event_or_a_bad_message(raw: bytes, limits: EventLimits,
                                                                 broker: int | None) -> None:
    decode_or_reject(raw, limits, broker)


def test_hostile_events_are_rejected_quickly_with_a_short_reason() -> None:
    head = b'{"schema_version":1,"impression_id":"a","ts":1,"user_id":1,"item_id":2,'
    hostile = [
        head + b'"context":{"a":' + b"[" * 1000 + b"1" + b"]" * 1000 + b"}}",  # as deep as the parser goes
        head + b'"context":{"a":' + b"[" * 1100 + b"1" + b"]" * 1100 + b"}}",  # deeper
        head + b'"dense":{"a":"' + b"x" * 60_000 + b'"}}',  # a long string
        head + b'"context":{"' + b"k" * 60_000 + b'":1}}',  # a long key
        head + b'"context":{' + b",".join(b'"k%d":%d' % (i, i) for i in range(5000)) + b"}}",  # many keys
        head + b'"context":{"a":[' + b",".join(b"1" for _ in range(30_000)) + b"]}}",  # a long list
        head + b'"dense":{"a":' + b"9" * 5000 + b"}}",  # a number too large for a double
        b'{"schema_version":1,"impression_id":"' + b"\\\\" * 30_000 + b'","ts":1}',  # backslash runs
        b'{"schema_version":1,"impression_id":"' + b'\\":' * 20_000 + b'","ts":1}',  # colons after quotes
        b'{"schema_version":1' + b' "' * 30_000,  # broken
        head + b'"context":{' + b'"a":1,' * 10_000 + b'"a":1}}',  # one key 10 001 times
    ]
    for raw in hostile:
        for decode in (decode_impression, decode_click):
            t0 = time.perf_counter()
            with pytest.raises(BadMessage) as info:
                decode(raw)
            assert time.perf_counter() - t0 < 2.0, raw[:80]
            check_reason(info.value)


# -- samples (Arrow IPC) --------------------------------------------------------------------------
CFG = FeatureConfig((FieldSpec("user_id", "single", 50), FieldSpec("item_id", "single", 40),
                     FieldSpec("history", "sequence", 40, shares="item_id"), FieldSpec("ctx.genres", "multi", 10)),
                    embedding_dim=4)
# Every layout path: a dynamic field (keys kept), a scalar context field, dense columns present and missing.
CFG_WIDE = FeatureConfig((FieldSpec("user_id", "single", 50, capacity=8), FieldSpec("item_id", "single", 40),
                          FieldSpec("history", "sequence", 40, shares="item_id"),
                          FieldSpec("ctx.genres", "multi", 10), FieldSpec("ctx.age", "single", 7)),
                         dense=("price", "missing"), embedding_dim=4)


def check_trainable(sb: SampleBatch) -> None:
    """What decode accepted becomes tensors without an exception, and the tensors are consistent."""
    for cfg in (CFG, CFG_WIDE):
        tb = to_tensors(sb, cfg, [(0, 1, len(sb))])
        b, f = len(sb), cfg.num_fields
        offsets, values = tb.offsets.numpy(), tb.values.numpy()
        assert offsets.shape == (f * b + 1,) and offsets[0] == 0 and offsets[-1] == len(values)
        assert (np.diff(offsets) >= 0).all()
        assert ((values >= 0) & (values < cfg.num_rows)).all()
        assert tb.dense.shape == (b, len(cfg.dense)) and bool(tb.dense.isfinite().all())
        assert set(tb.labels.tolist()) <= {0.0, 1.0}
        assert len(tb.impression_ids) == b and len(tb.ts) == b and (tb.ts >= 0).all()
        assert tb.keys is None or len(tb.keys) == len(values)
        # every column in the joiner's domain (SampleBatch.decode): nothing downstream meets a value it cannot handle
        assert (tb.ts <= MAX_TS_MS).all() and tb.label_delay_ms is not None
        assert ((tb.label_delay_ms >= 0) & (tb.label_delay_ms <= MAX_TS_MS)).all()
        assert tb.keys is None or (tb.keys >= 0).all()  # hashed ids: IdMap refuses negative ones
        assert bool((tb.dense.abs() < 2.0**64).all())  # squares inside float32 (Adam's second moment)
        assert tb.kinds is None or set(tb.kinds.tolist()) <= {0, 1, 2}
        assert tb.kinds is None or (tb.labels.numpy()[tb.kinds == 2] == 1).all()


def decode_samples(raw: bytes) -> SampleBatch | None:
    try:
        sb = read_samples(raw)  # the learner's reader: SampleBatch.decode and the [limits] bounds on its strings
    except BadMessage as exc:
        check_reason(exc)
        return None
    check_trainable(sb)
    event("decoded: SampleBatch")
    return sb


def _valid_samples(n: int = 3) -> SampleBatch:
    return SampleBatch.from_columns(
        impression_id=[f"i{k}" for k in range(n)], ts=np.arange(n), label=np.arange(n) % 2,
        label_delay_ms=np.zeros(n), user_id=np.arange(n) * 7, item_id=np.arange(n) * 11,
        history=[list(range(k)) for k in range(n)], context={"genres": [[1, 2]] * n, "age": np.arange(n)},
        dense={"price": np.ones(n)})


@example(b"")
@example(b"\xff\xff\xff\xff\x00\x00\x00\x00")
@example(_valid_samples().encode())
@given(st.one_of(st.binary(max_size=400), st.builds(lambda b, k: _valid_samples().encode()[:k] + b,
                                                    st.binary(max_size=40), st.integers(0, 2000))))
@fuzz(300)
def test_any_bytes_decode_to_a_sample_batch_or_a_bad_message(raw: bytes) -> None:
    decode_samples(raw)


I64 = st.integers(-INT64, INT64 - 1)


def _wrong_type_array(draw: st.DrawFn, n: int) -> pa.Array:
    kind = draw(st.sampled_from(["int32", "int8", "float64", "float32", "utf8", "binary", "list32", "large_list",
                                 "null", "dict", "struct", "bool", "int64", "list64", "uint64"]))
    if kind == "int32":
        return pa.array(draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=n, max_size=n)), pa.int32())
    if kind == "int8":
        return pa.array(draw(st.lists(st.integers(-128, 127), min_size=n, max_size=n)), pa.int8())
    if kind == "float64":
        return pa.array(draw(st.lists(st.floats(), min_size=n, max_size=n)), pa.float64())
    if kind == "float32":
        return pa.array(np.asarray(draw(st.lists(st.floats(width=32), min_size=n, max_size=n)), np.float32))
    if kind == "utf8":
        return pa.array(draw(st.lists(st.text(max_size=4), min_size=n, max_size=n)), pa.utf8())
    if kind == "binary":
        return pa.array(draw(st.lists(st.binary(max_size=4), min_size=n, max_size=n)), pa.binary())
    if kind == "list32":
        return pa.array(draw(st.lists(st.lists(st.integers(-5, 5), max_size=3), min_size=n, max_size=n)),
                        pa.list_(pa.int32()))
    if kind == "large_list":
        return pa.array(draw(st.lists(st.lists(I64, max_size=3), min_size=n, max_size=n)), pa.large_list(pa.int64()))
    if kind == "null":
        return pa.nulls(n)
    if kind == "dict":
        return pa.array([f"v{k % 2}" for k in range(n)]).dictionary_encode()
    if kind == "struct":
        return pa.array([{"a": k} for k in range(n)], pa.struct([("a", pa.int64())]))
    if kind == "bool":
        return pa.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), pa.bool_())
    if kind == "uint64":
        return pa.array(draw(st.lists(st.integers(0, 2**64 - 1), min_size=n, max_size=n)), pa.uint64())
    if kind == "list64":
        return pa.array(draw(st.lists(st.lists(I64, max_size=3), min_size=n, max_size=n)), pa.list_(pa.int64()))
    return pa.array(draw(st.lists(I64, min_size=n, max_size=n)), pa.int64())


def _with_null(draw: st.DrawFn, arr: pa.Array) -> pa.Array:
    """``arr`` with one null: at the top level, or inside one of its lists."""
    rows = arr.to_pylist()
    if not rows:
        return arr
    i = draw(st.integers(0, len(rows) - 1))
    if pa.types.is_list(arr.type) and draw(st.booleans()):
        rows[i] = [*rows[i], None]
    else:
        rows[i] = None
    return pa.array(rows, arr.type)


@st.composite
def hostile_samples(draw: st.DrawFn) -> bytes:
    n = draw(st.integers(0, 6))

    def col(good: st.SearchStrategy, bad: st.SearchStrategy) -> list:  # mostly valid, one column in eight hostile
        element = bad if draw(st.integers(0, 7)) == 0 else good
        return [draw(element) for _ in range(n)]

    cols: dict[str, pa.Array] = {
        "impression_id": pa.array(col(st.text(max_size=6), st.text(st.characters(codec="utf-8"), max_size=6)),
                                  pa.utf8()),
        "ts": pa.array(col(st.integers(0, MAX_TS_MS), I64), pa.int64()),
        "label": pa.array(col(st.integers(0, 1), st.integers(-128, 127)), pa.int8()),
        "label_delay_ms": pa.array(col(st.integers(0, 10**7), I64), pa.int64()),
        "user_id": pa.array(col(st.integers(0, INT64 - 1), I64), pa.int64()),
        "item_id": pa.array(col(st.integers(0, INT64 - 1), I64), pa.int64()),
        "history": pa.array(col(st.lists(st.integers(0, 10**6), max_size=4), st.lists(I64, max_size=4)),
                            pa.list_(pa.int64())),
    }
    if draw(st.booleans()):
        cols["ctx.genres"] = pa.array(col(st.lists(st.integers(0, 100), max_size=3), st.lists(I64, max_size=3)),
                                      pa.list_(pa.int64()))
    if draw(st.booleans()):  # a multi field sent as a scalar column, a single field as a list
        cols["ctx.genres" if draw(st.booleans()) else "ctx.age"] = pa.array(col(I64, I64), pa.int64())
    if draw(st.booleans()):
        cols["ctx.age"] = pa.array(col(st.lists(I64, max_size=2), st.lists(I64, max_size=2)), pa.list_(pa.int64()))
    if draw(st.integers(0, 5)) == 0:  # the same layout under another child name, or a non-nullable child
        child = draw(st.sampled_from([pa.field("element", pa.int64()), pa.field("item", pa.int64(), nullable=False)]))
        cols["history"] = pa.array(cols["history"].to_pylist(), pa.list_(child))
    if draw(st.booleans()):
        cols["dense.price"] = pa.array(np.asarray(col(st.floats(-1e6, 1e6), st.floats(width=32)), np.float32))
    names = list(cols)
    arrays = list(cols.values())
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 1, 2, 3]))):
        op = draw(st.sampled_from(["retype", "nulls", "dup", "drop", "extra"]))
        i = draw(st.integers(0, len(names) - 1)) if names else 0
        if op == "retype" and names:
            arrays[i] = _wrong_type_array(draw, n)
        elif op == "nulls" and names:
            arrays[i] = _with_null(draw, arrays[i])
        elif op == "dup" and names:
            names.append(names[i])
            arrays.append(arrays[i] if draw(st.booleans()) else _wrong_type_array(draw, n))
        elif op == "drop" and names:
            del names[i], arrays[i]
        elif op == "extra":
            names.append(draw(st.sampled_from(["ctx.x", "dense.y", "zzz", "ctx.", "dense.", "history", "label"])))
            arrays.append(_wrong_type_array(draw, n))
    good_metadata = {b"streamrec.schema": b"samples", b"streamrec.schema_version": b"1"}
    metadata = draw(st.sampled_from([good_metadata] * 6 + [
        None, {b"streamrec.schema": b"samples"},
        {b"streamrec.schema": b"samples", b"streamrec.schema_version": b"3"}, {b"streamrec.schema": b"x"}]))
    nullable = draw(st.booleans())
    schema = pa.schema([pa.field(nm, a.type, nullable=nullable or a.type == pa.null())
                        for nm, a in zip(names, arrays, strict=True)], metadata=metadata)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        rb = pa.RecordBatch.from_arrays(arrays, schema=schema)
        if n and draw(st.integers(0, 4)) == 0:  # a slice: list offsets that need not start at 0
            rb = rb.slice(draw(st.integers(0, n)))
        for _ in range(draw(st.sampled_from([1] * 8 + [0, 2]))):
            writer.write_batch(rb)
    raw = bytearray(sink.getvalue().to_pybytes())
    # Damage the body the way a broken producer would: offsets (negative, decreasing, past the values),
    # bytes that are not UTF-8, any flipped byte, a cut.
    hist = cols["history"]
    if n and draw(st.integers(0, 4)) == 0:
        old = np.asarray(hist.offsets, np.int32).tobytes()
        at = raw.rfind(old)
        if at >= 0:
            new = draw(st.one_of(
                st.lists(st.integers(-(2**31), 2**31 - 1), min_size=n + 1, max_size=n + 1),
                st.lists(st.integers(-3, 40), min_size=n + 1, max_size=n + 1)))
            raw[at:at + len(old)] = np.asarray(new, np.int32).tobytes()
    ids_ = [s.encode() for s in cols["impression_id"].to_pylist() if len(s.encode()) >= 2]
    if ids_ and draw(st.integers(0, 4)) == 0:
        old = draw(st.sampled_from(ids_))
        at = raw.rfind(old)
        if at >= 0:
            raw[at:at + 2] = draw(st.sampled_from([b"\xff\xfe", b"\xed\xa0", b"\xc0\x80", b"a\x80"]))
    for _ in range(draw(st.integers(0, 2))):
        if raw and draw(st.integers(0, 4)) == 0:
            j = draw(st.integers(0, len(raw) - 1))
            raw[j] ^= draw(st.integers(1, 255))
    if raw and draw(st.integers(0, 7)) == 0:
        del raw[draw(st.integers(1, len(raw))):]
    return bytes(raw)


def _ipc(names: list[str], arrays: list[pa.Array]) -> bytes:
    schema = pa.schema([pa.field(nm, a.type) for nm, a in zip(names, arrays, strict=True)],
                       metadata={b"streamrec.schema": b"samples", b"streamrec.schema_version": b"1"})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        writer.write_batch(pa.RecordBatch.from_arrays(arrays, schema=schema))
    return sink.getvalue().to_pybytes()


def _base(n: int = 2) -> tuple[list[str], list[pa.Array]]:
    b = _valid_samples(n).batch
    return list(b.schema.names), list(b.columns)


def test_sample_batch_regressions_are_bad_messages() -> None:
    # A duplicated column name made schema.field() / batch.column() raise KeyError.
    names, arrays = _base()
    for dup in ("label", "dense.price", "ctx.genres", "history"):
        with pytest.raises(BadMessage, match="more than once"):
            SampleBatch.decode(_ipc([*names, dup], [*arrays, arrays[names.index(dup)]]))
    # A null inside a list (the list itself not null) passed decode; to_tensors then raised ArrowInvalid.
    for col in ("history", "ctx.genres"):
        names, arrays = _base()
        i = names.index(col)
        arrays[i] = pa.array([[1, None], [2]], pa.list_(pa.int64()))
        with pytest.raises(BadMessage, match="nulls"):
            SampleBatch.decode(_ipc(names, arrays))
    # A zero-row list column whose one offset points past its (empty) values passes Arrow's full validation,
    # and flatten() on it aborts the whole process (a C++ check): the nulls-inside-lists check must not use it.
    empty = SampleBatch.from_columns(impression_id=[], ts=np.zeros(0), label=np.zeros(0), label_delay_ms=np.zeros(0),
                                     user_id=np.zeros(0), item_id=np.zeros(0), history=[])
    raw = bytearray(empty.encode())
    raw[-16:-12] = np.int32(2).tobytes()  # the last buffer before the end-of-stream marker: history's offsets
    assert list(pa.ipc.open_stream(pa.py_buffer(bytes(raw))))[0].column("history").offsets.to_pylist() == [2]
    assert decode_samples(bytes(raw)) is not None
    # A column name that is not UTF-8 (one flipped byte in the schema) made schema.names raise UnicodeDecodeError.
    for name in (b"history", b"ctx.genres", b"dense.price"):
        raw = bytearray(_valid_samples().encode())
        raw[raw.find(name)] = 0xE8
        with pytest.raises(BadMessage, match="not UTF-8"):
            SampleBatch.decode(bytes(raw))


@given(hostile_samples())
@fuzz(300)
def test_hostile_sample_batches_train_or_are_a_bad_message(raw: bytes) -> None:
    decode_samples(raw)


# -- Redis history entries ------------------------------------------------------------------------
history_entries = st.lists(st.one_of(
    st.builds(lambda t, i: f"{t}:{i}", st.integers(0, INT64 - 1), I64),  # well-formed
    st.builds(lambda t, i: f"{t}:{i}".encode(), st.integers(-(2**65), 2**65), st.integers(-(2**65), 2**65)),
    st.builds(lambda t, i: f"{t}:{i}", st.sampled_from(["", " 1", "+1", "1_0", "٣", "1.5", "0x1", "9" * 5000]),
              st.sampled_from(["", "1:2", "-0", " 7 ", "1e3", "9" * 4400, "\ud800"])),
    st.binary(max_size=30), st.text(any_chars, max_size=30), st.sampled_from([b"!wrongtype", b"", b":", "::"]),
    st.none(), st.integers(), st.lists(st.binary(max_size=4), max_size=2),
), max_size=30)


@example(["5:1", b"5:1", "3:2", "9" * 5000 + ":1", b"\xff:1", "\ud800:1", None])
@given(history_entries)
@fuzz(600)
def test_history_entries_parse_to_sorted_equal_length_lists(entries: list[Any]) -> None:
    times, items = _parse(entries)  # type: ignore[arg-type]
    assert len(times) == len(items)
    assert times == sorted(times)
    assert all(type(t) is int and 0 <= t < INT64 for t in times)
    assert all(type(i) is int and -INT64 <= i < INT64 for i in items)
    valid = set()
    for raw in entries:
        if isinstance(raw, bytes | str):
            e = _entry(raw)
            if e is not None:
                valid.add(e)
    assert set(zip(times, items, strict=True)) == valid and len(times) == len(valid)


# -- config files and settings --------------------------------------------------------------------
TOML_TOKENS = ["[kafka]", "[joiner]", "[learner]", "[[kafka]]", "[kafka.x]", "partitions", "bootstrap_servers",
               "batch_max", "attribution_window_s", "amp", "metrics_port", "exit_when_idle_s", "checkpoint_dir",
               "=", " = ", "\n", "1", "-1", "1e999", "inf", "-inf", "nan", "+nan", "1.5", "9" * 5000, "0x7f", "1_000",
               "true", "false", '"x"', "'x'", '"""a\nb"""', '"\\ud800"', '"\\u0000"', "[", "]", "{", "}", ",", ".",
               "a.b.c", "1979-05-27T07:32:00Z", "1979-05-27", "07:32:00", "#", "\r\n", "\\", '"', "[" * 600,
               "]" * 600, "{a=" * 300, "}" * 300, "\x00", "é"]
toml_text = st.one_of(st.text(max_size=200), st.text(st.characters(codec="utf-8"), max_size=50),
                      st.lists(st.sampled_from(TOML_TOKENS), max_size=30).map("".join))
SECTIONS = [(KafkaSettings, "kafka"), (JoinerSettings, "joiner"), (LearnerSettings, "learner")]


def _write(data: bytes) -> Path:
    fd, name = tempfile.mkstemp(suffix=".toml", prefix="fuzz-")
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    return Path(name)


def read_or_reject(data: bytes) -> dict[str, Any] | None:
    path = _write(data)
    try:
        return read_config_file(path)
    except SettingsError as exc:
        assert str(exc).strip()
        event("config file: SettingsError")
        return None
    finally:
        path.unlink()


# Regressions: nesting deeper than tomllib recurses raised RecursionError; bytes that are not UTF-8 raised
# UnicodeDecodeError; an integer of more than 4300 digits raised a ValueError that was no SettingsError.
@example("a = " + "[" * 2000 + "]" * 2000)
@example(b'a = "\xff"')
@example("a = " + "9" * 5000)
@example(b"\xef\xbb\xbfa = 1")
@given(st.one_of(toml_text, st.binary(max_size=100)))
@fuzz(300)
def test_any_config_text_reads_to_a_dict_or_a_settings_error(text: str | bytes) -> None:
    data = read_or_reject(text if isinstance(text, bytes) else text.encode())
    assert data is None or isinstance(data, dict)


def build_or_reject(cls: type, section: str, file_data: Any, environ: dict[str, str]) -> Any:
    try:
        out = build(cls, section, file_data, environ)
    except SettingsError as exc:
        assert str(exc).strip()
        event("build: SettingsError")
        return None
    assert isinstance(out, cls)
    event("build: settings")
    return out


def test_reading_a_directory_or_an_unreadable_path_is_a_settings_error(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="cannot be read"):
        read_config_file(tmp_path)


@given(toml_text)
@fuzz(200)
def test_config_files_build_settings_or_a_settings_error(text: str) -> None:
    data = read_or_reject(text.encode())
    if data is not None:
        for cls, section in SECTIONS:
            build_or_reject(cls, section, data, {})


toml_scalars = st.one_of(
    st.text(max_size=20), st.text(any_chars, max_size=5), st.booleans(), ints,
    st.sampled_from([10**4000, -(10**4000), 10**4299, -(10**4299), 2**1024]), floats,
    st.datetimes(), st.dates(), st.times(), st.datetimes(timezones=st.just(dt.timezone.utc)),
    st.sampled_from(["1e999", "nan", "inf", "-0", "none", "", "9" * 5000, "true", "0x10", "1_000", " 3 ", "٣"]))
toml_values = st.recursive(toml_scalars, lambda kids: st.one_of(
    st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=8), kids, max_size=4)), max_leaves=12)
env_values = st.one_of(st.text(max_size=20), st.text(any_chars, max_size=8), st.sampled_from(
    ["1e999", "-1e999", "nan", "inf", "-inf", "none", "null", "", " ", "9" * 5000, "1" * 4300, "0x10", "1_000",
     "3.0", "3.5", "true", "off", "٣", "1e308", "-0", "+7", "1__0", "_1"]))


def _section_strategies(cls: type, section: str) -> tuple[st.SearchStrategy, st.SearchStrategy]:
    names = [f.name for f in dataclasses.fields(cls)]
    prefix = f"STREAMREC_{section.upper()}_"
    key = st.one_of(st.sampled_from(names), st.text(max_size=12))
    env_key = st.one_of(st.sampled_from([prefix + n.upper() for n in names]), st.text(max_size=12).map(prefix.__add__),
                        st.text(max_size=12))
    return st.dictionaries(key, toml_values, max_size=4), st.dictionaries(env_key, env_values, max_size=4)


SECTION_STRATEGIES = {section: _section_strategies(cls, section) for cls, section in SECTIONS}


@st.composite
def settings_sources(draw: st.DrawFn) -> tuple[type, str, Any, dict[str, str]]:
    cls, section = draw(st.sampled_from(SECTIONS))
    tables, environs = SECTION_STRATEGIES[section]
    shape = draw(st.integers(0, 9))
    if shape == 0:
        file_data: Any = {section: draw(toml_values)}  # the section is not a table
    elif shape == 1:
        file_data = {}
    elif shape == 2:
        file_data = None
    else:
        file_data = {section: draw(tables), draw(st.text(max_size=6)): draw(toml_values)}
    return cls, section, file_data, draw(environs)


# Regressions: a huge int for a float setting raised OverflowError; a table, array or date for a number
# raised TypeError; the message of an int too long to print raised ValueError while it was being built.
@example((KafkaSettings, "kafka", {"kafka": {"partitions": {"a": 1}}}, {}))
@example((KafkaSettings, "kafka", {"kafka": {"session_timeout_ms": [1]}}, {}))
@example((JoinerSettings, "joiner", {"joiner": {"attribution_window_s": 10**400}}, {}))
@example((JoinerSettings, "joiner", {"joiner": {"allowed_lateness_s": dt.date(2020, 1, 1)}}, {}))
@example((KafkaSettings, "kafka", {"kafka": {"client_id": 10**5000}}, {}))
@example((LearnerSettings, "learner", {"learner": {"amp": 10**5000}}, {}))
@example((LearnerSettings, "learner", {"learner": 10**5000}, {}))
@example((LearnerSettings, "learner", {"learner": {"checkpoint_dir": {"a": [1]}}}, {}))
@example((KafkaSettings, "kafka", {}, {"STREAMREC_KAFKA_PARTITIONS": "9" * 5000}))
@given(settings_sources())
@fuzz(400)
def test_any_toml_tables_and_environment_build_settings_or_an_error(src: tuple[type, str, Any, dict[str, str]],
                                                                    ) -> None:
    cls, section, file_data, environ = src
    build_or_reject(cls, section, file_data, environ)


# -- strike stores --------------------------------------------------------------------------------
def check_strikes(loaded: Any) -> None:
    assert isinstance(loaded, dict)
    for key, value in loaded.items():
        topic, partition, offset = key
        assert type(topic) is str and type(partition) is int and type(offset) is int
        n, error = value
        assert type(n) is int and type(error) is str


strike_fields = st.one_of(st.builds(lambda t, p, o: f"{t}:{p}:{o}".encode(), st.text(max_size=8), ints, ints),
                          st.binary(max_size=20),
                          st.sampled_from([b"", b":", b"a:1", b"a:b:c", b"::", b"a:1:" + b"9" * 5000]))
strike_values = st.one_of(st.builds(lambda n, e: f"{n} {e}".encode("utf-8", "surrogatepass"), ints, st.text(any_chars)),
                          st.binary(max_size=20), st.sampled_from([b"", b" ", b"1", b"x y", b"9" * 5000 + b" e"]))


@given(st.dictionaries(strike_fields, strike_values, max_size=6))
@fuzz(200)
def test_redis_strikes_load_any_hash(redis_client: redis.Redis, contents: dict[bytes, bytes]) -> None:
    key = f"test-fuzz-strikes-{uuid.uuid4().hex}"
    store = RedisStrikes(redis_client, key)
    try:
        if contents:
            redis_client.hset(key, mapping=contents)
        good = {("t", 1, k): (k + 1, f"e{k}") for k in range(2)}  # written by save: must survive the garbage
        store.save(good, [])
        loaded = store.load()
        check_strikes(loaded)
        assert all(loaded[k] == v for k, v in good.items())
    finally:
        redis_client.delete(key)


strike_json = st.recursive(
    st.one_of(st.none(), st.booleans(), ints, floats, st.text(max_size=10), raw_numbers),
    lambda kids: st.one_of(st.lists(kids, max_size=4),
                           st.lists(st.tuples(st.one_of(st.just("t:0:1"), strike_fields.map(
                               lambda b: b.decode("utf-8", "replace")), st.text(max_size=6)), kids),
                                    max_size=4).map(Obj)),
    max_leaves=12)


# Regressions: Infinity as a count raised OverflowError; nesting deeper than the json module recurses raised
# RecursionError.
@example(b'{"t:0:1": [Infinity, "x"]}')
@example(b'{"t:0:1": [1e999, "x"]}')
@example(b"[" * 100_000 + b"]" * 100_000)
@example(b'{"t:0:1": [' + b"[" * 100_000 + b"]" * 100_000 + b', "x"]}')
@given(st.one_of(st.binary(max_size=200), strike_json.map(encode), st.builds(encode, strike_json, st.just(False))))
@fuzz(200)
def test_file_strikes_load_any_file(raw: bytes) -> None:
    path = _write(raw)
    try:
        store = FileStrikes(path)
        check_strikes(store.load())
        store.save({("t", 0, 2): (1, "x")}, [])  # a damaged file is replaced, never a reason to stop
        assert FileStrikes(path).load()[("t", 0, 2)] == (1, "x")
    finally:
        path.unlink(missing_ok=True)
        path.with_name(path.name + ".tmp").unlink(missing_ok=True)

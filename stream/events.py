"""Impression and click events: the JSON schema on the ``impressions`` and ``clicks`` topics.

One event per Kafka message, key = ``impression_id`` (so impressions and clicks are co-partitioned): a message keyed
otherwise is rejected (``key_mismatch``, :func:`check_key`); an unkeyed one is accepted.

Impression, schema version 1::

    {"schema_version": 1, "impression_id": "ml-1m-000000042", "ts": 978300760000,
     "user_id": "1m_1", "item_id": 1193,
     "context": {"gender": "F", "age": 1, "genres": ["Drama"]},      # optional
     "dense": {"price": 3.5}}                                          # optional

Click, schema version 1::

    {"schema_version": 1, "impression_id": "ml-1m-000000042", "ts": 978300790000}

``ts`` is event time in milliseconds since the epoch. Ids are non-negative 64-bit integers or
non-empty strings. Context values are strings, integers, finite floats, booleans, or lists of
strings/integers (multi-valued fields such as genres). Dense values are numbers with |x| < 2**64
(``stream.limits.DENSE_BOUND``, the bound of every stage).
Unknown fields and duplicate keys are rejected: add fields in a new schema version. Sizes, key counts,
string and list lengths and how far ``ts`` may lead the message's broker timestamp are bounded by
:class:`~stream.limits.EventLimits`.

Integers are read as written: an integer literal outside int64 (whatever its size: orjson reads one within 64 bits
unsigned as an int and one beyond as a float) is rejected in an id, ``ts``, ``schema_version`` and a context value,
and shown as written in the reason; in ``dense`` it is a number like any other (kept exact, the ``|x|`` bound
applies). Only a message whose parsed values hold a float of magnitude >= 2**63 is parsed again, with the
standard library (exact integers), to tell an integer literal from a float one (``1e19`` stays a float).

:func:`decode_impression` / :func:`decode_click` raise :class:`~stream.errors.ValidationError`
(field, value, expected) or :class:`~stream.errors.BadMessage` (not JSON); callers dead-letter those.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from stream.errors import BadMessage, ValidationError, quoted, shown
from stream.limits import DEFAULT_LIMITS, DENSE_BOUND, EventLimits

SCHEMA_VERSION = 1
SUPPORTED_VERSIONS = frozenset({1})

MAX_ID = 2**63 - 1
# 2100-01-01T00:00:00Z in ms: anything later is a unit mistake (microseconds, nanoseconds).
MAX_TS_MS = 4_102_444_800_000

Id = int | str
ContextValue = str | int | float | bool | list


# An event is a value: nothing changes one once decoded. Not a ``frozen`` dataclass all the same (unlike Click): a
# frozen dataclass's __init__ sets each field through object.__setattr__ (~0.8 us for an Impression against ~0.15 us),
# the joiner's decoder builds one per message, and its dict fields made it unhashable anyway.
@dataclass(slots=True)
class Impression:
    impression_id: str
    ts: int
    user_id: Id
    item_id: Id
    context: dict[str, ContextValue] = field(default_factory=dict)
    dense: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "impression_id": self.impression_id,
            "ts": self.ts,
            "user_id": self.user_id,
            "item_id": self.item_id,
        }
        if self.context:
            out["context"] = self.context
        if self.dense:
            out["dense"] = self.dense
        return out

    def encode(self) -> bytes:
        return orjson.dumps(self.to_json())


@dataclass(frozen=True, slots=True)
class Click:
    impression_id: str
    ts: int

    def to_json(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, "impression_id": self.impression_id, "ts": self.ts}

    def encode(self) -> bytes:
        return orjson.dumps(self.to_json())


_IMPRESSION_FIELDS = frozenset({"schema_version", "impression_id", "ts", "user_id", "item_id", "context", "dense"})
_CLICK_FIELDS = frozenset({"schema_version", "impression_id", "ts"})
# A real closing quote (an even number of backslashes before it) followed by a colon ends a JSON key.
_KEY_END = re.compile(rb'(?<!\\)(?:\\\\)*"\s*:')


_BIG = 2.0**63  # a float this large may be an integer literal orjson could not hold


class _Inexact(Exception):
    """A checked value is a float of magnitude >= 2**63, maybe an integer literal orjson read as a float:
    :func:`exactly` parses the text again with exact integers (it catches every one raised under it)."""


def _load(raw: bytes | None, limits: EventLimits) -> dict[str, Any]:
    if raw is None:
        raise BadMessage("message has no value (tombstone)", kind="empty")
    if len(raw) > limits.max_message_bytes:
        raise BadMessage(f"message is {len(raw)} bytes, over the limit of {limits.max_message_bytes} "
                         "([limits] max_message_bytes)", kind="too_large")
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadMessage(f"not valid JSON: {quoted(str(exc), 160)}", kind="bad_json") from None
    if not isinstance(obj, dict):
        raise BadMessage(f"expected a JSON object, got {type(obj).__name__}", kind="bad_json")
    return obj


def _version(obj: dict[str, Any]) -> None:
    version = obj.get("schema_version")
    # type first: a list or an object is unhashable, so ``in`` a frozenset would raise TypeError
    if isinstance(version, bool) or not isinstance(version, int | float) or version not in SUPPORTED_VERSIONS:
        raise ValidationError("schema_version", version, f"one of {sorted(SUPPORTED_VERSIONS)}")


def exactly(raw: bytes | None, obj: Any, build: Any, *args: Any) -> Any:
    """``build(obj, False, *args)``; where that meets a float of magnitude >= 2**63 (:class:`_Inexact`, or a
    :class:`ValidationError` whose value is or lists one), ``build`` of ``raw`` parsed again keeping integers exact,
    so an integer literal past int64 is rejected (or, in ``dense``, kept) as written. Costs nothing otherwise.
    ``obj``: ``orjson.loads(raw)``; ``build(obj, exact, *args)`` passes ``exact`` to :func:`check_context` and
    :func:`check_dense` and raises :class:`ValidationError` (the event decoders; serving's request parser too)."""
    try:
        return build(obj, False, *args)
    except (ValidationError, _Inexact) as exc:
        v = getattr(exc, "value", None)
        if isinstance(exc, ValidationError) and not (type(v) is float and abs(v) >= _BIG or type(v) is list and any(
                type(x) is float and abs(x) >= _BIG for x in v)):
            raise
    try:
        exact = json.loads(raw)  # type: ignore[arg-type]  # not None: orjson parsed it
    except (ValueError, RecursionError):  # orjson took it; deeper than the stdlib parser goes: floats stay floats
        exact = obj
    return build(exact, True, *args)


def _no_space_after_quote(raw: bytes) -> bool:
    """No JSON whitespace right after any ``"``: then every key ends in ``":`` exactly, so ``raw.count(b'":')`` bounds
    the key ends (a string value holding a colon, a title such as ``"Alien: Resurrection"``, adds none), ~0.3 us
    against ~9 us for the regex."""
    return b'" ' not in raw and b'"\n' not in raw and b'"\t' not in raw and b'"\r' not in raw


def _reject_duplicate_keys(raw: bytes, obj: dict[str, Any]) -> None:
    """JSON parsers keep the last of duplicate keys silently; an event with two values for one field is
    ambiguous, so it is rejected (:func:`reject_duplicate_keys`, with the event's keys counted: its own, its
    context's and its dense's)."""
    keys = len(obj) + sum(len(v) for name in ("context", "dense") if type(v := obj.get(name)) is dict)
    reject_duplicate_keys(raw, keys)


def count_keys(value: Any) -> int:
    """The keys of every JSON object in a parsed JSON value, at any depth (a loop, not recursion: any nesting orjson
    accepts)."""
    n, todo = 0, [value]
    pop, push = todo.pop, todo.append
    while todo:
        v = pop()
        if type(v) is dict:
            n += len(v)
            v = v.values()
        elif type(v) is not list:
            continue  # a scalar (only the top-level value can be one here)
        for x in v:
            t = type(x)
            if t is dict or t is list:
                push(x)
    return n


def reject_duplicate_keys(raw: bytes, keys: int) -> None:
    """Raise :class:`BadMessage` (``duplicate_key``) if any JSON object in ``raw`` repeats a key. ``keys``: how many
    keys its parsed objects hold (:func:`count_keys`; a parser keeps one per repeated name). Fast path: each key ends
    in ``":``, so when the raw text holds no more key ends than the parsed objects hold keys, no key repeats.
    Otherwise (a string value that holds a colon, or a real duplicate) the text is parsed once more, pair by pair."""
    if raw.count(b":") <= keys or (_no_space_after_quote(raw) and raw.count(b'":') <= keys) or \
            len(_KEY_END.findall(raw)) <= keys:  # colons bound key ends: ~0.1 us vs ~15
        return

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for k, v in items:
            if k in seen:
                raise BadMessage(f"duplicate key {shown(k)} in a JSON object", kind="duplicate_key")
            seen[k] = v
        return seen

    try:
        json.loads(raw, object_pairs_hook=pairs)
    except (ValueError, RecursionError):  # orjson accepted it; a stricter parser's quibbles are not ours
        return


def _check_fields(obj: dict[str, Any], allowed: frozenset[str], required: tuple[str, ...]) -> None:
    for name in required:
        if name not in obj:
            raise ValidationError(name, None, "a value (field is required)")
    extra = obj.keys() - allowed
    if extra:
        name = sorted(extra)[0]
        raise ValidationError(name, obj[name], f"no such field in schema v{SCHEMA_VERSION}")


def _impression_id(value: Any, limits: EventLimits = DEFAULT_LIMITS) -> str:
    if not isinstance(value, str) or not value or len(value) > limits.max_str_len:
        raise ValidationError("impression_id", value, f"a non-empty string of at most {limits.max_str_len} chars")
    return value


def ts_bound_ms(broker_ts_ms: int | None, now_ms: int) -> int:
    """The time an event's ``ts`` may lead by at most ``future_ts_s``: its message's broker timestamp, never later
    than this machine's wall clock ``now_ms``. A CreateTime is the producer's own (the broker keeps it unless the
    topic uses LogAppendTime, and Kafka before 4.0 accepts any by default): a producer whose clock was years ahead
    stamped message and ``ts`` alike and passed the bound, and a quorum of its events moved the partition's event
    time there for good (every later impression a negative at once, every click late). A message is read after it
    was written, so a timestamp ahead of the reader's clock is a wrong clock's. A message without one (<= 0: -1 is
    NOT_AVAILABLE, as the drivers pass it) is bounded by the wall clock alone, where it was not bounded at all;
    ``None`` is no message (an event decoded on its own): no bound."""
    if broker_ts_ms is None:
        return MAX_TS_MS
    return now_ms if broker_ts_ms <= 0 else min(broker_ts_ms, now_ms)


def _ts(value: Any, broker_ts_ms: int | None, limits: EventLimits) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TS_MS:
        raise ValidationError("ts", value, f"an integer of milliseconds since the epoch in [0, {MAX_TS_MS}]")
    bound = ts_bound_ms(broker_ts_ms, int(time.time() * 1000))
    if value > bound + limits.future_ts_ms:
        # the clock's lead is not stated: it changes by the millisecond, and a reason must not (the batch decoder's)
        lead = (f"{value - bound} ms ahead of the message's broker timestamp {broker_ts_ms}" if bound == broker_ts_ms
                else f"ahead of this machine's clock (which bounds it: the message's broker timestamp {broker_ts_ms} "
                "is later or none)")
        raise BadMessage(
            f"field 'ts': {value} is {lead}; at most {limits.future_ts_ms} ms ({limits.future_ts_s:g} s) is allowed "
            "([limits] future_ts_s): the producer's clock or time unit is wrong", kind="future_ts")
    return value


def check_id(name: str, value: Any, limits: EventLimits = DEFAULT_LIMITS) -> Id:
    if isinstance(value, bool):
        raise ValidationError(name, value, "a non-negative 64-bit integer or a non-empty string")
    if isinstance(value, int):
        if not 0 <= value <= MAX_ID:
            raise ValidationError(name, value, f"an integer in [0, {MAX_ID}]")
        return value
    if isinstance(value, str) and value and len(value) <= limits.max_str_len:
        return value
    raise ValidationError(name, value, f"a non-negative 64-bit integer or a non-empty string (<= {limits.max_str_len})")


def all_ids(values: list[Any], limits: EventLimits = DEFAULT_LIMITS) -> bool:
    """True when :func:`check_id` accepts every one of ``values`` as it is: one pass with no call per value, for a
    list of ids on a hot path (serving's 100 candidates per request); False sends the caller to ``check_id`` for
    each value, which says which one is wrong and why."""
    max_str = limits.max_str_len
    for v in values:
        t = type(v)
        if t is int:
            if not 0 <= v <= MAX_ID:
                return False
        elif t is not str or not v or len(v) > max_str:
            return False
    return True


def _scalar_ok(v: Any, max_str: int) -> bool:
    t = type(v)
    if t is str:
        return len(v) <= max_str
    if t is int:
        return -(2**63) <= v <= MAX_ID
    if t is float:
        return -_BIG < v < _BIG  # finite, and not maybe an integer literal past int64 (check_context looks closer)
    return t is bool


def _list_ok(v: list, limits: EventLimits) -> bool:
    if len(v) > limits.max_list_len:
        return False
    max_str = limits.max_str_len
    for x in v:
        t = type(x)
        if t is str:
            if len(x) > max_str:
                return False
        elif t is not int or not -(2**63) <= x <= MAX_ID:
            return False
    return True


def _check_keys(value: dict, field: str, max_keys: int, limits: EventLimits) -> None:
    if len(value) > max_keys:
        raise BadMessage(f"field {field!r} has {len(value)} keys, over the limit of {max_keys} ([limits])",
                         kind="too_many_keys")
    for k in value:
        if not k or len(k) > limits.max_key_len:
            raise ValidationError(f"{field} key", k, f"a non-empty name of at most {limits.max_key_len} chars")


def check_context(value: Any, field: str = "context", limits: EventLimits = DEFAULT_LIMITS,
                  exact: bool = True) -> dict[str, ContextValue]:
    """A context object (events, and serving requests: ``field`` names it in the error). ``exact=False``: ``value``
    is orjson's, whose float of magnitude >= 2**63 may be an integer literal past int64: such a float raises
    :class:`_Inexact` (:func:`exactly` parses the text again)."""
    if value is None:
        return {}
    if type(value) is not dict:
        raise ValidationError(field, value, "an object of feature name -> value")
    _check_keys(value, field, limits.max_context_keys, limits)
    for k, v in value.items():
        if type(v) is list:
            if not _list_ok(v, limits):
                raise ValidationError(f"{field}.{k}", v, f"a list of at most {limits.max_list_len} strings/integers "
                                      f"(strings of at most {limits.max_str_len} chars)")
        elif not _scalar_ok(v, limits.max_str_len):
            if type(v) is float and math.isfinite(v):
                if exact:
                    continue
                raise _Inexact
            raise ValidationError(f"{field}.{k}", v, f"a string (<= {limits.max_str_len} chars), 64-bit integer, "
                                  "finite float, boolean or list")
    return value


DENSE_RULE = "a finite number with |x| < 2**64 (~1.8e19; dense features must be scaled)"


def check_dense(value: Any, field: str = "dense", limits: EventLimits = DEFAULT_LIMITS,
                exact: bool = True) -> dict[str, float]:
    """A dense-features object: name -> number, ``|x| < DENSE_BOUND`` (~2**64: the bound of every stage).
    ``exact=False``: as in :func:`check_context` (a float of magnitude >= 2**63 raises :class:`_Inexact`)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValidationError(field, value, "an object of feature name -> finite number")
    _check_keys(value, field, limits.max_dense_keys, limits)
    for k, v in value.items():
        if not exact and type(v) is float and not -_BIG < v < _BIG and math.isfinite(v):
            raise _Inexact
        # abs(float(v)): every stage reads an integer through float64 (orjson, numpy), which may round it up to the
        # bound (2**64 - 2**39 - 1 becomes 2**64 - 2**39, then 2**64 as float32); abs(v) first: float() of a huge
        # integer overflows
        if isinstance(v, bool) or not isinstance(v, int | float) or not (abs(v) < DENSE_BOUND and
                                                                         abs(float(v)) < DENSE_BOUND):
            raise ValidationError(f"{field}.{k}", v, DENSE_RULE)
    return value


def check_key(key: bytes | None, impression_id: str) -> None:
    """The message's Kafka key is its event's ``impression_id`` (UTF-8) or absent. Both topics are keyed by
    impression_id so that an impression and its clicks share a partition; a message keyed otherwise can put the
    impression and its click on different partitions (the impression becomes a negative, its click an orphan), so it
    is a ``key_mismatch`` dead letter. No key (``None``) is accepted: one partition, or a producer that picks the
    partition itself; with several partitions a producer must key by impression_id."""
    if key is not None and key != impression_id.encode():
        raise BadMessage(f"message key {shown(key)} is not the event's impression_id {shown(impression_id)}: both "
                         "topics are keyed by impression_id (co-partitioned); key each message by it",
                         kind="key_mismatch")


def _impression(obj: dict[str, Any], exact: bool, limits: EventLimits, broker_ts_ms: int | None) -> Impression:
    _version(obj)
    _check_fields(obj, _IMPRESSION_FIELDS, ("impression_id", "ts", "user_id", "item_id"))
    return Impression(
        impression_id=_impression_id(obj["impression_id"], limits),
        ts=_ts(obj["ts"], broker_ts_ms, limits),
        user_id=check_id("user_id", obj["user_id"], limits),
        item_id=check_id("item_id", obj["item_id"], limits),
        context=check_context(obj.get("context"), limits=limits, exact=exact),
        dense=check_dense(obj.get("dense"), limits=limits, exact=exact),
    )


def _click(obj: dict[str, Any], exact: bool, limits: EventLimits, broker_ts_ms: int | None) -> Click:
    _version(obj)
    _check_fields(obj, _CLICK_FIELDS, ("impression_id", "ts"))
    return Click(_impression_id(obj["impression_id"], limits), _ts(obj["ts"], broker_ts_ms, limits))


def decode_impression(raw: bytes | None, limits: EventLimits = DEFAULT_LIMITS,
                      broker_ts_ms: int | None = None, key: bytes | None = None) -> Impression:
    """One ``impressions`` message. ``broker_ts_ms``: the message's timestamp, which bounds how far in the
    future ``ts`` may be (``limits.future_ts_s``; capped at the wall clock, which alone bounds it where the message
    has none, -1; ``None``, no message, skips the check: :func:`ts_bound_ms`). ``key``: the message's key, checked
    last (:func:`check_key`)."""
    imp: Impression = exactly(raw, obj := _load(raw, limits), _impression, limits, broker_ts_ms)
    _reject_duplicate_keys(raw, obj)  # type: ignore[arg-type]
    check_key(key, imp.impression_id)
    return imp


def decode_click(raw: bytes | None, limits: EventLimits = DEFAULT_LIMITS, broker_ts_ms: int | None = None,
                 key: bytes | None = None) -> Click:
    click: Click = exactly(raw, obj := _load(raw, limits), _click, limits, broker_ts_ms)
    _reject_duplicate_keys(raw, obj)  # type: ignore[arg-type]
    check_key(key, click.impression_id)
    return click

"""Impression and click events: the JSON schema on the ``impressions`` and ``clicks`` topics.

One event per Kafka message, key = ``impression_id`` (so impressions and clicks are co-partitioned).

Impression, schema version 1::

    {"schema_version": 1, "impression_id": "ml-1m-000000042", "ts": 978300760000,
     "user_id": "1m_1", "item_id": 1193,
     "context": {"gender": "F", "age": 1, "genres": ["Drama"]},      # optional
     "dense": {"price": 3.5}}                                          # optional

Click, schema version 1::

    {"schema_version": 1, "impression_id": "ml-1m-000000042", "ts": 978300790000}

``ts`` is event time in milliseconds since the epoch. Ids are non-negative 64-bit integers or
non-empty strings. Context values are strings, integers, finite floats, booleans, or lists of
strings/integers (multi-valued fields such as genres). Dense values are finite numbers.
Unknown fields are rejected: add them in a new schema version.

:func:`decode_impression` / :func:`decode_click` raise :class:`~stream.errors.ValidationError`
(field, value, expected) or :class:`~stream.errors.BadMessage` (not JSON); callers dead-letter those.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import orjson

from stream.errors import BadMessage, ValidationError

SCHEMA_VERSION = 1
SUPPORTED_VERSIONS = frozenset({1})

MAX_ID = 2**63 - 1
MAX_STR_ID_LEN = 256
MAX_LIST_LEN = 1024
# 2100-01-01T00:00:00Z in ms: anything later is a unit mistake (microseconds, nanoseconds).
MAX_TS_MS = 4_102_444_800_000

Id = int | str
ContextValue = str | int | float | bool | list


@dataclass(frozen=True, slots=True)
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


def _load(raw: bytes | None) -> dict[str, Any]:
    if raw is None:
        raise BadMessage("message has no value (tombstone)", kind="empty")
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadMessage(f"not valid JSON: {exc}", kind="bad_json") from None
    if not isinstance(obj, dict):
        raise BadMessage(f"expected a JSON object, got {type(obj).__name__}", kind="bad_json")
    version = obj.get("schema_version")
    if version not in SUPPORTED_VERSIONS or isinstance(version, bool):
        raise ValidationError("schema_version", version, f"one of {sorted(SUPPORTED_VERSIONS)}")
    return obj


def _check_fields(obj: dict[str, Any], allowed: frozenset[str], required: tuple[str, ...]) -> None:
    for name in required:
        if name not in obj:
            raise ValidationError(name, None, "a value (field is required)")
    extra = obj.keys() - allowed
    if extra:
        name = sorted(extra)[0]
        raise ValidationError(name, obj[name], f"no such field in schema v{SCHEMA_VERSION}")


def _impression_id(value: Any) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_STR_ID_LEN:
        raise ValidationError("impression_id", value, f"a non-empty string of at most {MAX_STR_ID_LEN} chars")
    return value


def _ts(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TS_MS:
        raise ValidationError("ts", value, f"an integer of milliseconds since the epoch in [0, {MAX_TS_MS}]")
    return value


def check_id(name: str, value: Any) -> Id:
    if isinstance(value, bool):
        raise ValidationError(name, value, "a non-negative 64-bit integer or a non-empty string")
    if isinstance(value, int):
        if not 0 <= value <= MAX_ID:
            raise ValidationError(name, value, f"an integer in [0, {MAX_ID}]")
        return value
    if isinstance(value, str) and value and len(value) <= MAX_STR_ID_LEN:
        return value
    raise ValidationError(name, value, f"a non-negative 64-bit integer or a non-empty string (<= {MAX_STR_ID_LEN})")


def _scalar_ok(v: Any) -> bool:
    t = type(v)
    if t is str:
        return len(v) <= MAX_STR_ID_LEN
    if t is int:
        return -(2**63) <= v <= MAX_ID
    if t is float:
        return math.isfinite(v)
    return t is bool


def _list_ok(v: list) -> bool:
    if len(v) > MAX_LIST_LEN:
        return False
    for x in v:
        t = type(x)
        if t is str:
            if len(x) > MAX_STR_ID_LEN:
                return False
        elif t is not int or not -(2**63) <= x <= MAX_ID:
            return False
    return True


def check_context(value: Any, field: str = "context") -> dict[str, ContextValue]:
    """A context object (events, and serving requests: ``field`` names it in the error)."""
    if value is None:
        return {}
    if type(value) is not dict:
        raise ValidationError(field, value, "an object of feature name -> value")
    for k, v in value.items():
        if type(v) is list:
            if not _list_ok(v):
                raise ValidationError(f"{field}.{k}", v, f"a list of at most {MAX_LIST_LEN} strings/integers")
        elif not _scalar_ok(v):
            raise ValidationError(f"{field}.{k}", v, "a string, 64-bit integer, finite float, boolean or list")
    return value


def check_dense(value: Any, field: str = "dense") -> dict[str, float]:
    """A dense-features object: name -> finite number."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValidationError(field, value, "an object of feature name -> finite number")
    for k, v in value.items():
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise ValidationError(f"{field}.{k}", v, "a finite number")
    return value


def decode_impression(raw: bytes | None) -> Impression:
    obj = _load(raw)
    _check_fields(obj, _IMPRESSION_FIELDS, ("impression_id", "ts", "user_id", "item_id"))
    return Impression(
        impression_id=_impression_id(obj["impression_id"]),
        ts=_ts(obj["ts"]),
        user_id=check_id("user_id", obj["user_id"]),
        item_id=check_id("item_id", obj["item_id"]),
        context=check_context(obj.get("context")),
        dense=check_dense(obj.get("dense")),
    )


def decode_click(raw: bytes | None) -> Click:
    obj = _load(raw)
    _check_fields(obj, _CLICK_FIELDS, ("impression_id", "ts"))
    return Click(impression_id=_impression_id(obj["impression_id"]), ts=_ts(obj["ts"]))

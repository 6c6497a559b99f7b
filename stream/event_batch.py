"""Many event messages decoded and validated at once, as columns: the joiner's decode step.

The rules are :mod:`stream.events`' and nothing else: :func:`decode_events` gives, for each message, exactly
what :func:`~stream.events.decode_impression` / :func:`~stream.events.decode_click` would return for it, or the
:class:`~stream.errors.BadMessage` it would raise (same reason, same ``kind``). How:

1. each message is parsed (``orjson.loads``, one C call each);
2. a block of rows is checked column by column, each check one C-level pass over a column (``set(map(type,
   col))``, ``min``/``max`` of lengths and integers, a magnitude bound over floats, one NumPy comparison for the
   broker-timestamp bound, list equality of the message keys with the ids' UTF-8) that accepts only what the
   per-event rules accept;
3. a block that fails a check is halved until the rows that fail are alone; those rows (and only those) go
   through the per-event decoder, which raises their exact reason (or accepts a row the fast checks were merely
   too strict for: a ``schema_version`` of ``1.0``, say). Good rows never pay for a bad neighbour beyond
   a few halvings.

A float of magnitude >= 2**63 in a context or dense value (maybe an integer literal orjson could not hold, which
:mod:`stream.events` tells apart by the text) fails the fast checks: such a row takes the per-event decoder.

Duplicate keys: as in :mod:`stream.events`, a row whose text holds no more ``":`` than its parsed objects hold
keys cannot repeat a key; the rest (a string value holding a colon) take the per-event duplicate-key check.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from itertools import chain, compress, repeat
from operator import eq, is_, itemgetter, or_
from typing import Any, cast

import numpy as np
import orjson

from stream.errors import BadMessage
from stream.events import (
    MAX_ID,
    MAX_TS_MS,
    SUPPORTED_VERSIONS,
    Click,
    Impression,
    _reject_duplicate_keys,
    decode_click,
    decode_impression,
)
from stream.limits import DEFAULT_LIMITS, DENSE_BOUND, EventLimits

Decoded = Impression | Click | BadMessage

_IMPRESSION_KEYS = frozenset({"schema_version", "impression_id", "ts", "user_id", "item_id", "context", "dense"})
_IMPRESSION_REQUIRED = frozenset({"schema_version", "impression_id", "ts", "user_id", "item_id"})
_CLICK_KEYS = frozenset({"schema_version", "impression_id", "ts"})
_MIN_BLOCK = 4  # a failing block this small goes row by row
_INT64_MIN = -(2**63)
_BIG = 2.0**63  # a float this large may be an integer literal past int64 (stream.events decides, from the text)
_NONE = type(None)
_SV, _ID, _TS = itemgetter("schema_version"), itemgetter("impression_id"), itemgetter("ts")
_USER, _ITEM = itemgetter("user_id"), itemgetter("item_id")


class _Reject(Exception):
    """A block failed a fast check: halve it (never leaves this module)."""


def decode_events(values: Sequence[bytes | None], broker_ts: Sequence[int | None], clicks: bool,
                  limits: EventLimits = DEFAULT_LIMITS, keys: Sequence[bytes | None] | None = None) -> list[Decoded]:
    """One topic's messages -> per message its event or why it is bad (see the module docstring).
    ``broker_ts[i]``: message i's broker timestamp (ms) or None, as the per-event decoders take it; ``keys[i]``:
    its Kafka key or None (``stream.events.check_key``); ``keys=None``: no key is checked."""
    out: list[Decoded] = [None] * len(values)  # type: ignore[list-item]
    _block(values, broker_ts, [None] * len(values) if keys is None else keys, 0, len(values), clicks, limits, out)
    return out


def _block(values: Sequence[bytes | None], broker_ts: Sequence[int | None], keys: Sequence[bytes | None], lo: int,
           hi: int, clicks: bool, limits: EventLimits, out: list[Decoded]) -> None:
    if lo >= hi:
        return
    if hi - lo > _MIN_BLOCK or hi - lo == len(values):
        try:
            out[lo:hi] = _fast(values[lo:hi], broker_ts[lo:hi], keys[lo:hi], clicks, limits)
            return
        except (_Reject, TypeError, ValueError, OverflowError, AttributeError, KeyError):
            pass  # a row breaks a fast check (or its assumptions): find it
        if hi - lo > _MIN_BLOCK:
            mid = (lo + hi) // 2
            _block(values, broker_ts, keys, lo, mid, clicks, limits, out)
            _block(values, broker_ts, keys, mid, hi, clicks, limits, out)
            return
    decode = decode_click if clicks else decode_impression
    for i in range(lo, hi):
        try:
            out[i] = decode(values[i], limits, broker_ts[i], keys[i])
        except BadMessage as exc:
            out[i] = exc


def _check(ok: bool) -> None:
    if not ok:
        raise _Reject


def _ints_in(col: list, lo: int, hi: int) -> None:
    """Every element of ``col`` (all exactly ``int``) in ``[lo, hi]``."""
    _check(not col or (min(col) >= lo and max(col) <= hi))


def _lengths_in(col: list, lo: int, hi: int) -> None:
    _check(not col or (min(map(len, col)) >= lo and max(map(len, col)) <= hi))


def _ids(col: list, limits: EventLimits) -> None:
    """``stream.events.check_id`` over a column: ints in [0, MAX_ID] or non-empty strings of at most max_str_len."""
    types = set(map(type, col))
    if types == {int}:
        _ints_in(col, 0, MAX_ID)
        return
    _check(types <= {int, str})
    kinds = list(map(type, col))
    _ints_in(_of_type(col, kinds, int), 0, MAX_ID)
    _lengths_in(_of_type(col, kinds, str), 1, limits.max_str_len)


def _of_type(values: list, kinds: list[type], t: type) -> list:
    """The elements of ``values`` whose type (``kinds[i]``, exactly) is ``t``, in one C-level pass."""
    return list(compress(values, map(is_, kinds, repeat(t))))


def _named_objects(col: list, max_keys: int, limits: EventLimits) -> tuple[list[dict], set[tuple[str, ...]]]:
    """The non-empty dicts of an optional object field (None: absent) and their distinct key lists, the key counts
    and key lengths checked once per distinct key list."""
    types = set(map(type, col))
    _check(types <= {dict, _NONE})
    objs = list(filter(None, col))  # the non-empty ones
    shapes = set(map(tuple, objs))
    if shapes:
        _check(max(map(len, shapes)) <= max_keys)
        _lengths_in(list(chain.from_iterable(shapes)), 1, limits.max_key_len)
    return objs, shapes


def _context_values(objs: list[dict], shapes: set[tuple[str, ...]], limits: EventLimits) -> None:
    """``stream.events.check_context``'s value rules over every value of every context (``objs``, whose distinct key
    lists are ``shapes``) at once. Where every context has the same keys (the usual stream), column by column: a
    column is mostly of one type, checked in one pass."""
    if len(shapes) == 1 and len(next(iter(shapes))) > 1:  # dict order is key order: the values zip into columns
        for column in zip(*map(dict.values, objs), strict=True):
            _values(list(column), limits)
    else:
        _values(list(chain.from_iterable(map(dict.values, objs))), limits)


def _values(values: list, limits: EventLimits) -> None:
    """Context values (of any keys) checked by type, each type's check one C-level pass."""
    types = set(map(type, values))
    _check(types <= {str, int, float, bool, list})
    by_type = {t: values for t in types} if len(types) == 1 else _by_type(values, types)
    _lengths_in(by_type.get(str, []), 0, limits.max_str_len)
    _ints_in(by_type.get(int, []), _INT64_MIN, MAX_ID)
    _check(all(map(_BIG.__gt__, map(abs, by_type.get(float, [])))))  # finite, and surely a float literal
    lists = by_type.get(list, [])
    if lists:
        _check(max(map(len, lists)) <= limits.max_list_len)
        elements = list(chain.from_iterable(lists))
        types = set(map(type, elements))
        _check(types <= {str, int})
        of = {t: elements for t in types} if len(types) == 1 else _by_type(elements, types)
        _lengths_in(of.get(str, []), 0, limits.max_str_len)
        _ints_in(of.get(int, []), _INT64_MIN, MAX_ID)


def _by_type(values: list, types: set[type]) -> dict[type, list[Any]]:
    """``values`` split by their exact type (``types``: the types among them)."""
    kinds = list(map(type, values))
    return {t: _of_type(values, kinds, t) for t in types}


def _dense_values(objs: list[dict]) -> None:
    """``stream.events.check_dense``'s rule: numbers (not booleans) with ``|x| < DENSE_BOUND``; a float of magnitude
    >= 2**63 (an integer literal orjson could not hold?) is left to the per-event decoder."""
    values = list(chain.from_iterable(map(dict.values, objs)))
    _check(set(map(type, values)) <= {int, float})
    if values:
        size = np.abs(np.array(values, dtype=np.float64))
        _check(bool(np.all(size < DENSE_BOUND)))
        big = np.flatnonzero(size >= _BIG).tolist()
        _check(not big or float not in set(map(type, map(values.__getitem__, big))))


def _or_empty(col: list[dict | None]) -> list[dict]:
    """Each dict of ``col``, and ``{}`` for each None (a new dict each)."""
    return cast("list[dict]", col) if None not in col else [c if c is not None else {} for c in col]


def _keys_match(keys: Sequence[bytes | None], ids: list[str]) -> None:
    """``stream.events.check_key`` over a column: each key None or its id's UTF-8, one C-level pass (list equality
    where every message is keyed, the usual stream)."""
    if keys.count(None) == len(keys):  # no message keyed (or no keys given)
        return
    encoded = list(map(str.encode, ids))
    if None not in keys:
        _check(list(keys) == encoded)
    else:
        _check(all(map(or_, map(is_, keys, repeat(None)), map(eq, keys, encoded))))


def _fast(values: Sequence[bytes | None], broker_ts: Sequence[int | None], keys: Sequence[bytes | None], clicks: bool,
          limits: EventLimits) -> list[Decoded]:
    """A block decoded with the column checks, or :class:`_Reject` / a parse error when any row fails one."""
    raw = cast("Sequence[bytes]", values)  # a None among them fails the first check (len(None): TypeError)
    _check(max(map(len, raw)) <= limits.max_message_bytes)
    objs = list(map(orjson.loads, raw))  # a bad row raises orjson.JSONDecodeError, a ValueError
    _check(set(map(type, objs)) == {dict})
    allowed, required = (_CLICK_KEYS, _CLICK_KEYS) if clicks else (_IMPRESSION_KEYS, _IMPRESSION_REQUIRED)
    for shape in set(map(tuple, objs)):  # the distinct key lists (a few per block)
        _check(required <= set(shape) <= allowed)
    versions = list(map(_SV, objs))
    _check(set(map(type, versions)) == {int} and set(versions) <= SUPPORTED_VERSIONS)
    ids = list(map(_ID, objs))
    _check(set(map(type, ids)) == {str})
    _lengths_in(ids, 1, limits.max_str_len)
    ts = list(map(_TS, objs))
    _check(set(map(type, ts)) == {int})
    _ints_in(ts, 0, MAX_TS_MS)
    _keys_match(keys, ids)
    # each event's bound, capped at the wall clock: stream.events.ts_bound_ms, inline (a call per event cost 0.16 us
    # of a ~25 us event); the tests hold the two decoders to one answer
    now = int(time.time() * 1000)
    known = [MAX_TS_MS if b is None else now if b <= 0 or b > now else b for b in broker_ts]
    _check(bool(np.all(np.array(ts, np.int64) <= np.array(known, np.int64) + limits.future_ts_ms)))
    n_keys: Any = list(map(len, objs))  # each object's JSON keys (with its context's and dense's below)
    if clicks:
        events: list[Decoded] = list(map(Click, ids, ts))
    else:
        users, items = list(map(_USER, objs)), list(map(_ITEM, objs))
        _ids(users, limits)
        _ids(items, limits)
        contexts = list(map(dict.get, objs, repeat("context")))
        denses = list(map(dict.get, objs, repeat("dense")))
        ctx, shapes = _named_objects(contexts, limits.max_context_keys, limits)
        if ctx:
            _context_values(ctx, shapes, limits)
        dense, _ = _named_objects(denses, limits.max_dense_keys, limits)
        if dense:
            _dense_values(dense)
        # the per-event decoder keeps the parsed object itself, and {} for an absent one
        context_of, dense_of = _or_empty(contexts), _or_empty(denses)
        n_keys = np.add(np.add(n_keys, list(map(len, context_of))), list(map(len, dense_of)))
        events = list(map(Impression, ids, ts, users, items, context_of, dense_of))
    colons = np.fromiter(map(bytes.count, raw, repeat(b":")), np.int64, len(raw))
    for i in np.flatnonzero(colons > np.asarray(n_keys)).tolist():
        try:  # a colon inside a string, or a real duplicate key: the per-event check decides
            _reject_duplicate_keys(raw[i], objs[i])
        except BadMessage as exc:
            events[i] = exc
    return events

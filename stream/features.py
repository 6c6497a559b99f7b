"""Raw event fields -> the hashed feature values every stage uses (joiner, learner, serving).

Categorical values (ids, context strings and numbers) become ``stable_hash`` int64s; list-valued
context fields become lists of them; dense values stay floats. Defined once, here: a second copy in
serving would be the start of training/serving skew.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache
from sys import getsizeof
from typing import Any

import numpy as np

from stream.events import ContextValue
from stream.ids import stable_hash

MISSING = 0  # the hashed value of an absent categorical feature (stable_hash never yields 0 in practice)

#: The request-time field: the context name an impression's serving time goes under, and its granularities
#: (ms per unit, units per period), UTC. MovieLens' replay sends the hour of the week (it beat hour of day and
#: weekday on AutoInt's valid AUC, README "Evaluation"); an app sends whatever it knows at request time.
REQUEST_TIME = "request_time"
TIME_UNITS = {"hour": (3_600_000, 24), "weekday": (86_400_000, 7), "hour_of_week": (3_600_000, 168)}


def request_time(ts_ms: np.ndarray, kind: str = "hour_of_week") -> np.ndarray:
    """(N,) int64 raw request-time value of each event time (UTC): hour of day, weekday (0 = Thursday, the
    epoch's weekday) or hour of the week."""
    unit, period = TIME_UNITS[kind]
    return (np.asarray(ts_ms, np.int64) // unit) % period


# Feature values repeat a lot (gender, genres, devices); typed=True keeps True and 1 apart. Its values come from
# outside (events, serving requests), so it is kept small: 65,536 entries of up to max_str_len (256) characters are at
# most ~50 MB (a 256-character string costs ~720 B here); at 2**20 entries a client sending distinct long strings
# could hold ~0.7 GB of a serving process.
hash_value = lru_cache(maxsize=1 << 16, typed=True)(stable_hash)

# hash_ids' cache, also of the joiner's single-type str or int columns (hash_column, hash_context's long lists): ids
# (int or str, never bool or float, so equal keys always hash alike) -> hash_value; emptied when it passes
# _ID_CACHE_MAX entries or about _ID_CACHE_MAX_BYTES (each key's own size plus _ENTRY_BYTES for its slot and hash):
# ids are client-chosen in serving, and a million distinct 256-character ids took ~430 MB.
_ID_CACHE: dict[int | str, int] = {}
_ID_CACHE_MAX = 1 << 20
_ID_CACHE_MAX_BYTES = 64 << 20
_ENTRY_BYTES = 100  # a dict entry with its share of the table, and the hashed int
_id_cache_bytes = 0  # the estimate for _ID_CACHE since it was last emptied


def hash_ids(ids: Sequence[int | str]) -> np.ndarray:
    """(N,) int64: :data:`hash_value` of each id, for ids as ``stream.events.check_id`` accepts them (int or str;
    never a bool or a float, whose equal keys hash apart: ``True == 1``). Serving hashes its 100 candidates per
    request through this: a plain dict's hit costs about a third of ``hash_value``'s (an ``lru_cache`` keyed by value
    and type, which keeps its recency order on every hit)."""
    cache = _ID_CACHE
    n = len(ids)
    try:
        return np.fromiter(map(cache.__getitem__, ids), np.int64, n)
    except KeyError:
        _fill_id_cache(ids)
    try:
        return np.fromiter(map(cache.__getitem__, ids), np.int64, n)
    except KeyError:  # another thread emptied the cache meanwhile
        return np.fromiter(map(hash_value, ids), np.int64, n)


def _fill_id_cache(ids: Sequence[int | str]) -> None:
    """The ids missing from the cache hashed into it. With ``stable_hash`` itself, not through :data:`hash_value`'s
    ``lru_cache``: an id in both caches took 3.2x the memory (a million distinct ids: 237 MB against 74 MB, and
    filling took 1.7 s against 1.0 s)."""
    global _id_cache_bytes
    cache = _ID_CACHE
    if len(cache) > _ID_CACHE_MAX or _id_cache_bytes > _ID_CACHE_MAX_BYTES:
        cache.clear()
        _id_cache_bytes = 0
    added = 0
    for v in ids:
        if v not in cache:
            cache[v] = stable_hash(v)
            added += getsizeof(v) + _ENTRY_BYTES
    _id_cache_bytes += added  # threads may race here: an estimate, as the bound is


# Types whose equal values always have the same text (and so the same hash): a column of one of them may be hashed
# once per distinct value. Not float (0.0 == -0.0) and not a mix (1 == True == 1.0).
_DEDUP_SAFE = frozenset({str, int, bool})
_ID_TYPES = frozenset({str, int})  # the keys of hash_ids' cache
_DEDUP_MIN = 64  # a list this long is worth the type check (the joiner's context columns)


def hash_context(context: dict[str, ContextValue], _hash: Callable[[Any], int] = hash_value
                 ) -> dict[str, int | list[int]]:
    # A plain loop with the hash bound locally and lists mapped in C: ~20% faster than a comprehension here. The
    # joiner hashes a batch's contexts in one call, each key's column as one long list (context_block.py).
    out: dict[str, int | list[int]] = {}
    for k, v in context.items():
        out[k] = _hash_list(v, _hash) if isinstance(v, list) else _hash(v)
    return out


def _hash_list(values: list, _hash: Callable[[Any], int]) -> list[int]:
    """``_hash`` of each value; a long list of :data:`hash_value` of one type, str or int, is looked up in
    :func:`hash_ids`' cache (a plain dict's hit costs a fraction of ``hash_value``'s ``lru_cache`` hit)."""
    if _hash is hash_value and len(values) >= _DEDUP_MIN and len(types := set(map(type, values))) == 1 \
            and types <= _ID_TYPES:
        try:
            return list(map(_ID_CACHE.__getitem__, values))
        except KeyError:
            _fill_id_cache(values)
        try:
            return list(map(_ID_CACHE.__getitem__, values))
        except KeyError:  # another thread emptied the cache meanwhile
            pass
    return list(map(_hash, values))


def hash_column(values: Sequence[Any], types: set[type] | None = None) -> np.ndarray:
    """(N,) int64: :data:`hash_value` of each value, :data:`MISSING` for None (an absent feature). The same numbers
    as the per-value function; a column of str or of int goes through :func:`hash_ids`' cache, one of bool is hashed
    once per distinct value. ``types``: the values' types, where the caller has them already (the joiner's context
    columns: one scan of a column, not two)."""
    types = set(map(type, values)) if types is None else types
    if len(types) == 1 and types <= _ID_TYPES:
        return hash_ids(values)
    if len(types) == 1 and types <= _DEDUP_SAFE:
        distinct = dict.fromkeys(values)
        hashed = dict(zip(distinct, map(hash_value, distinct), strict=True))
        return np.fromiter(map(hashed.__getitem__, values), np.int64, len(values))
    return np.fromiter((MISSING if v is None else hash_value(v) for v in values), np.int64, len(values))

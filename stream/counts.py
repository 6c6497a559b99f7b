"""Per-day item and user occurrence counts in Redis sorted sets.

The nightly hot-embedding cache refresh reads the most frequent items/users of the last days from
here, and cold-start admission reads how often a new id has been seen.

Key layout (one sorted set per kind, event and UTC day of the *event* time)::

    {prefix}:counts:{kind}:{event}:{YYYYMMDD}      member = id, score = count

``kind`` is ``item`` or ``user``; ``event`` is ``impression`` or ``click``. Members are the ids as the
caller gives them, as text; the joiner records the ids' stable 64-bit hashes (``stream.ids.stable_hash``
of the raw id, so ``123`` and ``"123"`` are one member), which is what ``cache_refresh/hot_set.py``
maps to rows.

Expiry: a day's key expires ``ttl_days`` after the *end of its own day* (``day_start + (ttl_days +
1) * 86400``), so in live traffic today's key is kept for ``ttl_days`` full days after midnight
and a key never depends on when it happened to be written. That alone would make a replay of old
data (MovieLens is from 2000) write keys whose expiry is already in the past, which Redis deletes at
once, so the expiry is never earlier than ``ttl_days`` from now: ``max(own-day expiry, now +
ttl_days * 86400)``. In consequence a key of a day older than yesterday lives ``ttl_days`` after its
*last write*; only today's and yesterday's keys (and future days) get the longer own-day expiry.
Every write refreshes the expiry (``EXPIREAT``), so it only ever moves forward.

Clocks: an event time more than ``future_s`` (default 1 hour, ``[limits] future_ts_s``) ahead of
the wall clock is not counted (:attr:`DailyCounts.future_dropped` says how many), and days that
start beyond that are never "the latest day" (:meth:`days_available`): one client with a wrong
clock cannot make tomorrow's near-empty key the hot set's source.
"""

from __future__ import annotations

import datetime as dt
import re
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import redis

KINDS = ("item", "user")
EVENTS = ("impression", "click")
DAY_S = 86_400
DAY_MS = DAY_S * 1000
_EPOCH = dt.date(1970, 1, 1)
_DAY_RE = re.compile(r"\d{8}")
_TMP_TTL_S = 60  # safety net only: the temporary union key is deleted in the same transaction


def day_of(ts_ms: int) -> str:
    """The UTC day ``YYYYMMDD`` of an event time in ms."""
    return _day_str(int(ts_ms) // DAY_MS)


def _day_str(day_index: int) -> str:
    return (_EPOCH + dt.timedelta(days=day_index)).strftime("%Y%m%d")


def _parse_day(day: str) -> dt.date:
    if not isinstance(day, str) or not _DAY_RE.fullmatch(day):
        raise ValueError(f"argument 'day': got {day!r}, expected a UTC date as 'YYYYMMDD' (e.g. '20001231')")
    try:
        return dt.datetime.strptime(day, "%Y%m%d").date()
    except ValueError:
        raise ValueError(f"argument 'day': got {day!r}, which is not a calendar date (expected 'YYYYMMDD')") from None


def _check_kind_event(kind: str, event: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"argument 'kind': got {kind!r}, expected one of {', '.join(KINDS)}")
    if event not in EVENTS:
        raise ValueError(f"argument 'event': got {event!r}, expected one of {', '.join(EVENTS)}")


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"argument {name!r}: got {value!r}, expected an integer >= 1")


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _glob_escape(text: str) -> str:
    """Escape Redis glob metacharacters so a prefix is matched literally by SCAN MATCH."""
    return re.sub(r"([\\*?\[\]])", r"\\\1", text)


def _member(value: object, position: int) -> str:
    if isinstance(value, str):
        if value:
            return value
    elif isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)) and value >= 0:
        return str(int(value))
    raise ValueError(
        f"argument 'ids': element {position} is {value!r}, expected a non-negative integer or a non-empty string"
    )


def _nonnegative_ints(values: Sequence[object]) -> bool:
    """Whether every element is a plain non-negative int (what ``_member`` accepts as an integer id)."""
    return set(map(type, values)) <= {int} and min(cast("Sequence[int]", values), default=0) >= 0


# KEYS[1] = the day key; ARGV = expire-at (unix s), then count, member, count, member, ...
_ZINCR_MANY = """
for i = 2, #ARGV, 2 do redis.call('ZINCRBY', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('EXPIREAT', KEYS[1], ARGV[1])
return 0
"""


class DailyCounts:
    """Item and user occurrence counts per UTC day (see the module docstring for keys and expiry)."""

    def __init__(self, client: redis.Redis, prefix: str = "streamrec", ttl_days: int = 8,
                 future_s: float = 3600.0) -> None:
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"argument 'prefix': got {prefix!r}, expected a non-empty string")
        _check_positive_int("ttl_days", ttl_days)
        self.client = client
        self.prefix = prefix
        self.ttl_days = int(ttl_days)
        self.future_s = float(future_s)
        self.future_dropped = 0  # events not counted: their time was too far ahead of the wall clock
        self._zincr_many: Any = None  # registered on first use

    # -- keys -------------------------------------------------------------------------------------
    def key(self, kind: str, event: str, day: str) -> str:
        _check_kind_event(kind, event)
        _parse_day(day)
        return f"{self.prefix}:counts:{kind}:{event}:{day}"

    def expire_at(self, day_index: int, now_s: float | None = None) -> int:
        """Unix time (s) at which the key of day ``day_index`` (days since the epoch) expires."""
        now = time.time() if now_s is None else now_s
        own_day = (day_index + self.ttl_days + 1) * DAY_S
        return max(own_day, int(now) + self.ttl_days * DAY_S)

    # -- writes -----------------------------------------------------------------------------------
    def record(self, kind: str, event: str, ids: Sequence[int | str], ts_ms: Sequence[int] | np.ndarray) -> None:
        """Count ``ids[i]`` once on the UTC day of ``ts_ms[i]``; one Redis round trip per call.

        Counts are aggregated here first, then written with one non-transactional pipeline holding one
        script call per day key touched: the script runs ZINCRBY for each (member, count) pair it is
        given and sets EXPIREAT (redis-py spends ~5 us packing each command; the joiner touches tens of
        thousands of distinct ids per flush).
        """
        _check_kind_event(kind, event)
        id_list = ids.tolist() if isinstance(ids, np.ndarray) else list(ids)
        ts = np.asarray(ts_ms)
        if ts.ndim != 1:
            raise ValueError(f"argument 'ts_ms': got shape {ts.shape}, expected a sequence of times (one per id)")
        if len(id_list) != len(ts):
            raise ValueError(
                f"argument 'ts_ms': has {len(ts)} elements but 'ids' has {len(id_list)}; expected one time per id"
            )
        if not id_list:
            return
        if ts.dtype.kind not in "iu":
            if ts.dtype.kind == "f" and np.all(np.isfinite(ts)) and np.all(ts == np.floor(ts)):
                ts = ts.astype(np.int64)
            else:
                raise ValueError(f"argument 'ts_ms': got dtype {ts.dtype}, expected integer milliseconds")
        ts = ts.astype(np.int64, copy=False)
        if ts.min() < 0:
            bad = int(np.argmin(ts))
            raise ValueError(f"argument 'ts_ms': element {bad} is {int(ts[bad])}, expected milliseconds >= 0")
        # Validated once per element; the joiner's ids (non-negative ints) in one C-level pass, and turned into text
        # only once per distinct id after counting (popular ids repeat).
        text = not _nonnegative_ints(id_list)
        members: list[int | str] = [_member(v, i) for i, v in enumerate(id_list)] if text else id_list
        now = time.time()
        ahead = ts > int((now + self.future_s) * 1000)
        if ahead.any():
            self.future_dropped += int(ahead.sum())
            keep = np.flatnonzero(~ahead)
            members, ts = [members[i] for i in keep.tolist()], ts[keep]
            if not members:
                return
        day_index = (ts // DAY_MS).tolist()
        counts = Counter(zip(day_index, members, strict=True))

        args: dict[int, list[int | str]] = {}
        for (d, member), n in counts.items():
            args.setdefault(d, []).extend((n, member if text else str(member)))
        if self._zincr_many is None:
            self._zincr_many = self.client.register_script(_ZINCR_MANY)
        pipe = self.client.pipeline(transaction=False)
        for d, pairs in args.items():
            key = f"{self.prefix}:counts:{kind}:{event}:{_day_str(d)}"
            self._zincr_many(keys=[key], args=[self.expire_at(d, now), *pairs], client=pipe)
        pipe.execute()

    # -- reads ------------------------------------------------------------------------------------
    def days_available(self, kind: str, event: str) -> list[str]:
        """The days (``YYYYMMDD``, ascending) that have a key for ``kind``/``event`` (found with SCAN), up to
        the day of now + ``future_s``: a key of a later day was written by a wrong clock."""
        _check_kind_event(kind, event)
        base = f"{self.prefix}:counts:{kind}:{event}:"
        pattern = _glob_escape(base) + "*"
        days = set()
        for raw in self.client.scan_iter(match=pattern, count=1000):
            suffix = _text(raw)[len(base):]
            if _DAY_RE.fullmatch(suffix):
                days.add(suffix)
        last = day_of(int((time.time() + self.future_s) * 1000))
        return sorted(d for d in days if d <= last)

    def top(
        self, kind: str, event: str = "impression", day: str | None = None, days: int = 1, k: int = 10
    ) -> list[tuple[str, float]]:
        """The ``k`` most frequent ids over ``days`` consecutive UTC days ending at ``day`` (inclusive).

        ``day`` defaults to the latest day with a key for ``kind``/``event``; with no data at all the
        result is empty. Counts of the days are summed (missing days count as empty). Ordered by
        count descending; equal counts in Redis's reverse order (reverse lexicographic by id text).
        """
        _check_kind_event(kind, event)
        _check_positive_int("days", days)
        _check_positive_int("k", k)
        if day is None:
            available = self.days_available(kind, event)
            if not available:
                return []
            day = available[-1]
        end = _parse_day(day)
        keys = [
            f"{self.prefix}:counts:{kind}:{event}:{(end - dt.timedelta(days=i)).strftime('%Y%m%d')}"
            for i in range(int(days))
        ]
        rows: list[tuple[bytes, float]]  # (member, score), highest first
        if len(keys) == 1:
            rows = self.client.zrevrange(keys[0], 0, int(k) - 1, withscores=True)  # type: ignore[assignment]
        else:
            # Merge on the server and send back only k rows; MULTI/EXEC so the temporary key never
            # outlives the call (the short TTL is a safety net).
            tmp = f"{self.prefix}:counts:tmp:{uuid.uuid4().hex}"
            pipe = self.client.pipeline(transaction=True)
            pipe.zunionstore(tmp, keys, aggregate="SUM")
            pipe.expire(tmp, _TMP_TTL_S)
            pipe.zrevrange(tmp, 0, int(k) - 1, withscores=True)
            pipe.delete(tmp)
            rows = pipe.execute()[2]
        return [(_text(member), float(score)) for member, score in rows]

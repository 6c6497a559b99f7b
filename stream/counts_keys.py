"""The day counts' vocabulary: their kinds and events, UTC days (day arithmetic, parsing, the days of a
window that can hold counts) and the layout of their keys in Redis, which ``stream/counts.py``'s
:class:`DailyCounts` writes and reads.

Key layout (one sorted set per kind, event and UTC day of the *event* time)::

    {prefix}:counts:{{kind}}:{event}:{YYYYMMDD}    member = id, score = count

The braces are literal: ``{item}`` / ``{user}`` is the key's Redis Cluster hash tag, so all of one kind's keys
(every event, every day and its names) hash to one slot. That is what lets
one :meth:`DailyCounts.record` call write several days in one MULTI/EXEC, the counting script touch the counts and
the names key together and ``top`` pipeline its reads of several days on a Redis Cluster (``[redis] cluster``), as
on a single node; it also puts each kind's counts on one cluster node (history, a key per user, spreads over all of
them). Keys still begin with ``{prefix}:`` (the ACLs of a secured deployment grant ``~{prefix}:*``).

``kind`` is ``item`` or ``user``; ``event`` is ``impression`` or ``click`` (the joiner's, by event time) or
``lookup`` (serving's own row reads, by the wall-clock day of the flush: ``serving/lookup_counts.py`` writes
them with :meth:`DailyCounts.add_counts`, a request scoring 100 candidates counts 100 item lookups where the joiner
later counts one impression). Members are the ids as the caller gives them, as text; the joiner and serving
record the ids' stable 64-bit hashes (``stream.ids.stable_hash`` of the raw id, so ``123`` and ``"123"`` are one
member), which is what ``cache_refresh/hot_set.py`` maps to rows.

Names (the raw ids behind the hashes, for operators: ``streamrec counts top``, the hot set's summary)::

    {prefix}:names:{{kind}}:{YYYYMMDD}             hash field = member, value = raw id text

How counts and names are written and read, the layout before hash tags (still read on a single node), expiry,
retries and clocks: ``stream/counts.py``'s docstring.
"""

from __future__ import annotations

import datetime as dt
import re

KINDS = ("item", "user")
EVENTS = ("impression", "click", "lookup")
DAY_S = 86_400
DAY_MS = DAY_S * 1000
_EPOCH = dt.date(1970, 1, 1)
_DAY_RE = re.compile(r"\d{8}")
# what follows ``{prefix}:counts:`` in a day's counts key: ``{kind}:event:day``, or ``kind:event:day`` (the layout
# before hash tags: ``stream/counts.py``'s docstring, "Upgrade")
COUNTS_KEY_RE = re.compile(r"(?:\{(?P<kind>" + "|".join(KINDS) + r")\}|(?P<legacy>" + "|".join(KINDS) + r")):"
                            r"(?P<event>" + "|".join(EVENTS) + r"):(?P<day>[0-9]{8})")


def day_of(ts_ms: int) -> str:
    """The UTC day ``YYYYMMDD`` of an event time in ms."""
    return day_str(int(ts_ms) // DAY_MS)


def day_str(day_index: int) -> str:
    return (_EPOCH + dt.timedelta(days=day_index)).strftime("%Y%m%d")


def parse_day(day: str) -> dt.date:
    if not isinstance(day, str) or not _DAY_RE.fullmatch(day):
        raise ValueError(f"argument 'day': got {day!r}, expected a UTC date as 'YYYYMMDD' (e.g. '20001231')")
    try:
        return dt.datetime.strptime(day, "%Y%m%d").date()
    except ValueError:
        raise ValueError(f"argument 'day': got {day!r}, which is not a calendar date (expected 'YYYYMMDD')") from None


def is_date(day: str) -> bool:
    """Whether ``day`` (8 ASCII digits) is a calendar date from the epoch on: a key of ``20001399`` (any client can
    write one) is no day, which ``top`` would refuse as the hot set's latest; nor is one before 1970, which no writer
    here makes (``record`` refuses times before the epoch): as the latest day, ``00010101``'s window failed the hot set
    (OverflowError) and ``09991231``'s read nothing (``strftime`` drops the year's leading zeros)."""
    try:
        return dt.datetime.strptime(day, "%Y%m%d").date() >= _EPOCH
    except ValueError:
        return False


def days_back(end: dt.date, days: int) -> int:
    """How many of the ``days`` days ending at ``end`` are from 1970 on: the days of a window that can hold counts
    (:func:`is_date`). ``--days 1000000`` reached back before the year 1 (``OverflowError``, a traceback)."""
    return max(0, min(days, (end - _EPOCH).days + 1))


def check_kind_event(kind: str, event: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"argument 'kind': got {kind!r}, expected one of {', '.join(KINDS)}")
    if event not in EVENTS:
        raise ValueError(f"argument 'event': got {event!r}, expected one of {', '.join(EVENTS)}")

"""Per-day item and user occurrence counts in Redis sorted sets.

The nightly hot-embedding cache refresh reads the most frequent items/users of the last days from
here, and cold-start admission reads how often a new id has been seen.

Keys (a sorted set per kind, event and UTC day of the *event* time, the names beside them, their hash tags):
``stream/counts_keys.py``'s docstring. The Lua scripts that write and read them: ``stream/counts_scripts.py``.

Names (the names key, ``stream/counts_keys.py``):

A caller that knows the raw ids passes them to :meth:`DailyCounts.record` (``names``); the same script call
that counts a member on a day also sets its name there (HSETNX: the first name stays). Every script call, with names
or none (a click, ids named already, serving's lookups under their own TTL), extends the names key's expiry to its
counts key's where that is later, never earlier. So a day's names are bounded exactly like its counts (one field per
member counted that day, impression or click, of that kind) and live as long as every counts key of their kind and day
written since they were first set (lookup counts all written before the joiner first named an id that day may outlive
them). The raw id text is the text ``stable_hash`` hashes: ``123`` and ``"123"`` are both ``123``.
Readers (:meth:`DailyCounts.names`) look a member up in the days they read and, for a click counted just
after midnight whose impression (and so its name) came the day before, one day earlier; a member with no
name found (counted before names were kept, or by a caller that passed none) is shown by its hash.

Upgrade from the layout before hash tags (``{prefix}:counts:{kind}:{event}:{YYYYMMDD}`` and
``{prefix}:names:{kind}:{YYYYMMDD}``, no braces; only ever written to a single node, where the old scripts could
run): writes go to the tagged keys only, and on a single node the readers (:meth:`DailyCounts.days_available`,
:meth:`DailyCounts.top`, :meth:`DailyCounts.names`) also read the old keys and add their counts, so a deployment
upgraded in place keeps its counts. The old keys expire as they always did, within ``counts_ttl_days`` of their
last write; after that these reads find nothing (they are skipped on a cluster, where no old key can exist) and
the code reading them can go.

Expiry: a day's key expires ``ttl_days`` after the *end of its own day* (``day_start + (ttl_days +
1) * 86400``), so in live traffic today's key is kept for ``ttl_days`` full days after midnight
and a key never depends on when it happened to be written. That alone would make a replay of old
data (MovieLens is from 2000) write keys whose expiry is already in the past, which Redis deletes at
once, so the expiry is never earlier than ``ttl_days`` from now: ``max(own-day expiry, now +
ttl_days * 86400)``. In consequence a key of a day older than yesterday lives ``ttl_days`` after its
*last write*; only today's and yesterday's keys (and future days) get the longer own-day expiry.
Every write refreshes the expiry (``EXPIREAT``), so it only ever moves forward.

Retries: one :meth:`DailyCounts.record` (or :meth:`DailyCounts.add_counts`) call is all or nothing when the
connection fails or Redis refuses it: its script calls (one per day; ``add_counts``: per chunk) go in one MULTI/EXEC,
which Redis runs only once it has the whole transaction, so a connection lost part way through the pipeline writes
nothing. (As a non-transactional pipeline, the days before the break were written and then written again by the
retry.) A failure after Redis ran the EXEC but before its reply arrived (a timeout, a dropped connection) leaves the
caller not knowing whether it ran, so every call is a *write* with an id (``write_id``, :func:`new_write_id`, a fresh
one when the caller gives none), and each of its script calls has a marker, a field of a hash beside the counts key
it writes, in the kind's hash slot::

    {prefix}:counts:{{kind}}:w:{event}:{YYYYMMDD}    field = {write id}:{part} (part: add_counts's chunk, 0: record)

A script call that finds its marker writes nothing; one that does not writes its counts and names, then sets the marker
(last; a key of the wrong type refuses the call before its first write: nothing written, no marker). So a call again
with the same write id and the same counts counts each day once, whether the first ran, did not, or ran only some of its
days (an error inside one script call: Redis does not roll back the other calls of the EXEC, and their markers are set).
A marker per script call, not per write: the first day of an EXEC does not make the later days skip, and a resend of the
same EXEC (redis-py's own retries, on a cluster too) counts once as well. The markers are never days to
:meth:`DailyCounts.days_available` (its SCAN skips them).

However late a retry comes, it is recognised: the markers hash gets the counts key's expiry in the same script call,
so the two live and go together (an expiry, a FLUSHALL, a restarted Redis without persistence). While the counts a
write added exist, so does its marker; once they are gone, its retry counts it in a fresh key, once. (The markers once
expired a day after their write, so a retry after a Redis outage of over a day, the joiner's batches failing all
along, counted its write twice.) There is no bound to document against how far back a consumer rewinds: a consumer
that re-reads input it had counted (a restart before its commit) makes new writes with new ids, which no marker can
tell from new counts. The joiner counts a batch only once its state is durable (``stream/joiner/pipeline.py``),
and a re-read impression or click that state holds (within ``late_retention``) is a duplicate, not counted again.

Kept for days instead of one, the markers of every write would cost (at ~100 bytes of Redis memory each, measured as
hash fields) ~150 MB per joiner worker (a flush every 2 s, four kinds/events, ``ttl_days`` 8: 9 days of markers) and
~30 MB per serving process (every 5 s, two kinds). But a marker matters only to a retry, and a caller retries only a
write that failed: the markers of a write that succeeded are deleted by the next write of the same kind, in its own
transaction (a forget call of the same script, no round trip of its own). So what stays is one write's markers per
kind and :class:`DailyCounts` object, and those of failed writes until their retry succeeds (or, never retried: a
crash, serving's second failure, until the day's counts expire). One id, one write: a call with a write id that once
succeeded is not recognised as a retry.

The caller makes the id when it first hands counts to a write and keeps it, with those counts unchanged, until the
write succeeds; it never adds newer counts to a write that failed (Redis may have run it: retried under its id the
newer counts would be skipped, under a new id its own counted twice). The joiner retries a failed flush's write as it
was, before writing what came since (``stream/joiner/day_counts.py``, ``DayCountsWriter.finish_flush``); serving's
lookup counts retry a failed day and kind once, at the next flush (``serving/lookup_counts.py``).

Cost per script call (per day and kind/event; per chunk for ``add_counts``): the marker, ~30 bytes sent, three
commands inside the script (HEXISTS, HSET, EXPIREAT: ~5 us of server time against ~5 us per member counted), and
deleting it in the kind's next write (one HDEL). A script call refused for a key of another type (another client's)
writes nothing: it reads each key it writes before its first write (the counts were once written before the names key
was found a string, without the marker, and its retry counted them twice).

Clocks: an event time more than ``future_s`` (default 1 hour, ``[limits] future_ts_s``) ahead of
the wall clock is not counted (:attr:`DailyCounts.future_dropped` says how many), and a day that has not
started on the wall clock is never "the latest day" (:meth:`days_available`): one client with a wrong
clock cannot make tomorrow's near-empty key the hot set's source (capped at the day of now + ``future_s``, it did
in the last hour of every day: one event 40 minutes ahead at 23:30 was tomorrow's only count, and the latest day).

Which events of a :meth:`DailyCounts.record` are too far ahead is part of its write: decided once, by the wall clock
of the write's first attempt, and counted in ``future_dropped`` then (whether or not that attempt succeeds: the
events were not counted for being ahead either way). A call that fails keeps that cut-off for its write (kind, event
and write id, a write id the caller gave) until a call with the same write succeeds, and that retry drops exactly the
same events and adds nothing to ``future_dropped``. Deciding again at the retry's clock would double count: each retry
counted the same dropped events again; a clock that moved on re-admitted an event already counted as dropped (on a
day the first attempt did not write, the retry wrote it: counted in Redis and as dropped); one stepped back dropped
events the first attempt may have written (counted in Redis and as dropped), or lost them from both. The cut-offs of
at most ``_CUTOFFS_MAX`` failed writes are kept (the joiner has at most one failed write, four kinds/events, waiting),
the oldest forgotten first: a write retried after its cut-off was forgotten is decided and counted again.
:meth:`DailyCounts.add_counts` (serving's lookups, by the wall-clock day of the flush) has no such cut-off.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import re
import secrets
import time
from collections.abc import Mapping, Sequence
from itertools import compress, repeat
from operator import is_not, not_
from typing import Any, cast

import numpy as np
import redis
from redis.crc import key_slot
from redis.exceptions import NoPermissionError

from stream.counts_keys import (
    COUNTS_KEY_RE,
    DAY_MS,
    DAY_S,
    EVENTS,
    KINDS,
    check_kind_event,
    day_of,
    day_str,
    days_back,
    is_date,
    parse_day,
)
from stream.counts_scripts import MEMBER_MAX_BYTES, NAME_MAX_BYTES, NAMES_BOUNDED, TOP_PAGE_BOUNDED, ZINCR_MANY
from stream.errors import quoted
from stream.redis_client import Client, ClusterUnavailable, is_cluster, run_script
from stream.redis_deadline import replies_by, round_trip

_SLOT_TRIES = 20  # DailyCounts._slot_keys: tries while a resharding moves a kind's slot (~10 s of waits in all)
_SLOT_KEYS_MAX = 1_000_000  # keys listed from a kind's slot (a day has 7 of each kind; other prefixes share it)
TOP_PAGE = 10_000  # the most members DailyCounts.top reads from one key in one command (a window of several days)
TOP_READS = 3  # DailyCounts._top_of_one: reads of one day's top while writes move members across its pages
log = logging.getLogger("streamrec.counts")
_NAMES_DAYS_PER_TRIP = 32  # days of names DailyCounts.names asks in one pipelined round trip


def new_write_id() -> str:
    """A fresh write id (96 random bits, as text): what a caller makes when it first hands counts to a write and
    passes again with every retry of those same counts (module docstring, "Retries")."""
    return secrets.token_hex(12)

def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"argument {name!r}: got {value!r}, expected an integer >= 1")


def check_top_window(days: object, k: object) -> None:
    """What :meth:`DailyCounts.top` checks of ``days`` and ``k`` before it reads anything (ValueError), for a caller
    that reads something first (the latest day with counts): a bad value is said before Redis is asked."""
    _check_positive_int("days", days)
    _check_positive_int("k", k)


def _text(value: bytes | str) -> str:
    """A member or a name as read: bytes that are no UTF-8 (any client can write them) replaced, never a failed read."""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _scored(reply: list[Any]) -> list[tuple[bytes, float]]:
    """A ``TOP_PAGE_BOUNDED`` reply's page (member, score text, member, ...) as ZREVRANGE WITHSCORES gives it:
    (member, score) pairs."""
    flat = reply[0]
    return [(m, float(score)) for m, score in zip(flat[0::2], flat[1::2], strict=True)]


def _elsewhere(reply: list[Any], others: list[int]) -> list[tuple[int, bytes, float]]:
    """A ``TOP_PAGE_BOUNDED`` reply's scores of its page's replaced members in the keys ``others`` (indexes, in the
    order of the call's KEYS[2..]): (key index, member as replaced, score) where the key holds the member."""
    flat, got, step = reply[0], reply[1], len(others) + 1
    return [(j, flat[got[at] - 1], float(score)) for at in range(0, len(got), step)
            for j, score in zip(others, got[at + 1:at + step], strict=True) if score is not None]


def _kth_largest(values: Mapping[Any, float], k: int) -> float:
    """The ``k``-th largest of ``values``' values (1 <= k <= len(values))."""
    arr = np.fromiter(values.values(), np.float64, len(values))
    return float(np.partition(arr, len(arr) - k)[len(arr) - k])


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


def _name_text(member: int | str, value: object) -> str:
    """The text of a raw id as ``stable_hash`` hashes it (``123`` and ``"123"`` are both ``123``)."""
    if isinstance(value, str):
        if value:
            return value
    elif isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)) and value >= 0:
        return str(int(value))
    raise ValueError(f"argument 'names': the name of id {member!r} is {value!r}, expected the raw id (a non-negative "
                     "integer or a non-empty string)")


def _name_texts(ids: list[Any], values: list[Any]) -> list[str]:
    """:func:`_name_text` of each ``values[i]`` (the name of id ``ids[i]``), in C-level passes where all are
    of one type (the usual stream: every raw id an int, or every one a str); element by element otherwise, which
    raises for the first bad one."""
    types = set(map(type, values))
    if types == {str} and "" not in values:
        return values
    if types == {int} and min(values) >= 0:
        return list(map(str, values))
    return [_name_text(i, v) for i, v in zip(ids, values, strict=True)]


def _member_column(members: list[int | str], text: bool) -> np.ndarray:
    """``members`` (checked: non-negative ints, or ``text``: non-empty strings) as one column: uint64 where every int
    fits (the joiner's hashes), objects otherwise (strings, or a larger int a caller gave)."""
    if not text:
        try:
            return np.array(members, dtype=np.uint64)
        except OverflowError:
            pass
    column = np.empty(len(members), dtype=object)
    column[:] = members
    return column


def _distinct(members: np.ndarray, day_index: np.ndarray) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per day (days since the epoch, ascending), its distinct members (``members[i]`` counted on day ``day_index[i]``,
    ascending) and how often each was counted: ``Counter(zip(day_index, members))`` as columns (np.unique), without
    a Python step per member. In sorted order, not in the order of their first events: a member's place among a
    script call's ZINCRBYs and HSETNXs (each member once) changes nothing in Redis, and keeping the first events'
    order took a stable sort, ~12x np.unique's (12 ms against 1 ms for 110 k hashes)."""
    days = np.unique(day_index)
    out = {}
    for d in days.tolist():
        of_day = members if len(days) == 1 else members[day_index == d]
        out[d] = np.unique(of_day, return_counts=True)  # (M,) members, (M,) counts
    return out


def _interleaved(a: list[Any], b: list[Any]) -> list[Any]:
    """``[a[0], b[0], a[1], b[1], ...]`` (``a`` and ``b`` of one length), built by two slice assignments."""
    out: list[Any] = [None] * (2 * len(a))
    out[0::2], out[1::2] = a, b
    return out


def _checked_write_id(write_id: object) -> str:
    """``write_id`` as given, or a fresh one for None (a call no caller retries still guards against a resend)."""
    if write_id is None:
        return new_write_id()
    if not isinstance(write_id, str) or not write_id or len(write_id) > 64:
        raise ValueError(f"argument 'write_id': got {write_id!r}, expected a non-empty string of at most 64 "
                         "characters (stream.counts.new_write_id() makes one)")
    return write_id


def _names_by_text(names: Mapping[Any, int | str]) -> dict[str, str]:
    """``names`` (id as given -> raw id) keyed by the id's member text, valued by the raw id's text."""
    out = {}
    for key, value in names.items():
        if isinstance(key, str) and key:
            text = key
        elif isinstance(key, (int, np.integer)) and not isinstance(key, (bool, np.bool_)) and key >= 0:
            text = str(int(key))
        else:
            raise ValueError(f"argument 'names': has the key {key!r}, expected an id as given in 'ids' (a non-negative "
                             "integer or a non-empty string)")
        out[text] = _name_text(key, value)
    return out

_CUTOFFS_MAX = 1024  # failed writes whose "too far ahead" cut-off DailyCounts keeps for their retry (the joiner: 4)
_NAMED_MAX = 1 << 17  # names remembered as written (DailyCounts._named), ~12 MB at most


class DailyCounts:
    """Item and user occurrence counts per UTC day (keys: ``stream/counts_keys.py``; expiry: the module docstring)."""

    def __init__(self, client: Client, prefix: str = "streamrec", ttl_days: int = 8,
                 future_s: float = 3600.0, write_timeout_s: float | None = None) -> None:
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"argument 'prefix': got {prefix!r}, expected a non-empty string")
        _check_positive_int("ttl_days", ttl_days)
        self.client = client
        # Each write's whole MULTI/EXEC completes within it where the client bounds whole replies (connect(...,
        # whole_reply=True)): its replies (MULTI's, a QUEUED per script call, EXEC's) share one deadline
        # (stream.redis_deadline.replies_by). Bounded one by one, a Redis trickling them held a write of many days one
        # timeout per reply. None: each reply bounded alone.
        self.write_timeout_s = write_timeout_s
        self.prefix = prefix
        self.ttl_days = int(ttl_days)
        self.future_s = float(future_s)
        self._scan_warned = False  # (_cluster_keys: the fallback to SCAN logged once)
        self.future_dropped = 0  # events not counted: their time was too far ahead of the wall clock
        # (kind, event, write id) -> the cut-off (ms) its first attempt dropped events beyond, for a write that failed
        # (its retry keeps it); removed when the write succeeds. Bounded by _CUTOFFS_MAX, the oldest forgotten first.
        self._cutoffs: dict[tuple[str, str, str], int] = {}
        self._zincr_many: Any = None  # registered on first use
        self._names_bounded: Any = None
        self._top_page_bounded: Any = None
        # kind -> {markers key: markers} of kind's last write that succeeded: forgotten in Redis by kind's next write
        # (module docstring, "Retries"). One write's markers per kind: a day's for record, a chunk's for add_counts.
        self._acked: dict[str, dict[str, list[str]]] = {}
        # Names this object has written, per names key: not sent again (a popular id is counted in every flush).
        # Bounded by _NAMED_MAX in all (then forgotten, so sent once more); a names key found missing (deleted,
        # evicted) forgets its entries, so the next flush that counts them names them again.
        self._named: dict[str, set[str]] = {}
        self._named_total = 0

    # -- keys -------------------------------------------------------------------------------------
    def key(self, kind: str, event: str, day: str) -> str:
        check_kind_event(kind, event)
        parse_day(day)
        return self._key(kind, event, day)

    def names_key(self, kind: str, day: str) -> str:
        """The key of ``kind``'s names on ``day`` (member -> raw id text: ``stream/counts_keys.py``; "Names" in the
        module docstring)."""
        check_kind_event(kind, EVENTS[0])
        parse_day(day)
        return self._names_key(kind, day)

    def other_type_keys(self, kind: str, event: str, day: str) -> list[str]:
        """The keys a write of counts (:meth:`add_counts`) to ``kind``/``event`` on ``day`` reads that hold another
        Redis type than it writes (another client's: the write's WRONGTYPE), the counts' sorted set or its markers'
        hash (module docstring, "Retries"): the keys to delete, where a refusal's error names none. One round trip."""
        want = {self.key(kind, event, day): "zset", self._markers_key(kind, event, day): "hash"}
        pipe = self.client.pipeline(transaction=False)
        for key in want:
            pipe.type(key)
        with round_trip(self.client):  # the TYPEs by one timeout, not one each (as _sorted_sets')
            found = [_text(t) for t in pipe.execute()]
        return [key for (key, wanted), got in zip(want.items(), found, strict=True) if got not in ("none", wanted)]

    def _key(self, kind: str, event: str, day: str) -> str:
        return f"{self.prefix}:counts:{{{kind}}}:{event}:{day}"

    def _names_key(self, kind: str, day: str) -> str:
        return f"{self.prefix}:names:{{{kind}}}:{day}"

    def _markers_key(self, kind: str, event: str, day: str) -> str:
        """The markers of the writes into ``kind``/``event``'s counts of ``day`` (a hash expiring with those counts;
        module docstring, "Retries"). In the kind's hash slot, and never a day to ``days_available``."""
        return f"{self.prefix}:counts:{{{kind}}}:w:{event}:{day}"

    def _legacy(self) -> bool:
        """Whether the readers also read the layout before hash tags (module docstring: only on a single node)."""
        return not is_cluster(self.client)

    def _legacy_key(self, kind: str, event: str, day: str) -> str:
        return f"{self.prefix}:counts:{kind}:{event}:{day}"

    def _legacy_names_key(self, kind: str, day: str) -> str:
        return f"{self.prefix}:names:{kind}:{day}"

    def expire_at(self, day_index: int, now_s: float | None = None) -> int:
        """Unix time (s) at which the key of day ``day_index`` (days since the epoch) expires."""
        now = time.time() if now_s is None else now_s
        own_day = (day_index + self.ttl_days + 1) * DAY_S
        return max(own_day, int(now) + self.ttl_days * DAY_S)

    # -- writes -----------------------------------------------------------------------------------
    def record(self, kind: str, event: str, ids: Sequence[int | str], ts_ms: Sequence[int] | np.ndarray,
               names: Mapping[Any, int | str] | None = None, write_id: str | None = None) -> None:
        """Count ``ids[i]`` once on the UTC day of ``ts_ms[i]``; one Redis round trip per call.

        Counts are aggregated here first, then written with one MULTI/EXEC pipeline holding one script call per
        day key touched (all of them or none, see "Retries" in the module docstring): the script runs ZINCRBY for
        each (member, count) pair it is given and sets EXPIREAT (redis-py spends ~5 us packing each command; the
        joiner touches tens of thousands of distinct ids per flush).

        ``names`` maps ids (as given in ``ids``) to their raw ids: the name of each member counted is set
        in the same script call, on the same day (ids missing from it get no name; extra entries are
        ignored, so a name is only ever kept beside a count).

        ``write_id`` (:func:`new_write_id`; a fresh one when None) names these counts as one write: a call again with
        the same id and the same ids and times, after a failure that left it unknown whether Redis ran the first
        (a lost reply), counts each day once (module docstring, "Retries"), and drops the same events as too far
        ahead as the first attempt did, without counting them in :attr:`future_dropped` again ("Clocks"). One id, one
        write: never pass it with other counts of the same kind and event.
        """
        check_kind_event(kind, event)
        retriable = write_id is not None  # a fresh id is never given again: no retry to keep a cut-off for
        write_id = _checked_write_id(write_id)
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
        # Which events are too far ahead is decided once per write, by its first attempt's clock, and counted then;
        # a retry (the same write id) drops the same events and counts none (module docstring, "Clocks").
        write = (kind, event, write_id)
        cutoff = self._cutoffs.pop(write, None)
        if cutoff is None:
            cutoff = int((now + self.future_s) * 1000)
            ahead = ts > cutoff
            self.future_dropped += int(np.count_nonzero(ahead))
        else:
            ahead = ts > cutoff
        try:
            self._record(kind, event, members, ts, ahead, text, names, write_id, now)
        except BaseException:
            if retriable:  # a retry may come: it keeps this cut-off
                self._cutoffs[write] = cutoff
                if len(self._cutoffs) > _CUTOFFS_MAX:
                    del self._cutoffs[next(iter(self._cutoffs))]
            raise

    def _record(self, kind: str, event: str, members: list[int | str], ts: np.ndarray, ahead: np.ndarray, text: bool,
                names: Mapping[Any, int | str] | None, write_id: str, now: float) -> None:
        """:meth:`record`'s write, once its arguments are checked and the events too far ahead (``ahead``) decided."""
        column = _member_column(members, text)  # (N,)
        if ahead.any():
            column, ts = column[~ahead], ts[~ahead]
            if not len(column):
                return
        distinct = _distinct(column, ts // DAY_MS)
        args: dict[int, list[int | str]] = {}
        texts: dict[int, list[str]] = {}
        for d, (uniq, n) in distinct.items():
            texts[d] = list(map(str, uniq.tolist()))  # (M,) member texts of day d
            args[d] = _interleaved(n.tolist(), texts[d])  # (count, member) pairs
        days = {d: day_str(d) for d in args}
        named = self._names_to_send(kind, days, distinct, texts, names, text) if names else {}
        calls = [([self._key(kind, event, days[d]), self._names_key(kind, days[d]),
                   self._markers_key(kind, event, days[d])],
                  [self.expire_at(d, now), f"{write_id}:0", len(pairs) // 2, *pairs, *named.get(d, ())])
                 for d, pairs in args.items()]
        try:
            had_names = self._write(kind, calls)  # all days or none (see "Retries" in the module docstring)
        except BaseException:  # the names sent may not be written: not remembered as written
            for d in named:
                self._forget_named(self._names_key(kind, days[d]))
            raise
        for d, had in zip(args, had_names, strict=True):
            # the key was gone (deleted, evicted, a restart): of the names remembered for it, only those sent now are
            # in it. Forgotten also when none of the others was counted now: this call made the key again, and the
            # next found it and skipped them as named, for the rest of the day
            if not had:
                key = self._names_key(kind, days[d])
                self._forget_named(key)
                sent = named.get(d, [])[0::2]  # (member, name) pairs: the members
                if sent:
                    self._named[key] = set(sent)
                    self._named_total += len(sent)

    def add_counts(self, kind: str, event: str, members: np.ndarray, counts: np.ndarray, day_index: int,
                   chunk: int = 10_000, write_id: str | None = None) -> None:
        """Add pre-aggregated ``counts[i]`` to ``members[i]`` (int64 hashes, (M,) each) on day ``day_index`` (days
        since the epoch): one MULTI/EXEC pipeline of the same script :meth:`record` uses, ``chunk`` members
        per call (no names), all written or none. One round trip; the caller bounds ``M``. ``write_id``: as for
        :meth:`record` (a retry passes the same members, counts and ``chunk`` again)."""
        check_kind_event(kind, event)
        write_id = _checked_write_id(write_id)
        if len(members) != len(counts):
            raise ValueError(f"argument 'counts': has {len(counts)} elements but 'members' has {len(members)}")
        _check_positive_int("chunk", chunk)
        members, counts = np.asarray(members), np.asarray(counts)
        # a count of 0, below 0 or not whole would be added as it is (a ZINCRBY of -3, of NaN), a member that is no
        # stable hash named a row no reader finds (cache_refresh/hot_set.py member_hashes)
        if len(counts) and (counts.dtype.kind not in "iu" or int(counts.min()) < 1):
            raise ValueError(f"argument 'counts': expected integers >= 1, got {counts.dtype} {quoted(str(counts))}")
        if len(members) and (members.dtype.kind not in "iu" or int(members.min()) < 0):
            raise ValueError(f"argument 'members': expected non-negative integer hashes, got {members.dtype} "
                             f"{quoted(str(members))}")
        if not len(members):
            return
        day = day_str(int(day_index))
        keys = [self._key(kind, event, day), self._names_key(kind, day), self._markers_key(kind, event, day)]
        expire = self.expire_at(int(day_index))
        calls = []
        for part, i in enumerate(range(0, len(members), chunk)):
            m, c = members[i:i + chunk].tolist(), counts[i:i + chunk].tolist()
            pairs = [x for pair in zip(c, map(str, m), strict=True) for x in pair]
            calls.append((keys, [expire, f"{write_id}:{part}", len(m), *pairs]))
        self._write(kind, calls)  # all chunks or none (see "Retries" in the module docstring)

    def _write(self, kind: str, calls: list[tuple[list[str], list[Any]]]) -> list[Any]:
        """The counting script once per ``(keys, args)``, all in one MULTI/EXEC (one kind's keys: one hash slot); the
        results of ``calls``.

        The same transaction first forgets the markers of ``kind``'s last write that succeeded (its caller never
        retries it: module docstring, "Retries"); when this one succeeds, its own markers are the next to forget.
        A transaction that fails keeps those to forget (forgetting twice is harmless), and its own are kept in Redis
        for its retry."""
        if self._zincr_many is None:
            self._zincr_many = self.client.register_script(ZINCR_MANY)
        acked = self._acked.pop(kind, {})
        forget = [([key] * 3, [0, "", 0, *fields]) for key, fields in acked.items()]
        by = math.inf if self.write_timeout_s is None else time.monotonic() + self.write_timeout_s
        try:
            with replies_by(by):  # the transaction's replies by one deadline (write_timeout_s)
                results = run_script(self.client, self._zincr_many, forget + calls, transaction=True)
        except BaseException:
            self._acked[kind] = acked
            raise
        done: dict[str, list[str]] = {}
        for keys, args in calls:
            done.setdefault(keys[2], []).append(args[1])
        self._acked[kind] = done
        return results[len(forget):]

    def _names_to_send(self, kind: str, days: dict[int, str], distinct: dict[int, tuple[np.ndarray, np.ndarray]],
                       texts: dict[int, list[str]], names: Mapping[Any, int | str], text: bool) -> dict[int, list[str]]:
        """Per day, the (member, raw id text) pairs of the members counted (``distinct``'s, whose texts are ``texts``)
        that have a name in ``names`` and were not named by this object before (``self._named``; those sent now are
        marked as named). Each step a C-level pass over a day's distinct members: most of a flush's members were named
        by an earlier flush (popular ids are counted in every one), and a Python step per member was most of the
        joiner's counts writer thread's own Python (``bench/README.md``, "joiner"). Every name is checked before any
        is marked: a bad one raises with nothing marked."""
        by_text = _names_by_text(names) if text else None
        fresh: dict[int, tuple[list[str], list[str]]] = {}
        for d, (uniq, _) in distinct.items():
            done = self._named.get(self._names_key(kind, days[d]), set())
            new = list(map(not_, map(done.__contains__, texts[d])))
            members = list(compress(texts[d], new))
            ids = members if by_text is not None else list(compress(uniq.tolist(), new))  # as given in 'ids'
            given: list[Any] = list(map(names.get if by_text is None else by_text.get, ids))
            has = list(map(is_not, given, repeat(None)))
            members, ids, given = list(compress(members, has)), list(compress(ids, has)), list(compress(given, has))
            fresh[d] = (members, given if by_text is not None else _name_texts(ids, given))
        out: dict[int, list[str]] = {}
        for d, (members, raws) in fresh.items():
            if members:
                out[d] = _interleaved(members, raws)
                self._named.setdefault(self._names_key(kind, days[d]), set()).update(members)
                self._named_total += len(members)
        if self._named_total > _NAMED_MAX:
            self._named.clear()
            self._named_total = 0
        return out

    def _forget_named(self, key: str) -> None:
        self._named_total -= len(self._named.pop(key, ()))

    # -- reads ------------------------------------------------------------------------------------
    def days_available(self, kind: str, event: str) -> list[str]:
        """The days (``YYYYMMDD``, ascending) that have a sorted-set key for ``kind``/``event`` (SCAN, on a cluster the
        kind's hash slot listed; then TYPE), up to today (the wall clock's UTC day): a key of a later day was written
        by a clock ahead (counted if within ``future_s``), and is listed once its day starts. One walk of the keyspace
        (:meth:`all_days_available`): a reader of several kinds or events asks that once instead."""
        check_kind_event(kind, event)
        return self.all_days_available().get((kind, event), [])

    def all_days_available(self) -> dict[tuple[str, str], list[str]]:
        """:meth:`days_available` of every kind and event that has a day, ``{(kind, event): days}``, from one SCAN.

        SCAN walks the whole keyspace whatever its MATCH (history has a key per user, the embedding store a key per
        row): a walk per kind and event (and, on a single node, another for the layout before hash tags) made the
        nightly hot set walk it up to 16 times. One ``{prefix}:counts:*`` walk finds both layouts; the markers
        (``...:w:...``) are not days. On a cluster no SCAN: each kind's keys are listed from its one hash slot
        (:meth:`_slot_keys`), where a SCAN of every primary missed the keys a resharding moved meanwhile from a
        primary not walked yet to one walked already (days missing, the latest too: a hot set a day old)."""
        base = f"{self.prefix}:counts:"
        legacy = self._legacy()
        last = day_of(int(time.time() * 1000))  # a day not started yet is no latest day (module docstring, "Clocks")
        found: dict[str, tuple[tuple[str, str], str]] = {}  # key -> ((kind, event), day)
        listed = self._cluster_keys() if is_cluster(self.client) else None
        keys = listed if listed is not None else self.client.scan_iter(match=_glob_escape(base) + "*", count=1000)
        for raw in keys:
            # a key that is no UTF-8 (any client can write one under the prefix) is no day, never a failed read
            text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
            if not text.startswith(base):  # a cluster's slot holds every prefix's keys of the kind (_slot_keys)
                continue
            m = COUNTS_KEY_RE.fullmatch(text[len(base):])
            if m is None or (m["legacy"] is not None and not legacy) or m["day"] > last or not is_date(m["day"]):
                continue
            found[text] = ((m["kind"] or m["legacy"], m["event"]), m["day"])
        days: dict[tuple[str, str], set[str]] = {}
        for key in self._sorted_sets(list(found)):  # a list at a later day's key is no day (top leaves it out too)
            days.setdefault(found[key][0], set()).add(found[key][1])
        return {ke: sorted(d) for ke, d in days.items()}

    def top(
        self, kind: str, event: str = "impression", day: str | None = None, days: int = 1, k: int = 10
    ) -> list[tuple[str, float]]:
        """The ``k`` most frequent ids over ``days`` consecutive UTC days ending at ``day`` (inclusive).

        ``day`` defaults to the latest day with a key for ``kind``/``event``; with no data at all the
        result is empty. Counts of the days are summed (missing days count as empty). Ordered by
        count descending; equal counts in Redis's reverse order (reverse lexicographic by id text).
        """
        check_kind_event(kind, event)
        check_top_window(days, k)
        if day is None:
            available = self.days_available(kind, event)
            if not available:
                return []
            day = available[-1]
        keys = self._window_keys(kind, event, day, days)
        if not keys:
            return []
        rows: list[tuple[bytes, float]]  # (member, score), highest first
        if len(keys) == 1:
            rows = self._top_of_one(keys[0], int(k))
        else:
            rows = self._top_of_sum(keys, int(k))
        return [(_text(member), float(score)) for member, score in rows]

    def _read(self, script: Any, calls: list[tuple[list[str], list[Any]]]) -> list[Any]:
        """A read script's ``calls`` (one kind's keys: one hash slot), in one round trip. On a cluster in a MULTI/EXEC
        even when it is one call: ``run_script`` then loads the script on the slot's node only, where its one-call
        shortcut (redis-py's) loads it on every primary, which one node down fails (the counts on the others too)."""
        return run_script(self.client, script, calls, transaction=is_cluster(self.client))

    def _top_page(self) -> Any:
        """The ``TOP_PAGE_BOUNDED`` script, registered on first use."""
        if self._top_page_bounded is None:
            self._top_page_bounded = self.client.register_script(TOP_PAGE_BOUNDED)
        return self._top_page_bounded

    def _top_of_one(self, key: str, k: int) -> list[tuple[bytes, float]]:
        """The ``k`` highest members of one key, by score then member descending, read ``TOP_PAGE`` members per command
        (ZREVRANGE), as :meth:`_top_of_sum` reads a window: one ZREVRANGE of ``k`` was one reply of ``k`` members, and
        the hot set asks ``k`` again, doubled, past a head of refused members (``cache_refresh/hot_set.py``,
        ``top_ids``): a day of a million refused at the head read them in one reply, past ``redis_timeout_s``.

        Pages are no snapshot: a member a write moves into the pages already read (a live joiner's ZINCRBY) is read in
        none, and pushes the last one read into the next page, read twice. That repeat tells it: the key is read again,
        up to :data:`TOP_READS` times. Taking the pages as they came lost the member the write had made hotter, and
        with ``k - 1`` members read the hot set took the day for read to its end."""
        rows: dict[bytes, float] = {}
        for _ in range(TOP_READS):
            rows, moved = self._top_pages(key, k)
            if not moved:
                break
        return sorted(rows.items(), key=lambda r: (r[1], r[0]), reverse=True)  # (a read a write moved: in rank order)

    def _top_pages(self, key: str, k: int) -> tuple[dict[bytes, float], bool]:
        """One read of :meth:`_top_of_one`: the first ``k`` distinct members of ``key`` (all it has, if fewer), and
        whether a member came in two pages (a write moved members across a page boundary between two reads)."""
        rows: dict[bytes, float] = {}
        start, moved = 0, False
        while len(rows) < k:
            asked = min(TOP_PAGE, k - len(rows))
            got = self._read(self._top_page(), [([key], [start, start + asked - 1, MEMBER_MAX_BYTES])])
            page = _scored(got[0])
            for member, score in page:
                moved = moved or member in rows
                rows.setdefault(member, float(score))
            start += asked
            if len(page) < asked:
                break
        return rows, moved

    def _top_of_sum(self, keys: list[str], k: int) -> list[tuple[bytes, float]]:
        """The ``k`` members with the highest sum of their scores in ``keys``, ranked as ZUNIONSTORE (SUM) and
        ZREVRANGE rank them: sum descending, equal sums by member descending; a sum turning NaN (an inf and a -inf,
        another client's) is 0 from there, adding in key order (Redis's order of the days may differ: another sum).

        Read in pages (Fagin's threshold algorithm): each round reads the next ``page`` members of every key by score;
        a member new to it gets its score in every other key from what was read of that key (a key read to its end, in
        one page for the days of a small data set, has no more) or by ZMSCORE, so its sum is exact. A member not read
        yet scores at most the last score read in a key it is in (0 where it is not): once the k-th sum is above those
        bounds summed, no unread member can rank. No command asks for more than ``page`` members per key of the window.
        The union on the server read every member of every day in one command: 7 days of 300,000 members outlasted
        ``redis_timeout_s`` (the hot set failed as "Redis unreachable") and blocked Redis for every other client
        meanwhile. Not one snapshot: a count written between two rounds may be read in one and not the other.

        Each of a round's two pipelines (a read per live key) completes within the client's timeout as a whole
        (:func:`~stream.redis_deadline.round_trip`, where the client bounds whole replies: the refresh's): bounded reply
        by reply, a Redis trickling them held one round of a 7-day window up to 7 timeouts."""
        page = min(max(2 * k, 1000), TOP_PAGE)
        read: list[dict[bytes, float]] = [{} for _ in keys]  # every (member, score) read of each key
        sums: dict[bytes, float] = {}
        bound = [math.inf] * len(keys)  # the last score read of each key: no unread member of it scores more
        done = [False] * len(keys)  # every member of the key read
        depth = 0
        while True:
            live = [i for i, d in enumerate(done) if not d]
            fresh: dict[bytes, None] = {}
            span = [depth, depth + page - 1, MEMBER_MAX_BYTES]
            with round_trip(self.client):  # the round's reads by one timeout, not one each (a trickling Redis: 7)
                replies = self._read(self._top_page(), [([keys[i]], span) for i in live])
            # A page with a member too long to send is read again with the window's other keys, for its scores there
            # (rare: another client's member). Not every page with every other key: a window of n days sent n keys
            # with each of its n pages, and `--days 20000` held ~20 GB of key lists (the OOM killer ended it).
            again = [n for n, got in enumerate(replies) if got[1] and len(keys) > 1]
            others = {live[n]: [j for j in range(len(keys)) if j != live[n]] for n in again}
            if again:
                with round_trip(self.client):
                    more = self._read(self._top_page(), [([keys[live[n]], *(keys[j] for j in others[live[n]])], span)
                                                         for n in again])
                for n, got in zip(again, more, strict=True):
                    replies[n] = got
            pages = [_scored(got) for got in replies]
            for i, rows, got in zip(live, pages, replies, strict=True):
                for j, m, score in _elsewhere(got, others.get(i, [])):  # a replaced member's score in the other days
                    read[j][m] = score
                done[i] = len(rows) < page
                if rows:
                    bound[i] = float(rows[-1][1])
                read[i].update((m, float(score)) for m, score in rows)
                fresh.update((m, None) for m, _ in rows if m not in sums)
            depth += page
            new = list(fresh)
            asked = [(i, [m for m in new if m not in read[i]]) for i in range(len(keys)) if not done[i]]
            asked = [(i, members) for i, members in asked if members]
            pipe = self.client.pipeline(transaction=False)
            for i, members in asked:
                pipe.zmscore(keys[i], cast("list[str]", members))  # the members as read: bytes, sent as they are
            with round_trip(self.client):
                replies = pipe.execute() if asked else []
            for (i, members), scores in zip(asked, replies, strict=True):
                read[i].update((m, float(score)) for m, score in zip(members, scores, strict=True) if score is not None)
            for m in new:
                total = 0.0
                for got in read:
                    if m in got:
                        total += got[m]
                        total = 0.0 if math.isnan(total) else total  # as Redis's union
                sums[m] = total
            unread = sum(max(b, 0.0) for b, d in zip(bound, done, strict=True) if not d)
            if all(done) or (len(sums) >= k and _kth_largest(sums, k) > unread):
                return sorted(sums.items(), key=lambda r: (r[1], r[0]), reverse=True)[:k]

    def _window_keys(self, kind: str, event: str, day: str, days: int) -> list[str]:
        """The sorted sets of ``kind``/``event`` counts of the ``days`` days ending at ``day``."""
        end = parse_day(day)
        window = [(end - dt.timedelta(days=i)).strftime("%Y%m%d") for i in range(days_back(end, int(days)))]
        keys = [self._key(kind, event, d) for d in window]
        if self._legacy():  # the layout before hash tags, while its keys live (module docstring)
            old = [self._legacy_key(kind, event, d) for d in window]
            if self.client.exists(*old):
                keys += old
        return self._sorted_sets(keys)

    def day_counts(self, kind: str, event: str, members: Sequence[str], day: str, days: int = 1,
                   at_most: float | None = None) -> dict[str, list[float]]:
        """Each of ``members``' counts in the keys of :meth:`top`'s window that counted it: what :meth:`top`'s sum
        hides (a negative count one day lowers it, written by another client). Empty when the window is one key (its
        count is the sum); a one-day window on a single node is two while the day's key of the layout before hash tags
        lives, and their sum hid a -8 there. ``at_most``: only the keys that hold a count at or below it, found first by
        one ZCOUNT per key (one round trip); the members' scores (ZMSCORE) are then read from those keys alone, so a
        window with no such count (the joiner and serving write none) sends no member at all. Each of the two pipelines
        completes within the client's timeout as a whole (:func:`~stream.redis_deadline.round_trip`), not a key's."""
        check_kind_event(kind, event)
        _check_positive_int("days", days)
        found: dict[str, list[float]] = {}
        keys = self._window_keys(kind, event, day, days)
        if len(keys) < 2 or not members:
            return found
        if at_most is not None:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.zcount(key, "-inf", at_most)
            with round_trip(self.client):  # each pipeline's replies by one timeout, as _top_of_sum's
                keys = [key for key, n in zip(keys, pipe.execute(), strict=True) if n]
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.zmscore(key, list(members))
        with round_trip(self.client):
            replies = pipe.execute() if keys else []
        for scores in replies:
            for member, score in zip(members, scores, strict=True):
                if score is not None:
                    found.setdefault(member, []).append(float(score))
        return found

    def _cluster_keys(self) -> list[Any] | None:
        """Every kind's keys by :meth:`_slot_keys`; None where the cluster refuses ``CLUSTER GETKEYSINSLOT`` or
        ``CLUSTER NODES`` (an ACL user without them, a managed service that hides them): then a SCAN of every primary,
        which may miss a day a resharding moves meanwhile (logged once)."""
        try:
            return [k for kind in KINDS for k in self._slot_keys(kind)]
        except redis.ResponseError as exc:  # refused (NOPERM, a command renamed away), not a cluster down: an outage
            if not str(exc).startswith(("NOPERM", "ERR unknown")) and not isinstance(exc, NoPermissionError):
                raise
            if not self._scan_warned:
                self._scan_warned = True
                log.warning("the counts' hash slots cannot be listed (%s): days are found by SCAN, which misses a day "
                            "a resharding moves meanwhile", quoted(str(exc)))
            return None

    def _slot_keys(self, kind: str) -> list[Any]:
        """Every key in ``kind``'s hash slot on a cluster (every prefix's: the caller filters), as one node held them at
        one instant: ``CLUSTER GETKEYSINSLOT`` with ``CLUSTER NODES`` in one MULTI/EXEC on the node the client routes
        the slot to, taken only when that node owns the slot and is not migrating it (no other node then holds a key
        of it). While a resharding moves the slot it is asked again, after a command on the slot (MOVED teaches the
        client the new owner); a slot still moving after ``_SLOT_TRIES`` raises :class:`ClusterUnavailable`, which the
        callers retry as an outage."""
        key = self._key(kind, EVENTS[0], "19700101")  # any key of the kind's slot
        slot = key_slot(key.encode())
        cluster: Any = self.client  # a RedisCluster (or LazyClient of one): is_cluster
        for attempt in range(_SLOT_TRIES):
            if attempt:
                time.sleep(0.05 * attempt)
            cluster.exists(key)  # follows MOVED: the client's map then names the slot's owner
            pipe = cluster.get_node_from_key(key).redis_connection.pipeline(transaction=True)
            pipe.execute_command("CLUSTER GETKEYSINSLOT", slot, _SLOT_KEYS_MAX)
            pipe.execute_command("CLUSTER NODES")
            keys, view = pipe.execute()
            me = next(v for v in view.values() if "myself" in v["flags"])
            owns = any(int(r[0]) <= slot <= int(r[-1]) for r in me["slots"])
            if owns and not any(int(m["slot"]) == slot for m in me["migrations"]):
                if len(keys) >= _SLOT_KEYS_MAX:
                    raise ValueError(f"hash slot {slot} of the {kind} counts holds {len(keys)}+ keys; at most "
                                     f"{_SLOT_KEYS_MAX - 1} are listed")
                return list(keys)
        raise ClusterUnavailable(f"the hash slot {slot} of the {kind} counts kept moving between nodes (a resharding) "
                                 f"over {_SLOT_TRIES} tries; its days are read again at the next try")

    def _sorted_sets(self, keys: list[str]) -> list[str]:
        """``keys`` less those holding another type than a sorted set (any client can write a list or a string under
        the prefix), with a warning naming them: such a key is no day's counts. Before, one failed every read of its
        window with WRONGTYPE (and with it the nightly refresh). The TYPEs are one round trip bounded as a whole
        (:func:`~stream.redis_deadline.round_trip`)."""
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.type(key)
        with round_trip(self.client):  # the TYPEs by one timeout, not one each
            types = [_text(t) for t in pipe.execute()]
        wrong = [f"{k} ({t})" for k, t in zip(keys, types, strict=True) if t not in ("zset", "none")]
        if wrong:
            log.warning("day counts: %s %s not a sorted set (written by another client?); left out of the counts read",
                        quoted(", ".join(wrong)), "is" if len(wrong) == 1 else "are")
        return [k for k, t in zip(keys, types, strict=True) if t in ("zset", "none")]

    def names(self, kind: str, members: Sequence[str], day: str, days: int = 1) -> dict[str, str]:
        """The raw ids of ``members`` (as :meth:`top` returns them) that have a name: ``{member: raw id text}``.

        Looks in ``kind``'s names of the ``days`` days ending at ``day`` and of the day before them (a click
        just after midnight was named with its impression the day before), newest first; each further day is
        asked only for the members still without a name, and the search stops once every member has one. The days
        are asked ``_NAMES_DAYS_PER_TRIP`` at a time, one script call each (``NAMES_BOUNDED``): members that have no
        name at all (counted without names, e.g. serving's lookups) cost one round trip per that many days, not per
        day. Each round trip completes within the client's timeout as a whole
        (:func:`~stream.redis_deadline.round_trip`, as :meth:`_top_of_sum`'s rounds): bounded reply by reply, a
        trickling Redis held it up to one timeout per day.
        A name longer than ``NAME_MAX_BYTES`` is not read: its member has none (shown by hash), with a warning.
        """
        check_kind_event(kind, EVENTS[0])
        _check_positive_int("days", days)
        end = parse_day(day)
        missing = list(dict.fromkeys(members))
        found: dict[str, str | int] = {}  # a name, or the length of one too long to read
        n = days_back(end, int(days) + 1)
        for first in range(0, n, _NAMES_DAYS_PER_TRIP):
            if not missing:
                break
            keys = []  # newest day first; on a day, the layout before hash tags last (module docstring)
            for i in range(first, min(first + _NAMES_DAYS_PER_TRIP, n)):
                day_i = (end - dt.timedelta(days=i)).strftime("%Y%m%d")
                keys.append(self._names_key(kind, day_i))
                if self._legacy():
                    keys.append(self._legacy_names_key(kind, day_i))
            if self._names_bounded is None:
                self._names_bounded = self.client.register_script(NAMES_BOUNDED)
            with round_trip(self.client):  # a trip's reads by one timeout, not one each (a trickling Redis: 32)
                replies = self._read(self._names_bounded, [(keys, [NAME_MAX_BYTES, *missing])])[0]
            for values in self._names_read(keys, replies):  # in key order: the first name found stays
                for member, value in zip(missing, values, strict=True):
                    if value is not None and member not in found:
                        found[member] = value if isinstance(value, int) else _text(value)
            missing = [m for m in missing if m not in found]
        too_long = [m for m, v in found.items() if isinstance(v, int)]
        if too_long:
            log.warning("day names: %d of the %s names asked for are longer than %d bytes (written by another "
                        "client?); left unread, their ids shown by hash", len(too_long), kind, NAME_MAX_BYTES)
        return {m: v for m, v in found.items() if isinstance(v, str)}

    @staticmethod
    def _names_read(keys: list[str], replies: list[Any]) -> list[list[Any]]:
        """The ``NAMES_BOUNDED`` ``replies`` of the names ``keys``, less those of a key holding another type than a
        hash (any client can write one under the prefix), with a warning naming them: such a key holds no names.
        Before, one day's failed the whole read with WRONGTYPE: every day's names lost (the hot set's top ids all shown
        by hash, ``streamrec counts top`` failed)."""
        wrong = [k for k, r in zip(keys, replies, strict=True) if not isinstance(r, list)]  # the script's '!wrongtype'
        if wrong:
            log.warning("day names: %s %s not a hash (WRONGTYPE: written by another client?); left out of the names "
                        "read", quoted(", ".join(wrong)), "is" if len(wrong) == 1 else "are")
        return [r for r in replies if isinstance(r, list)]

"""The hot set: the most frequent items and users of the last days -> rows of the fused embedding table.

Counts come from per-day Redis sorted sets (``stream/counts.py``), whose members are the stable hashes of the raw
ids (``stream/ids.py``), the same int64 the samples carry. Which counts rank it (``[refresh] count_event``):

* ``lookup`` (default): serving's own row reads (``serving/lookup_counts.py``): the rows the hot cache is for. A
  request scores ~100 candidates per impression it leads to, and the ranker shows what it scores highest, so the
  ids looked up most are not the ids impressed most; ranked by lookups the hot set holds what serving reads.
* ``impression`` / ``click``: the joiner's counts by event time.

``fallback_event`` (default ``impression``) fills what the first ranking leaves empty: when fewer than
``hot_items`` (``hot_users``) ids have ``count_event`` counts in the window (serving does not count yet, Redis lost
them, a replay whose serving never ran), the most frequent ids by ``fallback_event`` that are not already in take
the rest of the budget. So with no lookup counts at all the hot set is exactly the impression-ranked one of before,
and lookups rank the head as soon as serving has counted for a day. ``fallback_event == count_event``: no fill.

Stale counts are not ranked by: when ``count_event``'s latest day is more than ``STALE_DAYS`` (1) day behind
``fallback_event``'s, the fallback ranks the whole budget (``{kind}_stale_day`` in the stats names the stale day,
with a warning in the log). Lookups are counted by the wall-clock day, the joiner's counts by event time: with both
running, serving's latest lookup day is today and the joiner's latest impression day today or, lagging, earlier, so
lookups a full day behind the impressions mean serving stopped counting (its lookup counts switched off, its flushes
failing) while the joiner went on. Each kind's window ended at its own latest day, so the lookups of that last day,
up to ``ttl_days`` old, ranked the hot set while the impressions went on being counted: a silently old hot set.

An item's row is ``item_id``'s block row of that hash (shared by ``history``, which reads item rows); a user's row
is ``user_id``'s. The mapping is the feature config's (``FeatureConfig.blocks``), the one the learner used.

The window of ``days`` days ends at the latest day that has counts, not at today: counts are kept by
event time, so a replayed data set (MovieLens is from 2000) gets the same hot set as live traffic.

For operators the stats (the artifact's manifest, the refresh summary) list the hottest ``show`` items and
users by raw id, from the names the joiner keeps beside the counts (``stream/counts.py``): each row is
``{"name": raw id, "count": n}``, or ``{"name": null, "hash": member, "count": n}`` where no name is known.

Redis may be briefly unavailable at 03:00: every read is retried with exponential backoff
(``attempts``, ``backoff_s`` doubling); :class:`RedisUnavailable` after the last attempt.
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
import math
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import redis

from learner.features import FeatureConfig
from learner.row_mapper import RowMapper
from stream.counts import DailyCounts
from stream.counts_keys import parse_day
from stream.errors import StreamrecError

log = logging.getLogger("streamrec.refresh")
T = TypeVar("T")

KIND_FIELDS = {"item": "item_id", "user": "user_id"}
STALE_DAYS = 1  # count_event's latest day this many days behind fallback_event's, and more: not ranked by
SHOW = 10  # hottest ids of each kind listed by raw id in the stats
# a name longer than this is no raw id shown (the joiner's raw ids: max_str_len, default 256): its row shows the hash
NAME_MAX_CHARS = 4096


class RedisUnavailable(StreamrecError):
    """Redis did not answer after every retry (unreachable, or slower than its timeout: the message says which)."""


def with_retries(what: str, fn: Callable[[], T], attempts: int, backoff_s: float,
                 sleep: Callable[[float], None] = time.sleep, on_retry: Callable[[str], None] | None = None,
                 between: Callable[[], object] = lambda: None) -> T:
    """``fn()``, retried on Redis connection/timeouts errors: waits backoff_s, 2*backoff_s, ...; ``on_retry`` gets each
    retry's warning (``job.RunProgress``: what a scheduler stopped meanwhile says when it abandons the run).

    The wait is outside the ``except``: a refresh's stop signal during it raises there (``job.StopSignals`` keeps a
    stop pending while an exception is in flight, as a failure's cleanup; this is no failure yet). ``between`` (the
    run's stop check) is called before each attempt and each wait, outside the ``except``: a stop kept pending (it came
    while redis-py or this ``except`` handled the error) raises there, not after every wait (~0.5, 1, 2, 4 s)."""
    last: Exception | None = None
    for i in range(max(1, attempts)):
        between()
        try:
            return fn()
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError) as exc:
            last = exc
        if i + 1 < attempts:
            wait = backoff_s * (2 ** i)
            warning = f"{what}: Redis error ({last}); attempt {i + 1}/{attempts}, retrying in {wait:.1f}s"
            log.warning("%s", warning)
            if on_retry is not None:
                on_retry(warning)
            between()
            sleep(wait)
    if isinstance(last, redis.TimeoutError):  # up and slow (a trickling reply, a read past its timeout): not "down"
        raise RedisUnavailable(f"{what}: Redis did not answer within its timeout in {attempts} attempt(s): {last}")
    raise RedisUnavailable(f"{what}: Redis unreachable after {attempts} attempt(s): {last}")


Days = Mapping[tuple[str, str], list[str]]  # (kind, event) -> its days, DailyCounts.all_days_available()


def _days(counts: DailyCounts, kind: str, event: str, available: Days | None) -> list[str]:
    """``kind``/``event``'s days: from ``available`` when given (no Redis read), else asked for."""
    return counts.days_available(kind, event) if available is None else list(available.get((kind, event), []))


@dataclass
class HotSet:
    rows: np.ndarray  # (H,) int64 sorted unique global rows
    stats: dict[str, Any] = field(default_factory=dict)


def top_ids(counts: DailyCounts, kind: str, event: str, days: int, k: int, available: Days | None = None,
            between: Callable[[], object] = lambda: None) -> tuple[list[tuple[str, float]], str | None]:
    """Top-k (member, count) over ``days`` days ending at the latest day with counts; and that day. ``available``:
    ``counts.all_days_available()`` when the caller has it (one walk of the keyspace for every kind and event), else
    ``kind``/``event``'s days are asked for. ``between`` (the refresh's stop check) comes before each read.

    Only members that are a stable hash's text with a positive finite count in each key of the window are ranked
    (:func:`member_hashes`, :func:`_is_count`; the others are left out, with a warning and their count: a day's
    negative count summed with positive ones silently lowered a member's rank): k ids are chosen whenever k valid ones
    have counts, however many refused ones rank above them. Left out only after the cut, each refused member cost the
    hot set a place. The common case (none refused) is one read of k; otherwise the read is asked again for at least
    twice as many (never fewer than k plus those refused), so a head of R refused members costs about log2(R / k) reads
    (each ranks the days' sum again: ``DailyCounts.top``), and the loop ends once a read returns fewer rows than asked
    (every member read)."""
    if k <= 0:
        return [], None
    have = _days(counts, kind, event, available)
    if not have:
        return [], None
    day = have[-1]
    ask = k
    while True:
        between()
        rows = counts.top(kind, event, day=day, days=days, k=ask)
        valid = {m: c for m, c in rows if _is_hash_text(m) and _is_count(c)}
        # a sum hides a day's (or a layout's) -8; a key with no count <= 0 hides nothing (an inf makes the sum inf)
        between()
        each = counts.day_counts(kind, event, list(valid), day, days, at_most=0.0)
        top = [(m, c) for m, c in valid.items() if all(_is_count(d) for d in each.get(m, ()))][:k]
        if len(top) >= k or len(rows) < ask:
            break
        ask = max(2 * ask, k + len(rows) - len(top))
    refused = (rows.index(top[-1]) + 1 if len(top) >= k else len(rows)) - len(top)
    if refused:
        log.warning("hot set: %d of the top %s ids by %s counts are not a stable hash's text or have not a positive "
                    "finite count (inf, 0, -5: written by a client other than the joiner and serving?); left out, the "
                    "ids below them ranked in their place", refused, kind, event)
    return top, day


def named_rows(counts: DailyCounts, kind: str, top: list[tuple[str, float]], day: str | None, days: int,
               ) -> list[dict[str, Any]]:
    """``top`` (member, count) as rows for operators: ``{"name": raw id, "count"}``, or ``{"name": None, "hash":
    member, "count"}`` where no name is known (see ``DailyCounts.names``) or the name is longer than
    :data:`NAME_MAX_CHARS` (the manifest holds these rows, and a manifest has at most 16 MB)."""
    if not top or day is None:
        return []
    try:
        names = counts.names(kind, [m for m, _ in top], day=day, days=days)
    except redis.ResponseError as exc:  # a names key of another type (any client can write one): shown by hash
        log.warning("hot set: the names of the top %ss cannot be read (%s); they are shown by hash", kind, exc)
        names = {}
    long = [m for m, n in names.items() if len(n) > NAME_MAX_CHARS]
    if long:  # 20 names of 1 MB made the manifest too large to load: "corrupt", every run failed at validate
        log.warning("hot set: %d of the top %ss have a name longer than %d characters (written by a client other than "
                    "the joiner?); shown by hash", len(long), kind, NAME_MAX_CHARS)
        names = {m: n for m, n in names.items() if len(n) <= NAME_MAX_CHARS}
    return [{"name": names[m], "count": int(c)} if m in names else {"name": None, "hash": m, "count": int(c)}
            for m, c in top]


def describe_top(rows: list[dict[str, Any]]) -> str:
    """``named_rows`` in one line for the log: ``2858 (3,428), 260 (2,991), hash 6112... (12)``."""
    return ", ".join(f"{r['name'] if r['name'] is not None else 'hash ' + str(r.get('hash'))} ({r['count']:,})"
                     for r in rows) or "none"


# a stable hash's text as the joiner and serving write it (str of an int below 2**63): ASCII digits, no leading zero
# ("007" and "7" were one row ranked as two ids: the hot set held a row fewer than its budget)
_HASH_TEXT = re.compile(r"0|[1-9][0-9]{0,18}")
_HASH_MAX = (1 << 63) - 1


def member_hashes(members: list[str]) -> tuple[np.ndarray, int]:
    """The members that are a stable hash's text, as int64 (in order); and how many are not. Anything with write
    access to Redis can add a member: one that is not (``"-3"``, ``"u1"``, ``"007"``, ``"99999999999999999999"``, an
    int64 overflow, ``"²"``, which ``str.isdigit`` takes and ``int`` refuses) is left out, never a failed refresh."""
    hashed = [int(m) for m in members if _is_hash_text(m)]
    return np.array(hashed, dtype=np.int64), len(members) - len(hashed)


def _is_count(count: float) -> bool:
    """Whether ``count`` is one the joiner or serving writes: positive and finite. Redis stores ``inf`` and negative
    scores (any client may ZADD one): an ``inf`` ranked first and failed the refresh (``int(inf)`` in the stats); a
    negative or zero one took a hot row."""
    return math.isfinite(count) and count > 0


def _is_hash_text(member: str) -> bool:
    """Whether ``member`` is a stable hash's text (:func:`member_hashes`)."""
    return _HASH_TEXT.fullmatch(member) is not None and int(member) <= _HASH_MAX


def hot_rows(cfg: FeatureConfig, kind: str, members: list[str], mapper: RowMapper | None = None) -> np.ndarray:
    """Global rows of ``members`` (hash texts) in the block of ``kind``'s field; [] if the model lacks it.
    ``mapper`` (the checkpoint's id maps) maps admitted ids to their own rows; without it, the buckets. Members
    that are no stable hash's text are left out (:func:`member_hashes`), with a warning."""
    name = KIND_FIELDS[kind]
    names = [f.name for f in cfg.fields]
    if name not in names or not members:
        return np.zeros(0, np.int64)
    hashed, skipped = member_hashes(members)
    if skipped:
        log.warning("hot set: %d of the top %d %s ids in the counts are not a stable hash's text (written by a "
                    "client other than the joiner and serving?); left out", skipped, len(members), kind)
    return (mapper or RowMapper(cfg)).rows(names.index(name), hashed)


def stale_day(counts: DailyCounts, kind: str, event: str, fallback: str, available: Days | None = None,
              ) -> str | None:
    """``event``'s latest day if it is more than ``STALE_DAYS`` behind ``fallback``'s latest day (see the module
    docstring), else None (also when either has no counts, or they are the same event). ``available``: as for
    :func:`top_ids`."""
    if event == fallback:
        return None
    mine, theirs = _days(counts, kind, event, available), _days(counts, kind, fallback, available)
    if not mine or not theirs:
        return None
    # the keys' YYYYMMDD read as the keys' module reads it: date.fromisoformat takes it from Python 3.11 on only
    behind = parse_day(theirs[-1]) - parse_day(mine[-1])
    return mine[-1] if behind > dt.timedelta(days=STALE_DAYS) else None


def ranked_ids(counts: DailyCounts, kind: str, event: str, fallback: str, days: int, k: int,
               available: Days | None = None, between: Callable[[], object] = lambda: None,
               ) -> tuple[list[tuple[str, float]], str | None, int]:
    """Top-k (member, count) by ``event``, filled up to k by ``fallback``'s top ids not already in (their counts are
    ``fallback``'s); the day the window ends (``event``'s, else ``fallback``'s) and how many came from ``fallback``.
    ``available``, ``between``: as for :func:`top_ids`."""
    top, day = top_ids(counts, kind, event, days, k, available, between)
    if len(top) >= k or fallback == event:
        return top, day, 0
    seen = {m for m, _ in top}
    more, fb_day = top_ids(counts, kind, fallback, days, k, available, between)
    fill = [(m, c) for m, c in more if m not in seen][: k - len(top)]
    return top + fill, day if day is not None else fb_day, len(fill)


def compute(client: redis.Redis, prefix: str, ttl_days: int, cfg: FeatureConfig, days: int, hot_items: int,
            hot_users: int, event: str = "lookup", small_field_rows: int = 0, attempts: int = 5,
            backoff_s: float = 0.5, sleep: Callable[[float], None] = time.sleep,
            mapper: RowMapper | None = None, show: int = SHOW, fallback: str = "impression",
            on_retry: Callable[[str], None] | None = None, between: Callable[[], object] = lambda: None) -> HotSet:
    """The hot rows of ``cfg``'s table from the last ``days`` days of ``event`` counts, filled by ``fallback``'s (see
    the module docstring), with stats for the manifest (the hottest ``show`` items and users by raw id under
    ``top_items``/``top_users``; ``{kind}s_from_fallback``: how many ids the fallback ranking added;
    ``{kind}_stale_day``: ``event``'s latest day where it was too old to rank by, else None;
    ``{kind}_count_covered``: the exact sum of the counts as integers, as the rows show them: counts near 1e308 of
    another client summed to ``Infinity`` as floats, which strict JSON readers refuse). ``between`` (the
    refresh's stop check): before each Redis read and each retry's wait (:func:`with_retries`, :func:`top_ids`)."""
    counts = DailyCounts(client, prefix=prefix, ttl_days=ttl_days)
    parts, stats = [], {"days": days, "event": event, "fallback_event": fallback}
    # every kind's and event's days from one walk of the keyspace (DailyCounts.all_days_available), not one per read
    available = with_retries("days with counts", counts.all_days_available, attempts, backoff_s,
                             sleep, on_retry, between) if hot_items > 0 or hot_users > 0 else {}
    for kind, k in (("item", hot_items), ("user", hot_users)):
        stale = stale_day(counts, kind, event, fallback, available) if k > 0 else None
        if stale is not None:
            log.warning("hot set: the %s %s counts end on %s, more than %d day behind the %s counts; ranking the %ss "
                        "by %s alone (is serving counting its lookups, [serve] lookup_counts?)", kind, event, stale,
                        STALE_DAYS, fallback, kind, fallback)
        top, day, filled = with_retries(
            f"top {kind}s", functools.partial(ranked_ids, counts, kind, fallback if stale else event, fallback, days,
                                              k, available, between), attempts, backoff_s, sleep, on_retry, between)
        stats[f"{kind}s_from_fallback"] = len(top) if stale else filled
        stats[f"{kind}_stale_day"] = stale
        rows = hot_rows(cfg, kind, [m for m, _ in top], mapper)
        parts.append(rows)
        stats[f"{kind}s"] = len(top)
        stats[f"{kind}_rows"] = int(len(np.unique(rows)))
        stats[f"{kind}_last_day"] = day
        stats[f"{kind}_count_covered"] = sum(int(c) for _, c in top)  # exact: floats near 1e308 summed to inf
        stats[f"top_{kind}s"] = with_retries(
            f"names of the top {kind}s", functools.partial(named_rows, counts, kind, top[:show], day, days),
            attempts, backoff_s, sleep, on_retry, between)
    small = small_field_rows_of(cfg, small_field_rows)
    stats["small_field_rows"] = int(len(small))
    rows = np.unique(np.concatenate([*parts, small]))
    return HotSet(rows, stats)


def small_field_rows_of(cfg: FeatureConfig, limit: int) -> np.ndarray:
    """Every row of the fields (with their own rows) that have at most ``limit`` buckets."""
    own = [(first, rows) for f, (first, rows) in zip(cfg.fields, cfg.blocks, strict=True)
           if f.shares is None and f.num_buckets <= limit]
    if not own:
        return np.zeros(0, np.int64)
    return np.concatenate([np.arange(first, first + rows, dtype=np.int64) for first, rows in own])

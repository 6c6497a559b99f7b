"""Each user's recently clicked items, in Redis, so serving sees the same history training saw.

Key layout::

    {prefix}:history:{user_hash}      a LIST of "{click_ts_ms}:{item_hash}", newest appended first

``user_hash`` and ``item_hash`` are ``stream.ids.stable_hash`` values (the caller hashes). No hash tag: on a Redis
Cluster (``[redis] cluster``) the users' lists spread over every node's slots. A batch's appends and reads are one
script call per hash slot (a script's keys must share one), all in one pipeline: one round trip per node holding
any of the batch's users (on a single node, one script call for the whole batch, as before), its replies bounded
together by the client's timeout (``stream.redis_deadline.round_trip``, a whole-reply client's: the joiner's):
bounded reply by reply, a node trickling its replies held a batch one timeout per hash slot of the batch's users on
it (tests/integration/test_redis_cluster.py, 40 slots in ~6 timeouts, none failed). Appends
LPUSH and LTRIM the list to ``max_len`` in the same script, so a list keeps the ``max_len`` most
recently *appended* clicks.

Redo rule: an entry found among the list's newest ``n + REDO_SLACK`` entries (``n``: the user's entries in this
batch) is not pushed again (one LPOS ... MAXLEN per entry, Redis >= 6.0.6; the stack, compose and the tests run
6.2-7.2). A joiner batch is done again after a failure rewinds the worker, after a SIGKILL between its history write
and its offset commit, and by the member a rebalance hands its partition to; each redo appended the batch's clicks
again, and those copies took the room of the user's oldest clicks, which fell off the list early and were missing
from later as-of reads (wrong features for training and serving, more with every redo of a crash-looping worker).
An entry is a click's identity: the joiner joins one click per impression (a second click on it is counted as
``duplicate_clicks`` and never appended), and two entries alike (the same item at the same millisecond) read as one
click anyway. Only the list's head is searched: a redo comes right after its failure, so the clicks of the user
appended meanwhile (by other partitions' workers) are few, and a search of the whole kept list cost 1.8-2.5x the
append (bench/README.md, "history appends"). What it misses: a redo after more than ``REDO_SLACK`` newer clicks of
that user were appended pushes copies, as every redo did before; readers still deduplicate (:func:`_parse`), so such
a copy costs one older click its room, never a wrong feature. Those newer clicks include the first run's own that the
redo's batch does not hold: a redo cut shorter (a rebalance's first fetch) with 5 of a user's 30 clicks searches the
newest 21 entries, where the first run left those 5 at depth 25-29, and pushes them again (measured on a real Redis).
Of a user's clicks in one batch only the newest ``max_len`` are sent: the LTRIM dropped the others at once, and a redo
that searched for them pushed them again over the batch's newer clicks (:meth:`UserHistory.append_many`).

Expiry (``[redis] history_ttl_days``, ``ttl_days`` here): each append also sets its key to expire ``ttl_days`` from
*now* (EXPIRE in the same script), a sliding expiry: an active user's list never expires, one idle that long is
dropped and starts cold again, so Redis holds the lists of the users seen in the last ``ttl_days`` only, not of every
user ever seen. Now is Redis's wall clock, never the clicks' event time: a replay of years-old data must not write
lists that are expired already. ``ttl_days = 0``: never expire (each append PERSISTs its key, so a deployment that
turns expiry off keeps the lists it had).

Clicks may be appended out of click-time order (late clicks, several joiner partitions). Readers
therefore never trust list order: they sort by click time and filter by it. :meth:`UserHistory.as_of`
returns only clicks strictly before the given time -- the rule that keeps the future (including the
impression's own click, whose time is after the impression) out of training features. As-of reads
are exact as long as the list still holds the clicks before that time, i.e. when fewer than
``max_len`` newer clicks of the user were appended since. A joiner reading in event order can still append more:
it reads a sample's history when the sample goes out (up to a window after its impression), and a user may click
more than that in between (README, "the samples topic": on ML-1M's bursts, up to 6.8% of the impressions).
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Callable, Sequence
from itertools import chain
from typing import Any, TypeVar, cast

import numpy as np
import redis
from redis.crc import key_slot

from stream.counts_keys import DAY_S
from stream.metrics import HISTORY_MALFORMED
from stream.redis_client import Client, is_cluster, run_script
from stream.redis_deadline import round_trip

# The redo rule's search depth beyond a user's own entries of the batch (module docstring): the newer clicks of the
# user that may come between a batch and its redo. Each LPOS scans up to n + REDO_SLACK entries (at most the kept
# list): measured, 0 / 16 / 32 / 64 cost 1.13 / 1.19-1.29 / 1.33-1.49 / 1.38-1.39x main's append on full lists
# (scratch runs on a loaded machine), 16 the most that looked within its 1.3x; bench/history_appends.py then measured
# 16 at 1.26-1.39x (bench/README.md, "history appends").
REDO_SLACK = 16

# The longest entry a history read sends back as it is: a well-formed one, "{ts}:{item}" of two int64s, is at most 40
# bytes (19 digits, a colon, a dash and 19 digits); a longer one is read as malformed (``_LRANGE_MANY``). 64: room
# above 40, and 50 entries of it are a ~3 KB reply per user however large the stored values are.
ENTRY_MAX_BYTES = 64


def _as_ints(name: str, values: Sequence[int] | np.ndarray) -> list[int]:
    seq = values.tolist() if isinstance(values, np.ndarray) else list(values)
    if set(map(type, seq)) <= {int}:  # the common case (the joiner's own ints), checked in one C-level pass
        return seq
    out = []
    for i, v in enumerate(seq):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"argument {name!r}: element {i} is {v!r}, expected an integer")
        out.append(int(v))
    return out


def _same_length(**named: list[int]) -> None:
    (first, ref), *rest = named.items()
    for name, seq in rest:
        if len(seq) != len(ref):
            raise ValueError(f"argument {name!r}: has {len(seq)} elements but {first!r} has {len(ref)}; "
                             "expected one per element")


_INT64 = 2**63


_ENTRY = re.compile(rb"(\d{1,19}):(-?\d{1,19})")  # one entry as the joiner writes it (ASCII digits only)
_WELL_FORMED = re.compile(rb"\d{1,19}:-?\d{1,19}(?:\n\d{1,19}:-?\d{1,19})*")  # entries joined by newlines


def _entry(raw: bytes | str) -> tuple[int, int] | None:
    """``"{ts}:{item}"`` -> ``(ts, item)``; None for anything else (written by someone else, or damaged). Only the
    form the joiner writes (``_ENTRY``): Python's int() also reads " 6", "+5", "1_0", "6\n" and other scripts' digits
    ("٣"), so a damaged or foreign entry read as a click, uncounted."""
    try:
        got = _ENTRY.fullmatch(raw.encode() if isinstance(raw, str) else raw)
    except (UnicodeEncodeError, TypeError, AttributeError):
        return None
    if got is None:
        return None
    ts, item = int(got[1]), int(got[2])
    if not 0 <= ts < _INT64 or not -_INT64 <= item < _INT64:
        return None
    return ts, item

_CLAMPED = (np.iinfo(np.int64).min, np.iinfo(np.int64).max)  # where np.fromstring saturates an out-of-range number
_COLON, _NEWLINE, _DASH = ord(":"), ord("\n"), ord("-")


def _well_formed(joined: bytes) -> bool:
    """``_WELL_FORMED.fullmatch(joined) is not None``, in a few numpy passes (about a fifth of the regex's time on a
    batch's entries): every byte a digit but the separators, which read ``:`` (``-``)? ``\n`` ... ``:`` (``-``)?, a
    dash only right after a colon, and every run of digits 1-19 long (the one between a colon and its dash, 0)."""
    b = np.frombuffer(joined, np.uint8)
    pos = np.flatnonzero((b - np.uint8(48)) >= 10)  # (S,) where the non-digits are
    if len(b) == 0 or len(pos) == 0:
        return False
    c = b[pos]
    dash = c == _DASH
    if not ((c == _COLON) | (c == _NEWLINE) | dash).all():
        return False
    if dash.any():
        at = np.flatnonzero(dash)
        if at[0] == 0 or not ((c[at - 1] == _COLON) & (pos[at - 1] == pos[at] - 1)).all():
            return False
        c = c[~dash]
    # ':' and '\n' alternate, from a colon to a colon
    if len(c) % 2 == 0 or not (c[0::2] == _COLON).all() or not (c[1::2] == _NEWLINE).all():
        return False
    runs = np.diff(pos, prepend=-1, append=len(b)) - 1  # (S + 1,) digits before each separator, and after the last
    ok = (runs >= 1) & (runs <= 19)
    ok[:-1] |= dash  # the run ending at a dash is the empty one after its colon
    return bool(ok.all())


def _parse_well_formed(entries: list[bytes | str]) -> tuple[list[int], list[int]] | None:
    """:func:`_parse` for the common case, in a few C-level passes over the whole list (one regex check, one numeric
    parse, one stable argsort), about half the time of the entry-by-entry path for a full list: every entry bytes,
    ``digits:digits``, in range and distinct. None otherwise, for :func:`_parse`'s entry-by-entry path (which skips,
    counts and deduplicates)."""
    if not entries or not all(map(bytes.__instancecheck__, entries)):
        return None
    joined = b"\n".join(reversed(entries))  # type: ignore[arg-type]  # oldest appended first
    if _WELL_FORMED.fullmatch(joined) is None:
        return None
    # The regex allows exactly two numbers per entry, so the text parse pairs them up; it saturates numbers out of
    # int64's range, so a value at either end goes the careful way.
    numbers = np.fromstring(joined.replace(b":", b" ").replace(b"\n", b" "), dtype=np.int64, sep=" ")
    if len(numbers) != 2 * len(entries) or numbers.min() == _CLAMPED[0] or numbers.max() == _CLAMPED[1]:
        return None
    ts, items = numbers[0::2], numbers[1::2]
    order = np.argsort(ts, kind="stable")  # equal click times keep append order
    ts_sorted, items_sorted = ts[order].tolist(), items[order].tolist()
    if len(set(zip(ts_sorted, items_sorted, strict=True))) != len(ts_sorted):  # a click appended twice
        return None
    return ts_sorted, items_sorted


def _parse(entries: list[bytes | str]) -> tuple[list[int], list[int]]:
    """Entries of one list (newest appended first) -> (click times, item hashes), oldest click first.

    Sorting is stable over the oldest-appended-first order, so equal click times keep append order.
    A malformed entry is skipped and counted (``streamrec_history_malformed_total``): one damaged
    entry must not fail a joiner batch or a serving request. A repeated entry (same click time and
    item) is one click: lists written before the redo rule, and a batch redone after more than ``REDO_SLACK`` newer
    clicks of the user, hold copies (module docstring).
    """
    # Long lists (a returning user's) the whole-list way; below ~16 entries its fixed cost is more than it saves.
    fast = _parse_well_formed(entries) if isinstance(entries, list) and len(entries) >= 16 else None
    return fast if fast is not None else _parse_each(entries)


def _parse_each(entries: list[bytes | str]) -> tuple[list[int], list[int]]:
    """:func:`_parse` entry by entry: the definition, and the path for anything but a clean long list."""
    pairs, seen = [], set()
    for raw in reversed(entries if isinstance(entries, list) else []):
        entry = _entry(raw)
        if entry is None:
            HISTORY_MALFORMED.inc()
            continue
        if entry not in seen:  # the same click appended twice (a batch redone late: the redo rule, module docstring)
            seen.add(entry)
            pairs.append(entry)
    pairs.sort(key=lambda p: p[0])
    return [p[0] for p in pairs], [p[1] for p in pairs]


_TS_BITS = 42  # 2**42 ms is past 2100 (events.MAX_TS_MS): a click time fits beside a user's index in one int64


def _empty_lists(n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` empty lists as (flat (0,) int64, offsets (n + 1,) int32)."""
    return np.zeros(0, np.int64), np.zeros(n + 1, np.int32)


def _to_lists(flat: np.ndarray, offsets: np.ndarray) -> list[list[int]]:
    """A list column (flat (H,), offsets (N + 1,)) as N Python lists."""
    items, bounds = flat.tolist(), offsets.tolist()
    return [items[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _as_of_columns(users: list[int], times: list[int], distinct: list[int], lists: list[list[bytes | str]],
                   max_len: int) -> list[list[int]] | None:
    """:func:`_as_of_flat` as one Python list per sample."""
    got = _as_of_flat(users, times, distinct, lists, max_len)
    return None if got is None else _to_lists(*got)


def _as_of_flat(users: list[int], times: list[int], distinct: list[int], lists: list[list[bytes | str]],
                max_len: int) -> tuple[np.ndarray, np.ndarray] | None:
    """:meth:`UserHistory.as_of_flat` over the whole batch at once, for the common case: every stored entry well
    formed (``digits:digits``, bytes, click time below 2**42), no entry stored twice for a user, fewer than 2**20
    users. One regex check and one numeric parse of every entry together, one stable sort by (user, click time), one
    binary search for all the samples, one gather of their items. None otherwise, for the per-user path (which skips,
    counts and deduplicates)."""
    counts = np.fromiter(map(len, lists), np.int64, len(lists))
    total = int(counts.sum())
    if total == 0:
        return _empty_lists(len(users))
    if len(distinct) >= 1 << 20 or not all(map(list.__instancecheck__, lists)):
        return None
    entries = list(chain.from_iterable(e[::-1] for e in lists if e))  # each user's oldest appended first
    if not all(map(bytes.__instancecheck__, entries)):
        return None
    joined = b"\n".join(cast("list[bytes]", entries))
    if not _well_formed(joined):
        return None
    numbers = np.fromstring(joined.replace(b":", b" ").replace(b"\n", b" "), dtype=np.int64, sep=" ")
    if len(numbers) != 2 * total or numbers.min() == _CLAMPED[0] or numbers.max() == _CLAMPED[1]:
        return None
    click_ts, items = numbers[0::2], numbers[1::2]
    if click_ts.max() >= 1 << _TS_BITS:
        return None
    if len(lists) == 1 and bool((click_ts[1:] > click_ts[:-1]).all()):
        # One user (a serving request) whose clicks came in strictly increasing time, as the joiner appends them: in
        # order already and no click twice, so the sort and the search for copies below have nothing to do (~20% of
        # this function for one user of 20-80 clicks, measured); user 0's key is its click time.
        key = click_ts
    else:
        owner = np.repeat(np.arange(len(lists), dtype=np.int64), counts)
        key = (owner << _TS_BITS) | click_ts
        order = np.argsort(key, kind="stable")  # by user, then click time; equal times keep append order
        key, items = key[order], items[order]
        same = np.flatnonzero(key[1:] == key[:-1])  # (R,) rows whose next row has the same user and click time
        if len(same):
            # The same click appended twice (a batch done again after a crash) is one click, which the per-user path
            # drops: a copy lies in a run of equal (user, click time), so only those rows are searched for one.
            rows = np.union1d(same, same + 1)
            k, it = key[rows], items[rows]
            by_item = np.lexsort((it, k))
            k, it = k[by_item], it[by_item]
            if ((k[1:] == k[:-1]) & (it[1:] == it[:-1])).any():
                return None
    sample_ts = np.asarray(times, np.int64)
    if len(sample_ts) and sample_ts.min() < 0:
        return None
    # A time past every storable click (serving asks "as of" the far future) is 2**42: the sum below is then the next
    # user's first key, before which the search ends (every click of the user), as it should.
    sample_ts = np.minimum(sample_ts, 1 << _TS_BITS)
    index = {u: i for i, u in enumerate(distinct)}
    who = np.fromiter(map(index.__getitem__, users), np.int64, len(users))
    ends = np.searchsorted(key, (who << _TS_BITS) + sample_ts, side="left")  # clicks of the user with time < ts
    starts = np.maximum(np.cumsum(counts)[who] - counts[who], ends - max_len)  # (N,)
    lengths = ends - starts  # (N,) each sample's history length
    offsets = np.zeros(len(users) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    # (H,) the items of every sample's range, in sample order: range i is items[starts[i]:ends[i]]
    flat = items[np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1], dtype=np.int64)]
    return flat, offsets.astype(np.int32)


_Answer = TypeVar("_Answer", tuple[np.ndarray, np.ndarray], list[list[int]])  # a read's answer: flat, or lists


def _every_click_of_one(times: list[int], distinct: list[int], lists: list[list[bytes | str]]) -> bool:
    """A read of one user's every stored click (serving's, "as of" the far future), which the list's own parse
    answers: one distinct user, every time past any storable click, its entries a list (not a wrong-type marker)."""
    return len(distinct) == 1 and min(times) >= 1 << _TS_BITS and isinstance(lists[0], list)


def keys_prefix(prefix: str) -> str:
    """What every user's history key starts with under Redis prefix ``prefix`` (:meth:`UserHistory.key`): the
    prefix serving's history cache asks Redis to track (``serving/history_cache.py``)."""
    return f"{prefix}:history:"


class UserHistory:
    """Users' recent clicks (see the module docstring for keys and the as-of rule)."""

    def __init__(self, client: Client, prefix: str = "streamrec", max_len: int = 50, ttl_days: int = 30) -> None:
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"argument 'prefix': got {prefix!r}, expected a non-empty string")
        if isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)) or max_len < 1:
            raise ValueError(f"argument 'max_len': got {max_len!r}, expected an integer >= 1")
        if isinstance(ttl_days, bool) or not isinstance(ttl_days, (int, np.integer)) or not 0 <= ttl_days <= 3_650:
            raise ValueError(f"argument 'ttl_days': got {ttl_days!r}, expected an integer 0-3650 (0: never expire)")
        self.client = client
        self.prefix = prefix
        self.max_len = int(max_len)
        self.ttl_days = int(ttl_days)
        self._lrange_many: Any = None  # registered on first use
        self._append_many: Any = None

    def key(self, user_hash: int) -> str:
        return f"{keys_prefix(self.prefix)}{int(user_hash)}"

    def append_many(
        self,
        user_hashes: Sequence[int] | np.ndarray,
        item_hashes: Sequence[int] | np.ndarray,
        click_ts: Sequence[int] | np.ndarray,
    ) -> None:
        """Append one click per element, in the given order; one Redis round trip for the batch.

        Per distinct user: one LPUSH with that user's entries in the given order (the same as one LPUSH per entry),
        but for those among the list's newest ``n + REDO_SLACK`` or earlier in the batch (the redo rule, module
        docstring: a batch appended again right after changes nothing; of a user's entries only the last ``max_len``
        are sent, the others being trimmed at once anyway), then one LTRIM to ``max_len`` (where the list
        grew past it) and one EXPIRE to ``ttl_days`` from now, wall clock (PERSIST where ``ttl_days`` is 0; module
        docstring); all in one script call (``_APPEND_MANY``). A key that is not a list
        fails its own append only (it is not trimmed, and its expiry is left as it was): the others are made, then
        ``redis.ResponseError`` is raised.
        """
        users = _as_ints("user_hashes", user_hashes)
        items = _as_ints("item_hashes", item_hashes)
        times = _as_ints("click_ts", click_ts)
        _same_length(user_hashes=users, item_hashes=items, click_ts=times)
        if not users:
            return
        by_user: dict[int, dict[str, None]] = {}  # each user's entries in the given order, each once
        for u, item, ts in zip(users, items, times, strict=True):
            by_user.setdefault(u, {})[f"{ts}:{item}"] = None
        calls = []
        for group in self._by_slot(list(by_user)):
            args: list[int | str] = [self.max_len, self.ttl_days * DAY_S]
            for u in group:
                # Only the newest max_len: the script's LTRIM would drop the older ones at once, and a redo that
                # searched for them (trimmed, so not found) pushed them again over the batch's newer clicks.
                entries = list(by_user[u])[-self.max_len:]
                args.append(len(entries))
                args.extend(entries)
            calls.append(([self.key(u) for u in group], args))
        if self._append_many is None:
            self._append_many = self.client.register_script(self._APPEND_MANY)
        with round_trip(self.client):  # a cluster's script calls (one per slot) by one timeout (module docstring)
            replies = run_script(self.client, self._append_many, calls, transaction=False)
        errors = [e for got in replies for e in got]
        if errors:
            first = errors[0]
            raise redis.ResponseError(first.decode() if isinstance(first, bytes) else str(first))

    def _by_slot(self, users: list[int]) -> list[list[int]]:
        """``users`` in groups whose keys share a Redis Cluster hash slot (a script's keys must), each group in the
        given order; on a single node one group of all. Results are put back in the given order by the callers."""
        if not is_cluster(self.client):
            return [users]
        groups: dict[int, list[int]] = {}
        for u in users:
            groups.setdefault(key_slot(self.key(u).encode()), []).append(u)
        return list(groups.values())

    # A batch's appends as one script: per key (KEYS) its count n of entries and the entries (ARGV, after max_len and
    # the expiry in seconds), one LPOS per entry over the list's newest n + REDO_SLACK (the redo rule: an entry found
    # is not pushed again), one LPUSH of the others (in slices: Lua's unpack has a stack limit), one LTRIM where the
    # list grew past max_len and one EXPIRE (PERSIST for 0). A redis-py pipeline spent ~5 us packing each of its two
    # commands per user: for 3,400 clicks of ~2,800 users 28.9 ms a batch against 10.4 ms (the same lists). One LRANGE
    # of the head per user costs more than the LPOSes (each entry it returns becomes a Lua string: bench/README.md,
    # "history appends"). pcall: an error on one key (not a list) leaves the others' appends made, as a pipeline did; a
    # key whose LPOS or first LPUSH failed (not a list: not ours) is neither trimmed nor given an expiry, one that a
    # later slice failed on (out of memory) is, as the entries pushed are.
    _APPEND_MANY = (
        "local max_len, ttl, at, errors = tonumber(ARGV[1]), tonumber(ARGV[2]), 3, {} "
        "for _, k in ipairs(KEYS) do "
        "local n, ok, fresh, len = tonumber(ARGV[at]), true, {}, 0 "
        f"local within = tostring(n + {REDO_SLACK}) "
        "for j = at + 1, at + n do "
        "local r = redis.pcall('LPOS', k, ARGV[j], 'MAXLEN', within) "
        "if type(r) == 'table' and r['err'] then errors[#errors + 1] = r['err'] ok = false break end "
        "if not r then fresh[#fresh + 1] = ARGV[j] end end "
        "for j = 1, ok and #fresh or 0, 4000 do "
        "local r = redis.pcall('LPUSH', k, unpack(fresh, j, math.min(j + 3999, #fresh))) "
        "if type(r) == 'table' and r['err'] then errors[#errors + 1] = r['err'] ok = j > 1 break end len = r end "
        "if ok then if len > max_len then redis.pcall('LTRIM', k, 0, max_len - 1) end "
        "if ttl > 0 then redis.pcall('EXPIRE', k, ttl) else redis.pcall('PERSIST', k) end end "
        "at = at + n + 1 end "
        "return errors"
    )

    # One command for a whole batch: redis-py spends ~5 us packing each pipelined command, so thousands of
    # LRANGEs cost more client time than the server's work. A server-side loop over KEYS does the same reads.
    # A key of the wrong type (damaged or written by someone else) reads as one malformed entry, not as an
    # error that fails the whole batch. Any other error (an ACL denying LRANGE: NOPERM, or Redis 6's "The user
    # executing the script can't run this command") fails the read: read as malformed, every user had no history.
    # An entry longer than ENTRY_MAX_BYTES is no click of ours (another client's, damaged): it is sent back as one
    # malformed entry too, so the reply holds at most max_len * ENTRY_MAX_BYTES bytes of entries per user. Sent
    # whole, one user's 20 MB entry crossed the socket on every serving request and every joiner batch for that
    # user (past the timeout, or into the memory of the process). The server still copies it into the script.
    _LRANGE_MANY = (
        "local out = {} for i, k in ipairs(KEYS) do "
        "local r = redis.pcall('LRANGE', k, 0, ARGV[1]) "
        "if r['err'] then if not string.find(r['err'], 'WRONGTYPE', 1, true) then return r end "
        "r = {'!wrongtype'} end "
        f"for j = 1, #r do if #r[j] > {ENTRY_MAX_BYTES} then r[j] = '!toolong' end end "
        "out[i] = r end return out"
    )

    def _script(self) -> Any:
        if self._lrange_many is None:
            self._lrange_many = self.client.register_script(self._LRANGE_MANY)
        return self._lrange_many

    def _lrange(self, distinct: list[int]) -> list[list[bytes | str]]:
        """The stored entries of each user (newest appended first), in the order of ``distinct``: one script call
        for all (one per hash slot on a cluster, pipelined)."""
        groups = self._by_slot(distinct)
        with round_trip(self.client):  # a cluster's script calls (one per slot) by one timeout (module docstring)
            got = run_script(self.client, self._script(), [([self.key(u) for u in g], [self.max_len - 1])
                                                           for g in groups], transaction=False)
        if len(groups) == 1:
            return cast("list[list[bytes | str]]", got[0])
        by_user = {u: entries for group, lists in zip(groups, got, strict=True)
                   for u, entries in zip(group, lists, strict=True)}
        return [by_user[u] for u in distinct]

    def _read(self, users: list[int]) -> dict[int, tuple[list[int], list[int]]]:
        distinct = list(dict.fromkeys(users))
        return {u: _parse(entries) for u, entries in zip(distinct, self._lrange(distinct), strict=True)}

    def as_of(self, user_hashes: Sequence[int] | np.ndarray, ts_ms: Sequence[int] | np.ndarray,
              limit: int | None = None) -> list[list[int]]:
        """For each ``(user, ts)``: item hashes of the user's clicks with click time ``< ts`` (strictly),
        oldest first (newest last), at most ``max_len`` (or ``limit``, the newest, when smaller). One pipeline,
        one LRANGE per distinct user."""
        return _to_lists(*self.as_of_flat(user_hashes, ts_ms, limit))

    def as_of_flat(self, user_hashes: Sequence[int] | np.ndarray, ts_ms: Sequence[int] | np.ndarray,
                   limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`as_of` as one list column: ``(flat, offsets)``, flat (H,) int64 item hashes and offsets (N + 1,)
        int32, the i-th history being ``flat[offsets[i]:offsets[i + 1]]`` (what an Arrow list array is made of: the
        joiner's samples take it as it is, with no Python list per sample)."""
        max_len = self.max_len if limit is None else max(0, min(self.max_len, int(limit)))
        users = _as_ints("user_hashes", user_hashes)
        times = _as_ints("ts_ms", ts_ms)
        _same_length(user_hashes=users, ts_ms=times)
        if not users:
            return _empty_lists(0)
        distinct = list(dict.fromkeys(users))
        return self._flat(users, times, distinct, self._lrange(distinct), max_len)

    def as_of_later(self, user_hashes: Sequence[int] | np.ndarray, ts_ms: Sequence[int] | np.ndarray,
                    limit: int | None = None) -> Callable[[], list[list[int]]]:
        """:meth:`as_of` in two halves, so a caller works while Redis answers: the read is SENT now, on a connection
        taken from the client's pool, and the returned callable reads the answer, gives the connection back and
        returns what :meth:`as_of` would have. Serving sends a user's history read before it encodes the candidates
        and collects it last (``serving/history.py``), which hides the round trip behind that work.

        Call the returned callable exactly once, also when the caller's own work failed: until it is called the
        answer is pending on a connection that is out of the pool (it is never given back with a reply still
        unread: a failed or timed-out read disconnects it first). A second call returns the first call's result
        (or raises its error again). Errors of the send (Redis down, refused login) are raised here, those of the
        answer (a timeout) by the callable. A client that does not pool connections (one bound to a single
        connection, or a Redis Cluster client, whose reads go to several nodes) reads at once and the callable returns
        that result."""
        return self._later(user_hashes, ts_ms, limit, self._lists)

    def as_of_flat_later(self, user_hashes: Sequence[int] | np.ndarray, ts_ms: Sequence[int] | np.ndarray,
                         limit: int | None = None) -> Callable[[], tuple[np.ndarray, np.ndarray]]:
        """:meth:`as_of_later` for :meth:`as_of_flat`: the callable returns the ``(flat, offsets)`` list column. The
        joiner sends a partition's read and joins the next partition while Redis answers (``stream/joiner/
        pipeline.py``); the same rules: call the callable exactly once, also when the caller's own work failed.

        On a Redis Cluster client (no ``connection_pool``: the users' keys live on several nodes) the read is sent AND
        collected here, at once, and the callable returns its result: serving's request does not overlap it with
        encoding the candidates. Its cost, measured in-process (a scratch loop, not kept: 1 user of 50 clicks x 100
        candidates, read + encode + score, loopback Redis, 3,000 requests a run, 5 runs on 2 shared CPU cores): p50
        456-464 us on a single node (the read sent early), 478-489 us on a single node read at once (4 of the 5 runs:
        the overlap is worth ~20-25 us here), 524-616 us on a three-primary cluster, i.e. +60-160 us p50 (+100-300 us
        p99) against the single node. Most of it is the cluster client's per-command cost, not the lost overlap: the
        read alone took 127-130 us on a node and 185-237 us on the cluster (redis-py's slot routing, ~10-35 us a
        command, and ``stream.redis_client.LazyClient``'s translation of cluster errors, ~10-15 us a command)."""
        return self._later(user_hashes, ts_ms, limit, self._flat)

    def _later(self, user_hashes: Sequence[int] | np.ndarray, ts_ms: Sequence[int] | np.ndarray, limit: int | None,
               finish: Callable[[list[int], list[int], list[int], list[list[bytes | str]], int], _Answer]
               ) -> Callable[[], _Answer]:
        """:meth:`as_of_flat_later` and :meth:`as_of_later`: the read sent now, ``finish`` (:meth:`_flat` or
        :meth:`_lists`) making the answer from the stored entries when it is collected."""
        max_len = self.max_len if limit is None else max(0, min(self.max_len, int(limit)))
        users = _as_ints("user_hashes", user_hashes)
        times = _as_ints("ts_ms", ts_ms)
        _same_length(user_hashes=users, ts_ms=times)
        pool = getattr(self.client, "connection_pool", None)
        if not users or pool is None or getattr(self.client, "connection", None) is not None:
            distinct = list(dict.fromkeys(users))
            done = finish(users, times, distinct, self._lrange(distinct) if users else [], max_len)
            return lambda: done
        distinct = list(dict.fromkeys(users))
        script = self._script()
        keys = [self.key(u) for u in distinct]
        conn = pool.get_connection()
        try:
            conn.send_command("EVALSHA", script.sha, len(keys), *keys, self.max_len - 1)
        except BaseException:
            pool.release(conn)  # send_command disconnected it on a socket error: nothing is pending
            raise
        outcome: list[Any] = []  # [result] or [None, exc]: what the first call gave

        def collect() -> _Answer:
            if not outcome:
                try:
                    try:
                        lists = conn.read_response()  # a socket error or a timeout disconnects it: nothing pending
                    except redis.exceptions.NoScriptError:  # a Redis restarted or flushed: load it, read again
                        lists = None
                    finally:
                        pool.release(conn)
                    if lists is None:
                        lists = self._lrange(distinct)
                    outcome.append(finish(users, times, distinct, lists, max_len))
                except BaseException as exc:
                    outcome[:] = [None, exc]
            if len(outcome) == 2:
                raise outcome[1]
            return cast("_Answer", outcome[0])

        return collect

    def _lists(self, users: list[int], times: list[int], distinct: list[int], lists: list[list[bytes | str]],
               max_len: int) -> list[list[int]]:
        """:meth:`_flat` as one Python list per sample (:meth:`as_of_later`'s answer). Serving's one-user read of every
        click takes the list's own parse straight to lists: through :meth:`_flat`'s arrays and back (``np.asarray``,
        ``np.tile``, ``_to_lists``) it cost ~25 us more a request in the server (bench/README.md, "## serving",
        forty-third session's history read)."""
        if _every_click_of_one(times, distinct, lists):
            got = _parse(lists[0])[1][-max_len:] if max_len else []
            return [got[:] for _ in users]  # (a list per sample, as _to_lists gives: a caller may change one)
        return _to_lists(*self._flat(users, times, distinct, lists, max_len))

    def _flat(self, users: list[int], times: list[int], distinct: list[int], lists: list[list[bytes | str]],
              max_len: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`as_of_flat` from the stored entries ``lists`` of the ``distinct`` users."""
        if _every_click_of_one(times, distinct, lists):
            # One user's every click (serving's read, "as of" the far future): the list's own parse, about half the
            # time of the batch path's search for this one case.
            got = np.asarray(_parse(lists[0])[1][-max_len:] if max_len else [], np.int64)  # (L,)
            return np.tile(got, len(users)), (np.arange(len(users) + 1) * len(got)).astype(np.int32)
        fast = _as_of_flat(users, times, distinct, lists, max_len)
        if fast is not None:
            return fast
        hist = {u: _parse(entries) for u, entries in zip(distinct, lists, strict=True)}
        out = []
        for u, ts in zip(users, times, strict=True):
            click_times, items = hist[u]
            n = bisect_left(click_times, ts)  # clicks with click_ts < ts
            out.append(items[max(0, n - max_len):n])
        offsets = np.zeros(len(out) + 1, np.int64)
        np.cumsum(np.fromiter(map(len, out), np.int64, len(out)), out=offsets[1:])
        return np.fromiter(chain.from_iterable(out), np.int64, int(offsets[-1])), offsets.astype(np.int32)

    def recent(self, user_hash: int) -> list[int]:
        """The user's stored clicks' item hashes, oldest first (newest last): what serving feeds the model."""
        if isinstance(user_hash, bool) or not isinstance(user_hash, (int, np.integer)):
            raise ValueError(f"argument 'user_hash': got {user_hash!r}, expected an integer")
        u = int(user_hash)
        return self._read([u])[u][1]

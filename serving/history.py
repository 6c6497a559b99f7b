"""The user's click history on the request path: whatever Redis holds or fails at, the request is scored.

Serving reads the list the joiner keeps (``stream/history.py``: ``UserHistory.as_of``, the joiner's own
parser, so serving sees exactly the clicks training saw). Degraded modes, each counted
(``serving/metrics.py``) and each scoring the request with less history instead of failing it:

* **Malformed entry** (not ``"<ts>:<item>"`` int64 integers, not UTF-8, or a key that is not a list):
  skipped by the shared parser, as the joiner skips it when it attaches history to a training sample,
  so the two stay equal; the user keeps the rest of the list (none, for a key of the wrong type).
  Counted in ``streamrec_history_malformed_total`` (the stream package's counter of skipped entries,
  which serving's ``/metrics`` includes). This deliberately follows the joiner rather than dropping the
  user's whole history: dropping it only at serving time would be training/serving skew.
* **Unreadable read** (should the reader still raise on data: a Redis ``ResponseError``, a parse error,
  a value beyond int64): that user has no history for this request; the other users of a batch keep
  theirs (the batch read is repeated per user to find which one).
  ``streamrec_serving_history_malformed_total`` counts the users.
* **Redis unavailable** (down, refusing, slower than ``redis_timeout_s``, or refusing this service's
  credentials or an ACL permission: a ``NOPERM`` answer, or Redis 6's codeless one from inside the read's script,
  ``stream.redis_client.acl_denied``, is not malformed data): every user of the request
  has no history; ``streamrec_serving_history_unavailable_total`` counts the requests. The request path
  never retries (the client is built with retries off, ``serving/service.py``), and after a failure
  requests skip Redis for ``retry_after_s`` (a breaker), so an outage costs one timeout per
  ``retry_after_s``, not one per request; the first request after that tries again.
* Any other Redis error is counted as unavailable too. ``streamrec_serving_history_errors_total`` counts
  every failed read of either of the last two kinds.

**History cache** (``[serve] history_cache_users``, ``serving/history_cache.py``): users whose histories are kept in the
process, fresh by Redis's invalidation messages, are answered without a read (:meth:`HistoryReader.start` reads only
the others); with the cache's listener disconnected every user is read as without it, so the degraded modes above are
unchanged.

The read is sent early and collected late (:meth:`HistoryReader.start`, over ``UserHistory.as_of_later``): the app
sends it as soon as it knows the user, encodes the candidates while Redis answers, and collects the answer when the
encoder reaches the history, last. It always collects it, also when the request failed in between (a 422 from the
encoder), so no answer is left unread on a pooled connection.

Logs are rate-limited (one line per kind every ``log_every_s``): a bad list of a busy user must not
flood the log.

**Redis emptied** (restarted without persistence, a FLUSHALL): every read answers an empty history, which is also
what a new user reads, so nothing above tells; every user is scored as if cold until the joiner records clicks again.
:class:`EmptiedRedisWatch` reads the joiner's keyspace markers (``stream/keyspace.py``, ``KeyspaceWatch.changed``)
every ``KEYSPACE_CHECK_S`` on a thread of its own, never on the request path, and says each loss once: a WARNING and
``streamrec_serving_redis_emptied_total{tag}``, as the joiner says it (``streamrec_join_redis_emptied_total``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from serving.history_cache import Fill, HistoryCache
from serving.metrics import ServingMetrics
from stream.history import UserHistory
from stream.keyspace import KeyspaceWatch
from stream.redis_client import acl_denied

log = logging.getLogger("streamrec.serve")

# How often serving looks at the keyspace markers: one pipelined pair of GETs per process every 10 s costs Redis
# nothing, and an emptied Redis is said within 10 s of the joiner noticing (or of the markers going)
KEYSPACE_CHECK_S = 10.0
_FAR_FUTURE_MS = 2**62  # history "as of" the far future: every stored click
_INT64 = (-(2**63), 2**63 - 1)
# Refused credentials (AuthenticationError, a ConnectionError) and a missing ACL permission (NoPermissionError,
# a ResponseError: not malformed data) are Redis unavailable to this service, said as such in the log.
_REFUSED = (redis.AuthenticationError, redis.exceptions.NoPermissionError,
            redis.exceptions.AuthenticationWrongNumberOfArgsError)
_UNAVAILABLE = (redis.ConnectionError, redis.TimeoutError, OSError, *_REFUSED)
_MALFORMED = (redis.ResponseError, ValueError, TypeError, OverflowError)


def _constant(value: list[list[int]]) -> Callable[[], list[list[int]]]:
    return lambda: value


def _once(fn: Callable[[], list[list[int]]]) -> Callable[[], list[list[int]]]:
    """``fn`` called on the first call only; every call returns its result."""
    got: list[list[list[int]]] = []

    def call() -> list[list[int]]:
        if not got:
            got.append(fn())
        return got[0]

    return call


def _raiser(exc: Exception) -> Callable[[], list[list[int]]]:
    def fail() -> list[list[int]]:
        raise exc

    return fail


def _valid(items: list[int]) -> bool:
    lo, hi = _INT64
    return all(type(v) is int and lo <= v <= hi for v in items)


class HistoryReader:
    """The last ``history_len`` clicked items of each user, oldest first; never raises for Redis or its data."""

    def __init__(self, history: UserHistory | None, history_len: int, metrics: ServingMetrics,
                 retry_after_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 log_every_s: float = 10.0, cache: HistoryCache | None = None) -> None:
        self.history, self.history_len, self.metrics = history, history_len, metrics
        self.cache = cache  # users' histories kept in process (serving/history_cache.py); None: every one read
        self.retry_after_s, self.clock, self.log_every_s = retry_after_s, clock, log_every_s
        self._skip_until = -float("inf")
        self._logged: dict[str, float] = {}
        self._lock = threading.Lock()

    def _log(self, kind: str, msg: str, *args: object) -> None:
        now = self.clock()
        with self._lock:
            if now - self._logged.get(kind, -float("inf")) < self.log_every_s:
                return
            self._logged[kind] = now
        log.warning(msg, *args)

    def _unavailable(self, n: int, exc: BaseException) -> list[list[int]]:
        self._skip_until = self.clock() + self.retry_after_s
        self.metrics.history_unavailable.inc()
        self.metrics.history_errors.inc()
        if isinstance(exc, _REFUSED) or acl_denied(exc):
            self._log("refused", "history unavailable: Redis refused this service's login or ACL permission (%s: %s); "
                      "check [redis] username and password_file; scoring without history, Redis skipped for %.1fs",
                      type(exc).__name__, exc, self.retry_after_s)
        else:
            self._log("unavailable", "history unavailable (%s: %s); scoring without history, Redis skipped for %.1fs",
                      type(exc).__name__, exc, self.retry_after_s)
        return [[] for _ in range(n)]

    def read(self, users: list[int]) -> list[list[int]]:
        """One history per user (in order). See the module docstring for what happens when Redis fails."""
        return self.start(users)()

    def start(self, users: list[int]) -> Callable[[], list[list[int]]]:
        """:meth:`read` in two halves: the read is sent now and the returned callable collects it (what :meth:`read`
        returns). Neither half raises for Redis or its data. Call the callable once the request's own work is done,
        and on every path (also when that work failed): until then the answer waits on a pooled connection
        (``UserHistory.as_of_later``); calling it again returns the same lists."""
        if self.history is None or not users:
            return _constant([[] for _ in users])
        if self.clock() < self._skip_until:
            self.metrics.history_unavailable.inc()
            return _constant([[] for _ in users])
        if self.cache is None:
            return self._send(users, None)
        hits, fill = self.cache.lookup(users)
        if not hits:
            return self._send(users, fill)
        if fill is None:  # every user cached: no Redis read at all
            return _constant([hits[u].tolist() for u in users])
        missing = fill.users  # (the cache's own list of the users it did not hold)
        read = self._send(missing, fill)

        def merge() -> list[list[int]]:
            got = dict(zip(missing, read(), strict=True))
            return [hits[u].tolist() if u in hits else got[u][:] for u in users]

        return _once(merge)

    def _send(self, users: list[int], fill: Fill | None) -> Callable[[], list[list[int]]]:
        """:meth:`start`'s Redis read of ``users``; ``fill`` (the cache's, or None) takes a clean answer."""
        assert self.history is not None  # start answers without one
        far = [_FAR_FUTURE_MS] * len(users)
        later = getattr(self.history, "as_of_later", None)
        if later is None:  # a reader with as_of only: it reads when collected
            history = self.history
            return _once(lambda: self._finish(users, lambda: history.as_of(users, far), fill))
        try:
            pending = later(users, far)
        except Exception as exc:  # noqa: BLE001 - sorted out by _finish exactly as a failed answer is
            return _constant(self._finish(users, _raiser(exc), fill))
        return _once(lambda: self._finish(users, pending, fill))

    def _finish(self, users: list[int], fetch: Callable[[], list[list[int]]],
                fill: Fill | None = None) -> list[list[int]]:
        """The collected read, or what each failure gives (module docstring); ``fill`` caches a clean answer only."""
        try:
            return self._collect(users, fetch, fill)
        finally:
            if fill is not None:
                fill.close()  # the users not cached by a clean answer: no longer pending

    def _collect(self, users: list[int], fetch: Callable[[], list[list[int]]],
                 fill: Fill | None) -> list[list[int]]:
        try:
            hists = fetch()
        except _UNAVAILABLE as exc:
            return self._unavailable(len(users), exc)
        except _MALFORMED as exc:  # an ACL's refusal inside the read's script is Redis 6's codeless ERR: not data
            return self._unavailable(len(users), exc) if acl_denied(exc) else self._per_user(users)
        except redis.RedisError as exc:
            return self._unavailable(len(users), exc)
        if not all(_valid(h) for h in hists):
            return self._per_user(users)
        out = [h[-self.history_len:] for h in hists]
        if fill is not None:
            fill.done(users, out)
        return out

    def _per_user(self, users: list[int]) -> list[list[int]]:
        """The batch read failed on malformed data: read each distinct user alone, empty for the bad ones."""
        assert self.history is not None
        got: dict[int, list[int]] = {}
        for u in dict.fromkeys(users):
            try:
                (h,) = self.history.as_of([u], [_FAR_FUTURE_MS])
            except _UNAVAILABLE as exc:
                return self._unavailable(len(users), exc)
            except (*_MALFORMED, redis.RedisError) as exc:
                h = None
                reason = f"{type(exc).__name__}: {exc}"
            else:
                reason = "an item beyond int64"
            if h is None or not _valid(h):
                self.metrics.history_malformed.inc()
                self.metrics.history_errors.inc()
                self._log("malformed", "user %d: malformed history in Redis (%s); scored without history",
                          u, str(reason)[:200])
                h = []
            got[u] = h[-self.history_len:]
        return [got[u] for u in users]


class EmptiedRedisWatch:
    """Says a Redis that lost the joiner's keys (module docstring, "Redis emptied"): :meth:`check` every ``every_s``
    on a thread between :meth:`start` and :meth:`stop`."""

    def __init__(self, client: Any, prefix: str, metrics: ServingMetrics, every_s: float = KEYSPACE_CHECK_S) -> None:
        self.watch, self.metrics, self.every_s = KeyspaceWatch(client, prefix), metrics, every_s
        self.prefix = prefix
        self._other_type: list[str] = []  # the markers of another Redis type, last said
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> list[str]:
        """One look at the markers: the tags lost since the last look, each said (a WARNING, the metric). A Redis that
        fails the look (down, slow) is the history reads' to report: logged at debug, tried again next time."""
        try:
            lost = self.watch.changed()
        except (redis.RedisError, OSError) as exc:
            log.debug("the Redis keyspace markers were not read: %s", exc)
            return []
        if self.watch.other_type != self._other_type:  # said when it starts (or changes), not every look
            self._other_type = self.watch.other_type
            for tag in self._other_type:
                log.warning("%s is not a keyspace marker (a key of another Redis type): a loss of the {%s} keys "
                            "cannot be told until it is deleted (redis-cli DEL %s)", self.watch.keys[tag], tag,
                            self.watch.keys[tag])
        for tag in lost:
            self.metrics.redis_emptied.labels(tag).inc()
            log.warning("Redis lost the keys under prefix %r (the joiner's %s marker is gone or set anew: restarted "
                        "without persistence, flushed, or on a Redis Cluster the node of the {%s} slot restarted "
                        "empty): users' click histories are empty until the joiner records clicks again, so users "
                        "are scored as if cold; enable persistence (appendonly)", self.prefix, self.watch.keys[tag],
                        tag)
        return lost

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="streamrec-keyspace-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        self.check()  # the first look: the markers as they are (no loss yet)
        while not self._stop.wait(self.every_s):
            self.check()

"""Users' click histories kept in the serving process, fresh by Redis's own invalidation messages.

``[serve] history_cache_users`` (0: off): a bounded LRU of user hash -> the history serving's read gave for that user
(``serving/history.py``, ``HistoryReader``: the user's last ``history_len`` clicks, oldest first), so a repeat
user's request does not cross to Redis at all (the read was ~215 us of a request's CPU and most of its slowest
requests' extra time: bench/README.md, "## serving"). Each entry is an ``array('q')`` (8 bytes a click: ~0.5 KB a
user at history_len 50, ~50 MB for 100,000 users).

**Kept fresh by Redis (server-assisted client-side caching, broadcast mode).** A listener thread holds one connection
of its own (never one of the request pool's; RESP2 whatever the request client speaks) and sends ``CLIENT ID``,
``CLIENT TRACKING on REDIRECT <its own id> BCAST PREFIX <prefix>:history:`` and ``SUBSCRIBE __redis__:invalidate``:
Redis then tells it every key under the history prefix that changes (the joiner's appends, a DEL, an expiry, an
eviction; a null message for FLUSHALL/FLUSHDB: everything), and the listener drops those users. Rules:

* **Fill race.** A read sent before a write whose invalidation is processed before the read's answer is cached must
  not be cached (it would be stale until the next write). Each miss registers the user as pending (a fill id) before
  its read is sent; an invalidation of the user (or of everything) removes it; the answer is cached only if the user
  is still pending with that id (:meth:`HistoryCache.lookup`, :class:`Fill`).
* **Listener lost** (Redis restarted, the connection killed or silent past ``ping_s`` + its timeout): invalidations
  may have been missed, so the cache is emptied and not used (every request reads Redis, as without the cache) until
  the listener is connected again with tracking on; it reconnects with backoff on its own thread, never on the
  request path. A Redis that is down therefore behaves exactly as without the cache (the reader's breaker, empty
  histories, its metrics).
* **Tracking refused** (an ACL without ``client`` or the channel, a Redis before 6, a Redis Cluster client: its keys
  live on several nodes): the cache is off, said once in a WARNING; reads go to Redis as without it.
* **Bounded**: at most ``max_users`` users (least recently used out first); an entry is exactly what the read returned
  (at most ``history_len`` clicks); a read that was not clean (a malformed entry re-read per user) is not cached.

**The one semantic change: staleness.** Between a write reaching Redis and the listener thread processing its
invalidation message, a request may still be answered from the cache with the history before that write. Measured on
loopback, 2 shared cores at load ~5 (bench/README.md, "## serving", forty-ninth session): from the write sent to the
user dropped p50 0.16-0.2 ms; p99 5-8 ms when the process's other threads yield the GIL, 16-25 ms when one spins in
Python (the listener waits for the GIL: 5 ms switch interval). Redis sends the invalidation before the write's own
reply, so the median write is already dropped when its writer reads the reply. Against click-to-score freshness (the
joiner's batch and window, seconds) this is noise; without the cache, a request in flight when a click is written
reads the history before the click too.

One more difference, in a metric: a user's malformed entries are counted by ``streamrec_history_malformed_total``
when the user's history is read from Redis, so once per fill rather than once per request.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import redis

from serving.metrics import ServingMetrics
from stream.history import keys_prefix
from stream.redis_client import is_cluster

log = logging.getLogger("streamrec.serve")

CHANNEL = "__redis__:invalidate"
LISTENER_NAME = "streamrec-history-cache"  # its connection's CLIENT SETNAME (CLIENT LIST shows it)
PING_S = 1.0  # the listener PINGs a connection silent this long; no answer within its timeout: the connection is lost
LISTENER_TIMEOUT_S = 2.0  # the listener's replies (CLIENT ID, TRACKING, SUBSCRIBE, PING) must come within this
BACKOFF_S = (0.05, 5.0)  # reconnects: the first after 50 ms, doubling up to 5 s between tries
_POLL_S = 0.1  # how often the listener looks at its stop flag while nothing arrives


class TrackingRefused(Exception):
    """Redis refused to track or to deliver invalidations to this connection (ACL, version): the cache stays off."""


class Fill:
    """The users a request is about to read from Redis, registered as pending: :meth:`done` caches the answers of those
    still pending (no invalidation meanwhile), :meth:`close` forgets the rest. Both are safe to call on every path."""

    def __init__(self, cache: HistoryCache, fill_id: int, users: list[int]) -> None:
        self.cache, self.fill_id, self.users = cache, fill_id, users

    def done(self, users: list[int], lists: list[list[int]]) -> None:
        self.cache._fill(self.fill_id, users, lists)

    def close(self) -> None:
        self.cache._cancel(self.fill_id, self.users)


class HistoryCache:
    """The LRU and its listener (module docstring): :meth:`start` / :meth:`stop` the listener thread;
    :meth:`lookup` on the request path."""

    def __init__(self, client: Any, prefix: str, max_users: int, metrics: ServingMetrics, *,
                 ping_s: float = PING_S, timeout_s: float = LISTENER_TIMEOUT_S,
                 backoff_s: tuple[float, float] = BACKOFF_S) -> None:
        if isinstance(max_users, bool) or not isinstance(max_users, int) or max_users < 1:
            raise ValueError(f"argument 'max_users': got {max_users!r}, expected an integer >= 1")
        self.prefix = keys_prefix(prefix)  # every user's history key: the prefix, then the user's hash
        self.max_users, self.metrics = max_users, metrics
        # bound once: a labels() lookup per request is a dict lookup under a lock each
        self._hits, self._misses = (metrics.history_cache_users.labels(r) for r in ("hit", "miss"))
        self.ping_s, self.timeout_s, self.backoff_s = ping_s, timeout_s, backoff_s
        self._entries: OrderedDict[int, array[int]] = OrderedDict()
        self._pending: dict[int, int] = {}  # user -> the fill id of the read in flight that may cache it
        self._fill_ids = itertools.count(1)
        self._lock = threading.Lock()
        self._up = False  # tracking on, subscribed: entries may be served and filled
        self._off = False  # tracking refused or impossible: never used
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._conn: Any = None
        pool = None if is_cluster(client) else getattr(client, "connection_pool", None)
        if pool is None:
            self._refused("[redis] cluster is set: the users' keys live on several nodes, and the cache listens to "
                          "one (set [serve] history_cache_users = 0 to silence this)")
            return
        kwargs = {**pool.connection_kwargs, "socket_timeout": timeout_s, "protocol": 2,
                  "client_name": LISTENER_NAME}
        self._connection_class, self._connection_kwargs = pool.connection_class, kwargs
        metrics.history_cache_up.set(0)

    @property
    def up(self) -> bool:
        """Whether entries are served now (the listener connected with tracking on)."""
        return self._up

    @property
    def off(self) -> bool:
        return self._off

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, user: object) -> bool:
        return user in self._entries

    # -- the request path --

    def lookup(self, users: list[int]) -> tuple[dict[int, array[int]], Fill | None]:
        """The cached histories among ``users`` and a :class:`Fill` for the others (None when the cache is not up:
        nothing read now may be cached). Counts each distinct user a hit or a miss."""
        if self._off:
            return {}, None
        distinct = list(dict.fromkeys(users))
        hits: dict[int, array[int]] = {}
        fill = None
        with self._lock:
            if self._up:
                for u in distinct:
                    got = self._entries.get(u)
                    if got is not None:
                        self._entries.move_to_end(u)
                        hits[u] = got
                missing = [u for u in distinct if u not in hits]
                if missing:
                    fill_id = next(self._fill_ids)
                    for u in missing:
                        self._pending[u] = fill_id
                    fill = Fill(self, fill_id, missing)
        if hits:
            self._hits.inc(len(hits))
        if len(distinct) > len(hits):
            self._misses.inc(len(distinct) - len(hits))
        return hits, fill

    def _fill(self, fill_id: int, users: list[int], lists: list[list[int]]) -> None:
        with self._lock:
            for u, h in zip(users, lists, strict=True):
                if self._pending.get(u) != fill_id:
                    continue  # invalidated (or the cache emptied) since the read was sent, or another read's now
                del self._pending[u]
                if self._up:
                    self._entries[u] = array("q", h)
                    self._entries.move_to_end(u)
            while len(self._entries) > self.max_users:
                self._entries.popitem(last=False)
            self._count()

    def _cancel(self, fill_id: int, users: list[int]) -> None:
        with self._lock:
            for u in users:
                if self._pending.get(u) == fill_id:
                    del self._pending[u]

    # -- invalidations (the listener thread) --

    def invalidate(self, keys: Iterable[bytes | str] | None) -> None:
        """Drop the users of ``keys`` (None: every user, Redis flushed), and their reads in flight."""
        if keys is None:
            self._clear()
            self.metrics.history_cache_invalidations.labels("all").inc()
            return
        users = []
        for k in ([keys] if isinstance(keys, (bytes, str)) else keys):
            text = k.decode(errors="replace") if isinstance(k, bytes) else str(k)
            try:
                users.append(int(text[len(self.prefix):]))
            except ValueError:
                continue  # a key under the prefix that is no user's list (another tool's): nothing cached for it
        with self._lock:
            for u in users:
                self._entries.pop(u, None)
                self._pending.pop(u, None)
            self._count()
        self.metrics.history_cache_invalidations.labels("key").inc(len(users))

    def _clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._pending.clear()
            self._count()

    def _count(self) -> None:
        """The entries gauge set to the size, under the lock (the caller holds it): set after its release, a request's
        fill and the listener's loss or invalidation could set it in the other order, and a stale size stayed (after a
        stop too) until the next change."""
        self.metrics.history_cache_entries.set(len(self._entries))

    def _set_up(self, up: bool) -> None:
        with self._lock:
            self._up = up
            self._entries.clear()  # both ways: entries filled before a loss may have missed invalidations
            self._pending.clear()
            self._count()
        self.metrics.history_cache_up.set(1 if up else 0)

    def _refused(self, why: str) -> None:
        self._off = True
        log.warning("history cache off ([serve] history_cache_users): %s; every history is read from Redis", why)

    # -- the listener --

    def start(self) -> None:
        if self._off or self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="streamrec-history-cache", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _connect(self) -> Any:
        """A listener connection with tracking on and subscribed; raises :class:`TrackingRefused` when Redis answers
        no to any step, a connection error when it cannot be reached."""
        conn = self._connection_class(**self._connection_kwargs)
        try:
            try:
                conn.connect()  # also names it (CLIENT SETNAME): an ACL without +client refuses that already
                conn.send_command("CLIENT", "ID")
                own_id = conn.read_response()
                conn.send_command("CLIENT", "TRACKING", "on", "REDIRECT", own_id, "BCAST", "PREFIX", self.prefix)
                conn.read_response()
                conn.send_command("SUBSCRIBE", CHANNEL)
                reply = conn.read_response()
            except redis.ResponseError as exc:  # NOPERM, an unknown command or option (Redis < 6)
                raise TrackingRefused(f"{type(exc).__name__}: {exc}") from exc
            if not (isinstance(reply, list) and reply[:1] == [b"subscribe"]):
                raise TrackingRefused(f"SUBSCRIBE {CHANNEL} answered {reply!r}")
        except BaseException:
            conn.disconnect()
            raise
        return conn

    def _run(self) -> None:
        delay = self.backoff_s[0]
        lost_said = False
        while not self._stop.is_set():
            try:
                self._conn = self._connect()
            except TrackingRefused as exc:
                self._refused(f"Redis refused tracking the history keys or their invalidation channel ({exc}); grant "
                              f"this service's ACL user +client|id +client|setname +client|tracking +subscribe and "
                              f"&{CHANNEL}")
                return
            except (redis.RedisError, OSError) as exc:
                if not lost_said:
                    log.warning("history cache: the invalidation listener cannot connect (%s: %s); serving reads every "
                                "history from Redis until it is back (retrying with backoff)", type(exc).__name__, exc)
                    lost_said = True
                if self._stop.wait(delay):
                    return
                delay = min(self.backoff_s[1], delay * 2)
                continue
            self._set_up(True)
            if lost_said:
                log.warning("history cache: the invalidation listener is back; the cache is in use again")
            lost_said, delay = False, self.backoff_s[0]
            try:
                self._listen(self._conn)
            except Exception as exc:  # noqa: BLE001 - any failure (a bug too): invalidations may be missed from here
                log.warning("history cache: the invalidation listener lost its connection (%s: %s); the cache is "
                            "emptied and not used until it is back", type(exc).__name__, exc,
                            exc_info=not isinstance(exc, (redis.RedisError, OSError)))
                lost_said = True
            finally:
                self._set_up(False)
                self._conn.disconnect()
                self._conn = None

    def _listen(self, conn: Any) -> None:
        """Invalidation messages until stopped (returns) or the connection is lost (raises)."""
        heard = time.monotonic()
        pinged = False
        while not self._stop.is_set():
            if not conn.can_read(timeout=_POLL_S):
                now = time.monotonic()
                if pinged and now - heard > self.ping_s + self.timeout_s:
                    raise redis.ConnectionError(f"no answer to PING within {self.timeout_s:g} s")
                if not pinged and now - heard > self.ping_s:
                    conn.send_command("PING")
                    pinged = True
                continue
            try:
                msg = conn.read_response()
            except redis.ResponseError:  # the answer to the PING, the one command sent here: an ACL without +ping
                msg = None  # refuses it (NOPERM), and a refusal is an answer too: the connection is alive
            heard, pinged = time.monotonic(), False
            if isinstance(msg, list) and len(msg) == 3 and msg[0] == b"message":
                self.invalidate(msg[2])

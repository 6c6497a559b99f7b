"""Serving's own row lookups per id, counted in memory and flushed to Redis day counts in the background.

The nightly hot set (``cache_refresh/hot_set.py``) should hold the rows serving actually reads. The joiner counts
impressions, but a request scores ~100 candidates for each impression it leads to, and the ranker shows the items it
scores highest, not the ones it looks up most: impression counts rank the rows serving reads only loosely. So every
scored request reports the ids whose rows it read, per kind as the hot set names them:

* ``user``: the request's user (one lookup);
* ``item``: its candidates and the user's history items (the history field shares the item block's rows).

The request path only appends the hashed ids it already has (``stream.features.hash_value``, as the encoder hashed
them) to an in-memory list under a lock, filed under the UTC day (wall clock) of the request: no Redis call, no
hashing, O(1) per request. A background thread flushes every ``flush_s`` seconds (at most a day), or sooner once
``flush_ids`` lookups are waiting: it counts them per distinct id (``np.unique``) and adds the counts to the
``lookup`` day keys (``{prefix}:counts:{kind}:lookup:{YYYYMMDD}``, ``stream/counts_keys.py``, beside the joiner's
impression counts) of the day they were made, not of the flush (a flush just after midnight writes the last seconds
of the day before to that day), with one pipelined round trip.

Bounded: at most ``max_pending`` lookups wait in memory (int64 each; those kept for a retry, below, count too, and
those a flush in progress holds: a slow Redis once let requests fill it again meanwhile); a request that would exceed
it is not counted (``streamrec_serving_lookup_counts_dropped_total{reason="full"}``).
A negative id (no hash: a history entry another Redis client wrote) is dropped at the flush (``reason="invalid"``).

A flush writes one day and kind at a time, each all or nothing and each a write of its own (``write_id``); what it
wrote counts as flushed. After a failure it asks that Redis nothing more: on a single node no later write is tried; on
a Redis Cluster only the failed kind's (each kind's counts live on one node), so with one node down the kinds on the
healthy nodes are still written (they were kept behind the failed kind, and dropped after its retry failed too).
A write Redis refuses for its key (a day key of another Redis type: WRONGTYPE) is no failure of Redis: the writes after
it still go, only it is kept for its retry, and its lookups are dropped as ``reason="refused"``, said in a WARNING once
per key (naming the key and the fix); it does not count as an outage, so a real one later is still logged.
A flush that fails (Redis down, slow, refusing, or the connection lost before Redis's reply came) keeps what it did not
write, per day and kind, counted and with its write id, for one more try at the next flush, ahead of the lookups made
since and apart from them: a write whose reply was lost may have run, and its retry under the same write id counts it
once (``stream/counts.py``, "Retries"); merged with newer lookups it could not be retried safely. What the second try
does not write is dropped (``reason="redis"``), and so is what is kept when :meth:`LookupCounts.stop`'s last flush
fails, or what waits when stop makes none (the last flush failed less than ``RECENT_FAILURE_S`` ago: Redis is not asked
again, so a frozen Redis holds a shutdown one timeout at most).
Failures are counted
(``streamrec_serving_lookup_count_flushes_total{outcome="error"}``), logged once per outage (not per flush), and
never reach a client: counts are a ranking signal, and a few seconds of them lost cost nothing a request would notice.
An unexpected error a flush raises outside its writes' handling (a bug, lookups that are no int64 ids) lost every
lookup it held uncounted (those kept for a retry too) and ended the flush thread; they are now dropped and counted
(``reason="error"``), the error is logged with its traceback once until a flush succeeds, and the thread goes on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import redis

from serving.metrics import ServingMetrics
from stream.counts import DailyCounts, new_write_id
from stream.counts_keys import DAY_MS, DAY_S, day_of
from stream.redis_client import is_cluster
from stream.strikes import is_infrastructure

log = logging.getLogger("streamrec.serve")

EVENT = "lookup"
STOP_TIMEOUT_S = 30.0  # LookupCounts.stop's bound on the wait for its flush thread
TRIES = 2  # flushes a day and kind's lookups are tried in (module docstring): the one they were made for, one retry
RECENT_FAILURE_S = 30.0  # a flush that failed this recently: stop() takes Redis as still down (no last flush)


def _refused(exc: Exception) -> bool:
    """Whether Redis answered a write with a refusal of its data (a lookup day key of another Redis type: WRONGTYPE,
    ``stream.strikes.is_infrastructure``), not a failure of its own: the writes after it still go (a string under
    today's item key once cost every user lookup of the day too, skipped behind it as behind a Redis that is down)."""
    return isinstance(exc, redis.ResponseError) and not is_infrastructure(exc)


@dataclass
class LookupWrite:
    """One day and kind's lookups counted per id, as one write (``DailyCounts.add_counts``): its id is kept across
    its retry, so a write whose reply was lost is counted once (``stream/counts.py``, "Retries")."""

    day: int  # days since the epoch (UTC) the lookups were made on
    kind: str
    members: np.ndarray  # (M,) int64, distinct hashed ids
    counts: np.ndarray  # (M,) int64, lookups of each
    lookups: int  # sum of counts
    write_id: str = field(default_factory=new_write_id)
    tries: int = 0  # flushes that tried (or failed before) it
    refused: bool = False  # Redis refused it for its key (_refused): no outage, dropped as reason="refused"


class LookupCounts:
    """Per-id lookup counts of this serving process, flushed to ``counts`` (``stream/counts.py``) in the background.

    ``add`` is the request path (thread-safe, never raises, never blocks on Redis); ``start``/``stop`` run the flush
    thread (``stop`` flushes what is left). ``flush`` may also be called directly (tests, the benchmark)."""

    def __init__(self, counts: DailyCounts, metrics: ServingMetrics | None = None, flush_s: float = 5.0,
                 flush_ids: int = 200_000, max_pending: int = 2_000_000,
                 clock: Callable[[], float] = time.time, flush_timeout_s: float | None = None) -> None:
        if not 0 < flush_s <= DAY_S or flush_ids < 1 or max_pending < 1:  # (an infinite wait raises OverflowError)
            raise ValueError(f"LookupCounts: flush_s must be in (0, {DAY_S}] and flush_ids, max_pending >= 1, got "
                             f"{flush_s!r}, {flush_ids!r}, {max_pending!r}")
        self.counts, self.metrics = counts, metrics
        self._cluster = is_cluster(counts.client)  # a failed write stops only its kind's writes (_apart)
        self.flush_s, self.flush_ids, self.max_pending = float(flush_s), int(flush_ids), int(max_pending)
        self.clock = clock
        self.flush_timeout_s = flush_timeout_s  # stop()'s wait on its last flush ([serve] lookup_counts_timeout_s)
        self._lock = threading.Lock()
        self._pending: dict[tuple[int, str], list[np.ndarray]] = {}  # (day, kind) -> hashed ids, (n,) int64 each
        self._n = 0  # lookups waiting in _pending
        self._kept: list[LookupWrite] = []  # what the last flush failed to write, for its retry (module docstring)
        self._kept_n = 0  # their lookups (they count against max_pending)
        self._held_n = 0  # lookups the flush in progress took (they count against max_pending until it ends)
        self._flush_lock = threading.Lock()  # one flush at a time (the thread, a direct call, stop)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False  # stopped: a lookup added now would never be flushed, so it is dropped and counted
        self._abandoned: threading.Thread | None = None  # a flush thread stop() gave up waiting for (stuck)
        self._failing = False  # the last flush failed: the next failure is not logged again
        self._refused_keys: set[str] = set()  # the day keys Redis refused writes to, said (_say_refused)
        self._failed_at = 0.0  # time.monotonic() when the last failed flush gave up (stop() skips its flush after one)
        self._settled = 0  # lookups the flush in progress wrote, dropped or kept (the rest of _held_n: unsettled)
        self._broken = False  # a flush failed unexpectedly (_unexpected) and none succeeded since: not logged again
        self.flushed = 0  # lookups written to Redis
        self.dropped = 0  # lookups not counted (buffer full, flush failed)

    # -- request path -----------------------------------------------------------------------------------
    def add(self, kind: str, hashed: np.ndarray) -> None:
        """Count one lookup of each of ``hashed`` (int64 (n,), ids hashed as the joiner hashes them) of ``kind``."""
        n = len(hashed)
        if not n:
            return
        day = int(self.clock()) // DAY_S  # the day it was served on, whenever it is flushed
        wake = False
        with self._lock:
            closed = self._closed
            full = not closed and self._n + self._kept_n + self._held_n + n > self.max_pending
            if not (closed or full):
                self._pending.setdefault((day, kind), []).append(hashed)
                self._n += n
                wake = self._n >= self.flush_ids
        if closed:
            self._drop("stopped", n)
        elif full:
            self._drop("full", n)
        elif wake:
            self._wake.set()

    # -- background -------------------------------------------------------------------------------------
    def flush(self) -> int:
        """Write what is waiting: first the writes the last flush failed to write (as they were, under their write
        ids), then the lookups made since, one pipelined round trip per day and kind (each all or nothing); the number
        of lookups written. On a failure what was not written is kept for the next flush, or dropped (and counted as
        dropped) when this was its second try (module docstring)."""
        with self._flush_lock:
            with self._lock:
                pending, self._pending = self._pending, {}
                writes, self._kept = self._kept, []
                self._held_n, self._n, self._kept_n = self._n + self._kept_n, 0, 0
            self._settled = 0
            try:
                return self._write(pending, writes)
            except Exception as exc:  # noqa: BLE001 - not a Redis failure (_failed takes those): a bug, bad lookups
                self._unexpected(exc)
                return 0
            finally:
                unsettled = self._held_n - self._settled  # 0 unless it raised: neither written, dropped nor kept
                with self._lock:  # the flush ends: what it held is written, dropped, or kept (_failed) in one step
                    self._kept_n, self._held_n = sum(w.lookups for w in self._kept), 0
                if unsettled:
                    self._drop("error", unsettled)

    def _write(self, pending: dict[tuple[int, str], list[np.ndarray]], writes: list[LookupWrite]) -> int:
        """:meth:`flush`'s writes: ``writes`` (kept from the last flush), then ``pending``'s lookups by day and kind."""
        for (day, kind), parts in sorted(pending.items()):
            members, counts = np.unique(np.concatenate(parts), return_counts=True)  # (M,), (M,), ascending
            members, counts = self._hashes_only(members, counts)
            if len(members):
                writes.append(LookupWrite(day, kind, members, counts, int(counts.sum())))
        if not writes:
            return 0
        written, unwritten = 0, list[LookupWrite]()  # unwritten: failed, or skipped after a failure (_apart)
        error: Exception | None = None  # the first failure of this flush
        outage: Exception | None = None  # the first of them Redis failed (not refused): the one the outage's line says
        down: list[LookupWrite] = []  # the writes Redis failed (not refused: _refused)
        for write in writes:
            if down and not self._apart(write, down):
                unwritten.append(write)  # its Redis (node) just failed: not asked again in this flush
                continue
            try:
                self.counts.add_counts(write.kind, EVENT, write.members, write.counts, write.day,
                                       write_id=write.write_id)
            except Exception as exc:  # noqa: BLE001 - Redis down or refusing: kept once, then lost; serving goes on
                error = error or exc
                unwritten.append(write)
                if _refused(exc):
                    self._say_refused(write, exc)
                else:
                    outage = outage or exc
                    down.append(write)
                continue
            written += write.lookups
        if error is not None:
            self._failed(outage or error, unwritten, outage=bool(down))
            self._flushed(written)
            return written
        if self._failing:
            log.info("lookup counts: flushing to Redis again")
        self._failing = self._broken = False
        self._outcome("ok")
        self._flushed(written)
        return written

    def _apart(self, write: LookupWrite, failed: list[LookupWrite]) -> bool:
        """Whether ``write`` goes to another Redis than the writes of this flush that ``failed``: only on a Redis
        Cluster, for a kind none of them has (each kind's counts live in one hash slot, so on one node:
        ``stream/counts.py``). On a single node every write goes where the first failure came from and is not tried
        again in the flush (a frozen Redis is waited on once); on a cluster with one node down, the kinds on the
        healthy nodes are still written (they were kept behind the failed kind, tried once more and dropped)."""
        return self._cluster and all(f.kind != write.kind for f in failed)

    def _hashes_only(self, members: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``members`` (M,) ascending and their ``counts`` (M,) without the negative ids, dropped and counted
        (``reason="invalid"``): no hash (``stream.ids.stable_hash`` is >= 0) but a history entry any Redis client may
        write ("ts:-7", read and scored as the learner read it); ``add_counts`` refuses them, and one failed its whole
        write, every lookup of the flush then kept, retried and dropped as a Redis failure."""
        start = int(np.searchsorted(members, 0))
        if start:
            self._drop("invalid", int(counts[:start].sum()))
            self._settled += int(counts[:start].sum())
        return members[start:], counts[start:]

    def _say_refused(self, write: LookupWrite, exc: Exception) -> None:
        """``write`` refused by Redis for its key (:func:`_refused`): marked, and said once per day key, naming the keys
        of another type to delete: the day key's, or its markers' (``DailyCounts.other_type_keys``; the day key was
        named whichever it was, and deleting it lost the day's good counts while the refusals went on)."""
        write.refused = True
        key = self.counts.key(write.kind, EVENT, day_of(write.day * DAY_MS))
        if key in self._refused_keys:
            return
        self._refused_keys.add(key)
        try:
            other = self.counts.other_type_keys(write.kind, EVENT, day_of(write.day * DAY_MS))
        except Exception:  # noqa: BLE001 - only for the message: Redis failing now is the next write's to say
            other = []
        if other:
            log.warning("lookup counts: Redis refuses the writes to %s (%s: %s): %s hold another Redis type than "
                        "streamrec writes there (another client's?); its lookups are not counted (streamrec_serving_"
                        "lookup_counts_dropped_total{reason=\"refused\"}) until deleted (redis-cli DEL %s)", key,
                        type(exc).__name__, exc, ", ".join(other), " ".join(other))
        else:
            log.warning("lookup counts: Redis refuses the writes to %s (%s: %s); its lookups are not counted "
                        "(streamrec_serving_lookup_counts_dropped_total{reason=\"refused\"})", key,
                        type(exc).__name__, exc)

    def _failed(self, exc: Exception, unwritten: list[LookupWrite], outage: bool = True) -> None:
        """A flush failed with ``exc`` before writing ``unwritten``: each is kept for the next flush (counted against
        ``max_pending`` when the flush ends, :meth:`flush`), unless this was its last try; counted and logged (once per
        outage). No ``outage``: Redis only refused writes for their keys (said by :meth:`_say_refused`), so nothing
        is logged here and a later outage is still said."""
        keep, lost, refused = [], 0, 0
        closed = self._closed  # stop()'s last flush: none comes after it
        for write in unwritten:
            write.tries += 1
            if write.tries < TRIES and not closed:
                keep.append(write)
            elif write.refused:
                refused += write.lookups
            else:
                lost += write.lookups
        with self._lock:
            self._kept = keep
            if outage:  # (Redis answered a refusal: up, and stop()'s last flush is still worth trying)
                self._failed_at = time.monotonic()
        self._settled += sum(w.lookups for w in unwritten)
        if lost:
            self._drop("redis", lost)
        if refused:
            self._drop("refused", refused)
        self._outcome("error")
        if not outage:  # Redis answered every write: an outage before is over, and the next one is said
            if self._failing:
                log.info("lookup counts: flushing to Redis again")
            self._failing = False
            return
        if not self._failing:
            log.warning("lookup counts: a flush to Redis failed (%s: %s); %d lookups kept for the next flush, %d not "
                        "counted, and further failures are counted in streamrec_serving_lookup_counts_dropped_total "
                        "until one succeeds", type(exc).__name__, exc, sum(w.lookups for w in keep), lost)
        self._failing = True

    def _unexpected(self, exc: Exception) -> None:
        """A flush raised ``exc`` outside its writes' handling: counted, and logged with the traceback once until a
        flush succeeds (:meth:`flush` drops what it held and did not settle, ``reason="error"``). It is not raised: the
        flush thread goes on (ended, it left every later lookup uncounted, "full", until serving restarted)."""
        self._outcome("error")
        if not self._broken:
            log.error("lookup counts: a flush failed unexpectedly (%s); the %d lookups it held (not written, dropped "
                      "or kept) are not counted, nor those of further such failures (streamrec_serving_lookup_counts_"
                      "dropped_total{reason=\"error\"}) until a flush succeeds", type(exc).__name__,
                      self._held_n - self._settled, exc_info=exc)
        self._broken = True

    def _flushed(self, n: int) -> None:
        self._settled += n
        self.flushed += n
        if self.metrics is not None and n:
            self.metrics.lookup_counts_flushed.inc(n)

    def _run(self) -> None:
        while True:
            self._wake.wait(self.flush_s)
            self._wake.clear()
            if self._stop.is_set():
                return  # stop() makes the last flush itself: one round trip, not this one and then its retry
            self.flush()

    def start(self) -> LookupCounts:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="lookup-counts", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop the flush thread and flush what is left (once); lookups added after this are dropped ("stopped": a
        request still running past the shutdown grace).

        The wait for the flush thread is bounded by ``timeout_s`` and by ``flush_timeout_s`` (a flush in progress as
        stop begins: a Redis trickling its reply held it ``timeout_s``, 30 s): a flush stuck on Redis must not hang the
        shutdown (every ``ScoringService`` exit comes here). Past it the error is logged naming the thread, the last
        flush is skipped (the stuck flush holds the flush lock) and what waits for it is dropped and counted
        ("stopped").

        Redis is waited on once at most: the last flush is waited for ``flush_timeout_s`` at most (``[serve]
        lookup_counts_timeout_s``, the counts client's timeout), the whole flush, where the client's timeouts bound each
        step of it (a connect, each recv: a Redis trickling its reply held it ~7 times as long); past it stop returns
        and the flush, left running, counts what it writes or drops. None is made when the last flush failed, less
        than ``RECENT_FAILURE_S`` ago (one
        in progress as stop began, or one just before it: Redis down or frozen, its retry would wait out the timeout
        again); what waits is then dropped and counted ("redis"). A failure older than that says little of Redis now:
        the last flush is made."""
        if self._abandoned is not None and self._abandoned.is_alive():
            return  # stopped before without its flush thread: a flush now would wait on the lock that thread holds
        if self._closed:  # stopped before: what it left is settled (a second stop said "the last flush failed ...")
            return
        self._stop.set()
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            # a flush in progress as stop begins is waited for as the last flush is: flush_timeout_s, once
            waited = timeout_s if self.flush_timeout_s is None else min(timeout_s, self.flush_timeout_s)
            thread.join(waited)
            if thread.is_alive():
                self._abandoned = thread
                with self._lock:
                    self._closed = True
                    waiting, self._pending, self._n = self._n, {}, 0
                log.error("lookup counts: the flush thread %r did not stop within %g s (a flush stuck on Redis?); "
                          "stopped without the last flush, %d lookups waiting for it not counted", thread.name,
                          waited, waiting)
                if waiting:
                    self._drop("stopped", waiting)
                return
        with self._lock:
            self._closed = True  # from here on nothing is appended: the flush below takes the last of them
        with self._flush_lock, self._lock:
            ago = time.monotonic() - self._failed_at
            down = self._failing and ago < RECENT_FAILURE_S
            if down:
                lost = self._n + self._kept_n
                refused = sum(w.lookups for w in self._kept if w.refused)  # refused for their key: no Redis failure
                self._pending, self._n, self._kept, self._kept_n = {}, 0, [], 0
        if down:
            log.warning("lookup counts: the last flush to Redis failed %.1f s before serving stopped; no last flush "
                        "(it would wait out the timeout again), %d lookups not counted", ago, lost)
            if lost - refused:
                self._drop("redis", lost - refused)
            if refused:
                self._drop("refused", refused)
            return
        with self._lock:
            writing = self._n + self._kept_n  # what the last flush takes
        last = threading.Thread(target=self.flush, name="lookup-counts-last", daemon=True)
        last.start()
        last.join(self.flush_timeout_s)  # once for the whole flush: the client's timeouts bound each step of it only
        if last.is_alive():
            self._abandoned = last  # what it writes is counted when it ends: flushed, or dropped ("redis")
            log.warning("lookup counts: the last flush to Redis did not finish within %g s "
                        "(lookup_counts_timeout_s); serving stops without waiting for it: its %d lookups are counted "
                        "when it ends, and lost uncounted if the process exits first", self.flush_timeout_s, writing)
            return
        with self._flush_lock, self._lock:  # the last flush failed: what it kept has no next flush
            kept, self._kept, self._kept_n = self._kept_n, [], 0
        if kept:
            self._drop("redis", kept)

    # -- accounting -------------------------------------------------------------------------------------
    def _drop(self, reason: str, n: int) -> None:
        with self._lock:
            self.dropped += n
        if self.metrics is not None:
            self.metrics.lookup_counts_dropped.labels(reason).inc(n)

    def _outcome(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.lookup_count_flushes.labels(outcome).inc()

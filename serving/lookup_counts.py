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
``lookup`` day keys of ``stream/counts.py`` (``{prefix}:counts:{kind}:lookup:{YYYYMMDD}``, beside the joiner's
impression counts) of the day they were made, not of the flush (a flush just after midnight writes the last seconds
of the day before to that day), with one pipelined round trip.

Bounded: at most ``max_pending`` lookups wait in memory (int64 each); a request that would exceed it is not counted
(``streamrec_serving_lookup_counts_dropped_total{reason="full"}``). A flush that fails (Redis down, slow, refusing)
drops what it had not written yet (``reason="redis"``,
``streamrec_serving_lookup_count_flushes_total{outcome="error"}``; it writes one day and kind at a time, each all or
nothing, and what it wrote before the failure counts as flushed), logs one line per outage (not per flush), and
never reaches a client: counts are a ranking signal, and a few seconds of them
lost cost nothing a request would notice.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from serving.metrics import ServingMetrics
from stream.counts import DAY_S, DailyCounts

log = logging.getLogger("streamrec.serve")

KINDS = ("user", "item")
EVENT = "lookup"


class LookupCounts:
    """Per-id lookup counts of this serving process, flushed to ``counts`` (``stream/counts.py``) in the background.

    ``add`` is the request path (thread-safe, never raises, never blocks on Redis); ``start``/``stop`` run the flush
    thread (``stop`` flushes what is left). ``flush`` may also be called directly (tests, the benchmark)."""

    def __init__(self, counts: DailyCounts, metrics: ServingMetrics | None = None, flush_s: float = 5.0,
                 flush_ids: int = 200_000, max_pending: int = 2_000_000,
                 clock: Callable[[], float] = time.time) -> None:
        if not 0 < flush_s <= DAY_S or flush_ids < 1 or max_pending < 1:  # (an infinite wait raises OverflowError)
            raise ValueError(f"LookupCounts: flush_s must be in (0, {DAY_S}] and flush_ids, max_pending >= 1, got "
                             f"{flush_s!r}, {flush_ids!r}, {max_pending!r}")
        self.counts, self.metrics = counts, metrics
        self.flush_s, self.flush_ids, self.max_pending = float(flush_s), int(flush_ids), int(max_pending)
        self.clock = clock
        self._lock = threading.Lock()
        self._pending: dict[tuple[int, str], list[np.ndarray]] = {}  # (day, kind) -> hashed ids, (n,) int64 each
        self._n = 0  # lookups waiting
        self._flush_lock = threading.Lock()  # one flush at a time (the thread, a direct call, stop)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False  # stopped: a lookup added now would never be flushed, so it is dropped and counted
        self._failing = False  # the last flush failed: the next failure is not logged again
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
            full = not closed and self._n + n > self.max_pending
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
        """Write what is waiting (one pipelined round trip per day and kind, each all or nothing); the number of
        lookups written. A failure drops (and counts as dropped) only the days and kinds not written before it."""
        with self._flush_lock:
            with self._lock:
                pending, self._pending = self._pending, {}
                n, self._n = self._n, 0
            if not n:
                return 0
            written = 0
            try:
                for (day, kind), parts in sorted(pending.items()):
                    ids = np.concatenate(parts)
                    members, counts = np.unique(ids, return_counts=True)  # (M,), (M,)
                    self.counts.add_counts(kind, EVENT, members, counts, day)
                    written += len(ids)
            except Exception as exc:  # noqa: BLE001 - Redis down or refusing: the counts are lost, serving goes on
                self._drop("redis", n - written)
                self._outcome("error")
                if not self._failing:
                    log.warning("lookup counts: a flush to Redis failed (%s: %s); %d lookups not counted, and further "
                                "failures are counted in streamrec_serving_lookup_counts_dropped_total until one "
                                "succeeds", type(exc).__name__, exc, n - written)
                self._failing = True
                self._flushed(written)
                return written
            if self._failing:
                log.info("lookup counts: flushing to Redis again")
            self._failing = False
            self._outcome("ok")
            self._flushed(n)
            return n

    def _flushed(self, n: int) -> None:
        self.flushed += n
        if self.metrics is not None and n:
            self.metrics.lookup_counts_flushed.inc(n)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.flush_s)
            self._wake.clear()
            self.flush()

    def start(self) -> LookupCounts:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="lookup-counts", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the flush thread and flush what is left (once); lookups added after this are dropped ("stopped": a
        request still running past the shutdown grace)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            self._closed = True  # from here on nothing is appended: the flush below takes the last of them
        self.flush()

    # -- accounting -------------------------------------------------------------------------------------
    def _drop(self, reason: str, n: int) -> None:
        with self._lock:
            self.dropped += n
        if self.metrics is not None:
            self.metrics.lookup_counts_dropped.labels(reason).inc(n)

    def _outcome(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.lookup_count_flushes.labels(outcome).inc()

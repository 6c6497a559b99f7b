"""The scoring service's Prometheus metrics, in a registry of its own (one per service instance).

    streamrec_serving_requests_total{endpoint, status}      requests answered, by HTTP status (the servers' own
                                                            refusals too: 400, 408, 413, 415, 431, 505, 503)
    streamrec_serving_request_seconds{endpoint}             service time (parse -> response bytes)
    streamrec_serving_candidates_total                      items scored
    streamrec_serving_embedding_lookups_total{tier}         hot (fast memory) / cold (the artifact's table, or in the
                                                            layered mode the LRU and Redis) row reads
    streamrec_serving_hot_cache_hit_rate                    hot / (hot + cold), since start
    streamrec_serving_id_lookups_total{field, row}          ids of dynamic fields mapped to rows: own (admitted) |
                                                            bucket (unknown to the live id maps: the hash-bucket
                                                            fallback of a brand-new user or item); history as item_id
    streamrec_serving_model_info{version, format}           1 for the model answering now
    streamrec_serving_delta_seq                             the last learner delta applied to it
    streamrec_serving_model_age_seconds                     now - when the newest training state it holds was
                                                            saved (its newest delta, else its source checkpoint)
    streamrec_serving_artifact_age_seconds                  now - when its artifact's source checkpoint was saved
    streamrec_serving_deltas_configured                     1 when the process reads learner deltas, else 0
    streamrec_serving_swaps_total                           artifacts swapped in
    streamrec_serving_swap_rejected_total                   artifacts refused (corrupt, unloadable)
    streamrec_serving_artifact_store_retries_total          layered mode: artifacts loaded again after a refusal
                                                            because Redis lacked their rows (bounded cadence)
    streamrec_serving_rejected_total{kind}                  artifact | delta versions rejected, each ONCE
                                                            (remembered until its files change)
    streamrec_serving_deltas_applied_total / _delta_gaps_total / _delta_rewinds_total / _delta_errors_total
    streamrec_serving_delta_retries_total                   delta reads (or applications) short of a resource of
                                                            this process, tried again next round (up to 3 rounds
                                                            in a row)
    streamrec_serving_deltas_skipped_total{reason}          deltas passed over on purpose (lineage: another
                                                            learner's training than the live artifact's)
    streamrec_serving_deltas_paused                         1 while the live artifact is a pinned rollback
                                                            (no deltas applied), else 0
    streamrec_serving_history_errors_total                  Redis history reads that failed (served without)
    streamrec_serving_history_unavailable_total             requests scored without history: Redis down,
                                                            refusing or slower than redis_timeout_s
    streamrec_serving_history_malformed_total               users whose history read failed on its data
                                                            (reader error, not Redis down): no history
    streamrec_serving_redis_emptied_total{tag}              times Redis was found to have lost the joiner's keys
                                                            (stream/keyspace.py: restarted without persistence,
                                                            flushed): histories empty, every user scored as cold
                                                            until the joiner refills them; item | user (the marker)
    streamrec_history_malformed_total                       malformed history entries skipped by the shared
                                                            parser (stream/history.py) since this service
                                                            started (a process-wide count: serving processes
                                                            read history on the request path only)
    streamrec_serving_history_cache_users_total{result}     users looked up in the history cache
                                                            ([serve] history_cache_users, serving/history_cache.py):
                                                            hit (no Redis read) | miss (read from Redis)
    streamrec_serving_history_cache_invalidations_total{kind}  Redis invalidation messages applied: key (a user's
                                                            list changed) | all (Redis flushed)
    streamrec_serving_history_cache_entries                 users cached now
    streamrec_serving_history_cache_listener_up             1 while the invalidation listener is connected with
                                                            tracking on (the cache is used), else 0
    streamrec_serving_in_flight                             requests being served
    streamrec_serving_embedding_cache_rows_total{result}    layered mode: rows looked up in the LRU of rows
                                                            fetched from Redis, hit | miss
    streamrec_serving_embedding_store_fetch_seconds         layered mode: one Redis round trip (MGET) per request
    streamrec_serving_embedding_store_errors_total          layered mode: failed Redis round trips (down, timed
                                                            out), round trips with bad rows, failed delta writes
    streamrec_serving_embedding_store_bad_rows_total{reason}  layered mode: rows that fell back alone: missing
                                                            (key deleted, evicted) | malformed (not a row of the
                                                            version: length, non-finite)
    streamrec_serving_embedding_store_fallback_rows_total{kind}  layered mode: rows served without Redis: bucket
                                                            (an admitted id's bucket row) | zero (no fallback row)
    streamrec_serving_lookup_count_flushes_total{outcome}   flushes of per-id row lookup counts to Redis
                                                            (serving/lookup_counts.py): ok | error
    streamrec_serving_lookup_counts_flushed_total           row lookups written to Redis day counts
    streamrec_serving_lookup_counts_dropped_total{reason}   row lookups not counted: full (too many waiting) |
                                                            redis (the flush holding them failed) | refused (Redis
                                                            refused their day key: of another type) | stopped (after
                                                            the counter stopped) | invalid (a negative id: no hash)
                                                            | error (the flush holding them failed unexpectedly: a
                                                            bug, logged with its traceback)
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from stream.counts_keys import KINDS
from stream.metrics import HISTORY_MALFORMED

LATENCY_BUCKETS = (0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05,
                   0.1, 0.25, 1.0)


class LookupTally:
    """One model's embedding and id lookup counts, kept apart from the model: the collector goes on reading a
    swapped-out model's tally (requests still running on it add to it) without keeping the model alive.

    The request path adds under :attr:`lock` (an attribute increment); every count only grows once the model is
    live, which is what keeps the exported counters monotonic across swaps (:class:`_LookupCollector`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.hot = 0
        self.cold = 0
        self.ids: dict[str, list[int]] = {}  # owner field -> [bucket, all] ids mapped (the model's map_rows)

    def id_lookups(self) -> dict[tuple[str, str], int]:
        """(owner field, "own" | "bucket") -> ids mapped so far (only fields that mapped one)."""
        with self.lock:
            counts = {name: tuple(c) for name, c in self.ids.items() if c[1]}
        return {key: n for name, (bucket, total) in counts.items()
                for key, n in (((name, "bucket"), bucket), ((name, "own"), total - bucket))}

    def add(self, other: LookupTally) -> None:
        """Fold ``other``'s counts into this one (``other`` no longer counting: its model is freed)."""
        hot, cold, ids = other.hot, other.cold, {name: list(c) for name, c in other.ids.items()}
        with self.lock:
            self.hot, self.cold = self.hot + hot, self.cold + cold
            for name, (bucket, total) in ids.items():
                mine = self.ids.setdefault(name, [0, 0])
                mine[0], mine[1] = mine[0] + bucket, mine[1] + total


class _LookupCollector:
    """Hot/cold and id lookups since start: the distinct tallies of the live model and every retired one, summed at
    scrape time.

    A retired model's tally stays summed after the swap (requests in flight on it still count), and retiring it
    BEFORE the swap (serving/swap.py) means no scrape sees it in neither place: a scrape reads the live model first,
    so one that finds the new model finds the old one retired, and one that finds the old model live and retired
    counts it once (tallies are told apart by identity). Tallies of retired models since freed (nothing can add to
    them any more) are folded into one at the next retire, so they do not pile up over swaps."""

    def __init__(self, live: Callable[[], Any]) -> None:
        self.live = live
        self._freed = LookupTally()  # retired models since freed, folded
        self._retired: list[tuple[LookupTally, weakref.ref[Any]]] = []  # (tally, its model) of retired models
        self._lock = threading.Lock()

    def retire(self, model: Any) -> None:
        """Keep counting ``model``'s lookups once it stops being live; call it before the swap that replaces it."""
        with self._lock:
            if all(t is not model.tally for t, _ in self._retired):
                self._retired.append((model.tally, weakref.ref(model)))
            alive = []
            for t, ref in self._retired:  # one pass: a model freed meanwhile is either folded or kept
                if ref() is None:
                    self._freed.add(t)
                else:
                    alive.append((t, ref))
            self._retired = alive

    def snapshot(self) -> tuple[int, int, dict[tuple[str, str], int]]:
        """(hot, cold, (field, "own" | "bucket") -> ids mapped) since start: the freed, retired and live tallies."""
        m = self.live()  # first, and held while summing: see the class docstring
        with self._lock:  # (a retire folding a tally while it is summed would count it twice)
            tallies = [self._freed, *(t for t, _ in self._retired)]
            if m is not None and all(t is not m.tally for t in tallies):
                tallies.append(m.tally)
            hot, cold, ids = 0, 0, dict[tuple[str, str], int]()
            for t in tallies:
                hot, cold = hot + t.hot, cold + t.cold
                for key, n in t.id_lookups().items():
                    ids[key] = ids.get(key, 0) + n
        return hot, cold, ids

    def collect(self) -> Iterator[Metric]:
        hot, cold, id_totals = self.snapshot()
        c = CounterMetricFamily("streamrec_serving_embedding_lookups", "Embedding rows read, by tier: hot (the "
                                "artifact's hot set, fast memory) or cold (the artifact's table; layered mode: LRU "
                                "and Redis).", labels=["tier"])
        c.add_metric(["hot"], hot)
        c.add_metric(["cold"], cold)
        yield c
        ids = CounterMetricFamily("streamrec_serving_id_lookups", "Ids of dynamic fields (user_id, item_id; a "
                                  "history's items as item_id) mapped to rows, by row: own (admitted) or bucket (the "
                                  "hash-bucket fallback of an id the live id maps do not know).",
                                  labels=["field", "row"])
        for (name, kind), n in sorted(id_totals.items()):
            ids.add_metric([name, kind], n)
        yield ids
        yield GaugeMetricFamily("streamrec_serving_hot_cache_hit_rate", "Share of embedding row reads served by "
                                "the hot set since start.", value=hot / (hot + cold) if hot + cold else 0.0)
        m = self.live()
        info = GaugeMetricFamily("streamrec_serving_model_info", "1 for the artifact answering requests now.",
                                 labels=["version", "format"])
        if m is not None:
            info.add_metric([m.version, m.format], 1.0)
        yield info
        yield GaugeMetricFamily("streamrec_serving_delta_seq", "The last learner delta applied to the live model "
                                "(0: none since its artifact).", value=m.delta_seq if m is not None else 0)
        now = time.time()  # no model: NaN (no age, rather than a 0 that looks fresh; NaN never fires a rule)
        yield GaugeMetricFamily("streamrec_serving_model_age_seconds", "Seconds since the newest training state the "
                                "live model holds was saved: its newest learner delta, else its artifact's source "
                                "checkpoint (NaN: no model).",
                                value=max(0.0, now - m.trained_at) if m is not None else math.nan)
        yield GaugeMetricFamily("streamrec_serving_artifact_age_seconds", "Seconds since the live artifact's source "
                                "checkpoint was saved (its build time for artifacts that do not record it; NaN: no "
                                "model).", value=max(0.0, now - m.source_created) if m is not None else math.nan)


def _counter_total(counter: Counter) -> float:
    return sum(s.value for mf in counter.collect() for s in mf.samples if s.name.endswith("_total"))


class _SinceStart:
    """A process-wide counter of another package, exposed from this registry as counted since start."""

    def __init__(self, name: str, doc: str, counter: Counter) -> None:
        self.name, self.doc, self.counter = name, doc, counter
        self.baseline = _counter_total(counter)

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self.name, self.doc, value=_counter_total(self.counter) - self.baseline)


class ServingMetrics:
    def __init__(self, live_model: Callable[[], Any]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("streamrec_serving_requests", "Requests answered, by endpoint and HTTP status.",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram("streamrec_serving_request_seconds", "Service time of a request (body parsed to "
                                 "response encoded), seconds.", ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.candidates = Counter("streamrec_serving_candidates", "Candidate items scored.", registry=r)
        self.swaps = Counter("streamrec_serving_swaps", "Artifacts swapped in (the first load counts).", registry=r)
        self.artifact_store_retries = Counter("streamrec_serving_artifact_store_retries", "Layered mode: loads of an "
                                              "artifact tried again because the embedding store lacked its rows "
                                              "(meta) the last time (a bounded cadence, serving/swap.py).",
                                              registry=r)
        self.swap_rejected = Counter("streamrec_serving_swap_rejected", "Artifacts refused (corrupt or "
                                     "unloadable); the live model kept serving.", registry=r)
        self.deltas_applied = Counter("streamrec_serving_deltas_applied", "Learner deltas applied.", registry=r)
        self.delta_gaps = Counter("streamrec_serving_delta_gaps", "Learner deltas pruned before serving read them.",
                                  registry=r)
        self.delta_rewinds = Counter("streamrec_serving_delta_rewinds", "Times the learner's delta numbering went "
                                     "back behind the live model's (its deltas directory emptied or replaced); "
                                     "serving re-based on samples_trained.", registry=r)
        self.delta_retries = Counter("streamrec_serving_delta_retries", "Learner delta reads or applications that "
                                     "failed for want of a resource of this process (descriptors, memory) and were "
                                     "left for the next round; no later delta applied meanwhile.", registry=r)
        self.delta_errors = Counter("streamrec_serving_delta_errors", "Learner deltas that could not be applied.",
                                    registry=r)
        self.nonfinite_scores = Counter("streamrec_serving_nonfinite_scores", "Calls answered 503 because the live "
                                        "model scored a candidate NaN or inf (weights that overflow in float32).",
                                        registry=r)
        self.history_errors = Counter("streamrec_serving_history_errors", "Redis history reads that failed; the "
                                      "request was scored without history.", registry=r)
        self.rejected = Counter("streamrec_serving_rejected", "Artifact or delta versions rejected (each once, until "
                                "its files change): corrupt, malformed, not finite or not fitting the model.",
                                ["kind"], registry=r)
        for kind in ("artifact", "delta"):
            self.rejected.labels(kind)
        self.deltas_skipped = Counter("streamrec_serving_deltas_skipped", "Learner deltas passed over on purpose, "
                                      "by reason.", ["reason"], registry=r)
        self.deltas_skipped.labels("lineage")
        self.deltas_paused = Gauge("streamrec_serving_deltas_paused", "1 while no learner deltas are applied because "
                                   "the live artifact is a pinned rollback (streamrec refresh --rollback).", registry=r)
        self.deltas_configured = Gauge("streamrec_serving_deltas_configured", "1 when this process reads learner "
                                       "deltas ([serve] deltas_dir), else 0.", registry=r)
        self.history_unavailable = Counter("streamrec_serving_history_unavailable", "Requests scored without "
                                           "history because Redis was down, refused or timed out.", registry=r)
        self.history_malformed = Counter("streamrec_serving_history_malformed", "Users whose Redis history read failed "
                                         "on its data (not Redis being down); scored without history.", registry=r)
        self.redis_emptied = Counter("streamrec_serving_redis_emptied", "Times Redis was found to have lost the "
                                     "joiner's keys under the prefix (restarted without persistence, flushed): users' "
                                     "histories are empty until the joiner refills them; by marker tag.", ["tag"],
                                     registry=r)
        for tag in KINDS:  # the keyspace markers' tags (stream/keyspace.py)
            self.redis_emptied.labels(tag)
        r.register(_SinceStart("streamrec_history_malformed", "Malformed entries in users' Redis click histories, "
                               "skipped when read (as the joiner skips them), since this service started.",
                               HISTORY_MALFORMED))  # type: ignore[arg-type]
        self.in_flight = Gauge("streamrec_serving_in_flight", "Requests being served.", registry=r)
        # the history cache (serving/history_cache.py); 0 when [serve] history_cache_users = 0
        self.history_cache_users = Counter("streamrec_serving_history_cache_users", "Users looked up in the history "
                                           "cache, by result (hit: no Redis read, miss: read from Redis).",
                                           ["result"], registry=r)
        for result in ("hit", "miss"):
            self.history_cache_users.labels(result)
        self.history_cache_invalidations = Counter("streamrec_serving_history_cache_invalidations", "Redis "
                                                   "invalidation messages applied to the history cache, by kind "
                                                   "(key: one user's list changed, all: Redis flushed).", ["kind"],
                                                   registry=r)
        for kind in ("key", "all"):
            self.history_cache_invalidations.labels(kind)
        self.history_cache_entries = Gauge("streamrec_serving_history_cache_entries", "Users in the history cache.",
                                           registry=r)
        self.history_cache_up = Gauge("streamrec_serving_history_cache_listener_up", "1 while the history cache's "
                                      "invalidation listener is connected with tracking on (the cache is in use).",
                                      registry=r)
        # the layered mode (serving/embedding_store.py); 0 in the in_process mode
        self.embedding_cache_rows = Counter("streamrec_serving_embedding_cache_rows", "Layered mode: non-hot rows "
                                            "looked up in the LRU of rows fetched from Redis, by result (hit, miss).",
                                            ["result"], registry=r)
        for result in ("hit", "miss"):
            self.embedding_cache_rows.labels(result)
        self.embedding_store_fetch_seconds = Histogram("streamrec_serving_embedding_store_fetch_seconds", "Layered "
                                                       "mode: one Redis round trip for a request's missing rows, "
                                                       "seconds.", buckets=LATENCY_BUCKETS, registry=r)
        self.embedding_store_errors = Counter("streamrec_serving_embedding_store_errors", "Layered mode: failed "
                                              "embedding store operations (Redis down, timed out, rows missing, delta "
                                              "writes); the rows fell back to bucket rows or zeros.", registry=r)
        self.embedding_store_fallback_rows = Counter("streamrec_serving_embedding_store_fallback_rows", "Layered "
                                                     "mode: rows served without the embedding store, by kind: bucket "
                                                     "(an admitted id's hash-bucket row), zero (none).", ["kind"],
                                                     registry=r)
        for kind in ("bucket", "zero"):
            self.embedding_store_fallback_rows.labels(kind)
        self.embedding_store_bad_rows = Counter("streamrec_serving_embedding_store_bad_rows", "Layered mode: rows "
                                                "Redis answered without (missing: key deleted or evicted) or with a "
                                                "value that is not a row of the version (malformed); each fell back "
                                                "alone, Redis kept serving the others.", ["reason"], registry=r)
        for reason in ("missing", "malformed"):
            self.embedding_store_bad_rows.labels(reason)
        self.lookup_count_flushes = Counter("streamrec_serving_lookup_count_flushes", "Flushes of per-id row lookup "
                                            "counts to Redis (for the hot set), by outcome.", ["outcome"], registry=r)
        for outcome in ("ok", "error"):
            self.lookup_count_flushes.labels(outcome)
        self.lookup_counts_flushed = Counter("streamrec_serving_lookup_counts_flushed", "Row lookups written to the "
                                             "Redis day counts the hot set ranks by.", registry=r)
        self.lookup_counts_dropped = Counter("streamrec_serving_lookup_counts_dropped", "Row lookups not counted: "
                                             "full (too many waiting), redis (their flush failed), refused "
                                             "(Redis refused their day key: another type), stopped "
                                             "(after stop()), invalid (a negative id, no hash) or error (their "
                                             "flush failed unexpectedly: a bug, logged).", ["reason"],
                                             registry=r)
        for reason in ("full", "redis", "refused", "stopped", "invalid", "error"):
            self.lookup_counts_dropped.labels(reason)
        self.served_version_errors = Counter("streamrec_serving_served_version_errors", "Writes (or the stop's "
                                             "delete) of this process's <prefix>:serving:<host>:<pid> key that Redis "
                                             "failed or refused: a refresh may prune the version it serves.",
                                             registry=r)
        self.lookups = _LookupCollector(live_model)
        r.register(self.lookups)  # type: ignore[arg-type]

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""The layered deployment's embedding store: cold rows in Redis, fetched per request, cached in a bounded LRU.

``[serve] embedding_store = "layered"`` splits the table the in-process mode keeps in one process::

    ranker (serving/model.py)                            embedding store (Redis, or Redis Cluster)
      hot rows + MLP      (the scorer, on the device)      <prefix>:emb:<version>:meta    JSON, written LAST
      delta overrides     (learner deltas, as today)       <prefix>:emb:<version>:r:<row> D + 1 values, raw
      bucket rows         (dynamic fields' fallback rows,                                  float32 | float16 LE,
                                                                                           then a 4-byte tag
                           copied from the artifact)       <prefix>:emb:<version>:d:<row> delta overlay: the same,
                                                                                           written by serving,
                                                                                           never read by requests
      RowCache            (bounded LRU of fetched rows) <-- one MGET per request for its misses

A row is read, in order, from: the scorer's hot set, the delta overrides, the local bucket rows, the LRU, Redis.
Every row a request needs from Redis is asked for in ONE round trip (``MGET``; with ``embedding_store_cluster``
one MGET per hash slot, pipelined: one round trip per cluster node holding any of them), deduplicated; past
``_FETCH_CHUNK`` keys, as pipelined MGETs of that many (still one round trip: one huge MGET outlasts the timeout).

The keys, and the rows' bytes with their integrity tags: ``serving/row_codec.py``; writing, listing and deleting a
version (the refresh): ``serving/stored_versions.py``.

**Deltas.** Serving applies the learner's deltas as overrides exactly as in-process (``ScoringModel.apply_delta``),
so a delta changes layered scores exactly as it changes in-process ones, with or without Redis; the LRU drops the
rows a delta changes (:meth:`LayeredRows.on_delta`), so nothing stale is served from it either. **A version's row
keys (``r:``) only ever hold the artifact's rows**: the refresh writes them, nothing else does. A version is loaded
again with its deltas dropped (``streamrec refresh --rollback`` pins it with no deltas; a restart or a swap back
applies only the deltas serving reads after loading it), so rows of deltas written over its ``r:`` keys would serve
a model no one trained: the artifact's hot rows and dense weights with a later delta's cold rows. With
``embedding_store_write_deltas`` (off by default) the serving process that applies a delta writes its non-hot rows
apart, to the version's **delta overlay** ``<prefix>:emb:<version>:d:<row>`` (one pipelined MSET per delta, best
effort, in the version's dtype, so only once its meta was read; a failed write is counted in ``..._errors_total``
but does not make requests skip Redis). Requests never read the overlay: every ranker that applies deltas to a
version holds their rows as overrides until its next artifact, and one that does not apply them (a pinned rollback)
must not see them; rows of deltas pruned before a ranker read them wait for the next artifact, as in-process
(``learner/deltas.py``). The overlay is what serving has applied to the version, newest write wins (for tools and
for inspection), and is deleted with the version (:func:`~serving.stored_versions.delete_version`); it can grow to
one value per non-hot row the deltas touch in the version's life, as large as the version's own rows, which is why
it is off unless a tool reads it. Versions written before the overlay existed may hold delta rows under ``r:``:
``streamrec refresh --now`` writes a clean version.

**Redis down** (refused, timed out): the round trip counts in ``streamrec_serving_embedding_store_errors_total`` (the
default alert rule ``embedding_store_errors`` fires on it), requests skip Redis for ``embedding_store_retry_after_s``
(one failed round trip per period, not one per request), and the rows it should have given fall back: an admitted
id's own row to its hash bucket's row (the row the id would have if it were not admitted, kept locally), any other
row (a static field's hash row: it is its own bucket) to zeros, the "unknown" value of an embedding;
``..._fallback_rows_total{kind}`` counts them. Hot rows, overrides and cached rows keep serving; no request fails.
The outage is logged once, at its first failed read, and once more when Redis answers again. A Redis that answers
without the rows of a version loaded while it was down (back empty, say) is not an outage: it is logged once as what
it is (:meth:`RedisEmbeddingStore.refused`), and once more when the rows are there.
Nothing is cached from a failed round trip. **A bad row** (its key missing: deleted, evicted; or its value malformed:
of another length, not finite or beyond ``MAX_ROW_ABS``, a bound no trained row reaches) is not Redis being down: that
row alone falls back, uncached, the round trip's other rows are served and cached, and Redis stays in use;
``..._bad_rows_total{reason}`` counts the rows and ``..._errors_total`` the round trip (so the alert fires for a
deleted version as for a Redis that is down).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
from redis.cluster import PipelineCommand
from redis.crc import key_slot
from redis.exceptions import AskError, ClusterError, TryAgainError

from learner.artifact_versions import ArtifactError
from serving.row_codec import (
    MAX_ROW_ABS,
    ROW_CHECK,
    decode_answer,
    encode_rows,
    meta_key,
    overlay_keys,
    row_keys,
    tag_key,
)
from serving.settings import RowDtype
from serving.stored_versions import decode_meta, get_value
from stream.redis_client import wrong_type
from stream.redis_deadline import replies_by

log = logging.getLogger("streamrec.serve")

# Keys per MGET when a request's misses are read (single node): more go as pipelined MGETs of at most this many, in
# the same one round trip. One MGET of the 262,144 rows a request may look up ([serve] max_request_values) kept Redis
# busy past a 50 ms embedding_store_timeout_s before its first reply byte (measured: a TimeoutError, so EVERY
# request's misses fell back for retry_after_s); 5,000 keys take Redis ~7 ms, and their reply is read as it comes.
_FETCH_CHUNK = 5_000


# -- the LRU ------------------------------------------------------------------------------------------------------
class RowCache:
    """A bounded LRU of rows fetched from the store: global row -> (D + 1,) float32. Thread-safe; ``capacity`` 0
    caches nothing.

    The vectors live in one preallocated (capacity, D + 1) array (allocated at the first put), the LRU order in
    an ``OrderedDict`` of row -> slot: memory is capacity x (D + 1) x 4 bytes plus ~100 B of dict entry per row,
    whatever the request sizes (a dict of per-row array views would keep every fetched batch alive)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = int(capacity)
        self._rows: OrderedDict[int, int] = OrderedDict()  # row -> slot in self._data, least recent first
        self._data: np.ndarray | None = None  # (capacity, D + 1) float32
        self._free: list[int] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, row: int) -> bool:
        return int(row) in self._rows

    def get_many(self, rows: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Fill ``out[i]`` for the cached ``rows[i]`` ((M,) unique); returns the (M,) bool mask of hits."""
        hit = np.zeros(len(rows), dtype=bool)
        if not self.capacity or self._data is None:
            return hit
        idx, slots = [], []
        with self._lock:
            cache = self._rows
            for i, r in enumerate(rows.tolist()):
                s = cache.get(r)
                if s is not None:
                    cache.move_to_end(r)
                    idx.append(i)
                    slots.append(s)
            if idx:
                out[idx] = self._data[slots]  # copied under the lock: a put cannot reuse a slot half-way
        hit[idx] = True
        return hit

    def put_many(self, rows: np.ndarray, vectors: np.ndarray) -> None:
        """Cache ``vectors`` (M, D + 1) of ``rows`` (M,), evicting the least recently used rows beyond capacity."""
        if not self.capacity or not len(rows):
            return
        with self._lock:
            if self._data is None:
                self._data = np.empty((self.capacity, vectors.shape[1]), np.float32)
                self._free = list(range(self.capacity - 1, -1, -1))
            cache, free = self._rows, self._free
            slots = []
            for r in rows.tolist()[-self.capacity:]:  # more rows than capacity: the last ones win
                s = cache.get(r)
                if s is None:
                    s = free.pop() if free else cache.popitem(last=False)[1]
                    cache[r] = s
                else:
                    cache.move_to_end(r)
                slots.append(s)
            self._data[slots] = vectors[-self.capacity:]

    def discard_many(self, rows: np.ndarray) -> None:
        with self._lock:
            for r in rows.tolist():
                s = self._rows.pop(r, None)
                if s is not None:
                    self._free.append(s)


# -- the store of one service, and the rows of one loaded version -----------------------------------------------
class VersionNotStored(ArtifactError, ValueError):
    """Redis answers without a version's ``meta``: its rows are not (all) there. Not the artifact's fault, and it may
    pass (a refresh still writing the rows, a Redis restored or refilled), so serving tries the version again at a
    bounded cadence (``serving/swap.py``) where every other refusal waits for the artifact's files to change."""


class StoreUnavailable(Exception):
    """The store could not be read (internal: turned into fallback rows, never raised to a request)."""


class RedisEmbeddingStore:
    """The Redis side of the layered mode, one per scoring service: the client, the retry-after window and the
    metrics. :meth:`open` gives the rows of one artifact version (:class:`LayeredRows`)."""

    def __init__(self, client: Any, prefix: str, *, cache_rows: int = 200_000, retry_after_s: float = 1.0,
                 write_deltas: bool = False, metrics: Any = None,
                 clock: Callable[[], float] = time.monotonic, cluster: bool | None = None,
                 fetch_chunk: int = _FETCH_CHUNK, timeout_s: float | None = None) -> None:
        self.client, self.prefix = client, prefix
        # a fetch's deadline (embedding_store_timeout_s, on ``clock``): a cluster's slot split mid-move is read again
        # key by key only before it; None: no deadline
        self.timeout_s = timeout_s
        self.fetch_chunk = max(1, int(fetch_chunk))  # keys per MGET (:data:`_FETCH_CHUNK`)
        self.cache_rows, self.retry_after_s, self.write_deltas = int(cache_rows), float(retry_after_s), write_deltas
        self.metrics = metrics  # serving.metrics.ServingMetrics (its embedding_* metrics), or None
        # a Redis Cluster client (its *_nonatomic commands); say so for a LazyClient, which is not made yet
        self.cluster = hasattr(client, "mget_nonatomic") if cluster is None else cluster
        self._clock = clock
        self._down_until = -float("inf")
        self._quiet_until = -float("inf")  # bad rows are logged at most once per retry_after_s
        self.last_error: str | None = None
        self._outage_lock = threading.Lock()
        self._failures = 0  # failed reads since Redis last answered: an outage is logged at its first and its end

    # -- failures: counted, then Redis is skipped for retry_after_s --
    def failed(self, what: str, exc: BaseException, skip_reads: bool = True) -> None:
        """Count a failure; ``skip_reads``: requests skip Redis for ``retry_after_s`` (not for a failed delta write:
        writes may stall while reads answer, and a best-effort write must not cost requests their rows). A failed read
        is logged once per outage, at its first failure (:meth:`answered` says when it ends): every request in flight
        as Redis froze, and the one try of each retry-after window, logged a line each."""
        if skip_reads:
            self._down_until = self._clock() + self.retry_after_s
        self.last_error = f"{what}: {type(exc).__name__}: {exc}"[:300]
        if self.metrics is not None:
            self.metrics.embedding_store_errors.inc()
        if skip_reads:
            with self._outage_lock:
                self._failures += 1
                first = self._failures == 1
            if first:
                log.warning("embedding store %s failed (%s); misses use fallback rows, Redis is tried again every "
                            "%.1fs (said once until it answers; failures counted in streamrec_serving_embedding_"
                            "store_errors_total)", what, self.last_error, self.retry_after_s)
        else:
            log.warning("embedding store %s failed (%s); the delta serves from this process's overrides, Redis "
                        "gets the rows at the next refresh", what, self.last_error)

    def refused(self, what: str, exc: BaseException, said: str | None = None) -> str:
        """Redis answered, but without a loaded version's rows (:meth:`open`'s ValueError: its meta gone, as from a
        Redis restarted empty or a version pruned, or one that does not fit). Counted, and Redis skipped for
        ``retry_after_s``, as a failed read (the meta is asked again once per window); not an outage: it ends one
        :meth:`failed` logged (whose line would otherwise stay the last word: a ConnectionError, while Redis answers),
        and is logged itself unless its reason is ``said`` (the caller's last: it lasts until the rows are written,
        so once, not a line per window) and no outage was logged since. Returns the reason."""
        self._down_until = self._clock() + self.retry_after_s
        reason = self.last_error = f"{what}: {type(exc).__name__}: {exc}"[:300]
        if self.metrics is not None:
            self.metrics.embedding_store_errors.inc()
        with self._outage_lock:
            outage, self._failures = self._failures, 0
        if reason != said or outage:  # said again after an outage logged since
            log.warning("embedding store: Redis answers, but %s; the version's misses use fallback rows until its rows "
                        "are there (a Redis restarted empty: `streamrec refresh --now` writes a new version's), asked "
                        "again every %.1fs (said once; counted in streamrec_serving_embedding_store_errors_total)",
                        reason, self.retry_after_s)
        return reason

    def answered(self) -> None:
        """Redis answered a read: an outage :meth:`failed` logged has ended, said once."""
        if not self._failures:  # the common case: no lock
            return
        with self._outage_lock:
            failures, self._failures = self._failures, 0
        if failures:
            log.warning("embedding store: Redis answers again after %d failed reads; rows are read from it again",
                        failures)

    @property
    def available(self) -> bool:
        return self._clock() >= self._down_until

    def open(self, version: str, num_rows: int, dim: int) -> dict[str, Any] | None:
        """The version's meta, checked against the artifact (``num_rows`` rows of ``dim`` values).

        None when Redis cannot be read now (counted; the version loads and serves fallback rows until it can).
        :class:`VersionNotStored` (a ValueError) when Redis answers that the version is not there (not written yet,
        or pruned); ValueError when its meta does not fit, or is not JSON (Redis answered: a damaged meta is not a
        Redis that is down, which would load the version and serve all its non-hot rows from fallback rows)."""
        key = meta_key(self.prefix, version)
        try:
            raw = get_value(self.client, key)  # a key of another type: ValueError, Redis answered
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001 - any Redis or socket failure: serve on fallback rows
            self.failed(f"reading {key}", exc)
            return None
        meta = decode_meta(key, raw)  # Redis answered: a damaged meta is a ValueError, not Redis down
        if meta is None:
            raise VersionNotStored(f"the embedding store has no rows of version {version} (no "
                             f"{meta_key(self.prefix, version)}): publish it with [refresh] embedding_store = "
                             "\"layered\" (and the same [redis] url and "
                             "prefix as serving), or serve with [serve] embedding_store = \"in_process\"")
        dtypes = {d.value for d in RowDtype}
        if (meta.get("rows") != num_rows or meta.get("dim") != dim  # (decode_meta: an object)
                or not isinstance(meta.get("dtype"), str) or meta["dtype"] not in dtypes
                or meta.get("row_check") not in (None, ROW_CHECK)):  # None: written before the tags, untagged
            raise ValueError(f"the embedding store's rows of version {version} do not fit the artifact ({num_rows} "
                             f"rows of {dim} values; meta {str(meta)[:200]}); republish with `streamrec refresh --now`")
        self.answered()
        return meta

    def fetch(self, version: str, rows: np.ndarray, dim: int, dtype: RowDtype,
              key: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """((M, dim) float32, bad (M,) bool) of ``rows`` (M,) in ONE round trip; :class:`StoreUnavailable` when the
        round trip fails (or inside the retry-after window, without trying). ``bad`` rows (their key missing, or a
        value that is malformed) are zeros, counted (:meth:`bad_rows`); the others are good whatever they are."""
        if not self.available:
            raise StoreUnavailable(self.last_error or "embedding store unavailable")
        keys = row_keys(self.prefix, version, rows)
        t0 = time.perf_counter()
        deadline = float("inf") if self.timeout_s is None else self._clock() + self.timeout_s
        late = np.zeros(len(keys), dtype=bool)  # (M,) rows a split slot held, not read by the deadline
        # the whole round trip's replies by timeout_s (a whole-reply client bounds each alone: a trickling Redis held
        # pipelined MGETs one timeout each), on the monotonic clock the sockets read by (self._clock may be a test's)
        by = math.inf if self.timeout_s is None else time.monotonic() + self.timeout_s
        try:
            with replies_by(by):
                values = self._mget(keys, deadline, late)
            if len(values) != len(keys):
                raise ValueError(f"{len(values)} answers to an MGET of {len(keys)} keys")
        except Exception as exc:  # noqa: BLE001 - refused, timed out, a broken answer: fallback rows
            self.failed(f"MGET of {len(keys)} rows", exc)
            raise StoreUnavailable(self.last_error or "") from exc
        finally:
            if self.metrics is not None:
                self.metrics.embedding_store_fetch_seconds.observe(time.perf_counter() - t0)
        self.answered()
        out, missing, malformed = decode_answer(values, dim, dtype, rows, key)
        missing &= ~late
        bad = missing | malformed
        if bad.any():
            self.bad_rows(keys, missing, malformed, dim, dtype)
        if late.any():
            self.late_rows(keys, late)
        if self.metrics is not None and (bad.any() or late.any()):  # one round trip, one error, whatever fell back
            self.metrics.embedding_store_errors.inc()
        return out, bad | late

    def late_rows(self, keys: list[str], late: np.ndarray) -> None:
        """Count a fetch that gave up rows at its deadline (a slot split mid-resharding, not read again in time):
        they fall back (counted by the caller in ``..._fallback_rows_total``), uncached; Redis stays in use (the
        split ends with the move). Counted in ``..._errors_total`` by :meth:`fetch`, once per fetch (bad rows in it
        too); logged at most once per ``retry_after_s``."""
        self.last_error = (f"{int(late.sum())} of {len(keys)} rows were in a hash slot a resharding has split between "
                           f"two nodes and were not read within embedding_store_timeout_s ({self.timeout_s} s), e.g. "
                           f"{keys[int(np.flatnonzero(late)[0])]}")[:300]
        now = self._clock()
        if now >= self._quiet_until:
            self._quiet_until = now + self.retry_after_s
            log.warning("embedding store: %s; those rows use fallback rows until the move ends", self.last_error)

    def _mget(self, keys: list[str], deadline: float = float("inf"), late: np.ndarray | None = None) -> list[Any]:
        """The values of ``keys`` in one round trip: one MGET, or pipelined MGETs of at most ``fetch_chunk`` keys
        (:data:`_FETCH_CHUNK`). On a cluster, one MGET per hash slot, pipelined (one round trip per node), redirections
        not followed; a slot a resharding has split between two nodes refuses an MGET of several of its keys (ASK, then
        TRYAGAIN from the importing node), so before ``deadline`` (on the store's clock) those keys go again one GET
        each, pipelined, each followed to its node (ASK); after it they are left None and marked in ``late`` (M,).
        redis-py, left to follow the MGET, tried it 16 times, sleeping 50 ms between the last TRYAGAINs: ~0.1 s for
        a request whose embedding_store_timeout_s is 0.05. Only a failure of the GETs, or any other failure, fails
        the round trip; a GET's WRONGTYPE (a key of another type) is None, as the MGET answers it: it failed the whole
        round trip, and every request's rows fell back for ``retry_after_s``."""
        if self.cluster:
            return self._mget_by_slot(keys, deadline, np.zeros(len(keys), dtype=bool) if late is None else late)
        n = self.fetch_chunk
        if len(keys) <= n:
            return list(self.client.mget(keys))
        pipe = self.client.pipeline(transaction=False)
        for start in range(0, len(keys), n):
            pipe.mget(keys[start:start + n])
        return [v for part in pipe.execute() for v in part]

    def _mget_by_slot(self, keys: list[str], deadline: float, late: np.ndarray) -> list[Any]:
        slots: dict[int, list[int]] = {}  # hash slot -> positions of its keys
        for i, k in enumerate(keys):
            slots.setdefault(key_slot(k.encode()), []).append(i)
        pipe, out, split = self.client.pipeline(), [None] * len(keys), []
        node_of = self.client.nodes_manager.get_node_from_slot
        # sent to the slot's node, as mget_nonatomic: not split by slot again (~1 ms); a redirection is answered, not
        # followed (:meth:`_mget`)
        stack = [PipelineCommand(("MGET", *[keys[i] for i in idx]), {"target_nodes": [node_of(slot)]}, n)
                 for n, (slot, idx) in enumerate(slots.items())]
        answers = pipe.send_cluster_commands(stack, raise_on_error=False, allow_redirections=False)
        for idx, got in zip(slots.values(), answers, strict=True):
            if isinstance(got, (AskError, ClusterError, TryAgainError)):  # the slot is split mid-move (or moved)
                split += idx
            elif isinstance(got, Exception):
                raise got
            else:  # (a short answer: ValueError)
                for i, v in zip(idx, got, strict=True):
                    out[i] = v
        if split and self._clock() >= deadline:  # no time left to read them again: they fall back
            late[split] = True
            split = []
        for i in split:
            pipe.get(keys[i])
        for i, v in zip(split, pipe.execute(raise_on_error=False) if split else [], strict=True):
            if wrong_type(v):
                v = None  # a key of another type: nil, as the MGET answers it (its row alone falls back)
            elif isinstance(v, Exception):
                raise v
            out[i] = v
        return out

    def bad_rows(self, keys: list[str], missing: np.ndarray, malformed: np.ndarray, dim: int,
                 dtype: RowDtype) -> None:
        """Count a round trip that answered but not with every row: its bad rows fall back, each alone; Redis stays
        in use (no retry-after window: one deleted or damaged key must not cost every request its rows). Counted in
        ``..._errors_total`` once per round trip, by :meth:`fetch` (the ``embedding_store_errors`` alert fires, as for
        a Redis that is down), and row by row in ``..._bad_rows_total{reason}``; logged at most once per
        ``retry_after_s``."""
        n_missing, n_malformed = int(missing.sum()), int(malformed.sum())
        example = keys[int(np.flatnonzero(missing | malformed)[0])]
        self.last_error = (f"of {len(keys)} rows, {n_missing} are missing (deleted or evicted keys: maxmemory?) and "
                           f"{n_malformed} malformed (not {dim} {dtype} values: of another length, non-finite or "
                           f"beyond |x| <= {MAX_ROW_ABS:g}; not written by a refresh), e.g. {example}")[:300]
        if self.metrics is not None:
            self.metrics.embedding_store_bad_rows.labels("missing").inc(n_missing)
            self.metrics.embedding_store_bad_rows.labels("malformed").inc(n_malformed)
        now = self._clock()
        if now >= self._quiet_until:
            self._quiet_until = now + self.retry_after_s
            log.warning("embedding store: %s; those rows use fallback rows, the others are served from Redis (said "
                        "at most every %.1fs, counted in streamrec_serving_embedding_store_bad_rows_total)",
                        self.last_error, self.retry_after_s)

    def write_overlay(self, version: str, rows: np.ndarray, vectors: np.ndarray, dtype: RowDtype,
                      key: int | None = None) -> bool:
        """Best effort: write a delta's rows to ``version``'s delta overlay (never its row keys: module docstring);
        False (counted) when Redis fails."""
        if not len(rows) or not self.write_deltas:
            return True
        try:
            mset = self.client.mset_nonatomic if self.cluster else self.client.mset
            mset(dict(zip(overlay_keys(self.prefix, version, rows), encode_rows(vectors, dtype, rows, key),
                          strict=True)))
        except Exception as exc:  # noqa: BLE001 - the override serves the delta; Redis catches up at the next refresh
            self.failed(f"writing {len(rows)} delta rows", exc, skip_reads=False)
            return False
        return True


class LayeredRows:
    """The non-hot rows of one loaded version: local bucket rows, an LRU, then the store (module docstring).

    ``table`` is the artifact's (N, D + 1) cold file (memory-mapped): only the bucket areas of dynamic fields
    (``buckets``: (first row, bucket rows, own rows) per field with an id map) are copied from it, once.
    """

    def __init__(self, store: RedisEmbeddingStore, version: str, table: np.ndarray,
                 buckets: list[tuple[int, int, int, str]], id_maps: dict[str, Any] | None) -> None:
        self.store, self.version = store, version
        self.num_rows, self.dim = int(table.shape[0]), int(table.shape[1])
        meta = store.open(version, self.num_rows, self.dim)
        self.dtype = RowDtype.of(meta["dtype"] if meta else RowDtype.FLOAT32, "embedding store dtype")
        self.key = self._key_of(meta)  # the values' tag key (None: untagged values, written before the tags)
        self._checked = meta is not None  # meta not read yet (Redis down at load): read it before the first fetch
        self._refusal: str | None = None  # why Redis, answering, lacked the version's rows (logged: store.refused)
        self.cache = RowCache(min(store.cache_rows, self.num_rows))  # never more rows than the table has
        # Dynamic fields: (first, bucket rows, own rows, field name); their bucket areas are local.
        self._blocks = sorted(buckets)
        self._local_first = np.array([b[0] for b in self._blocks], dtype=np.int64)
        self._local_end = np.array([b[0] + b[1] for b in self._blocks], dtype=np.int64)
        self._own_end = np.array([b[0] + b[1] + b[2] for b in self._blocks], dtype=np.int64)
        sizes = [b[1] for b in self._blocks]
        self._local_start = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)  # into self._local
        self._local = (np.concatenate([np.asarray(table[f:f + n], dtype=np.float32) for f, n, _, _ in self._blocks])
                       if self._blocks else np.zeros((0, self.dim), np.float32))  # (sum of bucket rows, D + 1)
        self._row_keys: list[np.ndarray] = []
        self.set_id_maps(id_maps)

    def set_id_maps(self, id_maps: dict[str, Any] | None) -> None:
        """Own row -> hashed id of every dynamic field (the id maps' ``row_key``), for the bucket fallback: the
        artifact's (a delta's travel in the model's snapshot with the maps they come from, :meth:`fallback_rows`)."""
        self.use_row_keys(self.row_keys_of(id_maps))

    def row_keys_of(self, id_maps: dict[str, Any] | None) -> list[np.ndarray]:
        """What :meth:`set_id_maps` would use, checked: ValueError unless each dynamic field's ``row_key`` is a 1-D
        integer array of one key per own row. (The id map's own load broadcasts a ``row_key`` of one key over every
        row; indexed here as it came, a malformed delta's made every fallback of an admitted id past it an
        IndexError: a 500 for each request of such an id while Redis was down.)"""
        keys = []
        for _, _, own, name in self._blocks:
            state = (id_maps or {}).get(name)
            try:
                rk: Any = state["row_key"] if state is not None else np.full(own, -1)
                arr = np.asarray(rk.numpy() if hasattr(rk, "numpy") else rk)
            except Exception as exc:  # noqa: BLE001 - any malformed state is a misfit
                raise ValueError(f"id maps: {name}'s row_key cannot be read ({type(exc).__name__}: {exc})") from exc
            if arr.shape != (own,) or arr.dtype.kind not in "iu":
                raise ValueError(f"id maps: {name}'s row_key is {arr.dtype} of shape {arr.shape}, expected one integer "
                                 f"key per own row ({own},)")
            keys.append(arr.astype(np.int64, copy=False))
        return keys

    def use_row_keys(self, keys: list[np.ndarray]) -> None:
        """Use :meth:`row_keys_of`'s keys."""
        self._row_keys = keys  # one assignment: readers see the old or the new list

    def _block_of(self, rows: np.ndarray) -> np.ndarray:
        """Index of the dynamic block holding each row, -1 for rows outside every dynamic block."""
        if not self._blocks:
            return np.full(len(rows), -1, dtype=np.int64)
        b = np.searchsorted(self._local_first, rows, side="right") - 1
        inside = (b >= 0) & (rows < self._own_end[np.maximum(b, 0)])
        return np.where(inside, b, -1)

    def _local_rows(self, rows: np.ndarray, block: np.ndarray) -> np.ndarray:
        """Index into ``self._local`` of each row in a dynamic bucket area, -1 for the others."""
        if not self._blocks:  # a static config: nothing is local
            return np.full(len(rows), -1, dtype=np.int64)
        bs = np.maximum(block, 0)
        local = (block >= 0) & (rows < self._local_end[bs])
        return np.where(local, self._local_start[bs] + rows - self._local_first[bs], -1)

    def fallback_rows(self, rows: np.ndarray, keys: list[np.ndarray] | None = None) -> np.ndarray:
        """The row to serve instead of each of ``rows`` (M,) when the store cannot give it: an admitted id's own
        row -> its bucket row; -1 for every other row (zeros). ``keys``: the :meth:`row_keys_of` of the id maps the
        rows were mapped with (a request's snapshot, ``serving.model._Live``; not the newest delta's, whose maps may
        have given an evicted id's row to another), the artifact's by default."""
        block = self._block_of(rows)
        out = np.full(len(rows), -1, dtype=np.int64)
        keys_of = self._row_keys if keys is None else keys
        for b in np.unique(block[block >= 0]).tolist():
            first, nb, _, _ = self._blocks[b]
            sel = np.flatnonzero(block == b)
            local = rows[sel] - first - nb  # own row index (< 0: a bucket row itself)
            own = local >= 0
            key = np.full(len(sel), -1, dtype=np.int64)
            key[own] = keys_of[b][local[own]]
            out[sel[own & (key >= 0)]] = first + key[own & (key >= 0)] % nb
            out[sel[~own]] = rows[sel[~own]]
        return out

    def local(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(mask (M,), vectors (M, D + 1)): the rows held locally (dynamic fields' bucket rows)."""
        idx = self._local_rows(rows, self._block_of(rows))
        have = idx >= 0
        vec = np.zeros((len(rows), self.dim), np.float32)
        vec[have] = self._local[idx[have]]
        return have, vec

    def gather(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(vectors (M, D + 1) float32, failed (M,) bool) for unique non-hot, non-overridden ``rows`` (M,):
        local bucket rows, then the LRU, then ONE round trip for the rest. ``failed`` rows (the store was not
        available) are zeros here: the caller substitutes :meth:`fallback_rows`."""
        m = self.store.metrics
        have, out = self.local(rows)
        rest = np.flatnonzero(~have)
        failed = np.zeros(len(rows), dtype=bool)
        if not len(rest):
            return out, failed
        sub = rows[rest]
        got = np.zeros((len(sub), self.dim), np.float32)
        hit = self.cache.get_many(sub, got)
        miss = np.flatnonzero(~hit)
        if m is not None:
            m.embedding_cache_rows.labels("hit").inc(int(hit.sum()))
            m.embedding_cache_rows.labels("miss").inc(len(miss))
        if len(miss):
            try:
                self._check()
                fetched, bad = self.store.fetch(self.version, sub[miss], self.dim, self.dtype, self.key)
            except StoreUnavailable:
                failed[rest[miss]] = True
            except ValueError as exc:  # Redis is back but never had this version: fallback, counted, never a 5xx
                self._refusal = self.store.refused("checking the version's rows", exc, self._refusal)
                failed[rest[miss]] = True
            else:
                got[miss] = fetched
                failed[rest[miss[bad]]] = True  # a bad key: its row alone falls back, and is not cached
                self.cache.put_many(sub[miss[~bad]], fetched[~bad])
        out[rest] = got
        out[failed] = 0.0
        return out, failed

    def _check(self) -> None:
        if self._checked:
            return
        if not self.store.available:  # inside the retry-after window: not asked, as fetch (one failure per window)
            raise StoreUnavailable(self.store.last_error or "embedding store unavailable")
        meta = self.store.open(self.version, self.num_rows, self.dim)  # ValueError: the version is not there
        if meta is None:
            raise StoreUnavailable(self.store.last_error or "")
        self.dtype = RowDtype.of(meta["dtype"], "embedding store dtype")
        self.key = self._key_of(meta)
        self._checked = True
        if self._refusal is not None:
            log.warning("embedding store: the rows of version %s are in Redis now; its misses are read from it again",
                        self.version)
            self._refusal = None

    def _key_of(self, meta: dict[str, Any] | None) -> int | None:
        return tag_key(self.version, self.dtype) if meta and meta.get("row_check") == ROW_CHECK else None

    def on_delta(self, rows: np.ndarray, vectors: np.ndarray, hot: np.ndarray) -> None:
        """A delta changed ``rows`` (R,) to ``vectors`` (R, D + 1): drop them from the LRU and, with
        ``write_deltas``, write the non-hot ones (``hot`` (R,) bool) that are not local to the version's delta
        overlay in Redis (never over its rows)."""
        self.cache.discard_many(rows)
        block = self._block_of(rows)
        remote = ~hot & (self._local_rows(rows, block) < 0)
        if not remote.any() or not self.store.available or not self.store.write_deltas:
            return
        try:
            self._check()  # the version's dtype comes from its meta: never write rows in a guessed one
        except StoreUnavailable:
            return  # counted by open(); the override serves the delta, the next refresh rewrites the row
        except ValueError as exc:  # Redis answers, without this version (or with one that does not fit)
            self._refusal = self.store.refused("checking the version's rows", exc, self._refusal)
            return
        self.store.write_overlay(self.version, rows[remote], vectors[remote], self.dtype, self.key)

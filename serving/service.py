"""One scoring service, wired: settings -> Redis, history, model holder, updater, routes, HTTP server.

    with ScoringService(ServeSettings(port=0), RedisSettings(url=...)) as svc:
        svc.url          # http://127.0.0.1:<port>
        svc.updater.check_now()

``start`` loads the current artifact (if any) before the port answers, so the first request does not
race the first load; without one the service starts anyway, answers 503 and picks up the first publish.
"""

from __future__ import annotations

import logging
from types import TracebackType

import redis
import torch

from learner.tensorpack import load_signing_key
from serving.app import ScoringApp
from serving.embedding_store import RedisEmbeddingStore
from serving.history import EmptiedRedisWatch
from serving.history_cache import HistoryCache
from serving.http_server import Server, make_server
from serving.lookup_counts import LookupCounts
from serving.metrics import ServingMetrics
from serving.model import ScoringModel
from serving.served_versions import ServedVersionBeacon
from serving.settings import EmbeddingStore, ServeSettings
from serving.swap import ModelHolder, ModelUpdater
from stream.config import RedisSettings
from stream.counts import DailyCounts
from stream.errors import ConfigError
from stream.history import UserHistory
from stream.limits import DEFAULT_LIMITS, EventLimits
from stream.redis_client import RedisAuthError, connect, eviction_advice, latency_advice, verify

log = logging.getLogger("streamrec.serve")


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"[serve] device must be auto, cpu or cuda[:N], got {device!r}")
    return device


def _embedding_store(settings: ServeSettings, redis_settings: RedisSettings | None,
                     metrics: ServingMetrics) -> RedisEmbeddingStore | None:
    """The layered mode's store ([serve] embedding_store = "layered"), on its own client: a short timeout (of each
    whole reply: a trickling Redis costs no more), no
    retries (a failed round trip falls back at once), a Redis Cluster with ``[redis] cluster`` (made at its
    first use: an unreachable cluster at start costs fallback rows, as a single node that is down does)."""
    if settings.embedding_store is not EmbeddingStore.LAYERED:
        return None
    if redis_settings is None:
        raise ConfigError('[serve] embedding_store = "layered" reads rows from Redis: configure [redis] '
                          '(not --no-redis)')
    t = settings.embedding_store_timeout_s
    rs = redis_settings
    client = connect(rs, timeout_s=t, retries=0, whole_reply=True)
    return RedisEmbeddingStore(client, redis_settings.prefix, cache_rows=settings.embedding_cache_rows, timeout_s=t,
                               retry_after_s=settings.embedding_store_retry_after_s,
                               write_deltas=settings.embedding_store_write_deltas, metrics=metrics,
                               cluster=rs.cluster)


class ScoringService:
    def __init__(self, settings: ServeSettings, redis_settings: RedisSettings | None, version: str = "0",
                 limits: EventLimits = DEFAULT_LIMITS) -> None:
        self.s = settings
        self.device = resolve_device(settings.device)
        self.holder = ModelHolder()
        self.metrics = ServingMetrics(self.holder.model)
        history = None
        self.emptied: EmptiedRedisWatch | None = None
        self.history_cache: HistoryCache | None = None
        self.redis: redis.Redis | None = None
        self.pubsub_redis: redis.Redis | None = None
        prefix = "streamrec"
        if redis_settings is not None:  # the older [serve] embedding_store_cluster: an alias of [redis] cluster
            redis_settings = redis_settings.clustered(settings.embedding_store_cluster)
        self._redis_settings = redis_settings
        if redis_settings is not None:
            prefix = redis_settings.prefix
            # Request path: a short timeout and NO retries (redis-py retries timeouts 3 times with backoff by
            # default), so a slow or dead Redis costs one timeout and the request is scored without history; the
            # timeout bounds each whole reply (whole_reply), so a Redis trickling its reply costs no more.
            # Credentials and TLS come from [redis] (stream/redis_client.py), for both clients.
            self.redis = connect(redis_settings, timeout_s=settings.redis_timeout_s, retries=0, whole_reply=True)
            # The joiner keeps 4 x history_len clicks per user and attaches the last history_len.
            history = UserHistory(self.redis, prefix=redis_settings.prefix, max_len=4 * redis_settings.history_len)
            # An emptied Redis said, off the request path (serving/history.py, "Redis emptied")
            self.emptied = EmptiedRedisWatch(self.redis, redis_settings.prefix, self.metrics)
            if settings.history_cache_users:  # repeat users' histories in process (serving/history_cache.py)
                self.history_cache = HistoryCache(self.redis, redis_settings.prefix, settings.history_cache_users,
                                                  self.metrics)
            # The update channels: reads bounded by the default command timeout, redis-py's retries.
            self.pubsub_redis = connect(redis_settings, connect_timeout_s=2.0)
        signing_key = load_signing_key(settings.signing_key_file)
        self.embedding_store = _embedding_store(settings, redis_settings, self.metrics)
        load = None
        if self.embedding_store is not None:  # the layered mode: cold rows from Redis (serving/embedding_store.py)
            store = self.embedding_store
            load = lambda p, d: ScoringModel.load(p, device=d, signing_key=signing_key, store=store)  # noqa: E731
        # The version this process serves, told to the refresh (its prune keeps it): on the update channels' client
        self.served: ServedVersionBeacon | None = None
        if self.pubsub_redis is not None:
            self.served = ServedVersionBeacon(self.pubsub_redis, prefix, self._live_version, self.metrics)
        self.updater = ModelUpdater(self.holder, self.metrics, settings.publish_root, settings.deltas_dir,
                                    device=self.device, poll_s=settings.poll_s, redis_client=self.pubsub_redis,
                                    prefix=prefix, signing_key=signing_key, load=load,
                                    on_swap=self.served.wake if self.served is not None else lambda: None)
        self.lookups: LookupCounts | None = None
        if redis_settings is not None and settings.lookup_counts:
            # Its own client: a flush of many ids may take longer than the request path's timeout; no retries
            # (a failed flush is dropped and counted, the next one comes flush_s later).
            client = connect(redis_settings, timeout_s=settings.lookup_counts_timeout_s, retries=0, whole_reply=True)
            counts = DailyCounts(client, prefix=redis_settings.prefix, ttl_days=redis_settings.counts_ttl_days,
                                 write_timeout_s=settings.lookup_counts_timeout_s)  # each MULTI/EXEC as a whole
            self.lookups = LookupCounts(counts, self.metrics, flush_s=settings.lookup_counts_flush_s,
                                        flush_ids=settings.lookup_counts_flush_ids,
                                        max_pending=settings.lookup_counts_max_pending,
                                        flush_timeout_s=settings.lookup_counts_timeout_s)
        self.app = ScoringApp(settings, self.holder, self.metrics, history,
                              history_len=redis_settings.history_len if redis_settings else 50, version=version,
                              lookups=self.lookups, limits=limits, history_cache=self.history_cache)
        self.server: Server | None = None

    def _live_version(self) -> str | None:
        model = self.holder.model()
        return model.version if model is not None else None

    @property
    def port(self) -> int:
        assert self.server is not None, "not started"
        return self.server.port

    @property
    def url(self) -> str:
        return f"http://{self.s.host}:{self.port}"

    def start(self) -> ScoringService:
        """Load the current artifact, start the updater and lookup-count threads, then the HTTP server. A start
        that fails (the port taken, ...) stops what it started and closes the clients before raising: ``with``
        never calls ``__exit__`` when ``__enter__`` raised."""
        try:
            self._check_redis()
            if self.emptied is not None:
                self.emptied.start()
            if self.history_cache is not None:
                self.history_cache.start()
            self.updater.start()
            if self.served is not None:
                self.served.start()
            if self.lookups is not None:
                self.lookups.start()
            self.server = make_server(self.s.server, self.app, self.s.host, self.s.port)
            self.server.start()
        except BaseException:
            self.stop(grace_s=0.0)  # both servers' stop() also closes a server that never started
            raise
        return self

    def _check_redis(self) -> None:
        """Say at start, in one line, when Redis refuses this service's credentials: serving starts anyway and
        scores without history (Redis problems never fail a request), but a wrong password is no outage to wait
        out. An unreachable Redis is not logged here: the history reads say so. Then a warning when the server's
        settings cost the request path latency (``stream.redis_client.latency_advice``: active rehashing; the
        layered mode's store is the same ``[redis]``), and when it evicts keys (``eviction_advice``)."""
        if self.redis is None or self._redis_settings is None:
            return
        try:
            if not verify(self.redis, self._redis_settings, reachable=False):
                return  # unreachable: the history reads say so
        except RedisAuthError as exc:
            log.error("%s; serving scores without history and polls for models until this is fixed", exc)
            return
        except Exception as exc:  # noqa: BLE001 - a start-time probe never stops serving from starting
            log.debug("Redis probe at start failed: %s", exc)
            return
        for advice in (latency_advice(self.redis, self._redis_settings),
                       eviction_advice(self.redis, self._redis_settings, "serving's lookup counts and, in the layered "
                                       "mode, its embedding rows (a missing row scores with its hash bucket)")):
            if advice:
                log.warning("%s", advice)

    def stop(self, grace_s: float = 10.0) -> None:
        """Drain and stop the server, the model updater and the lookup counter (which flushes what the last requests
        counted), and close the Redis clients. Every step runs even when an earlier one fails (a server that fails to
        stop must not leave the updater's threads and the clients behind); the first failure is raised at the end."""
        self.app.draining = True
        steps = []
        if self.server is not None:
            server = self.server
            steps.append(lambda: server.stop(grace_s))
        steps.append(self.updater.stop)
        if self.served is not None:
            steps.append(self.served.stop)  # (before the clients close: its key is deleted)
        if self.emptied is not None:
            steps.append(self.emptied.stop)
        if self.history_cache is not None:
            steps.append(self.history_cache.stop)
        if self.lookups is not None:
            steps += [self.lookups.stop, self.lookups.counts.client.close]
        store_client = self.embedding_store.client if self.embedding_store is not None else None
        steps += [client.close for client in (self.redis, self.pubsub_redis, store_client) if client is not None]
        failed: list[BaseException] = []
        for step in steps:
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - the other steps still run; the first failure is raised
                log.warning("stopping the service: %s: %s", type(exc).__name__, exc)
                failed.append(exc)
        if failed:
            raise failed[0]

    def __enter__(self) -> ScoringService:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

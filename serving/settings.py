"""Settings of the scoring service (``streamrec serve``), built once at the process edge.

``[serve]`` in the ``--config`` file and ``STREAMREC_SERVE_<KEY>`` override these defaults; flags
override both. Redis (history, pub/sub) comes from ``[redis]`` (:class:`streamrec.settings.RedisSettings`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from learner.config import Device
from serving.lookup_counts import STOP_TIMEOUT_S
from stream.config import Choice, check_counts, check_durations, check_ports
from stream.errors import ConfigError

MAX_DURATION_S = 86_400.0  # the longest period or timeout a [serve] duration may name


class EmbeddingStore(Choice):
    """Where the rows outside the artifact's hot set come from (serving/model.py, serving/embedding_store.py)."""

    IN_PROCESS = "in_process"  # the artifact's cold file, copied into memory at load (all in one process; default)
    LAYERED = "layered"  # Redis (written by the refresh with [refresh] embedding_store = "layered"), via a bounded LRU


class RowDtype(Choice):
    """How the refresh stores a row's D + 1 values in the embedding store (serving reads the version's choice)."""

    FLOAT32 = "float32"  # exact: layered scores equal in-process scores
    FLOAT16 = "float16"  # half the Redis memory; rows rounded to float16 (tests bound the scores' change)


class ServerKind(Choice):
    """The HTTP server under the scoring app (serving/http_server.py)."""

    THREADING = "threading"
    AIOHTTP = "aiohttp"


@dataclass(frozen=True)
class ServeSettings:
    # Where the refresh publishes and the learner writes deltas, and the key both sign with, when [serve] does not say
    # (stream.setting_values.inherited): one file set them for those commands, and serving watched its own defaults
    INHERITS: ClassVar[dict[str, tuple[tuple[str, str], ...]]] = {
        "publish_root": (("refresh", "publish_root"),), "deltas_dir": (("learner", "deltas_dir"),),
        "signing_key_file": (("refresh", "signing_key_file"), ("learner", "signing_key_file"))}
    host: str = "127.0.0.1"  # loopback by default: expose deliberately (0.0.0.0) behind a proxy
    port: int = 8080
    publish_root: Path = Path(".streamrec/serving")  # <root>/CURRENT -> <root>/versions/<version>/
    deltas_dir: Path | None = None  # the learner's delta files; None: no freshness between refreshes
    device: Device = Device.AUTO  # auto | cpu | cuda: where the hot rows and the dense part live
    threads: int = 1  # torch intra-op threads per request (run in parallel on their own threads); at most 1,024
    server: ServerKind = ServerKind.THREADING  # threading (stdlib ThreadingHTTPServer) | aiohttp
    max_candidates: int = 1000  # items per request
    # Rows one HTTP call (a batch's requests together) may look up, the candidates' and the shared context's (a 422
    # past it): a context field sent per item makes every candidate carry a bag of it (serving/features.py), so a
    # small body could ask for millions of lookups.
    max_request_values: int = 1 << 18
    max_batch: int = 64  # requests per /v1/score:batch call
    max_body_bytes: int = 4 << 20  # at most 1 GiB (1 << 30)
    poll_s: float = 0.5  # how often CURRENT and the deltas directory are checked (pub/sub wakes it sooner)
    redis_timeout_s: float = 0.05  # a slow history read fails open (empty history) rather than the request
    history_retry_after_s: float = 1.0  # after a failed history read, requests skip Redis this long (no retries)
    # Users whose click histories are kept in this process (an LRU kept fresh by Redis's invalidation messages,
    # serving/history_cache.py: a repeat user's request reads no Redis); 0: off, every history read from Redis.
    # ~0.5 KB a user at history_len 50. At most 100,000,000. Off by default: with it on, a history written to Redis is
    # seen a fraction of a millisecond later (the invalidation's trip), and a frozen Redis (its connections open) is
    # noticed by cached users' requests only when the listener's PING goes unanswered (1 + 2 s), not at their first
    # timeout: tests/integration/test_serving_faults.py and test_serving_slow_redis.py assert today's behaviour there.
    history_cache_users: int = 0
    # HMAC-SHA256 key file (>= 16 bytes, read once at start; the refresh's and the learner's file): artifacts whose
    # manifest is unsigned or mis-signed and deltas that are not signed with it are refused. None: no signatures.
    signing_key_file: Path | None = None
    # -- HTTP limits (both servers, serving/http_server.py) --
    # Open client connections at once; one more is answered 503 (Retry-After: 1, Connection: close) and closed.
    max_connections: int = 256
    # Requests in flight at once (body read, being scored, not yet answered); one more is answered 503
    # with Retry-After: 1. /healthz, /readyz and /metrics are never refused, so probes answer under load.
    max_in_flight: int = 64
    # A request's headers and body must all arrive within this many seconds of its first byte (slowloris); past it
    # the request is answered 408 and the connection closed. Scoring time is not counted.
    request_timeout_s: float = 10.0
    # A keep-alive connection with no request started is closed after this many idle seconds.
    keepalive_timeout_s: float = 30.0
    # Lingering close (RFC 9112 9.6): an answer that closes the connection with the request's rest unread (a 413, a
    # 503 or a 400 from the headers) half-closes, then reads and drops up to linger_bytes for up to linger_s, so the
    # client reads the answer, not a reset (nginx lingering_time, Apache's 2 s); 0 bytes: close at once.
    linger_s: float = 2.0
    linger_bytes: int = 8 << 20
    # Requests scored at once by the threading server (the others wait for a turn); 0: no bound. 1 suits the ONNX
    # formats on a few cores (less GIL contention); TorchScript does better unbounded (serving/http_server.py).
    max_active: int = 0
    # SO_REUSEPORT: several serve processes on one port (each its own model, deltas and /metrics; http_server.py).
    reuse_port: bool = False

    # -- row lookup counts for the nightly hot set (serving/lookup_counts.py) --
    # Count this process's row lookups per user and item id and add them to Redis day counts ("lookup", beside the
    # joiner's impressions) in the background: every lookup_counts_flush_s seconds or lookup_counts_flush_ids
    # lookups; beyond lookup_counts_max_pending waiting lookups (Redis slow or down) new ones are dropped, counted.
    lookup_counts: bool = True
    lookup_counts_flush_s: float = 5.0
    lookup_counts_flush_ids: int = 200_000
    lookup_counts_max_pending: int = 2_000_000  # int64 each: 16 MB at most
    # Each flush's Redis timeout (the counts client's, no retries), stop's last flush included: a frozen Redis holds
    # a shutdown this long at most (serving/lookup_counts.py). > 0 and at most STOP_TIMEOUT_S (30 s, stop's bound on
    # its flush thread). Stop waits on its last flush this long in all (the client's timeouts bound each step only).
    lookup_counts_timeout_s: float = 2.0

    # -- the layered deployment (serving/embedding_store.py) --
    # in_process: cold rows from the artifact's file (copied at load); layered: from Redis ([redis] url, the rows the
    # refresh wrote under <prefix>:emb:<version>:), one round trip per request for the rows neither hot nor cached.
    embedding_store: EmbeddingStore = EmbeddingStore.IN_PROCESS
    # layered: rows fetched from Redis kept in an LRU (per loaded artifact); at most 1,000,000,000
    embedding_cache_rows: int = 200_000
    embedding_store_timeout_s: float = 0.05  # layered: a slower round trip fails; the request uses fallback rows
    embedding_store_retry_after_s: float = 1.0  # layered: after a failed round trip, misses skip Redis this long
    embedding_store_cluster: bool = False  # layered: [redis] url is a Redis Cluster node (redis-py RedisCluster)
    # layered: write each applied delta's non-hot rows to the version's delta overlay in Redis, never over its rows
    # (serving/embedding_store.py). Off by default: nothing in streamrec reads the overlay (it is for tools outside
    # it), and it can grow to a version's own size in Redis
    embedding_store_write_deltas: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", Device.of(self.device, "[serve] device"))
        object.__setattr__(self, "server", ServerKind.of(self.server, "[serve] server"))
        object.__setattr__(self, "embedding_store", EmbeddingStore.of(self.embedding_store, "[serve] embedding_store"))
        # every *_s (poll_s, the timeouts, retry-afters, flush periods) > 0 and at most a day: 0 or less pins a
        # core (poll_s), an infinite flush period kills the flush thread at its first wait (OverflowError), an
        # infinite retry-after never asks Redis again after one failure, an infinite timeout waits for ever
        check_durations("serve", self, max_s=MAX_DURATION_S)
        if self.lookup_counts_timeout_s > STOP_TIMEOUT_S:
            raise ConfigError(f"[serve] lookup_counts_timeout_s must be a finite number of seconds > 0 and <= "
                              f"{STOP_TIMEOUT_S:g} (a shutdown waits it out on a frozen Redis), got "
                              f"{self.lookup_counts_timeout_s!r}")
        check_ports("serve", self)
        # every count and limit >= 1 (threads 0 was bumped to 1, max_candidates 0 refused every request); 0 means:
        # max_active no bound, embedding_cache_rows no LRU (every non-hot row from Redis). The counts that size memory
        # or threads have bounds no deployment reaches (the rest: stream.config.MAX_COUNT)
        check_counts("serve", self, zero_ok=("max_active", "embedding_cache_rows", "linger_bytes",
                                             "history_cache_users"),
                     at_most={"threads": 1_024, "max_body_bytes": 1 << 30, "embedding_cache_rows": 1_000_000_000,
                              "history_cache_users": 100_000_000})

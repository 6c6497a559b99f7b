"""Which version each live scoring process serves, told to the refresh through Redis: each scoring service writes
``<prefix>:serving:<host>:<pid>:<instance>`` (``<instance>``: random hex of its own, so two services in one process,
an embedder's or a test's, never share a key) = ``{"version", "host", "pid", "since"}`` with a TTL of :data:`TTL_S`
(3 heartbeats), again every :data:`HEARTBEAT_S` and at each swap, and deletes it at a clean stop
(:class:`ServedVersionBeacon`; a stop waits on Redis :data:`STOP_TIMEOUT_S` at most, twice at most).
The refresh reads them (:func:`served_versions`) and never prunes a version some live process still serves: a
process that rejected the last publishes (a signing key mismatch, an artifact failing its probe) keeps its old model,
whose directory (and layered rows) a prune would otherwise delete. One key per service, on any node of a Redis
Cluster (SCAN goes through every primary). Best effort both ways: a failed write is one WARNING and a metric
(``streamrec_serving_served_version_errors_total``), never a failed request or swap; a process killed leaves its key
to expire."""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from serving.metrics import ServingMetrics
from serving.row_codec import glob_literal
from serving.stored_versions import get_value
from stream.redis_client import acl_denied

log = logging.getLogger("streamrec.serve")

HEARTBEAT_S = 10.0  # the key written again this often
TTL_S = 3 * HEARTBEAT_S  # a process gone (killed, its Redis cut off) stops holding its version back after this
MAX_INSTANCES = 10_000  # keys the refresh reads at most (a bound on its SCAN); more is a warning
STOP_TIMEOUT_S = 1.0  # stop()'s bound on each of its two waits: for a write in progress, for the DEL


def served_key(prefix: str, instance: str) -> str:
    return f"{prefix}:serving:{instance}"


class ServedVersionBeacon:
    """Keeps ``<prefix>:serving:<host>:<pid>:<instance>`` naming ``version_of()`` (None: no model yet, nothing
    written), from a thread of its own: :meth:`wake` (at a swap) writes it at once. ``client``: serving's
    update-channel client."""

    def __init__(self, client: Any, prefix: str, version_of: Callable[[], str | None], metrics: ServingMetrics,
                 heartbeat_s: float = HEARTBEAT_S) -> None:
        self.client, self.version_of, self.metrics, self.heartbeat_s = client, version_of, metrics, heartbeat_s
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.key = served_key(prefix, f"{self.host}:{self.pid}:{secrets.token_hex(4)}")  # this service's own
        self.pattern = served_key(prefix, "*")  # every process's key: what the ACL grants
        self._since: tuple[str, float] | None = None  # (version, when it went live here)
        self._failing = False
        self._wake, self._stopping = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="serve-served-version", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop the thread, then delete the key (best effort): this service serves nothing any more.

        Redis is waited on ``timeout_s`` at most, twice at most, never the client's socket timeout (5 s, and its
        retries): a frozen Redis must not hold serving's stop. The thread only sleeps on an event, so its join waits
        for a write in progress only: one still running past ``timeout_s`` (Redis frozen) leaves the key to expire
        by its TTL, no DEL sent (it would wait too, and that write could land after it). No DEL either when the last
        write failed (Redis down or refusing: already said; the key, if any, expires by its TTL). The DEL runs in a
        thread of its own, waited for ``timeout_s``: past it stop returns and the DEL, left running, ends with the
        client (a failure is said then)."""
        self._stopping.set()
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=timeout_s)
            if thread.is_alive():
                log.warning("%s: the write in progress did not finish within %g s (Redis frozen?); serving stops "
                            "without deleting the key, which expires by its TTL (%d s)", self.key, timeout_s, TTL_S)
                return
        if self._failing:  # the last write failed: said when it did; Redis would likely be waited on in vain
            log.info("%s not deleted: the last write to Redis failed; it expires by its TTL (%d s)", self.key, TTL_S)
            return
        delete = threading.Thread(target=self._best_effort, args=("delete", lambda: self.client.delete(self.key)),
                                  name="serve-served-version-delete", daemon=True)
        delete.start()
        delete.join(timeout=timeout_s)
        if delete.is_alive():
            log.warning("%s: Redis did not answer its DEL within %g s (Redis frozen?); serving stops without waiting, "
                        "the key expires by its TTL (%d s)", self.key, timeout_s, TTL_S)

    def _run(self) -> None:
        while not self._stopping.is_set():
            self.beat()
            self._wake.wait(self.heartbeat_s)
            self._wake.clear()

    def beat(self) -> None:
        """Write the key naming the live version, with its TTL."""
        version = self.version_of()
        if version is None:
            return
        if self._since is None or self._since[0] != version:
            self._since = (version, time.time())
        value = json.dumps({"version": version, "host": self.host, "pid": self.pid, "since": self._since[1]})
        self._best_effort("write", lambda: self.client.set(self.key, value, ex=int(TTL_S)))

    def _best_effort(self, what: str, command: Callable[[], object]) -> None:
        try:
            command()
        except Exception as exc:  # noqa: BLE001 - Redis down, NOPERM: never a failed request or swap
            self.metrics.served_version_errors.inc()
            if not self._failing:  # the fix named is the one for this error: a grant only for an ACL refusal
                fix = (f"grant serving +set +del on ~{self.pattern} (the README's ACL)" if acl_denied(exc) else
                       "check that the Redis of [redis] url is up, reachable from this host and accepts its "
                       "credentials")
                log.warning("could not %s %s in Redis (%s: %s): a refresh may prune the version this process "
                            "serves; %s", what, self.key, type(exc).__name__, exc, fix)
            self._failing = True
            return
        if self._failing:
            log.info("%s written in Redis again", self.key)
        self._failing = False


def served_versions(client: Any, prefix: str, limit: int = MAX_INSTANCES) -> dict[str, list[str]]:
    """The versions live scoring processes serve: version -> ``["host:pid", ...]`` (each process once, however many
    of its services serve the version). Redis errors propagate (the caller decides); a key that is not a beacon's
    JSON is logged and skipped; past ``limit`` keys the rest is not read (a WARNING)."""
    out: dict[str, list[str]] = {}
    for n, key in enumerate(client.scan_iter(match=glob_literal(served_key(prefix, "")) + "*", count=1000)):
        if n >= limit:
            log.warning("more than %d %s* keys: the rest are not read, and versions they name may be pruned", limit,
                        served_key(prefix, ""))
            break
        try:
            raw = get_value(client, key.decode() if isinstance(key, bytes) else key)  # WRONGTYPE: a ValueError
            if raw is None:  # expired since the scan
                continue
            held = json.loads(raw)
            out.setdefault(str(held["version"]), []).append(f"{held['host']}:{held['pid']}")
        except (ValueError, TypeError, KeyError, RecursionError) as exc:
            log.warning("%r is not a serving process's version (%s: %s); skipped", key, type(exc).__name__, exc)
    return {version: list(dict.fromkeys(who)) for version, who in out.items()}  # a process once, in order

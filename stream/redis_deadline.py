"""Redis connections whose ``socket_timeout`` bounds each whole reply, not each read of it.

redis-py applies ``socket_timeout`` to every ``recv``: a Redis that trickles its reply (a congested or lossy link, a
server swapping, a middlebox pacing bytes) and never leaves a read idle for the whole timeout holds a command for as
long as it keeps trickling. Measured (tests/integration/test_serving_slow_redis.py, replies a byte per 20 ms): a
layered request whose history and row reads were to time out in 0.2 s each was not answered in 10 s. The connections
here bound a reply's reads together: the first read waits ``socket_timeout`` as before, each later read of the same
reply only what is left of it since the first, and a reply not complete by then fails as a timeout (redis-py's
``TimeoutError``, the connection disconnected: nothing is left unread on it), which every caller already handles as
a Redis slower than its timeout.

The common reply arrives in one read and costs nothing more (no ``settimeout`` call); only a reply in several reads
shortens its socket's timeout, restored when the reply is read. A pipeline's replies are bounded one by one, unless
the caller bounds them together (:func:`replies_by`: the layered row fetch, whose pipelined MGETs are one round trip
of ``embedding_store_timeout_s``; :func:`round_trip`: one round trip of the client's own timeout, as every pipelined
read of the day counts and a cluster's history reads are). Reads with a timeout of their own (redis-py's
``can_read``, pub/sub polls) are left as they are.

:func:`stream.redis_client.connect` builds its clients with these classes where asked (``whole_reply=True``), and a
cluster's with its topology refresh outside the deadlines (:func:`refresh_outside_deadlines`).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis

_local = threading.local()  # .by: the deadline replies_by set on this thread (connections are one thread's at a time)


@contextmanager
def replies_by(deadline: float) -> Iterator[None]:
    """Every reply a whole-reply connection reads on this thread inside the block completes by ``deadline`` (on
    ``time.monotonic``) as well as within its own ``socket_timeout``: a pipeline's replies share one deadline."""
    with _by(min(getattr(_local, "by", math.inf), deadline)):
        yield


@contextmanager
def _by(deadline: float) -> Iterator[None]:
    """``deadline`` the one replies on this thread complete by inside the block (math.inf: none), the one before it
    back after."""
    before = getattr(_local, "by", math.inf)
    _local.by = deadline
    try:
        yield
    finally:
        _local.by = before


@contextmanager
def round_trip(client: Any) -> Iterator[None]:
    """Every reply read inside the block completes within one ``socket_timeout`` of ``client`` (a single node's or a
    cluster's client) from now: a pipeline of several replies bounded as one reply is (:func:`replies_by`). A client
    with no timeout, or not whole-reply, is left as it is."""
    timeout = client.get_connection_kwargs().get("socket_timeout")
    with replies_by(math.inf if timeout is None else time.monotonic() + float(timeout)):
        yield


def refresh_outside_deadlines(cluster: Any) -> Any:
    """``cluster`` (a redis-py ``RedisCluster``), its topology refresh (``NodesManager.initialize``: CLUSTER SLOTS of
    the nodes) read outside any :func:`replies_by` deadline, each reply within its own ``socket_timeout``.

    redis-py refreshes the topology after a node's timeout, inside the command that timed out: within a spent deadline
    every node's reply failed at once, the refresh reached no node, and the timeout surfaced as "Redis Cluster cannot
    be connected" (``RedisClusterUnreachableError``, streamrec's ClusterUnavailable) though one node was slow and the
    others healthy, with a failed refresh logged and backed off. The refresh is redis-py's, not the caller's round
    trip: outside it, it learns the topology from the healthy nodes, and the command fails as the timeout it was."""
    manager = cluster.nodes_manager
    initialize = manager.initialize

    def initialize_unbounded(*args: Any, **kwargs: Any) -> Any:
        with _by(math.inf):
            return initialize(*args, **kwargs)

    manager.initialize = initialize_unbounded
    return cluster


class _DeadlineSocket:
    """A connection's socket whose reads share one deadline while a reply is read (:meth:`begin` .. :meth:`end`);
    every other use passes through to the socket."""

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self._reading = False
        self._deadline: float | None = None
        self._timeout: float | None = None  # the socket's own timeout, restored by end() where a read shortened it

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)

    def begin(self) -> None:
        self._reading, self._deadline, self._timeout = True, None, None

    def end(self) -> None:
        """After a reply: the socket's own timeout back, unless a failed read closed it (redis-py disconnects before
        the reply's error reaches here; ``settimeout`` on a closed socket would replace that error with EBADF)."""
        if self._timeout is not None and self._sock.fileno() != -1:
            self._sock.settimeout(self._timeout)
        self._reading, self._deadline, self._timeout = False, None, None

    def _bound(self) -> None:
        """Before each read of a reply: the first sets the deadline (and waits the socket's own timeout, unless
        :func:`replies_by` leaves less), a later one waits only what is left of it."""
        if not self._reading:
            return
        now = time.monotonic()
        if self._deadline is None:
            timeout = self._sock.gettimeout()
            own = math.inf if timeout is None else now + timeout  # no socket timeout: only replies_by bounds it
            self._deadline = min(own, getattr(_local, "by", math.inf))
            if self._deadline == own:
                return
        if self._deadline == math.inf:
            return
        left = self._deadline - now
        if left <= 0:
            raise TimeoutError("timed out: the reply did not complete within socket_timeout")
        if self._timeout is None:
            self._timeout = self._sock.gettimeout()
        self._sock.settimeout(left)

    def recv(self, *args: Any) -> Any:
        self._bound()
        return self._sock.recv(*args)

    def recv_into(self, *args: Any) -> Any:
        self._bound()
        return self._sock.recv_into(*args)


class _WholeReply:
    """The mixin: the socket wrapped at connect, each ``read_response`` without a timeout of its own bounded."""

    _sock: Any

    def _connect(self) -> Any:
        return _DeadlineSocket(super()._connect())  # type: ignore[misc]

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        sock = self._sock
        if not isinstance(sock, _DeadlineSocket) or "timeout" in kwargs:
            return super().read_response(*args, **kwargs)  # type: ignore[misc]
        sock.begin()
        try:
            return super().read_response(*args, **kwargs)  # type: ignore[misc]
        finally:
            sock.end()


class WholeReplyConnection(_WholeReply, redis.Connection):
    """A TCP connection whose ``socket_timeout`` bounds each whole reply (module docstring)."""


class WholeReplySSLConnection(_WholeReply, redis.SSLConnection):
    """A TLS connection whose ``socket_timeout`` bounds each whole reply (module docstring)."""


class WholeReplyUnixConnection(_WholeReply, redis.UnixDomainSocketConnection):
    """A Unix-socket connection whose ``socket_timeout`` bounds each whole reply (module docstring)."""


def connection_class(url: str) -> type[redis.connection.AbstractConnection]:
    """The whole-reply connection class for a Redis ``url`` (its scheme: redis, rediss or unix)."""
    if url.startswith("rediss://"):
        return WholeReplySSLConnection
    if url.startswith("unix://"):
        return WholeReplyUnixConnection
    return WholeReplyConnection

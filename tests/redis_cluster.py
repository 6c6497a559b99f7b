"""A real Redis Cluster for tests: three primaries (no replicas) on free ports, started from the same redis-server
binary the local stack runs (``streamrec.stack.redis_binary``). ``tests/conftest.py`` makes it the ``redis_cluster``
fixture (one node's url) and the ``cluster_nodes`` fixture (:class:`ClusterNodes`: the same cluster with its nodes to
stop and start again), so every test that claims something about Redis Cluster (the layered embedding store, counts,
history, pub/sub, the joiner writing into a cluster, a node failing under any of them) checks it against the real
thing."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path

import redis
from redis.crc import key_slot

from stream.redis_client import wait_until_up
from stream.startup import not_started
from streamrec.stack import free_port, redis_binary

PRIMARIES = 3
SLOTS = 16384
NODE_TIMEOUT_MS = 2000  # cluster-node-timeout: a stopped primary is marked failed (the cluster down) after this
BUS_OFFSET = 10000  # a node's cluster bus port is its port + 10000 (Redis 6.2 has no cluster-port setting)
SPAWN_TRIES = 5  # ports a node of a forming cluster is tried on, each taken by another process since it was found


def cluster_port(taken: Collection[int] = ()) -> int:
    """A free port whose cluster bus port is free too, neither of them ``taken`` nor the bus port of one ``taken``
    (the other nodes' ports: ``free_port`` may hand out a port again once its probe socket is closed). Free when
    found, not reserved: another process may bind it before the node does (:meth:`ClusterNodes.form` then tries
    another)."""
    busy = {*taken, *(t + BUS_OFFSET for t in taken)}
    while True:
        p = free_port()
        if p + BUS_OFFSET > 65535 or p in busy or p + BUS_OFFSET in busy:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + BUS_OFFSET))
            except OSError:
                continue
        return p


def cluster_ports(n: int) -> list[int]:
    """``n`` distinct cluster ports (:func:`cluster_port`), no one's bus port another's port."""
    ports: list[int] = []
    for _ in range(n):
        ports.append(cluster_port(ports))
    return ports


class NodeNotStarted(AssertionError):
    """A cluster node's redis-server did not start on its port (taken by another process since it was found, or
    another error its log names)."""


class ClusterNodes:
    """The primaries of a test's cluster, each a redis-server process that can be stopped and started again on its
    port with its node file (so it comes back as the same node, owning the same slots, with an empty keyspace:
    ``--save ""``). Node ``k`` owns the ``k``-th third of the slots (:meth:`index_of`).

    With no replicas, a stopped primary's slots are served by nobody: commands for them fail at once (connection
    refused) and, once the other nodes mark it failed (``NODE_TIMEOUT_MS``), the whole cluster answers CLUSTERDOWN
    (``cluster-require-full-coverage``, Redis's default) until it is back."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.ports = cluster_ports(PRIMARIES)
        self.procs: list[subprocess.Popen | None] = [None] * PRIMARIES
        self.url = f"redis://127.0.0.1:{self.ports[0]}/0"  # one node's url: clients discover the others

    def _admin(self, k: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.ports[k], socket_timeout=2)

    def log(self, k: int) -> Path:
        """Node ``k``'s log (each start on its port appends to it)."""
        return self.directory / f"redis-{self.ports[k]}.log"

    def _spawn(self, k: int) -> None:
        """Start node ``k`` on its port; :class:`NodeNotStarted` (it stopped again) unless that very process answers
        there: not another cluster's node that took the port since it was found (a test's commands would reach it)."""
        p, log = self.ports[k], self.log(k)
        since = log.stat().st_size if log.exists() else 0
        with log.open("ab") as out:
            proc = subprocess.Popen(
                [str(redis_binary()), "--bind", "127.0.0.1", "--port", str(p), "--save", "", "--appendonly", "no",
                 "--cluster-enabled", "yes", "--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--dir",
                 str(self.directory), "--cluster-config-file", f"nodes-{p}.conf"], stdout=out, stderr=out)
        with contextlib.closing(self._admin(k)) as c:
            if wait_until_up(c, 10, lambda: proc.poll() is None, proc.pid):
                self.procs[k] = proc
                return
        code = proc.poll()  # None: still running, another process answering its port (or none): stopped
        proc.kill()
        proc.wait()
        raise NodeNotStarted(not_started(f"redis-server (cluster node {k})", f"127.0.0.1:{p}", code, 10, log, since,
                                         "start it again"))

    def _spawn_anew(self, k: int) -> None:
        """Start node ``k`` of a forming cluster, on a fresh port each time its port was taken before it bound it."""
        for attempt in range(SPAWN_TRIES):
            try:
                return self._spawn(k)
            except NodeNotStarted:
                if attempt == SPAWN_TRIES - 1:
                    raise
                self.ports[k] = cluster_port(self.ports[:k] + self.ports[k + 1:])
                self.url = f"redis://127.0.0.1:{self.ports[0]}/0"

    def form(self) -> None:
        """Start every node, give each its third of the slots, join them and wait until the cluster is ok."""
        for k in range(PRIMARIES):
            self._spawn_anew(k)
        share = SLOTS // PRIMARIES + 1
        for k in range(PRIMARIES):
            with contextlib.closing(self._admin(k)) as c:
                c.execute_command("CLUSTER ADDSLOTS", *range(k * share, min(SLOTS, (k + 1) * share)))
        with contextlib.closing(self._admin(0)) as c:
            for p in self.ports[1:]:
                c.execute_command("CLUSTER MEET", "127.0.0.1", p)
        self.wait_ok()

    def running(self, k: int) -> bool:
        proc = self.procs[k]
        return proc is not None and proc.poll() is None

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every running node says ``cluster_state:ok`` (every slot served again)."""
        deadline = time.monotonic() + timeout_s
        for k in range(PRIMARIES):
            if not self.running(k):
                continue
            with contextlib.closing(self._admin(k)) as c:
                while c.cluster("info")["cluster_state"] != "ok":
                    assert time.monotonic() < deadline, f"the cluster is not ok after {timeout_s} s"
                    time.sleep(0.05)

    def wait_down(self, timeout_s: float = 30.0) -> None:
        """Until every running node says ``cluster_state:fail`` (a stopped primary marked failed: CLUSTERDOWN)."""
        deadline = time.monotonic() + timeout_s
        for k in range(PRIMARIES):
            if not self.running(k):
                continue
            with contextlib.closing(self._admin(k)) as c:
                while c.cluster("info")["cluster_state"] != "fail":
                    assert time.monotonic() < deadline, f"the cluster is not marked failed after {timeout_s} s"
                    time.sleep(0.05)

    def stop(self, k: int) -> None:
        """Kill node ``k`` (SIGKILL: a crash, no goodbye to its clients or to the other nodes)."""
        proc = self.procs[k]
        if proc is not None:
            proc.kill()
            proc.wait()
        self.procs[k] = None

    def start(self, k: int, *, wait_ok: bool = True) -> None:
        """Start node ``k`` again (same port, same node file: it rejoins owning its slots, its keyspace empty) and,
        with ``wait_ok``, wait until the cluster is ok again."""
        assert not self.running(k), f"node {k} is running"
        self._spawn(k)
        if wait_ok:
            self.wait_ok()

    def restart(self, k: int) -> None:
        self.stop(k)
        self.start(k)

    def stop_all(self) -> None:
        """Kill every node: a client's commands fail to connect, and once its topology refresh has found no node
        to ask, redis-py raises ``RedisClusterUnreachableError`` (no ``redis.RedisError``) for them."""
        for k in range(PRIMARIES):
            self.stop(k)

    def start_all(self) -> None:
        """Start every stopped node again and wait until the cluster is ok."""
        for k in range(PRIMARIES):
            if not self.running(k):
                self.start(k, wait_ok=False)
        self.wait_ok()

    def begin_move(self, slot: int, src: int, dst: int, keys: int | Sequence[str] = 0) -> None:
        """Start moving hash ``slot`` from node ``src`` to node ``dst`` as a resharding does (``redis-cli --cluster
        reshard``): ``dst`` IMPORTING, ``src`` MIGRATING, then ``keys`` MIGRATEd: a number of the slot's keys, any of
        them, or these keys (of ``slot``; on a cluster several tests share, the slot may hold another test's keys, and
        a number may move none of this test's). Until :meth:`finish_move`, a key of the slot is on either node:
        ``src`` answers ASK for one it no longer has, and a command on several of the slot's keys that are not all on
        one node is refused with TRYAGAIN."""
        named = [] if isinstance(keys, int) else [k.encode() for k in keys]
        if any(key_slot(k) != slot for k in named):
            raise ValueError(f"keys of other slots than {slot}: {[k for k in named if key_slot(k) != slot]}")
        with contextlib.closing(self._admin(src)) as s, contextlib.closing(self._admin(dst)) as d:
            d.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", _node_id(s))
            s.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", _node_id(d))
            if isinstance(keys, int) and keys:
                self._migrate(s, dst, s.execute_command("CLUSTER GETKEYSINSLOT", slot, keys))
            elif named:
                if (reply := self._migrate(s, dst, named)) not in (b"OK", "OK", True):  # NOKEY: none was there
                    raise AssertionError(f"MIGRATE of {named} to node {dst} answered {reply!r}")

    def finish_move(self, slot: int, src: int, dst: int) -> None:
        """Move the rest of ``slot``'s keys (:meth:`begin_move`) and make ``dst`` its owner on every node (the clients'
        next command on it there is answered MOVED)."""
        with contextlib.closing(self._admin(src)) as s, contextlib.closing(self._admin(dst)) as d:
            while keys := s.execute_command("CLUSTER GETKEYSINSLOT", slot, 1000):
                self._migrate(s, dst, keys)
            owner = _node_id(d)
        for k in range(PRIMARIES):
            with contextlib.closing(self._admin(k)) as c:
                c.execute_command("CLUSTER SETSLOT", slot, "NODE", owner)

    def move(self, slot: int, src: int, dst: int) -> None:
        """:meth:`begin_move` and :meth:`finish_move`: the whole slot with its keys."""
        self.begin_move(slot, src, dst)
        self.finish_move(slot, src, dst)

    def _migrate(self, src: redis.Redis, dst: int, keys: list[bytes]) -> object:
        """MIGRATE's reply (OK; NOKEY when none of ``keys`` was on ``src``)."""
        if not keys:
            return None
        return src.execute_command("MIGRATE", "127.0.0.1", self.ports[dst], "", 0, 5000, "KEYS", *keys)

    def index_of(self, key: str | bytes) -> int:
        """The node owning ``key``'s hash slot (the split :meth:`form` made)."""
        return key_slot(key.encode() if isinstance(key, str) else key) // (SLOTS // PRIMARIES + 1)

    def close(self) -> None:
        for k in range(PRIMARIES):
            self.stop(k)


@contextlib.contextmanager
def redis_cluster(directory: Path) -> Iterator[ClusterNodes]:
    """Three primaries (no replicas) of a real Redis Cluster on free ports, their node files in ``directory``;
    yields them as :class:`ClusterNodes` (``.url``: one node's url, clients discover the others). The 16384 slots
    are split in three, so keys of different hash slots land on different processes; the nodes are killed on
    exit."""
    nodes = ClusterNodes(directory)
    try:
        nodes.form()
        yield nodes
    finally:
        nodes.close()


def _node_id(client: redis.Redis) -> str:
    got = client.execute_command("CLUSTER MYID")
    return got.decode() if isinstance(got, bytes) else str(got)

"""A real Redis Cluster for tests: three primaries (no replicas) on free ports, started from the same redis-server
binary the local stack runs (``streamrec.stack.redis_binary``). ``tests/conftest.py`` makes it the ``redis_cluster``
fixture, so every test that claims something about Redis Cluster (the layered embedding store, counts, history,
pub/sub, the joiner writing into a cluster) checks it against the real thing."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import redis

from stream.redis_client import wait_until_up
from streamrec.stack import free_port, redis_binary

PRIMARIES = 3


def cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000, Redis 6.2 has no cluster-port setting) is free too."""
    while True:
        p = free_port()
        if p + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 10000))
            except OSError:
                continue
        return p


@contextlib.contextmanager
def redis_cluster(directory: Path) -> Iterator[str]:
    """Three primaries (no replicas) of a real Redis Cluster on free ports, their node files in ``directory``;
    yields one node's url (clients discover the others). The 16384 slots are split in three, so keys of different
    hash slots land on different processes; the nodes are killed on exit."""
    ports = [cluster_port() for _ in range(PRIMARIES)]
    procs = [subprocess.Popen([str(redis_binary()), "--bind", "127.0.0.1", "--port", str(p), "--save", "",
                               "--appendonly", "no", "--cluster-enabled", "yes", "--dir", str(directory),
                               "--cluster-config-file", f"nodes-{p}.conf"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for p in ports]
    clients = [redis.Redis(host="127.0.0.1", port=p, socket_timeout=2) for p in ports]
    try:
        for c in clients:
            assert wait_until_up(c, 10), "redis-server (cluster mode) did not start"
        share = 16384 // PRIMARIES + 1
        for k, c in enumerate(clients):
            c.execute_command("CLUSTER ADDSLOTS", *range(k * share, min(16384, (k + 1) * share)))
        for p in ports[1:]:
            clients[0].execute_command("CLUSTER MEET", "127.0.0.1", p)
        deadline = time.monotonic() + 20
        while not all(c.cluster("info")["cluster_state"] == "ok" for c in clients):
            assert time.monotonic() < deadline, "the cluster did not form"
            time.sleep(0.1)
        yield f"redis://127.0.0.1:{ports[0]}/0"
    finally:
        for c in clients:
            c.close()
        for proc in procs:
            proc.kill()
            proc.wait()

"""Whether Redis still holds the keys this process has been writing under a prefix: a Redis that lost them under the
system (a single node restarted empty without persistence, a FLUSHALL; on a Redis Cluster, one node restarted empty)
answers every read as if nothing had ever been written. Nothing else tells: an empty click history and a missing day
count are also what a new user and an unseen id read.

One marker key per counts hash tag (``stream/counts_keys.py``: ``{item}``, ``{user}``), so on a cluster each lives on
the node of one kind's counts, and a node restarted empty loses that kind's marker with its counts::

    {prefix}:keyspace:{{tag}}    value = unix ms it was set

A writer calls :meth:`KeyspaceWatch.check` once per flush: one pipelined round trip of ``SET NX`` (a marker found is
left as it was). A marker that this watch had seen and that is gone now was lost with the keys beside it since the
last check; :meth:`check` names its tag, and the caller says what that costs its readers. The markers have no expiry
(two keys per prefix); at the first check a marker missing is a keyspace new to this process, not counted as lost (a
Redis emptied while no writer ran is not told from a new deployment). Histories carry no hash tag and spread over
every node: a cluster node restarted empty that holds neither tag's slot loses some users' histories unseen here.

A reader of those keys (serving: its click histories) calls :meth:`KeyspaceWatch.changed` instead: it only reads the
markers (a pipelined GET each), so it needs no write permission and never sets a marker again itself, which would hide
the loss from the writer (the first SET NX after a loss tells it; the writer's own check would then find it there). A
marker gone, or set anew (its value changed: the writer found it gone first), since the reader's last look is a loss.
"""

from __future__ import annotations

import time
from typing import Any

from stream.counts_keys import KINDS
from stream.redis_client import wrong_type


class KeyspaceWatch:
    """The markers of ``prefix`` on ``client`` (module docstring), checked by :meth:`check`."""

    def __init__(self, client: Any, prefix: str) -> None:
        self.client = client
        # one marker per counts hash tag (stream/counts_keys.py: a kind's): on a cluster, the node of each kind's counts
        self.keys = {tag: f"{prefix}:keyspace:{{{tag}}}" for tag in KINDS}
        self._seen = False  # a check has run: every marker was there or set by it
        self._read: dict[str, bytes | None] = {}  # changed(): each marker's value at the last look (None: missing)
        self.other_type: list[str] = []  # changed(): the tags whose marker key held another Redis type at the last look

    def check(self) -> list[str]:
        """The tags whose marker is gone since the last check (their Redis, or cluster node, lost its keys), each set
        again; empty at the first check. Raises what the client raises (Redis down: the caller's outage)."""
        pipe = self.client.pipeline(transaction=False)
        for key in self.keys.values():
            pipe.set(key, int(time.time() * 1000), nx=True)
        created = pipe.execute()  # True: the marker was missing and is set now
        lost = [tag for tag, new in zip(self.keys, created, strict=True) if new] if self._seen else []
        self._seen = True
        return lost

    def changed(self) -> list[str]:
        """A reader's check, writing nothing: the tags whose marker was there at the last look and is gone or holds
        another value now (set anew by the writer after a loss); empty at the first look, and for a marker never set
        (no writer yet). A marker key of another Redis type (another client's) reads as missing, its tag in
        :attr:`other_type` for the caller to say. Raises what the client raises."""
        pipe = self.client.pipeline(transaction=False)
        for key in self.keys.values():
            pipe.get(key)
        now = dict(zip(self.keys, pipe.execute(raise_on_error=False), strict=True))
        self.other_type = [tag for tag, value in now.items() if wrong_type(value)]
        for tag in self.other_type:  # another client's key there: no marker to compare (the other tag's still is)
            now[tag] = None
        for value in now.values():
            if isinstance(value, Exception):  # any other error reply: the caller's, as a raising read's
                raise value
        lost = [tag for tag, value in now.items() if self._read.get(tag) is not None and value != self._read[tag]]
        self._read = now
        return lost


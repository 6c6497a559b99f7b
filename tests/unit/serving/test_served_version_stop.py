"""The served version beacon's stop (serving/served_versions.py) against a frozen Redis (accepting, never answering):
it waits on Redis STOP_TIMEOUT_S at most, never the client's socket timeout. Before, its join waited 5 s for a write
stuck on Redis and its DEL then waited the client's whole socket timeout, so serving's stop took up to ~10 s longer."""

from __future__ import annotations

import threading

import pytest
import redis

from serving.metrics import ServingMetrics
from serving.served_versions import ServedVersionBeacon

SOCKET_TIMEOUT_S = 10.0  # the fake client's: what a frozen Redis holds a command (past the old 5 s join)


class FrozenClient:
    """A client of a frozen Redis: a command waits (until the test releases it, else the socket timeout) and then
    times out. ``frozen``: which commands freeze (the others answer at once); ``calls``: the commands sent."""

    def __init__(self, *frozen: str) -> None:
        self.frozen: tuple[str, ...] = frozen
        self.calls: list[str] = []
        self.entered, self.release, self.answered = threading.Event(), threading.Event(), threading.Event()

    def _command(self, name: str) -> None:
        self.calls.append(name)
        if name in self.frozen:
            self.entered.set()
            self.release.wait(SOCKET_TIMEOUT_S)
            self.answered.set()
            raise redis.TimeoutError("Timeout reading from socket")

    def set(self, *args: object, **kwargs: object) -> None:
        self._command("set")

    def delete(self, *args: object) -> None:
        self._command("delete")


def beacon_of(client: FrozenClient) -> ServedVersionBeacon:
    return ServedVersionBeacon(client, "p", lambda: "v001", ServingMetrics(lambda: None))


def test_stop_after_a_failed_write_sends_no_delete_the_key_expires_by_its_ttl() -> None:
    client = FrozenClient("set")
    client.release.set()  # the write times out at once, as one to a frozen Redis did before stop
    beacon = beacon_of(client)
    beacon.beat()
    beacon.stop()
    assert client.calls == ["set"]  # no DEL to wait out the socket timeout again


def test_stop_during_a_write_stuck_on_a_frozen_redis_returns_without_it_and_sends_no_delete(
        caplog: pytest.LogCaptureFixture) -> None:
    client = FrozenClient("set", "delete")
    beacon = beacon_of(client)
    beacon.start()
    try:
        assert client.entered.wait(10)  # the thread's first write hangs
        with caplog.at_level("WARNING", logger="streamrec.serve"):
            beacon.stop()
        assert not client.answered.is_set()  # returned while the write still waits: not its socket timeout
        assert client.calls == ["set"]  # no DEL behind it (it would wait too, and the write could land after it)
        assert "expires by its TTL" in caplog.text
    finally:
        client.release.set()


def test_stop_with_redis_frozen_since_the_last_write_returns_before_its_delete_times_out(
        caplog: pytest.LogCaptureFixture) -> None:
    client = FrozenClient("delete")
    beacon = beacon_of(client)
    beacon.beat()  # written while Redis answered
    try:
        with caplog.at_level("WARNING", logger="streamrec.serve"):
            beacon.stop()
        assert client.calls == ["set", "delete"]
        assert not client.answered.is_set()  # returned while the DEL still waits: not its socket timeout
        assert "did not answer its DEL" in caplog.text
    finally:
        client.release.set()

"""``stream.redis_client.wait_until_up`` with the started process's pid: only that process's answer counts, and a
server that refuses ``INFO`` (renamed, an ACL without it) is taken at its PING, not waited for until the timeout."""

from __future__ import annotations

from typing import Any

import redis

from stream.redis_client import wait_until_up


class Answering:
    """A client whose server answers PING, and INFO with ``pid`` (or refuses it with ``refuse``)."""

    def __init__(self, pid: int, refuse: BaseException | None = None) -> None:
        self.pid, self.refuse, self.infos = pid, refuse, 0

    def ping(self) -> bool:
        return True

    def info(self, section: str) -> dict[str, Any]:
        self.infos += 1
        if self.refuse is not None:
            raise self.refuse
        return {"process_id": self.pid}


def test_an_answer_from_another_process_on_the_port_does_not_count() -> None:
    assert wait_until_up(Answering(pid=111), 0.2, pid=222) is False


def test_the_started_process_answering_counts() -> None:
    assert wait_until_up(Answering(pid=222), 5.0, pid=222) is True


def test_a_server_refusing_info_is_taken_at_its_ping_rather_than_timing_out() -> None:
    client = Answering(pid=0, refuse=redis.ResponseError("unknown command 'INFO'"))
    assert wait_until_up(client, 5.0, pid=222) is True and client.infos == 1
    denied = Answering(pid=0, refuse=redis.exceptions.NoPermissionError("NOPERM this user has no permissions"))
    assert wait_until_up(denied, 5.0, pid=222) is True


def test_a_connection_lost_at_info_is_not_up_yet() -> None:
    assert wait_until_up(Answering(pid=222, refuse=redis.ConnectionError("reset")), 0.2, pid=222) is False

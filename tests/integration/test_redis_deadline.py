"""stream.redis_deadline against a real redis-server behind tests/trickle_proxy.py: a reply trickled past the
client's ``socket_timeout`` fails as redis-py's ``TimeoutError`` (what every caller handles), and the client's next
command on the same pool reads its own reply, not the rest of the abandoned one."""

from __future__ import annotations

import pytest
import redis

from stream.config import RedisSettings
from stream.redis_client import connect
from tests.integration.test_layered_serving import own_redis  # noqa: F401 - a fixture
from tests.trickle_proxy import TrickleProxy

TIMEOUT_S = 0.2
VALUE = b"v" * 300  # trickled a byte per 20 ms: 6 s, far past TIMEOUT_S, and no read idle for TIMEOUT_S


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


def test_a_trickled_reply_past_its_timeout_raises_redis_timeout_and_the_next_command_reads_its_own_reply(
        own_redis: tuple) -> None:  # noqa: F811
    _, url = own_redis
    writer = redis.Redis.from_url(url)
    writer.set("a", VALUE)
    writer.set("b", b"other")
    writer.close()
    with TrickleProxy(_port(url)) as proxy:
        client = connect(RedisSettings(url=proxy.url), timeout_s=TIMEOUT_S, retries=0, whole_reply=True)
        try:
            assert client.get("a") == VALUE
            proxy.trickling = True
            with pytest.raises(redis.TimeoutError):
                client.get("a")
            proxy.trickling = False
            assert client.get("b") == b"other"
            assert client.get("a") == VALUE
        finally:
            client.close()

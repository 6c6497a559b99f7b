"""Redis settings that cost the request path latency, against real redis-servers: the local stack runs without active
rehashing, ``latency_advice`` names it where a server has it (and says nothing where Redis will not tell), and serving
warns at start."""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

from serving.service import ScoringService
from serving.settings import ServeSettings
from stream.config import RedisSettings
from stream.redis_client import connect, latency_advice, wait_until_up
from streamrec.stack import LocalStack, free_port, redis_binary

PASSWORD = "latency-s3cret"


@contextmanager
def redis_server(*args: str) -> Iterator[str]:
    """A redis-server with Redis's own defaults but ``args`` (no ``redis_server_args``: that is what is tested), on a
    free port; yields its url."""
    port = free_port()
    proc = subprocess.Popen([str(redis_binary()), "--bind", "127.0.0.1", "--port", str(port), "--save", "", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    password = args[args.index("--requirepass") + 1] if "--requirepass" in args else None
    client = redis.Redis(port=port, password=password)
    try:
        assert wait_until_up(client, 10), "redis-server did not start"
        yield f"redis://{f':{password}@' if password else ''}127.0.0.1:{port}/0"
    finally:
        client.close()
        proc.kill()
        proc.wait()


def test_advice_names_active_rehashing_without_the_password_until_it_is_turned_off() -> None:
    with redis_server("--requirepass", PASSWORD) as url:
        settings = RedisSettings(url=url)
        client = connect(settings, timeout_s=1.0, retries=0)
        try:
            advice = latency_advice(client, settings)
            assert advice is not None and "activerehashing yes" in advice and "activerehashing no" in advice
            assert PASSWORD not in advice and "127.0.0.1" in advice
            client.config_set("activerehashing", "no")
            assert latency_advice(client, settings) is None
        finally:
            client.close()


def test_advice_is_none_where_redis_will_not_say_or_cannot_be_reached() -> None:
    with redis_server("--rename-command", "CONFIG", "") as url:  # as managed services hide CONFIG
        settings = RedisSettings(url=url)
        client = connect(settings, timeout_s=1.0, retries=0)
        try:
            client.ping()
            with pytest.raises(redis.ResponseError):
                client.config_get("activerehashing")
            assert latency_advice(client, settings) is None
        finally:
            client.close()
    gone = RedisSettings(url=f"redis://127.0.0.1:{free_port()}/0")
    client = connect(gone, timeout_s=0.5, retries=0)
    assert latency_advice(client, gone) is None
    client.close()


def test_the_local_stack_runs_redis_without_active_rehashing(stack: LocalStack, redis_client: redis.Redis) -> None:
    got = redis_client.config_get("activerehashing")
    assert {str(k if isinstance(k, str) else k.decode()): v if isinstance(v, str) else v.decode()
            for k, v in got.items()} == {"activerehashing": "no"}
    assert latency_advice(redis_client, RedisSettings(url=stack.redis_url)) is None


@pytest.mark.parametrize("rehashing", ["yes", "no"])
def test_serving_warns_at_start_only_when_its_redis_rehashes_actively(tmp_path: Path, rehashing: str,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    with redis_server("--activerehashing", rehashing) as url:
        settings = ServeSettings(port=0, publish_root=tmp_path / "serving", poll_s=3600)
        with caplog.at_level(logging.WARNING, logger="streamrec.serve"):
            with ScoringService(settings, RedisSettings(url=url)):
                pass
        warned = [r for r in caplog.records if "activerehashing yes" in r.getMessage()]
        assert len(warned) == (1 if rehashing == "yes" else 0)
        if warned:
            assert warned[0].levelno == logging.WARNING


def test_waiting_for_a_redis_gives_up_where_nothing_listens_and_sees_one_that_does() -> None:
    nobody = redis.Redis(port=free_port(), socket_timeout=0.2)
    assert wait_until_up(nobody, 0.3) is False
    with redis_server() as url:  # started and waited for by the same helper
        assert wait_until_up(redis.Redis.from_url(url), 0.0) is True

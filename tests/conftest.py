"""Session fixtures: a real Kafka-protocol broker and a real Redis, started by the project's own stack code
on free ports, with a unique topic set and consumer group per test."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator

import pytest
import redis

from stream.config import KafkaSettings
from streamrec.stack import LocalStack, StackSettings, free_port


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fault-rounds", type=int, default=1,
                     help="rounds of each fault-injection test (tests/test_faults.py); CI runs 1, `make faults` 10")


@pytest.fixture
def fault_rounds(request: pytest.FixtureRequest) -> int:
    return max(1, int(request.config.getoption("--fault-rounds")))


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    st = LocalStack(StackSettings(state_dir=tmp_path_factory.mktemp("stack"), kafka_port=free_port(),
                                  redis_port=free_port()))
    st.up()
    try:
        yield st
    finally:
        st.down()


@pytest.fixture
def kafka(stack: LocalStack) -> KafkaSettings:
    """Settings pointing at the session broker, with topic names unique to this test."""
    tag = uuid.uuid4().hex[:10]
    return dataclasses.replace(
        KafkaSettings(bootstrap_servers=stack.bootstrap_servers),
        impressions_topic=f"impressions-{tag}",
        clicks_topic=f"clicks-{tag}",
        samples_topic=f"samples-{tag}",
        client_id=f"test-{tag}",
    )


@pytest.fixture
def group_id() -> str:
    return f"group-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def redis_client(stack: LocalStack) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(stack.redis_url)
    try:
        yield client
    finally:
        client.close()

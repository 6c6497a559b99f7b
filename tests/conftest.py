"""Session fixtures: a real Kafka-protocol broker and a real Redis, started by the project's own stack code
on free ports, with a unique topic set and consumer group per test."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING
from unittest import mock

import pytest
import redis

from stream.config import KafkaSettings
from streamrec.stack import LocalStack, StackSettings, free_port
from tests.bounded_teardown import Reaper

if TYPE_CHECKING:
    from tests.redis_cluster import ClusterNodes

pytest_plugins = ["tests.hang_watchdog"]

# Tansu answers a JoinGroup only once half the member's session timeout has passed (../shared/environment.md; its
# coordinator sleeps in 1 s steps until then): 3 s sessions (heartbeats every 0.5 s, stream.kafka.heartbeat_interval_s)
# join in 2 s where the product default of 6 s takes 3, about 10% of the suite's time over some hundred group joins.
# Set in the environment, so every CLI a test starts (their environments copy os.environ) reads it too; a test that
# needs the default builds KafkaSettings itself or drops STREAMREC_ variables from the child's environment.
SESSION_TIMEOUT_MS = int(os.environ.setdefault("STREAMREC_KAFKA_SESSION_TIMEOUT_MS", "3000"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fault-rounds", type=int, default=1,
                     help="rounds of each fault-injection test (tests/integration/test_faults*.py); CI runs 1, "
                     "`make faults` 10")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Two tests with one node id: pytest-xdist schedules by node id and runs one of them (schemathesis'
    parametrize once gave six operations one id, and five went untested under `make test`)."""
    seen: set[str] = set()
    twice = sorted({item.nodeid for item in items if item.nodeid in seen or seen.add(item.nodeid)})
    if twice:
        raise pytest.UsageError(f"tests with the same node id (give each its own id): {twice[:5]}")


@pytest.fixture
def fault_rounds(request: pytest.FixtureRequest) -> int:
    return max(1, int(request.config.getoption("--fault-rounds")))


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    st = LocalStack(StackSettings(state_dir=tmp_path_factory.mktemp("stack"), kafka_port=free_port(),
                                  redis_port=free_port()), bound=True)  # gone with a session killed before teardown
    try:  # up inside: a Redis that fails to start after the broker did (or a ^C during up) left the broker running
        st.up()
        yield st
    finally:
        st.down()


@pytest.fixture
def kafka(stack: LocalStack) -> KafkaSettings:
    """Settings pointing at the session broker, with topic names unique to this test."""
    tag = uuid.uuid4().hex[:10]
    return dataclasses.replace(
        KafkaSettings(bootstrap_servers=stack.bootstrap_servers, session_timeout_ms=SESSION_TIMEOUT_MS),
        impressions_topic=f"impressions-{tag}",
        clicks_topic=f"clicks-{tag}",
        samples_topic=f"samples-{tag}",
        client_id=f"test-{tag}",
    )


@pytest.fixture
def environ_restored() -> Iterator[None]:
    """``os.environ`` put back whole after the test: for a command run in process that sets variables for its children
    (``streamrec train`` sets MALLOC_*; monkeypatch.delenv of a variable not set records nothing to undo, so they
    stayed set for every later test, and its children, on that pytest worker)."""
    with mock.patch.dict(os.environ):
        yield


@pytest.fixture
def reaper() -> Iterator[Reaper]:
    """Child processes of the test (``reaper.add(Popen(...))``), killed and reaped, bounded, at its teardown."""
    r = Reaper()
    try:
        yield r
    finally:
        r.close()


@pytest.fixture
def group_id() -> str:
    return f"group-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def cluster_nodes(tmp_path: Path) -> Iterator[ClusterNodes]:
    """A real three-primary Redis Cluster of this test's own (tests/redis_cluster.py), its nodes to stop and start."""
    from tests.redis_cluster import redis_cluster as start

    with start(tmp_path) as nodes:
        yield nodes


@pytest.fixture
def redis_cluster(cluster_nodes: ClusterNodes) -> str:
    """The ``cluster_nodes`` cluster as one node's url (clients discover the others)."""
    return cluster_nodes.url


@pytest.fixture
def redis_client(stack: LocalStack) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(stack.redis_url)
    try:
        yield client
    finally:
        client.close()


# -- thread-leak guard ----------------------------------------------------------------------------
# Every test must stop the threads it starts (servers, consumers, workers, pools): a thread left running
# keeps sockets, files and brokers' group memberships open, and makes later tests flaky. The guard below
# snapshots ``threading.enumerate()`` before each test and, after every function-scoped fixture has been
# torn down (it is autouse, so it is set up first and torn down last), gives the new threads a short grace
# period to end and fails the test naming those still alive. Threads of session- and module-scoped fixtures
# are set up before the snapshot, so they are never blamed on a test; a second guard does the same around
# each module, so a module-scoped fixture that does not stop its threads fails the module's last test.
# (The session's stack runs its broker and Redis as subprocesses: no Python threads.)

THREAD_LEAK_GRACE_S = 2.0  # total time the new threads of one test get to finish after its teardown


# Threads that may outlive the test that started them: thread-name prefix -> why. Keep it minimal, justify every
# entry. It is empty: with the fixes made when the guard came in, the whole suite (-m "not slow") runs without an
# exception. librdkafka's threads (confluent-kafka producers, consumers, admin clients) are C threads and never
# appear in threading.enumerate(); torch's and pyarrow's pools are native too; the session's stack is subprocesses.
THREAD_LEAK_ALLOWED: dict[str, str] = {}


def _allowed_thread(t: threading.Thread) -> str | None:
    """Why ``t`` may outlive the test that started it (None: it may not)."""
    return next((why for prefix, why in THREAD_LEAK_ALLOWED.items() if t.name.startswith(prefix)), None)


def _describe_thread(t: threading.Thread) -> str:
    target = getattr(t, "_target", None)
    where = getattr(target, "__qualname__", None) or (repr(target) if target is not None else type(t).__qualname__)
    module = getattr(target, "__module__", None) or type(t).__module__
    return f"{t.name!r} (target {module}.{where}, {'daemon' if t.daemon else 'non-daemon'})"


def leaked_threads(before: set[threading.Thread], grace_s: float = THREAD_LEAK_GRACE_S) -> list[threading.Thread]:
    """Threads alive now that were not in ``before`` and are not allowed, after waiting up to ``grace_s`` in
    total for them to end."""
    deadline = time.monotonic() + grace_s
    new = [t for t in threading.enumerate() if t not in before and _allowed_thread(t) is None]
    for t in new:
        # a _DummyThread stands for a thread started outside Python (a C library calling back): it cannot be
        # joined and never ends, so it is reported at once
        if t is not threading.current_thread() and not isinstance(t, threading._DummyThread):
            t.join(max(0.0, deadline - time.monotonic()))
    return [t for t in new if t.is_alive()]


def thread_leak_report(leaked: list[threading.Thread]) -> str:
    return (f"{len(leaked)} thread(s) started during the test still run after its teardown: "
            + "; ".join(_describe_thread(t) for t in leaked)
            + ". Stop and join them (close()/stop()/shutdown()) in the test or the code it drives, or mark the "
            "test @pytest.mark.allow_thread_leak(\"why\") if the leak is in code this test cannot fix.")


@pytest.fixture(autouse=True)
def _no_thread_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.node.get_closest_marker("allow_thread_leak") is not None:  # the marker names the reason
        yield
        return
    before = set(threading.enumerate())
    yield
    leaked = leaked_threads(before)
    if leaked:
        pytest.fail(thread_leak_report(leaked), pytrace=False)


@pytest.fixture(scope="module", autouse=True)
def _no_thread_leaks_in_module(request: pytest.FixtureRequest) -> Iterator[None]:
    items = [i for i in request.session.items if i.getparent(pytest.Module) is request.node]
    if any(i.get_closest_marker("allow_thread_leak") is not None for i in items):
        yield  # a test of this module may leave a thread running, with its reason
        return
    before = set(threading.enumerate())
    yield
    leaked = leaked_threads(before)
    if leaked:
        pytest.fail("module-scoped fixtures: " + thread_leak_report(leaked), pytrace=False)


@pytest.fixture(autouse=True)
def _no_retention_losses_remembered() -> Iterator[None]:
    """stream.retention remembers the losses a process said (so a rewind does not say them again): each test starts
    with none, or one test's loss on a (reader, topic, partition) is taken for said in the next (the learner's tests
    share the samples topic)."""
    from stream import retention

    retention._SAID.clear()
    yield

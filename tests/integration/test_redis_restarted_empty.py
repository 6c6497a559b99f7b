"""A Redis that loses its keys under the system (a single node restarted empty, no persistence) is reported by the
joiner, which writes the day counts and histories everything else reads (``stream/keyspace.py``): once per loss, a
warning and ``streamrec_join_redis_emptied_total{tag}``. Against a redis-server of the test's own, started with
``--save "" --appendonly no`` and restarted."""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from prometheus_client import REGISTRY

from stream.counts import DailyCounts
from streamrec.stack import free_port, redis_binary
from tests.integration.test_counts_retry import joiner_counting
from tests.integration.test_faults import Service


@pytest.fixture
def empty_on_restart(tmp_path: Path) -> Iterator[Service]:
    """A single Redis node without persistence: stopped and started again, it comes back with no keys."""
    port = free_port()
    svc = Service([str(redis_binary()), "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
                   "--dir", str(tmp_path)], port)
    svc.start()
    try:
        yield svc
    finally:
        svc.stop()


def emptied(tag: str) -> float:
    return REGISTRY.get_sample_value("streamrec_join_redis_emptied_total", {"tag": tag}) or 0.0


def test_a_joiner_flush_after_its_redis_restarted_empty_warns_and_counts_the_loss_once_per_tag(
        empty_on_restart: Service, caplog: pytest.LogCaptureFixture) -> None:
    prefix = f"e{uuid.uuid4().hex[:8]}"
    with contextlib.closing(redis.Redis(port=empty_on_restart.port)) as client:
        counts = DailyCounts(client, prefix=prefix)
        p = joiner_counting(counts)
        before = {tag: emptied(tag) for tag in ("item", "user")}
        try:
            def flush() -> None:
                now_ms = int(time.time() * 1000)
                for kind in ("item", "user"):
                    p._counts_buffer[(kind, "impression")] = ([1, 2], [now_ms] * 2)
                p.flush_counts()

            flush()  # the first: the markers set, nothing lost
            flush()
            assert {tag: emptied(tag) for tag in before} == before
            empty_on_restart.stop()
            empty_on_restart.start()  # back with no keys: the counts and histories written so far are gone
            with caplog.at_level(logging.WARNING, logger="streamrec.join"):
                flush()
            flush()  # counted once: the markers are set again
        finally:
            p._counts_writer.shutdown(wait=True)
    assert {tag: emptied(tag) - before[tag] for tag in before} == {"item": 1.0, "user": 1.0}
    lost = [r.getMessage() for r in caplog.records if "lost the keys" in r.getMessage()]
    assert len(lost) == 2 and all(prefix in m and "click histories" in m for m in lost), lost

"""Serving in front of a Redis that is slow, trickling or frozen (not down), against real redis-servers of this
module's own: a layered service (history and cold rows from Redis) answers every request, with the documented
fallbacks, within the configured Redis timeouts (bounds derived from the settings, x3), counts the degradation, and
serves from Redis again by itself once Redis answers normally.

A trickling Redis (``tests/trickle_proxy.py``) sends its reply a byte at a time: no read ever waits a whole socket
timeout, so only a bound on the whole reply holds it to the setting.
"""

from __future__ import annotations

import logging
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import redis

from serving.embedding_store import RedisEmbeddingStore, StoreUnavailable
from serving.model import ScoringModel
from serving.row_codec import tag_key
from serving.service import ScoringService
from serving.settings import EmbeddingStore, RowDtype, ServeSettings
from serving.stored_versions import write_version
from stream.config import RedisSettings
from stream.features import hash_value
from stream.history import UserHistory
from stream.redis_client import connect
from tests.integration.test_layered_serving import (  # noqa: F401 - own_redis is a fixture
    ADMITTED_USERS,
    NEW_ITEMS,
    _sample,
    bucket_twin,
    own_redis,
    post,
    publish_version,
    request,
    score,
    scrape,
)
from tests.trickle_proxy import TrickleProxy

TIMEOUT_S = 0.2  # redis_timeout_s and embedding_store_timeout_s alike
MARGIN = 3  # a request may take the history read's and the row fetch's timeouts, x MARGIN (a loaded 2-core machine)
CONCURRENT = 8


def layered_settings(root: Path) -> ServeSettings:
    return ServeSettings(port=0, publish_root=root, embedding_store=EmbeddingStore.LAYERED, poll_s=60,
                         lookup_counts=False, redis_timeout_s=TIMEOUT_S, embedding_store_timeout_s=TIMEOUT_S,
                         history_retry_after_s=0.5, embedding_store_retry_after_s=0.5)


def timed_post(port: int, body: dict) -> tuple[int, dict, float]:
    t0 = time.monotonic()
    status, out = post(port, body)
    return status, out, time.monotonic() - t0


def test_a_trickling_redis_costs_a_layered_request_its_timeouts_not_the_trickle_and_serving_recovers(
        own_redis: tuple, tmp_path: Path) -> None:  # noqa: F811
    """Replies trickled a byte per 20 ms (a per-read timeout of 0.2 s never fires): concurrent requests of admitted
    users whose rows are cold each answer 200 within MARGIN x (redis_timeout_s + embedding_store_timeout_s), scored
    with no history and their bucket rows, counted; once the trickle ends, Redis serves rows and history again."""
    _, url = own_redis
    prefix = "slow"
    writer = redis.Redis.from_url(url)
    path = publish_version(tmp_path, writer, prefix)
    users = ADMITTED_USERS[:CONCURRENT]
    UserHistory(writer, prefix=prefix, max_len=200).append_many([hash_value(u) for u in users],
                                                                [hash_value(i) for i in NEW_ITEMS[:1] * len(users)],
                                                                list(range(len(users))))
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    writer.close()
    in_process = ScoringModel.load(path)
    bound = MARGIN * 2 * TIMEOUT_S
    with TrickleProxy(port) as proxy, ScoringService(layered_settings(tmp_path),
                                                     RedisSettings(url=proxy.url, prefix=prefix)) as svc:
        reqs = [request(u, NEW_ITEMS) for u in users]
        healthy = [post(svc.port, r) for r in reqs]
        assert [s for s, _ in healthy] == [200] * len(reqs)
        svc.holder.model().layered.cache.discard_many(np.arange(in_process.table.shape[0]))  # type: ignore[union-attr]
        proxy.trickling = True
        with ThreadPoolExecutor(CONCURRENT) as pool:
            answers = list(pool.map(lambda r: timed_post(svc.port, r), reqs))
        assert [s for s, _, _ in answers] == [200] * len(reqs)
        slowest = max(t for _, _, t in answers)
        assert slowest < bound, f"a request took {slowest:.2f}s with Redis trickling (bound {bound:.2f}s)"
        for user, (_, body, _) in zip(users, answers, strict=True):  # no history, the user's bucket row
            assert body["scores"] == pytest.approx(score(in_process, request(bucket_twin(user), NEW_ITEMS)).tolist(),
                                                   abs=1e-6)
        text = scrape(svc.port)
        assert _sample(text, "streamrec_serving_embedding_store_errors_total") >= 1
        assert _sample(text, "streamrec_serving_history_unavailable_total") >= 1

        proxy.trickling = False
        deadline = time.monotonic() + 30  # the retry-after windows pass; every reply is whole again
        while [post(svc.port, r)[1]["scores"] for r in reqs] != [b["scores"] for _, b in healthy]:
            assert time.monotonic() < deadline, "serving did not use Redis again after the trickle ended"
            time.sleep(0.1)


def test_a_frozen_redis_answers_every_concurrent_request_within_its_timeouts_logs_once_and_recovers_after_sigcont(
        own_redis: tuple, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    """Redis SIGSTOPped (accepting, never answering) across several retry-after windows while requests come
    concurrently: each answers 200 within MARGIN x the two timeouts, with no history and bucket rows, the outage is
    counted and logged once (not once per retry window), neither client's pool grows past the requests in flight, and
    after SIGCONT serving uses Redis again by itself (and says so once)."""
    proc, url = own_redis
    prefix = "frozen"
    writer = redis.Redis.from_url(url)
    path = publish_version(tmp_path, writer, prefix)
    users = ADMITTED_USERS[:CONCURRENT]
    writer.close()
    in_process = ScoringModel.load(path)
    settings = layered_settings(tmp_path)
    bound = MARGIN * 2 * TIMEOUT_S
    reqs = [request(u, NEW_ITEMS) for u in users]
    with ScoringService(settings, RedisSettings(url=url, prefix=prefix)) as svc:
        healthy = [post(svc.port, r) for r in reqs]
        assert [s for s, _ in healthy] == [200] * len(reqs)
        svc.holder.model().layered.cache.discard_many(np.arange(in_process.table.shape[0]))  # type: ignore[union-attr]
        caplog.clear()
        proc.send_signal(signal.SIGSTOP)
        try:
            answers = []
            frozen_until = time.monotonic() + 3 * settings.embedding_store_retry_after_s
            with ThreadPoolExecutor(CONCURRENT) as pool:
                while time.monotonic() < frozen_until:  # several retry-after windows, each tried again
                    answers += pool.map(lambda r: timed_post(svc.port, r), reqs)
        finally:
            proc.send_signal(signal.SIGCONT)
        assert {s for s, _, _ in answers} == {200}
        slowest = max(t for _, _, t in answers)
        assert slowest < bound, f"a request took {slowest:.2f}s with Redis frozen (bound {bound:.2f}s)"
        fallback = [score(in_process, request(bucket_twin(u), NEW_ITEMS)).tolist() for u in users]
        for i, (_, body, _) in enumerate(answers):  # in the order of reqs, round after round
            assert body["scores"] == pytest.approx(fallback[i % len(users)], abs=1e-6)
        text = scrape(svc.port)
        assert _sample(text, "streamrec_serving_embedding_store_errors_total") >= 2  # tried again each window
        assert _sample(text, "streamrec_serving_history_unavailable_total") >= len(answers)
        store_lines = [r for r in caplog.records
                       if "embedding store" in r.getMessage() and r.levelno >= logging.WARNING]
        assert len(store_lines) == 1, [r.getMessage() for r in store_lines]
        assert len([r for r in caplog.records if "history unavailable" in r.getMessage()]) == 1
        for client in (svc.redis, svc.embedding_store.client):  # type: ignore[union-attr]
            held = client.connection_pool  # type: ignore[union-attr]
            assert len(held._available_connections) + len(held._in_use_connections) <= CONCURRENT + 1

        caplog.clear()
        deadline = time.monotonic() + 30
        while [post(svc.port, r)[1]["scores"] for r in reqs] != [b["scores"] for _, b in healthy]:
            assert time.monotonic() < deadline, "serving did not use Redis again after SIGCONT"
            time.sleep(0.1)
        assert len([r for r in caplog.records if "answers again" in r.getMessage()]) == 1


def test_a_trickling_redis_fails_a_pipelined_row_fetch_at_its_timeout_not_one_timeout_per_mget(
        own_redis: tuple, tmp_path: Path) -> None:  # noqa: F811
    """Past ``fetch_chunk`` keys a fetch is pipelined MGETs, one round trip: replies trickled so that each MGET's
    reply alone comes within embedding_store_timeout_s, but all of them do not, fail the fetch (fallback rows) within
    MARGIN x the timeout, not after one timeout per MGET."""
    _, url = own_redis
    timeout_s, rows = 0.5, 40
    writer = redis.Redis.from_url(url)
    table = np.arange(rows * 5, dtype=np.float32).reshape(rows, 5)
    write_version(writer, "pipe", "v1", table, np.arange(rows), RowDtype.FLOAT32)
    writer.close()
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    with TrickleProxy(port, gap_s=0.002) as proxy:
        client = connect(RedisSettings(url=proxy.url), timeout_s=timeout_s, retries=0, whole_reply=True)
        store = RedisEmbeddingStore(client, "pipe", fetch_chunk=1, timeout_s=timeout_s)
        try:
            meta = store.open("v1", rows, 5)
            assert meta is not None
            key = tag_key("v1", RowDtype.FLOAT32)
            got, bad = store.fetch("v1", np.arange(rows), 5, RowDtype.FLOAT32, key)  # healthy: every row
            assert not bad.any() and np.array_equal(got, table)
            proxy.trickling = True  # ~40 bytes a reply: ~0.1 s each, 40 of them
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable):
                store.fetch("v1", np.arange(rows), 5, RowDtype.FLOAT32, key)
            took = time.monotonic() - t0
            assert took < MARGIN * timeout_s, f"the fetch took {took:.2f}s (timeout {timeout_s}s)"
        finally:
            client.close()

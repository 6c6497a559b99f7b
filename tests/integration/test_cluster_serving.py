"""Serving on a real Redis Cluster (``[redis] cluster = true``, tests/redis_cluster.py) whose nodes fail: requests
while nodes are down, and the update notifications through the cluster's pub/sub.

The cluster's nodes run with ``--save ""``: a node started again comes back owning its slots with an empty keyspace,
so after a restart the tests write the history and the layered rows again (as the joiner and a refresh would) before
they expect serving to read them.
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from serving.features import FeatureEncoder
from serving.model import ScoringModel
from serving.request import parse_request
from serving.service import ScoringService
from serving.settings import EmbeddingStore, ServeSettings
from stream.config import RedisSettings
from stream.features import hash_value
from stream.history import UserHistory
from stream.redis_client import connect
from tests.integration.test_layered_serving import (
    ADMITTED_USERS,
    NEW_ITEMS,
    ROWS_READ_S,
    bucket_twin,
    post,
    publish_version,
    request,
)
from tests.integration.test_serving import HISTORY_READ_S

HISTORY_ITEMS = [7, 9, 11]  # the test user's clicks (admitted items: the history field shares the item rows)


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}"


def scores_of(model: ScoringModel, req: dict[str, Any], history: list[int]) -> list[float]:
    values, offsets, dense = FeatureEncoder(model).encode(parse_request(req, 100), history)
    return model.score_request(torch.from_numpy(values), torch.from_numpy(offsets), torch.from_numpy(dense)).tolist()


def fill(client: Any, path: Path, prefix: str, rds: RedisSettings, user: str) -> None:
    """What the refresh and the joiner keep in Redis: the version's rows and ``user``'s clicks."""
    from serving.settings import RowDtype
    from serving.stored_versions import write_version

    model = ScoringModel.load(path)
    write_version(client, prefix, model.version, model.table, model.non_hot_rows(), RowDtype.FLOAT32)
    UserHistory(client, prefix=prefix, max_len=4 * rds.history_len).append_many(
        [hash_value(user)] * len(HISTORY_ITEMS), [hash_value(i) for i in HISTORY_ITEMS], [1, 2, 3])


# the failures a cluster that cannot serve must show in serving's metrics, as a single node that is down does
FAILURE_COUNTERS: tuple[tuple[str, dict[str, str]], ...] = (
    ("streamrec_serving_history_unavailable_total", {}), ("streamrec_serving_history_errors_total", {}),
    ("streamrec_serving_embedding_store_errors_total", {}),
    ("streamrec_serving_embedding_store_fallback_rows_total", {"kind": "bucket"}),
    ("streamrec_serving_lookup_count_flushes_total", {"outcome": "error"}))


def counters(svc: ScoringService) -> dict[str, float]:
    got = {}
    for name, labels in FAILURE_COUNTERS:
        got[name + str(labels or "")] = svc.metrics.registry.get_sample_value(name, labels) or 0.0
    return got


@pytest.mark.parametrize("down", ["every node", "the history key's primary"])
def test_a_layered_service_with_cluster_nodes_down_answers_200_without_history_on_bucket_rows_and_uses_both_once_back(
        cluster_nodes: Any, prefix: str, tmp_path: Path, down: str) -> None:
    rds = RedisSettings(url=cluster_nodes.url, prefix=prefix, cluster=True)
    user = ADMITTED_USERS[7]
    history = [hash_value(i) for i in HISTORY_ITEMS]
    writer = connect(rds, timeout_s=2.0)
    try:
        path = publish_version(tmp_path, writer, prefix)
        fill(writer, path, prefix, rds, user)
        key = UserHistory(writer, prefix=prefix).key(hash_value(user))
    finally:
        writer.close()
    in_process = ScoringModel.load(path)
    req = request(user, NEW_ITEMS)
    full = scores_of(in_process, req, history)  # Redis serving: the user's own row and history
    degraded = scores_of(in_process, request(bucket_twin(user), NEW_ITEMS), [])  # its bucket row, no history
    assert not np.allclose(full, degraded, atol=1e-4)
    settings = ServeSettings(port=0, publish_root=tmp_path, poll_s=3600, embedding_store=EmbeddingStore.LAYERED,
                             embedding_store_retry_after_s=0.2, history_retry_after_s=0.2,
                             # the answers with history and rows from Redis need the reads to succeed: the default
                             # 50 ms row fetch fell back whenever a node took longer on a loaded machine (reproduced by
                             # SIGSTOPping the row's node for 0.2 s); a node down is refused at once whatever these are
                             redis_timeout_s=HISTORY_READ_S, embedding_store_timeout_s=ROWS_READ_S,
                             lookup_counts_flush_s=0.2)
    with ScoringService(settings, rds) as svc:
        status, body = post(svc.port, req)
        assert status == 200 and body["scores"] == pytest.approx(full, abs=1e-6)
        before = counters(svc)
        layered = svc.holder.model().layered  # type: ignore[union-attr]
        assert layered is not None

        if down == "every node":
            cluster_nodes.stop_all()
        else:
            cluster_nodes.stop(cluster_nodes.index_of(key))
        answers = []
        for phase in ("refused", "marked failed"):  # before and after the other nodes mark it failed (CLUSTERDOWN)
            if phase == "marked failed":
                cluster_nodes.wait_down()
            t_end = time.monotonic() + 3.0  # several breaker periods, past redis-py giving up on the topology
            while time.monotonic() < t_end:
                layered.cache.discard_many(np.arange(layered.num_rows))  # the user's row must come from Redis
                status, body = post(svc.port, req)
                answers.append((status, body))
                time.sleep(0.02)
        assert all(status == 200 for status, _ in answers), answers[:3]
        assert all(all(math.isfinite(s) for s in body["scores"]) for _, body in answers)
        # once the breaker has seen the failure, every answer is the degraded one
        assert answers[-1][1]["scores"] == pytest.approx(degraded, abs=1e-6)
        during = counters(svc)
        assert [name for name in before if during[name] <= before[name]] == []  # every kind of failure counted

        cluster_nodes.start_all()
        writer = connect(rds, timeout_s=2.0)
        try:
            fill(writer, path, prefix, rds, user)  # the restarted nodes came back empty
        finally:
            writer.close()
        deadline, got = time.monotonic() + 30, None
        while time.monotonic() < deadline:
            layered.cache.discard_many(np.arange(layered.num_rows))
            status, body = post(svc.port, req)
            assert status == 200
            got = body["scores"]
            if got == pytest.approx(full, abs=1e-6):
                break
            time.sleep(0.05)
        assert got == pytest.approx(full, abs=1e-6), "history and rows from Redis never came back"
        settled = counters(svc)
        for _ in range(10):
            layered.cache.discard_many(np.arange(layered.num_rows))
            status, body = post(svc.port, req)
            assert status == 200 and body["scores"] == pytest.approx(full, abs=1e-6)
        after = counters(svc)
        for name in ("streamrec_serving_history_unavailable_total", "streamrec_serving_embedding_store_errors_total"):
            assert after[name] == settled[name], name  # no more degraded reads

        def flushed() -> float:
            return svc.metrics.registry.get_sample_value("streamrec_serving_lookup_counts_flushed_total") or 0.0

        flushed_before, deadline = flushed(), time.monotonic() + 30
        while flushed() <= flushed_before:  # the lookups of the requests since the nodes came back
            assert time.monotonic() < deadline, "the lookup counts are not flushed to the cluster again"
            time.sleep(0.05)


# -- notifications: the refresh's and the learner's PUBLISH, serving's subscriber (serving/swap.py) --------------
def score_once(port: int) -> dict[str, Any]:
    status, body = post(port, NOTIFIED_REQUEST)
    assert status == 200, body
    return body


NOTIFIED_REQUEST = {"user_id": "bob", "items": [1, 2, 3], "context": {"device": 1, "genres": [4, 5], "year": 1995}}


def until_served(port: int, send: Any, served: Any, timeout_s: float) -> None:
    """``send()`` (a notification) every half second until a request's answer is ``served``; fails after
    ``timeout_s``. Serving polls every hour here: only a notification makes it look."""
    deadline, body = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        send()
        t_next = time.monotonic() + 0.5
        while time.monotonic() < t_next:
            body = score_once(port)
            if served(body):
                return
            time.sleep(0.02)
    raise AssertionError(f"no notification reached serving in {timeout_s} s (last answer {body})")


@pytest.mark.parametrize("outage", ["its node restarted", "its node down until the cluster failed", "every node down"])
def test_a_service_on_a_cluster_hears_the_refreshs_and_the_learners_notifications_also_after_an_outage(
        cluster_nodes: Any, prefix: str, tmp_path: Path, outage: str) -> None:
    from cache_refresh import job
    from cache_refresh.settings import RefreshSettings
    from learner.delta_writer import DeltaWriter, redis_notifier
    from serving.swap import artifact_channel
    from tests.integration.test_serving import CFG, TinyLearner
    from tests.integration.test_serving import publish_version as publish_learner_version

    rds = RedisSettings(url=cluster_nodes.url, prefix=prefix, cluster=True)
    root, deltas = tmp_path / "serving", tmp_path / "deltas"
    learner = TinyLearner(seed=3)
    publish_learner_version(learner, root, "v001")
    notify_delta = redis_notifier(rds, rds.deltas_channel)  # what DeltaWriter.from_settings gives the learner
    writer = DeltaWriter(deltas, CFG.num_rows, every_s=3600, notify=notify_delta)
    rs = RefreshSettings(publish_root=root, redis_attempts=1)
    settings = ServeSettings(port=0, publish_root=root, deltas_dir=deltas, poll_s=3600, lookup_counts=False)
    subscribed_on = cluster_nodes.index_of(artifact_channel(prefix))  # redis-py subscribes on the first channel's node
    with ScoringService(settings, rds) as svc:
        versions = iter(f"v{k:03d}" for k in range(2, 100))

        def a_round(timeout_s: float) -> None:
            version = next(versions)
            path = publish_learner_version(learner, root, version)
            until_served(svc.port, lambda: job.notify(rs, rds, version, path),
                         lambda body: body["model_version"] == version, timeout_s)
            # PUBLISH goes to the channel's node, where serving subscribes: the refresh's summary counts serving
            assert job.notify(rs, rds, version, path) == 1
            for tb in learner.train(2, users=["bob"] * 16, label=1):
                writer.mark(tb.values)
            writer.write(learner.model, learner.trainer.samples)
            seq = writer.seq
            until_served(svc.port, lambda: notify_delta(seq), lambda body: body["delta_seq"] == seq, timeout_s)

        a_round(15)
        if outage == "its node restarted":
            cluster_nodes.restart(subscribed_on)
        elif outage == "its node down until the cluster failed":
            cluster_nodes.stop(subscribed_on)
            cluster_nodes.wait_down()
            time.sleep(3.0)  # the subscriber fails to subscribe again meanwhile
            cluster_nodes.start(subscribed_on)
        else:
            cluster_nodes.stop_all()
            time.sleep(3.0)
            cluster_nodes.start_all()
        a_round(30)
        assert [t.name for t in threading.enumerate() if t.name == "serve-pubsub"] == ["serve-pubsub"]

"""The layered deployment (serving/embedding_store.py) against real Redis: the session stack's, and one of this
module's own that a test stops mid-serving.

Tolerances: float32 rows in Redis give layered scores EQUAL to in-process scores (bit for bit, same scorer, same
rows); float16 rows change a probability by at most ``F16_TOL`` (rows of N(0, 0.3) rounded to float16: relative
error <= 2^-11 per value; measured here ~1e-4).
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import torch

from cache_refresh.publish import publish
from learner.artifact import build_artifact
from learner.features import FeatureConfig, FieldSpec
from learner.model import DeepFM
from learner.row_mapper import RowMapper
from monitor.rule_engine import RuleEngine
from monitor.rules import load_rules
from monitor.scrape import Snapshot
from serving.embedding_store import RedisEmbeddingStore
from serving.features import FeatureEncoder
from serving.metrics import ServingMetrics
from serving.model import ScoringModel
from serving.request import parse_request
from serving.row_codec import decode_answer, encode_rows, overlay_keys, row_keys, tag_key
from serving.service import ScoringService
from serving.settings import EmbeddingStore, RowDtype, ServeSettings
from serving.stored_versions import write_version
from stream.config import RedisSettings
from stream.errors import BindError
from stream.features import hash_value
from stream.redis_client import wait_until_up
from streamrec.stack import LocalStack, free_port, redis_binary

F16_TOL = 2e-3
CFG = FeatureConfig((FieldSpec("user_id", "single", 8, capacity=40), FieldSpec("item_id", "single", 10, capacity=60),
                     FieldSpec("history", "sequence", 1, shares="item_id"), FieldSpec("ctx.device", "single", 6)),
                    dense=("price",), embedding_dim=4)
ADMITTED_USERS = [f"u{k}" for k in range(30)]
ADMITTED_ITEMS = list(range(50))
NEW_ITEMS = [1000, 1001, 1002]  # never admitted: their hash-bucket rows (hot, and local in the layered mode)
# The layered store answers a fetch slower than embedding_store_timeout_s (50 ms by default) with fallback rows. A test
# that compares answers with the version's own rows gives the fetch this long: on a loaded machine (CI runs four
# workers on two cores) a fetch Redis answers at once can take past 50 ms to be scheduled (as HISTORY_READ_S in
# tests/integration/test_serving.py for history reads). A refused connection still fails at once.
ROWS_READ_S = 5.0


def checkpoint(seed: int = 0) -> dict[str, Any]:
    """A DeepFM with a table of N(0, 0.3) (scores far from 0.5, so rows matter) and id maps that admitted 30 users
    and 50 items (own rows), the other ids on their hash buckets."""
    model = DeepFM(CFG, mlp=(8,), seed=seed, autocast_dtype=None)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    state["sparse.bag.weight"] = torch.randn(state["sparse.bag.weight"].shape, generator=g) * 0.3
    mapper = RowMapper(CFG)
    mapper.maps["user_id"].lookup(np.array([hash_value(u) for u in ADMITTED_USERS]), 0.0, train=True)
    mapper.maps["item_id"].lookup(np.array([hash_value(i) for i in ADMITTED_ITEMS]), 0.0, train=True)
    return {"meta": {"feature_config": CFG.to_dict(), "model": {"mlp": "8", "dropout": 0.0}, "samples_trained": 10,
                     "offsets": {}},
            "model": state, "id_maps": mapper.state_dict(), "path": "synthetic"}


def own_rows(field: str, n: int) -> np.ndarray:
    first = CFG.blocks[[f.name for f in CFG.fields].index(field)][0]
    nb = next(f.num_buckets for f in CFG.fields if f.name == field)
    return first + nb + np.arange(n)


# hot: every bucket row and the device field, plus 10 admitted items; the admitted users' own rows are all cold
HOT = np.concatenate([np.arange(0, 8), np.arange(48, 58), own_rows("item_id", 10), np.arange(CFG.num_rows - 6,
                                                                                             CFG.num_rows)])


def publish_version(root: Path, client: Any, prefix: str, dtype: RowDtype = RowDtype.FLOAT32,
                    version: str = "v1") -> Path:
    path = publish(root, build_artifact(checkpoint(), root, HOT, version=version), keep=10)
    model = ScoringModel.load(path)
    write_version(client, prefix, model.version, model.table, model.non_hot_rows(), dtype)
    return path


def stored_row(value: Any, row: int, dtype: RowDtype = RowDtype.FLOAT32, version: str = "v1") -> np.ndarray:
    """A row's value as the refresh or serving wrote it (tagged: serving/row_codec.py), its tag checked."""
    assert value is not None
    out, missing, malformed = decode_answer([value], CFG.embedding_dim + 1, dtype, np.array([row]),
                                            tag_key(version, dtype))
    assert not missing.any() and not malformed.any()
    return out[0]


def request(user: Any, items: list[Any]) -> dict[str, Any]:
    return {"user_id": user, "items": items, "context": {"device": "ios"}, "dense": {"price": 1.5}}


def score(model: ScoringModel, req: dict[str, Any]) -> torch.Tensor:
    values, offsets, dense = FeatureEncoder(model).encode(parse_request(req, 100), [])
    return model.score_request(torch.from_numpy(values), torch.from_numpy(offsets), torch.from_numpy(dense))


def some_requests(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    users = ADMITTED_USERS + [f"new{k}" for k in range(10)]
    return [request(users[int(rng.integers(len(users)))], rng.integers(0, 80, 20).tolist()) for _ in range(n)]


def mget_calls(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_mget", {}).get("calls", 0))


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}"


def store_of(stack: LocalStack, prefix: str, cache_rows: int = 1000, metrics: Any = None) -> RedisEmbeddingStore:
    return RedisEmbeddingStore(redis.Redis.from_url(stack.redis_url, socket_timeout=1.0), prefix,
                               cache_rows=cache_rows, metrics=metrics, write_deltas=True)


def assert_load_refused(stack: LocalStack, prefix: str, path: Path, match: str) -> None:
    """Loading ``path`` in layered mode raises an ArtifactError matching ``match``."""
    from learner.artifact_versions import ArtifactError
    store = store_of(stack, prefix)
    try:
        with pytest.raises(ArtifactError, match=match):
            ScoringModel.load(path, store=store)
    finally:
        store.client.close()


# -- scores ------------------------------------------------------------------------------------------------------
def test_layered_scores_equal_in_process_scores_for_float32_rows(stack: LocalStack, redis_client: redis.Redis,
                                                                 prefix: str, tmp_path: Path) -> None:
    path = publish_version(tmp_path, redis_client, prefix)
    in_process = ScoringModel.load(path)
    store = store_of(stack, prefix)
    layered = ScoringModel.load(path, store=store)
    try:
        assert layered.layered is not None and in_process.layered is None
        for req in some_requests(30):
            a, b = score(in_process, req), score(layered, req)
            assert torch.equal(a, b), (req, a, b)
        assert layered.cold_lookups > 0 and len(layered.layered.cache) > 0  # rows did come from Redis
    finally:
        store.client.close()


def test_layered_scores_equal_in_process_scores_for_a_static_config_too(stack: LocalStack, redis_client: redis.Redis,
                                                                        prefix: str, tmp_path: Path) -> None:
    static = FeatureConfig(tuple(dataclasses.replace(f, capacity=0) for f in CFG.fields), dense=CFG.dense,
                           embedding_dim=CFG.embedding_dim)
    ck = checkpoint()
    model = DeepFM(static, mlp=(8,), seed=1, autocast_dtype=None)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["sparse.bag.weight"] = torch.randn(state["sparse.bag.weight"].shape) * 0.3
    ck = {**ck, "meta": {**ck["meta"], "feature_config": static.to_dict()}, "model": state, "id_maps": None}
    path = publish(tmp_path, build_artifact(ck, tmp_path, np.arange(0, static.num_rows, 4), version="s1"), keep=10)
    in_process = ScoringModel.load(path)
    write_version(redis_client, prefix, "s1", in_process.table, in_process.non_hot_rows(), RowDtype.FLOAT32)
    store = store_of(stack, prefix)
    try:
        layered = ScoringModel.load(path, store=store)
        for req in some_requests(10):
            assert torch.equal(score(in_process, req), score(layered, req))
        assert layered.cold_lookups > 0
    finally:
        store.client.close()


def test_float16_rows_move_scores_by_at_most_the_stated_tolerance(stack: LocalStack, redis_client: redis.Redis,
                                                                   prefix: str, tmp_path: Path) -> None:
    path = publish_version(tmp_path, redis_client, prefix, RowDtype.FLOAT16)
    in_process = ScoringModel.load(path)
    store = store_of(stack, prefix)
    layered = ScoringModel.load(path, store=store)
    try:
        diffs = [float((score(in_process, r) - score(layered, r)).abs().max()) for r in some_requests(30)]
        assert max(diffs) <= F16_TOL
        assert max(diffs) > 0  # the rows really were float16
    finally:
        store.client.close()


def test_a_version_missing_from_the_store_is_refused_at_load(stack: LocalStack, redis_client: redis.Redis,
                                                             prefix: str, tmp_path: Path) -> None:
    path = publish(tmp_path, build_artifact(checkpoint(), tmp_path, HOT, version="v9"), keep=10)
    assert_load_refused(stack, prefix, path, "embedding store has no rows of version v9")


# -- round trips and the LRU ---------------------------------------------------------------------------------
def test_one_redis_round_trip_per_request_and_the_lru_stays_bounded(stack: LocalStack, redis_client: redis.Redis,
                                                                    prefix: str, tmp_path: Path) -> None:
    path = publish_version(tmp_path, redis_client, prefix)
    metrics = ServingMetrics(lambda: None)
    store = store_of(stack, prefix, cache_rows=12, metrics=metrics)
    layered = ScoringModel.load(path, store=store)
    reqs = [request(u, list(range(50))) for u in ADMITTED_USERS[:20]]  # 50 items, 40 of them cold own rows
    try:
        before = mget_calls(redis_client)
        for req in reqs:
            score(layered, req)
            assert len(layered.layered.cache) <= 12  # type: ignore[union-attr]
        assert mget_calls(redis_client) - before == len(reqs)  # exactly one MGET per request with misses
        # a request whose only non-hot row is cached costs no round trip
        small = request(ADMITTED_USERS[25], NEW_ITEMS)  # item bucket rows are local; the user's own row is not
        before = mget_calls(redis_client)
        score(layered, small)
        assert mget_calls(redis_client) == before + 1
        score(layered, small)
        assert mget_calls(redis_client) == before + 1  # the user's row came from the LRU
        text = metrics.render().decode()
        assert 'streamrec_serving_embedding_cache_rows_total{result="hit"}' in text
        assert _sample(text, "streamrec_serving_embedding_store_fetch_seconds_count") == len(reqs) + 1
        assert _sample(text, 'streamrec_serving_embedding_cache_rows_total{result="miss"}') >= 40
    finally:
        store.client.close()


def _sample(text: str, name: str) -> float:
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))


# -- deltas ----------------------------------------------------------------------------------------------------
def test_a_delta_changes_layered_scores_exactly_as_in_process(stack: LocalStack, redis_client: redis.Redis,
                                                              prefix: str, tmp_path: Path) -> None:
    path = publish_version(tmp_path, redis_client, prefix)
    in_process = ScoringModel.load(path)
    store = store_of(stack, prefix)
    layered = ScoringModel.load(path, store=store)
    try:
        req = request(ADMITTED_USERS[3], ADMITTED_ITEMS[:40])
        assert torch.equal(score(in_process, req), score(layered, req))  # the user's and items' rows now cached
        user_row = int(layered.map_rows(0, np.array([hash_value(ADMITTED_USERS[3])]))[0])
        assert user_row not in set(HOT.tolist()) and user_row in layered.layered.cache  # type: ignore
        rows = torch.tensor([user_row, int(own_rows("item_id", 30)[-1]), 2])  # cold cached, cold, hot
        vectors = torch.randn(3, CFG.embedding_dim + 1, generator=torch.Generator().manual_seed(5))
        dense = {k: v + 0.1 for k, v in checkpoint()["model"].items() if not k.startswith("sparse.")}
        before = score(layered, req)
        for m in (in_process, layered):
            m.apply_delta(rows, vectors, dense, seq=1)
        after_in, after_layered = score(in_process, req), score(layered, req)
        assert torch.equal(after_in, after_layered)
        assert not torch.equal(before, after_layered)
        assert user_row not in layered.layered.cache  # type: ignore[union-attr]
        # the serving process wrote the delta's non-hot rows to the delta overlay of the version it applied them to,
        # and left the version's rows as the artifact's
        got = redis_client.mget(overlay_keys(prefix, "v1", np.array([user_row, 2])))
        assert got[1] is None  # the hot row is not the store's
        assert np.array_equal(stored_row(got[0], user_row), vectors[0].numpy())
        kept = redis_client.get(row_keys(prefix, "v1", np.array([user_row]))[0])
        assert kept is not None
        assert np.array_equal(stored_row(kept, user_row),
                              in_process.table[user_row])
    finally:
        store.client.close()


# -- Redis down ------------------------------------------------------------------------------------------------
@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    port = free_port()
    proc = subprocess.Popen([str(redis_binary()), "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url, socket_timeout=0.5)
    assert wait_until_up(client, 10), "redis-server did not start"
    client.close()
    try:
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def post(port: int, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", "/v1/score", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def scrape(port: int) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def bucket_twin(user: str) -> str:
    """A user that is not admitted and hashes to the same user bucket as ``user``."""
    want = hash_value(user) % 8
    return next(f"twin{k}" for k in range(10_000) if hash_value(f"twin{k}") % 8 == want)


def test_redis_stopped_mid_serving_answers_200_from_hot_rows_and_bucket_rows_and_the_alert_fires(
        own_redis: tuple[subprocess.Popen[bytes], str], prefix: str, tmp_path: Path) -> None:
    proc, url = own_redis
    writer = redis.Redis.from_url(url)
    path = publish_version(tmp_path, writer, prefix)
    writer.close()
    in_process = ScoringModel.load(path)
    settings = ServeSettings(port=0, publish_root=tmp_path, embedding_store=EmbeddingStore.LAYERED,
                             embedding_store_retry_after_s=0.2, lookup_counts=False, poll_s=60,
                             embedding_store_timeout_s=ROWS_READ_S)
    rule = next(r for r in load_rules(None).rules if r.name == "embedding_store_errors")
    engine = RuleEngine([dataclasses.replace(rule, for_s=0)], history_s=600)
    user, twin = ADMITTED_USERS[7], bucket_twin(ADMITTED_USERS[7])
    hot_only = request("nobody", NEW_ITEMS)  # a user bucket row, item bucket rows, hot device rows: all local
    cold_user = request(user, NEW_ITEMS)  # the same, but the user's own row comes from Redis
    with ScoringService(settings, RedisSettings(url=url, prefix=prefix)) as svc:
        status, hot_before = post(svc.port, hot_only)
        assert status == 200
        assert hot_before["scores"] == pytest.approx(score(in_process, hot_only).tolist(), abs=1e-7)
        status, cold_before = post(svc.port, cold_user)
        assert status == 200 and cold_before["scores"] == pytest.approx(score(in_process, cold_user).tolist(),
                                                                        abs=1e-7)
        t0 = time.time()
        assert not engine.evaluate(Snapshot.from_texts({"serving": scrape(svc.port)}), t0)
        svc.holder.model().layered.cache.discard_many(np.arange(CFG.num_rows))  # type: ignore[union-attr]

        proc.kill()
        proc.wait()
        statuses, answers = [], []
        for req in (hot_only, cold_user, *some_requests(10)):
            status, body = post(svc.port, req)
            statuses.append(status)
            answers.append(body)
        assert statuses == [200] * len(statuses)
        assert answers[0]["scores"] == hot_before["scores"]  # hot rows unchanged
        # the admitted user's own row fell back to its hash bucket: the score of a user that lives in that bucket
        assert answers[1]["scores"] == pytest.approx(score(in_process, request(twin, NEW_ITEMS)).tolist(), abs=1e-7)
        assert answers[1]["scores"] != pytest.approx(cold_before["scores"], abs=1e-6)
        text = scrape(svc.port)
        assert _sample(text, "streamrec_serving_embedding_store_errors_total") >= 1
        assert _sample(text, 'streamrec_serving_embedding_store_fallback_rows_total{kind="bucket"}') >= 1
        alerts = engine.evaluate(Snapshot.from_texts({"serving": text}), t0 + 30)
        assert [a.rule for a in alerts] == ["embedding_store_errors"]


# -- the refresh writes (and prunes) a version's rows ----------------------------------------------------------
def test_a_layered_refresh_writes_rows_before_publishing_and_deletes_a_pruned_versions_rows_once_it_is_not_live(
        stack: LocalStack, kafka: Any, redis_client: redis.Redis, prefix: str, tmp_path: Path) -> None:
    from cache_refresh import job
    from cache_refresh.settings import RefreshSettings
    from learner import checkpoint as ckpt_io
    from learner.artifact_versions import read_current
    from serving.stored_versions import read_meta, version_names

    ck = checkpoint()
    meta = {**ck["meta"], "steps": 1, "metrics": {}, "topic": "samples"}
    state = {"model": ck["model"], "id_maps": ck["id_maps"], "recent_ids": []}
    ckpt_dir = tmp_path / "ckpt"
    ckpt_io.save(ckpt_dir, state, meta)
    rs = RefreshSettings(checkpoint_dir=ckpt_dir, publish_root=tmp_path / "serving", holdout_messages=0,
                         small_field_rows=100, keep_versions=1, redis_attempts=1, alerts_topic="",
                         embedding_store=EmbeddingStore.LAYERED, embedding_store_dtype=RowDtype.FLOAT16)
    rds = RedisSettings(url=stack.redis_url, prefix=prefix)
    write_version(redis_client, prefix, "other", np.zeros((3, 5), np.float32), np.arange(3), RowDtype.FLOAT32,
                  owner="/another/publish/root")
    first = job.run_once(rs, kafka, rds)
    m1 = read_meta(redis_client, prefix, first["version"])
    model = ScoringModel.load(Path(first["path"]))
    assert m1 is not None and m1["dtype"] == "float16" and m1["stored"] == len(model.non_hot_rows()) > 0
    store = store_of(stack, prefix)
    try:
        layered = ScoringModel.load(Path(first["path"]), store=store)
        for req in some_requests(5):
            assert float((score(model, req) - score(layered, req)).abs().max()) <= F16_TOL
    finally:
        store.client.close()
    time.sleep(0.01)
    ckpt_io.save(ckpt_dir, state, {**meta, "samples_trained": 20})
    second = job.run_once(rs, kafka, rds)  # keep_versions=1: the first version's files are pruned ...
    assert read_current(rs.publish_root).name == second["version"] != first["version"]
    # ... but its rows stay while rankers may still serve it (it was live until this publish)
    assert version_names(redis_client, prefix) == {first["version"], second["version"], "other"}
    redis_client.set(overlay_keys(prefix, first["version"], np.array([1]))[0], b"a delta row serving wrote")
    time.sleep(0.01)
    ckpt_io.save(ckpt_dir, state, {**meta, "samples_trained": 30})
    third = job.run_once(rs, kafka, rds)  # now the first version is neither kept nor the one live before
    assert read_current(rs.publish_root).name == third["version"]
    assert version_names(redis_client, prefix) == {second["version"], third["version"], "other"}  # another
    assert not list(redis_client.scan_iter(match=f"{prefix}:emb:{first['version']}:*"))  # root's version stays
    # (and the first version's delta overlay went with its rows)


# -- Redis Cluster (the redis_cluster fixture: tests/redis_cluster.py) -------------------------------------------
def test_layered_scores_equal_in_process_scores_on_a_redis_cluster(redis_cluster: str, prefix: str,
                                                                   tmp_path: Path) -> None:
    from serving.stored_versions import delete_version, version_names
    from stream.redis_client import connect

    rds = RedisSettings(url=redis_cluster, prefix=prefix, cluster=True)
    writer = connect(rds, timeout_s=2.0)
    # the reader's timeout is no bound under test: a read slower than 0.5 s on a loaded machine fell back to bucket
    # rows and the scores differed (reproduced by SIGSTOPping the nodes for 0.7 s before the requests)
    reader = connect(rds, timeout_s=10.0)
    try:
        path = publish_version(tmp_path, writer, prefix)
        in_process = ScoringModel.load(path)
        store = RedisEmbeddingStore(reader, prefix, cache_rows=0)
        layered = ScoringModel.load(path, store=store)
        keys_per_node = [n.redis_connection.dbsize() for n in writer.get_primaries()]
        assert len(keys_per_node) == 3 and min(keys_per_node) > 0  # the rows spread over every node
        for req in some_requests(10):
            assert torch.equal(score(in_process, req), score(layered, req))
        assert store.last_error is None and layered.cold_lookups > 0
        assert version_names(writer, prefix) == {"v1"}
        delete_version(writer, prefix, "v1")
        assert sum(n.redis_connection.dbsize() for n in writer.get_primaries()) == 0
    finally:
        writer.close()
        reader.close()


def test_a_learner_delta_reaches_a_layered_service_and_redis_through_the_delta_directory(
        stack: LocalStack, redis_client: redis.Redis, prefix: str, tmp_path: Path) -> None:
    from learner.delta_writer import DeltaWriter

    path = publish_version(tmp_path / "serving", redis_client, prefix)
    deltas = tmp_path / "deltas"
    writer = DeltaWriter(deltas, CFG.num_rows, every_s=3600)
    settings = ServeSettings(port=0, publish_root=tmp_path / "serving", deltas_dir=deltas, poll_s=3600,
                             embedding_store=EmbeddingStore.LAYERED, lookup_counts=False,
                             embedding_store_write_deltas=True, embedding_store_timeout_s=ROWS_READ_S)
    req = request(ADMITTED_USERS[4], NEW_ITEMS)
    in_process = ScoringModel.load(path)
    with ScoringService(settings, RedisSettings(url=stack.redis_url, prefix=prefix)) as svc:
        status, before = post(svc.port, req)  # the user's own row is fetched from Redis and cached
        assert status == 200 and before["scores"] == pytest.approx(score(in_process, req).tolist(), abs=1e-7)
        user_row = int(in_process.map_rows(0, np.array([hash_value(ADMITTED_USERS[4])]))[0])
        learner = DeepFM(CFG, mlp=(8,), seed=0, autocast_dtype=None)
        learner.load_state_dict(checkpoint()["model"])
        with torch.no_grad():
            learner.sparse.bag.weight[user_row] += 0.5  # type: ignore[index]
        writer.mark(torch.tensor([user_row]))
        writer.write(learner, samples_trained=20)
        svc.updater.check_now()
        status, after = post(svc.port, req)
        new_vector = learner.sparse.bag.weight[user_row].detach()  # type: ignore[index]
        in_process.apply_delta(torch.tensor([user_row]), new_vector[None], None, seq=1)
        assert status == 200 and after["delta_seq"] == 1
        assert after["scores"] == pytest.approx(score(in_process, req).tolist(), abs=1e-7)
        assert after["scores"] != pytest.approx(before["scores"], abs=1e-4)
        stored = redis_client.get(overlay_keys(prefix, "v1", np.array([user_row]))[0])
        assert stored is not None
        assert np.array_equal(stored_row(stored, user_row), new_vector.numpy())


# -- failure paths: Redis down at load, garbage in Redis, a failed write, a failed start ------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def refusing_client() -> redis.Redis:
    """A client whose every command is refused at once (a port nobody listens on)."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis(host="127.0.0.1", port=free_port(), socket_timeout=0.2, socket_connect_timeout=0.2,
                       retry=Retry(NoBackoff(), 0))  # refused at once (redis-py retries with backoff by default)


def store_down_at_load(stack: LocalStack, prefix: str, clock: Clock,
                       metrics: Any = None) -> tuple[RedisEmbeddingStore, redis.Redis]:
    """A store whose client refuses (:func:`refusing_client`) and the real client to put in its place later."""
    store = RedisEmbeddingStore(refusing_client(), prefix, cache_rows=1000, retry_after_s=1.0, metrics=metrics,
                                clock=clock, write_deltas=True)
    return store, redis.Redis.from_url(stack.redis_url, socket_timeout=1.0)


def test_a_delta_applied_before_the_version_meta_was_read_writes_rows_in_the_versions_dtype(
        stack: LocalStack, redis_client: redis.Redis, prefix: str, tmp_path: Path) -> None:
    # Redis down when the float16 version loads: its dtype is not known yet. A delta that arrives once Redis is back,
    # before any request read the meta, must not write float32 rows into the float16 version (rows of the wrong
    # length, which every later MGET touching them would reject as a failed round trip).
    path = publish_version(tmp_path, redis_client, prefix, RowDtype.FLOAT16)
    clock = Clock()
    store, real = store_down_at_load(stack, prefix, clock)
    try:
        layered = ScoringModel.load(path, store=store)
        store.client.close()
        store.client = real
        clock.now = 5.0  # past the retry-after window: Redis is tried again
        user_row = int(layered.map_rows(0, np.array([hash_value(ADMITTED_USERS[6])]))[0])
        assert user_row not in set(HOT.tolist())
        vector = torch.full((1, CFG.embedding_dim + 1), 0.25)
        layered.apply_delta(torch.tensor([user_row]), vector, None, seq=1)
        stored = redis_client.get(overlay_keys(prefix, "v1", np.array([user_row]))[0])
        assert stored is not None and len(stored) == (CFG.embedding_dim + 1) * 2 + 4  # float16 + tag, as the version
        assert np.array_equal(stored_row(stored, user_row, RowDtype.FLOAT16), vector[0].numpy())
        errors = store.last_error
        vec, failed = layered.layered.gather(np.array([user_row]))  # type: ignore[union-attr]
        assert not failed.any() and store.last_error == errors
    finally:
        store.client.close()


@pytest.mark.parametrize(("garbage", "said"), [
    (b'"not a dict"', "is not a meta a refresh writes"), (b"[1, 2]", "is not a meta a refresh writes"),
    (json.dumps({"rows": CFG.num_rows, "dim": CFG.embedding_dim + 1, "dtype": ["float32"]}).encode(), "fit")])
def test_a_garbage_meta_read_after_load_falls_back_instead_of_failing_the_request(
        stack: LocalStack, redis_client: redis.Redis, prefix: str, tmp_path: Path, garbage: bytes, said: str) -> None:
    path = publish_version(tmp_path, redis_client, prefix)
    clock = Clock()
    store, real = store_down_at_load(stack, prefix, clock)
    try:
        layered = ScoringModel.load(path, store=store)
        store.client.close()
        store.client = real
        clock.now = 5.0
        redis_client.set(f"{prefix}:emb:v1:meta", garbage)
        scores = score(layered, request(ADMITTED_USERS[2], ADMITTED_ITEMS[:30]))  # no exception: fallback rows
        assert bool(torch.isfinite(scores).all())
        assert store.last_error is not None and said in store.last_error
        assert len(layered.layered.cache) == 0  # type: ignore[union-attr]
    finally:
        store.client.close()


def test_a_version_loaded_while_redis_was_down_whose_rows_redis_then_lacks_is_said_once_not_left_as_an_outage(
        stack: LocalStack, redis_client: redis.Redis, prefix: str, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    # Redis down as the version loads (its meta unread), then back empty (restarted without persistence): every miss
    # falls back, and the log must say why (the version's rows are not in Redis), not stay at the outage's
    # ConnectionError; once, not once per retry-after window; and when the rows are there again, say so.
    path = publish_version(tmp_path, redis_client, prefix)
    clock = Clock()
    metrics = ServingMetrics(lambda: None)
    store, real = store_down_at_load(stack, prefix, clock, metrics)
    try:
        with caplog.at_level("WARNING", logger="streamrec.serve"):
            layered = ScoringModel.load(path, store=store)
            store.client.close()
            store.client = real
            meta = redis_client.get(f"{prefix}:emb:v1:meta")
            redis_client.delete(f"{prefix}:emb:v1:meta")  # Redis back, without the version
            caplog.clear()
            for window in range(3):
                clock.now = 5.0 + 2 * window  # each past the last window: the meta is asked again
                assert bool(torch.isfinite(score(layered, request(ADMITTED_USERS[2], ADMITTED_ITEMS[:30]))).all())
            said = [r.getMessage() for r in caplog.records if "no rows of version v1" in r.getMessage()]
            assert len(said) == 1, [r.getMessage() for r in caplog.records]
            assert _sample(metrics.render().decode(), "streamrec_serving_embedding_store_errors_total") == 4
            caplog.clear()
            up = store.client
            # down again (its outage logged), then back, still without the version: said again
            store.client = refusing_client()
            clock.now = 12.0
            score(layered, request(ADMITTED_USERS[2], ADMITTED_ITEMS[:30]))
            store.client.close()
            store.client = up
            clock.now = 14.0
            score(layered, request(ADMITTED_USERS[2], ADMITTED_ITEMS[:30]))
            lines = [r.getMessage() for r in caplog.records]
            assert len(lines) == 2 and "ConnectionError" in lines[0] and "no rows of version v1" in lines[1], lines
            caplog.clear()
            redis_client.set(f"{prefix}:emb:v1:meta", meta)  # the rows are there again
            clock.now = 20.0
            score(layered, request(ADMITTED_USERS[2], ADMITTED_ITEMS[:30]))
            assert len(layered.layered.cache) > 0  # type: ignore[union-attr]
            assert [r for r in caplog.records if "v1" in r.getMessage() and "again" in r.getMessage()], \
                [r.getMessage() for r in caplog.records]
    finally:
        store.client.close()


def test_a_garbage_meta_at_load_is_an_artifact_error_naming_it(stack: LocalStack, redis_client: redis.Redis,
                                                               prefix: str, tmp_path: Path) -> None:
    path = publish_version(tmp_path, redis_client, prefix)
    redis_client.set(f"{prefix}:emb:v1:meta", b"[1, 2]")  # JSON, no meta object (decode_meta)
    assert_load_refused(stack, prefix, path, r"emb:v1:meta is not a meta a refresh writes \(ValueError: JSON list")


def test_non_finite_rows_in_redis_are_not_served_nor_cached(stack: LocalStack, redis_client: redis.Redis,
                                                           prefix: str, tmp_path: Path) -> None:
    # A row of the right length whose bytes decode to NaN (a foreign writer, a corrupted value): the request scores
    # on fallback rows, finite, and the LRU does not keep the row (it would poison every later request).
    path = publish_version(tmp_path, redis_client, prefix)
    metrics = ServingMetrics(lambda: None)
    store = store_of(stack, prefix, metrics=metrics)
    try:
        layered = ScoringModel.load(path, store=store)
        user_row = int(layered.map_rows(0, np.array([hash_value(ADMITTED_USERS[7])]))[0])
        nan = np.full((1, CFG.embedding_dim + 1), np.nan, np.float32)
        redis_client.set(row_keys(prefix, "v1", np.array([user_row]))[0], nan.tobytes())
        scores = score(layered, request(ADMITTED_USERS[7], NEW_ITEMS))
        assert bool(torch.isfinite(scores).all()), scores
        assert user_row not in layered.layered.cache  # type: ignore[union-attr]
        assert store.last_error is not None and "non-finite" in store.last_error
        assert _sample(metrics.render().decode(), "streamrec_serving_embedding_store_errors_total") >= 1
    finally:
        store.client.close()


@pytest.mark.parametrize("value", [1e30, -3e13])
def test_a_finite_row_beyond_the_served_bound_in_redis_falls_back_instead_of_scoring_nan(
        stack: LocalStack, redis_client: redis.Redis, prefix: str, tmp_path: Path, value: float) -> None:
    # A row of the right length and a matching tag whose values are finite but beyond MAX_ROW_ABS (another writer
    # using the same encoder, a version written before the tags): served, 1e30 scored NaN (a 503 for every request of
    # the user) and -3e13 scored 0.0 for every candidate, silently. Malformed like a non-finite row: fallback, uncached.
    path = publish_version(tmp_path, redis_client, prefix)
    metrics = ServingMetrics(lambda: None)
    store = store_of(stack, prefix, metrics=metrics)
    try:
        layered = ScoringModel.load(path, store=store)
        user_row = np.array([int(layered.map_rows(0, np.array([hash_value(ADMITTED_USERS[7])]))[0])])
        big = np.full((1, CFG.embedding_dim + 1), value, np.float32)
        redis_client.set(row_keys(prefix, "v1", user_row)[0],
                         encode_rows(big, RowDtype.FLOAT32, user_row, tag_key("v1", RowDtype.FLOAT32))[0])
        scores = score(layered, request(ADMITTED_USERS[7], NEW_ITEMS))
        assert bool(torch.isfinite(scores).all()), scores
        assert int(user_row[0]) not in layered.layered.cache  # type: ignore[union-attr]
        assert _sample(metrics.render().decode(),
                       'streamrec_serving_embedding_store_bad_rows_total{reason="malformed"}') == 1
    finally:
        store.client.close()


def test_pruning_skips_a_garbage_meta_of_another_writer_and_still_deletes_its_own_pruned_versions(
        stack: LocalStack, redis_client: redis.Redis, prefix: str, tmp_path: Path) -> None:
    # After publishing nothing may fail the refresh; an undecodable meta under the shared prefix (another writer's,
    # a hand-set key) must not raise out of the prune, nor stop it deleting this root's pruned versions.
    from cache_refresh import stored_rows
    from cache_refresh.settings import RefreshSettings
    from serving.stored_versions import version_names

    rs = RefreshSettings(publish_root=tmp_path / "serving", embedding_store=EmbeddingStore.LAYERED)
    rds = RedisSettings(url=stack.redis_url, prefix=prefix)
    write_version(redis_client, prefix, "old", np.zeros((3, 5), np.float32), np.arange(3), RowDtype.FLOAT32,
                  owner=stored_rows._owner(rs))
    redis_client.set(f"{prefix}:emb:junk:meta", b"\xff\xfe not json")
    redis_client.set(f"{prefix}:emb:list:meta", b"[1]")
    stored_rows._prune_stored(rs, rds, tmp_path / "serving", None)  # no exception
    assert not list(redis_client.scan_iter(match=f"{prefix}:emb:old:*"))
    assert version_names(redis_client, prefix) == {"junk", "list"}  # not ours: left alone


def test_a_meta_key_of_another_redis_type_is_refused_at_load_not_taken_for_redis_down(
        stack: LocalStack, redis_client: redis.Redis, prefix: str, tmp_path: Path) -> None:
    # GET of a hash is a WRONGTYPE error: Redis answered, the meta is not one a refresh writes. Read as Redis down,
    # the version loaded and was swapped in serving every non-hot row from fallback rows, for as long as the key stayed.
    path = publish_version(tmp_path, redis_client, prefix)
    redis_client.delete(f"{prefix}:emb:v1:meta")
    redis_client.hset(f"{prefix}:emb:v1:meta", "rows", str(CFG.num_rows))
    assert_load_refused(stack, prefix, path, f"{prefix}:emb:v1:meta is a Redis hash")


def test_keys_of_another_redis_type_under_the_prefix_stop_neither_pruning_nor_the_cleanup_of_killed_writes(
        stack: LocalStack, redis_client: redis.Redis, prefix: str, tmp_path: Path) -> None:
    # Another writer's (or a hand-set) meta or writer marker of another type under the shared prefix raised WRONGTYPE
    # out of the listing: the refresh then deleted none of its own pruned or abandoned versions' rows, each run.
    from cache_refresh import stored_rows
    from cache_refresh.settings import RefreshSettings
    from serving.row_codec import writer_key
    from serving.stored_versions import unfinished_versions, version_names

    rs = RefreshSettings(publish_root=tmp_path / "serving", embedding_store=EmbeddingStore.LAYERED)
    rds = RedisSettings(url=stack.redis_url, prefix=prefix)
    write_version(redis_client, prefix, "old", np.zeros((3, 5), np.float32), np.arange(3), RowDtype.FLOAT32,
                  owner=stored_rows._owner(rs))
    redis_client.hset(f"{prefix}:emb:hash:meta", "a", "b")
    redis_client.rpush(writer_key(prefix, "list"), "x")
    redis_client.hset(writer_key(prefix, "hash"), "a", "b")  # a writer marker beside the hash meta
    stored_rows._prune_stored(rs, rds, tmp_path / "serving", None)
    assert not list(redis_client.scan_iter(match=f"{prefix}:emb:old:*"))
    assert version_names(redis_client, prefix) == {"hash"}  # not ours: left alone
    assert unfinished_versions(redis_client, prefix, stored_rows._owner(rs)) == set()


def test_a_version_name_another_publish_root_holds_in_the_store_is_refused_and_its_rows_are_left_alone(
        stack: LocalStack, redis_client: redis.Redis, prefix: str, tmp_path: Path) -> None:
    # Two publish roots may share a prefix; a version name both chose (their refreshes named it in the same
    # millisecond) made the second write its rows over the first's: the first root's rankers served the second's rows
    # (every tag matched: it names the version, not the root) with no error, and the second root's pruning then deleted
    # them under the first's rankers.
    from cache_refresh import job
    from cache_refresh.settings import RefreshSettings

    path = publish_version(tmp_path / "a", redis_client, prefix)  # root a's v1, written without an owner
    other = ScoringModel.load(publish(tmp_path / "b", build_artifact(checkpoint(seed=1), tmp_path / "b", HOT,
                                                                     version="v1"), keep=10))
    before = {k: redis_client.get(k) for k in redis_client.scan_iter(match=f"{prefix}:emb:v1:*")}
    rs = RefreshSettings(publish_root=tmp_path / "b", embedding_store=EmbeddingStore.LAYERED)
    with pytest.raises(job.RefreshError, match="v1 is in the embedding store already"):
        job._store_rows(rs, RedisSettings(url=stack.redis_url, prefix=prefix), other)
    assert {k: redis_client.get(k) for k in redis_client.scan_iter(match=f"{prefix}:emb:v1:*")} == before
    store = store_of(stack, prefix)
    try:  # root a's rankers still serve root a's rows
        req = request(ADMITTED_USERS[3], ADMITTED_ITEMS[:20])
        assert torch.equal(score(ScoringModel.load(path, store=store), req), score(ScoringModel.load(path), req))
    finally:
        store.client.close()
    # a root writing over a version of its own (a rerun) is not refused
    write_version(redis_client, prefix, "w", np.zeros((3, 5), np.float32), np.arange(3), RowDtype.FLOAT32, owner="o")
    write_version(redis_client, prefix, "w", np.ones((3, 5), np.float32), np.arange(3), RowDtype.FLOAT32, owner="o")


def test_a_failed_write_of_a_versions_rows_leaves_no_rows_behind(stack: LocalStack, redis_client: redis.Redis,
                                                                prefix: str, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # Rows written without their meta are never served and never pruned (pruning finds versions by their meta):
    # a write that fails before meta must delete what it wrote, or each failed refresh leaks a table into Redis.
    from cache_refresh import job
    from cache_refresh.settings import RefreshSettings

    class MetaRefused:
        """The real client, whose SET (the meta, written last) fails as a dropped connection would."""

        def __init__(self, client: redis.Redis) -> None:
            self._client = client

        def set(self, *_a: Any, **_k: Any) -> None:
            raise redis.ConnectionError("connection lost while writing meta")

        def __getattr__(self, name: str) -> Any:
            return getattr(self._client, name)

    path = publish(tmp_path, build_artifact(checkpoint(), tmp_path, HOT, version="w1"), keep=10)
    model = ScoringModel.load(path)
    rs = RefreshSettings(publish_root=tmp_path, embedding_store=EmbeddingStore.LAYERED)
    rds = RedisSettings(url=stack.redis_url, prefix=prefix)
    monkeypatch.setattr(job, "_redis", lambda rds, rs: MetaRefused(redis.Redis.from_url(stack.redis_url)))
    with pytest.raises(job.RefreshError, match="embedding_store"):
        job._store_rows(rs, rds, model)
    assert not list(redis_client.scan_iter(match=f"{prefix}:emb:w1:*"))


def test_a_service_that_fails_to_start_leaves_no_thread_running(stack: LocalStack, prefix: str,
                                                               tmp_path: Path) -> None:
    import socket
    import threading

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        settings = ServeSettings(port=taken.getsockname()[1], publish_root=tmp_path / "serving", poll_s=3600,
                                 embedding_store=EmbeddingStore.LAYERED)
        svc = ScoringService(settings, RedisSettings(url=stack.redis_url, prefix=prefix))
        with pytest.raises(BindError, match="the port is in use"):
            svc.start()
    names = {t.name for t in threading.enumerate() if t.is_alive()}
    assert not names & {"serve-updater", "serve-pubsub", "lookup-counts"}, names


def test_a_cluster_store_unreachable_at_start_serves_on_fallback_rows_instead_of_refusing_to_start(
        prefix: str, tmp_path: Path) -> None:
    # redis-py's RedisCluster contacts a node when it is made: made at start, an unreachable cluster stopped the
    # service from starting at all, while a single-node store that is down serves hot and bucket rows (200s).
    root = tmp_path / "serving"
    publish(root, build_artifact(checkpoint(), root, HOT, version="v1"), keep=10)
    nobody = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    settings = ServeSettings(port=0, publish_root=root, poll_s=3600, embedding_store=EmbeddingStore.LAYERED,
                             embedding_store_cluster=True, lookup_counts=False)
    with ScoringService(settings, RedisSettings(url=nobody, prefix=prefix)) as svc:
        status, body = post(svc.port, request(ADMITTED_USERS[1], ADMITTED_ITEMS[:10] + NEW_ITEMS))
        assert status == 200 and len(body["scores"]) == 13
        assert svc.embedding_store is not None and svc.embedding_store.last_error is not None


def test_a_delta_write_that_times_out_does_not_make_requests_skip_a_redis_that_still_reads(
        own_redis: tuple[subprocess.Popen[bytes], str], prefix: str, tmp_path: Path) -> None:
    # The delta's rows go to Redis best effort, on the request path's short-timeout client. Writes stalled (CLIENT
    # PAUSE WRITE: a failover, a full replica link) while reads answer: the failed write must not open the
    # retry-after window that makes every request's misses skip Redis and serve fallback rows.
    _, url = own_redis
    admin = redis.Redis.from_url(url)
    path = publish_version(tmp_path, admin, prefix)
    # the write times out (2 s) long before the pause would end (30 s; lifted once the read is done), and the read has
    # those 2 s: with a 0.1 s timeout a read slower than that on a loaded machine failed (reproduced by SIGSTOPping
    # Redis for 0.3 s before it)
    store = RedisEmbeddingStore(redis.Redis.from_url(url, socket_timeout=2.0), prefix, cache_rows=1000,
                                retry_after_s=30.0, write_deltas=True)
    try:
        layered = ScoringModel.load(path, store=store)
        user_rows = layered.map_rows(0, np.array([hash_value(u) for u in ADMITTED_USERS[10:12]]))
        admin.execute_command("CLIENT", "PAUSE", "30000", "WRITE")
        try:
            layered.apply_delta(torch.tensor(user_rows[:1]), torch.full((1, CFG.embedding_dim + 1), 0.5), None, 1)
            assert store.last_error is not None and "delta" in store.last_error  # the write failed, counted
            vec, failed = layered.layered.gather(user_rows[1:])  # type: ignore[union-attr]
        finally:
            admin.execute_command("CLIENT", "UNPAUSE")
        assert not failed.any() and np.array_equal(vec, layered.table[user_rows[1:]])
    finally:
        store.client.close()
        admin.close()


def test_requests_during_a_swap_score_every_row_from_the_version_they_report(
        stack: LocalStack, redis_client: redis.Redis, prefix: str, tmp_path: Path) -> None:
    # Two versions with different tables under one Redis prefix, a swap while requests run: each answer must equal
    # the in-process scores of the version it names (no row of one version's LRU or keys served under the other).
    import threading

    root = tmp_path / "serving"
    paths = {}
    for version, seed in (("v1", 0), ("v2", 1)):
        path = publish(root, build_artifact(checkpoint(seed), root, HOT, version=version), keep=10)
        model = ScoringModel.load(path)
        write_version(redis_client, prefix, version, model.table, model.non_hot_rows(), RowDtype.FLOAT32)
        paths[version] = path
    (root / "CURRENT").write_text("v1")
    expected = {v: ScoringModel.load(p) for v, p in paths.items()}
    reqs = some_requests(40, seed=3)
    settings = ServeSettings(port=0, publish_root=root, poll_s=3600, embedding_store=EmbeddingStore.LAYERED,
                             lookup_counts=False, embedding_cache_rows=50, embedding_store_timeout_s=ROWS_READ_S)
    answers: list[tuple[int, dict[str, Any], dict[str, Any]]] = []
    with ScoringService(settings, RedisSettings(url=stack.redis_url, prefix=prefix)) as svc:
        stop = threading.Event()

        def client() -> None:
            k = 0
            while not stop.is_set():
                req = reqs[k % len(reqs)]
                status, body = post(svc.port, req)
                answers.append((status, req, body))
                k += 1

        threads = [threading.Thread(target=client) for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        (root / "CURRENT").write_text("v2")
        svc.updater.check_now()
        time.sleep(0.3)
        stop.set()
        for t in threads:
            t.join(10)
    versions = {body["model_version"] for _, _, body in answers}
    assert versions == {"v1", "v2"}, versions
    for status, req, body in answers:
        assert status == 200
        want = score(expected[body["model_version"]], req).tolist()
        assert body["scores"] == pytest.approx(want, abs=1e-7), body["model_version"]


def test_a_table_beyond_float16_fails_the_layered_write_and_leaves_no_rows(
        stack: LocalStack, redis_client: redis.Redis, prefix: str, tmp_path: Path) -> None:
    from cache_refresh import job
    from cache_refresh.settings import RefreshSettings

    ck = checkpoint()
    weight = ck["model"]["sparse.bag.weight"].clone()
    cold_row = int(own_rows("user_id", 1)[0])  # an admitted user's own row: not hot, so written to Redis
    assert cold_row not in set(HOT.tolist())
    weight[cold_row, 0] = 1e5  # finite, and beyond float16's 65504
    ck = {**ck, "model": {**ck["model"], "sparse.bag.weight": weight}}
    path = publish(tmp_path, build_artifact(ck, tmp_path, HOT, version="h1"), keep=10)
    rs = RefreshSettings(publish_root=tmp_path, embedding_store=EmbeddingStore.LAYERED,
                         embedding_store_dtype=RowDtype.FLOAT16)
    with pytest.raises(ValueError, match="beyond float16"):
        job._store_rows(rs, RedisSettings(url=stack.redis_url, prefix=prefix), ScoringModel.load(path))
    assert not list(redis_client.scan_iter(match=f"{prefix}:emb:h1:*"))


def test_a_server_that_fails_to_stop_still_stops_the_updater_and_the_lookup_counter_and_the_error_is_raised(
        stack: LocalStack, prefix: str, tmp_path: Path) -> None:
    import threading

    settings = ServeSettings(port=0, publish_root=tmp_path / "serving", poll_s=3600)
    svc = ScoringService(settings, RedisSettings(url=stack.redis_url, prefix=prefix)).start()
    assert svc.server is not None and svc.lookups is not None
    real_stop = svc.server.stop

    def failing_stop(grace_s: float) -> None:
        real_stop(grace_s)
        raise RuntimeError("the server would not stop")

    svc.server.stop = failing_stop  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="would not stop"):
        svc.stop(grace_s=1.0)
    names = {t.name for t in threading.enumerate() if t.is_alive()}
    assert not names & {"serve-updater", "serve-pubsub", "lookup-counts"}, names


# -- a version's rows are the artifact's: delta rows kept apart, a rollback serves exactly the published rows ----
def test_a_rollback_serves_the_published_versions_rows_not_the_rows_of_deltas_applied_to_it_before(
        stack: LocalStack, redis_client: redis.Redis, prefix: str, tmp_path: Path) -> None:
    from cache_refresh.publish import rollback
    from learner.delta_writer import DeltaWriter

    root = tmp_path / "serving"
    path = publish_version(root, redis_client, prefix)
    deltas = tmp_path / "deltas"
    writer = DeltaWriter(deltas, CFG.num_rows, every_s=3600)
    settings = ServeSettings(port=0, publish_root=root, deltas_dir=deltas, poll_s=3600,
                             embedding_store=EmbeddingStore.LAYERED, lookup_counts=False,
                             embedding_store_write_deltas=True,  # the delta rows written, as a tool may want
                             embedding_store_timeout_s=ROWS_READ_S)
    req = request(ADMITTED_USERS[4], NEW_ITEMS)
    published = score(ScoringModel.load(path), req).tolist()  # v1 as published: the artifact's rows
    user_row = int(ScoringModel.load(path).map_rows(0, np.array([hash_value(ADMITTED_USERS[4])]))[0])
    assert user_row not in set(HOT.tolist())
    with ScoringService(settings, RedisSettings(url=stack.redis_url, prefix=prefix)) as svc:
        learner = DeepFM(CFG, mlp=(8,), seed=0, autocast_dtype=None)
        learner.load_state_dict(checkpoint()["model"])
        with torch.no_grad():
            learner.sparse.bag.weight[user_row] += 0.5  # type: ignore[index]
        writer.mark(torch.tensor([user_row]))
        writer.write(learner, samples_trained=20)
        svc.updater.check_now()  # v1 + the delta; the delta's row goes to Redis
        status, fresh = post(svc.port, req)
        assert status == 200 and fresh["delta_seq"] == 1
        assert fresh["scores"] != pytest.approx(published, abs=1e-4)
        publish_version(root, redis_client, prefix, version="v2")
        svc.updater.check_now()
        assert svc.holder.model().version == "v2"  # type: ignore[union-attr]
        assert rollback(root) == "v1"
        svc.updater.check_now()  # v1 again, pinned: no deltas; its rows must be v1's as published
        status, rolled = post(svc.port, req)
        assert status == 200 and rolled["model_version"] == "v1" and rolled["delta_seq"] == 0
        assert rolled["scores"] == pytest.approx(published, abs=1e-7)
    stored = redis_client.get(row_keys(prefix, "v1", np.array([user_row]))[0])
    assert stored is not None
    assert np.array_equal(stored_row(stored, user_row),
                          ScoringModel.load(path).table[user_row])


# -- one bad key falls back for its row only ----------------------------------------------------------------------
def test_a_missing_or_malformed_row_key_falls_back_for_that_row_only_and_redis_keeps_serving_the_others(
        stack: LocalStack, redis_client: redis.Redis, prefix: str, tmp_path: Path) -> None:
    path = publish_version(tmp_path, redis_client, prefix)
    in_process = ScoringModel.load(path)
    metrics = ServingMetrics(lambda: None)
    store = RedisEmbeddingStore(redis.Redis.from_url(stack.redis_url, socket_timeout=1.0), prefix, cache_rows=1000,
                                retry_after_s=3600.0, metrics=metrics)  # a failed round trip: no Redis for an hour
    try:
        layered = ScoringModel.load(path, store=store)
        cold = np.setdiff1d(in_process.non_hot_rows(), np.arange(0, 58))  # no bucket rows (those are local)
        deleted, short, wide = (int(r) for r in cold[:3])
        redis_client.delete(row_keys(prefix, "v1", np.array([deleted]))[0])
        redis_client.set(row_keys(prefix, "v1", np.array([short]))[0], b"\0" * 3)
        redis_client.set(row_keys(prefix, "v1", np.array([wide]))[0], np.zeros(40, np.float32).tobytes())
        rows = cold[:10]
        vec, failed = layered.layered.gather(rows)  # type: ignore[union-attr]
        assert failed.tolist() == [True, True, True] + [False] * 7
        assert np.array_equal(vec[3:], in_process.table[rows[3:]])
        cache = layered.layered.cache  # type: ignore[union-attr]
        assert not any(r in cache for r in (deleted, short, wide))  # the bad rows are not cached, the good ones are
        assert all(int(r) in cache for r in rows[3:])
        # the next request still reads Redis (no retry-after window was opened) and gets every row it asks for
        more = cold[10:30]
        vec, failed = layered.layered.gather(more)  # type: ignore[union-attr]
        assert store.available and not failed.any() and np.array_equal(vec, in_process.table[more])
        text = metrics.render().decode()
        assert _sample(text, 'streamrec_serving_embedding_store_bad_rows_total{reason="missing"}') == 1
        assert _sample(text, 'streamrec_serving_embedding_store_bad_rows_total{reason="malformed"}') == 2
        assert _sample(text, "streamrec_serving_embedding_store_errors_total") >= 1  # the alert still fires
    finally:
        store.client.close()


def test_a_delta_whose_id_map_has_one_key_for_every_row_is_refused_whole_and_every_fallback_still_scores(
        stack: LocalStack, redis_client: redis.Redis, prefix: str, tmp_path: Path) -> None:
    path = publish_version(tmp_path, redis_client, prefix)
    store = store_of(stack, prefix)
    try:
        model = ScoringModel.load(path, store=store)
        users = own_rows("user_id", len(ADMITTED_USERS))  # all cold: read from Redis, or their bucket rows
        redis_client.delete(*row_keys(prefix, "v1", users))  # so every admitted user's row falls back
        maps = checkpoint()["id_maps"]
        # the id map's own load broadcasts one key over every row: it takes this state
        maps["user_id"] = {**maps["user_id"], "row_key": maps["user_id"]["row_key"][:1].clone()}
        with pytest.raises(ValueError, match="row_key"):
            model.apply_delta(torch.zeros(0, dtype=torch.int64), torch.zeros(0, CFG.embedding_dim + 1), None, 1,
                              id_maps=maps)
        assert model.delta_seq == 0  # all or nothing
        for user in ADMITTED_USERS:  # each one's own row falls back to its bucket row (was an IndexError: a 500)
            p = score(model, request(user, [1, 2]))
            assert bool(torch.isfinite(p).all())
    finally:
        store.client.close()


def evicted_for_a_stranger(victim: str) -> tuple[dict[str, Any], str]:
    """The checkpoint's id maps after ``victim`` was evicted and its own row given to a new user whose hash bucket is
    another one (the capacity of 40 filled, ``victim`` the least recently seen): (id maps, the new user)."""
    mapper = RowMapper.from_state(CFG, checkpoint()["id_maps"])
    users = mapper.maps["user_id"]
    others = [hash_value(u) for u in ADMITTED_USERS if u != victim]
    users.lookup(np.array(others + [hash_value(f"filler{k}") for k in range(10)]), 1.0, train=True)  # full now
    stranger = next(s for s in (f"stranger{k}" for k in range(100))
                    if hash_value(s) % 8 != hash_value(victim) % 8)
    users.lookup(np.array([hash_value(stranger)]), 2.0, train=True)  # evicts the victim, seen last at 0.0
    return mapper.state_dict(), stranger


def test_a_delta_landing_mid_request_leaves_an_evicted_ids_fallback_on_its_own_bucket_not_the_new_owners(
        stack: LocalStack, redis_client: redis.Redis, prefix: str, tmp_path: Path) -> None:
    """A request maps ids with one snapshot (``pinned``); a delta landing before its rows are gathered gave an
    evicted user's own row to a stranger. The request still scores the evicted user, so a row of it that Redis
    cannot give (here: its key evicted) falls back to the evicted user's bucket, as the snapshot says, not the
    stranger's (the newest delta's row keys)."""
    path = publish_version(tmp_path, redis_client, prefix)
    store = store_of(stack, prefix)
    try:
        model = ScoringModel.load(path, store=store)
        victim = ADMITTED_USERS[0]
        row = int(model.map_rows(0, np.array([hash_value(victim)]))[0])
        redis_client.delete(row_keys(prefix, "v1", np.array([row]))[0])  # maxmemory evicted it: it falls back
        maps, stranger = evicted_for_a_stranger(victim)
        enc = FeatureEncoder(model)
        pin = model.pinned()
        values, offsets, dense = enc.rows(enc.check(parse_request(request(victim, [1, 2]), 100), []), pin)
        before = pin.score_request(torch.from_numpy(values), torch.from_numpy(offsets), torch.from_numpy(dense))
        model.apply_delta(torch.zeros(0, dtype=torch.int64), torch.zeros(0, CFG.embedding_dim + 1), None, 1,
                          id_maps=maps)  # lands between the request's id mapping and its gather
        assert int(model.map_rows(0, np.array([hash_value(stranger)]))[0]) == row  # the victim's row is the stranger's
        raced = pin.score_request(torch.from_numpy(values), torch.from_numpy(offsets), torch.from_numpy(dense))
        assert torch.equal(raced, before)
    finally:
        store.client.close()


def test_a_store_down_at_load_is_asked_once_per_retry_after_window_not_once_per_request(
        prefix: str, tmp_path: Path) -> None:
    """A version loaded while Redis was down reads its meta before its first fetch; inside the retry-after window
    opened by the failed read at load, requests skip Redis (one failed round trip per window: module docstring), as
    they do once the meta was read, instead of each paying a round trip (a timeout each, for a Redis that hangs)."""
    root = tmp_path / "serving"
    path = publish(root, build_artifact(checkpoint(), root, HOT, version="v1"), keep=10)
    metrics = ServingMetrics(lambda: None)
    nobody = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    store = RedisEmbeddingStore(redis.Redis.from_url(nobody, socket_timeout=1.0), prefix, retry_after_s=3600.0,
                                metrics=metrics)
    try:
        model = ScoringModel.load(path, store=store)  # the meta's read fails: counted, the window opens
        assert _sample(metrics.render().decode(), "streamrec_serving_embedding_store_errors_total") == 1
        for user in ADMITTED_USERS[:3]:  # their own rows are cold: each request misses
            assert bool(torch.isfinite(score(model, request(user, [1, 2]))).all())
        text = metrics.render().decode()
        assert _sample(text, "streamrec_serving_embedding_store_errors_total") == 1
        assert _sample(text, 'streamrec_serving_embedding_store_fallback_rows_total{kind="bucket"}') >= 3
    finally:
        store.client.close()


# -- an artifact refused because Redis lacked its rows is tried again, at a bounded cadence ----------------------
def updater_of(root: Path, store: RedisEmbeddingStore, metrics: ServingMetrics, clock: Clock,
               calls: list[Path]) -> Any:
    from serving.swap import ModelHolder, ModelUpdater

    def load(p: Path, device: str) -> ScoringModel:
        calls.append(p)
        return ScoringModel.load(p, device=device, store=store)

    return ModelUpdater(ModelHolder(), metrics, root, None, poll_s=3600, load=load, clock=clock)


def test_an_artifact_refused_because_redis_lacked_its_rows_is_tried_again_once_they_are_there(
        stack: LocalStack, redis_client: redis.Redis, prefix: str, tmp_path: Path) -> None:
    root = tmp_path / "serving"
    path = publish(root, build_artifact(checkpoint(), root, HOT, version="v1"), keep=10)  # files only, no rows yet
    metrics = ServingMetrics(lambda: None)
    store = store_of(stack, prefix, metrics=metrics)
    clock, calls = Clock(), []  # type: ignore[var-annotated]
    try:
        updater = updater_of(root, store, metrics, clock, calls)
        updater.check_now()
        assert updater.holder.live is None and "no rows of version v1" in (updater.holder.problem or "")
        clock.now = 1.0
        updater.check_now()  # not due yet: the version is not loaded (and hashed) again at every poll
        assert len(calls) == 1
        model = ScoringModel.load(path)
        write_version(redis_client, prefix, "v1", model.table, model.non_hot_rows(), RowDtype.FLOAT32)  # the refresh
        clock.now = 600.0  # past the retry delay
        updater.check_now()
        assert len(calls) == 2 and updater.holder.model() is not None and updater.holder.problem is None
        text = metrics.render().decode()
        assert _sample(text, "streamrec_serving_artifact_store_retries_total") == 1
        assert _sample(text, "streamrec_serving_swap_rejected_total") == 1  # the first refusal only
    finally:
        store.client.close()


def test_an_artifact_refused_for_another_reason_is_not_tried_again_until_its_files_change(
        stack: LocalStack, redis_client: redis.Redis, prefix: str, tmp_path: Path) -> None:
    root = tmp_path / "serving"
    publish_version(root, redis_client, prefix)
    redis_client.set(f"{prefix}:emb:v1:meta", b"[1, 2]")  # no meta a refresh writes: refused, and not retried
    metrics = ServingMetrics(lambda: None)
    store = store_of(stack, prefix, metrics=metrics)
    clock, calls = Clock(), []  # type: ignore[var-annotated]
    try:
        updater = updater_of(root, store, metrics, clock, calls)
        updater.check_now()
        assert updater.holder.live is None and "is not a meta a refresh writes" in (updater.holder.problem or "")
        for t in (600.0, 6000.0, 60000.0):
            clock.now = t
            updater.check_now()
        assert len(calls) == 1
        assert _sample(metrics.render().decode(), "streamrec_serving_artifact_store_retries_total") == 0
    finally:
        store.client.close()


# -- every value carries a tag of its version, dtype and row --------------------------------------------------------
def test_a_value_of_the_right_length_from_another_version_or_row_or_garbage_is_refused_by_its_tag(
        stack: LocalStack, redis_client: redis.Redis, prefix: str, tmp_path: Path) -> None:
    path = publish_version(tmp_path, redis_client, prefix)
    in_process = ScoringModel.load(path)
    table = in_process.table
    cold = np.setdiff1d(in_process.non_hot_rows(), np.arange(0, 58))  # no bucket rows (those are local)
    other, moved, garbage = (int(r) for r in cold[:3])
    write_version(redis_client, prefix, "v0", table * 2, np.array([other]), RowDtype.FLOAT32)  # an older version
    key = row_keys(prefix, "v1", np.array([other, moved, garbage]))
    redis_client.set(key[0], redis_client.get(row_keys(prefix, "v0", np.array([other]))[0]))  # type: ignore[arg-type]
    redis_client.set(key[1], redis_client.get(row_keys(prefix, "v1", np.array([cold[5]]))[0]))  # type: ignore[arg-type]
    value = redis_client.get(key[2])
    assert value is not None
    redis_client.set(key[2], bytes(b ^ 1 if i == 3 else b for i, b in enumerate(value)))  # one bit of one value
    metrics = ServingMetrics(lambda: None)
    store = store_of(stack, prefix, metrics=metrics)
    try:
        layered = ScoringModel.load(path, store=store)
        vec, failed = layered.layered.gather(cold[:10])  # type: ignore[union-attr]
        assert failed.tolist() == [True, True, True] + [False] * 7
        assert np.array_equal(vec[3:], table[cold[3:10]])
        assert _sample(metrics.render().decode(),
                       'streamrec_serving_embedding_store_bad_rows_total{reason="malformed"}') == 3
    finally:
        store.client.close()


def test_a_layered_refresh_that_does_not_publish_leaves_no_rows_of_its_version_in_redis(
        stack: LocalStack, kafka: Any, redis_client: redis.Redis, prefix: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The rows are written before the publish; a run that then does not publish (a scheduled run held by a rollback
    pin, every night the pin lasts; a publish that fails: a full disk) deletes them. They were left in Redis, a whole
    table each, until some later run published (a pin can last days)."""
    from cache_refresh import job
    from cache_refresh.settings import RefreshSettings
    from learner import artifact_versions
    from learner import checkpoint as ckpt_io
    from serving.stored_versions import version_names

    ck = checkpoint()
    meta = {**ck["meta"], "steps": 1, "metrics": {}, "topic": "samples"}
    state = {"model": ck["model"], "id_maps": ck["id_maps"], "recent_ids": []}
    ckpt_dir = tmp_path / "ckpt"
    ckpt_io.save(ckpt_dir, state, meta)
    rs = RefreshSettings(checkpoint_dir=ckpt_dir, publish_root=tmp_path / "serving", holdout_messages=0,
                         small_field_rows=100, keep_versions=3, redis_attempts=1, alerts_topic="",
                         embedding_store=EmbeddingStore.LAYERED)
    rds = RedisSettings(url=stack.redis_url, prefix=prefix)
    live = job.run_once(rs, kafka, rds)["version"]

    def keys() -> set[str]:
        return {k.decode().split(":")[2] for k in redis_client.scan_iter(match=f"{prefix}:emb:*")}

    (rs.publish_root / artifact_versions.PIN).write_text(json.dumps({"version": live, "rolled_back_from": None,
                                                                     "at": 0}))
    held = job.scheduled_run(rs, kafka, rds)
    assert held is not None and held["published"] is False and held["built"] != live
    assert keys() == {live} and version_names(redis_client, prefix) == {live}

    def disk_full(*args: Any, **kwargs: Any) -> Path:
        raise artifact_versions.ArtifactError("could not make it current: the file system is full (injected)")

    monkeypatch.setattr(job, "publish", disk_full)
    with pytest.raises(job.RefreshError, match="at publish: .*file system is full"):
        job.run_once(rs, kafka, rds)
    assert keys() == {live}
    assert artifact_versions.read_current(rs.publish_root).name == live


class Killed(BaseException):
    """The refresh process killed (SIGKILL, OOM): no handler of the job runs."""


def test_rows_a_killed_layered_refresh_left_without_meta_are_deleted_by_the_next_run(
        stack: LocalStack, kafka: Any, redis_client: redis.Redis, prefix: str, tmp_path: Path) -> None:
    """A run killed while writing its rows leaves rows and no ``meta``; pruning finds versions by their meta, so they
    stayed in Redis for ever, a table per killed run. The next run of the same publish root (holding its lock: the
    writer is gone) deletes them before writing its own; an unfinished write of another publish root sharing the
    prefix, and the live version, are left alone."""
    from cache_refresh import job, stored_rows
    from cache_refresh.settings import RefreshSettings
    from learner import checkpoint as ckpt_io

    ck = checkpoint()
    meta = {**ck["meta"], "steps": 1, "metrics": {}, "topic": "samples"}
    ckpt_dir = tmp_path / "ckpt"
    ckpt_io.save(ckpt_dir, {"model": ck["model"], "id_maps": ck["id_maps"], "recent_ids": []}, meta)
    rs = RefreshSettings(checkpoint_dir=ckpt_dir, publish_root=tmp_path / "serving", holdout_messages=0,
                         small_field_rows=100, keep_versions=3, redis_attempts=1, alerts_topic="",
                         embedding_store=EmbeddingStore.LAYERED)
    rds = RedisSettings(url=stack.redis_url, prefix=prefix)
    live = job.run_once(rs, kafka, rds)["version"]

    class KilledBeforeMeta:
        """The refresh's client until the process dies: the rows are written, the meta (written last) is not."""

        def __init__(self, client: redis.Redis) -> None:
            self.client = client

        def __getattr__(self, name: str) -> Any:
            return getattr(self.client, name)

        def set(self, key: str, value: Any, **kw: Any) -> Any:
            if key.endswith(":meta"):
                raise Killed
            return self.client.set(key, value, **kw)

    table = np.ones((50, 5), np.float32)
    for version, owner in (("killed", stored_rows._owner(rs)), ("elsewhere", "/another/publish/root")):
        with pytest.raises(Killed):
            write_version(KilledBeforeMeta(redis_client), prefix, version, table, np.arange(50), RowDtype.FLOAT32,
                          chunk=10, owner=owner)

    def keys() -> set[str]:
        return {k.decode().split(":")[2] for k in redis_client.scan_iter(match=f"{prefix}:emb:*")}

    assert keys() == {live, "killed", "elsewhere"}
    newer = job.run_once(rs, kafka, rds)["version"]
    assert keys() == {live, newer, "elsewhere"}


def test_glob_characters_in_a_prefix_or_a_version_delete_and_list_only_their_own_keys(
        redis_client: redis.Redis, prefix: str) -> None:
    """SCAN's MATCH is a glob: a prefix "p?" or a stray version key named "*" (not written by a refresh) matched other
    prefixes' and versions' keys, so pruning them deleted rows another deployment, or the live version, serves."""
    from serving.stored_versions import delete_version, unfinished_versions, version_names

    rows = np.zeros((3, 5), np.float32)
    ours, theirs = f"{prefix}?", f"{prefix}x"  # "p?" is a legal prefix, and matched "px"
    write_version(redis_client, theirs, "v1", rows, np.arange(3), RowDtype.FLOAT32, owner="/root")
    write_version(redis_client, ours, "v1", rows, np.arange(3), RowDtype.FLOAT32, owner="/root")
    redis_client.set(f"{theirs}:emb:v2:writer", b'{"owner": "/root"}')  # theirs: unfinished, not ours
    assert version_names(redis_client, ours) == {"v1"} and unfinished_versions(redis_client, ours, "/root") == set()
    assert delete_version(redis_client, ours, "v1") == 5  # meta, 3 rows, writer marker: its own
    write_version(redis_client, theirs, "*", rows, np.arange(3), RowDtype.FLOAT32, owner="/root")
    assert version_names(redis_client, theirs, owner="/root") == {"v1", "*"}
    assert delete_version(redis_client, theirs, "*") == 5  # the version literally named "*": not v1
    assert len(list(redis_client.scan_iter(match=f"{theirs}:emb:v1:r:*"))) == 3
    assert redis_client.get(f"{theirs}:emb:v1:meta") is not None


def test_the_live_versions_rows_are_not_deleted_as_a_killed_write_when_its_meta_was_evicted(
        stack: LocalStack, kafka: Any, redis_client: redis.Redis, prefix: str, tmp_path: Path) -> None:
    """A version's meta is read once, at load: under maxmemory (allkeys-lru) it is the first key Redis evicts. Its
    writer marker and no meta made the published, live version look like a killed write, and the next run deleted all
    its rows before writing its own (rankers serve it until they load the new version: fallback rows meanwhile). A
    version the publish root holds is left to pruning."""
    from cache_refresh import job
    from cache_refresh.settings import RefreshSettings
    from learner import checkpoint as ckpt_io

    ck = checkpoint()
    meta = {**ck["meta"], "steps": 1, "metrics": {}, "topic": "samples"}
    ckpt_dir = tmp_path / "ckpt"
    ckpt_io.save(ckpt_dir, {"model": ck["model"], "id_maps": ck["id_maps"], "recent_ids": []}, meta)
    rs = RefreshSettings(checkpoint_dir=ckpt_dir, publish_root=tmp_path / "serving", holdout_messages=0,
                         small_field_rows=100, keep_versions=3, redis_attempts=1, alerts_topic="",
                         embedding_store=EmbeddingStore.LAYERED)
    live = job.run_once(rs, kafka, RedisSettings(url=stack.redis_url, prefix=prefix))["version"]
    rows = len(list(redis_client.scan_iter(match=f"{prefix}:emb:{live}:r:*")))
    assert rows > 0
    redis_client.delete(f"{prefix}:emb:{live}:meta")  # evicted
    newer = job.run_once(rs, kafka, RedisSettings(url=stack.redis_url, prefix=prefix))["version"]
    assert newer != live
    assert len(list(redis_client.scan_iter(match=f"{prefix}:emb:{live}:r:*"))) == rows

"""The scoring service against real artifacts (learner/artifact.py) and the real Redis of the session stack.

Tolerance: served probabilities equal the learner's eager fp32 DeepFM on the same inputs within 1e-5
absolute (the artifact docstring measures ~1e-7; scores are float32 on the wire).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import torch

from cache_refresh.publish import publish
from learner.artifact import build_artifact, eager_model
from learner.batch import TensorBatch, to_tensors
from learner.delta_writer import DeltaWriter
from learner.features import FeatureConfig, FieldSpec
from learner.model import DeepFM
from learner.optim import make_optimizers
from learner.scorer import to_candidate_rows
from learner.trainer import Trainer
from serving.features import FeatureEncoder
from serving.request import parse_request
from serving.service import ScoringService
from serving.settings import ServeSettings
from serving.swap import artifact_channel
from stream.config import RedisSettings
from stream.features import hash_context, hash_value
from stream.history import UserHistory
from stream.joiner.engine import Pending, Sample
from stream.joiner.sample_rows import to_batch
from stream.samples import SampleBatch

TOL = 1e-5
CFG = FeatureConfig((FieldSpec("user_id", "single", 50), FieldSpec("item_id", "single", 40),
                     FieldSpec("history", "sequence", 40, shares="item_id"), FieldSpec("ctx.device", "single", 10),
                     FieldSpec("ctx.genres", "multi", 12), FieldSpec("ctx.year", "single", 10)),
                    dense=("price",), embedding_dim=4)
# Serving's history read fails open after redis_timeout_s (50 ms by default: a slow read costs the request its history,
# not its answer). A test whose expectation needs the read to succeed gives it this long instead: on a loaded machine
# (CI runs four workers on two cores) a read Redis answers at once can take past 50 ms to be scheduled, and a TLS or
# ACL connection's first read includes its handshake. A test of the timeout itself sets its own.
HISTORY_READ_S = 5.0


# -- a tiny trained learner ----------------------------------------------------------------------------
def random_samples(rng: np.random.Generator, n: int, users: list[Any] | None = None, label: int | None = None,
                   start: int = 0) -> SampleBatch:
    u = [hash_value(x) for x in users] if users else rng.integers(0, 1000, n)
    items = rng.integers(0, 1000, n)
    return SampleBatch.from_columns(
        impression_id=[f"s{start + k}" for k in range(n)], ts=np.arange(start, start + n),
        label=np.full(n, label) if label is not None else ((np.asarray(u) + items) % 3 == 0).astype(np.int8),
        label_delay_ms=np.zeros(n), user_id=np.asarray(u), item_id=items,
        history=[rng.integers(0, 1000, rng.integers(0, 4)).tolist() for _ in range(n)],
        context={"device": rng.integers(0, 3, n), "genres": [rng.integers(0, 50, 2).tolist() for _ in range(n)],
                 "year": rng.integers(1990, 2000, n)},
        dense={"price": rng.random(n).astype(np.float32)})


class TinyLearner:
    """A DeepFM (fp32) trained a little, whose checkpoints feed build_artifact."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.model = DeepFM(CFG, mlp=(8,), seed=seed, autocast_dtype=None)
        s, d = make_optimizers(self.model, lr_sparse=0.3, lr_dense=0.02)
        self.trainer = Trainer(self.model, s, d)
        self.train(4)

    def train(self, batches: int, users: list[Any] | None = None, label: int | None = None) -> list[TensorBatch]:
        out = []
        for _ in range(batches):
            n = len(users) if users else 64
            tb = to_tensors(random_samples(self.rng, n, users, label, start=self.trainer.samples), CFG)
            self.trainer.test_then_train(tb)
            out.append(tb)
        return out

    def checkpoint(self) -> dict[str, Any]:
        return {"meta": {"feature_config": CFG.to_dict(), "model": {"mlp": "8", "dropout": 0.0},
                         "samples_trained": self.trainer.samples, "offsets": {}},
                "model": {k: v.clone() for k, v in self.model.state_dict().items()}, "path": "tiny"}

    @torch.no_grad()
    def eager_scores(self, tb: TensorBatch) -> np.ndarray:
        self.model.eval()
        return torch.sigmoid(self.model(tb.values, tb.offsets, tb.dense)).numpy()


def publish_version(learner: TinyLearner, root: Path, version: str, fmt: str = "torchscript",
                    hot: np.ndarray | None = None) -> Path:
    hot_rows = np.arange(0, CFG.num_rows, 3) if hot is None else hot  # a third hot: both paths exercised
    return publish(root, build_artifact(learner.checkpoint(), root, hot_rows, format=fmt, version=version), keep=30)


# -- the joiner's view of a request ----------------------------------------------------------------------
def joiner_batch(user: Any, items: list[Any], shared_ctx: dict, item_ctx: list[dict], shared_dense: dict,
                 item_dense: list[dict], history: list[int]) -> SampleBatch:
    """The samples the joiner emits for these impressions (stream/joiner/engine.py + sample_rows.py)."""
    rows = []
    for k, (item, ic, idn) in enumerate(zip(items, item_ctx, item_dense, strict=True)):
        p = Pending(f"imp{k}", 10_000, hash_value(user), hash_value(item), hash_context({**shared_ctx, **ic}),
                    {**shared_dense, **idn}, chunk=0, history=history)
        rows.append(Sample(p, 0, 0))
    return to_batch(rows)


REQUEST = {"user_id": "alice", "items": [3, "x", {"item_id": 11, "context": {"genres": ["Drama", "War"], "year": 1999},
                                                  "dense": {"price": 2.5}},
                                         {"item_id": 12, "context": {"year": 2001}}],
           "context": {"device": "ios", "genres": ["Action"]}, "dense": {"price": 1.25}}


def request_as_joiner_batch(req: dict, history: list[int]) -> SampleBatch:
    objs = [it if isinstance(it, dict) else {"item_id": it} for it in req["items"]]
    return joiner_batch(req["user_id"], [o["item_id"] for o in objs], req.get("context", {}),
                        [o.get("context", {}) for o in objs], req.get("dense", {}), [o.get("dense", {}) for o in objs],
                        history)


# -- fixtures --------------------------------------------------------------------------------------------
@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "serving"


def redis_settings(stack: Any, prefix: str) -> RedisSettings:
    return RedisSettings(url=stack.redis_url, prefix=prefix)


def wait_subscribed(client: redis.Redis, channel: str, timeout_s: float = 60.0) -> None:
    """Wait until Redis counts a subscriber on ``channel``: a message published before the updater's thread has
    subscribed is lost (pub/sub keeps nothing), so a fixed sleep made the wake-up tests depend on how soon a loaded
    machine ran that thread. The timeout guards a subscriber that never comes, not a slow one."""
    deadline = time.monotonic() + timeout_s
    while client.pubsub_numsub(channel)[0][1] < 1:
        assert time.monotonic() < deadline, f"nothing subscribed to {channel} after {timeout_s:g} s"
        time.sleep(0.02)


def post(conn: http.client.HTTPConnection, path: str, body: Any) -> tuple[int, dict]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, raw, {"Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, json.loads(r.read())


def get(conn: http.client.HTTPConnection, path: str) -> tuple[int, bytes]:
    conn.request("GET", path)
    r = conn.getresponse()
    return r.status, r.read()


def connect(svc: ScoringService) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", svc.port, timeout=10)


# -- tests -----------------------------------------------------------------------------------------------
def test_request_features_equal_the_joiners_training_tensors(stack, redis_client: redis.Redis, root: Path,
                                                             prefix: str) -> None:
    """No training/serving skew: the encoder's tensors are to_tensors of the batch the joiner would build."""
    learner = TinyLearner()
    publish_version(learner, root, "v001")
    hist = UserHistory(redis_client, prefix=prefix, max_len=200)
    hist.append_many([hash_value("alice")] * 3, [hash_value(i) for i in (7, "eight", 9)], [1000, 3000, 2000])
    with ScoringService(ServeSettings(port=0, publish_root=root, redis_timeout_s=HISTORY_READ_S),
                        redis_settings(stack, prefix)) as svc:
        live = svc.holder.live
        assert live is not None
        (history,) = svc.app._histories([hash_value("alice")])
        assert history == [hash_value(i) for i in (7, 9, "eight")]  # oldest click first, as the joiner attaches
        values, offsets, dense = FeatureEncoder(live.model).encode(parse_request(REQUEST, 100), history)
    want = to_tensors(request_as_joiner_batch(REQUEST, history), CFG)
    # the user row (the user, the history, the shared context) repeated per candidate is the joiner's batch
    cand_values, cand_offsets = to_candidate_rows(values, offsets, CFG.num_fields)
    assert cand_values.tolist() == want.values.tolist()
    assert cand_offsets.tolist() == want.offsets.tolist()
    assert np.array_equal(dense, want.dense.numpy())
    assert len(values) < len(want.values)  # the user's bags once, not once per candidate


@pytest.mark.parametrize("fmt", ["torchscript", "export", "eager"])
def test_served_scores_equal_the_learners_eager_scores(stack, redis_client: redis.Redis, root: Path, prefix: str,
                                                       fmt: str) -> None:
    learner = TinyLearner(seed=1)
    publish_version(learner, root, "v001", fmt=fmt)
    UserHistory(redis_client, prefix=prefix, max_len=200).append_many(
        [hash_value("alice")] * 2, [hash_value(5), hash_value(6)], [1, 2])
    with ScoringService(ServeSettings(port=0, publish_root=root, redis_timeout_s=HISTORY_READ_S),
                        redis_settings(stack, prefix)) as svc:
        status, out = post(connect(svc), "/v1/score", REQUEST)
    assert status == 200, out
    assert out["model_version"] == "v001" and out["delta_seq"] == 0 and len(out["scores"]) == 4
    tb = to_tensors(request_as_joiner_batch(REQUEST, [hash_value(5), hash_value(6)]), CFG)
    want = learner.eager_scores(tb)
    assert np.allclose(out["scores"], want, atol=TOL, rtol=0), (out["scores"], want)
    with torch.no_grad():  # and the reference cache_refresh validates against, rebuilt from the checkpoint
        ref = torch.sigmoid(eager_model(learner.checkpoint())(tb.values, tb.offsets, tb.dense)).numpy()
    assert np.allclose(out["scores"], ref, atol=TOL, rtol=0)


def test_bad_requests_are_4xx_with_messages(stack, root: Path, prefix: str) -> None:
    publish_version(TinyLearner(), root, "v001")
    ss = ServeSettings(port=0, publish_root=root, max_candidates=5, max_batch=2)
    cases: list[tuple[bytes | dict, int, str]] = [
        (b"{not json", 400, "malformed JSON"),
        (b"", 400, "empty body"),
        (b"[1, 2]", 422, "expected a JSON object"),
        ({"user_id": 1, "items": [1], "userid": 2}, 422, "unknown field 'userid'"),
        ({"items": [1]}, 422, "'user_id' is required"),
        ({"user_id": 1.5, "items": [1]}, 422, "field 'user_id'"),
        ({"user_id": 1, "items": "abc"}, 422, "field 'items'"),
        ({"user_id": 1, "items": []}, 422, "empty"),
        ({"user_id": 1, "items": list(range(6))}, 422, "at most 5"),
        ({"user_id": 1, "items": [None]}, 422, "items[0]"),
        ({"user_id": 1, "items": [{"id": 3}]}, 422, "unknown field 'items[0].id'"),
        ({"user_id": 1, "items": [1], "context": {"devise": "ios"}}, 422, "no such context feature; known: device"),
        ({"user_id": 1, "items": [1], "context": {"device": {"a": 1}}}, 422, "context.device"),
        ({"user_id": 1, "items": [1], "dense": {"price": "high"}}, 422, "dense.price"),
        ({"user_id": 1, "items": [1], "dense": {"cost": 1.0}}, 422, "no such dense feature"),
        ({"user_id": 1, "items": [{"item_id": 1, "context": {"year": [1, 2], "x": 1}}]}, 422, "items[0].context.x"),
    ]
    with ScoringService(ss, redis_settings(stack, prefix)) as svc:
        conn = connect(svc)
        for body, status, text in cases:
            got, out = post(conn, "/v1/score", body)
            assert (got, text in out.get("error", "")) == (status, True), (body, got, out)
        got, out = post(conn, "/v1/score:batch", {"requests": [{"user_id": 1, "items": [1]}] * 3})
        assert got == 422 and "at most 2" in out["error"]
        got, out = post(conn, "/v1/score:batch", {"requests": [{"user_id": 1, "items": [1]}, {"user_id": 1}]})
        assert got == 422 and "'requests[1].items' is required" in out["error"]
        two = {"requests": [{"user_id": 1, "items": [1]}, {"user_id": 2, "items": [1, 2]}]}
        got, out = post(conn, "/v1/score:batch", two)
        assert got == 200 and [len(r["scores"]) for r in out["results"]] == [1, 2]
        assert post(conn, "/v1/nope", {})[0] == 404
        status, body = get(conn, "/v1/score")
        assert status == 405 and b"use POST" in body
        status, body = get(conn, "/openapi.json")
        spec = json.loads(body)
        assert status == 200 and spec["openapi"].startswith("3.") and "/v1/score" in spec["paths"]
        assert spec["components"]["schemas"]["ScoreRequest"]["properties"]["items"]["maxItems"] == 5
        status, body = get(conn, "/metrics")
        text = body.decode()
        assert status == 200 and 'streamrec_serving_requests_total{endpoint="/v1/score",status="422"}' in text
        assert "streamrec_serving_hot_cache_hit_rate" in text and 'version="v001"' in text


def test_no_artifact_is_503_until_one_is_published(stack, root: Path, prefix: str) -> None:
    with ScoringService(ServeSettings(port=0, publish_root=root, poll_s=0.05), redis_settings(stack, prefix)) as svc:
        conn = connect(svc)
        status, out = post(conn, "/v1/score", {"user_id": 1, "items": [1]})
        assert status == 503 and "streamrec refresh --now" in out["error"]
        assert get(conn, "/readyz")[0] == 503 and get(conn, "/healthz")[0] == 200
        publish_version(TinyLearner(), root, "v001")
        deadline = time.monotonic() + 5
        while get(conn, "/readyz")[0] != 200:
            assert time.monotonic() < deadline, "the first publish was not picked up"
            time.sleep(0.02)
        assert post(conn, "/v1/score", {"user_id": 1, "items": [1]})[1]["model_version"] == "v001"


def test_a_corrupt_artifact_is_rejected_and_the_live_one_keeps_serving(stack, root: Path, prefix: str) -> None:
    learner = TinyLearner()
    publish_version(learner, root, "v001")
    with ScoringService(ServeSettings(port=0, publish_root=root, poll_s=3600), redis_settings(stack, prefix)) as svc:
        conn = connect(svc)
        before = post(conn, "/v1/score", REQUEST)[1]
        # truncated cold rows, then a scorer file with one byte flipped (same size): both fail the manifest.
        # (publish verifies what it renames, so the damage is done after publishing: a disk going bad.)
        for version, name, damage in (("v002", "cold_rows.npy", "truncate"), ("v003", "scorer.pt", "flip")):
            published = publish(root, build_artifact(learner.checkpoint(), root, np.arange(10), version=version),
                                keep=30)
            path = published / name
            data = bytearray(path.read_bytes())
            if damage == "truncate":
                del data[len(data) // 2:]
            else:
                data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
            svc.updater.check_now()
            status, out = post(conn, "/v1/score", REQUEST)
            assert status == 200 and out == before  # same model, same scores
            assert get(conn, "/readyz")[0] == 200
        assert svc.updater.last_error is not None and "sha256" in svc.updater.last_error
        metrics = get(conn, "/metrics")[1].decode()
        assert "streamrec_serving_swap_rejected_total 2.0" in metrics
        publish_version(learner, root, "v004")  # a good one is taken again
        svc.updater.check_now()
        assert post(conn, "/v1/score", REQUEST)[1]["model_version"] == "v004"


def test_a_delta_changes_the_touched_users_score_and_delta_seq_increases(stack, root: Path, prefix: str,
                                                                          tmp_path: Path) -> None:
    learner = TinyLearner(seed=2)
    deltas = tmp_path / "deltas"
    writer = DeltaWriter(deltas, CFG.num_rows, every_s=3600)
    publish_version(learner, root, "v001")
    ss = ServeSettings(port=0, publish_root=root, deltas_dir=deltas, poll_s=3600)
    req = {"user_id": "bob", "items": [1, 2, 3], "context": {"device": 1, "genres": [4, 5], "year": 1995}}
    with ScoringService(ss, None) as svc:
        conn = connect(svc)
        before = post(conn, "/v1/score", req)[1]
        for tb in learner.train(5, users=["bob"] * 32, label=1):  # bob clicks a lot
            writer.mark(tb.values)
        writer.write(learner.model, learner.trainer.samples)
        svc.updater.check_now()
        after = post(conn, "/v1/score", req)[1]
        assert after["model_version"] == "v001" and (before["delta_seq"], after["delta_seq"]) == (0, 1)
        assert np.all(np.array(after["scores"]) > np.array(before["scores"]) + 1e-3)
        want = learner.eager_scores(to_tensors(request_as_joiner_batch(req, []), CFG))
        assert np.allclose(after["scores"], want, atol=TOL, rtol=0)  # the delta made it the learner's model
        # A newer artifact built after the delta skips it (already inside) and answers the same scores.
        publish_version(learner, root, "v002")
        svc.updater.check_now()
        again = post(conn, "/v1/score", req)[1]
        assert again["model_version"] == "v002" and again["delta_seq"] == 0
        assert np.allclose(again["scores"], want, atol=TOL, rtol=0)


def test_pubsub_wakes_serving_before_its_next_poll(stack, root: Path, prefix: str) -> None:
    learner = TinyLearner()
    publish_version(learner, root, "v001")
    with ScoringService(ServeSettings(port=0, publish_root=root, poll_s=3600), redis_settings(stack, prefix)) as svc:
        conn = connect(svc)
        publish_version(learner, root, "v002")
        with redis.Redis.from_url(stack.redis_url) as client:
            wait_subscribed(client, artifact_channel(prefix))
            client.publish(artifact_channel(prefix), "v002")
        deadline = time.monotonic() + 30  # a hang guard: without the wake, the next poll is an hour away
        while post(conn, "/v1/score", REQUEST)[1]["model_version"] != "v002":
            assert time.monotonic() < deadline, "the update message did not wake serving"
            time.sleep(0.02)


def test_20_swaps_and_a_stream_of_deltas_under_load_fail_no_request(stack, redis_client: redis.Redis, root: Path,
                                                                     prefix: str, tmp_path: Path) -> None:
    learner = TinyLearner(seed=3)
    deltas = tmp_path / "deltas"
    writer = DeltaWriter(deltas, CFG.num_rows, every_s=3600, keep=10,
                         notify=lambda seq: redis_client.publish(f"{prefix}:model-deltas", str(seq)) and None)
    publish_version(learner, root, "v000")
    ss = ServeSettings(port=0, publish_root=root, deltas_dir=deltas, poll_s=0.05)
    failures: list[Any] = []
    seen: list[tuple[str, int]] = []
    stop = threading.Event()

    def client(k: int, svc: ScoringService) -> None:
        conn = connect(svc)
        body = {**REQUEST, "user_id": f"user{k}"}
        while not stop.is_set():
            try:
                status, out = post(conn, "/v1/score", body)
            except Exception as exc:  # noqa: BLE001 - every failure is recorded and fails the test
                failures.append(repr(exc))
                conn = connect(svc)
                continue
            if status != 200 or len(out["scores"]) != 4 or not all(0 < s < 1 for s in out["scores"]):
                failures.append((status, out))
            else:
                seen.append((out["model_version"], out["delta_seq"]))

    with ScoringService(ss, redis_settings(stack, prefix)) as svc:
        threads = [threading.Thread(target=client, args=(k, svc)) for k in range(3)]
        for t in threads:
            t.start()
        try:
            for i in range(1, 21):
                for _ in range(2):  # deltas between artifacts
                    for tb in learner.train(1):
                        writer.mark(tb.values)
                    writer.write(learner.model, learner.trainer.samples)
                    time.sleep(0.06)
                publish_version(learner, root, f"v{i:03d}", hot=np.arange(0, CFG.num_rows, 1 + i % 4))
                redis_client.publish(artifact_channel(prefix), f"v{i:03d}")
            for tb in learner.train(1):
                writer.mark(tb.values)
            writer.write(learner.model, learner.trainer.samples)
            deadline = time.monotonic() + 10
            while not seen or seen[-1] != ("v020", writer.seq):
                assert time.monotonic() < deadline, f"serving did not reach v020 + delta {writer.seq}: {seen[-1:]}"
                time.sleep(0.02)
        finally:
            stop.set()
            for t in threads:
                t.join()
        swaps = get(connect(svc), "/metrics")[1].decode()
    assert failures == []
    versions = {v for v, _ in seen}
    assert len(versions) >= 5 and "v020" in versions, sorted(versions)
    assert "streamrec_serving_swaps_total 21.0" in swaps
    assert max(s for _, s in seen) == writer.seq and len(seen) > 100


def test_streamrec_serve_command_serves_and_exits_cleanly_on_sigterm(stack, root: Path, prefix: str) -> None:
    publish_version(TinyLearner(), root, "v001")
    env = dict(os.environ, STREAMREC_REDIS_URL=stack.redis_url, STREAMREC_REDIS_PREFIX=prefix)
    proc = subprocess.Popen([sys.executable, "-m", "streamrec.cli", "serve", "--port", "0", "--publish-root", str(root),
                             "--json"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        line = ""
        while "serving on" not in line:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "streamrec serve died at start"
        port = int(line.split("serving on http://127.0.0.1:")[1].split()[0])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        status, out = post(conn, "/v1/score", {"user_id": 1, "items": [1, 2]})
        assert status == 200 and out["model_version"] == "v001"
        proc.send_signal(signal.SIGTERM)
        stdout, _ = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["model_version"] == "v001" and summary["requests"] == 1


def test_openapi_and_request_schema_stay_in_step() -> None:
    """Every top-level request field the parser accepts is in the OpenAPI schema, and no other."""
    from serving.request import _REQUEST_FIELDS, openapi

    props = openapi(10, 2, "0")["components"]["schemas"]["ScoreRequest"]["properties"]
    assert set(props) == set(_REQUEST_FIELDS)

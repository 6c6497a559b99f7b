"""``serving/app.py`` (ScoringApp.handle(method, path, body) -> (status, content type, body)), no HTTP server.

Routes and statuses (404 naming the endpoints, 405 naming the methods, 413, 503 before a model and while
draining), the bodies of ``/healthz`` and ``/readyz``, ``/openapi.json`` naming the live model's features,
``/metrics`` text, scores of a real published artifact (equal to the learner's eager model on the same
tensors, with the user's history), JSON errors that say what to fix, the batch route, a bug costing one
request (500), and a Redis that is unavailable: scored without history and counted, never an error.
The model is wired as ``serving/service.py`` wires it: ModelHolder + ModelUpdater.check_now + ServingMetrics.
"""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from serving.app import JSON, PROMETHEUS, ScoringApp
from serving.lookup_counts import LookupCounts
from serving.metrics import ServingMetrics
from serving.settings import ServeSettings
from serving.swap import ModelHolder, ModelUpdater
from stream.features import hash_value
from stream.history import UserHistory
from stream.limits import DEFAULT_LIMITS, EventLimits
from streamrec.stack import free_port
from tests.integration.test_serving import REQUEST, TOL, TinyLearner, publish_version
from tests.integration.test_serving_faults import eager
from tests.unit.serving.test_lookup_counts import FakeCounts

MAX_CANDIDATES, MAX_BATCH, MAX_BODY = 5, 2, 10_000
SIMPLE = {"user_id": "alice", "items": [1, 2, 3]}


class FakeHistory:
    """``UserHistory.as_of`` over a dict (user hash -> clicked item hashes, oldest first)."""

    def __init__(self, clicks: dict[int, list[int]] | None = None) -> None:
        self.clicks = clicks or {}
        self.calls = 0

    def as_of(self, users: list[int], _ts: list[int]) -> list[list[int]]:
        self.calls += 1
        return [list(self.clicks.get(u, [])) for u in users]


def make_app(root: Path, history: Any = None, history_len: int = 50, lookups: LookupCounts | None = None,
             deltas: Path | None = None, limits: EventLimits = DEFAULT_LIMITS, **settings: Any) -> ScoringApp:
    ss = ServeSettings(port=0, publish_root=root, device="cpu", max_candidates=MAX_CANDIDATES, max_batch=MAX_BATCH,
                       max_body_bytes=MAX_BODY, **settings)
    holder = ModelHolder()
    metrics = ServingMetrics(holder.model)
    ModelUpdater(holder, metrics, root, deltas, device="cpu").check_now()  # what ScoringService.start does first
    return ScoringApp(ss, holder, metrics, history, history_len=history_len, version="9.9.9", lookups=lookups,
                      limits=limits)


def call(app: ScoringApp, method: str, path: str, body: Any = b"") -> tuple[int, str, Any]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, ctype, out = app.handle(method, path, raw)
    return status, ctype, (json.loads(out) if ctype == JSON else out.decode())


def sample(app: ScoringApp, name: str, labels: dict[str, str] | None = None) -> float:
    return app.metrics.registry.get_sample_value(name, labels or {}) or 0.0


@pytest.fixture(scope="module")
def learner() -> TinyLearner:
    return TinyLearner(seed=31)


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory, learner: TinyLearner) -> Path:
    root = tmp_path_factory.mktemp("app") / "serving"
    publish_version(learner, root, "v001")
    return root


# -- without a model ---------------------------------------------------------------------------------------------
def test_before_a_model_healthz_is_200_readyz_and_score_are_503_saying_why(tmp_path: Path) -> None:
    app = make_app(tmp_path / "empty")
    assert call(app, "GET", "/healthz") == (200, JSON, {"status": "ok"})
    status, ctype, out = call(app, "GET", "/readyz")
    assert (status, ctype) == (503, JSON) and out["error"] == f"no model loaded yet from {tmp_path / 'empty'}"
    status, _, out = call(app, "POST", "/v1/score", SIMPLE)
    assert status == 503 and "nothing is published (no CURRENT file)" in out["error"]
    assert "streamrec refresh --now" in out["error"]
    assert call(app, "POST", "/v1/score:batch", {"requests": [SIMPLE]})[0] == 503
    app.holder.problem = "checksum mismatch in dense.pt"  # what ModelUpdater sets when it rejects an artifact
    assert call(app, "GET", "/readyz")[2]["error"].endswith(": the published artifact was rejected "
                                                            "(checksum mismatch in dense.pt)")
    assert "the published artifact was rejected (checksum mismatch" in call(app, "POST", "/v1/score", SIMPLE)[2][
        "error"]


def test_unknown_paths_are_404_naming_the_endpoints_and_wrong_methods_405_naming_the_allowed(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    status, _, out = call(app, "GET", "/v2/score")
    assert status == 404 and out["error"] == ("no endpoint /v2/score; endpoints: /healthz, /metrics, /openapi.json, "
                                              "/readyz, /v1/score, /v1/score:batch")
    status, _, out = call(app, "GET", "/v1/score")
    assert status == 405 and out["error"] == "GET /v1/score: method not allowed; use POST"
    status, _, out = call(app, "DELETE", "/readyz?probe=1")  # the query string is not part of the path
    assert status == 405 and out["error"] == "DELETE /readyz: method not allowed; use GET"
    assert app.allowed_methods("/v1/score") == ["POST"]
    assert app.allowed_methods("/readyz?x=1") == ["GET", "HEAD"]  # HEAD goes with GET (the Allow header)
    assert app.allowed_methods("/nowhere") == []
    assert call(app, "GET", "/healthz?verbose=1")[0] == 200


def test_a_long_path_or_method_is_quoted_cut_short_in_a_404_or_405(tmp_path: Path) -> None:
    """The threading server takes request lines of up to 64 KiB: its 404 / 405 quoted all of it back."""
    app = make_app(tmp_path)
    status, _, out = call(app, "GET", "/" + "a" * 60_000)
    assert status == 404 and out["error"].startswith("no endpoint /" + "a" * 199 + "... (59,801 more chars); "
                                                      "endpoints: /healthz"), out
    assert len(out["error"]) < 350 and out["error"].isprintable()
    status, _, out = call(app, "M" * 60_000, "/readyz")  # no method the server knows: a 501
    assert status == 501 and out["error"].startswith("method '" + "M" * 38 + "'... (59,962 more chars) is not "
                                                      "implemented"), out
    status, _, out = call(app, "GET", "/no\tsuch")
    assert status == 404 and out["error"].startswith("no endpoint /no\\tsuch; endpoints:"), out  # escaped


def test_a_body_over_max_body_bytes_is_413_before_it_is_parsed(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    status, _, out = app.handle("POST", "/v1/score", b"{" * (MAX_BODY + 1))
    assert status == 413 and json.loads(out)["error"] == f"body of {MAX_BODY + 1} bytes exceeds {MAX_BODY}"
    assert call(app, "POST", "/v1/score", b"{" * MAX_BODY)[0] == 400  # at the limit: parsed (and malformed)


def test_metrics_is_prometheus_text_counting_requests_by_endpoint_and_status(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    call(app, "GET", "/healthz")
    call(app, "GET", "/nope")
    call(app, "POST", "/v1/score", SIMPLE)
    status, ctype, text = call(app, "GET", "/metrics")
    assert (status, ctype) == (200, PROMETHEUS)
    assert 'streamrec_serving_requests_total{endpoint="/healthz",status="200"} 1.0' in text
    assert 'streamrec_serving_requests_total{endpoint="other",status="404"} 1.0' in text  # unknown paths: one label
    assert 'streamrec_serving_requests_total{endpoint="/v1/score",status="503"} 1.0' in text
    assert "streamrec_serving_request_seconds_bucket" in text
    assert app.in_flight == 0 and sample(app, "streamrec_serving_in_flight") == 0


def test_readyz_is_503_while_draining(published: Path) -> None:
    app = make_app(published)
    assert call(app, "GET", "/readyz")[0] == 200
    app.draining = True  # ScoringService.stop sets it: balancers stop sending
    assert call(app, "GET", "/readyz") == (503, JSON, {"error": "shutting down"})
    assert call(app, "GET", "/healthz")[0] == 200


# -- with a published artifact ------------------------------------------------------------------------------------
def test_readyz_and_openapi_describe_the_live_model(published: Path) -> None:
    app = make_app(published)
    assert call(app, "GET", "/readyz") == (200, JSON, {"status": "ready", "model_version": "v001",
                                                       "format": "torchscript", "delta_seq": 0, "problem": None})
    status, ctype, doc = call(app, "GET", "/openapi.json")
    assert (status, ctype) == (200, JSON) and doc["openapi"].startswith("3.") and doc["info"]["version"] == "9.9.9"
    props = doc["components"]["schemas"]["ScoreRequest"]["properties"]
    assert set(props["context"]["properties"]) == {"device", "genres", "year"}  # the artifact's features
    assert props["context"]["additionalProperties"] is False and set(props["dense"]["properties"]) == {"price"}
    assert props["items"]["maxItems"] == MAX_CANDIDATES
    assert set(doc["paths"]) == {"/v1/score", "/v1/score:batch", "/healthz", "/readyz", "/metrics", "/openapi.json"}
    assert app.openapi_document() is app.openapi_document()  # built once per live model, not per request


def test_a_model_swapped_out_is_freed_though_openapi_json_described_it(tmp_path: Path, learner: TinyLearner) -> None:
    # /openapi.json cached its document with the encoder it described, and the encoder holds its model: the model
    # swapped out (its scorer, hot rows, memory-mapped table) stayed referenced until the next /openapi.json.
    root = tmp_path / "serving"
    publish_version(learner, root, "v001")
    app = make_app(root)
    assert call(app, "GET", "/openapi.json")[0] == 200 and call(app, "POST", "/v1/score", SIMPLE)[0] == 200
    assert app.holder.live is not None
    old = weakref.ref(app.holder.live.model)
    publish_version(learner, root, "v002")
    ModelUpdater(app.holder, app.metrics, root, None, device="cpu").check_now()
    assert call(app, "POST", "/v1/score", SIMPLE)[2]["model_version"] == "v002"
    gc.collect()
    assert old() is None, "the swapped-out model is still referenced"


def test_openapi_without_a_model_allows_any_feature_name(tmp_path: Path) -> None:
    doc = json.loads(make_app(tmp_path).openapi_document())
    ctx = doc["components"]["schemas"]["ScoreRequest"]["properties"]["context"]
    assert "properties" not in ctx or not ctx["properties"]
    assert ctx.get("additionalProperties", True) is not False


def test_openapi_states_the_limits_requests_are_checked_against(tmp_path: Path) -> None:
    """The document said the built-in 256 characters and 1024 list entries whatever [limits] the server checked."""
    limits = EventLimits(max_str_len=512, max_list_len=2048, max_context_keys=80)
    request = json.loads(make_app(tmp_path, limits=limits).openapi_document())["components"]["schemas"]["ScoreRequest"]
    user, ctx = request["properties"]["user_id"], request["properties"]["context"]
    assert [s.get("maxLength") for s in user["oneOf"]] == [None, 512]
    assert ctx["maxProperties"] == 80
    text, *_, lists = ctx["additionalProperties"]["anyOf"]
    assert (text["maxLength"], lists["maxItems"]) == (512, 2048)


def test_scores_equal_the_learners_eager_model_with_the_users_history(published: Path, learner: TinyLearner) -> None:
    clicks = [hash_value(i) for i in (5, 6, 7)]
    history = FakeHistory({hash_value(REQUEST["user_id"]): clicks})
    app = make_app(published, history, history_len=2)  # the last history_len clicks, as the joiner attaches
    status, ctype, out = call(app, "POST", "/v1/score", REQUEST)
    assert (status, ctype) == (200, JSON), out
    assert out["model_version"] == "v001" and out["delta_seq"] == 0 and len(out["scores"]) == len(REQUEST["items"])
    assert np.allclose(out["scores"], eager(learner, REQUEST, clicks[-2:]), atol=TOL, rtol=0)
    assert not np.allclose(out["scores"], eager(learner, REQUEST, []), atol=TOL, rtol=0)  # the history mattered
    assert sample(app, "streamrec_serving_candidates_total") == len(REQUEST["items"])
    assert sample(app, "streamrec_serving_requests_total", {"endpoint": "/v1/score", "status": "200"}) == 1


def test_the_batch_route_answers_each_request_as_the_single_route_does(published: Path) -> None:
    history = FakeHistory({hash_value("bob"): [hash_value(9)]})
    app = make_app(published, history)
    reqs = [REQUEST, {"user_id": "bob", "items": [1, "x"], "context": {"device": "android"}}]
    status, _, out = call(app, "POST", "/v1/score:batch", {"requests": reqs})
    assert status == 200 and len(out["results"]) == 2
    for req, res in zip(reqs, out["results"], strict=True):
        single = call(app, "POST", "/v1/score", req)[2]
        assert res["model_version"] == "v001" and np.allclose(res["scores"], single["scores"], atol=1e-7, rtol=0)
    status, _, out = call(app, "POST", "/v1/score:batch", {"requests": [SIMPLE] * (MAX_BATCH + 1)})
    assert status == 422 and f"at most {MAX_BATCH} per batch call" in out["error"]
    status, _, out = call(app, "POST", "/v1/score:batch", {"requests": [SIMPLE, {"user_id": 1}]})
    assert status == 422 and "'requests[1].items' is required" in out["error"]


@pytest.mark.parametrize(("body", "status", "words"), [
    (b"{not json", 400, "malformed JSON"),
    (b"", 400, "empty body"),
    (b"[1, 2]", 422, "expected a JSON object"),
    ({"items": [1]}, 422, "field 'user_id' is required"),
    ({"user_id": 1, "items": []}, 422, "empty; send at least one candidate"),
    ({"user_id": 1, "items": list(range(MAX_CANDIDATES + 1))}, 422, f"at most {MAX_CANDIDATES}"),
    ({"user_id": 1, "items": [1], "context": {"devise": "ios"}}, 422, "no such context feature; known: device"),
    ({"user_id": 1, "items": [1], "dense": {"price": "high"}}, 422, "dense.price"),
])
def test_a_malformed_request_is_a_json_4xx_naming_what_to_fix(published: Path, body: Any, status: int,
                                                              words: str) -> None:
    app = make_app(published)
    got, ctype, out = call(app, "POST", "/v1/score", body)
    assert (got, ctype) == (status, JSON) and set(out) == {"error"} and words in out["error"], out


def test_ids_as_long_as_the_configured_limits_allow_are_scored_not_refused(published: Path) -> None:
    """[limits] max_str_len raised for the joiner (ids of 300 characters trained on) holds for serving too: it refused
    every request of such a user or item with a 422, whatever the learner had learned for them."""
    long_user, long_item = "u" * 300, "i" * 300
    single = {"user_id": long_user, "items": [long_item, {"item_id": long_item}]}
    default = make_app(published)
    assert call(default, "POST", "/v1/score", single)[0] == 422  # past the default 256 characters
    app = make_app(published, limits=EventLimits(max_str_len=512))
    status, _, out = call(app, "POST", "/v1/score", single)
    assert status == 200 and len(out["scores"]) == 2, out
    status, _, out = call(app, "POST", "/v1/score:batch", {"requests": [single, SIMPLE]})
    assert status == 200 and [len(r["scores"]) for r in out["results"]] == [2, 3], out


def test_a_bug_while_scoring_costs_that_request_a_500_not_the_app(published: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    app = make_app(published)
    monkeypatch.setattr(app, "_run", lambda *_a: 1 / 0)
    assert call(app, "POST", "/v1/score", SIMPLE) == (
        500, JSON, {"error": "internal error while scoring; see the service log"})
    assert app.in_flight == 0  # counted out whatever happened
    monkeypatch.undo()
    assert call(app, "POST", "/v1/score", SIMPLE)[0] == 200


def test_an_unavailable_redis_scores_without_history_and_counts_it(published: Path, learner: TinyLearner) -> None:
    # A real UserHistory on a port nothing listens on, built like ScoringService builds it (no retries).
    client = redis.Redis(port=free_port(), socket_timeout=0.2, socket_connect_timeout=0.2,
                         retry=Retry(NoBackoff(), 0), retry_on_error=[])
    try:
        app = make_app(published, UserHistory(client, prefix="nobody"), history_retry_after_s=3600)
        for _ in range(2):
            status, _, out = call(app, "POST", "/v1/score", REQUEST)
            assert status == 200 and np.allclose(out["scores"], eager(learner, REQUEST, []), atol=TOL, rtol=0)
        status, _, out = call(app, "POST", "/v1/score:batch", {"requests": [REQUEST, SIMPLE]})
        assert status == 200 and len(out["results"]) == 2
    finally:
        client.close()
    assert sample(app, "streamrec_serving_history_unavailable_total") == 3  # every request scored without it
    assert sample(app, "streamrec_serving_history_errors_total") == 1  # Redis tried once, then skipped (breaker)


def test_no_history_reader_means_no_history_and_nothing_counted(published: Path, learner: TinyLearner) -> None:
    app = make_app(published, None)
    status, _, out = call(app, "POST", "/v1/score", REQUEST)
    assert status == 200 and np.allclose(out["scores"], eager(learner, REQUEST, []), atol=TOL, rtol=0)
    assert sample(app, "streamrec_serving_history_unavailable_total") == 0


@pytest.mark.parametrize(("body", "words"), [
    (b'{"user_id":"a","user_id":"b","items":[1]}', "duplicate key 'user_id'"),
    (b'{"user_id":"a","items":[1],"items":[2,3]}', "duplicate key 'items'"),
    (b'{"user_id":"a","items":[1],"context":{"device":"ios","device":"web"}}', "duplicate key 'device'"),
    (b'{"user_id":"a","items":[{"item_id":1,"item_id":2}]}', "duplicate key 'item_id'"),
    (b'{"user_id" : "a:b", "items" : [1], "user_id" : "c"}', "duplicate key 'user_id'"),  # spaces, a colon in a value
])
def test_a_request_repeating_a_key_is_422_not_scored_on_the_last_value(published: Path, body: bytes,
                                                                       words: str) -> None:
    # a parser keeps the last value: a gateway that checked the first would disagree with what is scored
    got, _, out = call(make_app(published), "POST", "/v1/score", body)
    assert got == 422 and words in out["error"], out
    batch = b'{"requests":[' + body + b"]}"
    got, _, out = call(make_app(published), "POST", "/v1/score:batch", batch)
    assert got == 422 and words in out["error"], out


def test_colons_and_spaces_in_a_request_without_repeated_keys_are_scored(published: Path) -> None:
    body = b'{ "user_id" : "user:42", "items" : [ 1, {"item_id": "i:7", "context": {"genres": ["Sci-Fi: B"]}} ] }'
    got, _, out = call(make_app(published), "POST", "/v1/score", body)
    assert got == 200 and len(out["scores"]) == 2, out


def test_errors_in_a_batch_name_the_request_they_are_in(published: Path) -> None:
    app = make_app(published)
    cases = [({"user_id": "a", "items": [1], "context": {"zz": 1}}, "'requests[1].context.zz'"),
             ({"user_id": "a", "items": [1], "dense": {"zz": 1.0}}, "'requests[1].dense.zz'"),
             ({"user_id": "a", "items": [{"item_id": 1, "context": {"zz": 1}}]}, "'requests[1].items[0].context.zz'"),
             ({"user_id": "a", "items": [{"item_id": 1, "dense": {"zz": 1.0}}]}, "'requests[1].items[0].dense.zz'"),
             ({"user_id": "a", "items": [{"context": {}}]}, "field 'requests[1].items[0].item_id' is required"),
             (7, "requests[1]: expected a JSON object")]
    for bad, words in cases:
        got, _, out = call(app, "POST", "/v1/score:batch", {"requests": [SIMPLE, bad]})
        assert got == 422 and words in out["error"], (bad, out)


def test_a_context_field_sent_per_item_is_refused_past_max_request_values(published: Path) -> None:
    # one item overriding a field makes every candidate carry it: a shared list of 1,024 x the candidates
    shared = {"genres": [f"g{i}" for i in range(1000)]}
    items = [{"item_id": 0, "context": {"genres": ["Drama"]}}, 1, 2, 3, 4]
    app = make_app(published, max_request_values=1000)
    got, _, out = call(app, "POST", "/v1/score", {"user_id": "a", "items": items, "context": shared})
    assert got == 422 and "max_request_values" in out["error"] and "'context.genres'" in out["error"], out
    got, _, out = call(app, "POST", "/v1/score", {"user_id": "a", "items": items,
                                                  "context": {"genres": shared["genres"][:199]}})
    assert got == 200 and len(out["scores"]) == 5, out  # 5 + 1 + 4 x 199 = 802 values: under the bound
    got, _, out = call(app, "POST", "/v1/score", {"user_id": "a", "items": [0, 1, 2, 3, 4],
                                                  "context": {"genres": shared["genres"][:995]}})
    assert got == 200, out  # shared and not overridden: once in the user row, counted once (5 + 995), not expanded


def test_max_request_values_bounds_a_whole_batch_call_not_each_request(published: Path) -> None:
    # Each request alone is under the bound (5 + 1 + 4 x 199 = 802 values of 1,000); a batch of two asks for 1,604:
    # checked per request, max_batch requests multiplied the limit (64 x 262,144 from a ~400 KB body by default).
    one = {"user_id": "a", "items": [{"item_id": 0, "context": {"genres": ["Drama"]}}, 1, 2, 3, 4],
           "context": {"genres": [f"g{i}" for i in range(199)]}}
    app = make_app(published, max_request_values=1000)
    assert call(app, "POST", "/v1/score", one)[0] == 200
    got, _, out = call(app, "POST", "/v1/score:batch", {"requests": [one, one]})
    assert got == 422, out  # the single route's status for the same limit
    assert "max_request_values" in out["error"] and "1,000" in out["error"] and "1,604" in out["error"], out
    assert "requests[1]" in out["error"], out
    # bare candidates count too: 5 + 5 of them under a bound of 8 (no context sent per item)
    app = make_app(published, max_request_values=8)
    bare = {"user_id": "a", "items": [0, 1, 2, 3, 4]}
    assert call(app, "POST", "/v1/score", bare)[0] == 200
    got, _, out = call(app, "POST", "/v1/score:batch", {"requests": [bare, bare]})
    assert got == 422 and "max_request_values" in out["error"] and "10" in out["error"], out


def test_max_request_values_counts_the_shared_context_values_on_the_single_and_batch_routes(published: Path) -> None:
    # A shared list is looked up once (the user row), yet it is rows the call reads: uncounted, a batch of max_batch
    # requests each sharing max_list_len values per context field looked up far past the bound.
    app = make_app(published, max_request_values=1000)
    huge = {"user_id": "a", "items": [1, 2, 3, 4, 5], "context": {"genres": [f"g{i}" for i in range(996)]}}
    got, _, out = call(app, "POST", "/v1/score", huge)  # 5 candidates + 996 shared values = 1,001
    assert got == 422 and "max_request_values" in out["error"] and "1,001" in out["error"], out
    assert "'context.genres'" in out["error"], out
    huge["context"]["genres"].pop()  # type: ignore[attr-defined]
    assert call(app, "POST", "/v1/score", huge)[0] == 200  # 1,000: at the bound
    half = {"user_id": "a", "items": [1, 2, 3, 4, 5], "context": {"genres": [f"g{i}" for i in range(600)]}}
    got, _, out = call(app, "POST", "/v1/score:batch", {"requests": [half, half]})  # 605 + 605
    assert got == 422 and "max_request_values" in out["error"] and "1,210" in out["error"], out
    assert "requests[1]" in out["error"], out


def test_a_call_refused_while_encoded_scores_counts_and_reports_nothing(published: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # A batch whose second request names a feature the model lacks, and a request past max_request_values: both are
    # found by the encoder, after the first request's (or the items') rows were looked up. The 422 must come before
    # any forward pass, any candidate counted as scored, and any lookup reported to the hot set's counts.
    counts = FakeCounts()
    lookups = LookupCounts(counts)  # type: ignore[arg-type]
    app = make_app(published, lookups=lookups, max_request_values=10)
    forward_passes: list[int] = []
    model = app.holder.live.model  # type: ignore[union-attr]
    score_arrays = model.score_arrays  # what the app scores with (serving/app.py _run)

    def counted(*args: Any, **kwargs: Any) -> Any:
        forward_passes.append(1)
        return score_arrays(*args, **kwargs)

    monkeypatch.setattr(model, "score_arrays", counted)
    refused = [("/v1/score:batch", {"requests": [SIMPLE, {"user_id": "a", "items": [1], "context": {"zz": 1}}]}),
               ("/v1/score", {"user_id": "a", "items": [{"item_id": 0, "context": {"genres": ["Drama"]}}, 1, 2],
                              "context": {"genres": [f"g{i}" for i in range(9)]}})]
    for path, body in refused:
        got, _, out = call(app, "POST", path, body)
        assert got == 422, out
    assert forward_passes == [] and sample(app, "streamrec_serving_candidates_total") == 0
    assert lookups.flush() == 0 and counts.calls == []
    got, _, out = call(app, "POST", "/v1/score:batch", {"requests": [SIMPLE, {"user_id": "b", "items": [4]}]})
    assert got == 200 and forward_passes == [1, 1] and sample(app, "streamrec_serving_candidates_total") == 4
    assert lookups.flush() == 6  # 2 users and 4 items, reported once answered


def test_a_batch_refused_for_its_last_request_looks_up_no_rows_and_records_no_lookup_counts(
        published: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The first request is valid, the last one names a feature the model lacks (or takes the call past
    # max_request_values): the first one's ids were mapped to rows (ScoringModel.map_rows, which counts them in
    # streamrec_serving_id_lookups_total) before the last was refused. A refused call has no side effects: every
    # request is checked before any row is looked up.
    counts = FakeCounts()
    lookups = LookupCounts(counts)  # type: ignore[arg-type]
    app = make_app(published, lookups=lookups, max_request_values=10)
    model = app.holder.live.model  # type: ignore[union-attr]
    mapped: list[int] = []
    map_rows = model.map_rows

    def spy(field_index: int, hashed: np.ndarray, live: Any = None) -> np.ndarray:
        mapped.append(len(hashed))
        return map_rows(field_index, hashed, live)

    monkeypatch.setattr(model, "map_rows", spy)
    refused = [{"user_id": "b", "items": [4], "context": {"zz": 1}}, {"user_id": "b", "items": [4], "dense": {"zz": 1}},
               {"user_id": "b", "items": [4, 5], "context": {"genres": [f"g{i}" for i in range(6)]}}]  # 3 + 2 + 6 > 10
    for last in refused:
        got, _, out = call(app, "POST", "/v1/score:batch", {"requests": [SIMPLE, last]})
        assert got == 422 and "requests[1]" in out["error"], out
    assert mapped == [] and lookups.flush() == 0 and counts.calls == []
    got, _, out = call(app, "POST", "/v1/score:batch", {"requests": [SIMPLE, {"user_id": "b", "items": [4]}]})
    assert got == 200 and sum(mapped) > 0 and lookups.flush() == 6  # (the spy sees the rows of an answered call)


def test_non_finite_scores_are_a_503_counted_and_logged_once_never_a_200_with_nulls(
        published: Path, learner: TinyLearner, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # A model past the delta bounds (here: the bound lifted; a learner's dense weights x 1e30) scores NaN, which
    # orjson writes as null: a client read 200 with {"scores": [null, null, null]}.
    import torch

    import serving.model

    monkeypatch.setattr(serving.model, "MAX_DENSE_ABS", float("inf"))
    app = make_app(published)
    model = app.holder.live.model  # type: ignore[union-attr]
    dense = {k: v * 1e30 for k, v in learner.model.state_dict().items() if not k.startswith("sparse.")}
    model.apply_delta(torch.zeros(0, dtype=torch.int64), torch.zeros(0, model.table.shape[1]), dense, 1)
    with caplog.at_level("ERROR", logger="streamrec.serve"):
        got, _, out = call(app, "POST", "/v1/score", SIMPLE)
        assert got == 503 and "non-finite scores" in out["error"] and "v001" in out["error"], out
        got, _, out = call(app, "POST", "/v1/score:batch", {"requests": [SIMPLE, SIMPLE]})
        assert got == 503 and "non-finite scores" in out["error"], out
    assert sample(app, "streamrec_serving_nonfinite_scores_total") == 2
    assert sample(app, "streamrec_serving_candidates_total") == 0  # not answers: nothing counted as scored
    assert sum("non-finite scores" in r.getMessage() for r in caplog.records) == 1  # rate-limited
    assert app.headers("POST", "/v1/score", 503).get("Retry-After") == "1"

"""The scoring service's routes, independent of the HTTP server that carries them.

    POST /v1/score          {user_id, items, context?, dense?} -> {scores, model_version, delta_seq}
    POST /v1/score:batch    {requests: [...]} -> {results: [...]}, every result from the same model
    GET  /openapi.json      the OpenAPI 3 document (serving/request.py), naming the live model's features
    GET  /healthz           200 while the process runs
    GET  /readyz            200 when a model is loaded, else 503
    GET  /metrics           Prometheus text (serving/metrics.py)

:meth:`ScoringApp.handle` takes ``(method, path, body)`` and returns ``(status, content type, body)``;
``serving/http_server.py`` binds it to a server. Errors are JSON ``{"error": "..."}`` with a 4xx status
that says what to fix, or 503 while no artifact has been published, or when the live model scores a candidate
NaN or inf (``streamrec_serving_nonfinite_scores_total``, a rate-limited log line: never a 200 with null scores).

The user's click history is read from Redis (``stream/history.py``, the list the joiner keeps, the
last ``history_len`` items as the joiner attaches them) through ``serving/history.py``: the read is sent as soon
as the request is parsed and collected when the encoder reaches the history field, so the round trip overlaps the
candidates' encoding (and is collected on every path, errors included). A malformed
entry, a failed or a slow read (``redis_timeout_s``) scores the request without that history and is
counted (``streamrec_serving_history_malformed_total``, ``..._history_unavailable_total``), rather than
failing it: a ranking degraded for one request beats an error page. Those are never a 500.

HTTP semantics both servers share: ``OPTIONS <path>`` is a 204 whose ``Allow`` names the path's methods
(``OPTIONS *``: every method); ``HEAD`` is ``GET`` without the body (:meth:`ScoringApp.handle` answers it as GET, a
405 naming HEAD where the path has no GET; the server drops the body); a method the path does not take is a 405 with
``Allow`` (:meth:`ScoringApp.headers`), a method outside :data:`KNOWN_METHODS` a 501 on
every path (methods are case-sensitive, RFC 9110 9.1: ``get`` and ``BREW`` alike); every 503 carries ``Retry-After: 1``.
:meth:`ScoringApp.admission` bounds the requests in flight (``max_in_flight``): the server holds a slot from the
end of a request's body to its answer (a body being read holds none: ``serving/http_server.py``), and one more
request is a 503 at once, except the probes (``/healthz``,
``/readyz``, ``/metrics``), which are never refused.

Readiness: ``/readyz`` is 503 while no model is loaded (nothing published yet, or every version tried
was rejected: the body says why), 200 once one answers; it stays 200 while a newer artifact is
rejected and the previous one keeps serving (the body's ``problem`` says so).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import orjson

from serving.history import HistoryReader
from serving.history_cache import HistoryCache
from serving.lookup_counts import LookupCounts
from serving.metrics import ServingMetrics
from serving.request import RequestError, ScoreRequest, openapi, read_batch, read_request
from serving.settings import ServeSettings
from serving.swap import LiveModel, ModelHolder
from stream.errors import quoted, shown
from stream.features import hash_value
from stream.history import UserHistory
from stream.limits import DEFAULT_LIMITS, EventLimits

log = logging.getLogger("streamrec.serve")
NONFINITE_LOG_EVERY_S = 10.0  # a model scoring NaN fails every request: one log line per this many seconds

JSON = "application/json"
PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"
Response = tuple[int, str, bytes]
PROBES = frozenset({"/healthz", "/readyz", "/metrics"})  # never refused by the in-flight limit
# The methods the server recognises (RFC 9110 9.3, and PATCH): one a path does not take is a 405 with Allow; any other
# token is a 501 Not Implemented (RFC 9110 15.6.2), whatever the path
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"})


def _json(status: int, obj: Any) -> Response:
    return status, JSON, orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)


def _error(status: int, message: str) -> Response:
    return _json(status, {"error": message})


class ScoringApp:
    def __init__(self, settings: ServeSettings, holder: ModelHolder, metrics: ServingMetrics,
                 history: UserHistory | None, history_len: int = 50, version: str = "0",
                 lookups: LookupCounts | None = None, limits: EventLimits = DEFAULT_LIMITS,
                 history_cache: HistoryCache | None = None) -> None:
        self.s, self.holder, self.metrics, self.history = settings, holder, metrics, history
        self.limits = limits  # [limits]: the joiner's bounds on ids and context, so what it trained on is scored
        # Per-id row lookups, counted for the nightly hot set (serving/lookup_counts.py); None: not counted.
        self._observe = lookups.add if lookups is not None else None
        self.history_len = history_len
        self.history_reader = HistoryReader(history, history_len, metrics,
                                            retry_after_s=settings.history_retry_after_s, cache=history_cache)
        self.draining = False  # set at shutdown: /readyz turns 503 so balancers stop sending
        self.in_flight = 0
        self.admitted = 0  # requests holding an admission slot (see admission)
        self._count_lock = threading.Lock()
        self._nonfinite_logged = -float("inf")  # monotonic time of the last "non-finite scores" log line
        self._version = version
        # (the feature names it describes, the document): names, not the encoder, which holds its model (a model
        # swapped out stayed referenced until the next /openapi.json)
        self._openapi: tuple[Any, bytes] = (None, b"")
        self._routes = {
            ("POST", "/v1/score"): self._score,
            ("POST", "/v1/score:batch"): self._score_batch,
            ("GET", "/openapi.json"): lambda _b: (200, JSON, self.openapi_document()),
            ("GET", "/healthz"): lambda _b: _json(200, {"status": "ok"}),
            ("GET", "/readyz"): self._ready,
            ("GET", "/metrics"): lambda _b: (200, PROMETHEUS, self.metrics.render()),
        }
        self._paths = {p for _, p in self._routes}
        self._children: dict[tuple[str, int], tuple[Any, Any]] = {}  # handle's metrics, by (endpoint, status)
        self._children_of = metrics

    # -- dispatch ---------------------------------------------------------------------------------
    def allowed_methods(self, path: str) -> list[str]:
        """The methods ``path`` answers (for a 405's ``Allow`` header); HEAD goes with GET."""
        path = path.split("?", 1)[0]
        methods = {m for m, p in self._routes if p == path}
        if "GET" in methods:
            methods.add("HEAD")
        return sorted(methods)

    def allow(self, path: str) -> str:
        """The ``Allow`` header of ``path`` (a 405, an ``OPTIONS``): its methods and OPTIONS; every method for ``*``."""
        path = path.split("?", 1)[0]
        methods = (set(self.allowed_methods(path)) if path != "*"
                   else {m for m, _ in self._routes} | {"HEAD"}) | {"OPTIONS"}
        return ", ".join(sorted(methods))

    def headers(self, method: str, path: str, status: int) -> dict[str, str]:
        """Headers the server adds to the answer ``status`` of ``method path``: ``Allow`` on a 405 and on the 204
        of an OPTIONS, ``Retry-After`` on a 503 (overloaded, no model yet, shutting down: all worth a retry)."""
        if status == 405 or (method == "OPTIONS" and status == 204):
            return {"Allow": self.allow(path)}
        if status == 503:
            return {"Retry-After": "1"}
        return {}

    @contextmanager
    def admission(self, path: str) -> Iterator[Response | None]:
        """``with app.admission(path) as refused:`` around reading, scoring and answering one request, entered as
        soon as its headers are in: ``refused`` is None and a slot of ``max_in_flight`` is held until the block
        ends, or it is the 503 to answer instead (every slot is taken). The probes never take a slot."""
        path = path.split("?", 1)[0]
        if path in PROBES:
            yield None
            return
        with self._count_lock:
            full = self.admitted >= self.s.max_in_flight
            if not full:
                self.admitted += 1
        if full:
            self.refused(path, 503)
            yield _error(503, f"overloaded: {self.s.max_in_flight} requests in flight (max_in_flight); "
                              "retry shortly")
            return
        try:
            yield None
        finally:
            with self._count_lock:
                self.admitted -= 1

    def refused(self, path: str, status: int) -> None:
        """Count an answer given without :meth:`handle` (a slot refused, and the servers' own: bad framing, a body
        over ``max_body_bytes``, a deadline's 408, a header block too large, a version, a connection over
        ``max_connections``) in ``streamrec_serving_requests_total`` by endpoint (``other`` where the path is unknown
        or unread) and status, as :meth:`handle` counts its answers: those refusals were in no metric."""
        path = path.split("?", 1)[0]
        self.metrics.requests.labels(path if path in self._paths else "other", str(status)).inc()

    def handle(self, method: str, path: str, body: bytes) -> Response:
        t0 = time.perf_counter()
        path = path.split("?", 1)[0]
        route = self._routes.get(("GET" if method == "HEAD" else method, path))  # (a 405 still names HEAD)
        m = self.metrics
        with self._count_lock:
            self.in_flight += 1
        m.in_flight.inc()
        try:
            if route is None and method == "OPTIONS" and (path in self._paths or path == "*"):
                resp = (204, JSON, b"")  # the Allow header says it (headers())
            elif route is None and method not in KNOWN_METHODS:
                resp = _error(501, f"method {shown(method, 40)} is not implemented (methods are case-sensitive, RFC "
                                   f"9110 9.1); this service answers {self.allow('*')}")
            elif route is None:
                if path in self._paths:
                    allowed = sorted(meth for meth, p in self._routes if p == path)
                    resp = _error(405, f"{quoted(method, 40)} {path}: method not allowed; use {', '.join(allowed)}")
                else:  # (a path, or a method, is quoted cut short: the threading server takes a 64 KiB request line)
                    resp = _error(404, f"no endpoint {quoted(path, 200)}; endpoints: " + ", ".join(sorted(self._paths)))
            elif len(body) > self.s.max_body_bytes:
                resp = _error(413, f"body of {len(body)} bytes exceeds {self.s.max_body_bytes}")
            else:
                try:
                    resp = route(body)
                except RequestError as exc:
                    resp = _error(exc.status, exc.message)
                except Exception:  # noqa: BLE001 - a bug must cost one request, not the server
                    log.exception("%s %s failed", method, path)
                    resp = _error(500, "internal error while scoring; see the service log")
        finally:
            m.in_flight.dec()
            with self._count_lock:
                self.in_flight -= 1
        endpoint = path if route is not None else "other"
        key = (endpoint, resp[0])
        if self._children_of is not m:  # the metrics object was replaced (tests do): its own children
            self._children, self._children_of = {}, m
        children = self._children.get(key)
        if children is None:  # the metrics' labelled children, looked up once per (endpoint, status)
            children = self._children[key] = (m.requests.labels(endpoint, str(resp[0])), m.latency.labels(endpoint))
        children[0].inc()
        children[1].observe(time.perf_counter() - t0)
        return resp

    # -- endpoints --------------------------------------------------------------------------------
    def openapi_document(self) -> bytes:
        """``/openapi.json``: the live model's feature names in the request schema (any name without a model);
        rebuilt only when those names change (a swap to a model of other features)."""
        live = self.holder.live
        encoder = live.encoder if live is not None else None
        names = (encoder.context_names, encoder.dense_names) if encoder is not None else (None, None)
        cached_for, doc = self._openapi
        if doc and cached_for == names:
            return doc
        # the standard library's encoder: the dense bounds are integers past int64 (stream.limits.DENSE_MAX_LITERAL),
        # which orjson refuses ("Integer exceeds 64-bit range": the document was a 500)
        doc = json.dumps(openapi(self.s.max_candidates, self.s.max_batch, self._version, names[0], names[1],
                                 self.limits), separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
        self._openapi = (names, doc)
        return doc

    def _live(self) -> LiveModel:
        live = self.holder.live
        if live is None:
            problem = self.holder.problem
            raise RequestError(503, f"no model loaded yet from {self.s.publish_root}: "
                               + (f"the published artifact was rejected ({problem}); " if problem else
                                  "nothing is published (no CURRENT file); ")
                               + "run `streamrec refresh --now` and serving picks it up within poll_s")
        return live

    def _ready(self, _body: bytes) -> Response:
        live = self.holder.live
        if self.draining:
            return _error(503, "shutting down")
        problem = self.holder.problem
        if live is None:
            return _error(503, f"no model loaded yet from {self.s.publish_root}"
                          + (f": the published artifact was rejected ({problem})" if problem else ""))
        m = live.model
        return _json(200, {"status": "ready", "model_version": m.version, "format": m.format,
                           "delta_seq": m.delta_seq, "problem": problem})

    def _histories(self, users: list[int]) -> list[list[int]]:
        """One history per user; empty (and counted) when Redis is down or the entry is malformed."""
        return self.history_reader.read(users)

    def _run(self, live: LiveModel, reqs: list[ScoreRequest],
             collect: Callable[[], list[list[int]]]) -> list[dict[str, Any]]:
        """The answers to ``reqs`` (one call's: ``/v1/score``'s one, a batch's all) on ``live``; ``collect()[i]`` is
        request i's history. Every request is checked before any row is looked up: one the encoder refuses (a 422: a
        feature this model lacks, ``max_request_values``) refuses the call before an id is mapped to a row
        (``streamrec_serving_id_lookups_total``), a forward pass runs, a candidate is counted
        (``streamrec_serving_candidates_total``: items scored) or a lookup is reported for the hot set
        (``serving/lookup_counts.py``: rows of answers given, not of refused calls a client may repeat)."""
        seen: list[tuple[str, np.ndarray]] = []  # the lookups, reported once every request is scored
        observe = None if self._observe is None else (lambda kind, hashed: seen.append((kind, hashed)))
        # one snapshot, taken before the history read (a delta may land meanwhile): ids mapped to rows and those rows
        # scored with the same id maps
        pin = live.model.pinned()
        checked, spent = [], 0  # max_request_values holds for the call: a batch's requests share it
        last = len(reqs) - 1
        for i, r in enumerate(reqs):  # every request checked before any row is looked up: a refused call has none
            one = live.encoder.check(r, lambda i=i: collect()[i], observe,  # type: ignore[misc]
                                     self.s.max_request_values, spent)
            if i < last:  # what the next request may still spend (no one reads it after the last: /v1/score's one)
                spent += live.encoder.request_values(r, one[1])
            checked.append(one)
        encoded = [live.encoder.rows(one, pin) for one in checked]
        out = []
        for values, offsets, dense in encoded:  # (N,), (F+F*B+1,), (B, Dd)
            scores = pin.score_arrays(values, offsets, dense)  # (B,)
            if not np.isfinite(scores).all():  # orjson writes NaN as null: never a 200 with null scores
                raise self._nonfinite(live, pin.delta_seq, scores)
            out.append({"scores": scores.astype(np.float64, copy=False), "model_version": live.model.version,
                        "delta_seq": pin.delta_seq})
        self.metrics.candidates.inc(sum(len(r.items) for r in reqs))
        if self._observe is not None:
            for kind, hashed in seen:
                self._observe(kind, hashed)
        return out

    def _nonfinite(self, live: LiveModel, delta_seq: int, scores: np.ndarray) -> RequestError:
        """The 503 of a call whose model scored NaN or inf: counted (``streamrec_serving_nonfinite_scores_total``),
        logged at most once per ``NONFINITE_LOG_EVERY_S`` (every request may hit it), answered before anything of
        the call is counted as scored."""
        self.metrics.nonfinite_scores.inc()
        what = (f"model {live.model.version} (delta_seq {delta_seq}) produced non-finite scores "
                f"({int((~np.isfinite(scores)).sum())} of {len(scores)})")
        now = time.monotonic()
        with self._count_lock:
            due = now - self._nonfinite_logged >= NONFINITE_LOG_EVERY_S
            if due:
                self._nonfinite_logged = now
        if due:
            log.error("%s: answered 503; the artifact or a delta holds weights that overflow in float32 (publish a "
                      "good version, or roll back with `streamrec refresh --rollback`)", what)
        return RequestError(503, f"{what}; this server cannot answer until a sound model is published: retry later")

    def _score(self, body: bytes) -> Response:
        req = read_request(body, self.s.max_candidates, self.limits)
        live = self._live()  # read once: this request finishes on this model whatever swaps meanwhile
        # The history read goes out now and is collected when the encoder reaches it, last (serving/history.py):
        # Redis answers while the candidates are encoded. Collected in every case, so no answer stays unread on a
        # pooled connection (a 422 from the encoder, a bug).
        collect = self.history_reader.start([hash_value(req.user_id)])
        try:
            return _json(200, self._run(live, [req], collect)[0])
        finally:
            collect()

    def _score_batch(self, body: bytes) -> Response:
        reqs = read_batch(body, self.s.max_candidates, self.s.max_batch, self.limits)
        live = self._live()
        collect = self.history_reader.start([hash_value(r.user_id) for r in reqs])  # one read for all, as _score
        try:
            return _json(200, {"results": self._run(live, reqs, collect)})
        finally:
            collect()

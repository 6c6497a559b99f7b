"""The scoring request: its JSON schema, its validation, and the OpenAPI document that describes it.

``POST /v1/score``::

    {"user_id": "u42",                                   # an id, as in impression events
     "items": [1193, "i7", {"item_id": 3408, "context": {"genres": ["Drama"], "year": 2000}}],
     "context": {"device": "ios", "hour": 20},           # optional: shared by every candidate
     "dense": {"price": 3.5}}                            # optional: dense features, shared

An item is an id or an object ``{"item_id", "context"?, "dense"?}`` whose context and dense values
(item attributes such as genres) apply to that candidate only and override the shared ones. Ids,
context and dense values follow the impression event schema (``stream/events.py``), because they are
hashed by the same code (``stream/features.py``) into the same features the model was trained on.

``POST /v1/score:batch``: ``{"requests": [<score request>, ...]}``.

Every violation raises :class:`RequestError` carrying the HTTP status and a message that names the
field, the value and what was expected. Integers are read as written, as the event decoders read them
(:func:`stream.events.exactly`): an integer literal outside int64 is a 422 in an id or a context value, shown as
written (orjson reads one past 2**64 - 1 as a float); in ``dense`` it is kept exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from stream.errors import BadMessage, StreamrecError, ValidationError
from stream.events import (
    ContextValue,
    Id,
    all_ids,
    check_context,
    check_dense,
    check_id,
    count_keys,
    exactly,
    reject_duplicate_keys,
)
from stream.limits import DEFAULT_LIMITS, DENSE_MAX_LITERAL, EventLimits

_REQUEST_FIELDS = frozenset({"user_id", "items", "context", "dense"})
_ITEM_FIELDS = frozenset({"item_id", "context", "dense"})


class RequestError(StreamrecError):
    """A request the service refuses; ``status`` is the HTTP status (4xx), ``str(exc)`` the reason."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True, slots=True)
class ScoreRequest:
    user_id: Id
    items: list[Id]  # (B,) candidate ids
    context: dict[str, ContextValue]  # shared by every candidate
    dense: dict[str, float]
    # Per-candidate overrides, None when no item carried any (the common, fast case).
    item_context: list[dict[str, ContextValue]] | None = None
    item_dense: list[dict[str, float]] | None = None
    # Where the request sits in the body: "" for /v1/score, "requests[i]." in a batch; errors found later (the
    # model's feature names, serving/features.py) name their field from it.
    where: str = ""


def _refused(parse: Any, *args: Any) -> Any:
    """``parse(*args)``, a :class:`~stream.errors.BadMessage` of the events' checks (a ValidationError, too many
    keys) answered as a 422 with the events' message: the checks raise it (not a RequestError) so that
    :func:`~stream.events.exactly` sees a float that may be an integer literal past int64."""
    try:
        return parse(*args)
    except BadMessage as exc:
        raise RequestError(422, exc.reason) from None


def _unknown(field: str, obj: dict[str, Any], allowed: frozenset[str]) -> None:
    extra = obj.keys() - allowed
    if extra:
        name = sorted(extra)[0]
        where = f"{field}.{name}" if field else name
        raise RequestError(422, f"unknown field {where!r}; allowed: {', '.join(sorted(allowed))}")


def _items(where: str, items_raw: list[Any], exact: bool = True, limits: EventLimits = DEFAULT_LIMITS) -> tuple[
        list[Id], list[dict[str, ContextValue]] | None, list[dict[str, float]] | None]:
    """The candidates one by one: ids, and the per-item context and dense overrides (None where no item has any)."""
    items: list[Id] = []
    item_context: list[dict[str, ContextValue]] | None = None
    item_dense: list[dict[str, float]] | None = None
    for i, it in enumerate(items_raw):
        t = type(it)
        if t is str or t is int:
            items.append(check_id(f"{where}items[{i}]", it, limits))
            continue
        if t is not dict:
            raise ValidationError(f"{where}items[{i}]", it, "an item id or an object {item_id, context, dense}")
        _unknown(f"{where}items[{i}]", it, _ITEM_FIELDS)
        if "item_id" not in it:
            raise RequestError(422, f"field {f'{where}items[{i}].item_id'!r} is required")
        items.append(check_id(f"{where}items[{i}].item_id", it["item_id"], limits))
        if "context" in it:
            if item_context is None:
                item_context = [{} for _ in items_raw]
            item_context[i] = check_context(it["context"], f"{where}items[{i}].context", limits, exact)
        if "dense" in it:
            if item_dense is None:
                item_dense = [{} for _ in items_raw]
            item_dense[i] = check_dense(it["dense"], f"{where}items[{i}].dense", limits, exact)
    return items, item_context, item_dense


def parse_request(obj: Any, max_candidates: int, where: str = "",
                  limits: EventLimits = DEFAULT_LIMITS) -> ScoreRequest:
    """A decoded JSON value (integers exact: a Python value, ``json.loads``'s) -> :class:`ScoreRequest`, or
    :class:`RequestError` (422). A body: :func:`read_request`."""
    return _refused(_request, obj, True, max_candidates, where, limits)


def read_request(body: bytes, max_candidates: int, limits: EventLimits = DEFAULT_LIMITS) -> ScoreRequest:
    """``POST /v1/score``'s body -> :class:`ScoreRequest`, integers read as written; :class:`RequestError`. ``limits``:
    the ``[limits]`` the joiner decodes events with, so an id or context value it trained on is one serving takes."""
    return _refused(exactly, body, decode_json(body), _request, max_candidates, "", limits)


def _request(obj: Any, exact: bool, max_candidates: int, where: str,
             limits: EventLimits = DEFAULT_LIMITS) -> ScoreRequest:
    if type(obj) is not dict:
        raise RequestError(422, f"{where.rstrip('.') or 'body'}: expected a JSON object {{user_id, items, context}}, "
                           f"got {type(obj).__name__}")
    _unknown(where.rstrip("."), obj, _REQUEST_FIELDS)
    for name in ("user_id", "items"):
        if name not in obj:
            raise RequestError(422, f"field {where + name!r} is required")
    user = check_id(where + "user_id", obj["user_id"], limits)
    items_raw = obj["items"]
    if type(items_raw) is not list:
        raise ValidationError(where + "items", items_raw, "a list of item ids or {item_id, context, dense} objects")
    if not items_raw:
        raise RequestError(422, f"field {where + 'items'!r}: empty; send at least one candidate")
    if len(items_raw) > max_candidates:
        raise RequestError(422, f"field {where + 'items'!r}: {len(items_raw)} candidates, at most {max_candidates} "
                           "per request (split them, or raise [serve] max_candidates)")
    if all_ids(items_raw, limits):  # bare ids only, each valid as it is (the common request): no call per candidate
        items, item_context, item_dense = list(items_raw), None, None
    else:
        items, item_context, item_dense = _items(where, items_raw, exact, limits)
    return ScoreRequest(user, items, check_context(obj.get("context"), where + "context", limits, exact),
                        check_dense(obj.get("dense"), where + "dense", limits, exact), item_context, item_dense, where)


def decode_json(body: bytes) -> Any:
    """The body's JSON value; 400 if it is not JSON, 422 if an object repeats a key (a parser keeps the last one
    silently, a gateway that checked the first would disagree with what is scored: refused, as events are)."""
    if not body:
        raise RequestError(400, "empty body; send a JSON object (Content-Type: application/json)")
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise RequestError(400, f"malformed JSON: {exc}") from None
    # the usual request's keys are its own and its context's: no colon beyond them, no key can repeat (~1 us)
    shallow = len(obj) + sum(len(v) for v in obj.values() if type(v) is dict) if type(obj) is dict else 0
    if body.count(b":") > shallow:
        try:
            reject_duplicate_keys(body, count_keys(obj))
        except BadMessage as exc:
            raise RequestError(422, f"body: {exc.reason}; send each field once") from None
    return obj


def read_batch(body: bytes, max_candidates: int, max_batch: int,
               limits: EventLimits = DEFAULT_LIMITS) -> list[ScoreRequest]:
    """``POST /v1/score:batch``'s body, as :func:`read_request` reads one request's."""
    return _refused(exactly, body, decode_json(body), _batch, max_candidates, max_batch, limits)


def _batch(obj: Any, exact: bool, max_candidates: int, max_batch: int, limits: EventLimits) -> list[ScoreRequest]:
    if type(obj) is not dict:
        raise RequestError(422, f"body: expected a JSON object {{requests: [...]}}, got {type(obj).__name__}")
    _unknown("", obj, frozenset({"requests"}))
    reqs = obj.get("requests")
    if type(reqs) is not list or not reqs:
        raise ValidationError("requests", reqs, "a non-empty list of score requests")
    if len(reqs) > max_batch:
        raise RequestError(422, f"field 'requests': {len(reqs)} requests, at most {max_batch} per batch call")
    return [_request(r, exact, max_candidates, f"requests[{i}].", limits) for i, r in enumerate(reqs)]


# -- OpenAPI ---------------------------------------------------------------------------------------
def _id_schema(description: str, limits: EventLimits) -> dict[str, Any]:
    return {"description": description, "oneOf": [
        {"type": "integer", "minimum": 0, "maximum": 2**63 - 1},
        {"type": "string", "minLength": 1, "maxLength": limits.max_str_len}]}


_INT64 = {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}
# anyOf, not oneOf: an integer is a number too, and oneOf would then forbid it. An integer literal must fit int64
# whatever its size (read as written, stream/events.py), any finite float literal is a value: the `not` says so
# (OpenAPI 3.0's JSON Schema: an integer is a number written without a fraction or an exponent).
_NUMBER = {"type": "number", "not": {"type": "integer"}}


def _context_value(limits: EventLimits) -> dict[str, Any]:
    text = {"type": "string", "maxLength": limits.max_str_len}
    return {"anyOf": [text, _INT64, _NUMBER, {"type": "boolean"},
                      {"type": "array", "maxItems": limits.max_list_len, "items": {"anyOf": [text, _INT64]}}]}


_DENSE_VALUE = {"type": "number", "minimum": -DENSE_MAX_LITERAL, "maximum": DENSE_MAX_LITERAL}


def _features(kind: str, value: dict[str, Any], names: Any, max_keys: int, description: str) -> dict[str, Any]:
    """An object of features: the live model's names when known (others are a 422), else any name.

    Without a model the key rules (1 to ``max_key_len`` characters) cannot be said in OpenAPI 3.0; the
    server answers 422 for a bad key, as it does for a feature the model does not have."""
    out: dict[str, Any] = {"type": "object", "nullable": True, "description": description}
    if names is None:
        out.update(maxProperties=max_keys, additionalProperties=value)
    else:
        names = sorted(names)
        out.update(properties={n: value for n in names}, additionalProperties=False)
        out["description"] += f"; this model's {kind} features: {', '.join(names) or 'none'}"
    return out


def _context_schema(names: Any, limits: EventLimits) -> dict[str, Any]:
    return _features("context", _context_value(limits), names, limits.max_context_keys,
                     "categorical features: name -> string, integer, float, boolean, or a list of strings/integers "
                     "(multi-valued, e.g. genres); hashed as in impression events; null or absent: none")


def _dense_schema(names: Any, limits: EventLimits) -> dict[str, Any]:
    return _features("dense", _DENSE_VALUE, names, limits.max_dense_keys,
                     "dense features: name -> number, |x| < 2**64 (absent ones are 0); null or absent: none")


def openapi(max_candidates: int, max_batch: int, version: str, context_names: Any = None,
            dense_names: Any = None, limits: EventLimits = DEFAULT_LIMITS) -> dict[str, Any]:
    """The OpenAPI 3.0 document served at ``GET /openapi.json``, with the ``limits`` requests are checked against.

    With the live model's feature names (``context_names``, ``dense_names``) the request schema lists
    exactly those (any other name is a 422), so every request valid under the document is scored; without
    a model any name is allowed by the document."""
    ctx, dense = _context_schema(context_names, limits), _dense_schema(dense_names, limits)
    error = {"description": "the request was refused; `error` says which field, what it held and what was expected",
             "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    unavailable = {"description": "no model is loaded yet (no artifact published under the publish root), the "
                   "service is overloaded or shutting down, or the live model produced non-finite scores",
                   "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    return {
        "openapi": "3.0.3",
        "info": {"title": "streamrec scoring service", "version": version,
                 "description": "Click-through-rate scores for candidate items of one user, from the latest "
                 "published DeepFM artifact plus the learner's deltas since."},
        "paths": {
            "/v1/score": {"post": {
                "summary": "score the candidates of one user",
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/ScoreRequest"}}}},
                "responses": {"200": {"description": "one probability per item, in request order",
                                      "content": {"application/json": {
                                          "schema": {"$ref": "#/components/schemas/ScoreResponse"}}}},
                              "400": error, "413": error, "415": error, "422": error, "503": unavailable}}},
            "/v1/score:batch": {"post": {
                "summary": "score several requests in one call (all on the same model)",
                "requestBody": {"required": True, "content": {"application/json": {"schema": {
                    "type": "object", "additionalProperties": False, "required": ["requests"],
                    "properties": {"requests": {"type": "array", "minItems": 1, "maxItems": max_batch,
                                                "items": {"$ref": "#/components/schemas/ScoreRequest"}}}}}}},
                "responses": {"200": {"description": "one result per request, in order",
                                      "content": {"application/json": {"schema": {
                                          "type": "object", "properties": {"results": {"type": "array", "items": {
                                              "$ref": "#/components/schemas/ScoreResponse"}}}}}}},
                              "400": error, "413": error, "415": error, "422": error, "503": unavailable}}},
            "/healthz": {"get": {"summary": "the process is up", "responses": {"200": {"description": "ok"}}}},
            "/readyz": {"get": {"summary": "a model is loaded and requests can be served",
                                "responses": {"200": {"description": "ready"}, "503": unavailable}}},
            "/metrics": {"get": {"summary": "Prometheus metrics (text exposition format)",
                                 "responses": {"200": {"description": "metrics"}}}},
            "/openapi.json": {"get": {"summary": "this document", "responses": {"200": {"description": "OpenAPI"}}}},
        },
        "components": {"schemas": {
            "ScoreRequest": {"type": "object", "additionalProperties": False, "required": ["user_id", "items"],
                             "properties": {
                                 "user_id": _id_schema("the user, as in impression events; unseen users fall back "
                                                       "to their hash bucket", limits),
                                 "items": {"type": "array", "minItems": 1, "maxItems": max_candidates,
                                           "items": {"oneOf": [
                                               _id_schema("a candidate item id", limits),
                                               {"type": "object", "additionalProperties": False,
                                                "required": ["item_id"],
                                                "properties": {"item_id": _id_schema("a candidate item id", limits),
                                                               "context": ctx, "dense": dense}}]}},
                                 "context": ctx, "dense": dense}},
            "ScoreResponse": {"type": "object", "properties": {
                "scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}},
                "model_version": {"type": "string", "description": "the artifact version that answered"},
                "delta_seq": {"type": "integer", "description": "the last learner delta applied to it (0: none)"}}},
            "Error": {"type": "object", "required": ["error"],
                      "properties": {"error": {"type": "string", "minLength": 1,
                                               "description": "what was wrong and what to do"}}},
        }},
    }

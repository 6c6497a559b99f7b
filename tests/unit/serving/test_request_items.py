"""The request's candidate list: bare ids take one pass (``stream.events.all_ids``), anything else the per-item path;
both give the same request and the same errors."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from serving.request import RequestError, _items, parse_request, read_batch, read_request
from stream.limits import DEFAULT_LIMITS, EventLimits


def test_bare_ids_parse_to_what_the_per_item_path_gives() -> None:
    items: list[Any] = [1193, "i7", 0, 2**63 - 1, "x" * 256]
    req = parse_request({"user_id": "u42", "items": items}, 100)
    assert req.items == items and req.items is not items  # a copy: the request owns its list
    assert (req.items, req.item_context, req.item_dense) == _items("", items)


@pytest.mark.parametrize("bad", [-1, 2**63, True, "", "x" * 257, 1.5, None, [3]])
def test_one_bad_id_among_bare_ids_is_a_422_naming_its_index(bad: Any) -> None:
    with pytest.raises(RequestError) as exc:
        parse_request({"user_id": "u42", "items": [1, 2, bad, 4]}, 100)
    assert exc.value.status == 422
    assert "items[2]" in exc.value.message


def test_items_with_overrides_still_take_the_per_item_path() -> None:
    req = parse_request({"user_id": "u42", "items": [1, {"item_id": 2, "dense": {"price": 3.5}}]}, 100)
    assert req.items == [1, 2]
    assert req.item_dense == [{}, {"price": 3.5}]
    assert req.item_context is None


def test_a_request_is_checked_against_the_configured_limits_the_joiner_decodes_events_with() -> None:
    """Ids, context lists and context keys within ``[limits]`` are what the joiner trained on, so serving takes them
    on every path (bare ids, per-item objects, shared and per-item context, the batch route); past the defaults they
    were a 422."""
    tags = ["t"] * (DEFAULT_LIMITS.max_list_len + 1)
    key = "k" * (DEFAULT_LIMITS.max_key_len + 1)
    long_id = "x" * (DEFAULT_LIMITS.max_str_len + 1)
    obj = {"user_id": long_id, "items": [long_id, {"item_id": long_id, "context": {"tags": tags}}],
           "context": {"tags": tags, key: 1}}
    with pytest.raises(RequestError):
        parse_request(obj, 100)
    limits = EventLimits(max_str_len=2 * len(long_id), max_list_len=2 * len(tags), max_key_len=2 * len(key))
    req = parse_request(obj, 100, limits=limits)
    assert req.user_id == long_id and req.items == [long_id, long_id] and req.context["tags"] == tags
    assert read_request(json.dumps(obj).encode(), 100, limits) == req
    assert read_batch(json.dumps({"requests": [obj]}).encode(), 100, 1, limits) == [replace(req, where="requests[0].")]

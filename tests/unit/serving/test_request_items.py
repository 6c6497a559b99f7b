"""The request's candidate list: bare ids take one pass (``stream.events.all_ids``), anything else the per-item path;
both give the same request and the same errors."""

from __future__ import annotations

from typing import Any

import pytest

from serving.request import RequestError, _items, parse_request


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

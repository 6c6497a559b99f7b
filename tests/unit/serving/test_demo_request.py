"""``python -m serving.demo`` (the last step of ``make demo``) asks for ``--k`` candidates on either data set."""

from __future__ import annotations

import pytest

from serving.demo import build_request


@pytest.mark.parametrize(("dataset", "user"), [("ml-100k", "1"), ("ml-1m", "1m_1")])
def test_the_demo_request_holds_k_distinct_candidates_on_either_data_set(dataset: str, user: str) -> None:
    # on ml-100k (DEMO_DATASET=ml-100k make demo) `--k 5` scored 2 movies: the user's first k // 2 ratings, then
    # popular ML-1M titles, none of which is an ml-100k item id
    items = [i["item_id"] for i in build_request(dataset, user, 5)["items"]]
    assert len(items) == 5 and len(set(items)) == 5

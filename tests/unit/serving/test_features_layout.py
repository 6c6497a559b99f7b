"""The request encoder's user-row layout (serving/features.py): the user's bags once, the candidates' per candidate."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from learner.features import FeatureConfig, FieldSpec
from learner.scorer import to_candidate_rows
from serving.features import FeatureEncoder
from serving.request import RequestError, parse_request
from stream.features import hash_value

CFG = FeatureConfig(
    fields=(FieldSpec("user_id", "single", 300), FieldSpec("item_id", "single", 200),
            FieldSpec("history", "sequence", 200, shares="item_id"), FieldSpec("ctx.device", "single", 7),
            FieldSpec("ctx.genres", "multi", 20)),
    dense=("price",), embedding_dim=8)
F = CFG.num_fields
HISTORY = [hash_value(x) for x in range(20)]


def encoder() -> FeatureEncoder:
    blocks = CFG.blocks

    def map_rows(f: int, hashed: np.ndarray) -> np.ndarray:
        first, rows = blocks[f]
        return first + np.asarray(hashed, np.int64) % rows

    return FeatureEncoder(SimpleNamespace(feature_config=CFG, map_rows=map_rows))  # type: ignore[arg-type]


def bags(values: np.ndarray, offsets: np.ndarray) -> list[list[int]]:
    return [values[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:], strict=True)]


def test_the_users_bags_are_encoded_once_and_every_candidate_carries_only_its_item() -> None:
    b = 100
    req = parse_request({"user_id": "u1", "items": list(range(b)), "context": {"device": "ios"}}, 1000)
    seen: list[tuple[str, int]] = []
    values, offsets, dense = encoder().encode(req, HISTORY, lambda kind, hashed: seen.append((kind, len(hashed))))
    assert offsets.shape == (F + F * b + 1,) and dense.shape == (b, 1)  # (F + F*B + 1,), (B, Dd)
    user, cand = bags(values, offsets[: F + 1]), np.diff(offsets[F:]).reshape(F, b)  # (F,) bags, (F, B) lengths
    assert [len(x) for x in user] == [1, 0, 20, 1, 0]  # user, (item), history, device, (genres: absent: empty)
    assert cand[1].tolist() == [1] * b and cand[[0, 2, 3, 4]].sum() == 0  # only the item per candidate
    assert len(values) == 1 + 20 + 1 + b  # not (1 + 20 + 1) * b + b
    assert sorted(seen) == [("item", 20), ("item", b), ("user", 1)]  # each lookup observed once


def test_a_context_feature_sent_per_item_moves_to_the_candidates_side_and_expands_to_the_joiners_bags() -> None:
    req = parse_request({"user_id": 7, "context": {"device": "web", "genres": ["Drama"]},
                         "items": [1, {"item_id": 2, "context": {"genres": ["War", "Drama"]}}, 3]}, 1000)
    enc = encoder()
    values, offsets, _ = enc.encode(req, HISTORY[:3])
    user = bags(values, offsets[: F + 1])
    assert [len(x) for x in user] == [1, 0, 3, 1, 0]  # genres is no longer shared: the candidates carry it
    cand = np.diff(offsets[F:]).reshape(F, 3)
    assert cand[4].tolist() == [1, 2, 1]  # the shared ["Drama"], the item's own two, the shared one
    batch_values, batch_offsets = to_candidate_rows(values, offsets, F)
    per_sample = bags(batch_values, batch_offsets)  # field-major (F*B,) as a training batch lays them out
    for i in range(3):
        assert per_sample[0 * 3 + i] == user[0] and per_sample[2 * 3 + i] == user[2]  # user and history repeated
    genres = [per_sample[4 * 3 + i] for i in range(3)]
    assert genres[0] == genres[2] != genres[1] and len(genres[1]) == 2


def test_an_absent_single_valued_context_feature_is_one_missing_row_in_the_user_row() -> None:
    req = parse_request({"user_id": 7, "items": [1, 2]}, 1000)
    values, offsets, _ = encoder().encode(req, [])
    assert [len(x) for x in bags(values, offsets[: F + 1])] == [1, 0, 0, 1, 0]  # device absent: MISSING, shared
    assert len(values) == 1 + 1 + 2


def test_a_shared_context_past_max_values_is_refused_before_any_row_is_looked_up() -> None:
    # 2 candidates + a shared list of 50 values under a bound of 20: refused (422) before map_rows is called once; it
    # used to map the user row's bags (the 50 values among them) first and count them after.
    enc = encoder()
    looked_up: list[int] = []
    map_rows = enc.mapper.map_rows
    spy = SimpleNamespace(feature_config=CFG, map_rows=lambda f, h: looked_up.append(len(h)) or map_rows(f, h))
    req = parse_request({"user_id": 7, "items": [1, 2], "context": {"device": "ios",
                                                                    "genres": [f"g{i}" for i in range(50)]}}, 1000)
    with pytest.raises(RequestError) as refused:
        enc.encode(req, HISTORY, max_values=20, mapper=spy)  # type: ignore[arg-type]
    assert refused.value.status == 422 and "'context.genres'" in str(refused.value), refused.value
    assert looked_up == []
    enc.encode(req, HISTORY, max_values=53, mapper=spy)  # type: ignore[arg-type]  # 2 + device + 50 genres: at the bound
    assert sorted(looked_up) == [1, 1, 2, 20, 50]  # user, device, items, history, genres

"""Differential harness: the same user, item, context and dense values given once as impression events (the joiner's
decode, hashing and sample columns, then the learner's ``to_tensors``) and once as a scoring request (serving's parser
and encoder, turned into the training layout by ``to_candidate_rows``) must give the model the same bags of rows and
the same dense values. No broker: the joiner's own sample-building functions and serving's own encoder."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import orjson
import pytest

from learner.batch import to_tensors
from learner.features import FeatureConfig, FieldSpec
from learner.scorer import to_candidate_rows
from serving.features import FeatureEncoder
from serving.request import read_request
from stream.event_batch import decode_events
from stream.events import Impression
from stream.features import hash_column, hash_context, hash_value
from stream.joiner.context_block import hashed_rows
from stream.joiner.engine import Pending, Sample
from stream.joiner.sample_rows import to_batches
from stream.samples import SampleBatch

CFG = FeatureConfig(
    fields=(FieldSpec("user_id", "single", 300), FieldSpec("item_id", "single", 200),
            FieldSpec("history", "sequence", 200, shares="item_id"), FieldSpec("ctx.device", "single", 7),
            FieldSpec("ctx.genres", "multi", 20)),
    dense=("price",), embedding_dim=8)
F = CFG.num_fields
Bags = list[list[int]]


def _bags(values: np.ndarray, offsets: np.ndarray) -> Bags:
    return [values[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:], strict=True)]


def trained(events: list[dict[str, Any]], history: list[int]) -> tuple[Bags, np.ndarray]:
    """The events joined into one samples message, as the learner reads it: (F*B bags, field-major; dense (B, Dd))."""
    raws = [orjson.dumps({"schema_version": 1, "impression_id": f"i{n}", "ts": 1_000, **e})
            for n, e in enumerate(events)]
    decoded = decode_events(raws, [None] * len(raws), clicks=False)  # the joiner's decode
    imps = [i for i in decoded if isinstance(i, Impression)]
    assert len(imps) == len(raws), decoded
    users = hash_column([i.user_id for i in imps]).tolist()
    items = hash_column([i.item_id for i in imps]).tolist()
    contexts = hashed_rows([i.context for i in imps], hash_context)
    rows = [Sample(Pending(i.impression_id, i.ts, u, it, c, dict(i.dense), 0, history=list(history)), 0, 0)
            for i, u, it, c in zip(imps, users, items, contexts, strict=True)]
    (message,) = to_batches(rows, 10_000)
    tb = to_tensors(SampleBatch.decode(message), CFG)
    return _bags(tb.values.numpy(), tb.offsets.numpy()), tb.dense.numpy()


def served(request: dict[str, Any], history: list[int]) -> tuple[Bags, np.ndarray]:
    """The request as serving encodes it, in the training layout: (F*B bags, field-major; dense (B, Dd))."""
    blocks = CFG.blocks

    def map_rows(f: int, hashed: np.ndarray) -> np.ndarray:
        first, rows = blocks[f]
        return first + np.asarray(hashed, np.int64) % rows

    encoder = FeatureEncoder(SimpleNamespace(feature_config=CFG, map_rows=map_rows))  # type: ignore[arg-type]
    values, offsets, dense = encoder.encode(read_request(orjson.dumps(request), 1000), history)
    return _bags(*to_candidate_rows(values, offsets, F)), dense


def sample_of(bags: Bags, row: int, rows: int) -> Bags:
    """Sample ``row``'s F bags out of a field-major batch of ``rows`` samples."""
    return [bags[f * rows + row] for f in range(F)]


def as_event(user: Any, item: Any, context: dict | None, dense: dict | None) -> dict[str, Any]:
    return {"user_id": user, "item_id": item, **({"context": context} if context is not None else {}),
            **({"dense": dense} if dense is not None else {})}


def as_request(user: Any, item: Any, context: dict | None, dense: dict | None) -> dict[str, Any]:
    return {"user_id": user, "items": [item], **({"context": context} if context is not None else {}),
            **({"dense": dense} if dense is not None else {})}


HISTORY = [hash_value(x) for x in (5, "x", 9)]


@pytest.mark.parametrize(("user", "item", "context", "dense"), [
    (7, 8, {"device": "ios", "genres": ["Drama", "War"]}, {"price": 3.5}),
    ("7", "008", {"device": 7, "genres": ["War", "Drama", "War"]}, {"price": 3}),
    (2**63 - 1, "Caf\u00e9", {"device": True, "genres": []}, {"price": -0.0}),
    ("Cafe\u0301", 0, {"device": -0.0, "genres": "Drama"}, {"price": 1e-45}),
    ("u", "i", {"device": ["a", "b"]}, {"price": 2**60 + 2**36 + 1}),
])
def test_an_event_and_a_request_of_the_same_features_give_the_model_the_same_rows_and_dense_values(
        user: Any, item: Any, context: dict, dense: dict) -> None:
    """Ids as ints or strings, unicode text as sent, bools, float zeros, lists in order with duplicates, an empty
    list, a scalar for a multi-valued field, a list for a single-valued one, an integer dense value past 2**53."""
    t_bags, t_dense = trained([as_event(user, item, context, dense)], HISTORY)
    s_bags, s_dense = served(as_request(user, item, context, dense), HISTORY)
    assert t_bags == s_bags
    assert t_dense.tobytes() == s_dense.tobytes()


def test_a_single_valued_context_feature_absent_from_a_whole_samples_message_trains_on_the_missing_row() -> None:
    """A context field of the model that no event of a samples message carries: serving (and a message where another
    event carries it) gives the absent feature its MISSING row; training gave it an empty bag (a zero vector)."""
    t_bags, _ = trained([as_event(7, 8, None, None)], [])
    s_bags, _ = served(as_request(7, 8, None, None), [])
    assert t_bags == s_bags
    with_other, _ = trained([as_event(7, 8, None, None), as_event(7, 9, {"device": "ios"}, None)], [])
    assert sample_of(with_other, 0, 2) == t_bags  # the same sample trains alike whatever shares its message


def test_a_list_valued_feature_absent_from_a_row_of_a_column_of_scalars_trains_as_the_empty_bag() -> None:
    """A multi-valued field sent as a scalar by one event (``"genres": "Drama"``, one genre) and absent from the next
    event of the same message: the joiner writes a column of scalars, the absent row MISSING, which training pooled as
    the MISSING row; serving gives an absent list-valued feature an empty bag."""
    t_bags, _ = trained([as_event(7, 8, {"genres": "Drama"}, None), as_event(7, 9, None, None)], [])
    s_bags, _ = served(as_request(7, 9, None, None), [])
    assert sample_of(t_bags, 1, 2) == s_bags


def test_a_single_valued_feature_absent_from_a_row_of_a_list_column_trains_on_the_missing_row() -> None:
    """A single-valued field sent as a list by one event (``"device": ["ios"]``) and absent from the next event of the
    same message: the joiner writes a list column, the absent row an empty list, which training pooled as a zero
    vector; serving gives an absent single-valued feature its MISSING row (as training does beside scalars)."""
    t_bags, _ = trained([as_event(7, 8, {"device": ["ios"]}, None), as_event(7, 9, None, None)], [])
    s_bags, _ = served(as_request(7, 9, None, None), [])
    assert sample_of(t_bags, 1, 2) == s_bags
    sent_empty, _ = trained([as_event(7, 8, {"device": ["ios"]}, None), as_event(7, 9, {"device": []}, None)], [])
    assert sample_of(sent_empty, 1, 2) == served(as_request(7, 9, {"device": []}, None), [])[0]  # [] sent: empty


def test_a_request_with_per_item_context_and_dense_agrees_with_one_event_per_candidate() -> None:
    """Per-item context and dense override the shared ones (a scalar for a list field, a list for a single field, an
    empty list); the candidates train as the events that carry the merged values, also when the message's rows differ
    in column types, and every row as it would alone."""
    req = {"user_id": "u", "context": {"device": "ios", "genres": ["a", "b"]}, "dense": {"price": 2.5},
           "items": [{"item_id": 8, "context": {"genres": "c"}}, 9,
                     {"item_id": 10, "context": {"device": ["x", "y"]}, "dense": {"price": -1}},
                     {"item_id": 11, "context": {"genres": []}}]}
    events = [as_event("u", 8, {"device": "ios", "genres": "c"}, {"price": 2.5}),
              as_event("u", 9, {"device": "ios", "genres": ["a", "b"]}, {"price": 2.5}),
              as_event("u", 10, {"device": ["x", "y"], "genres": ["a", "b"]}, {"price": -1}),
              as_event("u", 11, {"device": "ios", "genres": []}, {"price": 2.5})]
    t_bags, t_dense = trained(events, HISTORY)
    s_bags, s_dense = served(req, HISTORY)
    assert t_bags == s_bags and t_dense.tobytes() == s_dense.tobytes()
    for i, event in enumerate(events):
        assert sample_of(t_bags, i, len(events)) == trained([event], HISTORY)[0]

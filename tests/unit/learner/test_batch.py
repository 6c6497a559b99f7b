"""learner/batch.py's concat with the zero-row parts the dataset puts in a batch (learner/kafka_dataset.py)."""

from __future__ import annotations

import numpy as np
import torch

from learner.batch import concat, to_tensors
from learner.features import FeatureConfig, FieldSpec
from learner.kafka_dataset import to_tensors_empty
from stream.samples import SampleBatch

DYNAMIC = FeatureConfig((FieldSpec("user_id", "single", 50, capacity=64, admit_after=1),
                         FieldSpec("item_id", "single", 40, capacity=64, admit_after=1),
                         FieldSpec("history", "sequence", 40, shares="item_id"),
                         FieldSpec("ctx.genres", "multi", 10)), dense=("price",), embedding_dim=4)


def _part(start: int, n: int = 4) -> SampleBatch:
    return SampleBatch.from_columns(
        impression_id=[f"i{start + k}" for k in range(n)], ts=1_700_000_000_000 + np.arange(n) * 1000,
        label=np.arange(n) % 2, label_delay_ms=np.arange(n) * 1000 + start, user_id=np.arange(n) + 100 * start,
        item_id=np.arange(n) + 7, history=[[1, 2]] * n, context={"genres": [[3]] * n},
        dense={"price": np.ones(n, np.float32)})


def test_a_dead_lettered_messages_placeholder_keeps_every_rows_keys_and_label_delays() -> None:
    """One dead-lettered message in a training batch dropped the keys (dynamic ids, cold tracking) and label delays
    (calibration, the bias rule) of every row of the batch."""
    a, b = to_tensors(_part(0), DYNAMIC, [(0, 0, 4)]), to_tensors(_part(10), DYNAMIC, [(0, 2, 4)])
    clean = concat([a, b], DYNAMIC.num_fields)
    for placeholder in (to_tensors_empty(DYNAMIC, (0, 1, 0)), to_tensors_empty(DYNAMIC, None)):
        for parts in ([a, placeholder, b], [placeholder, a, b], [a, b, placeholder]):
            joined = concat(parts, DYNAMIC.num_fields)
            assert joined.keys is not None and clean.keys is not None
            np.testing.assert_array_equal(joined.keys, clean.keys)
            assert joined.label_delay_ms is not None and clean.label_delay_ms is not None
            np.testing.assert_array_equal(joined.label_delay_ms, clean.label_delay_ms)
            assert torch.equal(joined.values, clean.values) and torch.equal(joined.offsets, clean.offsets)
            assert joined.positions == [p for t in parts for p in t.positions]


def test_a_batch_keeps_each_partitions_newest_joiner_watermark_through_concat_select_and_chunks() -> None:
    """The joiner's watermark of each message (learner/served.py closes observed 0s by it) goes with the batch: the
    newest per partition, on the last chunk only (with the positions), and through a dedup's select."""
    a, b, c = (to_tensors(_part(s), DYNAMIC, [(p, s, 4)]) for s, p in ((0, 0), (10, 0), (20, 1)))
    a.watermarks, b.watermarks, c.watermarks = {0: 500}, {0: 900}, {1: 40}
    joined = concat([a, to_tensors_empty(DYNAMIC, (0, 5, 0)), b, c], DYNAMIC.num_fields)
    assert joined.watermarks == {0: 900, 1: 40}
    keep = np.ones(len(joined), bool)
    keep[0] = False
    assert joined.select(keep).watermarks == {0: 900, 1: 40}
    assert [piece.watermarks for piece in joined.chunks(5)] == [{}, {}, {0: 900, 1: 40}]

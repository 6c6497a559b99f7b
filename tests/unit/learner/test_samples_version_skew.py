"""Samples written by another version of the joiner (README, "Upgrades and version skew"): what the learner does not
read changes nothing it trains, and every other change is a dead letter (``BadMessage``), never a different model."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pytest
import torch

from learner.batch import TensorBatch, to_tensors
from learner.features import default_config
from stream.errors import BadMessage
from stream.samples import SampleBatch

CFG = default_config({"dev": "single", "g": "multi"}, dense=("x",))
SB = SampleBatch.from_columns(
    impression_id=["a", "b"], ts=np.array([1, 2]), label=np.array([0, 1]), label_delay_ms=np.array([0, 5]),
    user_id=np.array([3, 4]), item_id=np.array([5, 6]), history=[[1], [2, 3]],
    context={"dev": np.array([7, 8]), "g": [[1, 2], [3]]}, dense={"x": np.array([0.5, 1.5])})
Change = Callable[[list[pa.Array], list[pa.Field], dict[bytes, bytes]], None]


def _encoded(change: Change) -> bytes:
    arrays, fields, meta = list(SB.batch.columns), list(SB.batch.schema), dict(SB.batch.schema.metadata)
    change(arrays, fields, meta)
    batch = pa.RecordBatch.from_arrays(arrays, schema=pa.schema(fields, metadata=meta))
    return b"".join((batch.schema.serialize(), batch.serialize(), b"\xff\xff\xff\xff\x00\x00\x00\x00"))


def _add(name: str, arr: pa.Array) -> Change:
    return lambda a, f, _m: (a.append(arr), f.append(pa.field(name, arr.type)))  # type: ignore[func-returns-value]


def _retype(name: str, to: pa.DataType) -> Change:
    def change(a: list[pa.Array], f: list[pa.Field], _m: dict[bytes, bytes]) -> None:
        i = [x.name for x in f].index(name)
        a[i], f[i] = a[i].cast(to), pa.field(name, to)
    return change


def _reverse(a: list[pa.Array], f: list[pa.Field], _m: dict[bytes, bytes]) -> None:
    a.reverse()
    f.reverse()


def _same(x: TensorBatch, y: TensorBatch) -> bool:
    return all(torch.equal(getattr(x, k), getattr(y, k)) for k in ("values", "offsets", "dense", "labels"))


@pytest.mark.parametrize("change", [
    _add("score", pa.array([1.0, 2.0])),  # a newer joiner's column of its own
    _add("ctx.new", pa.array([1, 2])),  # a context feature this learner's config lacks
    _add("nested", pa.array([{"a": [1]}, {"a": [2]}])),
    _add("long", pa.array([[1], [2]], pa.large_list(pa.int64()))),
    _reverse,
    lambda a, f, m: (f.__setitem__(slice(None), [x.with_nullable(True).with_metadata({b"k": b"v"}) for x in f]),
                     m.update({b"written_by": b"streamrec 9"})),
], ids=["extra_float64", "extra_ctx", "extra_struct", "extra_large_list", "column_order", "nullable_and_metadata"])
def test_what_the_learner_does_not_read_trains_exactly_as_without_it(change: Change) -> None:
    before = to_tensors(SampleBatch.decode(SB.encode()), CFG)
    assert _same(to_tensors(SampleBatch.decode(_encoded(change)), CFG), before)


@pytest.mark.parametrize("change, why", [
    (_retype("ctx.dev", pa.int32()), "ctx.dev"),
    (_retype("user_id", pa.int32()), "user_id"),
    (_retype("history", pa.large_list(pa.int64())), "history"),
    (_retype("ctx.g", pa.list_(pa.field("item", pa.int64(), nullable=False))), "ctx.g"),
    (_retype("impression_id", pa.large_utf8()), "impression_id"),
    (_retype("dense.x", pa.float64()), "dense.x"),
    (_add("ctx.new", pa.array(["x", "y"])), "ctx.new"),
    (_add("score", pa.array([1.0, None])), "nulls"),
    (lambda _a, _f, m: m.update({b"streamrec.schema_version": b"3"}), "schema_version"),
], ids=["ctx_int32", "id_int32", "history_large_list", "list_not_null_values", "large_string", "dense_float64",
        "ctx_string", "extra_with_nulls", "schema_version_3"])
def test_a_column_changed_by_another_version_is_a_dead_letter_naming_it(change: Change, why: str) -> None:
    with pytest.raises(BadMessage, match=why):
        SampleBatch.decode(_encoded(change))


def test_a_dictionary_encoded_column_is_a_dead_letter() -> None:
    i = SB.batch.schema.get_field_index("impression_id")
    batch = SB.batch.set_column(i, "impression_id", SB.batch.column(i).dictionary_encode())
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    with pytest.raises(BadMessage, match="dictionary"):
        SampleBatch.decode(sink.getvalue().to_pybytes())

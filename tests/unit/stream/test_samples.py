from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stream.errors import BadMessage
from stream.events import MAX_TS_MS
from stream.ids import stable_hash, stable_hash_many
from stream.samples import SampleBatch

i64 = st.integers(0, 2**63 - 1)  # hashed ids (stream/ids.py) and MISSING (0)
names = st.text(alphabet="abcdefgh_", min_size=1, max_size=6)


@st.composite
def sample_columns(draw):
    n = draw(st.integers(1, 40))
    col = lambda elems: draw(st.lists(elems, min_size=n, max_size=n))  # noqa: E731
    ctx_names = draw(st.lists(names, unique=True, max_size=3))
    multi = set(draw(st.lists(st.sampled_from(ctx_names), unique=True))) if ctx_names else set()
    return dict(
        impression_id=col(st.text(min_size=1, max_size=20)),
        ts=np.array(col(st.integers(0, MAX_TS_MS)), np.int64),
        label=np.array(col(st.integers(0, 1)), np.int8),
        label_delay_ms=np.array(col(st.integers(0, 10**8)), np.int64),
        user_id=np.array(col(i64), np.int64),
        item_id=np.array(col(i64), np.int64),
        history=col(st.lists(i64, max_size=6)),
        context={c: (col(st.lists(i64, max_size=4)) if c in multi else np.array(col(i64), np.int64))
                 for c in ctx_names},
        dense={d: np.array(col(st.floats(-(2.0**63), 2.0**63, width=32)), np.float32)
               for d in draw(st.lists(names, unique=True, max_size=2))},
    )


@settings(max_examples=100, deadline=None)
@given(cols=sample_columns())
def test_arrow_ipc_round_trip(cols) -> None:
    batch = SampleBatch.from_columns(**cols)
    back = SampleBatch.decode(batch.encode())
    assert back.batch.equals(batch.batch)
    assert back.impression_ids == cols["impression_id"]
    np.testing.assert_array_equal(back.column("user_id"), cols["user_id"])
    values, offsets = back.lists("history")
    assert offsets[0] == 0 and len(offsets) == len(cols["history"]) + 1
    for row, hist in enumerate(cols["history"]):
        assert values[offsets[row]:offsets[row + 1]].tolist() == hist
    assert sorted(back.context_names) == sorted(cols["context"])
    for name, want in cols["dense"].items():
        np.testing.assert_array_equal(back.column("dense." + name), want)


def _written_by_a_stream_writer(batch: pa.RecordBatch) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


@settings(max_examples=60, deadline=None)
@given(cols=sample_columns(), cut=st.tuples(st.integers(0, 39), st.integers(0, 40)))
def test_encode_writes_what_an_arrow_stream_writer_writes_for_a_batch_and_a_slice(cols, cut) -> None:
    batch = SampleBatch.from_columns(**cols).batch
    start = min(cut[0], batch.num_rows - 1)
    for part in (batch, batch.slice(start, cut[1])):  # the joiner sends slices of one batch
        assert SampleBatch(part).encode() == _written_by_a_stream_writer(part)
        assert SampleBatch.decode(SampleBatch(part).encode()).batch.equals(part)


def test_lists_of_a_slice_start_at_zero() -> None:
    b = SampleBatch.from_columns(impression_id=["a", "b", "c"], ts=np.arange(3), label=np.zeros(3),
                                 label_delay_ms=np.zeros(3), user_id=np.arange(3), item_id=np.arange(3),
                                 history=[[1, 2], [3], [4, 5, 6]])
    values, offsets = SampleBatch(b.batch.slice(1, 2)).lists("history")
    assert values.tolist() == [3, 4, 5, 6] and offsets.tolist() == [0, 1, 4]


def test_history_from_flat_values_and_offsets() -> None:
    b = SampleBatch.from_columns(impression_id=["a", "b"], ts=np.arange(2), label=np.ones(2),
                                 label_delay_ms=np.zeros(2), user_id=np.arange(2), item_id=np.arange(2),
                                 history=(np.array([9, 8, 7]), np.array([0, 1, 3])))
    assert b.batch.column("history").to_pylist() == [[9], [8, 7]]


def _raw_ipc(batch: pa.RecordBatch) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    return sink.getvalue().to_pybytes()


def test_decode_rejects_what_is_not_a_v1_samples_batch() -> None:
    with pytest.raises(BadMessage, match="not an Arrow IPC stream"):
        SampleBatch.decode(b"garbage")
    with pytest.raises(BadMessage, match="empty"):
        SampleBatch.decode(b"")
    foreign = pa.RecordBatch.from_pydict({"x": [1, 2]})
    with pytest.raises(BadMessage, match="schema metadata missing"):
        SampleBatch.decode(_raw_ipc(foreign))
    good = SampleBatch.from_columns(impression_id=["a"], ts=np.arange(1), label=np.ones(1),
                                    label_delay_ms=np.zeros(1), user_id=np.arange(1), item_id=np.arange(1),
                                    history=[[]])
    wrong_version = good.batch.replace_schema_metadata({b"streamrec.schema": b"samples",
                                                        b"streamrec.schema_version": b"99"})
    with pytest.raises(BadMessage, match="unsupported samples schema_version"):
        SampleBatch.decode(_raw_ipc(wrong_version))
    no_label = good.batch.drop_columns(["label"]).replace_schema_metadata(good.batch.schema.metadata)
    with pytest.raises(BadMessage, match="column 'label'"):
        SampleBatch.decode(_raw_ipc(no_label))


def test_stable_hash_is_stable_and_canonical() -> None:
    assert stable_hash(123) == stable_hash("123")
    assert stable_hash("u1") != stable_hash("u2")
    # A fixed value: changing the hash would silently remap every trained embedding row.
    assert stable_hash("1m_1") == 0x0 + stable_hash("1m_1") and 0 <= stable_hash("1m_1") < 2**63
    h = stable_hash_many(["a", 1, "b"])
    assert h.dtype == np.int64 and h.tolist() == [stable_hash("a"), stable_hash(1), stable_hash("b")]


def _one(**over) -> bytes:
    cols = dict(impression_id=["a", "b"], ts=np.array([1_700_000_000_000] * 2), label=np.array([1, 0]),
                label_delay_ms=np.array([30_000, 0]), user_id=np.array([1, 2]), item_id=np.array([3, 4]),
                history=[[5], []], context={"genre": [[6], [7, 8]], "device": np.array([9, 0])},
                dense={"price": np.array([1.5, 0.0], np.float32)}, kind=np.array([1, 1], np.int8))
    cols.update(over)
    return SampleBatch.from_columns(**cols).encode()


def test_the_valid_message_of_these_tests_decodes() -> None:
    assert len(SampleBatch.decode(_one())) == 2


@pytest.mark.parametrize(("column", "value"), [("label_delay_ms", -1), ("label_delay_ms", -10**12),
                                               ("label_delay_ms", MAX_TS_MS + 1), ("ts", MAX_TS_MS + 1),
                                               ("ts", -1)])
def test_decode_refuses_times_outside_what_the_joiner_writes(column: str, value: int) -> None:
    """A negative label delay gave the learner's bias NaN; one beyond MAX_TS_MS overflows ts + delay."""
    good = {"ts": np.array([1_700_000_000_000] * 2), "label_delay_ms": np.array([30_000, 0])}[column]
    with pytest.raises(BadMessage, match=f"column '{column}': values outside") as e:
        SampleBatch.decode(_one(**{column: np.array([good[0], value])}))
    assert e.value.kind == "bad_value"


@pytest.mark.parametrize("over", [
    {"user_id": np.array([1, -5])}, {"item_id": np.array([-(2**63), 4])}, {"history": [[5], [1, -7]]},
    {"context": {"genre": [[6], [-1]], "device": np.array([9, 0])}},
    {"context": {"genre": [[6], [7]], "device": np.array([9, -3])}},
], ids=["user_id", "item_id", "history", "ctx list", "ctx scalar"])
def test_decode_refuses_a_negative_hashed_id_in_any_id_or_context_column(over) -> None:
    """No hash the joiner writes is negative; the learner's IdMap raised on one inside training (three crashes
    before the strikes dead-lettered the message)."""
    with pytest.raises(BadMessage, match="negative ids") as e:
        SampleBatch.decode(_one(**over))
    assert e.value.kind == "bad_value"


def _v1_with(kind: pa.Array, label: list[int] | None = None) -> bytes:
    batch = SampleBatch.decode(_one()).batch
    cols = {n: batch.column(n) for n in batch.schema.names if n != "kind"}
    cols["kind"] = kind
    if label is not None:
        cols["label"] = pa.array(label, pa.int8())
    meta = {b"streamrec.schema": b"samples", b"streamrec.schema_version": b"1"}
    return _raw_ipc(pa.RecordBatch.from_arrays(list(cols.values()), schema=pa.schema(
        [pa.field(n, c.type) for n, c in cols.items()], metadata=meta)))


@pytest.mark.parametrize(("kind", "label", "expect"), [
    (pa.array([0, 7], pa.int8()), None, ("bad_value", "column 'kind': values other than")),
    (pa.array([2, 2], pa.int8()), [0, 0], ("bad_value", "delayed_positive row with label 0")),
    (pa.array([0, 257], pa.int64()), None, ("bad_schema", "column 'kind': got int64")),  # wrapped to 1 as int8
    (pa.array([0.0, 1.9]), None, ("bad_schema", "column 'kind': got double")),
], ids=["kind 7", "delayed positive with label 0", "int64 257", "float 1.9"])
def test_a_version_1_message_with_a_kind_column_has_it_checked_as_version_2_does(kind, label, expect) -> None:
    """Version 1 has no kind column, but SampleBatch.kinds reads one that is there: it went to training unchecked."""
    with pytest.raises(BadMessage, match=expect[1]) as e:
        SampleBatch.decode(_v1_with(kind, label))
    assert e.value.kind == expect[0]



@pytest.mark.parametrize("compression", ["zstd", "lz4"])
def test_a_compressed_arrow_body_is_refused_before_it_is_decompressed(compression, monkeypatch) -> None:
    """The joiner never compresses a body; 6 KB of zstd decompressed to a 128 MiB history (2.2 GB in the learner)."""
    batch = SampleBatch.decode(_one()).batch
    ones = pa.array(np.ones(1 << 20, np.int64))
    history = pa.ListArray.from_arrays(pa.array([0, 1 << 20, 1 << 20], pa.int32()), ones)
    bomb = batch.set_column(batch.schema.get_field_index("history"), batch.schema.field("history"), history)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, bomb.schema, options=pa.ipc.IpcWriteOptions(compression=compression)) as w:
        w.write_batch(bomb)
    raw = sink.getvalue().to_pybytes()
    assert len(raw) * 10 < 8 << 20  # the history alone is 8 MiB decompressed

    def no_reading(*a, **k):
        raise AssertionError("the record batch was read (and decompressed)")

    monkeypatch.setattr(pa.ipc, "open_stream", no_reading)
    with pytest.raises(BadMessage, match="compressed") as e:
        SampleBatch.decode(raw)
    assert e.value.kind == "bad_arrow"


def test_a_message_over_the_byte_bound_is_refused_before_it_is_parsed(monkeypatch) -> None:
    import stream.samples as samples
    raw = _one()
    monkeypatch.setattr(samples, "MAX_MESSAGE_BYTES", len(raw) - 1)
    with pytest.raises(BadMessage, match=f"samples message of {len(raw)} bytes, over the bound") as e:
        SampleBatch.decode(raw)
    assert e.value.kind == "too_large"


def test_a_message_over_the_list_value_bound_is_refused(monkeypatch) -> None:
    """List values (history, list context) cost the learner ~100 B each in training: bounded per message."""
    import stream.samples as samples
    monkeypatch.setattr(samples, "MAX_LIST_VALUES", 4)  # _one() holds 1 history id and 3 genre ids
    assert len(SampleBatch.decode(_one()))
    with pytest.raises(BadMessage, match="5 list values .* over the bound of 4") as e:
        SampleBatch.decode(_one(history=[[5, 6], []]))
    assert e.value.kind == "too_large"


def test_decode_refuses_an_empty_impression_id() -> None:
    """The event decoder refuses one, so the joiner never writes one; every impression id is a dedup key."""
    with pytest.raises(BadMessage, match="column 'impression_id': empty impression ids") as e:
        SampleBatch.decode(_one(impression_id=["a", ""]))
    assert e.value.kind == "bad_value"


def test_a_dictionary_batch_is_refused_before_the_stream_is_read(monkeypatch) -> None:
    """Samples columns are never dictionary-encoded; a dictionary batch's body may be compressed too."""
    batch = SampleBatch.decode(_one()).batch
    ids = batch.column("impression_id").dictionary_encode()
    schema = pa.schema([pa.field("impression_id", ids.type), *list(batch.schema)[1:]], metadata=batch.schema.metadata)
    hostile = pa.RecordBatch.from_arrays([ids, *batch.columns[1:]], schema=schema)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, hostile.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as w:
        w.write_batch(hostile)

    def no_reading(*a, **k):
        raise AssertionError("the stream was read (and its dictionary decompressed)")

    monkeypatch.setattr(pa.ipc, "open_stream", no_reading)
    with pytest.raises(BadMessage, match="a dictionary batch") as e:
        SampleBatch.decode(sink.getvalue().to_pybytes())
    assert e.value.kind == "bad_schema"


class _CountedName(str):
    """A column name that counts how often it is compared with another."""

    compared = 0

    def __eq__(self, other: object) -> bool:
        _CountedName.compared += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def test_a_column_named_twice_among_many_is_refused_after_name_comparisons_linear_in_the_columns(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The duplicate-name check counted each name with list.count: quadratic in the columns, and a 16 MiB message
    holds ~280k (null-typed) columns, so one with a name twice held the reader about half an hour per decode (20k
    columns took 10 s, 40k 35 s), past worker_stall_s, at every restart. Its names' comparisons are counted here
    (the reader's batch sees them as a str that counts its __eq__ calls): about one per column now, not columns**2."""
    n = 1000
    fields = [pa.field(f"c{i}", pa.null()) for i in range(n)] + [pa.field("c7", pa.null())]
    batch = pa.RecordBatch.from_arrays([pa.array([], pa.null())] * len(fields),
                                       schema=pa.schema(fields, metadata={b"streamrec.schema": b"samples",
                                                                          b"streamrec.schema_version": b"2"}))
    real_open = pa.ipc.open_stream

    class Batch:
        def __init__(self, b: pa.RecordBatch) -> None:
            self.schema = SimpleNamespace(names=[_CountedName(x) for x in b.schema.names])

    class Reader:
        def __init__(self, source: pa.Buffer) -> None:
            self._r = real_open(source)
            self.schema = self._r.schema

        def __iter__(self):  # type: ignore[no-untyped-def]
            return (Batch(b) for b in self._r)

    monkeypatch.setattr(pa.ipc, "open_stream", Reader)
    _CountedName.compared = 0
    with pytest.raises(BadMessage, match="column 'c7' appears more than once"):
        SampleBatch.decode(_raw_ipc(batch))
    assert _CountedName.compared <= 2 * len(fields)

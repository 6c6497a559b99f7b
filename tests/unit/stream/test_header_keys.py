"""The faust driver's reading of fetched record batches (``stream/joiner/header_keys.py``), through aiokafka's own
fetcher code on batches its Python builder writes (the broker-level test: tests/integration/test_hostile_input.py)."""

from __future__ import annotations

import pytest
from aiokafka.consumer.fetcher import READ_UNCOMMITTED, PartitionRecords
from aiokafka.record.default_records import _DefaultRecordBatchBuilderPy
from aiokafka.structs import TopicPartition

from stream.errors import BadMessage
from stream.joiner.header_keys import _Records, checked
from tests.kafka_io import _RawHeaderKey


def _batch(codec: int) -> bytes:
    builder = _DefaultRecordBatchBuilderPy(magic=2, compression_type=codec, is_transactional=0, producer_id=-1,
                                           producer_epoch=-1, base_sequence=-1, batch_size=1 << 20)
    builder.append(0, timestamp=1, key=b"a", value=b"1", headers=[])
    builder.append(1, timestamp=1, key=b"h", value=b"2", headers=[(_RawHeaderKey(b"\xff\xfe"), b"x"), ("ok", b"y")])
    builder.append(2, timestamp=1, key=b"b", value=b"3", headers=[("trace", b"t")])
    return bytes(builder.build())


@pytest.mark.parametrize("codec", [0, 1], ids=["plain", "gzip"])
def test_a_header_key_not_utf8_in_the_middle_of_a_batch_marks_that_record_and_every_record_comes_once(
        codec: int) -> None:
    """aiokafka's compiled reader raised UnicodeDecodeError at the record, out of every fetch of it; read again by the
    Python reader from there, the fetcher skips the records it had handed on."""
    records = PartitionRecords(TopicPartition("t", 0), _Records(_batch(codec)), [], 0, None, None, True,
                               READ_UNCOMMITTED)
    got = [(r.offset, r.key, r.value, checked(r.headers) if r.headers else r.headers) for r in records]
    assert [g[:3] for g in got] == [(0, b"a", b"1"), (1, b"h", b"2"), (2, b"b", b"3")]
    assert got[0][3] == () and got[2][3] == (("trace", b"t"),)
    assert isinstance(got[1][3], BadMessage) and got[1][3].kind == "bad_header"

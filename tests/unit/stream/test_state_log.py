"""The joiner's state chunks (stream/joiner/state_log.py): what a chunk carries, in parts under the message limit, and
when a restore takes its parts as the chunk."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import orjson
import pytest

from stream.config import DURATION_CAP_S, KafkaSettings
from stream.events import MAX_TS_MS, Click, Impression
from stream.joiner import state_log
from stream.joiner.engine import JoinConfig, PartitionJoin, Pending, StateChunk
from stream.joiner.sample_rows import state_batch
from stream.joiner.state_log import (
    FENCE_SPAN,
    PartitionLog,
    StateLogError,
    _split,
    _whole,
    decode_chunk,
    encode_chunk,
    encode_claim,
    load_chunks,
    next_claim,
)
from tests.unit.stream.test_join_engine import Feed, imp


def pending(i: int, history: list[int]) -> Pending:
    p = Pending(f"imp-{i}", 1_700_000_000_000 + i, 11 + i, 22 + i, {"genres": [5, 6], "age": 25}, {"price": 1.5}, 3)
    p.history = history
    return p


def test_a_chunk_leaves_the_histories_out_and_keeps_everything_else() -> None:
    # Under fake_negative every added impression has had its sample's history attached before the chunk is written;
    # a history is read from Redis whenever a sample goes out, so the state must not carry (and grow with) it.
    with_history = [pending(i, list(range(1_000, 1_050))) for i in range(200)]
    without = [pending(i, []) for i in range(200)]
    chunk = StateChunk(3, with_history, [("imp-1", 1_700_000_000_500)], [], 1_700_000_000_000, (5, 7),
                       1_700_000_000_199)
    encoded = encode_chunk(chunk)
    assert [len(v) for v in encoded] == [len(v) for v in encode_chunk(dataclasses.replace(chunk, added=without))]
    back = decode_chunk(encoded)
    assert [p.history for p in back.added] == [[]] * 200
    assert [dataclasses.replace(p, history=[]) for p in back.added] == without
    assert (back.seq, back.joined, back.offsets, back.max_ts) == (3, [("imp-1", 1_700_000_000_500)], (5, 7),
                                                                  1_700_000_000_000)


def big_chunk() -> StateChunk:
    ids = [f"{'x' * 200}-{i:05d}" for i in range(3000)]
    return StateChunk(7, [pending(i, []) for i in range(300)],
                      [(i, 1_700_000_000_000 + n) for n, i in enumerate(ids[:800])],
                      [(i, 1_700_000_000_001) for i in ids[800:1800]], 1_700_000_000_000, (5, 7), 1_700_000_000_299,
                      ids[1800:2300], [(i, 1_700_000_000_002) for i in ids[2300:]], (1_700_000_000_010, None))


def test_every_list_of_a_chunk_is_split_across_parts_under_the_limit_and_joined_back() -> None:
    # The clicks joined, waiting and given up and the evictions were all in part 0's header, whatever their size: a
    # batch of 5,000 orphan clicks with 256-character ids made a 1.4 MB record, over the producer's message limit.
    chunk = big_chunk()
    parts = encode_chunk(chunk, max_bytes=100_000)
    assert len(parts) > 6 and max(map(len, parts)) <= 100_000
    back = decode_chunk(parts)
    assert dataclasses.replace(back, added=[]) == dataclasses.replace(chunk, added=[])
    assert [dataclasses.replace(p, context=dict(p.context)) for p in back.added] == [
        dataclasses.replace(p, chunk=7) for p in chunk.added]  # a restored impression names the chunk it came in


def test_each_part_says_how_many_parts_its_chunk_has_and_which_write_it_is() -> None:
    parts = encode_chunk(big_chunk(), max_bytes=100_000)
    headers = [orjson.loads(raw[8:8 + int.from_bytes(raw[4:8], "big")]) for raw in parts]
    assert {h["parts"] for h in headers} == {len(parts)} and len({h["write"] for h in headers}) == 1
    again = encode_chunk(big_chunk(), max_bytes=100_000)
    assert orjson.loads(again[0][8:8 + int.from_bytes(again[0][4:8], "big")])["write"] != headers[0]["write"]


def test_a_chunk_written_before_parts_were_counted_still_decodes() -> None:
    # the previous format: every list in part 0's header, no "parts" nor "write" (its max_ts the watermark + lateness)
    chunk = StateChunk(3, [pending(i, []) for i in range(4)], [("imp-1", 1_700_000_000_500)], [("w", 9)],
                       1_700_000_000_000, (5, 7), 1_700_000_000_003, ["e"], [("u", 8)], (1, 2))
    header = orjson.dumps({"seq": 3, "joined": chunk.joined, "waiting": chunk.waiting, "max_ts": chunk.max_ts - 1,
                           "offsets": chunk.offsets, "max_ref_ts": chunk.max_ref_ts, "evicted": chunk.evicted,
                           "unwaited": chunk.unwaited, "topic_max": chunk.topic_max})
    body = state_batch(chunk.added).encode()
    back = decode_chunk([b"SRJ1" + len(header).to_bytes(4, "big") + header + body])
    assert dataclasses.replace(back, added=[]) == dataclasses.replace(chunk, added=[])
    assert [p.impression_id for p in back.added] == [p.impression_id for p in chunk.added]


def test_a_chunk_keeps_its_input_topics_ids_and_without_ids_is_written_as_before() -> None:
    """The ids tell a restore which topics the offsets are of (pipeline._follow_topics); a broker that gives none
    writes the chunk without the field, so a joiner from before it (which refuses a field it does not know) reads it."""
    chunk = StateChunk(3, [pending(1, [])], [], [], 1_700_000_000_000, (5, 7), 1_700_000_000_001)
    with_ids = dataclasses.replace(chunk, topic_ids=("imp-id", None))
    assert decode_chunk(encode_chunk(with_ids)).topic_ids == ("imp-id", None)
    header = state_log._split(encode_chunk(chunk)[0])[0]
    assert "topic_ids" not in header and decode_chunk(encode_chunk(chunk)).topic_ids == (None, None)


def test_a_chunk_whose_parts_are_not_all_there_is_left_out() -> None:
    parts = [_split(raw) for raw in encode_chunk(big_chunk(), max_bytes=100_000)]
    n = len(parts)
    assert _whole(dict(enumerate(parts)))[0] is not None
    assert _whole({i: parts[i] for i in range(n - 1)})[0] is None  # the last part was never written
    assert _whole({i: parts[i] for i in range(1, n)})[0] is None  # part 0 tombstoned: being retired
    stale = [_split(raw) for raw in encode_chunk(big_chunk(), max_bytes=100_000)]
    assert _whole({**dict(enumerate(parts)), 1: stale[1]})[0] is None  # a part of another write of the seq
    whole = _whole({**dict(enumerate(parts)), n: stale[1]})[0]  # a part past this write's count: not in it
    assert whole is not None and len(whole) == n


# -- what a restore reads of the log (load_chunks over the records a read of the topic returns) ------------------------
class _Record:
    def __init__(self, offset: int, key: bytes, value: bytes | None) -> None:
        self._offset, self._key, self._value = offset, key, value

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return self._offset

    def key(self) -> bytes:
        return self._key

    def value(self) -> bytes | None:
        return self._value


def _load(monkeypatch: pytest.MonkeyPatch, records: list[tuple[bytes, bytes | None]]) -> PartitionLog:
    """Partition 0 of a state log holding ``records`` (key, value), in offset order."""
    def read(_kafka: object, _topic: str, apply: Callable[[_Record], None], **_: object) -> None:
        for offset, (key, value) in enumerate(records):
            apply(_Record(offset, key, value))

    monkeypatch.setattr(state_log, "read_to_end", read)
    return load_chunks(KafkaSettings(), "app-join-state", [0])[0]


_HEADER = {"seq": 0, "joined": [["a", 5]], "waiting": [["b", 6]], "max_ts": 1_000, "offsets": [5, 7],
           "max_ref_ts": 1_000, "evicted": ["c"], "unwaited": [["d", 8]], "topic_max": [1_000, 900],
           "topic_top": [[990, 1_000], [900, 950]], "parts": 1, "write": "0a1b2c3d"}


def _raw(header: bytes) -> bytes:
    return b"SRJ1" + len(header).to_bytes(4, "big") + header


def test_a_well_formed_header_loads_as_written(monkeypatch: pytest.MonkeyPatch) -> None:
    # (the header's max_ts is the watermark + lateness; the engine's 1 ms more: watermark = max_ts - lateness - 1)
    (chunk,) = _load(monkeypatch, [(b"0:0:0", _raw(orjson.dumps(_HEADER)))]).chunks
    assert chunk == StateChunk(0, [], [("a", 5)], [("b", 6)], 1_001, (5, 7), 1_000, ["c"], [("d", 8)], (1_000, 900),
                               ([990, 1_000], [900, 950]))


@pytest.mark.parametrize("field, value", [
    ("topic_top", "12"),  # was read as ([1], [2])
    ("topic_top", [[1_000]]),  # one input's: the restore failed on an IndexError naming no record
    ("topic_top", [[1_000], [900], [5]]),
    ("topic_top", [[1.5], [900]]),  # was cut to 1
    ("topic_top", [[True], [900]]),
    ("topic_max", [1_000]),
    ("topic_max", ["1000", None]),
    ("offsets", [5]),
    ("offsets", "57"),
    ("max_ts", "1000"),
    ("max_ref_ts", None),
    ("seq", 9),  # not the key's: retired under a key it does not have
    ("joined", ["ab"]),  # was read as the click ("a", "b")
    ("joined", [["a"]]),
    ("waiting", [["b", "6"]]),
    ("unwaited", [[7, 8]]),
    ("evicted", [5]),
    ("parts", True),  # was taken as 1 part
    ("parts", 0),
    ("parts", "1"),
    ("write", 5),
    ("topic_ids", ["a"]),
    ("topic_ids", [5, None]),
])
def test_a_header_field_of_the_wrong_shape_is_refused_naming_the_record(
        monkeypatch: pytest.MonkeyPatch, field: str, value: object) -> None:
    with pytest.raises(StateLogError, match=rf"app-join-state partition 0: the record b'0:0:0' \(offset 1\b.*{field}"):
        _load(monkeypatch, [(b"0:claim", encode_claim([])), (b"0:0:0", _raw(orjson.dumps({**_HEADER, field: value})))])


@pytest.mark.parametrize("field, value", [
    ("max_ts", (1 << 63) - 1),  # restored; the drain then wrote a chunk past int64 that the next restore refused
    ("max_ts", -2),
    ("max_ref_ts", (1 << 63) - 1),
    ("waiting", [["b", (1 << 63) - 1]]),  # a click waiting at int64 max: the drain moved time past it, past int64
    ("joined", [["a", MAX_TS_MS + 1]]),
    ("unwaited", [["d", -1]]),
    ("topic_max", [MAX_TS_MS + 1, None]),
    ("topic_top", [[990, 1 << 62], [900]]),
])
def test_a_time_no_joiner_writes_is_refused_naming_the_record(
        monkeypatch: pytest.MonkeyPatch, field: str, value: object) -> None:
    """Any int64 was taken as a time: a forged ``max_ts`` or click time near int64 max restored, the drain moved event
    time past it (a window and the lateness on), and the chunk it wrote past int64 was then refused at the next
    restore as the joiner's own record: the partition blocked. Event times are in [0, MAX_TS_MS] (events.py), the
    event time a drain reaches at most two duration caps later."""
    with pytest.raises(StateLogError, match=rf"b'0:0:0' \(offset 0\b.*{field}"):
        _load(monkeypatch, [(b"0:0:0", _raw(orjson.dumps({**_HEADER, field: value})))])


def test_a_drain_at_the_last_event_time_with_the_longest_window_restores() -> None:
    """The bound is exact for what a joiner writes: an impression at MAX_TS_MS drained with the longest window and
    lateness the settings allow restores from the chunk it wrote."""
    cap_ms = int(DURATION_CAP_S * 1000)
    cfg = JoinConfig(window_ms=cap_ms, lateness_ms=cap_ms, late_retention_ms=5000, watermark_quorum=1)
    eng = PartitionJoin(0, cfg)
    first = eng.apply([(1, Impression("i", MAX_TS_MS, "u", 1, {}))], [(1, Click("i", MAX_TS_MS))])
    drained = eng.apply([], [], drain=True)
    back = PartitionJoin.restore(0, cfg, [decode_chunk(encode_chunk(c)) for c in (first.chunk, drained.chunk)])
    assert back.watermark == eng.watermark == MAX_TS_MS + cap_ms


def test_a_time_outside_int64_is_refused_naming_the_record(monkeypatch: pytest.MonkeyPatch) -> None:
    header = orjson.dumps(_HEADER).replace(b"[990,1000]", b"[990,18446744073709551615]")  # the engine's times are int64
    with pytest.raises(StateLogError, match=r"b'0:0:0' \(offset 0\b.*topic_top"):
        _load(monkeypatch, [(b"0:0:0", _raw(header))])


@pytest.mark.parametrize("key", [
    b"5:0:0",  # another partition's key in partition 0: was taken as partition 0's chunk 0
    b"0:00:0",  # a second key for chunk 0 part 0, which its tombstone never removes
    b"0:0_0:0",
    b"0:+0:0",
    b"0: 0:0",
    b"0:-1:0",  # (its header's seq -1 too)
    b"0:0:-1",
])
def test_a_chunk_key_not_written_by_this_partitions_joiner_is_refused_naming_it(
        monkeypatch: pytest.MonkeyPatch, key: bytes) -> None:
    with pytest.raises(StateLogError, match=rf"partition 0: the record {re.escape(repr(key))} \(offset 0\b"):
        _load(monkeypatch, [(key, _raw(orjson.dumps({**_HEADER, "seq": -1 if key == b"0:-1:0" else 0})))])


def test_a_part_claiming_a_huge_part_count_is_left_out_as_incomplete_without_counting_to_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # _whole listed the parts 0..n-1 its head named: "parts": 2**62 made the restore build a list of 2**62 entries
    # (10**8 took 9 s and 800 MB; this one never ends but in a MemoryError)
    plog = _load(monkeypatch, [(b"0:0:0", _raw(orjson.dumps({**_HEADER, "parts": 1 << 62}))),
                               (b"0:1:0", _raw(orjson.dumps({**_HEADER, "seq": 1})))])
    assert [c.seq for c in plog.chunks] == [1] and plog.incomplete == {0: [0]}


def test_a_claim_past_int64_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # was read, and the new owner's claim (its range past it) failed to encode: a TypeError naming no record, at every
    # restore
    with pytest.raises(StateLogError, match=r"the record b'0:claim' \(offset 0\b"):
        _load(monkeypatch, [(b"0:claim", b'{"fenced":[[0,18446744073709551606]]}')])


def test_a_claim_leaving_a_new_owner_no_int64_seq_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # the new owner numbered its chunks from 2**63 + 65527: each was refused by the next restore, naming that chunk
    with pytest.raises(StateLogError, match=r"the record b'0:claim' \(offset 1\b"):
        _load(monkeypatch, [(b"0:0:0", _raw(orjson.dumps(_HEADER))),
                            (b"0:claim", b'{"fenced":[[1,9223372036854775798]]}')])
    top = f"{(1 << 63) - 1 - FENCE_SPAN}".encode()  # a chunk as high: a claim past it would not be int64
    with pytest.raises(StateLogError, match=rf"the record b'0:{top.decode()}:0' \(offset 0\b"):
        _load(monkeypatch, [(b"0:%s:0" % top, _raw(orjson.dumps({**_HEADER, "seq": int(top)})))])
    plog = _load(monkeypatch, [(b"0:claim", b'{"fenced":[[0,%d]]}' % ((1 << 63) - 2 - FENCE_SPAN))])
    assert next_claim(plog)[1] == (1 << 63) - 1  # the highest a claim can leave: its owner's first chunk an int64


def test_a_claim_records_the_emission_settings_its_owner_writes_under_and_refuses_a_damaged_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The restore compares them with the joiner's (pipeline.JoinPipeline._check_emission): the policy alone let an
    # es_dfm state restored under another elapsed_s, or any state under another window or lateness, lose samples
    es_dfm = JoinConfig(window_ms=60_000, lateness_ms=5_000, policy="es_dfm", elapsed_ms=20_000)
    claim, _ = next_claim(PartitionLog([], {}, {}), emission=es_dfm.emission())
    assert _load(monkeypatch, [(b"0:claim", claim)]).emission == {"policy": "es_dfm", "window_ms": 60_000,
                                                                   "lateness_ms": 5_000, "elapsed_ms": 20_000}
    assert JoinConfig(policy="wait").emission().keys() == {"policy", "window_ms", "lateness_ms"}  # no elapsed time
    assert _load(monkeypatch, [(b"0:claim", b'{"fenced":[],"policy":"wait"}')]).emission == {"policy": "wait"}
    for bad in (b'"5"', b"-1", b"true", b"1.5"):
        with pytest.raises(StateLogError, match=r"the record b'0:claim' .*elapsed_ms must be an integer"):
            _load(monkeypatch, [(b"0:claim", b'{"fenced":[],"elapsed_ms":%s}' % bad)])


def _old_joiner_chunk(lateness_ms: int) -> list[bytes]:
    """The chunk the joiner before the 1 ms watermark (d910cad) wrote for a batch that added impression "a" at 100 and
    moved both inputs (quorum 1, window 1000) to 1100 + lateness: its watermark ``max_ts - lateness`` = 1100 closed
    "a" (ts + window = 1100) and sent its negative in that batch, and gave the click "z" at 1100 up as an orphan."""
    a = Pending("a", 100, 11, 22, {"age": 25}, {}, 0)
    now = 1100 + lateness_ms
    header = orjson.dumps({"seq": 0, "joined": [], "waiting": [["z", 1100]], "max_ts": now, "offsets": [1, 0],
                           "max_ref_ts": 1100, "evicted": [], "unwaited": [], "topic_max": [now, now],
                           "topic_top": [[now], [now]], "parts": 1, "write": "0a1b2c3d"})
    return [_raw(header) + state_batch([a]).encode()]


@pytest.mark.parametrize("lateness_ms", [0, 5])
def test_a_chunk_of_the_joiner_before_the_1ms_watermark_restores_its_watermark_so_nothing_is_emitted_twice(
        lateness_ms: int) -> None:
    """A rolling upgrade: the new joiner restores the old one's chunk. Read with the new watermark rule (max_ts -
    lateness - 1) the restored watermark stood 1 ms short of where the old joiner had closed: "a" was pending again and
    went out a second time (a second negative at the drain), and the click "z" it had reported an orphan was reported
    again."""
    cfg = JoinConfig(window_ms=1000, lateness_ms=lateness_ms, late_retention_ms=5000, watermark_quorum=1)
    eng = PartitionJoin.restore(0, cfg, [decode_chunk(_old_joiner_chunk(lateness_ms))])
    drained = eng.apply([], [], drain=True)
    assert [s.pending.impression_id for s in drained.samples] == [] and drained.unjoined == []
    assert PartitionJoin.restore(0, cfg, [decode_chunk(_old_joiner_chunk(lateness_ms))]).watermark == 1100


@pytest.mark.parametrize("lateness_ms", [0, 5])
def test_a_chunk_states_the_watermark_as_the_joiner_before_the_1ms_watermark_reads_it(lateness_ms: int) -> None:
    """The other side of a rolling upgrade: a joiner not yet upgraded restores the new one's chunk and takes the
    header's ``max_ts - lateness`` as its watermark, expiring what it passed as already emitted. One past the new
    watermark lost every impression and waiting click exactly at it (the new joiner had not closed them; the old one
    never would)."""
    cfg = JoinConfig(window_ms=1000, lateness_ms=lateness_ms, late_retention_ms=5000, watermark_quorum=1)
    eng, f = PartitionJoin(0, cfg), Feed()
    res = eng.apply(f.imps(imp("a", 100 - 1), imp("b", 1100 + lateness_ms)), f.clicks(Click("b", 1100 + lateness_ms)))
    assert eng.watermark == 1099 and "a" not in eng.pending  # "a" (ts + window = 1099) closed in this batch
    assert res.chunk is not None
    (raw,) = encode_chunk(res.chunk)
    header, _ = _split(raw)
    assert header["max_ts"] - lateness_ms == eng.watermark



def test_a_header_field_of_a_newer_joiner_is_refused_naming_it_not_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rollback (or an older member of a rolling upgrade) reading a chunk written by a newer joiner: a header field
    this version does not know is state it cannot restore. Taken without it, the restore rebuilt another state in
    silence (as older joiners did with ``parts``: a chunk restored from part 0 alone claimed its whole batch); refused,
    the record is named and the operator told to run the version that wrote it."""
    with pytest.raises(StateLogError, match=r"b'0:0:0' \(offset 0\b.*'held'.*newer"):
        _load(monkeypatch, [(b"0:0:0", _raw(orjson.dumps({**_HEADER, "held": [["e", 7]]})))])
    with pytest.raises(ValueError, match=r"'held'"):
        decode_chunk([_raw(orjson.dumps({**_HEADER, "held": [["e", 7]]}))])


def test_a_column_of_a_newer_joiner_in_a_chunks_impressions_is_refused_naming_it_not_dropped() -> None:
    """The chunk's added impressions (an Arrow sample batch) with a column this version neither writes nor reads: a
    newer joiner's per-impression state, which the restore dropped in silence."""
    import pyarrow as pa

    batch = state_batch([pending(i, []) for i in range(2)]).batch
    newer = batch.append_column(pa.field("emitted", pa.int8(), nullable=False), pa.array([1, 0], pa.int8()))
    body = b"".join((newer.schema.serialize(), newer.serialize(), b"\xff\xff\xff\xff\x00\x00\x00\x00"))
    header = orjson.dumps({**_HEADER, "joined": [], "waiting": [], "evicted": [], "unwaited": []})
    assert len(decode_chunk([_raw(header) + state_batch([pending(i, []) for i in range(2)]).encode()]).added) == 2
    with pytest.raises(ValueError, match=r"'emitted'.*newer"):
        decode_chunk([_raw(header) + body])

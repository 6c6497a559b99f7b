"""An event-log import checks rows against the joiner's ``[limits]`` (``load_eventlog(limits=...)``), not the built-in
defaults: raised, it publishes the ids and context the joiner accepts; lowered, it dead-letters at the source what the
joiner would dead-letter (so nothing it publishes is refused downstream)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stream.errors import ValidationError
from stream.events import Impression, decode_impression
from stream.limits import DEFAULT_LIMITS, EventLimits
from stream.replay.column_map import ColumnMap, EventLogError
from stream.replay.config import ClickDelay, DelayKind
from stream.replay.eventlog import load_eventlog
from stream.replay.table import EventTable

FIXED = ClickDelay(DelayKind.FIXED, median_s=30.0)
COLS = ColumnMap(time_unit="ms", impression_id="imp", clicked=None, features=("cat", "tags"))
LONG = "x" * 300  # over the default max_str_len (256)


def write_log(path: Path, rows: list[dict]) -> Path:
    """A Parquet log of ``rows`` (keys imp, user_id, item_id, ts, cat, tags)."""
    pq.write_table(pa.table({
        "imp": [r["imp"] for r in rows], "user_id": [r["user_id"] for r in rows],
        "item_id": [r["item_id"] for r in rows], "ts": pa.array([1000 + i for i in range(len(rows))], pa.int64()),
        "cat": [r.get("cat", "c") for r in rows], "tags": pa.array([r.get("tags", []) for r in rows],
                                                                   pa.list_(pa.string()))}), path)
    return path


def published(t: EventTable) -> list[Impression]:
    """The accepted rows as the publisher builds their events."""
    ctx = [{} for _ in range(t.n_impressions)]
    for part in t.context:
        for i, k in enumerate(part.index.tolist()):
            ctx[i].update(part.dicts[k])
    return [Impression(imp, ts, u, it, c) for imp, ts, u, it, c in zip(
        t.impression_id.tolist(), t.ts.tolist(), t.user_id.tolist(), t.item_id.tolist(), ctx, strict=True)]


def test_raised_max_str_len_imports_the_long_ids_and_context_the_joiner_accepts(tmp_path: Path) -> None:
    """With [limits] max_str_len = 512 the joiner accepts 300-char ids and context values: so does the import."""
    path = write_log(tmp_path / "long.parquet", [
        {"imp": LONG, "user_id": "u" + LONG, "item_id": "i" + LONG, "cat": LONG, "tags": [LONG]}])
    raised = EventLimits(max_str_len=512)
    t = load_eventlog(path, COLS, FIXED, seed=0, limits=raised)
    assert t.stats["rejected_rows"] == 0 and t.n_impressions == 1
    (imp,) = published(t)
    assert decode_impression(imp.encode(), raised) == imp  # the joiner's decoder, under the same limits
    refused = load_eventlog(path, COLS, FIXED, seed=0)  # the defaults: the same row is refused
    assert refused.n_impressions == 0 and refused.stats["rejected_by_field"] == {"impression_id": 1}


LOWERED = EventLimits(max_str_len=8, max_list_len=2, max_message_bytes=400)
ROWS = [  # (imp, row's other values): the field each breaks under LOWERED (None: accepted)
    ("ok", {"user_id": "u1", "item_id": "i1", "tags": ["a", "b"]}, None),
    ("longimp-9", {"user_id": "u2", "item_id": "i2"}, "impression_id"),
    ("longuser", {"user_id": "u" * 9, "item_id": "i3"}, "user_id"),
    ("longitem", {"user_id": "u4", "item_id": "i" * 9}, "item_id"),
    ("longcat", {"user_id": "u5", "item_id": "i5", "cat": "c" * 9}, "context.cat"),
    ("manytags", {"user_id": "u6", "item_id": "i6", "tags": ["a", "b", "c"]}, "context.tags"),
    ("longtag", {"user_id": "u7", "item_id": "i7", "tags": ["t" * 9]}, "context.tags"),
]


def test_lowered_limits_dead_letter_at_import_what_the_joiner_would_refuse(tmp_path: Path) -> None:
    path = write_log(tmp_path / "low.parquet", [{"imp": imp, **row} for imp, row, _ in ROWS])
    t = load_eventlog(path, COLS, FIXED, seed=0, limits=LOWERED)
    want = {imp: field for imp, _, field in ROWS if field}
    got = {m.key.decode(): m.error.field for m in t.raw}
    assert got == {("low-000000001" if k == "longimp-9" else k): v for k, v in want.items()}  # a bad id: generated key
    assert all("[limits]" in m.error.expected for m in t.raw)  # the reason names the setting to change
    for imp in published(t):  # what is published the joiner accepts
        assert decode_impression(imp.encode(), LOWERED) == imp
    everything = published(load_eventlog(path, COLS, FIXED, seed=0))  # under the defaults all are published...
    for imp in everything:
        if imp.impression_id in want:  # ... and the joiner dead-letters these
            with pytest.raises(ValidationError):
                decode_impression(imp.encode(), LOWERED)


def test_lowered_max_message_bytes_rejects_an_event_the_joiner_would_find_too_large(tmp_path: Path) -> None:
    small = EventLimits(max_message_bytes=200)
    path = write_log(tmp_path / "big.parquet", [{"imp": "small", "user_id": "u", "item_id": "i"},
                                                {"imp": "big", "user_id": "u", "item_id": "i", "tags": ["t"] * 40}])
    t = load_eventlog(path, COLS, FIXED, seed=0, limits=small)
    assert [(m.key, m.error.kind) for m in t.raw] == [(b"big", "too_large")]
    (imp,) = published(t)
    assert decode_impression(imp.encode(), small) == imp
    assert load_eventlog(path, COLS, FIXED, seed=0).stats["rejected_rows"] == 0  # under the defaults it fits


def test_key_limits_of_the_limits_section_bound_the_column_mapping(tmp_path: Path) -> None:
    """Column names become context keys: a mapping the configured limits make every event break is refused."""
    path = write_log(tmp_path / "keys.parquet", [{"imp": "a", "user_id": "u", "item_id": "i"}])
    with pytest.raises(EventLogError, match=r"at most 1 keys \(\[limits\] max_context_keys\)"):
        load_eventlog(path, COLS, FIXED, seed=0, limits=EventLimits(max_context_keys=1))
    with pytest.raises(EventLogError, match=r"at most 3 chars \(\[limits\] max_key_len\)"):
        load_eventlog(path, COLS, FIXED, seed=0, limits=EventLimits(max_key_len=3))
    assert load_eventlog(path, COLS, FIXED, seed=0, limits=DEFAULT_LIMITS).n_impressions == 1


def test_a_shorter_future_ts_s_dead_letters_a_row_the_defaults_publish(tmp_path: Path) -> None:
    import time

    ahead = int(time.time() * 1000) + 600_000  # 10 min ahead: inside the default hour, past a 60 s bound
    pq.write_table(pa.table({"user_id": [1], "item_id": [2], "ts": pa.array([ahead], pa.int64())}),
                   tmp_path / "f.parquet")
    cols = ColumnMap(time_unit="ms", clicked=None)
    t = load_eventlog(tmp_path / "f.parquet", cols, FIXED, seed=0, limits=EventLimits(future_ts_s=60))
    assert [m.error.kind for m in t.raw] == ["future_ts"] and "at most 60 s ahead" in t.raw[0].error.reason
    assert load_eventlog(tmp_path / "f.parquet", cols, FIXED, seed=0).n_impressions == 1


def test_generated_impression_ids_over_max_str_len_refuse_the_file_not_publish_what_the_joiner_rejects(
        tmp_path: Path) -> None:
    """Without an impression id column each row's id is generated from the file name (``<stem>-<row:09d>``). Under a
    lowered max_str_len that id was over it for every row, yet every row was published: the joiner dead-lettered each
    impression (and its click). Now the import is refused up front, naming the fixes."""
    path = tmp_path / "clickstream_export_2024_week_03.csv"  # ids of 41 chars
    path.write_text("user_id,item_id,ts\n1,2,1700000000000\n")
    lowered = EventLimits(max_str_len=32)
    with pytest.raises(EventLogError, match=r"41 chars.*max_str_len.*--impression-id-col"):
        load_eventlog(path, ColumnMap(clicked=None), FIXED, seed=0, limits=lowered)
    fits = load_eventlog(path, ColumnMap(clicked=None), FIXED, seed=0, limits=EventLimits(max_str_len=41))
    assert [decode_impression(i.encode(), EventLimits(max_str_len=41)).impression_id for i in published(fits)] == [
        "clickstream_export_2024_week_03-000000000"]

"""The Parquet/CSV event-log source (stream/replay/eventlog.py): pure logic, no broker."""

from __future__ import annotations

import math
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stream.errors import ValidationError
from stream.events import MAX_TS_MS, Click, Impression, decode_click, decode_impression
from stream.replay.column_map import ColumnMap, EventLogError
from stream.replay.config import ClickDelay, DelayKind
from stream.replay.eventlog import load_eventlog
from stream.replay.table import IMPRESSION, EventTable, draw_click_delays_ms

FIXED = ClickDelay(DelayKind.FIXED, median_s=30.0)
LOGNORMAL = ClickDelay(DelayKind.LOGNORMAL, median_s=30.0, sigma=1.0)
T0 = 978_300_760  # 2000-12-31T22:12:40Z, seconds


def write_csv(path: Path, header: list[str], rows: list[list[object]], sep: str = ",") -> Path:
    lines = [sep.join(header)] + [sep.join("" if v is None else str(v) for v in row) for row in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def write_parquet(path: Path, columns: dict[str, pa.Array | list]) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


def impressions(t: EventTable) -> list[Impression]:
    """The impressions as the publisher builds them (Python values via tolist())."""
    users, items, ts = t.user_id.tolist(), t.item_id.tolist(), t.ts.tolist()
    parts = [(p.index.tolist(), p.dicts) for p in t.context]
    dense = {k: v.tolist() for k, v in t.dense.items()}
    out = []
    for i, imp_id in enumerate(t.impression_id.tolist()):
        ctx: dict = {}
        for index, dicts in parts:
            ctx.update(dicts[index[i]])
        out.append(Impression(imp_id, ts[i], users[i], items[i], ctx, {k: v[i] for k, v in dense.items()}))
    return out


def check_table(t: EventTable) -> list[Impression]:
    """Invariants every load must keep; returns the decoded impressions."""
    s = t.stats
    assert t.n_impressions + s["rejected_rows"] == s["rows_read"]
    assert len(t.raw) == s["rejected_rows"] == sum(s["rejected_by_field"].values())
    assert s["clicked_rows"] == t.n_clicks
    assert t.ts.dtype == np.int64 and t.click_ts.dtype == np.int64
    for v in t.dense.values():
        assert v.dtype == np.float64 and len(v) == t.n_impressions
    decoded = []
    for imp in impressions(t):
        back = decode_impression(imp.encode())  # must not raise
        assert back == imp
        decoded.append(back)
    ts_by_id = dict(zip(t.impression_id.tolist(), t.ts.tolist(), strict=True))
    for cid, cts in zip(t.click_impression_id.tolist(), t.click_ts.tolist(), strict=True):
        decode_click(Click(cid, cts).encode())
        assert cts >= ts_by_id[cid]
    for raw in t.raw:
        assert raw.topic_kind == IMPRESSION
        assert isinstance(raw.error, ValidationError)
        assert isinstance(raw.key, bytes) and raw.key
        assert isinstance(orjson.loads(raw.value), dict)
    return decoded


def rejected(t: EventTable) -> dict[str, str]:
    """key -> field of the rejected rows."""
    return {m.key.decode(): m.error.field for m in t.raw}


# -- happy paths ------------------------------------------------------------------------------------
def test_csv_with_custom_columns_seconds_and_generated_ids(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "my_log.csv", ["uid", "iid", "when", "clk", "genre", "price"], [
        [1, 10, T0 + 5, 1, "Drama", 1.5],
        [2, 11, T0, 0, "Comedy", 2],
        [3, 12, T0 + 9, "", "", 0.25],
    ])
    cols = ColumnMap(user="uid", item="iid", time="when", time_unit="s", clicked="clk",
                     features=("genre",), dense=("price",))
    t = load_eventlog(path, cols, FIXED, seed=1)
    imps = check_table(t)
    assert t.impression_id.tolist() == ["my_log-000000000", "my_log-000000001", "my_log-000000002"]
    assert t.ts.tolist() == [(T0 + 5) * 1000, T0 * 1000, (T0 + 9) * 1000]
    assert t.user_id.tolist() == [1, 2, 3] and all(type(u) is int for u in t.user_id.tolist())
    assert t.item_id.tolist() == [10, 11, 12]
    assert [i.context for i in imps] == [{"genre": "Drama"}, {"genre": "Comedy"}, {}]  # empty cell dropped
    assert t.dense["price"].tolist() == [1.5, 2.0, 0.25]
    assert t.click_impression_id.tolist() == ["my_log-000000000"]
    assert t.click_ts.tolist() == [(T0 + 5) * 1000 + 30_000]  # fixed 30 s delay
    assert t.stats["format"] == "csv" and t.stats["file"] == str(path)
    assert t.stats["rows_read"] == 3 and t.stats["rejected_rows"] == 0 and t.stats["clicked_rows"] == 1


def test_parquet_with_mapped_ids_lists_click_time_and_string_ids(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "log.parquet", {
        "rid": ["a", "b", "c", "d"],
        "who": ["u1", "u2", "u1", "u3"],
        "what": pa.array([5, 6, 7, 8], pa.int32()),
        "t_ms": [1000, 2000, 3000, 4000],
        "is_click": [True, True, False, True],
        "click_ms": pa.array([1500, None, None, 4000], pa.int64()),
        "tags": pa.array([["x", "y"], None, [], ["z", None]], pa.list_(pa.string())),
        "age": pa.array([30, None, 41, 22], pa.int64()),
        "device": pa.array(["ios", "web", None, "ios"]).dictionary_encode(),
        "score": [0.5, -1.0, 2.0, 1e9],
    })
    cols = ColumnMap(time_unit="ms", user="who", item="what", time="t_ms", impression_id="rid", clicked="is_click",
                     click_time="click_ms", features=("tags", "age", "device"), dense=("score",))
    t = load_eventlog(path, cols, FIXED, seed=3)
    imps = check_table(t)
    assert t.stats["format"] == "parquet"
    assert t.impression_id.tolist() == ["a", "b", "c", "d"]
    assert t.user_id.tolist() == ["u1", "u2", "u1", "u3"] and t.item_id.tolist() == [5, 6, 7, 8]
    assert [i.context for i in imps] == [
        {"tags": ["x", "y"], "age": 30, "device": "ios"},
        {"device": "web"},
        {"tags": [], "age": 41},
        {"tags": ["z"], "age": 22, "device": "ios"},  # null list entry dropped
    ]
    clicks = dict(zip(t.click_impression_id.tolist(), t.click_ts.tolist(), strict=True))
    assert clicks == {"a": 1500, "b": 2000 + 30_000, "d": 4000}  # column, else drawn delay; equal ts ok
    assert t.dense["score"].tolist() == [0.5, -1.0, 2.0, 1e9]


@pytest.mark.parametrize("unit,scale", [("s", 1), ("ms", 1000), ("us", 1_000_000), ("ns", 1_000_000_000)])
def test_numeric_time_units(tmp_path: Path, unit: str, scale: int) -> None:
    path = write_parquet(tmp_path / "u.parquet", {
        "user_id": [1, 2], "item_id": [1, 2], "ts": [T0 * scale, (T0 + 1) * scale], "clicked": [0, 0],
    })
    t = load_eventlog(path, ColumnMap(time_unit=unit), FIXED, seed=0)
    check_table(t)
    assert t.ts.tolist() == [T0 * 1000, (T0 + 1) * 1000]


def test_float_seconds_round_to_ms(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "f.csv", ["user_id", "item_id", "ts"], [[1, 2, f"{T0}.123"], [1, 2, f"{T0}.5"]])
    t = load_eventlog(path, ColumnMap(time_unit="s", clicked=None), FIXED, seed=0)
    assert t.ts.tolist() == [T0 * 1000 + 123, T0 * 1000 + 500]


def test_iso_strings_in_csv(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "iso.csv", ["user_id", "item_id", "ts", "clicked"], [
        ["u", "i", "2000-12-31T22:12:40Z", 0],
        ["u", "i", "2000-12-31 22:12:40.250", 0],  # no offset: UTC
        ["u", "i", "2001-01-01T00:12:40+02:00", 0],
        ["u", "i", "2000-12-31", 0],
    ])
    t = load_eventlog(path, ColumnMap(time_unit="iso"), FIXED, seed=0)
    check_table(t)
    assert t.ts.tolist() == [T0 * 1000, T0 * 1000 + 250, T0 * 1000, 978_220_800_000]


def test_iso_uniform_strings_use_the_fast_path(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "iso.parquet", {
        "user_id": ["u", "v"], "item_id": ["i", "j"], "ts": ["2000-12-31T22:12:40", "2000-12-31T22:12:41.5"],
    })
    t = load_eventlog(path, ColumnMap(time_unit="iso", clicked=None), FIXED, seed=0)
    assert t.ts.tolist() == [T0 * 1000, T0 * 1000 + 1500]


def test_arrow_timestamp_and_date_columns(tmp_path: Path) -> None:
    when = datetime.fromtimestamp(T0, timezone.utc)
    path = write_parquet(tmp_path / "ts.parquet", {
        "user_id": [1], "item_id": [2],
        "ts": pa.array([when], pa.timestamp("us", "UTC")),
        "naive": pa.array([when.replace(tzinfo=None)], pa.timestamp("ns")),
        "day": pa.array([when.date()], pa.date32()),
    })
    for col, expected in (("ts", T0 * 1000), ("naive", T0 * 1000), ("day", 978_220_800_000)):
        t = load_eventlog(path, ColumnMap(time=col, time_unit="iso", clicked=None), FIXED, seed=0)
        assert t.ts.tolist() == [expected]
    # a timestamp column carries its own unit, whatever time_unit says
    t = load_eventlog(path, ColumnMap(time="ts", time_unit="s", clicked=None), FIXED, seed=0)
    assert t.ts.tolist() == [T0 * 1000]


def test_clicked_values(tmp_path: Path) -> None:
    values = ["TRUE", "false", "Yes", "no", "1", "0", ""]
    path = write_csv(tmp_path / "c.csv", ["user_id", "item_id", "ts", "clicked"],
                     [[1, 2, 1000 + k, v] for k, v in enumerate(values)])
    t = load_eventlog(path, ColumnMap(time_unit="ms"), FIXED, seed=0)
    check_table(t)
    assert t.click_impression_id.tolist() == ["c-000000000", "c-000000002", "c-000000004"]
    for typed, expected in ((pa.array([True, False, None]), 1), (pa.array([3, 0, None]), 1),
                            (pa.array([1.0, 0.0, float("nan")]), 1)):
        p = write_parquet(tmp_path / "c.parquet", {"user_id": [1, 2, 3], "item_id": [1, 2, 3],
                                                   "ts": [1, 2, 3], "clicked": typed})
        assert load_eventlog(p, ColumnMap(time_unit="ms"), FIXED, seed=0).n_clicks == expected


def test_no_clicked_column_and_click_time_only(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "p.parquet", {
        "user_id": [1, 2], "item_id": [1, 2], "ts": [1000, 2000], "click_at": pa.array([None, 2500], pa.int64()),
    })
    assert load_eventlog(path, ColumnMap(time_unit="ms", clicked=None), FIXED, seed=0).n_clicks == 0
    t = load_eventlog(path, ColumnMap(time_unit="ms", clicked=None, click_time="click_at"), FIXED, seed=0)
    assert t.click_impression_id.tolist() == ["p-000000001"] and t.click_ts.tolist() == [2500]


def test_drawn_delays_are_seeded_and_per_row(tmp_path: Path) -> None:
    n = 50
    path = write_parquet(tmp_path / "d.parquet", {
        "user_id": list(range(n)), "item_id": list(range(n)), "ts": [10_000 * k for k in range(n)],
        "clicked": [k % 3 == 0 for k in range(n)],
    })
    a = load_eventlog(path, ColumnMap(time_unit="ms"), LOGNORMAL, seed=11)
    b = load_eventlog(path, ColumnMap(time_unit="ms"), LOGNORMAL, seed=11)
    c = load_eventlog(path, ColumnMap(time_unit="ms"), LOGNORMAL, seed=12)
    assert a.click_ts.tolist() == b.click_ts.tolist() != c.click_ts.tolist()
    delays = draw_click_delays_ms(LOGNORMAL, n, np.random.Generator(np.random.PCG64(11)))
    clicked = np.arange(n) % 3 == 0
    assert a.click_ts.tolist() == (np.arange(n)[clicked] * 10_000 + delays[clicked]).tolist()
    # limit keeps the first rows and their delays
    head = load_eventlog(path, ColumnMap(time_unit="ms"), LOGNORMAL, seed=11, limit=20)
    assert head.click_ts.tolist() == a.click_ts.tolist()[: len(head.click_ts)]


def test_limit_takes_the_first_rows_of_the_file(tmp_path: Path) -> None:
    rows = [[k, k, 10_000 - k, 0] for k in range(10)]  # file order is reverse time order
    path = write_csv(tmp_path / "l.csv", ["user_id", "item_id", "ts", "clicked"], rows)
    t = load_eventlog(path, ColumnMap(time_unit="ms"), FIXED, seed=0, limit=3)
    assert t.user_id.tolist() == [0, 1, 2] and t.stats["rows_read"] == 3
    pq_path = write_parquet(tmp_path / "l.parquet", {"user_id": list(range(10)), "item_id": list(range(10)),
                                                     "ts": list(range(10))})
    t = load_eventlog(pq_path, ColumnMap(time_unit="ms", clicked=None), FIXED, seed=0, limit=4)
    assert t.user_id.tolist() == [0, 1, 2, 3]
    assert load_eventlog(pq_path, ColumnMap(time_unit="ms", clicked=None), FIXED, seed=0, limit=0).n_impressions == 0


def test_csv_limit_when_a_later_block_changes_a_column_type(tmp_path: Path) -> None:
    n = 120_000  # > one 1 MiB CSV block
    lines = ["user_id,item_id,ts,clicked"] + [f"{k},{k},{k},0" for k in range(n)]
    lines[-1] = "x,1,5,maybe"  # 'clicked' stops being an integer column in the last block
    path = tmp_path / "big.csv"
    path.write_text("\n".join(lines) + "\n")
    t = load_eventlog(path, ColumnMap(time_unit="ms"), FIXED, seed=0, limit=n)
    check_table(t)
    assert t.stats["rows_read"] == n and rejected(t) == {f"big-{n - 1:09d}": "clicked"}


def test_tsv_and_explicit_delimiter(tmp_path: Path) -> None:
    tsv = write_csv(tmp_path / "t.tsv", ["user_id", "item_id", "ts"], [[1, 2, 3]], sep="\t")
    assert load_eventlog(tsv, ColumnMap(time_unit="ms", clicked=None), FIXED, seed=0).user_id.tolist() == [1]
    semi = write_csv(tmp_path / "s.txt", ["user_id", "item_id", "ts"], [[4, 5, 6]], sep=";")
    t = load_eventlog(semi, ColumnMap(time_unit="ms", clicked=None), FIXED, seed=0, csv_delimiter=";")
    assert t.user_id.tolist() == [4] and t.item_id.tolist() == [5]


def test_csv_ids_keep_their_text(tmp_path: Path) -> None:
    big = 2**64 - 1  # past int64: must not become a float
    path = write_csv(tmp_path / "ids.csv", ["user_id", "item_id", "ts"], [[big, "007", 1], [3, "7", 2]])
    t = load_eventlog(path, ColumnMap(time_unit="ms", clicked=None), FIXED, seed=0)
    check_table(t)
    assert t.user_id.tolist() == [str(big), "3"]  # one non-int64 value: the column stays text
    assert t.item_id.tolist() == ["007", "7"]  # zero-padded ids are not integers


def test_float_id_column_holds_whole_numbers(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "f.parquet", {
        "user_id": pa.array([1.0, None, 2.5, 4.0]), "item_id": [1, 2, 3, 4], "ts": [1, 2, 3, 4],
    })
    t = load_eventlog(path, ColumnMap(time_unit="ms", clicked=None), FIXED, seed=0)
    check_table(t)
    assert t.user_id.tolist() == [1, 4] and type(t.user_id[0]) is int
    assert rejected(t) == {"f-000000001": "user_id", "f-000000002": "user_id"}


# -- rejected rows -------------------------------------------------------------------------------
@pytest.mark.parametrize("row,field", [
    ([None, 10, 5000, 0, 1.0], "user_id"),
    (["", 10, 5000, 0, 1.0], "user_id"),
    ([-3, 10, 5000, 0, 1.0], "user_id"),
    ([1, -10, 5000, 0, 1.0], "item_id"),
    ([1, 10, 5000, 0, "nan"], "dense.price"),
    ([1, 10, 5000, 0, "inf"], "dense.price"),
    ([1, 10, 5000, 0, None], "dense.price"),
    ([1, 10, 5000, 0, "cheap"], "dense.price"),
    ([1, 10, "soon", 0, 1.0], "ts"),
    ([1, 10, None, 0, 1.0], "ts"),
    ([1, 10, -5, 0, 1.0], "ts"),
    ([1, 10, MAX_TS_MS + 1, 0, 1.0], "ts"),
    ([1, 10, 5000, "maybe", 1.0], "clicked"),
    ([1, 10, 5000, 0, 1e39], "dense.price"),  # finite, but inf as float32
])
def test_bad_csv_rows_are_dead_lettered(tmp_path: Path, row: list, field: str) -> None:
    good = [[1, 10, 1000, 1, 0.5], [2, 20, 2000, 0, 1.5]]
    path = write_csv(tmp_path / "bad.csv", ["uid", "iid", "t", "c", "price"], [good[0], row, good[1]])
    cols = ColumnMap(time_unit="ms", user="uid", item="iid", time="t", clicked="c", dense=("price",))
    t = load_eventlog(path, cols, FIXED, seed=0)
    check_table(t)
    assert t.n_impressions == 2 and t.stats["rejected_rows"] == 1 and t.stats["rows_read"] == 3
    assert t.stats["rejected_by_field"] == {field: 1}
    (raw,) = t.raw
    assert raw.error.field == field and "row 1" in raw.error.reason
    assert raw.key == b"bad-000000001"
    assert raw.ts == (5000 if field != "ts" else 0)
    value = orjson.loads(raw.value)
    assert set(value) == {"uid", "iid", "t", "c", "price"}
    if row[0] in (None, ""):
        assert value["uid"] is None  # null for missing
    assert t.n_clicks == 1  # the good clicked row still clicks


def test_bad_parquet_rows(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "bad.parquet", {
        "imp": ["ok", None, "neg", "nan", "time", "long", "ctx", "list", "clk"],
        "user": pa.array([1, 2, -1, 4, 5, 6, 7, 8, 9], pa.int64()),
        "item": pa.array(["a", "b", "c", "d", "e", "f", "g", "h", "i"]),
        "t": pa.array([1, 2, 3, 4, 10**13, 6, 7, 8, 9], pa.int64()),
        "clk": ["1", "0", "0", "0", "0", "0", "0", "0", "sure"],
        "x": [1.0, 1.0, 1.0, float("nan"), 1.0, 1.0, 1.0, 1.0, 1.0],
        "cat": ["s", "s", "s", "s", "s", "s" * 300, "s", "s", "s"],
        "f": [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, float("inf"), 0.5, 0.5],
        "l": pa.array([[1]] * 7 + [list(range(2000))] + [[1]], pa.list_(pa.int64())),
    })
    cols = ColumnMap(time_unit="ms", user="user", item="item", time="t", impression_id="imp", clicked="clk",
                     features=("cat", "f", "l"), dense=("x",))
    t = load_eventlog(path, cols, FIXED, seed=0)
    check_table(t)
    assert t.impression_id.tolist() == ["ok"]
    assert rejected(t) == {
        "bad-000000001": "impression_id",  # null mapped id: the key falls back to the generated one
        "neg": "user_id", "nan": "dense.x", "time": "ts", "long": "context.cat", "ctx": "context.f",
        "list": "context.l", "clk": "clicked",
    }
    assert t.stats["rejected_rows"] == 8 and t.stats["rows_read"] == 9
    by_key = {m.key: m for m in t.raw}
    assert by_key[b"time"].ts == 0 and by_key[b"neg"].ts == 3
    assert orjson.loads(by_key[b"nan"].value)["x"] == "nan"  # as written, not null (a missing value)
    assert by_key[b"neg"].error.value == -1


def test_click_time_before_impression_or_bad_is_rejected(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "ct.csv", ["user_id", "item_id", "ts", "clicked", "cts"], [
        [1, 1, 5000, 1, 4000],  # before the impression
        [2, 2, 5000, 1, "later"],  # unparseable
        [3, 3, 5000, 0, "later"],  # not clicked: click time ignored
        [4, 4, 5000, 1, 7000],
    ])
    t = load_eventlog(path, ColumnMap(time_unit="ms", click_time="cts"), FIXED, seed=0)
    check_table(t)
    assert rejected(t) == {"ct-000000000": "click_ts", "ct-000000001": "click_ts"}
    assert t.click_ts.tolist() == [7000]
    assert "after the impression" in t.raw[0].error.expected


def test_every_impression_decodes_on_a_messy_file(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    n = 500
    users = [None if k % 37 == 0 else int(rng.integers(-3, 1000)) for k in range(n)]
    dense = [float("nan") if k % 41 == 0 else float(rng.normal()) for k in range(n)]
    tags = [None if k % 5 == 0 else [f"t{j}" for j in range(k % 4)] for k in range(n)]
    path = write_parquet(tmp_path / "messy.parquet", {
        "user_id": pa.array(users, pa.int64()), "item_id": [f"i{k % 50}" for k in range(n)],
        "ts": [T0 * 1000 + k if k % 43 else -1 for k in range(n)],
        "clicked": rng.random(n) < 0.3, "tags": pa.array(tags, pa.list_(pa.string())),
        "price": dense, "city": [None if k % 3 else "Oslo" for k in range(n)],
    })
    t = load_eventlog(path, ColumnMap(time_unit="ms", features=("tags", "city"), dense=("price",)), LOGNORMAL, seed=2)
    check_table(t)
    assert 0 < t.stats["rejected_rows"] < n
    assert set(t.stats["rejected_by_field"]) <= {"user_id", "ts", "dense.price"}


# -- configuration errors ---------------------------------------------------------------------------
def test_missing_column_names_it_the_file_and_the_flag(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "m.csv", ["user", "item_id", "ts"], [[1, 2, 3]])
    with pytest.raises(ValueError) as err:
        load_eventlog(path, ColumnMap(time_unit="ms", clicked=None), FIXED, seed=0)
    msg = str(err.value)
    assert "'user_id'" in msg and "--user-col" in msg and str(path) in msg
    assert "'user'" in msg and "'item_id'" in msg and "'ts'" in msg  # the columns it has
    ppath = write_parquet(tmp_path / "m.parquet", {"user_id": [1], "item_id": [2], "ts": [3]})
    with pytest.raises(EventLogError, match=r"'genre'.*--feature-cols"):
        load_eventlog(ppath, ColumnMap(time_unit="ms", clicked=None, features=("genre",)), FIXED, seed=0)
    with pytest.raises(EventLogError, match=r"'clicked'.*--clicked-col"):
        load_eventlog(ppath, ColumnMap(time_unit="ms"), FIXED, seed=0)


def test_unknown_format_and_bad_settings(tmp_path: Path) -> None:
    path = tmp_path / "log.json"
    path.write_text("{}")
    with pytest.raises(ValueError, match="cannot tell the format"):
        load_eventlog(path, ColumnMap(time_unit="ms"), FIXED, seed=0)
    csv = write_csv(tmp_path / "ok.csv", ["user_id", "item_id", "ts"], [[1, 2, 3]])
    with pytest.raises(ValueError, match="--time-unit"):
        load_eventlog(csv, ColumnMap(time_unit="minutes", clicked=None), FIXED, seed=0)
    with pytest.raises(ValueError, match="not ISO-8601"):
        load_eventlog(csv, ColumnMap(time_unit="iso", clicked=None), FIXED, seed=0)
    with pytest.raises(ValueError, match="does not exist"):
        load_eventlog(tmp_path / "nope.csv", ColumnMap(time_unit="ms"), FIXED, seed=0)
    ppath = write_parquet(tmp_path / "b.parquet", {"user_id": [True], "item_id": [2], "ts": [3]})
    with pytest.raises(ValueError, match="ids must be integers or strings"):
        load_eventlog(ppath, ColumnMap(time_unit="ms", clicked=None), FIXED, seed=0)


def test_empty_file(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "e.csv", ["user_id", "item_id", "ts", "clicked"], [])
    t = load_eventlog(path, ColumnMap(time_unit="ms"), LOGNORMAL, seed=0)
    check_table(t)
    assert t.n_impressions == 0 and t.stats["rows_read"] == 0


def test_rejected_value_is_json_even_for_odd_types(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "o.parquet", {
        "user_id": pa.array([None], pa.string()), "item_id": [1],
        "ts": pa.array([1_000_000_123], pa.timestamp("ns")), "clicked": [0],
    })
    t = load_eventlog(path, ColumnMap(time_unit="ms"), FIXED, seed=0)
    (raw,) = t.raw
    value = orjson.loads(raw.value)
    assert value["user_id"] is None and value["ts"].startswith("1970-01-01")
    assert raw.ts == 1000 and not math.isnan(raw.ts)


def test_a_row_too_far_ahead_of_the_wall_clock_is_dead_lettered_as_future_ts(tmp_path: Path) -> None:
    import time

    now = int(time.time() * 1000)
    rows = [[1, 10, 1000, 0], [2, 20, now + 7_200_000, 0], [3, 30, now + 60_000, 0]]  # 2 h ahead; 1 min is fine
    path = write_csv(tmp_path / "future.csv", ["uid", "iid", "t", "c"], rows)
    t = load_eventlog(path, ColumnMap(time_unit="ms", user="uid", item="iid", time="t", clicked="c"), FIXED, seed=0)
    assert t.n_impressions == 2 and [r.error.kind for r in t.raw] == ["future_ts"]
    assert "ahead of the wall clock" in t.raw[0].error.reason

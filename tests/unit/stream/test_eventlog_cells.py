"""Each cell of a replayed event log is judged on its own (stream/replay/eventlog.py): a row's time, its
``clicked`` value and what its reason reports never depend on the other rows of the file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest

from stream.features import hash_context
from stream.replay import eventlog_cells
from stream.replay.column_map import ColumnMap
from stream.replay.config import ClickDelay, DelayKind
from stream.replay.eventlog import load_eventlog
from stream.replay.table import EventTable

FIXED = ClickDelay(DelayKind.FIXED, median_s=30.0)
T0_S = 978_300_760  # 2000-12-31T22:12:40Z
T0_MS = T0_S * 1000


def write_csv(path: Path, header: str, rows: list[str]) -> Path:
    path.write_text("\n".join([header, *rows]) + "\n")
    return path


def rejected(t: EventTable) -> dict[int, tuple[str, str]]:
    """row number -> (field, reason) of every rejected row."""
    out = {}
    for raw in t.raw:
        row = int(raw.error.reason.rsplit("row ", 1)[1].split(" ")[0])
        out[row] = (raw.error.field, raw.error.reason)
    return out


# -- 1: a row whose time is implausible for its unit ------------------------------------------------
@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_epoch_seconds_rows_among_milliseconds_are_dead_lettered_naming_the_unit(tmp_path: Path, fmt: str) -> None:
    times = [T0_MS, T0_S + 60, T0_MS + 120_000, T0_S + 180]  # rows 1 and 3 in seconds
    if fmt == "csv":
        path = write_csv(tmp_path / "mixed.csv", "user_id,item_id,ts,clicked",
                         [f"{k},{k},{t},0" for k, t in enumerate(times)])
    else:
        path = tmp_path / "mixed.parquet"
        pq.write_table(pa.table({"user_id": [0, 1, 2, 3], "item_id": [0, 1, 2, 3],
                                 "ts": pa.array(times, pa.int64()), "clicked": [0, 0, 0, 0]}), path)
    t = load_eventlog(path, ColumnMap(), FIXED, seed=0)  # the default unit: ms
    assert t.ts.tolist() == [T0_MS, T0_MS + 120_000]  # no event of January 1970 is published
    bad = rejected(t)
    assert sorted(bad) == [1, 3]
    for field, reason in bad.values():
        assert field == "ts"
        assert "before 1973" in reason and "seconds" in reason and "--time-unit s" in reason
    # the row as the file holds it: a CSV cell's text, a Parquet integer
    assert orjson.loads(t.raw[0].value)["ts"] == (str(T0_S + 60) if fmt == "csv" else T0_S + 60)


def test_a_time_out_of_range_for_its_unit_names_the_unit_it_looks_like(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "s.csv", "user_id,item_id,ts,clicked",
                     [f"1,1,{T0_S},0", f"2,2,{T0_MS},0", f"3,3,{T0_MS * 1000},0"])
    t = load_eventlog(path, ColumnMap(time_unit="s"), FIXED, seed=0)
    bad = rejected(t)
    assert sorted(bad) == [1, 2]
    assert "milliseconds" in bad[1][1] and "--time-unit ms" in bad[1][1]
    assert "microseconds" in bad[2][1] and "--time-unit us" in bad[2][1]


def test_an_explicit_ms_unit_still_takes_early_times_as_they_are(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "early.csv", "user_id,item_id,ts,clicked", [f"1,1,{T0_MS},0", "2,2,5000,0"])
    t = load_eventlog(path, ColumnMap(time_unit="ms"), FIXED, seed=0)
    assert t.ts.tolist() == [T0_MS, 5000] and not t.raw


# -- 2: what a bad cell held, not "missing" -------------------------------------------------------
@pytest.mark.parametrize("cell", ["nan", "NaN", "inf", "-inf", "NA", "null"])
def test_a_time_cell_that_is_no_number_is_reported_as_written_not_as_missing(tmp_path: Path, cell: str) -> None:
    path = write_csv(tmp_path / "t.csv", "user_id,item_id,ts,clicked",
                     [f"1,1,{T0_MS},0", f"2,2,{cell},0", f"3,3,{T0_MS + 1},0"])
    t = load_eventlog(path, ColumnMap(), FIXED, seed=0)
    assert t.ts.tolist() == [T0_MS, T0_MS + 1]
    (raw,) = t.raw
    assert raw.error.field == "ts" and raw.error.value == cell
    assert "missing" not in raw.error.reason and repr(cell) in raw.error.reason
    assert orjson.loads(raw.value)["ts"] == cell


# a click-time `nan` is missing (section 5), not a bad cell: the click-time column is tried with inf and a typo
@pytest.mark.parametrize("cell,click_cell", [("nan", "inf"), ("inf", "soon")])
def test_a_dense_or_click_time_cell_that_is_no_number_is_reported_as_written(tmp_path: Path, cell: str,
                                                                             click_cell: str) -> None:
    path = write_csv(tmp_path / "d.csv", "user_id,item_id,ts,clicked,price,cts",
                     [f"1,1,{T0_MS},1,0.5,{T0_MS + 5}", f"2,2,{T0_MS},0,{cell},", f"3,3,{T0_MS},1,1.5,{click_cell}"])
    t = load_eventlog(path, ColumnMap(dense=("price",), click_time="cts"), FIXED, seed=0)
    bad = {raw.error.field: raw for raw in t.raw}
    assert set(bad) == {"dense.price", "click_ts"}
    for field, column, written in (("dense.price", "price", cell), ("click_ts", "cts", click_cell)):
        assert bad[field].error.value == written and "missing" not in bad[field].error.reason
        assert orjson.loads(bad[field].value)[column] == written


def test_empty_time_and_dense_cells_are_still_missing(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "e.csv", "user_id,item_id,ts,clicked,price",
                     [f"1,1,{T0_MS},0,0.5", "2,2,,0,1.0", f"3,3,{T0_MS},0,"])
    t = load_eventlog(path, ColumnMap(dense=("price",)), FIXED, seed=0)
    assert sorted((r.error.field, r.error.value) for r in t.raw) == [("dense.price", None), ("ts", None)]
    assert all("missing" in r.error.reason for r in t.raw)


def test_iso_times_in_a_csv_are_read_whatever_the_numeric_unit(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "iso.csv", "user_id,item_id,ts,clicked",
                     ["1,1,2000-12-31T22:12:40Z,0", "2,2,2000-12-31T22:12:41Z,0"])
    for unit in (None, "s"):
        assert load_eventlog(path, ColumnMap(time_unit=unit), FIXED, seed=0).ts.tolist() == [T0_MS, T0_MS + 1000]


# -- 3: one rule for a clicked cell, whatever its neighbours -------------------------------------------
CLICKED_CELLS = {"2": True, "-1": True, "0": False, "1": True, "0.0": False, "1.5": True, "nan": False, "": False,
                 "no": False, "Yes": True}


@pytest.mark.parametrize("neighbour", [None, "TRUE", "false", "7"])
def test_a_clicked_cell_means_the_same_whatever_the_rest_of_its_column_holds(tmp_path: Path,
                                                                            neighbour: str | None) -> None:
    cells = list(CLICKED_CELLS) + ([neighbour] if neighbour is not None else [])
    path = write_csv(tmp_path / "c.csv", "user_id,item_id,ts,clicked",
                     [f"{k},{k},{T0_MS + k},{c}" for k, c in enumerate(cells)])
    t = load_eventlog(path, ColumnMap(), FIXED, seed=0)
    assert not t.raw, [str(r.error) for r in t.raw]
    clicked = {int(i.rsplit("-", 1)[1]) for i in t.click_impression_id.tolist()}
    assert clicked & set(range(len(CLICKED_CELLS))) == {k for k, v in enumerate(CLICKED_CELLS.values()) if v}


def test_a_clicked_cell_that_is_no_value_of_the_rule_is_dead_lettered_as_written(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "c.csv", "user_id,item_id,ts,clicked", [f"1,1,{T0_MS},1", f"2,2,{T0_MS},maybe"])
    (raw,) = load_eventlog(path, ColumnMap(), FIXED, seed=0).raw
    assert raw.error.field == "clicked" and raw.error.value == "maybe"


# -- 4: cells Arrow's CSV inference read, read the same now that the columns are text -------------
def test_a_plus_signed_integer_cell_reads_as_its_number_in_time_dense_and_clicked_columns(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "plus.csv", "user_id,item_id,ts,clicked,price",
                     [f"1,1,+{T0_MS},+1,+5", f"2,2,{T0_MS + 1},0,3"])
    t = load_eventlog(path, ColumnMap(dense=("price",)), FIXED, seed=0)
    assert not t.raw
    assert t.ts.tolist() == [T0_MS, T0_MS + 1] and t.dense["price"].tolist() == [5.0, 3.0]
    assert t.click_impression_id.tolist() == ["plus-000000000"]


@pytest.mark.parametrize("cell", ["nan", "NA", "null", "garbage"])
def test_one_bad_cell_among_iso_times_rejects_its_own_row_only(tmp_path: Path, cell: str) -> None:
    path = write_csv(tmp_path / "iso.csv", "user_id,item_id,ts,clicked",
                     ["1,1,2000-12-31T22:12:40Z,0", f"2,2,{cell},0", "3,3,2000-12-31T22:12:42Z,0"])
    t = load_eventlog(path, ColumnMap(), FIXED, seed=0)
    assert t.ts.tolist() == [T0_MS, T0_MS + 2000]
    assert [(r.error.field, r.error.value) for r in t.raw] == [("ts", cell)]


# -- 5: Arrow's default null tokens (NA, null, nan, N/A, #N/A, -nan, ...) are missing in the clicked and click-time
# columns, trimmed and in any case ----------------------------------------------------------------------------------
ARROW_NULL_TOKENS = pcsv.ConvertOptions().null_values  # the published reference: '', '#N/A', 'N/A', 'NA', 'nan', ...
MISSING_WORDS = [*ARROW_NULL_TOKENS, "na", "Null", "NAN", "n/A", " NA ", " #N/A\t"]


@pytest.mark.parametrize("cell", MISSING_WORDS)
def test_a_null_token_in_the_clicked_column_is_not_clicked(tmp_path: Path, cell: str) -> None:
    path = write_csv(tmp_path / "c.csv", "user_id,item_id,ts,clicked",
                     [f"1,1,{T0_MS},1", f"2,2,{T0_MS + 1},{cell}", f"3,3,{T0_MS + 2},0"])
    t = load_eventlog(path, ColumnMap(), FIXED, seed=0)
    assert not t.raw, [str(r.error) for r in t.raw]
    assert t.ts.tolist() == [T0_MS, T0_MS + 1, T0_MS + 2]
    assert t.click_impression_id.tolist() == ["c-000000000"]


@pytest.mark.parametrize("cell", MISSING_WORDS)
def test_a_null_token_in_a_click_time_column_alone_is_no_click(tmp_path: Path, cell: str) -> None:
    path = write_csv(tmp_path / "ct.csv", "user_id,item_id,ts,cts",
                     [f"1,1,{T0_MS},{T0_MS + 5}", f"2,2,{T0_MS + 1},{cell}"])
    t = load_eventlog(path, ColumnMap(clicked=None, click_time="cts"), FIXED, seed=0)
    assert not t.raw, [str(r.error) for r in t.raw]
    assert t.ts.tolist() == [T0_MS, T0_MS + 1]
    assert t.click_impression_id.tolist() == ["ct-000000000"] and t.click_ts.tolist() == [T0_MS + 5]


@pytest.mark.parametrize("cell", MISSING_WORDS)
def test_a_clicked_row_whose_click_time_is_a_null_token_clicks_after_a_drawn_delay(tmp_path: Path,
                                                                                    cell: str) -> None:
    path = write_csv(tmp_path / "ct.csv", "user_id,item_id,ts,clicked,cts",
                     [f"1,1,{T0_MS},1,{T0_MS + 5}", f"2,2,{T0_MS + 1},1,{cell}"])
    t = load_eventlog(path, ColumnMap(click_time="cts"), FIXED, seed=0)
    assert not t.raw, [str(r.error) for r in t.raw]
    assert t.click_ts.tolist() == [T0_MS + 5, T0_MS + 1 + 30_000]  # the fixed delay: 30 s


@pytest.mark.parametrize("cell", ["NA", "null", "nan", "N/A", "#N/A", "-nan"])
def test_na_null_or_nan_in_the_time_column_is_still_a_rejected_row_reported_as_written(tmp_path: Path,
                                                                                      cell: str) -> None:
    path = write_csv(tmp_path / "t.csv", "user_id,item_id,ts,clicked,cts",
                     [f"1,1,{T0_MS},1,NA", f"2,2,{cell},NA,{T0_MS + 5}"])
    t = load_eventlog(path, ColumnMap(click_time="cts"), FIXED, seed=0)
    assert t.ts.tolist() == [T0_MS]
    (raw,) = t.raw
    assert raw.error.field == "ts" and raw.error.value == cell and "missing" not in raw.error.reason


# -- 6: a clean column is read in one cast; its cells read as the cell-by-cell parse reads them ---------
# Each cell in a column with one well-formed neighbour (the one-cast path where the cell allows it) and in the same
# column with a 'junk' cell added (which only the cell-by-cell parse reads): the two rows come out the same.
ONE_CAST_CELLS = {
    "ts": ["978300760000000000", "1699999999999999999", "0978300760000000000", "0x10", "-0",
           "+978300760000000000", "9.783007600005e17", "", "NA", "N/A", "-nan"],
    "clicked": ["0", "1", "7", "007", "0000000000000000000", "0x0", "0x10", "-0", "1e3", "+1", *ARROW_NULL_TOKENS,
                " NA", "None"],
    "price": ["0.5", "7", "-0", "-0.0", "1e400", "nan", "inf", "1.", ".5", "+5", "1234567890123456789", "0x10"],
}


def outcome(t: EventTable) -> tuple[object, ...]:
    """What a load made of rows 0 and 1 (the rows both files share)."""
    return (t.ts.tolist(), t.dense["price"].tolist(), np.signbit(t.dense["price"]).tolist(),
            t.click_impression_id.tolist(), t.click_ts.tolist(), {k: v for k, v in rejected(t).items() if k < 2})


@pytest.mark.parametrize("column,cell", [(c, v) for c, cells in ONE_CAST_CELLS.items() for v in cells])
def test_a_cell_reads_the_same_whether_its_column_is_cast_at_once_or_parsed_cell_by_cell(tmp_path: Path, column: str,
                                                                                        cell: str) -> None:
    normal = {"ts": str(T0_MS * 10**6), "clicked": "1", "price": "1.5"}
    rows = [dict(normal), {**normal, column: cell}, {**normal, column: "junk"}]
    loads = []
    for name, n in (("clean", 2), ("junk", 3)):
        (tmp_path / name).mkdir()
        path = write_csv(tmp_path / name / "log.csv", "user_id,item_id,ts,clicked,price",
                         [f"{k},{k},{r['ts']},{r['clicked']},{r['price']}" for k, r in enumerate(rows[:n])])
        loads.append(load_eventlog(path, ColumnMap(time_unit="ns", dense=("price",)), FIXED, seed=0))
    clean, junk = loads
    assert len(junk.raw) == len(clean.raw) + 1  # the junk row is rejected and only it
    assert outcome(clean) == outcome(junk)


def test_clicked_and_click_time_columns_whose_only_irregular_cells_are_null_tokens_are_read_in_one_cast(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def cell_by_cell(arr: pa.Array) -> None:
        raise AssertionError("the column was parsed cell by cell")

    monkeypatch.setattr(eventlog_cells, "_parse_numbers", cell_by_cell)
    path = write_csv(tmp_path / "gaps.csv", "user_id,item_id,ts,clicked,cts",
                     [f"1,1,{T0_MS},1,{T0_MS + 5}", f"2,2,{T0_MS + 1},,", f"3,3,{T0_MS + 2},NA,N/A",
                      f"4,4,{T0_MS + 3},1,", f"5,5,{T0_MS + 4}, nan ,0"])
    t = load_eventlog(path, ColumnMap(click_time="cts"), FIXED, seed=0)
    assert not t.raw, [str(r.error) for r in t.raw]
    assert t.click_impression_id.tolist() == ["gaps-000000000", "gaps-000000003"]
    assert t.click_ts.tolist() == [T0_MS + 5, T0_MS + 3 + 30_000]


# -- 7: a non-finite float in a Parquet file is judged and reported as the same CSV cell is -------------------------
def _csv_cell(v: float) -> str:
    return repr(v)  # nan, inf, -inf, 978300760000.0, 0.5: what a CSV writer puts in the cell


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("column", ["ts", "cts", "price"])
def test_a_non_finite_parquet_float_is_rejected_with_the_reason_and_value_of_the_same_csv_cell(
        tmp_path: Path, column: str, value: float) -> None:
    rows: dict[str, list[float]] = {"user_id": [1.0, 2.0], "item_id": [1.0, 2.0], "ts": [float(T0_MS)] * 2,
                                    "clicked": [1.0, 1.0], "cts": [float(T0_MS + 5)] * 2, "price": [0.5, 0.5]}
    rows[column][1] = value
    pq.write_table(pa.table(rows), tmp_path / "log.parquet")
    write_csv(tmp_path / "log.csv", ",".join(rows), [",".join(_csv_cell(rows[c][k]) for c in rows) for k in (0, 1)])
    seen = []
    for name in ("log.parquet", "log.csv"):
        t = load_eventlog(tmp_path / name, ColumnMap(click_time="cts", dense=("price",)), FIXED, seed=0)
        seen.append((t.ts.tolist(), t.click_ts.tolist(),
                     [(r.error.field, r.error.value, r.error.reason, orjson.loads(r.value)[column]) for r in t.raw]))
    parquet, csv = seen
    assert parquet == csv
    assert all("missing" not in reason for _, _, reason, _ in parquet[2])


def test_a_nan_parquet_float_feature_is_missing_as_the_same_csv_cell_nan_is(tmp_path: Path) -> None:
    table = pa.table({"user_id": [1, 2], "item_id": [1, 2], "ts": [T0_MS, T0_MS + 1], "clicked": [0, 1],
                      "cat": [0.5, float("nan")]})
    pq.write_table(table, tmp_path / "log.parquet")
    pcsv.write_csv(table, tmp_path / "log.csv")  # the NaN cell is written as `nan`
    seen = []
    for name in ("log.parquet", "log.csv"):
        t = load_eventlog(tmp_path / name, ColumnMap(features=("cat",)), FIXED, seed=0)
        (part,) = t.context
        seen.append(([part.dicts[i] for i in part.index.tolist()], t.user_id.tolist(), [str(r.error) for r in t.raw]))
    parquet, csv = seen
    assert csv == ([{"cat": 0.5}, {}], [1, 2], [])
    assert parquet == csv


# -- 8: a CSV feature (context) cell means the same whatever the rest of its column holds ---------------------------
def _contexts(tmp_path: Path, name: str, cells: list[str]) -> list[dict]:
    """The context of each row of a one-feature CSV whose ``cat`` column holds ``cells`` (every row accepted)."""
    path = write_csv(tmp_path / f"{name}.csv", "user_id,item_id,ts,clicked,cat",
                     [f"{k},{k},{T0_MS + k},0,{c}" for k, c in enumerate(cells)])
    t = load_eventlog(path, ColumnMap(features=("cat",)), FIXED, seed=0)
    assert not t.raw, [str(r.error) for r in t.raw]
    (part,) = t.context
    return [part.dicts[i] for i in part.index.tolist()]


# cell -> its meaning alone in a column: missing (None) or the typed value (its type is part of the meaning)
FEATURE_CELLS = {"1": 1, "-3": -3, "N/A": None, "NA": None, " null ": None, "#N/A": None, "": None, "1.50": 1.5,
                 "2.0": 2.0, "1e3": 1000.0, "true": True, "FALSE": False, "007": "007", "+5": "+5",
                 "0x10": "0x10", "word": "word", "12:00": "12:00", "2020-01-01T10:00:00": "2020-01-01T10:00:00",
                 "99999999999999999999": "99999999999999999999", "None": "None", "<NA>": "<NA>"}
NEIGHBOURS = ["7", "2.5", "true", "word"]  # an int, a float, a boolean and a word column


def test_a_feature_cell_means_the_same_in_a_numeric_looking_column_and_in_a_word_column(tmp_path: Path) -> None:
    for k, (cell, meaning) in enumerate(FEATURE_CELLS.items()):
        for j, neighbour in enumerate(NEIGHBOURS):
            ctx = _contexts(tmp_path, f"f{k}_{j}", [cell, neighbour])[0]
            got = ctx.get("cat")
            assert (type(got), got) == (type(meaning), meaning), (cell, neighbour, ctx)
            if meaning is not None:
                assert hash_context(ctx) == hash_context({"cat": meaning})


def test_a_clean_numeric_or_boolean_feature_column_hashes_as_arrows_inference_read_it(tmp_path: Path) -> None:
    """What existing models learned: a column Arrow typed whole (int64, double, bool) keeps each value's hash."""
    for name, cells, arrow_type in [("ints", ["1", "42", "-3", "0", "", "NA"], pa.int64()),
                                    ("floats", ["0.5", "2.25", "1.50", "1e3", "2.0", "-0.0", "N/A"], pa.float64()),
                                    ("bools", ["true", "false", "True", "FALSE", ""], pa.bool_())]:
        got = _contexts(tmp_path, name, cells)
        path = tmp_path / f"{name}.csv"
        inferred = pcsv.read_csv(path).column("cat")
        assert inferred.type == arrow_type
        want = [{} if v is None else {"cat": v} for v in inferred.to_pylist()]
        assert [hash_context(c) for c in got] == [hash_context(c) for c in want], name


@pytest.mark.parametrize("cell", ["1e400", "inf", "-Inf", "Infinity"])  # an infinite float, as a Parquet float inf
@pytest.mark.parametrize("neighbour", NEIGHBOURS)
def test_a_feature_cell_past_a_float_is_rejected_reporting_its_text_in_any_column(tmp_path: Path, neighbour: str,
                                                                                 cell: str) -> None:
    path = write_csv(tmp_path / "big.csv", "user_id,item_id,ts,clicked,cat",
                     [f"1,1,{T0_MS},0,{cell}", f"2,2,{T0_MS + 1},0,{neighbour}"])
    (raw,) = load_eventlog(path, ColumnMap(features=("cat",)), FIXED, seed=0).raw
    assert (raw.error.field, raw.error.value, orjson.loads(raw.value)["cat"]) == ("context.cat", cell, cell)

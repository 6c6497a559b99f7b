"""Each cell of a replayed event log is judged on its own (stream/replay/eventlog.py): a row's time, its
``clicked`` value and what its reason reports never depend on the other rows of the file."""

from __future__ import annotations

from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stream.replay.config import ClickDelay, DelayKind
from stream.replay.eventlog import ColumnMap, load_eventlog
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
    assert orjson.loads(t.raw[0].value)["ts"] == T0_S + 60


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

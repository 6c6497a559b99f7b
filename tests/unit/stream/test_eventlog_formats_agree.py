"""The same events written as CSV and as Parquet replay the same (stream/replay/eventlog.py): the same ids, times,
clicks and feature hashes, and the same rows rejected for the same reasons. Each test writes one typed table both
ways (the CSV as Arrow's writer writes it, or as R's ``write.csv`` does where that is the point) and compares what
the loader makes of the two files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

from stream.features import hash_context
from stream.ids import stable_hash
from stream.replay.column_map import ColumnMap
from stream.replay.config import ClickDelay, DelayKind
from stream.replay.eventlog import load_eventlog
from stream.replay.table import EventTable

FIXED = ClickDelay(DelayKind.FIXED, median_s=30.0)
T0_MS = 978_300_760_000  # 2000-12-31T22:12:40Z


def replayed(t: EventTable) -> dict[str, Any]:
    """What a replay publishes and dead-letters, in terms that do not depend on the file format."""
    contexts: list[dict[str, Any]] = [{} for _ in range(len(t.ts))]
    for part in t.context:
        for i, d in zip(part.index.tolist(), part.dicts, strict=True):
            contexts[i] = d
    return {
        "users": [stable_hash(u) for u in t.user_id.tolist()],
        "items": [stable_hash(i) for i in t.item_id.tolist()],
        "ts": t.ts.tolist(),
        "context": contexts,
        "context_hashes": [hash_context(c) for c in contexts],
        "clicks": t.click_impression_id.tolist(),
        "rejected": [(r.error.field, r.error.expected) for r in t.raw],
    }


def both_ways(tmp_path: Path, table: pa.Table, cols: ColumnMap, csv_text: str | None = None
              ) -> tuple[dict[str, Any], dict[str, Any]]:
    """``table`` written as ``log.parquet`` and as ``log.csv`` (Arrow's CSV writer unless ``csv_text`` is given),
    each loaded with ``cols``: ``(parquet, csv)``."""
    pq.write_table(table, tmp_path / "log.parquet")
    if csv_text is None:
        pcsv.write_csv(table, tmp_path / "log.csv")
    else:
        (tmp_path / "log.csv").write_text(csv_text)
    return tuple(replayed(load_eventlog(tmp_path / name, cols, FIXED, seed=0))  # type: ignore[return-value]
                 for name in ("log.parquet", "log.csv"))


def events(n: int, **columns: pa.Array) -> pa.Table:
    """``n`` valid rows (users 1..n, item 7, clicked 0) with ``columns`` added or replacing theirs."""
    return pa.table({"user_id": pa.array(range(1, n + 1), pa.int64()), "item_id": pa.array([7] * n, pa.int64()),
                     "ts": pa.array([T0_MS + k for k in range(n)], pa.int64()),
                     "clicked": pa.array([0] * n, pa.int64()), **columns})


def test_an_infinite_float_feature_is_rejected_in_parquet_and_as_the_csv_cell_inf(tmp_path: Path) -> None:
    table = events(3, score=pa.array([0.5, float("inf"), float("-inf")], pa.float64()))
    parquet, csv = both_ways(tmp_path, table, ColumnMap(features=("score",)))  # Arrow writes inf and -inf
    assert parquet["rejected"] == [("context.score", "a finite number (column 'score', row 1 counting from 0)"),
                                   ("context.score", "a finite number (column 'score', row 2 counting from 0)")]
    assert csv == parquet
    for name in ("log.parquet", "log.csv"):  # each reported as written: 'inf', '-inf'
        t = load_eventlog(tmp_path / name, ColumnMap(features=("score",)), FIXED, seed=0)
        assert [r.error.value for r in t.raw] == ["inf", "-inf"]


def test_a_null_token_in_a_csv_id_column_is_the_missing_id_a_parquet_null_is(tmp_path: Path) -> None:
    table = events(4, rid=pa.array(["r0", "r1", "r2", None]), user_id=pa.array(["a", None, "b", "c"]),
                   item_id=pa.array([5, 6, None, 8], pa.int64()))
    # as R's write.csv writes a missing value: NA (any null token, any case, as in the other columns)
    csv_text = ("rid,user_id,item_id,ts,clicked\n"
                + "\n".join([f"r0,a,5,{T0_MS},0", f"r1,NA,6,{T0_MS + 1},0", f"r2,b, null ,{T0_MS + 2},0",
                             f"N/A,c,8,{T0_MS + 3},0"]) + "\n")
    parquet, csv = both_ways(tmp_path, table, ColumnMap(impression_id="rid"), csv_text)
    assert [field for field, _ in parquet["rejected"]] == ["user_id", "item_id", "impression_id"]
    assert csv == parquet
    t = load_eventlog(tmp_path / "log.csv", ColumnMap(impression_id="rid"), FIXED, seed=0)
    assert [r.error.value for r in t.raw] == ["NA", " null ", "N/A"]  # reported as written


def test_the_int64_bounds_as_feature_cells_are_the_integers_parquet_holds(tmp_path: Path) -> None:
    """-2**63 is within int64 as 2**63-1 is: the CSV cell ``-9223372036854775808`` was the text (another hash) where
    the same Parquet int64 value is the integer."""
    table = events(3, big=pa.array([-(2**63), 2**63 - 1, -5], pa.int64()))
    parquet, csv = both_ways(tmp_path, table, ColumnMap(features=("big",)))
    assert [c["big"] for c in parquet["context"]] == [-(2**63), 2**63 - 1, -5]
    assert csv == parquet

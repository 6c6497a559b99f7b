"""Replay a user's own event log: one impression per row of a Parquet or CSV file.

Map the file's columns with a :class:`ColumnMap` (the CLI's ``--*-col`` flags) and load it with
:func:`load_eventlog`; the result is an :class:`~stream.replay.table.EventTable` for the publisher.

Reading
    ``.parquet``/``.pq`` with ``pyarrow.parquet``; ``.csv``/``.tsv``/``.txt`` (optionally ``.gz``,
    ``.bz2``, ``.zst``) with ``pyarrow.csv``, delimiter tab for ``.tsv`` and comma otherwise unless
    given. Only the mapped columns are read. A CSV file needs a header row; a quoted value may hold line breaks
    (RFC 4180), in a file of any size. In CSV files the id columns
    are read as text: a column whose values are all canonical non-negative integers (``0``, ``42``,
    not ``007``) becomes integer ids, any other column stays string ids, so an id's text (what
    :func:`stream.ids.stable_hash` hashes) never changes; ``-1`` is a negative integer id there (a canonical
    integer past int64, ``9223372036854775808``, makes its column string ids, which hash alike). An empty cell or a
    null token (below; spaces around ignored) in an id column (user, item, impression id) is a missing id, as a
    Parquet null is: the row is rejected, its cell reported as written (``NA`` was the user ``"NA"``; a Parquet
    string ``"NA"`` still is). The time,
    click-time, clicked and dense columns are read as text as well and each cell parsed on its own. In the time and
    dense columns only an empty cell is missing, and a rejected row's reason shows what its cell held (``nan``,
    ``inf``, ``NA``), which Arrow's type inference read as a missing value or a float. In the clicked and click-time
    columns an empty cell and Arrow's default null tokens (``pyarrow.csv.ConvertOptions().null_values``: ``NA``,
    ``N/A``, ``n/a``, ``#N/A``, ``#N/A N/A``, ``#NA``, ``null``, ``NULL``, ``nan``, ``NaN``, ``-nan``, ``-NaN``,
    ``1.#IND``, ``-1.#IND``, ``1.#QNAN``, ``-1.#QNAN``; in any case, spaces around ignored; R's ``write.csv`` writes
    ``NA``) are missing: not clicked / no click time, as that inference read them. A text column with ISO-8601
    cells and no numbers is read as times whatever the numeric unit (as that inference did), each other cell a
    rejected row. A feature (context) cell is read alone too, close to the rule Arrow's inference applies to a column
    of that one cell, so a clean column of canonical integers, decimals or booleans keeps its values and hashes
    (zero-padded integers such as ``007`` are text now: Arrow read 7; integers past int64 are text, Arrow read
    floats): empty or a null token (as above) is missing; an integer as Python writes it (``42``, ``-3``,
    within int64) is an int, a decimal number
    (``1.50``, ``2.0``, ``1e3``) a float, ``true``/``True``/``TRUE`` (``false`` alike) a bool, an infinity
    (``inf``, ``-Inf``, ``Infinity``, any case) or a number past a float (``1e400``) the rejected row a Parquet float
    inf is, anything else its text as written (``007``, ``+5``, ``12:00``, ``2020-01-01T10:00:00``); numbers and
    booleans trimmed. So
    ``N/A`` is missing beside ``a`` as beside ``1``; ``1`` beside ``2.5`` is 1, not 1.0. pandas' ``None`` and ``<NA>``
    are values, not null tokens, in every column (``to_csv`` writes a missing value as an empty cell; ``none`` is a
    plausible category). A mapped column name that appears twice
    in the file is refused (Arrow would silently take the first). A CSV row that does not parse (a missing or extra
    delimiter, an unclosed quote, bytes that are not UTF-8 in an id column) refuses the file, naming its line
    (the header is line 1); rows longer than Arrow's 1 MiB block are read with larger blocks (up to 256 MiB).
    A Parquet string cell that is not UTF-8 (Arrow does not check them on read) rejects its row in an id or feature
    column and refuses the file, naming the column and row, in any other.
    A file named ``.csv`` that starts like gzip, bzip2, zstd or Parquet is refused with the name that reads it.
    Text from the file in an error message is escaped (control characters as ``\\x..``) and clipped.

Context and dense
    One context dict per row from the ``features`` columns, missing values left out (and missing
    entries of list columns; a float NaN is missing, as the CSV cell ``nan`` is). Strings, integers,
    floats, booleans and lists of strings/integers pass as they are; timestamp, date, decimal and
    binary values pass as text. ``dense`` columns become float64 arrays (numbers, booleans, or numeric text).

``limit``
    The first ``limit`` rows of the file (rejected rows included), in file order; the publisher
    sorts them into event time. It is not "the earliest N events".

Time (``time_unit``)
    ``s``/``ms``/``us``/``ns``: integer or float epoch times (floats are rounded to the nearest ms,
    integers truncated). ``None`` (the CLI without ``--time-unit``): ``ms``, but a file whose every valid
    numeric time is before 1973 read as ms (epoch seconds, most likely) is refused with a hint to give the
    unit, and in a file where only some are, each such row is rejected (below), its reason naming the unit its
    number looks like; so is a time out of range for a given unit. ``iso``: ISO-8601 strings
    (``2000-12-31T22:12:40Z``, offsets allowed, no offset = UTC). Arrow timestamp and date columns carry their
    own unit and are taken as they
    are whatever ``time_unit`` says (naive timestamps are UTC). A float NaN or infinity (Parquet) is no number, as
    the CSV cell ``nan`` or ``inf`` is: the same reason, the value as text (``'nan'``, ``'inf'``, also in the row's
    JSON, where orjson would write null); a NaN click time is missing, as ``nan`` is there.

Clicks
    ``clicked`` accepts booleans, integers (non-zero = clicked), floats (non-zero, NaN = not
    clicked) and the strings true/false/1/0/yes/no (any case); a missing value is not clicked. A CSV
    cell is judged alone by the same rule (its column is read as text): ``2``, ``-1``, ``0.5`` are
    clicks, ``0``, ``0.0`` and the missing cells (empty, ``NA``, ``N/A``, ``null``, ``nan``, ...) are not, the rest is
    rejected, whether the rest of the column holds integers or words (a ``TRUE`` elsewhere made ``2``
    unparseable). A clicked row's click is at its ``click_time`` when that column is mapped and the value is not
    missing (a CSV cell: the same missing cells), else at ``ts`` + a delay drawn with ``draw_click_delays_ms`` from
    ``np.random.Generator(np.random.PCG64(seed))``. One delay is drawn per row read (row ``i`` uses
    draw ``i``), so a row's delay does not depend on which other rows were clicked or rejected, and
    ``limit`` keeps the delays of the rows it keeps. A drawn click time is cut at the wall clock at import +
    ``future_ts_s`` (the latest the joiner takes from a message sent then). With ``clicked=None`` and ``click_time``
    set, a row is clicked when its click time is present.

Rejected rows
    A row the event schema (``stream/events.py``) would not accept is not published as an
    impression: it becomes a :class:`~stream.replay.table.RawMessage` for the impressions topic
    whose value is the row as JSON (mapped columns, ``null`` for missing) and whose error is a
    :class:`~stream.errors.ValidationError`; the publisher dead-letters it with the reason. Its key
    is the row's impression id, its ts the row's time (0 when that is unusable). The error's
    ``field`` is the event field (``impression_id``, ``ts``, ``user_id``, ``item_id``,
    ``context.<col>``, ``dense.<col>``) or ``clicked`` / ``click_ts``; the first failing one in that
    order is reported, and ``expected`` ends with the column and the row (counting data rows from 0).
    Reasons: a missing or empty id, a negative integer id, an id over ``max_str_len`` chars (256 by
    default) or over 2**63-1; a missing/unparseable time or one outside [1970-01-01, 2100-01-01) (or, under
    the default unit, before 1973-03-03: epoch seconds among milliseconds); a dense value that is missing
    or not finite; a context value the schema rejects (non-finite float, string over ``max_str_len``
    chars, list over ``max_list_len`` entries); an unparseable clicked value; a click time that is
    unparseable, out of range, before the impression or over ``future_ts_s`` ahead of the wall clock (kind
    ``future_ts``, as the joiner dead-letters it). A row whose every value passes but whose event,
    as the publisher encodes it, is over ``[limits] max_message_bytes`` (long context lists, say) is
    rejected last, with field ``message``, kind ``too_large`` and its size in bytes as the value (no column is named).
    ``impressions + rejected_rows == rows_read``.

Column types that can never be valid (a bool id column, a struct feature) are configuration
mistakes and raise :class:`EventLogError` (a ``ValueError``), as do a missing column, an unknown
file format, and a mapping that breaks the limits on every event: more ``features`` columns than
``max_context_keys`` or ``dense`` columns than ``max_dense_keys``, or one whose name (the event's
key) is over ``max_key_len`` chars, or no impression id column with a file name that makes the generated ids
(``<stem>-<row:09d>``) longer than ``max_str_len``. The limits checked are ``load_eventlog``'s ``limits``: the
command's ``[limits]``, the joiner's, so an import publishes what the joiner accepts and dead-letters at the source
what it would refuse.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import io
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

from stream.errors import ConfigError, ValidationError
from stream.events import DENSE_RULE, MAX_ID, MAX_TS_MS, SCHEMA_VERSION
from stream.files import NotRegularFile, ReadAt, describe_os_error, open_regular
from stream.limits import DEFAULT_LIMITS, DENSE_BOUND, EventLimits
from stream.replay.config import ClickDelay
from stream.replay.table import IMPRESSION, ContextPart, EventTable, RawMessage, draw_click_delays_ms
from stream.samples import DENSE_PREFIX

TIME_UNITS = ("s", "ms", "us", "ns", "iso")
_MS_PER = {"s": 1000, "ms": 1, "us": 1e-3, "ns": 1e-6}
_DIV = {"ms": 1, "us": 1000, "ns": 1_000_000}  # integer input -> ms by floor division
_PARQUET_EXT = (".parquet", ".pq")
_CSV_EXT = (".csv", ".tsv", ".txt")
_COMPRESSED_EXT = (".gz", ".bz2", ".zst")
_CODEC = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd"}  # what Arrow infers from a path's extension
DATASET_SETTING = "--dataset ([replay] dataset)"  # the setting that names the event log, in error messages

# The CLI flag that sets each ColumnMap field (named in error messages).
FLAGS = {
    "user": "--user-col", "item": "--item-col", "time": "--time-col", "time_unit": "--time-unit",
    "impression_id": "--impression-id-col", "clicked": "--clicked-col", "click_time": "--click-time-col",
    "features": "--feature-cols", "dense": "--dense-cols",
}

_INT_RE = r"^[+-]?[0-9]{1,18}$"
_FLOAT_RE = r"^[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?$"
_CANONICAL_UINT_RE = r"^(0|[1-9][0-9]*)$"
_NEG_INT_RE = r"^-[0-9]+$"
_TRUE = ("true", "1", "yes")
_FALSE = ("false", "0", "no")
# A clicked or click-time CSV cell that is one of these (trimmed, any case) is missing: not clicked / no click time,
# as Arrow's type inference read them before these columns were read as text (R's write.csv writes NA). The list is
# Arrow's default null tokens (pyarrow.csv.ConvertOptions().null_values; pandas' read_csv takes these too). The time and
# dense columns do not take them: there only an empty cell is missing, and a `nan` time is a bad row.
_NULL_TOKENS = ("", "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN", "N/A", "NA",
               "NULL", "NaN", "n/a", "nan", "null")
_MISSING_WORDS = tuple(dict.fromkeys(t.lower() for t in _NULL_TOKENS))
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_ONE_MS = timedelta(milliseconds=1)

# time conversion status codes
_OK, _MISSING, _UNPARSEABLE, _OUT_OF_RANGE, _IMPLAUSIBLE = 0, 1, 2, 3, 4


class EventLogError(ConfigError):
    """The event log cannot be read as mapped (missing column, unknown format, unusable type).

    A ``ValueError`` (via :class:`~stream.errors.ConfigError`, so the CLI reports it as a
    usage error); the message names the file, the column and the flag that fixes it.
    """


@dataclass(frozen=True)
class ColumnMap:
    """Which column of the file holds what (defaults match the CLI flags' defaults)."""

    user: str = "user_id"
    item: str = "item_id"
    time: str = "ts"
    # one of s, ms, us, ns, iso (ISO-8601 strings or Arrow timestamp columns); None (the default, here as in the
    # CLI when --time-unit is not given): ms, checked: numbers that are all before 1973 as ms are refused (epoch
    # seconds?). An explicit "ms" reads them as they are
    time_unit: str | None = None
    impression_id: str | None = None  # None -> generated f"{file_stem}-{row:09d}"
    clicked: str | None = "clicked"  # truthy (1/true/yes) -> a click follows after a delay; None -> no clicks
    click_time: str | None = None  # the click's own time (same unit), when present; overrides the delay
    features: tuple[str, ...] = ()  # categorical/multi-valued context columns, passed as context
    dense: tuple[str, ...] = ()  # numeric columns passed as dense features

    def roles(self) -> list[tuple[str, str]]:
        """``(ColumnMap field, column name)`` of every mapped column, in a stable order."""
        out: list[tuple[str, str]] = []
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "time_unit" or v is None:
                continue
            for col in (v,) if isinstance(v, str) else v:
                out.append((f.name, col))
        return out


# -- reading ---------------------------------------------------------------------------------------
def detect_format(path: Path) -> tuple[str, str]:
    """``(format, stem)`` of ``path`` from its extension: format ``parquet`` or ``csv``."""
    name = path.name
    lower = name.lower()
    compressed = next((e for e in _COMPRESSED_EXT if lower.endswith(e)), "")
    base, base_lower = name[: len(name) - len(compressed)], lower[: len(lower) - len(compressed)]
    for fmt, exts in (("parquet", _PARQUET_EXT), ("csv", _CSV_EXT)):
        for ext in exts:
            if base_lower.endswith(ext) and not (compressed and fmt == "parquet"):
                return fmt, base[: len(base) - len(ext)] or base
    raise EventLogError(
        f"cannot tell the format of {path}: expected a Parquet file (.parquet, .pq) or a CSV file "
        f"(.csv, .tsv, .txt, optionally compressed {'/'.join(_COMPRESSED_EXT)})"
    )


@contextlib.contextmanager
def _open_log(path: Path) -> Iterator[io.FileIO]:
    """The event log opened once (:func:`stream.files.open_regular`) for every read of it, refused unless it is a
    regular file: a FIFO hung the replay (Arrow opened it by name and waited for a writer), a device read without end.
    No size bound: an event log is legitimately gigabytes."""
    with contextlib.ExitStack() as stack:
        try:
            fh, _ = stack.enter_context(open_regular(path))
        except NotRegularFile as exc:
            raise EventLogError(f"{DATASET_SETTING}: {exc}; an event log must be a Parquet or CSV file") from None
        except FileNotFoundError:
            raise EventLogError(f"{DATASET_SETTING}: event log {path} does not exist") from None
        except IsADirectoryError:  # fdopen's, before open_regular's check: its message names a descriptor
            raise EventLogError(f"{DATASET_SETTING}: {path} is a directory; an event log must be a Parquet or CSV "
                                "file") from None
        except OSError as exc:
            raise EventLogError(f"{DATASET_SETTING}: cannot open event log {path}: {describe_os_error(exc)}") from None
        yield fh


@contextlib.contextmanager
def _stream(fh: io.FileIO, codec: str | None) -> Iterator[Any]:
    """``fh`` from its start, for one Arrow read (decompressed with ``codec``): the open file, not its name, so what
    :func:`_open_log` checked is what is read; each read through a view with its own position
    (:class:`~stream.files.ReadAt`), so that a previous read's background read-ahead, which may outlive its reader,
    cannot move it (sharing ``fh``'s offset, a read under load started mid-file and found no header)."""
    view = ReadAt(fh.fileno())
    if codec is None:
        yield view
        return
    stream = pa.CompressedInputStream(view, codec)
    try:
        yield stream
    finally:
        stream.close()


def _delimiter(path_ext: str, given: str | None) -> str:
    if given is None:
        return "\t" if path_ext == ".tsv" else ","
    d = {"\\t": "\t", "tab": "\t"}.get(given, given)
    # Arrow takes one ASCII character (a non-ASCII one was a ValueError traceback, not a usage error), and neither a
    # line end nor the quote character; a control character is no delimiter a file is written with
    if len(d) != 1 or not (d == "\t" or (d.isascii() and d.isprintable())) or d == '"':
        raise EventLogError(f"--csv-delimiter must be one printable ASCII character other than '\"' (or '\\t' for a "
                            f"tab), got {given!r}")
    return d


def _missing_columns_error(path: Path, have: list[str], cols: ColumnMap, missing: list[str]) -> EventLogError:
    role_of = {col: role for role, col in reversed(cols.roles())}
    shown = ", ".join(_shown(c, 80) for c in have[:60])
    if len(have) > 60:
        shown += f", ... ({len(have) - 60} more)"
    what = "; ".join(f"column {_shown(c, 80)} (set with {FLAGS[role_of[c]]})" for c in missing)
    return EventLogError(f"{path} has no {what}; the file's columns are: {shown or '(none)'}")


def _shown(text: str, limit: int = 200) -> str:
    """``text`` quoted as ``repr`` quotes it (control characters as escapes) and clipped to ``limit`` chars:
    file bytes in an error message must not reach the terminal as they are."""
    return repr(text[:limit]) + (f"... ({len(text) - limit:,} more chars)" if len(text) > limit else "")


def _escaped(text: str, limit: int = 300) -> str:
    """An Arrow error message for the terminal: control characters as escapes, clipped to ``limit`` chars."""
    text = text.strip()
    out = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text[:limit])
    return out + (f"... ({len(text) - limit:,} more chars)" if len(text) > limit else "")


def _check_columns(path: Path, have: list[str], cols: ColumnMap, wanted: list[str]) -> None:
    """Every mapped column is in ``have`` exactly once (Arrow would silently pick the first of two)."""
    missing = [c for c in wanted if c not in have]
    if missing:
        raise _missing_columns_error(path, have, cols, missing)
    role_of = {col: role for role, col in reversed(cols.roles())}
    for c in wanted:
        at = [str(i + 1) for i, name in enumerate(have) if name == c]
        if len(at) > 1:
            raise EventLogError(f"{path} has {len(at)} columns named {_shown(c, 80)} (columns {', '.join(at[:-1])} "
                                f"and {at[-1]}, counting from 1), mapped with {FLAGS[role_of[c]]}: rename all but "
                                "one of them so the mapping is unambiguous")


def _read_parquet(path: Path, fh: io.FileIO, cols: ColumnMap, wanted: list[str], limit: int | None) -> pa.Table:
    try:
        pf = pq.ParquetFile(fh)
        have = pf.schema_arrow.names
        _check_columns(path, have, cols, wanted)
        if limit is None:
            return pf.read(columns=wanted)
        batches, rows = [], 0
        if limit > 0:
            for batch in pf.iter_batches(batch_size=min(limit, 65_536), columns=wanted):
                batches.append(batch)
                rows += batch.num_rows
                if rows >= limit:
                    break
    except (pa.ArrowException, OSError, UnicodeDecodeError) as exc:  # a bad footer or corrupt data pages
        raise EventLogError(f"cannot read {path} as Parquet: {_escaped(str(exc))}") from None
    if not batches:
        return pa.schema([pf.schema_arrow.field(c) for c in wanted]).empty_table()
    return pa.Table.from_batches(batches).slice(0, limit)


_CELLWISE_ROLES = ("user", "item", "impression_id", "features")  # columns whose cells that are not UTF-8 reject a row


def _utf8_checked(path: Path, table: pa.Table, cols: ColumnMap) -> pa.Table:
    """A Parquet table whose string columns are UTF-8 text: Arrow does not check them when it reads a file, which
    another writer can fill with other bytes (a Latin-1 id), and reading such a cell was a UnicodeDecodeError
    traceback. A column that holds one becomes binary, so in an id or feature column each such cell rejects its row
    (``_to_text``, as a CSV feature cell does); in a time, clicked or dense column it refuses the file, naming the
    column and the row. A list of strings holding one becomes a list of binary entries, refused whole as one read
    so (``_prepare_feature``)."""
    roles: dict[str, set[str]] = {}
    for role, name in cols.roles():
        roles.setdefault(name, set()).add(role)
    for i, f in enumerate(table.schema):
        arr = _plain(table.column(i))
        listed = _is_list(arr.type) and _is_text(arr.type.value_type)
        if not (_is_text(arr.type) or listed):
            continue
        try:
            arr.validate(full=True)
            continue
        except pa.ArrowInvalid:
            raw = arr.cast(pa.list_(pa.large_binary()) if listed else pa.large_binary())
        if not listed and not roles.get(f.name, set()) <= set(_CELLWISE_ROLES):
            row = next(k for k, v in enumerate(raw.to_pylist()) if v is not None and not _is_utf8(v))
            raise EventLogError(f"{path}: column {_shown(f.name, 80)} holds bytes that are not UTF-8 text (row {row} "
                                "counting from 0): a Latin-1 or other non-UTF-8 file? convert it to UTF-8")
        table = table.set_column(i, f.name, raw)
    return table


def _is_utf8(value: bytes) -> bool:
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


# The first bytes of files that are not CSV text, and the name that reads them.
_MAGIC = ((b"\x1f\x8b", "gzip-compressed", ".csv.gz"), (b"BZh", "bzip2-compressed", ".csv.bz2"),
          (b"\x28\xb5\x2f\xfd", "zstd-compressed", ".csv.zst"), (b"PAR1", "Parquet", ".parquet"))
_MAX_CSV_BLOCK = 256 << 20  # the longest CSV row read (Arrow reads whole rows per block; default 1 MiB)
_ROW_RE = re.compile(r"^(?:CSV parse error: )?(?:(In CSV column #\d+): )?Row #(\d+): (.*)$", re.S)


def _csv_error(path: Path, exc: BaseException, read: Any, serial: pcsv.ReadOptions,
               names: Sequence[str] = (), cols: ColumnMap | None = None,
               line_of: Callable[[int], int | None] | None = None) -> EventLogError:
    """One message for an Arrow CSV error: file, line (from a single-threaded re-read, which Arrow numbers), the
    column by its header name and role (Arrow numbers it: ``names`` is the header), and Arrow's reason with the
    row text escaped and clipped."""
    if isinstance(exc, UnicodeDecodeError):  # Arrow's own message held undecodable row bytes
        return EventLogError(f"cannot read {path} as CSV: a row does not parse and holds bytes that are not UTF-8 "
                             "text (a binary or compressed file?)")
    msg = str(exc)
    if "Empty CSV file" in msg:
        return EventLogError(f"cannot read {path} as CSV: it is empty (a CSV file needs a header row)")
    try:
        read(serial)
    except (pa.ArrowException, OSError, UnicodeDecodeError) as again:
        msg = str(again) if isinstance(again, pa.ArrowException) else msg
    m = _ROW_RE.match(msg)
    if m is None:
        return EventLogError(f"cannot read {path} as CSV: {_escaped(msg)}")
    column, record, reason = m.groups()
    line = line_of(int(record)) if line_of is not None else None
    where = (f"line {line} (the header is line 1)" if line is not None
             else f"record {record} (the header is record 1; blank lines not counted)")
    detail = re.match(r"Expected (\d+) columns, got (\d+): (.*)$", reason, re.S)
    if detail:
        reason = (f"expected {detail[1]} columns, got {detail[2]} (a missing or extra delimiter, or an unclosed "
                  f"quote): {_shown(detail[3])}")
    else:
        if "invalid UTF8" in reason:
            reason += " (a Latin-1 or other non-UTF-8 file? convert it to UTF-8)"
        reason = _escaped(f"{_column_named(column, names, cols)}: {reason}" if column else reason)
    return EventLogError(f"cannot read {path} as CSV at {where}: {reason}")


def _file_line(fh: io.FileIO, codec: str | None, delimiter: str, record: int) -> int | None:
    """The line of ``fh`` (from 1) where CSV record ``record`` starts, as Arrow numbers records in its errors (the
    header is 1, empty lines are skipped, a quoted value may span lines): Arrow's number was reported as the line,
    wrong after a blank line or a quoted line break. None when the file cannot be scanned so (a field over the csv
    module's 128 KiB limit). A second pass over the file, on the error path only."""
    count, end = 0, 0  # records seen; the line the last one ended on
    with _stream(fh, codec) as src:
        text = io.TextIOWrapper(io.BufferedReader(src), encoding="latin-1", newline="")  # bytes kept, as one char each
        reader = csv.reader(text, delimiter=delimiter)
        try:
            for fields_ in reader:
                if fields_:  # [] is an empty line, which Arrow skips
                    count += 1
                    if count == record:
                        return end + 1
                end = reader.line_num
        except csv.Error:  # the record itself does not parse (an unclosed quote at the end), or one before it
            return end + 1 if count == record - 1 else None
    return None


def _column_named(arrow_column: str, names: Sequence[str], cols: ColumnMap | None) -> str:
    """Arrow's ``In CSV column #N`` (N: the file's column, from 0) as the header's name and its role in ``cols``."""
    i = int(arrow_column.rsplit("#", 1)[1])
    if not 0 <= i < len(names):
        return arrow_column
    roles = [role for role, col in (cols.roles() if cols is not None else []) if col == names[i]]
    return f"column {names[i]!r}" + (f" (the {' and '.join(roles)} column)" if roles else "")


def _csv(path: Path, read: Any, names: Sequence[str] = (), cols: ColumnMap | None = None,
         line_of: Callable[[int], int | None] | None = None) -> Any:
    """``read(ReadOptions)``, retried with larger blocks for a long row; Arrow errors as :func:`_csv_error` (with the
    header ``names``, the map ``cols`` to name a column and ``line_of`` to name the line)."""
    block = 1 << 20
    while True:
        try:
            return read(pcsv.ReadOptions(block_size=block))
        except (pa.ArrowException, OSError, UnicodeDecodeError) as exc:
            if not (isinstance(exc, pa.ArrowInvalid) and "straddling object" in str(exc)):
                raise _csv_error(path, exc, read, pcsv.ReadOptions(block_size=block, use_threads=False), names,
                                 cols, line_of) from None
            if block >= _MAX_CSV_BLOCK:
                raise EventLogError(f"cannot read {path} as CSV: a row is longer than {_MAX_CSV_BLOCK >> 20} MiB (an "
                                    "unclosed quote?)") from None
            block *= 16


def _read_csv(path: Path, fh: io.FileIO, ext: str, cols: ColumnMap, wanted: list[str], limit: int | None,
              delimiter: str | None) -> pa.Table:
    # Blocks split where a row ends, quotes heeded (RFC 4180 lets a quoted value hold line breaks; pandas and Excel
    # write multi-line text so). Split at any line end (Arrow's default, a little faster), a block boundary inside a
    # quoted value made a file of such values unreadable past its first 1 MiB, and the rows after an unclosed quote
    # were dropped without a word when the blocks were parsed in parallel (64,406 of 100,000 rows read).
    parse = pcsv.ParseOptions(delimiter=_delimiter(ext, delimiter), newlines_in_values=True)
    codec = _CODEC.get(path.suffix.lower())
    if path.suffix.lower() in _CSV_EXT:  # not named compressed: it should be text
        fh.seek(0)
        head = fh.read(4) or b""
        for magic, what, name in _MAGIC:
            if head.startswith(magic):
                raise EventLogError(f"{path} looks like a {what} file (it starts with {head!r}), not CSV text: name "
                                    f"it {path.stem}{name}")

    def header(ro: pcsv.ReadOptions) -> list[str]:
        with _stream(fh, codec) as src, pcsv.open_csv(src, read_options=ro, parse_options=parse) as reader:
            return list(reader.schema.names)

    line_of = functools.partial(_file_line, fh, codec, parse.delimiter)  # an error's line
    have = _csv(path, header, line_of=line_of)
    _check_columns(path, have, cols, wanted)
    # Ids as text: Arrow would read ids past 2**63-1 as floats (losing digits); see _ids(). Times and dense values
    # as text too: Arrow's inference read `nan`, `NA` or `null` as a missing value and `inf` as a float, so a row's
    # reason said "missing" (or showed null) instead of what the cell held; each cell is parsed in _times/_dense.
    # The clicked column too, so that a cell means the same whatever its neighbours (see _clicked). In the clicked
    # and click-time columns NA/null/nan still mean missing (_MISSING_WORDS), as the inference read them.
    # Feature columns as bytes (a cell that is not UTF-8 dead-letters its row): each cell is read alone in
    # _feature_cells, not by what Arrow inferred from its neighbours (`N/A` missing beside `1`, a value beside `a`).
    text_cols = {c: pa.string() for c in (cols.user, cols.item, cols.impression_id, cols.time, cols.click_time,
                                          cols.clicked, *cols.dense) if c is not None}
    text_cols.update({c: pa.binary() for c in cols.features if c not in text_cols})
    convert = pcsv.ConvertOptions(include_columns=wanted, column_types=text_cols)
    if limit is not None:
        # Streaming stops early, but it infers types from the first block only: if a later block
        # does not fit them, read the whole file (which infers over all of it) instead.
        def head_rows(ro: pcsv.ReadOptions) -> pa.Table | None:
            batches, rows = [], 0
            with _stream(fh, codec) as src, pcsv.open_csv(src, read_options=ro, parse_options=parse,
                                                         convert_options=convert) as reader:
                while rows < limit:
                    try:
                        batch = reader.read_next_batch()
                    except StopIteration:
                        break
                    except pa.ArrowInvalid as exc:
                        if "straddling object" in str(exc):
                            raise
                        # a type inferred from the first block does not fit a later one (or a bad row: the
                        # whole read reports it)
                        return None
                    batches.append(batch)
                    rows += batch.num_rows
                schema = reader.schema
            return pa.Table.from_batches(batches, schema=schema).slice(0, limit)

        table = _csv(path, head_rows, have, cols, line_of)
        if table is not None:
            return table
    def whole(ro: pcsv.ReadOptions) -> pa.Table:
        with _stream(fh, codec) as src:
            return pcsv.read_csv(src, read_options=ro, parse_options=parse, convert_options=convert)

    table = _csv(path, whole, have, cols, line_of)
    return table if limit is None else table.slice(0, limit)


# -- column helpers ----------------------------------------------------------------------------
def _plain(arr: pa.ChunkedArray | pa.Array) -> pa.Array:
    """One contiguous array, dictionaries decoded."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    return arr


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or str(t) == "string_view"


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _is_binary(t: pa.DataType) -> bool:
    return pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t)


def _np_bool(arr: pa.Array, null: bool = False) -> np.ndarray:
    return np.asarray(pc.fill_null(arr, null).to_numpy(zero_copy_only=False), dtype=bool)


def _nulls(arr: pa.Array) -> np.ndarray:
    return np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool)


def _matches(arr: pa.Array, pattern: str) -> np.ndarray:
    return _np_bool(pc.match_substring_regex(arr, pattern))


def _missing_words(arr: pa.Array) -> np.ndarray:
    """(N,) bool: the text cells that are missing in a clicked or click-time column (null, or one of _MISSING_WORDS).
    Only the cells that are not all digits are trimmed and lowered (a column of 0/1 has few of them)."""
    out, odd = _nulls(arr), np.flatnonzero(~_np_bool(pc.ascii_is_decimal(arr)))
    out[odd] |= _np_bool(pc.is_in(pc.utf8_lower(pc.utf8_trim_whitespace(arr.take(odd))), pa.array(_MISSING_WORDS)))
    return out


def _to_text(arr: pa.Array, field: str, column: str) -> tuple[pa.Array, list[_Check]]:
    """A binary (or integer) column as text, and the check of its cells that are not UTF-8, if any (read as missing,
    so the other checks pass them; each such row is dead-lettered with this reason, not the whole file refused)."""
    try:
        return arr.cast(pa.string()), []
    except pa.ArrowInvalid:
        pass

    ok = np.fromiter((v is None or _is_utf8(v) for v in arr.to_pylist()), bool, len(arr))  # (N,) on failure only
    text = pc.if_else(pa.array(ok), arr, pa.scalar(None, arr.type)).cast(pa.string())
    return text, [_Check(~ok, field, column, "UTF-8 text (a Latin-1 or other non-UTF-8 file? convert it to UTF-8)")]


def _ints(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Integer array -> ``(int64 values, over MAX_ID)``; nulls read as 0."""
    v = pc.fill_null(arr, 0).to_numpy(zero_copy_only=False)
    if v.dtype == np.uint64:
        big = v > MAX_ID
        return np.where(big, np.uint64(0), v).astype(np.int64), big
    return v.astype(np.int64, copy=False), np.zeros(len(v), dtype=bool)


def _floats(arr: pa.Array) -> np.ndarray:
    """Numeric array -> float64, nulls NaN."""
    return np.asarray(pc.fill_null(arr.cast(pa.float64()), np.nan).to_numpy(zero_copy_only=False),
                      dtype=np.float64)


def _digit_ints(arr: pa.Array, missing: np.ndarray | None = None) -> np.ndarray | None:
    """A text column's int64 values (nulls 0) when every present cell is 1-18 ASCII digits, else None: the common
    case in one vectorised check and one Arrow cast instead of :func:`_parse_numbers`' regexes, same values (such a
    cell is one ``_INT_RE`` takes; the check keeps out what the cast alone reads otherwise: ``0x10``, 19 digits).
    ``missing`` (N,) bool: cells read as nulls (empty cells, null tokens), so that they keep a column on this path."""
    if missing is not None and missing.any():
        arr = pc.if_else(pa.array(missing), pa.scalar(None, arr.type), arr)
    if not pc.all(pc.ascii_is_decimal(arr)).as_py() or (pc.max(pc.binary_length(arr)).as_py() or 0) > 18:
        return None
    return _ints(pc.cast(arr, pa.int64(), safe=True))[0]


def _cast_floats(arr: pa.Array) -> np.ndarray | None:
    """A text column as float64 (nulls NaN) in one Arrow cast, or None where a cell does not cast (a word, an empty
    or padded cell) or reads as -0.0 (``-0``: :func:`_parse_numbers` reads 0). Where it casts, a finite value is the
    one ``_parse_numbers`` gives and a non-finite one (``nan``, ``inf``, ``1e400``) is no finite number either way."""
    try:
        v = _floats(pc.cast(arr, pa.float64(), safe=True))
    except pa.ArrowInvalid:
        return None
    return None if (np.signbit(v) & (v == 0)).any() else v


def _parse_numbers(arr: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Text -> ``(missing, is_int, int64 values, is_float, float64 values)``; neither = unparseable."""
    s = pc.utf8_trim_whitespace(arr)
    missing = _nulls(s) | _np_bool(pc.equal(s, ""))
    is_int = _matches(s, _INT_RE)
    is_float = _matches(s, _FLOAT_RE) & ~is_int
    # Arrow casts '+5' to a float but not to an int64: an int's one leading '+' goes (Arrow's CSV inference took it)
    ints = pc.cast(pc.if_else(pa.array(is_int), pc.utf8_ltrim(s, "+"), "0"), pa.int64()).to_numpy(zero_copy_only=False)
    flts = pc.cast(pc.if_else(pa.array(is_float), s, "0"), pa.float64()).to_numpy(zero_copy_only=False)
    return missing, is_int, np.asarray(ints, np.int64), is_float, np.asarray(flts, np.float64)


# -- ids ----------------------------------------------------------------------------------------
@dataclass
class _Check:
    """Rows failing one rule: ``mask`` (N,) bool; reported as ValidationError(field, cell, expected)."""

    mask: np.ndarray
    field: str
    column: str
    expected: str
    kind: str = "invalid_field"  # the DLQ kind
    values: np.ndarray | None = None  # (N,) the value to report per row; None: the row's cell of ``column``


def _object_array(values: list[Any]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def _ids(arr: pa.Array, field: str, column: str, csv: bool, max_len: int) -> tuple[np.ndarray, list[_Check]]:
    """An id column -> ``(object array of int/str, checks)``; integer columns stay Python ints. ``max_len``:
    ``[limits] max_str_len``."""
    t = arr.type
    n = len(arr)
    id_expected = f"a non-negative 64-bit integer or a non-empty string (<= {max_len} chars)"
    if pa.types.is_null(t):
        return _object_array([None] * n), [_Check(np.ones(n, bool), field, column, id_expected)]
    utf8: list[_Check] = []  # cells that are not UTF-8 text, when the column holds bytes
    if _is_binary(t):
        arr, utf8 = _to_text(arr, field, column)
        t = pa.string()
    if _is_text(t):  # in a CSV a null token is the missing id a Parquet null is
        missing = _missing_words(arr) if csv else _nulls(arr) | _np_bool(pc.equal(arr, ""))
        too_long = _np_bool(pc.greater(pc.utf8_length(arr), max_len))
        checks = [*utf8, _Check(missing, field, column, id_expected),
                  _Check(too_long, field, column, f"a string id of at most {max_len} chars ([limits] max_str_len)")]
        if csv:
            negative = _matches(arr, _NEG_INT_RE)
            checks.append(_Check(negative, field, column, f"an integer id in [0, {MAX_ID}]"))
            ok = ~(missing | too_long | negative)
            if ok.any() and _matches(arr, _CANONICAL_UINT_RE)[ok].all():
                try:
                    ints = pc.cast(pc.if_else(pa.array(ok), arr, "0"), pa.int64())
                    return _object_array(ints.to_pylist()), checks
                except pa.ArrowInvalid:  # past 2**63-1: keep the text
                    pass
        return _object_array(arr.to_pylist()), checks
    if pa.types.is_integer(t):
        v, big = _ints(arr)
        missing = _nulls(arr)
        return _object_array(v.tolist()), [
            _Check(missing, field, column, id_expected),
            _Check((v < 0) | big, field, column, f"an integer id in [0, {MAX_ID}]"),
        ]
    if pa.types.is_floating(t):  # e.g. pandas int columns with gaps; whole numbers only
        v = _floats(arr)
        missing = np.isnan(v)
        whole = np.isfinite(v) & (v >= 0) & (v < 2.0**63) & (np.floor(v) == v)
        ints = np.where(whole, v, 0).astype(np.int64)
        return _object_array(ints.tolist()), [
            _Check(missing, field, column, id_expected),
            _Check(~whole & ~missing, field, column, f"an integer id in [0, {MAX_ID}]"),
        ]
    raise EventLogError(f"{field} column {column!r} has type {t}; ids must be integers or strings "
                        f"(set the column with {FLAGS['user' if field == 'user_id' else 'item']})")


def _impression_ids(arr: pa.Array | None, column: str | None, stem: str, n: int, csv: bool, max_len: int
                    ) -> tuple[list[str], list[str], list[_Check]]:
    """``(impression ids, ids for rejected rows' keys, checks)``; in a CSV a null token is missing (:func:`_ids`).
    ``max_len``: ``[limits] max_str_len``."""
    generated = [f"{stem}-{i:09d}" for i in range(n)]
    if arr is None or column is None:
        # the longest is the last: over max_len, every row's event is one the joiner dead-letters (a mapping mistake)
        if n and len(generated[-1]) > max_len:
            raise EventLogError(f"the impression ids generated from the file name ({_shown(generated[-1])}) are "
                                f"{len(generated[-1])} chars, over the {max_len} an id may have ([limits] "
                                f"max_str_len): map an impression id column with {FLAGS['impression_id']}, give the "
                                "file a shorter name, or raise max_str_len")
        return generated, generated, []
    t = arr.type
    utf8: list[_Check] = []
    if pa.types.is_null(t):
        arr = pa.nulls(n, pa.string())
    elif pa.types.is_integer(t) or _is_binary(t):
        arr, utf8 = _to_text(arr, "impression_id", column)
    elif not _is_text(t):
        raise EventLogError(f"impression id column {column!r} has type {t}; it must hold strings or integers "
                            f"(set with {FLAGS['impression_id']})")
    missing = _missing_words(arr) if csv else _nulls(arr) | _np_bool(pc.equal(arr, ""))
    too_long = _np_bool(pc.greater(pc.utf8_length(arr), max_len))
    ids = arr.to_pylist()
    bad = missing | too_long  # (cells that are not UTF-8 are missing now: their rows get generated keys too)
    keys = [g if b else v for v, g, b in zip(ids, generated, bad.tolist(), strict=True)]
    expected = f"a non-empty string of at most {max_len} chars ([limits] max_str_len)"
    return ids, keys, [*utf8, _Check(missing, "impression_id", column, expected),
                       _Check(too_long, "impression_id", column, expected)]


# -- time -----------------------------------------------------------------------------------------
def _int_to_ms(v: np.ndarray, unit: str) -> tuple[np.ndarray, np.ndarray]:
    """int64 epoch times in ``unit`` -> ``(ms, in range)``."""
    if unit == "s":
        ok = (v >= 0) & (v <= MAX_TS_MS // 1000)
        return np.where(ok, v, 0) * 1000, ok
    ms = np.floor_divide(v, _DIV[unit])
    return ms, (ms >= 0) & (ms <= MAX_TS_MS)


def _float_to_ms(v: np.ndarray, unit: str) -> tuple[np.ndarray, np.ndarray]:
    with np.errstate(invalid="ignore", over="ignore"):
        r = np.rint(v * _MS_PER[unit])
        ok = np.isfinite(r) & (r >= 0) & (r <= MAX_TS_MS)
    return np.where(ok, r, 0).astype(np.int64), ok


def _parse_iso(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """ISO-8601 strings -> ``(ms, parsed)``, one Python parse per distinct string."""
    enc = arr.dictionary_encode()
    parsed_ms: list[int] = [0]
    parsed_ok: list[bool] = [False]  # slot 0: nulls
    for s in enc.dictionary.to_pylist():
        text = s.strip()
        if text[-1:] in ("Z", "z"):
            text = text[:-1] + "+00:00"
        try:
            dt = datetime.fromisoformat(text)
        except ValueError:
            parsed_ms.append(0)
            parsed_ok.append(False)
            continue
        if dt.tzinfo is None:
            dt = dt.replace(tzinfo=timezone.utc)
        parsed_ms.append((dt - _EPOCH) // _ONE_MS)
        parsed_ok.append(True)
    codes = np.asarray(pc.fill_null(enc.indices, -1).to_numpy(zero_copy_only=False), dtype=np.int64) + 1
    return np.asarray(parsed_ms, np.int64)[codes], np.asarray(parsed_ok, bool)[codes]


def _iso_column(arr: pa.Array, missing: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ISO-8601 text -> ``(ms, parsed)``: Arrow's parser when every value suits it, else Python's."""
    s = pc.if_else(pa.array(missing), pa.scalar(None, pa.string()),
                   pc.utf8_trim_whitespace(arr.cast(pa.string())))
    for target in (pa.timestamp("ns"), pa.timestamp("ns", "UTC")):
        try:
            ns = pc.cast(s, target).cast(pa.int64())
        except pa.ArrowInvalid:
            continue
        return np.floor_divide(_ints(ns)[0], 1_000_000), ~missing
    return _parse_iso(s)  # mixed offsets, unusual forms, bad values or years outside 1677-2262


def _iso_text(arr: pa.Array, missing: np.ndarray) -> bool:
    """No present cell of a text column is a number and some present cell is an ISO-8601 time: a column of ISO times
    whose other cells (a ``nan``, ``NA``, a typo) are rejected one by one, not a column of unparseable numbers."""
    if missing.all() or _matches(pc.utf8_trim_whitespace(arr), _FLOAT_RE).any():
        return False
    return bool(_iso_column(arr, missing)[1][~missing].any())


def _times(arr: pa.Array, unit: str, column: str, flag: str,
           words_missing: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A time column -> ``(int64 ms (N,), status (N,) int8, number (N,) float64)``, status one of _OK/_MISSING/...;
    ``number`` is each cell's number as written (in ``unit``), NaN where the cell is no number (text that does not
    parse, ISO text, Arrow timestamps and dates, which carry their own unit). ``words_missing`` (the click-time
    column): a text cell of _MISSING_WORDS is missing, not unparseable; else only an empty cell is."""
    t = arr.type
    n = len(arr)
    status = np.zeros(n, dtype=np.int8)
    number = np.full(n, np.nan)
    if pa.types.is_null(t):
        return np.zeros(n, np.int64), np.full(n, _MISSING, np.int8), number
    missing = _nulls(arr)
    if pa.types.is_timestamp(t) or pa.types.is_date(t):
        if pa.types.is_date32(t):
            v, vunit = _ints(arr.cast(pa.int32()))[0] * 86_400_000, "ms"
        elif pa.types.is_date64(t):
            v, vunit = _ints(arr.cast(pa.int64()))[0], "ms"
        else:
            v, vunit = _ints(arr.cast(pa.int64()))[0], t.unit
        ms, ok = _int_to_ms(v, vunit)
    elif pa.types.is_integer(t) or pa.types.is_floating(t):
        if unit == "iso":
            raise EventLogError(f"time column {column!r} holds numbers ({t}), not ISO-8601 strings: set "
                                f"{FLAGS['time_unit']} to s, ms, us or ns")
        if pa.types.is_integer(t):
            v, big = _ints(arr)
            ms, ok = _int_to_ms(v, unit)
            ok &= ~big
            number = np.where(big, np.inf, v.astype(np.float64))
        else:  # NaN and inf are no number, as a CSV cell `nan` or `inf` is (a NaN click time is missing, as `nan`)
            f = _floats(arr)
            if words_missing:
                missing = missing | np.isnan(f)
            ms, ok = _float_to_ms(f, unit)
            status[~np.isfinite(f)] = _UNPARSEABLE
            number = f
    elif _is_text(t):
        trimmed = pc.utf8_trim_whitespace(arr)
        missing = missing | (_missing_words(arr) if words_missing else _np_bool(pc.equal(trimmed, "")))
        if unit == "iso":
            if not missing.all() and _matches(trimmed, _FLOAT_RE)[~missing].all():
                raise EventLogError(f"time column {column!r} holds numbers, not ISO-8601 strings: set "
                                    f"{FLAGS['time_unit']} to s, ms, us or ns")
            ms, parsed = _iso_column(arr, missing)
            ok = parsed & (ms >= 0) & (ms <= MAX_TS_MS)
            status[~parsed] = _UNPARSEABLE
        elif (digits := _digit_ints(arr, missing)) is not None:  # the common case, in one cast
            ms, ok = _int_to_ms(digits, unit)
            number = np.where(missing, np.nan, digits.astype(np.float64))
        elif _iso_text(arr, missing):  # ISO-8601 text whatever the unit, as Arrow's CSV inference read it
            ms, parsed = _iso_column(arr, missing)
            ok = parsed & (ms >= 0) & (ms <= MAX_TS_MS)
            status[~parsed] = _UNPARSEABLE
        else:
            _, is_int, ints, is_float, flts = _parse_numbers(arr)
            ms_i, ok_i = _int_to_ms(ints, unit)
            ms_f, ok_f = _float_to_ms(flts, unit)
            ms = np.where(is_int, ms_i, ms_f)
            ok = np.where(is_int, ok_i, ok_f)
            status[~(is_int | is_float)] = _UNPARSEABLE
            ok &= is_int | is_float
            number = np.where(is_int, ints.astype(np.float64), np.where(is_float, flts, np.nan))
    else:
        raise EventLogError(f"time column {column!r} has type {t}; expected numbers (unit s/ms/us/ns), "
                            f"ISO-8601 strings or timestamps (set with {flag} and {FLAGS['time_unit']})")
    status[(status == _OK) & ~ok] = _OUT_OF_RANGE
    status[missing] = _MISSING
    return np.where(status == _OK, ms, 0).astype(np.int64), status, number


_PLAUSIBLE_MS = 100_000_000_000  # 1973-03-03T09:46:40Z; epoch seconds up to 5138 are below it
_UNIT_NAMES = {"s": "seconds", "ms": "milliseconds", "us": "microseconds", "ns": "nanoseconds"}


def _flag_implausible(status: np.ndarray, ms: np.ndarray, number: np.ndarray) -> None:
    """Under the default unit (ms, not given), a numeric time before 1973 is no event time: most likely epoch seconds
    (which would replay as January 1970). Each such row is marked ``_IMPLAUSIBLE`` (dead-lettered, its reason naming
    the unit it looks like): the rule of :func:`_check_default_unit`, which refuses a file whose every time breaks it,
    applied row by row, so a file mixing seconds and milliseconds publishes none of its seconds as 1970."""
    status[(status == _OK) & (ms < _PLAUSIBLE_MS) & ~np.isnan(number)] = _IMPLAUSIBLE


def _looks_like(number: np.ndarray) -> np.ndarray:
    """(N,) the unit (a key of ``_UNIT_NAMES``) in which each number is a time in [1973-03-03, 2100-01-01), or ''."""
    out = np.full(len(number), "", dtype=object)
    with np.errstate(invalid="ignore"):
        for u, per in _MS_PER.items():
            out[(number * per >= _PLAUSIBLE_MS) & (number * per <= MAX_TS_MS)] = u
    return out


def _time_checks(status: np.ndarray, number: np.ndarray, field: str, column: str, unit: str) -> list[_Check]:
    flag = FLAGS["time_unit"]
    if unit == "iso":
        what = "an ISO-8601 time such as 2000-12-31T22:12:40Z"
    else:
        what = f"a number of {unit} since the epoch ({flag} {unit})"
    top = {"s": MAX_TS_MS // 1000, "ms": MAX_TS_MS, "us": MAX_TS_MS * 1000, "ns": MAX_TS_MS * 10**6}.get(unit)
    span = "between 1970-01-01 and 2100-01-01" + ("" if unit == "iso" else f", i.e. [0, {top}] {unit}")
    checks = [
        _Check(status == _MISSING, field, column, f"{what} (the value is missing)"),
        _Check(status == _UNPARSEABLE, field, column, what),
    ]
    like = _looks_like(number)
    for guess in ("", *_UNIT_NAMES):  # a reason per unit the rows look like
        this = like == guess
        hint = (f"; it looks like epoch {_UNIT_NAMES[guess]}: {flag} {guess}?" if guess and guess != unit
                else f"; a wrong {flag}?")
        checks.append(_Check((status == _OUT_OF_RANGE) & this, field, column, f"a time {span}{hint}"))
        early = (f"it looks like epoch {_UNIT_NAMES[guess]}: pass {flag} {guess} for a file in {_UNIT_NAMES[guess]}"
                 if guess and guess != unit else f"pass {flag} ms to take times before 1973 as they are")
        checks.append(_Check((status == _IMPLAUSIBLE) & this, field, column,
                             f"a time from 1973-03-03 on: before 1973 read as milliseconds (the default {flag} ms); "
                             f"{early}, or fix the row"))
    return checks


def _check_default_unit(t: pa.DataType, ms: np.ndarray, column: str, path: Path) -> None:
    """Without an explicit ``time_unit``, numbers that are all before 1973 as milliseconds are refused: most
    likely epoch seconds, which would replay as January 1970. ``ms``: the valid times read."""
    if pa.types.is_timestamp(t) or pa.types.is_date(t) or not len(ms) or ms.max() >= _PLAUSIBLE_MS:
        return
    last = datetime.fromtimestamp(int(ms.max()) / 1000, timezone.utc).isoformat(timespec="seconds")
    raise EventLogError(f"{path}: every time in column {_shown(column, 80)} is before 1973 when read as milliseconds "
                        f"(the default {FLAGS['time_unit']} ms; the latest is {int(ms.max())}, {last}): epoch "
                        f"seconds? pass {FLAGS['time_unit']} s, or {FLAGS['time_unit']} ms to keep them as they are")


# -- clicked, context, dense ---------------------------------------------------------------------
def _clicked(arr: pa.Array, column: str) -> tuple[np.ndarray, np.ndarray]:
    """``(clicked (N,) bool, unparseable (N,) bool)``; a missing value is not clicked."""
    t = arr.type
    n = len(arr)
    if pa.types.is_null(t):
        return np.zeros(n, bool), np.zeros(n, bool)
    if pa.types.is_boolean(t):
        return _np_bool(arr), np.zeros(n, bool)
    if pa.types.is_integer(t):
        return _np_bool(pc.not_equal(arr, 0)), np.zeros(n, bool)
    if pa.types.is_floating(t):
        f = _floats(arr)
        return ~np.isnan(f) & (f != 0), np.zeros(n, bool)
    if _is_text(t):
        if (digits := _digit_ints(arr)) is not None:  # the common case (0/1), in one cast
            return digits != 0, np.zeros(n, bool)
        missing = _missing_words(arr)
        if missing.any() and (digits := _digit_ints(arr, missing)) is not None:  # 0/1 with missing cells: one cast
            return digits != 0, np.zeros(n, bool)
        # each cell by the rule of its own kind: a word, an integer, a float (missing: not clicked)
        s = pc.utf8_lower(pc.utf8_trim_whitespace(arr))
        yes = _np_bool(pc.is_in(s, pa.array(_TRUE)))
        no = _np_bool(pc.is_in(s, pa.array(_FALSE))) | missing
        _, is_int, ints, is_float, flts = _parse_numbers(arr)
        number = (is_int | is_float) & ~(yes | no)
        yes |= number & np.where(is_int, ints != 0, flts != 0)
        no |= number
        return yes, ~(yes | no)
    raise EventLogError(f"clicked column {column!r} has type {t}; expected booleans, integers or "
                        f"true/false/1/0/yes/no (set with {FLAGS['clicked']}, '' for no clicks)")


def _prepare_feature(arr: pa.Array, column: str, csv: bool, limits: EventLimits
                     ) -> tuple[pa.Array, list[_Check], bool]:
    """A context column -> ``(array for to_pylist, checks, lists may hold nulls)``, strings and lists checked against
    ``limits`` (``max_str_len``, ``max_list_len``) as the joiner's decoder checks them."""
    field = f"context.{column}"
    t = arr.type
    n = len(arr)
    none = np.zeros(n, bool)
    if pa.types.is_temporal(t) or pa.types.is_decimal(t):
        arr, t = arr.cast(pa.string()), pa.string()
    utf8: list[_Check] = []  # cells that are not UTF-8 text, when the column holds bytes
    if _is_binary(t):
        arr, utf8 = _to_text(arr, field, column)
        t = pa.string()
    if pa.types.is_null(t) or pa.types.is_boolean(t) or pa.types.is_integer(t):
        big = _ints(arr)[1] if pa.types.is_integer(t) else none
        return arr, [_Check(big, field, column, "an integer in the signed 64-bit range")], False
    if _is_text(t):
        long = _np_bool(pc.greater(pc.utf8_length(arr), limits.max_str_len))
        if csv:  # each cell alone: missing, an integer, a float, a boolean or its text
            arr, text, huge = _feature_cells(arr)
            long &= text
            utf8.append(_Check(huge, field, column, "a finite number"))
        return arr, [*utf8, _Check(long, field, column, f"a string of at most {limits.max_str_len} chars "
                                                        "([limits] max_str_len)")], False
    if pa.types.is_floating(t):  # NaN is missing, as the CSV cell `nan` is (a null token); inf is rejected
        arr = pc.if_else(pc.is_nan(arr), pa.scalar(None, arr.type), arr)
        f = pc.fill_null(arr.cast(pa.float64()), 0.0).to_numpy(zero_copy_only=False)
        return arr, [_Check(~np.isfinite(f), field, column, "a finite number")], False
    if _is_list(t):
        vt = t.value_type
        if pa.types.is_dictionary(vt):
            vt = vt.value_type
        if pa.types.is_null(vt) or _is_text(vt) or _is_binary(vt):
            vt_new = pa.string()
        elif pa.types.is_integer(vt):
            vt_new = vt
        else:
            raise EventLogError(f"feature column {column!r} has type {t}; context lists must hold strings or "
                                f"integers (set with {FLAGS['features']})")
        try:
            arr = arr.cast(pa.list_(vt_new))
        except pa.ArrowInvalid:
            raise EventLogError(f"feature column {column!r}: list values are not UTF-8 text") from None
        too_many = _np_bool(pc.greater(pc.list_value_length(arr), limits.max_list_len))
        values = pc.list_flatten(arr)
        parents = np.asarray(pc.list_parent_indices(arr).to_numpy(zero_copy_only=False), np.int64)
        if pa.types.is_integer(vt_new):
            bad_value = _ints(values)[1]
        else:
            bad_value = _np_bool(pc.greater(pc.utf8_length(values), limits.max_str_len))
        bad_entry = np.zeros(n, bool)
        bad_entry[parents[bad_value]] = True
        checks = [_Check(too_many, field, column, f"a list of at most {limits.max_list_len} strings/integers "
                         "([limits] max_list_len)"),
                  _Check(bad_entry, field, column, f"list entries of at most {limits.max_str_len} chars "
                         "([limits] max_str_len) and in the signed 64-bit range")]
        return arr, checks, values.null_count > 0
    raise EventLogError(f"feature column {column!r} has type {t}; context values must be strings, integers, "
                        f"floats, booleans or lists of strings/integers (set with {FLAGS['features']})")


_FEATURE_INT_RE = r"^-?(0|[1-9][0-9]{0,18})$"  # an integer as Python writes it (within int64: checked apart)
_INF_RE = r"(?i)^[+-]?inf(inity)?$"  # what Arrow reads as an infinite float: `inf`, `-Inf` (R), `Infinity` (Java, JS)
_FEATURE_BOOLS = ("true", "True", "TRUE", "false", "False", "FALSE")  # Arrow's true_values/false_values less 1/0
_INT, _FLOAT, _BOOL, _TEXT = 0, 1, 2, 3


def _feature_cells(arr: pa.Array) -> tuple[pa.Array, np.ndarray, np.ndarray]:
    """A CSV feature column (text) -> ``(values, text (N,) bool, not finite (N,) bool)``, each cell read alone, by the
    rule Arrow's type inference applied to a column of that one cell (the exceptions are in the module docstring), so
    that a clean column of canonical integers, decimals or booleans keeps the values (and hashes) the inference gave:
    missing (empty or a null token, :func:`_missing_words`); an
    integer as Python writes it (``42``, ``-3``, within int64) is an int; a decimal number (``1.50``, ``2.0``, ``1e3``)
    a float, and an infinity (``inf``, ``-Inf``, ``Infinity``) an infinite float (flagged not finite, as a Parquet
    float inf is rejected); ``true``/``True``/``TRUE`` (false alike) a bool; anything else (``007``, ``+5``,
    ``12:00``) its text as written. Numbers and booleans are trimmed. One kind of cell: a typed array; mixed: a dense
    union."""
    n = len(arr)
    s = pc.utf8_trim_whitespace(arr)
    missing = _missing_words(arr)
    kind = np.full(n, _TEXT, np.int8)
    digits = pc.utf8_ltrim(s, characters="-")
    # within int64: -2**63 too (the digits' bound alone made it text, where a Parquet int64 holds it as an integer)
    fits = _np_bool(pc.or_(pc.or_(pc.less(pc.utf8_length(digits), 19), pc.less_equal(digits, str(MAX_ID))),
                           pc.equal(s, str(-MAX_ID - 1))))
    kind[(_matches(s, _FLOAT_RE) & _matches(s, "[.eE]")) | _matches(s, _INF_RE)] = _FLOAT  # inf: rejected below
    kind[_matches(s, _FEATURE_INT_RE) & fits] = _INT
    kind[_np_bool(pc.is_in(s, pa.array(_FEATURE_BOOLS)))] = _BOOL
    kind[missing] = _TEXT
    null = pa.array(missing)
    typed = {_INT: pa.int64(), _FLOAT: pa.float64(), _BOOL: pa.bool_()}

    def values(k: int, cells: pa.Array) -> pa.Array:
        if k == _TEXT:
            return cells
        if k == _BOOL:
            return pc.equal(pc.utf8_lower(cells), "true")  # null stays null
        return pc.cast(cells, typed[k])

    kinds = np.unique(kind[~missing])
    if len(kinds) <= 1:
        k = int(kinds[0]) if len(kinds) else _TEXT
        cells = pc.if_else(null, pa.scalar(None, pa.string()), arr if k == _TEXT else s)
        out = values(k, cells)
        huge = ~np.isfinite(_floats(out)) & ~missing if k == _FLOAT else np.zeros(n, bool)
        return out, np.full(n, k == _TEXT) & ~missing, huge
    offsets = np.zeros(n, np.int32)
    children = []
    for k in (_INT, _FLOAT, _BOOL, _TEXT):
        at = np.flatnonzero(kind == k)
        offsets[at] = np.arange(len(at), dtype=np.int32)
        children.append(values(k, pc.if_else(null, pa.scalar(None, pa.string()), arr if k == _TEXT else s)
                               .take(pa.array(at))))
    with np.errstate(invalid="ignore"):
        huge = np.zeros(n, bool)
        huge[kind == _FLOAT] = ~np.isfinite(_floats(children[_FLOAT]))
    return (pa.UnionArray.from_dense(pa.array(kind), pa.array(offsets), children), (kind == _TEXT) & ~missing,
            huge)


def _dense(arr: pa.Array, column: str) -> tuple[np.ndarray, list[_Check]]:
    field = f"{DENSE_PREFIX}{column}"
    t = arr.type
    missing = _nulls(arr)
    if pa.types.is_null(t):
        v = np.full(len(arr), np.nan)
    elif any(is_(t) for is_ in (pa.types.is_integer, pa.types.is_floating, pa.types.is_boolean,
                                pa.types.is_decimal)):
        v = _floats(arr)
    elif _is_text(t) and (cast := _cast_floats(arr)) is not None:  # the common case, in one cast
        v = cast
    elif _is_text(t):
        missing, is_int, ints, is_float, flts = _parse_numbers(arr)
        v = np.where(is_int, ints.astype(np.float64), np.where(is_float, flts, np.nan))
        word = pc.utf8_lower(pc.utf8_trim_whitespace(arr))  # booleans as CSV writes them (Arrow's inference took them)
        v = np.where(_np_bool(pc.equal(word, "true")), 1.0, np.where(_np_bool(pc.equal(word, "false")), 0.0, v))
    else:
        raise EventLogError(f"dense column {column!r} has type {t}; dense features must be numbers "
                            f"(set with {FLAGS['dense']})")
    over = ~np.isfinite(v) | (np.abs(np.nan_to_num(v)) >= DENSE_BOUND)
    return v, [_Check(missing, field, column, "a finite number (the value is missing)"),
               _Check(over & ~missing, field, column, DENSE_RULE)]


# -- rejected rows --------------------------------------------------------------------------------
def _json_default(obj: Any) -> Any:
    if isinstance(obj, Decimal):
        return str(obj)
    if isinstance(obj, bytes | bytearray):
        return obj.decode("utf-8", "replace")
    return str(obj)


def _json_rows(table: pa.Table, csv: bool) -> list[dict[str, Any]]:
    """Rows as dicts for JSON: temporal values and non-finite floats as text (nanoseconds do not fit ``datetime``),
    and in CSV files an empty cell as ``None``."""
    for i, f in enumerate(table.schema):
        col = table.column(i)
        if pa.types.is_dictionary(f.type):
            col = col.cast(f.type.value_type)
        if pa.types.is_temporal(col.type):
            col = col.cast(pa.string())
        if csv and _is_binary(col.type):  # feature columns are read as bytes: text unless a cell is not UTF-8
            with contextlib.suppress(pa.ArrowInvalid):
                col = col.cast(pa.string())
        if csv and (_is_text(col.type) or _is_binary(col.type)):
            col = pc.if_else(pc.equal(pc.binary_length(col), 0), pa.scalar(None, col.type), col)
        table = table.set_column(i, f.name, col)
    rows = table.to_pylist()
    for f in table.schema:  # JSON has no NaN or inf (orjson writes null, a missing value): text, as a CSV cell has
        if pa.types.is_floating(f.type):
            col = _plain(table.column(f.name))
            for i in np.flatnonzero(~np.isfinite(_floats(col)) & ~_nulls(col)).tolist():
                rows[i][f.name] = repr(float(rows[i][f.name]))  # 'nan', 'inf', '-inf'
    return rows


# -- limits on the event as a whole ----------------------------------------------------------------
def _check_event_keys(cols: ColumnMap, limits: EventLimits) -> None:
    """The feature and dense column names become the event's context and dense keys: a mapping with more
    of them than ``[limits]`` allows, or a name over ``max_key_len``, makes every row an event the decoder
    rejects, so it is refused as a configuration mistake."""
    for role, field, max_keys in (("features", "context", limits.max_context_keys),
                                  ("dense", "dense", limits.max_dense_keys)):
        names = list(dict.fromkeys(getattr(cols, role)))
        if len(names) > max_keys:
            raise EventLogError(f"{FLAGS[role]} maps {len(names)} columns; an event's {field!r} holds at most "
                                f"{max_keys} keys ([limits] max_{field}_keys)")
        for name in names:
            if len(name) > limits.max_key_len:
                shown = repr(name) if len(name) <= 80 else f"{name[:80]!r}..."
                raise EventLogError(f"{FLAGS[role]}: column name {shown} is {len(name)} chars; an event's "
                                    f"{field!r} keys (the column names) are at most {limits.max_key_len} chars "
                                    "([limits] max_key_len): rename the column")


# JSON of an impression without its context (ids: strings of at most max_str_len chars, each char escaped
# to at most 6 bytes) and with one dense value (float64, at most 24 chars as orjson writes it) per key:
_EVENT_BASE_BYTES = len(b'{"schema_version":1,"impression_id":"","ts":,"user_id":"","item_id":""'
                        b',"context":,"dense":{}}')
_ESCAPED_CHAR_BYTES = 6
_INT_ID_BYTES = len(str(MAX_ID))
_TS_BYTES = len(str(MAX_TS_MS))
_DENSE_VALUE_BYTES = 24


def _oversized(imp_ids: np.ndarray, users: np.ndarray, items: np.ndarray, ts: np.ndarray,
               dicts: list[dict[str, Any]] | None, dense: dict[str, np.ndarray], limits: EventLimits
               ) -> tuple[np.ndarray, np.ndarray]:
    """``(over (N,) bool, size (N,) int64)`` of the accepted rows (columns of N rows each, ``dicts`` their
    context or None without feature columns): which events, encoded as the publisher
    encodes them (``stream/replay/publisher.py``), are over ``max_message_bytes``; ``size`` is exact where
    ``over``. A bound (the context's exact JSON + the most the other fields can take) clears most rows
    with one ``orjson.dumps`` of the context dict; only rows the bound does not clear are encoded whole."""
    n = len(imp_ids)
    limit = limits.max_message_bytes
    id_bytes = max(_ESCAPED_CHAR_BYTES * limits.max_str_len, _INT_ID_BYTES)  # a short max_str_len: int ids are longer
    rest = (_EVENT_BASE_BYTES + 3 * id_bytes + _TS_BYTES
            + sum(len(orjson.dumps(name)) + 2 + _DENSE_VALUE_BYTES for name in dense))
    size = np.full(n, rest, np.int64)
    if dicts is not None:
        dumps = orjson.dumps
        size += np.fromiter((len(dumps(d)) for d in dicts), dtype=np.int64, count=n)
    over = np.zeros(n, bool)
    for i in np.flatnonzero(size > limit).tolist():
        event: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "impression_id": imp_ids[i],
                                 "ts": ts[i].item(), "user_id": users[i], "item_id": items[i]}
        if dicts is not None and dicts[i]:
            event["context"] = dicts[i]
        if dense:
            event["dense"] = {name: col[i].item() for name, col in dense.items()}
        size[i] = len(orjson.dumps(event))
        over[i] = size[i] > limit
    return over, size


# -- the source -----------------------------------------------------------------------------------
def load_eventlog(path: str | Path, columns: ColumnMap, delay: ClickDelay, seed: int,
                  limit: int | None = None, csv_delimiter: str | None = None,
                  limits: EventLimits = DEFAULT_LIMITS) -> EventTable:
    """Read an event log (one impression per row) into an :class:`EventTable`.

    ``limit``: read only the first ``limit`` rows of the file (file order, rejected rows included);
    the publisher sorts them by event time. ``csv_delimiter`` overrides the one implied by the
    extension (tab for ``.tsv``, else comma). ``limits``: the joiner's (the command's ``[limits]``): a row
    it would dead-letter is rejected here, and one it accepts is published. ``stats``: ``file``, ``format``,
    ``rows_read``, ``rejected_rows``, ``rejected_by_field`` (field -> rows), ``clicked_rows`` (clicks produced),
    ``duplicate_impression_ids`` (accepted rows reusing an earlier row's mapped impression id).

    Raises :class:`EventLogError` (a ``ValueError``) for an unknown format, a missing file or
    column, or a column whose type cannot be used, and for a path that is no regular file (a FIFO, a device, a
    directory: refused unread, naming ``--dataset``).
    """
    path = Path(path)
    cols = columns
    if cols.time_unit is not None and cols.time_unit not in TIME_UNITS:
        raise EventLogError(f"{FLAGS['time_unit']} must be one of {', '.join(TIME_UNITS)}, "
                            f"got {cols.time_unit!r}")
    if limit is not None and limit < 0:
        raise EventLogError(f"--limit must be >= 0, got {limit}")
    for role, col in cols.roles():
        if not col:
            raise EventLogError(f"{FLAGS[role]} names no column (got an empty name)")
    _check_event_keys(cols, limits)
    fmt, stem = detect_format(path)
    wanted = list(dict.fromkeys(col for _, col in cols.roles()))
    with _open_log(path) as fh:
        if fmt == "parquet":
            table = _utf8_checked(path, _read_parquet(path, fh, cols, wanted, limit), cols)
        else:
            ext = path.name.lower()
            ext = ext[: len(ext) - len(next((e for e in _COMPRESSED_EXT if ext.endswith(e)), ""))]
            table = _read_csv(path, fh, Path(ext).suffix, cols, wanted, limit, csv_delimiter)
    return _build(table, cols, delay, seed, path, fmt, stem[:200], csv=fmt == "csv", limits=limits)


def _build(table: pa.Table, cols: ColumnMap, delay: ClickDelay, seed: int, path: Path, fmt: str,
           stem: str, csv: bool, limits: EventLimits) -> EventTable:
    n = table.num_rows
    col = {name: _plain(table.column(name)) for name in table.column_names}
    checks: list[_Check] = []

    imp_ids, keys, c = _impression_ids(col.get(cols.impression_id or ""), cols.impression_id, stem, n, csv,
                                       limits.max_str_len)
    checks += c
    unit = cols.time_unit or "ms"
    ts, ts_status, ts_number = _times(col[cols.time], unit, cols.time, FLAGS["time"])
    if cols.time_unit is None:
        _check_default_unit(col[cols.time].type, ts[ts_status == _OK], cols.time, path)
        _flag_implausible(ts_status, ts, ts_number)
    checks += _time_checks(ts_status, ts_number, "ts", cols.time, unit)
    # The producer stamps messages with the wall clock: a row further ahead than the joiner would accept
    # is dead-lettered here already (same bound, same kind).
    latest_ms = int(time.time() * 1000) + limits.future_ts_ms  # the last time the joiner takes from a message sent now
    ahead = (ts_status == _OK) & (ts > latest_ms)
    checks.append(_Check(ahead, "ts", cols.time, f"an event time at most {limits.future_ts_s:g} s ahead of "
                         "the wall clock at import (is --time-unit right? [limits] future_ts_s)", kind="future_ts"))
    users, c = _ids(col[cols.user], "user_id", cols.user, csv, limits.max_str_len)
    checks += c
    items, c = _ids(col[cols.item], "item_id", cols.item, csv, limits.max_str_len)
    checks += c

    features = list(dict.fromkeys(cols.features))
    prepared: dict[str, pa.Array] = {}
    list_nulls: list[str] = []
    for name in features:
        arr, c, has_nulls = _prepare_feature(col[name], name, csv, limits)
        prepared[name] = arr
        checks += c
        if has_nulls:
            list_nulls.append(name)
    dense: dict[str, np.ndarray] = {}
    for name in dict.fromkeys(cols.dense):
        dense[name], c = _dense(col[name], name)
        checks += c

    # clicks
    if cols.clicked is not None:
        clicked, unparseable = _clicked(col[cols.clicked], cols.clicked)
        checks.append(_Check(unparseable, "clicked", cols.clicked,
                             "a boolean, a number (non-zero = clicked) or one of true/false/yes/no"))
    else:
        clicked = np.zeros(n, bool)
    click_ts = np.zeros(n, np.int64)
    from_column = np.zeros(n, bool)
    if cols.click_time is not None:
        ct, ct_status, ct_number = _times(col[cols.click_time], unit, cols.click_time, FLAGS["click_time"],
                                          words_missing=True)
        if cols.time_unit is None:
            _flag_implausible(ct_status, ct, ct_number)
        if cols.clicked is None:
            clicked = ct_status != _MISSING
        from_column = clicked & (ct_status != _MISSING)
        ct_checks = _time_checks(ct_status, ct_number, "click_ts", cols.click_time, unit)[1:]
        for check in ct_checks:
            check.mask = check.mask & clicked
        checks += ct_checks
        before = from_column & (ct_status == _OK) & (ts_status == _OK) & (ct < ts)
        checks.append(_Check(before, "click_ts", cols.click_time,
                             "a click time at or after the impression's time"))
        # the clicks decoder bounds a click's ts by its broker time as it does an impression's (a click a year ahead
        # went out and the joiner dead-lettered it, its row's impression published as unclicked)
        checks.append(_Check(from_column & (ct_status == _OK) & (ct > latest_ms), "click_ts", cols.click_time,
                             f"a click time at most {limits.future_ts_s:g} s ahead of the wall clock at import "
                             "([limits] future_ts_s)", kind="future_ts"))
        click_ts[from_column] = ct[from_column]
    drawn = clicked & ~from_column
    if drawn.any():
        rng = np.random.Generator(np.random.PCG64(seed))
        delays = draw_click_delays_ms(delay, n, rng)  # one per row read: row i's delay is draw i
        # cut at the last time the joiner takes from a message sent now (a recent impression's long delay was a
        # click it dead-letters as future_ts)
        click_ts[drawn] = np.minimum(ts[drawn] + delays[drawn], min(MAX_TS_MS, latest_ms))

    # which rule each row breaks first
    first = np.full(n, -1, dtype=np.int64)
    for k in range(len(checks) - 1, -1, -1):
        first[checks[k].mask] = k
    good = first < 0

    # the context of the rows every value check accepts, one dict per row
    dicts: list[dict[str, Any]] | None = None
    if features:
        feat = pa.table(prepared).filter(pa.array(good))
        dicts = feat.to_pylist()
        # drop missing values (and missing list entries), touching only the rows that have them
        for name in feat.column_names:
            column = feat.column(name)
            if column.null_count or pa.types.is_union(column.type):  # a union has no validity bitmap of its own
                for i in np.flatnonzero(_nulls(_plain(column))).tolist():
                    del dicts[i][name]
        for name in list_nulls:
            for d in dicts:
                v = d.get(name)
                if v is not None and None in v:
                    d[name] = [x for x in v if x is not None]
    # the limit on the event as a whole, checked last: only an event whose every field is valid has a size
    good_idx = np.flatnonzero(good)
    over, size = _oversized(_object_array(imp_ids)[good], users[good], items[good], ts[good], dicts,
                            {name: v[good] for name, v in dense.items()}, limits)
    if over.any():
        limit = limits.max_message_bytes
        sizes = np.zeros(n, np.int64)
        sizes[good_idx[over]] = size[over]
        checks.append(_Check(sizes > 0, "message", "", f"an impression event of at most {limit} bytes as JSON "
                             "(the value is its size; [limits] max_message_bytes)", kind="too_large", values=sizes))
        first[good_idx[over]] = len(checks) - 1
        good = first < 0
        good_idx = np.flatnonzero(good)
        if dicts is not None:
            dicts = [d for d, o in zip(dicts, over.tolist(), strict=True) if not o]
    bad = ~good

    raw: list[RawMessage] = []
    by_field: Counter[str] = Counter()
    bad_idx = np.flatnonzero(bad)
    if len(bad_idx):
        rows = _json_rows(table.take(pa.array(bad_idx)), csv)
        for i, row in zip(bad_idx.tolist(), rows, strict=True):
            check = checks[first[i]]
            by_field[check.field] += 1
            value = row.get(check.column) if check.values is None else check.values[i].item()
            where = f"column {check.column!r}, " if check.column else ""
            error = ValidationError(check.field, value, f"{check.expected} ({where}row {i} counting from 0)")
            error.kind = check.kind
            raw.append(RawMessage(
                topic_kind=IMPRESSION,
                ts=int(ts[i]) if ts_status[i] == _OK else 0,
                key=keys[i].encode(),
                value=orjson.dumps(row, default=_json_default),
                error=error,
            ))

    # accepted rows
    impression_id = _object_array([imp_ids[i] for i in good_idx.tolist()])
    context: list[ContextPart] = []
    if dicts is not None:
        context.append(ContextPart(np.arange(len(dicts), dtype=np.int64), dicts))
    clicks = good & clicked
    duplicates = 0
    if cols.impression_id is not None and len(impression_id):
        duplicates = len(impression_id) - len(set(impression_id.tolist()))

    return EventTable(
        impression_id=impression_id,
        ts=ts[good].astype(np.int64),
        user_id=users[good],
        item_id=items[good],
        context=context,
        dense={name: v[good].astype(np.float64) for name, v in dense.items()},
        click_impression_id=_object_array([imp_ids[i] for i in np.flatnonzero(clicks).tolist()]),
        click_ts=click_ts[clicks].astype(np.int64),
        raw=raw,
        stats={
            "file": str(path),
            "format": fmt,
            "rows_read": n,
            "rejected_rows": len(raw),
            "rejected_by_field": dict(sorted(by_field.items())),
            "clicked_rows": int(clicks.sum()),
            "duplicate_impression_ids": duplicates,
        },
    )

"""Reading an event log's file for :func:`stream.replay.eventlog.load_eventlog`: its format from its name and first
bytes, one open regular file for every read, Parquet and CSV (compressed or not) read as Arrow tables of the mapped
columns, and the file's own errors (a row that does not parse, bytes that are not UTF-8) said with its line."""

from __future__ import annotations

import contextlib
import csv
import functools
import io
import logging
import os
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

from stream.errors import quoted, shown
from stream.files import NotRegularFile, ReadAt, describe_os_error, open_regular
from stream.replay.column_map import DATASET_SETTING, FLAGS, ColumnMap, EventLogError

_PARQUET_EXT = (".parquet", ".pq")
_CSV_EXT = (".csv", ".tsv", ".txt")
COMPRESSED_EXT = (".gz", ".bz2", ".zst")
_CODEC = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd"}  # what Arrow infers from a path's extension

log = logging.getLogger("streamrec.replay")
# -- reading ---------------------------------------------------------------------------------------
def detect_format(path: Path) -> tuple[str, str]:
    """``(format, stem)`` of ``path`` from its extension: format ``parquet`` or ``csv``."""
    name = path.name
    lower = name.lower()
    compressed = next((e for e in COMPRESSED_EXT if lower.endswith(e)), "")
    base, base_lower = name[: len(name) - len(compressed)], lower[: len(lower) - len(compressed)]
    for fmt, exts in (("parquet", _PARQUET_EXT), ("csv", _CSV_EXT)):
        for ext in exts:
            if base_lower.endswith(ext) and not (compressed and fmt == "parquet"):
                return fmt, base[: len(base) - len(ext)] or base
    raise EventLogError(
        f"cannot tell the format of {path}: expected a Parquet file (.parquet, .pq) or a CSV file "
        f"(.csv, .tsv, .txt, optionally compressed {'/'.join(COMPRESSED_EXT)})"
    )


@contextlib.contextmanager
def open_log(path: Path) -> Iterator[io.FileIO]:
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
    :func:`open_log` checked is what is read; each read through a view with its own position
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
    listed = ", ".join(shown(c, 80) for c in have[:60])
    if len(have) > 60:
        listed += f", ... ({len(have) - 60} more)"
    what = "; ".join(f"column {shown(c, 80)} (set with {FLAGS[role_of[c]]})" for c in missing)
    return EventLogError(f"{path} has no {what}; the file's columns are: {listed or '(none)'}")


def _check_columns(path: Path, have: list[str], cols: ColumnMap, wanted: list[str]) -> None:
    """Every mapped column is in ``have`` exactly once (Arrow would silently pick the first of two)."""
    missing = [c for c in wanted if c not in have]
    if missing:
        raise _missing_columns_error(path, have, cols, missing)
    role_of = {col: role for role, col in reversed(cols.roles())}
    for c in wanted:
        at = [str(i + 1) for i, name in enumerate(have) if name == c]
        if len(at) > 1:
            raise EventLogError(f"{path} has {len(at)} columns named {shown(c, 80)} (columns {', '.join(at[:-1])} "
                                f"and {at[-1]}, counting from 1), mapped with {FLAGS[role_of[c]]}: rename all but "
                                "one of them so the mapping is unambiguous")


def read_parquet(path: Path, fh: io.FileIO, cols: ColumnMap, wanted: list[str], limit: int | None) -> pa.Table:
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
        raise EventLogError(f"cannot read {path} as Parquet: {quoted(str(exc).strip(), 300)}") from None
    if not batches:
        return pa.schema([pf.schema_arrow.field(c) for c in wanted]).empty_table()
    return pa.Table.from_batches(batches).slice(0, limit)


_CELLWISE_ROLES = ("user", "item", "impression_id", "features")  # columns whose cells that are not UTF-8 reject a row


def utf8_checked(path: Path, table: pa.Table, cols: ColumnMap) -> pa.Table:
    """A Parquet table whose string columns are UTF-8 text: Arrow does not check them when it reads a file, which
    another writer can fill with other bytes (a Latin-1 id), and reading such a cell was a UnicodeDecodeError
    traceback. A column that holds one becomes binary, so in an id or feature column each such cell rejects its row
    (``_to_text``, as a CSV feature cell does); in a time, clicked or dense column it refuses the file, naming the
    column and the row. A list of strings holding one becomes a list of binary entries, refused whole as one read
    so (``prepare_feature``)."""
    roles: dict[str, set[str]] = {}
    for role, name in cols.roles():
        roles.setdefault(name, set()).add(role)
    for i, f in enumerate(table.schema):
        arr = plain_array(table.column(i))
        listed = is_list(arr.type) and is_text(arr.type.value_type)
        if not (is_text(arr.type) or listed):
            continue
        try:
            arr.validate(full=True)
            continue
        except pa.ArrowInvalid:
            raw = arr.cast(pa.list_(pa.large_binary()) if listed else pa.large_binary())
        if not listed and not roles.get(f.name, set()) <= set(_CELLWISE_ROLES):
            row = next(k for k, v in enumerate(raw.to_pylist()) if v is not None and not is_utf8(v))
            raise EventLogError(f"{path}: column {shown(f.name, 80)} holds bytes that are not UTF-8 text "
                                f"(row {row} counting from 0): a Latin-1 or other non-UTF-8 file? convert it to UTF-8")
        table = table.set_column(i, f.name, raw)
    return table


def is_utf8(value: bytes) -> bool:
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
    if "Empty CSV file" in msg:  # also a header alone with no line end after it (Arrow cannot count its columns)
        return EventLogError(f"cannot read {path} as CSV: it holds no header row ended by a line break (it is empty, "
                             "or its one line has no line end: a CSV file needs a header row; end it with one)")
    if "Truncated compressed stream" in msg:
        return EventLogError(f"cannot read {path} as CSV: the compressed file is cut short (an interrupted copy or "
                             "download?): copy it again whole")
    try:
        read(serial)
    except (pa.ArrowException, OSError, UnicodeDecodeError) as again:
        msg = str(again) if isinstance(again, pa.ArrowException) else msg
    m = _ROW_RE.match(msg)
    if m is None:
        return EventLogError(f"cannot read {path} as CSV: {quoted(msg.strip(), 300)}")
    column, record, reason = m.groups()
    line = line_of(int(record)) if line_of is not None else None
    where = (f"line {line} (the header is line 1)" if line is not None
             else f"record {record} (the header is record 1; blank lines not counted)")
    detail = re.match(r"Expected (\d+) columns, got (\d+): (.*)$", reason, re.S)
    if detail:
        reason = (f"expected {detail[1]} columns, got {detail[2]} (a missing or extra delimiter, or an unclosed "
                  f"quote): {shown(detail[3], 200)}")
    else:
        if "invalid UTF8" in reason:
            reason += " (a Latin-1 or other non-UTF-8 file? convert it to UTF-8)"
        reason = quoted((f"{_column_named(column, names, cols)}: {reason}" if column else reason).strip(), 300)
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


def read_csv(path: Path, fh: io.FileIO, ext: str, cols: ColumnMap, wanted: list[str], limit: int | None,
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
    # Ids as text: Arrow would read ids past 2**63-1 as floats (losing digits); see parse_ids(). Times and dense values
    # as text too: Arrow's inference read `nan`, `NA` or `null` as a missing value and `inf` as a float, so a row's
    # reason said "missing" (or showed null) instead of what the cell held; each cell is parsed in
    # parse_times/parse_dense.
    # The clicked column too, so that a cell means the same whatever its neighbours (see parse_clicked). In the clicked
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
            return _said_if_cut(path, fh, codec, table, limit)
    def whole(ro: pcsv.ReadOptions) -> pa.Table:
        with _stream(fh, codec) as src:
            return pcsv.read_csv(src, read_options=ro, parse_options=parse, convert_options=convert)

    table = _csv(path, whole, have, cols, line_of)
    return _said_if_cut(path, fh, codec, table if limit is None else table.slice(0, limit), limit)


def _said_if_cut(path: Path, fh: io.FileIO, codec: str | None, table: pa.Table, limit: int | None) -> pa.Table:
    """``table``, read to the end of an uncompressed CSV whose last line has no line end, with a WARNING: a file cut
    mid-line (a copy or an export still running) whose cut fell in its last column parses as a row with that value
    cut short (``3,4,16000`` for a time, ``1`` for ``17``), published as written. Many writers leave the last line
    end out, so it is read. A compressed file cut short is refused by its codec."""
    if codec is None and table.num_rows and (limit is None or table.num_rows < limit):
        size = os.fstat(fh.fileno()).st_size
        if size and os.pread(fh.fileno(), 1, size - 1) not in (b"\n", b"\r"):
            log.warning("[replay] %s: its last line has no line end; it is read as a row, but if the file was cut "
                        "short (a copy or an export still running) its last value is cut too: check that row, or "
                        "end the file with a line break", shown(str(path)))
    return table


# -- column helpers ----------------------------------------------------------------------------
def plain_array(arr: pa.ChunkedArray | pa.Array) -> pa.Array:
    """One contiguous array, dictionaries decoded."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    return arr


def is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or str(t) == "string_view"


def is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def is_binary(t: pa.DataType) -> bool:
    return pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t)

"""Hostile event logs (stream/replay/eventlog.py): a file that cannot be read as mapped is one clear error
(EventLogError, the CLI's exit 2) naming the file and what is wrong, never a traceback, a silent choice or
raw file bytes on the terminal."""

from __future__ import annotations

import contextlib
import gzip
import io
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import stream.replay.eventlog_files as eventlog_files
from stream.replay.column_map import ColumnMap, EventLogError
from stream.replay.config import ClickDelay, DelayKind
from stream.replay.eventlog import load_eventlog
from tests.fifos import fed_fifo

FIXED = ClickDelay(DelayKind.FIXED, median_s=30.0)
T0_S = 978_300_760  # 2000-12-31T22:12:40Z
HEADER = "user_id,item_id,ts,clicked,genre"


def rows(n: int, ts_scale: int = 1000) -> list[str]:
    return [f"{k % 7},{k % 5},{(T0_S + k) * ts_scale},{k % 2},g{k % 3}" for k in range(n)]


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def load(path: Path, limit: int | None = None, **cols: object):
    cols.setdefault("time_unit", "ms")
    return load_eventlog(path, ColumnMap(**cols), FIXED, seed=0, limit=limit)  # type: ignore[arg-type]


def assert_printable(msg: str) -> None:
    assert all(c.isprintable() for c in msg), f"raw control characters in {msg!r}"


# -- 8: a path that is no regular file ---------------------------------------------------------------
@pytest.mark.parametrize("name", ["log.csv", "log.csv.gz", "log.parquet"])
def test_a_fifo_as_the_event_log_is_refused_unread_naming_the_setting(tmp_path: Path, name: str) -> None:
    """Fed, the FIFO would be read (and the load succeed) by a reader that opens it; one without a writer hangs."""
    content = "\n".join([HEADER, *rows(3)]).encode() + b"\n"
    with fed_fifo(tmp_path / name, gzip.compress(content) if name.endswith(".gz") else content) as fifo:
        with pytest.raises(EventLogError, match=rf"--dataset.*{name}.* not a regular file \(mode p"):
            load(fifo)


@pytest.mark.parametrize("kind", ["device", "directory"])
def test_a_device_or_a_directory_as_the_event_log_is_refused_naming_the_setting(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "log.csv"
    if kind == "device":
        path.symlink_to("/dev/zero")  # read without end
    else:
        path.mkdir()
    with pytest.raises(EventLogError, match=r"--dataset.*log\.csv.* (not a regular file|is a directory)") as err:
        load(path)
    assert "Errno" not in str(err.value)


@pytest.mark.parametrize("name", ["log.csv", "log.parquet"])
def test_the_file_checked_is_the_file_read_when_its_name_is_swapped_for_a_fifo(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Arrow opened the log by name for each read (header, rows): a FIFO put at the name between the check and the
    reads was read (or, without a writer, hung the replay). Every read is of the one file opened and checked."""
    path = tmp_path / name
    if name.endswith(".parquet"):
        pq.write_table(pa.table({"user_id": [1], "item_id": [2], "ts": [T0_S * 1000], "clicked": [0]}), path)
    else:
        write(path, [HEADER, *rows(3)])
    planted = "\n".join([HEADER, "99,99,1,0,g"]).encode() + b"\n"
    check_columns = eventlog_files._check_columns

    def swapped(*args: object) -> None:  # once the columns are known: the name now holds a fed FIFO
        check_columns(*args)  # type: ignore[arg-type]
        os.unlink(path)
        stack.enter_context(fed_fifo(path, planted))

    monkeypatch.setattr(eventlog_files, "_check_columns", swapped)
    with contextlib.ExitStack() as stack:
        table = load(path)
    assert 99 not in table.user_id.tolist() and table.n_impressions + len(table.raw) >= 1


def test_the_cli_exits_2_for_a_fifo_as_the_dataset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from streamrec.cli import main

    with fed_fifo(tmp_path / "log.csv", "\n".join([HEADER, *rows(3)]).encode() + b"\n") as fifo:
        rc = main(["replay", "--dataset", str(fifo), "--no-progress", "--bootstrap-servers", "127.0.0.1:9"])
    err = capsys.readouterr().err
    assert rc == 2 and "--dataset" in err and str(fifo) in err and "Traceback" not in err


@pytest.mark.parametrize("delimiter", ["é", "\x00", "\n", '"'])
def test_a_csv_delimiter_arrow_cannot_use_is_an_event_log_error(tmp_path: Path, delimiter: str) -> None:
    """A non-ASCII one (or NUL) was Arrow's bare ValueError: a traceback and exit 1 at the CLI, not a usage error."""
    path = write(tmp_path / "log.csv", [HEADER, *rows(2)])
    with pytest.raises(EventLogError, match="--csv-delimiter must be one printable ASCII character"):
        load_eventlog(path, ColumnMap(time_unit="ms"), FIXED, seed=0, csv_delimiter=delimiter)


# -- 9: Parquet that cannot be read ---------------------------------------------------------------
def test_corrupt_parquet_pages_are_one_error_naming_the_file(tmp_path: Path) -> None:
    n = 100
    ok = tmp_path / "ok.parquet"
    pq.write_table(pa.table({"user_id": list(range(n)), "item_id": list(range(n)),
                             "ts": [(T0_S + k) * 1000 for k in range(n)], "clicked": [k % 2 for k in range(n)],
                             "genre": [f"g{k % 5}" for k in range(n)]}), ok)
    raw = bytearray(ok.read_bytes())
    mid = len(raw) // 3
    for i in range(mid, mid + 200):  # the data pages, footer intact
        raw[i] ^= 0x5A
    bad = tmp_path / "corrupt.parquet"
    bad.write_bytes(bytes(raw))
    for limit in (None, 50):
        with pytest.raises(EventLogError, match="cannot read .*corrupt.parquet") as err:
            load(bad, limit, features=("genre",))
        assert_printable(str(err.value))


def test_duplicate_parquet_column_names_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "dup.parquet"
    table = pa.Table.from_arrays([pa.array([1, 2]), pa.array([3, 4]), pa.array([T0_S * 1000] * 2),
                                  pa.array([9, 9])], names=["user_id", "item_id", "ts", "user_id"])
    pq.write_table(table, path)
    for limit in (None, 1):
        with pytest.raises(EventLogError, match=r"dup.parquet has 2 columns named 'user_id'.*--user-col"):
            load(path, limit, clicked=None)
    # a duplicated column the mapping does not use is harmless
    table = pa.Table.from_arrays([pa.array([1, 2]), pa.array([3, 4]), pa.array([T0_S * 1000] * 2),
                                  pa.array([9, 9]), pa.array([8, 8])], names=["user_id", "item_id", "ts", "x", "x"])
    pq.write_table(table, path)
    assert load(path, clicked=None).n_impressions == 2


# -- 10: CSV row-structure errors -------------------------------------------------------------------
@pytest.mark.parametrize("limit", [None, 10])
def test_a_ragged_csv_row_is_refused_naming_its_line(tmp_path: Path, limit: int | None) -> None:
    lines = [HEADER, *rows(20)]
    lines[6] = "1,2"  # data row 5, line 7 of the file
    path = write(tmp_path / "ragged.csv", lines)
    with pytest.raises(EventLogError, match=r"ragged.csv.* line 7\b.*expected 5 columns, got 2"):
        load(path, limit, features=("genre",))


def test_an_unterminated_quote_is_refused_naming_its_line(tmp_path: Path) -> None:
    lines = [HEADER, *rows(100)]
    lines[51] = 'x,"abc,1,2,g'  # data row 50, line 52: the quote swallows the rest of the file
    path = write(tmp_path / "quote.csv", lines)
    with pytest.raises(EventLogError, match=r"quote.csv.* line 52\b") as err:
        load(path, features=("genre",))
    assert len(str(err.value)) < 600  # the echoed rows are clipped


def test_file_bytes_in_a_csv_error_are_escaped(tmp_path: Path) -> None:
    lines = [HEADER, *rows(3)]
    lines[2] = "\x1b[2J\x1b[31mFAKE: all good\x1b]0;title\x07,2"
    path = write(tmp_path / "ansi.csv", lines)
    with pytest.raises(EventLogError) as err:
        load(path, features=("genre",))
    msg = str(err.value)
    assert_printable(msg)
    assert "\\x1b[2J" in msg and "line 3" in msg


def test_a_long_field_in_an_unmapped_column_is_read(tmp_path: Path) -> None:
    lines = [HEADER + ",blob", *(r + ",b" for r in rows(50))]
    lines[20] = lines[20][:-1] + "y" * (3 << 20)  # 3 MiB: longer than one 1 MiB CSV block
    path = write(tmp_path / "long.csv", lines)
    for limit in (None, 30):
        t = load(path, limit, features=("genre",))
        assert t.n_impressions == (limit or 50) and t.stats["rejected_rows"] == 0


@pytest.mark.parametrize("kind", ["gzip", "parquet", "bz2", "zstd"])
def test_compressed_or_parquet_bytes_named_csv_are_recognised(tmp_path: Path, kind: str) -> None:
    text = ("\n".join([HEADER, *rows(20)]) + "\n").encode()
    path = tmp_path / "log.csv"
    if kind == "gzip":
        path.write_bytes(gzip.compress(text))
    elif kind == "parquet":
        pq.write_table(pa.table({"user_id": [1]}), path)
    elif kind == "bz2":
        import bz2

        path.write_bytes(bz2.compress(text))
    else:
        path.write_bytes(b"\x28\xb5\x2f\xfd" + b"\x00" * 40)
    hint = {"gzip": r"\.csv\.gz", "parquet": r"\.parquet", "bz2": r"\.csv\.bz2", "zstd": r"\.csv\.zst"}[kind]
    with pytest.raises(EventLogError, match=rf"log.csv looks like a .*{hint}") as err:
        load(path, features=("genre",))
    assert_printable(str(err.value))


# -- 11: duplicate CSV header names -----------------------------------------------------------------
def test_a_duplicated_csv_header_name_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path / "dup.csv", [HEADER + ",user_id", *(r + ",OTHER" for r in rows(5))])
    with pytest.raises(EventLogError, match=r"dup.csv has 2 columns named 'user_id' \(columns 1 and 6\b.*--user-col"):
        load(path, features=("genre",))
    path = write(tmp_path / "dupts.csv", [HEADER + ",ts", *(r + ",-1" for r in rows(5))])
    with pytest.raises(EventLogError, match=r"2 columns named 'ts'.*--time-col"):
        load(path, limit=2, features=("genre",))


# -- 12: epoch seconds read as milliseconds ------------------------------------------------------
def test_epoch_seconds_under_the_default_unit_are_refused_with_a_hint(tmp_path: Path) -> None:
    secs = write(tmp_path / "secs.csv", [HEADER, *rows(10, ts_scale=1)])
    with pytest.raises(EventLogError, match=r"secs.csv.*'ts'.*before 1973.*--time-unit s"):
        load(secs, time_unit=None)
    with pytest.raises(EventLogError, match=r"before 1973"):  # the library's default map checks as the CLI does
        load_eventlog(secs, ColumnMap(), FIXED, seed=0)
    # given explicitly, the unit is taken as it is
    assert load(secs, time_unit="ms").ts.tolist()[0] == T0_S
    assert load(secs, time_unit="s").ts.tolist()[0] == T0_S * 1000
    # plausible milliseconds, missing or bad times, Arrow timestamps: no refusal
    ms = write(tmp_path / "ms.csv", [HEADER, *rows(10)])
    assert load(ms, time_unit=None).n_impressions == 10
    bad = write(tmp_path / "bad.csv", [HEADER, "1,2,,0,g", "1,2,abc,0,g"])
    assert load(bad, time_unit=None).stats["rejected_rows"] == 2
    stamps = tmp_path / "stamps.parquet"
    pq.write_table(pa.table({"user_id": [1], "item_id": [2], "ts": pa.array([1000], pa.timestamp("ms"))}), stamps)
    assert load(stamps, time_unit=None, clicked=None).ts.tolist() == [1000]


def test_the_cli_refuses_epoch_seconds_unless_the_unit_is_given(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    from streamrec.cli import main

    secs = write(tmp_path / "secs.csv", [HEADER, *rows(10, ts_scale=1)])
    rc = main(["replay", "--dataset", str(secs), "--no-progress", "--bootstrap-servers", "127.0.0.1:9"])
    err = capsys.readouterr().err
    assert rc == 2 and "--time-unit s" in err and "Traceback" not in err


@pytest.mark.parametrize(("header", "named"), [
    ("extra,item_id,user_id,ts,clicked", "column 'user_id' (the user column)"),
    ("user_id,ts,clicked,item_id", "column 'item_id' (the item column)"),
])
def test_a_conversion_error_names_the_column_by_its_header_and_role_and_the_line(
        tmp_path: Path, header: str, named: str) -> None:
    """Arrow numbers the file's columns ("In CSV column #2"): a user of a 30-column file could not tell which."""
    names = header.split(",")
    good = {"user_id": "1", "item_id": "2", "ts": str(T0_S * 1000), "clicked": "0", "extra": "x"}
    lines = [",".join(good[n] for n in names).encode()] * 3
    bad = dict(good, **{named.split("'")[1]: "\xe9t\xe9"})
    lines.append(",".join(bad[n] for n in names).encode("latin-1"))
    path = tmp_path / "latin1.csv"
    path.write_bytes(header.encode() + b"\n" + b"\n".join(lines) + b"\n")
    with pytest.raises(EventLogError) as e:
        load(path)
    msg = str(e.value)
    assert f"at line 5 (the header is line 1): {named}: " in msg and "non-UTF-8" in msg and "#" not in msg
    assert_printable(msg)


def test_a_cell_that_is_not_utf8_dead_letters_its_row_not_the_whole_file(tmp_path: Path) -> None:
    """A Latin-1 cell in a feature column (or a binary id / impression id column of a Parquet file) refused the
    whole file with "feature column 'genre': holds bytes that are not UTF-8 text", no file, no row."""
    good = [line.encode() for line in rows(6)]
    bad = f"1,2,{(T0_S + 9) * 1000},0,".encode() + "\xe9t\xe9".encode("latin-1")
    path = tmp_path / "latin1.csv"
    path.write_bytes(b"\n".join([HEADER.encode(), *good[:3], bad, *good[3:]]) + b"\n")
    t = load(path, features=("genre",))
    assert t.n_impressions == 6 and t.stats["rejected_rows"] == 1
    (raw,) = t.raw
    assert raw.error.field == "context.genre" and "UTF-8 text" in str(raw.error) and "row 3" in str(raw.error)
    ids = pa.array([b"u1", "\xe9".encode("latin-1"), b"u3"], pa.binary())
    pq.write_table(pa.table({"user_id": ids, "item_id": [1, 2, 3], "ts": [T0_S * 1000] * 3,
                             "rid": pa.array([b"r1", b"r2", b"\xff"], pa.binary())}), tmp_path / "bin.parquet")
    t = load(tmp_path / "bin.parquet", clicked=None, impression_id="rid")
    assert t.n_impressions == 1 and sorted(r.error.field for r in t.raw) == ["impression_id", "user_id"]
    assert all("UTF-8 text" in str(r.error) for r in t.raw)


def _string_column(cells: list[bytes]) -> pa.Array:
    """A Parquet ``string`` column holding ``cells`` as they are, UTF-8 or not (a writer other than Arrow can write
    such a file; Arrow does not check the bytes when it reads it)."""
    offsets = [0]
    for c in cells:
        offsets.append(offsets[-1] + len(c))
    offsets_buffer = pa.array(offsets, pa.int32()).buffers()[1]
    return pa.Array.from_buffers(pa.string(), len(cells), [None, offsets_buffer, pa.py_buffer(b"".join(cells))])


def test_a_parquet_string_cell_that_is_not_utf8_dead_letters_its_row_or_refuses_the_file_never_a_traceback(
        tmp_path: Path) -> None:
    """A Parquet string column is not checked for UTF-8 when read: a Latin-1 user id or feature value was a
    UnicodeDecodeError traceback out of ``streamrec replay``. Now an id or feature cell rejects its row as a CSV
    feature cell does, and such a cell in the time column refuses the file naming the column and the row."""
    bad = [b"u1", "caf\xe9".encode("latin-1"), b"u3"]
    path = tmp_path / "latin1.parquet"
    pq.write_table(pa.table({"user_id": _string_column(bad), "item_id": [1, 2, 3], "ts": [T0_S * 1000] * 3,
                             "genre": _string_column([b"a", b"b", b"\xff"])}), path)
    t = load(path, clicked=None, features=("genre",))
    assert t.n_impressions == 1 and t.user_id.tolist() == ["u1"]
    assert [r.error.field for r in t.raw] == ["user_id", "context.genre"]
    assert all("UTF-8 text" in str(r.error) for r in t.raw)
    ts_path = tmp_path / "ts.parquet"
    pq.write_table(pa.table({"user_id": [1, 2], "item_id": [1, 2], "ts": _string_column([b"1", b"2\xff"])}), ts_path)
    with pytest.raises(EventLogError, match=r"column 'ts' holds bytes that are not UTF-8 text \(row 1 "):
        load(ts_path, clicked=None)


def test_each_read_of_an_event_log_has_its_own_position_whatever_an_earlier_reader_still_reads() -> None:
    # pyarrow's streaming CSV reader reads ahead on a thread that may outlive the reader: through one shared file
    # offset, its late read moved the next read's start, which took a data row for the header ("Column 'user_id' in
    # include_columns does not exist", one run in ~100 of test_a_long_field_in_an_unmapped_column_is_read under load)
    import tempfile

    from stream.replay.eventlog_files import _stream

    with tempfile.TemporaryFile() as tmp:
        tmp.write(b"user_id,item_id\n" + b"1,2\n" * 1000)
        tmp.flush()
        fh = io.FileIO(tmp.fileno(), closefd=False)
        with _stream(fh, None) as first:
            first.read(100)
        with _stream(fh, None) as second:
            first.read(4096)  # the earlier reader's late read-ahead
            assert second.read(16) == b"user_id,item_id\n"


def test_a_parquet_list_feature_entry_that_is_not_utf8_refuses_the_file_as_a_binary_list_does(tmp_path: Path) -> None:
    """A ``list<string>`` feature column is not checked for UTF-8 when read either: a Latin-1 tag was a
    UnicodeDecodeError traceback out of the rows' ``to_pylist``; it is refused as a list of binary entries is."""
    tags = pa.ListArray.from_arrays(pa.array([0, 1, 2, 3], pa.int32()), _string_column([b"a", b"\xff", b"c"]))
    path = tmp_path / "tags.parquet"
    pq.write_table(pa.table({"user_id": ["u1", "u2", "u3"], "item_id": [1, 2, 3], "ts": [T0_S * 1000] * 3,
                             "tags": tags}), path)
    with pytest.raises(EventLogError, match=r"feature column 'tags': list values are not UTF-8 text"):
        load(path, clicked=None, features=("tags",))


@pytest.mark.parametrize("limit", [None, 20_000])
@pytest.mark.parametrize("mapped", [True, False])
def test_quoted_line_breaks_are_read_in_a_file_of_many_csv_blocks(tmp_path: Path, limit: int | None,
                                                                  mapped: bool) -> None:
    """RFC 4180 quotes a value holding a line break (pandas and Excel write multi-line text so): Arrow's blocks
    split at line ends and got out of sync with such a file past its first 1 MiB block, and the file was refused
    with advice to set an Arrow option no flag sets, while the same rows in a small file were read."""
    lines = [HEADER + ",note", *(f'{r},"first line\nsecond, line {k}"' for k, r in enumerate(rows(30_000)))]
    path = write(tmp_path / "multiline.csv", lines)
    assert path.stat().st_size > 1 << 20  # more than one block
    table = load(path, limit, features=("genre", "note") if mapped else ("genre",))
    assert table.n_impressions == (limit or 30_000) and not table.raw
    if mapped:
        assert table.context[0].dicts[-1]["note"] == f"first line\nsecond, line {table.n_impressions - 1}"


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
@pytest.mark.parametrize("name", ["shifted.csv", "shifted.csv.gz"])
def test_a_ragged_row_after_blank_lines_and_quoted_line_breaks_is_named_by_its_line_in_the_file(
        tmp_path: Path, newline: str, name: str) -> None:
    """Arrow numbers records, skipping empty lines and counting a quoted multi-line value once: its number was
    reported as the line, which pointed an editor two lines above the bad row here."""
    lines = [HEADER + ",note", *(f"{r},x" for r in rows(4))]
    lines[2] = lines[2][:-1] + '"two\nlines"'  # record 3 spans lines 3-4
    lines[4:4] = [""]  # an empty line: line 6
    lines.append("1,2")  # record 6, line 8 of the file
    content = ("\n".join(lines) + "\n").replace("\n", newline).encode()
    path = tmp_path / name
    path.write_bytes(gzip.compress(content) if name.endswith(".gz") else content)
    with pytest.raises(EventLogError, match=r"at line 8 \(the header is line 1\): expected 6 columns, got 2"):
        load(path, features=("genre", "note"))


@pytest.mark.parametrize("limit", [None, 50_000])
def test_an_unclosed_quote_in_a_file_of_many_csv_blocks_is_refused_not_read_short(
        tmp_path: Path, limit: int | None) -> None:
    """Split at every line end and parsed in parallel, the blocks after an unclosed quote lost the rows it swallowed
    and the file loaded, 64,406 of 100,000 rows, without a word."""
    lines = [HEADER, *rows(100_000)]
    lines[100] = 'x,"abc,1,2,g'  # data row 99, line 101
    path = write(tmp_path / "quote.csv", lines)
    assert path.stat().st_size > 2 << 20  # more than one block
    with pytest.raises(EventLogError, match=r"quote.csv.* line 101\b.*unclosed quote"):
        load(path, limit, features=("genre",))


def test_a_header_with_no_line_end_is_refused_as_such_not_as_an_empty_file(tmp_path: Path) -> None:
    """Arrow cannot count the columns of a header with no line break after it and calls the file empty: the error
    said 'it is empty' of a file holding a header row."""
    log = tmp_path / "log.csv"
    log.write_text("user_id,item_id,ts,clicked")
    with pytest.raises(EventLogError, match=r"log\.csv as CSV: .*its one line has no line end") as e:
        load_eventlog(log, ColumnMap(), ClickDelay(), seed=0)
    assert "it is empty (" not in str(e.value)


@pytest.mark.parametrize("limit", [None, 5])
def test_a_compressed_log_cut_short_is_refused_naming_the_file_and_the_fix(tmp_path: Path, limit: int | None) -> None:
    """A .csv.gz cut short (an interrupted copy) was Arrow's bare 'Truncated compressed stream', no fix said."""
    rows = b"".join(b"%d,2,1600000000000,0\n" % i for i in range(2000))
    whole = gzip.compress(b"user_id,item_id,ts,clicked\n" + rows)
    log = tmp_path / "log.csv.gz"
    log.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(EventLogError, match=r"log\.csv\.gz as CSV: the compressed file is cut short .*copy it again"):
        load_eventlog(log, ColumnMap(), ClickDelay(), seed=0, limit=limit)


@pytest.mark.parametrize(("end", "warned"), [("", True), ("\n", False), ("\r\n", False)])
def test_a_csv_whose_last_line_has_no_line_end_is_read_with_a_warning_that_its_last_row_may_be_cut(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, end: str, warned: bool) -> None:
    """A log cut mid-line in its last column (here the time: 1700000001000 cut to 17000) parsed as a row with the
    value cut, and nothing said; a line end missing at the end is said now (the row is still read)."""
    log = tmp_path / "log.csv"
    log.write_text("user_id,item_id,clicked,ts\n1,2,0,1700000000000\n3,4,0,17000" + end, newline="")
    with caplog.at_level("WARNING", logger="streamrec.replay"):
        table = load_eventlog(log, ColumnMap(time_unit="ms"), ClickDelay(), seed=0)
    assert table.n_impressions + len(table.raw) == 2
    assert any("its last line has no line end" in r.getMessage() for r in caplog.records) is warned

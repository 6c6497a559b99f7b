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
    An uncompressed CSV whose last line has no line end is read, with a WARNING that its last row may be cut (a file
    cut mid-line in its last column parses as a row with that value cut short).
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

import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa

from stream.errors import ValidationError
from stream.events import MAX_TS_MS
from stream.limits import DEFAULT_LIMITS, EventLimits
from stream.replay.column_map import FLAGS, TIME_UNITS, ColumnMap, EventLogError
from stream.replay.config import ClickDelay
from stream.replay.eventlog_cells import (
    TIME_MISSING,
    TIME_OK,
    Check,
    check_default_unit,
    check_event_keys,
    flag_implausible,
    json_default,
    json_rows,
    null_mask,
    object_array,
    oversized,
    parse_clicked,
    parse_dense,
    parse_ids,
    parse_impression_ids,
    parse_times,
    prepare_feature,
    time_checks,
)
from stream.replay.eventlog_files import (
    COMPRESSED_EXT,
    detect_format,
    open_log,
    plain_array,
    read_csv,
    read_parquet,
    utf8_checked,
)
from stream.replay.table import IMPRESSION, ContextPart, EventTable, RawMessage, draw_click_delays_ms


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
    check_event_keys(cols, limits)
    fmt, stem = detect_format(path)
    wanted = list(dict.fromkeys(col for _, col in cols.roles()))
    with open_log(path) as fh:
        if fmt == "parquet":
            table = utf8_checked(path, read_parquet(path, fh, cols, wanted, limit), cols)
        else:
            ext = path.name.lower()
            ext = ext[: len(ext) - len(next((e for e in COMPRESSED_EXT if ext.endswith(e)), ""))]
            table = read_csv(path, fh, Path(ext).suffix, cols, wanted, limit, csv_delimiter)
    return _build(table, cols, delay, seed, path, fmt, stem[:200], csv=fmt == "csv", limits=limits)


def _build(table: pa.Table, cols: ColumnMap, delay: ClickDelay, seed: int, path: Path, fmt: str,
           stem: str, csv: bool, limits: EventLimits) -> EventTable:
    n = table.num_rows
    col = {name: plain_array(table.column(name)) for name in table.column_names}
    checks: list[Check] = []

    imp_ids, keys, c = parse_impression_ids(col.get(cols.impression_id or ""), cols.impression_id, stem, n, csv,
                                       limits.max_str_len)
    checks += c
    unit = cols.time_unit or "ms"
    ts, ts_status, ts_number = parse_times(col[cols.time], unit, cols.time, FLAGS["time"])
    if cols.time_unit is None:
        check_default_unit(col[cols.time].type, ts[ts_status == TIME_OK], cols.time, path)
        flag_implausible(ts_status, ts, ts_number)
    checks += time_checks(ts_status, ts_number, "ts", cols.time, unit)
    # The producer stamps messages with the wall clock: a row further ahead than the joiner would accept
    # is dead-lettered here already (same bound, same kind).
    latest_ms = int(time.time() * 1000) + limits.future_ts_ms  # the last time the joiner takes from a message sent now
    ahead = (ts_status == TIME_OK) & (ts > latest_ms)
    checks.append(Check(ahead, "ts", cols.time, f"an event time at most {limits.future_ts_s:g} s ahead of "
                         "the wall clock at import (is --time-unit right? [limits] future_ts_s)", kind="future_ts"))
    users, c = parse_ids(col[cols.user], "user_id", cols.user, csv, limits.max_str_len)
    checks += c
    items, c = parse_ids(col[cols.item], "item_id", cols.item, csv, limits.max_str_len)
    checks += c

    features = list(dict.fromkeys(cols.features))
    prepared: dict[str, pa.Array] = {}
    list_nulls: list[str] = []
    for name in features:
        arr, c, has_nulls = prepare_feature(col[name], name, csv, limits)
        prepared[name] = arr
        checks += c
        if has_nulls:
            list_nulls.append(name)
    dense: dict[str, np.ndarray] = {}
    for name in dict.fromkeys(cols.dense):
        dense[name], c = parse_dense(col[name], name)
        checks += c

    # clicks
    if cols.clicked is not None:
        clicked, unparseable = parse_clicked(col[cols.clicked], cols.clicked)
        checks.append(Check(unparseable, "clicked", cols.clicked,
                             "a boolean, a number (non-zero = clicked) or one of true/false/yes/no"))
    else:
        clicked = np.zeros(n, bool)
    click_ts = np.zeros(n, np.int64)
    from_column = np.zeros(n, bool)
    if cols.click_time is not None:
        ct, ct_status, ct_number = parse_times(col[cols.click_time], unit, cols.click_time, FLAGS["click_time"],
                                          words_missing=True)
        if cols.time_unit is None:
            flag_implausible(ct_status, ct, ct_number)
        if cols.clicked is None:
            clicked = ct_status != TIME_MISSING
        from_column = clicked & (ct_status != TIME_MISSING)
        ct_checks = time_checks(ct_status, ct_number, "click_ts", cols.click_time, unit)[1:]
        for check in ct_checks:
            check.mask = check.mask & clicked
        checks += ct_checks
        before = from_column & (ct_status == TIME_OK) & (ts_status == TIME_OK) & (ct < ts)
        checks.append(Check(before, "click_ts", cols.click_time,
                             "a click time at or after the impression's time"))
        # the clicks decoder bounds a click's ts by its broker time as it does an impression's (a click a year ahead
        # went out and the joiner dead-lettered it, its row's impression published as unclicked)
        checks.append(Check(from_column & (ct_status == TIME_OK) & (ct > latest_ms), "click_ts", cols.click_time,
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
                for i in np.flatnonzero(null_mask(plain_array(column))).tolist():
                    del dicts[i][name]
        for name in list_nulls:
            for d in dicts:
                v = d.get(name)
                if v is not None and None in v:
                    d[name] = [x for x in v if x is not None]
    # the limit on the event as a whole, checked last: only an event whose every field is valid has a size
    good_idx = np.flatnonzero(good)
    over, size = oversized(object_array(imp_ids)[good], users[good], items[good], ts[good], dicts,
                            {name: v[good] for name, v in dense.items()}, limits)
    if over.any():
        limit = limits.max_message_bytes
        sizes = np.zeros(n, np.int64)
        sizes[good_idx[over]] = size[over]
        checks.append(Check(sizes > 0, "message", "", f"an impression event of at most {limit} bytes as JSON "
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
        rows = json_rows(table.take(pa.array(bad_idx)), csv)
        for i, row in zip(bad_idx.tolist(), rows, strict=True):
            check = checks[first[i]]
            by_field[check.field] += 1
            value = row.get(check.column) if check.values is None else check.values[i].item()
            where = f"column {check.column!r}, " if check.column else ""
            error = ValidationError(check.field, value, f"{check.expected} ({where}row {i} counting from 0)")
            error.kind = check.kind
            raw.append(RawMessage(
                topic_kind=IMPRESSION,
                ts=int(ts[i]) if ts_status[i] == TIME_OK and not ahead[i] else 0,  # ahead: no usable time either
                key=keys[i].encode(),
                value=orjson.dumps(row, default=json_default),
                error=error,
            ))

    # accepted rows
    impression_id = object_array([imp_ids[i] for i in good_idx.tolist()])
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
        click_impression_id=object_array([imp_ids[i] for i in np.flatnonzero(clicks).tolist()]),
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

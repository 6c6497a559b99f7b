"""Judging an event log's cells for :func:`stream.replay.eventlog.load_eventlog`: ids, times, clicks, context and
dense values parsed from Arrow columns, each cell on its own, into numpy columns and the checks that reject a row
(``eventlog.py``'s docstring says the rules)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from stream.errors import shown
from stream.events import DENSE_RULE, MAX_ID, MAX_TS_MS, SCHEMA_VERSION
from stream.limits import DENSE_BOUND, EventLimits
from stream.replay.column_map import FLAGS, ColumnMap, EventLogError
from stream.replay.eventlog_files import is_binary, is_list, is_text, is_utf8, plain_array
from stream.samples import DENSE_PREFIX

_MS_PER = {"s": 1000, "ms": 1, "us": 1e-3, "ns": 1e-6}
_DIV = {"ms": 1, "us": 1000, "ns": 1_000_000}  # integer input -> ms by floor division

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
TIME_OK, TIME_MISSING, TIME_UNPARSEABLE, TIME_OUT_OF_RANGE, TIME_IMPLAUSIBLE = 0, 1, 2, 3, 4

def _np_bool(arr: pa.Array, null: bool = False) -> np.ndarray:
    return np.asarray(pc.fill_null(arr, null).to_numpy(zero_copy_only=False), dtype=bool)


def null_mask(arr: pa.Array) -> np.ndarray:
    return np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool)


def _matches(arr: pa.Array, pattern: str) -> np.ndarray:
    return _np_bool(pc.match_substring_regex(arr, pattern))


def _missing_words(arr: pa.Array) -> np.ndarray:
    """(N,) bool: the text cells that are missing in a clicked or click-time column (null, or one of _MISSING_WORDS).
    Only the cells that are not all digits are trimmed and lowered (a column of 0/1 has few of them)."""
    out, odd = null_mask(arr), np.flatnonzero(~_np_bool(pc.ascii_is_decimal(arr)))
    out[odd] |= _np_bool(pc.is_in(pc.utf8_lower(pc.utf8_trim_whitespace(arr.take(odd))), pa.array(_MISSING_WORDS)))
    return out


def _to_text(arr: pa.Array, field: str, column: str) -> tuple[pa.Array, list[Check]]:
    """A binary (or integer) column as text, and the check of its cells that are not UTF-8, if any (read as missing,
    so the other checks pass them; each such row is dead-lettered with this reason, not the whole file refused)."""
    try:
        return arr.cast(pa.string()), []
    except pa.ArrowInvalid:
        pass

    ok = np.fromiter((v is None or is_utf8(v) for v in arr.to_pylist()), bool, len(arr))  # (N,) on failure only
    text = pc.if_else(pa.array(ok), arr, pa.scalar(None, arr.type)).cast(pa.string())
    return text, [Check(~ok, field, column, "UTF-8 text (a Latin-1 or other non-UTF-8 file? convert it to UTF-8)")]


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
    missing = null_mask(s) | _np_bool(pc.equal(s, ""))
    is_int = _matches(s, _INT_RE)
    is_float = _matches(s, _FLOAT_RE) & ~is_int
    # Arrow casts '+5' to a float but not to an int64: an int's one leading '+' goes (Arrow's CSV inference took it)
    ints = pc.cast(pc.if_else(pa.array(is_int), pc.utf8_ltrim(s, "+"), "0"), pa.int64()).to_numpy(zero_copy_only=False)
    flts = pc.cast(pc.if_else(pa.array(is_float), s, "0"), pa.float64()).to_numpy(zero_copy_only=False)
    return missing, is_int, np.asarray(ints, np.int64), is_float, np.asarray(flts, np.float64)


# -- ids ----------------------------------------------------------------------------------------
@dataclass
class Check:
    """Rows failing one rule: ``mask`` (N,) bool; reported as ValidationError(field, cell, expected)."""

    mask: np.ndarray
    field: str
    column: str
    expected: str
    kind: str = "invalid_field"  # the DLQ kind
    values: np.ndarray | None = None  # (N,) the value to report per row; None: the row's cell of ``column``


def object_array(values: list[Any]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def parse_ids(arr: pa.Array, field: str, column: str, csv: bool, max_len: int) -> tuple[np.ndarray, list[Check]]:
    """An id column -> ``(object array of int/str, checks)``; integer columns stay Python ints. ``max_len``:
    ``[limits] max_str_len``."""
    t = arr.type
    n = len(arr)
    id_expected = f"a non-negative 64-bit integer or a non-empty string (<= {max_len} chars)"
    if pa.types.is_null(t):
        return object_array([None] * n), [Check(np.ones(n, bool), field, column, id_expected)]
    utf8: list[Check] = []  # cells that are not UTF-8 text, when the column holds bytes
    if is_binary(t):
        arr, utf8 = _to_text(arr, field, column)
        t = pa.string()
    if is_text(t):  # in a CSV a null token is the missing id a Parquet null is
        missing = _missing_words(arr) if csv else null_mask(arr) | _np_bool(pc.equal(arr, ""))
        too_long = _np_bool(pc.greater(pc.utf8_length(arr), max_len))
        checks = [*utf8, Check(missing, field, column, id_expected),
                  Check(too_long, field, column, f"a string id of at most {max_len} chars ([limits] max_str_len)")]
        if csv:
            negative = _matches(arr, _NEG_INT_RE)
            checks.append(Check(negative, field, column, f"an integer id in [0, {MAX_ID}]"))
            ok = ~(missing | too_long | negative)
            if ok.any() and _matches(arr, _CANONICAL_UINT_RE)[ok].all():
                try:
                    ints = pc.cast(pc.if_else(pa.array(ok), arr, "0"), pa.int64())
                    return object_array(ints.to_pylist()), checks
                except pa.ArrowInvalid:  # past 2**63-1: keep the text
                    pass
        return object_array(arr.to_pylist()), checks
    if pa.types.is_integer(t):
        v, big = _ints(arr)
        missing = null_mask(arr)
        return object_array(v.tolist()), [
            Check(missing, field, column, id_expected),
            Check((v < 0) | big, field, column, f"an integer id in [0, {MAX_ID}]"),
        ]
    if pa.types.is_floating(t):  # e.g. pandas int columns with gaps; whole numbers only
        v = _floats(arr)
        missing = np.isnan(v)
        whole = np.isfinite(v) & (v >= 0) & (v < 2.0**63) & (np.floor(v) == v)
        ints = np.where(whole, v, 0).astype(np.int64)
        return object_array(ints.tolist()), [
            Check(missing, field, column, id_expected),
            Check(~whole & ~missing, field, column, f"an integer id in [0, {MAX_ID}]"),
        ]
    raise EventLogError(f"{field} column {column!r} has type {t}; ids must be integers or strings "
                        f"(set the column with {FLAGS['user' if field == 'user_id' else 'item']})")


def parse_impression_ids(arr: pa.Array | None, column: str | None, stem: str, n: int, csv: bool, max_len: int
                    ) -> tuple[list[str], list[str], list[Check]]:
    """``(impression ids, ids for rejected rows' keys, checks)``; in a CSV a null token is missing (:func:`parse_ids`).
    ``max_len``: ``[limits] max_str_len``."""
    generated = [f"{stem}-{i:09d}" for i in range(n)]
    if arr is None or column is None:
        # the longest is the last: over max_len, every row's event is one the joiner dead-letters (a mapping mistake)
        if n and len(generated[-1]) > max_len:
            raise EventLogError(f"the impression ids generated from the file name ({shown(generated[-1], 200)}) are "
                                f"{len(generated[-1])} chars, over the {max_len} an id may have ([limits] "
                                f"max_str_len): map an impression id column with {FLAGS['impression_id']}, give the "
                                "file a shorter name, or raise max_str_len")
        return generated, generated, []
    t = arr.type
    utf8: list[Check] = []
    if pa.types.is_null(t):
        arr = pa.nulls(n, pa.string())
    elif pa.types.is_integer(t) or is_binary(t):
        arr, utf8 = _to_text(arr, "impression_id", column)
    elif not is_text(t):
        raise EventLogError(f"impression id column {column!r} has type {t}; it must hold strings or integers "
                            f"(set with {FLAGS['impression_id']})")
    missing = _missing_words(arr) if csv else null_mask(arr) | _np_bool(pc.equal(arr, ""))
    too_long = _np_bool(pc.greater(pc.utf8_length(arr), max_len))
    ids = arr.to_pylist()
    bad = missing | too_long  # (cells that are not UTF-8 are missing now: their rows get generated keys too)
    keys = [g if b else v for v, g, b in zip(ids, generated, bad.tolist(), strict=True)]
    expected = f"a non-empty string of at most {max_len} chars ([limits] max_str_len)"
    return ids, keys, [*utf8, Check(missing, "impression_id", column, expected),
                       Check(too_long, "impression_id", column, expected)]


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


def parse_times(arr: pa.Array, unit: str, column: str, flag: str,
           words_missing: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A time column -> ``(int64 ms (N,), status (N,) int8, number (N,) float64)``, status one of
    TIME_OK/TIME_MISSING/...;
    ``number`` is each cell's number as written (in ``unit``), NaN where the cell is no number (text that does not
    parse, ISO text, Arrow timestamps and dates, which carry their own unit). ``words_missing`` (the click-time
    column): a text cell of _MISSING_WORDS is missing, not unparseable; else only an empty cell is."""
    t = arr.type
    n = len(arr)
    status = np.zeros(n, dtype=np.int8)
    number = np.full(n, np.nan)
    if pa.types.is_null(t):
        return np.zeros(n, np.int64), np.full(n, TIME_MISSING, np.int8), number
    missing = null_mask(arr)
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
            status[~np.isfinite(f)] = TIME_UNPARSEABLE
            number = f
    elif is_text(t):
        trimmed = pc.utf8_trim_whitespace(arr)
        missing = missing | (_missing_words(arr) if words_missing else _np_bool(pc.equal(trimmed, "")))
        if unit == "iso":
            if not missing.all() and _matches(trimmed, _FLOAT_RE)[~missing].all():
                raise EventLogError(f"time column {column!r} holds numbers, not ISO-8601 strings: set "
                                    f"{FLAGS['time_unit']} to s, ms, us or ns")
            ms, parsed = _iso_column(arr, missing)
            ok = parsed & (ms >= 0) & (ms <= MAX_TS_MS)
            status[~parsed] = TIME_UNPARSEABLE
        elif (digits := _digit_ints(arr, missing)) is not None:  # the common case, in one cast
            ms, ok = _int_to_ms(digits, unit)
            number = np.where(missing, np.nan, digits.astype(np.float64))
        elif _iso_text(arr, missing):  # ISO-8601 text whatever the unit, as Arrow's CSV inference read it
            ms, parsed = _iso_column(arr, missing)
            ok = parsed & (ms >= 0) & (ms <= MAX_TS_MS)
            status[~parsed] = TIME_UNPARSEABLE
        else:
            _, is_int, ints, is_float, flts = _parse_numbers(arr)
            ms_i, ok_i = _int_to_ms(ints, unit)
            ms_f, ok_f = _float_to_ms(flts, unit)
            ms = np.where(is_int, ms_i, ms_f)
            ok = np.where(is_int, ok_i, ok_f)
            status[~(is_int | is_float)] = TIME_UNPARSEABLE
            ok &= is_int | is_float
            number = np.where(is_int, ints.astype(np.float64), np.where(is_float, flts, np.nan))
    else:
        raise EventLogError(f"time column {column!r} has type {t}; expected numbers (unit s/ms/us/ns), "
                            f"ISO-8601 strings or timestamps (set with {flag} and {FLAGS['time_unit']})")
    status[(status == TIME_OK) & ~ok] = TIME_OUT_OF_RANGE
    status[missing] = TIME_MISSING
    return np.where(status == TIME_OK, ms, 0).astype(np.int64), status, number


_PLAUSIBLE_MS = 100_000_000_000  # 1973-03-03T09:46:40Z; epoch seconds up to 5138 are below it
_UNIT_NAMES = {"s": "seconds", "ms": "milliseconds", "us": "microseconds", "ns": "nanoseconds"}


def flag_implausible(status: np.ndarray, ms: np.ndarray, number: np.ndarray) -> None:
    """Under the default unit (ms, not given), a numeric time before 1973 is no event time: most likely epoch seconds
    (which would replay as January 1970). Each such row is marked ``TIME_IMPLAUSIBLE`` (dead-lettered, its reason naming
    the unit it looks like): the rule of :func:`check_default_unit`, which refuses a file whose every time breaks it,
    applied row by row, so a file mixing seconds and milliseconds publishes none of its seconds as 1970."""
    status[(status == TIME_OK) & (ms < _PLAUSIBLE_MS) & ~np.isnan(number)] = TIME_IMPLAUSIBLE


def _looks_like(number: np.ndarray) -> np.ndarray:
    """(N,) the unit (a key of ``_UNIT_NAMES``) in which each number is a time in [1973-03-03, 2100-01-01), or ''."""
    out = np.full(len(number), "", dtype=object)
    with np.errstate(invalid="ignore"):
        for u, per in _MS_PER.items():
            out[(number * per >= _PLAUSIBLE_MS) & (number * per <= MAX_TS_MS)] = u
    return out


def time_checks(status: np.ndarray, number: np.ndarray, field: str, column: str, unit: str) -> list[Check]:
    flag = FLAGS["time_unit"]
    if unit == "iso":
        what = "an ISO-8601 time such as 2000-12-31T22:12:40Z"
    else:
        what = f"a number of {unit} since the epoch ({flag} {unit})"
    top = {"s": MAX_TS_MS // 1000, "ms": MAX_TS_MS, "us": MAX_TS_MS * 1000, "ns": MAX_TS_MS * 10**6}.get(unit)
    span = "between 1970-01-01 and 2100-01-01" + ("" if unit == "iso" else f", i.e. [0, {top}] {unit}")
    checks = [
        Check(status == TIME_MISSING, field, column, f"{what} (the value is missing)"),
        Check(status == TIME_UNPARSEABLE, field, column, what),
    ]
    like = _looks_like(number)
    for guess in ("", *_UNIT_NAMES):  # a reason per unit the rows look like
        this = like == guess
        hint = (f"; it looks like epoch {_UNIT_NAMES[guess]}: {flag} {guess}?" if guess and guess != unit
                else f"; a wrong {flag}?")
        checks.append(Check((status == TIME_OUT_OF_RANGE) & this, field, column, f"a time {span}{hint}"))
        early = (f"it looks like epoch {_UNIT_NAMES[guess]}: pass {flag} {guess} for a file in {_UNIT_NAMES[guess]}"
                 if guess and guess != unit else f"pass {flag} ms to take times before 1973 as they are")
        checks.append(Check((status == TIME_IMPLAUSIBLE) & this, field, column,
                             f"a time from 1973-03-03 on: before 1973 read as milliseconds (the default {flag} ms); "
                             f"{early}, or fix the row"))
    return checks


def check_default_unit(t: pa.DataType, ms: np.ndarray, column: str, path: Path) -> None:
    """Without an explicit ``time_unit``, numbers that are all before 1973 as milliseconds are refused: most
    likely epoch seconds, which would replay as January 1970. ``ms``: the valid times read."""
    if pa.types.is_timestamp(t) or pa.types.is_date(t) or not len(ms) or ms.max() >= _PLAUSIBLE_MS:
        return
    last = datetime.fromtimestamp(int(ms.max()) / 1000, timezone.utc).isoformat(timespec="seconds")
    raise EventLogError(f"{path}: every time in column {shown(column, 80)} is before 1973 when read as "
                        f"milliseconds (the default {FLAGS['time_unit']} ms; the latest is {int(ms.max())}, {last}): "
                        f"epoch seconds? pass {FLAGS['time_unit']} s, or {FLAGS['time_unit']} ms to keep them as they "
                        "are")


# -- clicked, context, dense ---------------------------------------------------------------------
def parse_clicked(arr: pa.Array, column: str) -> tuple[np.ndarray, np.ndarray]:
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
    if is_text(t):
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


def prepare_feature(arr: pa.Array, column: str, csv: bool, limits: EventLimits
                     ) -> tuple[pa.Array, list[Check], bool]:
    """A context column -> ``(array for to_pylist, checks, lists may hold nulls)``, strings and lists checked against
    ``limits`` (``max_str_len``, ``max_list_len``) as the joiner's decoder checks them."""
    field = f"context.{column}"
    t = arr.type
    n = len(arr)
    none = np.zeros(n, bool)
    if pa.types.is_temporal(t) or pa.types.is_decimal(t):
        arr, t = arr.cast(pa.string()), pa.string()
    utf8: list[Check] = []  # cells that are not UTF-8 text, when the column holds bytes
    if is_binary(t):
        arr, utf8 = _to_text(arr, field, column)
        t = pa.string()
    if pa.types.is_null(t) or pa.types.is_boolean(t) or pa.types.is_integer(t):
        big = _ints(arr)[1] if pa.types.is_integer(t) else none
        return arr, [Check(big, field, column, "an integer in the signed 64-bit range")], False
    if is_text(t):
        long = _np_bool(pc.greater(pc.utf8_length(arr), limits.max_str_len))
        if csv:  # each cell alone: missing, an integer, a float, a boolean or its text
            arr, text, huge = _feature_cells(arr)
            long &= text
            utf8.append(Check(huge, field, column, "a finite number"))
        return arr, [*utf8, Check(long, field, column, f"a string of at most {limits.max_str_len} chars "
                                                        "([limits] max_str_len)")], False
    if pa.types.is_floating(t):  # NaN is missing, as the CSV cell `nan` is (a null token); inf is rejected
        arr = pc.if_else(pc.is_nan(arr), pa.scalar(None, arr.type), arr)
        f = pc.fill_null(arr.cast(pa.float64()), 0.0).to_numpy(zero_copy_only=False)
        return arr, [Check(~np.isfinite(f), field, column, "a finite number")], False
    if is_list(t):
        vt = t.value_type
        if pa.types.is_dictionary(vt):
            vt = vt.value_type
        if pa.types.is_null(vt) or is_text(vt) or is_binary(vt):
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
        checks = [Check(too_many, field, column, f"a list of at most {limits.max_list_len} strings/integers "
                         "([limits] max_list_len)"),
                  Check(bad_entry, field, column, f"list entries of at most {limits.max_str_len} chars "
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


def parse_dense(arr: pa.Array, column: str) -> tuple[np.ndarray, list[Check]]:
    field = f"{DENSE_PREFIX}{column}"
    t = arr.type
    missing = null_mask(arr)
    if pa.types.is_null(t):
        v = np.full(len(arr), np.nan)
    elif any(is_(t) for is_ in (pa.types.is_integer, pa.types.is_floating, pa.types.is_boolean,
                                pa.types.is_decimal)):
        v = _floats(arr)
    elif is_text(t) and (cast := _cast_floats(arr)) is not None:  # the common case, in one cast
        v = cast
    elif is_text(t):
        missing, is_int, ints, is_float, flts = _parse_numbers(arr)
        v = np.where(is_int, ints.astype(np.float64), np.where(is_float, flts, np.nan))
        word = pc.utf8_lower(pc.utf8_trim_whitespace(arr))  # booleans as CSV writes them (Arrow's inference took them)
        v = np.where(_np_bool(pc.equal(word, "true")), 1.0, np.where(_np_bool(pc.equal(word, "false")), 0.0, v))
    else:
        raise EventLogError(f"dense column {column!r} has type {t}; dense features must be numbers "
                            f"(set with {FLAGS['dense']})")
    over = ~np.isfinite(v) | (np.abs(np.nan_to_num(v)) >= DENSE_BOUND)
    return v, [Check(missing, field, column, "a finite number (the value is missing)"),
               Check(over & ~missing, field, column, DENSE_RULE)]


# -- rejected rows --------------------------------------------------------------------------------
def json_default(obj: Any) -> Any:
    if isinstance(obj, Decimal):
        return str(obj)
    if isinstance(obj, bytes | bytearray):
        return obj.decode("utf-8", "replace")
    return str(obj)


def json_rows(table: pa.Table, csv: bool) -> list[dict[str, Any]]:
    """Rows as dicts for JSON: temporal values and non-finite floats as text (nanoseconds do not fit ``datetime``),
    and in CSV files an empty cell as ``None``."""
    for i, f in enumerate(table.schema):
        col = table.column(i)
        if pa.types.is_dictionary(f.type):
            col = col.cast(f.type.value_type)
        if pa.types.is_temporal(col.type):
            col = col.cast(pa.string())
        if csv and is_binary(col.type):  # feature columns are read as bytes: text unless a cell is not UTF-8
            with contextlib.suppress(pa.ArrowInvalid):
                col = col.cast(pa.string())
        if csv and (is_text(col.type) or is_binary(col.type)):
            col = pc.if_else(pc.equal(pc.binary_length(col), 0), pa.scalar(None, col.type), col)
        table = table.set_column(i, f.name, col)
    rows = table.to_pylist()
    for f in table.schema:  # JSON has no NaN or inf (orjson writes null, a missing value): text, as a CSV cell has
        if pa.types.is_floating(f.type):
            col = plain_array(table.column(f.name))
            for i in np.flatnonzero(~np.isfinite(_floats(col)) & ~null_mask(col)).tolist():
                rows[i][f.name] = repr(float(rows[i][f.name]))  # 'nan', 'inf', '-inf'
    return rows


# -- limits on the event as a whole ----------------------------------------------------------------
def check_event_keys(cols: ColumnMap, limits: EventLimits) -> None:
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
                raise EventLogError(f"{FLAGS[role]}: column name {shown(name, 80)} is {len(name)} chars; an event's "
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


def oversized(imp_ids: np.ndarray, users: np.ndarray, items: np.ndarray, ts: np.ndarray,
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

"""The JSON bytes of an :class:`EventTable`'s impressions and clicks, built column-wise.

:class:`EventEncoder` writes, for any set of rows, exactly the bytes ``orjson.dumps`` writes for the event
dicts of ``stream/events.py`` (:meth:`~stream.events.Impression.encode`, :meth:`~stream.events.Click.encode`):
the fields in schema order, the context of every :class:`~stream.replay.table.ContextPart` merged in part
order, ``context`` left out when it is empty, ``dense`` there when the table has dense columns. It does so
without a Python dict or an ``orjson.dumps`` per event: every field becomes a column of JSON text once
(numbers formatted by Arrow, strings quoted once, each context dict encoded once as a fragment), and a
batch of events is one element-wise concatenation of those columns (``pyarrow.compute``).

Values orjson would write in another form than Arrow (strings that need escaping, ids that are neither all
strings nor all 64-bit integers, floats) are encoded by orjson itself, once per value, so the bytes stay
orjson's. Context parts whose key sets overlap (a later part overriding an earlier part's key) are merged
per event as dicts, as the table defines, since concatenated fragments would repeat the key.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from stream.events import SCHEMA_VERSION
from stream.replay.table import EventTable

# Characters orjson escapes in a string: the quote, the backslash and the C0 controls. Every other
# character (non-ASCII included) it writes as its UTF-8 bytes, as Arrow holds them.
_NEEDS_ESCAPE = r'["\\\x00-\x1f]'
_NOT_ARROW = (pa.ArrowException, OverflowError, TypeError, ValueError, UnicodeError)


def _any_escaped(arr: pa.Array) -> bool:
    """Whether any string of ``arr`` holds a character orjson escapes (a scan of the bytes: no other
    character's UTF-8 encoding holds those bytes)."""
    data = np.frombuffer(arr.buffers()[2], np.uint8)  # may hold bytes of no element: only ever a false alarm
    return bool(len(data)) and bool(data.min() < 0x20 or (data == ord('"')).any() or (data == ord("\\")).any())


def _key(name: str) -> str:
    """``"name":`` as orjson writes a key."""
    return orjson.dumps(name).decode() + ":"


def _orjson_texts(values: list[Any]) -> pa.Array:
    """(N,) string: each value as ``orjson.dumps`` writes it alone."""
    dumps = orjson.dumps
    return pa.array([dumps(v).decode() for v in values], pa.string())


def _number_texts(values: np.ndarray) -> pa.Array:
    """(N,) string: a float or int column as orjson writes each element, from one ``orjson.dumps`` of the
    whole column split at its commas (a number's text never holds one)."""
    n = len(values)
    if n == 0:
        return pa.array([], pa.string())
    body = np.frombuffer(orjson.dumps(values.tolist())[1:-1], np.uint8)
    commas = np.flatnonzero(body == ord(","))
    data = np.delete(body, commas)
    offsets = np.concatenate([[0], commas - np.arange(len(commas)), [len(data)]]).astype(np.int32)
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets.tobytes()), pa.py_buffer(data.tobytes()))


def json_column(values: np.ndarray) -> tuple[pa.Array, bool]:
    """``(text (N,) string, quoted)``: each value's JSON text as orjson writes it; when ``quoted``, the
    values are strings and ``text`` is what goes between the quotes (escaped where orjson escapes)."""
    if values.dtype.kind in "iu":
        return pc.cast(pa.array(values), pa.string()), False
    if values.dtype.kind == "f":
        return _number_texts(values), False
    try:
        arr = pa.array(values) if values.dtype == object else None
    except _NOT_ARROW:
        arr = None
    if arr is not None and arr.null_count == 0:
        if pa.types.is_integer(arr.type):
            return pc.cast(arr, pa.string()), False
        if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
            arr = arr.cast(pa.string())
            if len(arr) and _any_escaped(arr):  # rare: find the rows
                escape = pc.match_substring_regex(arr, _NEEDS_ESCAPE)
                inner = [orjson.dumps(s).decode()[1:-1] for s in arr.filter(escape).to_pylist()]
                arr = pc.replace_with_mask(arr, escape, pa.array(inner, pa.string()))
            return arr, True
    return _orjson_texts(values.tolist()), False


def _merge_constants(pieces: list[Any]) -> list[Any]:
    """Adjacent ``str`` pieces joined into one: each piece costs the element-wise join a pass."""
    out: list[Any] = []
    for p in pieces:
        if isinstance(p, str) and out and isinstance(out[-1], str):
            out[-1] += p
        else:
            out.append(p)
    return out


class _Rows:
    """Row indexes to select from columns: a zero-copy slice when they are one ascending run (the usual
    case for impressions, whose table rows a source writes in event-time order), else a ``take``."""

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows
        n = len(rows)
        self.start = int(rows[0]) if n else 0
        self.run = n == 0 or (int(rows[-1]) - self.start == n - 1 and bool((np.diff(rows) > 0).all()))
        self._taken: pa.Array | None = None if self.run else pa.array(rows, pa.int64())

    def of(self, column: pa.Array) -> pa.Array:
        if self._taken is None:
            return column.slice(self.start, len(self.rows))
        return column.take(self._taken)

    def of_numpy(self, column: np.ndarray) -> np.ndarray:
        return column[self.start:self.start + len(self.rows)] if self.run else column[self.rows]


class EventEncoder:
    """Encodes rows of one table: :meth:`impressions` and :meth:`clicks` take row indexes (int64) and return
    the events' JSON as a (len(rows),) string array, element ``k`` the event of row ``rows[k]``."""

    def __init__(self, table: EventTable) -> None:
        self._ts = pc.cast(pa.array(table.ts), pa.string())
        self._imp_id = json_column(table.impression_id)
        self._user = json_column(table.user_id)
        self._item = json_column(table.item_id)
        self._click_id = json_column(table.click_impression_id)
        self._click_ts = pc.cast(pa.array(table.click_ts), pa.string())
        self._dense = [(_key(name), _number_texts(col)) for name, col in table.dense.items()]
        # Context: each part's dicts as fragments, the object's text without its braces; an empty dict is ''.
        # Every part after the first carries its separating comma, so fragments join with no separator.
        # When the first part's dicts are all non-empty, every event has a context: the first part's
        # fragments then open it (',"context":{' in front) and the last part's close it (and the event too,
        # without dense features), so the context costs the join no constant pieces.
        keys = [set(itertools.chain.from_iterable(p.dicts)) for p in table.context]
        self._merge_per_event = any(a & b for a, b in itertools.combinations(keys, 2))
        self._dict_parts = [(p.index, p.dicts) for p in table.context]
        self._first_full = bool(table.context) and all(d for d in table.context[0].dicts)
        self._closes_event = self._first_full and not self._merge_per_event and not self._dense
        self._parts: list[tuple[np.ndarray, pa.Array]] = []
        dumps, last = orjson.dumps, len(table.context) - 1
        for k, p in enumerate(table.context if not self._merge_per_event else []):
            texts: list[str | None] = [dumps(d)[1:-1].decode() for d in p.dicts]
            if k > 0 or not self._first_full:
                texts = ["," + t if t else "" for t in texts]
            if self._first_full:
                if k == 0:
                    texts = [',"context":{' + t for t in texts]  # type: ignore[operator]
                if k == last:
                    texts = [t + ("}}" if self._closes_event else "}") for t in texts]  # type: ignore[operator]
            self._parts.append((p.index, pa.array(texts, pa.string())))

    @staticmethod
    def _field(column: tuple[pa.Array, bool], rows: _Rows) -> list[Any]:
        text, quoted = column
        taken = rows.of(text)
        return ['"', taken, '"'] if quoted else [taken]

    def _context(self, rows: _Rows) -> list[Any]:
        """The pieces of ``,"context":{...}`` (none when the table has no context parts)."""
        if not self._dict_parts:
            return []
        if self._merge_per_event:
            dumps, merged = orjson.dumps, []
            for i in rows.rows.tolist():
                ctx: dict[str, Any] = {}
                for index, dicts in self._dict_parts:
                    ctx.update(dicts[index[i]])
                merged.append(f',"context":{dumps(ctx).decode()}' if ctx else "")
            return [pa.array(merged, pa.string())]
        taken = [fragments.take(rows.of_numpy(index)) for index, fragments in self._parts]
        if self._first_full:
            return taken
        # The first part may be empty: every fragment then carries its leading comma, and the context's
        # text is the joined fragments without the first character (none when all are empty).
        ctx = taken[0] if len(taken) == 1 else pc.binary_join_element_wise(*taken, "")
        wrapped = pc.binary_join_element_wise(',"context":{', pc.utf8_slice_codeunits(ctx, start=1), "}", "")
        return [pc.if_else(pc.equal(ctx, ""), "", wrapped)]

    def impressions(self, rows: np.ndarray) -> pa.Array:
        r = _Rows(rows)
        pieces: list[Any] = [f'{{"schema_version":{SCHEMA_VERSION},"impression_id":',
                             *self._field(self._imp_id, r),
                             ',"ts":', r.of(self._ts),
                             ',"user_id":', *self._field(self._user, r),
                             ',"item_id":', *self._field(self._item, r),
                             *self._context(r)]
        for k, (key, texts) in enumerate(self._dense):
            pieces += [(',"dense":{' if k == 0 else ",") + key, r.of(texts)]
        if not self._closes_event:
            pieces.append("}}" if self._dense else "}")
        return self._join(pieces, len(rows))

    def clicks(self, rows: np.ndarray) -> pa.Array:
        r = _Rows(rows)
        pieces: list[Any] = [f'{{"schema_version":{SCHEMA_VERSION},"impression_id":',
                             *self._field(self._click_id, r), ',"ts":', r.of(self._click_ts), "}"]
        return self._join(pieces, len(rows))

    @staticmethod
    def _join(pieces: list[Any], n: int) -> pa.Array:
        if n == 0:
            return pa.array([], pa.string())
        return pc.binary_join_element_wise(*_merge_constants(pieces), "")


def impression_bytes(table: EventTable) -> list[bytes]:
    """Every impression of ``table`` as the publisher sends it, in row order (tests and tools)."""
    return to_bytes(EventEncoder(table).impressions(np.arange(table.n_impressions, dtype=np.int64)))


def click_bytes(table: EventTable) -> list[bytes]:
    """Every click of ``table`` as the publisher sends it, in row order."""
    return to_bytes(EventEncoder(table).clicks(np.arange(table.n_clicks, dtype=np.int64)))


def to_bytes(texts: pa.Array) -> list[Any]:
    """A string/binary array as a list of ``bytes`` (None for nulls)."""
    return texts.cast(pa.binary()).to_pylist()

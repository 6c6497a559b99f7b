"""A batch's hashed impression contexts as columns, and the row of it each pending impression refers to.

The engine hashes the contexts of a batch's impressions once per batch, column by column (one call of
:func:`stream.features.hash_column` per column: ``hash_context``'s numbers), into a :class:`ContextBlock`: one column
per context key, ``(N,)`` int64 for a categorical feature, a list column (flat ``(V,)`` int64 values, ``(N + 1,)``
int32 offsets) for a multi-valued one.
Each ``Pending`` holds a :class:`ContextRow` (its block and row) instead of a dict of hashed values, and sample and
state batches gather their context columns from the blocks (:func:`take_rows`) without a Python value per row.

A block's rows all have the same keys in the same order, each a list in every row or in none (its ``signature``); a
batch whose contexts differ is split into one block per signature, so rows of one signature gather as columns and the
rest (rows of different columns in one message) take the row-by-row union of ``sample_rows``. A :class:`ContextRow`
reads as the dict of hashed values it stands for (a read-only mapping), which is what that path and the tests use.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import chain, repeat
from operator import attrgetter, itemgetter
from typing import Any

import numpy as np

from stream.features import hash_column

ListColumn = tuple[np.ndarray, np.ndarray]  # flat (V,) int64 values, offsets (N + 1,) int32: row i is flat[o[i]:o[i+1]]
Column = np.ndarray | ListColumn  # (N,) int64, or a list column
Signature = tuple[tuple[str, bool], ...]  # (key, is a list column) in the rows' key order

HashContext = Callable[..., Mapping[str, Any]]  # stream.features.hash_context: a context -> its hashed values
_BLOCK, _ROW = attrgetter("block"), attrgetter("row")


class ContextBlock:
    """The hashed contexts of ``n`` impressions, one column per key (module docstring)."""

    __slots__ = ("columns", "n", "signature")

    def __init__(self, columns: dict[str, Column], n: int) -> None:
        self.columns = columns
        self.n = n
        self.signature: Signature = tuple((k, type(c) is tuple) for k, c in columns.items())

    def rows(self) -> list[ContextRow]:
        return list(map(ContextRow, repeat(self, self.n), range(self.n)))

    def take(self, rows: np.ndarray) -> dict[str, Column]:
        """The columns of ``rows`` ((M,) intp indices into this block), in that order."""
        return {k: _take_lists(c, rows) if type(c) is tuple else c[rows] for k, c in self.columns.items()}  # type: ignore[index, arg-type]


class ContextRow(Mapping[str, Any]):
    """One impression's context: row ``row`` of ``block``, read as the dict ``{key: hashed value or list}``."""

    __slots__ = ("block", "row")

    def __init__(self, block: ContextBlock, row: int) -> None:
        self.block = block
        self.row = row

    def __getitem__(self, key: str) -> int | list[int]:
        col = self.block.columns[key]
        if type(col) is tuple:
            flat, offsets = col
            return flat[offsets[self.row]:offsets[self.row + 1]].tolist()  # type: ignore[no-any-return]
        return int(col[self.row])  # type: ignore[index]

    def __iter__(self) -> Iterator[str]:
        return iter(self.block.columns)

    def __len__(self) -> int:
        return len(self.block.columns)

    def __repr__(self) -> str:
        return repr(dict(self))


def hashed_rows(contexts: Sequence[Mapping[str, Any]], hash_context: HashContext
                ) -> list[ContextRow]:
    """Each raw context (``Impression.context``, validated) hashed, as its row of a block: one block when every
    context has the same keys in the same order, each a list in all of them or in none (the usual stream), else one
    block per such signature. Each column (a list column's elements flattened) is hashed as an array by
    :func:`stream.features.hash_column` with the types this scan found, the same numbers as ``hash_context``
    (:func:`stream.features.hash_context`) gives each value; ``hash_context`` hashes a column holding None."""
    n = len(contexts)
    shapes = set(map(tuple, contexts))
    if len(shapes) == 1:
        keys = next(iter(shapes))
        raw = {k: list(map(itemgetter(k), contexts)) for k in keys}
        kinds = [set(map(type, col)) for col in raw.values()]
        if all(list not in t or len(t) == 1 for t in kinds):  # no key a list in some rows only
            return _block(raw, kinds, n, hash_context).rows()
    by_signature: dict[tuple, list[int]] = {}
    for i, c in enumerate(contexts):
        by_signature.setdefault(tuple((k, type(v) is list) for k, v in c.items()), []).append(i)
    out: list[ContextRow] = [None] * n  # type: ignore[list-item]
    for signature, idx in by_signature.items():
        part = [contexts[i] for i in idx]
        raw = {k: [c[k] for c in part] for k, _ in signature}
        block = _block(raw, [set(map(type, col)) for col in raw.values()], len(idx), hash_context)
        for i, row in zip(idx, block.rows(), strict=True):
            out[i] = row
    return out


def _block(raw: dict[str, list], kinds: list[set[type]], n: int,
           hash_context: HashContext) -> ContextBlock:
    """The block of ``n`` rows of raw columns (key -> (N,) values; a list column's values are the rows' lists), each
    column's value types in ``kinds`` (``{list}`` for a list column)."""
    columns: dict[str, Column] = {}
    for (k, col), types in zip(raw.items(), kinds, strict=True):
        if list in types:
            offsets = np.zeros(n + 1, np.int32)  # (N + 1,)
            np.cumsum(np.fromiter(map(len, col), np.int64, n), out=offsets[1:])
            flat = list(chain.from_iterable(col))  # (V,)
            columns[k] = (_hashed(k, flat, set(map(type, flat)), hash_context), offsets)
        else:
            columns[k] = _hashed(k, col, types, hash_context)
    return ContextBlock(columns, n)


def _hashed(key: str, values: list, types: set[type], hash_context: HashContext) -> np.ndarray:
    """(N,) int64: the hash of each of a column's ``values`` (of ``types``). ``hash_column`` gives every value a
    context may hold ``hash_context``'s number, without a Python list of them; None (no valid context value, which
    ``hash_column`` takes for an absent feature) keeps ``hash_context``'s."""
    if type(None) in types:
        return np.array(hash_context({key: values})[key], np.int64)
    return hash_column(values, types)


def take_rows(rows: Sequence[Mapping[str, Any]]) -> dict[str, Column] | None:
    """The context columns of ``rows`` (each a :class:`ContextRow`) gathered from their blocks, in order. None when
    there are none, when a row is not a :class:`ContextRow` (a plain dict) or when their blocks' signatures differ:
    the caller takes the rows one by one then."""
    n = len(rows)
    try:
        blocks: list[ContextBlock] = list(map(_BLOCK, rows))
    except AttributeError:
        return None
    if not n:
        return None
    idx = np.fromiter(map(_ROW, rows), np.intp, n)
    first = blocks[0]
    if blocks.count(first) == n:  # the usual case: one batch's rows
        return first.take(idx)
    distinct = dict(zip(map(id, blocks), blocks, strict=True))  # id -> block, each once
    if len({b.signature for b in distinct.values()}) != 1:
        return None
    serial = {bid: k for k, bid in enumerate(distinct)}
    which = np.fromiter(map(serial.__getitem__, map(id, blocks)), np.intp, n)  # (N,) each row's block
    order = np.argsort(which, kind="stable")  # rows grouped by block
    bounds = np.searchsorted(which[order], np.arange(len(distinct) + 1))
    parts = [b.take(idx[order[lo:hi]]) for b, lo, hi in zip(distinct.values(), bounds[:-1], bounds[1:], strict=True)]
    merged = ContextBlock({k: _concat([p[k] for p in parts]) for k in parts[0]}, n)  # rows in ``order``
    inverse = np.empty(n, np.intp)
    inverse[order] = np.arange(n)  # row i of ``rows`` is merged row inverse[i]
    return merged.take(inverse)


def _take_lists(col: ListColumn, rows: np.ndarray) -> ListColumn:
    flat, offsets = col
    starts = offsets[rows].astype(np.int64)  # (M,)
    lengths = offsets[rows + 1] - starts
    out = np.zeros(len(rows) + 1, np.int32)
    np.cumsum(lengths, out=out[1:])
    # output position p of row r (out[r] <= p < out[r + 1]) is flat[starts[r] + p - out[r]]
    return flat[np.repeat(starts - out[:-1], lengths) + np.arange(out[-1])], out


def _concat(cols: list[Column]) -> Column:
    if type(cols[0]) is not tuple:
        return np.concatenate(cols)  # type: ignore[arg-type]
    flats = [c[0] for c in cols]  # type: ignore[index]
    shift = np.cumsum([0, *(len(f) for f in flats[:-1])])
    offsets = np.concatenate([np.zeros(1, np.int64), *(c[1][1:] + s for c, s in zip(cols, shift, strict=True))])  # type: ignore[index]
    return np.concatenate(flats), offsets.astype(np.int32)

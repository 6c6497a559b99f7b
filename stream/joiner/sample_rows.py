"""Joined samples of one partition -> Arrow sample batches (``stream/samples.py``)."""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter, itemgetter
from typing import Any, TypeVar

import numpy as np

from stream.features import MISSING
from stream.joiner.context_block import take_rows
from stream.joiner.engine import Pending, Sample
from stream.samples import SampleBatch

T = TypeVar("T")
_IMPRESSION_ID, _TS, _USER, _ITEM, _CONTEXT = (  # of a Pending
    attrgetter(a) for a in ("impression_id", "ts", "user", "item", "context"))


def to_batch(rows: list[Sample], history: bool = True) -> SampleBatch:
    """Columns from samples. Context keys are the union over rows: a row without a key has :data:`MISSING`
    (``[MISSING]`` in a list column, while a ``[]`` sent stays empty: the learner reads MISSING as absent, by the
    field's kind, ``learner/batch.py``), a missing dense value 0.0; a key that is a list in any row is a list column.
    One pass over the rows' contexts fills every column (or, when they are rows of ``ContextBlock``s of one
    signature, each column is gathered from the blocks). ``history=False``: every row's history column is empty."""
    return _batch([s.pending for s in rows], _labels(rows), history)


def state_batch(ps: list[Pending]) -> SampleBatch:
    """The join state's rows (``state_log.py``): :func:`to_batch` of ``ps`` as label-0 :data:`~stream.samples.FINAL`
    samples with empty histories (a history is read from Redis when its sample goes out), without a ``Sample`` per
    row."""
    return _batch(ps, None, history=False)


Labels = tuple[np.ndarray, np.ndarray, np.ndarray]  # (N,) label int8, label_delay_ms int64, kind int8


def _labels(rows: list[Sample]) -> Labels:
    n = len(rows)
    return (np.fromiter(map(attrgetter("label"), rows), np.int8, n),
            np.fromiter(map(attrgetter("label_delay_ms"), rows), np.int64, n),
            np.fromiter(map(attrgetter("kind"), rows), np.int8, n))


def _no_labels(n: int) -> Labels:
    """Every row label 0, no delay, :data:`~stream.samples.FINAL` (0)."""
    return np.zeros(n, np.int8), np.zeros(n, np.int64), np.zeros(n, np.int8)


def _batch(ps: list[Pending], labels: Labels | None, history: bool) -> SampleBatch:
    """:func:`to_batch` of rows given as their pendings and label columns (None: :func:`_no_labels`)."""
    uniform = _columns(ps, labels, history)
    if uniform is not None:
        return uniform
    n = len(ps)
    label, delay, kind = _no_labels(n) if labels is None else labels
    ctx: dict[str, list] = {}
    dense: dict[str, list[float]] = {}
    list_keys: set[str] = set()
    for i, p in enumerate(ps):
        for k, v in p.context.items():
            col = ctx.get(k)
            if col is None:
                col = ctx[k] = [MISSING] * n
            col[i] = v
            if type(v) is list:
                list_keys.add(k)
        for k, x in p.dense.items():
            dcol = dense.get(k)
            if dcol is None:
                dcol = dense[k] = [0.0] * n
            dcol[i] = x
    context: dict[str, object] = {}
    for k, col in ctx.items():
        if k in list_keys:  # a list column: scalars become one-element lists, absent ones [MISSING]
            context[k] = [v if type(v) is list else [v] for v in col]
        else:
            context[k] = np.array(col, np.int64)
    return SampleBatch.from_columns(
        impression_id=[p.impression_id for p in ps],
        ts=np.array([p.ts for p in ps], np.int64),
        label=label,
        label_delay_ms=delay,
        user_id=np.array([p.user for p in ps], np.int64),
        item_id=np.array([p.item for p in ps], np.int64),
        history=[p.history for p in ps] if history else (np.zeros(0, np.int64), np.zeros(n + 1, np.int32)),
        context=context,  # type: ignore[arg-type]
        dense={k: np.array(v, np.float32) for k, v in dense.items()},
        kind=kind,
    )


History = tuple[np.ndarray, np.ndarray]  # a list column: flat (H,) int64 values, offsets (N + 1,) int32


def _columns(ps: list[Pending], labels: Labels | None, history: bool,
             histories: History | None = None) -> SampleBatch | None:
    """:func:`_batch` when the rows' contexts are rows of blocks with one signature (``context_block.py``: the same
    keys, each a list in every row or in none) and the rows have the same dense keys (the usual stream): the context
    columns gathered from the blocks, the others in one pass each. None otherwise. ``histories``: the rows' histories
    as a list column (``UserHistory.as_of_flat``) instead of each row's ``pending.history``."""
    columns = _column_args(ps, labels)
    if columns is None:
        return None
    n = len(ps)
    return SampleBatch.from_columns(
        history=(histories if histories is not None else [p.history for p in ps]) if history else
        (np.zeros(0, np.int64), np.zeros(n + 1, np.int32)), **columns)


def _column_args(ps: list[Pending], labels: Labels | None) -> dict[str, Any] | None:
    """:func:`_columns`' arguments of ``SampleBatch.from_columns`` but the history, or None."""
    denses = [p.dense for p in ps]
    dense_keys = set(map(tuple, denses))
    if len(dense_keys) != 1:
        return None
    context = take_rows(list(map(_CONTEXT, ps)))
    if context is None:
        return None
    n = len(ps)
    label, delay, kind = _no_labels(n) if labels is None else labels
    return {
        "impression_id": list(map(_IMPRESSION_ID, ps)),
        "ts": np.fromiter(map(_TS, ps), np.int64, n),
        "label": label,
        "label_delay_ms": delay,
        "user_id": np.fromiter(map(_USER, ps), np.int64, n),
        "item_id": np.fromiter(map(_ITEM, ps), np.int64, n),
        "context": context,
        "dense": {k: np.array(list(map(itemgetter(k), denses)), np.float32) for k in next(iter(dense_keys))},
        "kind": kind,
    }


MAX_MESSAGE_BYTES = 900_000  # Kafka's default message.max.bytes is 1 MB


def encode_bounded(items: list[T], encode: Callable[[list[T], bool], bytes], max_bytes: int,
                   max_items: int | None = None,
                   oversized: Callable[[list[T], bytes], bool | None] | None = None) -> list[bytes]:
    """``items`` encoded as consecutive parts of at most ``max_items`` items and (unless one item alone is
    bigger) ``max_bytes`` bytes: an oversized part is halved and encoded again. ``encode(part, first)``.
    One item alone over ``max_bytes`` goes to ``oversized(part, value)`` when given, and is left out unless that
    returns ``False`` (without ``oversized`` it is kept)."""
    step = max_items or max(len(items), 1)
    todo = [items[i:i + step] for i in range(0, len(items), step)][::-1] or [items]
    out: list[bytes] = []
    while todo:
        part = todo.pop()
        value = encode(part, not out)
        if len(value) > max_bytes and len(part) > 1:
            half = len(part) // 2
            todo.extend([part[half:], part[:half]])
        elif len(value) > max_bytes and oversized is not None and oversized(part, value) is not False:
            continue  # left out: ``oversized`` took it
        else:
            out.append(value)
    return out


def to_batches(rows: list[Sample], max_rows: int, max_bytes: int = MAX_MESSAGE_BYTES,
               oversized: Callable[[list[Sample], bytes], None] | None = None,
               histories: History | None = None) -> list[bytes]:
    """Encoded sample messages of at most ``max_rows`` rows and ``max_bytes``; a row bigger than that alone
    goes to ``oversized(rows, value)`` (the joiner dead-letters it). ``histories``: the rows' histories as one list
    column (flat (H,) int64, offsets (N + 1,) int32), taken as it is; None: each row's ``pending.history``."""
    return batches_later(rows, max_rows, max_bytes, oversized)(histories)


def batches_later(rows: list[Sample], max_rows: int, max_bytes: int = MAX_MESSAGE_BYTES,
                  oversized: Callable[[list[Sample], bytes], None] | None = None,
                  ) -> Callable[[History | None], list[bytes]]:
    """:func:`to_batches` in two halves: every column but the histories built now, the messages when the returned
    callable is given the histories (the joiner builds the columns while Redis reads the histories)."""
    if not rows:
        return lambda _histories: []
    columns = _column_args([s.pending for s in rows], _labels(rows))

    def finish(histories: History | None) -> list[bytes]:
        if columns is None and histories is not None:  # rows with different columns (rare): each row's own list
            flat, offsets = histories[0].tolist(), histories[1].tolist()
            for s, a, b in zip(rows, offsets[:-1], offsets[1:], strict=True):
                s.pending.history = flat[a:b]
        if columns is None:  # a message's columns are the union over its own rows
            return encode_bounded(rows, lambda part, _first: to_batch(part).encode(), max_bytes, max_rows, oversized)
        # Every row has the same columns: built once, each message a slice of them (a slice's columns are its rows').
        whole = SampleBatch.from_columns(
            history=histories if histories is not None else [s.pending.history for s in rows], **columns).batch
        on_oversized = None if oversized is None else lambda part, value: oversized([rows[i] for i in part], value)
        return encode_bounded(list(range(len(rows))),
                              lambda part, _first: SampleBatch(whole.slice(part[0], len(part))).encode(),
                              max_bytes, max_rows, on_oversized)

    return finish

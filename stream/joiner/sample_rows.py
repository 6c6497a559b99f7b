"""Joined samples of one partition -> Arrow sample batches (``stream/samples.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import numpy as np

from stream.features import MISSING
from stream.joiner.engine import Sample
from stream.samples import SampleBatch

T = TypeVar("T")


def to_batch(rows: list[Sample], history: bool = True) -> SampleBatch:
    """Columns from samples. Context keys are the union over rows: a missing categorical is
    :data:`MISSING`, a missing list ``[]``, a missing dense value 0.0; a key that is a list in any
    row is a list column. One pass over the rows' dicts fills every column. ``history=False``: every
    row's history column is empty (the join state: a history is read from Redis when its sample goes out)."""
    n = len(rows)
    ctx: dict[str, list] = {}
    dense: dict[str, list[float]] = {}
    list_keys: set[str] = set()
    for i, s in enumerate(rows):
        p = s.pending
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
        if k in list_keys:  # a list column: scalars become one-element lists, absent ones empty
            context[k] = [v if type(v) is list else ([] if v is MISSING else [v]) for v in col]
        else:
            context[k] = np.array(col, np.int64)
    ps = [s.pending for s in rows]
    return SampleBatch.from_columns(
        impression_id=[p.impression_id for p in ps],
        ts=np.array([p.ts for p in ps], np.int64),
        label=np.array([s.label for s in rows], np.int8),
        label_delay_ms=np.array([s.label_delay_ms for s in rows], np.int64),
        user_id=np.array([p.user for p in ps], np.int64),
        item_id=np.array([p.item for p in ps], np.int64),
        history=[p.history for p in ps] if history else (np.zeros(0, np.int64), np.zeros(n + 1, np.int32)),
        context=context,  # type: ignore[arg-type]
        dense={k: np.array(v, np.float32) for k, v in dense.items()},
        kind=np.array([s.kind for s in rows], np.int8),
    )


MAX_MESSAGE_BYTES = 900_000  # Kafka's default message.max.bytes is 1 MB


def encode_bounded(items: list[T], encode: Callable[[list[T], bool], bytes], max_bytes: int,
                   max_items: int | None = None,
                   oversized: Callable[[list[T], bytes], None] | None = None) -> list[bytes]:
    """``items`` encoded as consecutive parts of at most ``max_items`` items and (unless one item alone is
    bigger) ``max_bytes`` bytes: an oversized part is halved and encoded again. ``encode(part, first)``.
    One item alone over ``max_bytes`` goes to ``oversized(part, value)`` when given (else it is kept)."""
    step = max_items or max(len(items), 1)
    todo = [items[i:i + step] for i in range(0, len(items), step)][::-1] or [items]
    out: list[bytes] = []
    while todo:
        part = todo.pop()
        value = encode(part, not out)
        if len(value) > max_bytes and len(part) > 1:
            half = len(part) // 2
            todo.extend([part[half:], part[:half]])
        elif len(value) > max_bytes and oversized is not None:
            oversized(part, value)
        else:
            out.append(value)
    return out


def to_batches(rows: list[Sample], max_rows: int, max_bytes: int = MAX_MESSAGE_BYTES,
               oversized: Callable[[list[Sample], bytes], None] | None = None) -> list[bytes]:
    """Encoded sample messages of at most ``max_rows`` rows and ``max_bytes``; a row bigger than that alone
    goes to ``oversized(rows, value)`` (the joiner dead-letters it)."""
    if not rows:
        return []
    return encode_bounded(rows, lambda part, _first: to_batch(part).encode(), max_bytes, max_rows, oversized)

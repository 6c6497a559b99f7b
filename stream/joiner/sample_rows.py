"""Joined samples of one partition -> Arrow sample batches (``stream/samples.py``)."""

from __future__ import annotations

import numpy as np

from stream.features import MISSING
from stream.joiner.engine import Sample
from stream.samples import SampleBatch


def to_batch(rows: list[Sample]) -> SampleBatch:
    """Columns from samples. Context keys are the union over rows: a missing categorical is
    :data:`MISSING`, a missing list ``[]``, a missing dense value 0.0; a key that is a list in any
    row is a list column."""
    ps = [s.pending for s in rows]
    list_keys: set[str] = set()
    keys: set[str] = set()
    dense_keys: set[str] = set()
    for p in ps:
        for k, v in p.context.items():
            keys.add(k)
            if isinstance(v, list):
                list_keys.add(k)
        dense_keys.update(p.dense)
    context: dict[str, object] = {}
    for k in keys:
        if k in list_keys:
            context[k] = [v if isinstance(v, list) else [v] for v in (p.context.get(k, []) for p in ps)]
        else:
            context[k] = np.fromiter((p.context.get(k, MISSING) for p in ps), np.int64, len(ps))
    return SampleBatch.from_columns(
        impression_id=[p.impression_id for p in ps],
        ts=np.fromiter((p.ts for p in ps), np.int64, len(ps)),
        label=np.fromiter((s.label for s in rows), np.int8, len(ps)),
        label_delay_ms=np.fromiter((s.label_delay_ms for s in rows), np.int64, len(ps)),
        user_id=np.fromiter((p.user for p in ps), np.int64, len(ps)),
        item_id=np.fromiter((p.item for p in ps), np.int64, len(ps)),
        history=[p.history for p in ps],
        context=context,  # type: ignore[arg-type]
        dense={k: np.fromiter((p.dense.get(k, 0.0) for p in ps), np.float32, len(ps)) for k in dense_keys},
    )


MAX_MESSAGE_BYTES = 900_000  # Kafka's default message.max.bytes is 1 MB


def to_batches(rows: list[Sample], max_rows: int, max_bytes: int = MAX_MESSAGE_BYTES) -> list[bytes]:
    """Encoded sample messages of at most ``max_rows`` rows and (unless one row is bigger) ``max_bytes``."""
    out: list[bytes] = []
    stack = [rows[i:i + max_rows] for i in range(0, len(rows), max_rows)][::-1]
    while stack:
        part = stack.pop()
        value = to_batch(part).encode()
        if len(value) > max_bytes and len(part) > 1:
            half = len(part) // 2
            stack.extend([part[half:], part[:half]])
        else:
            out.append(value)
    return out

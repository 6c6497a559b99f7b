"""The columnar form every replay source produces, and the helpers they share.

A source (MovieLens, synthetic, a user's Parquet/CSV log) builds one :class:`EventTable`; the
publisher (``stream/replay/publisher.py``) merges its impressions, clicks and deliberately malformed
messages into one event-time order and produces them. Sources never talk to Kafka.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stream.errors import BadMessage
from stream.events import MAX_TS_MS
from stream.replay.config import ClickDelay, DelayKind

IMPRESSION = 0
CLICK = 1


@dataclass
class ContextPart:
    """Per-row context taken from a lookup: row ``i`` gets ``dicts[index[i]]``.

    MovieLens has one part for user attributes (indexed by user) and one for item attributes; a
    user's event log has one part with a dict per row. Dicts may be shared between rows.
    """

    index: np.ndarray  # (N,) int64 into ``dicts``
    dicts: list[dict[str, Any]]


@dataclass
class RawMessage:
    """A message published as-is (malformed on purpose) or dead-lettered at the source."""

    topic_kind: int  # IMPRESSION or CLICK: which topic it is for
    ts: int  # ms; where it goes in the replay order
    key: bytes | None
    value: bytes | None
    error: BadMessage | None = None  # set for rows rejected at the source (they go to the DLQ)


@dataclass
class EventTable:
    """Impressions and clicks of one source, columnar, in any order (the publisher sorts).

    Ids are Python ints or strs (``user_id``/``item_id`` are object arrays or int64 arrays).
    """

    impression_id: np.ndarray  # (N,) object: str
    ts: np.ndarray  # (N,) int64, ms
    user_id: np.ndarray  # (N,) object or int64
    item_id: np.ndarray  # (N,) object or int64
    context: list[ContextPart] = field(default_factory=list)
    dense: dict[str, np.ndarray] = field(default_factory=dict)  # name -> (N,) float
    click_impression_id: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=object))  # (M,)
    click_ts: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))  # (M,) ms
    raw: list[RawMessage] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)  # source facts for the summary

    def __post_init__(self) -> None:
        n = len(self.impression_id)
        for name, col in (("ts", self.ts), ("user_id", self.user_id), ("item_id", self.item_id)):
            if len(col) != n:
                raise ValueError(f"EventTable.{name} has {len(col)} rows, impression_id has {n}")
        if len(self.click_impression_id) != len(self.click_ts):
            raise ValueError("EventTable click columns differ in length")

    @property
    def n_impressions(self) -> int:
        return len(self.impression_id)

    @property
    def n_clicks(self) -> int:
        return len(self.click_ts)


def draw_click_delays_ms(delay: ClickDelay, n: int, rng: np.random.Generator) -> np.ndarray:
    """Draw ``n`` impression-to-click delays in ms (at least 1 ms, at most ``MAX_TS_MS``: a lognormal's far tail
    overflowed the cast to int64 and came out as 1 ms). Shape ``(n,)`` int64."""
    if delay.median_s < 0:
        raise ValueError(f"click delay median must be >= 0 s, got {delay.median_s}")
    if delay.kind is DelayKind.FIXED:
        seconds = np.full(n, delay.median_s)
    elif delay.kind is DelayKind.EXPONENTIAL:
        # median of Exp(scale) is scale * ln 2
        seconds = rng.exponential(delay.median_s / np.log(2), n)
    else:
        seconds = np.exp(rng.normal(np.log(max(delay.median_s, 1e-3)), delay.sigma, n))
    return np.clip(np.rint(seconds * 1000.0), 1, MAX_TS_MS).astype(np.int64)

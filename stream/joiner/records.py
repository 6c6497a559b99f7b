"""A joiner's input records as every driver hands them to the pipeline, and one topic-partition's records held back
(not joined yet) as columns.

A :class:`Record` is one raw Kafka message (both input topics, any partition); its event is what decoding made of it
(an impression, a click, or the :class:`~stream.errors.BadMessage` saying why it is bad, dead-lettered once
processed). :class:`Held` keeps the records the event-time frontier or the waiting cap held back, in offset order, so
that a record held for many batches is neither walked nor copied again with each (``pipeline.JoinPipeline._take``).
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from operator import attrgetter
from typing import Any, NamedTuple

import numpy as np

from stream.errors import BadMessage
from stream.events import Click, Impression
from stream.kafka import Headers

_TS_OF = attrgetter("ts")  # of an event


Event = Impression | Click | BadMessage  # a record's event, or why it is bad


def nth_good(events: list[Event], n: int) -> int:
    """The index of the ``n``-th (from 0) good event in ``events``: the bad records before it stay with the good."""
    for i, event in enumerate(events):
        if not isinstance(event, BadMessage):
            if n == 0:
                return i
            n -= 1
    return len(events)


def _good_times(events: list[Event]) -> tuple[np.ndarray, bool]:
    """((G,) int64 event times of the good events in order, whether all N events are good): one C-level pass when
    they are (the usual case)."""
    try:
        return np.fromiter(map(_TS_OF, events), np.int64, len(events)), True
    except AttributeError:  # a BadMessage among them (it has no ts)
        return np.array([e.ts for e in events if not isinstance(e, BadMessage)], np.int64), False  # type: ignore[union-attr]


class Record(NamedTuple):
    """A raw input message, as any driver receives it."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp: int | None = None  # the message's broker timestamp (ms; -1: none), which bounds how far ahead ts may be
    # the message's Kafka headers, which its dead letter keeps (stream/dlq.py), or why they could not be read
    # (``stream.kafka.headers_of``: a header key that is not UTF-8): the record is dead-lettered with that, without them
    headers: Headers | BadMessage | None = None


def records_of(*columns: Iterable[Any]) -> list[Record]:
    """Records from their seven columns (topic, partition, offset, key, value, timestamp, headers), each built in C: a
    NamedTuple's own ``__new__`` is Python code (~0.3 us a record), ``tuple.__new__`` over the zipped fields is not."""
    return list(map(_NEW_RECORD, zip(*columns, strict=True)))


_NEW_RECORD = partial(tuple.__new__, Record)


def kept_headers(r: Record) -> Headers | None:
    """The headers ``r``'s dead letter keeps: none where they could not be read."""
    return None if isinstance(r.headers, BadMessage) else r.headers


class Held:
    """One topic-partition's records not joined yet, in offset order, as columns: the records, their events (or why
    each is bad, dead-lettered once processed) and the good events' times. New records are appended and the joined
    ones taken from the front (``lo`` moves; the lists are compacted between batches), so a record held for many
    batches is neither walked nor copied with each: on a replayed ML-1M ~75 k records wait per batch, and copying the
    held records' lists (each copy touches every record) cost ~110 ns per record and batch, ~1.8 s of the run."""

    __slots__ = ("events", "lo", "records", "ts")
    _COMPACT = 4096  # taken records kept at the front until there are this many (and they are half the lists)

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.events: list[Event] = []
        self.ts = np.zeros(0, np.int64)  # (G,) int64, G <= len(self): the good events' times among records[lo:]
        self.lo = 0  # records[:lo] are taken

    def __len__(self) -> int:
        return len(self.records) - self.lo

    @property
    def clean(self) -> bool:
        """Whether every record not taken is good."""
        return len(self.ts) == len(self)

    def add(self, records: list[Record], events: list[Event]) -> None:
        """Append records (after every one held) with their events; only their events' times are read."""
        ts, _ = _good_times(events)
        self.records.extend(records)
        self.events.extend(events)
        self.ts = np.concatenate([self.ts, ts]) if len(self.ts) else ts

    def take(self, n: int) -> tuple[list[Record], list[Event]]:
        """The first ``n`` records not taken yet, with their events; the rest stay held."""
        lo, hi = self.lo, self.lo + n
        events = self.events[lo:hi]
        good = n if len(self.ts) == len(self) else sum(not isinstance(e, BadMessage) for e in events)
        self.lo, self.ts = hi, self.ts[good:]
        return self.records[lo:hi], events

    def compact(self) -> None:
        """Drop the taken records from the lists (between batches, so a failed batch can be undone: ``snapshot``)."""
        if self.lo == len(self.records):
            self.records, self.events, self.lo = [], [], 0
        elif self.lo >= self._COMPACT and 2 * self.lo >= len(self.records):
            del self.records[:self.lo], self.events[:self.lo]
            self.lo = 0

    def held(self) -> tuple[list[Record], list[Event]]:
        """The records not taken, with their events (copies)."""
        return self.records[self.lo:], self.events[self.lo:]

    def snapshot(self) -> tuple[int, int, np.ndarray]:
        return len(self.records), self.lo, self.ts

    def restore(self, snapshot: tuple[int, int, np.ndarray]) -> None:
        """Back to ``snapshot`` (taken after the last ``compact``): what a failed batch added and took is undone."""
        n, self.lo, self.ts = snapshot
        del self.records[n:], self.events[n:]


Groups = dict[tuple[str, int], tuple[list[Record], list[Event]]]  # (topic, partition) -> records, events in order

"""Publish an :class:`EventTable` to the ``impressions`` and ``clicks`` topics in event-time order.

- One event per message, key = ``impression_id`` (co-partitions impressions and clicks).
- Impressions before clicks at equal timestamps; source order breaks the remaining ties.
- The Kafka message timestamp is left to the producer (wall clock): event time travels in the
  payload. Replaying years-old event times as message timestamps would make a real Kafka broker
  delete the segments at once under time-based retention.
- Rows a source rejected go to ``<topic>.dlq`` with their reason; deliberately malformed messages
  (synthetic ``malformed_share``) go to the real topic for consumers to dead-letter.
- Pacing: ``rate`` (events per wall-clock second) or ``speed`` (event time / wall time), else as
  fast as the producer takes them. Every message is acknowledged before the summary is printed.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import orjson

from stream.config import KafkaSettings
from stream.dlq import DeadLetters
from stream.events import SCHEMA_VERSION
from stream.kafka import AckedProducer, ensure_topics
from stream.metrics import EVENTS
from stream.replay.table import CLICK, IMPRESSION, EventTable

_RAW = 2  # kind code of raw messages in the merged order


@dataclass
class ReplaySummary:
    dataset: str
    impressions: int = 0
    clicks: int = 0
    malformed_published: int = 0
    dead_lettered: int = 0
    acked: dict[str, int] = field(default_factory=dict)
    first_ts: int | None = None
    last_ts: int | None = None
    elapsed_s: float = 0.0
    events_per_s: float = 0.0
    source: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def replay_order(table: EventTable) -> tuple[np.ndarray, np.ndarray]:
    """The merged event-time order: ``(kind (E,), index (E,))``, E = impressions + clicks + raw."""
    raw_ts = np.fromiter((m.ts for m in table.raw), dtype=np.int64, count=len(table.raw))
    ts = np.concatenate([table.ts, table.click_ts, raw_ts])
    kind = np.concatenate([
        np.full(table.n_impressions, IMPRESSION, np.int8),
        np.full(table.n_clicks, CLICK, np.int8),
        np.full(len(table.raw), _RAW, np.int8),
    ])
    index = np.concatenate([
        np.arange(table.n_impressions), np.arange(table.n_clicks), np.arange(len(table.raw))
    ])
    order = np.lexsort((kind, ts))  # by ts, then kind; lexsort is stable so source order stays
    return kind[order], index[order]


class Pacer:
    """Sleeps so that at most ``rate`` events/s go out, or event time advances ``speed`` x wall time."""

    def __init__(self, rate: float | None, speed: float | None, first_ts: int) -> None:
        if rate is not None and speed is not None:
            raise ValueError("give either rate (events/s) or speed (x event time), not both")
        if (rate is not None and rate <= 0) or (speed is not None and speed <= 0):
            raise ValueError("rate and speed must be > 0")
        self._rate, self._speed, self._t0_event = rate, speed, first_ts
        self._t0 = time.monotonic()

    @property
    def active(self) -> bool:
        return self._rate is not None or self._speed is not None

    def wait(self, n_sent: int, ts: int) -> None:
        if self._rate is not None:
            due = n_sent / self._rate
        elif self._speed is not None:
            due = (ts - self._t0_event) / 1000.0 / self._speed
        else:
            return
        ahead = due - (time.monotonic() - self._t0)
        if ahead > 0.002:
            time.sleep(ahead)


def publish(table: EventTable, kafka: KafkaSettings, dataset: str, *, rate: float | None = None,
            speed: float | None = None, linger_ms: int = 20,
            progress: Callable[[int], None] | None = None) -> ReplaySummary:
    """Produce every event of ``table``; returns counts once all are acknowledged.

    ``progress(n)`` is called every few thousand events with the number sent since the last call.
    Raises ``DeliveryFailed`` if any message was not acknowledged.
    """
    topics = {IMPRESSION: kafka.impressions_topic, CLICK: kafka.clicks_topic}
    ensure_topics(kafka, [*topics.values(), *(kafka.dlq_topic(t) for t in topics.values())])
    producer = AckedProducer(kafka, **{"linger.ms": linger_ms})
    dead_letters = DeadLetters(kafka, producer)
    summary = ReplaySummary(dataset=dataset, source=dict(table.stats))

    kinds, indexes = replay_order(table)
    ts_all = np.concatenate([table.ts, table.click_ts])
    if len(ts_all):
        summary.first_ts, summary.last_ts = int(ts_all.min()), int(ts_all.max())
    pacer = Pacer(rate, speed, summary.first_ts or 0)
    paced = pacer.active

    # Python lists index faster than numpy arrays in the per-event loop below.
    imp_id, imp_ts = table.impression_id.tolist(), table.ts.tolist()
    users, items = table.user_id.tolist(), table.item_id.tolist()
    parts = [(p.index.tolist(), p.dicts) for p in table.context]
    dense = [(name, col.tolist()) for name, col in table.dense.items()]
    click_id, click_ts = table.click_impression_id.tolist(), table.click_ts.tolist()
    imp_topic, click_topic = topics[IMPRESSION], topics[CLICK]
    send, dumps = producer.send, orjson.dumps

    t0 = time.monotonic()
    step, reported = 5000, 0
    for n, (kind, i) in enumerate(zip(kinds.tolist(), indexes.tolist(), strict=True)):
        if kind == IMPRESSION:
            event: dict[str, Any] = {
                "schema_version": SCHEMA_VERSION, "impression_id": imp_id[i], "ts": imp_ts[i],
                "user_id": users[i], "item_id": items[i],
            }
            if parts:
                ctx: dict[str, Any] = {}
                for index, dicts in parts:
                    ctx.update(dicts[index[i]])
                if ctx:
                    event["context"] = ctx
            if dense:
                event["dense"] = {name: col[i] for name, col in dense}
            send(imp_topic, dumps(event), imp_id[i])
            summary.impressions += 1
            ts = imp_ts[i]
        elif kind == CLICK:
            send(click_topic, dumps({"schema_version": SCHEMA_VERSION, "impression_id": click_id[i],
                                     "ts": click_ts[i]}), click_id[i])
            summary.clicks += 1
            ts = click_ts[i]
        else:
            raw = table.raw[i]
            topic = topics[raw.topic_kind]
            if raw.error is not None:
                dead_letters.send(topic, raw.key, raw.value, raw.error)
                summary.dead_lettered += 1
            else:
                send(topic, raw.value, raw.key)
                summary.malformed_published += 1
            ts = raw.ts
        if n % step == 0:
            producer.poll()
            if progress is not None and n:
                progress(n - reported)
                reported = n
        if paced:
            pacer.wait(n + 1, ts)

    report = producer.flush()
    summary.elapsed_s = time.monotonic() - t0
    total = summary.impressions + summary.clicks + summary.malformed_published + summary.dead_lettered
    if progress is not None:
        progress(total - reported)
    summary.events_per_s = total / summary.elapsed_s if summary.elapsed_s > 0 else 0.0
    summary.acked = dict(sorted(report.acked.items()))
    EVENTS.labels("replay", imp_topic).inc(summary.impressions)
    EVENTS.labels("replay", click_topic).inc(summary.clicks)
    return summary


def progress_bar(total: int, enabled: bool) -> tuple[Callable[[int], None], Callable[[], None]]:
    """A tqdm bar on stderr: ``(update, close)``. Disabled -> no-ops."""
    if not enabled:
        return (lambda _n: None), (lambda: None)
    from tqdm import tqdm

    bar = tqdm(total=total, unit="ev", unit_scale=True, file=sys.stderr, desc="replay", smoothing=0.1)
    return bar.update, bar.close

"""``streamrec join``: the faust-streaming worker around :class:`~stream.joiner.engine.PartitionJoin`.

One agent reads ``impressions`` and ``clicks`` (co-partitioned by impression id: faust assigns
partition p of both topics to the same worker) in batches (``stream.take_events``). Per batch and
partition:

1. decode and validate; malformed messages -> ``<topic>.dlq`` with the reason;
2. look up the users' click history as of each impression's time in Redis (one pipeline);
3. join (pure logic, ``engine.py``);
4. write samples (Arrow IPC) to ``samples`` partition p, late/orphan clicks to ``late_clicks``,
   counts and new clicks to Redis; wait until the broker acknowledged them;
5. write the batch's state chunk (``state_log.py``);
6. only then let faust ack the input events (it acks when the batch loop resumes), and faust's
   commit flushes the producer before it commits offsets.

So committed offsets never run ahead of durable state, and the state never claims a sample that is
not durable. A crash between 4 and 5 re-emits that batch's samples: duplicates carry the same
impression id, and the learner drops them.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import faust
import orjson
import redis

from stream.counts import DailyCounts
from stream.errors import BadMessage
from stream.events import Click, Impression, decode_click, decode_impression
from stream.features import hash_value
from stream.history import UserHistory
from stream.joiner import metrics as m
from stream.joiner.engine import BatchResult, JoinConfig, PartitionJoin
from stream.joiner.sample_rows import to_batches
from stream.joiner.state_log import chunk_key, encode_chunk, load_chunks, state_topic
from stream.kafka import ensure_topics
from streamrec.settings import JoinerSettings, KafkaSettings, RedisSettings

log = logging.getLogger("streamrec.join")


@dataclass
class JoinTotals:
    """Counters of one worker run, printed as the summary at exit."""

    counts: Counter[str] = field(default_factory=Counter)
    started: float = field(default_factory=time.monotonic)
    first_event: float | None = None
    last_event: float | None = None

    def summary(self) -> dict[str, Any]:
        c = self.counts
        busy = (self.last_event - self.first_event) if self.first_event and self.last_event else 0.0
        events = c["impressions"] + c["clicks"] + c["dead_lettered"]
        clicks_seen = c["clicks"]
        return {
            "events": events,
            "impressions": c["impressions"],
            "clicks": clicks_seen,
            "samples": c["samples"],
            "positives": c["positives"],
            "negatives": c["samples"] - c["positives"],
            "late_clicks": c["late_clicks"],
            "orphan_clicks": c["orphan_clicks"],
            "duplicate_clicks": c["duplicate_clicks"],
            "clicks_before_impression": c["before_impression_clicks"],
            "duplicate_impressions": c["duplicate_impressions"],
            "redelivered_skipped": c["redelivered"],
            "dead_lettered": c["dead_lettered"],
            "click_coverage": round(c["joined_clicks"] / clicks_seen, 6) if clicks_seen else None,
            "pending_impressions": c["pending_impressions"],
            "elapsed_s": round(time.monotonic() - self.started, 3),
            "events_per_s": round(events / busy) if busy > 0 else None,
        }


class JoinWorker:
    """The faust app, its agent and the per-partition join state of one worker process."""

    def __init__(self, kafka: KafkaSettings, redis_settings: RedisSettings, js: JoinerSettings) -> None:
        self.kafka, self.js = kafka, js
        self.cfg = JoinConfig(
            window_ms=int(js.attribution_window_s * 1000), lateness_ms=int(js.allowed_lateness_s * 1000),
            late_retention_ms=int(js.late_retention_s * 1000), history_len=redis_settings.history_len,
        )
        self.redis = redis.Redis.from_url(redis_settings.url)
        self.counts = DailyCounts(self.redis, prefix=redis_settings.prefix, ttl_days=redis_settings.counts_ttl_days)
        self.history = UserHistory(self.redis, prefix=redis_settings.prefix, max_len=redis_settings.history_len)
        self.engines: dict[int, PartitionJoin] = {}
        self._chunks_to_write: dict[int, list[BatchResult]] = {}  # state chunks waiting for step 5
        self._parts: dict[tuple[int, int], int] = {}  # (partition, seq) -> records of that chunk
        self.totals = JoinTotals()
        self.state_topic_name = state_topic(js.app_id)
        self.exit_code = 0
        self._idle_since = time.monotonic()
        self._stopping = False
        self.worker: faust.Worker | None = None

        ensure_topics(kafka, [kafka.impressions_topic, kafka.clicks_topic, kafka.samples_topic,
                              js.late_clicks_topic, kafka.dlq_topic(kafka.impressions_topic),
                              kafka.dlq_topic(kafka.clicks_topic), self.state_topic_name])
        self.app = self._build_app()

    # -- faust wiring ------------------------------------------------------------------------
    def _build_app(self) -> faust.App:
        k = self.kafka
        app = faust.App(
            self.js.app_id,
            broker=[f"kafka://{b.strip()}" for b in k.bootstrap_servers.split(",")],
            store="memory://",
            topic_partitions=k.partitions,
            topic_replication_factor=k.replication_factor,
            broker_session_timeout=k.session_timeout_ms / 1000,
            broker_heartbeat_interval=max(0.5, k.session_timeout_ms / 6000),
            consumer_auto_offset_reset="earliest",
            broker_max_poll_records=self.js.batch_max,
            stream_buffer_maxsize=max(4096, 2 * self.js.batch_max),
            web_enabled=False,
            producer_acks=-1,
            # faust's own tables are not used (see state_log.py); no changelog topics to create.
            topic_allow_declare=False,
            consumer_max_fetch_size=8 * 1024 * 1024,
            producer_max_request_size=4 * 1024 * 1024,  # records stay under 1 MB; headroom for batching
        )
        raw = {"key_serializer": "raw", "value_serializer": "raw"}
        source = app.topic(k.impressions_topic, k.clicks_topic, **raw)
        self.t_samples = app.topic(k.samples_topic, **raw)
        self.t_late = app.topic(self.js.late_clicks_topic, **raw)
        self.t_state = app.topic(self.state_topic_name, **raw)
        self.t_dlq = {t: app.topic(k.dlq_topic(t), **raw) for t in (k.impressions_topic, k.clicks_topic)}

        async def join_agent(stream: faust.StreamT) -> None:
            async for events in stream.take_events(self.js.batch_max, within=self.js.batch_within_s):
                await self.process(events)

        app.agent(source, name="join")(join_agent)
        app.timer(0.25)(self._idle_check)
        app.on_partitions_revoked.connect(self._on_revoked)
        app.on_partitions_assigned.connect(self._on_assigned)
        return app

    async def _on_assigned(self, sender: Any, assigned: set, **kwargs: Any) -> None:
        self._idle_since = time.monotonic()  # idleness counts from when there is something to read

    async def _on_revoked(self, sender: Any, revoked: set, **kwargs: Any) -> None:
        for tp in revoked:
            if tp.topic == self.kafka.impressions_topic:
                self.engines.pop(tp.partition, None)

    # -- one batch ---------------------------------------------------------------------------
    def _engine(self, partition: int) -> PartitionJoin:
        eng = self.engines.get(partition)
        if eng is None:
            chunks, parts = load_chunks(self.kafka, self.state_topic_name, partition)
            self._parts.update({(partition, seq): n for seq, n in parts.items()})
            eng = PartitionJoin.restore(partition, self.cfg, chunks)
            self.engines[partition] = eng
            if chunks:
                log.info("partition %d: restored %d pending impressions from %d state chunks (offsets %s)",
                         partition, len(eng.pending), len(chunks), eng.offsets)
        return eng

    async def process(self, events: list[faust.EventT]) -> None:
        now = time.monotonic()
        self._idle_since = now
        self.totals.first_event = self.totals.first_event or now
        imps: dict[int, list[tuple[int, Impression]]] = defaultdict(list)
        clicks: dict[int, list[tuple[int, Click]]] = defaultdict(list)
        pending_sends: list[Any] = []
        imp_topic = self.kafka.impressions_topic
        for ev in events:
            msg = ev.message
            is_imp = msg.topic == imp_topic
            try:
                if is_imp:
                    imps[msg.partition].append((msg.offset, decode_impression(msg.value)))
                else:
                    clicks[msg.partition].append((msg.offset, decode_click(msg.value)))
            except BadMessage as exc:
                pending_sends.append(await self._dead_letter(msg, exc))
        for partition in sorted(set(imps) | set(clicks)):
            pending_sends.extend(await self._apply(partition, imps.get(partition, []), clicks.get(partition, [])))
        # Steps 4 -> 5: outputs acknowledged before the state chunks that account for them.
        await self._settle(pending_sends)
        for partition in sorted(set(imps) | set(clicks)):
            await self._write_state(partition)
        self.totals.last_event = time.monotonic()

    async def _apply(self, partition: int, imps: list[tuple[int, Impression]],
                     clicks: list[tuple[int, Click]], drain: bool = False) -> list[Any]:
        eng = self._engine(partition)
        users = [hash_value(i.user_id) for _, i in imps]
        ts = [i.ts for _, i in imps]
        history = dict(zip(zip(users, ts, strict=True), self.history.as_of(users, ts), strict=True)) if imps else {}
        res = eng.apply(imps, clicks, history, drain=drain)
        self._chunks_to_write.setdefault(partition, []).append(res)
        self._account(res, eng)
        self._record_redis(res)
        sends = []
        for value in to_batches(res.samples, self.js.sample_flush_rows):
            sends.append(await self.t_samples.send(key=str(partition).encode(), value=value, partition=partition))
        for u in res.unjoined:
            value = orjson.dumps({"impression_id": u.impression_id, "click_ts": u.click_ts, "reason": u.reason,
                                  "partition": partition})
            sends.append(await self.t_late.send(key=u.impression_id.encode(), value=value, partition=partition))
        return sends

    async def _write_state(self, partition: int) -> None:
        for res in self._chunks_to_write.pop(partition, []):
            if res.chunk is not None:
                records = encode_chunk(res.chunk)
                self._parts[(partition, res.chunk.seq)] = len(records)
                for part, value in enumerate(records):
                    await self.t_state.send(key=chunk_key(partition, res.chunk.seq, part), value=value,
                                            partition=partition)
            for seq in res.retired:
                for part in range(self._parts.pop((partition, seq), 1)):
                    await self.t_state.send(key=chunk_key(partition, seq, part), value=None, partition=partition)

    async def _dead_letter(self, msg: Any, exc: BadMessage) -> Any:
        self.totals.counts["dead_lettered"] += 1
        m.DLQ_MESSAGES.labels(msg.topic, exc.kind).inc()
        headers = [("dlq.reason", exc.reason.encode()), ("dlq.kind", exc.kind.encode()),
                   ("dlq.source.topic", msg.topic.encode()), ("dlq.source.partition", str(msg.partition).encode()),
                   ("dlq.source.offset", str(msg.offset).encode())]
        return await self.t_dlq[msg.topic].send(key=msg.key, value=msg.value, headers=headers)

    @staticmethod
    async def _settle(futures: list[Any]) -> None:
        if futures:
            await asyncio.gather(*futures)

    def _account(self, res: BatchResult, eng: PartitionJoin) -> None:
        c = self.totals.counts
        c.update(res.stats)
        positives = sum(s.label for s in res.samples)
        c["samples"] += len(res.samples)
        c["positives"] += positives
        c["pending_impressions"] = sum(len(e.pending) for e in self.engines.values())
        m.record(res, positives, self.engines, c)

    def _record_redis(self, res: BatchResult) -> None:
        if res.new_impressions:
            ts = [p.ts for p in res.new_impressions]
            self.counts.record("item", "impression", [p.item for p in res.new_impressions], ts)
            self.counts.record("user", "impression", [p.user for p in res.new_impressions], ts)
        if res.joined_clicks:
            ts = [j.click_ts for j in res.joined_clicks]
            self.counts.record("item", "click", [j.item for j in res.joined_clicks], ts)
            self.counts.record("user", "click", [j.user for j in res.joined_clicks], ts)
            self.history.append_many([j.user for j in res.joined_clicks], [j.item for j in res.joined_clicks], ts)

    # -- bounded runs ------------------------------------------------------------------------
    async def _idle_check(self) -> None:
        limit = self.js.exit_when_idle_s
        if limit is None or self._stopping or time.monotonic() - self._idle_since < limit:
            return
        self._stopping = True
        try:
            if self.js.drain_at_exit:
                await self.drain()
            await self.app.producer.flush()
            await self.app.consumer.commit()
        except Exception:
            log.exception("flush at exit failed")
            self.exit_code = 1
        if self.worker is not None:
            # The path a SIGTERM takes: stop the worker's services, then leave the run loop.
            self.worker._schedule_shutdown(signal.SIGTERM)

    async def drain(self) -> None:
        """End of input: expire every pending impression of the partitions this worker holds."""
        sends: list[Any] = []
        for partition in sorted(self.engines):
            sends.extend(await self._apply(partition, [], [], drain=True))
        await self._settle(sends)
        for partition in sorted(self.engines):
            await self._write_state(partition)

    def run(self, loglevel: str = "warn") -> int:
        """Run the worker until SIGTERM/SIGINT, or until idle when ``exit_when_idle_s`` is set."""
        self.worker = faust.Worker(self.app, loglevel=loglevel, quiet=True, redirect_stdouts=False)
        try:
            self.worker.execute_from_commandline()
        except SystemExit as exc:
            return self.exit_code or (exc.code if isinstance(exc.code, int) else 0)
        return self.exit_code

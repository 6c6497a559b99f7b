"""One joiner batch, end to end, whatever consumes the input (faust or confluent-kafka).

For each batch of raw records (both input topics, any partitions):

1. decode and validate; malformed messages -> ``<topic>.dlq`` with the reason;
2. join per partition (pure logic, ``engine.py``);
3. append the batch's joined clicks to the users' histories in Redis, then attach to every emitted
   sample the user's clicked items *before its impression time* (one pipeline). A sample is emitted
   once event time has passed its impression (at its click, or at window expiry), so the clicks
   before it have been seen even when a replay consumes the two topics far apart; the ``< ts``
   filter keeps its own and later clicks out;
4. write samples (Arrow IPC) to ``samples`` partition p, each message with p's join watermark in a header
   (``stream/samples.py``: the batch's last message the watermark after it, the others the one before), late/orphan
   clicks to ``late_clicks``, counts
   and joined clicks to Redis; wait until the broker acknowledged every message;
5. write the batch's state chunks (``state_log.py``) and wait for their acknowledgement.

The driver acknowledges / commits the input offsets only after :meth:`JoinPipeline.process`
returns, so committed offsets never run ahead of durable state, and the state never claims a sample
that is not durable. A crash between 4 and 5 re-emits that batch's samples: duplicates carry the
same impression id, and the learner drops them. Their labels are the first run's unless the re-run's batch holds
more of the input: a click later than ``allowed_lateness`` that the first run took as late may then join (its
delayed positive is new to the learner), or the reverse; no broker transactions tie a batch's cut to its output.

Failures (``stream/strikes.py``): an unexpected exception in a batch gives each of its messages a
strike and propagates (the driver stops without committing); a message with strikes is processed
alone, and after ``poison_after`` failures in a row it is dead-lettered (kind ``poison``); a suspect loses its
strikes when the :meth:`~JoinPipeline.process` call that joined or dead-lettered it returns, not before. A sample
too large for one Kafka message goes to ``samples.dlq`` (kind ``too_large``, with the watermark header of its batch's
messages before the last) instead of failing the producer. Redis degraded: the batch fails and is retried from the
last commit (history is part of what a batch makes durable); no strikes are given for it. Day counts are not: they are
aggregated for ``counts_flush_s`` and written by a writer thread while the batches go on (a SIGKILL loses at most that
much counting; a batch's exception in either driver writes them before the exit); a failed write fails the batch
that finds it, and its counts stay for the next flush, which retries it as it was under its write id before writing
what came since: a write whose reply was lost after Redis ran it is counted once (``stream/counts.py``, "Retries";
``stream/joiner/day_counts.py``). A batch's own counts join that buffer only once its state is durable: a failed
batch is done again, and is counted once. So do its counts in the summary and the ``streamrec_join_*`` counters
(``stream/joiner/totals.py``; the failed tries in ``batches_failed``).

Message size: at start the pipeline learns what each topic it writes to takes (``kafka_limits.message_limits``: the
topic's ``max.message.bytes`` by DescribeConfigs, the producer's ``message.max.bytes``, the smaller): samples, state,
late clicks and the dead-letter topics. It cuts samples messages and state parts under it (``sample_bytes``,
``state_bytes``), so a limit below the 900 kB it writes by default costs more, smaller messages, not failures; dead
letters are cut under theirs by ``stream/dlq.py`` (``dlq.value_truncated_from``); below ``MIN_MESSAGE_BYTES`` it is a
ConfigError at start. One sample alone over it is dead-lettered (``too_large``), and so is one impression whose join
state alone is over it, in the batch that finds it, its record taken out of the batch's join (its clicks are
reported as orphans; ``JoinPipeline._join_partition``), and a late click's record over it (possible only with ids
far longer than the ``[limits]`` default allow). A message refused as too large all the same is a
:class:`~stream.errors.MessageLimitError` (a ConfigError: the worker stops, exit 2, naming the topic and the setting),
neither an outage nor the batch's fault: it was sized under the learned limit, so the broker's limit is lower than
what it reported (not readable, or lowered since); a samples message holds the work of many good records, which
strikes would dead-letter, and a retry (it was a DeliveryFailed: an outage) sends the same message again and rewound
the worker for ever. That holds for every topic it writes, a dead letter's and a late click's too.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from itertools import compress, groupby, islice, repeat
from operator import attrgetter, is_, itemgetter

import numpy as np
import orjson
from confluent_kafka import KafkaException, TopicPartition

from stream.config import KafkaSettings, RedisSettings
from stream.counts import DailyCounts
from stream.dlq import DeadLetters
from stream.errors import (
    BadMessage,
    ConfigError,
    MessageTooLarge,
    PartitionLost,
    PartitionMissing,
    StreamError,
    close_after_error,
    quoted,
    shown,
)
from stream.event_batch import decode_events
from stream.events import Click, Impression, decode_click, decode_impression
from stream.history import UserHistory
from stream.idle_clock import IdleClock
from stream.joiner import metrics as m
from stream.joiner.backpressure import CLICKS, IMPRESSIONS, Behind, Key, click_room, hold_limits, input_of
from stream.joiner.config import JoinerSettings, check_late_clicks_topic
from stream.joiner.day_counts import DayCountsWriter
from stream.joiner.engine import CLICKS as CLICK_INPUT
from stream.joiner.engine import IMPRESSIONS as IMPRESSION_INPUT
from stream.joiner.engine import BatchResult, JoinConfig, PartitionJoin, Pending, Sample
from stream.joiner.gc_pacing import GcPacing
from stream.joiner.partitions import Layout, ensure_layout
from stream.joiner.records import Event, Groups, Held, Record, kept_headers, nth_good
from stream.joiner.sample_rows import batches_later
from stream.joiner.state_log import (
    MAX_RECORD_BYTES,
    chunk_key,
    claim_key,
    claimed_top,
    encode_chunk,
    load_chunks,
    next_claim,
    state_topic,
)
from stream.joiner.totals import JoinTotals
from stream.kafka import new_consumer
from stream.kafka_limits import message_limits, raise_limit, refused_as_too_large, usable_bytes
from stream.kafka_producer import AckedProducer
from stream.kafka_topics import ensure_topics, topic_identities
from stream.keyspace import KeyspaceWatch
from stream.limits import DEFAULT_LIMITS, EventLimits
from stream.redis_client import DEFAULT_TIMEOUT_S, connect, eviction_advice, scaled_timeout_s
from stream.samples import DELAYED_POSITIVE, watermark_header
from stream.strikes import RedisStrikes, Strikes, is_infrastructure

log = logging.getLogger("streamrec.join")

_ENGINE_INPUT = {IMPRESSIONS: IMPRESSION_INPUT, CLICKS: CLICK_INPUT}  # backpressure's input names -> the engine's
MIN_MESSAGE_BYTES = 6144  # the least limit the joiner writes under (its samples messages and state parts ~5 kB)


# The largest reply a joiner batch reads is its history read: up to batch_max distinct users, each up to 4 x
# history_len entries. At the defaults (5,000 users x 200 entries, ~15 MB) it took 1.5 s on a loaded 2-core machine
# against a local Redis, within DEFAULT_TIMEOUT_S (5 s) bounding the whole reply; settings that allow a larger reply
# give every reply a timeout grown in proportion, so that a healthy batch is never failed for its size.
_HISTORY_ENTRIES_PER_TIMEOUT = 5_000 * 200


def _redis_timeout_s(batch_max: int, max_len: int) -> float:
    """The joiner's Redis timeout (each whole reply): DEFAULT_TIMEOUT_S, longer where a batch's history read may be
    larger than the defaults allow."""
    return scaled_timeout_s(DEFAULT_TIMEOUT_S, batch_max * max_len, _HISTORY_ENTRIES_PER_TIMEOUT)


class StateTooLarge(StreamError):
    """A part of a join state chunk that is not one impression is over what the state topic takes (a guard: the ids
    it could hold are bounded by the ``[limits]``, far below the least limit the joiner starts with). The batch fails
    and its records get strikes. One impression whose state alone is too large is no such failure: it is dead-lettered
    in the batch (``JoinPipeline._join_partition``)."""


_USER_ID, _ITEM_ID = attrgetter("user_id"), attrgetter("item_id")
_TS_OF = attrgetter("ts")  # of an event or a Pending
_PENDING, _USER = attrgetter("pending"), attrgetter("user")  # of a Sample; of a Pending
_LABEL, _KIND = attrgetter("label"), attrgetter("kind")  # of a Sample
_TOPIC, _OFFSET, _KEY, _VALUE, _STAMP = itemgetter(0), itemgetter(2), itemgetter(3), itemgetter(4), itemgetter(5)
_TOPIC_PARTITION = itemgetter(0, 1)  # of a Record
_HEADERS = itemgetter(6)  # of a Record


def awake_clock(js: JoinerSettings) -> IdleClock:
    """The time the joiner ran, stalls left out (``stream/idle_clock.py``): ``click_idle_s`` counts on it. On the wall
    clock a stall (SIGSTOP, a long GC pause, a paused VM) counted as click idleness, and the first batch after it that
    brought impressions only closed windows whose clicks were written meanwhile, unread yet (they went late). The
    drivers tick it every round; a gap between two ticks over a driver round (``batch_within_s`` + 2 s) counts as one
    such round, no more, so a click input quiet while the process runs still becomes idle, also where every round is
    that slow (a backlog's big batches, a slow broker or Redis; counted as nothing, such rounds never made it idle)."""
    return IdleClock(js.batch_within_s + 2.0, js.batch_within_s + 2.0)


class _Step:
    """One partition's part of a batch between its join and its samples (``JoinPipeline._apply_all``)."""

    __slots__ = ("batches", "histories", "partition", "res", "watermarks", "_read")

    def __init__(self, partition: int, res: BatchResult,
                 read: Callable[[], tuple[np.ndarray, np.ndarray]] | None,
                 watermarks: tuple[int | None, int | None] = (None, None)) -> None:
        self.partition, self.res, self._read = partition, res, read
        self.watermarks = watermarks  # the partition's join watermark before and after the batch (samples' headers)
        self.histories: tuple[np.ndarray, np.ndarray] | None = None
        self.batches: Callable[[tuple[np.ndarray, np.ndarray] | None], list[bytes]] = lambda _histories: []

    def collect(self, quiet: bool = False) -> None:
        """The samples' histories from the read in flight (once); ``quiet``: a failure is dropped (the batch is
        failing already, for another reason)."""
        read, self._read = self._read, None
        if read is None:
            return
        try:
            self.histories = read()
        except Exception:
            if not quiet:
                raise


def running_check_timeout_s(kafka: KafkaSettings) -> float:
    """The bound on each broker call of the running topic-id check (:meth:`JoinPipeline.check_topics`, ``regressed``):
    a third of the group's session timeout, 10 s at most. The faust driver asks on its event loop, where the
    consumer's heartbeats run too: 2 x 10 s on a slow broker (the default timeout) outlasted the default 6 s session,
    and the member was evicted at every check. A broker slower than this is not asked (said once, as a broker that
    cannot give the ids); the restore's own ask at each assignment keeps the full timeout."""
    return min(10.0, kafka.session_timeout_ms / 3000)


class JoinPipeline:
    """The per-partition join state of one worker process and the batch step around it."""

    def __init__(self, kafka: KafkaSettings, redis_settings: RedisSettings, js: JoinerSettings,
                 limits: EventLimits = DEFAULT_LIMITS) -> None:
        check_late_clicks_topic(kafka, js.late_clicks_topic)
        self.kafka, self.js, self.limits = kafka, js, limits
        self.cfg = JoinConfig(
            window_ms=int(js.attribution_window_s * 1000), lateness_ms=int(js.allowed_lateness_s * 1000),
            late_retention_ms=int(js.late_retention_s * 1000), history_len=redis_settings.history_len,
            watermark_quorum=js.watermark_quorum, max_pending=js.max_pending_per_partition,
            max_waiting=js.max_waiting_per_partition, policy=js.emission.value, elapsed_ms=int(js.elapsed_s * 1000),
        )
        # Credentials and TLS from [redis]; one PING and one script first, so refused credentials or scripting end the
        # worker at start with one line (RedisAuthError) instead of failing every batch. The timeout bounds each whole
        # reply (stream/redis_deadline.py): a Redis trickling its replies fails the batch into its rewind and retry
        # instead of holding it for as long as it trickles (tests/integration/test_faults.py); _redis_timeout_s sizes
        # it.
        timeout_s = _redis_timeout_s(js.batch_max, 4 * redis_settings.history_len)
        self.redis = connect(redis_settings, timeout_s=timeout_s, check=True, whole_reply=True)
        advice = eviction_advice(self.redis, redis_settings, "the joiner's day counts, user click histories and poison "
                                 "strikes")
        if advice:
            log.warning("%s", advice)
        self.strikes = Strikes(RedisStrikes(self.redis, f"{redis_settings.prefix}:strikes:{js.app_id}"),
                               js.poison_after)
        # a counts write (one MULTI/EXEC) bounded as a whole, as one reply is: a trickling Redis fails the flush, and
        # the batch that finds it rewinds, within the timeout
        counts = DailyCounts(self.redis, prefix=redis_settings.prefix, ttl_days=redis_settings.counts_ttl_days,
                             future_s=limits.future_ts_s, write_timeout_s=timeout_s)
        # Redis keeps more than history_len clicks per user: a sample emitted up to a window after its
        # impression still finds the clicks before it when the user clicked more in between.
        self.history = UserHistory(self.redis, prefix=redis_settings.prefix, max_len=4 * redis_settings.history_len,
                                   ttl_days=redis_settings.history_ttl_days)
        # the day counts, written by a thread beside the batches; Redis emptied under us is checked after each write
        self.day_counts = DayCountsWriter(counts, KeyspaceWatch(self.redis, redis_settings.prefix), js.counts_flush_s)
        self.producer = AckedProducer(kafka, **{"linger.ms": 5, "message.max.bytes": max(js.max_sample_bytes + 65_536,
                                                                                      1_000_000)})
        self.engines: dict[int, PartitionJoin] = {}
        self.totals = JoinTotals()
        self.state_topic = state_topic(js.app_id)
        self._parts: dict[tuple[int, int], int] = {}  # (partition, seq) -> records of that chunk
        # (partition, input) -> (topic id in the state log, id now): a change _follow_topics said (once per change)
        self._followed: dict[tuple[int, int], tuple[str, str]] = {}
        # (input topic, partition) a restore found made again and read from its first record: where the group's
        # committed offset is the old topic's, the driver must start that input there too (kafka_driver._started_over)
        self.started_over: set[tuple[str, int]] = set()
        # (input topic, partition) -> its engine's offset when the topic's id was last asked (a restore, or a
        # regression: ``regressed``): records below it coming again are that same replay, not asked about again
        self._ids_asked: dict[tuple[str, int], int] = {}
        self._topics_next = time.monotonic() + js.topic_check_s  # when check_topics asks the inputs' ids next
        self._last_click: dict[int, float] = {}  # partition -> awake time a click (or the partition) was last seen
        self.awake = awake_clock(js)  # the time this process ran, stalls left out: click_idle_s counts on it
        # Partitions whose click input the driver holds back (backpressure.py): held is not idle, or impressions
        # alone would advance event time past clicks that are merely unread.
        self.clicks_held: set[int] = set()
        # The records process() last held back (the list it returned) and, per topic-partition, each with its event:
        # passed again ahead of the next batch, they are neither decoded nor walked again (_join).
        self._held_list: list[Record] = []
        self._held_groups: dict[tuple[str, int], Held] = {}
        self._held_before: dict[tuple[str, int, int], Event] = {}
        # Per topic-partition, how many records the last process() returned held (what the driver pauses on).
        self.held_counts: dict[tuple[str, int], int] = {}
        # Per topic-partition, the offset after the last record process() processed (joined or dead-lettered): what
        # the driver may commit once process() returned.
        self.processed: dict[tuple[str, int], int] = {}
        self._reached: dict[Key, int | None] = {}  # each input's time over what was joined and held (_hold)
        # The suspects joined (or dead-lettered) by the process() call in progress: they lose their strikes only once
        # it returns, the driver committing all of it, so a poison message dead-lettered before a later run fails
        # keeps them, and is dead-lettered again when it is read again, instead of starting over (_process_run).
        self._joined_suspects: list[tuple[str, int, int]] = []
        # The batch in progress's impression records per partition (offset order): what an impression whose join
        # state is too large is dead-lettered as (_state_too_large).
        self._batch_records: dict[int, list[Record]] = {}
        dlq_topics = [kafka.dlq_topic(t) for t in (kafka.impressions_topic, kafka.clicks_topic, kafka.samples_topic,
                                                   js.late_clicks_topic)]
        # The inputs co-partitioned, the outputs written by partition number as many (stream/joiner/partitions.py)
        outputs = [kafka.samples_topic, js.late_clicks_topic]
        self.layout = Layout(kafka, outputs, self.state_topic, ensure_layout(kafka, outputs, self.state_topic))
        ensure_topics(kafka, dlq_topics)
        # What each topic this worker writes to takes (module docstring, "Message size"), and the bounds its samples
        # messages, state parts and late clicks are cut to or checked against; the dead letters' are DeadLetters'.
        self.message_limits = message_limits(kafka, [kafka.samples_topic, self.state_topic, js.late_clicks_topic,
                                                     *dlq_topics],
                                             self.producer.max_message_bytes, self.producer.max_message_setting)
        for topic, limit in self.message_limits.items():
            if limit.bytes < MIN_MESSAGE_BYTES:
                raise ConfigError(f"topic {topic} takes records of at most {limit.bytes} bytes ({limit.source}); the "
                                  f"joiner needs at least {MIN_MESSAGE_BYTES}: {raise_limit(topic, limit)}")
        self.sample_bytes = min(js.max_sample_bytes, usable_bytes(self.message_limits[kafka.samples_topic].bytes))
        self.state_bytes = min(MAX_RECORD_BYTES, usable_bytes(self.message_limits[self.state_topic].bytes))
        self.late_click_bytes = usable_bytes(self.message_limits[js.late_clicks_topic].bytes)
        self.dead_letters = DeadLetters(kafka, self.producer, {t: self.message_limits[t] for t in dlq_topics})
        # Last: it changes the process's collector, which only close() gives back; taken before a check above that
        # raised, it stayed paced (no automatic full collection) for the rest of the process (a test worker's too)
        self.gc = GcPacing(js.gc_every_s)

    def close(self) -> None:
        """The last flush of the day counts, then Redis and the writer closed. A write in flight that failed on an
        outage gets the one retry a next flush would give it (under its write id, with the counts buffered since);
        only a failure of that last flush is raised (it used to lose both at the first, with every batch durable). Redis
        is closed whatever the flush raised (it was left open, its connections with it), the flush's error raised."""
        try:
            try:
                self.day_counts.flush_last()
            except BaseException:
                close_after_error(self.redis.close, "closing the joiner's Redis client", log)
                raise
            self.redis.close()
        finally:
            self.day_counts.shutdown()
            self.gc.close()

    # -- partitions ----------------------------------------------------------------------------
    def restore(self, partitions: set[int], say_lost: bool = True, reloaded: dict[int, int] | None = None) -> None:
        """Load the joins of ``partitions`` not held yet from the state log (one read for all); ``say_lost``: log
        those that have no state but committed input (:meth:`_say_lost_state`). ``reloaded``: partitions this owner
        held and reads again (:meth:`_reload`), with the seq its next chunk takes: its claim stands and none is written
        (a claim written in the batch of an owner that stalled past its session fenced off the new owner's chunks and
        let its own through), and where another owner has restored the partition since it is :class:`PartitionLost`,
        before anything is written."""
        missing = sorted(p for p in partitions if p not in self.engines)
        if not missing:
            return
        # what their previous owner struck before it stopped, less what the group committed past (stream/strikes.py)
        self.strikes.reload(missing, self._committed)
        t0 = time.monotonic()
        empty: list[int] = []
        restored: dict[int, PartitionJoin] = {}
        # which input topics the restored offsets must be of (_follow_topics): asked once per restore
        inputs = (self.kafka.impressions_topic, self.kafka.clicks_topic)
        ids = topic_identities(self.kafka, inputs)  # one admin client, one round trip for both
        now = [ids[t].get("topic_id") for t in inputs]
        for partition, plog in load_chunks(self.kafka, self.state_topic, missing).items():
            chunks, parts, incomplete = plog.chunks, plog.parts, plog.incomplete
            start = (reloaded or {}).get(partition)
            if start is not None and start <= claimed_top(plog):
                raise PartitionLost(f"partition {partition} was restored by another member since this one's last "
                                    f"chunk (its chunk {start} is used or fenced off in {self.state_topic}): this one "
                                    "stalled past its session; its batch is not written")
            self._parts.update({(partition, seq): n for seq, n in parts.items() if seq not in incomplete})
            # A chunk left incomplete by a stop is removed (a seq written again later writes its own parts after this)
            for seq in incomplete:
                for part in range(parts[seq]):
                    self.producer.send(self.state_topic, None, chunk_key(partition, seq, part), partition=partition)
            for seq, numbers in plog.fenced_out.items():  # a stale owner's chunk: removed as well
                for part in numbers:
                    self.producer.send(self.state_topic, None, chunk_key(partition, seq, part), partition=partition)
            eng = PartitionJoin.restore(partition, self.cfg, chunks)
            self._check_emission(eng, plog.emission)
            again = self._follow_topics(eng, now, plog.followed)
            self._ids_asked.update(((inputs[kind], partition), eng.offsets[kind]) for kind in (0, 1))
            if start is None:  # a reload's input is read on from where the batch is: no start over of the reader
                self.started_over.update((inputs[kind], partition) for kind in again)
            # This owner's claim, durable before its first chunk (the flush below): the seqs a stale owner would
            # write next are fenced off, and this one's chunks start past them (state_log.py, "Fencing")
            if start is None:
                claim, start = next_claim(plog, (now[0], now[1]), self.cfg.emission())
                self.producer.send(self.state_topic, claim, claim_key(partition), partition=partition)
            eng.continue_at(start)
            restored[partition] = eng
            if chunks:
                log.info("partition %d: restored %d pending impressions from %d state chunks (offsets %s)",
                         partition, len(eng.pending), len(chunks), eng.offsets)
            elif not incomplete and not plog.fenced_out:
                empty.append(partition)
        self.producer.flush()  # the claims (and removals) durable, or no partition is restored: asked again
        self.engines.update(restored)
        if empty and say_lost:
            self._say_lost_state(empty)
        self.totals.stage_s["restore"] += time.monotonic() - t0

    def _check_emission(self, eng: PartitionJoin, was: dict[str, int | str]) -> None:
        """A ConfigError naming both where ``eng``'s state holds impressions pending and was written under other
        emission settings (``was``, its claim's: ``JoinConfig.emission``; those it does not record are taken as this
        joiner's). The restore takes what its watermark passed under this joiner's settings as emitted: a wait
        impression as emitted by fake_negative (no sample), a fake_negative one by wait (two); an es_dfm impression
        past a shorter elapsed time as observed (no sample) and one before a longer one as not (its click an observed 1
        after its observed 0: the learner drops it as the same sample); one closed by a shorter window or lateness
        without its negative, and one a longer window holds open again twice. (The newest impression is pending
        whatever the settings, its time ahead of the watermark; only a drain closes every one, under the settings of
        then, and a longer window opens them again.)"""
        now = self.cfg.emission()
        changed = [k for k, v in was.items() if now.get(k, v) != v]
        if not changed or not eng.pending:
            return
        names = {"policy": "emission", "window_ms": "attribution_window_s", "lateness_ms": "allowed_lateness_s",
                 "elapsed_ms": "elapsed_s"}

        def shown_as(k: str, v: int | str) -> str:
            return repr(v) if k == "policy" else f"{int(v) / 1000:g}"

        said = ", ".join(f"{names[k]} = {shown_as(k, was[k])}" for k in changed)
        runs = ", ".join(f"{names[k]} = {shown_as(k, now[k])}" for k in changed) if len(changed) > 1 else \
            shown_as(changed[0], now[changed[0]])
        raise ConfigError(
            f"partition {eng.partition}'s join state ({self.state_topic}) was written under [joiner] {said}, and this "
            f"joiner runs {runs}: its pending impressions would be labelled wrong or lost. Run it with the settings it "
            "was written under, or change them under a new app_id (--app-id) and let the old one drain (`streamrec "
            "join --exit-when-idle N --drain`)")

    def _follow_topics(self, eng: PartitionJoin, now: list[str | None], followed: tuple[str | None, str | None]
                       ) -> list[int]:
        """Each input of ``eng`` read from its first record where its restored offsets are of another topic than the
        one of that name ``now`` (ids as ``kafka_topics.topic_identity`` gives them): deleted and created again since
        (or another cluster), its records up to the old offset were skipped as redelivered, in silence. Said as an
        ERROR naming both ids and counted; a chunk without an id (written before) or a broker that gives none keeps
        the offsets. The ids now are what the partition's next chunks record. A change this pipeline said already is
        followed in silence: a reload (:meth:`_reload`) before the partition's first new chunk finds the old id again
        (it was said and counted once more).

        The strikes of that input partition go too, here and in Redis (keyed by topic name and offset, they were the
        old topic's: its poisoned offset dead-lettered the new topic's record there unread), unless ``followed``, the
        ids of the partition's claim, says an owner since the change did so: a poison record of the new topic failing
        before the partition's first new chunk then kept its strikes at every restart instead of starting over.
        Returns the inputs (0 impressions, 1 clicks) read from their first record."""
        again = []
        for kind, (was, new) in enumerate(zip(eng.topic_ids, now, strict=True)):
            if was and new and was != new:
                if self._followed.get((eng.partition, kind)) != (was, new):
                    self._say_topic_changed(eng, kind, was, new)
                if followed[kind] != new:
                    topic = (self.kafka.impressions_topic, self.kafka.clicks_topic)[kind]
                    self.strikes.settle({(topic, eng.partition): 1 << 63})  # every offset of the old topic
                eng.start_over(kind, new)
                again.append(kind)
            elif new:
                eng.topic_ids[kind] = new
        return again

    def take_started_over(self) -> set[tuple[str, int]]:
        """``started_over``, emptied, each input said once (WARNING): the driver reads them from their first record."""
        again, self.started_over = self.started_over, set()
        for topic, partition in sorted(again):
            log.warning("%s partition %d was deleted and created again: reading it from its first record", topic,
                        partition)
        return again

    def below_applied(self, records: list[Record]) -> set[tuple[str, int]]:
        """The input topic-partitions of ``records`` (runs of one topic-partition, offsets ascending) whose first record
        is at or below what their engine in memory applied: read again, or of a topic made again under the running
        consumer (its fetch position reset to the new topic's first offset), whose records the engine would skip as
        redelivered, in silence. One comparison per run; for :meth:`regressed`."""
        inputs = (self.kafka.impressions_topic, self.kafka.clicks_topic)
        out = set()
        for (topic, partition), run in groupby(records, _TOPIC_PARTITION):
            eng = self.engines.get(partition)
            if eng is not None and topic in inputs and next(run).offset <= eng.offsets[inputs.index(topic)]:
                out.add((topic, partition))
        return out

    def regressed(self, topic_partitions: set[tuple[str, int]]) -> None:
        """Input partitions read again below what their engine in memory applied, while the consumer ran (no restore,
        whose topic-id check ran at the assignment): a topic deleted and made again under it. The inputs' topic ids are
        asked (one admin client, once per regression: not again while the engine's offset stays where it was asked,
        a restore's replay included), and an input whose id changed is started over as a restore does
        (:meth:`_follow_running`). A partition not restored yet is left to its restore."""
        inputs = (self.kafka.impressions_topic, self.kafka.clicks_topic)
        asked = {tp for tp in topic_partitions if tp[0] in inputs and tp[1] in self.engines
                 and self._ids_asked.get(tp) != self.engines[tp[1]].offsets[inputs.index(tp[0])]}
        if asked:
            self._follow_running({p for _, p in asked})

    def topics_due(self) -> bool:
        """Whether :meth:`check_topics` would ask the broker now: ``topic_check_s`` passed, and a partition is held."""
        return bool(self.engines) and time.monotonic() >= self._topics_next

    def check_topics(self) -> None:
        """Every ``topic_check_s`` (a driver calls it before each batch; it asks nothing in between): the input
        topics' ids asked once for every partition held, an input made again under the running consumer started over
        as :meth:`regressed` does. Its records below the consumer's position of the old topic never come (a fetch past
        a partition's end brings nothing on the local broker, and no out-of-range reset), and those past it were
        joined with the new topic's first records missing, in silence; read again from the first record, what was
        joined already is skipped as the duplicate it is (its impression id pending or finalized)."""
        if not self.topics_due():
            return
        self._topics_next = time.monotonic() + self.js.topic_check_s
        self._follow_running(set(self.engines))

    def _follow_running(self, partitions: set[int]) -> None:
        """The inputs' ids asked once (one admin client), each input of ``partitions`` whose id changed started over:
        ``_follow_topics`` (said, counted, strikes and offset gone), its held records (the old topic's) dropped, and
        put in ``started_over`` for the driver to commit its first offset and read it from there."""
        inputs = (self.kafka.impressions_topic, self.kafka.clicks_topic)
        ids = topic_identities(self.kafka, inputs, running_check_timeout_s(self.kafka))
        now = [ids[t].get("topic_id") for t in inputs]
        for partition in sorted(partitions):
            eng = self.engines[partition]
            again = {(inputs[kind], partition) for kind in self._follow_topics(eng, now, (None, None))}
            self._ids_asked.update(((inputs[kind], partition), eng.offsets[kind]) for kind in (0, 1))
            if again:
                self.drop_held(again)
                self.started_over |= again

    def _say_topic_changed(self, eng: PartitionJoin, kind: int, was: str, new: str) -> None:
        """The ERROR and the count of :meth:`_follow_topics` for input ``kind`` of ``eng``, remembered as said."""
        self._followed[eng.partition, kind] = (was, new)
        topic = (self.kafka.impressions_topic, self.kafka.clicks_topic)[kind]
        log.error("partition %d: the state log %s holds offsets (up to %d) of %s topic %r with topic id %s, "
                  "and %r now has topic id %s: it was deleted and created again (or this is another cluster). "
                  "Reading it from its first record; the join state (pending impressions, waiting clicks) is "
                  "kept, keyed by impression id", eng.partition, self.state_topic, eng.offsets[kind],
                  (IMPRESSIONS, CLICKS)[kind], topic, was, topic, new)
        m.TOPIC_CHANGED.labels((IMPRESSIONS, CLICKS)[kind]).inc()

    def _committed(self, partitions: list[int]) -> dict[tuple[str, int], int]:
        """The group's committed offsets of both inputs of ``partitions`` (none where it has none); empty when the
        broker cannot say now (the strikes below them are dropped at a later assignment instead)."""
        got = self._group_offsets(partitions, "to drop the strikes below them", logging.WARNING)
        return {} if got is None else got

    def _group_offsets(self, partitions: list[int], purpose: str, level: int) -> dict[tuple[str, int], int] | None:
        """``(topic, partition) -> offset`` the group has committed on both inputs of ``partitions`` (none where it has
        none); None, logged at ``level`` with ``purpose``, when the broker cannot say now."""
        topics = (self.kafka.impressions_topic, self.kafka.clicks_topic)
        try:
            consumer = new_consumer(self.kafka, self.js.app_id)  # asks the group's offsets; joins nothing
            try:
                got = consumer.committed([TopicPartition(t, p) for p in partitions for t in topics], timeout=10)
            finally:
                consumer.close()
        except KafkaException as exc:
            log.log(level, "could not read the committed offsets of group %s %s: %s", self.js.app_id, purpose,
                    quoted(str(exc)))
            return None
        return {(tp.topic, tp.partition): tp.offset for tp in got if tp.offset >= 0}

    def _say_lost_state(self, partitions: list[int]) -> None:
        """Partitions without any state chunk: new ones, or ones whose state was lost (the state topic deleted or
        emptied) while the group's committed offsets were kept. The second is said, loudly: the join goes on from
        the committed offsets, and the impressions before them that were still in their window are gone."""
        topics = (self.kafka.impressions_topic, self.kafka.clicks_topic)
        got = self._group_offsets(partitions, "(a diagnosis only: the restore goes on)", logging.DEBUG)
        if got is None:
            return
        committed = {tp: offset for tp, offset in got.items() if offset > 0}
        for p in partitions:
            imps, clicks = committed.get((topics[0], p)), committed.get((topics[1], p))
            if imps is None and clicks is None:
                continue
            log.error(
                "partition %d: the state log %s holds nothing for it, yet group %s has committed its input up to "
                "impressions offset %s, clicks offset %s: its join state was lost (the state topic deleted or "
                "emptied?). Joining goes on from those offsets; the impressions before them that were still in their "
                "window get no further sample (under wait and window none at all, under fake_negative and es_dfm no "
                "delayed positive) and clicks on them are reported as orphans. To join them again, reset the group's "
                "offsets of partition %d on both inputs to an attribution window before them (the samples already out "
                "come again; the learner drops the repeats it remembers). If every record before those offsets was "
                "dead-lettered, nothing was lost.", p, self.state_topic, self.js.app_id,
                "(none)" if imps is None else imps, "(none)" if clicks is None else clicks, p)

    def forget(self, partitions: set[int]) -> None:
        """Drop the in-memory state of revoked partitions (it is durable in the state log), and their gauges."""
        self._held_groups = {tp: h for tp, h in self._held_groups.items() if tp[1] not in partitions}
        self._held_list = []  # what the driver passes again is not that list any more
        self.held_counts = {tp: n for tp, n in self.held_counts.items() if tp[1] not in partitions}
        self._reached = {k: t for k, t in self._reached.items() if k[1] not in partitions}
        # a restore that failed after finding them made again: their next owner starts them over, not this member
        self.started_over = {tp for tp in self.started_over if tp[1] not in partitions}
        self._ids_asked = {tp: o for tp, o in self._ids_asked.items() if tp[1] not in partitions}
        self.strikes.forget(partitions)
        for p in partitions:
            self.engines.pop(p, None)
            self._last_click.pop(p, None)
            for key in [k for k in self._parts if k[0] == p]:
                del self._parts[key]
        m.forget(partitions)

    def waiting(self) -> dict[int, int]:
        """Per held partition, the impression ids whose clicks wait for their impression (backpressure.py)."""
        return {p: len(e.waiting) for p, e in self.engines.items()}

    def input_times(self) -> dict[int, tuple[int | None, int | None]]:
        """Per held partition, the (impressions, clicks) event time the engine has seen, or read when records
        were held back since (backpressure.py)."""
        def newest(*ts: int | None) -> int | None:
            known = [t for t in ts if t is not None]
            return max(known) if known else None

        return {p: (newest(e.topic_max[0], self._reached.get((IMPRESSIONS, p))),
                    newest(e.topic_max[1], self._reached.get((CLICKS, p)))) for p, e in self.engines.items()}

    # -- the batch step ------------------------------------------------------------------------
    def process(self, records: list[Record], behind: Behind | None = None) -> list[Record]:
        """Join one batch and make its outputs and state durable; see the module docstring for failures.

        With ``behind`` (whether an input of a partition has more to read, ``stream.kafka.has_more``), the
        batch is joined only up to its event-time frontier (:func:`~stream.joiner.backpressure.hold_limits`), and a
        partition's clicks only as far as its waiting cap has room (:func:`~stream.joiner.backpressure.click_room`):
        the records past them are returned unprocessed, a suffix of each topic-partition's records, for the
        caller to pass again with its next batch (what is not passed again is dropped). Without it every record is
        processed and none returned. :meth:`process_new` is the same step for a caller that does not pass them again.
        """
        self.totals.stage_s["gc"] += self.gc.between_batches()
        self.processed = {}
        self._joined_suspects = []
        held = self._held_groups
        n = sum(map(len, held.values()))
        # What was held, passed again ahead of new records (a list compare: identity first, in C)?
        if not self.strikes.counts and n <= len(records) and records[:n] == self._held_list:
            self._held_before = {}
            self._process_run(records[n:], behind)
        else:
            # Otherwise held records come back mixed with others (or not at all): found by their offsets.
            self._held_before = {(r.topic, r.partition, r.offset): e for h in held.values()
                                 for r, e in zip(*h.held(), strict=True)}
            self._held_groups = {}
            self._process_runs(records, behind)
        self._count_held()
        self._held_list = self._held_records()
        self._clear_joined_suspects()
        return self._held_list

    def process_new(self, records: list[Record], behind: Behind | None = None) -> None:
        """:meth:`process` for a caller that keeps nothing: the records held back last time come first without being
        passed again (each costs nothing per batch it waits), then ``records``, all new. What stays held is counted
        in ``held_counts``; :meth:`drop_held` and :meth:`forget` drop it (revoked, rewound)."""
        if self.strikes.counts:  # suspects go alone: the general path, with what was held passed first
            self.process(self._held_records() + records, behind)
            return
        self.totals.stage_s["gc"] += self.gc.between_batches()
        self.processed = {}
        self._joined_suspects = []
        self._held_before = {}
        self._process_run(records, behind)
        self._count_held()
        self._clear_joined_suspects()

    def _clear_joined_suspects(self) -> None:
        """The strikes of the suspects the call that returns now joined or dead-lettered: all of it is processed."""
        if self._joined_suspects:
            self.strikes.succeeded(self._joined_suspects)
            self._joined_suspects = []

    def _held_records(self) -> list[Record]:
        """Every record held now, per topic-partition in offset order."""
        return [r for h in self._held_groups.values() for r in h.records[h.lo:]]

    def drop_held(self, topic_partitions: set[tuple[str, int]]) -> None:
        """Forget the records held of ``topic_partitions`` (revoked: the next owner reads them)."""
        self._held_groups = {tp: h for tp, h in self._held_groups.items() if tp not in topic_partitions}
        self._held_list = []
        self._count_held()

    def _count_held(self) -> None:
        for h in self._held_groups.values():
            h.compact()
        self._held_groups = {tp: h for tp, h in self._held_groups.items() if len(h)}
        self.held_counts = {tp: len(h) for tp, h in self._held_groups.items()}
        if (now := sum(self.held_counts.values())) > self.totals.counts["held_peak"]:
            self.totals.counts["held_peak"] = now
        by_input: Counter[str] = Counter()
        for (kind, _), n in self.held_per_input().items():
            by_input[kind] += n
        m.held(by_input)

    def held_per_input(self) -> dict[Key, int]:
        """``held_counts`` per (input, partition) (``backpressure.py``'s keys): what a driver's hold bounds pause on."""
        return {(input_of(self.kafka, topic), p): n for (topic, p), n in self.held_counts.items()}

    def _process_runs(self, records: list[Record], behind: Behind | None) -> None:
        """``records`` joined in runs: suspects (messages of a batch that failed before) go alone, in order, so the one
        that fails again is known exactly and its neighbours are not blamed."""
        if not self.strikes.counts:
            self._process_run(records, behind)
            return
        run: list[Record] = []
        for r in records:
            if self.strikes.suspect((r.topic, r.partition, r.offset)):
                if run:
                    self._process_run(run, behind)
                    run = []
                self._process_run([r], behind)
            else:
                run.append(r)
        if run:
            self._process_run(run, behind)

    def _process_run(self, records: list[Record], behind: Behind | None) -> None:
        """``records`` joined after what is held, or each given a strike (with the held records it would have been
        joined with). What is joined of a topic-partition stays a prefix of its records: while messages have strikes,
        a topic-partition with records held in this batch keeps the run's records of it held too (a suspect is never
        joined behind a held one), and a run joins only its own topic-partitions."""
        if self.strikes.counts and (holding := {tp for tp, h in self._held_groups.items() if len(h)}):
            keep = [r for r in records if (r.topic, r.partition) in holding]
            if keep:
                self._held_groups_add(keep, self._decode_all(keep))
                records = [r for r in records if (r.topic, r.partition) not in holding]
                if not records:
                    return
        # While messages have strikes a run joins only its own topic-partitions' records: a suspect alone fails alone.
        only = {(r.topic, r.partition) for r in records} if self.strikes.counts else None
        before = {tp: h.snapshot() for tp, h in self._held_groups.items()}
        try:
            with self._batch():  # its counts count once it is durable
                self._join(records, behind, only)
        except Exception as exc:
            held = [r for tp, h in self._held_groups.items() if tp in before and (only is None or tp in only)
                    for r in h.records[before[tp][1]:before[tp][0]]]  # held before this run, joined with it
            for tp in list(self._held_groups):  # undone: the held records are as they were before this run
                if tp in before:
                    self._held_groups[tp].restore(before[tp])
                else:
                    del self._held_groups[tp]
            # A configuration error (a message refused as too large) is no record's fault: no strikes.
            if not is_infrastructure(exc) and not isinstance(exc, ConfigError):
                failed = held + records
                log.error("a batch of %d message(s) failed (%s: %s); each gets a strike, the worker stops without "
                          "committing", len(failed), type(exc).__name__, quoted(str(exc)))
                try:
                    self.strikes.failed([(r.topic, r.partition, r.offset) for r in failed], exc)
                except Exception:  # noqa: BLE001 - the original failure is the one to report
                    log.exception("could not record the strikes")
            raise
        if self.strikes.counts:  # what was joined: a record held (past the frontier, or the cap's room) is not cleared
            done = self.processed  # (cleared once the whole call returns: _joined_suspects)
            self._joined_suspects.extend((r.topic, r.partition, r.offset) for r in records
                                         if r.offset < done.get((r.topic, r.partition), 0)
                                         and self.strikes.suspect((r.topic, r.partition, r.offset)))

    def _decode(self, r: Record) -> Impression | Click:
        reason = self.strikes.poisoned((r.topic, r.partition, r.offset)) if self.strikes.counts else None
        if reason is not None:
            raise BadMessage(reason, kind="poison")
        if r.topic == self.kafka.impressions_topic:
            return decode_impression(r.value, self.limits, r.timestamp, r.key)
        return decode_click(r.value, self.limits, r.timestamp, r.key)

    def _decode_all(self, records: list[Record]) -> list[Event]:
        """Each record's event or why it is bad: a record held last time keeps what it was decoded to then (a bad one
        is dead-lettered only now); the rest are decoded per topic as columns (``stream/event_batch.py``), or one by
        one while messages have strikes (a poisoned one is dead-lettered without decoding)."""
        events: list[Event | None] = [None] * len(records)
        held_before = self._held_before
        if held_before:
            for i, r in enumerate(records):
                events[i] = held_before.pop((r.topic, r.partition, r.offset), None)
        if self.strikes.counts:
            for i, r in enumerate(records):
                if events[i] is None:
                    try:
                        events[i] = self._decode(r)
                    except BadMessage as exc:
                        events[i] = exc
            return events  # type: ignore[return-value]
        # Per topic, the records still to decode, decoded as one column each; every column one C-level pass.
        is_click = list(map(self.kafka.impressions_topic.__ne__, map(_TOPIC, records)))
        fresh = events.count(None) == len(events)  # none held before (the usual case)
        todo = is_click if fresh else [c if e is None else None for e, c in zip(events, is_click, strict=True)]
        decoded = {}
        for clicks in (False, True):
            chosen = list(compress(records, map(is_, todo, repeat(clicks))))
            decoded[clicks] = iter(decode_events(list(map(_VALUE, chosen)), list(map(_STAMP, chosen)), clicks,
                                                 self.limits, list(map(_KEY, chosen))))
        if fresh:  # each record's event from its topic's column, in record order
            return list(map(next, map(decoded.__getitem__, is_click)))
        return [e if e is not None else next(decoded[c]) for e, c in zip(events, is_click, strict=True)]

    def _held_groups_add(self, records: list[Record], events: list[Event]) -> None:
        """``records`` (with their events) appended to their topic-partitions' held records (a fetch brings runs of
        one topic-partition)."""
        held, start = self._held_groups, 0
        for tp, run in groupby(map(_TOPIC_PARTITION, records)):
            end = start + sum(1 for _ in run)
            h = held.get(tp)
            if h is None:
                h = held[tp] = Held()
            h.add(records[start:end], events[start:end])
            start = end

    def _join(self, records: list[Record], behind: Behind | None = None,
              only: set[tuple[str, int]] | None = None) -> None:
        """Decode ``records`` and append them to what is held, take what is joined now (all, or up to the event-time
        frontier with ``behind``; of the topic-partitions ``only`` when given), join it and make it durable."""
        t0 = time.monotonic()
        if self.totals.first_batch is None:
            self.totals.first_batch = t0
        imps: dict[int, list[tuple[int, Impression]]] = defaultdict(list)
        clicks: dict[int, list[tuple[int, Click]]] = defaultdict(list)
        self._batch_records = {}
        decoded = self._decode_all(records)
        # rare: headers that could not be read (a C-level pass; a second one only where records have headers)
        if any(map(_HEADERS, records)) and any(map(isinstance, map(_HEADERS, records), repeat(BadMessage))):
            decoded = [h if isinstance(h, BadMessage) else e
                       for e, h in zip(decoded, map(_HEADERS, records), strict=True)]
        self._held_groups_add(records, decoded)
        groups = self._take(behind, only)
        # A bad record at or below the last offset its partition's join state handled of its input was dead-lettered
        # by a batch that state accounts for (every output is acknowledged before the state chunk): read again (a
        # rebalance or a restart before its offsets were committed), it is skipped as the engine skips a good one
        # (redelivered), not dead-lettered again. So the partitions of bad records are restored before they are sent,
        # and each partition's state moves past the last record of each input the batch handled (``handled``), one
        # dead-lettered (or taken out as too large: _state_too_large) after its last good one or in place of any.
        bad = {tp for tp, (_, events) in groups.items() if any(map(isinstance, events, repeat(BadMessage)))}
        self.restore({p for _, p in bad})
        handled: dict[int, list[int]] = defaultdict(lambda: [-1, -1])
        for (topic, partition), (recs, events) in groups.items():
            self.processed[(topic, partition)] = recs[-1].offset + 1
            is_impression = topic == self.kafka.impressions_topic
            handled[partition][IMPRESSION_INPUT if is_impression else CLICK_INPUT] = recs[-1].offset
            if is_impression:
                self._batch_records[partition] = recs
            into = imps[partition] if is_impression else clicks[partition]
            if (topic, partition) not in bad:  # all good: (offset, event) pairs in one pass
                into.extend(zip(map(_OFFSET, recs), events, strict=True))  # type: ignore[arg-type]
                continue
            applied = self.engines[partition].offsets[IMPRESSION_INPUT if is_impression else CLICK_INPUT]
            for r, event in zip(recs, events, strict=True):
                if isinstance(event, BadMessage):
                    if r.offset <= applied:
                        self.totals.batch["redelivered"] += 1
                        continue
                    self.dead_letters.send(r.topic, r.key, r.value, event, r.partition, r.offset, kept_headers(r))
                    self.totals.batch["dead_lettered"] += 1
                else:
                    into.append((r.offset, event))  # type: ignore[arg-type]
        self.totals.stage_s["decode"] += time.monotonic() - t0
        partitions = set(handled)  # (one whose records were all read again is applied as with good ones: a no-op)
        self.restore(partitions)
        self._commit_state(self._apply_all([(p, imps.get(p, []), clicks.get(p, [])) for p in sorted(partitions)],
                                           handled=handled))
        self.totals.last_batch = time.monotonic()
        self.totals.busy_s += self.totals.last_batch - t0

    def _take(self, behind: Behind | None, only: set[tuple[str, int]] | None = None) -> Groups:
        """Per topic-partition (of ``only`` when given), the held records joined now, taken from the front of
        ``_held_groups`` (see :meth:`process`): all of them without ``behind``, else those up to their partition's
        frontier, and a partition's clicks no more than its waiting cap has room for while its impressions have more to
        read (``backpressure.click_room``). A bad record is held with its neighbours when it comes after a held one, so
        it is dead-lettered once. Only the event times are read (the held records' time column): a record may wait
        many batches."""
        held = self._held_groups if only is None else {tp: h for tp, h in self._held_groups.items() if tp in only}
        if behind is None:
            return {tp: h.take(len(h)) for tp, h in held.items() if len(h)}
        partitions = {p for (_, p), h in held.items() if len(h)}
        self.restore(partitions)
        ts_of = {(input_of(self.kafka, tp[0]), tp[1]): h.ts for tp, h in held.items() if len(h)}  # (G,) int64 each
        empty = np.zeros(0, np.int64)
        reached = {(kind, p): self.engines[p].reached(_ENGINE_INPUT[kind], ts_of.get((kind, p), empty))
                   for p in partitions for kind in (IMPRESSIONS, CLICKS)}
        self._reached.update(reached)
        limits = hold_limits(reached, behind, int((self.js.max_input_drift_s or 0) * 1000))
        groups: Groups = {}
        for tp, h in held.items():
            if not len(h):
                continue
            key = (input_of(self.kafka, tp[0]), tp[1])
            limit = limits.get(key)
            engine = self.engines[tp[1]]
            room = len(h.ts) if limit is None else engine.within(_ENGINE_INPUT[key[0]], h.ts, limit)
            if key[0] == CLICKS and behind(IMPRESSIONS, tp[1]):  # never past the waiting cap while impressions come
                capped = self._within_cap(engine, h, room)
                self.totals.batch["clicks_held_at_cap"] += room - capped  # held by the cap, not by time
                room = capped
            if room >= len(h.ts):  # nothing past the frontier: all of it, bad records after the last good one too
                cut = len(h)
            else:  # up to the first held good record
                cut = room if h.clean else nth_good(h.events[h.lo:], room)
            if cut:
                groups[tp] = h.take(cut)
            self.totals.batch["held_back"] += len(h)
        return groups

    @staticmethod
    def _within_cap(engine: PartitionJoin, h: Held, room: int) -> int:
        """How many of the first ``room`` good clicks held in ``h`` fit the waiting cap's room (``click_room``). Only
        the clicks that add a waiting id take a place (``PartitionJoin.clicks_within``): counted one each, the clicks of
        a full cap on impressions already held (joining at once, duplicates, late) were held back with the new ones."""
        cap, waiting = engine.cfg.max_waiting, len(engine.waiting)
        if click_room(cap, waiting) >= room:  # room for all: none adds more than one
            return room
        hopeless = set(engine.hopeless())  # full: the clicks past hope leave it first (engine)
        free = click_room(cap, waiting - len(hopeless))
        pairs = zip(map(_OFFSET, islice(h.records, h.lo, None)), islice(h.events, h.lo, None), strict=True)  # uncopied
        good = pairs if h.clean else ((o, e) for o, e in pairs if not isinstance(e, BadMessage))
        return engine.clicks_within(islice(good, room), free, hopeless)  # type: ignore[arg-type]  # (clicks)

    def drain(self) -> None:
        """End of input: expire every pending impression of the partitions this worker holds."""
        self._batch_records = {}
        with self._batch():
            self._commit_state(self._apply_all([(p, [], []) for p in sorted(self.engines)], drain=True))

    def _apply_all(self, batches: list[tuple[int, list[tuple[int, Impression]], list[tuple[int, Click]]]],
                   drain: bool = False, handled: dict[int, list[int]] | None = None
                   ) -> tuple[dict[int, BatchResult], dict[int, list[bytes]]]:
        """Each partition's ``(partition, impressions, clicks)`` joined and its samples sent, in order; returns the
        results and their state chunks encoded (for :meth:`_commit_state`). Redis sees what it saw when one partition
        was done after the other: partition p's history appends, then p's read, then p + 1's appends, ... But the
        read is collected as late as that allows, so the CPU work between runs while Redis answers (its script's
        time is most of a read): p's sample columns but the histories, then p - 1's samples encoded, then p + 1's
        join and state chunk encoded. p's read is answered before p + 1's appends are sent, so no read sees a later
        partition's clicks. A partition's state chunk is encoded right after its join, before anything of it goes to
        Redis or the producer: an impression whose state alone is too large is found there, while taking it out of
        the partition's batch is still possible (:meth:`_join_partition`)."""
        results: dict[int, BatchResult] = {}
        encoded: dict[int, list[bytes]] = {}
        stage = self.totals.stage_s
        self.day_counts.begin_batch()  # a failed batch's counts are dropped
        prev: _Step | None = None
        try:
            for partition, imps, clicks in batches:
                before = self.engines[partition].watermark
                res, chunk = self._join_partition(partition, imps, clicks, drain, (handled or {}).get(partition))
                if chunk is not None:
                    encoded[partition] = chunk
                t1 = time.monotonic()
                if prev is not None:
                    prev.collect()  # answered before this partition's appends are sent
                self._record_redis(res, imps)
                last, prev = prev, _Step(partition, res, self._read_histories(res),
                                         (before, self.engines[partition].watermark))
                t2 = time.monotonic()
                stage["redis"] += t2 - t1
                results[partition] = res
                prev.batches = batches_later(res.samples, self.js.sample_flush_rows, self.sample_bytes,
                                             oversized=partial(self._too_large, partition=partition, watermark=before))
                stage["encode_samples"] += time.monotonic() - t2
                if last is not None:
                    self._emit(last)
            if prev is not None:
                t2 = time.monotonic()
                prev.collect()
                stage["redis"] += time.monotonic() - t2
                self._emit(prev)
                prev = None
        finally:
            if prev is not None:  # failed with a read in flight: its answer is read (and dropped) off the connection
                prev.collect(quiet=True)
        return results, encoded

    def _encode_chunk(self, partition: int, res: BatchResult) -> tuple[list[bytes], list[tuple[Pending, int]]]:
        """``res``'s state chunk in parts under ``state_bytes``, and the impressions whose state alone is over it (with
        its size), which the parts leave out (``state_log.encode_chunk``). :class:`StateTooLarge` where an item that
        is not an impression is over it (ids are bounded by the ``[limits]``, so none is: kept as a guard)."""
        assert res.chunk is not None
        t0 = time.monotonic()
        over: list[tuple[Pending, int]] = []
        parts = encode_chunk(res.chunk, self.state_bytes, oversized=lambda p, size: over.append((p, size)))
        for raw in parts:
            if len(raw) > self.state_bytes:
                limit = self.message_limits[self.state_topic]
                raise StateTooLarge(
                    f"a part of the join state of partition {partition} is {len(raw)} bytes, over the "
                    f"{self.state_bytes} a record of {self.state_topic} may be (its limit {limit.bytes} bytes, "
                    f"{limit.source}): {raise_limit(self.state_topic, limit)}, or lower the [limits] on id length")
        self.totals.stage_s["encode_state"] += time.monotonic() - t0
        return parts, over

    def _state_too_large(self, partition: int, imps: list[tuple[int, Impression]], imp_from: int,
                         over: list[tuple[Pending, int]]) -> list[tuple[int, Impression]]:
        """Dead-letter (``too_large``) the impression records of ``imps`` whose join state alone is over what the
        state topic takes (``over``: their Pendings, made of them by this batch's join, and the sizes); returns
        ``imps`` without them. A Pending's record is the first new (offset after ``imp_from``) impression of its id
        and event time: the engine keeps the first of an id, in event-time order, then offset order."""
        limit = self.message_limits[self.state_topic]
        records = {r.offset: r for r in self._batch_records.get(partition, ())}
        gone: set[int] = set()
        for pending, size in over:
            offset = next(o for o, ev in imps if o > imp_from and o not in gone
                          and ev.impression_id == pending.impression_id and ev.ts == pending.ts)
            gone.add(offset)
            r = records[offset]
            err = BadMessage(
                f"the join state of impression {shown(pending.impression_id)} alone is {size} bytes encoded, over the "
                f"{self.state_bytes} a record of {self.state_topic} may be (its limit {limit.bytes} bytes, "
                f"{limit.source}); not joined (clicks on it are reported as orphans): lower the [limits] on context "
                f"size or {raise_limit(self.state_topic, limit)}", kind="too_large")
            self.dead_letters.send(r.topic, r.key, r.value, err, r.partition, r.offset, kept_headers(r))
            self.totals.batch["dead_lettered"] += 1
            self.totals.batch["state_too_large"] += 1
        return [pair for pair in imps if pair[0] not in gone]

    @contextmanager
    def _sized(self) -> Iterator[None]:
        """Sends and flushes of a batch's outputs: a message refused as too large is a
        :class:`~stream.errors.MessageLimitError` (module docstring, "Message size"): every topic the joiner writes to
        is sized under its learned limit. A message for a partition its topic does not have is the layout's ConfigError
        where the topics disagree now (``Layout.check``: an output created again with fewer partitions), else the outage
        it was (a rewind)."""
        try:
            yield
        except MessageTooLarge as exc:
            raise refused_as_too_large(exc, self.message_limits.get(exc.topic or "")) from None
        except PartitionMissing:
            self.layout.check()
            raise

    def _join_partition(self, partition: int, imps: list[tuple[int, Impression]], clicks: list[tuple[int, Click]],
                        drain: bool, handled: list[int] | None = None) -> tuple[BatchResult, list[bytes] | None]:
        """One partition's join and its state chunk encoded (None: the batch changed nothing).

        An impression whose join state alone is over what the state topic takes (module docstring, "Message size")
        is dead-lettered (``too_large``) and the partition's batch joined again without it, from its state before the
        batch (read back from the state log: the join changed the engine, and nothing of it went anywhere yet). Its
        clicks then wait for an impression that never comes, and are reported as orphans (``late_clicks``), as for
        any impression never seen; its state is nowhere. The batch and its other records go on: it was a
        :class:`StateTooLarge`, which failed the batch and left the impression to the strikes, ``poison_after``
        restarts later."""
        eng = self.engines[partition]
        t0, now = time.monotonic(), self.awake.tick()
        if clicks or partition not in self._last_click or partition in self.clicks_held:
            self._last_click[partition] = now
        clicks_idle = now - self._last_click[partition] >= self.js.click_idle_s
        imp_from = eng.offsets[0]
        res = eng.apply(imps, clicks, drain=drain, clicks_idle=clicks_idle, handled=handled)
        self.totals.stage_s["join"] += time.monotonic() - t0
        parts, over = self._encode_chunk(partition, res) if res.chunk is not None else (None, [])
        while over:  # again only where a later copy of a record taken out (same id and time) took its place
            if res.chunk is not None and res.chunk.snapshot:  # (the whole state: impressions of earlier batches too)
                self._no_snapshot(partition, over)
            else:
                imps = self._state_too_large(partition, imps, imp_from, over)
                self._reload(partition)
            t0 = time.monotonic()
            res = self.engines[partition].apply(imps, clicks, drain=drain, clicks_idle=clicks_idle, handled=handled)
            self.totals.stage_s["join"] += time.monotonic() - t0
            parts, over = self._encode_chunk(partition, res) if res.chunk is not None else (None, [])
        self._account(res)
        return res, parts

    def _no_snapshot(self, partition: int, over: list[tuple[Pending, int]]) -> None:
        """The partition's state read back as it was before the batch, to be joined again without a snapshot (the
        engine's ``compacts``, until the partition is restored again): ``over`` holds impressions of earlier batches,
        over what a state record may be now (the state topic's limit lowered since they came), which no snapshot can
        hold. Dead-lettering them as this batch's records found none of them in it (StopIteration), and the batch failed
        at every try, its innocent records struck."""
        log.warning("partition %d: the join state's snapshot holds %d impression(s) over the %d bytes a record of %s "
                    "may be now (e.g. %s, %d bytes: its limit lowered since they came); its state chunks are not "
                    "compacted while it is held here", partition, len(over), self.state_bytes, self.state_topic,
                    shown(over[0][0].impression_id), over[0][1])
        self._reload(partition)
        self.engines[partition].compacts = False

    def _reload(self, partition: int) -> None:
        """``partition``'s join state as the state log holds it (as it was before the batch in progress); its next
        chunk keeps its number (this owner's claim stands)."""
        seq = self.engines.pop(partition).next_seq
        for key in [k for k in self._parts if k[0] == partition]:
            del self._parts[key]
        self.restore({partition}, say_lost=False, reloaded={partition: seq})

    def _read_histories(self, res: BatchResult) -> Callable[[], tuple[np.ndarray, np.ndarray]] | None:
        """Each sample's history, sent now (one script call) and read by the returned callable (None: no samples)."""
        if not res.samples:
            return None
        ps = list(map(_PENDING, res.samples))
        return self.history.as_of_flat_later(list(map(_USER, ps)), list(map(_TS_OF, ps)), self.cfg.history_len)

    def _emit(self, step: _Step) -> None:
        """A partition's samples (with the histories its read gave) and unjoined clicks to the producer."""
        t0 = time.monotonic()
        partition, res = step.partition, step.res
        key = str(partition).encode()
        with self._sized():
            values = step.batches(step.histories)  # the last carries the watermark after the batch (stream/samples.py)
            for n, value in enumerate(values, 1):
                header = watermark_header(step.watermarks[n == len(values)])
                self.producer.send(self.kafka.samples_topic, value, key, [header], partition=partition)
            self.totals.stage_s["encode_samples"] += time.monotonic() - t0
            late, room = self.js.late_clicks_topic, self.late_click_bytes
            for u in res.unjoined:
                value = orjson.dumps({"impression_id": u.impression_id, "click_ts": u.click_ts, "reason": u.reason,
                                      "partition": partition})
                if len(value) + 4 * len(u.impression_id) > room and \
                        len(value) + len(u.impression_id.encode("utf-8", "surrogatepass")) > room:  # (4: UTF-8's most)
                    self._late_click_too_large(u.impression_id, value, partition)
                else:
                    self.producer.send(late, value, u.impression_id, partition=partition)

    def _late_click_too_large(self, impression_id: str, value: bytes, partition: int) -> None:
        """A late click's record over what the late-clicks topic takes (with the ``[limits]`` default of 256-character
        ids a record is under 3 kB, below any limit the joiner starts with: only far longer ids make one):
        dead-lettered to its ``.dlq`` (``too_large``, cut to what that takes), never a producer error nor dropped."""
        late, key_bytes = self.js.late_clicks_topic, len(impression_id.encode("utf-8", "surrogatepass"))
        limit = self.message_limits[late]
        err = BadMessage(f"the late click record on impression {shown(impression_id)} is {len(value)} bytes and its "
                         f"key {key_bytes}, over the {self.late_click_bytes} bytes a record of {late} may be (its "
                         f"limit {limit.bytes} bytes, {limit.source}): {raise_limit(late, limit)}, or lower [limits] "
                         "max_str_len", kind="too_large")
        self.dead_letters.send(late, impression_id, value, err, partition)
        self.totals.batch["late_clicks_too_large"] += 1

    def _too_large(self, rows: list[Sample], value: bytes, partition: int, watermark: int | None) -> None:
        """One sample alone is bigger than a samples message may be: dead-lettered, never a producer error. Its dead
        letter carries the watermark header of the batch's messages before the last (``watermark``: the partition's
        before the batch), so a replay of it to the samples topic reads as one of them, not as from an older joiner."""
        limit = self.message_limits[self.kafka.samples_topic]
        bound = self.js.max_sample_bytes
        over = (f"max_sample_bytes={bound} ([joiner])" if self.sample_bytes == bound
                else f"the {self.sample_bytes} bytes a message of {self.kafka.samples_topic} may be (its limit "
                f"{limit.bytes} bytes, {limit.source})")
        err = BadMessage(f"the sample of impression {shown(rows[0].pending.impression_id)} is {len(value)} bytes "
                         f"encoded, over {over}; lower the [limits] on context size or raise both limits together",
                         kind="too_large")
        self.dead_letters.send(self.kafka.samples_topic, rows[0].pending.impression_id, value, err, partition,
                               headers=[watermark_header(watermark)])
        self.totals.batch["samples_too_large"] += 1

    def _commit_state(self, done: tuple[dict[int, BatchResult], dict[int, list[bytes]]]) -> None:
        """``done``: :meth:`_apply_all`'s results and their state chunks, encoded."""
        # Step 4 -> 5: every output acknowledged before the state chunks that account for it.
        with self._sized():
            self._write_state(*done)
        self.day_counts.batch_done()
        m.counted(self.totals.batch_done(), self.totals.counts)  # the batch's counts, once: it is durable

    @contextmanager
    def _batch(self) -> Iterator[None]:
        """One batch (a join, or the drain): the counts it stages are counted once it is durable
        (:meth:`_commit_state`), and dropped where it fails before (``stream/joiner/totals.py``): a failed batch is done
        again from its input, and its first try's impressions, samples, dead letters, ... were counted again with the
        retry's. The failed try is counted (``batches_failed``, ``streamrec_join_batches_failed_total``)."""
        self.totals.begin_batch()
        try:
            yield
        except BaseException:
            self.totals.batch_failed()
            m.BATCHES_FAILED.inc()
            raise

    def _write_state(self, results: dict[int, BatchResult], encoded: dict[int, list[bytes]]) -> None:
        t0 = time.monotonic()
        self.producer.flush()
        t1 = time.monotonic()
        self.totals.stage_s["flush"] += t1 - t0
        replaced: list[tuple[int, list[int]]] = []  # (partition, seqs) a snapshot replaces: tombstoned once it is in
        for partition, res in results.items():
            if res.chunk is not None:
                records = encoded[partition]
                self._parts[(partition, res.chunk.seq)] = len(records)
                for part, value in enumerate(records):
                    self.producer.send(self.state_topic, value, chunk_key(partition, res.chunk.seq, part),
                                       partition=partition)
            if res.chunk is not None and res.chunk.snapshot:
                replaced.append((partition, res.retired))
            else:
                self._tombstone(partition, res.retired)
        if replaced:
            # A snapshot's predecessors hold live state only it holds too: their tombstones go once every part of it
            # is acknowledged (a flush raises at a failed one). Sent together, an idempotent producer that drops a
            # failed message and goes on could land the tombstones without it, and the restore lost the state.
            self.producer.flush()
            self.totals.batch["snapshots"] += len(replaced)
            for partition, seqs in replaced:
                self._tombstone(partition, seqs)
        t2 = time.monotonic()
        self.producer.flush()
        self.totals.stage_s["encode_state"] += t2 - t1
        self.totals.stage_s["flush"] += time.monotonic() - t2

    def _tombstone(self, partition: int, seqs: list[int]) -> None:
        """A tombstone for every part of each retired chunk ``seqs`` of ``partition``."""
        for seq in seqs:
            for part in range(self._parts.pop((partition, seq), 1)):
                self.producer.send(self.state_topic, None, chunk_key(partition, seq, part), partition=partition)

    def _account(self, res: BatchResult) -> None:
        """A partition's join counted for its batch (staged until the batch is durable: ``JoinTotals.batch``); the
        gauges set now."""
        c = self.totals.batch
        c.update(res.stats)
        c["samples"] += len(res.samples)
        c["positives"] += sum(map(_LABEL, res.samples))  # C-level passes: one per sample of the batch
        c["delayed_positives"] += list(map(_KIND, res.samples)).count(DELAYED_POSITIVE)
        self.totals.counts["pending_impressions"] = sum(len(e.pending) for e in self.engines.values())
        m.gauges(self.engines, self.totals.counts)

    def _record_redis(self, res: BatchResult, imps: list[tuple[int, Impression]]) -> None:
        """History now (the next batch's impressions read it); counts aggregated for ``counts_flush_s``:
        popular ids repeat, so one ZINCRBY covers many events (a crash loses at most that much counting).
        The raw ids of ``imps`` are kept (distinct) until the flush, which names the counted hashes with them.
        Both are kept apart for the batch until its state is durable (``DayCountsWriter.batch_done``): a batch that
        fails is done again from its input, and its counts must not be in the buffer twice (with a Redis outage retried
        five times, the first partition's counts were written six times). Its history appends are made now, and done
        again with it: an entry stored already is not pushed again (``stream/history.py``, the redo rule)."""
        buffer = self.day_counts.add
        if imps:
            events = [ev for _, ev in imps]
            self.day_counts.name("user", map(_USER_ID, events))
            self.day_counts.name("item", map(_ITEM_ID, events))
        if res.new_impressions:
            ts = [p.ts for p in res.new_impressions]
            buffer("item", "impression", [p.item for p in res.new_impressions], ts)
            buffer("user", "impression", [p.user for p in res.new_impressions], ts)
        if res.joined_clicks:
            ts = [j.click_ts for j in res.joined_clicks]
            buffer("item", "click", [j.item for j in res.joined_clicks], ts)
            buffer("user", "click", [j.user for j in res.joined_clicks], ts)
            self.history.append_many([j.user for j in res.joined_clicks], [j.item for j in res.joined_clicks], ts)
        self.day_counts.check()  # a failed write fails this batch (the worker rewinds), as a synchronous one would

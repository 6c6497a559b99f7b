"""Thin wrappers over confluent-kafka: the client configs (producer, consumer, admin; each checks access first,
``stream.kafka_access``) and the consumer helpers (headers, whether a partition has more, resume offsets, watermarks,
reading a topic to its end).

Nothing here relies on broker transactions (the local broker does not honour aborts): correctness
comes from idempotent producing (``stream.kafka_producer``), waiting for acknowledgements, and offsets stored with
state.
"""

from __future__ import annotations

import gc
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import chain
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Message, TopicPartition

from stream.config import KafkaSettings, check_group_id
from stream.errors import BadMessage, quoted
from stream.kafka_access import check_access, librdkafka_log, security_properties, servers_in_use
from stream.retention import account_for_retention

Headers = Sequence[tuple[str, bytes | None]]  # a header value may be null
log = logging.getLogger("streamrec.kafka")


def _client(kafka: KafkaSettings, conf: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """``conf``, then the caller's ``extra`` properties, then the security ones (see :func:`security_properties`),
    after :func:`check_access` found that the broker takes them. librdkafka's log lines go to
    ``streamrec.kafka.librdkafka`` (repeats held back) unless ``extra`` names its own ``logger``."""
    security = security_properties(kafka)
    check_access(kafka)
    servers_in_use[:] = [kafka.bootstrap_servers]
    conf["logger"] = librdkafka_log
    conf.update(extra)
    conf.update(security)
    return conf


BATCH_MESSAGES = 10_000  # the most records a streamrec producer puts in one record batch (resume_offsets)


def producer_config(kafka: KafkaSettings, **extra: Any) -> dict[str, Any]:
    conf: dict[str, Any] = {
        "bootstrap.servers": kafka.bootstrap_servers,
        "client.id": kafka.client_id,
        "enable.idempotence": True,
        "acks": "all",
        # murmur2 is what the Java client and aiokafka (faust) use: keys land on the same partition
        # whichever client produced them, which keeps impressions and clicks co-partitioned.
        "partitioner": "murmur2_random",
        "linger.ms": 20,
        "batch.num.messages": BATCH_MESSAGES,
        "queue.buffering.max.messages": 1_000_000,
        "queue.buffering.max.kbytes": 1_048_576,
        "compression.type": "lz4",
    }
    return _client(kafka, conf, extra)


def heartbeat_interval_s(kafka: KafkaSettings) -> float:
    """A group member's heartbeat interval: a sixth of the session, at least 0.5 s (both joiner drivers' consumers).
    A member that lost its partitions (it stalled past its session) hears so at its next heartbeat."""
    return max(0.5, kafka.session_timeout_ms / 6000)


# receive.message.max.bytes: 256 MiB, 2.5x librdkafka's default. Not its 2 GiB cap: librdkafka allocates the frame
# size a connection announces, so a bootstrap pointed at another protocol's port took its first bytes for one (a
# TLS alert 336 MiB, "-ERR" 759 MB, "HTTP" 1.2 GB) where this bound refuses it as an invalid frame
RECEIVE_MAX_BYTES = 256 << 20


def consumer_config(kafka: KafkaSettings, group_id: str, **extra: Any) -> dict[str, Any]:
    check_group_id("the consumer group (group.id)", group_id)  # librdkafka's "no group" aborted the process
    conf: dict[str, Any] = {
        "bootstrap.servers": kafka.bootstrap_servers,
        "client.id": kafka.client_id,
        "group.id": group_id,
        "session.timeout.ms": kafka.session_timeout_ms,
        "heartbeat.interval.ms": round(heartbeat_interval_s(kafka) * 1000),
        "auto.offset.reset": "earliest",
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        # The local broker reports wrong high watermarks; the end of a partition is detected from
        # partition-EOF events instead (see environment.md).
        "enable.partition.eof": True,
        # An application producing in transactions: what it aborted never reaches a consumer (librdkafka's default,
        # stated: the faust driver's aiokafka reads uncommitted unless told, stream/joiner/faust_delivery.py). The
        # local broker does not honour aborts (environment.md).
        "isolation.level": "read_committed",
        # A record up to RECEIVE_MAX_BYTES can be fetched: the broker hands over a partition's first record whatever
        # its size (KIP-74), and a fetch response over librdkafka's default 100 MB limit was dropped and fetched again
        # for ever (librdkafka's FAIL log line the only word): a reader stalled at a record a producer sent with a
        # raised message.max.bytes, and nothing before it in the same response was read either (one over 256 MiB
        # still does: README). Buffers are sized per response, so the bound costs nothing until such a record comes.
        "receive.message.max.bytes": RECEIVE_MAX_BYTES,
    }
    return _client(kafka, conf, extra)


def admin_config(kafka: KafkaSettings, **extra: Any) -> dict[str, Any]:
    """The one place an admin client's config is built."""
    return _client(kafka, {"bootstrap.servers": kafka.bootstrap_servers, "client.id": kafka.client_id}, extra)


def headers_of(msg: Message) -> Headers | None:
    """A consumed message's headers. Raises :class:`BadMessage` (``bad_header``) for a header key that is not UTF-8
    (Kafka's keys are bytes; another producer may write any). confluent-kafka (2.16) then returns a (key, value) pair
    with an empty key slot and its UnicodeDecodeError still set: CPython raises a SystemError, the UnicodeDecodeError
    at a later call, or (a specialised call site, no check) nothing. It keeps the broken list for the message's next
    ``headers()``, and reading the empty slot segfaults. So this is called once per message, and finds an empty slot
    without reading it: ``gc.get_referents`` skips it."""
    try:
        headers = msg.headers()
        broken = any(len(gc.get_referents(pair)) != len(pair) for pair in headers or ())
    except (SystemError, UnicodeDecodeError):
        broken = True
    if broken:
        raise header_key_not_utf8()
    return headers  # type: ignore[return-value]  # consumed: a list of (str, bytes | None)


def headers_whole(lists: Iterable[Headers | None]) -> bool:
    """Whether no (key, value) pair of ``lists`` (consumed messages' ``headers()``, each read once) has the empty slot
    :func:`headers_of` looks for: its check for a whole batch, in one C-level call (~0.2 us a message with two headers,
    where :func:`headers_of` a message cost ~1.1 us, on the joiner's per-batch path)."""
    pairs = list(chain.from_iterable(filter(None, lists)))
    return len(gc.get_referents(*pairs)) == sum(map(len, pairs))


def header_key_not_utf8() -> BadMessage:
    """Why a message whose header key is not UTF-8 is dead-lettered (its headers cannot be read, so none are kept)."""
    return BadMessage("a header key that is not UTF-8 (the message's headers are not kept)", kind="bad_header")


def has_more(consumer: Consumer, topic: str, partition: int, unknown: bool = False) -> bool:
    """Whether ``partition`` of ``topic`` has records past what ``consumer`` has handed out (:func:`fetched_more`).
    Unknown (no fetch yet, an error) counts as ``unknown``: no by default, since callers use it to hold other inputs
    back (``stream/alignment.py``) and a guess must not stall them; a caller with its own timeout for an input that
    sends nothing (the learner's merge, ``idle_s``; the joiner's hold, ``backpressure.Unfetched``) may count it as
    yes."""
    more = fetched_more(consumer, topic, partition)
    return unknown if more is None else more


def fetched_more(consumer: Consumer, topic: str, partition: int, start: int | None = None) -> bool | None:
    """Whether ``partition`` of ``topic`` has records past what ``consumer`` has handed out, by the high watermark
    its fetcher last saw (no broker round trip); None while that is unknown (not fetched since the assignment, an
    error). The cached high watermark is the one fetch responses carry, the partition's true end on the local
    broker too (measured: 60 after three record batches of 20, where its ListOffsets answer, ``cached=False``, says 41:
    the start of the last record batch + 1).

    librdkafka's position is unknown until a record of the assignment is handed out, so a partition assigned at its end
    read as "more" for as long as nothing came (the joiner's hold kept the other input back for good after a rebalance
    or restart). ``start``, the offset the caller assigned or sought it at (``stream.retention.Gaps.next``), stands in
    for that position; without it (a logical start: a group's first assignment starts at the beginning) an unknown
    position still counts as more, unless the partition holds no record at all: its low watermark (the log start
    offset fetch responses carry) equal to its high one, as after retention or DeleteRecords removed every record (a
    new group's hold kept the other input back for good there, the partition having nothing to hand out)."""
    tp = TopicPartition(topic, partition)
    try:
        low, high = consumer.get_watermark_offsets(tp, cached=True)
        position = consumer.position([tp])[0].offset
    except KafkaException:
        return None
    if high < 0:  # not fetched yet
        return None
    if high == 0 or high == low:  # empty: never written, or every record deleted
        return False
    if position < 0 and start is not None and start >= 0:
        position = start
    return position < 0 or position < high


def resume_offsets(consumer: Consumer, partitions: list[TopicPartition], reader: str) -> list[TopicPartition]:
    """Start positions for ``partitions``: the group's committed offsets, made safe for brokers whose
    high watermark lags (Tansu reports the base offset of the last record batch + 1), and checked against
    retention for ``reader`` (the joiner, an ``EventReader`` stage: the name its losses are logged and counted by).

    Resuming at an offset inside a partition's last record batch makes such a broker return nothing
    until more data arrives, so a consumer resuming there would stall on a bounded input. Where the
    committed offset is beyond the reported high watermark, start from the batch's base offset
    instead (high watermark - 1): the records in between are delivered again, and every streamrec
    consumer skips records it has already applied (they come with offsets). On Apache Kafka the
    committed offset never exceeds the high watermark unless the topic was deleted and created again (its offsets
    start over; the records before the committed offset are the new topic's, and a streamrec consumer skips them as
    applied): a committed offset more than one record batch (``BATCH_MESSAGES``, what streamrec's producers put in
    one) past the high watermark cannot be Tansu's lag and is logged as a WARNING naming that cause. It still starts
    at the high watermark - 1: that is right on Tansu, and on a recreated topic the consumer's state is keyed by the
    old topic's offsets, which no start position here can mend.
    A committed offset below the partition's low watermark (retention or DeleteRecords removed records the
    consumer never read) starts at the low watermark, the loss logged as an ERROR and counted
    (``stream.retention``); librdkafka's reset to the earliest offset would have said nothing. The low watermark is
    then committed for that partition (no record lies between), so the next assignment, rewind or restart does not
    say and count the same loss again. Partitions without a committed offset start at the beginning.
    """
    out = []
    lows: dict[tuple[str, int], int] = {}
    for tp in consumer.committed(partitions, timeout=10):
        offset = tp.offset
        if offset >= 0:
            low, high = consumer.get_watermark_offsets(TopicPartition(tp.topic, tp.partition), timeout=10)
            lows[(tp.topic, tp.partition)] = low
            if offset > high:
                start = max(high - 1, low, 0)  # not below the first record held: that is no loss
                if offset - high > BATCH_MESSAGES:
                    log.warning("%s: the committed offset %d of %s partition %d is %d past the partition's end (%d), "
                                "more than one record batch: the topic was probably deleted and created again (its "
                                "offsets started over). Starting at offset %d; the records before the committed "
                                "offset count as read. Reset this reader's group offsets (and its state) if the topic "
                                "is new", reader, offset, tp.topic, tp.partition, offset - high, high, start)
                offset = start
        else:
            offset = OFFSET_BEGINNING
        out.append(TopicPartition(tp.topic, tp.partition, offset))
    starts = account_for_retention(reader, out, lows)[0]
    # the group's offset moved past what is gone (nothing lies between), whether said now or earlier by this process
    # (stream.retention.Gaps): a rebalance, a rewind or a restart before anything new of the partition is processed
    # does not say and count the loss again (the review's 4 ERROR lines and a fourfold count for one loss)
    moved = [s for s, o in zip(starts, out, strict=True) if 0 <= o.offset < s.offset]
    if moved:
        try:
            consumer.commit(offsets=moved, asynchronous=False)
        except KafkaException as exc:
            log.warning("%s: could not commit the offsets past the records lost (%s): the loss may be said and counted "
                        "again at the next assignment", reader, quoted(str(exc)))
    return starts


def new_consumer(kafka: KafkaSettings, group_id: str, **extra: Any) -> Consumer:
    return Consumer(consumer_config(kafka, group_id, **extra))


# A broker call a reader's stop check must not wait behind (``between`` of watermarks, read_to_end): asked in tries of
# at most this long, the check between them. librdkafka's metadata and offset requests ran out their whole timeout
# (10 s, holdout_timeout_s) with the broker down before the refresh saw a stop it had kept pending.
BROKER_TRY_S = 0.5
# what such a request raises when it ran out of time: _TRANSPORT (metadata) and _ALL_BROKERS_DOWN (offsets) with the
# broker down, _TIMED_OUT with it slow
_RAN_OUT = frozenset({KafkaError._TIMED_OUT, KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN})


def _in_tries(call: Callable[[float], Any], timeout_s: float, between: Callable[[], object] | None) -> Any:
    """``call(timeout)`` bounded by ``timeout_s`` in all; with ``between``, asked in tries of at most
    :data:`BROKER_TRY_S` with ``between()`` after each that ran out (outside the ``except``: the refresh's stop check
    keeps a stop pending while an exception is in flight), the last try's error raised once ``timeout_s`` is spent.
    After a ``_TIMED_OUT`` (the broker is up, its answer slower than a try) the next try has all the time left: a
    re-asked request starts again, so a broker answering in 0.8 s timed out every 0.5 s try, and the call failed."""
    if between is None:
        return call(timeout_s)
    deadline, slow = time.monotonic() + timeout_s, False
    while True:
        left = deadline - time.monotonic()
        try:
            return call(max(0.0, left if slow else min(BROKER_TRY_S, left)))
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            if not isinstance(err, KafkaError) or err.code() not in _RAN_OUT or left <= BROKER_TRY_S or slow:
                raise
            slow = err.code() == KafkaError._TIMED_OUT
        between()


def watermarks(kafka: KafkaSettings, topic: str, timeout_s: float = 10.0,
               between: Callable[[], object] | None = None) -> dict[int, tuple[int, int]]:
    """``{partition: (low, high)}`` of ``topic``; empty when the topic does not exist. The local broker's
    high watermark may lag by one record batch (:func:`resume_offsets`): read to the end with
    :func:`read_to_end`, not to ``high``. Each request is bounded by ``timeout_s``; ``between`` (a stop check) is
    called between its tries (:func:`_in_tries`) and between partitions."""
    c = new_consumer(kafka, f"{kafka.client_id}-watermarks-{uuid.uuid4().hex[:8]}")
    try:
        md = _in_tries(lambda t: c.list_topics(topic, timeout=t), timeout_s, between).topics.get(topic)
        if md is None or md.error is not None:
            return {}
        marks: dict[int, tuple[int, int]] = {}
        for p in sorted(md.partitions):
            if between is not None and marks:
                between()
            tp = TopicPartition(topic, p)
            marks[p] = _in_tries(lambda t: c.get_watermark_offsets(tp, timeout=t), timeout_s, between)  # noqa: B023 - called in this iteration
        return marks
    finally:
        c.close()


def read_to_end(kafka: KafkaSettings, topic: str, handle: Callable[[Message], None], *,
                start: Mapping[int, int] | None = None, timeout_s: float | None = 60.0, stall_s: float | None = None,
                batch: int = 10_000, between: Callable[[], object] | None = None) -> list[int]:
    """Read partitions of ``topic`` to their end, handing every record to ``handle``; returns the partitions read.

    The one read-to-the-end loop (state restore, the refresh's holdout, test and bench readers). ``start``
    maps partition -> first offset (``OFFSET_BEGINNING`` allowed); None reads every partition from the
    beginning. Partitions the topic does not have, or a topic that does not exist, are skipped. A
    partition's end is its partition-EOF event after its last record, not the high watermark (which the
    local broker under-reports, environment.md). Records come in offset order per partition. Assigned
    without joining a group: nothing is committed. ``TimeoutError`` naming the partitions that did not
    reach their end within ``timeout_s`` (None: no bound on the whole read), or, with ``stall_s``, while no record
    and no end came for ``stall_s``: a reader of a topic others keep writing to needs the first (it may never see
    every partition at its end at once), a restore of a log only its reader writes the second (a large log takes as
    long as it takes, a broker that stops answering does not). An exception from ``handle`` propagates (the consumer
    is closed); so does one from ``between``, called after each poll and between the tries of the metadata request
    (:func:`_in_tries`; the refresh's stop check: a stop need not wait for the end of the read).
    """
    c = new_consumer(kafka, f"{kafka.client_id}-reader-{uuid.uuid4().hex[:8]}", **{"fetch.wait.max.ms": 20})
    try:
        md = _in_tries(lambda t: c.list_topics(topic, timeout=t), min(10.0, timeout_s or 10.0, stall_s or 10.0),
                       between).topics.get(topic)
        if md is None or md.error is not None:
            return []
        wanted = {p: OFFSET_BEGINNING for p in md.partitions} if start is None else dict(start)
        present = sorted(p for p in wanted if p in md.partitions)
        if not present:
            return []
        c.assign([TopicPartition(topic, p, wanted[p]) for p in present])
        todo = set(present)
        began = progress = time.monotonic()
        while todo:
            now = time.monotonic()
            if timeout_s is not None and now - began > timeout_s:
                raise TimeoutError(f"topic {topic} partitions {sorted(todo)} did not reach their end in {timeout_s:g}s")
            if stall_s is not None and now - progress > stall_s:
                raise TimeoutError(f"topic {topic} partitions {sorted(todo)}: no record and no end for {stall_s:g}s "
                                   f"(after {now - began:.0f}s of reading)")
            got = c.consume(batch, 0.2)
            for m in got:
                err = m.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        todo.discard(m.partition())
                    continue
                todo.add(m.partition())  # a record after an end: its partition ends at the next EOF
                handle(m)
            if got:  # (after handling them: time in ``handle`` is not the broker's stall)
                progress = time.monotonic()
            if between is not None:
                between()
        return present
    finally:
        c.close()

"""Input lost to retention: a consumer's saved offset below its partition's log start offset, said and counted.

A consumer that was down longer than an input topic's retention (or whose records an operator removed with
DeleteRecords) resumes at a saved offset below the partition's low watermark (its first record still held).
librdkafka then resets it to the earliest offset (``auto.offset.reset``) without an error: the records between the
saved offset and the low watermark are gone for that consumer, and nothing in streamrec said so (aiokafka, under the
joiner's faust driver, does the same with ``auto_offset_reset``). Every consumer that resumes from saved offsets (the
joiner's kafka driver and ``EventReader`` through ``stream.kafka.resume_offsets``, the joiner's faust driver at the
committed offsets faust seeks to after each assignment, ``stream.joiner.faust_delivery.BatchConsumer``, the
learner's ``KafkaSampleDataset`` at its checkpoint's offsets) passes its start
offsets through :func:`account_for_retention` first: it starts such a partition at the low watermark, logs one
ERROR line per partition (the reader, the topic, the partition, the range lost, the likely cause and what to do)
and counts the records lost in ``streamrec_input_lost_to_retention_total{reader, topic}``. The low watermark is
reliable on every broker (unlike the local broker's high watermark, ``stream.kafka.resume_offsets``); a start
offset that is no saved offset (``OFFSET_BEGINNING`` and the other logical offsets, all negative) loses nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from confluent_kafka import Consumer, KafkaException, TopicPartition

from stream.errors import clip
from stream.metrics import INPUT_LOST

log = logging.getLogger("streamrec.retention")


@dataclass(frozen=True, slots=True)
class Lost:
    """The records ``[saved, low)`` of ``topic``/``partition``, gone before ``reader`` read them."""

    reader: str
    topic: str
    partition: int
    saved: int
    low: int

    @property
    def records(self) -> int:
        return self.low - self.saved


def account_for_retention(reader: str, starts: Sequence[TopicPartition], lows: Mapping[tuple[str, int], int],
                          ) -> tuple[list[TopicPartition], list[Lost]]:
    """The offsets ``reader`` should start ``starts`` at, and what it lost: a start offset below its partition's low
    watermark (``lows``, keyed by (topic, partition); a partition not in it is not checked) becomes that low
    watermark, each such partition logged as one ERROR line and its records lost counted (module docstring)."""
    out: list[TopicPartition] = []
    lost: list[Lost] = []
    for tp in starts:
        low = lows.get((tp.topic, tp.partition))
        if low is None or tp.offset < 0 or tp.offset >= low:
            out.append(tp)
            continue
        gone = Lost(reader, tp.topic, tp.partition, tp.offset, low)
        lost.append(gone)
        INPUT_LOST.labels(reader, tp.topic).inc(gone.records)
        log.error("%s: %d record(s) of %s partition %d, offsets %d..%d, were deleted before it read them (its saved "
                  "offset %d is below the partition's first offset %d): the topic's retention (retention.ms / "
                  "retention.bytes) is shorter than this reader's downtime, or someone ran DeleteRecords. It goes on "
                  "from offset %d. Raise the topic's retention above the longest downtime you expect and alert on "
                  "this reader's lag", reader, gone.records, tp.topic, tp.partition, gone.saved, low - 1, gone.saved,
                  low, low)
        out.append(TopicPartition(tp.topic, tp.partition, low))
    return out, lost


def start_after_retention(consumer: Consumer, reader: str, starts: Sequence[TopicPartition], timeout_s: float = 10.0,
                          ) -> list[TopicPartition]:
    """:func:`account_for_retention` of ``starts`` with the low watermarks ``consumer`` asks the broker for, for a
    reader that starts at offsets of its own (the learner's checkpoint) rather than through
    ``stream.kafka.resume_offsets``. A broker that cannot say is logged as a WARNING naming what was not checked,
    and ``starts`` are used as they are: the reader's own fetches report a broker that stays away."""
    lows: dict[tuple[str, int], int] = {}
    try:
        for tp in starts:
            if tp.offset >= 0:
                lows[(tp.topic, tp.partition)] = consumer.get_watermark_offsets(
                    TopicPartition(tp.topic, tp.partition), timeout=timeout_s)[0]
    except KafkaException as exc:
        not_checked(reader, [(tp.topic, tp.partition) for tp in starts], exc)
        return list(starts)
    return account_for_retention(reader, starts, lows)[0]


def not_checked(reader: str, partitions: Iterable[tuple[str, int]], exc: BaseException) -> None:
    """The WARNING of a reader whose broker could not give the low watermarks of ``partitions``: it starts where it
    would have, unchecked (its own fetches report a broker that stays away)."""
    log.warning("%s: could not read the first offsets of %s (%s): whether records before its start offsets were "
                "deleted unread (retention, DeleteRecords) is not checked this time", reader, sorted(partitions),
                clip(str(exc) or type(exc).__name__))

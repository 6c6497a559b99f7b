"""The joiner's partition layout: what the topics it reads and writes must agree on, checked where it starts and
whenever it is given a partition it has not seen.

The join is keyed: impressions and clicks are both keyed by ``impression_id``, so with one partition count a click
lands in the partition number of its impression (the default partitioner: a hash of the key modulo the count), and
one worker owns partition p of both (Kafka Streams' co-partitioning requirement, which it checks at start too). With
other counts a click and its impression land in different partitions, and the join reports the click as an orphan
and the impression as a 0: wrong labels, not an error (measured: impressions in 4 partitions and clicks in 1 joined
69 of 301 clicks and reported 227 as orphans). The joiner writes join partition p to partition p of the samples, late
clicks and state topics, so those need at least as many partitions (with fewer, every batch of a partition past
them failed the producer with "Unknown partition" and was retried for ever).

At start (:func:`ensure_layout`) the inputs are made if missing (one with the other's count), their counts compared,
and the outputs made with the inputs' count if missing; any disagreement is a :class:`~stream.errors.ConfigError`
(exit 2) naming the topics, their counts and the fix. Partitions added to the inputs while the joiner runs come to
it in a rebalance: :meth:`Layout.assigned` checks again when a partition number past the known count is assigned,
and stops the worker the same way if the topics disagree. If they agree, it goes on and warns: keys written before
the change stay in their old partitions, so a click of an impression published before it may land elsewhere (an
orphan). Add partitions to both inputs before their producers write to them, and to the outputs first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Mapping

from stream.config import KafkaSettings
from stream.errors import ConfigError
from stream.kafka_topics import ensure_compacted, ensure_topics, partition_counts

log = logging.getLogger("streamrec.join")


def check_layout(counts: Mapping[str, int], impressions: str, clicks: str, outputs: Iterable[str]) -> int:
    """The inputs' partition count, given each topic's (``counts``); :class:`ConfigError` where the inputs differ
    or an output has fewer (module docstring)."""
    n_imp, n_clk = counts[impressions], counts[clicks]
    if n_imp != n_clk:
        raise ConfigError(
            f"topic {impressions} has {n_imp} partitions and topic {clicks} has {n_clk}: the join needs the same "
            f"number (both are keyed by impression_id, so a click lands in its impression's partition only when the "
            f"counts are equal; with other counts its clicks are reported as orphans). Give the one with fewer as "
            f"many (kafka-topics.sh --alter --topic <name> --partitions N) before its producers write to it")
    short = [(t, counts[t]) for t in dict.fromkeys(outputs) if counts[t] < n_imp]
    if short:
        names = ", ".join(f"{t} has {k}" for t, k in short)
        raise ConfigError(
            f"the input topics have {n_imp} partitions and the joiner writes join partition p to partition p of "
            f"its outputs, but {names}: add partitions to each (kafka-topics.sh --alter --topic <name> "
            f"--partitions {n_imp})")
    return n_imp


def ensure_inputs(kafka: KafkaSettings,
                  counts: Callable[[KafkaSettings, list[str]], dict[str, int]] = partition_counts) -> int:
    """Make the impressions and clicks topics where missing, one with the other's partition count where that one
    exists (``[kafka] partitions`` where neither does), and check they agree (:func:`check_layout`): their count.
    The replay calls it before it writes: events published into topics that disagree are joined wrong for good (a
    partition added later does not move them)."""
    imp, clk = kafka.impressions_topic, kafka.clicks_topic
    have = {t: n for t, n in counts(kafka, [imp, clk]).items() if n}
    ensure_topics(kafka, [imp, clk], partitions=next(iter(have.values()), None))
    return check_layout(counts(kafka, [imp, clk]), imp, clk, ())


def ensure_samples(kafka: KafkaSettings,
                   counts: Callable[[KafkaSettings, list[str]], dict[str, int]] = partition_counts) -> None:
    """Make the samples topic where missing with the inputs' partition count (the larger where they disagree; ``[kafka]
    partitions`` where neither exists): what a learner started before the joiner calls. It made it with ``[kafka]
    partitions``, and beside inputs of 8 the joiner then refused a samples topic of 4 (exit 2)."""
    have = [n for n in counts(kafka, [kafka.impressions_topic, kafka.clicks_topic]).values() if n]
    ensure_topics(kafka, [kafka.samples_topic], partitions=max(have, default=None))


def ensure_layout(kafka: KafkaSettings, outputs: Collection[str], state_topic: str,
                  counts: Callable[[KafkaSettings, list[str]], dict[str, int]] = partition_counts) -> int:
    """Make the inputs if missing (:func:`ensure_inputs`), then ``outputs`` (plain) and ``state_topic`` (compacted)
    with the inputs' count if missing, and check the layout (:func:`check_layout`): the inputs' partition count."""
    imp, clk = kafka.impressions_topic, kafka.clicks_topic
    n = ensure_inputs(kafka, counts)
    ensure_topics(kafka, outputs, partitions=n)
    ensure_compacted(kafka, state_topic, partitions=n)
    return check_layout(counts(kafka, [imp, clk, *outputs, state_topic]), imp, clk, [*outputs, state_topic])


class Layout:
    """The partition count the joiner started with, checked again when the group assigns a partition past it."""

    def __init__(self, kafka: KafkaSettings, outputs: Collection[str], state_topic: str, partitions: int,
                 counts: Callable[[KafkaSettings, list[str]], dict[str, int]] = partition_counts) -> None:
        """``partitions``: what :func:`ensure_layout` returned for the same topics."""
        self.kafka, self.outputs, self.state_topic, self._counts = kafka, list(outputs), state_topic, counts
        self.partitions = partitions

    def assigned(self, partitions: Iterable[int]) -> None:
        """Check a rebalance's ``partitions`` (either input's); :class:`ConfigError` if the topics disagree now, the
        metadata request's error (a KafkaException) if the broker cannot say: the kafka driver asks again, the faust
        driver exits 1 (their module docstrings). Nothing changes until a check passes."""
        top = max(partitions, default=-1)
        if top < self.partitions:
            return
        n = self.check()
        log.warning("the input topics have %d partitions now (%d at start): events keyed before the change stay in "
                    "their partitions, so a click of an impression published before it may land in another partition "
                    "and be reported as an orphan", n, self.partitions)
        self.partitions = n

    def check(self) -> int:
        """:func:`check_layout` of the topics as they are now (one metadata request): the inputs' count, or its
        ConfigError. Also where a write found a partition missing from an output (``JoinPipeline._sized``): an output
        deleted and created again with fewer partitions while the joiner ran, which the checks at start and at an
        assignment do not see (every batch of a partition past it was retried for ever)."""
        imp, clk, outputs = self.kafka.impressions_topic, self.kafka.clicks_topic, [*self.outputs, self.state_topic]
        return check_layout(self._counts(self.kafka, [imp, clk, *outputs]), imp, clk, outputs)

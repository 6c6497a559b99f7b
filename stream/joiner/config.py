"""The joiner's settings (``[joiner]``, ``STREAMREC_JOINER_*``)."""

from __future__ import annotations

from dataclasses import dataclass

from stream.config import (
    TOPIC_RULE,
    Choice,
    KafkaSettings,
    check_counts,
    check_durations,
    check_group_id,
    check_ports,
    check_topic,
    topic_problem,
)
from stream.errors import ConfigError, shown


def state_topic(app_id: str) -> str:
    """The joiner's compacted state log (``stream/joiner/state_log.py``): named after its app id."""
    return f"{app_id}-join-state"


class Driver(Choice):
    """How the joiner consumes: a faust-streaming agent, or a plain confluent-kafka loop (same semantics)."""

    FAUST = "faust"
    KAFKA = "kafka"


class EmissionPolicy(Choice):
    """When the joiner emits samples (``stream/joiner/engine.py``; the learner's correction in
    ``learner/delayed.py``). Changing it under an existing app id's state with impressions pending is refused at the
    restore (the claim records the policy: ``pipeline.JoinPipeline.restore``): drain it first or use a new ``app_id``
    (the restored impressions would be taken as emitted under the new policy)."""

    WAIT = "wait"  # a positive at its click, a negative at window close
    WINDOW = "window"  # everything at window close
    FAKE_NEGATIVE = "fake_negative"  # a negative at once, a positive again at the click (Ktena et al. 2019)
    ES_DFM = "es_dfm"  # the label observed after elapsed_s, a positive again at a later click (Yang et al. 2021)


@dataclass(frozen=True)
class JoinerSettings:
    """The impression-click joiner (``streamrec join``)."""

    app_id: str = "streamrec-joiner"  # faust app id = consumer group; names the state topic
    driver: Driver = Driver.FAUST  # faust | kafka (plain confluent-kafka loop, same semantics, faster)
    attribution_window_s: float = 1800.0  # a click within this event time of its impression labels it 1
    # When samples go out (EmissionPolicy). fake_negative (Ktena et al. 2019): every impression at once as a 0, a
    # clicked one again as a 1; measured best of the four on ML-1M and the synthetic streams (README, "Delayed
    # feedback"), and the freshest. wait is the simplest (one sample per impression, the label known).
    emission: EmissionPolicy = EmissionPolicy.FAKE_NEGATIVE
    elapsed_s: float = 60.0  # es_dfm: event time an impression waits for its click before its observed sample
    allowed_lateness_s: float = 5.0  # watermark = max event time seen - allowed lateness
    late_retention_s: float = 3600.0  # how long after expiry a click is still recognised as late
    # A partition without clicks for this long (wall clock) lets impressions alone advance event time.
    click_idle_s: float = 30.0
    counts_flush_s: float = 2.0  # Redis day counts are aggregated in memory this long between writes
    late_clicks_topic: str = "late_clicks"
    # Samples are flushed once per batch: a batch closes at batch_max events or after batch_within_s,
    # and its samples go out as messages of at most sample_flush_rows rows per partition.
    batch_max: int = 5000
    batch_within_s: float = 0.5
    # The learner merges the samples partitions a whole message at a time (learner/kafka_dataset.py), so a
    # message's span of event time is how far one partition's rows can run ahead of another's, and a model that
    # trained on them serves the others' older impressions with hindsight. 64 rows (a quarter of a learner step
    # over four partitions): on 300 k ML-1M ratings the daemon's served AUC read 0.7475 with up to 4,096 (median
    # look-ahead 58 min) and 0.7362 with 64 (p99 12 min), against 0.7288 read from one partition.
    sample_flush_rows: int = 64
    exit_when_idle_s: float | None = None  # bounded runs: exit after this long without input
    drain_at_exit: bool = False  # at exit, treat input as complete: expire every pending impression
    metrics_port: int | None = None  # serve Prometheus /metrics on this port
    metrics_host: str = "127.0.0.1"  # ... bound to this address (loopback; 0.0.0.0 exposes it to the network)
    # Hostile input (stream/joiner/engine.py, stream/strikes.py): event time per input is its
    # watermark_quorum-th largest event time, so no single event steers it; memory caps per partition;
    # a message in poison_after failed batches in a row (processed alone after the first) is dead-lettered.
    watermark_quorum: int = 16
    max_pending_per_partition: int = 500_000  # at most 1,000,000,000 (as max_waiting_per_partition)
    max_waiting_per_partition: int = 100_000
    # Backpressure (stream/joiner/backpressure.py): pause a partition's input while its event time leads the
    # other input's by more than max_input_drift_s (None: no time rule), and its clicks while their waiting count
    # is at 80% of max_waiting, as long as the other input has more to read. Off: clicks past the cap are given
    # up (overflow), and a backlog's samples go out in the order the inputs happen to be fetched.
    backpressure: bool = True
    max_input_drift_s: float | None = 60.0
    poison_after: int = 3
    max_sample_bytes: int = 900_000  # a samples message; Kafka's default message.max.bytes is 1 MB
    # Python's full garbage collections run between batches every gc_every_s seconds, not in the middle of them
    # (stream/joiner/gc_pacing.py: the join state is acyclic, and automatic full collections cost a growing state
    # 45% of the worker's time); 0 leaves Python's automatic collector on.
    gc_every_s: float = 60.0
    # How often a running worker asks the broker for its input topics' ids (one DescribeTopics, between batches): an
    # input deleted and made again under the running consumer (its position of the old topic kept, or reset below what
    # was applied) is then read from its first record (JoinPipeline.check_topics); a restore asks at every assignment.
    topic_check_s: float = 30.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "driver", Driver.of(self.driver, "[joiner] driver"))
        object.__setattr__(self, "emission", EmissionPolicy.of(self.emission, "[joiner] emission"))
        # every window, period and timeout finite and > 0; 0 is allowed where it means none or off (gc_every_s 0:
        # Python's automatic collector)
        check_durations("joiner", self, zero_ok=("gc_every_s", "elapsed_s", "allowed_lateness_s", "late_retention_s"))
        check_ports("joiner", self)
        check_group_id("[joiner] app_id", self.app_id)  # the consumer group of both drivers
        if problem := topic_problem(state_topic(self.app_id)):
            raise ConfigError(f"[joiner] app_id: {shown(self.app_id)} names the state topic "
                              f"{shown(state_topic(self.app_id))}, which {problem}; {TOPIC_RULE}")
        check_topic("[joiner] late_clicks_topic", self.late_clicks_topic)
        # every count >= 1, none has a meaning at 0 (batch_max 0: the kafka driver returned empty batches for ever);
        # batch_max at most confluent-kafka's consume() limit, a samples message at most librdkafka's
        # message.max.bytes (the producer's is this plus 64 KiB), the memory caps at a billion events (the rest:
        # stream.config.MAX_COUNT)
        check_counts("joiner", self, at_most={"batch_max": 1_000_000, "max_sample_bytes": 1_000_000_000 - 65_536,
                                              "max_pending_per_partition": 1_000_000_000,
                                              "max_waiting_per_partition": 1_000_000_000})
        if self.emission is EmissionPolicy.ES_DFM and not 0 <= self.elapsed_s <= self.attribution_window_s:
            raise ConfigError(f"[joiner] elapsed_s must be between 0 and attribution_window_s "
                              f"({self.attribution_window_s:g}), got {self.elapsed_s!r}")


def check_late_clicks_topic(kafka: KafkaSettings, late: str) -> None:
    """Refuse a ``late_clicks_topic`` that is one of the streams' topics or their dead-letter topics, or whose own
    dead-letter topic is a stream's (as ``KafkaSettings`` refuses among the streams): "clicks" wrote each late click
    back onto the clicks topic, read again and late again for ever; or whose dead-letter topic is no legal topic
    name. Checked when the joiner starts, before anything connects: the one place that knows both sections."""
    kafka.check_dead_letter_topic("[joiner] late_clicks_topic", late)
    for name in ("impressions_topic", "clicks_topic", "samples_topic"):
        topic = getattr(kafka, name)
        for ours, theirs in ((late, topic), (late, kafka.dlq_topic(topic)), (kafka.dlq_topic(late), topic)):
            if ours == theirs:
                raise ConfigError(f"[joiner] late_clicks_topic {late!r}: the late clicks (dead letters: {late!r} + "
                                  f"dlq_suffix) would share {theirs!r} with [kafka] {name} {topic!r} (dead letters: "
                                  f"{topic!r} + dlq_suffix): give the late clicks a topic of their own")

"""The joiner's partition layout against the real broker (stream/joiner/partitions.py): inputs whose partition counts
differ stop the replay before it sends (events sent into them would be joined wrong for good) and the joiner at start
(exit 2), where it used to report most clicks as orphans; a missing input is made with the other one's count; an output
with fewer partitions than the inputs is refused, where every batch of a partition past it was retried for ever; a
missing output is made with the inputs' count."""

from __future__ import annotations

import subprocess

import pytest

from stream.config import KafkaSettings
from stream.errors import ConfigError
from stream.joiner.partitions import ensure_layout
from stream.kafka_topics import ensure_topics, partition_counts
from stream.replay.config import ClickDelay, SyntheticSettings
from stream.replay.publisher import publish
from stream.replay.synthetic import build_synthetic
from tests.integration.test_joiner import join_cmd, join_env
from tests.kafka_io import read_topic

SYN = SyntheticSettings(impressions=600, users=200, items=50, impressions_per_s=20.0, base_ctr=0.3,
                        attribution_window_s=600.0)


def test_a_clicks_topic_with_fewer_partitions_stops_the_replay_before_it_sends_and_the_joiner_at_start(
        kafka: KafkaSettings, stack, group_id: str) -> None:
    ensure_topics(kafka, [kafka.impressions_topic], partitions=4)
    ensure_topics(kafka, [kafka.clicks_topic], partitions=1)
    table = build_synthetic(SYN, ClickDelay(median_s=60.0), seed=3)
    with pytest.raises(ConfigError, match=f"topic {kafka.impressions_topic} has 4 partitions and topic "
                                          f"{kafka.clicks_topic} has 1"):
        publish(table, kafka, "synthetic")  # events sent into them would be joined wrong for good
    assert read_topic(kafka, kafka.impressions_topic) == [] and read_topic(kafka, kafka.clicks_topic) == []
    out = subprocess.run(join_cmd(group_id, "kafka"), env=join_env(kafka, stack.redis_url, group_id),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"topic {kafka.impressions_topic} has 4 partitions and topic {kafka.clicks_topic} has 1" in out.stderr


def test_the_replay_makes_a_missing_input_topic_with_the_other_ones_partition_count(kafka: KafkaSettings) -> None:
    ensure_topics(kafka, [kafka.clicks_topic], partitions=2)  # impressions missing: made with clicks' 2, not 4
    publish(build_synthetic(SYN, ClickDelay(median_s=60.0), seed=3), kafka, "synthetic")
    counts = partition_counts(kafka, [kafka.impressions_topic, kafka.clicks_topic])
    assert counts == {kafka.impressions_topic: 2, kafka.clicks_topic: 2} and kafka.partitions == 4


def test_outputs_are_made_with_the_inputs_partition_count_and_one_with_fewer_is_refused(
        kafka: KafkaSettings) -> None:
    ensure_topics(kafka, [kafka.impressions_topic, kafka.clicks_topic], partitions=3)
    late, state = f"late-{kafka.samples_topic}", f"state-{kafka.samples_topic}"
    assert ensure_layout(kafka, [kafka.samples_topic, late], state) == 3
    assert partition_counts(kafka, [kafka.samples_topic, late, state]) == {kafka.samples_topic: 3, late: 3, state: 3}

    other = f"other-{kafka.samples_topic}"
    ensure_topics(kafka, [other], partitions=1)  # made by someone else with one partition
    with pytest.raises(ConfigError, match=f"{other} has 1: add partitions to each"):
        ensure_layout(kafka, [other, late], state)

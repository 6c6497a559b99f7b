"""Bounded runs (``--exit-when-idle``) end once the input is joined, whatever the group's shape, against the real
broker and Redis. A member of the group assigned no partition (more workers than partitions) never ended its run idle:
the faust driver took its empty assignment for a rebalance under way, the kafka driver left its loop only while it held
an assignment, so a bounded worker beside a long-running one on single-partition topics never ended (it did once the
other left and handed it the partition)."""

from __future__ import annotations

import dataclasses
import signal
import subprocess

import pytest

from stream.config import KafkaSettings
from stream.kafka_topics import ensure_topics
from stream.replay.config import ClickDelay, SyntheticSettings
from stream.replay.publisher import publish
from stream.replay.synthetic import build_synthetic
from tests.bounded_teardown import Reaper
from tests.integration.test_joiner import WINDOW_S, join_cmd, join_env, join_summary, wait_for_samples

SYN = SyntheticSettings(impressions=600, users=400, items=100, impressions_per_s=20.0, attribution_window_s=WINDOW_S,
                        malformed_share=0.0)
UNBOUNDED_S = 86_400.0  # an --exit-when-idle no test run reaches: the long-running worker


@pytest.mark.parametrize("driver", ["faust", "kafka"])
def test_a_bounded_worker_left_without_a_partition_exits_beside_a_long_running_one(
        kafka: KafkaSettings, stack, group_id: str, reaper: Reaper, driver: str) -> None:
    kafka = dataclasses.replace(kafka, partitions=1)
    ensure_topics(kafka, [kafka.impressions_topic, kafka.clicks_topic, kafka.samples_topic], partitions=1)
    publish(build_synthetic(SYN, ClickDelay(median_s=60.0), seed=41), kafka, "synthetic")
    env = {**join_env(kafka, stack.redis_url, group_id), "STREAMREC_KAFKA_PARTITIONS": "1"}

    def start(idle_s: float) -> subprocess.Popen[str]:
        return reaper.add(subprocess.Popen(join_cmd(group_id, driver, idle_s=idle_s), env=env, text=True,
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE))

    long_running = start(UNBOUNDED_S)
    wait_for_samples(kafka, 1, [long_running])  # it holds the partition and joins
    bounded = start(2.0)
    # exited 0, with or without the partition; the summary says why, for a caller that goes on (streamrec/demo.sh)
    assert join_summary(bounded, "the bounded worker")["reason"] == "input idle"
    assert long_running.poll() is None, "the long-running worker ended on its own"
    long_running.send_signal(signal.SIGTERM)
    assert join_summary(long_running, "the long-running worker")["reason"] == "signal"

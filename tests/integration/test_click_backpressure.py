"""Backpressure on the click input, against the real broker: clicks that run ahead of their impressions by more
than ``max_waiting_per_partition`` are held back instead of given up (``stream/joiner/backpressure.py``).

The stream: a synthetic log at a 50% click rate, produced in small record batches and read by a consumer that
fetches at most 64 KB per partition per request. A click is about a third of an impression's size, and the
clicks of three of the four partitions are all handed over while thousands of their impressions are still
in the topic (up to ~250 clicks wait for their impressions per partition). Without the gate
(``click_backpressure = false``) the waiting clicks pass the cap and the furthest are given up as
``overflow`` (their impressions become negatives): the first test shows the stream is hostile enough.
With it, every impression has exactly its label.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from collections import Counter

import pytest

from stream.config import KafkaSettings
from stream.replay.config import ClickDelay, SyntheticSettings
from stream.replay.publisher import publish
from stream.replay.synthetic import build_synthetic
from stream.replay.table import EventTable
from tests.integration.test_joiner import WINDOW_S, expected_join, join_cmd, join_env, read_samples

SYN = SyntheticSettings(impressions=6000, users=3000, items=500, impressions_per_s=20.0, base_ctr=0.5,
                        attribution_window_s=WINDOW_S)
CAP = 100  # max_waiting_per_partition; measured on this stream without the gate: up to ~250 clicks wait
BATCH = 20  # batch_max: the gate pauses at min(80% of the cap, cap - one batch)


@pytest.fixture
def hostile_stream(kafka: KafkaSettings) -> EventTable:
    table = build_synthetic(SYN, ClickDelay(median_s=60.0), seed=11)
    publish(table, dataclasses.replace(kafka, extra={"batch.num.messages": "50"}), "synthetic")  # small batches
    return table


def _join(kafka: KafkaSettings, redis_url: str, app_id: str, driver: str, backpressure: bool) -> dict:
    env = join_env(kafka, redis_url, app_id)
    env.update({"STREAMREC_JOINER_MAX_WAITING_PER_PARTITION": str(CAP), "STREAMREC_JOINER_BATCH_MAX": str(BATCH),
                "STREAMREC_JOINER_CLICK_BACKPRESSURE": str(backpressure).lower(),
                "STREAMREC_KAFKA_EXTRA": "max.partition.fetch.bytes=65536"})
    out = subprocess.run(join_cmd(app_id, driver), env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("driver", ["kafka", "faust"])
def test_without_backpressure_clicks_ahead_of_their_impressions_overflow(driver: str, kafka: KafkaSettings, stack,
                                                                         hostile_stream: EventTable,
                                                                         group_id: str) -> None:
    summary = _join(kafka, stack.redis_url, group_id, driver, backpressure=False)
    assert summary["overflow_clicks"] > 0 and summary["click_pauses"] == 0
    assert summary["click_coverage"] < 1.0


@pytest.mark.parametrize("driver", ["kafka", "faust"])
def test_with_backpressure_every_impression_has_exactly_its_label(driver: str, kafka: KafkaSettings, stack,
                                                                   hostile_stream: EventTable, group_id: str) -> None:
    want = expected_join(hostile_stream, int(WINDOW_S * 1000))
    summary = _join(kafka, stack.redis_url, group_id, driver, backpressure=True)
    assert summary["click_pauses"] > 0  # the gate did the work, not luck
    assert summary["overflow_clicks"] == 0
    rows = read_samples(kafka)
    assert set(Counter(r[0] for r in rows).values()) == {1} and len(rows) == SYN.impressions
    assert {r[0]: r[1] for r in rows} == want.labels
    assert summary["click_coverage"] == pytest.approx(sum(want.labels.values()) / hostile_stream.n_clicks, abs=1e-6)

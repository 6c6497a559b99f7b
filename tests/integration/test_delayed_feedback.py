"""Delayed feedback end to end on a real broker: the learner trains an OBSERVED 0 and its later
DELAYED_POSITIVE as two samples (while a redelivered message is still dropped), weights them, and pairs each
impression's first prediction with its final label (served quality), its observed 0s closed by the joiner's
watermark each samples message carries (``stream/samples.py``, ``WATERMARK_HEADER``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from stream.config import KafkaSettings
from stream.kafka_producer import AckedProducer
from stream.kafka_topics import ensure_topics
from stream.samples import DELAYED_POSITIVE, OBSERVED, SampleBatch, watermark_header


def batch(ids: list[int], labels: np.ndarray, kind: int, rng: np.random.Generator) -> SampleBatch:
    n = len(ids)
    users, items = np.array(ids) % 97, np.array(ids) % 89
    return SampleBatch.from_columns(
        impression_id=[f"i{k}" for k in ids], ts=np.array(ids, np.int64), label=labels.astype(np.int8),
        label_delay_ms=np.zeros(n), user_id=users, item_id=items,
        history=[rng.integers(0, 100, 2).tolist() for _ in range(n)], kind=np.full(n, kind, np.int8))


def test_observed_and_delayed_positive_are_two_samples_and_served_quality_pairs_them(
        kafka: KafkaSettings, tmp_path: Path) -> None:
    ensure_topics(kafka, [kafka.samples_topic])
    rng = np.random.default_rng(3)
    n, per_msg = 2000, 200
    clicked = rng.random(n) < 0.3
    p = AckedProducer(kafka)
    resent = None
    for start in range(0, n, per_msg):
        ids = list(range(start, start + per_msg))
        value = batch(ids, np.zeros(per_msg), OBSERVED, rng).encode()
        p.send(kafka.samples_topic, value, "0", partition=0)
        resent = resent or value
        if start >= per_msg:  # the clicks of the previous message's impressions come one message later
            late = [k for k in range(start - per_msg, start) if clicked[k]]
            # every impression before ``start`` has its click out now: the watermark closes them (ts + 500 <= it)
            p.send(kafka.samples_topic, batch(late, np.ones(len(late)), DELAYED_POSITIVE, rng).encode(), "0",
                   [watermark_header(start - 1 + 500)], partition=0)
    late = [k for k in range(n - per_msg, n) if clicked[k]]
    p.send(kafka.samples_topic, batch(late, np.ones(len(late)), DELAYED_POSITIVE, rng).encode(), "0",
           [watermark_header(n - 1 + 500)], partition=0)
    p.send(kafka.samples_topic, resent, "0", partition=0)  # a redelivered message: all duplicates
    p.flush()
    env = dict(os.environ, STREAMREC_KAFKA_BOOTSTRAP_SERVERS=kafka.bootstrap_servers,
               STREAMREC_KAFKA_SAMPLES_TOPIC=kafka.samples_topic, STREAMREC_LEARNER_BUCKETS="5000",
               STREAMREC_LEARNER_CTX_BUCKETS="500", STREAMREC_LEARNER_MLP="16",
               STREAMREC_LEARNER_ATTRIBUTION_WINDOW_S="0.5",  # 500 impressions of event time
               STREAMREC_LEARNER_GROUP_ID=f"learner-{kafka.samples_topic}")
    out = subprocess.run([sys.executable, "-m", "streamrec.cli", "train", "--checkpoint-dir", str(tmp_path / "c"),
                          "--batch-rows", "256", "--exit-when-idle", "4", "--json"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["samples_trained"] == n + int(clicked.sum())  # a delayed positive is not a duplicate
    assert summary["duplicates_dropped"] == per_msg  # a redelivered message still is
    served = summary["served"]
    assert served["unmatched"] == 0 and served["forced"] == 0
    # every impression is served once, each resolved by the last message's watermark (by the newest click time, the
    # last 500 impressions would still wait)
    assert served["all"]["impressions"] == n and served["pending"] == 0

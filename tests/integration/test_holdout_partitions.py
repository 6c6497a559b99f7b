"""The holdout reads ``holdout_messages`` messages of the samples topic however its partitions are filled
(cache_refresh/validate.py ``read_holdout``), against the session broker. Before, each partition was asked for its
share of the whole topic's partition count: with samples on one partition of four (a keyed topic, a joiner writing
one partition, a topic with more partitions than writers) it read a quarter of them, and the quality gate compared
models on that."""

from __future__ import annotations

import numpy as np

from cache_refresh import validate
from stream.config import KafkaSettings
from stream.kafka_producer import AckedProducer
from stream.kafka_topics import ensure_topics
from tests.integration.test_refresh import sample_batch


def test_the_holdout_reads_every_message_asked_for_when_only_one_partition_holds_samples(
        stack: object, kafka: KafkaSettings) -> None:
    ensure_topics(kafka, [kafka.samples_topic], partitions=4)
    producer = AckedProducer(kafka)
    rng = np.random.default_rng(7)
    sent = [sample_batch(rng, 3) for _ in range(6)]
    for batch in sent:
        producer.send(kafka.samples_topic, batch.encode(), partition=2)
    producer.flush()
    got = validate.read_holdout(kafka, 4, timeout_s=20)
    assert [list(b.impression_ids) for b in got] == [list(b.impression_ids) for b in sent[-4:]]

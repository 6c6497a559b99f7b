"""What a synchronous commit does when some of its partitions fail, on the real broker and the installed
confluent-kafka/librdkafka: every caller (``KafkaJoinWorker._commit``, ``EventReader.commit``, ``resume_offsets``,
the learners' group commits) treats ``commit(asynchronous=False)`` as all-or-nothing through ``KafkaException``.

confluent-kafka's docstring says a synchronous commit may return partitions whose ``.error`` is set. librdkafka
(``rd_kafka_handle_OffsetCommit``, since 1.4) makes any failed partition's error the request's, so the binding
raises instead: the partitions that failed are never returned as "committed", and the callers keep every offset of
the request for the next commit (re-committing those that did succeed is harmless). This test pins that behaviour:
if a library upgrade starts returning per-partition errors without raising, the callers must check them."""

from __future__ import annotations

import uuid

import pytest
from confluent_kafka import KafkaException, TopicPartition

from stream.config import KafkaSettings
from stream.kafka import new_consumer
from stream.kafka_topics import ensure_topics


def test_a_commit_with_one_failing_partition_raises_and_commits_the_others(kafka: KafkaSettings) -> None:
    ensure_topics(kafka, [kafka.samples_topic])
    consumer = new_consumer(kafka, f"commit-errors-{uuid.uuid4().hex[:8]}")
    try:
        good = TopicPartition(kafka.samples_topic, 0, 7)
        assert [(tp.offset, tp.error) for tp in consumer.commit(offsets=[good], asynchronous=False)] == [(7, None)]
        missing = TopicPartition(f"no-such-topic-{uuid.uuid4().hex[:8]}", 0, 3)
        with pytest.raises(KafkaException, match="(?i)unknown topic or partition"):
            consumer.commit(offsets=[TopicPartition(kafka.samples_topic, 0, 9), missing], asynchronous=False)
        assert consumer.committed([TopicPartition(kafka.samples_topic, 0)], timeout=10)[0].offset == 9
    finally:
        consumer.close()

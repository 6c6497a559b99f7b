"""``stream.kafka.fetched_more`` over the watermarks and position librdkafka caches (a stand-in consumer: the local
broker, Tansu, has no DeleteRecords or retention to empty a written partition; the integration tests of the position
and the start offset are in tests/integration/test_join_recovery.py)."""

from __future__ import annotations

from confluent_kafka import OFFSET_INVALID, TopicPartition

from stream.kafka import fetched_more


class Cached:
    """A consumer's cached (low, high) watermarks and position of one partition."""

    def __init__(self, low: int, high: int, position: int = OFFSET_INVALID) -> None:
        self.low, self.high, self.pos = low, high, position

    def get_watermark_offsets(self, tp: TopicPartition, cached: bool = False) -> tuple[int, int]:
        assert cached
        return self.low, self.high

    def position(self, partitions: list[TopicPartition]) -> list[TopicPartition]:
        return [TopicPartition(tp.topic, tp.partition, self.pos) for tp in partitions]


def test_a_partition_whose_records_were_all_deleted_has_nothing_more_for_a_group_starting_at_its_beginning() -> None:
    # a new group's first assignment starts at the logical beginning (no start offset known): nothing is ever handed
    # out there, so the position stays unknown; read as "more", the joiner's hold kept the other input back for good
    assert fetched_more(Cached(5_000, 5_000), "clicks", 0) is False  # type: ignore[arg-type]


def test_an_unknown_position_without_a_start_still_has_more_where_records_are_left() -> None:
    assert fetched_more(Cached(4_999, 5_000), "clicks", 0) is True  # type: ignore[arg-type]
    assert fetched_more(Cached(0, 5_000), "clicks", 0, start=5_000) is False  # type: ignore[arg-type]
    assert fetched_more(Cached(-1001, -1001), "clicks", 0) is None  # type: ignore[arg-type]  # not fetched yet

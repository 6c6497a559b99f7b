"""The joiner's late-clicks topic is refused where it, or its dead-letter topic, is one of the stream topics."""

from __future__ import annotations

import pytest

from stream.config import KafkaSettings, RedisSettings
from stream.errors import ConfigError
from stream.joiner.config import JoinerSettings
from stream.joiner.pipeline import JoinPipeline


@pytest.mark.parametrize(("late", "kafka"), [("clicks", {}), ("impressions.dlq", {}), ("samples", {}),
                                             ("x", {"clicks_topic": "x.dlq"})])
def test_a_late_clicks_topic_that_is_a_stream_topic_or_whose_dead_letters_are_is_refused(late: str,
                                                                                          kafka: dict) -> None:
    # late_clicks_topic = "clicks": each late click was written back onto the clicks topic, read again, late again,
    # written again, for ever; "impressions.dlq" mixed late clicks into impressions' dead letters; with clicks_topic
    # "x.dlq", late_clicks_topic "x" dead-lettered its refused records onto the clicks topic. Refused before any
    # connection is made.
    topics = {"impressions_topic": "impressions", "clicks_topic": "clicks", "samples_topic": "samples", **kafka}
    k = KafkaSettings(bootstrap_servers="127.0.0.1:1", **topics)
    with pytest.raises(ConfigError, match=r"\[joiner\] late_clicks_topic"):
        JoinPipeline(k, RedisSettings(), JoinerSettings(late_clicks_topic=late))

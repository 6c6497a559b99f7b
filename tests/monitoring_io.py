"""Test helpers that read what the stages expose to monitoring: a /metrics page, one series on it, the alerts topic;
a sink that drops every alert."""

from __future__ import annotations

import urllib.request
from collections.abc import Sequence

from monitor.alerts import Alert
from stream.config import KafkaSettings
from tests.kafka_io import read_topic


def scrape(url: str) -> str:
    """The /metrics page at ``url``; "" while nothing answers there."""
    try:
        return urllib.request.urlopen(url, timeout=2).read().decode()
    except OSError:
        return ""


def metric(text: str, series: str) -> float | None:
    """The value of ``series`` (name and labels, as exposed) on a /metrics page ``text``; None when absent."""
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return None


def alerts_so_far(kafka: KafkaSettings, topic: str) -> list[Alert]:
    try:
        return [Alert.from_json(r.value) for r in read_topic(kafka, topic, timeout_s=3.0)]
    except TimeoutError:  # the topic exists but the reader saw no end yet: nothing new to count
        return []


class NullSink:
    """An alert sink that takes every alert and keeps none: for a monitor whose alerts a test does not read."""

    name, timeout_s, batch_max = "null", 1.0, 100

    def send(self, alerts: Sequence[Alert], deadline: float | None = None) -> None:
        pass

    def close(self) -> None:
        pass

"""The running joiner's topic-id check (``JoinPipeline.check_topics``) bounds each broker call below the group's
session: the faust driver asks on its event loop, where the consumer's heartbeats run, and 2 x 10 s on a slow broker
outlasted the default 6 s session (the member evicted at every check)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from stream.config import KafkaSettings
from stream.joiner import pipeline
from stream.joiner.pipeline import JoinPipeline, running_check_timeout_s


@pytest.mark.parametrize(("session_ms", "bound_s"), [(6000, 2.0), (45000, 10.0), (3000, 1.0)])
def test_the_running_check_asks_the_broker_within_a_third_of_the_session(
        monkeypatch: pytest.MonkeyPatch, session_ms: int, bound_s: float) -> None:
    kafka = KafkaSettings(session_timeout_ms=session_ms)
    asked: list[float] = []

    def ids(k: KafkaSettings, topics: Any, timeout_s: float = 10.0) -> dict[str, dict[str, str]]:
        asked.append(timeout_s)
        return {t: {} for t in topics}

    monkeypatch.setattr(pipeline, "topic_identities", ids)
    JoinPipeline._follow_running(SimpleNamespace(kafka=kafka, engines={}), set())  # type: ignore[arg-type]
    assert asked == [bound_s] == [running_check_timeout_s(kafka)]
    assert bound_s * 2 < session_ms / 1000  # both of its calls (metadata, describe) inside one session

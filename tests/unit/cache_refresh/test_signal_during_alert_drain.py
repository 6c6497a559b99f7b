"""A second SIGINT/SIGTERM while ``streamrec refresh`` drains its alerts at shutdown (the Kafka alert queue's close,
up to ``close_timeout_s``, after the scheduler stopped; here the broker refuses every attempt). The drain ran after
run_forever had put the default handlers back: the SIGINT was a KeyboardInterrupt traceback out of the command. It
must end the drain at once, with a log line, the undelivered alerts dropped (counted ``closed``) and logged.

The composition is the process edge's (``streamrec/commands/refresh.py``): ``run_forever(..., alerts=alerts)``, then
``alerts.close()`` in a ``finally``."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Sequence

import pytest

from cache_refresh.alerts import FAILED_RULE, RefreshAlerts
from cache_refresh.scheduler import run_forever
from monitor.alerts import Alert, SinkSettings
from monitor.delivery import QueuedSink
from stream.config import KafkaSettings


class DownSink:
    """A broker that refuses every attempt; the operator's second signal comes with the first attempt of the drain."""

    name = "drain-test"
    timeout_s = 5.0
    batch_max = 100

    def __init__(self) -> None:
        self.attempts = 0

    def send(self, alerts: Sequence[Alert], deadline: float | None = None) -> None:
        self.attempts += 1
        if self.attempts == 2:  # the first try was when the alert was raised; this one is the drain's
            os.kill(os.getpid(), signal.SIGINT)
        raise ConnectionError("broker down")

    def close(self) -> None:
        pass


def test_a_second_signal_during_the_shutdown_alert_drain_ends_it_with_a_log_line_not_a_traceback(
        caplog: pytest.LogCaptureFixture) -> None:
    sink = DownSink()
    alerts = RefreshAlerts(KafkaSettings(), "")
    # a drain that would wait 60 s; retries only at the drain (the backoff is longer than the test)
    queue = QueuedSink(sink, SinkSettings(close_timeout_s=60.0, retry_backoff_s=600.0, retry_backoff_max_s=600.0))
    alerts._kafka = queue

    def run() -> None:  # a run fails (its alert queued, the broker down), then the operator stops the scheduler
        alerts.fire("hot_set", "refresh failed at hot_set: Redis unreachable", FAILED_RULE)
        os.kill(os.getpid(), signal.SIGTERM)

    handlers = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT))
    with caplog.at_level(logging.WARNING):
        try:
            code = run_forever(run, "* * * * *", "UTC", 3600, None, alerts=alerts, stop_grace_s=60)
        finally:
            alerts.close()
    assert code == 0
    assert sink.attempts == 2
    assert queue.stats.dropped["closed"] == 1 and [a.rule for a in queue.waiting()] == [FAILED_RULE]
    assert [r.getMessage() for r in caplog.records if "alert drain" in r.getMessage()] == [
        "SIGINT during the alert drain at shutdown: the drain ends now; the alerts still undelivered are dropped"]
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers
